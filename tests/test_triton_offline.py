"""The Triton kernel compiles with no GPU for sm_90, gfx942 and gfx950, and the offline table
reports resources and static residency (a grid too large for the chip is not resident)."""
import os

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from ffnq import symm
from ffnq import residency  # noqa: E402
from ffnq.backends.triton import TritonRunner, offline  # noqa: E402
from ffnq.backends.triton.tiles import _topk  # noqa: E402
from ffnq.spec import Experts, load_model  # noqa: E402

TARGETS = ["sm_90", "gfx942", "gfx950"]
KEYS = {"width", "kernel", "compile_s", "target", "spills", "shared_bytes", "ctas_per_cu", "cus", "grid", "resident"}


@pytest.fixture(scope="module")
def tables():
    spec = load_model("tiny")
    return {t: offline.offline_table(spec, 2, Experts.ALL, t, widths=[1, 16]) for t in TARGETS}


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_table_rows(tables, target):
    rows = tables[target]
    assert [r["width"] for r in rows] == [1, 16]
    for r in rows:
        assert "error" not in r, r.get("error")
        assert KEYS <= set(r), KEYS - set(r)
        assert r["target"] == target and r["cus"] == residency.CUS[target]
        assert r["grid"] == TritonRunner.blocks_for(r["width"]) == 264
        assert r["kernel"].startswith("ffn_tiny_s") and r["compile_s"] > 0
        assert r["ctas_per_cu"] >= 1 and r["resident"] is True
        # at 255 registers ptxas spills a few words on sm_90: minimax-m2 0-8 B, this tiny build
        # 72 B at 16 tokens with the scale on each K block's product (8 B without it; H = 256 is
        # two K steps, so its pipeline differs); a real spill problem is kilobytes
        assert r["spills"] <= 128
        if target == "sm_90":
            assert 0 < r["regs"] <= 255
            assert "mma" in r["mma"]
        else:
            assert r["vgpr"] > 0 and r["sgpr"] > 0
            assert r["mma"].startswith("v_mfma")


def test_grid_too_large_is_not_resident():
    spec = load_model("tiny")
    rows = offline.offline_table(spec, 1, Experts.ALL, "sm_90", widths=[2], blocks=4096, jobs=1)
    (r,) = rows
    assert "error" not in r, r.get("error")
    assert r["grid"] == 4096 and r["resident"] is False
    assert r["ctas_per_cu"] * r["cus"] < 4096


@pytest.mark.slow
def test_local_and_none_modes_compile():
    spec = load_model("tiny")
    for ex in (Experts.LOCAL, Experts.NONE):
        (r,) = offline.offline_table(spec, 2, ex, "sm_90", widths=[3], jobs=1)
        assert "error" not in r, r.get("error")
        assert r["resident"]


def test_fp32_dots_at_tf32_are_counted():
    """An fp32 tt.dot at tf32 precision is counted, and a build holding one is refused, named
    (offline rows and TritonRunner.warm); the f16 dots Triton also tags tf32 are not counted."""
    from ffnq.backends.triton import geometry as G
    f32 = ("%pl = tt.dot %a, %b, %c, inputPrecision = tf32 : tensor<16x16xf32, #ttg.dot_op<{opIdx = 0}>> * "
           "tensor<16x256xf32, #ttg.dot_op<{opIdx = 1}>> -> tensor<16x256xf32, #mma>")
    f16 = ("%r = tt.dot %a, %b, %c, inputPrecision = tf32 : tensor<64x64xf16, #ttg.dot_op<{opIdx = 0}>> * "
           "tensor<64x8xf16, #ttg.dot_op<{opIdx = 1}>> -> tensor<64x8xf32, #mma>")
    ieee = f32.replace("tf32", "ieee")
    assert G.tf32_dots("\n".join([f32, f16, ieee, f32])) == 2
    assert G.tf32_dots("\n".join([f16, ieee])) == 0
    G.check_exact("ffn_w16", "\n".join([f16, ieee]))
    with pytest.raises(RuntimeError, match="kernel ffn_w16: 1 fp32 tt.dot at tf32 precision"):
        G.check_exact("ffn_w16", f32)


def test_partial_logits_over_sixteen_rows_stay_fp32(monkeypatch):
    """LOGIT_FMA_ROWS over 16 live rows (9-16 tokens) runs in passes of 8: as one pass Triton 3.6
    folded it into an fp32 tt.dot at tf32 precision (routes flipped at 11 and 16 tokens); the
    offline row names such a build an error."""
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "LOGIT_FMA_ROWS=16")
    spec = load_model("minimax-m2")
    (row,) = offline.offline_table(spec, 1, Experts.ALL, "sm_90", widths=[16], jobs=1)
    assert "error" not in row, row.get("error")
    assert row["spills"] == 0 and row["resident"] is True


def test_launch_and_sync_choices(monkeypatch):
    """sm_90 builds launch as programmatic dependent launches (still cooperative) and publish
    with one system fence; the seam and reduce exchanges are tagged words, not on CDNA;
    CDNA and the interpreter do neither PDL nor the fence (griddepcontrol and the fence are
    PTX, HIP's launcher knows no launch_pdl); stage-2 tiles have 64 rows at one or two tokens.
    FFNQ_TRITON_TUNE turns each back."""
    from ffnq.backends.triton import geometry as G
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)
    spec = load_model("minimax-m2")

    def cx(s, hip=False, interp=False, blocks=None):
        return offline.constexprs_for(offline.build_key(spec, 2, Experts.ALL, s, blocks=blocks), hip, interp)

    def opts(c):
        return G.launch_options(c, offline.build_key(spec, 2, Experts.ALL, c["TOKENS"]))

    cuda = cx(1)
    assert cuda["PDL"] and cuda["FENCE"] and cuda["SORT_TOPK"] and cuda["TAGGED_WORDS"] and cuda["POLLS_PER_CLOCK"] == 8
    # the seam's reads before the push, its partial logits over the live rows at 1-2 tokens
    assert cuda["EARLY_SEAM_READS"] and cuda["LOGIT_FMA_ROWS"] == 2
    assert cx(1, interp=True)["TAGGED_WORDS"] and not cx(1, hip=True)["TAGGED_WORDS"]
    assert opts(cuda) == {"launch_cooperative_grid": True, "launch_pdl": True}
    for c in (cx(1, hip=True), cx(1, interp=True)):
        assert not c["PDL"] and not c["FENCE"]
        assert opts(c) == {"launch_cooperative_grid": True}
    assert [cx(s)["DOWN_TILE"] for s in (1, 2, 3, 16)] == [64, 64, 128, 128]
    # development keys: a width's own grid (the grid barrier counts each launch from 0, so grids
    # may differ) sizes the peer buffer's flags for the largest grid; MAXNREG@1 caps width 1's registers
    from ffnq.backends.triton import TritonRunner
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "GRID@1=528,MAXNREG@1=128")
    assert (TritonRunner.blocks_for(1), TritonRunner.blocks_for(2), TritonRunner.flag_blocks()) == (528, 264, 528)
    assert opts(cx(1))["maxnreg"] == 128 and "maxnreg" not in opts(cx(2))
    assert "maxnreg" not in opts(cx(1, hip=True))
    big = TritonRunner.peer_bytes(spec, 2)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "")
    # the flags of 528 CTAs, not 396 (3 per SM: the measured table's largest grid)
    assert TritonRunner.flag_blocks() == 396 and big > TritonRunner.peer_bytes(spec, 2)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "PDL=0,FENCE=0,POLLS_PER_CLOCK=1,SORT_TOPK=0,DOWN_TILE=128,TAGGED_WORDS=0,"
                                           "EARLY_SEAM_READS=0,LOGIT_FMA_ROWS=0")
    off = cx(1)
    assert not (off["PDL"] or off["FENCE"] or off["SORT_TOPK"] or off["TAGGED_WORDS"] or off["EARLY_SEAM_READS"]
                or off["LOGIT_FMA_ROWS"])
    assert (off["POLLS_PER_CLOCK"], off["DOWN_TILE"]) == (1, 128)
    assert opts(off) == {"launch_cooperative_grid": True}
    # SOLO: TP1 without its exchanges (the identity there); a TP2 build keeps them
    def tp1(hip=False):
        return offline.constexprs_for(offline.build_key(spec, 1, Experts.ALL, 1), hip)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "")
    assert tp1()["SOLO"] and tp1(hip=True)["SOLO"] and not cuda["SOLO"]
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "SOLO=0,COOPERATIVE=0")
    assert not tp1()["SOLO"] and opts(cx(1))["launch_cooperative_grid"] is False
    # FULL_ROWS=n: TP1 up to n tokens reads whole rows for its logits, one barrier, no per-row pick;
    # at TP2 only when asked (each CTA then waits for the peers' whole rows too: tagged words only)
    w2 = offline.constexprs_for(offline.build_key(spec, 1, Experts.ALL, 2), False)
    assert tp1()["FULL_ROWS"] == 1 and w2["FULL_ROWS"] == 1 and not w2["ROW_PICK"]  # FULL_ROWS=2 by default
    assert cx(1)["FULL_ROWS"] == 0 and cx(1,
                                          hip=True)["FULL_ROWS"] == 0 and not cx(2)["FULL_ROWS"] and cx(2)["ROW_PICK"]
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "FULL_ROWS=4")  # at most 2: the rows are held whole
    fr = {s: offline.constexprs_for(offline.build_key(spec, 1, Experts.ALL, s), False) for s in (1, 2, 3)}
    assert [fr[s]["FULL_ROWS"] for s in (1, 2, 3)] == [1, 1, 0]
    assert not fr[2]["ROW_PICK"] and fr[3]["ROW_PICK"]
    # TP2 one token only (its peers' words spill two tokens' build)
    assert [cx(s)["FULL_ROWS"] for s in (1, 2, 3)] == [1, 0, 0] and not cx(1)["ROW_PICK"] and tp1(hip=True)["FULL_ROWS"]
    with pytest.raises(ValueError, match="FULL_ROWS at TP > 1 needs the tagged-word exchange"):
        cx(1, hip=True)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "FULL_ROWS=2,TAGGED_WORDS=0")
    with pytest.raises(ValueError, match="it needs TAGGED_WORDS=1"):
        cx(1)
    assert tp1()["FULL_ROWS"] == 1  # TP1 has no peer rows to read
    # SOLO=2 (one rank's build alone on one GPU): a TP2 build without exchanges, so FULL_ROWS as TP1's;
    # where the shipped build holds three CTAs per SM (three tokens) its registers are capped to fit
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "FULL_ROWS=2,TAGGED_WORDS=0,SOLO=2")
    assert cx(1)["SOLO"] and [cx(s)["FULL_ROWS"] for s in (1, 2, 3)] == [1, 1, 0]
    assert opts(cx(3))["maxnreg"] == 168 and "maxnreg" not in opts(cx(2))
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "SOLO=2,MAXNREG@3=160")
    assert opts(cx(3))["maxnreg"] == 160


@pytest.mark.slow
def test_the_grid_follows_the_device(monkeypatch):
    """On NVIDIA the grid is 2 CTAs per SM of the job's GPU (264 on an H200 or H100 SXM, 228 on an
    H100 PCIe, 156 on an H20), 3 per SM where a width's build fits 3 and was measured faster
    (TP1 at 2 tokens, TP2 at 3); a runner with a grid of its own keeps it; CPU keeps BLOCKS. An
    H20's grid is smaller than the seam's 192 chunks of 16 columns: 154 chunks of 20, two experts'
    logits per CTA; it compiles resident on 78 SMs (offline --cus)."""
    import torch
    from ffnq.backends.triton import TritonRunner
    from ffnq.backends.triton import geometry as G
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)
    spec = load_model("minimax-m2")
    assert TritonRunner.for_device(torch.device("cpu")) is TritonRunner
    assert TritonRunner.for_sms(132) is TritonRunner
    pcie = TritonRunner.for_sms(114)
    assert (pcie.BLOCKS, pcie.blocks_for(1), pcie.flag_blocks()) == (228, 228, 342)
    # TP1 at 2 tokens 3 CTAs per SM of whichever device, 1 and 3 tokens 2 (configs/triton-measured.toml
    # CTAS_PER_SM)
    assert [pcie.blocks_for(s, spec, 1) for s in (1, 2, 3, 4)] == [228, 342, 228, 228]
    assert [TritonRunner.blocks_for(s, spec, 1) for s in (1, 2, 3, 4, 16)] == [264, 396, 264, 264, 264]
    # TP2: three per SM at 3 tokens only (one token was no faster there)
    assert [TritonRunner.blocks_for(s, spec, 2) for s in (1, 2, 3, 4)] == [264, 264, 396, 264]
    assert TritonRunner.blocks_for(1, spec, 1, hip=True) == 264  # CDNA keeps its grid
    assert TritonRunner.with_grid(256).blocks_for(1, spec, 1) == 256  # a development grid: every width
    assert [offline.build_key(spec, 1, Experts.ALL, 2, target=t).blocks for t in ("sm_90", "gfx942")] == [396, 264]
    # and those builds fit as many per SM (a kernel change that grows the 3-per-SM builds past 168
    # registers or 75 KB of shared memory fails here, not in a cooperative launch on the device)
    for r in offline.offline_table(spec, 1, Experts.ALL, "sm_90", widths=[1, 2, 3], jobs=2):
        grid = 396 if r["width"] == 2 else 264
        assert (r["grid"], r["resident"], r["spills"]) == (grid, True, 0) and r["ctas_per_cu"] >= grid // 132, r
    assert pcie.for_device(torch.device("cuda", 0)) is pcie  # its own grid: no device query
    assert pcie.peer_bytes(spec, 2) < TritonRunner.peer_bytes(spec, 2)
    g = G.geometry(offline.build_key(spec, 2, Experts.ALL, 1, blocks=156))
    assert (g["CHUNKS"], g["CHUNK"], g["CTA_EXPERTS"], g["BLOCKS"]) == (154, 20, 2, 156)
    for blocks in (100, 128, 156, 160, 191, 192, 228, 264, 396):
        g = G.geometry(offline.build_key(spec, 2, Experts.ALL, 16, blocks=blocks))
        # every chunk holds columns: a chunk past H would sum H tiles that do not exist (a CTA
        # of grid 156 waited for them until its bound)
        assert (g["CHUNKS"] - 1) * g["CHUNK"] < g["HIDDEN"] <= g["CHUNKS"] * g["CHUNK"] and g["CHUNKS"] <= blocks
    (row,) = offline.offline_table(spec, 2, Experts.ALL, "sm_90", widths=[16], cus=78, jobs=1)
    assert (row["cus"], row["grid"], row["resident"], row["spills"]) == (78, 156, True, 0), row


@pytest.mark.parametrize("tune,blocks", [("", None), ("GRID@1=396,MAXNREG@1=168", None), ("GRID@1=396", 264),
                                         ("MAXNREG@3=168", None)])
def test_offline_build_is_the_launch_build(tune, blocks, monkeypatch):
    """The prewarm fills the cache only if every constexpr of a width is the launch's: with one
    width on its own grid (GRID@1), the peer flags of every width are sized for the largest grid
    (a prewarm that sized them per width missed the cache at widths 2-16, and the device compiled
    30 builds)."""
    from ffnq.backends.triton import TritonRunner
    from ffnq.backends.triton import geometry as G
    monkeypatch.setenv("FFNQ_TRITON_TUNE", tune)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a runner on this CPU: its constexprs, no launch
    spec = load_model("minimax-m2")
    cls = TritonRunner.with_grid(blocks)
    pb = cls.open_peers(spec, 1, 0, "cpu", "t")
    r = cls(1, 0, pb.sym, pb.peers, "cpu", widths=[1, 2, 3], model=spec)
    for s in (1, 2, 3):
        key = offline.build_key(spec, 1, Experts.ALL, s, blocks=blocks, timeout_ns=r.keys[s].timeout_ns)
        assert key == r.keys[s]
        for final in (False, True):
            cx = offline.constexprs_for(key, False, interp=True, final=final)
            assert cx == r._cx[(s, final)] and G.launch_options(cx, key) == r._opts[(s, final)]
    # a width's register cap reaches the launch as the prewarm's (no TP1 width measures one)
    for s in (1, 3):
        assert r._opts[(s, False)].get("maxnreg") == (168 if f"MAXNREG@{s}" in tune else None)
    # (without a grid of its own TP1 one token is 2 CTAs per SM and two tokens 3: 264 and 396 on the
    # 132 SMs the interpreter stands for, configs/triton-measured.toml)
    assert r.keys[1].blocks == (396 if "GRID@1" in tune else blocks or 264)
    assert r.keys[2].blocks == (blocks or 396)
    assert r.keys[2].flags == r.keys[1].flags == max(r.keys[1].blocks, r.keys[2].blocks)


def test_scale_range_is_checked_only_for_the_fp16_scale_path(monkeypatch):
    """SCALE_ON_PRODUCT=0 folds the block scale into fp16 operands (x 2^8): warm refuses a scale that would
    overflow there, naming the tensor and the limit; the default path takes any scale."""
    import torch
    from ffnq.backends.triton import geometry as G
    from ffnq.errors import UsageError
    from ffnq.weights import shard, synthetic
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a cpu runner; warm fails before any launch
    spec = load_model("tiny")
    w = shard(synthetic(spec, seed=3), spec, 1, 0, Experts.ALL)
    w.s13 = w.s13 * 0 + 0.75  # 448 x 0.75 x 2^8 > 65504
    pb = TritonRunner.open_peers(spec, 1, 0, "cpu", "t")
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "SCALE_ON_PRODUCT=0,FP8_X=0")
    assert G.max_scale() == pytest.approx(0.5711, abs=1e-4)
    r = TritonRunner(1, 0, pb.sym, pb.peers, "cpu", widths=[1], model=spec)
    with pytest.raises(UsageError, match=r"s13 is 0.75.*below 0.571"):
        r.warm(w)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "")
    assert G.max_scale() is None
    r = TritonRunner(1, 0, pb.sym, pb.peers, "cpu", widths=[1], model=spec)
    r.warm(w)  # the interpreter's warm records the width without compiling
    assert r.describe(1)["grid"] == 264 and torch.isfinite(w.s13).all()


def _tp1_runner(runner_cls, S: int, weights_seed: int):
    """A TP1 runner of tiny at width S on the CPU and its weights: (runner, full, shard)."""
    from ffnq.weights import shard, synthetic
    spec = load_model("tiny")
    full = synthetic(spec, seed=weights_seed)
    pb = runner_cls.open_peers(spec, 1, 0, "cpu", "t")
    return runner_cls(1, 0, pb.sym, pb.peers, "cpu", widths=[S], model=spec), full, shard(full, spec, 1, 0, Experts.ALL)


def _tp1_run(r, full, w, slots, g):
    """One step of runner ``r`` (the interpreter's staged launches) on fresh inputs from
    generator ``g``: (out, res_out, the fp64 reference of the same step)."""
    import torch
    from ffnq import reference
    spec, S = r.model, len(slots)
    part = torch.randn(S, spec.hidden, generator=g).bfloat16()
    resid = torch.randn(S, spec.hidden, generator=g).bfloat16()
    out, res = r(part, resid, w, slots)
    return out, res, reference.step([part], resid, slots, full, spec)


def _tp1_step(runner_cls, slots, weights_seed: int, inputs_seed: int):
    """One TP1 step of tiny through ``runner_cls`` on the CPU: (runner, out, res_out, reference)."""
    import torch
    r, full, w = _tp1_runner(runner_cls, len(slots), weights_seed)
    return (r, *_tp1_run(r, full, w, slots, torch.Generator().manual_seed(inputs_seed)))


def _assert_step_matches(r, out, ref, slots):
    """A TP1 step of ``r`` at width len(slots): its live rows match the fp64 reference, its routes
    are the reference's, its padding rows are zero and no fault is recorded."""
    import torch
    from ffnq import reference
    live, S = slots >= 0, len(slots)
    assert reference.compare(out, ref.out, rows=torch.nonzero(live).flatten())["rel_err"] < 1e-2
    assert torch.equal(r.view(S, "route").long(), ref.chosen)
    # the routing weights it reports, as qualify checks them (0 on a padding row)
    assert (r.chosen_weights(S).double() - ref.weights).abs().max() <= 1e-4
    assert (out[~live] == 0).all() and r.fault(S) is None


def _claims_and_items(r, S: int) -> tuple[int, list]:
    """(WORK_QUEUE) The work counter after a step of width S, and the two stages' item counts."""
    from ffnq.backends.triton import geometry as G
    g = G.geometry(r.keys[S])
    n_act = int(r.view(S, "meta")[0])
    items = [n_act * (g["INTER"] // g["UP_TILE"]) * g["UP_KSPLIT"],
             n_act * (g["HIDDEN"] // g["DOWN_TILE"]) * g["DOWN_KSPLIT"]]
    return int(r.view(S, "sync")[g["QUEUE_AT"]]), items


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="slow: set TRITON_INTERPRET=1 to run")
@pytest.mark.parametrize("tune", ["", "ROW_PICK_FROM=8", "ROW_PICK_MAX_CTAS=4", "LOGIT_FMA_ROWS=4", "SOLO=0",
                                  "DOWN_KSPLIT=2", "DOWN_FP8=0", "DOWN_FP8=1", "DOWN_ACT_TERMS=4", "WORK_QUEUE=1",
                                  "EARLY_HEADER=3", "EARLY_HEADER=3,DOWN_FP8=0,WORK_QUEUE=1", "PACKED_W13=0",
                                  "PACKED_W2=1", "PACKED_W2=1,DOWN_FP8=1,DOWN_KSPLIT=2", "DOWN_TILE=64", "SORT_TOPK=2",
                                  "SORT_TOPK=2,ROW_PICK_FROM=8"])
def test_interpreter_tp1_matches_reference(tune, monkeypatch):
    """TP1 numerics on a CPU: the staged kernel under the Triton interpreter, three rows with
    the per-row top-k of phase B (the default from 3 rows), with every CTA's (ROW_PICK_FROM=8),
    and with 4 CTAs per row in the per-row pick (ROW_PICK_MAX_CTAS=4: most CTAs sit the pick out),
    with the seam's partial logits over the live rows as FMAs, not a 16-row dot
    (LOGIT_FMA_ROWS=4), with the exchanges that TP1 skips by default (SOLO=0: they are the
    identity there), with each stage-2 item in two parts of the intermediate, summed in phase E
    (DOWN_KSPLIT=2), with stage 2 on the fp16 act (DOWN_FP8=0: the default is two fp8 act
    terms), on fp8 terms in steps of one stage-1 tile (DOWN_FP8=1), on four act terms
    (DOWN_ACT_TERMS=4), with a CTA's items after its first from one counter (WORK_QUEUE=1, TP1's
    3-16 tokens), and with each stage-2 item's header read at the end of the item before
    (EARLY_HEADER=3: both stages), on the fp8 act and on the fp16 one, and with w13 as given
    (PACKED_W13=0: the default reads it tile-packed by the runner), and with w2 tile-packed
    (PACKED_W2=1), also in steps of one stage-1 tile and two parts of the intermediate, and as 64-row
    items reading their half of each 128-row packed block (DOWN_TILE=64, as 1-2 tokens), and with
    the top-k as a sort of the fp32 scores (SORT_TOPK=2), in the row pick and in every CTA."""
    monkeypatch.setenv("FFNQ_TRITON_TUNE", tune)
    import torch
    from ffnq import reference
    from ffnq.backends.triton import TritonRunner
    slots = torch.tensor([0, -1, 2])
    r, out, res, ref = _tp1_step(TritonRunner, slots, 2, 5)
    _assert_step_matches(r, out, ref, slots)
    assert reference.compare(res, ref.res_out)["rel_err"] < 1e-2


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="slow: set TRITON_INTERPRET=1 to run")
@pytest.mark.parametrize("tune", ["FULL_ROWS=2", "FULL_ROWS=2,UP_KSPLIT=2,PACKED_W13=0,EARLY_HEADER=3"])
def test_interpreter_tp1_whole_rows_router(tune, monkeypatch):
    """FULL_ROWS: every CTA reads the two whole rows for rstd and its own experts' logits, in phase A,
    and passes one grid barrier; x, the logits and the routing must be the reference's. Also as
    one token's build runs (two K parts, w13 as given, every BLOCKS-th item) with each item's
    header read at the end of the item before (EARLY_HEADER=3, measured faster there)."""
    monkeypatch.setenv("FFNQ_TRITON_TUNE", tune)
    import torch
    from ffnq import reference
    from ffnq.backends.triton import TritonRunner
    from ffnq.backends.triton import geometry as G
    r, out, res, ref = _tp1_step(TritonRunner, torch.tensor([0, 1]), 3, 7)
    g = G.geometry(r.keys[2])
    assert g["FULL_ROWS"] == 1 and g["EARLY_HEADER"] == (3 if "EARLY_HEADER" in tune else 0)
    assert reference.compare(out, ref.out)["rel_err"] < 1e-2
    assert reference.compare(res, ref.res_out)["rel_err"] < 1e-2
    assert torch.equal(r.view(2, "route").long(), ref.chosen)
    assert torch.allclose(r.view(2, "route_w").double(), ref.weights, rtol=1e-4, atol=1e-6)
    assert r.fault(2) is None


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="slow: set TRITON_INTERPRET=1 to run")
@pytest.mark.parametrize("blocks", [12, 7])
def test_interpreter_grid_with_a_partial_last_chunk(blocks, monkeypatch):
    """A grid that does not divide the hidden size (the grid follows the GPU's SMs: an H20's 156
    CTAs over 3072 columns): tiny's 256 columns over 12 CTAs are 12 chunks of 22, over 7 CTAs 7 of
    37, the last ending past H. Its sum must wait only for H tiles that exist (it waited out its
    bound for tile H / DOWN_TILE on the H200)."""
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)
    import torch
    from ffnq import reference
    from ffnq.backends.triton import TritonRunner
    from ffnq.backends.triton import geometry as G
    spec = load_model("tiny")
    g0 = G.geometry(offline.build_key(spec, 1, Experts.ALL, 2, blocks=blocks))
    assert g0["CHUNKS"] * g0["CHUNK"] > spec.hidden  # the case under test
    r, out, res, ref = _tp1_step(TritonRunner.with_grid(blocks), torch.tensor([0, 1]), 8, 9)
    assert r.fault(2) is None
    assert reference.compare(out, ref.out)["rel_err"] < 1e-2
    assert reference.compare(res, ref.res_out)["rel_err"] < 1e-2


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="slow: set TRITON_INTERPRET=1 to run")
@pytest.mark.parametrize("tune", ["WORK_QUEUE=1,UP_KSPLIT=2", "WORK_QUEUE=1,UP_KSPLIT=2,EARLY_HEADER=3"])
def test_interpreter_items_taken_from_counters(tune, monkeypatch):
    """WORK_QUEUE=1 (TP1's 3-16 tokens, configs/triton-measured.toml): after its first item a CTA takes
    the next ticket of one counter for both stages, not every BLOCKS-th item; its first stage-2
    item is the one its last stage-1 claim took (carried from the stage-1 launch to the stage-2
    launch here). The interpreter runs CTAs one after another, so on a grid of 7 CTA 0 takes
    every ticket after the first round: each item must still run exactly once (the counter ends
    at the items' count) and the step match the reference, split K's fix-up included; also
    with each item's successor and header taken at the end of the item before (EARLY_HEADER=3)."""
    import torch
    from ffnq import reference
    from ffnq.backends.triton import TritonRunner
    from ffnq.backends.triton import geometry as G
    monkeypatch.setenv("FFNQ_TRITON_TUNE", tune)
    S = 3
    slots = torch.tensor([0, -1, 2])
    r, out, res, ref = _tp1_step(TritonRunner.with_grid(7), slots, 4, 6)
    g = G.geometry(r.keys[S])
    assert g["WORK_QUEUE"] == 1 and g["UP_KSPLIT"] == 2 and g["BLOCKS"] == 7
    assert g["EARLY_HEADER"] == (3 if "EARLY_HEADER" in tune else 0)
    q, (n1, n2) = _claims_and_items(r, S)
    assert n1 > 7 and n2 > 7  # more items than CTAs: the counter is in use
    assert q == n1 + n2  # one claim per item run: every item once
    _assert_step_matches(r, out, ref, slots)
    assert reference.compare(res, ref.res_out)["rel_err"] < 1e-2


def test_progressive_sum_counters(monkeypatch):
    """SUM_AS_DONE=1 or 2: a counter per (slot, H tile) after the split-K arrivals, before the work
    counter; off by default and where a build has no slots; other values refused."""
    from ffnq.backends.triton import geometry as G
    spec = load_model("minimax-m2")
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "")
    g0 = G.geometry(offline.build_key(spec, 1, Experts.ALL, 16))
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "SUM_AS_DONE=1")
    g1 = G.geometry(offline.build_key(spec, 1, Experts.ALL, 16))
    nht = spec.hidden // g1["DOWN_TILE"]
    assert g0["SUM_AS_DONE"] == 0 and g0["QUEUE_AT"] == g0["SLOT_TILE_AT"]
    assert g1["SUM_AS_DONE"] == 1 and g1["SLOT_TILE_AT"] == g0["SLOT_TILE_AT"]
    assert g1["QUEUE_AT"] == g1["SLOT_TILE_AT"] + g1["SLOTS"] * nht
    assert g1["COUNTERS"] == g0["COUNTERS"] + g1["SLOTS"] * nht and g1["SLOTS_P2"] >= g1["SLOTS"]
    assert G.geometry(offline.build_key(spec, 1, Experts.NONE, 16))["SUM_AS_DONE"] == 0
    # SUM_AS_DONE=2 polls by loads: a lane per thread, so the prefix's min crosses the warps
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "SUM_AS_DONE=2")
    assert G.geometry(offline.build_key(spec, 1, Experts.ALL, 2))["SLOTS_P2"] == 32 * G.NUM_WARPS
    assert offline.NUM_WARPS == TritonRunner.NUM_WARPS == G.NUM_WARPS
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "SUM_AS_DONE=3")
    with pytest.raises(ValueError, match="SUM_AS_DONE=3"):
        G.geometry(offline.build_key(spec, 1, Experts.ALL, 2))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="slow: set TRITON_INTERPRET=1 to run")
@pytest.mark.parametrize("tune, blocks", [("", None), ("DOWN_KSPLIT=2", None), ("", 7)])
def test_interpreter_progressive_sum(tune, blocks, monkeypatch):
    """SUM_AS_DONE=1: phase E sums each slot once its stage-2 items are done, in the same slot
    order as after the tile's last slot, so the step is bitwise the one without it; every (slot,
    tile) counter ends at DOWN_KSPLIT (the parts of the intermediate), also with chunks across
    two H tiles (a grid of 7)."""
    import torch
    from ffnq import reference
    from ffnq.backends.triton import TritonRunner
    from ffnq.backends.triton import geometry as G
    cls = TritonRunner.with_grid(blocks) if blocks else TritonRunner
    slots = torch.tensor([0, -1, 2, 3])
    runs = {}
    for ps in (0, 1):
        # (SUM_OWN_SLOTS=0 in both: SUM_AS_DONE=1 turns it off, and it adds a row's slots in
        # another order than the sum of every slot, so SUM_AS_DONE=0 with it would not be
        # bitwise SUM_AS_DONE=1's step)
        monkeypatch.setenv("FFNQ_TRITON_TUNE", ",".join(t for t in (tune, f"SUM_AS_DONE={ps}", "SUM_OWN_SLOTS=0") if t))
        runs[ps] = _tp1_step(cls, slots, 3, 11)
    r, out, res, ref = runs[1]
    g = G.geometry(r.keys[4])
    assert g["SUM_AS_DONE"] == 1 and runs[0][0].fault(4) is None and r.fault(4) is None
    assert torch.equal(out, runs[0][1]) and torch.equal(res, runs[0][2])
    assert reference.compare(out, ref.out, rows=torch.tensor([0, 2, 3]))["rel_err"] < 1e-2
    n_act, nht = int(r.view(4, "meta")[0]), g["HIDDEN"] // g["DOWN_TILE"]
    cnt = r.view(4, "sync")[g["SLOT_TILE_AT"]:g["QUEUE_AT"]].view(g["SLOTS"], nht)
    assert n_act > 1 and (cnt[:n_act] == g["DOWN_KSPLIT"]).all() and (cnt[n_act:] == 0).all()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="slow: set TRITON_INTERPRET=1 to run")
@pytest.mark.parametrize("tune", ["SUM_OWN_SLOTS=1", "SUM_OWN_SLOTS=2", "SUM_OWN_SLOTS=2,DOWN_KSPLIT=2",
                                  "SUM_OWN_SLOTS=2,EARLY_HEADER=3"])
def test_interpreter_sum_of_each_rows_own_slots(tune, monkeypatch):
    """SUM_OWN_SLOTS: phase E sums each row's own TOP_K slots (its route mapped by phase C's expert -> slot
    table), not every active slot. The partials are poisoned (NaN) before a second step with new
    inputs: it must still match the reference, so the sum read nothing that step did not write;
    with SUM_OWN_SLOTS=2 the partials of a row not routed to a slot's expert stay poisoned (never written)."""
    import torch
    from ffnq import reference
    from ffnq.backends.triton import TritonRunner
    from ffnq.backends.triton import geometry as G
    monkeypatch.setenv("FFNQ_TRITON_TUNE", tune)
    S = 4
    r, full, w = _tp1_runner(TritonRunner, S, 5)
    slots, live = torch.tensor([0, -1, 2, 3]), torch.tensor([0, 2, 3])
    g = torch.Generator().manual_seed(12)
    for step in range(2):
        if step:
            r.view(S, "ypart").fill_(float("nan"))
        out, res, ref = _tp1_run(r, full, w, slots, g)
        assert reference.compare(out, ref.out, rows=live)["rel_err"] < 1e-2, step
        assert (out[1] == 0).all() and r.fault(S) is None
    geo = G.geometry(r.keys[S])
    assert geo["SUM_OWN_SLOTS"] == int(tune.split(",")[0].split("=")[1])
    assert geo["DOWN_KSPLIT"] == (2 if "DOWN_KSPLIT" in tune else 1)
    n_act = int(r.view(S, "meta")[0])
    ecta = r.view(S, "ecta")[0, :n_act].long()
    inv = r.view(S, "inv")[0].long()
    assert torch.equal(inv[ecta], torch.arange(n_act)) and int((inv >= 0).sum()) == n_act  # -1: no slot
    routed = (ref.chosen[:, :, None] == ecta[None, None, :]).any(1)  # [S, n_act]
    # [slot, part, row]
    written = ~r.view(S, "ypart").view(-1, geo["DOWN_KSPLIT"], S, r.model.hidden)[:n_act].isnan().all(-1)
    assert (written == (routed.T[:, None, :] if geo["SUM_OWN_SLOTS"] == 2 else True)).all()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="slow: set TRITON_INTERPRET=1 to run")
@pytest.mark.parametrize("tune", ["UP_KSPLIT=2", "UP_KSPLIT=2,LOGIT_FMA_ROWS=8"])
def test_interpreter_row_topk_and_split_k(tune, monkeypatch):
    """Six rows, so one CTA per row picks that row's top-k in phase B, and the stage-1 items
    split in two K parts (the last arriver of a tile sums them): TP1 numerics and routing; also
    with phase A's partial logits over the 8-row live tile as FMAs (LOGIT_FMA_ROWS=8, TP1's 5-6 tokens)."""
    import torch
    from ffnq import reference
    from ffnq.backends.triton import TritonRunner
    from ffnq.backends.triton import geometry as G
    monkeypatch.setenv("FFNQ_TRITON_TUNE", tune)
    S = 6
    slots = torch.tensor([0, 1, -1, 3, 4, 5])
    r, out, res, ref = _tp1_step(TritonRunner, slots, 6, 8)
    geo = G.geometry(r.keys[S])
    assert geo["UP_KSPLIT"] == 2 and geo["ROW_PICK"]
    _assert_step_matches(r, out, ref, slots)
    assert reference.compare(res, ref.res_out)["rel_err"] < 1e-2
    live = torch.tensor([0, 1, 3, 4, 5])
    assert torch.allclose(r.view(S, "route_w")[live].double(), ref.weights[live], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="slow: set TRITON_INTERPRET=1 to run")
def test_interpreter_partial_logits_in_passes(monkeypatch):
    """LOGIT_FMA_ROWS=16 at eleven rows (one padding): phase A's partial logits over the 16-row live tile in
    two passes of 8 rows; TP1 numerics and routing against the fp64 reference."""
    import torch
    from ffnq.backends.triton import TritonRunner
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "LOGIT_FMA_ROWS=16")
    slots = torch.tensor([0, 1, 2, 3, 4, -1, 6, 7, 8, 9, 10])
    r, out, _, ref = _tp1_step(TritonRunner, slots, 6, 8)
    _assert_step_matches(r, out, ref, slots)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="slow: set TRITON_INTERPRET=1 to run")
@pytest.mark.parametrize("tune", ["TAGGED_WORDS=1", "TAGGED_WORDS=0", "TAGGED_WORDS=1,FULL_ROWS=2"])
def test_interpreter_fault_protocol_tp2_in_one_process(tune, monkeypatch):
    """Rank 0 runs alone: its seam wait expires (the interpreter has no clock: one look), it
    records rank 1 as missing, notes it in every fault_box and publishes -e later; rank 1 then
    learns from its fault_box that it was the missing one. Both launches end and move the epoch.
    Both exchanges: tagged words (the default) and values + flags (TAGGED_WORDS=0, as on CDNA);
    and with the whole rows' wait after the chunk's (FULL_ROWS=2), which must not record a second
    fault."""
    monkeypatch.setenv("FFNQ_TRITON_TUNE", tune)
    ll, S = "TAGGED_WORDS=1" in tune, 1 if "FULL_ROWS" in tune else 2  # (FULL_ROWS at TP2: one token only)
    import torch
    from ffnq.backends.triton import TritonRunner
    from ffnq.backends.triton import geometry as G
    from ffnq.spec import view
    from ffnq.weights import shard, synthetic
    spec = load_model("tiny")
    nb = TritonRunner.peer_bytes(spec, 2)
    bufs = [torch.zeros(nb, dtype=torch.uint8) for _ in range(2)]
    for b in bufs:
        symm.BUFFERS[b.data_ptr()] = b
    try:
        peers = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
        full = synthetic(spec, seed=1)
        rs = [TritonRunner(2, k, bufs[k].data_ptr(), peers, "cpu", widths=[S], model=spec, timeline=True)
              for k in range(2)]
        assert G.geometry(rs[0].keys[S])["FULL_ROWS"] == ("FULL_ROWS" in tune)
        g = torch.Generator().manual_seed(3)
        parts = [torch.randn(S, spec.hidden, generator=g).bfloat16() for _ in range(2)]
        resid = torch.randn(S, spec.hidden, generator=g).bfloat16()
        for k in range(2):
            rs[k](parts[k], resid, shard(full, spec, 2, k, Experts.ALL), torch.arange(S), final=True)
            f = rs[k].fault(S)
            assert f is not None and f["missing_ranks"] == [1], f
            assert f["phase_name"] == ("seam" if k == 0 else "reduce"), f
            assert int(rs[k].epoch[0]) == 1
        # in rank 1's buffer: rank 0's seam tags are epoch 1 (it had not faulted when it pushed),
        # its reduce tags -1 (it had), as is its handshake flag
        flags = view(bufs[1], rs[0].peer_regions["flags"])
        if ll:
            tags = {n: view(bufs[1], rs[0].peer_regions[n])[1, 0, :S] >> 32 for n in ("seam_ll", "moe_ll")}
            assert (tags["seam_ll"] == 1).all() and (tags["moe_ll"] == -1).all()
        else:
            assert flags[0, 0].tolist() == [1, 1] and flags[1, 0, 0] == -1
        assert flags[2, 0, 0] == -1
        assert view(bufs[1], rs[0].peer_regions["fault_box"])[0, :2].tolist() == [1, 2]
    finally:
        for b in bufs:
            symm.BUFFERS.pop(b.data_ptr(), None)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="slow: set TRITON_INTERPRET=1 to run")
@pytest.mark.parametrize("experts,tune", [(Experts.ALL, ""), (Experts.LOCAL, ""), (Experts.NONE, ""),
                                          (Experts.ALL, "TAGGED_WORDS=0"), (Experts.ALL,
                                                                            "UP_NARROW_FROM=1"), (Experts.ALL,
                                                                                "LOGIT_FMA_ROWS=4"),
                                          (Experts.LOCAL, "WORK_QUEUE=1"), (Experts.ALL, "WORK_QUEUE=1"), (Experts.ALL,
                                              "WORK_QUEUE=1,EARLY_HEADER=3"),
                                          (Experts.ALL, "SUM_OWN_SLOTS=2"), (Experts.LOCAL, "SUM_OWN_SLOTS=2"),
                                          (Experts.ALL, "FULL_ROWS=2"), (Experts.LOCAL, "FULL_ROWS=2")])
def test_interpreter_tp2_stage_by_stage_matches_reference(experts, tune, monkeypatch):
    """Two ranks in one process, run stage by stage interleaved (each publish precedes its wait):
    the whole protocol (seam, reduce, handshake) and the numerics of every Experts mode at TP2,
    and once with the flagged exchanges (TAGGED_WORDS=0, CDNA's); ALL again with the seam's partial
    logits over the live rows (LOGIT_FMA_ROWS=4); LOCAL and ALL with the items from one counter on
    a grid of 7, so that most items are taken from it (WORK_QUEUE=1: on at 3-16 tokens); ALL and
    LOCAL with the sum of each row's own slots (SUM_OWN_SLOTS=2, on at every width: LOCAL's rows
    have route entries of other ranks' experts, which have no slot here; the tiny model's three
    rows take neither from the
    measured table, which is minimax-m2's); and at one row with the router from every rank's
    whole rows in each CTA (FULL_ROWS: TP1's at 1-2 tokens; at TP2 off, and one token at most)."""
    monkeypatch.setenv("FFNQ_TRITON_TUNE", tune)
    import torch
    from ffnq import reference
    from ffnq.backends.triton import TritonRunner
    from ffnq.backends.triton import geometry as G
    from ffnq.weights import shard, synthetic
    spec, tp = load_model("tiny"), 2
    slots = torch.tensor([1] if "FULL_ROWS" in tune else [0, -1, 2])  # (FULL_ROWS at TP2: one token only)
    S, real = len(slots), torch.nonzero(slots >= 0).flatten()
    nb = TritonRunner.peer_bytes(spec, tp)
    bufs = [torch.zeros(nb, dtype=torch.uint8) for _ in range(tp)]
    for b in bufs:
        symm.BUFFERS[b.data_ptr()] = b
    try:
        peers = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
        full = synthetic(spec, seed=4)
        cls = TritonRunner.with_grid(7) if "WORK_QUEUE" in tune else TritonRunner
        rs = [cls(tp, k, bufs[k].data_ptr(), peers, "cpu", widths=[S], model=spec, experts=experts)
              for k in range(tp)]
        g = torch.Generator().manual_seed(9)
        parts = [torch.randn(S, spec.hidden, generator=g).bfloat16() for _ in range(tp)]
        resid = torch.randn(S, spec.hidden, generator=g).bfloat16()
        assert G.geometry(rs[0].keys[S])["FULL_ROWS"] == ("FULL_ROWS" in tune)
        steps = [rs[k].staged(parts[k], resid, shard(full, spec, tp, k, experts), slots, final=True)
                 for k in range(tp)]
        for i in range(len(steps[0][0])):
            for k in range(tp):
                steps[k][0][i]()
        ref = reference.step(parts, resid, slots, full, spec, experts)
        for k in range(tp):
            out, res = steps[k][1]
            # the interpreter truncates to bf16 (no round-to-nearest): ~2x the GPU's error
            assert reference.compare(out, ref.out, rows=real)["rel_err"] < 1e-2
            assert reference.compare(res, ref.res_out)["rel_err"] < 1e-2
            assert torch.equal(rs[k].view(S, "route").long(), ref.chosen)
            assert torch.allclose(rs[k].view(S, "route_w").double(), ref.weights, rtol=1e-4, atol=1e-6)
            assert (out[slots < 0] == 0).all() and rs[k].fault(S) is None and int(rs[k].epoch[0]) == 1
            if "WORK_QUEUE" in tune:  # every item once, most from the counter
                q, (n1, n2) = _claims_and_items(rs[k], S)
                assert n1 > 7 and n2 > 7
                assert q == n1 + n2
    finally:
        for b in bufs:
            symm.BUFFERS.pop(b.data_ptr(), None)


@triton.jit
def _topk_kernel(lg_ptr, b_ptr, sel_ptr, w_ptr, R: tl.constexpr, E: tl.constexpr, K: tl.constexpr, KP2: tl.constexpr,
                 SORT: tl.constexpr):
    r, e = tl.arange(0, R), tl.arange(0, E)
    sel, w = _topk(tl.load(lg_ptr + r[:, None] * E + e[None, :]), tl.load(b_ptr + e), e, e < E, r != 1, K, KP2, E,
                   SORT)
    tl.store(sel_ptr + r[:, None] * E + e[None, :], sel)
    tl.store(w_ptr + r[:, None] * E + e[None, :], w)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="slow: set TRITON_INTERPRET=1 to run")
def test_interpreter_topk_by_sort_matches_max_rounds():
    """SORT_TOPK: the router's top-k as one partial bitonic sort picks the same experts with the
    same weights as K rounds of a max, also among tied scores (the index in the key breaks ties)."""
    import torch

    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        lg = torch.randn(4, 256, generator=g)
        if seed % 2:
            lg = (lg * 2).round() / 2  # many equal scores
        bias = torch.randn(256, generator=g) * 0.01 if seed < 2 else torch.zeros(256)
        got = []
        for sort in (0, 1):
            sel, w = torch.empty(4, 256, dtype=torch.int32), torch.empty(4, 256)
            _topk_kernel[(1,)](lg, bias, sel, w, 4, 256, 8, 8, sort)
            got.append((sel, w))
        (sel0, w0), (sel1, w1) = got
        assert torch.equal(sel0, sel1) and torch.equal(w0, w1), seed
        assert sel1.sum(1).tolist() == [8, 0, 8, 8]  # row 1 is not live: it selects nothing
        # the picks are the 8 highest biased scores
        want = torch.topk(torch.sigmoid(lg) + bias, 8, dim=1).indices
        for r in (0, 2, 3):
            assert set(want[r].tolist()) == set(torch.nonzero(sel1[r]).flatten().tolist()) or seed % 2, (seed, r)


def test_warm_table_takes_the_fewer_ctas_of_both_variants(monkeypatch):
    """`ffnq warm --target`: a job launches the plain and the handshake variant, so a width is as
    resident as the fewer CTAs per CU of the two (TP2's three tokens at a grid of 198: 168
    registers, three per SM, against 180, two); a failed variant fails the width."""
    def fake(model, tp, experts, target, widths=None, final=False):
        assert final == "both"
        return [dict(width=3, kernel="k3", compile_s=1.0, regs=168, spills=0, ctas_per_cu=3, cus=132, grid=396,
                     resident=True, final=False),
                dict(width=3, kernel="k3", compile_s=2.0, regs=180, spills=0, ctas_per_cu=2, cus=132, grid=396,
                     resident=False, final=True),
                dict(width=1, kernel="k1", compile_s=1.0, regs=200, spills=0, ctas_per_cu=2, cus=132, grid=264,
                     resident=True, final=False),
                dict(width=1, kernel="k1", target="sm_90", error="boom", grid=264, resident=False, final=True)]
    monkeypatch.setattr(offline, "offline_table", fake)
    r1, r3 = offline.warm_table("minimax-m2", 2, "all", "sm_90", [1, 3])
    assert (r3["ctas_per_cu"], r3["resident"], r3["regs"], r3["final_regs"], r3["compile_s"]) == (2, False, 168, 180,
        3.0)
    assert "final_spills" not in r3 and "final" not in r3
    assert r1["resident"] is False and r1["error"] == "final: boom"


def test_resources_are_read_once_per_compiled_kernel(tmp_path, monkeypatch):
    """cuobjdump and ptxas -v take seconds per build: kept beside Triton's cache under the kernel's
    hash, a second warm of the same builds reads them back (another hash is another kernel)."""
    from types import SimpleNamespace

    from triton import knobs

    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    calls = []

    def nv_resources(ck):
        calls.append(ck.metadata.hash)
        return {"regs": 180, "spills": 0}

    a, b = (SimpleNamespace(metadata=SimpleNamespace(hash=h)) for h in ("aa11", "bb22"))
    assert offline.cached_resources(a, nv_resources) == {"regs": 180, "spills": 0}
    assert offline.cached_resources(a, nv_resources) == {"regs": 180, "spills": 0}
    offline.cached_resources(b, nv_resources)
    assert calls == ["aa11", "bb22"] and len(list((tmp_path / "ffnq-resources").iterdir())) == 2
