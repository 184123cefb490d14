"""The stock composition (bench baselines b and c) computes the same step as the reference."""
import pytest
import torch

from ffnq import reference
from ffnq.spec import Experts, load_model
from ffnq.baselines.stock import Stock
from ffnq.weights import shard, synthetic


@pytest.mark.slow  # 50 s
def test_stock_matches_reference_tp1():
    m = load_model("tiny")
    full = synthetic(m, seed=31)
    g = torch.Generator().manual_seed(2)
    for experts in (Experts.ALL, Experts.LOCAL):
        st = Stock(shard(full, m, 1, 0, experts), m, 1, experts, "cpu")
        for s in (1, 7, 16):
            part = torch.randn(s, m.hidden, generator=g).bfloat16()
            res = torch.randn(s, m.hidden, generator=g).bfloat16()
            slots = torch.arange(s)
            slots[::3] = -1
            out, res_out = st(part, res, None, slots)
            ref = reference.step([part], res, slots, full, m, experts)
            # bf16 activations and bf16 grouped GEMM: about 1e-2 of bf16 rounding noise at worst
            assert reference.compare(out, ref.out)["rel_err"] < 2e-2
            assert reference.compare(res_out, ref.res_out)["wrong"] == 0
            assert (out[slots < 0] == 0).all()
            assert torch.equal(st.chosen(s), ref.chosen)  # sorted, -1 on padding rows: what bench follows
