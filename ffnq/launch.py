"""Run a job's ranks through torchrun under a deadline and collect what they wrote.

    verbs -> launch.run(opts) -> torchrun -> python -m ffnq.jobs.<opts.job> on every rank

Each rank appends JSON lines to ``<tmp>/rank<r>.jsonl`` (progress, rows, done or error); rank 0
also writes every rank's rows, gathered, into ``all.jsonl`` (the only file a multi-node run
needs on this host). The temp dir is never the reports folder. torchrun runs in its own session,
so a job past its deadline is killed as a whole group; a rank that dies makes torchrun end the
others, and the error names the dead rank (from its error record, else torchrun's root cause).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from ffnq.errors import Stopped

if TYPE_CHECKING:
    from ffnq.options import JobOptions


class LaunchError(RuntimeError):
    """The job ran but did not finish: a rank died, or the deadline passed. ``records`` keeps
    what every rank wrote before that, so a report can still show what finished."""

    def __init__(self, message: str, records: list[dict] | None = None):
        super().__init__(message)
        self.records = records or []


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
    recs = []
    for f in sorted(result_dir.glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a torn last line of a killed rank
    return recs


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
        with _terminated_as_exit():
            proc = subprocess.Popen(cmd, env=job_env(tag), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_die_with_parent())
            try:
                rc = _wait(proc, result_dir, t0 + deadline, job, progress)
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
                log.close()
                sweep(tag)
        wall = time.monotonic() - t0
        recs = read_records(result_dir)
        if rc is None:
            raise LaunchError(f"{job} passed its deadline of {deadline:g} s (--deadline): "
                              f"{_unfinished(recs, opts.tp)}; the job was killed", recs)
        if rc != 0:
            raise LaunchError(_failure(job, rc, recs, opts.tp, (result_dir / "torchrun.log").read_text()), recs)
        merged = result_dir / "all.jsonl"
        if merged.exists():
            recs = [json.loads(line) for line in merged.read_text().splitlines() if line.strip()]
        rows: dict[str, list] = {}
        for r in recs:
            if r.get("kind") == "row":
                rows.setdefault(r["table"], []).append(r["data"])
        return JobResult({k: pd.DataFrame(v) for k, v in rows.items()}, cmd, wall, tag, recs)


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


def _wait(proc, result_dir: Path, end: float, job: str, progress: bool) -> int | None:
    """Poll the job and rank 0's progress until it exits (rc) or the deadline (None)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TextColumn("{task.fields[what]}"), TimeElapsedColumn(), console=console, transient=True,
                   disable=not (progress and console.is_terminal))
    rank0 = result_dir / "rank0.jsonl"
    with bar:
        task = bar.add_task(f"{job}: starting ranks", total=None, what="")
        seen = 0
        while True:
            try:
                return proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > end:
                _kill_group(proc)
                return None
            if rank0.exists():
                lines = rank0.read_text().splitlines()
                for line in lines[seen:]:
                    try:
                        r = json.loads(line)
                    except json.JSONDecodeError:
                        break
                    seen += 1
                    if r.get("kind") == "progress":
                        bar.update(task, description=job, completed=r["done"], total=r["total"], what=r.get("what", ""))


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
    """The last record of each rank."""
    last: dict[int, dict] = {}
    for r in recs:
        if "rank" in r:
            last[r["rank"]] = r
    return last


def _unfinished(recs: list[dict], tp: int) -> str:
    last = _last(recs, tp)
    waiting = [r for r in range(tp) if last.get(r, {}).get("kind") != "done"]
    where = ", ".join(f"rank {r} at {_where(last.get(r))}" for r in waiting)
    return f"rank(s) {', '.join(map(str, waiting))} had not finished ({where})"


def _where(rec: dict | None) -> str:
    if rec is None:
        return "start-up"
    if rec.get("kind") == "start":
        return "set-up (process group, peer buffers, weights)"
    if rec.get("kind") == "progress":
        return f"{rec.get('what') or 'step'} ({rec['done']}/{rec['total']})"
    return rec.get("kind", "?")


def _failure(job: str, rc: int, recs: list[dict], tp: int, log: str) -> str:
    errors = [r for r in recs if r.get("kind") == "error"]
    if errors:
        first = min(errors, key=lambda r: r.get("t", 0))
        return f"{job}: rank {first['rank']} failed: {first['message']}"
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", log, re.S)
    if m:
        code = int(m[2])
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return f"{job}: rank {m[1]} died ({how}); torchrun ended the others. {_unfinished(recs, tp)}"
    tail = " | ".join(log.strip().splitlines()[-3:])
    return f"{job}: torchrun exited {rc}; {_unfinished(recs, tp)}; log: {tail}"


def command_line(cmd: list[str]) -> str:
    return shlex.join(cmd)
