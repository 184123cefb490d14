"""Baseline (d), vLLM's decode step: where its files come from, which launch config each width
runs (vLLM's rules), when the alignment is skipped, what a sweep picks, the baselines' one-line
descriptions; and the Triton glue in the interpreter (test_baselines_glue.py, in a process of its
own: the interpreter is chosen when Triton is imported)."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ffnq.baselines import vllm as V
from ffnq.baselines.profile import kernels_per_step
from ffnq.baselines.stock import Stock
from ffnq.baselines.unfused import Unfused
from ffnq.errors import UsageError
from ffnq.spec import Experts, load_model
from ffnq.weights import FP8, RankWeights

GLUE = Path(__file__).with_name("test_baselines_glue.py")


class NoLaunch:
    """A fused_moe_kernel that is never launched: construction and config logic only."""

    arg_names = ["a_ptr", "b_ptr", "c_ptr", "a_scale_ptr", "b_scale_ptr", "topk_weights_ptr",
                 "sorted_token_ids_ptr", "expert_ids_ptr", "num_tokens_post_padded_ptr", "EM",
                 "num_valid_tokens", "naive_block_assignment", "BLOCK_SIZE_M", "top_k"]


def fake_weights(E: int, H: int, I: int, block: int = 128) -> RankWeights:
    """Shapes only (nothing here is computed)."""
    return RankWeights(torch.ones(H), torch.zeros(E, H), torch.zeros(E), torch.empty(E, 2 * I, H, dtype=FP8),
                       torch.ones(E, 2 * I // block, H // block), torch.empty(E, H, I, dtype=FP8),
                       torch.ones(E, H // block, I // block))


@pytest.fixture
def no_vllm_env(monkeypatch):
    for k in (V.ENV, V.ENV_DIR, V.ENV_CONFIG):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the glue tests run in this process")
def test_glue_kernels_in_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(GLUE)], env=env,
                       capture_output=True, text=True, timeout=900, cwd=GLUE.parent.parent)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout


def compile_sm90(fn, kwargs: dict):
    """What a launch on an H100/H200 compiles, with no GPU (the JIT's own binder on stand-ins)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    kw = {"num_warps": 4, "num_stages": 3, **kwargs, "debug": False,
          "instrumentation_mode": knobs.compilation.instrumentation_mode}
    bound, spec, _ = create_function_from_signature(fn.signature, fn.params, backend)(**kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, None)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles the GPU code: not in the interpreter")
def test_glue_kernels_compile_for_sm90_at_minimax_m2_shapes():
    from ffnq.baselines import vllm_glue as G

    def e(dt):
        return torch.empty(16, dtype=dt)
    bf, f32, i32, f8 = torch.bfloat16, torch.float32, torch.int32, torch.float8_e4m3fn
    H, E = 3072, 256
    cases = [(G._add_rms_norm_kernel, dict(part_ptr=e(bf), res_ptr=e(bf), w_ptr=e(f32), res_out_ptr=e(bf), x_ptr=e(bf),
                                           x32_ptr=e(f32), H=H, eps=1e-6, BLOCK=4096, INTERP=False, num_warps=8)),
             (G._topk_sigmoid_kernel, dict(logits_ptr=e(f32), bias_ptr=e(f32), slots_ptr=e(torch.int64), w_ptr=e(f32),
                                           ids_ptr=e(i32), E=E, TOPK=8, EP=256, KP=8)),
             (G._group_quant_kernel, dict(y_ptr=e(bf), q_ptr=e(f8), s_ptr=e(f32), group=128, cols_total=H, row_stride=H,
                                          BLOCK=128, INTERP=False, num_warps=1)),
             (G._silu_mul_quant_kernel, dict(gu_ptr=e(bf), q_ptr=e(f8), s_ptr=e(f32), I=1536, GROUP=128, NG=12, NGP=16,
                                             INTERP=False)),
             (G._moe_sum_kernel, dict(c_ptr=e(bf), ids_ptr=e(i32), out_ptr=e(bf), H=H, first=0, n_local=E, TOPK=8,
                                      BLOCK=1024, INTERP=False))]
    for bm in (16, 64):  # 16 tokens' 128 pairs over 256 experts
        cases.append((G._align_kernel, dict(ids_ptr=e(i32), sorted_ptr=e(i32), expert_ids_ptr=e(i32), ntp_ptr=e(i32),
                                            numel=128, first=0, n_local=E, BM=bm, NP=128, EP=256, TAIL=bm,
                                            MAXB=G.p2(128 // bm))))
    for fn, kw in cases:
        ck = compile_sm90(fn, kw)
        assert ck.metadata.shared <= 228 * 1024, fn.__name__


@pytest.mark.skipif(not (os.environ.get("FFNQ_VLLM_DIR") or os.environ.get("FFNQ_VLLM_MOE"))
                    or os.environ.get("TRITON_INTERPRET") == "1", reason="needs FFNQ_VLLM_DIR (vLLM's kernel)")
def test_vllms_kernel_compiles_for_sm90_as_launched():
    """The launches VllmMoe makes on an H100/H200 (swap-AB, TMA B descriptor, naive and aligned)."""
    m = load_model("minimax-m2")
    st = V.VllmMoe(fake_weights(256, m.hidden, 768), m, 1, Experts.ALL, "cpu", quant=None)
    st.cap = (9, 0)
    for s in (1, 16):
        b = st._width(s)
        assert b.naive == (s == 1)
        for grid, kw in (b.g1, b.g2):
            assert kw["SWAP_AB"] and kw["USE_TMA_B"]
            assert "wgmma" in compile_sm90(st.kernel, kw).asm["ptx"]


def test_missing_kernel_is_a_usage_error(no_vllm_env, tmp_path):
    with pytest.raises(UsageError, match="FFNQ_VLLM_MOE='' is not a file"):
        V.kernel_path()
    f = tmp_path / "k.py"
    f.write_text("x = 1\n")
    no_vllm_env.setenv(V.ENV, str(f))
    with pytest.raises(UsageError, match="holds no fused_moe_kernel"):
        V.kernel_path()


def test_one_folder_names_every_file(no_vllm_env, tmp_path):
    (tmp_path / "fused_moe.py").write_text("def fused_moe_kernel(a_ptr):\n    pass\n")
    (tmp_path / "SOURCE.txt").write_text("source: x.whl\nrelease: 0.34.0 g62d4bc3c7\n")
    no_vllm_env.setenv(V.ENV_DIR, str(tmp_path))
    assert V.kernel_path() == tmp_path / "fused_moe.py" and V.load_kernel().__name__ == "fused_moe_kernel"
    assert V.load_quant() is None  # no fp8_quant.py: ffnq's quant kernel runs
    assert V.release() == "vLLM 0.34.0 g62d4bc3c7"
    no_vllm_env.delenv(V.ENV_DIR)
    no_vllm_env.setenv(V.ENV, str(tmp_path / "fused_moe.py"))  # the file alone: its folder is the dir
    assert V.vllm_dir() == tmp_path and V.release().endswith("g62d4bc3c7")


def test_default_config_is_vllms_block_fp8_default():
    # vLLM's get_default_config, fp8_w8a8 with [128, 128] blocks on CUDA
    assert V.default_config(1, 128) == {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128,
                                        "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 4}
    assert V.default_config(8, 128)["num_stages"] == 3 and V.default_config(8, 128)["BLOCK_SIZE_N"] == 64
    assert V.default_config(16, 128)["BLOCK_SIZE_N"] == 128 and V.default_config(16, 128)["GROUP_SIZE_M"] == 1
    assert V.default_config(32, 128)["GROUP_SIZE_M"] == 32 and V.default_config(65, 128)["BLOCK_SIZE_M"] == 64
    # the file vLLM would read for MiniMax-M2 at TP2 on an H200: N is w2.shape[2]
    assert V.config_file_name(256, 768, "NVIDIA_H200", 128) == \
        "E=256,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"


def test_tuned_file_is_read_at_the_closest_batch_key(no_vllm_env, tmp_path):
    m = load_model("tiny")
    w = fake_weights(m.experts, m.hidden, m.intermediate // 2)  # a TP2 rank's shard
    name = V.config_file_name(m.experts, m.intermediate // 2, "cpu", m.block)
    cfg = {k: {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
               "num_stages": 3} for k, bm in (("1", 16), ("4", 32), ("16", 64))}
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / name).write_text(json.dumps({"triton_version": "3.6.0", **cfg}))
    no_vllm_env.setenv(V.ENV_DIR, str(tmp_path))
    st = V.VllmMoe(w, m, 1, Experts.ALL, "cpu", kernel=NoLaunch(), quant=None)
    assert [st.config(s)["BLOCK_SIZE_M"] for s in (1, 2, 3, 9, 11, 16)] == [16, 16, 32, 32, 64, 64]
    assert st.config_name(3).startswith(f"vLLM tuned {name} key 4: BLOCK_SIZE_M=32")
    st.adopt({3: ({**cfg["1"], "num_stages": 5}, 12.5)}, 320)
    assert st.config(3)["num_stages"] == 5
    assert st.config_name(3).startswith(f"sweep of 320 benchmark_moe.py configs for {name}, best at M=3 (12.5 us): ")
    assert f"config sweep of 320 benchmark_moe.py configs for {name} / vLLM tuned {name}, per width" in st.describe
    no_vllm_env.setenv(V.ENV_CONFIG, '{"BLOCK_SIZE_M": 64}')
    st = V.VllmMoe(w, m, 1, Experts.ALL, "cpu", kernel=NoLaunch(), quant=None)
    assert st.config(1)["BLOCK_SIZE_M"] == 64 and st.config_name(1).startswith(V.ENV_CONFIG)


def test_naive_assignment_while_tokens_times_topk_times_4_fit_the_experts(no_vllm_env):
    m = dataclasses.replace(load_model("tiny"), experts=256)  # MiniMax-M2's 256 experts, top-8
    w = fake_weights(256, m.hidden, 128)
    st = V.VllmMoe(w, m, 1, Experts.ALL, "cpu", kernel=NoLaunch(), quant=None)
    for s in range(1, 17):
        b = st._width(s)
        assert b.naive == (s <= 8), s  # 8 tokens * 8 * 4 = 256 <= 256
        (grid, kw), bm = b.g1, b.cfg["BLOCK_SIZE_M"]
        if b.naive:  # one block per (token, expert) pair, expert_ids the route itself
            assert kw["sorted_token_ids_ptr"] is None and kw["EM"] == s * 8 * bm and int(b.ntp) == s * 8 * bm
            assert kw["expert_ids_ptr"].data_ptr() == b.ids.data_ptr()
        else:  # vLLM's small-batch bound on the launched blocks, and its sorted_ids length
            assert kw["EM"] == min(b.sorted.numel(), s * 8 * bm) and b.sorted.numel() == s * 8 * bm
        assert grid == (-(-kw["EM"] // bm) * -(-2 * 128 // b.cfg["BLOCK_SIZE_N"]),)


def test_expert_parallel_always_aligns(no_vllm_env):
    m = dataclasses.replace(load_model("tiny"), experts=256)
    w = fake_weights(128, m.hidden, 128)
    w.first_expert, w.experts = 128, Experts.LOCAL
    st = V.VllmMoe(w, m, 1, Experts.LOCAL, "cpu", kernel=NoLaunch(), quant=None)
    b = st._width(1)
    assert not b.naive and st.first == 128 and st.n == 128 and st.n_align == 256  # vLLM's expert map


def test_a_kernel_with_unknown_required_arguments_is_refused(no_vllm_env):
    class Newer(NoLaunch):
        arg_names = NoLaunch.arg_names + ["SOMETHING_NEW"]

    m = load_model("tiny")
    st = V.VllmMoe(fake_weights(m.experts, m.hidden, 128), m, 1, Experts.ALL, "cpu", kernel=Newer(), quant=None)
    with pytest.raises(UsageError, match="SOMETHING_NEW"):
        st._width(1)


def test_search_space_is_benchmark_moes_pruned_for_block_fp8():
    full, space = V.search_space(dedupe=False), V.search_space()
    assert len(full) == 640 and len(space) == 320
    assert all(c["BLOCK_SIZE_K"] % 128 == 0 and c["BLOCK_SIZE_N"] % 128 == 0 for c in full)
    assert {c["BLOCK_SIZE_M"] for c in space} == {16, 32, 64, 128, 256} and {c["BLOCK_SIZE_K"] for c in space} == {128}


def test_sweep_takes_the_fastest_per_width_and_skips_what_cannot_compile():
    import triton

    space = V.search_space()[:6]

    def time_us(s, cfg):
        if cfg is space[0]:
            raise triton.runtime.errors.OutOfResources(1, 0, "shared memory")
        return abs(space.index(cfg) - s) + 1.0

    best = V.sweep(time_us, [2, 4], space)
    assert best[2] == (space[2], 1.0) and best[4] == (space[4], 1.0)


def test_plain_pytorch_baselines_say_so_and_count_no_kernels_off_a_gpu():
    m = dataclasses.replace(load_model("tiny"), experts=8, intermediate=128)
    w = fake_weights(8, m.hidden, 128)
    for b in (Unfused(w, m, 1, Experts.ALL, "cpu"), Stock(w, m, 1, Experts.ALL, "cpu")):
        assert b.describe.startswith("a plain PyTorch composition (no all-reduce") and "not a tuned stack" in b.describe
    assert kernels_per_step(lambda: None, "cpu") is None
