"""The runner contract every backend and plug-in obeys, the backend registry, plug-in loading.

    Runner(tp, rank, sym, peers, device, widths=range(1, MAX_TOKENS + 1), experts=Experts.ALL,
           timeline=False, epoch=None, *, model=..., timeout=1.0, **build)

``sym`` is this rank's peer buffer (an address), ``peers`` every rank's (int64 addresses on the
runner's device). A job makes both with ``Runner.open_peers`` (collective), which also owns
their lifetime. Widths are row counts 1..model.max_tokens; each gets one compiled kernel and
one scratch buffer. Runners built on one peer buffer share its epoch word unless given another
``epoch``: a flag value repeated during the buffer's life could match a stale pair.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch

from ffnq.dist import PeerBuffer  # part of the runner contract: backends and plug-ins take it from here
from ffnq.errors import UsageError
from ffnq.spec import (EPOCH_WORDS, Experts, FfnBuild, ModelSpec, Region, decode_fault, layout_bytes,
                       load_model, peer_layout, scratch_layout, view)

BACKENDS = {
    "cpu": "ffnq.backends.cpu:CpuRunner",
    "triton": "ffnq.backends.triton:TritonRunner",
    "flydsl": "ffnq.backends.flydsl:FlydslRunner",
}


class NotReadable(LookupError):
    """A region a check reads that this runner does not expose (or not in ffnq's format): the
    check is reported as not checked, never as passed."""


class Runner:
    backend = "base"
    DIST_BACKEND = "gloo"  # the process group the job opens for this runner
    BLOCKS = 1  # CTAs of the persistent grid
    THREADS = 1  # threads per CTA
    EPOCH_WORDS = EPOCH_WORDS
    # set by the checks (qualify, bench's check, soak): each output element is NaN until the kernel
    # writes it, so an element it skips cannot pass on what the caching allocator handed back
    poison_outputs = False
    # finer stamps than the timeline's phase boundaries, where a timeline build writes them: (the
    # scratch region, {its column: a name}); bench --phases reads them beside the timeline
    PHASE_STAMPS: tuple[str, dict[int, str]] | None = None

    def __init__(self, tp: int, rank: int, sym: int, peers: torch.Tensor, device: torch.device | str,
                 widths=None, experts: Experts | str = Experts.ALL, timeline: bool = False,
                 epoch: torch.Tensor | None = None, *, model: ModelSpec | str = "tiny",
                 timeout: float = 1.0, **build: Any) -> None:
        self.model = load_model(model) if isinstance(model, str) else model
        experts = Experts(experts)
        if not 0 <= rank < tp:
            raise UsageError(f"rank {rank}: allowed 0..{tp - 1} at tp={tp}")
        if not timeout > 0:
            raise UsageError(f"timeout {timeout} s: must be > 0")
        if len(peers) != tp:
            raise UsageError(f"peers has {len(peers)} addresses, tp={tp} needs one per rank")
        self.tp, self.rank, self.sym, self.peers = tp, rank, int(sym), peers
        self.device = torch.device(device)
        self.accept_device(self.device)
        self.widths = tuple(range(1, self.model.max_tokens + 1)) if widths is None else tuple(widths)
        bad = [s for s in self.widths if not 1 <= s <= self.model.max_tokens]
        if bad or not self.widths:
            raise UsageError(f"widths {bad or '[]'}: allowed 1..{self.model.max_tokens} for {self.model.name}")
        self.experts, self.timeline, self.timeout = experts, bool(timeline), float(timeout)
        flags = self.flag_blocks()  # one peer buffer for every width: its flags are in each build
        self.keys = {s: FfnBuild(tokens=s, tp=tp, experts=experts, timeline=self.timeline, model=self.model,
                                 timeout_ns=int(self.timeout * 1e9), blocks=self.blocks_for(s, self.model, tp),
                                 flag_blocks=flags, **build)
                     for s in self.widths}
        self.layouts = {s: scratch_layout(k, self.scratch_extra(k)) for s, k in self.keys.items()}
        self.peer_regions = peer_layout(self.model, tp, flags)
        self.scratch = {s: torch.zeros(layout_bytes(lay), dtype=torch.uint8, device=self.device)
                        for s, lay in self.layouts.items()}
        self.own = self.peer_view(self.sym)  # uint8 view of this rank's peer buffer
        self.epoch = view(self.own, self.peer_regions["epoch"]) if epoch is None else epoch
        # fault injection: [rank + 1, delay ns], 0 = off
        self.inject = torch.zeros(2, dtype=torch.int32, device=self.device)
        self.residency: dict[int, int] = {}

    # ---- what a backend provides --------------------------------------------------------------
    @classmethod
    def default_device(cls, local_rank: int) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def check_build(cls) -> None:
        """Before any rank starts: refuse (ValueError, one line) a build setting that every rank
        would refuse, e.g. a malformed override in the environment."""

    @classmethod
    def for_device(cls, device: torch.device) -> type[Runner]:
        """This runner as it runs on ``device`` (a backend whose grid follows the device's
        compute units returns a subclass with that grid); the job asks before anything is built."""
        return cls

    @classmethod
    def blocks_for(cls, width: int, model: ModelSpec | None = None, tp: int = 1, hip: bool | None = None) -> int:
        """The grid of a width's kernel (<= flag_blocks(), which sizes the peer buffer's flags);
        ``model``/``tp``: a backend may pick it per build, ``hip``: for that target (None: this host)."""
        return cls.BLOCKS

    @classmethod
    def flag_blocks(cls) -> int:
        """The largest grid of any width: the peer buffer's flags hold one slot per CTA of it."""
        return cls.BLOCKS

    @classmethod
    def peer_bytes(cls, model: ModelSpec, tp: int) -> int:
        return layout_bytes(peer_layout(model, tp, cls.flag_blocks()))

    @classmethod
    def open_peers(cls, model: ModelSpec, tp: int, rank: int, device: torch.device, tag: str) -> PeerBuffer:
        """Collective over the default process group: allocate and exchange peer buffers."""
        raise NotImplementedError

    def peer_view(self, address: int) -> torch.Tensor:
        """A uint8 tensor over a peer buffer at ``address`` (as mapped here)."""
        raise NotImplementedError

    def accept_device(self, device: torch.device) -> None:
        """Raise UsageError for a device this backend cannot run on."""

    def scratch_extra(self, key: FfnBuild) -> list:
        return []

    def warm(self, weights, compute_units: int | None = None) -> None:
        raise NotImplementedError

    def __call__(self, part: torch.Tensor, residual: torch.Tensor, weights, slots: torch.Tensor,
                 final: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def reset(self) -> None:
        """Collective: every width's scratch, this rank's flags and fault box, and the epoch
        cleared, with no launch in flight anywhere before or after."""
        from ffnq.dist import barrier

        def sync():
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        sync()
        barrier()
        for buf in self.scratch.values():
            buf.zero_()
        for name in ("flags", "fault_box", "seam_ll", "moe_ll"):  # every tag a wait could take
            view(self.own, self.peer_regions[name]).zero_()
        self.epoch.zero_()
        sync()
        barrier()  # nobody starts a step on a half-cleared peer

    def describe(self, width: int) -> dict:
        """Per-width facts for warm's table (compile seconds, registers, ...)."""
        return {}

    def clock_ns(self) -> int:
        """Now on the clock that timeline stamps use (for cross-rank offsets)."""
        import time
        return time.monotonic_ns()

    # ---- shared ------------------------------------------------------------------------------
    def region(self, width: int, name: str) -> torch.Tensor:
        """Raw bytes of a named region: the width's scratch, else this rank's peer buffer."""
        r = self._region(width, name)
        buf = self.scratch[width] if name in self.layouts[width] else self.own
        return buf[r.offset: r.offset + r.nbytes]

    def view(self, width: int, name: str) -> torch.Tensor:
        """The same region, typed and shaped."""
        r = self._region(width, name)
        return view(self.scratch[width] if name in self.layouts[width] else self.own, r)

    def chosen(self, width: int) -> torch.Tensor:
        """The experts the kernel chose in its last step of this width, [s, k] int64 (-1 on a
        padding row): what the checks follow on a near tie and compare with the oracle."""
        return self.view(width, "route").long()

    def new_outputs(self, part: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's (out, res_out) for a kernel to write: NaN-filled under ``poison_outputs``."""
        if self.poison_outputs:
            return torch.full_like(part, float("nan")), torch.full_like(residual, float("nan"))
        return torch.empty_like(part), torch.empty_like(residual)

    def chosen_weights(self, width: int) -> torch.Tensor:
        """The routing weights of ``chosen``'s experts in its order, [s, k] fp32 (0 on a padding row)."""
        return self.view(width, "route_w").float()

    def _region(self, width: int, name: str) -> Region:
        if width not in self.layouts:
            raise UsageError(f"width {width}: this runner has widths {list(self.widths)}")
        r = self.layouts[width].get(name) or self.peer_regions.get(name)
        if r is None:
            known = sorted(self.layouts[width]) + sorted(self.peer_regions)
            raise UsageError(f"region {name!r}: known regions {', '.join(known)}")
        return r

    def fault(self, width: int) -> dict | None:
        """The last launch's fault record at this width (None when every wait was met)."""
        return decode_fault(self.view(width, "fault"), self.tp)

    def readable(self, name: str, width: int | None = None) -> bool:
        """Whether a check can read region ``name`` (ffnq's runners expose every one; a runner of
        the original contract only those it names): a check that cannot is "not checked"."""
        try:
            self.region(self.widths[0] if width is None else width, name)
            return True
        except NotReadable:
            return False

    def check_inputs(self, part, residual, slots) -> int:
        s = part.shape[0] if part.dim() == 2 else -1
        H = self.model.hidden
        if s not in self.scratch:
            raise UsageError(f"width {s}: this runner has widths {list(self.widths)}")
        for name, t in (("part", part), ("residual", residual)):
            if tuple(t.shape) != (s, H) or t.dtype != torch.bfloat16 or not t.is_contiguous():
                raise UsageError(f"{name}: {tuple(t.shape)} {t.dtype}; need contiguous ({s}, {H}) bfloat16")
        if slots.dtype != torch.int64 or slots.numel() < s or not slots.is_contiguous():
            raise UsageError(f"slots: {slots.dtype} with {slots.numel()} elements; need contiguous int64 >= {s}")
        return s


def load_runner(name: str) -> type[Runner]:
    """A backend name (cpu, triton, flydsl) or a plug-in ``package.module:Class``."""
    target = BACKENDS.get(name, name)
    if ":" not in target:
        raise UsageError(f"runner {name!r}: not a backend ({', '.join(BACKENDS)}) nor package.module:Class")
    mod, _, cls = target.partition(":")
    try:
        module = importlib.import_module(mod)
    except ImportError as e:
        raise UsageError(f"runner {name!r}: cannot import {mod} ({e}); put its package on PYTHONPATH") from None
    except Exception as e:  # noqa: BLE001 - a syntax error or a raise in the user's module is bad input here
        raise UsageError(f"runner {name!r}: importing {mod} failed: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}; fix the module and retry") from None
    obj = getattr(module, cls, None)
    if obj is None:
        raise UsageError(f"runner {name!r}: {mod} has no {cls}") from None
    if isinstance(obj, type) and issubclass(obj, Runner):
        return obj
    if isinstance(obj, type) and all(callable(getattr(obj, m, None)) for m in ("warm", "reset", "__call__")):
        return seed_runner(obj, module)  # a class of the original contract: ffnq adapts it
    raise UsageError(f"runner {name!r}: {target} is not a runner class (a subclass of ffnq.runner.Runner, or a "
                     "class of the original contract with warm, reset and __call__)")


# ---- runners of the original design's contract ---------------------------------------------------

MAP_ENV = "FFNQ_RUNNER_MAP"
SEED_REGIONS = ("fault", "route", "route_w", "timeline")  # what the checks read from a runner's scratch


def runner_map(text: str | None = None) -> dict:
    """FFNQ_RUNNER_MAP, e.g. "fault=fault_rec,route=,device=cpu,peer_bytes=8388608": for each
    scratch region a check reads, the runner's own name for it (empty: it has none); the device
    its ranks use (cpu or cuda; default cuda where a GPU is); the bytes of each peer buffer
    (default ffnq's own peer layout, a superset of what the protocol needs)."""
    import os

    text = os.environ.get(MAP_ENV, "") if text is None else text
    out: dict = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or key not in (*SEED_REGIONS, "device", "peer_bytes"):
            raise UsageError(f"{MAP_ENV} item {item!r}: need KEY=VALUE with KEY one of {', '.join(SEED_REGIONS)}, "
                             "device, peer_bytes")
        if key == "device" and value not in ("cpu", "cuda"):
            raise UsageError(f"{MAP_ENV} device={value!r}: allowed cpu or cuda")
        if key == "peer_bytes" and not (value.isdigit() and int(value) > 0):
            raise UsageError(f"{MAP_ENV} peer_bytes={value!r}: need a byte count > 0")
        out[key] = int(value) if key == "peer_bytes" else value
    return out


def seed_runner(cls: type, module) -> type[Runner]:
    """``cls`` (a class of the original contract, in ``module``) as an ffnq Runner: ffnq opens
    the peer buffers and their shared epoch, builds ``cls`` unchanged and reads what it exposes."""
    names = runner_map()
    cuda = names.get("device", "cuda" if torch.cuda.is_available() else "cpu") == "cuda"
    attrs = {"inner_cls": cls, "module": module, "names": names, "on_cuda": cuda,
             "backend": f"{module.__name__}:{cls.__name__}",
             "DIST_BACKEND": "cpu:gloo,cuda:nccl" if cuda else "gloo",
             **{k: getattr(module, k) for k in ("BLOCKS", "THREADS") if isinstance(getattr(module, k, None), int)}}
    return type(f"Seed{cls.__name__}", (SeedRunner,), attrs)


class SeedRunner(Runner):
    """The adapter ``seed_runner`` makes a class of: jobs see a Runner, ``inner`` is the user's
    runner, constructed as ``(tp, rank, sym, peers, device, widths, experts, timeline, epoch,
    **build)``. ffnq reads only what that contract exposes: outputs, ``epoch``, ``inject``,
    ``residency`` and the scratch regions ``region(width, name)`` names (through FFNQ_RUNNER_MAP),
    viewed in ffnq's formats (spec.scratch_layout); a region it lacks, or of another size, raises
    NotReadable, and the check that reads it says "not checked". Its peer-buffer layout is its own,
    so nothing of it is read or written (no poisoned rows, no planted stale flags)."""

    inner_cls: type = object
    module = None
    names: dict = {}
    on_cuda = False
    _EPOCHS: dict[int, torch.Tensor] = {}  # peer buffer (sym) -> the epoch its runners share

    @classmethod
    def default_device(cls, local_rank: int) -> torch.device:
        return torch.device(f"cuda:{local_rank}") if cls.on_cuda else torch.device("cpu")

    @classmethod
    def peer_bytes(cls, model: ModelSpec, tp: int) -> int:
        return cls.names.get("peer_bytes") or layout_bytes(peer_layout(model, tp, cls.flag_blocks()))

    @classmethod
    def open_peers(cls, model: ModelSpec, tp: int, rank: int, device, tag: str) -> PeerBuffer:
        nbytes = cls.peer_bytes(model, tp)
        if torch.device(device).type == "cpu":
            from ffnq.dist import ShmPeers

            shm = ShmPeers(tag, rank, tp, nbytes)
            pb = PeerBuffer(shm.addresses[rank], torch.tensor(shm.addresses, dtype=torch.int64), nbytes,
                            close=shm.close, keep=[shm])
        else:
            from ffnq import symm

            pb = symm.open_peers(nbytes, tp, rank, device)
        # the original design: "runners on one peer buffer must share epoch"; ffnq holds it
        words = getattr(cls.module, "EPOCH_WORDS", EPOCH_WORDS)
        cls._EPOCHS[pb.sym] = torch.zeros(words, dtype=torch.int32, device=device)
        close = pb.close

        def release() -> None:
            cls._EPOCHS.pop(pb.sym, None)
            close()
        pb.close = release
        return pb

    def __init__(self, tp: int, rank: int, sym: int, peers: torch.Tensor, device, widths=None,
                 experts: Experts | str = Experts.ALL, timeline: bool = False, epoch: torch.Tensor | None = None,
                 *, model: ModelSpec | str = "tiny", timeout: float = 1.0, **build: Any) -> None:
        self.model = load_model(model) if isinstance(model, str) else model
        experts = Experts(experts)
        if not 0 <= rank < tp or len(peers) != tp or not timeout > 0:
            raise UsageError(f"rank {rank}, {len(peers)} peers, timeout {timeout}: need 0 <= rank < tp={tp}, one "
                             "peer per rank, timeout > 0")
        self.tp, self.rank, self.sym, self.peers = tp, rank, int(sym), peers
        self.device = torch.device(device)
        self.widths = tuple(range(1, self.model.max_tokens + 1)) if widths is None else tuple(widths)
        self.experts, self.timeline, self.timeout = experts, bool(timeline), float(timeout)
        self._check_model()
        # ffnq's own build keys: they give the formats the regions are read in, nothing is built
        self.keys = {s: FfnBuild(tokens=s, tp=tp, experts=experts, timeline=self.timeline, model=self.model,
                                 timeout_ns=int(self.timeout * 1e9), blocks=self.BLOCKS, flag_blocks=self.BLOCKS)
                     for s in self.widths}
        self.layouts = {s: scratch_layout(k) for s, k in self.keys.items()}
        # ffnq's peer layout names the regions of its own runners' peer buffers: never read here
        self.peer_regions = peer_layout(self.model, tp, self.BLOCKS)
        self.scratch, self.own = dict.fromkeys(self.widths), None
        shared = epoch if epoch is not None else self._EPOCHS.get(self.sym)
        kw = dict(build)
        key_fields = getattr(getattr(self.module, "FfnBuild", None), "__dataclass_fields__", {})
        if "timeout_ns" in key_fields:  # the kernel's bound on every wait, where its build key takes one
            kw.setdefault("timeout_ns", int(self.timeout * 1e9))
        self.inner = self.inner_cls(tp, rank, self.sym, peers, self.device, widths=self.widths,
                                    experts=self._their_experts(experts), timeline=self.timeline, epoch=shared, **kw)
        self.epoch, self.inject = self.inner.epoch, self.inner.inject

    def _check_model(self) -> None:
        """A runner of the original contract is built for one model: its constants must match."""
        m = self.model
        for const, have in (("HIDDEN", m.hidden), ("MAX_TOKENS", m.max_tokens), ("TOP_K", m.top_k)):
            want = getattr(self.module, const, None)
            if isinstance(want, int) and want != have:
                raise UsageError(f"--model {m.name}: {const.lower()} {have}, but {self.backend} is built for "
                                 f"{const} = {want}; pick the model it was built for")

    def _their_experts(self, experts: Experts):
        theirs = getattr(self.module, "Experts", None)
        if theirs is None:
            return experts
        for pick in (lambda: theirs[experts.name], lambda: theirs(experts.value)):
            try:
                return pick()
            except (KeyError, ValueError):
                continue
        raise UsageError(f"--experts {experts.value}: {self.backend} has no such mode (its Experts: "
                         f"{', '.join(e.name for e in theirs)})")

    @property
    def residency(self) -> dict:
        return getattr(self.inner, "residency", {})

    def warm(self, weights, compute_units: int | None = None) -> None:
        self.inner.warm(weights, compute_units)

    def __call__(self, part, residual, weights, slots, final=False):
        self.check_inputs(part, residual, slots)
        # its outputs are its own (torch.empty_like): ffnq cannot poison them before the launch
        return self.inner(part, residual, weights, slots, final=final)

    def reset(self) -> None:
        """The runner's own reset, made collective (no launch in flight on any rank before or after)."""
        from ffnq.dist import barrier

        def sync():
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        sync()
        barrier()
        self.inner.reset()
        sync()
        barrier()

    def describe(self, width: int) -> dict:
        name = getattr(self.module, "kernel_name", None)
        key = getattr(self.inner, "keys", {}).get(width)
        return {"kernel": name(key) if callable(name) and key is not None else f"{self.inner_cls.__name__}[{width}]",
                "grid": self.BLOCKS, "contract": "original"}

    def clock_ns(self) -> int:
        if self.device.type != "cuda":
            import time
            return time.monotonic_ns()
        # the GPU's global timer, as the kernels stamp it: the triton backend's clock kernel
        return load_runner("triton").global_timer_ns(self.device)

    def region(self, width: int, name: str) -> torch.Tensor:
        r = self._region(width, name)  # ffnq's format for it (UsageError: a name no check reads)
        theirs = self.names.get(name, name) if name in SEED_REGIONS else ""
        if not theirs:
            raise NotReadable(f"{name}: {self.backend} exposes no such region"
                              + ("" if name in SEED_REGIONS else " (its peer buffer's layout is its own)"))
        try:
            raw = self.inner.region(width, theirs)
        except Exception as e:  # noqa: BLE001 - whatever its region() says, the check cannot read it
            raise NotReadable(f"{name}: {self.backend}.region({width}, {theirs!r}) failed: {type(e).__name__}: {e}") \
                from None
        raw = raw.reshape(-1).view(torch.uint8) if isinstance(raw, torch.Tensor) else None
        if raw is None or raw.numel() != r.nbytes:
            raise NotReadable(f"{name}: {self.backend}.region({width}, {theirs!r}) is "
                              f"{'no tensor' if raw is None else f'{raw.numel()} bytes'}; ffnq reads {name} as "
                              f"{r.dtype} {list(r.shape)} ({r.nbytes} bytes)")
        return raw

    def view(self, width: int, name: str) -> torch.Tensor:
        r = self._region(width, name)
        return self.region(width, name).view(r.dtype).view(r.shape)
