"""scripts/device_env.sh: the one preamble every device script sources (multicast off, the tree's
package on the path, the FFNQ_COMMIT guard)."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import commit_all

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
SOURCE = '. "$(dirname "$0")/device_env.sh"'


def test_exports_what_every_job_on_a_lent_machine_needs():
    r = subprocess.run(["bash", "-c", f'. "{SCRIPTS / "device_env.sh"}"; env'], cwd=ROOT, capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin"})
    env = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert r.returncode == 0, r.stderr
    assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"], env["NVSHMEM_DISABLE_NVLS"]) == \
        ("0", "1", "1")
    assert env["PYTHONPATH"] == str(ROOT) and env["PYTHONUNBUFFERED"] == "1" and env["MPLBACKEND"] == "Agg"


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.sh")
                                          # (the files they source, not scripts of their own)
                                          if p.name not in ("device_env.sh", "commit_guard.sh", "variant.sh")))
def test_every_device_script_sources_it_before_starting_anything(script):
    lines = (SCRIPTS / script).read_text().splitlines()
    assert SOURCE in lines, f"{script} does not source device_env.sh"
    first_run = next((i for i, ln in enumerate(lines)
                      if re.search(r"\b(python3|nvidia-smi|torch\.distributed\.run|ncu)\b", ln) and not ln.startswith("#")),
                     len(lines))  # (proxy_batch.sh starts only other scripts)
    assert lines.index(SOURCE) < first_run
    # the multicast settings live in one place
    assert not any("NCCL_NVLS_ENABLE" in ln for ln in lines)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_commit_guard_applies_through_it(tmp_path):
    """Sourced from a script in another folder, device_env.sh still finds commit_guard.sh beside it."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "ffnq").mkdir()
    for name in ("device_env.sh", "commit_guard.sh"):
        shutil.copy(SCRIPTS / name, tmp_path / "scripts" / name)
    (tmp_path / "ffnq" / "k.py").write_text("a = 1\n")
    old = commit_all(tmp_path)
    caller = tmp_path / "elsewhere" / "round.sh"
    caller.parent.mkdir()
    caller.write_text(f'. "{tmp_path}/scripts/device_env.sh"\necho passed\n')

    def run():
        return subprocess.run(["bash", str(caller)], cwd=tmp_path, capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin", "FFNQ_COMMIT": old})
    assert run().stdout.strip() == "passed"
    (tmp_path / "ffnq" / "k.py").write_text("a = 2\n")  # the tree moved on; its .git did not
    r = run()
    assert r.returncode == 2 and f"FFNQ_COMMIT={old}: the tree here differs" in r.stdout and "passed" not in r.stdout
