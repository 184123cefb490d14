"""Ahead-of-time compile of the fused kernel with no GPU (sm_90, gfx942, gfx950) and the static
residency of every width.

The compile goes through the same path as a launch: the JIT's own argument binder specialises
stand-in CPU tensors (dtype, 16-byte alignment) exactly as it would the device tensors, so the
ASTSource (signature, constexprs, attributes), the options and hence Triton's cache key are the
ones a launch on that target builds: ``ffnq warm --target`` (warm_table) on a GPU machine fills
the cache in parallel before the runner's warm.

Resources: NVIDIA from the cubin through the cuobjdump bundled in the triton wheel (REG, SHARED,
LOCAL) and ptxas -v on the PTX (spill bytes); AMD from the amdgcn text (.vgpr_count,
.agpr_count, .sgpr_count, spill counts, scratch, LLVM's Occupancy). Shared memory is Triton's
dynamic ``metadata.shared`` (plus the cubin's static SHARED on sm_90).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

from ffnq import residency
from ffnq.spec import Experts, FfnBuild, ModelSpec, kernel_name, load_model, peer_layout, scratch_layout

TARGETS = {"sm_90": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64), "gfx950": ("hip", "gfx950", 64)}
NUM_WARPS = 4
NUM_STAGES = 2


def _target(name: str):
    from triton.backends.compiler import GPUTarget
    if name not in TARGETS:
        raise ValueError(f"target {name!r}: known {', '.join(TARGETS)}")
    return GPUTarget(*TARGETS[name])


def build_key(model: ModelSpec, tp: int, experts: Experts, tokens: int, timeline: bool = False,
              blocks: int | None = None, timeout_ns: int = 1_000_000_000, target: str = "sm_90",
              sms: int | None = None) -> FfnBuild:
    """The build a TritonRunner launches for ``target`` (``blocks``: every width's grid, as
    ``TritonRunner.with_grid``; else that of an NVIDIA device of ``sms`` SMs, an H200's by
    default), its peer flags sized as that runner sizes them."""
    from ffnq.backends.triton.runner import TritonRunner
    runner = TritonRunner.with_grid(blocks) if blocks else TritonRunner.for_sms(sms) if sms else TritonRunner
    hip = _target(target).backend == "hip"
    return FfnBuild(tokens=tokens, tp=tp, experts=Experts(experts), timeline=timeline, model=model,
                    timeout_ns=timeout_ns, blocks=runner.blocks_for(tokens, model, tp, hip=hip),
                    flag_blocks=runner.flag_blocks())


def _standins(key: FfnBuild):
    """CPU tensors with the dtypes of a launch (the binder only reads dtype and alignment)."""
    import torch
    from ffnq.backends.triton import geometry as G
    t = {n: torch.empty(16, dtype=torch.bfloat16) for n in ("part", "residual", "out", "res_out")}
    t.update(slots=torch.empty(16, dtype=torch.int64), post_norm=torch.empty(16), router=torch.empty(16),
             router_bias=torch.empty(16), w13=torch.empty(16, dtype=torch.float8_e4m3fn), s13=torch.empty(16),
             w2=torch.empty(16, dtype=torch.float8_e4m3fn), s2=torch.empty(16),
             scratch=torch.empty(16, dtype=torch.uint8), peers=torch.empty(16, dtype=torch.int64),
             epoch=torch.empty(16, dtype=torch.int32), inject=torch.empty(16, dtype=torch.int32),
             cfg=torch.empty(16, dtype=torch.int64), rank=0, first_expert=0)
    return [t[n] for n in G.ARG_NAMES]


def constexprs_for(key: FfnBuild, hip: bool, interp: bool = False, stage: int = 0, final: bool = False) -> dict:
    """Every constexpr of one build, with the scratch and peer layouts a launch of it uses."""
    from ffnq.backends.triton import geometry as G
    lay = scratch_layout(key, G.scratch_extra(key))
    return G.constexprs(key, lay, peer_layout(key.model, key.tp, key.flags), hip, interp, stage=stage, final=final)


def compile_key(key: FfnBuild, target: str, stage: int = 0, final: bool = False):
    """The CompiledKernel of one build for one target, as the JIT would make it."""
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    from triton import knobs
    from ffnq.backends.triton import geometry as G
    from ffnq.backends.triton import kernel as K
    tgt = _target(target)
    backend = make_backend(tgt)
    fn = K.ffn_kernel
    cx = constexprs_for(key, tgt.backend == "hip", stage=stage, final=final)
    kwargs = dict(cx, num_warps=NUM_WARPS, num_stages=NUM_STAGES, **G.launch_options(cx, key))
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, _ = binder(*_standins(key), **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, None)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=tgt, options=options.__dict__)


def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def cached_resources(ck, read) -> dict:
    """``read(ck)`` (cuobjdump and ptxas -v: seconds per build) kept beside Triton's cache under the
    compiled kernel's hash: a function of that binary alone, so a second ``ffnq warm --target``
    that finds the kernel in Triton's cache finds its resources too."""
    from triton import knobs

    path = os.path.join(knobs.cache.dir, "ffnq-resources", f"{ck.metadata.hash}-{read.__name__}.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    got = read(ck)
    try:  # written whole or not at all: a parallel compile of the same build may race this one
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(got, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: resources are read again next time
    return got


def nv_resources(ck) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(ck.asm["cubin"])
        txt = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin], capture_output=True,
                             text=True).stdout
        m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", txt)
        if m:
            out.update(regs=int(m.group(1)), stack=int(m.group(2)), static_shared=int(m.group(3)),
                       local_bytes=int(m.group(4)))
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(ck.asm["ptx"])
        log = subprocess.run([_tool("ptxas"), "-v", f"--gpu-name=sm_{ck.metadata.target.arch}a", ptx, "-o",
                              os.path.join(d, "k.o")], capture_output=True, text=True).stderr
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        out["spills"] = int(m.group(1)) if m else out.get("local_bytes", 0)
    mma = sorted(set(re.findall(r"(wgmma\.mma_async[\w.]*|mma\.sync\.aligned\.[\w.]*)", ck.asm["ptx"])))
    out["mma"] = ",".join(mma)
    return out


AMD_KEYS = {"vgpr": r"\.vgpr_count:\s+(\d+)", "agpr": r"\.agpr_count:\s+(\d+)", "sgpr": r"\.sgpr_count:\s+(\d+)",
            "vgpr_spill": r"\.vgpr_spill_count:\s+(\d+)", "sgpr_spill": r"\.sgpr_spill_count:\s+(\d+)",
            "scratch_bytes": r"\.private_segment_fixed_size:\s+(\d+)", "llvm_occupancy": r"; Occupancy:\s+(\d+)",
            "num_vgprs": r"; NumVgprs:\s+(\d+)", "num_agprs": r"; NumAgprs:\s+(\d+)"}


def amd_resources(ck) -> dict:
    asm = ck.asm["amdgcn"]
    out = {}
    for k, pat in AMD_KEYS.items():
        m = re.search(pat, asm)
        if m:
            out[k] = int(m.group(1))
    # memory spills: VGPRs to scratch (SGPR spills go to VGPR lanes, no memory traffic: reported apart)
    out["spills"] = out.get("vgpr_spill", 0)
    out["mma"] = ",".join(sorted(set(re.findall(r"v_mfma_\w+", asm))))
    return out


def width_row(key: FfnBuild, target: str, cus: int | None = None, final: bool = False) -> dict:
    """Compile one width for one target; resources and static residency. The step's last launch
    (``final``, with the handshake) is its own variant; the table reports the plain one."""
    from ffnq.backends.triton import geometry as G
    t0 = time.perf_counter()
    ck = compile_key(key, target, final=final)
    dt = time.perf_counter() - t0
    shared = int(ck.metadata.shared)
    row = {"width": key.tokens, "kernel": kernel_name(key), "compile_s": round(dt, 2), "target": target,
           "grid": key.blocks, "shared_bytes": shared, "cus": cus or residency.CUS[target]}
    if target == "sm_90":
        r = cached_resources(ck, nv_resources)
        per, lim = residency.occupancy_sm90(r.get("regs", 255), shared, NUM_WARPS * 32, r.get("static_shared", 0))
        row.update(regs=r.get("regs"), spills=r.get("spills", 0), static_shared=r.get("static_shared", 0),
                   mma=r.get("mma"))
        try:
            G.check_exact(row["kernel"], ck.asm["ttgir"])
        except RuntimeError as e:
            row["error"] = str(e)
    else:
        r = amd_resources(ck)
        per, lim = residency.occupancy_cdna(r.get("num_vgprs", r.get("vgpr", 512)), r.get("num_agprs", r.get("agpr", 0)),
                                            NUM_WARPS, shared, target, r.get("llvm_occupancy"))
        row.update(vgpr=r.get("vgpr"), agpr=r.get("agpr"), sgpr=r.get("sgpr"), spills=r.get("spills", 0),
                   sgpr_spills=r.get("sgpr_spill", 0), scratch_bytes=r.get("scratch_bytes", 0), mma=r.get("mma"))
    row["ctas_per_cu"] = per
    row["limit"] = min(lim, key=lim.get)
    row["resident"] = per * row["cus"] >= key.blocks
    return row


def _row_job(args):
    model, tp, experts, tokens, timeline, blocks, target, cus, final = args
    key = build_key(model, tp, Experts(experts), tokens, timeline, blocks, target=target,
                    sms=cus if target == "sm_90" else None)
    try:
        row = width_row(key, target, cus, final)
        row["final"] = final
        return row
    except Exception as e:  # noqa: BLE001 - one failed width is a row, not a crash
        return {"width": tokens, "kernel": kernel_name(key), "target": target, "error": f"{type(e).__name__}: {e}"[:500],
                "grid": key.blocks, "resident": False, "final": final}


def warm_table(model: ModelSpec | str, tp: int, experts: Experts | str, target: str, widths=None) -> list[dict]:
    """``ffnq warm --target``'s rows: both variants of each width compiled, folded into one row.
    A job launches both (the last layer's step takes the handshake variant), so a width is as
    resident as the fewer CTAs per CU of the two; the row keeps the plain build's resources and
    names the handshake build's registers and spills where they differ (TP2's three tokens at a
    grid of 198: 180 registers against 168, two CTAs per SM against three)."""
    rows = offline_table(model, tp, experts, target, widths, final="both")
    plain = {r["width"]: r for r in rows if not r.get("final")}
    for f in (r for r in rows if r.get("final")):
        p = plain[f["width"]]
        if f.get("error"):
            p["error"] = "; ".join(x for x in (p.get("error"), f"final: {f['error']}") if x)
            p["resident"] = False
            continue
        for k in ("regs", "vgpr", "spills"):
            if k in f and f[k] != p.get(k):
                p[f"final_{k}"] = f[k]
        if "ctas_per_cu" in p:
            p["ctas_per_cu"] = min(p["ctas_per_cu"], f["ctas_per_cu"])
        p["resident"] = bool(p.get("resident")) and bool(f.get("resident"))
        p["compile_s"] = round(p.get("compile_s", 0) + f.get("compile_s", 0), 2)
    for p in plain.values():
        p.pop("final", None)
    return [plain[w] for w in sorted(plain)]


def _prime() -> None:
    """Hash Triton's own source and the kernel's once, here: every compile's cache key starts with
    them (~1.2 s on a loaded core), and the forked workers inherit them rather than each paying it
    (ffnq warm --target sm_90 of minimax-m2 from Triton's cache: 40 s -> 14 s on two loaded cores)."""
    from triton.runtime.cache import triton_key

    from ffnq.backends.triton import kernel as K
    triton_key()
    K.ffn_kernel.cache_key  # noqa: B018 - computed and kept on the function


def offline_table(model: ModelSpec | str, tp: int, experts: Experts | str, target: str, widths=None,
                  timeline: bool = False, blocks: int | None = None, cus: int | None = None,
                  jobs: int | None = None, final: bool | str = False) -> list[dict]:
    """One row per width: width, kernel, compile_s, target, regs (sm_90) or vgpr/agpr/sgpr (AMD), spills,
    shared_bytes, ctas_per_cu, cus, grid, resident. Widths compile in parallel processes.
    ``final``: False (the plain variant), True (the handshake variant) or "both" (fills a cache)."""
    from ffnq.backends.triton import geometry as G
    from ffnq.backends.triton import tune
    from ffnq.errors import UsageError
    try:  # before any build: a bad override would otherwise fail in every compile job
        tune.read()
        G.measured_table()
    except ValueError as e:
        raise UsageError(str(e)) from None
    model = load_model(model) if isinstance(model, str) else model
    experts = Experts(experts)
    model.check(tp, experts)
    _target(target)
    widths = list(widths or range(1, model.max_tokens + 1))
    finals = (False, True) if final == "both" else (bool(final),)
    jobs_in = [(model, tp, experts.value, s, timeline, blocks, target, cus, f) for s in widths for f in finals]
    n = jobs or min(len(jobs_in), os.cpu_count() or 1)
    if n <= 1:
        return [_row_job(j) for j in jobs_in]
    _prime()
    import multiprocessing as mp
    with ProcessPoolExecutor(max_workers=n, mp_context=mp.get_context("fork")) as ex:
        return list(ex.map(_row_job, jobs_in))
