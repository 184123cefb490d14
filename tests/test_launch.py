"""launch: parsing, validation before torchrun, the torchrun command, failure messages, the ranks
ended with ffnq."""
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ffnq.errors import UsageError
from ffnq.launch import (JobOptions, _failure, deadline_for, job_env, over_delay_ns, parse_inject, parse_widths,
                         torchrun_command, under_delay_ns, validate)
from helpers import TESTS, ffnq_cmd, job_pids


def test_widths_lists_and_ranges():
    assert parse_widths("1-4,8,16", 16) == [1, 2, 3, 4, 8, 16]
    assert parse_widths("3,1-2,2", 16) == [1, 2, 3]
    assert parse_widths("all", 4) == [1, 2, 3, 4]


@pytest.mark.parametrize("text", ["0", "17", "4-2", "1-x", "1,,2", "-3", "1.5"])
def test_widths_refused_with_the_value(text):
    with pytest.raises(UsageError, match="--widths"):
        parse_widths(text, 16)


def test_widths_error_names_the_option():
    with pytest.raises(UsageError, match=r"^--time '1-20': 1-20 outside 1\.\.16"):
        parse_widths("1-20", 16, "--time")


def test_inject_ranks():
    assert parse_inject(["all"], 3) == [0, 1, 2]
    assert parse_inject(["1", "0,1"], 2) == [0, 1]
    with pytest.raises(UsageError, match=r"--inject-rank '2': allowed 0\.\.1"):
        parse_inject(["2"], 2)


@pytest.mark.parametrize("kw, match", [
    (dict(tp=0), "--tp 0"), (dict(tp=8), "tp=8"), (dict(experts="some"), "--experts 'some'"),
    (dict(widths=[0]), r"widths \[0\]"), (dict(timeout_s=0), "--timeout 0"), (dict(timeout_s=-1), "--timeout -1"),
    (dict(inject_ranks=[2]), "--inject-rank 2"), (dict(backend="nope"), "--backend 'nope'"),
    (dict(backend="triton"), "needs a GPU"), (dict(backend="no.such:Runner"), "cannot import"),
    (dict(model="nope"), "model 'nope'"), (dict(nnodes=2), "needs --rdzv-endpoint"), (dict(layers=0), "--layers 0"),
    (dict(timeout_s=3.0, inject_ranks=[0]), "int32 ns"), (dict(deadline_s=0), "--deadline 0"),
])
def test_validate_refuses_before_anything_runs(kw, match):
    with pytest.raises(UsageError, match=match):
        validate(JobOptions(**kw))


def test_validate_fills_widths():
    assert validate(JobOptions(tp=2)).widths == list(range(1, 17))


def test_torchrun_command_standalone_and_rdzv(tmp_path):
    f = tmp_path / "o.json"
    cmd = torchrun_command("qualify", JobOptions(tp=2), f)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert cmd[-4:] == ["2", "-m", "ffnq.jobs.qualify", str(f)] and "--nproc-per-node" in cmd
    cmd = torchrun_command("bench", JobOptions(tp=4, nnodes=2, rdzv_endpoint="h:29500"), f)
    assert "--standalone" not in cmd
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "h:29500"


def test_env_and_delays():
    env = job_env("jtag")
    assert env["FFNQ_TAG"] == "jtag" and env["OMP_NUM_THREADS"] == "1" and env["NCCL_NVLS_ENABLE"] == "0"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert under_delay_ns(1.0) == 300_000_000 < 1e9 < 1.5e9 < over_delay_ns(1.0) < 2**31
    o = JobOptions(widths=[1, 2], inject_ranks=[0, 1])
    assert deadline_for("qualify", o) > 2 * over_delay_ns(1.0) / 1e9
    assert deadline_for("qualify", JobOptions(deadline_s=7)) == 7


def test_the_deadline_allows_for_reading_a_checkpoint():
    """Each rank of a node reads its layer (a GPU bench: its four weight sets' layers) from one
    disk: 3.6 GB a MiniMax-M2 layer, at 0.5 GB/s."""
    m2 = dict(model="minimax-m2", tp=2, widths=[1])
    base = deadline_for("bench", JobOptions(backend="triton", **m2))
    cpu = deadline_for("qualify", JobOptions(checkpoint="ck", checkpoint_layer=0, **m2)) - deadline_for("qualify", JobOptions(**m2))
    gpu = deadline_for("bench", JobOptions(backend="triton", checkpoint="ck", checkpoint_layer=0, **m2)) - base
    assert cpu == pytest.approx(30 + 2 * 3.62 / 0.5, rel=0.01) and gpu == pytest.approx(30 + 8 * 3.62 / 0.5, rel=0.01)


def test_failure_names_the_rank():
    recs = [{"kind": "start", "rank": 0}, {"kind": "progress", "rank": 0, "done": 3, "total": 9, "what": "correct w=4"}]
    log = ("Root Cause (first observed failure):\n[0]:\n  time      : x\n  host      : vm\n"
           "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 123)\n")
    msg = _failure("qualify", 1, recs, 2, log)
    assert "rank 1 died (killed by signal 9)" in msg and "rank 0 at correct w=4 (3/9)" in msg
    err = recs + [{"kind": "error", "rank": 0, "t": 1, "message": "RankFault: boom"}]
    assert _failure("qualify", 1, err, 2, log) == "qualify: rank 0 failed: RankFault: boom"


def test_triton_interpreter_is_one_rank(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(UsageError, match="runs one rank only"):
        validate(JobOptions(backend="triton", tp=2))


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("sig, rc, says", [
    (signal.SIGINT, 130, "error: interrupted (SIGINT): the job's ranks were ended"),
    (signal.SIGTERM, 128 + signal.SIGTERM, "error: stopped by SIGTERM: the job's ranks were ended"),
    (signal.SIGKILL, -signal.SIGKILL, None)], ids=["SIGINT", "SIGTERM", "SIGKILL"])
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
            assert p.stderr.read().decode().strip().splitlines()[-1] == says
        end = time.monotonic() + 20
        while job_pids(tmp_path) and time.monotonic() < end:
            time.sleep(0.5)
        assert job_pids(tmp_path) == []
        assert not (tmp_path / "reports").exists()  # nothing half-written
    finally:
        for pid in job_pids(tmp_path):
            os.kill(pid, signal.SIGKILL)
        p.kill()
