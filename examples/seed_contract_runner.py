"""A runner written to the original design's contract alone: it imports torch, not ffnq.

    FfnRunner(tp, rank, sym, peers, device, widths=tuple(range(1, MAX_TOKENS + 1)),
              experts=Experts.ALL, timeline=False, epoch=None, **build)
    .warm(weights, compute_units=None)   .reset()   .region(width, name)   .inject   .residency
    (out, res_out) = runner(part, residual, weights, slots, final=False)

It is what a team whose kernel was written to that contract has: a class with these members
and module constants (MAX_TOKENS, TOP_K, BLOCKS, THREADS, EPOCH_WORDS, Experts, FfnBuild,
kernel_name, scratch_layout), no base class. ffnq qualifies it by import path, unchanged:

    PYTHONPATH=. ffnq qualify --runner examples.seed_contract_runner:FfnRunner --tp 2 --inject-rank all

ffnq opens the peer buffers (``sym``, ``peers``: addresses in this process, shared memory on a
cpu host) and the epoch the runners on one buffer share, and reads what this contract exposes:
the outputs, ``epoch``, ``inject``, and the scratch regions ``fault``, ``route``, ``route_w``
and ``timeline`` through ``region``. Where a runner names them otherwise, ``FFNQ_RUNNER_MAP``
maps them (``fault=fault_rec,route=picks``); one it lacks is reported "not checked".

The "kernel" here is a port of the fused step in torch CPU code (the math and the protocol of
ffnq's cpu backend, written again): BLOCKS virtual CTAs each push a column chunk of the seam and
reduce rows into every peer's buffer and raise their own flag, which carries the epoch; every
wait matches the epoch exactly and ends at ``timeout_ns``, writing the fault record.
"""
from __future__ import annotations

import ctypes
import time
import weakref
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

MAX_TOKENS = 16
TOP_K = 8
BLOCK = 128  # FP8 scale block (128 x 128)
EPS = 1e-6  # post-attention RMSNorm
BLOCKS = 4  # virtual CTAs of the persistent grid
THREADS = 1
EPOCH_WORDS = 4
PHASES = ("seam", "reduce", "handshake")
# the fault record a late wait leaves in scratch "fault" (int64 each)
FAULT_FIELDS = ("valid", "epoch", "phase", "rank", "missing_mask", "waited_ns", "cta", "at_ns")
ALIGN = 128


class Experts(Enum):
    ALL = "all"  # every expert, intermediate dim sharded over TP
    LOCAL = "local"  # expert parallel: this rank's whole experts
    NONE = "none"  # seam + router + reduce only


@dataclass(frozen=True)
class FfnBuild:
    tokens: int
    tp: int
    experts: Experts = Experts.ALL
    timeline: bool = False
    timeout_ns: int = 1_000_000_000  # bound on every wait


def kernel_name(key: FfnBuild) -> str:
    return f"seed_ffn_s{key.tokens}_tp{key.tp}_{key.experts.value}" + ("_tl" if key.timeline else "")


def stamp_names(tp: int) -> list[str]:
    """Timeline columns per CTA (ns): each phase's arrival, each peer's flag seen, its end."""
    names = ["start"]
    for p in PHASES:
        names += [f"{p}_arrive"] + [f"{p}_seen{r}" for r in range(tp)] + [f"{p}_done"]
        if p == "seam":
            names += ["router_done", "experts_done"]
    return names + ["end"]


def _layout(items) -> dict[str, tuple[int, int, torch.dtype, tuple]]:
    out, off = {}, 0
    for name, dtype, shape in items:
        n = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        out[name] = (off, n, dtype, shape)
        off += -(-n // ALIGN) * ALIGN
    return out


def scratch_layout(s: int, tp: int) -> dict[str, tuple[int, int]]:
    """name -> (offset, nbytes) of one width's scratch."""
    return {k: v[:2] for k, v in _scratch(s, tp).items()}


def _scratch(s: int, tp: int):
    return _layout([("fault", torch.int64, (len(FAULT_FIELDS),)),
                    ("timeline", torch.int64, (BLOCKS, len(stamp_names(tp)))),
                    ("route", torch.int32, (s, TOP_K)), ("route_w", torch.float32, (s, TOP_K))])


def scratch_bytes(s: int, tp: int) -> int:
    off, n, *_ = max(_scratch(s, tp).values())
    return -(-(off + n) // ALIGN) * ALIGN


def _peer(tp: int, hidden: int):
    """This runner's own peer-buffer layout (ffnq never reads it): flags [phase][cta][src] holding
    the epoch a source arrived at (negative: it faulted), a faulted source's note per peer, and
    the pushed rows, double-buffered by the epoch's parity."""
    rows = (2, tp, MAX_TOKENS, hidden)
    return _layout([("flags", torch.int32, (len(PHASES), BLOCKS, tp)), ("box", torch.int64, (tp, 2)),
                    ("seam", torch.bfloat16, rows), ("moe", torch.bfloat16, rows)])


def _at(address: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def _view(buf: torch.Tensor, entry) -> torch.Tensor:
    off, n, dtype, shape = entry
    return buf[off: off + n].view(dtype).view(shape)


def _dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Blockwise q * scale (scale is the dequant multiplier of each 128 x 128 block)."""
    R, C = q.shape
    return (q.float().view(R // BLOCK, BLOCK, C // BLOCK, BLOCK) * scale.float()[:, None, :, None]).view(R, C)


class FfnRunner:
    """``sym``: this rank's peer buffer; ``peers``: every rank's (int64 addresses). Runners on
    one peer buffer must share ``epoch``: a tag repeated over the buffer's life could match a
    stale pair."""

    def __init__(self, tp: int, rank: int, sym: int, peers: torch.Tensor, device: torch.device,
                 widths: tuple[int, ...] = tuple(range(1, MAX_TOKENS + 1)), experts: Experts = Experts.ALL,
                 timeline: bool = False, epoch: torch.Tensor | None = None, **build) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"device {device}: this runner runs on cpu")
        self.tp, self.rank, self.sym, self.peers = tp, rank, sym, peers
        self.widths = tuple(widths)
        self.keys = {s: FfnBuild(tokens=s, tp=tp, experts=experts, timeline=timeline, **build) for s in self.widths}
        self.epoch = torch.zeros(EPOCH_WORDS, dtype=torch.int32) if epoch is None else epoch
        # fault injection (qualification): [rank + 1, delay ns], 0 = off
        self.inject = torch.zeros(2, dtype=torch.int32)
        self.scratch = {s: torch.zeros(scratch_bytes(s, tp), dtype=torch.uint8) for s in self.widths}
        self.residency: dict[int, int] = {}  # no occupancy query on a cpu
        self._cols = None
        self._deq: dict = {}  # (ids of w13, s13, w2, s2; expert) -> (weakrefs, versions, (w13, w2) fp32)

    def _map_peers(self, hidden: int) -> None:
        lay = _peer(self.tp, hidden)
        nbytes = max(off + n for off, n, *_ in lay.values())
        self._p = {name: [_view(_at(int(a), nbytes), lay[name]) for a in self.peers.tolist()] for name in lay}
        self._cols = [slice(c * hidden // BLOCKS, (c + 1) * hidden // BLOCKS) for c in range(BLOCKS)]

    def warm(self, weights, compute_units: int | None = None) -> None:
        """Map the peer buffers and dequantize every local expert once."""
        self._map_peers(weights.post_norm.shape[0])
        for e in range(weights.w13.shape[0]):
            self._expert(weights, e)

    def region(self, s: int, name: str) -> torch.Tensor:
        off, nbytes = scratch_layout(s, self.tp)[name]
        return self.scratch[s][off: off + nbytes]

    def reset(self) -> None:
        """Every width's scratch, this rank's flags and notes, and the epoch cleared (no launch
        in flight)."""
        for buf in self.scratch.values():
            buf.zero_()
        if self._cols is not None:
            self._p["flags"][self.rank].zero_()
            self._p["box"][self.rank].zero_()
        self.epoch.zero_()

    def __call__(self, part, residual, weights, slots, final: bool = False):
        """``part``: this rank's unreduced o_proj output; ``slots``: int64, a negative slot is a
        padding row (runs the seam, joins no expert, MoE output 0). Returns (out, res_out)."""
        s = part.shape[0]
        assert part.is_contiguous() and residual.is_contiguous()
        assert slots.dtype == torch.int64 and slots.numel() >= s
        return _Step(self, s, weights).run(part, residual, slots[:s], final)

    def _expert(self, w, e: int):
        ts = (w.w13, w.s13, w.w2, w.s2)
        key, versions = (*map(id, ts), e), tuple(t._version for t in ts)
        hit = self._deq.get(key)
        if hit and all(r() is t for r, t in zip(hit[0], ts)) and hit[1] == versions:
            return hit[2]
        self._deq = {k: v for k, v in self._deq.items() if all(r() is not None for r in v[0])}
        val = _dequant(w.w13[e], w.s13[e]), _dequant(w.w2[e], w.s2[e])
        self._deq[key] = (tuple(weakref.ref(t) for t in ts), versions, val)
        return val


class _Step:
    """One launch on one rank, phase by phase."""

    def __init__(self, r: FfnRunner, s: int, w):
        self.r, self.s, self.w = r, s, w
        e = int(r.epoch[0])
        self.e = 1 if e >= 2**31 - 1 or e < 0 else e + 1  # 0 is the cleared value, never a live tag
        self.par, self.key = self.e & 1, r.keys[s]
        lay = _scratch(s, r.tp)
        self.fault = _view(r.scratch[s], lay["fault"])
        self.fault.zero_()
        self.tl = _view(r.scratch[s], lay["timeline"]) if self.key.timeline else None
        if self.tl is not None:
            self.tl.zero_()
        self.route, self.route_w = _view(r.scratch[s], lay["route"]), _view(r.scratch[s], lay["route_w"])
        self.stamps = {n: i for i, n in enumerate(stamp_names(r.tp))}
        self.faulted = False

    def stamp(self, name: str, c: int | None = None) -> None:
        if self.tl is not None:
            self.tl[slice(None) if c is None else c, self.stamps[name]] = time.monotonic_ns()

    def run(self, part, residual, slots, final):
        r, w = self.r, self.w
        self.stamp("start")
        who, delay = r.inject.tolist()
        if who == r.rank + 1 and delay > 0:
            time.sleep(delay / 1e9)
        self.exchange(0, "seam", part)
        h = residual.float() + self.gather("seam")
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w.post_norm.float()
        pad = slots < 0
        scores = torch.sigmoid(x @ w.router.float().T)
        idx = torch.topk(scores + w.router_bias.float(), TOP_K, dim=-1).indices  # the bias only selects
        wts = scores.gather(1, idx)
        wts = wts / wts.sum(-1, keepdim=True)
        order = idx.sort(-1)
        self.route.copy_(order.values.masked_fill(pad[:, None], -1))
        self.route_w.copy_(wts.gather(1, order.indices).masked_fill(pad[:, None], 0))
        self.stamp("router_done")
        y = self.experts(x, idx, wts, pad)
        self.stamp("experts_done")
        self.exchange(1, "moe", y.to(torch.bfloat16))
        out = self.gather("moe").to(torch.bfloat16)
        if final:
            self.exchange(2, None, None)
        self.stamp("end")
        r.epoch[0] = self.e
        return out, h.to(torch.bfloat16)

    def experts(self, x, idx, wts, pad):
        r, w, mode = self.r, self.w, self.key.experts
        y = torch.zeros_like(x)
        if mode is Experts.NONE:
            return y
        first, n = getattr(w, "first_expert", 0) if mode is Experts.LOCAL else 0, w.w13.shape[0]
        half = w.w13.shape[1] // 2
        for e in torch.unique(idx[~pad]).tolist():
            if not 0 <= e - first < n:
                continue  # another rank's expert (LOCAL)
            rows, k = torch.nonzero((idx == e) & ~pad[:, None], as_tuple=True)
            w13, w2 = r._expert(w, e - first)
            gu = x[rows] @ w13.T
            y.index_add_(0, rows, ((F.silu(gu[:, :half]) * gu[:, half:]) @ w2.T) * wts[rows, k, None])
        return y

    def gather(self, region: str) -> torch.Tensor:
        return self.r._p[region][self.r.rank][self.par, :, : self.s].float().sum(0)

    def exchange(self, phase: int, region: str | None, rows) -> None:
        r, p = self.r, PHASES[phase]
        for c, cols in enumerate(r._cols):
            if region is not None:
                for dst in range(r.tp):
                    r._p[region][dst][self.par, r.rank, : self.s, cols] = rows[:, cols]
            for dst in range(r.tp):  # x86 keeps stores in order: the rows land before the flag
                r._p["flags"][dst][phase, c, r.rank] = -self.e if self.faulted else self.e
            self.stamp(f"{p}_arrive", c)
        self.wait(phase)

    def wait(self, phase: int) -> None:
        r, p = self.r, PHASES[phase]
        flags = r._p["flags"][r.rank][phase]
        t0 = time.monotonic_ns()
        for c in range(BLOCKS):
            for src in range(r.tp):
                spins = 0
                while not self.faulted:
                    v = int(flags[c, src])
                    if v == self.e:
                        self.stamp(f"{p}_seen{src}", c)
                        break
                    if v == -self.e:  # src faulted this epoch: its note says who was missing
                        box = r._p["box"][r.rank][src].tolist()
                        self.record(phase, c, box[1] if box[0] == self.e else 1 << src, time.monotonic_ns() - t0)
                        break
                    if time.monotonic_ns() - t0 > self.key.timeout_ns:
                        mask = sum(1 << q for q in range(r.tp) if int(flags[c, q]) != self.e)
                        self.record(phase, c, mask, time.monotonic_ns() - t0)
                        break
                    spins += 1
                    time.sleep(0 if spins < 50 else min(1e-3, 1e-5 * 2 ** min(spins - 50, 7)))
            self.stamp(f"{p}_done", c)

    def record(self, phase: int, c: int, mask: int, waited: int) -> None:
        r = self.r
        self.faulted = True
        vals = dict(valid=1, epoch=self.e, phase=phase, rank=r.rank, missing_mask=mask, waited_ns=waited, cta=c,
                    at_ns=time.monotonic_ns())
        self.fault.copy_(torch.tensor([vals[f] for f in FAULT_FIELDS], dtype=torch.int64))
        for dst in range(r.tp):  # the note first: a peer that sees the negative flag finds it
            r._p["box"][dst][r.rank].copy_(torch.tensor([self.e, mask], dtype=torch.int64))
