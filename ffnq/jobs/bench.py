"""bench, one rank: per width, check then time the fused step and the unfused baseline.

On a GPU a timed step walks four weight sets (cold L2); the fused step is first checked at every
width on each set after the first, against that set's own fp64 oracle (check_set). Then each
width: fresh inputs, one checked step of each variant against the fp64 reference (a variant that
is wrong is not timed), an estimate (3 calls of the StepTimer that then takes the
samples: graph replays on a GPU; max over ranks) that turns the ms budgets into step counts every
rank agrees on, then warm-up and samples, on a GPU in
bursts of ``burst_ms`` each after ``idle_ms`` idle, so that no window runs long enough to bring
the GPU to its power cap (ffnq.gpu_clocks), with the SM clock and the share of time under a cap
recorded per window. A step is ``layers`` launches, ``final=True`` on the last. One row per
(width, variant, rank) in table ``latency``; ``summarize`` makes one row per width.
"""
from __future__ import annotations

import math
import statistics

from dataclasses import dataclass, field

import pandas as pd
import torch

from ffnq import reference
from ffnq.dist import barrier
from ffnq.errors import UsageError
from ffnq.gpu_clocks import ClockWatch
from ffnq.jobs import bench_baselines
from ffnq.jobs.bench_baselines import BASELINE_REL_ERR, BASELINES, REL_ERR_OF
from ffnq.jobs.rank import from_options
from ffnq.jobs.records import Records, main, max_over_ranks
from ffnq.options import JobOptions
from ffnq.spec import Experts
from ffnq.timing import StepTimer, quantiles_us, steps_for

CASE = 50_000  # input case ids of bench (qualify uses small ones)
# a bench's seed when none is given (`ffnq bench`, a gate's bench job): one workload, so two runs
# (compare, a gate's base) read the same experts; the checks (qualify, soak) draw a fresh one
BENCH_SEED = 0
ROTATE_SETS_GPU = 4  # weight sets one timed graph walks through: 4 x 57 MB at s=1, TP2 >> a 60 MB L2
MAX_WINDOW_MS = 10_000  # a bench burst or idle longer than this is a typo, not a method
MAX_LAYERS, MAX_REP_MS, MAX_WARMUP_MS = 256, 600_000.0, 60_000.0  # ten minutes per variant


@dataclass
class BenchOptions(JobOptions):
    layers: int = 1
    rep_ms: float = 1000.0  # timed budget per width and variant (ms), converted to a step count
    warmup_ms: float = 200.0
    burst_ms: float = 250.0  # on a GPU the timed steps run in bursts this long (0: one window)...
    idle_ms: float = 250.0  # ...each after this long idle: no window reaches the power cap
    min_steps: int = 10
    max_steps: int = 1000
    baseline: bool = True  # False: time the fused step alone
    phase_split: bool = False  # also time the kernel with Experts NONE (seam + router + reduce)
    phases: bool = False  # also a timeline build's phase boundaries per width (phase_rows)
    baselines: list[str] = field(default_factory=list)  # empty: auto (see baselines())
    routing: str = "uniform"  # the synthetic router (weights.ROUTING); a checkpoint routes as it does
    seed: int = BENCH_SEED

    job = "bench"

    def check(self) -> None:
        from ffnq.weights import ROUTING

        if self.routing not in ROUTING:
            raise UsageError(f"--routing {self.routing!r}: allowed {', '.join(ROUTING)}")
        if self.checkpoint and self.routing != "uniform":
            raise UsageError(f"--routing {self.routing}: the synthetic router's; --checkpoint routes as its "
                             "router does")
        if not (0 < self.rep_ms <= MAX_REP_MS and 0 <= self.warmup_ms <= MAX_WARMUP_MS):
            raise UsageError(f"--rep-ms {self.rep_ms:g} / --warmup-ms {self.warmup_ms:g}: allowed 0 < rep <= "
                             f"{MAX_REP_MS:g} and 0 <= warmup <= {MAX_WARMUP_MS:g} (ms)")
        if not 0 <= self.burst_ms <= MAX_WINDOW_MS or not 0 <= self.idle_ms <= MAX_WINDOW_MS:
            raise UsageError(f"--burst-ms {self.burst_ms:g} / --idle-ms {self.idle_ms:g}: allowed 0..{MAX_WINDOW_MS} "
                             "ms each (--burst-ms 0: one timed window)")
        bad = [b for b in self.baselines if b not in BASELINES]
        if bad:
            raise UsageError(f"--baselines {bad[0]!r}: allowed auto, none, or a list of {', '.join(BASELINES)}")
        for b in [b for b in self.baselines if b.startswith("vllm")]:
            if not self.gpu:
                raise UsageError(f"--baselines {b}: needs a GPU backend (vLLM's fused_moe is a Triton GPU kernel)")
            from ffnq.baselines.vllm import kernel_path

            kernel_path()  # a one-line error before any rank starts when the fetched copy is missing
        for b in ("stock", "stock-symm"):
            if b in self.baselines and (self.tp < 2 or not self.gpu):
                raise UsageError(f"--baselines {b}: needs a GPU backend and --tp >= 2 (symmetric memory)")
        if any(b.startswith(("stock", "vllm")) for b in self.baselines) and self.experts == "none":
            raise UsageError("--baselines stock*/vllm: the composition needs --experts all or local")
        if not 1 <= self.layers <= MAX_LAYERS:
            raise UsageError(f"--layers {self.layers}: allowed 1..{MAX_LAYERS}")

    def work_s(self) -> float:
        variants = 1 + (max(len(self.baselines), 3) if self.baseline else 0)
        bursts = math.ceil(self.rep_ms / self.burst_ms) if self.burst_ms else 0
        per = (self.rep_ms + self.warmup_ms + bursts * self.idle_ms) / 1e3 * variants + 3.0 * self.layers
        if self.gpu:  # each further weight set's check (an oracle step and the launches)
            per += (ROTATE_SETS_GPU - 1) * (1.0 + 0.1 * self.layers)
        if self.phases:  # a timeline build per width: its compile (~6 s a variant for minimax-m2 on a
            per += 12.0 + 0.2 * self.layers  # GPU host, two a width) and PHASE_STEPS eager steps
        return len(self.widths) * per * 3

    def weight_sets(self) -> int:
        return ROTATE_SETS_GPU if self.gpu else 1


def body(opts: dict, rec: Records) -> None:
    job = from_options(opts)
    try:
        run(job, opts, rec)
    finally:
        barrier()
        job.close()


def weight_sets(job, layers: list[int]):
    """(RankWeights, FullWeights) of each weight set, made as asked for: the rank's own and, on a
    GPU, more sets, so a timed replay reads every expert from HBM rather than from the L2 a
    previous step filled (cold weights): synthetic ones of their own seeds, or from a checkpoint
    its ``layers`` (set_layers), as a decode step walks the model. A set's whole layer (what its
    oracle reads) lives until the next is made."""
    yield job.weights, job.full
    if job.device.type != "cuda":
        return
    from ffnq.weights import load_layer, shard, synthetic

    for k in range(1, ROTATE_SETS_GPU):
        if job.checkpoint:
            full = load_layer(job.checkpoint, layers[k], job.model, job.device)
        else:
            full = synthetic(job.model, job.seed + 1000 * k, job.device, job.routing)
        yield shard(full, job.model, job.tp, job.rank, job.experts), full
        del full


def step_on(r, inputs: tuple, rank: int, weights, L: int, poison: bool = False):
    """One step of ``r`` (a Runner or a baseline) on ``weights``: ``L`` launches, final=True on the
    last. ``poison``: a Runner's outputs are NaN until it writes them (the checks; the timed steps
    pay no fill)."""
    parts, residual, slots = inputs
    if poison:
        r.poison_outputs = True
    for layer in range(L):
        out = r(parts[rank], residual, weights, slots, final=layer == L - 1)
    if poison:
        r.poison_outputs = False
    return out


def kernel_ok(fault, c: dict, c2: dict, want: reference.Reference) -> bool:
    """The kernel under test's standard (qualify's): no fault, no element of out or res_out beyond
    tolerance, and each output's rel_err within the step's own bound (``want.rel_bound_out`` and
    ``rel_bound_res``, from the step's arithmetic: ~5e-3 for the fused kernel's out, not a round 1e-2)."""
    return (not fault and c["wrong"] + c2["wrong"] == 0 and c["rel_err"] <= want.rel_bound_out
            and c2["rel_err"] <= want.rel_bound_res)


def check_set(job, fused, inputs: dict, weights, full, L: int, rec: Records) -> tuple[dict, dict]:
    """Every width (``inputs``: width -> its inputs) on one more weight set (the width's own check
    covers the first), against the fp64 oracle of that set's layer ``full``, before anything is
    timed: a replay that read other weights than it was given (a runner's stale packed copy) would
    time L2-warm bytes that the floor counts as HBM reads, and pass a check of the first set alone.
    Collective. Returns width -> what failed there (the same on every rank) and width -> the
    checked outputs (copies)."""
    bad, outs = {}, {}
    for i, (s, inp) in enumerate(inputs.items()):
        rec.progress(i, len(inputs), f"check w={s}")
        ref = reference.step(*inp, full, job.model, job.experts)
        barrier()
        out, res_out = step_on(fused, inp, job.rank, weights, L, poison=True)
        fault = fused.fault(s)
        want = oracle(job, "fused", fused.chosen(s), inp, ref, full)
        c, c2 = reference.compare(out, want.out), reference.compare(res_out, want.res_out)
        ok = kernel_ok(fault, c, c2, want)
        if not all_ranks_ok(ok):
            bad[s] = str(fault or c["worst"] or c2["worst"]) if not ok else "another rank's check failed"
        outs[s] = (out.clone(), res_out.clone())
    return bad, outs


def replay_differs(timer: StepTimer, want: tuple) -> int:
    """Bytes in which the timed step's outputs, poisoned (NaN) and then made again by one more
    timed call (on a GPU a graph replay), differ from the checked step's on the same weight set
    ``want``: 0 for a kernel whose sums have a fixed order. What was timed is what was checked, and
    not outputs a warm-up or the capture left behind. Collective."""
    for t in timer.last:
        t.fill_(float("nan"))
    timer(1)
    return sum(int((g.contiguous().view(-1).view(torch.uint8) != w.contiguous().view(-1).view(torch.uint8)).sum())
               for g, w in zip(timer.last, want))


def set_layers(job) -> list[int]:
    """A checkpoint's layers the GPU weight sets read: the job's and the ones after it, round the
    layers the checkpoint holds (one layer held: that layer read again, into memory of its own)."""
    from ffnq.weights import checkpoint_layers

    held = checkpoint_layers(job.checkpoint)
    at = held.index(job.layer)
    return [held[(at + k) % len(held)] for k in range(ROTATE_SETS_GPU)]


def floor_terms(job) -> tuple[float, float] | None:
    """(HBM read GB/s, one-shot link us) measured on this GPU; None off a GPU (collective)."""
    if job.device.type != "cuda":
        return None
    from ffnq.floor import hbm_read_gbps, link_latency_us

    return hbm_read_gbps(job.device), link_latency_us(job.model.hidden, job.device)


def touched(job, chosen: torch.Tensor) -> int:
    """Distinct experts this rank reads for these rows (padding rows are -1)."""

    ids = torch.unique(chosen[chosen >= 0]).tolist()
    if job.experts is Experts.NONE:
        return 0
    if job.experts is Experts.LOCAL:
        n = job.model.experts_per_rank(job.tp, job.experts)
        first = job.weights.first_expert
        ids = [e for e in ids if first <= e < first + n]
    return len(ids)


def floor_row(job, floor: tuple[float, float], inputs: tuple, sets: list) -> dict:
    """The floor of one width's step over ``sets``: a timed step runs every weight set, and each
    set has its own router, so its bytes are the mean of the sets' touched experts (set 0's alone
    is what reports before 2026-12-01 19:40 UTC used)."""
    from ffnq.floor import floor_us

    n_set = [touched(job, reference.chosen(*inputs, w, job.model)) for w in sets]
    n_exp = sum(n_set) / len(n_set)
    per = job.model.expert_bytes(job.tp, job.experts)
    return {"floor_us": floor_us(n_exp, per, *floor), "hbm_read_gbps": floor[0], "link_us": floor[1],
            "touched_experts": n_exp, "touched_per_set": "/".join(map(str, n_set)), "weight_bytes": n_exp * per,
            "weight_sets": len(sets)}


def oracle(job, name: str, pick: torch.Tensor | None, inputs: tuple, ref: reference.Reference,
           full=None) -> reference.Reference:
    """What variant ``name`` is checked against: the oracle ``ref`` (of ``full``, the job's layer
    unless given), except on a near-tie row that the variant broke its own way (``pick``, its
    route) where that is still a top-k: the fused kernel within TIE_EPS (fp32 router), a baseline
    within BF16_TIE_EPS (its h is rounded to bf16, which flips about one row in a hundred at TP2)."""
    if pick is None:
        return ref
    pick = pick.to(ref.chosen.device)
    if torch.equal(pick, ref.chosen):
        return ref
    eps = reference.TIE_EPS if name == "fused" else reference.BF16_TIE_EPS
    return reference.step(*inputs, job.full if full is None else full, job.model, job.experts, follow=pick,
                          tie_eps=eps)


def run(job, opts: dict, rec: Records) -> None:
    widths, L = opts["widths"], opts["layers"]
    fused = job.runner(widths)
    fused.warm(job.weights, job.compute_units())  # a grid that cannot be resident fails here, named
    layers = set_layers(job) if job.checkpoint and job.device.type == "cuda" else []  # the GPU's weight sets
    inputs = {s: job.inputs(s, CASE + s) for s in widths}  # each width's, the same on every weight set
    sets, bad_sets, last_outs = [], {}, {}  # last_outs: the checked outputs of the last set, by width
    for k, (weights, full) in enumerate(weight_sets(job, layers)):
        sets.append(weights)
        if k:
            name = f"weight set {k}" + (f" (checkpoint layer {layers[k]})" if layers else "")
            bad, last_outs = check_set(job, fused, inputs, weights, full, L, rec)
            bad_sets |= {s: f"{name}: {why}" for s, why in bad.items() if s not in bad_sets}
        del full  # one whole layer besides the job's at a time
    sets_of = f" (checkpoint layers {', '.join(map(str, layers))})" if layers and len(sets) > 1 else ""
    variants = [("fused", [fused] * len(sets))]
    if opts["baseline"]:
        variants += bench_baselines.make(job, opts.get("baselines") or [], sets)
        if job.rank == 0:
            for name, what in bench_baselines.described(variants).items():
                rec.row("baselines", {"baseline": name, "what": what})

    def step_of(r, s):  # one step of r at width s on the first weight set
        return lambda: step_on(r, inputs[s], job.rank, sets[0], L)

    tuned = bench_baselines.tune_vllm(job, variants, step_of, widths, rec)
    if tuned and job.rank == 0:
        rec.row("baselines", {"baseline": "vllm configs", "what": tuned})
    if opts.get("phase_split") and job.experts is not Experts.NONE:
        none = job.runner(widths, experts=Experts.NONE)  # same peer buffer: shares the epoch
        none.warm(job.weights, job.compute_units())
        variants.append(("none", [none] * len(sets)))
    graph = job.device.type == "cuda"
    floor = floor_terms(job)
    total, done = len(widths) * len(variants), 0
    for s in widths:
        inp = inputs[s]
        ref = reference.step(*inp, job.full, job.model, job.experts)
        ref_none = reference.step(*inp, job.full, job.model, Experts.NONE)
        extra = floor_row(job, floor, inp, sets) if floor else {}
        for name, rs in variants:
            rec.progress(done, total, f"{name} w={s}")
            done += 1

            def step(rs=rs, inp=inp):  # one step on every weight set in turn; samples are divided by it
                for r, w in zip(rs, sets):
                    out = step_on(r, inp, job.rank, w, L)
                return out

            barrier()
            kernel = name in ("fused", "none")  # a Runner; the baselines make their own outputs
            out, res_out = step_on(rs[0], inp, job.rank, sets[0], L, poison=kernel)
            fault = rs[0].fault(s) if kernel else None
            want = oracle(job, name, rs[0].chosen(s) if name != "none" else None, inp,
                          ref_none if name == "none" else ref)
            c = reference.compare(out, want.out)
            c2 = reference.compare(res_out, want.res_out)
            rel = max(c["rel_err"], c2["rel_err"])
            if kernel:  # the kernel under test: the qualify standard
                ok = kernel_ok(fault, c, c2, want)
            else:  # a baseline only has to compute the same step (stock parts round in bf16)
                ok = rel <= REL_ERR_OF.get(name, BASELINE_REL_ERR) and c2["wrong"] == 0
            if name == "fused" and s in bad_sets:  # another of the sets it is timed on was read wrong
                ok, fault = False, fault or bad_sets[s]
            if name == "fused" and len(sets) == 1:  # the set a timed step ends on: its checked outputs
                last_outs[s] = (out.clone(), res_out.clone())
            row = {"width": s, "variant": name, "rank": job.rank, "check": "OK" if ok else "FAIL",
                   "rel_err": rel, "wrong": c["wrong"] + c2["wrong"], "layers": L,
                   "followed": int((want.chosen != ref.chosen).any(-1).sum())} | extra
            if not all_ranks_ok(ok):
                rec.row("latency", row | {"check": "FAIL", "detail": str(fault or c["worst"])})
                continue
            per = len(sets)
            # one timer for the estimate and the samples: the step captured once (eager where
            # it cannot be), the estimate timed as the samples are (an eager Triton step at one
            # token takes 2-4x its replay, which made bursts a quarter to half of --burst-ms)
            timer = StepTimer(step, barrier=barrier, device=job.device, graph=graph, fallback=True)
            est_us = max_over_ranks(statistics.median(timer(3)) / per)
            n = steps_for(est_us * per, opts["rep_ms"], opts["min_steps"], opts["max_steps"])
            burst_ms, idle_ms = (opts.get("burst_ms", 0.0), opts.get("idle_ms", 0.0)) if graph else (0.0, 0.0)
            burst = steps_for(est_us * per, burst_ms, 1, n) if burst_ms else n
            watch = ClockWatch(job.device)
            warmup = steps_for(est_us * per, opts["warmup_ms"], 1, opts["max_steps"])
            samples = [x / per for x in timer(n, burst=burst, idle_s=idle_ms / 1e3, watch=watch, warmup=warmup)]
            checked = ", each checked" if name == "fused" else ""  # check_set holds the kernel alone to every set
            row["timing"] = (timer.mode + (f", {per} weight sets{sets_of} per replay (cold L2){checked}"
                                           if per > 1 else "")
                             + (f", bursts of {burst} steps after {idle_ms:g} ms idle" if idle_ms else ""))
            row |= watch.summary()
            if graph:  # what the step is made of: its launches, and (d)'s GEMMs alone
                row |= bench_baselines.extras(job, name, rs, sets, s, step_of)
            if name == "fused":
                faulted = fused.fault(s)
                if faulted:
                    row["check"], row["detail"] = "FAIL", f"fault while timing: {faulted}"
                if all_ranks_ok(not faulted):  # then one more timed call, checked (every rank launches it)
                    nbad = replay_differs(timer, last_outs[s])
                    if not all_ranks_ok(nbad == 0):
                        row["check"] = "FAIL"
                        row["detail"] = (f"the timed step's outputs differ from the checked step's in {nbad} bytes"
                                         if nbad else "another rank's timed outputs differ from its checked step's")
            rec.row("latency", row | quantiles_us(samples))
    if opts.get("phases"):
        tl = job.runner(widths, timeline=True)  # same peer buffer: shares the epoch
        tl.warm(job.weights, job.compute_units())
        for i, s in enumerate(widths):
            rec.progress(i, len(widths), f"phases w={s}")
            if tl.readable("timeline", s):
                for row in phase_rows(job, tl, s, inputs[s], sets, L):
                    rec.row("phases", row)
    rec.progress(total, total, "done")


PHASE_STEPS, PHASE_SKIP = 20, 3  # eager timeline steps per width, the first PHASE_SKIP not kept


def phase_rows(job, tl, s: int, inp: tuple, sets: list, L: int) -> list[dict]:
    """When the median and the latest CTA of this rank pass each phase boundary of a step at width
    ``s`` (us from the first CTA's start; timeline.phase_profile), the median over PHASE_STEPS eager
    steps that walk the weight sets as the timed steps do (cold L2 on a GPU). Eager launches, so a
    graph replay's launch gap is not in them: where the time goes inside one step."""
    from ffnq.spec import stamp_names
    from ffnq.timeline import phase_profile

    names, got = stamp_names(job.tp), {}
    region, finer = tl.PHASE_STAMPS or (None, {})  # the runner's own finer stamps, where it has them
    if region is None or not tl.readable(region, s):
        finer = {}
    for i in range(PHASE_SKIP + PHASE_STEPS):
        step_on(tl, inp, job.rank, sets[i % len(sets)], L)
        if i >= PHASE_SKIP:
            t = tl.view(s, "timeline").cpu().long()  # the copy to the host waits for the step
            if finer:
                sub = tl.view(s, region).cpu().long().reshape(t.shape[0], -1)
                t = torch.cat([t, sub[:, list(finer)]], dim=1)
            for n, v in phase_profile(t, names + list(finer.values())).items():
                got.setdefault(n, []).append(v)
    rows = [{"width": s, "rank": job.rank, "stamp": n, "median_us": statistics.median(m for m, _ in v),
             "latest_us": statistics.median(x for _, x in v)} for n, v in got.items()]
    return sorted(rows, key=lambda r: r["median_us"])


def _parts(b: pd.DataFrame, key: str) -> dict:
    """A baseline's decomposition at one width (slowest rank): kernels a step launches and, for
    (d), its GEMMs alone, its other kernels' profiled time, their sum (what its p50 should be
    near: a p50 far above it is host or launch overhead the composition carries) and its config."""
    out = {}
    if "kernels_per_step" in b and b.kernels_per_step.notna().any():
        out[f"{key}_kernels"] = int(b.kernels_per_step.max())
    if "kernel_us" in b and b.kernel_us.notna().any():
        out[f"{key}_kernel_us"] = b.kernel_us.max()
        out[f"{key}_glue_us"] = b.glue_us.max()
        out[f"{key}_parts_us"] = out[f"{key}_kernel_us"] + out[f"{key}_glue_us"]
        out[f"{key}_config"] = b.config.dropna().iloc[0] if b.config.notna().any() else None
    return out


def all_ranks_ok(ok: bool) -> bool:
    return max_over_ranks(0.0 if ok else 1.0) == 0.0


def summarize_phases(ph: pd.DataFrame) -> pd.DataFrame:
    """Per width and phase boundary, the slowest rank's median-CTA and latest-CTA times (us), in
    the order a step passes them."""
    g = ph.groupby(["width", "stamp"], sort=False)[["median_us", "latest_us"]].max().reset_index()
    return g.sort_values(["width", "median_us"], kind="stable").reset_index(drop=True)


def summarize(lat: pd.DataFrame) -> pd.DataFrame:
    """Per width: the slowest rank's quantiles of the fused step (a step is as slow as its slowest
    rank), the skew between ranks' p50, each baseline's p50 and speedup_<baseline> = baseline p50 /
    fused p50, and the floor (max over ranks) where measured. ``check`` is the fused step's;
    ``followed`` names the variants whose check followed their own pick on a near-tie row."""
    rows = []
    for s, g in lat.groupby("width", sort=True):
        f = g[g.variant == "fused"]
        row = {"width": int(s)}
        if "p50_us" in f and f.p50_us.notna().any():
            row |= {"p50_us": f.p50_us.max(), "p90_us": f.p90_us.max(), "p99_us": f.p99_us.max(),
                    "skew_us": f.p50_us.max() - f.p50_us.min(), "steps": int(f.steps.min())}
            if "kernels_per_step" in f and f.kernels_per_step.notna().any():
                row["kernels_per_step"] = int(f.kernels_per_step.max())
        for v in dict.fromkeys(g.variant):
            b = g[g.variant == v]
            if v == "fused" or "p50_us" not in b or not b.p50_us.notna().any():
                continue
            key = v.replace("-", "_")
            row[f"{key}_p50_us"] = b.p50_us.max()
            # its own spread, so that compare judges a baseline's delta against its noise too
            row[f"{key}_p90_us"], row[f"{key}_steps"] = b.p90_us.max(), int(b.steps.min())
            row |= _parts(b, key)
            if v == "none":  # the phase split: the same kernel without expert work
                if "p50_us" in row:
                    row["experts_us"] = row["p50_us"] - row["none_p50_us"]
                continue
            if "p50_us" in row:
                row[f"speedup_{key}"] = row[f"{key}_p50_us"] / row["p50_us"]
                if f"{key}_kernel_us" in row:  # over the GEMMs alone: the best a vLLM user could get
                    row[f"speedup_{key}_kernel"] = row[f"{key}_kernel_us"] / row["p50_us"]
        if "sm_mhz" in f and f.sm_mhz.notna().any():  # the slowest rank's clock; a cap in any variant
            row["sm_mhz"] = f.sm_mhz.min()
            row["capped_pct"] = g.capped_pct.max()
        if "floor_us" in f and f.floor_us.notna().any():
            row["floor_us"] = f.floor_us.max()
            row["touched_experts"] = f.touched_experts.max()
            if "p50_us" in row and row["floor_us"] > 0:  # --experts none reads no weights: no floor to be over
                row["x_floor"] = row["p50_us"] / row["floor_us"]
                row["weights_gbps"] = f.weight_bytes.max() / row["p50_us"] / 1e3
        row |= {"rel_err": f.rel_err.max(), "check": "OK" if (f.check == "OK").all() and len(f) else "FAIL"}
        if "timing" in f and f.timing.notna().any():
            row["timing"] = f.timing.dropna().iloc[0]
        if "followed" in g:  # near-tie rows checked against the variant's own admissible pick
            n = g.groupby("variant", sort=False).followed.max()
            if (n > 0).any():
                row["followed"] = ", ".join(f"{v} {int(k)}" for v, k in n.items() if k > 0)
        if "detail" in g and g.detail.notna().any():
            row["detail"] = "; ".join(f"{v} r{r}: {d}" for v, r, d in zip(g.variant, g["rank"], g.detail) if d == d and d)
        rows.append(row)
    return pd.DataFrame(rows)

if __name__ == "__main__":
    main(body)
