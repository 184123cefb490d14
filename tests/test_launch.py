"""launch: the torchrun command, failure messages, the host watchdog, the ranks ended with ffnq."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ffnq.jobs.bench import BenchOptions
from ffnq.jobs.qualify import QualifyOptions
from ffnq.launch import Tail, Watch, _failure, _positions, diagnose, rank_states, torchrun_command, torchrun_failures
from helpers import TESTS, ffnq_cmd, job_pids


def test_torchrun_command_standalone_and_rdzv(tmp_path):
    f = tmp_path / "o.json"
    cmd = torchrun_command(QualifyOptions(tp=2), f)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert cmd[-4:] == ["2", "-m", "ffnq.jobs.qualify", str(f)] and "--nproc-per-node" in cmd
    cmd = torchrun_command(BenchOptions(tp=4, nnodes=2, rdzv_endpoint="h:29500"), f)
    assert "--standalone" not in cmd
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "h:29500"


ROOT_KILLED = ("Root Cause (first observed failure):\n[0]:\n  time      : x\n  host      : vm\n"
               "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 123)\n")
# the race that blamed the survivor: rank 0 saw the closed connection and exited first
ROOT_SURVIVOR = ("Failures:\n[1]:\n  time      : x\n  host      : vm\n  rank      : 1 (local_rank: 1)\n"
                 "  exitcode  : -9 (pid: 124)  (SIGKILL)\n------\nRoot Cause (first observed failure):\n[0]:\n"
                 "  time      : x\n  host      : vm\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 123)\n")
CLOSED = {"kind": "error", "rank": 0, "t": 2, "peer_loss": True,
          "message": "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"}


def test_positions_say_where_each_unfinished_rank_was():
    """A stopped or late job's line: each unfinished rank's count as its progress bar showed it
    (soak's steps of its heartbeat), or its phase; a rank that said done is left out."""
    from ffnq.errors import Stopped

    recs = [{"kind": "start", "rank": 0}, {"kind": "start", "rank": 1}, {"kind": "done", "rank": 2},
            {"kind": "beat", "rank": 0, "phase": "steps, 0 mismatches", "done": 4500, "total": 100000},
            {"kind": "beat", "rank": 1, "phase": "set-up (process group, peer buffers, weights, warm)"}]
    where = _positions(recs, 3)
    assert where == ("rank 0 at 4500/100000 steps, 0 mismatches, "
                     "rank 1 at set-up (process group, peer buffers, weights, warm)")
    assert _positions([{"kind": "done", "rank": 0}], 1) == "every rank had finished"
    e = Stopped(signal.SIGTERM)
    assert e.code == 128 + signal.SIGTERM and e.message == "stopped by SIGTERM: the job's ranks were ended"
    e.where = f"after 93 s ({where})"
    assert e.message == f"stopped by SIGTERM after 93 s ({where}): the job's ranks were ended"


def test_failure_names_the_rank():
    recs = [{"kind": "start", "rank": 0}, {"kind": "progress", "rank": 0, "done": 3, "total": 9, "what": "correct w=4"}]
    msg = _failure("qualify", 1, recs, 2, ROOT_KILLED)
    assert "rank 1 died (killed by signal 9, SIGKILL)" in msg and "rank 0 at 3/9 correct w=4" in msg
    # a rank's own error (no lost peer) is the verdict when no rank died by a signal
    err = recs + [{"kind": "error", "rank": 0, "t": 1, "message": "ValueError: boom"}]
    assert _failure("qualify", 1, err, 2, "") == "qualify: rank 0 failed: ValueError: boom"


@pytest.mark.parametrize("log", [ROOT_KILLED, ROOT_SURVIVOR, ""], ids=["root-killed", "root-survivor", "no-log"])
def test_a_survivors_lost_peer_error_never_blames_the_survivor(log):
    """SIGKILL of rank 1: rank 0's collective fails with "Connection closed by peer". Whichever
    torchrun saw first, or with no word from torchrun at all, rank 1 is named."""
    recs = [{"kind": "start", "rank": r} for r in (0, 1)] + [
        {"kind": "progress", "rank": 1, "done": 5, "total": 9, "what": "run w=16"}, CLOSED]
    v = diagnose("qualify", 1, recs, 2, log)
    msg = v.message
    assert not v.usage and v.use is None and "rank 0 failed" not in msg
    assert ("rank 1 died (killed by signal 9, SIGKILL)" in msg) if log else ("lost rank 1 at 5/9 run w=16" in msg), msg


def test_a_bounded_wait_that_expired_names_the_missing_rank():
    fault = {"kind": "error", "rank": 0, "t": 1, "peer_loss": True, "missing": [1],
             "message": "RankFault: rank 0 faulted in phase seam at epoch 9: waited 1000.0 ms for rank(s) 1"}
    recs = [{"kind": "start", "rank": 0}, {"kind": "start", "rank": 1}, {"kind": "done", "rank": 1}, fault]
    msg = diagnose("soak", 1, recs, 2, "").message
    assert msg.startswith("soak: lost rank 1") and "waited 1000.0 ms for rank(s) 1" in msg


def test_a_usage_error_in_a_rank_is_bad_input():
    e = {"kind": "error", "rank": 1, "t": 1, "usage": True, "peer_loss": False,
         "message": "UsageError: runner mutants:X: warm failed: RuntimeError: no"}
    v = diagnose("qualify", 1, [e, CLOSED | {"t": 3}], 2, ROOT_SURVIVOR.replace("-9", "1"))
    assert v.usage and v.use is None
    assert v.message == v.what == "qualify: rank 1 failed: UsageError: runner mutants:X: warm failed: RuntimeError: no"


# a runner's UsageError(what, use="--backend cpu") on rank 1, as records.main writes it (test_records)
NEEDS_GPU = "runner triton: __init__ failed: --backend triton: needs a GPU and this host has none"
USAGE = {"kind": "error", "rank": 1, "t": 1, "usage": True, "peer_loss": False, "message": f"UsageError: {NEEDS_GPU}",
         "use": "--backend cpu"}
USAGE_LINE = f"qualify: rank 1 failed: UsageError: {NEEDS_GPU} (use --backend cpu)"  # the one line, as before


def test_a_rank_usage_errors_flag_is_the_verdicts_use():
    """The flag crosses as data: ``what`` is the line without "(use ...)" (a gate names its job
    from it), ``use`` the flag, ``message`` the one line the user reads."""
    v = diagnose("qualify", 1, [{"kind": "start", "rank": 0}, USAGE, CLOSED | {"t": 3}], 2, "")
    assert (v.usage, v.use, v.message) == (True, "--backend cpu", USAGE_LINE)
    assert v.what == f"qualify: rank 1 failed: UsageError: {NEEDS_GPU}" and "(use" not in v.what
    assert _failure("qualify", 1, [USAGE], 2, "") == USAGE_LINE
    assert rank_states([USAGE], 2)[1]["error"] == f"UsageError: {NEEDS_GPU} (use --backend cpu)"


RANK_RAISES = """
import os, sys
from ffnq.errors import UsageError
from ffnq.jobs import records
from ffnq.jobs.rank import runner_error

os.environ["RANK"] = "1"
gpu = UsageError("--backend triton: needs a GPU and this host has none", use="--backend cpu")


def body(opts, rec):
    raise runner_error("triton", "__init__", gpu)


records.main(body)
"""


def test_the_launchers_usage_error_keeps_the_ranks_flag(tmp_path, monkeypatch, capsys):
    """launch.run on a job whose rank 1 raises a runner's UsageError(..., use="--backend cpu")
    through records.main: the launcher's UsageError has ``use`` and a ``what`` free of it; the
    CLI prints the same one line as before and exits 2."""
    import typer

    from ffnq import launch
    from ffnq.cli import _guard
    from ffnq.errors import UsageError

    monkeypatch.setattr(launch, "torchrun_command", lambda opts, f: [sys.executable, "-c", RANK_RAISES, str(f)])
    with pytest.raises(UsageError) as got:
        launch.run(QualifyOptions(tp=2), progress=False)
    e = got.value
    assert (str(e), e.use) == (USAGE_LINE, "--backend cpu")
    assert e.what == f"qualify: rank 1 failed: UsageError: {NEEDS_GPU}" and "(use" not in e.what
    with pytest.raises(typer.Exit) as ended:
        _guard(lambda: launch.run(QualifyOptions(tp=2), progress=False))
    assert ended.value.exit_code == 2
    err = capsys.readouterr().err
    assert err == f"error: {USAGE_LINE}\n", err


def test_torchrun_failures_parsed():
    assert torchrun_failures(ROOT_SURVIVOR) == ([(1, -9), (0, 1)], (0, 1))
    assert torchrun_failures("") == ([], None)


def test_rank_states_say_how_and_where_each_rank_ended():
    recs = [{"kind": "progress", "rank": 0, "done": 2, "total": 9, "what": "correct w=2"}, CLOSED,
            {"kind": "progress", "rank": 1, "done": 3, "total": 9, "what": "correct w=3"},
            {"kind": "beat", "rank": 1, "phase": "correct w=3", "call_case": "correct", "call_width": 3, "call_s": 7.5}]
    rows = rank_states(recs, 2)
    assert rows[0]["ended"] == "error (a lost peer's)" and rows[0]["progress"] == "2/9"
    assert rows[1]["ended"] == "no final word" and "runner call of case correct w=3, 7.5 s in" in rows[1]["where"]


def beat(d: Path, rank: int, **kw) -> None:
    doc = {"rank": rank, "pid": kw.pop("pid", 0), "host": kw.pop("host", os.uname().nodename), "t": time.time(),
           "phase": "correct w=4"} | kw
    (d / f"rank{rank}.beat").write_text(json.dumps(doc))


def test_tail_reads_only_whole_lines_appended_since_the_last_look(tmp_path):
    f = tmp_path / "rank0.jsonl"
    t = Tail(f)
    assert t.new() == []  # not written yet
    f.write_text('{"kind": "start"}\n{"kind": "progress", "do')
    assert t.new() == [{"kind": "start"}]  # the half-written line waits
    with f.open("a") as fh:
        fh.write('ne": 1}\nnot json\n{"kind": "done"}\n')
    assert t.new() == [{"kind": "progress", "done": 1}, {"kind": "done"}]
    assert t.new() == []
    assert t.pos == f.stat().st_size


def test_watch_names_a_silent_rank_and_a_call_past_its_deadline(tmp_path):
    w = Watch(tmp_path, 2, 1.0, "marker")
    beat(tmp_path, 0)
    beat(tmp_path, 1)
    assert not w.check(now=100.0) and not w.check(now=102.9)  # no new beat, but within 1 + 2 s
    beat(tmp_path, 0)  # rank 0 still beats, rank 1 does not
    assert w.check(now=103.2) and w.culprits == [1] and "rank 1 hung: no heartbeat for 3.2 s" in w.verdict
    for name in ("setup", "call", "final"):
        (tmp_path / name).mkdir()
    w = Watch(tmp_path / "setup", 2, 1.0, "marker")
    beat(tmp_path / "setup", 1, phase="set-up (process group, peer buffers, weights, warm)")
    assert not w.check(now=0.0) and not w.check(now=20.0)  # set-up may hold the interpreter longer
    assert w.check(now=31.0) and "no heartbeat for 31.0 s (limit 30 s)" in w.verdict
    w = Watch(tmp_path / "call", 2, 1.0, "marker")
    beat(tmp_path / "call", 1, call_case="run", call_width=16, call_s=5.5, call_deadline_s=5.0)
    assert w.check(now=0.0) and w.culprits == [1]
    assert "rank 1 hung in a runner call that did not return: case run w=16, 5.5 s in" in w.verdict
    beat(tmp_path / "final", 1, final="done")  # a rank that said its last word is not watched
    w = Watch(tmp_path / "final", 2, 1.0, "marker")
    assert not w.check(now=0.0) and not w.check(now=60.0)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_watch_leaves_a_dead_rank_to_torchrun(tmp_path):
    """A rank killed but not yet reaped (a zombie), or gone, is not hung however long its beats
    stop: torchrun names it and its signal. A live silent one still is."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        w = Watch(tmp_path, 2, 0.5, "marker")
        beat(tmp_path, 0, pid=p.pid)
        assert not w.check(now=0.0)
        assert w.check(now=10.0) and "rank 0 hung: no heartbeat" in w.verdict  # alive and silent
        w = Watch(tmp_path, 2, 0.5, "marker")
        assert not w.check(now=0.0)
        p.send_signal(signal.SIGKILL)
        time.sleep(0.3)  # a zombie until reaped
        assert not w.check(now=10.0)
        p.wait(timeout=5)
        assert not w.check(now=20.0)  # gone
    finally:
        p.kill()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_watch_names_a_stopped_rank_and_kills_it(tmp_path):
    marker = f"ffnq-watch-test-{tmp_path.name}"
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        w = Watch(tmp_path, 2, 0.5, marker)
        beat(tmp_path, 0, pid=p.pid)
        assert not w.check(now=0.0)
        p.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        assert not w.check(now=0.1)  # stopped, but not yet for the timeout
        assert w.check(now=0.7) and w.culprits == [0] and "rank 0 is stopped (process state T" in w.verdict
        w.kill_ranks()
        assert p.wait(timeout=5) == -signal.SIGKILL
    finally:
        p.kill()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("sig, rc, says", [
    (signal.SIGINT, 130, r"error: interrupted \(SIGINT\): the job's ranks were ended"),
    (signal.SIGTERM, 128 + signal.SIGTERM,
     r"error: stopped by SIGTERM after \d+ s \(rank 0 at .+, rank 1 at .+\): the job's ranks were ended"),
    (signal.SIGKILL, -signal.SIGKILL, None)], ids=["SIGINT", "SIGTERM", "SIGKILL"])
@pytest.mark.slow  # 11-16 s each signal
def test_a_terminated_ffnq_takes_its_ranks_with_it(tmp_path, sig, rc, says):
    """SIGTERM to ffnq (a cancelled CI job, `timeout ffnq ...`) or Ctrl-C ends the job's torchrun
    and ranks too, in one line: they run in a session of their own, so nothing else would.
    SIGKILL, which ffnq cannot see, ends them through torchrun's parent-death signal."""
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # SIGINT as a terminal delivers it: a shell's background job (CI's) inherits it ignored
    p = subprocess.Popen([*ffnq_cmd(), "soak", "--backend", "cpu", "--tp", "2", "--steps", "1000000", "--out",
                          str(tmp_path / "reports")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        end = time.monotonic() + 120
        while len(job_pids(tmp_path)) < 3 and time.monotonic() < end and p.poll() is None:
            time.sleep(0.5)  # torchrun and both ranks up
        assert len(job_pids(tmp_path)) >= 3, p.stderr.read().decode() if p.poll() is not None else "no ranks"
        p.send_signal(sig)
        assert p.wait(timeout=30) == rc
        if says:
            assert re.fullmatch(says, p.stderr.read().decode().strip().splitlines()[-1])
        end = time.monotonic() + 20
        while job_pids(tmp_path) and time.monotonic() < end:
            time.sleep(0.5)
        assert job_pids(tmp_path) == []
        assert not (tmp_path / "reports").exists()  # nothing half-written
    finally:
        for pid in job_pids(tmp_path):
            os.kill(pid, signal.SIGKILL)
        p.kill()
