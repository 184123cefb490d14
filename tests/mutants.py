"""Planted-bug runners: the cpu backend with one bug each, of the kinds real fused kernels ship
with. ``ffnq qualify --runner mutants:NAME`` (tests/ on PYTHONPATH) must FAIL every one.
Each class's docstring is the one line that says what it breaks."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ffnq.backends.cpu import CpuRunner, CpuStep


def mutant(step_cls: type[CpuStep], doc: str, **attrs) -> type[CpuRunner]:
    return type(step_cls.__name__.lstrip("_"), (CpuRunner,), {"step_cls": step_cls, "__doc__": doc, **attrs})


class _BiasAsWeight(CpuStep):
    def select(self, scores):
        biased = scores + self.w.router_bias.float()
        idx = torch.topk(biased, self.r.model.top_k, dim=-1).indices
        wts = biased.gather(1, idx)
        return idx, wts / wts.sum(-1, keepdim=True)


class _BiasIgnored(CpuStep):
    def select(self, scores):
        idx = torch.topk(scores, self.r.model.top_k, dim=-1).indices
        wts = scores.gather(1, idx)
        return idx, wts / wts.sum(-1, keepdim=True)


class _NoRenorm(CpuStep):
    def select(self, scores):
        idx = torch.topk(scores + self.w.router_bias.float(), self.r.model.top_k, dim=-1).indices
        return idx, scores.gather(1, idx)


class _RouterBf16(CpuStep):
    def route(self, x, pad):
        logits = (x.bfloat16() @ self.w.router.bfloat16().T).float()
        idx, wts = self.select(torch.sigmoid(logits))
        order = idx.sort(-1)
        self.r.view(self.s, "route").copy_(order.values.masked_fill(pad[:, None], -1))
        self.r.view(self.s, "route_w").copy_(wts.gather(1, order.indices).masked_fill(pad[:, None], 0))
        return idx, wts


class _RouteWeightsUnwritten(CpuStep):
    def route(self, x, pad):
        idx, wts = self.select(torch.sigmoid(x @ self.w.router.float().T))
        self.r.view(self.s, "route").copy_(idx.sort(-1).values.masked_fill(pad[:, None], -1))
        return idx, wts


class _PaddingToExperts(CpuStep):
    @staticmethod
    def padding(slots):
        return torch.zeros_like(slots, dtype=torch.bool)


class _EpochAtLeast(CpuStep):
    @staticmethod
    def matches(v, e):
        return v >= e


class _EpochStuck(CpuStep):
    @staticmethod
    def next_epoch(e):
        return 1


class _InjectIgnored(CpuStep):
    def arrive_late(self):
        pass


class _TimeoutIgnored(CpuStep):
    def deadline(self, t0):
        return t0 + 10**15


class _EpsWrong(CpuStep):
    def norm(self, h):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * self.w.post_norm.float()


class _OwnPartTwice(CpuStep):
    def gather(self, region):
        rows = self.r._peer[region][self.r.rank][self.par, :, : self.s].float()
        return rows.sum(0) + (rows[self.r.rank] if region == "seam" else 0)


class _ReduceSkipsLast(CpuStep):
    def gather(self, region):
        rows = self.r._peer[region][self.r.rank][self.par, :, : self.s].float()
        return rows[:-1].sum(0) if region == "moe" and self.r.tp > 1 else rows.sum(0)


class _LastChunkShort(CpuStep):
    def cols(self):
        c = list(self.r._cols)
        c[-1] = slice(c[-1].start, c[-1].stop - 1)
        return c


class _SiluOnUp(CpuStep):
    def experts(self, x, idx, wts, pad):
        r, w = self.r, self.w
        y = torch.zeros_like(x)
        half = w.w13.shape[1] // 2
        for e in torch.unique(idx[~pad]).tolist():
            rows, k = torch.nonzero((idx == e) & ~pad[:, None], as_tuple=True)
            w13, w2 = r.expert(w, e)
            gu = x[rows] @ w13.T
            y.index_add_(0, rows, ((gu[:, :half] * F.silu(gu[:, half:])) @ w2.T) * wts[rows, k, None])
        return y


class _ResetKeepsScratch(CpuStep):
    pass


class _ScaleColumnsShifted(CpuStep):
    pass


def _expert_scale_columns_shifted(self, w, le: int):
    from ffnq.weights import dequant
    b = self.model.block
    return dequant(w.w13[le], w.s13[le].roll(1, -1), b), dequant(w.w2[le], w.s2[le].roll(1, -1), b)


def _reset_keeps_scratch(self):
    from ffnq.dist import barrier
    barrier()
    for name in ("flags", "fault_box"):
        self._peer[name][self.rank].zero_()
    self.epoch.zero_()
    barrier()


BiasAsWeight = mutant(_BiasAsWeight, "the biased scores used as the expert weights")
BiasIgnored = mutant(_BiasIgnored, "the selection bias ignored: top-k of the plain scores")
NoRenorm = mutant(_NoRenorm, "the chosen weights not renormalised to sum 1")
RouterBf16 = mutant(_RouterBf16, "router logits computed in bf16 instead of fp32")


class LastRowUnwritten(CpuRunner):
    """the last row of out and res_out never written (its memory as the allocator gave it)"""

    def __call__(self, part, residual, weights, slots, final=False):
        out, res = super().__call__(part, residual, weights, slots, final)
        o, r = self.new_outputs(out, res)
        o[:-1], r[:-1] = out[:-1], res[:-1]
        return o, r


class OutputTwoPercentHigh(CpuRunner):
    """the MoE output 2% too large: within a bf16 baseline's 3e-2 of the oracle, not the kernel's 1e-2"""

    def __call__(self, part, residual, weights, slots, final=False):
        out, res = super().__call__(part, residual, weights, slots, final)
        return (out.float() * 1.02).to(out.dtype), res


class OutputsOnce(CpuRunner):
    """each width's outputs computed on its first call only; later calls return them as they are"""

    def __call__(self, part, residual, weights, slots, final=False):
        self._once = getattr(self, "_once", {})
        s = self.check_inputs(part, residual, slots)
        if s not in self._once:
            self._once[s] = super().__call__(part, residual, weights, slots, final)
        return self._once[s]


class EveryNthWrong(CpuRunner):
    """every 50th call (of each runner) returns its output 5% too large: an intermittent fault"""

    N = 50

    def __call__(self, part, residual, weights, slots, final=False):
        out, res = super().__call__(part, residual, weights, slots, final)
        self._calls = getattr(self, "_calls", 0) + 1
        return ((out.float() * 1.05).to(out.dtype) if self._calls % self.N == 0 else out), res


class OneRankScaled(CpuRunner):
    """rank 1's output 0.8% too large, below a round 1e-2 bound: an error confined to one rank"""

    def __call__(self, part, residual, weights, slots, final=False):
        out, res = super().__call__(part, residual, weights, slots, final)
        return ((out.float() * 1.008).to(out.dtype) if self.rank == 1 else out), res


class CallNeverReturns(CpuRunner):
    """rank 1's 4th call at the widest width never returns (a wait with no bound of its own)"""

    def __call__(self, part, residual, weights, slots, final=False):
        if self.rank == 1 and part.shape[0] == max(self.widths):
            self._wide = getattr(self, "_wide", 0) + 1
            while self._wide == 4:
                time.sleep(0.05)
        return super().__call__(part, residual, weights, slots, final)


class FirstWeightsKept(CpuRunner):
    """the experts of the first weights it was stepped on used for every later set (a cache keyed by shape)"""

    def expert(self, w, le):
        self._first = getattr(self, "_first", None) or w
        return super().expert(self._first, le)


RouteWeightsUnwritten = mutant(_RouteWeightsUnwritten, "the routing weights (route_w) not written")
ScaleColumnsShifted = mutant(_ScaleColumnsShifted, "each FP8 block scale taken from the next column block",
                             expert=_expert_scale_columns_shifted)
PaddingToExperts = mutant(_PaddingToExperts, "padding rows (slot < 0) sent to experts")
EpochAtLeast = mutant(_EpochAtLeast, "a wait accepts flag >= epoch instead of == epoch")
EpochStuck = mutant(_EpochStuck, "the epoch not moved on by the step")
InjectIgnored = mutant(_InjectIgnored, "the inject tensor ignored")
TimeoutIgnored = mutant(_TimeoutIgnored, "waits never time out")
EpsWrong = mutant(_EpsWrong, "RMSNorm eps 1e-5 instead of the model's 1e-6")
OwnPartTwice = mutant(_OwnPartTwice, "this rank's own part counted twice in the seam")
ReduceSkipsLast = mutant(_ReduceSkipsLast, "the MoE reduce skips the last rank")
LastChunkShort = mutant(_LastChunkShort, "off-by-one: the last CTA's chunk misses its last column")
SiluOnUp = mutant(_SiluOnUp, "SiLU applied to the up projection instead of the gate")
ResetKeepsScratch = mutant(_ResetKeepsScratch, "reset() leaves every width's scratch as it was",
                           reset=_reset_keeps_scratch)

ALL = {name: cls for name, cls in globals().items()
       if isinstance(cls, type) and issubclass(cls, CpuRunner) and cls is not CpuRunner}
