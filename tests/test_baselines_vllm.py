"""Baseline (d): vLLM's fused_moe kernel in the stock composition. The host side (alignment,
activation quantization) is ffnq's and tested here; the kernel itself is a fetched copy that ffnq
does not ship, so its end-to-end test runs only where FFNQ_VLLM_MOE names it (interpreter or GPU)."""
import os

import pytest
import torch
import torch.nn.functional as F

from ffnq import reference
from ffnq.errors import UsageError
from ffnq.spec import Experts, load_model
from ffnq.baselines.vllm import VllmMoe, align, kernel_path, quant_groups
from ffnq.weights import shard, synthetic


def test_align_groups_pairs_by_expert_in_padded_blocks():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 6, (5, 4), generator=g)
    ids[0] = torch.tensor([2, 2, 2, 2])  # an expert with a run longer than one block
    sorted_ids, expert_ids, ntp = align(ids, 6, 4)
    n, flat = ids.numel(), ids.flatten()
    assert sorted_ids.numel() == n + 6 * 3 and int(ntp) % 4 == 0
    seen = []
    for b in range(int(ntp) // 4):
        blk = sorted_ids[4 * b: 4 * b + 4]
        real = blk[blk < n].long()
        assert (flat[real] == expert_ids[b]).all()  # every pair of a block is its expert's
        assert (blk[: len(real)] < n).all()  # padding only at a run's end
        seen += real.tolist()
    assert sorted(seen) == list(range(n))  # every pair once
    assert int(ntp) == sum(-(-int((flat == e).sum()) // 4) * 4 for e in range(6))
    assert (sorted_ids[int(ntp):] == n).all()


def test_quant_groups_round_trip_within_fp8_precision():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 256, generator=g) * torch.logspace(-3, 3, 256)
    q, s = quant_groups(x, 128)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    back = (q.float().view(3, 2, 128) * s[..., None]).view(3, 256)
    big = x.abs() > 1e-3 * x.abs().amax()  # e4m3: 3 mantissa bits, 2^-4 relative
    assert ((back - x).abs()[big] <= x.abs()[big] / 16 + 1e-12).all()


def test_missing_kernel_is_a_usage_error(monkeypatch, tmp_path):
    monkeypatch.delenv("FFNQ_VLLM_MOE", raising=False)
    with pytest.raises(UsageError, match="FFNQ_VLLM_MOE='' is not a file"):
        kernel_path()
    f = tmp_path / "k.py"
    f.write_text("x = 1\n")
    monkeypatch.setenv("FFNQ_VLLM_MOE", str(f))
    with pytest.raises(UsageError, match="holds no fused_moe_kernel"):
        kernel_path()


@pytest.mark.skipif(not os.environ.get("FFNQ_VLLM_MOE") or not (os.environ.get("TRITON_INTERPRET") == "1"
                                                                 or torch.cuda.is_available()),
                    reason="needs FFNQ_VLLM_MOE (a fetched copy of vLLM's kernel) and a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("cfg", ['{"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "GROUP_SIZE_M": 1}', ""])
def test_vllm_composition_matches_reference(cfg, monkeypatch):
    monkeypatch.setenv("FFNQ_VLLM_MOE_CONFIG", cfg)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernel's range() over a runtime bound needs
        import triton.runtime.interpreter as ti   # int() of a 1-element array, an error in numpy 2

        patch = ti._patch_lang_tensor

        def index_fix(tensor, scope):
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        monkeypatch.setattr(ti, "_patch_lang_tensor", index_fix)
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    m = load_model("tiny")
    full = synthetic(m, seed=41)
    st = VllmMoe(shard(full, m, 1, 0, Experts.ALL, dev), m, 1, Experts.ALL, dev)
    g = torch.Generator().manual_seed(3)
    s = 5
    part = torch.randn(s, m.hidden, generator=g).bfloat16()
    res = torch.randn(s, m.hidden, generator=g).bfloat16()
    slots = torch.tensor([0, 1, -1, 3, 4])
    out, res_out = st(part.to(dev), res.to(dev), None, slots.to(dev))
    ref = reference.step([part], res, slots, full, m, Experts.ALL)
    # FP8 activations (W8A8, 1 x 128 groups) cost ~3% against the fp64 step: a bound for gross
    # errors only; the layouts, strides and alignment are held to the same numerics emulated below
    assert reference.compare(out.cpu(), ref.out)["rel_err"] < 8e-2
    assert (out[2] == 0).all()
    assert reference.compare(res_out.cpu(), ref.res_out)["wrong"] == 0
    x = torch.randn(s, m.hidden, generator=g).to(dev)
    local = torch.randint(0, st.n, (s, m.top_k), generator=g).to(dev)
    wts = torch.rand(s, m.top_k, generator=g).to(dev)
    got = st._experts(x, local, wts, s).cpu().double()
    assert torch.allclose(got, emulate(st, x, local, wts).double(), rtol=2e-2, atol=2e-2 * got.abs().max())


def emulate(st, x, local, wts):
    """The kernel's numerics in fp64 from the same quantized operands (bf16 where it stores)."""
    from ffnq.weights import dequant

    b = st.spec.block

    def deq(q, sc):
        return (q.double().view(q.shape[0], -1, b) * sc.double()[..., None]).view(q.shape)

    w13 = dequant(st.w13, st.s13, b, torch.float64)
    w2 = dequant(st.w2, st.s2, b, torch.float64)
    xq = deq(*quant_groups(x.to(torch.bfloat16), b))
    y = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=x.device)
    for r in range(x.shape[0]):
        for k in range(local.shape[1]):
            e = int(local[r, k])
            gu = (w13[e] @ xq[r]).to(torch.bfloat16)
            a = F.silu(gu[: st.half]) * gu[st.half:]
            aq = deq(*quant_groups(a[None], b))[0]
            y[r] += (w2[e] @ aq * float(wts[r, k])).to(torch.bfloat16).double()
    return y
