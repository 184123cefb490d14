"""tools/extract_vllm.py on a stand-in vLLM (a tree and the same files as a wheel): the folder it
writes is what bench's vllm baseline loads, and needs nothing of vLLM but triton."""
import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("extract_vllm", ROOT / "tools" / "extract_vllm.py")
X = importlib.util.module_from_spec(spec)
spec.loader.exec_module(X)

MOE = '''"""vLLM's fused_moe.py, in short."""
import torch
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton

PAD = 7


@triton.jit
def write_zeros_to_output(c_ptr, N: tl.constexpr):
    tl.store(c_ptr + tl.arange(0, N), tl.zeros((N,), tl.float32) + PAD)


@triton.jit
def fused_moe_kernel(a_ptr, c_ptr, N: tl.constexpr, SWAP_AB: tl.constexpr):
    write_zeros_to_output(c_ptr, N)


def invoke_fused_moe_kernel(A):
    return current_platform.is_cuda()
'''
QUANT = '''from vllm import envs
from vllm.triton_utils import tl, triton


@triton.jit
def _per_token_group_quant_fp8(y_ptr, BLOCK: tl.constexpr):
    pass


@triton.jit
def _w8a8_triton_block_scaled_mm(A):
    pass
'''
VERSION = "__version__ = version = '0.34.0'\n__commit_id__ = commit_id = 'g62d4bc3c7'\n"
CONFIG = "E=256,N=1536,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"


def files():
    return {X.MOE: MOE, X.QUANT: QUANT, X.VERSION: VERSION, X.CONFIGS + CONFIG: '{"1": {"BLOCK_SIZE_M": 16}}'}


def tree(root: Path) -> Path:
    for name, text in files().items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files().items():
            z.writestr(name, text)
    return path


def load(path: Path, name: str):
    s = importlib.util.spec_from_file_location(path.stem + "_x", path)
    m = importlib.util.module_from_spec(s)
    s.loader.exec_module(m)  # would fail on any vllm import left behind
    return m, getattr(m, name)


@pytest.mark.parametrize("form", ["tree", "wheel"])
def test_extract_takes_the_kernels_and_what_they_call_and_nothing_of_vllm(tmp_path, form):
    src = tree(tmp_path / "vllm-src") if form == "tree" else wheel(tmp_path / "vllm-0.34.0-cp38-abi3.whl")
    out = X.extract(src, tmp_path / "out")
    moe, kernel = load(out / "fused_moe.py", "fused_moe_kernel")
    assert kernel.arg_names == ["a_ptr", "c_ptr", "N", "SWAP_AB"]  # a JITFunction: its decorator kept
    assert hasattr(moe, "write_zeros_to_output") and moe.PAD == 7  # what it calls, transitively
    assert not hasattr(moe, "invoke_fused_moe_kernel")
    text = (out / "fused_moe.py").read_text()
    assert "vllm" not in text and text.startswith(X.HEADER)
    quant, _ = load(out / "fp8_quant.py", "_per_token_group_quant_fp8")
    assert not hasattr(quant, "_w8a8_triton_block_scaled_mm")
    assert (out / "configs" / CONFIG).read_text() == '{"1": {"BLOCK_SIZE_M": 16}}'
    assert (out / "SOURCE.txt").read_text() == f"source: {src.name}\nrelease: 0.34.0 g62d4bc3c7\n"


def test_the_baseline_reads_what_extract_wrote(tmp_path, monkeypatch):
    from ffnq.baselines import vllm as V
    out = X.extract(tree(tmp_path / "src"), tmp_path / "out")
    monkeypatch.setenv(V.ENV_DIR, str(out))
    monkeypatch.delenv(V.ENV, raising=False)
    assert V.kernel_path() == out / "fused_moe.py"
    assert V.release() == "vLLM 0.34.0 g62d4bc3c7"
    assert V.load_quant().arg_names == ["y_ptr", "BLOCK"]


@pytest.mark.parametrize("what", ["missing", "not-vllm", "no-kernel", "not-a-wheel"])
def test_a_source_that_is_not_vllm_is_one_line_and_writes_nothing(tmp_path, what):
    src = tmp_path / ("src.whl" if what == "not-a-wheel" else "src")
    if what == "not-a-wheel":
        src.write_text("not a zip")
    elif what != "missing":
        src.mkdir()
    if what == "no-kernel":
        (tmp_path / "src" / X.MOE).parent.mkdir(parents=True)
        (tmp_path / "src" / X.MOE).write_text("def fused_experts():\n    pass\n")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "extract_vllm.py"), str(src), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and str(src) in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def report(folder: Path, configs: list) -> Path:
    rows = [{"width": w, "p50_us": 50.0, "vllm_config": c} for w, c in configs]
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"job": "bench", "tables": {"results": rows}}))
    return folder


def test_configs_from_a_report_are_the_tuned_files_its_vllm_ran(tmp_path, monkeypatch):
    """--configs-from: a rerun times vLLM with the launch configs of the report it reproduces."""
    from ffnq.baselines import vllm as V
    rep = report(tmp_path / "ref", [
        (1, f"vLLM tuned {CONFIG} key 1: BLOCK_SIZE_M=16,BLOCK_SIZE_N=128,num_stages=4"),
        (3, f"vLLM tuned {CONFIG} key 2: BLOCK_SIZE_M=16,BLOCK_SIZE_N=64,num_stages=3"),
        (8, f"sweep of 320 benchmark_moe.py configs for {CONFIG}, best at M=8 (212.5 us): BLOCK_SIZE_M=16,num_stages=2"),
        (16, "vLLM get_default_config(M=16) (no tuned x.json): BLOCK_SIZE_M=16"),  # not a tuned file: skipped
    ])
    out = X.extract(tree(tmp_path / "src"), tmp_path / "out", [rep])
    tuned = json.loads((out / "configs" / CONFIG).read_text())
    assert tuned == {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "num_stages": 4},
                     "2": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "num_stages": 3},
                     "8": {"BLOCK_SIZE_M": 16, "num_stages": 2}}  # the report's, not vLLM's file
    monkeypatch.setenv(V.ENV_DIR, str(out))
    assert V.closest({int(k): v for k, v in tuned.items()}, 3) == 2


def test_the_shipped_h100_reference_gives_its_vllm_configs(tmp_path):
    out = X.extract(tree(tmp_path / "src"), tmp_path / "out", [ROOT / "configs" / "gates" / "ref" / "h100-tp1-bench"])
    name = "E=256,N=1536,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8,block_shape=[128,128].json"
    assert sorted(json.loads((out / "configs" / name).read_text()), key=int) == ["1", "2", "4", "8", "16"]


@pytest.mark.parametrize("rows", [[], [(1, f"vLLM tuned {CONFIG} key 1: BLOCK_SIZE_M=sixteen")]])
def test_a_report_without_tuned_vllm_configs_is_refused_before_anything_is_written(tmp_path, rows):
    rep = report(tmp_path / "ref", rows)
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "extract_vllm.py"), str(tree(tmp_path / "src")),
                        "--configs-from", str(rep), "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and str(rep) in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
