"""scripts/tp2_one_gpu.py: its model and width lists are read before any GPU work, a bad one named, exit 2."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("args, message", [
    # device round 80's first call: `--time 1-16` was read only after every check had run
    (["--time", "1-20"], "error: --time '1-20': 1-20 outside 1..16"),
    (["--time", "x"], "error: --time 'x': 'x' is not N or N-M"),
    (["--widths", "0"], "error: --widths '0': 0 outside 1..16"),
    (["--model", "nosuch"], "error: model 'nosuch': no such file; known models:")])
def test_bad_widths_named_before_any_step(args, message, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "tp2_one_gpu.py"), *args, "--out", str(tmp_path / "r")],
                       cwd=ROOT, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host would run it")
def test_no_gpu_named(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "tp2_one_gpu.py"), "--widths", "1", "--out",
                        str(tmp_path / "r")], cwd=ROOT, capture_output=True, text=True,
                       env=os.environ | {"PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: this host has no CUDA GPU: both ranks run on one (the CPU's TP2 checks are "
        "tests/test_triton_offline.py's, TRITON_INTERPRET=1)"), r.stderr
    assert not (tmp_path / "r").exists()
