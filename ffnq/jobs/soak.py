"""soak, one rank: many random steps, every one checked, with optional chaos.

Each step draws its width, padding rows, ``final`` and which of the runners (sharing one peer
buffer, so one epoch) from (seed, step) alone, so every rank agrees with no communication.
Checks: every rank's output checksum must equal every other's, every step; rank ``step % tp``
also compares the step with the fp64 reference (all steps on cpu; one in ``check_every`` on a
GPU), which follows the kernel's pick on a near-tie row when that pick is admissible, its
rel_err held to the step's own bound (reference.py). A mismatch whose output matches an earlier
step's expected output of the same width is counted as a stale match too (data from another
epoch). A fault ends the job: the rank raises it after writing its counts, so the report keeps
every step that finished; the counts also ride on every heartbeat (every 0.5 s), so a rank
killed from outside shows its last count, not zero.

Chaos: ``kill_rank`` ends itself with SIGKILL at ``at_step``; ``hang_rank`` stops arriving
(sleeps) at ``at_step``; the others must report it within their timeout.
"""
from __future__ import annotations

import os
import random
import signal
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ffnq import reference
from ffnq.errors import RankFault, UsageError
from ffnq.jobs.rank import from_options
from ffnq.jobs.records import CallDeadlines, Records, main
from ffnq.options import JobOptions

MAX_RUNNERS, MAX_STEPS = 16, 100_000_000


@dataclass
class SoakOptions(JobOptions):
    steps: int = 1000
    random_padding: bool = True
    runners: int = 2
    check_every: int | None = None  # None: every step on cpu, 1 in 100 on a GPU
    kill_rank: int | None = None
    hang_rank: int | None = None
    at_step: int | None = None

    job = "soak"

    def check(self) -> None:
        if self.check_every is not None and self.check_every < 1:
            raise UsageError(f"--check-every {self.check_every}: must be >= 1")
        for name in ("kill_rank", "hang_rank"):
            r = getattr(self, name)
            if r is not None and not 0 <= r < self.tp:
                raise UsageError(f"--{name.replace('_', '-')} {r}: allowed 0..{self.tp - 1} (tp={self.tp})")
        if (self.kill_rank is not None or self.hang_rank is not None) and self.at_step is None:
            raise UsageError("--kill-rank/--hang-rank need --at-step K")
        if self.kill_rank is not None and self.hang_rank is not None:
            raise UsageError(f"--kill-rank {self.kill_rank} and --hang-rank {self.hang_rank}: allowed one fault "
                             "per soak")
        if self.at_step is not None and self.kill_rank is None and self.hang_rank is None:
            raise UsageError(f"--at-step {self.at_step}: needs --kill-rank or --hang-rank (the fault it places)")
        if self.at_step is not None and not 0 <= self.at_step < self.steps:
            raise UsageError(f"--at-step {self.at_step}: allowed 0..{self.steps - 1} (--steps {self.steps})")
        if not (1 <= self.steps <= MAX_STEPS and 1 <= self.runners <= MAX_RUNNERS):
            raise UsageError(f"--steps {self.steps} / --runners {self.runners}: allowed 1..{MAX_STEPS} / "
                             f"1..{MAX_RUNNERS}")

    def work_s(self) -> float:  # a last resort: the kernel's bounded waits end a faulted soak first
        return 60 + self.steps * 0.1 + 5 * self.timeout_s


SOAK_CASE = 7_000_001  # input stream of the soak, apart from qualify's cases
CHECKPOINT_STEPS = 1000
PROGRESS_S = 2.0  # rank 0 tells the launcher's bar where it is at least this often
WARM_STEPS = 500  # by then the reference's fp64 weight cache and the allocators are full: RSS is
                  # read there too, and growth after it is what a leak would show
HANG_S = 24 * 3600  # the launcher's deadline or torchrun's teardown ends it first


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def draw(seed: int, step: int, widths: list[int], random_padding: bool, runners: int):
    g = random.Random(seed * 1_000_003 + step)
    s = g.choice(widths)
    padding = g.randint(0, s) if random_padding else 0
    return s, padding, g.random() < 0.5, g.randrange(runners)


def checksum(out: torch.Tensor, res_out: torch.Tensor) -> torch.Tensor:
    return torch.stack([out.double().sum(), out.double().abs().sum(), res_out.double().sum()]).cpu()


class Terminated(Exception):
    """SIGTERM (torchrun ending the job after another rank died): report, then go."""


def _on_term(signum, frame):
    raise Terminated()


class Soak:
    def __init__(self, opts: dict, rec: Records):
        self.opts, self.rec = opts, rec
        self.job = from_options(opts)
        self.rank, self.tp = self.job.rank, self.job.tp
        self.runners = [self.job.runner(opts["widths"]) for _ in range(opts.get("runners", 2))]
        rec.progress(0, opts["steps"], "warming the runners")
        for r in self.runners:
            r.warm(self.job.weights, self.job.compute_units())
            r.poison_outputs = True  # every step's checksum is exchanged: none may pass on stale memory
        gpu = self.job.device.type != "cpu"
        self.check_every = opts.get("check_every") or (100 if gpu else 1)
        self.cache: dict = {}
        self.history: dict[int, deque] = {}
        self.n = dict(steps=0, checked=0, mismatches=0, stale=0, disagree=0, faults=0)
        self.rss0 = rss_mb()
        self.rss_warm = None
        self.deadlines = CallDeadlines(self.job.timeout)
        self.rec.counts = lambda: dict(self.n)  # on every heartbeat: a rank killed from outside keeps its count
        self.rec.phase("soak")

    def counts(self, t0: float) -> dict:
        dt = time.perf_counter() - t0
        return {"rank": self.rank, **self.n, "steps_per_s": self.n["steps"] / dt if dt else 0.0,
                "rss_start_mb": round(self.rss0, 1), "rss_warm_mb": self.rss_warm, "rss_end_mb": round(rss_mb(), 1),
                "wall_s": round(dt, 2)}

    def run(self) -> None:
        t0 = time.perf_counter()
        signal.signal(signal.SIGTERM, _on_term)
        try:
            self.loop(t0)
        except Terminated:
            self.rec.row("soak", self.counts(t0) | {"ended": f"terminated after {self.n['steps']} steps"})
            raise SystemExit(143) from None

    def loop(self, t0: float) -> None:
        o = self.opts
        steps = o["steps"]
        self.rec.progress(0, steps, "first step")
        told = time.monotonic()
        for step in range(steps):
            if step == o.get("at_step"):
                self.chaos(t0)
            self.one(step, t0)
            self.n["steps"] += 1
            if step + 1 == min(WARM_STEPS, steps):
                self.rss_warm = round(rss_mb(), 1)
            if time.monotonic() - told >= PROGRESS_S or step + 1 == steps:
                self.rec.progress(step + 1, steps, f"steps, {self.n['mismatches']} mismatches")
                told = time.monotonic()
            if (step + 1) % CHECKPOINT_STEPS == 0:
                self.rec.write("checkpoint", **self.counts(t0))
        self.rec.row("soak", self.counts(t0) | {"ended": "ok"})

    def one(self, step: int, t0: float) -> None:
        """Step ``step`` of the stream: drawn, run, checked (alone it replays that step)."""
        o = self.opts
        s, padding, final, ri = draw(self.job.seed, step, o["widths"], o.get("random_padding", True), len(self.runners))
        r = self.runners[ri]
        parts, residual, slots = self.job.inputs(s, SOAK_CASE, step, padding)
        t = time.perf_counter()
        with self.rec.call(f"soak step {step}", s, self.deadlines.deadline_s(r, s)):
            out, res_out = r(parts[self.rank], residual, self.job.weights, slots, final=final)
        self.deadlines.took(time.perf_counter() - t)  # a faulted call ends the soak: no later deadline
        fault = r.fault(s)
        if fault:
            self.n["faults"] += 1
            self.rec.row("soak", self.counts(t0) | {"ended": f"fault at step {step}"})
            raise RankFault(fault)
        self.check(step, s, parts, residual, slots, out, res_out, r)

    def chaos(self, t0: float) -> None:
        o = self.opts
        if o.get("kill_rank") == self.rank:
            self.rec.write("chaos", what=f"rank {self.rank} kills itself (SIGKILL) at step {o['at_step']}")
            # its counts so far, as a checkpoint: the report keeps every rank's counts up to the fault
            self.rec.write("checkpoint", **self.counts(t0))
            os.kill(os.getpid(), signal.SIGKILL)
        if o.get("hang_rank") == self.rank:
            self.rec.write("chaos", what=f"rank {self.rank} stops arriving at step {o['at_step']}")
            time.sleep(HANG_S)

    def check(self, step, s, parts, residual, slots, out, res_out, r) -> None:
        # rank step % tp compares with fp64 before the checksums' all_gather: the all_gather
        # holds the peers on the host until it is done, not in the next launch's seam wait,
        # whose timeout would otherwise count the check (a TP3 cpu soak on two cores faulted so)
        verdict = self.versus_reference(step, s, parts, residual, slots, out, res_out, r)
        mine = checksum(out, res_out)
        if self.tp > 1:
            got = [torch.zeros_like(mine) for _ in range(self.tp)]
            dist.all_gather(got, mine)
            if any(not torch.equal(g, mine) for g in got):
                self.n["disagree"] += 1
                self.n["mismatches"] += 1
                self.rec.row("mismatch", {"step": step, "width": s, "rank": self.rank, "why": "ranks disagree"})
                return
        if verdict is None:
            return
        ok, row, ref_out = verdict
        self.n["checked"] += 1
        hist = self.history.setdefault(s, deque(maxlen=4))
        if not ok:
            self.n["mismatches"] += 1
            # an output equal to an earlier step's expected one of this width: another epoch's data
            stale = any(reference.compare(out, old)["wrong"] == 0 for old in hist)
            self.n["stale"] += stale
            self.rec.row("mismatch", {"step": step, "width": s, "rank": self.rank, "stale": stale, **row})
        hist.append(ref_out)

    def versus_reference(self, step, s, parts, residual, slots, out, res_out, r) -> tuple | None:
        """(ok, the mismatch row's numbers, the fp64 output) on the steps this rank checks, else None."""
        if step % self.tp != self.rank or (step // self.tp) % self.check_every:
            return None
        # a near-tie row may pick either side: the oracle follows the kernel's pick there when it
        # is admissible, so that row's output is checked against the experts really used
        route = r.chosen(s).to(residual.device)
        ref = reference.step(parts, residual, slots, self.job.full, self.job.model, self.job.experts, self.cache,
                             follow=route, act_bits=reference.act_bits(r))
        c, cr = reference.compare(out, ref.out), reference.compare(res_out, ref.res_out)
        route_ok = bool((route == ref.chosen).all())
        in_bound = c["rel_err"] <= ref.rel_bound_out and cr["rel_err"] <= ref.rel_bound_res
        ok = in_bound and c["wrong"] == 0 and cr["wrong"] == 0 and route_ok
        return ok, {"rel_err": c["rel_err"], "rel_bound": ref.rel_bound_out, "res_rel_err": cr["rel_err"],
                    "res_rel_bound": ref.rel_bound_res, "wrong": c["wrong"], "route_ok": route_ok,
                    "worst": c["worst"]}, ref.out


def summarize(recs: list[dict], tp: int, error: str | None = None):
    """One row per rank from its final ``soak`` row, else the later of its last checkpoint and its
    last heartbeat's counts (a rank that died or hung); and the mismatch rows."""
    import pandas as pd

    final, last, bad = {}, {}, []
    for r in recs:
        if r.get("kind") == "row" and r.get("table") == "soak":
            final[r["rank"]] = r["data"]
        elif r.get("kind") == "row" and r.get("table") == "mismatch":
            bad.append(r["data"])
        elif r.get("kind") == "checkpoint":
            last[r["rank"]] = {k: v for k, v in r.items() if k not in ("kind", "t")}
        elif r.get("kind") == "beat" and isinstance(r.get("counts"), dict):
            if r["counts"].get("steps", 0) >= last.get(r["rank"], {}).get("steps", -1):
                last[r["rank"]] = {"rank": r["rank"], **r["counts"]}
    rows = []
    for rank in range(tp):
        row = final.get(rank) or (last.get(rank, {"rank": rank, "steps": 0}) | {"ended": "no final word"})
        rows.append({"rank": rank} | {k: row.get(k) for k in ("steps", "checked", "mismatches", "stale",
                                                               "disagree", "faults", "steps_per_s", "rss_start_mb",
                                                               "rss_warm_mb", "rss_end_mb", "wall_s", "ended")})
    table = pd.DataFrame(rows)
    for c in ("steps", "checked", "mismatches", "stale", "disagree", "faults"):
        table[c] = table[c].fillna(0).astype(int)
    return table, pd.DataFrame(bad)


def body(opts: dict, rec: Records) -> None:
    soak = Soak(opts, rec)
    try:
        soak.run()
    finally:
        soak.job.close()


if __name__ == "__main__":
    main(body)
