"""scripts/commit_guard.sh: the device scripts' check that FFNQ_COMMIT names the tree that runs."""
import shutil
import subprocess
from pathlib import Path

import pytest

GUARD = Path(__file__).resolve().parent.parent / "scripts" / "commit_guard.sh"


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def _guard(repo, commit):
    return subprocess.run(["bash", "-c", f'. "{GUARD}"; echo passed'], cwd=repo, capture_output=True, text=True,
                          env={"FFNQ_COMMIT": commit, "PATH": "/usr/bin:/bin"})


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_guard_refuses_a_commit_the_tree_is_not(tmp_path):
    (tmp_path / "ffnq").mkdir()
    (tmp_path / "ffnq" / "k.py").write_text("a = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    old = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert _guard(tmp_path, old).stdout.strip() == "passed"
    (tmp_path / "ffnq" / "k.py").write_text("a = 2\n")  # the tree moved on; its .git did not
    r = _guard(tmp_path, old)
    assert r.returncode == 2 and f"FFNQ_COMMIT={old}: the tree here differs" in r.stdout
    # a commit this .git does not know (made elsewhere, later) cannot be checked: it passes
    assert _guard(tmp_path, "0" * 40).stdout.strip() == "passed"
