"""scripts/variant.sh: the BASE[:TUNE] variants of dev_round.sh and proxy_round.sh, split in one place."""
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "variant.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("variant, base, tune", [
    ("default", "default", ""), ("256", "256", ""), ("default:PLR=2", "default", "PLR=2"),
    ("198:CPS@3=3,NS@3=3", "198", "CPS@3=3,NS@3=3")])
def test_variant_split(variant, base, tune):
    r = subprocess.run(["bash", "-c", f'. "{SCRIPT}"; echo "$(variant_base "$1")|$(variant_tune "$1")"', "_", variant],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == f"{base}|{tune}"
