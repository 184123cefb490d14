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
* per injected rank R: ``inject-under`` (delay 0.3 x timeout: correct, and every other rank's
  timeline shows it waited for R), ``inject-over`` (delay 2.5 x timeout: every rank reports a
  fault naming R, the others return before R arrives), ``recovery`` (reset, then correct);
* ``stale-epoch``: the last rank arrives late while the others hold the previous epoch and the
  one before it in their flags for it: the wait must not be satisfied (a fault, never a result),
  then ``recovery``.

One row per case per rank (table ``cases``); ``summarize`` merges them into one row per case.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import pandas as pd
import torch

from ffnq import reference
from ffnq.dist import barrier
from ffnq.errors import RankFault, UsageError
from ffnq.jobs.rank import from_options
from ffnq.jobs.records import Records, clock_offsets, main
from ffnq.options import JobOptions
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
        return 2 * len(self.widths) * 3.0 + 40 + injected * (3 * t + 2 * over_delay_ns(t) / 1e9 + 10)


POISON_ROUTE = -7
ROUTE_W_ATOL = 1e-4  # routing weights (each ~1/k, summing to 1) against the oracle's
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

    # ---- one checked step ----------------------------------------------------------------------
    def step(self, r, s: int, padding: int = 0, final: bool = True, check: bool = True, scale: float = 1.0,
             weights=None) -> dict:
        """One step on ``weights`` (RankWeights and the FullWeights its oracle reads; the job's own
        if not given), checked unless ``check`` is off."""
        rank_w, full = weights or (self.job.weights, self.job.full)
        self.case_id += 1
        parts, residual, slots = self.job.inputs(s, self.case_id, 0, padding)
        if scale != 1.0:
            parts = [(p.float() * scale).bfloat16() for p in parts]
            residual = (residual.float() * scale).bfloat16()
        barrier()  # no step in flight: safe to poison this rank's rows
        if check:
            for name in ("seam", "moe"):
                r.view(s, name).fill_(float("nan"))
            r.view(s, "route").fill_(POISON_ROUTE)
            r.view(s, "route_w").fill_(float("nan"))
        barrier()
        t0 = time.perf_counter()
        raised = None
        try:
            out, res_out = r(parts[self.rank], residual, rank_w, slots, final=final)
            _sync(r.device)
        except RankFault as e:  # a runner may raise its fault record instead of leaving it
            raised = e.record
        wall_ms = (time.perf_counter() - t0) * 1e3
        ev = {"wall_ms": wall_ms, "fault": r.fault(s) or raised}
        if check and raised is None:
            # a near-tie row may pick either side: the oracle follows the kernel's admissible pick
            route = r.chosen(s).to(residual.device)
            ref = reference.step(parts, residual, slots, full, self.job.model, self.job.experts, follow=route)
            ev |= evidence(r, s, out, res_out, ref, slots)
        return ev

    def run(self) -> None:
        plan = self.plan()
        for i, (name, s, fn) in enumerate(plan):
            self.rec.progress(i, len(plan), f"{name} w={s}")
            row = {"case": name, "width": s, "rank": self.rank} | fn()
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
        if "rel_err" in ev:
            if ev["wrong"] or not ev["rel_err"] <= reference.MAX_REL_ERR:
                problems.append(ev["worst_txt"])
            if ev["route_mismatch"] or ev["route_w_wrong"]:
                problems.append(ev["route_txt"])
        ev["status"] = "FAIL" if problems else "PASS"
        ev["evidence"] = "; ".join(problems)
        for k in ("worst_txt", "route_txt"):
            ev.pop(k, None)
        return ev

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
        problems = self.after_reset()  # before the next launch could hide a stale record
        return self.verdict(self.step(self.main, self.wt, 1, final=True), problems)

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
            ev = self.step(self.tl, self.wt, 1, final=True)
        finally:
            self.tl.inject.zero_()
        waits = self.timeline(f"inject-under r{R}")
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
            ev = self.step(self.tl, self.wt, 0, final=True, check=False)
        finally:
            self.tl.inject.zero_()
        self.timeline(f"{'stale-epoch' if stale else 'inject-over'} r{R}")
        return self.expect_fault(ev, R, delay)

    def expect_fault(self, ev: dict, R: int, delay: int) -> dict:
        f, problems = ev["fault"], []
        if f is None:
            problems.append(f"no fault: rank {R} was {delay / 1e6:.0f} ms late, timeout "
                            f"{self.job.timeout * 1e3:.0f} ms")
        elif R not in f.get("missing_ranks", []):
            problems.append(f"fault names rank(s) {f.get('missing_ranks')}, not {R}")
        if self.rank != R and ev["wall_ms"] * 1e6 >= delay:
            problems.append(f"returned after {ev['wall_ms']:.0f} ms: waited out rank {R}'s "
                            f"{delay / 1e6:.0f} ms delay instead of the {self.job.timeout * 1e3:.0f} ms bound")
        ev["status"] = "FAIL" if problems else "PASS"
        ev["evidence"] = "; ".join(problems)
        return ev

    def stale_epoch(self, kind: str) -> dict:
        """Rank tp-1 is late; every other rank holds stale epochs in its flags for it: ``older``
        the previous epoch and the one before (a wait that accepts any flag fails), ``newer``
        epochs ahead of the step's, as a life before a reset leaves them (a wait that accepts
        flag >= epoch fails)."""
        R, s = self.tp - 1, self.wt
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
            ev = self.step(self.tl, s, 0, final=True, check=False)
        finally:
            self.tl.inject.zero_()
        self.timeline(f"stale-epoch {kind} r{R}")
        ev["evidence_pre"] = f"flags for rank {R} held epochs {vals[0]} and {vals[1]}; step epoch {e + 1}"
        out = self.expect_fault(ev, R, delay)
        out["evidence"] = out["evidence"] or out.pop("evidence_pre")
        out.pop("evidence_pre", None)
        return out

    def recovery(self) -> dict:
        """After a fault: the collective reset must clear every width's fault record and the
        epoch (checked before any launch could hide it), then the next step must be correct."""
        self.reset()
        problems = self.after_reset()
        return self.verdict(self.step(self.main, self.wt, 1, final=True), problems)

    def after_reset(self) -> list[str]:
        problems = []
        if int(self.main.epoch[0]) != 0:
            problems.append(f"epoch {int(self.main.epoch[0])} after reset (want 0)")
        for name, r in (("main", self.main), ("timeline", self.tl)):
            left = [s for s in r.widths if r.fault(s) is not None]
            if left:
                problems.append(f"{name} runner: fault record of width(s) {left} not cleared by reset")
        return problems

    # ---- helpers -------------------------------------------------------------------------------
    def reset(self) -> None:
        for r in (self.main, self.tl):
            r.reset()

    def worst(self, evs: list[dict], problems: list[str]) -> dict:
        bad = [e for e in evs if e["status"] == "FAIL"]
        ev = dict(max(evs, key=lambda e: e.get("rel_err", 0)) if not bad else bad[0])
        for k in ("wrong", "elements", "route_rows", "route_mismatch", "route_excused", "route_w_wrong"):
            ev[k] = sum(e.get(k, 0) for e in evs)
        ev["wall_ms"] = sum(e["wall_ms"] for e in evs)
        problems = problems + ([ev["evidence"]] if bad else [])
        ev["status"] = "FAIL" if problems else "PASS"
        ev["evidence"] = "; ".join(problems)
        return ev

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


def evidence(r, s, out, res_out, ref, slots) -> dict:
    c_out, c_res = reference.compare(out, ref.out), reference.compare(res_out, ref.res_out)
    pad = (slots[:s] < 0).to(out.device)
    pad_nonzero = int((out[pad] != 0).sum())
    got = r.chosen(s).cpu().sort(-1).values
    want = ref.chosen.cpu()
    bad_rows = ~(got == want).all(-1)
    tie = ref.near_tie.cpu()
    mismatch = bad_rows  # the reference already took the kernel's pick where a near tie allows it
    # the routing weights the kernel reports for its experts (a padding row's are 0): fp32 from fp32
    # logits, so within ROUTE_W_ATOL of the oracle's (a weight off by that moves the output under
    # bf16's step); rows whose experts differ are already counted above
    w_got = r.chosen_weights(s).cpu().double()
    wdiff = (w_got - ref.weights.cpu()).abs()[~bad_rows].nan_to_num(float("inf"))
    w_wrong = int((wdiff > ROUTE_W_ATOL).sum())
    worst_c = c_out if c_out["rel_err"] >= c_res["rel_err"] else c_res
    w = worst_c["worst"] or {}
    which = "out" if worst_c is c_out else "res_out"
    ev = {"rel_err": max(c_out["rel_err"], c_res["rel_err"]), "wrong": c_out["wrong"] + c_res["wrong"] + pad_nonzero,
          "elements": c_out["elements"] + c_res["elements"], "route_rows": s,
          "route_mismatch": int(mismatch.sum()), "route_excused": int((tie & ~bad_rows).sum()),
          "route_w_wrong": w_wrong,
          "worst_txt": (f"{which}[{w.get('row')},{w.get('col')}] expected {w.get('expected', 0):.5g} got "
                        f"{w.get('got', 0):.5g}; {c_out['wrong'] + c_res['wrong']} wrong"
                        + (f", {pad_nonzero} nonzero in padding rows" if pad_nonzero else ""))}
    if mismatch.any():
        i = int(mismatch.nonzero()[0])
        ev["route_txt"] = f"route row {i}: expected {want[i].tolist()} got {got[i].tolist()}"
    elif w_wrong:
        row = int((~bad_rows).nonzero().flatten()[int(wdiff.argmax()) // wdiff.shape[1]])
        ev["route_txt"] = (f"route_w row {row}: expected {ref.weights[row].tolist()} got "
                           f"{w_got[row].tolist()}; {w_wrong} weights off by > {ROUTE_W_ATOL:g}")
    return ev


def compact_fault(f) -> str:
    if not f:
        return ""
    if isinstance(f, str):
        return f
    return (f"r{f.get('rank')}:{f.get('phase_name')} e{f.get('epoch')} missing {f.get('missing_ranks')} "
            f"after {f.get('waited_ns', 0) / 1e6:.0f}ms")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def summarize(cases: pd.DataFrame) -> pd.DataFrame:
    """One row per case: PASS only when every rank passed; errors maxed, counts summed."""
    rows = []
    for (case, width), g in cases.groupby(["case", "width"], sort=False):
        bad = g[g.status != "PASS"]
        num = lambda k: g[k].fillna(0) if k in g else pd.Series([0])  # noqa: E731
        rows.append({
            "case": case, "width": int(width), "status": "FAIL" if len(bad) else "PASS",
            "rel_err": float(g["rel_err"].max()) if "rel_err" in g else float("nan"), "wrong": int(num("wrong").sum()),
            "elements": int(num("elements").sum()),
            "route_agree": f"{int(num('route_rows').sum() - num('route_mismatch').sum())}/{int(num('route_rows').sum())}"
                           + (f" ({int(num('route_excused').sum())} tie)" if num("route_excused").sum() else ""),
            "route_mismatch": int(num("route_mismatch").sum()),
            "fault": "; ".join(f for f in g["fault"].fillna("") if f),
            "wall_ms": float(g.wall_ms.max()),
            "evidence": "; ".join(f"r{r}: {e}" for r, e in zip(bad["rank"], bad["evidence"].fillna("")) if e),
        })
    return pd.DataFrame(rows)


def body(opts: dict, rec: Records) -> None:
    q = Qualify(opts, rec)
    try:
        q.run()
    finally:
        barrier()
        q.job.close()


if __name__ == "__main__":
    main(body)
