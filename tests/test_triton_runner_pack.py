"""The Triton runner's packed w13 and w2 (PACKED_W13, PACKED_W2): the layouts the kernel's stages
read, one copy per tensor object, remade after an in-place write, and handed only to the builds
that read them."""
import pytest
import torch

from ffnq.backends.triton.runner import PackedWeights, packed_w13, packed_w2


def test_packed_layout_is_each_k_steps_gate_then_up_block():
    ne, i_r, h, bn = 2, 8, 256, 4
    w = torch.arange(ne * 2 * i_r * h, dtype=torch.int32).remainder(251).to(torch.uint8).view(ne, 2 * i_r, h)
    w = w.view(torch.float8_e4m3fn)
    p = packed_w13(w, bn)
    assert p.shape == w.shape and p.dtype == w.dtype and p.is_contiguous()
    flat = p.view(torch.uint8).view(ne, i_r // bn, h // 128, 2, bn, 128)
    raw = w.view(torch.uint8)
    for e, t, kb, half, r in [(0, 0, 0, 0, 0), (1, 1, 1, 1, 3), (0, 1, 0, 1, 2), (1, 0, 1, 0, 1)]:
        row = half * i_r + t * bn + r  # gate rows first, the up rows INTER further
        assert torch.equal(flat[e, t, kb, half, r], raw[e, row, kb * 128:(kb + 1) * 128])


def test_packed_w2_layout_is_each_items_rows_in_k_blocks():
    ne, h, i, bh, bk = 2, 256, 192, 128, 64
    w = torch.arange(ne * h * i, dtype=torch.int32).remainder(251).to(torch.uint8).view(ne, h, i)
    p = packed_w2(w.view(torch.float8_e4m3fn), bh, bk)
    assert p.shape == w.shape and p.is_contiguous()
    flat = p.view(torch.uint8).view(ne, h // bh, i // bk, bh, bk)
    for e, t, kb, r in [(0, 0, 0, 0), (1, 1, 2, 127), (0, 1, 1, 5), (1, 0, 2, 64)]:
        assert torch.equal(flat[e, t, kb, r], w[e, t * bh + r, kb * bk:(kb + 1) * bk])
    # an item (t) reads bh x i contiguous bytes: its rows' every K block, block after block
    assert torch.equal(p.view(torch.uint8)[1].reshape(-1)[bh * i:2 * bh * i].view(i // bk, bh, bk),
                       w[1, bh:2 * bh].view(bh, i // bk, bk).permute(1, 0, 2))


def test_one_copy_per_tensor_remade_after_an_in_place_write():
    pk = PackedWeights()
    w = torch.randn(2, 16, 256).to(torch.float8_e4m3fn)
    a = pk.get(w, 4)
    assert pk.get(w, 4) is a  # the same tensor object: the same copy
    assert pk.get(w, 8) is not a  # another tile height: its own layout
    other = w.clone()  # equal values, another tensor: packed anew
    assert pk.get(other, 4) is not a
    w.view(torch.uint8)[0, 0, 0] ^= 1  # written in place: its version moved on
    b = pk.get(w, 4)
    assert b is not a and torch.equal(b.view(torch.uint8), packed_w13(w, 4).view(torch.uint8))
    del other
    fresh = w.clone()
    pk.get(fresh, 4)  # a miss: the copies of freed tensors (other's) go, and w's of its old version
    assert sorted(id(ref()) for ref, *_ in pk._packed) == sorted([id(w), id(fresh)])


def _tiny_runner(tune: str, width: int | list[int], monkeypatch):
    """A TP1 Triton runner of the tiny model on this CPU at ``width`` (or widths: its constexprs, no
    launch) and its weights."""
    monkeypatch.setenv("FFNQ_TRITON_TUNE", tune)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from ffnq.backends.triton import TritonRunner
    from ffnq.spec import Experts, load_model
    from ffnq.weights import shard, synthetic
    spec = load_model("tiny")
    pb = TritonRunner.open_peers(spec, 1, 0, "cpu", "t")
    r = TritonRunner(1, 0, pb.sym, pb.peers, "cpu", widths=[width] if isinstance(width, int) else width, model=spec)
    return r, shard(synthetic(spec, seed=1), spec, 1, 0, Experts.ALL)


@pytest.mark.parametrize("tune, packed", [("", True), ("PACKED_W13=0", False)])
def test_only_builds_that_read_it_get_the_packed_copy(tune, packed, monkeypatch):
    r, w = _tiny_runner(tune, 2, monkeypatch)
    got = r._weights(w, 2)[3]
    assert (got is not w.w13) == packed
    assert torch.equal(got.view(torch.uint8), (packed_w13(w.w13, 64) if packed else w.w13).view(torch.uint8))


@pytest.mark.parametrize("tune, packed", [("", True), ("PACKED_W2=0", False), ("PACKED_W2=1,DOWN_FP8=0", False)])
def test_only_builds_that_read_it_get_the_packed_w2(tune, packed, monkeypatch):
    """PACKED_W2 (on by default) packs w2 in W2_PACK_ROWS-row tiles of UP_TILE columns; the fp16
    stage 2 (DOWN_FP8=0) reads w2 as given whatever the key says."""
    r, w = _tiny_runner(tune, 3, monkeypatch)
    got = r._weights(w, 3)[5]
    cx = r._cx[(3, False)]
    assert (got is not w.w2) == packed == bool(cx["PACKED_W2"])
    want = packed_w2(w.w2, 128, cx["UP_TILE"]) if packed else w.w2
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_one_packed_w2_serves_both_tile_heights(monkeypatch):
    """Two tokens' 64-row stage-2 tiles and three tokens' 128-row ones read the same packed w2
    (W2_PACK_ROWS = 128): a runner over widths 1-16 keeps one w2 copy, not one per tile height;
    W2_PACK_ROWS = 64 at two tokens is a layout of its own."""
    r, w = _tiny_runner("", [2, 3], monkeypatch)
    assert (r._cx[(2, False)]["DOWN_TILE"], r._cx[(3, False)]["DOWN_TILE"]) == (64, 128)
    assert r._weights(w, 2)[5] is r._weights(w, 3)[5]
    r64, _ = _tiny_runner("W2_PACK_ROWS@2=64", [2, 3], monkeypatch)
    a, b = r64._weights(w, 2)[5], r64._weights(w, 3)[5]
    assert a is not b and torch.equal(a.view(torch.uint8), packed_w2(w.w2, 64, 64).view(torch.uint8))


def test_a_pack_height_that_is_not_a_multiple_of_the_tile_is_refused_named(monkeypatch):
    from ffnq.backends.triton import geometry as G, offline
    from ffnq.spec import Experts, load_model
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "W2_PACK_ROWS=64")
    with pytest.raises(ValueError, match=r"W2_PACK_ROWS=64: allowed a multiple of DOWN_TILE \(128\)"):
        G.geometry(offline.build_key(load_model("minimax-m2"), 1, Experts.ALL, 3))


def test_a_new_view_of_the_same_weights_is_not_packed_again():
    """A step that indexes its layer's weights anew (w13_all[layer]: a new view object each time)
    reads the same weights: one copy per layer, not a copy per launch; another layer, another
    place in the owner, its own copy; a write through any view repacks (their one version count)."""
    pk = PackedWeights()
    w_all = torch.randn(3, 2, 16, 256).to(torch.float8_e4m3fn)  # [layers, experts, 2 I, H]
    a = pk.get(w_all[0], 4)
    assert pk.get(w_all[0], 4) is a and pk.get(w_all.select(0, 0), 4) is a
    b = pk.get(w_all[1], 4)
    assert b is not a and torch.equal(b.view(torch.uint8), packed_w13(w_all[1], 4).view(torch.uint8))
    assert len(pk._packed) == 2
    w_all[2].view(torch.uint8)[0, 0, 0] ^= 1  # a write to layer 2 moves the owner's one version count
    c = pk.get(w_all[0], 4)
    assert c is not a and len(pk._packed) == 1  # layer 1's copy, of the old version, went too
    assert torch.equal(c.view(torch.uint8), packed_w13(w_all[0], 4).view(torch.uint8))


def test_settled_weights_know_a_new_view_of_the_same_tensors():
    from ffnq.backends.triton.runner import SettledWeights
    seen = SettledWeights()
    base = torch.ones(2, 8)
    assert seen.first([base[0]]) and not seen.first([base[0]])  # a new view, the same place
    assert seen.first([base[1]])  # another place in it: other weights
    assert seen.first([base[0].view(2, 4)])  # another shape: not the same tensor
