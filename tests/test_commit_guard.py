"""scripts/commit_guard.sh: the device scripts' check that FFNQ_COMMIT names the tree that runs."""
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import commit_all

GUARD = Path(__file__).resolve().parent.parent / "scripts" / "commit_guard.sh"


def _guard(repo, commit):
    return subprocess.run(["bash", "-c", f'. "{GUARD}"; echo passed'], cwd=repo, capture_output=True, text=True,
                          env={"FFNQ_COMMIT": commit, "PATH": "/usr/bin:/bin"})


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_guard_refuses_a_commit_the_tree_is_not(tmp_path):
    (tmp_path / "ffnq").mkdir()
    (tmp_path / "ffnq" / "k.py").write_text("a = 1\n")
    old = commit_all(tmp_path)[:7]
    assert _guard(tmp_path, old).stdout.strip() == "passed"
    (tmp_path / "ffnq" / "k.py").write_text("a = 2\n")  # the tree moved on; its .git did not
    r = _guard(tmp_path, old)
    assert r.returncode == 2 and f"FFNQ_COMMIT={old}: the tree here differs" in r.stdout
    # a commit this .git does not know (made elsewhere, later) cannot be checked: it passes
    assert _guard(tmp_path, "0" * 40).stdout.strip() == "passed"
