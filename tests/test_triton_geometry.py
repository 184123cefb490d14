"""One build's host-side specialisation (geometry.py): its tile sizes and chunking, the choices
the measured table and FFNQ_TRITON_TUNE make, scratch regions, constexprs and launch options.
Plain Python: no compile, no GPU."""
import pytest

pytest.importorskip("triton")

from ffnq.backends.triton import geometry as G  # noqa: E402
from ffnq.backends.triton import offline  # noqa: E402
from ffnq.spec import Experts, load_model  # noqa: E402


def test_geometry_splits_k_and_picks_the_row_top_k(monkeypatch):
    """The host-side choices: one token's 96 stage-1 items of MiniMax-M2 at TP2 split in two K
    parts on 264 CTAs (192 items, one round); four and six tokens with whole K, the measured
    table's (the model splits them in two, 768 = three full rounds, not 1.5, but whole K was
    1.3-2.2% faster); rows >= 2 pick their top-k one row per CTA group; stage 1 gives each x term
    8 token columns from 7 tokens (and where the table says); ROW_PICK_MAX_CTAS caps the CTAs per
    row of that pick, 16 by default, always a power of two."""
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)
    spec = load_model("minimax-m2")
    geo = {s: G.geometry(offline.build_key(spec, 2, Experts.ALL, s)) for s in (1, 2, 3, 4, 5, 6, 7, 8, 16)}
    assert [geo[s]["UP_KSPLIT"] for s in (1, 2, 4, 5, 6, 16)] == [2, 1, 1, 1, 1, 1]
    assert G.measured("minimax-m2", 2, 4)["UP_KSPLIT"] == G.measured("minimax-m2", 2, 6)["UP_KSPLIT"] == 1
    # nine tokens: 105 rounds x steps split in two against 108 whole, but the fix-up of a split
    # tile costs more than that (UP_KSPLIT_FIXUP): whole K
    assert G.geometry(offline.build_key(spec, 2, Experts.ALL, 9))["UP_KSPLIT"] == 1
    assert [geo[s]["ROW_PICK"] for s in (1, 2, 3, 4, 5, 16)] == [False, True, True, True, True, True]
    # (1, 4-5 and 7-8 tokens over 8 columns, as TP1's)
    assert [geo[s]["UP_COLS"] for s in (1, 4, 6, 7, 8, 16)] == [8, 8, 16, 8, 8, 16]
    assert [geo[s]["ROW_PICK_CTAS"] for s in (1, 2, 4, 16)] == [264, 16, 16, 16]  # at most 16 CTAs per row
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "ROW_PICK_MAX_CTAS=64")
    assert G.geometry(offline.build_key(spec, 2, Experts.ALL, 4))["ROW_PICK_CTAS"] == 64  # the grid's share
    assert G.geometry(offline.build_key(spec, 2, Experts.ALL, 1))["ROW_PICK_CTAS"] == 264  # no per-row pick there
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "ROW_PICK_MAX_CTAS=12")
    assert G.geometry(offline.build_key(spec, 2, Experts.ALL, 4))["ROW_PICK_CTAS"] == 8  # a power of two
    monkeypatch.delenv("FFNQ_TRITON_TUNE")
    # a grid that is not a power of two: 192 CTAs over 4 rows is 48 each, 32 taken
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "ROW_PICK_MAX_CTAS=64")
    assert G.geometry(offline.build_key(spec, 2, Experts.ALL, 4, blocks=192))["ROW_PICK_CTAS"] == 32
    monkeypatch.delenv("FFNQ_TRITON_TUNE")
    assert all((3072 // 128) % g["UP_KSPLIT"] == 0 for g in geo.values())
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "UP_KSPLIT=5")
    with pytest.raises(ValueError, match="UP_KSPLIT=5"):
        G.geometry(offline.build_key(spec, 2, Experts.ALL, 1))
    # the measured table (configs/triton-measured.toml): TP1 one token in two K parts, where the
    # model, pricing stage 1 alone, keeps whole K; FFNQ_TRITON_TUNE overrides it
    monkeypatch.delenv("FFNQ_TRITON_TUNE")
    # (two tokens: whole K, the model's pick on the grid of 396, where 360 items are one round)
    assert [G.geometry(offline.build_key(spec, 1, Experts.ALL, s))["UP_KSPLIT"] for s in (1, 2, 3, 4)] == [2, 1, 2, 1]
    assert G.measured("minimax-m2", 1, 1) == {"UP_KSPLIT": 2, "CTAS_PER_SM": 2, "UP_STAGES": 5, "UP_NARROW_FROM": 1,
                                              "PACKED_W13": 0, "EARLY_HEADER": 3}
    assert G.measured("minimax-m2", 2, 1) == {"EARLY_WEIGHTS": 1, "PACKED_W13": 0, "SUM_OWN_SLOTS": 2,
                                              "UP_NARROW_FROM": 1, "X_TERMS": 2}
    assert G.measured("minimax-m2", 2, 2) == {"EARLY_WEIGHTS": 1, "SUM_OWN_SLOTS": 2}
    # items from one counter at TP1's 4-16 tokens (it gains nothing at 1-2), and at 3 with stage-2
    # items in two halves of the intermediate (DOWN_KSPLIT, also at 4); TP2's 3 the same
    geo = {(tp, s): G.geometry(offline.build_key(spec, tp, Experts.ALL, s)) for tp in (1, 2) for s in range(1, 17)}
    dq = {k: g["WORK_QUEUE"] for k, g in geo.items()}
    assert [s for s in range(1, 17) if dq[1, s]] == list(range(3, 17))
    assert [(tp, s) for (tp, s), g in geo.items() if g["DOWN_KSPLIT"] != 1] == [(1, 3), (1, 4), (2, 3)]
    assert dq[2, 3]
    # each item's header read at the end of the item before, both stages, at TP1's 1 and 5-16
    # tokens (no gain at 2-4); TP2 unmeasured
    assert {k: g["EARLY_HEADER"] for k, g in geo.items() if g["EARLY_HEADER"]} == {(1, s): 3 for s in (1, *range(5, 17))}
    assert [s for s in range(1, 17) if dq[2, s]] == list(range(3, 17))
    # five stage-1 pipeline stages, stage 2 at four, at TP1's 4-16 tokens; five and five at 1, four
    # and four at 3 (two CTAs per SM), three at 2 (three); TP2 four, but five / four at 4-5 and 7-16
    # (six tokens' build would take 122 KB, one CTA per SM) and three at 3 (three CTAs per SM)
    ns = {(tp, s): G.geometry(offline.build_key(spec, tp, Experts.ALL, s)) for tp in (1, 2) for s in range(1, 17)}
    assert [s for s in range(1, 17) if ns[1, s]["UP_STAGES"] == 5] == [1] + list(range(4, 17))
    assert all(ns[1, s]["DOWN_STAGES"] == 4 for s in range(4, 17)) and ns[1, 1]["DOWN_STAGES"] == 5
    assert ns[1, 2]["UP_STAGES"] == ns[1, 2]["DOWN_STAGES"] == 3 and ns[1, 3]["UP_STAGES"] == ns[1, 3]["DOWN_STAGES"] == 4
    deep = {3: (3, 3), 6: (4, 4), 1: (4, 4), 2: (4, 4)}
    assert all((ns[2, s]["UP_STAGES"], ns[2, s]["DOWN_STAGES"]) == deep.get(s, (5, 4)) for s in range(1, 17))
    # stage 1's MMA N (x terms x token columns) 16 at TP1's 1-8 tokens, 32 at 9-16; TP2's 1, 4
    # and 7-8 tokens 16 too
    n = {(tp, s): ns[tp, s]["X_TERMS"] * ns[tp, s]["UP_COLS"] for tp in (1, 2) for s in range(1, 17)}
    assert [n[1, s] for s in range(1, 17)] == [16] * 8 + [32] * 8
    assert (ns[1, 4]["UP_COLS"], ns[1, 7]["X_TERMS"], ns[2, 7]["X_TERMS"], n[2, 7]) == (8, 2, 2, 16)
    assert [n[2, s] for s in (1, 2, 4, 5, 6, 7, 8)] == [16, 32, 16, 32, 64, 16, 16]  # 5: four terms over 8 columns
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "UP_KSPLIT=1")
    assert G.geometry(offline.build_key(spec, 1, Experts.ALL, 1))["UP_KSPLIT"] == 1
    monkeypatch.setattr(G, "measured_table", lambda: {"tiny": {"tp1": {"w1": {"TAGGED_WORDS": 0}}}})
    with pytest.raises(ValueError, match=r"\['TAGGED_WORDS'\] are not build choices"):
        G.measured("tiny", 1, 1)
    # a key for one width only ("KEY@w"), over the plain key at that width
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "UP_KSPLIT@1=2,DOWN_TILE@3=64,DOWN_TILE=128,UP_KSPLIT@11=3")
    tp1 = {s: G.geometry(offline.build_key(spec, 1, Experts.ALL, s)) for s in (1, 2, 3, 11)}
    assert [tp1[s]["UP_KSPLIT"] for s in (1, 2, 3, 11)] == [2, 2, 2, 3]
    assert [tp1[s]["DOWN_TILE"] for s in (1, 2, 3, 11)] == [128, 128, 64, 128]


def test_fp8_stage_one_on_nvidia_only(monkeypatch):
    """Stage 1 multiplies fp8 x terms with the fp8 weight codes on sm_90 (the scale on each K
    block's product, so no scale limit); CDNA keeps the fp16 path (its fp8 MMA is the fnuz format)."""
    from ffnq.spec import scratch_layout
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)
    spec = load_model("minimax-m2")
    key = offline.build_key(spec, 2, Experts.ALL, 4)
    lay = scratch_layout(key, G.scratch_extra(key))  # the layouts of a launch, as offline builds them
    cuda, hip = offline.constexprs_for(key, False), offline.constexprs_for(key, True)
    assert cuda["FP8_X"] and cuda["SCALE_ON_PRODUCT"] and cuda["SCALE_MUL"] == 1.0
    assert not hip["FP8_X"] and hip["SCALE_ON_PRODUCT"]
    assert G.max_scale() is None
    # x's scratch holds 4 fp8 terms or the fp16 pair in the same bytes
    assert lay["x"].nbytes == 2 * 2 * 4 * spec.hidden


def test_fp8_stage_two_on_nvidia(monkeypatch):
    """DOWN_FP8: stage 2 multiplies fp8 act terms with the fp8 w2 codes (steps of 128, an MMA per
    stage-1 tile), the act as fp8 terms x 16 token rows per slot and a scale per stage-1 tile in
    scratch, at every width two terms (DOWN_ACT_TERMS). CDNA and the fp16 x path (FP8_X=0) keep
    the fp16 act; DOWN_ACT_TERMS takes 1, 2 or 4 terms and names anything else."""
    from ffnq.spec import scratch_layout
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)
    spec = load_model("minimax-m2")
    keys = {s: offline.build_key(spec, tp, Experts.ALL, s) for tp, s in ((1, 1), (2, 8), (2, 16))}
    assert [G.geometry(k)["DOWN_FP8"] for k in keys.values()] == [2, 2, 2]
    assert [G.geometry(k)["DOWN_ACT_TERMS"] for k in keys.values()] == [2, 2, 2]
    assert [G.geometry(k)["DOWN_COLS"] for k in keys.values()] == [4, 8, 16]
    assert offline.constexprs_for(keys[1], False)["DOWN_FP8"] == 2 and offline.constexprs_for(keys[1],
        True)["DOWN_FP8"] == 0
    g = G.geometry(keys[8])
    lay = scratch_layout(keys[8], G.scratch_extra(keys[8]))
    # the terms written, two by default
    assert lay["act8"].nbytes == g["MAX_SLOTS"] * g["DOWN_ACT_TERMS"] * 16 * g["INTER"]
    assert lay["ascale"].nbytes == 4 * g["MAX_SLOTS"] * g["INTER"] // g["UP_TILE"]
    assert "act" in lay  # CDNA's fp16 act, where a build keeps DOWN_FP8 but the target turns it off
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "DOWN_FP8@16=0,DOWN_ACT_TERMS@8=4")
    assert "act8" not in scratch_layout(keys[16], G.scratch_extra(keys[16]))
    assert G.geometry(keys[8])["DOWN_ACT_TERMS"] == 4
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "DOWN_ACT_TERMS=3")
    with pytest.raises(ValueError, match="DOWN_ACT_TERMS=3: allowed 1, 2 or 4"):
        G.geometry(keys[1])
    # DOWN_MIN_COLS: the least act columns per term (8 gives two terms 16 MMA columns: the fp8 wgmma)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "DOWN_MIN_COLS=8")
    assert [G.geometry(k)["DOWN_COLS"] for k in keys.values()] == [8, 8, 16]
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "DOWN_MIN_COLS=6")
    with pytest.raises(ValueError, match="DOWN_MIN_COLS=6: allowed 4, 8 or 16"):
        G.geometry(keys[1])
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "WORK_QUEUE=2")
    with pytest.raises(ValueError, match=r"WORK_QUEUE=2: allowed 0 \(every BLOCKS-th item\) or 1"):
        G.geometry(keys[1])
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "EARLY_HEADER=4")
    with pytest.raises(ValueError, match=r"EARLY_HEADER=4: allowed 0 \(off\), 1 \(stage 2\), 2 \(stage 1\) or 3"):
        G.geometry(keys[1])
    # WORK_QUEUE carries each CTA's claimed stage-2 item between staged launches: a second meta word per CTA
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "WORK_QUEUE=1")
    assert scratch_layout(keys[8], G.scratch_extra(keys[8]))["meta"].nbytes == 2 * 4 * keys[8].blocks
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "FP8_X=0")
    assert G.geometry(keys[1])["DOWN_FP8"] == 0


def test_x_terms(monkeypatch):
    """X_TERMS, x's fp8 terms: two, so stage 1's MMA has half the columns, except where four make
    N = 32 from 8 token columns (7-8 tokens) and at TP2's widths whose two-term builds spill
    (configs/triton-measured.toml); TP1's 4-8 tokens and TP2's 4 and 7-8 take two over 8 columns
    there (N = 16); other values are refused, named."""
    spec = load_model("minimax-m2")
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)

    def terms(tp):
        gs = {s: G.geometry(offline.build_key(spec, tp, Experts.ALL, s)) for s in (1, 4, 6, 7, 8, 12, 16)}
        return {s: (g["X_TERMS"], g["UP_COLS"]) for s, g in gs.items()}
    assert terms(1) == {1: (2, 8), 4: (2, 8), 6: (2, 8), 7: (2, 8), 8: (2, 8), 12: (2, 16), 16: (2, 16)}
    # (TP2's 1, 4 and 7-8 tokens two terms over 8 columns, as TP1's)
    assert terms(2) == {1: (2, 8), 4: (2, 8), 6: (4, 16), 7: (2, 8), 8: (2, 8), 12: (2, 16), 16: (2, 16)}
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "X_TERMS@8=2")
    assert G.geometry(offline.build_key(spec, 2, Experts.ALL, 8))["UP_COLS"] == 8  # 2 terms x 8 columns
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "X_TERMS=3")
    with pytest.raises(ValueError, match="X_TERMS=3: allowed 2 or 4"):
        G.geometry(offline.build_key(spec, 1, Experts.ALL, 1))


def test_partial_logits_over_live_rows(monkeypatch):
    """LOGIT_FMA_ROWS: phase A's partial logits as FMAs over the live row tile where it is at most
    that many rows (1-2 tokens by default, 3-16 at TP1 and TP2 from configs/triton-measured.toml)."""
    spec = load_model("minimax-m2")
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)

    def fma_rows(tp):
        gs = {s: G.geometry(offline.build_key(spec, tp, Experts.ALL, s)) for s in range(1, 17)}
        return [s for s, g in gs.items() if g["ROW_TILE"] <= g["LOGIT_FMA_ROWS"]]
    assert fma_rows(1) == list(range(1, 17))
    assert fma_rows(2) == list(range(1, 17))
    # over chunks wider than 16 columns (an H20's grid of 156: 20) the table's value stops at two
    # rows (its FMAs spilled there, 78 SMs offline); the 16-column grids keep it
    plr = {b: [G.geometry(offline.build_key(spec, tp, Experts.ALL, s, blocks=b))["LOGIT_FMA_ROWS"] for tp in (1,
        2) for s in (2, 5, 9)]
           for b in (156, 132, 192, 228, 264)}
    assert plr[156] == plr[132] == [2] * 6 and plr[192] == plr[228] == plr[264] == [2, 8, 16] * 2
    # CDNA's TP2 builds keep the 16-row dot from 9 rows (16 rows of FMAs left gfx950 one CTA per CU)
    def hip_rows(tp, s):
        key = offline.build_key(spec, tp, Experts.ALL, s, target="gfx950")
        return offline.constexprs_for(key, True)["LOGIT_FMA_ROWS"]

    hip = {(tp, s): hip_rows(tp, s) for tp in (1, 2) for s in (5, 14)}
    assert hip == {(1, 5): 8, (1, 14): 16, (2, 5): 8, (2, 14): 8}
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "LOGIT_FMA_ROWS@7=4")
    assert G.geometry(offline.build_key(spec, 1, Experts.ALL, 7))["LOGIT_FMA_ROWS"] == 4
    assert G.geometry(offline.build_key(spec, 1, Experts.ALL, 7, blocks=156))["LOGIT_FMA_ROWS"] == 4  # as asked


def test_dropped_keys_are_gone_and_a8_is_checked(monkeypatch):
    """RS, DOWN_FP8=3, PF and KROT were measured and dropped (docs/triton-kernel.md): no build
    carries them, and DOWN_FP8=3 is refused, named."""
    spec = load_model("minimax-m2")
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)
    g = G.geometry(offline.build_key(spec, 1, Experts.ALL, 4))
    assert not {"RS", "PF", "KROT", "TLG"} & set(g) and g["DOWN_FP8"] == 2
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "DOWN_FP8=3")
    with pytest.raises(ValueError, match="DOWN_FP8=3: allowed 0"):
        G.geometry(offline.build_key(spec, 1, Experts.ALL, 4))


def test_a_measured_register_cap(monkeypatch):
    """MAXNREG in a row of configs/triton-measured.toml caps that width's registers on NVIDIA (TP2's
    three tokens at 168, so three CTAs per SM fit); FFNQ_TRITON_TUNE's MAXNREG@w or MAXNREG is over
    it."""
    spec = load_model("minimax-m2")

    def opts(s, hip=False, tp=1):
        key = offline.build_key(spec, tp, Experts.ALL, s)
        return G.launch_options(offline.constexprs_for(key, hip), key)

    monkeypatch.setenv("FFNQ_TRITON_TUNE", "")
    assert opts(3, tp=2)["maxnreg"] == 168 and "maxnreg" not in opts(2, tp=2) and "maxnreg" not in opts(3, 1, 2)
    assert "maxnreg" not in opts(3) and "maxnreg" not in opts(4)  # TP1's three tokens: two CTAs per SM, uncapped
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "MAXNREG@3=200,MAXNREG@4=160")
    assert opts(3)["maxnreg"] == 200 and opts(4)["maxnreg"] == 160 and "maxnreg" not in opts(5)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "MAXNREG=150")
    assert opts(3)["maxnreg"] == opts(5)["maxnreg"] == 150


def test_early_weights_default_and_settling(monkeypatch):
    """EARLY_WEIGHTS: TP1 builds read their weights before the PDL wait, TP2's too as
    configs/triton-measured.toml sets it there, other TPs' not unless asked; the runner waits for
    the stream once per set of weight tensors it has not seen, and a new tensor at a freed one's
    address is a new set."""
    import torch
    from ffnq.backends.triton.runner import SettledWeights
    spec = load_model("minimax-m2")
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "")
    assert [G.geometry(offline.build_key(spec, tp, Experts.ALL, 4))["EARLY_WEIGHTS"] for tp in (1, 2,
        4)] == [True, True, False]
    assert G.measured("minimax-m2", 2, 4)["EARLY_WEIGHTS"] == 1 and "EARLY_WEIGHTS" not in G.measured("minimax-m2", 4,
        4)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "EARLY_WEIGHTS=0")
    assert not G.geometry(offline.build_key(spec, 1, Experts.ALL, 4))["EARLY_WEIGHTS"]
    seen = SettledWeights()
    a = [torch.ones(4), torch.ones(8), torch.ones(2)]
    assert seen.first(a) and not seen.first(a) and not seen.first(list(a))
    b = [a[0], torch.ones(8), a[2]]  # one tensor replaced: a set not waited for
    assert seen.first(b) and not seen.first(b)
    addr = a[1].data_ptr()
    del a, b
    c = [torch.ones(4), torch.ones(8), torch.ones(2)]  # maybe at the freed addresses: still new
    assert seen.first(c) and len(seen._refs) == 1, (addr, c[1].data_ptr())


def test_sum_of_each_rows_own_slots_geometry(monkeypatch):
    """SUM_OWN_SLOTS=1 or 2: 2 by default at TP1, at TP2 from the measured table, off at other TPs
    unless asked; only where phase B picks the rows (the route is written before barrier 2) and
    SUM_AS_DONE is off; an expert -> slot table per CTA in the scratch only then; other values
    refused."""

    def regions(k) -> dict:
        return {n: shape for n, _, shape in G.scratch_extra(k)}

    spec = load_model("minimax-m2")
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "")
    key = offline.build_key(spec, 1, Experts.ALL, 16)
    key2, key4 = (offline.build_key(spec, tp, Experts.ALL, 16) for tp in (2, 4))
    assert G.geometry(key2)["SUM_OWN_SLOTS"] == 2 and "inv" in regions(key2)
    assert G.geometry(key4)["SUM_OWN_SLOTS"] == 0 and "inv" not in regions(key4)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "SUM_OWN_SLOTS=0")
    assert G.geometry(key)["SUM_OWN_SLOTS"] == 0 and "inv" not in regions(key)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "")
    g = G.geometry(key)
    assert g["SUM_OWN_SLOTS"] == 2 and g["ROW_PICK"]
    assert regions(key)["inv"] == (key.blocks, g["EXPERTS_P2"])
    assert G.geometry(offline.build_key(spec, 1, Experts.ALL, 2))["SUM_OWN_SLOTS"] == 0  # FULL_ROWS: every CTA's top-k
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "SUM_OWN_SLOTS=1,SUM_AS_DONE=1")
    assert G.geometry(key)["SUM_OWN_SLOTS"] == 0
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "SUM_OWN_SLOTS=3")
    with pytest.raises(ValueError, match="SUM_OWN_SLOTS=3"):
        G.geometry(key)


def test_packed_w13_by_default(monkeypatch):
    """Every build with experts reads w13 tile-packed (PACKED_W13) but one token's (the measured
    table's PACKED_W13 = 0, slower packed on an H200); PACKED_W13=0 reads it as given; others
    refused."""
    spec = load_model("minimax-m2")
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)
    assert all(G.geometry(offline.build_key(spec, tp, Experts.ALL, s))["PACKED_W13"] == 1 for tp in (1, 2) for s in (2,
        7, 16))
    assert [G.geometry(offline.build_key(spec, tp, Experts.ALL, 1))["PACKED_W13"] for tp in (1, 2)] == [0, 0]
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "PACKED_W13=1")  # the override still wins over the table
    assert G.geometry(offline.build_key(spec, 1, Experts.ALL, 1))["PACKED_W13"] == 1
    assert G.geometry(offline.build_key(spec, 1, Experts.NONE, 4))["PACKED_W13"] == 0  # no experts: no w13 read
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "PACKED_W13=0")
    assert G.geometry(offline.build_key(spec, 2, Experts.ALL, 4))["PACKED_W13"] == 0
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "PACKED_W13=2")
    with pytest.raises(ValueError, match="PACKED_W13=2"):
        G.geometry(offline.build_key(spec, 2, Experts.ALL, 4))


def test_packed_w2_at_tp1_by_default(monkeypatch):
    """TP1's builds read w2 tile-packed (PACKED_W2: measured faster at every width on an H100);
    TP2's as given until timed there; the key wins either way; the fp16 stage 2 (DOWN_FP8=0)
    and a build without experts never read it packed."""
    spec = load_model("minimax-m2")
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)
    packed = {tp: [G.geometry(offline.build_key(spec, tp, Experts.ALL, s))["PACKED_W2"] for s in (1, 3, 16)]
              for tp in (1, 2)}
    assert packed == {1: [1, 1, 1], 2: [0, 0, 0]}
    assert G.geometry(offline.build_key(spec, 1, Experts.NONE, 4))["PACKED_W2"] == 0
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "PACKED_W2=1")
    assert G.geometry(offline.build_key(spec, 2, Experts.ALL, 4))["PACKED_W2"] == 1
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "PACKED_W2=0")
    assert G.geometry(offline.build_key(spec, 1, Experts.ALL, 4))["PACKED_W2"] == 0
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "PACKED_W2=1,DOWN_FP8=0")
    assert G.geometry(offline.build_key(spec, 1, Experts.ALL, 4))["PACKED_W2"] == 0


def test_down_tile_over_one_scale_block_is_refused(monkeypatch):
    """Stage 2 takes one w2 block scale a K step, so a tile of more than 128 rows (two scale
    blocks) would scale half its rows wrong: refused, named."""
    from ffnq.backends.triton import offline
    from ffnq.spec import Experts, load_model
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "DOWN_TILE=256")
    with pytest.raises(ValueError, match="DOWN_TILE=256"):
        G.geometry(offline.build_key(load_model("minimax-m2"), 1, Experts.ALL, 8))
