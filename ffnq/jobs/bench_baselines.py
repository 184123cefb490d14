"""What bench does with its baselines besides checking and timing them like the fused step.

    (b) unfused      a plain PyTorch composition, NCCL all-reduces (ffnq.baselines.stock)
    (c) stock        the same with torch's symm-mem one-shot all-reduce
    (d) vllm         vLLM's own decode step (ffnq.baselines.vllm), symm-mem one-shot all-reduces;
        vllm-nccl    the same with NCCL

Each variant says what it is (``describe``). Beside its p50, bench reports per width
``kernels_per_step`` (a profiler pass: how much glue a step carries) and, for (d),
``kernel_us`` (its two fused_moe_kernel launches alone, graph-replayed over the same weight sets:
the best a vLLM user could ever get), ``glue_us`` (the profiled time of its other kernels: norm,
router, top-k, quant, alignment, sum) and ``config`` (the launch config each width ran).

Where the extracted vLLM kernels have no tuned config file for this expert shape and GPU (vLLM 0.34
ships none for MiniMax-M2's E=256, N=1536 / 768), bench tunes one as a vLLM user does with
benchmark_moe.py --tune: every config of SWEEP_SPACE timed on this GPU per width, the best kept,
and written into the fetched tree's configs/ under vLLM's own file name, so a later run (and the
gate) reads it as the tuned file it is.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from ffnq.jobs.records import max_over_ranks
from ffnq.spec import Experts
from ffnq.timing import StepTimer

BASELINES = ("unfused", "stock", "stock-nccl", "stock-symm", "vllm", "vllm-nccl")
BASELINE_REL_ERR = 3e-2  # stock parts run bf16 experts: ~1e-2 of rounding at worst
# vLLM's block-FP8 kernel quantizes the activations to e4m3 too (W8A8): ~3% against fp64
REL_ERR_OF = {"vllm": 8e-2, "vllm-nccl": 8e-2}
SWEEP_SAMPLES = 20  # graph replays per config and width: the sweep ranks configs, bench times the winner
GEMM = "fused_moe_kernel"  # (d)'s two launches; every other kernel of its step is glue


def sweep_space() -> list[dict]:
    """benchmark_moe.py's block-FP8 space (ffnq.baselines.vllm.search_space) where a decode width
    can tell its configs apart: BLOCK_SIZE_M <= 64 (at <= 16 tokens x top-8 a block holds one or
    two (token, expert) pairs: a larger block only computes padding rows) and GROUP_SIZE_M = 1
    (it reorders M blocks for weight reuse between them, and at decode each block reads another
    expert's weights). 48 of its 320 configs, each compiled for both GEMMs."""
    from ffnq.baselines.vllm import search_space

    return [c for c in search_space() if c["BLOCK_SIZE_M"] <= 64 and c["GROUP_SIZE_M"] == 1]


def make(job, names: list[str], sets: list) -> list[tuple[str, list]]:
    """The baselines to time beside the fused step, one per weight set.
    [] or ["auto"]: on cpu the unfused loop; on a GPU (b) ``unfused`` and, at tp > 1, (c)
    ``stock``. Asked for by name only: (d) ``vllm`` and ``vllm-nccl`` (FFNQ_VLLM_DIR: tools/extract_vllm.py)."""
    from ffnq.baselines.stock import Stock
    from ffnq.baselines.unfused import Unfused

    cuda = job.device.type == "cuda"
    if not names or names == ["auto"]:
        names = (["unfused"] + (["stock"] if job.tp > 1 else [])) if cuda else ["unfused"]
    out = []
    for n in names:
        if job.experts is Experts.NONE and (cuda or n != "unfused"):
            continue
        if n == "unfused" and not cuda:
            out.append((n, [Unfused(w, job.model, job.tp, job.experts, job.device) for w in sets]))
        elif n in ("unfused", "stock", "stock-nccl", "stock-symm"):
            ar = "symm" if n in ("stock", "stock-symm") else "nccl"
            out.append((n, [Stock(w, job.model, job.tp, job.experts, job.device, allreduce=ar) for w in sets]))
        elif n in ("vllm", "vllm-nccl"):
            from ffnq.baselines.vllm import VARIANTS, VllmMoe, load_kernel

            kernel = load_kernel()
            out.append((n, [VllmMoe(w, job.model, job.tp, job.experts, job.device, allreduce=VARIANTS[n],
                                    kernel=kernel) for w in sets]))
    return out


def tune_vllm(job, variants: list[tuple[str, list]], step_of, widths: list[int], rec) -> str | None:
    """Where (d) has no tuned config file for this shape and GPU, and no override: sweep
    sweep_space() per width on the first weight set (``step_of(obj, width)``: a callable running
    one step), keep the best for every instance, and write vLLM's tuned file. Collective: every
    rank times every config (max over ranks decides). Returns a line for the report, or None."""
    moes = [rs for name, rs in variants if name.startswith("vllm")]
    if not moes or moes[0][0].tuned or moes[0][0].override or job.device.type != "cuda":
        return None
    import triton

    from ffnq.baselines.vllm import sweep, vllm_dir

    first = moes[0][0]
    space = sweep_space()
    done = [0]

    def time_us(s: int, cfg: dict) -> float:
        rec.progress(done[0], len(space) * len(widths), f"tuning vLLM's launch config w={s}")
        done[0] += 1
        first.set_config(s, cfg, "trial")
        try:
            step_of(first, s)()  # compiles; an OutOfResources here skips the config (on every rank)
            ok = 1.0
        except triton.runtime.errors.OutOfResources:
            ok = 0.0
        if max_over_ranks(1.0 - ok):
            raise triton.runtime.errors.OutOfResources(0, 0, "shared memory")
        timer = StepTimer(step_of(first, s), barrier=None, device=job.device, graph=True, fallback=True)
        timer(3)
        return max_over_ranks(statistics.median(timer(SWEEP_SAMPLES)))

    best = sweep(time_us, widths, space)
    for rs in moes:
        for m in rs:
            m.adopt(best, len(space))
    d = vllm_dir()
    if d is None or job.rank != 0:
        return f"vLLM launch configs swept on this GPU ({len(space)} configs of benchmark_moe.py's space)"
    path = Path(d) / "configs" / first.file
    tuned = {str(s): cfg for s, (cfg, _) in sorted(best.items())}
    try:  # vLLM's own tuned-file format, so the next run reads it as vLLM would
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(tuned, indent=1) + "\n")
        where = f"written to {path}"
    except OSError as e:
        where = f"not written ({e.strerror})"
    return (f"vLLM launch configs swept on this GPU ({len(space)} configs of benchmark_moe.py's space, best per "
            f"width), {where}")


def extras(job, name: str, rs: list, sets: list, s: int, step_of) -> dict:
    """A variant's columns beside its p50 at width ``s``: kernels_per_step always on a GPU; for
    (d) also kernel_us (its two GEMMs alone, over every weight set), glue_us and config."""
    from ffnq.baselines.profile import profile_step

    n, glue = profile_step(step_of(rs[0], s), job.device, apart=GEMM)
    row = {"kernels_per_step": n}
    if hasattr(rs[0], "gemms") and job.device.type == "cuda":
        fns = [r.gemms(s) for r in rs]
        timer = StepTimer(lambda: [f() for f in fns], device=job.device, graph=True, fallback=True)
        timer(3)
        row |= {"kernel_us": max_over_ranks(statistics.median(timer(50)) / len(fns)), "glue_us": glue,
                "config": rs[0].config_name(s)}
    return row


def described(variants: list[tuple[str, list]]) -> dict[str, str]:
    """Each baseline's one line: what it is."""
    return {name: rs[0].describe for name, rs in variants if name not in ("fused", "none")}
