"""ffnq.timing's StepTimer on a GPU (skipped without CUDA)."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from ffnq.timing import StepTimer  # noqa: E402

DEV = torch.device("cuda", 0)


def test_one_capture_timed_twice():
    """The step runs twice in all (the allocator's warm call and the capture); every later
    sample, the estimate's and the timed ones, is a replay of that one graph."""
    x = torch.randn(1 << 20, device=DEV)
    calls = []

    def step():
        calls.append(1)
        x.mul_(1.0001)

    t = StepTimer(step, device=DEV, graph=True, fallback=True)
    est = t(3)
    s = t(20, warmup=5, burst=7)
    assert t.mode == "cuda-graph" and len(calls) == 2
    assert len(est) == 3 and len(s) == 20 and all(v > 0 for v in est + s)


def test_a_step_that_cannot_be_captured():
    """A step that synchronizes cannot be captured: with ``fallback`` it is timed eagerly between
    events and ``mode`` says why; without, the capture's error is raised."""
    x = torch.randn(1 << 16, device=DEV)

    def step():
        x.add_(1.0)
        torch.cuda.synchronize(DEV)

    t = StepTimer(step, device=DEV, graph=True, fallback=True)
    s = t(5, warmup=1)
    assert t.mode.startswith("cuda-events (graph capture failed") and len(s) == 5 and all(v > 0 for v in s)
    with pytest.raises(RuntimeError):
        StepTimer(step, device=DEV, graph=True)(1)

