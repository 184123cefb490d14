"""The host-side kernels of baseline (d): what vLLM runs around its two fused_moe_kernel launches
in a decode step, each one Triton launch of ffnq's own where vLLM's is a CUDA op (vLLM's CUDA
ops need its compiled extension; these are small enough to write again).

    add_rms_norm      vLLM's fused_add_rms_norm: h = part + residual rounded to bf16 (the new
                      residual), x = rms_norm(h) * post_norm as bf16 for the experts, and the same
                      bf16 values as fp32 for the router GEMM (vLLM's MiniMax-M2 gate is an fp32
                      GateLinear that reads the bf16 x: one GEMM, no cast kernel)
    topk_sigmoid      vLLM's topk_sigmoid (FusedTopKBiasRouter): sigmoid scores, the top_k of
                      score + e_score_correction_bias, weights the unbiased scores renormalised;
                      a padding row gets expert -1 and weight 0 (VLLM_MOE_SKIP_PADDING, default on)
    align             vLLM's moe_align_block_size (CUDA): (token, k) pairs grouped by expert, each
                      expert's run padded to a multiple of BLOCK_SIZE_M with the sentinel
                      numel; the expert of each block; the padded length. Pairs of an expert
                      outside [first, first + n) (another rank's, or -1) are dropped, as vLLM's
                      ignore_invalid_experts does under an expert map. One program, no loop.
    group_quant_fp8   vLLM's per_token_group_quant_fp8 (its Triton _per_token_group_quant_fp8 is
                      used where the fetched copy has it; this one has the same arithmetic)
    silu_mul_quant    vLLM's silu_and_mul_per_block_quant (CUDA, used by TritonExperts for SiLU
                      with 128x128 FP8 blocks): silu(gate) * up, rounded to bf16, quantized per
                      1 x 128 group
    moe_sum           vLLM's moe_sum with topk_ids: the sum over k of the second GEMM's
                      (already weighted) rows, skipping pairs whose expert is not this rank's

Under TRITON_INTERPRET=1 Triton 3.6 converts fp32 to e4m3 wrongly where rounding carries into an
odd exponent (126.9 -> 64, not 128: ~3% of random values) and to bf16 by truncation (half of
random values one ulp off); there the kernels round to nearest even by arithmetic first, so
their outputs are the GPU's bit for bit in the interpreter too.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max, vLLM's get_fp8_min_max on CUDA
EPS = 1e-10  # vLLM's per_token_group_quant_fp8 eps


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def p2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@triton.jit
def _fp8(v, INTERP: tl.constexpr):
    """fp32 -> e4m3 (round to nearest even, |v| <= 448 already); exact in the interpreter too."""
    if INTERP:
        e = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(v), 1e-30))), -6.0)
        step = tl.exp2(e - 3.0)
        r = _rne(tl.abs(v) / step) * step
        v = r * tl.where(v < 0, -1.0, 1.0)  # -0.0 kept, as the conversion keeps it
    return v.to(tl.float8e4nv)


@triton.jit
def _bf16(v, INTERP: tl.constexpr):
    """fp32 -> bf16, round to nearest even; in the interpreter too."""
    if INTERP:
        u = v.to(tl.uint32, bitcast=True)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        v = u.to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def _rne(v):
    """round half to even (the hardware conversion's mode)"""
    f = tl.floor(v)
    d = v - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _quant_groups(y, q_ptrs, s_ptrs, mask, smask, INTERP: tl.constexpr):
    """Rows of ``y`` [groups, group] as vLLM's _per_token_group_quant_fp8 quantizes one group:
    scale = max(absmax, eps) / 448 (a multiply by the reciprocal, as vLLM's), codes clamp(y / scale)."""
    absmax = tl.maximum(tl.max(tl.abs(y), 1), 1e-10)
    scale = absmax * (1.0 / 448.0)
    q = tl.clamp(y / scale[:, None], -448.0, 448.0)
    tl.store(q_ptrs, _fp8(q, INTERP), mask=mask)
    tl.store(s_ptrs, scale, mask=smask)


@triton.jit
def _add_rms_norm_kernel(part_ptr, res_ptr, w_ptr, res_out_ptr, x_ptr, x32_ptr, H, eps,
                         BLOCK: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    off = row.to(tl.int64) * H + cols
    z = tl.load(part_ptr + off, mask=m, other=0.0).to(tl.float32) + tl.load(res_ptr + off, mask=m, other=0.0).to(tl.float32)
    h = _bf16(z, INTERP)
    tl.store(res_out_ptr + off, h, mask=m)
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / H + eps)
    x = _bf16(hf * inv * tl.load(w_ptr + cols, mask=m, other=0.0), INTERP)
    tl.store(x_ptr + off, x, mask=m)
    tl.store(x32_ptr + off, x.to(tl.float32), mask=m)


@triton.jit
def _topk_sigmoid_kernel(logits_ptr, bias_ptr, slots_ptr, w_ptr, ids_ptr, E,
                         TOPK: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr):
    row = tl.program_id(0)
    e = tl.arange(0, EP)
    m = e < E
    score = tl.sigmoid(tl.load(logits_ptr + row.to(tl.int64) * E + e, mask=m, other=0.0))
    biased = tl.where(m, score + tl.load(bias_ptr + e, mask=m, other=0.0), float("-inf"))
    kk = tl.arange(0, KP)
    ids = tl.zeros([KP], tl.int32)
    wts = tl.zeros([KP], tl.float32)
    for k in tl.static_range(TOPK):
        top = tl.argmax(biased, 0)  # the lowest index on a tie
        ids = tl.where(kk == k, top, ids)
        wts = tl.where(kk == k, tl.sum(tl.where(e == top, score, 0.0), 0), wts)
        biased = tl.where(e == top, float("-inf"), biased)
    pad = tl.load(slots_ptr + row) < 0
    wts = tl.where(pad, 0.0, wts / tl.sum(wts, 0))
    ids = tl.where(pad, -1, ids)
    out = row * TOPK + kk
    tl.store(ids_ptr + out, ids, mask=kk < TOPK)
    tl.store(w_ptr + out, wts, mask=kk < TOPK)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, ntp_ptr, numel, first, n_local,
                  BM: tl.constexpr, NP: tl.constexpr, EP: tl.constexpr, TAIL: tl.constexpr,
                  MAXB: tl.constexpr):
    i = tl.arange(0, NP)
    inb = i < numel
    e = tl.load(ids_ptr + i, mask=inb, other=-1) - first
    valid = inb & (e >= 0) & (e < n_local)
    e = tl.where(valid, e, 0)
    counts = tl.histogram(e, EP, mask=valid)
    padded = (counts + BM - 1) // BM * BM
    starts = tl.cumsum(padded, 0) - padded
    # a pair's place in its expert's run: the earlier pairs of the same expert (stable order)
    before = (e[:, None] == e[None, :]) & valid[None, :] & (i[None, :] < i[:, None])
    pos = tl.gather(starts, e, 0) + tl.sum(before.to(tl.int32), 1)
    tl.store(sorted_ptr + pos, i.to(tl.int32), mask=valid)
    # each run's padding tail (disjoint from the pairs' places: no ordering needed)
    j = tl.arange(0, TAIL)
    tail = (starts + counts)[:, None] + j[None, :]
    tl.store(sorted_ptr + tail, numel, mask=j[None, :] < (padded - counts)[:, None])
    ex = tl.arange(0, EP)
    b = tl.arange(0, MAXB)
    blk = (starts // BM)[:, None] + b[None, :]
    tl.store(expert_ids_ptr + blk, (ex[:, None] + b[None, :] * 0).to(tl.int32),
             mask=b[None, :] < (padded // BM)[:, None])
    tl.store(ntp_ptr, tl.sum(padded, 0).to(tl.int32))


@triton.jit
def _group_quant_kernel(y_ptr, q_ptr, s_ptr, group, cols_total, row_stride,
                        BLOCK: tl.constexpr, INTERP: tl.constexpr):
    g = tl.program_id(0)  # one program per group, as vLLM launches its kernel
    per_row = cols_total // group
    row = g // per_row
    cols = tl.arange(0, BLOCK)[None, :]
    m = cols < group
    y = tl.load(y_ptr + row.to(tl.int64) * row_stride + (g % per_row) * group + cols, mask=m, other=0.0)
    one = tl.arange(0, 1)
    _quant_groups(y.to(tl.float32), q_ptr + g.to(tl.int64) * group + cols, s_ptr + g + one, m, one == 0, INTERP)


@triton.jit
def _silu_mul_quant_kernel(gu_ptr, q_ptr, s_ptr, I, GROUP: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr,
                           INTERP: tl.constexpr):
    row = tl.program_id(0)  # one program per (token, k) row: its NG groups at once
    grp = tl.arange(0, NGP)
    cols = grp[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    m = grp[:, None] < NG
    base = gu_ptr + row.to(tl.int64) * 2 * I + cols
    g = tl.load(base, mask=m, other=0.0).to(tl.float32)
    u = tl.load(base + I, mask=m, other=0.0).to(tl.float32)
    a = _bf16(g / (1.0 + tl.exp(-g)) * u, INTERP).to(tl.float32)
    _quant_groups(a, q_ptr + row.to(tl.int64) * I + cols, s_ptr + row * NG + grp, m, grp < NG, INTERP)


@triton.jit
def _moe_sum_kernel(c_ptr, ids_ptr, out_ptr, H, first, n_local, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                    INTERP: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOPK):
        e = tl.load(ids_ptr + row * TOPK + k) - first
        keep = (e >= 0) & (e < n_local)
        v = tl.load(c_ptr + (row * TOPK + k).to(tl.int64) * H + cols, mask=m & keep, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * H + cols, _bf16(acc, INTERP), mask=m)


# ---- launches: one each; every shape is fixed by the width, so a CUDA graph captures them ----

def add_rms_norm(part, residual, weight, eps, res_out, x, x32) -> None:
    """Rows of ``part`` and ``residual`` (made contiguous: a no-op for the step's own tensors);
    ``res_out`` may be ``part`` itself (each row is read whole before it is written)."""
    s, H = part.shape
    part, residual = part.contiguous(), residual.contiguous()
    _add_rms_norm_kernel[(s,)](part, residual, weight, res_out, x, x32, H, eps, BLOCK=p2(H),
                               INTERP=interpreting(), num_warps=8 if H >= 2048 else 4)


def topk_sigmoid(logits, bias, slots, top_k: int, wts, ids) -> None:
    s, E = logits.shape
    _topk_sigmoid_kernel[(s,)](logits, bias, slots, wts, ids, E, TOPK=top_k, EP=p2(E), KP=p2(top_k),
                               num_warps=4 if E > 64 else 1)


def align_size(numel: int, n_experts: int, block_m: int) -> int:
    """sorted_token_ids' length as vLLM's moe_align_block_size allocates it (pad_sorted_ids off)."""
    size = numel + n_experts * (block_m - 1)
    return min(numel * block_m, size) if numel < n_experts else size


def align(ids, block_m: int, first: int, n_local: int, sorted_ids, expert_ids, ntp) -> None:
    """``ids`` int32 [numel] (global expert ids, -1 on padding) -> the three outputs in place."""
    numel = ids.numel()
    _align_kernel[(1,)](ids, sorted_ids, expert_ids, ntp, numel, first, n_local, BM=block_m, NP=p2(numel),
                        EP=p2(n_local), TAIL=p2(block_m), MAXB=p2(triton.cdiv(numel, block_m)), num_warps=4)


def group_quant_fp8(y, group: int, q, scale) -> None:
    r, c = y.shape
    _group_quant_kernel[(r * (c // group),)](y, q, scale, group, c, y.stride(0), BLOCK=p2(group),
                                             INTERP=interpreting(), num_warps=1)


def silu_mul_quant(gu, group: int, q, scale) -> None:
    """``gu`` [P, 2I] bf16 (gate | up) -> q [P, I] e4m3, scale [P, I / group] fp32."""
    P, I2 = gu.shape
    ng = I2 // 2 // group
    _silu_mul_quant_kernel[(P,)](gu, q, scale, I2 // 2, GROUP=group, NG=ng, NGP=p2(ng), INTERP=interpreting(),
                                 num_warps=4)


def moe_sum(c, ids, first: int, n_local: int, out) -> None:
    """``c`` [s, k, H] -> out [s, H] bf16, pairs of experts not in [first, first + n) skipped."""
    s, k, H = c.shape
    block = min(p2(H), 1024)
    _moe_sum_kernel[(s, triton.cdiv(H, block))](c, ids, out, H, first, n_local, TOPK=k, BLOCK=block,
                                               INTERP=interpreting(), num_warps=4)


def quant_reference(y: torch.Tensor, group: int):
    """The same arithmetic in torch (fp32): codes and scales, for the tests and the stand-in."""
    r, c = y.shape
    g = y.float().view(r, c // group, group)
    scale = g.abs().amax(-1).clamp(min=EPS) * (1.0 / FP8_MAX)
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(r, c), scale
