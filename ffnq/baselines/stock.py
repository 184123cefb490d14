"""Bench baselines (b) ``unfused`` and (c) ``stock``: the step a PyTorch user writes from stock parts.

    h   = all_reduce(part) + residual; x = F.rms_norm(h) ; fp32 router, sigmoid, biased top-k
    y   = torch._grouped_mm over the chosen (row, expert) pairs, bf16 experts, SiLU-gated
    out = all_reduce(y)

``allreduce="nccl"`` uses dist.all_reduce (b); ``"symm"`` uses torch.ops.symm_mem.
one_shot_all_reduce on a symmetric-memory staging buffer (c). Every shape is fixed by the
width (all s*top_k pairs go through the grouped GEMM, padding pairs with weight 0), so the
step captures into a CUDA graph. Experts are dequantized to bf16 once, at build: the step
reads 2x the FP8 bytes (14.2 MB per chosen expert at TP2 against 7.1 MB) and pays no dequant.
It is what a user gets without a serving stack, not what a tuned one runs: the argsort,
scatter_add, cumsum, gathers and casts around the two grouped GEMMs are each a launch of their
own (dozens a step, against the nine of vLLM's: baseline (d), ffnq.baselines.vllm).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ffnq import reference
from ffnq.baselines.unfused import route
from ffnq.spec import Experts, ModelSpec
from ffnq.weights import RankWeights, dequant


class Stock:
    def __init__(self, w: RankWeights, spec: ModelSpec, tp: int, experts: Experts, device,
                 allreduce: str = "nccl"):
        if experts is Experts.NONE:
            raise ValueError("the stock composition needs experts (all or local)")
        self.spec, self.tp, self.w, self.allreduce = spec, tp, w, allreduce
        self.first = w.first_expert if experts is Experts.LOCAL else 0
        self.n = w.w13.shape[0]
        self._prepare(w)
        self.device = torch.device(device)
        self.group = dist.group.WORLD.group_name if tp > 1 else None
        if tp > 1 and allreduce == "symm":
            import torch.distributed._symmetric_memory as symm_mem
            self.stage = symm_mem.empty(spec.max_tokens * spec.hidden, dtype=torch.bfloat16, device=self.device)
            symm_mem.rendezvous(self.stage, self.group)

    @property
    def describe(self) -> str:
        ar = "no all-reduce" if self.tp == 1 else (
            "symm-mem one-shot all-reduce" if self.allreduce == "symm" else "NCCL all-reduce")
        return (f"a plain PyTorch composition ({ar}, F.rms_norm, fp32 router + torch.topk, torch._grouped_mm "
                "over bf16-dequantized experts, index_add), not a tuned stack")

    def _prepare(self, w: RankWeights) -> None:
        # grouped GEMM wants [G, K, N]: x [pairs, K] @ w[g] -> [pairs, N]
        self.w13 = dequant(w.w13, w.s13, self.spec.block, torch.bfloat16).transpose(1, 2).contiguous()
        self.w2 = dequant(w.w2, w.s2, self.spec.block, torch.bfloat16).transpose(1, 2).contiguous()
        self.half = self.w13.shape[2] // 2

    def chosen(self, width: int) -> torch.Tensor:
        """The experts of the last step, [s, k] int64 sorted, -1 on a padding row (as
        Runner.chosen): the bench's check follows them on a near tie at bf16's precision."""
        return reference.picks(*self._route)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return t
        if self.allreduce == "symm":
            buf = self.stage[: t.numel()].view_as(t)
            buf.copy_(t)
            return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group)
        dist.all_reduce(t)
        return t

    def __call__(self, part, residual, weights, slots, final=False):
        m, s = self.spec, part.shape[0]
        h = self._all_reduce(part.clone()).float() + residual.float()
        x = F.rms_norm(h, (m.hidden,), self.w.post_norm.float(), m.eps)
        idx, wts = route(x, self.w, m.top_k)
        self._route = idx, slots[:s]  # for chosen(): no op here, so a captured step times none
        # pairs sorted by local expert; another rank's expert (LOCAL) or a padding row: weight 0
        local = idx - self.first
        keep = (local >= 0) & (local < self.n) & (slots[:s] >= 0)[:, None]
        wts = torch.where(keep, wts, torch.zeros_like(wts))
        y = self._experts(x, local.clamp(0, self.n - 1), wts, s)
        return self._all_reduce(y.to(torch.bfloat16)), h.to(torch.bfloat16)

    def _experts(self, x: torch.Tensor, local: torch.Tensor, wts: torch.Tensor, s: int) -> torch.Tensor:
        """sum_k wts[:, k] * expert local[:, k] (x), fp32 [s, H]; every pair goes through the
        grouped GEMM (a pair with weight 0 adds 0)."""
        m = self.spec
        e = local.flatten()
        order = torch.argsort(e, stable=True)
        rows = torch.arange(s, device=x.device).repeat_interleave(m.top_k)[order]
        # scatter_add, not bincount: bincount reads the max back to the host, which a graph forbids
        counts = torch.zeros(self.n, dtype=torch.int64, device=x.device).scatter_add_(0, e, torch.ones_like(e))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        xs = x.to(torch.bfloat16)[rows]
        gu = torch._grouped_mm(xs, self.w13, offs=offs)
        a = F.silu(gu[:, : self.half]) * gu[:, self.half:]
        ys = torch._grouped_mm(a, self.w2, offs=offs) * wts.flatten()[order, None].to(torch.bfloat16)
        return torch.zeros(s, m.hidden, dtype=torch.float32, device=x.device).index_add_(0, rows, ys.float())
