"""The unfused baseline computes the same step as the reference, through the router both stock
compositions share."""
import pytest
import torch

from ffnq import reference
from ffnq.baselines.unfused import Unfused, route
from ffnq.spec import Experts, load_model
from ffnq.weights import shard, synthetic


@pytest.mark.slow  # 29 s
def test_unfused_matches_reference_tp1():
    m = load_model("tiny")
    full = synthetic(m, seed=37)
    g = torch.Generator().manual_seed(5)
    for experts in (Experts.ALL, Experts.LOCAL, Experts.NONE):
        un = Unfused(shard(full, m, 1, 0, experts), m, 1, experts, "cpu")
        for s in (1, 9, 16):
            part = torch.randn(s, m.hidden, generator=g).bfloat16()
            res = torch.randn(s, m.hidden, generator=g).bfloat16()
            slots = torch.arange(s)
            slots[1::4] = -1
            out, res_out = un(part, res, None, slots)
            ref = reference.step([part], res, slots, full, m, experts)
            # fp32 experts on cpu, bf16 output: bf16 rounding of the sum at worst
            assert reference.compare(out, ref.out)["rel_err"] < 1e-2, (experts, s)
            assert reference.compare(res_out, ref.res_out)["wrong"] == 0
            assert (out[slots < 0] == 0).all()
            assert torch.equal(un.chosen(s), ref.chosen)


def test_route_picks_by_biased_scores_and_weighs_by_unbiased():
    m = load_model("tiny")
    w = shard(synthetic(m, seed=3), m, 1, 0, Experts.ALL)
    x = torch.randn(5, m.hidden, generator=torch.Generator().manual_seed(1))
    w.router_bias.zero_()
    w.router_bias[7] = 1e3  # expert 7 picked for every row, whatever its score
    idx, wts = route(x, w, m.top_k)
    scores = torch.sigmoid(x @ w.router.float().T)
    assert idx.shape == wts.shape == (5, m.top_k) and (idx == 7).any(-1).all()
    assert torch.allclose(wts.sum(-1), torch.ones(5))
    assert torch.allclose(wts * scores.gather(1, idx).sum(-1, keepdim=True), scores.gather(1, idx))
