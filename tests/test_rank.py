"""ffnq.jobs.rank.step_inputs: every rank regenerates every check's inputs from (seed, case, step,
s) alone, so they must be the same for the same key and fresh for any other; their shapes and
dtypes are what the runners take, and padding rows (slot -1) number min(padding, s) among
distinct non-negative slots."""
import pytest
import torch

from ffnq.jobs.rank import step_inputs
from ffnq.spec import Experts, load_model
from helpers import write_checkpoint

M = load_model("tiny")


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


def test_same_key_same_inputs_any_other_key_fresh_inputs():
    base = dict(tp=2, seed=5, s=6, case=3, step=7, padding=2)
    a = step_inputs(M, **base)
    assert same(a, step_inputs(M, **base))
    for key in ("seed", "case", "step"):
        b = step_inputs(M, **base | {key: base[key] + 1})
        assert not torch.equal(a[0][0], b[0][0]), key
        assert not torch.equal(a[1], b[1]), key


def test_shapes_dtypes_and_not_zeros():
    parts, residual, slots = step_inputs(M, 3, 1, 5, 0)
    assert len(parts) == 3
    for p in parts:
        assert p.shape == (5, M.hidden) and p.dtype == torch.bfloat16 and p.device.type == "cpu"
        assert (p != 0).float().mean() > 0.9
    assert residual.shape == (5, M.hidden) and residual.dtype == torch.bfloat16
    assert 0.5 < residual.float().std() < 2.0
    assert not torch.equal(parts[0], parts[1])  # each rank has its own part
    assert slots.shape == (5,) and slots.dtype == torch.int64
    for case in range(20):  # two rows never share a slot, at the widest width too
        wide = step_inputs(M, 1, 1, M.max_tokens, case)[2]
        assert wide.unique().numel() == M.max_tokens and (wide >= 0).all()
    # parts are scaled by 1/sqrt(tp): their sum has about the residual's scale
    assert 0.85 < sum(p.float() for p in parts).std() < 1.15


@pytest.mark.parametrize("s, padding", [(1, 0), (1, 1), (4, 1), (7, 3), (7, 6), (7, 7), (5, 9), (16, 5)])
def test_padding_rows_and_distinct_slots(s, padding):
    _, _, slots = step_inputs(M, 2, 9, s, 4, 0, padding)
    pad = slots == -1
    assert int(pad.sum()) == min(padding, s)
    assert bool(pad.all()) == (padding >= s)
    live = slots[~pad]
    assert (live >= 0).all() and live.unique().numel() == live.numel()
    assert not (slots < -1).any()


def test_padding_marks_rows_only_and_leaves_the_rest():
    """The same key with and without padding: the live rows keep their slots and the parts and
    residual are the same draws, so a padded check differs from its plain one only by its pads."""
    plain = step_inputs(M, 2, 9, 8, 4, 0, 0)
    padded = step_inputs(M, 2, 9, 8, 4, 0, 3)
    assert torch.equal(plain[1], padded[1]) and torch.equal(plain[0][1], padded[0][1])
    live = padded[2] != -1
    assert torch.equal(plain[2][live], padded[2][live])


def test_padding_rows_are_spread_over_the_width():
    """Over many draws the padded rows fall everywhere, not always at the start or the end."""
    hit = torch.zeros(8, dtype=torch.int64)
    for case in range(40):
        hit += (step_inputs(M, 1, 2, 8, case, 0, 2)[2] == -1).long()
    assert (hit > 0).all()


def test_negative_padding_is_refused():
    with pytest.raises(ValueError, match="padding -1"):
        step_inputs(M, 1, 0, 6, 0, 0, -1)


@pytest.mark.slow  # 32 s
def test_a_checkpoint_layer_is_every_rank_s_weights(tmp_path):
    """setup(checkpoint=, layer=): the full layer on every rank is the file's (not the seed's
    synthetic one), each rank holds its shard of it, and steps on it check against the oracle."""
    from multirank import run_ranks
    from rankfns import digest, from_checkpoint

    from ffnq.weights import load_layer, shard

    ck = write_checkpoint(tmp_path / "ck", M, layers=[4, 9], seed=100)
    got = run_ranks(from_checkpoint, 2, str(ck), 9)
    want = load_layer(ck, 9, M)
    for rank, g in enumerate(got):
        assert g["router"] == digest(want.router)
        assert g["w13"] == digest(shard(want, M, 2, rank, Experts.ALL).w13)
        for c in g["checks"]:
            assert c["fault"] is None and c["route_ok"] and c["pad_zero"], c
            assert c["out"]["wrong"] == 0 and c["out"]["rel_err"] < 1e-2, c
    assert got[0]["router"] != digest(load_layer(ck, 4, M).router) and got[0]["w13"] != got[1]["w13"]
