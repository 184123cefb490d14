"""FlydslRunner: the FlyDSL kernel of kernel.py behind the ffnq runner contract (AMD ROCm only).

One compiled kernel per width (flyc.compile of the width's @flyc.jit launcher), one scratch
buffer per width, the epoch words in this rank's peer buffer. FlyDSL has no cooperative launch
(hipModuleLaunchKernel only), so nothing but a residency check stands between a too-big grid and
a hang in its first grid barrier: ``warm`` asks HIP for every width
(hipModuleOccupancyMaxActiveBlocksPerMultiprocessor, through FlyDSL's
CompiledFunction.max_blocks_per_cu) and, given ``compute_units``, refuses a width whose grid
cannot fit; a launch of a width that cannot fit on this device's CUs is refused in any case.

Executing a FlyDSL kernel on a host without an AMD GPU aborts the whole process (FlyDSL's JIT
runtime dlopens libamdhip64 and calls abort), so the runner refuses before anything is compiled
or launched: construction checks for a ROCm build of torch with a visible gfx942/gfx950 device.
Offline compile and static residency work anywhere: ``ffnq warm --backend flydsl --target
gfx942`` (offline.py).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ffnq.errors import UsageError
from ffnq import symm
from ffnq.runner import PeerBuffer, Runner
from ffnq.spec import Experts, ModelSpec, kernel_name

ARCHES = ("gfx942", "gfx950")
OFFLINE_HINT = "offline compile and static residency need no GPU: ffnq warm --backend flydsl --target gfx942"


def amd_gpu_problem(device: torch.device | None = None) -> str | None:
    """Why this host cannot execute a FlyDSL kernel (None when it can)."""
    if device is not None and device.type != "cuda":
        return f"device {device} is not a GPU"
    if getattr(torch.version, "hip", None) is None:
        return "this torch is not a ROCm build (torch.version.hip is None)"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "no AMD GPU is visible"
    idx = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    arch = str(getattr(torch.cuda.get_device_properties(idx), "gcnArchName", "")).split(":")[0]
    if arch not in ARCHES:
        return f"GPU {idx} is {arch or 'unknown'}, the kernel is built for {', '.join(ARCHES)}"
    return None


def writable_flydsl_cache() -> str:
    """FlyDSL's disk cache must be writable (AITER points it at a read-only bundled cache)."""
    cur = os.environ.get("FLYDSL_RUNTIME_CACHE_DIR")
    if cur and os.path.isdir(cur) and os.access(cur, os.W_OK):
        return cur
    path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ffnq" / "flydsl"
    path.mkdir(parents=True, exist_ok=True)
    os.environ["FLYDSL_RUNTIME_CACHE_DIR"] = str(path)
    return str(path)


class FlydslRunner(Runner):
    backend = "flydsl"
    BLOCKS = 128  # persistent grid: <= 256 CUs (MI355X) / 304 CUs (MI300X) at 1 CTA per CU
    THREADS = 256  # 4 wave64 waves per CTA

    # ---- device ------------------------------------------------------------------------------
    @classmethod
    def default_device(cls, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank)

    def accept_device(self, device: torch.device) -> None:
        why = amd_gpu_problem(device)
        if why:
            raise UsageError(f"the flydsl backend executes only on an AMD GPU ({', '.join(ARCHES)}): {why}; "
                             f"{OFFLINE_HINT}")
        try:
            import flydsl  # noqa: F401
        except ImportError as e:
            raise UsageError(f"the flydsl backend needs the flydsl package (pip install 'ffnq[amd]'): {e}") from None

    # ---- peer buffers (torch symmetric memory, as the Triton backend) -------------------------
    @classmethod
    def open_peers(cls, model: ModelSpec, tp: int, rank: int, device, tag: str) -> PeerBuffer:
        dev = torch.device(device)
        why = amd_gpu_problem(dev)
        if why:
            raise UsageError(f"the flydsl backend executes only on an AMD GPU: {why}; {OFFLINE_HINT}")
        return symm.open_peers(cls.peer_bytes(model, tp), tp, rank, device)

    def peer_view(self, address: int) -> torch.Tensor:
        return symm.view(address, self.peer_bytes(self.model, self.tp), "FlydslRunner")

    # ---- contract ----------------------------------------------------------------------------
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # accept_device refuses a host without an AMD GPU
        from ffnq.backends.flydsl import kernel as K
        self._K = K
        self._launch = {}
        for s, key in self.keys.items():
            try:
                self._launch[s] = K.build(key, self.layouts[s], self.peer_regions, kernel_name(key))[0]
            except ValueError as e:
                raise UsageError(f"flydsl kernel for {kernel_name(key)}: {e}") from None
        self._compiled: dict[int, object] = {}
        self._info: dict[int, dict] = {}
        self._dummy: dict[torch.dtype, torch.Tensor] = {}
        self._clock = None
        self._ncu: int | None = None
        # never let FlyDSL fall back to gfx942 on another chip: name the device's architecture
        arch = str(torch.cuda.get_device_properties(self.device).gcnArchName).split(":")[0]
        for var in ("ARCH", "FLYDSL_GPU_ARCH"):
            os.environ.setdefault(var, arch)

    def scratch_extra(self, key) -> list:
        from ffnq.backends.flydsl import kernel as K
        try:
            return K.scratch_extra(key)
        except ValueError as e:
            raise UsageError(f"flydsl kernel for {kernel_name(key)}: {e}") from None

    def _weights(self, w) -> list[int]:
        out = []
        for name in ("post_norm", "router", "router_bias", "w13", "s13", "w2", "s2"):
            t = getattr(w, name)
            if t.numel() == 0:  # Experts.NONE: the kernel never reads them; any valid address
                if t.dtype not in self._dummy:
                    self._dummy[t.dtype] = torch.zeros(16, dtype=t.dtype, device=self.device)
                t = self._dummy[t.dtype]
            if t.device != self.device or not t.is_contiguous():
                raise UsageError(f"weights.{name}: needs a contiguous tensor on {self.device}")
            out.append(t.data_ptr())
        return out

    def _args(self, s, part, residual, slots, out, res_out, weights, final) -> tuple:
        first = int(getattr(weights, "first_expert", 0)) if self.experts is Experts.LOCAL else 0
        timeout_ns = self.keys[s].timeout_ns
        return (part.data_ptr(), residual.data_ptr(), slots.data_ptr(), out.data_ptr(), res_out.data_ptr(),
                *self._weights(weights), self.scratch[s].data_ptr(), self.peers.data_ptr(), self.epoch.data_ptr(),
                self.inject.data_ptr(), int(timeout_ns), self.rank, first, 1 if final else 0,
                torch.cuda.current_stream(self.device))

    def warm(self, weights, compute_units: int | None = None) -> None:
        """Compile and load every width and ask HIP how many of its CTAs fit per CU
        (``residency``); with ``compute_units``, refuse a width whose grid cannot be resident.
        Without it, a non-resident width is refused at launch (see __call__)."""
        import flydsl.compiler as flyc
        if os.environ.get("COMPILE_ONLY", "0").lower() in ("1", "true", "yes", "on"):
            raise UsageError("COMPILE_ONLY is set: FlyDSL would compile without loading; unset it to run")
        writable_flydsl_cache()
        m = self.model
        for s in self.widths:
            if s not in self._compiled:
                t0 = time.perf_counter()
                part = torch.zeros(s, m.hidden, dtype=torch.bfloat16, device=self.device)
                slots = torch.zeros(m.max_tokens, dtype=torch.int64, device=self.device)
                args = self._args(s, part, part, slots, part, part, weights, False)
                self._compiled[s] = flyc.compile(self._launch[s], *args)
                self._info[s] = {"kernel": kernel_name(self.keys[s]), "compile_s": round(time.perf_counter() - t0, 3),
                                 "grid": self.BLOCKS, "threads": self.THREADS}
            info = self._info[s]
            if s not in self.residency:
                # HIP's answer for the loaded kernel (FlyDSL: exactly one launch per jit function)
                per = int(self._compiled[s].max_blocks_per_cu())
                self.residency[s] = per
                info["ctas_per_cu"] = per
            per = self.residency[s]
            if compute_units is not None:
                info.update(cus=compute_units, resident=per * compute_units >= self.BLOCKS)
                if per * compute_units < self.BLOCKS:
                    raise RuntimeError(f"kernel {info['kernel']}: grid of {self.BLOCKS} CTAs cannot be resident: "
                                       f"{per} CTAs per CU x {compute_units} CUs = {per * compute_units}")

    def describe(self, width: int) -> dict:
        return dict(self._info.get(width, {"kernel": kernel_name(self.keys[width]), "grid": self.BLOCKS,
                                           "threads": self.THREADS}))

    def __call__(self, part, residual, weights, slots, final=False):
        s = self.check_inputs(part, residual, slots)
        if s not in self._compiled:
            raise UsageError(f"width {s}: not compiled; call warm() first")
        # FlyDSL has no cooperative launch: a grid that cannot be co-resident would hang in its
        # first grid barrier instead of failing, so it is refused here
        per, cus = self.residency.get(s, 0), self._cus()
        if per * cus < self.BLOCKS:
            raise RuntimeError(f"kernel {kernel_name(self.keys[s])}: grid of {self.BLOCKS} CTAs cannot be resident "
                               f"({per} CTAs per CU x {cus} CUs); not launched")
        out, res_out = self.new_outputs(part, residual)
        self._compiled[s](*self._args(s, part, residual, slots, out, res_out, weights, final))
        return out, res_out

    def _cus(self) -> int:
        if self._ncu is None:
            self._ncu = torch.cuda.get_device_properties(self.device).multi_processor_count
        return self._ncu


    def clock_ns(self) -> int:
        """s_memrealtime x 10 ns, read by a one-thread FlyDSL kernel (the timeline's clock)."""
        import flydsl.compiler as flyc
        t = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self._clock is None:
            self._clock = flyc.compile(self._K.build_clock(), t.data_ptr(), torch.cuda.current_stream(self.device))
        self._clock(t.data_ptr(), torch.cuda.current_stream(self.device))
        return int(t.item())
