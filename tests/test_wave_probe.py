"""scripts/wave_probe.py --pack: the tile-packed layout holds each stage-1 item's K-step blocks
(gate, then up) contiguously, and the probe's packed loads read the items the row-major ones do."""
import os

import pytest
import torch
from helpers import script_module


def _probe():
    return script_module("wave_probe")


def test_packed_layout_is_the_items_blocks_in_order():
    p = _probe()
    bn, k = 4, 256
    w = torch.arange(2 * 16 * k, dtype=torch.int32).view(2, 16, k)  # 2 experts, 8 gate + 8 up rows
    g = p.packed(w, bn, True)  # [expert, tile, K block, (gate, up), bn, 128]
    assert g.shape == (2, 2, 2, 2, bn, 128) and g.is_contiguous()
    for e, t, kb, gu, r in [(0, 0, 0, 0, 0), (1, 1, 1, 1, 3), (0, 1, 0, 1, 2), (1, 0, 1, 0, 1)]:
        assert torch.equal(g[e, t, kb, gu, r], w[e, gu * 8 + t * bn + r, kb * 128:(kb + 1) * 128])
    d = p.packed(w, bn, False)  # [expert, tile, K block, bn, 128]
    assert d.shape == (2, 4, 2, bn, 128) and torch.equal(d[1, 3, 1, 2], w[1, 3 * bn + 2, 128:])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="slow: set TRITON_INTERPRET=1 to run")
def test_packed_loads_read_the_same_items():
    """Both layouts' items against torch's sums; row-major weights read as packed are wrong."""
    p = _probe()
    ne, ks, ir = 2, 2, 128
    nt = ir // p.BN
    (w, s), = p.weight_sets(1, ne, 2 * ir, p.H, p.BN, torch.device("cpu"))
    xt = torch.randn(p.N, p.H).to(p.F8)
    ref = p.want(w, s, xt, nt, ks, p.BN, True)
    err = {}
    for name, ww, pack in (("rows", w, False), ("packed", p.packed(w, p.BN, True), True), ("mixed", w, True)):
        o = torch.full((ne * nt * ks, p.BN, p.N), float("nan"))
        p.expert_items[(3,)](ww, ww, s, xt, o, ne * nt * ks, NT=nt, KS=ks, K=p.H, ROWS=2 * ir, BN=p.BN, N=p.N,
                             GU=True, TMA=False, NS=3, PACK=pack)
        err[name] = ((o - ref).abs().max() / ref.abs().max()).item()
    assert err["rows"] < 1e-4 and err["packed"] < 1e-4 and err["mixed"] > 0.1


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="slow: set TRITON_INTERPRET=1 to run")
def test_fused_items_match_torch():
    """--fused: each item's stage-1 tile and its down projection against torch's; a w2 scale
    read from the wrong item is caught."""
    p = _probe()
    ne, ir, bn, S = 1, 64, 32, 2
    nt = ir // bn
    n = ne * nt
    w1 = p.packed((torch.randn(ne, 2 * ir, p.H) * 0.5).to(p.F8), bn, True)
    s1 = torch.rand(ne, 2 * nt, p.H // 128) + 0.5
    w2 = (torch.randn(n, p.H, bn) * 0.5).to(p.F8)
    s2 = torch.rand(n, p.H // 128) + 0.5
    x = torch.randn(p.N, p.H).to(p.F8)
    ref = p.want_fused(w1, s1, x, w2, s2, bn, S)
    for scales, ok in ((s2, True), (s2.flip(0), False)):
        o = torch.full((n, S, p.H), float("nan"))
        p.fused_items[(2,)](w1, s1, x, w2, scales, o, n, NT=nt, K=p.H, BN=bn, N=p.N, S=S, HB=256, NS=3, NS2=3)
        err = ((o - ref).abs().max() / ref.abs().max()).item()
        assert (err < 1e-2) == ok, err
