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
