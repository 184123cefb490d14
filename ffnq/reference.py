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

Each step also carries the error a correct kernel may show against it (``rel_bound_out``,
``rel_bound_res``), derived from the arithmetic of this very step rather than a round number:
BOUND_Z times the RMS of the modelled rounding error, relative to the oracle's norm. The model:

* res_out: h (a sum of bf16 values, exact in fp32) rounded to bf16: the oracle rounds it too, so
  this term is the error itself (a sum of bf16 values has few bits past bf16's 8, so its rounding
  is no uniform +-ulp/2: often a tie, exactly half an ulp);
* out: at tp > 1 each rank's MoE partial is rounded to bf16 before the one-shot reduce, the fp32
  sum of those rounded again; the oracle does the same to its own fp64 partials (``partials``), a
  sample of the kernel's rounding error (thousands of independent elements: its norm is within a
  few percent of the RMS); at tp = 1 the output's one rounding;
* activations: a kernel that feeds x and silu(g) * u to its GEMMs at ``act_bits`` significand
  bits (bf16, or two fp8 e4m3 terms: 8) adds their rounding (uniform, ulp^2 / 12), passed through
  both GEMMs (squared weights) and the SiLU's slope per element (``_act_var``); the cpu backend
  and this oracle compute in fp32 / fp64, whose rounding is the next term;
* fp32 accumulation: 2^-24 x sqrt(K) of the norm (K = hidden + intermediate chained terms).

The terms are independent, so their variances add. Measured: the cpu backend's arithmetic sits
at 1/BOUND_Z = 0.67 of its bound at TP1, 2 and 4, on tiny and on minimax-m2 shapes (rel_err
~1.6e-3 / ~2.4e-3 against ~2.4e-3 / ~3.6e-3 at TP1 / TP2); a kernel rounding x and the
activation to bf16 at 0.60-0.76 of the act_bits = 8 bound (~5.0e-3 / ~5.8e-3 on minimax-m2);
the triton kernel's reference runs (configs/gates/ref, rel_err <= 2.0e-3 / 2.5e-3) at <= 0.43
of it. One rank's output 0.8% high (rel_err ~8e-3, under a round 1e-2) is over any of them.
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
# (1% of the rows flipped, at gaps up to 5.4e-4, over 10,000 MiniMax-M2 rows at TP2); a flip needs a gap
# under twice the move
BF16_TIE_EPS = 4e-3


BF16_BITS, FP32_BITS = 8, 24  # significand bits (the stored ones + the implicit 1)
BOUND_Z = 1.5  # rel_bound = BOUND_Z x the modelled rounding error's RMS / the oracle's norm: the
# model's own spread (a few percent at >= 256 elements) and its simplifications, not a round headroom


@dataclass
class Reference:
    out: torch.Tensor  # [s, H] fp64
    res_out: torch.Tensor  # [s, H] fp64
    chosen: torch.Tensor  # [s, k] int64, sorted per row; -1 for padding rows
    weights: torch.Tensor  # [s, k] fp64, matching chosen
    near_tie: torch.Tensor  # [s] bool
    rel_bound_out: float = float("nan")  # the largest rel_err a correct kernel shows on out (see above)
    rel_bound_res: float = float("nan")  # the same for res_out


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


def act_bits(runner) -> int:
    """Significand bits of the activations a runner's GEMMs take (the bound's activation term):
    its ``ACT_MANTISSA_BITS`` where it says; else 24 for the cpu backend (fp32 throughout), 8 for
    any other (bf16, or two fp8 e4m3 terms as triton's X_TERMS / DOWN_ACT_TERMS = 2)."""
    bits = getattr(runner, "ACT_MANTISSA_BITS", None)
    if bits is None:
        bits = FP32_BITS if getattr(runner, "backend", None) == "cpu" else BF16_BITS
    return int(bits)


def ulp_var(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Variance of rounding ``v`` to nearest at ``bits`` significand bits: ulp^2 / 12, where
    ulp = 2^(floor(log2|v|) + 1 - bits) (0 for v = 0)."""
    _, e = torch.frexp(v)  # v = m 2^e, 0.5 <= |m| < 1: floor(log2|v|) = e - 1
    ulp = torch.ldexp(torch.ones_like(v), (e - bits).to(torch.int32))
    return torch.where(v == 0, torch.zeros_like(v), ulp * ulp / 12)


def bound(ref: torch.Tensor, var: torch.Tensor, acc_terms: int) -> float:
    """BOUND_Z x the RMS of the modelled error (``var``: its square per element, plus fp32
    accumulation over ``acc_terms`` chained terms), relative to the oracle's norm (0 for an
    all-zero oracle: then any error fails)."""
    n2 = float(ref.pow(2).sum())
    if n2 == 0:
        return 0.0
    acc = 2.0 ** -FP32_BITS * acc_terms ** 0.5
    return BOUND_Z * (float(var.sum()) / n2 + acc * acc) ** 0.5


def step(parts: list[torch.Tensor], residual: torch.Tensor, slots: torch.Tensor, w: FullWeights,
         spec: ModelSpec, experts: Experts = Experts.ALL, cache: dict | None = None,
         follow: torch.Tensor | None = None, tie_eps: float = TIE_EPS, act_bits: int = FP32_BITS) -> Reference:
    """``cache``: a dict the caller keeps, for repeated steps on one set of weights.
    ``follow``: a route [s, k] (the kernel's, or a baseline's with ``tie_eps=BF16_TIE_EPS``);
    near-tie rows (within ``tie_eps``) where it is admissible use its experts (and ``chosen``
    says so), every other row keeps the oracle's own pick. ``act_bits``: significand bits of
    the activations the kernel feeds its GEMMs (the bound's activation term; tp = len(parts))."""
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
    tp = len(parts)
    out = torch.zeros_like(h)
    partials = torch.zeros((tp, *h.shape), dtype=dt, device=dev) if tp > 1 else None
    act_var = torch.zeros_like(h) if act_bits < FP32_BITS else None
    if experts is not Experts.NONE:
        for e in torch.unique(idx[~pad]).tolist():
            rows, k = torch.nonzero((idx == e) & ~pad[:, None], as_tuple=True)
            xe = x[rows]
            w1, w3, w2 = expert64(w, e, spec.block, cache)
            g, u = xe @ w1.T, xe @ w3.T
            a = F.silu(g) * u
            wk = wts[rows, k, None]
            y = (a @ w2.T) * wk
            out.index_add_(0, rows, y)
            if partials is not None:
                _partials(partials, rows, y, a, w2, wk, e, spec, experts)
            if act_var is not None:
                act_var.index_add_(0, rows, _act_var(xe, g, u, a, w1, w3, w2, act_bits) * wk * wk)
    order = idx.sort(-1)
    chosen = order.values.masked_fill(pad[:, None], -1)
    weights = wts.gather(1, order.indices).masked_fill(pad[:, None], 0.0)
    # the kernel's roundings done on the oracle's values: each partial to bf16, their sum to bf16
    sim = partials.bfloat16().double().sum(0) if partials is not None else out
    var = (sim.bfloat16().double() - out).pow(2)
    if act_var is not None:
        var = var + act_var
    b_out = bound(out, var, spec.hidden + spec.intermediate)
    b_res = bound(h, (h.bfloat16().double() - h).pow(2), tp + 1)
    return Reference(out, h, chosen, weights, tie & ~pad, b_out, b_res)


def _partials(partials: torch.Tensor, rows, y, a, w2, wk, e: int, spec: ModelSpec, experts: Experts) -> None:
    """Add expert ``e``'s output on ``rows`` (``y``, the whole expert's) to each rank's MoE
    partial: ALL splits the intermediate (rank r: columns r*I/tp..), LOCAL gives ``y`` to its owner."""
    tp = partials.shape[0]
    if experts is Experts.LOCAL:
        partials[e // (spec.experts // tp)].index_add_(0, rows, y)
        return
    n = a.shape[1] // tp
    for r in range(tp):
        c = slice(r * n, (r + 1) * n)
        partials[r].index_add_(0, rows, (a[:, c] @ w2[:, c].T) * wk)


def _act_var(xe, g, u, a, w1, w3, w2, bits: int) -> torch.Tensor:
    """Per output element of one expert, the variance that rounding x and the activation
    silu(g) * u to ``bits`` significand bits adds: through the up GEMMs (squared weights), the
    SiLU's slope and the down GEMM."""
    vx = ulp_var(xe, bits)
    vg, vu = vx @ (w1 * w1).T, vx @ (w3 * w3).T
    sg = torch.sigmoid(g)
    silu, dsilu = g * sg, sg * (1 + g * (1 - sg))
    va = (dsilu * u).pow(2) * vg + silu.pow(2) * vu + ulp_var(a, bits)
    return va @ (w2 * w2).T


# tolerance of a bf16-output kernel against the fp64 oracle: rtol on each element plus an atol of
# ATOL_RMS times the output's RMS. The atol is not rtol: every rank's MoE partial crosses the link
# as bf16 (as a bf16 all-reduce does), so an element carries up to 2^-9 of each partial's size,
# and where partials cancel they are several times the output (a soak of 300 TP2 steps met one
# element at 1.6% of the RMS off). A planted bug misses by O(RMS) and still counts.
RTOL = {torch.bfloat16: 1.6e-2, torch.float16: 4e-3, torch.float32: 1e-4}
ATOL_RMS = 5e-2
# a ceiling for checks that have no per-step bound (a plug-in runner's examples); qualify, soak
# and bench judge the kernel's rel_err by the step's own rel_bound (Reference.rel_bound_out / rel_bound_res)
MAX_REL_ERR = 1e-2
ROUTE_W_ATOL = 1e-4  # routing weights (each ~1/k, summing to 1) against the oracle's


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


def disagreement(mine: torch.Tensor, theirs: torch.Tensor, rtol: float = 0.0) -> tuple[int, int, float]:
    """Two ranks' [out, res_out] (flattened, concatenated, equal halves) elementwise: (elements of
    out that differ, of res_out, the largest difference over that output's RMS). Equal means bit
    for bit (NaN equals NaN) or, with ``rtol``, within rtol x (|value| + the output's RMS)."""
    a, b, half = mine.double(), theirs.double(), mine.numel() // 2
    counts, worst = [], 0.0
    for part in (slice(0, half), slice(half, mine.numel())):
        x, y = a[part], b[part]
        same = (x == y) | (torch.isnan(x) & torch.isnan(y))
        rms = float(y.nan_to_num(0).pow(2).mean().sqrt()) if y.numel() else 0.0
        if rtol:
            same |= (x - y).abs() <= rtol * (y.abs() + rms)
        off = ~same
        counts.append(int(off.sum()))
        if off.any():
            worst = max(worst, float((x - y).abs().nan_to_num(float("inf"))[off].max()) / (rms or 1.0))
    return counts[0], counts[1], worst


def _ratio(err: float, bound: float) -> float:
    return err / bound if bound > 0 else (0.0 if err == 0 else float("inf"))


def evidence(r, s, out, res_out, ref: Reference, slots) -> dict:
    """One checked step of runner ``r`` at width ``s`` against the oracle ``ref``: rel_err and
    rel_bound (of out, unless res_out is over its bound and nearer it), elements beyond tolerance
    (padding rows must be 0), the route and its weights; the texts a FAIL's evidence quotes.
    ``r`` None: a runner with no route region, whose outputs alone are judged (route counts 0)."""
    c_out, c_res = compare(out, ref.out), compare(res_out, ref.res_out)
    m_out, m_res = _ratio(c_out["rel_err"], ref.rel_bound_out), _ratio(c_res["rel_err"], ref.rel_bound_res)
    pad = (slots[:s] < 0).to(out.device)
    pad_nonzero = int((out[pad] != 0).sum())
    route, route_txt = _route_evidence(r, s, ref) if r is not None else (dict.fromkeys(ROUTE_COUNTS, 0), None)
    worst_c = c_out if (m_out, c_out["wrong"]) >= (m_res, c_res["wrong"]) else c_res
    w = worst_c["worst"] or {}
    which = "out" if worst_c is c_out else "res_out"
    # rel_err and rel_bound: out's, unless res_out is over its bound and nearer it than out
    near, bnd, margin = (c_res, ref.rel_bound_res, m_res) if 1 < m_res > m_out else (c_out, ref.rel_bound_out, m_out)
    over = [f"{name} rel_err {c['rel_err']:.3g} > its bound {b:.3g}" for name, c, b, m in
            (("out", c_out, ref.rel_bound_out, m_out), ("res_out", c_res, ref.rel_bound_res, m_res)) if m > 1]
    ev = {"rel_err": near["rel_err"], "rel_bound": bnd, "margin": margin, "over_bound": bool(over),
          "wrong": c_out["wrong"] + c_res["wrong"] + pad_nonzero,
          "elements": c_out["elements"] + c_res["elements"], **route,
          "worst_txt": ("; ".join(over) + ("; " if over else "")
                        + f"{which}[{w.get('row')},{w.get('col')}] expected {w.get('expected', 0):.5g} got "
                        f"{w.get('got', 0):.5g}; {c_out['wrong'] + c_res['wrong']} wrong"
                        + (f", {pad_nonzero} nonzero in padding rows" if pad_nonzero else ""))}
    if route_txt:
        ev["route_txt"] = route_txt
    return ev


ROUTE_COUNTS = ("route_rows", "route_mismatch", "route_excused", "route_w_wrong")


def _route_evidence(r, s, ref: Reference) -> tuple[dict, str | None]:
    """The route runner ``r`` reports at width ``s`` and its weights against the oracle's: the
    counts (ROUTE_COUNTS) and, where any is off, the text a FAIL quotes."""
    got = r.chosen(s).cpu().sort(-1).values
    want = ref.chosen.cpu()
    # the reference already took the kernel's pick where a near tie allows it: any other row is a mismatch
    mismatch = ~(got == want).all(-1)
    # the routing weights the kernel reports for its experts (a padding row's are 0): fp32 from fp32
    # logits, so within ROUTE_W_ATOL of the oracle's (a weight off by that moves the output under
    # bf16's step); rows whose experts differ are already counted above
    w_got = r.chosen_weights(s).cpu().double()
    wdiff = (w_got - ref.weights.cpu()).abs()[~mismatch].nan_to_num(float("inf"))
    w_wrong = int((wdiff > ROUTE_W_ATOL).sum())
    counts = {"route_rows": s, "route_mismatch": int(mismatch.sum()),
              "route_excused": int((ref.near_tie.cpu() & ~mismatch).sum()), "route_w_wrong": w_wrong}
    txt = None
    if mismatch.any():
        i = int(mismatch.nonzero()[0])
        txt = f"route row {i}: expected {want[i].tolist()} got {got[i].tolist()}"
    elif w_wrong:
        row = int((~mismatch).nonzero().flatten()[int(wdiff.argmax()) // wdiff.shape[1]])
        txt = (f"route_w row {row}: expected {ref.weights[row].tolist()} got "
               f"{w_got[row].tolist()}; {w_wrong} weights off by > {ROUTE_W_ATOL:g}")
    return counts, txt
