"""ffnq's fp64 oracle held to the model's authors: Hugging Face transformers ships MiniMax-M2's own
modules (MiniMaxM2RMSNorm, MiniMaxM2SparseMoeBlock: sigmoid scores, a selection-only bias,
renormalised top-k, SiLU-gated experts), and on the same weights and inputs they must give what
ffnq.reference gives. Only the post-attention norm and the MoE block are compared: the seam's
sum (residual + every rank's part) is the input of both."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("transformers.models.minimax_m2.modeling_minimax_m2")

from ffnq import reference  # noqa: E402
from ffnq.spec import Experts, load_model  # noqa: E402
from ffnq.weights import dequant, synthetic  # noqa: E402


def hf_layer(spec, full):
    """The model's own norm and MoE block, fp64, holding ``full`` dequantized."""
    cfg = transformers.MiniMaxM2Config(hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                                       num_local_experts=spec.experts, num_experts_per_tok=spec.top_k,
                                       rms_norm_eps=spec.eps, hidden_act="silu")
    norm = hf.MiniMaxM2RMSNorm(spec.hidden, eps=cfg.rms_norm_eps).double()
    moe = hf.MiniMaxM2SparseMoeBlock(cfg).double().eval()
    f64 = torch.float64
    with torch.no_grad():
        norm.weight.copy_(full.post_norm.to(f64))
        moe.gate.weight.copy_(full.router.to(f64))
        moe.e_score_correction_bias.copy_(full.router_bias.to(f64))
        w1, w3 = dequant(full.w1, full.s1, spec.block, f64), dequant(full.w3, full.s3, spec.block, f64)
        moe.experts.gate_up_proj.copy_(torch.cat([w1, w3], 1))  # [E, 2I, H]: gate rows, then up rows
        moe.experts.down_proj.copy_(dequant(full.w2, full.s2, spec.block, f64))
    return norm, moe


def test_the_model_config_matches_ffnq_s_minimax_m2():
    c, m = transformers.MiniMaxM2Config(), load_model("minimax-m2")
    assert (c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok, c.rms_norm_eps,
            c.hidden_act) == (m.hidden, m.intermediate, m.experts, m.top_k, m.eps, "silu")


@pytest.mark.parametrize("scale", [1.0, 1e-3], ids=["unit", "small-rms"])  # 1e-3: the eps shows
def test_reference_matches_the_model_s_own_modules(scale):
    spec = load_model("tiny")
    full = synthetic(spec, seed=11)
    g = torch.Generator().manual_seed(5)
    s, tp = 16, 2
    parts = [(torch.randn(s, spec.hidden, generator=g) * scale).bfloat16() for _ in range(tp)]
    residual = (torch.randn(s, spec.hidden, generator=g) * scale).bfloat16()
    slots = torch.arange(s, dtype=torch.int64)  # no padding: the model has none
    ref = reference.step(parts, residual, slots, full, spec, Experts.ALL)
    assert not ref.near_tie.any()  # the model scores in fp32: a near tie could pick the other side

    norm, moe = hf_layer(spec, full)
    with torch.no_grad():
        h = residual.double() + sum(p.double() for p in parts)
        x = norm(h)
        _, weights, idx = moe.gate(x, moe.e_score_correction_bias)
        out = moe(x[None])[0]

    torch.testing.assert_close(ref.res_out, h, rtol=0, atol=0)
    order = idx.sort(-1)
    assert torch.equal(ref.chosen, order.values)  # the bias selects ...
    # ... and the weights are the un-biased sigmoid scores renormalised (the model rounds them to fp32)
    torch.testing.assert_close(ref.weights, weights.gather(1, order.indices).double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ref.out, out, rtol=1e-5, atol=1e-6 * float(out.abs().max()))
    assert float(out.abs().max()) > 0


def test_a_bias_that_only_selects_is_what_the_model_does():
    """A large bias on one expert makes every row choose it, but its weight stays its plain
    sigmoid score renormalised: a bias added into the weights would fail here."""
    spec = load_model("tiny")
    full = synthetic(spec, seed=3)
    full.router_bias.zero_()
    full.router_bias[5] = 10.0
    g = torch.Generator().manual_seed(9)
    parts = [torch.randn(4, spec.hidden, generator=g).bfloat16()]
    residual = torch.randn(4, spec.hidden, generator=g).bfloat16()
    ref = reference.step(parts, residual, torch.arange(4), full, spec, Experts.ALL)
    norm, moe = hf_layer(spec, full)
    with torch.no_grad():
        x = norm(residual.double() + parts[0].double())
        _, weights, idx = moe.gate(x, moe.e_score_correction_bias)
    assert (ref.chosen == 5).any(-1).all() and (idx == 5).any(-1).all()
    order = idx.sort(-1)
    torch.testing.assert_close(ref.weights, weights.gather(1, order.indices).double(), rtol=1e-6, atol=1e-7)
    assert float(ref.weights[ref.chosen == 5].max()) < 0.5  # a score under 1 among eight, not 10
