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
    return profile_step(fn, device)[0]


def profile_step(fn, device, apart: str | None = None) -> tuple[int | None, float | None]:
    """(kernels one ``fn()`` launches, the profiled device time of those whose name does not
    hold ``apart``, us): a step's glue beside its GEMMs. (None, None) off a GPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None, None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(dev)
    ks = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.name.startswith(NOT_KERNELS)]
    return len(ks), float(sum(e.device_time_total for e in ks if not apart or apart not in e.name))
