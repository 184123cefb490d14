"""The floor a fused decode step cannot beat, measured on the GPU it runs on.

    floor_us = touched expert-shard bytes / HBM read bandwidth + 2 x one-shot link latency

The bandwidth comes from a read-only reduction over buffers several times the L2, rotated so
no timed read hits the cache; the link latency from the smallest one-shot all-reduce through
symmetric memory (one row of the model), timed by CUDA-graph replay. TP1 has no link term.
"""
from __future__ import annotations

import statistics

import torch

from ffnq.timing import time_steps, warm_median_us

L2_MULTIPLE = 4  # read sets together this many times the L2, so each read comes from HBM
WARMUP_MS = 200  # of reads before the timed ones: freshly placed buffers first read slower
SAMPLES = 40


def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_all(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        """Every program sums a grid-strided share of x: 16-byte loads, nothing written back
        but one word per program, so the bytes moved are the bytes read."""
        pid, nprog = tl.program_id(0), tl.num_programs(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid * BLOCK, n, nprog * BLOCK):  # n is a multiple of BLOCK: no mask
            acc += tl.load(x_ptr + tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK))
        tl.store(out_ptr + pid, tl.sum(acc))

    return read_all


def hbm_read_gbps(device: torch.device, mbytes: int = 512, warmup_ms: float = WARMUP_MS,
                  samples: int = SAMPLES) -> float:
    """Read-only bandwidth (GB/s, bytes read only) of a grid-stride Triton read over buffers
    together several times the L2, so each read comes from HBM: the median of ``samples`` after
    ``warmup_ms`` of the same reads. On one H200, ten samples straight after the buffers were
    placed read 3.91 TB/s in 12 of 16 placements and 4.50 in the rest; after the warm-up, 4.50
    in 8 of 8 (0.3% spread, buffers moved between samples).
    The bench had measured it cold: 3.89-4.43 TB/s between runs whose p50s moved under 1%."""
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 64 << 20)
    n = mbytes << 20
    sets = max(2, -(-L2_MULTIPLE * l2 // n))
    bufs = [torch.randint(-2**30, 2**30, (n // 4,), dtype=torch.int32, device=device) for _ in range(sets)]
    grid = props.multi_processor_count * 4
    out = torch.empty(grid, dtype=torch.int32, device=device)
    kernel = _read_kernel()

    def read_all():
        for b in bufs:
            kernel[(grid,)](b, out, b.numel(), BLOCK=4096, num_warps=8)

    us = warm_median_us(read_all, samples, warmup_ms=warmup_ms, device=device, graph=True)
    return sets * n / us / 1e3


def link_latency_us(hidden: int, device: torch.device) -> float:
    """One-shot all-reduce of one bf16 row through torch symmetric memory (0 at TP1)."""
    import torch.distributed as dist
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return 0.0
    import torch.distributed._symmetric_memory as symm_mem
    group = dist.group.WORLD.group_name
    buf = symm_mem.empty(hidden, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(buf, group)
    buf.normal_()
    dist.barrier()
    reps = 20  # one sample = 20 back-to-back one-shots, so the graph launch is amortised

    def oneshot():
        for _ in range(reps):
            torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group)

    return statistics.median(time_steps(oneshot, 20, barrier=dist.barrier, device=device, graph=True)) / reps


def floor_us(touched_experts: float, expert_bytes: int, read_gbps: float, link_us: float) -> float:
    return touched_experts * expert_bytes / (read_gbps * 1e3) + 2 * link_us
