"""The unfused baseline: the same step composed of stock torch ops and the backend's all-reduce.

    h   = all_reduce(part) + residual          (res_out)
    x   = rms_norm(h) * post_norm
    w,k = fp32 sigmoid router, biased top-k, renormalised
    y   = sum_k w_k * w2_k(silu(w1_k x) * w3_k x)   over this rank's (dequantized) shards
    out = all_reduce(y)

The cpu backend's baseline (on a GPU bench runs ffnq.baselines.stock under this name): a loop
over the chosen experts, whose torch.unique reads the route back to the host, so it cannot be
captured in a CUDA graph, and runs a dozen torch ops per chosen expert (~100 a step at one token).
Experts are dequantized once at build (bf16 on GPU, fp32 on cpu where bf16 matmuls are slow),
so the baseline pays no dequant cost in the loop; it wins nothing from FP8.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ffnq import reference
from ffnq.spec import Experts, ModelSpec
from ffnq.weights import RankWeights, dequant


def route(x: torch.Tensor, w: RankWeights, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 sigmoid router as a PyTorch user writes it: the biased scores pick top_k, the
    unbiased ones weigh them, renormalised. (idx, wts), each [s, top_k]."""
    scores = torch.sigmoid(x @ w.router.float().T)
    idx = torch.topk(scores + w.router_bias.float(), top_k, dim=-1).indices
    wts = scores.gather(1, idx)
    return idx, wts / wts.sum(-1, keepdim=True)


class Unfused:
    def __init__(self, w: RankWeights, spec: ModelSpec, tp: int, experts: Experts, device):
        self.spec, self.tp, self.experts, self.w = spec, tp, experts, w
        self.dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        self.first = w.first_expert if experts is Experts.LOCAL else 0
        self.n = spec.experts_per_rank(tp, experts) if experts is not Experts.NONE else 0
        if self.n:
            self.w13 = dequant(w.w13, w.s13, spec.block, self.dtype)  # [E_r, 2*I_r, H]
            self.w2 = dequant(w.w2, w.s2, spec.block, self.dtype)  # [E_r, H, I_r]

    @property
    def describe(self) -> str:
        ar = "no all-reduce" if self.tp == 1 else f"{dist.get_backend()} all-reduce"
        return (f"a plain PyTorch composition ({ar}, F.rms_norm, fp32 router + torch.topk, a loop over the chosen "
                f"experts with {str(self.dtype).removeprefix('torch.')} matmuls), not a tuned stack")

    def chosen(self, width: int) -> torch.Tensor:
        """The experts of the last step, [s, k] int64 sorted, -1 on a padding row (as
        Runner.chosen): the bench's check follows them on a near tie at bf16's precision."""
        return reference.picks(*self._route)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            dist.all_reduce(t)
        return t

    def __call__(self, part, residual, weights, slots, final=False):
        s, m = part.shape[0], self.spec
        h = self._all_reduce(part.clone()).float() + residual.float()
        res_out = h.to(torch.bfloat16)
        x = F.rms_norm(h, (m.hidden,), self.w.post_norm.float(), m.eps)
        idx, wts = route(x, self.w, m.top_k)
        self._route = idx, slots[:s]  # for chosen(): no op here, so a captured step times none
        y = torch.zeros(s, m.hidden, dtype=self.dtype, device=part.device)
        if self.n:
            keep = (slots[:s] >= 0)[:, None]
            xd = x.to(self.dtype)
            half = self.w13.shape[1] // 2
            for e in torch.unique(idx[keep.expand_as(idx)]).tolist():
                le = e - self.first
                if not 0 <= le < self.n:
                    continue
                rows, k = torch.nonzero((idx == e) & keep, as_tuple=True)
                gu = xd[rows] @ self.w13[le].T
                a = F.silu(gu[:, :half]) * gu[:, half:]
                y.index_add_(0, rows, (a @ self.w2[le].T) * wts[rows, k, None].to(self.dtype))
        out = self._all_reduce(y.to(torch.bfloat16))
        return out, res_out
