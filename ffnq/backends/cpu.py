"""The cpu backend: the whole fused-step protocol in torch CPU code over /dev/shm peer buffers.

It is the reference every other backend is judged against, so it follows the kernel's protocol
step for step: BLOCKS virtual CTAs each push a column chunk and carry their own flags, flags
hold the epoch and match exactly, every wait is bounded, a fault is recorded and passed on to
the peers (fault_box + a negative flag) and the step still ends and moves the epoch on.
Waits back off from a yield to 1 ms sleeps, so three ranks on two cores never starve each other.
x86 keeps stores in order (TSO), which is what orders a pushed row before its flag here.
"""
from __future__ import annotations

import time
import weakref

import torch
import torch.nn.functional as F

from ffnq.dist import ShmPeers, address_view
from ffnq.errors import UsageError
from ffnq.runner import PeerBuffer, Runner
from ffnq.spec import FAULT_FIELDS, Experts, ModelSpec, Phase, kernel_name, stamp_names, view
from ffnq.weights import dequant

MAX_EPOCH = 2**31 - 1
DEQUANT_CACHE_BYTES = 1 << 30  # fp8 -> fp32 costs ~2 ms per tiny expert on one core: do it once


def next_epoch(e: int) -> int:
    return 1 if e >= MAX_EPOCH or e < 0 else e + 1  # 0 is the cleared value: never a live tag


class CpuRunner(Runner):
    backend = "cpu"
    BLOCKS = 4
    step_cls: type  # CpuStep, set below
    THREADS = 1

    @classmethod
    def open_peers(cls, model: ModelSpec, tp: int, rank: int, device, tag: str) -> PeerBuffer:
        nbytes = cls.peer_bytes(model, tp)
        shm = ShmPeers(tag, rank, tp, nbytes)
        return PeerBuffer(shm.addresses[rank], torch.tensor(shm.addresses, dtype=torch.int64), nbytes,
                          close=shm.close, keep=[shm])

    def peer_view(self, address: int) -> torch.Tensor:
        return address_view(address, self.peer_bytes(self.model, self.tp))

    def accept_device(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise UsageError(f"device {device}: the cpu backend runs on cpu")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        bufs = [self.own if int(a) == self.sym else self.peer_view(int(a)) for a in self.peers.tolist()]
        self._peer = {name: [view(b, self.peer_regions[name]) for b in bufs]
                      for name in ("flags", "fault_box", "seam", "moe")}
        H, B = self.model.hidden, self.BLOCKS
        self._cols = [slice(c * H // B, (c + 1) * H // B) for c in range(B)]
        self._stamp = {n: i for i, n in enumerate(stamp_names(self.tp))}
        # (ids of w13, s13, w2, s2; local expert) -> (weakrefs to them, their versions, (w13, w2) fp32)
        self._deq: dict[tuple, tuple] = {}
        self._deq_bytes = 0

    # ---- contract ----------------------------------------------------------------------------
    def warm(self, weights, compute_units: int | None = None) -> None:
        """Check the weights' shapes and dequantize the local experts once (the cpu's 'load', one
        for every width: no width has a compile time of its own, so warm's table shows none)."""
        self._check_weights(weights)
        if self.experts is not Experts.NONE:
            for le in range(weights.w13.shape[0]):
                self.expert(weights, le)

    def describe(self, width: int) -> dict:
        return {"kernel": kernel_name(self.keys[width]), "compile_s": None,
                "grid": self.BLOCKS, "threads": self.THREADS}

    def __call__(self, part, residual, weights, slots, final=False):
        s = self.check_inputs(part, residual, slots)
        return self.step_cls(self, s, weights).run(part, residual, slots[:s], final)

    # ---- helpers -----------------------------------------------------------------------------
    def expert(self, w, le: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert ``le`` dequantized to fp32 (w13, w2), cached while the four tensors it came
        from live unchanged: held weakly, with their version counts, not keyed by an address (a
        freed set's successor may get the same one; new scales under one w13 are new weights)."""
        ts = (w.w13, w.s13, w.w2, w.s2)
        key = (*map(id, ts), le)
        versions = tuple(t._version for t in ts)
        entry = self._deq.get(key)
        if entry is not None and all(r() is t for r, t in zip(entry[0], ts)) and entry[1] == versions:
            return entry[2]
        b = self.model.block
        hit = dequant(w.w13[le], w.s13[le], b), dequant(w.w2[le], w.s2[le], b)
        # the copies of freed or rewritten tensors go when a new one is made
        for k, (refs, vs, old) in list(self._deq.items()):
            if k == key or any(r() is None for r in refs) or (
                    all(r() is t for r, t in zip(refs, ts)) and vs != versions):
                del self._deq[k]
                self._deq_bytes -= 4 * (old[0].numel() + old[1].numel())
        nbytes = 4 * (hit[0].numel() + hit[1].numel())
        if self._deq_bytes + nbytes <= DEQUANT_CACHE_BYTES:
            self._deq[key] = (tuple(weakref.ref(t) for t in ts), versions, hit)
            self._deq_bytes += nbytes
        return hit

    def _check_weights(self, w) -> None:
        m, tp, ex = self.model, self.tp, self.experts
        want = {"post_norm": (m.hidden,), "router": (m.experts, m.hidden), "router_bias": (m.experts,)}
        if ex is not Experts.NONE:
            E, I = m.experts_per_rank(tp, ex), m.intermediate_per_rank(tp, ex)
            want |= {"w13": (E, 2 * I, m.hidden), "s13": (E, 2 * I // m.block, m.hidden // m.block),
                     "w2": (E, m.hidden, I), "s2": (E, m.hidden // m.block, I // m.block)}
        for name, shape in want.items():
            got = getattr(w, name, None)
            if got is None or tuple(got.shape) != shape:
                raise UsageError(f"weights.{name}: {None if got is None else tuple(got.shape)}; "
                                 f"{m.name} at tp={tp}, experts={ex.value} needs {shape}")


class CpuStep:
    """One step of one rank: the kernel's body, phase by phase. Each stage is a method, so a
    planted-bug runner (tests/mutants.py) changes exactly one of them."""

    def __init__(self, r: CpuRunner, s: int, weights):
        self.r, self.s, self.w = r, s, weights
        self.e = self.next_epoch(int(r.epoch[0]))
        self.par = self.e & 1
        self.fault = r.view(s, "fault")
        self.fault.zero_()
        self.tl = r.view(s, "timeline") if r.timeline else None
        if self.tl is not None:
            self.tl.zero_()
        self.faulted = False

    def stamp(self, name: str, c: int | None = None) -> None:
        if self.tl is not None:
            t = time.monotonic_ns()
            col = self.r._stamp[name]
            if c is None:
                self.tl[:, col] = t
            else:
                self.tl[c, col] = t

    def run(self, part, residual, slots, final):
        r = self.r
        self.stamp("start")
        self.arrive_late()
        self.exchange(Phase.SEAM, "seam", part)
        h = residual.float() + self.gather("seam")
        x = self.norm(h)
        pad = self.padding(slots)
        idx, wts = self.route(x, pad)
        self.stamp("router_done")
        y = self.experts(x, idx, wts, pad)
        self.stamp("experts_done")
        self.exchange(Phase.REDUCE, "moe", y.to(torch.bfloat16))
        out = self.gather("moe").to(torch.bfloat16)
        if final:
            self.exchange(Phase.HANDSHAKE, None, None)
        self.stamp("end")
        r.epoch[0] = self.e
        return out, h.to(torch.bfloat16)

    def arrive_late(self) -> None:
        """inject = [rank + 1, ns]: the named rank holds back its arrival."""
        who, delay = self.r.inject.tolist()
        if who == self.r.rank + 1 and delay > 0:
            time.sleep(delay / 1e9)

    def deadline(self, t0: int) -> int:
        return t0 + self.r.keys[self.s].timeout_ns

    @staticmethod
    def next_epoch(e: int) -> int:
        return next_epoch(e)

    @staticmethod
    def matches(v: int, e: int) -> bool:
        return v == e  # exact: a stale or future tag never satisfies a wait

    def cols(self) -> list[slice]:
        """The hidden columns each virtual CTA pushes."""
        return self.r._cols

    def gather(self, region: str) -> torch.Tensor:
        """fp32 sum of every rank's rows in this rank's slot of ``region``."""
        return self.r._peer[region][self.r.rank][self.par, :, : self.s].float().sum(0)

    def norm(self, h):
        m = self.r.model
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + m.eps) * self.w.post_norm.float()

    @staticmethod
    def padding(slots):
        return slots < 0

    def select(self, scores):
        """Expert choice: biased scores pick, un-biased scores weigh, renormalised."""
        idx = torch.topk(scores + self.w.router_bias.float(), self.r.model.top_k, dim=-1).indices
        wts = scores.gather(1, idx)
        return idx, wts / wts.sum(-1, keepdim=True)

    def route(self, x, pad):
        r = self.r
        idx, wts = self.select(torch.sigmoid(x @ self.w.router.float().T))
        order = idx.sort(-1)
        r.view(self.s, "route").copy_(order.values.masked_fill(pad[:, None], -1))
        r.view(self.s, "route_w").copy_(wts.gather(1, order.indices).masked_fill(pad[:, None], 0))
        return idx, wts

    def experts(self, x, idx, wts, pad):
        r, w = self.r, self.w
        y = torch.zeros_like(x)
        if r.experts is Experts.NONE:
            return y
        n = r.model.experts_per_rank(r.tp, r.experts)
        first = getattr(w, "first_expert", 0) if r.experts is Experts.LOCAL else 0
        half = w.w13.shape[1] // 2
        for e in torch.unique(idx[~pad]).tolist():
            le = e - first
            if not 0 <= le < n:
                continue  # another rank's expert (LOCAL)
            rows, k = torch.nonzero((idx == e) & ~pad[:, None], as_tuple=True)
            w13, w2 = r.expert(w, le)
            gu = x[rows] @ w13.T
            a = F.silu(gu[:, :half]) * gu[:, half:]
            y.index_add_(0, rows, (a @ w2.T) * wts[rows, k, None])
        return y

    # ---- protocol ----------------------------------------------------------------------------
    def exchange(self, phase: Phase, region: str | None, rows) -> None:
        """Push this rank's rows into every peer's slot, publish, wait for every peer."""
        r, p = self.r, phase.name.lower()
        for c, cols in enumerate(self.cols()):
            if region is not None:
                for dst in range(r.tp):
                    r._peer[region][dst][self.par, r.rank, : self.s, cols] = rows[:, cols]
            val = -self.e if self.faulted else self.e
            for dst in range(r.tp):
                r._peer["flags"][dst][phase, c, r.rank] = val
            self.stamp(f"{p}_arrive", c)
        self.wait(phase)

    def wait(self, phase: Phase) -> None:
        r, p = self.r, phase.name.lower()
        flags = r._peer["flags"][r.rank][phase]
        t0 = time.monotonic_ns()
        deadline = self.deadline(t0)
        for c in range(r.BLOCKS):
            for src in range(r.tp):
                if self.faulted:
                    break  # after a fault no wait is entered again; the span still ends here
                spins = 0
                while True:
                    v = int(flags[c, src])
                    if self.matches(v, self.e):
                        self.stamp(f"{p}_seen{src}", c)
                        break
                    if v == -self.e:  # src faulted: take its word for who is missing
                        box = r._peer["fault_box"][r.rank][src].tolist()
                        mask = box[1] if box[0] == self.e else 1 << src
                        self.record(phase, c, mask, time.monotonic_ns() - t0)
                        break
                    now = time.monotonic_ns()
                    if now > deadline:
                        mask = sum(1 << q for q in range(r.tp) if not self.matches(int(flags[c, q]), self.e))
                        self.record(phase, c, mask, now - t0)
                        break
                    spins += 1
                    time.sleep(0 if spins < 50 else min(1e-3, 1e-5 * 2 ** min(spins - 50, 7)))
            self.stamp(f"{p}_done", c)

    def record(self, phase: Phase, c: int, mask: int, waited: int) -> None:
        r = self.r
        self.faulted = True
        vals = dict(valid=1, epoch=self.e, phase=int(phase), rank=r.rank, missing_mask=mask,
                    waited_ns=waited, cta=c, at_ns=time.monotonic_ns())
        self.fault.copy_(torch.tensor([vals[f] for f in FAULT_FIELDS], dtype=torch.int64))
        note = torch.tensor([self.e, mask, int(phase), waited], dtype=torch.int64)
        for dst in range(r.tp):  # before any negative flag, so a peer that sees one finds this
            r._peer["fault_box"][dst][r.rank].copy_(note)


CpuRunner.step_cls = CpuStep
