"""Chaos from outside: a rank SIGKILLed or SIGSTOPped mid-job (not through the job's own chaos
options) is named, never the survivor; the job ends within the kernel's timeout plus seconds, not
at gloo's 120 s collective timeout; the report keeps what finished; nothing is left behind."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ffnq.jobs.records import BEAT_S
from helpers import ffnq_cmd, job_pids, one_report

TIMEOUT_S = 1.0
SLACK_S = 5.0  # the bound past the timeout, from the signal to ffnq's exit
LOAD_S = 2.0  # two busy cores: reading the ranks' files and writing the report


def rank_pid(tmp: Path, rank: int, min_done: int) -> int | None:
    """Rank ``rank``'s pid once its progress (qualify: cases; soak: steps, from its heartbeat)
    reached ``min_done``."""
    for f in tmp.glob(f"ffnq-job-*/rank{rank}.jsonl"):
        pid, done = None, -1
        for line in f.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("kind") == "start":
                pid = r["pid"]
            elif r.get("kind") == "progress":
                done = r["done"]
        try:
            done = max(done, json.loads(f.with_suffix(".beat").read_text()).get("counts", {}).get("steps", -1))
        except (OSError, ValueError):
            pass
        if pid and done >= min_done:
            return pid
    return None


def chaos(tmp_path: Path, job: str, sig: signal.Signals, rank: int, min_done: int, after_s: float, *args: str):
    """Start ``ffnq job``, signal ``rank`` once it reached ``min_done`` and ``after_s`` more
    seconds passed; (rc, stderr, seconds from the signal to exit)."""
    env = dict(os.environ, TMPDIR=str(tmp_path), COLUMNS="250")
    cmd = [*ffnq_cmd(), job, "--backend", "cpu", "--tp", "2", "--timeout", str(TIMEOUT_S), "--out",
           str(tmp_path / "out"), "--json", *args]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = None
    try:
        end = time.monotonic() + 300
        while pid is None and p.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
            pid = rank_pid(tmp_path, rank, min_done)
        assert pid, (p.poll(), p.stderr.read() if p.poll() is not None else "rank never got there")
        time.sleep(after_s)
        t = time.monotonic()
        os.kill(pid, sig)
        _, err = p.communicate(timeout=200)
        return p.returncode, err, time.monotonic() - t
    finally:
        p.kill()
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def said(err: str) -> str:
    """The error line (rich wraps it: one line again)."""
    text = " ".join(err.split())
    return text[text.find("error:"):]


def left(tmp_path: Path, wait_s: float = 20.0) -> list:
    """The job's shared-memory segments and processes still there after up to ``wait_s``."""
    end = time.monotonic() + wait_s
    while True:
        found = [p.name for p in Path("/dev/shm").glob("ffnq-j*")] + job_pids(tmp_path)
        if not found or time.monotonic() >= end:
            return found
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_rank_killed_or_stopped_mid_qualify_is_named_in_seconds(tmp_path, sig, rank):
    rng = random.Random(f"{sig}{rank}")
    rc, err, wall = chaos(tmp_path, "qualify", sig, rank, rng.randrange(3, 30), rng.uniform(0, 3),
                          "--inject-rank", "all")
    line = said(err)
    assert rc == 1, err[-3000:]
    if sig == signal.SIGKILL:
        assert f"qualify: rank {rank} died (killed by signal 9, SIGKILL)" in line, line
    else:
        assert f"qualify: rank {rank} is stopped (process state T" in line, line
    assert f"rank {1 - rank} failed" not in line and "Connection closed" not in line.split(";")[0], line
    assert wall <= TIMEOUT_S + SLACK_S + LOAD_S, (wall, line)
    # the cut-short report keeps every case that finished, and says why it stopped
    rep = one_report(tmp_path / "out", "qualify")
    doc = json.loads((rep / "results.json").read_text())
    cases = doc["tables"]["results"]
    assert cases[-1]["case"] == "cut short" and f"rank {rank}" in cases[-1]["evidence"]
    assert sum(c["status"] == "PASS" for c in cases) >= 2, [c["case"] for c in cases]
    assert {r["rank"] for r in doc["tables"]["ranks"]} == {0, 1} and "cut short" in doc["verdict"]
    assert not left(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_soak_rank_killed_or_stopped_from_outside_keeps_its_count(tmp_path, sig):
    """The soak's counts ride on every heartbeat: a rank killed from outside shows the steps it
    finished (it showed "0 steps, no final word" after ~266 of them), a stopped one is named."""
    rc, err, wall = chaos(tmp_path, "soak", sig, 1, 30, 3.0, "--steps", "100000", "--widths", "1-4")
    line = said(err)
    assert rc == 1, err[-3000:]
    assert ("soak: rank 1 died (killed by signal 9" if sig == signal.SIGKILL else "soak: rank 1 is stopped") in line, line
    assert wall <= TIMEOUT_S + SLACK_S + LOAD_S, (wall, line)
    rows = json.loads((one_report(tmp_path / "out", "soak") / "results.json").read_text())["tables"]["results"]
    steps = {r["rank"]: r["steps"] for r in rows}
    # its last beat's count, not 0: behind rank 0 (one step ahead at most, lockstep) by what it ran
    # since that beat, at most a beat period at the rate both ran from step 30 to the signal, 3 s
    # on (~80 steps/s on 2 cores: one beat ~40 steps), with half a period of slack for the scheduler
    beat_steps = (steps[0] - 30) / 3.0 * BEAT_S
    assert steps[1] >= 20 and steps[0] - steps[1] <= 1.5 * beat_steps + 1, (rows, beat_steps)
    assert not left(tmp_path)
