"""Rank bodies for the engine tests (run in spawned processes by multirank.run_ranks).

Each returns plain data; the test asserts on it in the parent, so a failing rank shows up as a
value, not as a hang.
"""
from __future__ import annotations

import time

import torch

from ffnq import reference
from ffnq.dist import barrier
from ffnq.jobs.rank import setup
from ffnq.spec import Phase, stamp_names

TIMEOUT = 0.5  # s: short enough for fast fault tests, long enough for 3 ranks on 2 cores
# the soak's options in its rank bodies (the default stream: seed 0, random padding, 2 runners)
SOAK_OPTS = {"backend": "cpu", "model": "tiny", "experts": "all", "seed": 0, "random_padding": True, "runners": 2}


def _check(job, runner, s, case, padding=0, final=False):
    """One step on every rank, checked against fp64 by each. The ranks start it together: a
    rank's check of its last step must not count against this step's kernel timeout."""
    barrier()
    parts, residual, slots = job.inputs(s, case, padding=padding)
    out, res_out = runner(parts[job.rank], residual, job.weights, slots, final=final)
    pad = slots[:s] < 0
    route = runner.chosen(s)
    ref = reference.step(parts, residual, slots, job.full, job.model, job.experts, follow=route)
    ok_rows = (route == ref.chosen).all(-1)
    return {
        "s": s, "case": case, "padding": int(pad.sum()),
        "out": reference.compare(out, ref.out), "res": reference.compare(res_out, ref.res_out),
        "route_ok": bool(ok_rows.all()), "pad_zero": bool((out[pad] == 0).all()),
        "fault": runner.fault(s),
    }


def correctness(rank, world, widths, experts="all", timeline=False, timeout=TIMEOUT):
    job = setup("cpu", "tiny", experts, timeout, seed=3)
    r = job.runner(widths=widths, timeline=timeline)
    r.warm(job.weights)
    out = []
    for i, s in enumerate(widths):
        out.append(_check(job, r, s, case=10 + i, padding=s // 3, final=i % 2 == 1))
    job.close()
    return out


def shared_epoch(rank, world):
    """Two runners on one peer buffer, alternating: both move the one epoch word on."""
    job = setup("cpu", "tiny", "all", TIMEOUT, seed=4)
    a, b = job.runner(widths=[2, 7]), job.runner(widths=[2, 7])
    seen, res = [], []
    for i in range(6):
        r = (a, b)[i % 2]
        res.append(_check(job, r, (2, 7)[i // 2 % 2], case=i))
        seen.append(int(a.epoch[0]))
    same = a.epoch.data_ptr() == b.epoch.data_ptr()
    job.close()
    return {"epochs": seen, "same_word": same, "checks": res}


def injection(rank, world, late, delay_s, s=4):
    """One step with rank ``late`` delayed, then a collective reset and a checked step."""
    job = setup("cpu", "tiny", "all", TIMEOUT, seed=5)
    r = job.runner(widths=[s], timeline=True)
    r.warm(job.weights)
    r.inject.copy_(torch.tensor([late + 1, int(delay_s * 1e9)], dtype=torch.int32))
    barrier()  # the clock starts once every rank is here, so the wait seen is the injected delay
    t0 = time.monotonic()
    first = _check(job, r, s, case=1, final=True)
    first["wall_s"] = time.monotonic() - t0
    names = stamp_names(world)
    tl = r.view(s, "timeline")
    first["seam_wait_ns"] = [int(tl[c, names.index(f"seam_seen{late}")] - tl[c, names.index("seam_arrive")])
                             for c in range(r.BLOCKS)]
    r.inject.zero_()
    r.reset()
    after = _check(job, r, s, case=2, final=True)
    job.close()
    return {"first": first, "after": after}


def stale(rank, world, s=3):
    """Rank 1 never arrives; rank 0 finds stale tags (earlier epochs, negative, future) in its
    flags from rank 1: none may satisfy the wait."""
    job = setup("cpu", "tiny", "all", TIMEOUT, seed=6)
    r = job.runner(widths=[s])
    good = _check(job, r, s, case=1)  # epoch 1 for both
    barrier()
    result = {"good": good}
    if rank == 0:
        flags = r.view(s, "flags")
        e = int(r.epoch[0]) + 1
        result["tags"] = {}
        for tag in (e - 1, e - 2, -(e - 1), e + 1):  # stale, older, stale fault, future
            flags[:, :, 1] = tag
            t0 = time.monotonic()
            parts, residual, slots = job.inputs(s, 9)
            r(parts[0], residual, job.weights, slots)
            f = r.fault(s)
            result["tags"][tag] = {"fault": f, "wall_s": time.monotonic() - t0}
            e = int(r.epoch[0]) + 1
    barrier()
    job.close()
    return result


PHASE_NAMES = [p.name.lower() for p in Phase]


def soak_replay(rank, world, steps, result_dir):
    """Steps of the default soak stream (seed 0, widths 1-16, random padding, 2 runners) run
    alone through Soak.one, which checks them as the soak does. Also says, per checked step,
    whether the kernel's route differs from the oracle's own pick on some row (a near tie)."""
    from ffnq.jobs.records import Records
    from ffnq.jobs.soak import SOAK_CASE, Soak, draw

    # the skewed router's weights: the stream's near-tie steps were found on them
    opts = SOAK_OPTS | {"timeout_s": 10.0, "widths": list(range(1, 17)), "steps": max(steps) + 1, "routing": "skewed"}
    soak = Soak(opts, Records(result_dir, rank))
    tied = []
    try:
        t0 = time.perf_counter()
        for step in steps:
            soak.one(step, t0)
            if step % world == rank:
                s, padding, _, ri = draw(0, step, opts["widths"], True, 2)
                parts, residual, slots = soak.job.inputs(s, SOAK_CASE, step, padding)
                own = reference.step(parts, residual, slots, soak.job.full, soak.job.model, soak.job.experts,
                                     soak.cache)
                route = soak.runners[ri].chosen(s)
                tied.append(bool((route != own.chosen).any()))
            barrier()  # the next step starts together, not while one rank still checks this one
        mismatches = [r["data"] for r in soak.rec.rows if r["table"] == "mismatch"]
        return {"n": dict(soak.n), "mismatches": mismatches, "tied": tied}
    finally:
        soak.job.close()


def soak_slow_check(rank, world, result_dir, check_s, timeout_s):
    """A soak whose fp64 check takes ``check_s``, longer than the kernel's ``timeout_s``: the
    peers must wait for it on the host, not in the next launch's seam."""
    import ffnq.reference
    from ffnq.jobs.records import Records
    from ffnq.jobs.soak import Soak

    step = ffnq.reference.step

    def slow(*a, **k):
        time.sleep(check_s)
        return step(*a, **k)

    ffnq.reference.step = slow
    opts = SOAK_OPTS | {"timeout_s": timeout_s, "widths": [1, 2], "steps": 2 * world}
    soak = Soak(opts, Records(result_dir, rank))
    try:
        soak.loop(time.perf_counter())
        return dict(soak.n)
    finally:
        soak.job.close()


def bench_timers(rank, world, result_dir):
    """A bench of two widths with its StepTimer recorded: how many timers each (width, variant)
    made and what each was asked (the estimate, then warm-up and samples of the same timer)."""
    import ffnq.jobs.bench as bench
    from ffnq.jobs.records import Records

    made = []

    class Recorded(bench.StepTimer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.asked = []
            made.append(self.asked)

        def __call__(self, steps, **k):
            self.asked.append((steps, k.get("warmup", 0)))
            return super().__call__(steps, **k)

    bench.StepTimer = Recorded
    from ffnq.jobs.bench import BenchOptions

    # the job's options as the launcher writes them (every field, its defaults), with a short bench
    opts = BenchOptions(tp=world, timeout_s=10.0, widths=[1, 2], rep_ms=5.0, warmup_ms=1.0, burst_ms=0.0, idle_ms=0.0,
                      min_steps=3, max_steps=20).to_json()
    rec = Records(result_dir, rank)
    bench.body(opts, rec)
    return {"made": made, "rows": [r["data"] for r in rec.rows if r["table"] == "latency"]}


def from_checkpoint(rank, world, path, layer):
    """setup() from a checkpoint's layer: the weights each rank holds, and checked steps on them."""
    job = setup("cpu", "tiny", "all", TIMEOUT, seed=7, checkpoint=path, layer=layer)
    r = job.runner(widths=[1, 5])
    r.warm(job.weights)
    out = {"router": digest(job.full.router), "w13": digest(job.weights.w13),
           "checks": [_check(job, r, s, case=20 + s, padding=s // 3) for s in (1, 5)]}
    job.close()
    return out


def digest(t: torch.Tensor) -> str:
    """A tensor's bytes as a short hash: plain data through the ranks' queue (a tensor would go
    as a shared-memory handle its exited rank no longer serves)."""
    import hashlib

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _set(job, seed):
    """Another layer's weights (synthetic from ``seed``) and this rank's shard of them."""
    from ffnq.weights import shard, synthetic

    full = synthetic(job.model, seed)
    return full, shard(full, job.model, job.tp, job.rank, job.experts)


def other_weights(rank, world):
    """One runner stepped on weights other than those it warmed on: another set, the same w13 with
    other scales, and weights written in place; each step's rel_err against its own fp64 oracle
    (a dequant cached by address or by w13 alone answers with the old weights')."""
    import dataclasses

    job = setup("cpu", "tiny", "all", TIMEOUT, seed=7)
    r = job.runner(widths=[4])
    r.warm(job.weights)
    parts, residual, slots = job.inputs(4, 5)

    def err(full, w):
        barrier()
        out, _ = r(parts[job.rank], residual, w, slots, final=True)
        return reference.compare(out, reference.step(parts, residual, slots, full, job.model).out)["rel_err"]

    got = {"own": err(job.full, job.weights)}
    full, w = _set(job, 11)
    got["other set"] = err(full, w)
    rescaled = dataclasses.replace(full, s1=full.s1 * 2, s3=full.s3 * 2, s2=full.s2 * 3)
    w2 = dataclasses.replace(w, s13=w.s13 * 2, s2=w.s2 * 3)  # the same w13 and w2 tensors
    got["other scales"] = err(rescaled, w2)
    full3, w3 = _set(job, 12)
    w.w13.copy_(w3.w13)
    w.w2.copy_(w3.w2)
    w.s13.copy_(w3.s13)
    w.s2.copy_(w3.s2)
    got["written in place"] = err(dataclasses.replace(full3, post_norm=full.post_norm, router=full.router,
                                                      router_bias=full.router_bias), w)
    job.close()
    return got


def bench_check_set(rank, world, result_dir):
    """bench.check_set on a second weight set: a runner that reads the set it is given passes every
    width; one that keeps reading the first weights it saw (a stale copy) fails every width."""
    from ffnq.jobs import bench
    from ffnq.jobs.records import Records

    job = setup("cpu", "tiny", "all", TIMEOUT, seed=7)
    rec = Records(result_dir, rank)
    full, w = _set(job, 1007)
    good = job.runner(widths=[1, 3])
    good.warm(job.weights)
    stale = job.runner(widths=[1, 3])
    stale.warm(job.weights)
    first = job.weights

    class Stale(type(stale)):
        def __call__(self, part, residual, weights, slots, final=False):
            return super().__call__(part, residual, first, slots, final=final)

    stale.__class__ = Stale
    inputs = {s: job.inputs(s, bench.CASE + s) for s in (1, 3)}
    (good_bad, good_outs), (stale_bad, _) = (bench.check_set(job, r, inputs, w, full, L, rec)
                                             for r, L in ((good, 2), (stale, 1)))
    out = {"good": good_bad, "stale": stale_bad, "outs": {s: [t.shape[0] for t in o] for s, o in good_outs.items()}}
    job.close()
    return out
