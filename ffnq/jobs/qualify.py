"""qualify, one rank: the case matrix against the fp64 reference, each rank checking itself.

Cases, in order (every check has fresh random inputs from (seed, case, step); the rank's own
peer rows and route scratch are poisoned with NaN / -7 first, and each output is NaN until the
kernel writes it, so a row nobody wrote fails):

* ``correct`` / ``correct+padding`` at every width (a third of the rows get slot -1, at least one;
  at width 1 that is its only row: ``all-padding``, every output row must be zero), and
  ``correct small-rms`` (inputs scaled by 1e-3, so the RMSNorm eps matters);
* ``two-runners``: a production and a timeline runner on one peer buffer alternate; every step
  must be correct and move the one shared epoch on by exactly 1;
* ``reset-mid-run``: a layer, a collective reset (epoch back to 0, no fault), then a step;
* ``other-weights``: a step on another layer's weights, then one on the job's own again, each
  checked against its own layer's oracle (a runner that keys what it derives from the weights,
  a packed copy or a dequant, by anything but those tensors answers with the old ones);
* ``run``: RUN_MIN_STEPS plus a seed-drawn 0..RUN_SPREAD-1 consecutive checked steps of one
  runner (widths, padding rows and ``final`` drawn from the seed): a fault that strikes every Nth
  call or epoch, N <= RUN_MIN_STEPS, falls on one of them whatever its phase (the other cases'
  ~40 steps would let a fault of period 50 through). Each step is checked against the fp64
  reference by one rank in turn (the agreement check below carries it to the others);
* per injected rank R: ``inject-under`` (delay 0.3 x timeout: correct, and every other rank's
  timeline shows it waited for R), ``inject-over`` (delay 2.5 x timeout: every rank reports a
  fault naming R, the others return before R arrives), ``recovery`` (reset, then correct);
* ``stale-epoch``: the last rank arrives late while the others hold the previous epoch and the
  one before it in their flags for it: the wait must not be satisfied (a fault, never a result),
  then ``recovery``.

Every checked step is judged three ways: elementwise against the oracle (``wrong``), in norm
against the step's own bound (``rel_err`` <= ``rel_bound``: reference.py derives it from the bf16
and activation roundings of that step), and across ranks: after the final reduce every rank holds
the same sum, so every rank's out and res_out must equal every other's, bit for bit where the
kernel sums the ranks in one order on every rank (cpu, triton); a runner whose order depends on
the rank declares ``CROSS_RANK_RTOL`` (elementwise, of |value| + the RMS). An error confined to
one rank's contribution, below any norm bound, shows there (``disagree``). The bound's activation
term takes the runner's ``ACT_MANTISSA_BITS`` (default: 24 for the cpu backend, which computes in
fp32; 8, bf16-like, for any other).

Each runner call runs under a deadline (records.call_deadline_s: the timeout, the injected delay,
and the call's own time) that the rank's heartbeat carries, so the launcher names a call that
never returns (rank, case, width).

One row per case per rank (table ``cases``); ``summarize`` merges them into one row per case.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ffnq import reference
from ffnq.dist import all_ranks, barrier
from ffnq.errors import RankFault, UsageError
from ffnq.jobs.qualify_cases import NOT_CHECKED, compact_fault, judged
from ffnq.jobs.rank import from_options
from ffnq.jobs.records import SET_UP, CallDeadlines, Records, clock_offsets, main
from ffnq.options import JobOptions
from ffnq.runner import NotReadable
from ffnq.spec import stamp_names
from ffnq.weights import shard, synthetic

MAX_INJECT_NS = 2**31 - 1  # inject ticks are int32


def under_delay_ns(timeout_s: float) -> int:
    """inject-under's delay: well inside the timeout, long enough to show as a wait."""
    return int(0.3 * timeout_s * 1e9)


def over_delay_ns(timeout_s: float) -> int:
    """inject-over's and stale-epoch's delay: past the timeout by half of it at least."""
    return min(int(2.5 * timeout_s * 1e9), MAX_INJECT_NS)


@dataclass
class QualifyOptions(JobOptions):
    inject_ranks: list[int] = field(default_factory=list)

    job = "qualify"

    def check(self) -> None:
        bad = [r for r in self.inject_ranks if not 0 <= r < self.tp]
        if bad:
            raise UsageError(f"--inject-rank {bad[0]}: allowed 0..{self.tp - 1} or all (tp={self.tp})")
        # the stale-epoch cases delay the last rank past the timeout at every tp > 1
        if (self.inject_ranks or self.tp > 1) and over_delay_ns(self.timeout_s) <= 1.5 * self.timeout_s * 1e9:
            raise UsageError(f"--timeout {self.timeout_s:g}: qualify's cases over the timeout need a delay above "
                             f"1.5 x timeout in int32 ns (< {MAX_INJECT_NS / 1e9:.2f} s); use --timeout <= 1.4")

    def work_s(self) -> float:
        t = self.timeout_s
        injected = len(self.inject_ranks) + (1 if self.tp > 1 else 0)
        run = (RUN_MIN_STEPS + RUN_SPREAD) * 1.0
        return 2 * len(self.widths) * 3.0 + 40 + run + injected * (3 * t + 2 * over_delay_ns(t) / 1e9 + 10)


RUN_MIN_STEPS, RUN_SPREAD = 100, 28  # the run case's length: 100 + a seed-drawn 0..27 steps
POISON_ROUTE = -7
OTHER_WEIGHTS_SEED = 7919  # other-weights' layer: synthetic from the job's seed plus this
WAIT_SEEN_FRACTION = 0.5  # an under-timeout delay must show as at least this much wait (of the delay)


class Qualify:
    def __init__(self, opts: dict, rec: Records):
        self.opts, self.rec = opts, rec
        self.job = from_options(opts)
        self.rank, self.tp = self.job.rank, self.job.tp
        self.widths = list(opts["widths"])
        self.wt = max(self.widths)  # width of the timeline runner and the fault cases
        self.main = self.job.runner(self.widths)
        self.tl = self.job.runner([self.wt], timeline=True)  # same peer buffer: shares the epoch
        for r in (self.main, self.tl):
            r.warm(self.job.weights, self.job.compute_units())
            r.poison_outputs = True
        self.offsets = clock_offsets(self.main.clock_ns)
        rec.row("clock", {"rank": self.rank, "offset_ns": self.offsets[self.rank], "rounds": 9,
                          "method": "median of (clock_ns on rank - on rank 0) after a barrier"})
        self.case_id = 0
        self.case = SET_UP
        self.deadlines = CallDeadlines(self.job.timeout)
        # the oracle's fp64 experts of the job's own weights, kept on the cpu (~300 MB for tiny; a
        # GPU's 256 minimax-m2 experts would be 29 GB: there each step dequantizes its own)
        self.cache: dict | None = {} if self.job.device.type == "cpu" else None

    # ---- one checked step ----------------------------------------------------------------------
    def step(self, r, s: int, padding: int = 0, final: bool = True, check: bool = True, scale: float = 1.0,
             weights=None, delay_ns: int = 0, versus_ref: bool = True) -> dict:
        """One step on ``weights`` (RankWeights and the FullWeights its oracle reads; the job's own
        if not given), checked unless ``check`` is off: against every other rank's outputs
        (collective: ``check`` is the same on every rank) and, where ``versus_ref``, the oracle."""
        rank_w, full = weights or (self.job.weights, self.job.full)
        self.case_id += 1
        parts, residual, slots = self.job.inputs(s, self.case_id, 0, padding)
        if scale != 1.0:
            parts = [(p.float() * scale).bfloat16() for p in parts]
            residual = (residual.float() * scale).bfloat16()
        barrier()  # no step in flight: safe to poison this rank's rows
        if check:  # (a runner of the original contract keeps its peer rows to itself: nothing to poison)
            for name, val in (("seam", float("nan")), ("moe", float("nan")), ("route", POISON_ROUTE),
                              ("route_w", float("nan"))):
                if r.readable(name, s):
                    r.view(s, name).fill_(val)
        barrier()
        t0 = time.perf_counter()
        raised = None
        out = res_out = None
        with self.rec.call(self.case, s, self.deadlines.deadline_s(r, s, delay_ns / 1e9)):
            try:
                out, res_out = r(parts[self.rank], residual, rank_w, slots, final=final)
                _sync(r.device)
            except RankFault as e:  # a runner may raise its fault record instead of leaving it
                raised = e.record
        wall = time.perf_counter() - t0
        ev = {"wall_ms": wall * 1e3, "fault": raised, "not_checked": []}
        if r.readable("fault", s):
            ev["fault"] = r.fault(s) or raised
        else:
            ev["not_checked"].append("fault record (no fault region)")
        if not delay_ns and not ev["fault"]:
            self.deadlines.took(wall)
        if check:
            ev |= self.agree(r, s, None if raised else out, res_out)
        if check and raised is None and versus_ref:
            # a near-tie row may pick either side: the oracle follows the kernel's admissible pick
            route = r.chosen(s).to(residual.device) if r.readable("route", s) else None
            cache = self.cache if full is self.job.full else None
            ref = reference.step(parts, residual, slots, full, self.job.model, self.job.experts, cache, follow=route,
                                 act_bits=reference.act_bits(r))
            # no route region: the outputs alone are judged, against the oracle's own route
            ev |= reference.evidence(r if route is not None else None, s, out, res_out, ref, slots)
            if route is None:
                ev["not_checked"].append("route (no route region)")
        return ev

    def agree(self, r, s: int, out, res_out) -> dict:
        """Collective: this rank's out and res_out against every other rank's, elementwise: equal
        (NaN equals NaN: the oracle fails those), or within the runner's CROSS_RANK_RTOL. A rank
        whose call raised its fault sends nothing to compare."""
        if self.tp == 1:
            return {"disagree": 0}
        n = 2 * s * self.job.model.hidden
        ok = out is not None and out.numel() + res_out.numel() == n
        have = all_ranks(int(ok))
        mine = torch.cat([out.float().flatten(), res_out.float().flatten()]).cpu() if ok else torch.zeros(n)
        got = [torch.empty_like(mine) for _ in range(self.tp)]
        dist.all_gather(got, mine)
        if not ok:
            return {"disagree": 0}
        rtol = float(getattr(r, "CROSS_RANK_RTOL", 0.0) or 0.0)
        bad, worst = [], 0.0
        for q in range(self.tp):
            if q != self.rank and have[q]:
                n_out, n_res, off = reference.disagreement(mine, got[q], rtol)
                worst = max(worst, off)
                if n_out or n_res:
                    bad.append((q, n_out, n_res))
        half = n // 2
        ev = {"disagree": sum(o + h for _, o, h in bad)}
        if bad:
            how = "bit for bit" if not rtol else f"within {rtol:g} (CROSS_RANK_RTOL)"
            ev["agree_txt"] = ("ranks disagree: " + "; ".join(
                f"out differs from rank {q}'s in {o}/{half} elements, res_out in {h}/{half}" for q, o, h in bad)
                + f" (largest {worst:.2g} of the RMS; after the reduce every rank must hold the same sum, {how})")
        return ev

    def run(self) -> None:
        plan = self.plan()
        for i, (name, s, fn) in enumerate(plan):
            self.rec.progress(i, len(plan), f"{name} w={s}")
            self.case = name
            try:
                got = fn()
            except NotReadable as e:  # every rank's runner is of one class: every rank ends here
                got = {"status": NOT_CHECKED, "evidence": f"not checked: {e}", "wall_ms": 0.0}
            got.pop("not_checked", None)  # said in status and evidence
            row = {"case": name, "width": s, "rank": self.rank} | got
            row["fault"] = compact_fault(row.get("fault"))
            self.rec.row("cases", row)
        self.rec.progress(len(plan), len(plan), "done")

    def plan(self) -> list:
        p = []
        for s in self.widths:
            p.append(("correct", s, lambda s=s: self.verdict(self.step(self.main, s, 0, final=False))))
            # a third of the rows padded, at least one and never all; one row padded is its own case
            p.append(("correct+padding" if s > 1 else "all-padding", s,
                      lambda s=s: self.verdict(self.step(self.main, s, max(1, s // 3), final=True))))
        # rows whose mean square (~1e-6) is comparable to the RMSNorm eps: the only inputs where
        # the eps shows (at unit scale 1e-5 vs 1e-6 moves the output by ~5e-6, under bf16's step)
        p.append(("correct small-rms", self.wt,
                  lambda: self.verdict(self.step(self.main, self.wt, 1, final=True, scale=1e-3))))
        p.append(("two-runners", self.wt, self.two_runners))
        p.append(("reset-mid-run", self.wt, self.reset_mid_run))
        p.append(("other-weights", self.wt, self.other_weights))
        p.append(("run", self.wt, self.steady_run))
        if self.tp > 1:
            for R in self.opts["inject_ranks"]:
                p.append((f"inject-under r{R}", self.wt, lambda R=R: self.inject_under(R)))
                p.append((f"inject-over r{R}", self.wt, lambda R=R: self.inject_over(R)))
                p.append((f"recovery r{R}", self.wt, self.recovery))
            for kind in ("older", "newer"):
                p.append((f"stale-epoch {kind} r{self.tp - 1}", self.wt, lambda k=kind: self.stale_epoch(k)))
                p.append((f"recovery stale-epoch {kind}", self.wt, self.recovery))
        return p

    # ---- cases ---------------------------------------------------------------------------------
    def verdict(self, ev: dict, problems: list[str] | None = None) -> dict:
        problems = list(problems or [])
        if ev.get("fault"):
            problems.insert(0, f"unexpected fault: {compact_fault(ev['fault'])}")
        if ev.get("disagree"):
            problems.append(ev["agree_txt"])
        if "rel_err" in ev:
            if ev["wrong"] or ev["over_bound"]:
                problems.append(ev["worst_txt"])
            if ev["route_mismatch"] or ev["route_w_wrong"]:
                problems.append(ev["route_txt"])
        return judged(ev, problems)

    def steady_run(self) -> dict:
        """RUN_MIN_STEPS + a seed-drawn 0..RUN_SPREAD-1 checked steps in a row on the main runner
        (each rank draws the same widths, padding and final from the seed); rank i % tp checks
        step i against the oracle, every rank checks every step against the others."""
        g = random.Random(self.job.seed * 1_000_003 + 4_111)
        n = RUN_MIN_STEPS + g.randrange(RUN_SPREAD)
        evs, bad = [], []
        for i in range(n):
            s = g.choice(self.widths)
            padding, final = g.randrange(s), g.random() < 0.5  # at least one live row
            ev = self.verdict(self.step(self.main, s, padding, final=final, versus_ref=i % self.tp == self.rank))
            if ev["status"] == "FAIL":
                bad.append(f"step {i + 1} of {n} (w={s}): {ev['evidence']}")
            evs.append(ev)
        out = self.worst(evs, [])  # FAIL on a failed step, else NOT CHECKED or PASS, as judged says
        if bad:  # the count and the first two, in place of the first one's evidence alone
            out["evidence"] = f"{len(bad)} of {n} steps failed; " + "; ".join(bad[:2])
        out["steps"] = n
        return out

    def two_runners(self) -> dict:
        evs, problems = [], []
        a = min(self.widths)
        for i in range(6):
            r, s = (self.main, a) if i % 2 == 0 else (self.tl, self.wt)
            before = int(self.main.epoch[0])
            ev = self.step(r, s, padding=i % 3, final=i == 5)
            after = (int(self.main.epoch[0]), int(self.tl.epoch[0]))
            if after != (before + 1, before + 1):
                problems.append(f"step {i}: epoch {before} -> main {after[0]}, timeline {after[1]} (want {before + 1})")
            evs.append(self.verdict(ev))
        return self.worst(evs, problems)

    def reset_mid_run(self) -> dict:
        self.step(self.main, self.wt, final=False, check=False)
        self.reset()
        problems, unread = self.after_reset()  # before the next launch could hide a stale record
        ev = self.step(self.main, self.wt, 1, final=True)
        ev["not_checked"] += unread
        return self.verdict(ev, problems)

    def other_weights(self) -> dict:
        job = self.job
        full = synthetic(job.model, job.seed + OTHER_WEIGHTS_SEED, job.device, job.routing)
        other = (shard(full, job.model, job.tp, job.rank, job.experts), full)
        evs = [self.verdict(self.step(self.main, self.wt, 1, final=False, weights=other)),
               self.verdict(self.step(self.main, self.wt, 0, final=True))]
        return self.worst(evs, [])

    def inject_under(self, R: int) -> dict:
        delay = under_delay_ns(self.job.timeout)
        self.tl.inject.copy_(torch.tensor([R + 1, delay], dtype=torch.int32))
        try:
            ev = self.step(self.tl, self.wt, 1, final=True, delay_ns=delay)
        finally:
            self.tl.inject.zero_()
        waits = self.timeline(f"inject-under r{R}")  # NotReadable without one: the case is its wait
        problems = []
        if self.rank != R:
            waited = waits.get(R, 0)
            ev["waited_ms"] = waited / 1e6
            if waited < WAIT_SEEN_FRACTION * delay:
                problems.append(f"timeline shows a wait of {waited / 1e6:.1f} ms for rank {R}, "
                                f"delay was {delay / 1e6:.0f} ms")
        return self.verdict(ev, problems)

    def inject_over(self, R: int, stale: bool = False) -> dict:
        delay = over_delay_ns(self.job.timeout)
        self.tl.inject.copy_(torch.tensor([R + 1, delay], dtype=torch.int32))
        try:
            ev = self.step(self.tl, self.wt, 0, final=True, check=False, delay_ns=delay)
        finally:
            self.tl.inject.zero_()
        self.trace(f"{'stale-epoch' if stale else 'inject-over'} r{R}")
        return self.expect_fault(ev, R, delay)

    def expect_fault(self, ev: dict, R: int, delay: int) -> dict:
        f, problems = ev["fault"], []
        if f is None and ev.get("not_checked"):  # the fault record is the case: unread, it is not checked
            return judged(ev, [])
        if f is None:
            problems.append(f"no fault: rank {R} was {delay / 1e6:.0f} ms late, timeout "
                            f"{self.job.timeout * 1e3:.0f} ms")
        elif R not in f.get("missing_ranks", []):
            problems.append(f"fault names rank(s) {f.get('missing_ranks')}, not {R}")
        if self.rank != R and ev["wall_ms"] * 1e6 >= delay:
            problems.append(f"returned after {ev['wall_ms']:.0f} ms: waited out rank {R}'s "
                            f"{delay / 1e6:.0f} ms delay instead of the {self.job.timeout * 1e3:.0f} ms bound")
        return judged(ev, problems)

    def stale_epoch(self, kind: str) -> dict:
        """Rank tp-1 is late; every other rank holds stale epochs in its flags for it: ``older``
        the previous epoch and the one before (a wait that accepts any flag fails), ``newer``
        epochs ahead of the step's, as a life before a reset leaves them (a wait that accepts
        flag >= epoch fails)."""
        R, s = self.tp - 1, self.wt
        unread = [n for n in ("flags", "seam_ll", "moe_ll") if not self.tl.readable(n, s)]
        if unread:  # checked on every rank before any launch: the ranks take one branch
            return {"status": NOT_CHECKED, "wall_ms": 0.0, "evidence": f"not checked: the stale tags cannot be "
                    f"planted ({', '.join(unread)}: the runner's peer-buffer layout is its own)"}
        for _ in range(2):  # move the epoch on, so "previous" and "previous - 1" are distinct live tags
            self.step(self.tl, s, final=True, check=False)
        barrier()
        e = int(self.tl.epoch[0])  # the step below runs at the next epoch
        vals = (e, max(e - 1, 1)) if kind == "older" else (e + 2, e + 7)
        if self.rank != R:
            flags = self.tl.view(s, "flags")  # [phase][cta][src]
            for c in range(flags.shape[1]):
                flags[:, c, R] = vals[c % 2]
            for name in ("seam_ll", "moe_ll"):  # the tagged words of R's slots [parity][src][row][col]
                words = self.tl.view(s, name)
                words[:, R, :, 0::2] = vals[0] << 32
                words[:, R, :, 1::2] = vals[1] << 32
        delay = over_delay_ns(self.job.timeout)
        self.tl.inject.copy_(torch.tensor([R + 1, delay], dtype=torch.int32))
        try:
            ev = self.step(self.tl, s, 0, final=True, check=False, delay_ns=delay)
        finally:
            self.tl.inject.zero_()
        self.trace(f"stale-epoch {kind} r{R}")
        ev["evidence_pre"] = f"flags for rank {R} held epochs {vals[0]} and {vals[1]}; step epoch {e + 1}"
        out = self.expect_fault(ev, R, delay)
        out["evidence"] = out["evidence"] or out.pop("evidence_pre")
        out.pop("evidence_pre", None)
        return out

    def recovery(self) -> dict:
        """After a fault: the collective reset must clear every width's fault record and the
        epoch (checked before any launch could hide it), then the next step must be correct."""
        self.reset()
        problems, unread = self.after_reset()
        ev = self.step(self.main, self.wt, 1, final=True)
        ev["not_checked"] += unread
        return self.verdict(ev, problems)

    def after_reset(self) -> tuple[list[str], list[str]]:
        """(problems, what could not be read) right after a reset."""
        problems, unread = [], []
        if int(self.main.epoch[0]) != 0:
            problems.append(f"epoch {int(self.main.epoch[0])} after reset (want 0)")
        for name, r in (("main", self.main), ("timeline", self.tl)):
            if not r.readable("fault"):
                unread.append(f"{name} runner's fault records cleared by reset (no fault region)")
                continue
            left = [s for s in r.widths if r.fault(s) is not None]
            if left:
                problems.append(f"{name} runner: fault record of width(s) {left} not cleared by reset")
        return problems, unread

    # ---- helpers -------------------------------------------------------------------------------
    def reset(self) -> None:
        for r in (self.main, self.tl):
            r.reset()

    def worst(self, evs: list[dict], problems: list[str]) -> dict:
        bad = [e for e in evs if e["status"] == "FAIL"]
        ev = dict(max(evs, key=lambda e: e.get("margin", 0)) if not bad else bad[0])
        for k in ("wrong", "elements", "route_rows", "route_mismatch", "route_excused", "route_w_wrong", "disagree"):
            ev[k] = sum(e.get(k, 0) for e in evs)
        ev["wall_ms"] = sum(e["wall_ms"] for e in evs)
        ev["not_checked"] = sorted({n for e in evs for n in e.get("not_checked") or []})
        problems = problems + ([ev["evidence"]] if bad else [])
        return judged(ev, problems)

    def trace(self, case: str) -> None:
        """The timeline rows of a case that judges no wait (the report's), where the runner has one."""
        if self.tl.readable("timeline", self.wt):
            self.timeline(case)

    def timeline(self, case: str) -> dict[int, int]:
        """Write this rank's timeline rows; return the longest seam wait (ns) per source rank."""
        tl = self.tl.view(self.wt, "timeline").cpu()
        names = stamp_names(self.tp)
        off = self.offsets[self.rank]
        for c in range(tl.shape[0]):
            for j, n in enumerate(names):
                t = int(tl[c, j])
                if t:
                    self.rec.row("timeline", {"case": case, "rank": self.rank, "cta": c, "stamp": n,
                                              "t_ns": t, "t_common_ns": t - off})
        waits = {}
        arrive = names.index("seam_arrive")
        for src in range(self.tp):
            seen = names.index(f"seam_seen{src}")
            w = [int(tl[c, seen] - tl[c, arrive]) for c in range(tl.shape[0]) if tl[c, seen] and tl[c, arrive]]
            waits[src] = max(w, default=0)
        return waits


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def body(opts: dict, rec: Records) -> None:
    q = Qualify(opts, rec)
    try:
        q.run()
    finally:
        barrier()
        q.job.close()


if __name__ == "__main__":
    main(body)
