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

and prints, per kernel, whether its weight loads were pipelined (async copies) and whether the
spin comes before the act load in the loop body. Triton 3.6 (this probe, 2026-12-04): all three
pipeline the weights; in `flat` the spin lands at the end of the body, after the copies of later
steps were issued (a wait there would not order the act loads after it); in `dep` it is first.
So the one-loop form is sound only with such a data edge. Usage: python scripts/flat_loop_probe.py
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


def schedule(fn, dep: bool = False) -> dict:
    """The loop body's facts from fn's sm_90 TTGIR: pipelined weight copies, and whether the spin
    (the first acquire atomic in the loop) precedes the act load."""
    sig = {"w_ptr": "*fp8e4nv", "x_ptr": "*fp8e4nv", "y_ptr": "*fp32", "cnt": "*i32", "n_items": "i32",
           "KSTEPS": "constexpr", "BH": "constexpr", "BK": "constexpr", "NS": "constexpr", "DEP": "constexpr"}
    cx = {"KSTEPS": 12, "BH": 128, "BK": 128, "NS": 4, "DEP": dep}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # 16-byte pointers, as the kernel's
    ck = triton.compile(ASTSource(fn, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4, "num_stages": 2})
    g = ck.asm["ttgir"]
    body = g[g.index("scf.for"):]  # the pipelined K loop (the outer while, if any, comes before it)
    spin = body.find("tt.atomic_rmw")
    act = body.find("tt.load")
    return {"kernel": fn.__name__ + ("_dep" if dep else ""), "async_copies": g.count("async_copy_global_to_local"),
            "spin_in_loop": spin >= 0, "spin_before_act": 0 <= spin < act if spin >= 0 and act >= 0 else None}


if __name__ == "__main__":
    print(f"triton {triton.__version__}")
    for fn, dep in ((nested, False), (flat, False), (flat, True)):
        print(schedule(fn, dep))
