"""The cpu runner against the fp64 reference, in real processes, and its fault protocol."""
from __future__ import annotations

import pytest
import torch

import rankfns
from ffnq.backends.cpu import CpuRunner
from ffnq.errors import UsageError
from ffnq.spec import load_model
from multirank import run_ranks

MAX_REL = 1e-2


def assert_correct(chk):
    where = f"width {chk['s']} case {chk['case']}"
    assert chk["fault"] is None, where
    assert chk["out"]["rel_err"] < MAX_REL and chk["out"]["wrong"] == 0, (where, chk["out"])
    # res_out is one bf16 rounding of the fp32 sum: about 2^-9 relative
    assert chk["res"]["rel_err"] < 4e-3 and chk["res"]["wrong"] == 0, (where, chk["res"])
    assert chk["route_ok"], where
    assert chk["pad_zero"], where


@pytest.mark.parametrize("tp,widths", [(1, [1, 3, 16]), (2, [1, 2, 5, 8, 16]),
                                       pytest.param(3, [1, 4, 13], marks=pytest.mark.slow)])  # tp 3: 12-18 s
def test_matches_reference(tp, widths):
    for rank_checks in run_ranks(rankfns.correctness, tp, widths):
        assert [c["s"] for c in rank_checks] == widths
        for chk in rank_checks:
            assert_correct(chk)
    # padding rows were exercised
    assert any(c["padding"] for c in rank_checks)


@pytest.mark.slow  # 12-18 s
def test_tp4_all_experts():
    # MiniMax-like TP4 (384 per rank at minimax, 384 at tiny)
    for rank_checks in run_ranks(rankfns.correctness, 4, [1, 16], "all", False, 5.0, timeout=300):
        for chk in rank_checks:
            assert_correct(chk)


@pytest.mark.slow  # 45 s
def test_eight_ranks_local_experts():
    # 8 ranks of whole experts (EP8), still one reduce over all ranks;
    # a generous wait bound: 8 processes share 2 cores
    for rank_checks in run_ranks(rankfns.correctness, 8, [1, 16], "local", False, 5.0, timeout=300):
        for chk in rank_checks:
            assert_correct(chk)


@pytest.mark.slow  # 26 s
def test_local_and_none_experts():
    for chk in run_ranks(rankfns.correctness, 2, [3, 9], experts="local")[0]:
        assert_correct(chk)
    # NONE: no expert runs, so the oracle's MoE output is zero and every element must be (a zero
    # reference gives a zero tolerance: any nonzero element counts as wrong)
    for chk in run_ranks(rankfns.correctness, 2, [3], experts="none")[1]:
        assert chk["out"]["elements"] and chk["out"]["wrong"] == 0 and chk["out"]["rel_err"] == 0, chk["out"]
        assert chk["fault"] is None and chk["route_ok"] and chk["pad_zero"]
        assert chk["res"]["rel_err"] < 4e-3


@pytest.mark.slow  # 33 s
def test_two_runners_share_one_epoch():
    for res in run_ranks(rankfns.shared_epoch, 2):
        assert res["same_word"]
        assert res["epochs"] == [1, 2, 3, 4, 5, 6]
        for chk in res["checks"]:
            assert_correct(chk)


@pytest.mark.slow  # 12-18 s
def test_injection_under_timeout_is_correct_and_visible():
    late, delay = 1, 0.3 * rankfns.TIMEOUT
    res = run_ranks(rankfns.injection, 2, late, delay)
    for rank, r in enumerate(res):
        assert_correct(r["first"])
        assert_correct(r["after"])
    # the on-time rank's timeline shows it waiting about the delay for the late one
    waits = res[0]["first"]["seam_wait_ns"]
    assert min(waits) > 0.5 * delay * 1e9, waits
    assert res[1]["first"]["seam_wait_ns"][0] < 0.5 * delay * 1e9


@pytest.mark.slow  # 17-21 s each
@pytest.mark.parametrize("tp,late", [(2, 0), (2, 1), (3, 2)])
def test_injection_over_timeout_faults_every_rank_then_recovers(tp, late):
    delay = 2.5 * rankfns.TIMEOUT
    res = run_ranks(rankfns.injection, tp, late, delay)
    for rank, r in enumerate(res):
        f = r["first"]["fault"]
        assert f is not None, f"rank {rank} saw no fault"
        assert f["missing_ranks"] == [late], (rank, f)
        assert f["rank"] == rank and f["epoch"] == 1
        # bounded: the late rank's own delay plus one timeout, plus scheduling margin
        assert r["first"]["wall_s"] < delay + rankfns.TIMEOUT + 1.0
        if rank != late:
            assert f["waited_ns"] >= rankfns.TIMEOUT * 1e9
        assert_correct(r["after"])


@pytest.mark.slow  # 12-18 s
def test_stale_flags_never_satisfy_a_wait():
    r0 = run_ranks(rankfns.stale, 2)[0]
    assert_correct(r0["good"])
    assert len(r0["tags"]) == 4
    for tag, got in r0["tags"].items():
        f = got["fault"]
        assert f is not None and f["missing_ranks"] == [1], (tag, f)
        assert got["wall_s"] < rankfns.TIMEOUT + 0.5


def _runner(**kw):
    m = load_model("tiny")
    args = dict(tp=1, rank=0, sym=0, peers=torch.zeros(1, dtype=torch.int64), device="cpu", model=m)
    args.update(kw)
    return CpuRunner(**args)


@pytest.mark.parametrize("kw,match", [
    (dict(rank=1), "rank 1"),
    (dict(timeout=0), "timeout 0"),
    (dict(widths=[0, 17]), r"widths \[0, 17\]"),
    (dict(tp=8, peers=torch.zeros(8, dtype=torch.int64)), "tp=8"),
    (dict(peers=torch.zeros(2, dtype=torch.int64)), "peers has 2"),
    (dict(device="cuda:0"), "cpu backend"),
])
def test_bad_runner_arguments(kw, match, tmp_path):
    from ffnq.dist import ShmPeers
    shm = ShmPeers(f"bad{abs(hash(match)) % 10**6}", 0, 1, CpuRunner.peer_bytes(load_model("tiny"), 1))
    kw.setdefault("sym", shm.addresses[0])
    if "peers" not in kw:
        kw["peers"] = torch.tensor(shm.addresses)
    with pytest.raises(UsageError, match=match):
        _runner(**kw)
    shm.close()


def test_bad_call_arguments():
    from ffnq.dist import ShmPeers
    m = load_model("tiny")
    shm = ShmPeers("badcall", 0, 1, CpuRunner.peer_bytes(m, 1))
    r = CpuRunner(1, 0, shm.addresses[0], torch.tensor(shm.addresses), "cpu", widths=[2], model=m)
    x = torch.randn(2, m.hidden).bfloat16()
    with pytest.raises(UsageError, match="width 3"):
        r(torch.randn(3, m.hidden).bfloat16(), x, None, torch.arange(3))
    with pytest.raises(UsageError, match="residual"):
        r(x, x.float(), None, torch.arange(2))
    with pytest.raises(UsageError, match="slots"):
        r(x, x, None, torch.arange(2).int())
    with pytest.raises(UsageError, match="weights.post_norm: None"):
        r.warm(object())
    with pytest.raises(UsageError, match="region 'nope'"):
        r.region(2, "nope")
    shm.close()


@pytest.mark.slow  # 26 s
def test_steps_on_other_weights_read_those_weights():
    """The runner's fp32 copies of the experts answer for the tensors they came from while those
    live unchanged: another set, the same w13 under other scales, and weights written in place
    are each stepped on as themselves."""
    got = run_ranks(rankfns.other_weights, 1)[0]
    assert set(got) == {"own", "other set", "other scales", "written in place"}
    assert all(e < MAX_REL for e in got.values()), got
