"""ffnq.timing on the cpu, under a fake clock (no real durations asserted): budgets become clamped
step counts, quantiles are the linear ones, a cpu sample is one call after its barrier (the
barrier's wait not counted), bursts are watched one at a time, and warm_median_us sizes its
warm-up from one sample. The CUDA paths are in test_timing_gpu.py."""
import random
from types import SimpleNamespace

import pytest

from ffnq import timing
from ffnq.timing import StepTimer, quantiles_us, steps_for, time_steps, warm_median_us


@pytest.fixture
def clock(monkeypatch):
    """A fake perf_counter_ns: a call "takes" what it adds to ``clock.ns``."""
    c = SimpleNamespace(ns=random.randrange(1 << 40))
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter_ns=lambda: c.ns))
    return c


def test_steps_for_budgets_truncate_and_clamp():
    assert steps_for(300.0, 1, 1, 100) == 3 and steps_for(600.0, 1, 1, 100) == 1  # calls that fit: truncated
    assert steps_for(250.0, 2.5, 1, 100) == 10
    assert steps_for(300.0, 1, 5, 100) == 5 and steps_for(1.0, 1, 1, 100) == 100
    assert steps_for(0.0, 1, 1, 10**9) == 10**6  # a zero estimate counts as 1 ns, no division by 0


def test_quantiles_are_linear_over_the_samples():
    xs = [float(x) for x in range(1, 102)]
    random.shuffle(xs)
    q = quantiles_us(xs)
    assert q == pytest.approx({"p50_us": 51.0, "p90_us": 91.0, "p99_us": 100.0, "mean_us": 51.0, "steps": 101})
    q = quantiles_us([10.0, 20.0])
    assert (q["p50_us"], q["p90_us"], q["mean_us"], q["steps"]) == (15.0, pytest.approx(19.0), 15.0, 2)


def test_a_cpu_sample_is_one_call_after_its_barrier(clock):
    seen, us = [], random.randint(2, 900)

    def barrier():
        seen.append("b")
        clock.ns += 10**9  # waiting for the other ranks: not part of the sample

    def fn():
        seen.append("f")
        clock.ns += us * 1000

    t = StepTimer(fn, barrier=barrier, device="cpu", graph=True)  # graph means nothing on cpu
    assert t.mode == "wall-clock"
    assert t(4, warmup=2, idle_s=0.5) == [float(us)] * 4
    assert seen == ["b", "f"] * 6


@pytest.mark.parametrize("steps, burst, chunks", [(5, 2, 3), (6, 2, 3), (5, 0, 1), (5, 5, 1), (5, 9, 1), (0, 2, 0)])
def test_bursts_are_watched_one_at_a_time(steps, burst, chunks):
    class Watch:
        entered = 0

        def __enter__(self):
            Watch.entered += 1

        def __exit__(self, *exc):
            return False

    calls = []
    s = time_steps(lambda: calls.append(1), steps, burst=burst, watch=Watch())
    assert len(s) == steps == len(calls) and Watch.entered == chunks


def test_warm_median_sizes_its_warm_up_from_one_sample(clock):
    durations = iter([2000] + [1] * 10 + [30, 10, 50, 20, 40])  # us: one to size, 10 warm-up, 5 samples
    calls = []

    def fn():
        calls.append(1)
        clock.ns += next(durations) * 1000

    # 20 ms of warm-up at the first sample's 2 ms: 10 calls, then the median of 5 samples
    assert warm_median_us(fn, 5, warmup_ms=20) == 30.0
    assert len(calls) == 16
