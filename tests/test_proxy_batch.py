"""scripts/proxy_batch.sh: several proxy_round.sh groups in one call, each with its own environment
and variants, all packed into one archive after every group."""
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "proxy_batch.sh"
# stands in for proxy_round.sh: logs what it was given; a variant "fail" makes it exit 3
STUB = """#!/bin/bash
mkdir -p "$OUT"
echo "proxy=${PROXY:-pair} widths=${WIDTHS:-all} args=$*" > "$OUT/proxy.log"
for v in "$@"; do echo "   timed $v"; done >> "$OUT/proxy.log"
for v in "$@"; do [ "$v" = fail ] && exit 3; done
exit 0
"""


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None, reason="needs bash and tar")
def test_groups_run_in_turn_with_their_own_environment(tmp_path):
    stub = tmp_path / "round.sh"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out = tmp_path / "out"
    groups = ["PROXY=solo WIDTHS=1,2 default default:FR=1", "fail 198:KH=2,R@3=168", "WIDTHS=3", "198"]
    r = subprocess.run(["bash", str(SCRIPT), *groups], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(out), "PROXY_ROUND": str(stub)}, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    # group 1: its VAR=value words are the environment, the rest the variants, in order
    assert "proxy=solo widths=1,2 args=default default:FR=1" in lines
    assert "   timed default:FR=1" in lines
    # group 2 fails and the next still runs; a variant with = and @ is not taken for a variable
    assert "group 2 rc=3" in lines and "proxy=pair widths=all args=fail 198:KH=2,R@3=168" in lines
    assert "group 3 names no variant: skipped" in lines
    # group 4 does not inherit group 1's environment
    assert "proxy=pair widths=all args=198" in lines and "group 4 rc=0" in lines
    with tarfile.open(out / "batch.tgz") as t:
        names = {n.lstrip("./") for n in t.getnames()}
    assert {"1/proxy.log", "2/proxy.log", "4/proxy.log"} <= names and not any(n.startswith("3/") for n in names)
