"""scripts/tp2_solo.py: bad input named before any GPU work; the SOLO=2 TP2 build computes what the
script's reference says (rank 0's own part and its shard's partial), in Triton's interpreter."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ffnq.spec import Experts, load_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.mark.parametrize("args, env, message", [
    (["--time", "1-20"], {}, "error: --time '1-20': 1-20 outside 1..16"),
    (["--widths", "0"], {}, "error: --widths '0': 0 outside 1..16"),
    (["--model", "nosuch"], {}, "error: model 'nosuch': no such file; known models:"),
    ([], {"FFNQ_TRITON_TUNE": "NOPE=1"}, "error: FFNQ_TRITON_TUNE key 'NOPE': no build reads it"),
    (["--profile", "17"], {}, "error: --profile '17': 17 outside 1..16"),
    (["--device", "cpu"], {"TRITON_INTERPRET": "0"}, "error: --device cpu: runs the checks in Triton's interpreter"),
    (["--device", "cpu", "--profile", "1"], {"TRITON_INTERPRET": "1"},
     "error: --device cpu: runs the checks in Triton's interpreter only (TRITON_INTERPRET=1, no --time, --profile or "
     "--floor)"),
    (["--floor"], {}, "error: --floor: counts the bytes of timed or profiled widths; name them (--time, --profile)")])
def test_bad_input_named_before_any_step(args, env, message, tmp_path):
    _run_refused(args, env, message, tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host would run it")
def test_no_gpu_named(tmp_path):
    _run_refused(["--widths", "1"], {"TRITON_INTERPRET": "0"}, "error: --device cuda: this host has no CUDA GPU",
                 tmp_path)


def _run_refused(args, env, message, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "tp2_solo.py"), *args, "--out", str(tmp_path / "r")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=os.environ | {"PYTHONPATH": str(ROOT)} | env)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="slow: set TRITON_INTERPRET=1 to run")
@pytest.mark.parametrize("tune, slots", [("SOLO=2", [0, -1, 2]), ("SOLO=2,FR=2", [1, -1])])
def test_interpreter_solo_build_is_its_ranks_partial(tune, slots, monkeypatch):
    """Rank 0's TP2 build with SOLO=2, alone on the CPU: its residual is its own part's, its MoE
    output its shard's partial (tp2_solo.own_shard_only's reference), routing and route weights
    the reference's, padding rows 0; under FR=2 too (the whole rows read from its own part)."""
    monkeypatch.setenv("FFNQ_TRITON_TUNE", tune)
    from tp2_solo import own_shard_only

    from ffnq import reference
    from ffnq.backends import symm
    from ffnq.backends.triton import TritonRunner
    from ffnq.backends.triton import geometry as G
    from ffnq.weights import shard, synthetic
    spec, slots = load_model("tiny"), torch.tensor(slots)
    S = len(slots)
    buf = torch.zeros(TritonRunner.peer_bytes(spec, 2), dtype=torch.uint8)
    symm.BUFFERS[buf.data_ptr()] = buf
    try:
        peers = torch.tensor([buf.data_ptr()] * 2, dtype=torch.int64)
        r = TritonRunner(2, 0, buf.data_ptr(), peers, "cpu", widths=[S], model=spec)
        g = G.geometry(r.keys[S])
        assert g["SOLO"] and g["FR"] == ("FR" in tune)
        full = synthetic(spec, seed=6)
        gen = torch.Generator().manual_seed(8)
        part = torch.randn(S, spec.hidden, generator=gen).bfloat16()
        resid = torch.randn(S, spec.hidden, generator=gen).bfloat16()
        out, res = r(part, resid, shard(full, spec, 2, 0, Experts.ALL), slots)
        ref = reference.step([part], resid, slots, own_shard_only(full, spec), spec)
        whole = reference.step([part], resid, slots, full, spec)
        live = torch.nonzero(slots >= 0).flatten()
        assert reference.compare(out, ref.out, rows=live)["rel_err"] < 1e-2
        assert reference.compare(out, whole.out, rows=live)["rel_err"] > 0.1  # not the whole MoE output
        assert reference.compare(res, ref.res_out)["rel_err"] < 1e-2
        assert torch.equal(r.view(S, "route").long(), ref.chosen)
        assert (r.chosen_weights(S).double() - ref.weights).abs().max() <= 1e-4
        assert (out[slots < 0] == 0).all() and r.fault(S) is None
    finally:
        symm.BUFFERS.pop(buf.data_ptr(), None)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="slow: set TRITON_INTERPRET=1 to run")
def test_interpreter_script_end_to_end(tmp_path):
    """The script itself on the CPU (--device cpu, the interpreter): its checks at one token and
    at three with a padding row pass, and it writes its report; --time is refused there."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "FFNQ_TRITON_TUNE": ""}
    run = [sys.executable, str(ROOT / "scripts" / "tp2_solo.py"), "--model", "tiny", "--device", "cpu",
           "--out", str(tmp_path / "r")]
    r = subprocess.run([*run, "--widths", "1,3"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS 2/2" in r.stdout
    (folder,) = (tmp_path / "r").iterdir()
    assert folder.name.endswith("-tp2-solo-triton-tp2") and (folder / "results.csv").is_file()
    r = subprocess.run([*run, "--widths", "1", "--time", "1"], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 2 and "interpreter only" in r.stderr


def test_bytes_counted_against_the_read_rate():
    """--floor's arithmetic: a route's distinct experts; the profiled expert phase (top-k done to
    stage 2 done) as TB/s and a share of the read rate; a timed step over its experts' read time,
    the experts the mean over the weight sets of the reference's routing of rank 0's own part."""
    from tp2_solo import bytes_row, expert_rate, touched

    from ffnq.weights import shard, synthetic
    assert touched(torch.tensor([[3, 9], [9, 40], [-1, -1]])) == 3
    spec = load_model("minimax-m2")
    per = spec.expert_bytes(2, Experts.ALL)  # 7.08 MB at TP2
    got = expert_rate({"latest": {"topk": 8.0, "stage2": 28.0}}, 8, spec, 4000.0)
    assert got["experts"] == 8 and got["expert_mb"] == round(8 * per / 1e6, 1)
    assert got["expert_tbps"] == round(8 * per / 1e6 / 20.0, 2) and got["of_read"] == round(8 * per / 20e6 / 4.0, 3)
    tiny = load_model("tiny")
    sets = [[shard(synthetic(tiny, seed=3 + i), tiny, 2, 0, Experts.ALL)] for i in range(2)]
    row = bytes_row(tiny, 4, sets, torch.device("cpu"), 50.0, 2000.0)
    assert 8 <= row["experts"] <= min(4 * 8, tiny.experts)
    assert row["expert_mb"] == round(row["experts"] * tiny.expert_bytes(2, Experts.ALL) / 1e6, 1)
    read_us = row["experts"] * tiny.expert_bytes(2, Experts.ALL) / 2000.0e3  # bytes over 2000 GB/s, in us
    assert row["read_us"] == round(read_us, 1) and row["x_bytes"] == round(50.0 / read_us, 3)
