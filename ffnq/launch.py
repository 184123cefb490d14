"""Run a job's ranks through torchrun under a deadline and collect what they wrote.

    verbs -> launch.run(opts) -> torchrun -> python -m ffnq.jobs.<opts.job> on every rank

Each rank appends JSON lines to ``<tmp>/rank<r>.jsonl`` (progress, rows, done or error); rank 0
also writes every rank's rows, gathered, into ``all.jsonl`` (the only file a multi-node run
needs on this host). The temp dir is never the reports folder. torchrun runs in its own session,
so a job past its deadline is killed as a whole group; a rank that dies makes torchrun end the
others.

The host watchdog (``Watch``) reads every rank's heartbeat (``rank<r>.beat``, rewritten every
0.5 s by a thread of the rank) while the job runs, and ends the job, naming the rank and what
it was doing, when one

* is stopped (process state T, SIGSTOP or a debugger) for longer than the kernel's timeout,
* stops beating for longer than the timeout + STALL_MARGIN_S (a frozen process; SETUP_STALL_S
  while it sets up: loading and compiling may hold the interpreter),
* runs one runner call past the deadline the job gave it (a kernel with no bounded wait),

so a hung rank is named within seconds, not at gloo's 120 s collective timeout (each node's ffnq
watches the ranks it launched: their beats are in its job folder). The verdict of a
failed job prefers, in order: the watchdog's; a rank killed by a signal (torchrun's failures); a
rank's own error; and only then an error that a lost peer causes on a survivor (a collective's
connection error, a bounded wait that expired), which names the lost rank, not the survivor.
A rank whose error is bad input (``usage``: e.g. a runner whose construction or warm-up raised)
ends the job as a UsageError (exit 2).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import pandas as pd

from ffnq.errors import Stopped, UsageError, with_use
from ffnq.jobs.records import SET_UP, SET_UP_PHASE

if TYPE_CHECKING:
    from ffnq.options import JobOptions

POLL_S = 0.2
STALL_MARGIN_S = 2.0  # a beat (every 0.5 s) missing this long past the timeout: the rank is frozen
SETUP_STALL_S = 30.0  # the same while a rank sets up (imports, weights, compiles may hold the GIL)


class LaunchError(RuntimeError):
    """The job ran but did not finish: a rank died or hung, or the deadline passed. ``records``
    keeps what every rank wrote before that (and its last heartbeat, kind ``beat``), so a report
    can still show what finished; ``ranks`` says where each rank was."""

    def __init__(self, message: str, records: list[dict] | None = None, ranks: list[dict] | None = None):
        super().__init__(message)
        self.records = records or []
        self.ranks = ranks or []


def torchrun_command(opts: JobOptions, opts_file: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if opts.nnodes > 1 or opts.rdzv_endpoint:
        cmd += ["--nnodes", str(opts.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", opts.rdzv_endpoint or ""]
    else:
        cmd += ["--standalone"]
    cmd += ["--nproc-per-node", str(opts.tp // opts.nnodes), "-m", f"ffnq.jobs.{opts.job}", str(opts_file)]
    return cmd


def job_env(tag: str) -> dict:
    env = dict(os.environ)
    env.update(FFNQ_TAG=tag, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1")
    return env


@dataclass
class JobResult:
    tables: dict[str, pd.DataFrame]
    command: list[str]
    wall_s: float
    tag: str
    records: list[dict] = field(default_factory=list)  # every rank's rows (merged), as written


def read_records(result_dir: Path) -> list[dict]:
    """Every rank's records as written, then each rank's last heartbeat (kind ``beat``)."""
    recs = []
    for f in sorted(result_dir.glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a torn last line of a killed rank
    return recs + [{"kind": "beat", **b} for _, b in sorted(read_beats(result_dir).items())]


def read_beats(result_dir: Path) -> dict[int, dict]:
    beats = {}
    for f in result_dir.glob("rank*.beat"):
        try:
            b = json.loads(f.read_text())
            beats[int(b["rank"])] = b
        except (OSError, ValueError, KeyError, TypeError):
            pass  # being replaced, or torn by a kill: the next read has it
    return beats


def run(opts: JobOptions, progress: bool = True) -> JobResult:
    """Run ``python -m ffnq.jobs.<opts.job>`` on every rank; tables of rows by name."""
    from ffnq.dist import sweep

    job = opts.job
    deadline = opts.deadline()
    tag = "j" + secrets.token_hex(4)
    with tempfile.TemporaryDirectory(prefix="ffnq-job-") as tmp:
        result_dir = Path(tmp)
        opts_file = result_dir / "options.json"
        opts_file.write_text(json.dumps({"job": job, "result_dir": str(result_dir), **opts.to_json()}))
        cmd = torchrun_command(opts, opts_file)
        log = (result_dir / "torchrun.log").open("w")
        t0 = time.monotonic()
        watch = Watch(result_dir, opts.tp, opts.timeout_s, str(opts_file))
        try:
            with _terminated_as_exit():
                proc = subprocess.Popen(cmd, env=job_env(tag), stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=_die_with_parent())
                try:
                    rc = _wait(proc, result_dir, t0 + deadline, job, progress, watch)
                finally:
                    if proc.poll() is None:
                        _kill_group(proc)
                    watch.kill_ranks()  # any rank torchrun could not end (a stopped one ignores SIGTERM)
                    log.close()
                    sweep(tag)
        except Stopped as e:  # the ranks are ended; their records say where the job was
            e.where = f"after {time.monotonic() - t0:.0f} s ({_positions(read_records(result_dir), opts.tp)})"
            raise
        wall = time.monotonic() - t0
        recs = read_records(result_dir)
        ranks = rank_states(recs, opts.tp)
        if watch.verdict:
            raise LaunchError(f"{job}: {watch.verdict}; the job was ended. {_elsewhere(ranks, watch.culprits)}",
                              recs, ranks)
        if rc is None:
            raise LaunchError(f"{job} passed its deadline of {deadline:g} s (--deadline): "
                              f"{_unfinished(recs, opts.tp)}; the job was killed", recs, ranks)
        if rc != 0:
            verdict = diagnose(job, rc, recs, opts.tp, (result_dir / "torchrun.log").read_text())
            if verdict.usage:
                raise UsageError(verdict.what, use=verdict.use)
            raise LaunchError(verdict.message, recs, ranks)
        merged = result_dir / "all.jsonl"
        if merged.exists():
            recs = [json.loads(line) for line in merged.read_text().splitlines() if line.strip()]
        return JobResult(tables(recs), cmd, wall, tag, recs)


def tables(recs: list[dict]) -> dict[str, pd.DataFrame]:
    """The rows among ``recs`` as tables by name (a cut-short job's: what its ranks wrote)."""
    rows: dict[str, list] = {}
    for r in recs:
        if r.get("kind") == "row":
            rows.setdefault(r["table"], []).append(r["data"])
    return {k: pd.DataFrame(v) for k, v in rows.items()}


def _die_with_parent():
    """The preexec_fn that makes torchrun take SIGTERM when ffnq dies, even by SIGKILL, which no
    handler sees (torchrun then ends its ranks); None off Linux. libc is looked up here, in the
    parent: between fork and exec the child only calls it (an import there can deadlock). The
    signal follows the forking thread's exit, so only the main thread arms it."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    prctl, parent, term = ctypes.CDLL(None, use_errno=True).prctl, os.getpid(), int(signal.SIGTERM)

    def arm() -> None:
        prctl(1, term)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # ffnq died before the call: nobody would signal
            os._exit(1)
    return arm


@contextmanager
def _terminated_as_exit():
    """SIGTERM and SIGHUP end this process through Stopped (SystemExit(128 + signal)) while a job
    runs, so run's ``finally`` kills the ranks: they run in a session of their own (no terminal
    signal reaches them), and the default action would end ffnq at once and leave them running (a
    CI job cancelled, ``timeout`` around ffnq). Only the main thread can take signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def end(sig, frame):
        raise Stopped(sig)

    old = {s: signal.signal(s, end) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _wait(proc, result_dir: Path, end: float, job: str, progress: bool, watch: Watch) -> int | None:
    """Poll the job and rank 0's progress until it exits (rc), the deadline passes or the watchdog
    names a rank (None: the job was killed)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                   TextColumn("{task.fields[what]}"), TimeElapsedColumn(), console=console, transient=True,
                   disable=not (progress and console.is_terminal))
    rank0 = Tail(result_dir / "rank0.jsonl")
    with bar:
        task = bar.add_task(f"{job}: starting the ranks", total=None, what="", count="")
        while True:
            try:
                return proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > end:
                _kill_group(proc)
                return None
            if watch.check():
                bar.update(task, description=f"{job}: ending ({watch.verdict})")
                # every rank's rows are on disk as written and its counts in its last beat: end them
                # all at once (a survivor waits in a collective; a stopped rank ignores SIGTERM)
                watch.kill_ranks()
                _kill_group(proc)
                return None
            for r in rank0.new():
                if r.get("kind") == "start":  # until its job's first progress: what it is doing
                    bar.update(task, description=f"{job}: {SET_UP_PHASE}")
                elif r.get("kind") == "progress":
                    bar.update(task, description=job, completed=r["done"], total=r["total"], what=r.get("what", ""),
                               count=f"{r['done']}/{r['total']}")


class Tail:
    """The records appended to a JSON-lines file since the last look: a soak of hours writes
    thousands of lines, and a poll every POLL_S reads only the new bytes."""

    def __init__(self, path: Path):
        self.path, self.pos = path, 0

    def new(self) -> list[dict]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.pos)
                got = f.read()
        except FileNotFoundError:  # the rank has not started writing
            return []
        whole = got.rfind(b"\n") + 1  # a line still being written waits for the next look
        self.pos += whole
        out = []
        for line in got[:whole].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return out


def _kill_group(proc) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _last(recs: list[dict], tp: int) -> dict[int, dict]:
    """The last record of each rank (heartbeats aside)."""
    last: dict[int, dict] = {}
    for r in recs:
        if "rank" in r and r.get("kind") != "beat":
            last[r["rank"]] = r
    return last


def _beats(recs: list[dict]) -> dict[int, dict]:
    return {r["rank"]: r for r in recs if r.get("kind") == "beat" and "rank" in r}


def _waiting(last: dict[int, dict], tp: int) -> list[int]:
    """The ranks whose last record (``_last``) is not their done."""
    return [r for r in range(tp) if last.get(r, {}).get("kind") != "done"]


def _unfinished(recs: list[dict], tp: int) -> str:
    waiting = _waiting(_last(recs, tp), tp)
    return f"rank(s) {', '.join(map(str, waiting))} had not finished ({_positions(recs, tp)})"


def _positions(recs: list[dict], tp: int) -> str:
    """Where each rank that had not finished was: 'rank 0 at 4500/100000 steps, 0 mismatches, rank 1 at ...'."""
    last, beats = _last(recs, tp), _beats(recs)
    return (", ".join(f"rank {r} at {_where(last.get(r), beats.get(r))}" for r in _waiting(last, tp))
            or "every rank had finished")


def _counted(what: str, done: int, total: int) -> str:
    """A progress count as the bar shows it ('3/9 correct w=4'); a count of one says nothing."""
    return f"{done}/{total} {what}" if total > 1 else what


def _where(rec: dict | None, beat: dict | None = None) -> str:
    """What a rank was doing: its heartbeat's phase (and runner call), else its last record."""
    if beat is not None and beat.get("phase"):
        if beat.get("call_case") is not None:
            return (f"{beat['phase']}: runner call of case {beat['call_case']} w={beat['call_width']}, "
                    f"{beat['call_s']:.1f} s in")
        return _counted(str(beat["phase"]), beat.get("done", 0), beat.get("total", 0))
    if rec is None:
        return "start-up"
    if rec.get("kind") == "start":
        return SET_UP_PHASE
    if rec.get("kind") == "progress":
        return _counted(rec.get("what") or "steps", rec["done"], rec["total"])
    return rec.get("kind", "?")


def rank_states(recs: list[dict], tp: int) -> list[dict]:
    """One row per rank: how it ended (done / error / no final word), where it was, its last
    progress, and its error if any: a report's account of a job that did not finish."""
    last, beats = _last(recs, tp), _beats(recs)
    errors = {r["rank"]: r for r in recs if r.get("kind") == "error"}
    progress = {r["rank"]: r for r in recs if r.get("kind") == "progress"}
    rows = []
    for rank in range(tp):
        kind = last.get(rank, {}).get("kind")
        ended = ("done" if kind == "done" else "no final word" if rank not in errors else
                 "error (a lost peer's)" if errors[rank].get("peer_loss") else "error")
        p = progress.get(rank)
        rows.append({"rank": rank, "ended": ended, "where": _where(last.get(rank), beats.get(rank)),
                     "progress": f"{p['done']}/{p['total']}" if p else "",
                     "error": with_use(errors[rank]["message"], errors[rank].get("use")) if rank in errors
                     else ""})
    return rows


def _elsewhere(ranks: list[dict], culprits: list[int]) -> str:
    others = [f"rank {r['rank']}: {r['ended']} at {r['where']}" for r in ranks if r["rank"] not in culprits]
    return ("Others: " + "; ".join(others)) if others else ""


FAILURE = re.compile(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def torchrun_failures(log: str) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
    """(every failure torchrun listed as (rank, exit code), its root cause or None)."""
    root = None
    _, sep, tail = log.partition("Root Cause")
    if sep:
        m = FAILURE.search(tail)
        root = (int(m[1]), int(m[2])) if m else None
    seen = [(int(m[1]), int(m[2])) for m in FAILURE.finditer(log)]
    return list(dict.fromkeys(seen)), root


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class Verdict(NamedTuple):
    """diagnose's word on a job that exited rc != 0: ``what``, one line; ``usage``: bad input
    (the launcher raises UsageError(what, use), exit 2); ``use``: the flag to change that a
    rank's UsageError named, kept apart from ``what`` as UsageError keeps it."""
    what: str
    usage: bool = False
    use: str | None = None

    @property
    def message(self) -> str:
        """The line as the user reads it: ``what``, then "(use FLAG)" where a flag is named."""
        return with_use(self.what, self.use)


def diagnose(job: str, rc: int, recs: list[dict], tp: int, log: str) -> Verdict:
    """The verdict of a job that exited rc != 0, and whether it was bad input. A rank that died
    by a signal first, then a rank's own error, then torchrun's root cause; an error that a lost
    peer causes on a survivor names the lost rank, never the survivor."""
    last, beats = _last(recs, tp), _beats(recs)
    errors = sorted((r for r in recs if r.get("kind") == "error"), key=lambda r: r.get("t", 0))
    erred = {e["rank"] for e in errors}
    failures, root = torchrun_failures(log)
    where = lambda r: _where(last.get(r), beats.get(r))  # noqa: E731
    # killed by a signal: not SIGTERM, which is torchrun ending the others (unless it is all there is)
    deaths = [(r, c) for r, c in failures if c < 0 and c != -signal.SIGTERM]
    if not deaths and root and root[1] < 0 and root[0] not in erred:
        deaths = [root]
    if deaths:
        if root in deaths:  # the first observed first
            deaths.remove(root)
            deaths.insert(0, root)
        r, c = deaths[0]
        return Verdict(f"{job}: rank {r} died (killed by signal {-c}, {_signal_name(c)}) at {where(r)}; torchrun "
                       f"ended the others. {_unfinished(recs, tp)}")
    own = [e for e in errors if not e.get("peer_loss")]
    if own:
        e = own[0]
        return Verdict(f"{job}: rank {e['rank']} failed: {e['message']}", bool(e.get("usage")), e.get("use"))
    if root and root[1] > 0 and root[0] not in erred:
        return Verdict(f"{job}: rank {root[0]} exited with code {root[1]} without a word at {where(root[0])}; "
                       f"torchrun ended the others. {_unfinished(recs, tp)}")
    if errors:  # only survivors' errors: name the rank(s) they lost
        e = errors[0]
        missing = sorted({m for x in errors for m in x.get("missing", [])})
        silent = [r for r in _waiting(last, tp) if r not in erred]
        lost = missing or silent
        if lost:
            who = ", ".join(f"rank {r} at {where(r)}" for r in lost)
            saw = with_use(e["message"], e.get("use"))
            return Verdict(f"{job}: lost {who} (no final word from it); rank {e['rank']} saw it as {saw}")
        return Verdict(f"{job}: rank {e['rank']} failed: {e['message']}", use=e.get("use"))
    if root:
        how = f"killed by signal {-root[1]}" if root[1] < 0 else f"exit code {root[1]}"
        return Verdict(f"{job}: rank {root[0]} died ({how}); torchrun ended the others. {_unfinished(recs, tp)}")
    tail = " | ".join(log.strip().splitlines()[-3:])
    return Verdict(f"{job}: torchrun exited {rc}; {_unfinished(recs, tp)}; log: {tail}")


def _failure(job: str, rc: int, recs: list[dict], tp: int, log: str) -> str:
    return diagnose(job, rc, recs, tp, log).message


# ---- the host watchdog ----------------------------------------------------------------------------

def _proc_state(pid: int) -> str | None:
    """The process state letter (R, S, D, T, t, Z, ...) from /proc, None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split(" ", 1)[0]


class Watch:
    """The host's watchdog over the ranks' heartbeats (see the module's docstring)."""

    def __init__(self, result_dir: Path, tp: int, timeout_s: float, marker: str):
        self.dir, self.tp, self.timeout = result_dir, tp, float(timeout_s)
        self.marker = marker  # on every rank's command line: a pid is this job's rank, not a reused one
        self.host = socket.gethostname()
        self.changed: dict[int, tuple[float, float]] = {}  # rank -> (beat's t, host monotonic when it changed)
        self.stopped: dict[int, float] = {}  # rank -> host monotonic when first seen stopped
        self.beats: dict[int, dict] = {}
        self.pids: dict[int, int] = {}
        self.verdict: str | None = None
        self.culprits: list[int] = []

    def check(self, now: float | None = None) -> bool:
        """Read the beats; True (``verdict`` and ``culprits`` set) when a rank is to be named."""
        now = time.monotonic() if now is None else now
        self._read(now)
        named = []
        for r, b in sorted(self.beats.items()):
            if b.get("final"):
                continue
            why = self._hung(r, b, now)
            if why:
                named.append((r, why))
        if named:
            # a stopped or frozen rank first: the others may be stuck in a call only because of it
            named.sort(key=lambda x: "runner call" in x[1])
            self.culprits = [r for r, _ in named]
            self.verdict = "; ".join(f"rank {r} {why}" for r, why in named)
        return bool(named)

    def _read(self, now: float) -> None:
        for r, b in read_beats(self.dir).items():
            self.beats[r] = b
            if b.get("host") == self.host and b.get("pid"):
                self.pids[r] = int(b["pid"])
            if self.changed.get(r, (None,))[0] != b.get("t"):
                self.changed[r] = (b.get("t"), now)

    def _hung(self, r: int, b: dict, now: float) -> str | None:
        where = _where(None, b)
        state = _proc_state(self.pids[r]) if r in self.pids else None
        if r in self.pids and state in (None, "Z", "X"):
            # dead, not hung: torchrun reaps it and names its signal (diagnose); on a loaded host
            # its reaping came after the heartbeat's limit, and a killed rank was named hung
            return None
        if state in ("T", "t"):
            first = self.stopped.setdefault(r, now)
            if now - first > self.timeout:
                return (f"is stopped (process state {state}: SIGSTOP or a debugger) for over {self.timeout:g} s "
                        f"(--timeout) at {where}")
        else:
            self.stopped.pop(r, None)
        set_up = str(b.get("phase", "")).startswith(SET_UP)
        limit = SETUP_STALL_S if set_up else self.timeout + STALL_MARGIN_S
        quiet = now - self.changed[r][1]
        if quiet > limit:
            return f"hung: no heartbeat for {quiet:.1f} s (limit {limit:g} s) at {where}"
        if b.get("call_deadline_s") is not None and b.get("call_s", 0) > b["call_deadline_s"]:
            return (f"hung in a runner call that did not return: case {b.get('call_case')} w={b.get('call_width')}, "
                    f"{b['call_s']:.1f} s in, past its deadline of {b['call_deadline_s']:g} s (--timeout "
                    f"{self.timeout:g} s plus the step's own time): a wait with no bound?")
        return None

    def _ours(self, pid: int) -> bool:
        try:
            return self.marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return False

    def _kill(self, ranks) -> None:
        for r in ranks:
            pid = self.pids.get(r)
            if pid and self._ours(pid):
                try:
                    os.kill(pid, signal.SIGKILL)  # also ends a stopped process
                except ProcessLookupError:
                    pass

    def kill_ranks(self) -> None:
        """SIGKILL every rank of this host still alive (torchrun's SIGTERM does not end a stopped
        one, nor one whose SIGTERM handler waits on a collective)."""
        self._read(time.monotonic())
        self._kill(range(self.tp))


def command_line(cmd: list[str]) -> str:
    return shlex.join(cmd)
