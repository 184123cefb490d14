"""launch: the torchrun command, failure messages, the ranks ended with ffnq."""
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ffnq.jobs.bench import BenchOptions
from ffnq.jobs.qualify import QualifyOptions
from ffnq.launch import _failure, torchrun_command
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


def test_failure_names_the_rank():
    recs = [{"kind": "start", "rank": 0}, {"kind": "progress", "rank": 0, "done": 3, "total": 9, "what": "correct w=4"}]
    log = ("Root Cause (first observed failure):\n[0]:\n  time      : x\n  host      : vm\n"
           "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 123)\n")
    msg = _failure("qualify", 1, recs, 2, log)
    assert "rank 1 died (killed by signal 9)" in msg and "rank 0 at correct w=4 (3/9)" in msg
    err = recs + [{"kind": "error", "rank": 0, "t": 1, "message": "RankFault: boom"}]
    assert _failure("qualify", 1, err, 2, log) == "qualify: rank 0 failed: RankFault: boom"


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
