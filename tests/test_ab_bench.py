"""scripts/ab_bench.sh: its bad arguments are named, exit 2, before anything is written."""
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "ab_bench.sh"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("args,commit,message", [
    ([], "c" * 40, "usage: FFNQ_COMMIT=<this tree's commit> scripts/ab_bench.sh OTHER_COMMIT [ROUNDS]"),
    # without it this tree's reports would name the device copy's stale HEAD (dev round 77)
    (["HEAD"], None, "FFNQ_COMMIT is unset, allowed: this tree's full commit"),
    (["f" * 40], "c" * 40, f"{'f' * 40} is not a commit this copy's .git holds"),
    (["HEAD", "0"], "c" * 40, "ROUNDS=0, allowed: a whole number >= 1")])
def test_bad_arguments_are_named(args, commit, message, tmp_path):
    out = tmp_path / "out"
    env = {"OUT": str(out), "PATH": "/usr/bin:/bin"} | ({"FFNQ_COMMIT": commit} if commit else {})
    r = subprocess.run(["bash", str(SCRIPT), *args], cwd=SCRIPT.parent.parent, capture_output=True, text=True,
                       env=env)
    assert r.returncode == 2 and message in r.stdout
    assert not out.exists()
