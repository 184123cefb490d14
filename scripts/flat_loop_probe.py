#!/usr/bin/env python3
"""Offline probe (no GPU): can a CTA's stage-2 items run as ONE software-pipelined loop over all
their K steps, so that the next item's first weight loads are in flight while this item's last
steps compute (the fill and drain the per-item loops pay, notes/triton-kernel.md "Thirty-fourth
session")? The item's header (a spin on its tiles' counter) sits under `if k == 0` in the loop,
its epilogue (the partial's store) under `if k == last`.

Compiles three toy kernels of that shape for sm_90 and reads their TTGIR:
  nested  the per-item form (a K loop per item, as the kernel has it)
  flat    one loop; the spin has no data edge to the loads
  dep     one loop; the item's act is addressed through the spin's value (+ 16 * (v < 0), never
          taken), a data edge the pipeliner must keep

  carried dep with the item carried from step to step, advanced at an item's last step (as a
          work counter's claim must be), and again with a CTA barrier after the wait

and prints, per kernel, how many weight copies its pipeline issues ahead of the loop and whether
the spin comes before the act load in the loop body. Triton 3.6 (this probe, 2026-12-04):
  * nested, flat and dep load three steps ahead; in `flat` the spin lands at the end of the body,
    after the copies of later steps were issued, so it orders nothing; in `dep` it comes first;
  * carried loads nothing ahead: an item id carried across steps is not known when a later
    step's copy would be issued; with a barrier in the body the loop is not pipelined at all.
So the one-loop form needs each CTA's items fixed up front (a function of the step index, not a
claim) and no CTA barrier in the body, which the kernel's release of a partial uses.

  fused   the per-item form inside tl.range(flatten=True) (Triton fuses the two loops itself),
          the release behind a CTA barrier written as tl.debug_barrier or as inline PTX

The thirty-fifth session (2026-12-04): Triton flattens and pipelines `fused` three steps ahead
when its barrier is inline PTX (the pipeliner sees no gpu.barrier; a scalar atomic's broadcast
gets its barrier only when lowered, after pipelining), and not at all with tl.debug_barrier.
The kernel's FL took that form (a7867f2, items._s2_fl_item) and was measured 2.7-4.8% slower at
TP1's 3-16 tokens (dev round 116) and 2.2-4.7% in the TP2 proxy (device round 91), then removed.
Usage: python scripts/flat_loop_probe.py
"""
from __future__ import annotations

import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

GRID = 264  # TP1's grid on an H200: two CTAs per SM


@triton.jit
def _spin(cnt, it):
    v = tl.atomic_add(cnt + it, 0, sem="acquire", scope="gpu")
    while v < 1:
        v = tl.atomic_add(cnt + it, 0, sem="acquire", scope="gpu")
    return v


@triton.jit
def nested(w_ptr, x_ptr, y_ptr, cnt, n_items, KSTEPS: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
           NS: tl.constexpr, DEP: tl.constexpr):
    pid = tl.program_id(0)
    hh, kk, nn = tl.arange(0, BH), tl.arange(0, BK), tl.arange(0, 16)
    it = pid
    while it < n_items:
        _spin(cnt, it)
        acc = tl.zeros((BH, 16), tl.float32)
        for k in tl.range(0, KSTEPS, num_stages=NS):
            w = tl.load(w_ptr + (it * BH + hh)[:, None].to(tl.int64) * (KSTEPS * BK) + k * BK + kk[None, :])
            x = tl.load(x_ptr + (k * BK + kk)[:, None] * 16 + nn[None, :])
            acc = tl.dot(w, x, acc)
        tl.store(y_ptr + (it * BH + hh)[:, None] * 16 + nn[None, :], acc)
        it += 264


@triton.jit
def flat(w_ptr, x_ptr, y_ptr, cnt, n_items, KSTEPS: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
         NS: tl.constexpr, DEP: tl.constexpr):
    pid = tl.program_id(0)
    hh, kk, nn = tl.arange(0, BH), tl.arange(0, BK), tl.arange(0, 16)
    acc = tl.zeros((BH, 16), tl.float32)
    v = 0
    for i in tl.range(0, (n_items - pid + 263) // 264 * KSTEPS, num_stages=NS):
        it = pid + (i // KSTEPS) * 264
        k = i % KSTEPS
        if k == 0:
            v = _spin(cnt, it)
        w = tl.load(w_ptr + (it * BH + hh)[:, None].to(tl.int64) * (KSTEPS * BK) + k * BK + kk[None, :])
        xo = (k * BK + kk)[:, None] * 16 + nn[None, :]
        if DEP:
            xo += (v < 0).to(tl.int32) * 16
        x = tl.load(x_ptr + xo)
        acc = tl.dot(w, x, acc)
        if k == KSTEPS - 1:
            tl.store(y_ptr + (it * BH + hh)[:, None] * 16 + nn[None, :], acc)
            acc = tl.zeros((BH, 16), tl.float32)


@triton.jit
def carried(w_ptr, x_ptr, y_ptr, cnt, n_items, KSTEPS: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
            NS: tl.constexpr, DEP: tl.constexpr):
    """dep's loop with the item carried from step to step (advanced at an item's last step, as a
    work counter's claim would have to be) and, with DEP, a CTA barrier after the wait (as the
    kernel's broadcast of a scalar atomic and its release of a partial take)."""
    pid = tl.program_id(0)
    hh, kk, nn = tl.arange(0, BH), tl.arange(0, BK), tl.arange(0, 16)
    acc = tl.zeros((BH, 16), tl.float32)
    v = 0
    it = pid
    for i in tl.range(0, (n_items - pid + 263) // 264 * KSTEPS, num_stages=NS):
        k = i % KSTEPS
        if k == 0:
            v = _spin(cnt, it)
            if DEP:
                tl.debug_barrier()
        w = tl.load(w_ptr + (it * BH + hh)[:, None].to(tl.int64) * (KSTEPS * BK) + k * BK + kk[None, :])
        x = tl.load(x_ptr + (k * BK + kk)[:, None] * 16 + nn[None, :] + (v >> 31))
        acc = tl.dot(w, x, acc)
        if k == KSTEPS - 1:
            tl.store(y_ptr + (it * BH + hh)[:, None] * 16 + nn[None, :], acc)
            acc = tl.zeros((BH, 16), tl.float32)
            it += 264


@triton.jit
def fused(w_ptr, x_ptr, y_ptr, cnt, n_items, KSTEPS: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
          NS: tl.constexpr, DEP: tl.constexpr):
    """The kernel's FL form: a loop over the CTA's items (every 264-th) around each item's K loop,
    flattened by Triton itself (tl.range(flatten=True)); the wait with its data edge, the partial
    stored and released behind a CTA barrier: with DEP as inline PTX (bar.sync), which the
    pipeliner does not see, else as tl.debug_barrier (a gpu.barrier)."""
    pid = tl.program_id(0)
    hh, kk, nn = tl.arange(0, BH), tl.arange(0, BK), tl.arange(0, 16)
    for it in tl.range(pid, n_items, 264, flatten=True):
        v = _spin(cnt, it)
        acc = tl.zeros((BH, 16), tl.float32)
        for k in tl.range(0, KSTEPS, num_stages=NS):
            w = tl.load(w_ptr + (it * BH + hh)[:, None].to(tl.int64) * (KSTEPS * BK) + k * BK + kk[None, :])
            x = tl.load(x_ptr + (k * BK + kk)[:, None] * 16 + nn[None, :] + (v < 0).to(tl.int32) * 16)
            acc = tl.dot(w, x, acc)
        tl.store(y_ptr + (it * BH + hh)[:, None] * 16 + nn[None, :], acc)
        if DEP:
            tl.inline_asm_elementwise("bar.sync 0;\n mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.debug_barrier()
        tl.atomic_add(cnt + 100000 + it, 1, sem="release", scope="gpu")


def schedule(fn, dep: bool = False, name: str | None = None) -> dict:
    """The loop body's facts from fn's sm_90 TTGIR: pipelined weight copies, and whether the spin
    (the first acquire atomic in the loop) precedes the act load."""
    sig = {"w_ptr": "*fp8e4nv", "x_ptr": "*fp8e4nv", "y_ptr": "*fp32", "cnt": "*i32", "n_items": "i32",
           "KSTEPS": "constexpr", "BH": "constexpr", "BK": "constexpr", "NS": "constexpr", "DEP": "constexpr"}
    cx = {"KSTEPS": 12, "BH": 128, "BK": 128, "NS": 4, "DEP": dep}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # 16-byte pointers, as the kernel's
    ck = triton.compile(ASTSource(fn, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4, "num_stages": 2})
    g = ck.asm["ttgir"]
    loop = g.index("scf.for")  # the K loop (the outer while, if any, comes before it)
    body = g[loop:]
    spin = body.find("tt.atomic_rmw")
    act = body.find("tt.load")
    return {"kernel": name or fn.__name__,
            # copies issued before the loop: the pipeline's prologue (0: no step is loaded ahead)
            "ahead": g[:loop].count("async_copy_global_to_local"), "copies": g.count("async_copy_global_to_local"),
            "spin_in_loop": spin >= 0, "spin_before_act": 0 <= spin < act if spin >= 0 and act >= 0 else None}


if __name__ == "__main__":
    print(f"triton {triton.__version__}")
    for fn, dep, name in ((nested, False, None), (flat, False, None), (flat, True, "dep"), (carried, False, None),
                          (carried, True, "carried+barrier"), (fused, False, "fused+gpu.barrier"),
                          (fused, True, "fused+bar.sync")):
        print(schedule(fn, dep, name))
