"""The fp64 oracle of one fused step, computed from every rank's inputs and the full weights.

    h       = residual + sum_r part_r                     (res_out)
    x       = h / sqrt(mean(h^2) + eps) * post_norm
    scores  = sigmoid(x @ router^T)
    chosen  = top_k(scores + router_bias)                 (the bias only selects)
    w       = scores[chosen] / sum(scores[chosen])
    out     = sum_k w_k * w2_k(silu(w1_k x) * w3_k x)     (0 for padding rows, slot < 0)

A near-tie row (k-th and (k+1)-th biased scores within TIE_EPS) may pick either side, and the
two picks give outputs O(RMS) apart. ``step(..., follow=route)`` takes the kernel's pick on such
a row when it is admissible (a top-k of the scores moved by at most TIE_EPS), so the output of
that row is checked against the experts the kernel really used, not excused nor falsely failed.
A composition that rounds the all-reduced h to bf16 (the bench's baselines) moves the scores by
up to ~2e-3 and flips about one row in a hundred at TP2: its check follows its pick within
BF16_TIE_EPS.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ffnq.spec import Experts, ModelSpec
from ffnq.weights import FullWeights

TIE_EPS = 1e-6  # a row whose k-th and (k+1)-th biased scores are this close may pick either
# the same for a step whose all-reduced h is rounded to bf16 (NCCL or symm-mem bf16 sums): the
# biased scores of minimax-m2 shapes moved by at most 1.7e-3 over 4096 rows x 256 experts on CPU
# (1% of the rows flipped, at gaps up to 5.4e-4: scripts/bf16_route_flips.py); a flip needs a gap
# under twice the move
BF16_TIE_EPS = 4e-3


@dataclass
class Reference:
    out: torch.Tensor  # [s, H] fp64
    res_out: torch.Tensor  # [s, H] fp64
    chosen: torch.Tensor  # [s, k] int64, sorted per row; -1 for padding rows
    weights: torch.Tensor  # [s, k] fp64, matching chosen
    near_tie: torch.Tensor  # [s] bool


def route(x: torch.Tensor, w: FullWeights, spec: ModelSpec, tie_eps: float = TIE_EPS):
    """Sigmoid scores, biased top-k, renormalised weights; also flags near-tie rows."""
    scores = torch.sigmoid(x @ w.router.to(x.dtype).T)
    biased = scores + w.router_bias.to(x.dtype)
    top = torch.topk(biased, min(spec.top_k + 1, spec.experts), dim=-1)
    idx = top.indices[:, : spec.top_k]
    if spec.top_k < spec.experts:
        gap = top.values[:, spec.top_k - 1] - top.values[:, spec.top_k]
        tie = gap.abs() <= tie_eps
    else:
        tie = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    wts = scores.gather(1, idx)
    return idx, wts / wts.sum(-1, keepdim=True), tie


def admissible(biased: torch.Tensor, pick: torch.Tensor, k: int, eps: float = TIE_EPS) -> torch.Tensor:
    """[s] bool: row i of ``pick`` ([s, k] expert ids) is k distinct experts whose lowest biased
    score is within ``eps`` of the highest score left out (a top-k up to an ``eps`` nudge)."""
    E = biased.shape[-1]
    ok = ((pick >= 0) & (pick < E)).all(-1)
    p = pick.clamp(0, E - 1)
    taken = torch.zeros_like(biased, dtype=torch.bool).scatter_(1, p, True)
    ok &= taken.sum(-1) == k
    low = biased.gather(1, p).min(-1).values
    high = biased.masked_fill(taken, float("-inf")).max(-1).values
    return ok & (low >= high - eps)


def picks(idx: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A composition's top-k indices [s, k] as ``Reference.chosen`` holds them: sorted per row,
    -1 on a padding row (slot < 0)."""
    return idx.sort(-1).values.masked_fill((slots[: idx.shape[0]] < 0)[:, None], -1)


def dequant64(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """``q * scale`` in fp64, each element's scale picked by its block's index: written apart from
    weights.dequant (which the backends use), so one slip in the block arithmetic cannot pass
    both the oracle and the thing it checks."""
    rows = torch.arange(q.shape[-2], device=q.device) // block
    cols = torch.arange(q.shape[-1], device=q.device) // block
    return q.to(torch.float64) * scale.to(torch.float64)[rows[:, None], cols[None, :]]


def expert64(w: FullWeights, e: int, block: int, cache: dict | None = None):
    """Expert ``e`` dequantized to fp64 (w1, w3, w2); ``cache`` keeps them across steps."""
    if cache is not None and e in cache:
        return cache[e]
    got = tuple(dequant64(getattr(w, f"w{i}")[e], getattr(w, f"s{i}")[e], block) for i in (1, 3, 2))
    if cache is not None:
        cache[e] = got
    return got


def normed(parts: list[torch.Tensor], residual: torch.Tensor, w, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, x) in fp64: the all-reduced h and the router's input x = rms_norm(h) * post_norm."""
    dt = torch.float64
    h = residual.to(dt) + sum(p.to(dt) for p in parts)
    return h, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + spec.eps) * w.post_norm.to(residual.device, dt)


def chosen(parts: list[torch.Tensor], residual: torch.Tensor, slots: torch.Tensor, w, spec: ModelSpec) -> torch.Tensor:
    """The oracle's experts [s, k] as ``Reference.chosen`` holds them, without the expert MLPs:
    ``w`` is full or one rank's weights (only post_norm and the router are read)."""
    _, x = normed(parts, residual, w, spec)
    idx, _, _ = route(x, w, spec)
    pad = slots[: x.shape[0]].to(x.device) < 0
    return idx.sort(-1).values.masked_fill(pad[:, None], -1)


def step(parts: list[torch.Tensor], residual: torch.Tensor, slots: torch.Tensor, w: FullWeights,
         spec: ModelSpec, experts: Experts = Experts.ALL, cache: dict | None = None,
         follow: torch.Tensor | None = None, tie_eps: float = TIE_EPS) -> Reference:
    """``cache``: a dict the caller keeps, for repeated steps on one set of weights.
    ``follow``: a route [s, k] (the kernel's, or a baseline's with ``tie_eps=BF16_TIE_EPS``);
    near-tie rows (within ``tie_eps``) where it is admissible use its experts (and ``chosen``
    says so), every other row keeps the oracle's own pick."""
    dt = torch.float64
    dev = residual.device
    h, x = normed(parts, residual, w, spec)
    idx, wts, tie = route(x, w, spec, tie_eps)
    pad = slots[: h.shape[0]].to(dev) < 0
    if follow is not None and tie.any():
        pick = follow.to(dev, torch.int64)
        scores = torch.sigmoid(x @ w.router.to(dev, dt).T)
        take = tie & ~pad & admissible(scores + w.router_bias.to(dev, dt), pick, spec.top_k, tie_eps)
        if take.any():
            p = pick[take]
            idx, wts = idx.clone(), wts.clone()
            idx[take] = p
            wp = scores[take].gather(1, p)
            wts[take] = wp / wp.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    if experts is not Experts.NONE:
        for e in torch.unique(idx[~pad]).tolist():
            rows, k = torch.nonzero((idx == e) & ~pad[:, None], as_tuple=True)
            xe = x[rows]
            w1, w3, w2 = expert64(w, e, spec.block, cache)
            y = (F.silu(xe @ w1.T) * (xe @ w3.T)) @ w2.T
            out.index_add_(0, rows, y * wts[rows, k, None])
    order = idx.sort(-1)
    chosen = order.values.masked_fill(pad[:, None], -1)
    weights = wts.gather(1, order.indices).masked_fill(pad[:, None], 0.0)
    return Reference(out, h, chosen, weights, tie & ~pad)


# tolerance of a bf16-output kernel against the fp64 oracle: rtol on each element plus an atol of
# ATOL_RMS times the output's RMS. The atol is not rtol: every rank's MoE partial crosses the link
# as bf16 (as a bf16 all-reduce does), so an element carries up to 2^-9 of each partial's size,
# and where partials cancel they are several times the output (a soak of 300 TP2 steps met one
# element at 1.6% of the RMS off). A planted bug misses by O(RMS) and still counts.
RTOL = {torch.bfloat16: 1.6e-2, torch.float16: 4e-3, torch.float32: 1e-4}
ATOL_RMS = 5e-2
MAX_REL_ERR = 1e-2


def compare(got: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor | None = None) -> dict:
    """rel_err = ||got - ref|| / ||ref|| over the kept rows; wrong = elements beyond tolerance
    (nccl-tests' #wrong); worst = the row, column, expected and got of the largest miss."""
    g, r = got.double(), ref.double().to(got.device)
    if rows is not None:
        g, r = g[rows.to(got.device)], r[rows.to(got.device)]
    rtol = RTOL.get(got.dtype, 1.6e-2)
    nan = int(torch.isnan(g).sum() + torch.isinf(g).sum())
    diff = (g - r).abs().nan_to_num(float("inf"))
    rms = r.pow(2).mean().sqrt().item() if r.numel() else 0.0
    tol = rtol * r.abs() + (ATOL_RMS if got.dtype == torch.bfloat16 else rtol) * rms
    wrong = int((diff > tol).sum())
    rn = r.norm().item()
    rel = (diff.nan_to_num(0).norm().item() / rn) if rn > 0 else float(diff.max().item() if diff.numel() else 0)
    if nan:
        rel = float("inf")
    worst = None
    if diff.numel():
        i = int(torch.argmax(diff - tol))
        row, col = divmod(i, diff.shape[-1])
        worst = {"row": row, "col": col, "expected": float(r.view(-1)[i]), "got": float(g.view(-1)[i])}
    return {"rel_err": rel, "wrong": wrong, "nan": nan, "elements": int(r.numel()), "worst": worst}
