"""How many GPU kernels one call of a step launches: the measure of how much host-side glue a
baseline carries (a plain PyTorch composition runs dozens; vLLM's decode step about a dozen;
the fused kernel one)."""
from __future__ import annotations

import torch

NOT_KERNELS = ("Memcpy", "Memset")  # copies and fills the profiler lists beside kernels


def kernels_per_step(fn, device) -> int | None:
    """GPU kernels launched by one ``fn()`` (after one warm-up call that compiles what it must),
    counted by torch.profiler's CUDA activity; memcpy and memset are not kernels. None off a GPU.
    Collective where ``fn`` is (every rank calls it)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(dev)
    return sum(1 for e in prof.events()
               if e.device_type == DeviceType.CUDA and not e.name.startswith(NOT_KERNELS))
