"""A plug-in runner to copy: the shape of a runner for your own kernel, working as it stands.

    PYTHONPATH=. ffnq qualify --runner examples.my_runner:MyRunner --tp 2 --inject-rank all
    PYTHONPATH=. ffnq bench --runner examples.my_runner:MyRunner --tp 2 --widths 1,2,4,8,16

It subclasses ffnq's cpu runner, so it runs anywhere and passes every check: its "kernel"
(``_launch``) is the cpu backend's fused step. Replace ``_launch`` with a launch of yours, and
``warm`` with your compile; keep what they read and write. docs/runners.md has the whole
contract; this file marks the places a kernel team touches:

1. ``warm``: compile and load each width, fill ``residency`` (CTAs per SM/CU), time each width;
2. ``__call__``: check the inputs, take the outputs from ``new_outputs`` (NaN while the checks
   run, so an element your kernel skips fails), launch;
3. the regions the checks read after a launch, in this width's scratch (``self.view``):
   ``route`` / ``route_w`` (the experts your router chose and their weights), ``fault`` (the fault
   record a timed-out wait writes), ``timeline`` (per-CTA stamps, when built with timeline=True);
4. ``inject`` ([rank + 1, delay ns], 0 = off): the named rank holds back its arrival by that
   delay, which qualify uses to test the bounded waits.

For a GPU kernel also override ``default_device`` (``cuda:<local_rank>``), ``open_peers`` and
``peer_view`` (peer buffers your kernel can write: ffnq/backends/triton/runner.py uses torch
symmetric memory), ``DIST_BACKEND = "cpu:gloo,cuda:nccl"``, ``BLOCKS``/``THREADS`` and
``clock_ns`` (the clock your timeline stamps use).
"""
from __future__ import annotations

import time

import torch

from ffnq.backends.cpu import CpuRunner
from ffnq.spec import FAULT_FIELDS, kernel_name


class MyRunner(CpuRunner):
    backend = "my-kernel"  # the report folders' and tables' name for it
    BLOCKS = 4  # CTAs of your persistent grid (every width's here; blocks_for() may vary it per width)

    def warm(self, weights, compute_units: int | None = None) -> None:
        """Compile and load every width. With ``compute_units`` (the jobs pass the GPU's SMs/CUs),
        refuse a width whose grid cannot be resident: ffnq.residency.check(kernel, per_cu, cus, grid)
        raises with the numbers. Keep the driver's answer in ``self.residency[width]``."""
        super().warm(weights, compute_units)  # the cpu stand-in: checks the weights, dequantizes them once
        self._compile_s = {}
        for s in self.widths:
            t0 = time.perf_counter()
            # YOUR COMPILE HERE, e.g. self._kernels[s] = compile(self.keys[s]) -- self.keys[s] is the
            # width's ffnq.spec.FfnBuild (tokens, tp, experts, timeline, timeout_ns, blocks, model)
            self._compile_s[s] = time.perf_counter() - t0  # warm's table shows it per width
            # on a GPU: self.residency[s] = <CTAs per SM from the occupancy query>

    def describe(self, width: int) -> dict:
        """warm's row for a width: kernel, compile_s, grid; any other key lands in `resources`."""
        return {"kernel": kernel_name(self.keys[width]).replace("ffn_", "my_ffn_"),
                "compile_s": self._compile_s.get(width), "grid": self.BLOCKS, "threads": self.THREADS}

    def __call__(self, part: torch.Tensor, residual: torch.Tensor, weights, slots: torch.Tensor,
                 final: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.check_inputs(part, residual, slots)  # [s, hidden] bf16 twice, int64 slots: refused otherwise
        out, res_out = self.new_outputs(part, residual)
        self._launch(s, part, residual, weights, slots, out, res_out, final)
        return out, res_out

    def _launch(self, s: int, part, residual, weights, slots, out, res_out, final: bool) -> None:
        """YOUR KERNEL HERE. What it gets and what the checks read back:

        - ``self.sym`` / ``self.peers``: this rank's peer buffer and every rank's (int64 addresses;
          layout ``self.peer_regions``: flags, fault_box, seam, moe, epoch ...);
        - ``self.epoch``: the int32 words every runner on this peer buffer shares; the kernel moves
          epoch[0] on by one per launch, and every flag it waits on must equal it exactly;
        - ``self.inject``: int32 [rank + 1, delay ns]; the rank named holds back its arrival;
        - ``self.scratch[s]``, regions ``self.layouts[s]`` (``self.view(s, name)`` types them):
          ``route`` int32 [s, top_k] sorted expert ids, -1 on padding rows; ``route_w`` fp32 [s,
          top_k] their weights; ``timeline`` int64 [BLOCKS, stamps] ns per CTA (ffnq.spec.stamp_names);
          ``fault`` int64 record, see ``fault_record`` below;
        - ``weights``: post_norm, router, router_bias, w13, s13, w2, s2 (FP8 with 128x128 scales).
        """
        o, r = self.step_cls(self, s, weights).run(part, residual, slots[:s], final)  # the cpu "kernel"
        out.copy_(o)
        res_out.copy_(r)

    def fault_record(self, width: int) -> dict:
        """What a timed-out wait leaves in scratch ``fault`` (the kernel writes it, then skips the
        remaining waits and returns; the jobs read it through ``self.fault(width)``, which decodes
        it and names the missing ranks): one int64 per field of ffnq.spec.FAULT_FIELDS."""
        return dict(zip(FAULT_FIELDS, self.view(width, "fault").tolist()))
