"""What every job's rank shares: options in, JSON-line records out, a heartbeat, clock offsets,
the entry.

A rank appends to ``<result_dir>/rank<r>.jsonl``: ``start`` (pid, host), ``progress``
(done/total/what), ``row`` (table name + one dict), then ``done`` or ``error`` (the exception,
one line; ``usage``: bad input found on a rank, a runner whose construction or warm-up raised
(rank.runner_error), exit 2; ``use``: a UsageError's flag to change, apart from its line;
``peer_loss``: an error that another rank's death or hang causes here, never the verdict while
that rank can be named). At the end rank 0 gathers every rank's rows into ``all.jsonl``.

The heartbeat: a thread rewrites ``rank<r>.beat`` every BEAT_S with what the rank is doing
(``phase``; inside a runner call also ``case``, ``width``, the seconds it has run and its
deadline; any counts the job publishes). The launcher's watchdog reads it: a beat that stops (a
stopped or frozen process) or a call past its deadline (a kernel with no bounded wait) names the
rank, in seconds rather than at gloo's 120 s collective timeout.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ffnq.dist import barrier
from ffnq.errors import RankFault, UsageError

CLOCK_ROUNDS = 9  # barrier + clock_ns samples; the median is the offset
BEAT_S = 0.5  # the heartbeat's period
FIRST_CALL_S = 10.0  # a runner call's own time before any call of the rank was timed
STEP_SLACK_S, SLOW_FACTOR = 2.0, 10.0  # after: this + SLOW_FACTOR x the slowest call so far
SET_UP = "set-up"  # a rank's phase until its job's own work begins: the watchdog allows it SETUP_STALL_S
SET_UP_PHASE = f"{SET_UP} (process group, peer buffers, weights, warm)"  # as the heartbeat, bar and errors say it
# what another rank's death or hang makes a collective or a bounded wait raise here (gloo, NCCL)
PEER_LOSS = ("connection closed", "connection reset", "connection refused", "broken pipe", "closed by peer",
             "timed out", "gloo", "nccl", "socket")


def peer_loss(e: BaseException) -> bool:
    """An error that another rank's death or hang causes on this one: a collective's connection
    error or timeout, or a bounded wait that expired (RankFault names the missing ranks)."""
    if isinstance(e, RankFault):
        return True
    if isinstance(e, UsageError):
        return False
    text = f"{type(e).__name__} {e}".lower()
    return type(e).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError") or (
        isinstance(e, (RuntimeError, OSError)) and any(k in text for k in PEER_LOSS))


def call_deadline_s(timeout_s: float, slowest_s: float | None, delay_s: float = 0.0) -> float:
    """A runner call's deadline: the kernel's bound on its waits, a delay injected into it, and
    the call's own time (FIRST_CALL_S before any call was timed; then STEP_SLACK_S + SLOW_FACTOR x
    the slowest call with no fault and no delay)."""
    own = FIRST_CALL_S if slowest_s is None else STEP_SLACK_S + SLOW_FACTOR * slowest_s
    return timeout_s + delay_s + own


class CallDeadlines:
    """The deadlines of one rank's runner calls, in seconds (call_deadline_s): a runner's first
    call at a width gets FIRST_CALL_S (it may finish loading), every later one follows the
    slowest call timed so far."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.slowest_s: float | None = None
        self._called: set[tuple[int, int]] = set()  # (id(runner), width) called once

    def deadline_s(self, runner: object, width: int, delay_s: float = 0.0) -> float:
        """This call's deadline (s), with ``delay_s`` injected into it."""
        key = (id(runner), width)
        first = key not in self._called
        self._called.add(key)
        return call_deadline_s(self.timeout_s, None if first else self.slowest_s, delay_s)

    def took(self, wall_s: float) -> None:
        """A call's own time (s; one with no fault and no delay): later deadlines follow the slowest."""
        self.slowest_s = max(self.slowest_s or 0.0, wall_s)


class Records:
    def __init__(self, result_dir: str, rank: int, beat: bool = False):
        self.rank = rank
        self.dir = Path(result_dir)
        self.file = (self.dir / f"rank{rank}.jsonl").open("a", buffering=1)
        self.rows: list[dict] = []
        self.state: dict = {"phase": SET_UP_PHASE}
        self.counts: Callable[[], dict] | None = None  # a job's running counts, in every beat
        self._call: tuple | None = None  # (case, width, monotonic start, deadline_s) of the call in flight
        self._stop = threading.Event()
        self._beat_file = self.dir / f"rank{rank}.beat"
        self._thread = None
        if beat:
            self.beat()
            self._thread = threading.Thread(target=self._beat_loop, name="ffnq-heartbeat", daemon=True)
            self._thread.start()

    def write(self, kind: str, **data) -> None:
        self.file.write(json.dumps({"kind": kind, "rank": self.rank, "t": time.time(), **data}, default=str) + "\n")
        self.file.flush()

    def progress(self, done: int, total: int, what: str = "") -> None:
        self.write("progress", done=done, total=total, what=what)
        self.state = {"phase": what or "step", "done": done, "total": total}

    def phase(self, phase: str, **about) -> None:
        """What the rank does now (the heartbeat's ``phase``; the report's where each rank was)."""
        self.state = {"phase": phase, **about}

    @contextmanager
    def call(self, case: str, width: int, deadline_s: float):
        """A runner call in flight: the beat carries its case, width, seconds so far and
        ``deadline_s``; the launcher names the rank if it runs past that."""
        self._call = (case, width, time.monotonic(), deadline_s)
        try:
            yield
        finally:
            self._call = None

    # ---- the heartbeat ---------------------------------------------------------------------------
    def beat(self, final: str | None = None) -> None:
        doc = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "t": time.time(), **self.state}
        call = self._call
        if call is not None:
            doc |= {"call_case": call[0], "call_width": call[1], "call_s": round(time.monotonic() - call[2], 3),
                    "call_deadline_s": round(call[3], 3)}
        if self.counts is not None:
            try:
                doc["counts"] = self.counts()
            except Exception:  # noqa: BLE001 - a count read mid-update: the next beat has it
                pass
        if final:
            doc["final"] = final
        tmp = self._beat_file.with_suffix(".beat.tmp")
        try:
            tmp.write_text(json.dumps(doc, default=str))
            os.replace(tmp, self._beat_file)
        except OSError:  # the job's folder gone (the launcher ended it): nothing to tell
            pass

    def _beat_loop(self) -> None:
        while not self._stop.wait(BEAT_S):
            self.beat()

    def row(self, table: str, data: dict) -> None:
        rec = {"kind": "row", "rank": self.rank, "table": table, "data": data}
        self.rows.append(rec)
        self.file.write(json.dumps(rec, default=str) + "\n")

    def close(self, final: str = "closed") -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * BEAT_S)
            self.beat(final)  # the last word: the launcher stops watching this rank
        self.file.close()

    def gather(self) -> None:
        """Collective: each node's first rank (rank 0's node and every other) writes every rank's
        rows to its all.jsonl: each node's ffnq reports the whole job, not its own ranks alone."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            got = [None] * dist.get_world_size()
            dist.all_gather_object(got, self.rows)
        else:
            got = [self.rows]
        if int(os.environ.get("LOCAL_RANK", self.rank)) == 0:
            tmp = self.dir / "all.jsonl.tmp"
            tmp.write_text("".join(json.dumps(r, default=str) + "\n" for rows in got for r in rows))
            tmp.rename(self.dir / "all.jsonl")


def clock_offsets(clock_ns: Callable[[], int], rounds: int = CLOCK_ROUNDS) -> list[int]:
    """Collective: offset_ns[r] = median over rounds of (clock on r - clock on rank 0), each read
    right after a common barrier. Its error is the barrier's exit skew (gloo: tens of us)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [0]
    world = dist.get_world_size()
    samples = []
    for _ in range(rounds):
        barrier()
        t = torch.tensor([clock_ns()], dtype=torch.int64)
        got = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(got, t)
        samples.append([int(g) - int(got[0]) for g in got])
    return [int(torch.tensor([s[r] for s in samples]).median()) for r in range(world)]


def max_over_ranks(x: float) -> float:
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)
    return x


def main(body: Callable[[dict, Records], None]) -> None:
    """The entry of ``python -m ffnq.jobs.<job> OPTIONS.json`` on one rank."""
    opts = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ.get("RANK", 0))
    rec = Records(opts["result_dir"], rank, beat=True)
    torch.set_num_threads(1)
    die = os.environ.get("FFNQ_TEST_DIE_RANK")  # test hook: this rank dies (SIGKILL) at start
    if die is not None and int(die) == rank:
        os.kill(os.getpid(), 9)
    hang = os.environ.get("FFNQ_TEST_HANG_RANK")  # test hook: this rank never arrives
    if hang is not None and int(hang) == rank:
        rec.progress(0, 1, "hanging (FFNQ_TEST_HANG_RANK)")
        time.sleep(3600)
    rec.write("start", pid=os.getpid(), host=socket.gethostname())
    final = "error"
    try:
        body(opts, rec)
        rec.phase("gathering the rows")
        rec.gather()
        rec.write("done")
        final = "done"
    except SystemExit:  # ended from outside (torchrun after another rank died): not this rank's fault
        final = "ended"
        raise
    except BaseException as e:  # noqa: BLE001 - recorded for the launcher, then re-raised
        # a UsageError's line without its flag: ``use`` crosses to the launcher as its own field
        said = e.what if isinstance(e, UsageError) else str(e)
        msg = said.splitlines()[0] if said else ""
        extra = {"missing": e.record.get("missing_ranks", [])} if isinstance(e, RankFault) else {}
        if isinstance(e, UsageError) and e.use:
            extra["use"] = e.use
        rec.write("error", message=f"{type(e).__name__}: {msg}", trace=traceback.format_exc(),
                  usage=bool(getattr(e, "bad_input", False)), peer_loss=peer_loss(e), phase=rec.state.get("phase"),
                  **extra)
        raise
    finally:
        rec.close(final)
        if dist.is_initialized():
            dist.destroy_process_group()
