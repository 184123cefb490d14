"""TritonRunner: the fused persistent kernel of kernel.py behind the ffnq runner contract.

One compiled kernel per width (TOKENS is a constexpr) and variant (FINAL), launched as a
cooperative grid of blocks_for(width) CTAs. Under TRITON_INTERPRET=1 (CPU) each step runs as one
launch per part (geometry.STAGES), since the interpreter runs CTAs one after another and grid
barriers would hang.

The first launch on a weights object's tensors prepares them: the stream is waited for once
(EARLY_WEIGHTS builds, SettledWeights) and w13 and w2 are packed into the layouts the two stages
read (PACKED_W13, PACKED_W2, PackedWeights: one more copy of each while the tensor lives, remade
after an in-place write; one w2 copy serves every width, W2_PACK_ROWS). So that first launch
must run eagerly, not inside a CUDA-graph capture (warm and the bench's timers do so).
"""
from __future__ import annotations

import os
import time
import weakref

import torch

from ffnq.backends.triton import geometry as G
from ffnq.backends.triton import kernel as K
from ffnq.backends.triton import tune
from ffnq.errors import UsageError
from ffnq import symm
from ffnq.runner import PeerBuffer, Runner
from ffnq.spec import Experts, ModelSpec, kernel_name


def _interp() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _owner(t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """The tensor object that owns t's memory (a view's base) and where in it t lies: a view made
    anew for each step (a layer's w13_all[layer]) is the same weights, not new ones, which keyed
    by the view object were settled or packed again on every launch (a w13 copy a step)."""
    base = t._base if t._base is not None else t
    return base, (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class SettledWeights:
    """Which weight tensors the stream has been waited for since they were made. An EARLY_WEIGHTS build reads
    router, post_norm and router_bias before its PDL wait, where the writes of the kernel just
    before it need not be visible yet; so the first launch on tensors not seen before waits for
    the stream. Held weakly, by the tensor that owns the memory (_owner): tensors freed and new
    ones at the same address count as new."""

    def __init__(self):
        # per set, per tensor: (weakref to the tensor object, weakref to its owner, where in it)
        self._refs: list[tuple] = []

    def first(self, tensors) -> bool:
        """True (and from now on seen) when these tensors (or views of the same owners at the same
        places) were not seen before."""
        # every launch asks: the tensor objects seen last time hit without _owner (~2 us of Python)
        if any(all(y() is t for (y, _, _), t in zip(r, tensors)) for r in self._refs):
            return False
        ids = [_owner(t) for t in tensors]
        if any(all(x() is o and at == where for (_, x, at), (o, where) in zip(r, ids)) for r in self._refs):
            return False
        # the sets whose tensors were freed go when a new one comes, not on every launch
        self._refs = [r for r in self._refs if all(x() is not None for _, x, _ in r)]
        self._refs.append(tuple((weakref.ref(t), weakref.ref(o), where) for t, (o, where) in zip(tensors, ids)))
        return True


def packed_w13(w13: torch.Tensor, bn: int) -> torch.Tensor:
    """(PACKED_W13) w13 [experts, 2 I, H] tile-packed as the kernel reads it: [experts, I / bn, H / 128,
    (gate, up), bn, 128], each K step's gate block and then its up block contiguous (as given, a
    K step of a tile reads 128 bytes of each of its 2 x bn rows, H bytes apart)."""
    ne, rows, h = w13.shape
    return w13.view(ne, 2, rows // 2 // bn, bn, h // 128, 128).permute(0, 2, 4, 1, 3, 5).reshape(ne, rows, h)


def packed_w2(w2: torch.Tensor, bh: int, bk: int) -> torch.Tensor:
    """(PACKED_W2) w2 [experts, H, I] tile-packed as stage 2 reads it: [experts, H / bh, I / bk, bh, bk],
    a stage-2 item's bh rows one contiguous bh x I bytes and each of its loop's steps one bh x bk
    block (as given, a step reads bk bytes of each of bh rows, I apart)."""
    ne, h, i = w2.shape
    return w2.view(ne, h // bh, bh, i // bk, bk).permute(0, 1, 3, 2, 4).reshape(ne, h, i)


class PackedWeights:
    """(PACKED_W13, PACKED_W2) Each w13's (w2's) packed copy, made on its first launch and kept while
    the tensor that owns its memory lives (held weakly by that owner and the place in it, as
    SettledWeights: a freed tensor's address reused is new weights, a new view of the same weights
    is not; remade if the weights were written in place since, by their version count).
    Packing launches torch copies, so it must not happen while a CUDA graph is captured: a step
    run eagerly before the capture (as the bench and the runner's warm do) makes it."""

    def __init__(self):
        # (weakref to the weight's owner, where in it, bn, its version when packed, the packed copy)
        self._packed: list[tuple] = []

    def get(self, w: torch.Tensor, bn: int | tuple, pack=packed_w13) -> torch.Tensor:
        """``w`` as ``pack`` (packed_w13 or packed_w2, named packed_<weight>) lays it out for tile
        ``bn`` (a tuple: the pack's arguments after the tensor)."""
        owner, where = _owner(w)
        for ref, at, b, version, p in self._packed:  # by identity (a tensor's == is elementwise)
            if ref() is owner and at == where and b == bn and version == w._version:
                return p
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            name = pack.__name__.removeprefix("packed_")
            raise UsageError(f"weights: {name} is not packed for the Triton build (PACKED_{name.upper()}) yet; run one "
                             "step on them before capturing a CUDA graph")
        # the copies of freed tensors go when a new one is made, and so do the owner's copies of an
        # older version (its views share one version count) and the one this replaces
        self._packed = [e for e in self._packed if e[0]() is not None and not (
            e[0]() is owner and (e[3] != w._version or (e[1] == where and e[2] == bn)))]
        p = pack(w, *(bn if isinstance(bn, tuple) else (bn,)))
        self._packed.append((weakref.ref(owner), where, bn, w._version, p))
        return p


class TritonRunner(Runner):
    backend = "triton"
    # gloo for the jobs' cpu-tensor collectives (records, clock offsets, checksums), NCCL for
    # the baselines' device all-reduce
    DIST_BACKEND = "cpu:gloo,cuda:nccl"
    # 2 CTAs per SM on an H200 (255 registers x 128 threads, 90 KB of shared memory each): two
    # warp groups per SM stream weights. From 2 tokens 256 CTAs were 10-16% faster than 128, one
    # token 3.4% once its items were split in two K parts; 264, every slot of the H200's 132 SMs,
    # not 256: 0.4-4.4% faster at 14 of 16 widths. Resident on gfx942 and gfx950 too (ffnq warm
    # --target).
    BLOCKS = 264
    # on NVIDIA the grid is CTAS_PER_SM x the device's SMs (264 on an H200 or H100 SXM, 228 on an
    # H100 PCIe): every build fits two per SM (<= 255 registers x 128 threads, <= 98 KB of shared
    # memory), and a width whose build fits three and was measured faster so takes 3 x SMs
    # (CTAS_PER_SM in configs/triton-measured.toml). A class with a grid of its own (with_grid)
    # keeps it at every width. CDNA keeps BLOCKS (resident at 1 per CU on gfx942's 304 CUs,
    # offline; never run there).
    CTAS_PER_SM = 2
    # (PACKED_W13) one packed copy of each w13 per process, not per runner: the jobs run several
    # runners on the same weights (qualify's two runners, the timeline and inject runners)
    PACKED = PackedWeights()
    GRID_FROM_DEVICE = True
    # the kernel's stamps inside the router and the expert phases (kernel.py: _stamp(sub_row, column))
    PHASE_STAMPS = ("sub", {0: "router_start", 1: "router_logits", 10: "pick_arrive", 11: "topk_done",
                            2: "topk_start", 3: "stage1_done", 4: "stage2_start", 8: "stage2_first_go",
                            9: "stage2_first_done", 5: "stage2_done", 6: "sum_start", 7: "sum_waited"})
    MEASURED_GRID = True
    NUM_WARPS = G.NUM_WARPS
    THREADS = 128  # NUM_WARPS * 32 on NVIDIA (x64 lanes per wave on AMD)

    @classmethod
    def for_device(cls, device: torch.device) -> type[TritonRunner]:
        device = torch.device(device)
        if not cls.GRID_FROM_DEVICE or device.type != "cuda" or torch.version.hip is not None or _interp():
            return cls
        return cls.for_sms(torch.cuda.get_device_properties(device).multi_processor_count)

    @classmethod
    def for_sms(cls, sms: int) -> type[TritonRunner]:
        """This runner with the grid of an NVIDIA device of ``sms`` SMs."""
        blocks = cls.CTAS_PER_SM * int(sms)
        return cls if blocks == cls.BLOCKS else cls._grid_class(blocks, measured=True)

    @classmethod
    def blocks_for(cls, width: int, model: ModelSpec | None = None, tp: int = 1, hip: bool | None = None) -> int:
        # FFNQ_TRITON_TUNE="GRID@1=396": one width's grid, for development (3 CTAs per SM where that
        # build's registers and shared memory allow it; ffnq warm --target reads the same keys;
        # the grid barrier takes launches of any grids on one buffer)
        over = tune.read(width)
        grid = over.get("GRID")
        if grid:
            return grid
        hip = torch.version.hip is not None if hip is None else hip
        if model is None or hip or not cls.MEASURED_GRID:
            return cls.BLOCKS
        cps = over.get("CTAS_PER_SM", G.measured(model.name, tp, width).get("CTAS_PER_SM", cls.CTAS_PER_SM))
        return cls.BLOCKS // cls.CTAS_PER_SM * cps

    @classmethod
    def with_grid(cls, blocks: int | None) -> type[TritonRunner]:
        """This runner with ``blocks`` as every width's grid (development)."""
        return cls._grid_class(blocks, measured=False) if blocks else cls

    @classmethod
    def _grid_class(cls, blocks: int, measured: bool) -> type[TritonRunner]:
        return type(f"{cls.__name__}{blocks}", (cls,),
                    {"BLOCKS": blocks, "GRID_FROM_DEVICE": False, "MEASURED_GRID": measured})

    @classmethod
    def flag_blocks(cls) -> int:
        grids = tune.values("GRID")
        if cls.MEASURED_GRID:
            cps = max([G.most_measured("CTAS_PER_SM", cls.CTAS_PER_SM), *tune.values("CTAS_PER_SM")])
            grids.append(cls.BLOCKS // cls.CTAS_PER_SM * cps)
        return max([cls.BLOCKS, *grids])

    @classmethod
    def check_build(cls) -> None:
        tune.read()
        G.measured_table()

    @classmethod
    def default_device(cls, local_rank: int) -> torch.device:
        if _interp():
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise UsageError("--backend triton: needs a GPU and this host has none", use="--backend cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)

    # ---- peer buffers -----------------------------------------------------------------------
    @classmethod
    def open_peers(cls, model: ModelSpec, tp: int, rank: int, device, tag: str) -> PeerBuffer:
        return symm.open_peers(cls.peer_bytes(model, tp), tp, rank, device)

    def peer_view(self, address: int) -> torch.Tensor:
        return symm.view(address, self.peer_bytes(self.model, self.tp), "TritonRunner")

    # ---- contract ---------------------------------------------------------------------------
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_hip = torch.version.hip is not None
        self.interp = _interp()
        self.params = torch.tensor([self.keys[self.widths[0]].timeout_ns], dtype=torch.int64, device=self.device)
        # one compiled variant per (width, final): the handshake is a constexpr branch
        self._cx = {(s, f): G.constexprs(k, self.layouts[s], self.peer_regions, self.is_hip, self.interp, final=f)
                    for s, k in self.keys.items() for f in (False, True)}
        # launch options once per build, not per launch (R<width> parses FFNQ_TRITON_TUNE)
        self._opts = {sf: G.launch_options(cx, self.keys[sf[0]]) for sf, cx in self._cx.items()}
        self._info: dict[int, dict] = {}
        self._dummy = {}
        self._settled = SettledWeights()
        # the widths whose builds read weights before the PDL wait (a GPU stream to wait for)
        self._early = {s for (s, _), cx in self._cx.items() if cx.get("EARLY_WEIGHTS") and cx.get("PDL")} \
            if self.device.type == "cuda" else set()

    def scratch_extra(self, key) -> list:
        return G.scratch_extra(key)

    def _weights(self, w, s: int):
        """The weight tensors width ``s``'s kernel reads (a one-element stand-in where a mode has
        none; PACKED_W13, PACKED_W2: w13, w2 packed)."""
        def dummy(dtype):
            if dtype not in self._dummy:
                self._dummy[dtype] = torch.zeros(16, dtype=dtype, device=self.device)
            return self._dummy[dtype]
        out = [w.post_norm, w.router, w.router_bias]
        cx = self._cx[(s, False)]
        for name in ("w13", "s13", "w2", "s2"):
            t = getattr(w, name)
            if self.experts is Experts.NONE or t.numel() == 0:
                t = dummy(t.dtype)
            elif name == "w13" and cx["PACKED_W13"]:
                t = self.PACKED.get(t, cx["UP_TILE"])
            elif name == "w2" and cx.get("PACKED_W2"):
                t = self.PACKED.get(t, (cx["W2_PACK_ROWS"], cx["UP_TILE"]), packed_w2)
            out.append(t)
        return out

    def _args(self, s, part, residual, slots, out, res_out, weights):
        first = int(getattr(weights, "first_expert", 0)) if self.experts is Experts.LOCAL else 0
        return [part, residual, slots, out, res_out, *self._weights(weights, s), self.scratch[s], self.peers,
                self.epoch, self.inject, self.params, self.rank, first]

    def _launch(self, s, args, final=False):
        cx = self._cx[(s, bool(final))]
        if self.interp:
            for stage in G.STAGES:
                self._launch_stage(s, args, stage, final)
            return None
        return K.launch(self.keys[s].blocks, args, cx, self.NUM_WARPS, self._opts[(s, bool(final))])

    def _launch_stage(self, s, args, stage, final=False):
        """One part of the step (STAGE > 0, no grid barrier inside): the interpreter's path."""
        cx = dict(self._cx[(s, bool(final))], STAGE=stage)
        K.launch(self.keys[s].blocks, args, cx, self.NUM_WARPS, num_stages=None)

    def staged(self, part, residual, weights, slots, final=False):
        """The step as a list of per-stage callables (for running several ranks of one process
        interleaved, stage by stage, under the interpreter) and its (out, res_out)."""
        s = self.check_inputs(part, residual, slots)
        out, res_out = self.new_outputs(part, residual)
        args = self._args(s, part, residual, slots, out, res_out, weights)
        return [lambda st=st: self._launch_stage(s, args, st, final) for st in G.STAGES], (out, res_out)

    def warm(self, weights, compute_units: int | None = None) -> None:
        from ffnq import residency
        m = self.model
        limit = G.max_scale()
        for name in ("s13", "s2") if limit else ():
            t = getattr(weights, name, None)
            big = float(t.abs().max()) if t is not None and t.numel() else 0.0
            if big >= limit:
                raise UsageError(f"weights: a block scale of {name} is {big:.3g}; the Triton "
                                 f"kernel's fp16 weight path (SACC=0) allows scales below {limit:.3g}")
        for s in self.widths:
            t0 = time.perf_counter()
            part = torch.zeros(s, m.hidden, dtype=torch.bfloat16, device=self.device)
            slots = torch.zeros(m.max_tokens, dtype=torch.int64, device=self.device)
            args = self._args(s, part, part.clone(), slots, part.clone(), part.clone(), weights)
            grid = self.keys[s].blocks
            info = {"kernel": kernel_name(self.keys[s]), "grid": grid, "threads": self.THREADS}
            if self.interp:
                info.update(compile_s=0.0, note="TRITON_INTERPRET=1: not compiled")
                self._info[s] = info
                continue
            cks = {}
            for final in (True, False):  # the non-final variant's resources are the ones reported
                cx = self._cx[(s, final)]
                cks[final] = K.ffn_kernel.warmup(*args, grid=(grid,), **cx, num_warps=self.NUM_WARPS, num_stages=2,
                                                 **self._opts[(s, final)])
                G.check_exact(info["kernel"], cks[final].asm["ttgir"])
                cks[final]._init_handles()
            ck, fk = cks[False], cks[True]
            info.update(compile_s=round(time.perf_counter() - t0, 3), n_regs=ck.n_regs, n_spills=ck.n_spills,
                        shared_bytes=ck.metadata.shared)
            if (fk.n_regs, fk.n_spills) != (ck.n_regs, ck.n_spills):
                info.update(final_regs=fk.n_regs, final_spills=fk.n_spills)
            threads = self.NUM_WARPS * (64 if self.is_hip else 32)
            try:
                # the fewer of the two variants': the handshake's may take more registers (TP2's
                # three tokens at a grid of 198: 180 against 168, two CTAs per SM, not three)
                per = min(residency.live_ctas_per_cu(k.function, threads, k.metadata.shared, hip=self.is_hip)
                          for k in (ck, fk))
            except Exception as e:  # noqa: BLE001 - keep warm going, report why
                per = None
                info["residency_error"] = f"{type(e).__name__}: {e}"[:200]
            if per is not None:
                self.residency[s] = per
                info["ctas_per_cu"] = per
            self._info[s] = info
            if compute_units is not None and per is not None:
                info["cus"] = compute_units
                info["resident"] = per * compute_units >= grid
                residency.check(info["kernel"], per, compute_units, grid)

    def describe(self, width: int) -> dict:
        return dict(self._info.get(width, {"kernel": kernel_name(self.keys[width]), "grid": self.keys[width].blocks}))

    def settle(self, s, weights) -> None:
        """Before an EARLY_WEIGHTS build's launch on weights the stream was not waited for since they were
        made (see SettledWeights). Not while a CUDA graph is captured: nothing runs then, and a
        replay comes after the work that made them (they are not taken as settled either)."""
        if s not in self._early or torch.cuda.is_current_stream_capturing():
            return
        if self._settled.first((weights.post_norm, weights.router, weights.router_bias)):
            torch.cuda.current_stream(self.device).synchronize()

    def __call__(self, part, residual, weights, slots, final=False):
        s = self.check_inputs(part, residual, slots)
        self.settle(s, weights)
        out, res_out = self.new_outputs(part, residual)
        self._launch(s, self._args(s, part, residual, slots, out, res_out, weights), final)
        return out, res_out

    def clock_ns(self) -> int:
        if self.device.type != "cuda" or self.interp:
            return time.monotonic_ns()
        return self.global_timer_ns(self.device)

    @staticmethod
    def global_timer_ns(device) -> int:
        """The GPU's global timer (ns on NVIDIA, 10 ns ticks on AMD), as the kernels stamp it."""
        t = torch.zeros(1, dtype=torch.int64, device=device)
        K.clock_kernel[(1,)](t, IS_HIP=torch.version.hip is not None)
        return int(t.item())
