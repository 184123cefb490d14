"""The FlyDSL backend offline, with no AMD GPU: compile for gfx942 and gfx950, resources, static
residency, the `error:` detector, and the runner's refusal to execute without an AMD GPU."""
import os
import re

import pytest
import torch

pytest.importorskip("numpy", reason="flydsl's compiler needs numpy")
try:
    import flydsl.compiler as flyc
    import flydsl.expr as fx
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"flydsl is not importable ({e}); pip install 'ffnq[amd]' (flydsl>=0.5)", allow_module_level=True)

from ffnq.backends.flydsl import offline
from ffnq.backends.flydsl.runner import FlydslRunner
from ffnq.errors import UsageError
from ffnq.spec import Experts, FfnBuild, kernel_name, load_model

KEYS = {"width", "kernel", "compile_s", "target", "vgpr", "sgpr", "agpr", "lds_bytes", "scratch_bytes",
        "ctas_per_cu", "cus", "grid", "resident"}
TARGETS = ("gfx942", "gfx950")


@pytest.fixture(autouse=True)
def _clean_env():
    keys = ("COMPILE_ONLY", "ARCH", "FLYDSL_GPU_ARCH", "FLYDSL_RUNTIME_ENABLE_CACHE")
    before = {k: os.environ.get(k) for k in keys}
    yield
    after = {k: os.environ.get(k) for k in keys}
    assert after == before, "offline compile must restore the environment it changes"


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_tiny_widths_compile_and_are_resident(target):
    spec = load_model("tiny")
    widths = [1, 3, 16]
    rows = offline.offline_table("tiny", 2, "all", target, widths, detail=True)
    assert [r["width"] for r in rows] == widths
    for r in rows:
        assert KEYS <= set(r), KEYS - set(r)
        key = FfnBuild(tokens=r["width"], tp=2, model=spec, blocks=FlydslRunner.BLOCKS)
        assert r["kernel"] == kernel_name(key)
        assert r["target"] == target
        assert r["grid"] == FlydslRunner.BLOCKS and r["threads"] == FlydslRunner.THREADS
        assert r["cus"] == offline.CUS[target]
        assert 16 <= r["vgpr"] <= 512 and 8 <= r["sgpr"] <= 112
        assert r["lds_bytes"] > 0 and r["denorm_f32"] == 3  # the fp8 decode needs f32 denormals kept
        # the tiny model runs out of SGPRs on gfx950 (spilled to VGPR lanes, a few to scratch); the
        # real model's kernel has none (test_minimax_widest_width_both_targets)
        assert r["scratch_bytes"] <= 256
        assert r["instructions"] >= 1000  # a real body, not the silent-miscompile stub
        assert 1 <= r["ctas_per_cu"] <= r["ctas_per_cu_hip"]
        assert r["resident"] == ("yes" if r["ctas_per_cu"] * r["cus"] >= r["grid"] else "no")
        assert r["resident"] == "yes"
        assert r["compile_s"] > 0


def test_modes_and_timeline_compile():
    for experts in (Experts.LOCAL, Experts.NONE):
        (r,) = offline.offline_table("tiny", 2, experts, "gfx942", [3])
        assert r["resident"] == "yes" and r["kernel"].endswith(experts.value)
    (r,) = offline.offline_table("tiny", 2, "all", "gfx950", [2], timeline=True)
    assert r["kernel"].endswith("_tl") and r["resident"] == "yes"


@pytest.mark.slow
def test_minimax_widest_width_both_targets(tmp_path):
    for target in TARGETS:
        (r,) = offline.offline_table("minimax-m2", 2, "all", target, [16], keep_isa=str(tmp_path))
        assert r["resident"] == "yes" and r["scratch_bytes"] == 0 and r["spills"] == 0
        isa = (tmp_path / f"{r['kernel']}.{target}.s").read_text()
        assert re.search(rf'\.amdgcn_target\s+"amdgcn-amd-amdhsa-[a-z]*-{target}"', isa)
        # the fp8 decode relies on f32 denormals being kept (mode 3: in and out)
        assert ".amdhsa_float_denorm_mode_32 3" in isa
        # protocol lowering: system-scope release (sc0 sc1 write-back) and acquire (invalidate)
        assert "buffer_wbl2 sc0 sc1" in isa and "buffer_inv sc0 sc1" in isa
        assert "s_memrealtime" in isa and "s_sleep" in isa


def test_bad_target_and_widths_are_usage_errors():
    with pytest.raises(UsageError, match="gfx942, gfx950"):
        offline.offline_table("tiny", 2, "all", "sm_90", [1])
    with pytest.raises(UsageError, match="widths"):
        offline.offline_table("tiny", 2, "all", "gfx942", [0, 17])
    with pytest.raises(UsageError, match="tp=8"):
        offline.offline_table("minimax-m2", 8, "all", "gfx942", [1])


# ---- the `error:` detector --------------------------------------------------------------------
def _ptr(addr):
    return fx.inttoptr(fx.PointerType.get(elem_ty=fx.Float32.ir_type, address_space=fx.AddressSpace.Global,
                                          alignment=4), addr)


@flyc.kernel
def _tanh_kernel(a: fx.Int64):
    x = fx.generic_load(_ptr(a + fx.Int64(fx.thread_idx.x) * 4))
    fx.generic_store(_ptr(a), fx.tanh(x) + x * x)


@flyc.jit
def _tanh_launch(a: fx.Int64, stream: fx.Stream = fx.Stream(None)):
    _tanh_kernel(a).launch(grid=(1, 1, 1), block=(64, 1, 1), stream=stream)


@flyc.kernel
def _exp_kernel(a: fx.Int64):
    x = fx.generic_load(_ptr(a + fx.Int64(fx.thread_idx.x) * 4))
    fx.generic_store(_ptr(a), fx.exp(x) + x * x)


@flyc.jit
def _exp_launch(a: fx.Int64, stream: fx.Stream = fx.Stream(None)):
    _exp_kernel(a).launch(grid=(1, 1, 1), block=(64, 1, 1), stream=stream)


@pytest.mark.parametrize("target", TARGETS)
def test_error_detector_fails_a_silently_broken_build(target):
    # FlyDSL 0.5.0 prints "error: no libcall available for ftanh", raises nothing and returns an
    # empty kernel: the checked compile must fail it
    with pytest.raises(offline.BuildError, match="error:|empty"):
        offline.compile_checked(_tanh_launch, (0,), target, protocol=False, min_instructions=4)
    # the same kernel with exp compiles: the detector does not fail everything
    r = offline.compile_checked(_exp_launch, (0,), target, protocol=False, min_instructions=4)
    assert r["vgpr"] >= 1 and r["threads"] == 64


def test_protocol_check_fails_a_kernel_without_the_protocol():
    with pytest.raises(offline.BuildError, match="lacks"):
        offline.compile_checked(_exp_launch, (0,), "gfx942", protocol=True, min_instructions=4)


# ---- static occupancy ------------------------------------------------------------------------
def test_occupancy_formula():
    # small kernel, 128 threads: 8 waves per SIMD -> 32 waves per CU -> 16 two-wave CTAs
    assert offline.ctas_per_cu("gfx942", 16, 26, 0, 128)["ctas_per_cu_hip"] == 16
    # 48 KiB of LDS: one CTA on gfx942 (64 KiB per CU), three on gfx950 (160 KiB)
    assert offline.ctas_per_cu("gfx942", 5, 19, 49152, 512)["ctas_per_cu"] == 1
    assert offline.ctas_per_cu("gfx950", 5, 19, 49152, 512, vgpr_alloc=73)["ctas_per_cu"] == 3
    # 256 VGPRs: 2 waves per SIMD -> 8 waves per CU -> 2 four-wave CTAs, limited by registers
    o = offline.ctas_per_cu("gfx942", 256, 32, 1024, 256)
    assert (o["ctas_per_cu"], o["limit"]) == (2, "waves")
    # the hardware allocation (kernel descriptor) can only lower the figure
    assert offline.ctas_per_cu("gfx942", 64, 32, 0, 256, vgpr_alloc=128)["ctas_per_cu"] == 4
    # 16 barrier slots cap multi-wave workgroups
    assert offline.ctas_per_cu("gfx950", 8, 16, 0, 128)["ctas_per_cu"] == 16


# ---- never execute without an AMD GPU ---------------------------------------------------------
def test_runner_refuses_to_execute_without_an_amd_gpu():
    peers = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(UsageError, match="AMD GPU"):
        FlydslRunner(2, 0, 0, peers, "cpu", widths=[1])
    with pytest.raises(UsageError, match="AMD GPU"):
        FlydslRunner.open_peers(load_model("tiny"), 2, 0, "cpu", "t")


# ---- the kernel's fp8 decode, bit for bit -----------------------------------------------------
def test_fp8_decode_formula_is_exact_for_every_code():
    import numpy as np

    from ffnq.backends.flydsl.kernel import TWO_120, fp8_bits
    codes = np.arange(256, dtype=np.int64)
    finite = (codes & 0x7F) != 0x7F  # 0x7f / 0xff are NaN in e4m3fn
    t = (codes << 24).astype(np.uint32).view(np.int32)  # the code in the top byte, as in the kernel
    got = fp8_bits(t).astype(np.int32).view(np.float32).astype(np.float64) * TWO_120
    want = torch.tensor(codes.astype(np.uint8)).view(torch.float8_e4m3fn).double().numpy()
    assert np.array_equal(got[finite], want[finite])
    # and every byte position of a packed word decodes the same (the kernel's shifts)
    word = np.array([0x3C01B87F], dtype=np.uint32).view(np.int32)
    for i, code in enumerate((0x7F, 0xB8, 0x01, 0x3C)):
        ti = (word << (24 - 8 * i)) if i < 3 else word
        v = fp8_bits(ti).astype(np.int32).view(np.float32).astype(np.float64)[0] * TWO_120
        w = torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).double().item()
        assert (np.isnan(w) and code == 0x7F) or v == w


def test_launcher_arguments_match_what_the_runner_passes():
    import inspect

    from ffnq.backends.flydsl import kernel as K
    launch, key = offline.build_width(load_model("tiny"), 2, Experts.ALL, 1)
    params = list(inspect.signature(launch.func if hasattr(launch, "func") else launch).parameters)
    assert params == list(K.ARG_NAMES) + ["stream"]
    assert len(offline.placeholder_args(2)) == len(K.ARG_NAMES)
    src = inspect.getsource(FlydslRunner._args)
    # the runner's positional order: part, residual, slots, out, res_out, 7 weights, scratch, peers, epoch,
    # inject, timeout_ns, rank, first_expert, final, stream
    order = ["part", "residual", "slots", "out", "res_out", "_weights", "scratch", "peers", "epoch", "inject",
             "timeout_ns", "self.rank", "first", "final", "current_stream"]
    pos = [src.index(tok, src.index("return (")) for tok in order]
    assert pos == sorted(pos)
