"""One timing function for every backend: samples of one step in microseconds.

    time_steps(fn, steps, barrier=dist_barrier)                 # cpu: wall clock per call
    time_steps(fn, steps, device="cuda:0", graph=True)          # GPU: CUDA-graph replay, events
    time_steps(fn, steps, device="cuda:0", graph=True, burst=200, idle_s=0.25, watch=ClockWatch(dev))
    t = StepTimer(fn, device="cuda:0", graph=True, fallback=True); t(3); t(steps)   # one capture, timed twice

Budgets are in ms and become step counts (``steps_for``), as triton.testing.do_bench does.
Ranks must agree on the count: the job takes the max estimate over ranks first.

Bursts: a GPU held at its power limit lowers its clocks after well under a second of this kernel
(ffnq.gpu_clocks), so one long window mixes two clock states. With ``burst`` the samples are
taken ``burst`` at a time, each burst after ``idle_s`` with the GPU idle and LEAD untimed calls
(the first call after an idle is slow); ``watch`` (a ClockWatch) polls the clocks during the bursts
only.
"""
from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from typing import Callable

import torch

from ffnq.gpu_clocks import idle

LEAD = 3  # untimed calls after each idle


def steps_for(estimate_us: float, budget_ms: float, lo: int, hi: int) -> int:
    """How many calls of ``estimate_us`` fit in ``budget_ms``, clamped to [lo, hi]."""
    return max(lo, min(hi, int(budget_ms * 1e3 / max(estimate_us, 1e-3))))


class StepTimer:
    """Times one step any number of times (the bench's estimate, warm-up and samples). On cpu: a
    barrier (ranks start together), then the wall clock around one call. On cuda with ``graph``:
    the step is captured into a CUDA graph once, at the first timing (every collective setup must
    be done before), and each sample is one replay between two events; where the capture fails
    and ``fallback`` allows, the step is timed eagerly between events instead (``mode`` says
    which), else the capture's RuntimeError is raised. ``last``: what the latest call returned
    (of a graph: what its capture returned, memory each replay writes again)."""

    def __init__(self, fn: Callable[[], object], *, barrier: Callable[[], None] | None = None,
                 device: torch.device | str = "cpu", graph: bool = False, fallback: bool = False):
        self.fn, self.barrier, self.dev = fn, barrier, torch.device(device)
        self.graph, self.fallback = graph and self.dev.type == "cuda", fallback
        self.mode = "wall-clock" if self.dev.type != "cuda" else "cuda-graph" if self.graph else "cuda-events"
        self._call = self._stream = None
        self.last = None

    def _keep(self) -> None:
        self.last = self.fn()

    def _ready(self) -> Callable[[], object]:
        if self._call is None:
            self._stream = torch.cuda.Stream(self.dev)
            self._stream.wait_stream(torch.cuda.current_stream(self.dev))
            with torch.cuda.stream(self._stream):
                self._keep()  # warm the allocator on the capture stream
                self._call = self._keep
                if self.graph:
                    try:
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g, stream=self._stream):
                            out = self.fn()
                        self._call, self.last = g.replay, out  # (the bound method keeps the graph alive)
                    except RuntimeError as e:
                        if not self.fallback:
                            raise
                        self.mode = f"cuda-events (graph capture failed: {str(e).splitlines()[0][:80]})"
                        torch.cuda.synchronize(self.dev)
                        self._stream = torch.cuda.Stream(self.dev)  # not the one the capture left
        return self._call

    def _wall_us(self) -> float:
        if self.barrier:
            self.barrier()
        t0 = time.perf_counter_ns()
        self.last = self.fn()
        return (time.perf_counter_ns() - t0) / 1e3

    def __call__(self, steps: int, *, burst: int = 0, idle_s: float = 0.0, watch=None,
                 warmup: int = 0) -> list[float]:
        """``steps`` samples (us) after ``warmup`` untimed calls (replays). ``burst``, ``idle_s``,
        ``watch``: see the module's docstring (idle_s only on a GPU)."""
        burst = burst if 0 < burst < steps else max(steps, 1)
        chunks = [min(burst, steps - i) for i in range(0, steps, burst)]
        watch = watch if watch is not None else nullcontext()
        if self.dev.type != "cuda":
            for _ in range(warmup):
                self._wall_us()
            out = []
            for n in chunks:
                with watch:
                    out += [self._wall_us() for _ in range(n)]
            return out
        call, dev = self._ready(), self.dev
        ev = []
        with torch.cuda.stream(self._stream):
            for _ in range(warmup):
                call()
            torch.cuda.synchronize(dev)
            for n in chunks:
                if idle_s > 0:
                    idle(idle_s, dev)
                    if self.barrier:
                        self.barrier()
                    for _ in range(LEAD):
                        call()
                pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                         for _ in range(n)]
                with watch:
                    for a, b in pairs:
                        if self.barrier:
                            self.barrier()
                        a.record(self._stream)
                        call()
                        b.record(self._stream)
                    torch.cuda.synchronize(dev)
                ev += pairs
        return [a.elapsed_time(b) * 1e3 for a, b in ev]


def time_steps(fn: Callable[[], object], steps: int, *, barrier: Callable[[], None] | None = None,
               device: torch.device | str = "cpu", graph: bool = False, burst: int = 0, idle_s: float = 0.0,
               watch=None, warmup: int = 0) -> list[float]:
    """``steps`` samples (us) of ``fn`` from a StepTimer of its own (a capture that fails raises)."""
    return StepTimer(fn, barrier=barrier, device=device, graph=graph)(steps, burst=burst, idle_s=idle_s,
                                                                       watch=watch, warmup=warmup)


def warm_median_us(fn: Callable[[], object], samples: int, *, warmup_ms: float,
                   device: torch.device | str = "cpu", graph: bool = False) -> float:
    """The median of ``samples`` samples of ``fn`` (as time_steps) after ``warmup_ms`` of plain
    calls, sized by one timed sample: for rates that read low on a cold GPU (ffnq.floor)."""
    first = time_steps(fn, 1, device=device, graph=graph)[0]
    for _ in range(steps_for(first, warmup_ms, 1, 10_000)):
        fn()
    return statistics.median(time_steps(fn, samples, device=device, graph=graph))


def quantiles_us(samples: list[float]) -> dict:
    t = torch.tensor(samples, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return {"p50_us": q[0], "p90_us": q[1], "p99_us": q[2], "mean_us": float(t.mean()), "steps": len(samples)}
