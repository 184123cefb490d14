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


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_other_commit_from_an_archive(tmp_path):
    """OTHER may be the file of `git archive -o FILE COMMIT` (the device copy's .git lacks later
    commits): its commit is read from the archive; a file that is not one is named."""
    root = SCRIPT.parent.parent
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    tar = tmp_path / "base.tar"
    subprocess.run(["git", "archive", "-o", str(tar), head], cwd=root, check=True)
    bogus = tmp_path / "bogus.tar"
    bogus.write_bytes(b"not an archive")
    env = {"OUT": str(tmp_path / "out"), "PATH": "/usr/bin:/bin", "FFNQ_COMMIT": "c" * 40}
    for other, message in ((tar, "ROUNDS=0, allowed"), (bogus, f"{bogus} is not a git archive of a commit")):
        # ROUNDS=0 is refused after OTHER is read: the archive itself was taken
        r = subprocess.run(["bash", str(SCRIPT), str(other), "0"], cwd=root, capture_output=True, text=True, env=env)
        assert r.returncode == 2 and message in r.stdout, r.stdout
    assert not (tmp_path / "out").exists()
