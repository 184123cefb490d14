"""Offline compile and static residency of the FlyDSL kernel for gfx942 / gfx950, with no GPU.

Every width is compiled with FlyDSL's own pipeline in compile-only mode (``COMPILE_ONLY=1``,
``ARCH`` and ``FLYDSL_GPU_ARCH`` set to the target: FlyDSL silently picks gfx942 when neither
is set and no GPU answers). The pipeline's last pass is switched from
``gpu-module-to-binary{format=fatbin}`` to ``{format=isa}``: the bundled LLVM AMDGPU backend
then emits the final assembly with its ``.amdgpu_metadata`` and ``.amdhsa_kernel`` blocks and no
``ld.lld`` from a ROCm install is needed (the fatbin step shells out to $ROCM_PATH/llvm/bin/ld.lld).
The register and LDS figures are the same ones the linked code object carries.

A build fails (BuildError) when the compiler printed ``error:`` on the process's stderr (FlyDSL
can report e.g. ``error: no libcall available for ftanh`` and still return an empty kernel), when
the kernel's body is almost empty, or when the protocol's instructions (system-scope atomics,
s_memrealtime, s_sleep) are missing from it.

Static CTAs per CU, two figures:
* ``ctas_per_cu_hip``: the formula of ROCm/clr ``ihipOccupancyMaxActiveBlocksPerMultiprocessor``
  (what ``hipModuleOccupancyMaxActiveBlocksPerMultiprocessor`` returns on the device): waves per
  SIMD from the metadata VGPR count (granule 8 of 512) and SGPR count (granule 16 of 800), at
  most 8; threads per CU = 4 SIMDs x waves x 64; blocks = min(threads / block, LDS per CU / LDS).
* ``ctas_per_cu``: adds what the hardware allocates: the VGPRs the kernel descriptor reserves
  (.amdhsa_next_free_vgpr, which LLVM raises up to the occupancy that LDS already imposes), the
  waves of one workgroup spread over the 4 SIMDs, 16 barrier slots per CU for multi-wave
  workgroups and the LDS allocation granule (512 B gfx942, 1280 B gfx950). Never above the HIP one.
``resident``: ctas_per_cu x CUs >= grid (BLOCKS), with MI300X = 304 CUs (gfx942) and MI355X =
256 CUs (gfx950) unless ``cus`` says otherwise.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
import time

from ffnq.errors import UsageError

TARGETS = ("gfx942", "gfx950")
CUS = {"gfx942": 304, "gfx950": 256}  # MI300X, MI355X
LDS_PER_CU = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
LDS_GRANULE = {"gfx942": 512, "gfx950": 1280}
SIMDS, MAX_WAVES, VGPRS, VGPR_GRAN, SGPRS, SGPR_GRAN, BARRIERS, WAVE = 4, 8, 512, 8, 800, 16, 16, 64
MIN_INSTRUCTIONS = 64  # an "empty" kernel (the silent-miscompile case) has a handful
PROTOCOL_OPS = ("global_atomic_swap", "s_memrealtime", "s_sleep")


class BuildError(RuntimeError):
    """A FlyDSL build that must not count as compiled."""


# ---------------------------------------------------------------------------------------------
# environment: compile-only, target, no disk cache, ISA output
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def compile_env(target: str):
    """COMPILE_ONLY + ARCH/FLYDSL_GPU_ARCH = target + ISA output, restored afterwards."""
    if target not in TARGETS:
        raise UsageError(f"target {target!r}: the flydsl backend compiles for {', '.join(TARGETS)}")
    saved = {k: os.environ.get(k) for k in ("COMPILE_ONLY", "ARCH", "FLYDSL_GPU_ARCH",
                                            "FLYDSL_RUNTIME_ENABLE_CACHE")}
    os.environ.update(COMPILE_ONLY="1", ARCH=target, FLYDSL_GPU_ARCH=target, FLYDSL_RUNTIME_ENABLE_CACHE="0")
    from flydsl.compiler.backends.rocm import RocmBackend
    orig = RocmBackend.pipeline_fragments

    def isa_fragments(self, *, compile_hints):
        frags = orig(self, compile_hints=compile_hints)
        if not frags[-1].startswith("gpu-module-to-binary"):
            raise BuildError(f"unexpected last FlyDSL pipeline fragment {frags[-1]!r} (flydsl version?)")
        return frags[:-1] + ["gpu-module-to-binary{format=isa}"]

    RocmBackend.pipeline_fragments = isa_fragments
    try:
        yield
    finally:
        RocmBackend.pipeline_fragments = orig
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def captured_stderr():
    """Everything written to file descriptor 2 (LLVM prints there, not to sys.stderr)."""
    import sys
    box = {"text": ""}
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box["text"] = tmp.read().decode(errors="replace")


# ---------------------------------------------------------------------------------------------
# reading the compiled module
# ---------------------------------------------------------------------------------------------
def binaries_and_launches(ir_text: str) -> tuple[dict, list]:
    """({gpu.binary name: bytes}, [launch dicts]) of a compiled FlyDSL module."""
    from flydsl._mlir import ir
    from flydsl._mlir.dialects import gpu as gpu_d

    bins, launches = {}, []

    def const(v):
        if v is None:
            return 0
        owner = v.owner
        if getattr(owner, "name", None) != "llvm.mlir.constant":
            return None
        return ir.IntegerAttr(owner.attributes["value"]).value

    def visit(op):
        if op.name == "gpu.binary":
            objs = ir.ArrayAttr(op.attributes["objects"])
            bins[ir.StringAttr(op.attributes["sym_name"]).value] = bytes(gpu_d.ObjectAttr(objs[0]).object)
        elif op.name == "gpu.launch_func":
            lf = op.opview
            mod, kern = ir.SymbolRefAttr(lf.kernel).value
            launches.append({"module": mod, "kernel": kern,
                             "block": (const(lf.blockSizeX), const(lf.blockSizeY), const(lf.blockSizeZ)),
                             "grid": (const(lf.gridSizeX), const(lf.gridSizeY), const(lf.gridSizeZ)),
                             "dynamic_lds": const(lf.dynamicSharedMemorySize)})
        return ir.WalkResult.ADVANCE

    ctx = ir.Context()
    ctx.load_all_available_dialects()
    with ctx:
        ir.Module.parse(ir_text).operation.walk(visit)
    return bins, launches


def _num(s: str):
    s = s.strip().strip("'\"")
    if s in ("true", "false"):
        return s == "true"
    try:
        return int(s, 0)
    except ValueError:
        return s


def parse_isa(text: str) -> dict:
    """Per kernel: its .amdgpu_metadata fields, its .amdhsa_* directives, its instruction count
    and the set of instruction mnemonics of its body."""
    out: dict[str, dict] = {}
    meta = re.search(r"^\s*\.amdgpu_metadata\s*$(.*?)^\s*\.end_amdgpu_metadata", text, re.S | re.M)
    if meta:
        cur = None
        for line in meta.group(1).splitlines():
            m = re.match(r"^  - \.(\w+):\s*(.*)$", line)
            if m:
                cur = {}
                out.setdefault("__list__", []).append(cur)
                if m.group(2):
                    cur[m.group(1)] = _num(m.group(2))
                continue
            m = re.match(r"^    \.(\w+):\s*(\S.*)?$", line)
            if m and cur is not None and m.group(2) is not None:
                cur[m.group(1)] = _num(m.group(2))
    kernels = {k["name"]: k for k in out.pop("__list__", []) if "name" in k}
    for name, body in re.findall(r"\.amdhsa_kernel (\S+)\n(.*?)\.end_amdhsa_kernel", text, re.S):
        kernels.setdefault(name, {})["amdhsa"] = {k: int(v, 0) for k, v in
                                                  re.findall(r"\.amdhsa_(\w+)\s+(-?(?:0x)?[0-9a-fA-F]+)\s*$",
                                                             body, re.M)}
    for name in list(kernels):
        m = re.search(rf"^{re.escape(name)}:\s*$(.*?)^\.Lfunc_end", text, re.S | re.M)
        body = m.group(1) if m else ""
        ops = [ln.split()[0] for ln in body.splitlines()
               if ln.strip() and ln.startswith(("\t", " ")) and not ln.strip().startswith((".", ";", "//"))]
        kernels[name]["instructions"] = len(ops)
        kernels[name]["mnemonics"] = set(ops)
    return kernels


def _up(x: int, g: int) -> int:
    return -(-x // g) * g


def ctas_per_cu(target: str, vgpr: int, sgpr: int, lds: int, threads: int, vgpr_alloc: int | None = None,
                agpr: int = 0) -> dict:
    """Static workgroups per CU (see the module docstring for both figures)."""
    lds_cu = LDS_PER_CU[target]
    # HIP (ROCclr) formula
    vw = VGPRS // _up(max(vgpr, 1), VGPR_GRAN)
    gw = min(vw, SGPRS // _up(max(sgpr, 1), SGPR_GRAN))
    alu_threads = SIMDS * min(MAX_WAVES, gw) * WAVE
    by_lds_hip = lds_cu // lds if lds else 10**9
    hip = min(alu_threads // _up(threads, WAVE), by_lds_hip)
    # what the hardware allocates
    unified = max(vgpr, vgpr_alloc or 0)
    if agpr:
        unified = _up(unified, 4) + agpr
    hw_vw = VGPRS // _up(max(unified, 1), VGPR_GRAN) if unified <= VGPRS else 0
    per_simd = min(MAX_WAVES, hw_vw, SGPRS // _up(max(sgpr, 1), SGPR_GRAN))
    waves_wg = math.ceil(threads / WAVE)
    by_waves = (per_simd * SIMDS) // waves_wg
    by_lds = lds_cu // _up(lds, LDS_GRANULE[target]) if lds else 10**9
    by_bar = BARRIERS if waves_wg > 1 else 10**9
    strict = min(by_waves, by_lds, by_bar, hip)
    limits = {"waves": by_waves, "lds": by_lds, "barriers": by_bar}
    limit = min((k for k in limits), key=lambda k: limits[k])
    return {"ctas_per_cu": strict, "ctas_per_cu_hip": hip, "limit": limit}


# ---------------------------------------------------------------------------------------------
# one checked build
# ---------------------------------------------------------------------------------------------
def compile_checked(jit_fn, args: tuple, target: str, *, protocol: bool = True,
                    min_instructions: int = MIN_INSTRUCTIONS) -> dict:
    """Compile one @flyc.jit launcher for ``target`` (compile-only, ISA); check it; return the
    kernel's resources: kernel, vgpr, vgpr_alloc, sgpr, agpr, lds_bytes, scratch_bytes, spills,
    threads, grid, instructions, compile_s, isa."""
    import flydsl.compiler as flyc

    with compile_env(target), captured_stderr() as err:
        t0 = time.perf_counter()
        try:
            ret = flyc.compile(jit_fn, *args)
        except Exception as e:  # noqa: BLE001 - a compile failure is a BuildError with the reason
            raise BuildError(f"FlyDSL compile for {target} failed: {type(e).__name__}: {str(e)[:2000]}") from e
        compile_s = time.perf_counter() - t0
    if ret is not None:
        raise BuildError("COMPILE_ONLY was ignored: flyc.compile returned a callable (would execute)")
    if re.search(r"\berror:", err["text"]):
        lines = [ln for ln in err["text"].splitlines() if "error:" in ln]
        raise BuildError(f"compiler reported errors for {target}: " + "; ".join(lines[:5]))
    last = getattr(jit_fn, "_last_compiled", None)
    if not last:
        raise BuildError("no compiled artifact (flydsl internals changed: JitFunction._last_compiled)")
    bins, launches = binaries_and_launches(last[1].ir)
    if len(launches) != 1:
        raise BuildError(f"expected one kernel launch, found {len(launches)}")
    lf = launches[0]
    isa = bins[lf["module"]].decode(errors="replace")
    tgt = re.search(r'\.amdgcn_target\s+"([^"]+)"', isa)
    if not tgt or target not in tgt.group(1):
        raise BuildError(f"code object is for {tgt.group(1) if tgt else '?'}, not {target}")
    res = parse_isa(isa).get(lf["kernel"])
    if res is None or "vgpr_count" not in res:
        raise BuildError(f"no metadata for kernel {lf['kernel']} in the {target} ISA")
    if res["instructions"] < min_instructions:
        raise BuildError(f"kernel {lf['kernel']} for {target} is empty ({res['instructions']} instructions): "
                         "a silent miscompile")
    if protocol:
        missing = [op for op in PROTOCOL_OPS if not any(m.startswith(op) for m in res["mnemonics"])]
        if missing:
            raise BuildError(f"kernel {lf['kernel']} for {target} lacks {', '.join(missing)}")
    threads = math.prod(lf["block"])
    hs = res.get("amdhsa", {})
    return {"kernel": lf["kernel"], "vgpr": res["vgpr_count"], "vgpr_alloc": hs.get("next_free_vgpr"),
            "sgpr": res["sgpr_count"], "agpr": res.get("agpr_count", 0),
            "lds_bytes": res["group_segment_fixed_size"] + (lf["dynamic_lds"] or 0),
            "scratch_bytes": res["private_segment_fixed_size"],
            "spills": res.get("vgpr_spill_count", 0) + res.get("sgpr_spill_count", 0),
            "threads": threads, "grid": lf["grid"][0], "instructions": res["instructions"],
            "denorm_f32": hs.get("float_denorm_mode_32"), "compile_s": round(compile_s, 3), "isa": isa}


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------
def placeholder_args(tp: int) -> tuple:
    """Kernel arguments for a compile-only trace: addresses and scalars are just values."""
    from ffnq.backends.flydsl.kernel import ARG_NAMES
    vals = {n: 0 for n in ARG_NAMES}
    vals.update(timeout_ns=1_000_000_000, rank=0, first_expert=0, final=1)
    return tuple(vals[n] for n in ARG_NAMES)


def build_width(model, tp: int, experts, width: int, *, timeline: bool = False, blocks: int | None = None):
    """(launcher, key) of one width, as FlydslRunner builds it."""
    from ffnq.backends.flydsl import kernel as K
    from ffnq.backends.flydsl.runner import FlydslRunner
    from ffnq.spec import FfnBuild, kernel_name, peer_layout, scratch_layout
    blocks = blocks or FlydslRunner.BLOCKS
    key = FfnBuild(tokens=width, tp=tp, experts=experts, timeline=timeline, model=model, blocks=blocks)
    layout = scratch_layout(key, K.scratch_extra(key))
    launch, _ = K.build(key, layout, peer_layout(model, tp, blocks), kernel_name(key))
    return launch, key


def width_row(spec, tp: int, experts, target: str, width: int, *, cus: int | None = None, timeline: bool = False,
              keep_isa: str | None = None, detail: bool = False) -> dict:
    """One width's row of the offline table (raises BuildError on a bad build)."""
    ncu = int(cus or CUS[target])
    t0 = time.perf_counter()
    launch, key = build_width(spec, tp, experts, width, timeline=timeline)
    r = compile_checked(launch, placeholder_args(tp), target)
    isa = r.pop("isa")
    if keep_isa:
        os.makedirs(keep_isa, exist_ok=True)
        with open(os.path.join(keep_isa, f"{r['kernel']}.{target}.s"), "w") as fh:
            fh.write(isa)
    occ = ctas_per_cu(target, r["vgpr"], r["sgpr"], r["lds_bytes"], r["threads"], r["vgpr_alloc"], r["agpr"])
    row = {"width": width, "kernel": r["kernel"], "compile_s": round(time.perf_counter() - t0, 3),
           "target": target, "vgpr": r["vgpr"], "sgpr": r["sgpr"], "agpr": r["agpr"],
           "lds_bytes": r["lds_bytes"], "scratch_bytes": r["scratch_bytes"], "spills": r["spills"],
           "ctas_per_cu": occ["ctas_per_cu"], "limit": occ["limit"], "cus": ncu, "grid": r["grid"],
           "resident": "yes" if occ["ctas_per_cu"] * ncu >= r["grid"] else "no",
           "ctas_per_cu_hip": occ["ctas_per_cu_hip"]}
    if detail:
        row.update(threads=r["threads"], vgpr_alloc=r["vgpr_alloc"], instructions=r["instructions"],
                   denorm_f32=r["denorm_f32"])
    return row


def _row_job(job) -> dict:
    spec, tp, experts, target, width, cus, timeline, keep_isa, strict, detail = job
    try:
        return width_row(spec, tp, experts, target, width, cus=cus, timeline=timeline, keep_isa=keep_isa,
                         detail=detail)
    except BuildError as e:
        if strict:
            raise
        from ffnq.spec import FfnBuild, kernel_name
        from ffnq.backends.flydsl.runner import FlydslRunner
        key = FfnBuild(tokens=width, tp=tp, experts=experts, timeline=timeline, model=spec,
                       blocks=FlydslRunner.BLOCKS)
        return {"width": width, "kernel": kernel_name(key), "target": target, "error": str(e)[:500],
                "cus": int(cus or CUS[target]), "grid": key.blocks, "resident": "no"}


def offline_table(model, tp, experts, target, widths=None, *, cus: int | None = None,
                  timeline: bool = False, keep_isa: str | None = None, jobs: int | None = None,
                  strict: bool = False, detail: bool = False) -> list[dict]:
    """Compile every width for ``target`` (gfx942 / gfx950) with no GPU; one row per width:
    width, kernel, compile_s, target, vgpr, sgpr, agpr, lds_bytes, scratch_bytes, ctas_per_cu,
    cus, grid, resident, plus spills, limit (what bounds CTAs/CU) and ctas_per_cu_hip (the HIP
    formula); ``detail`` adds threads, vgpr_alloc, instructions and denorm_f32.
    A width whose build fails is a row with ``error`` and resident "no" (``strict``: raise
    BuildError instead). ``keep_isa``: a folder for each width's assembly. ``jobs``: widths
    compiled in that many processes (default: one per core, at most one per width)."""
    from ffnq.spec import Experts, ModelSpec, load_model
    try:
        import flydsl  # noqa: F401
    except ImportError as e:
        raise UsageError(f"the flydsl backend needs the flydsl package (pip install 'ffnq[amd]'): {e}") from None
    spec = model if isinstance(model, ModelSpec) else load_model(model)
    experts = Experts(experts)
    tp = int(tp)
    spec.check(tp, experts)
    if target not in TARGETS:
        raise UsageError(f"target {target!r}: the flydsl backend compiles for {', '.join(TARGETS)}")
    ws = list(range(1, spec.max_tokens + 1)) if widths is None or widths == "all" else [int(w) for w in widths]
    bad = [w for w in ws if not 1 <= w <= spec.max_tokens]
    if bad or not ws:
        raise UsageError(f"widths {bad or '[]'}: allowed 1..{spec.max_tokens} for {spec.name}")
    todo = [(spec, tp, experts, target, w, cus, timeline, keep_isa, strict, detail) for w in ws]
    n = min(len(todo), jobs or os.cpu_count() or 1)
    import __main__
    main_file = getattr(__main__, "__file__", None)
    if main_file and not os.path.exists(main_file):
        n = 1  # e.g. `python -` : spawned workers could not re-import the main module
    if n <= 1:
        return [_row_job(j) for j in todo]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    # spawn: a fresh interpreter per worker (no forked MLIR/LLVM threads); each sets its own env
    try:
        with ProcessPoolExecutor(max_workers=n, mp_context=mp.get_context("spawn")) as ex:
            return list(ex.map(_row_job, todo))
    except BrokenProcessPool:
        return [_row_job(j) for j in todo]


def warm_table(model, tp, experts, target, widths=None) -> list[dict]:
    """``ffnq warm --target``'s rows: a FlyDSL width is one build (the last layer's handshake is a
    runtime argument, ``final``, not a second variant as in Triton), so its offline table."""
    return offline_table(model, tp, experts, target, widths)
