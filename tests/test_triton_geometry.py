"""One build's host-side specialisation (geometry.py): its tile sizes and chunking, the choices
the measured table and FFNQ_TRITON_TUNE make, scratch regions, constexprs and launch options.
Plain Python: no compile, no GPU."""
import pytest

pytest.importorskip("triton")

from ffnq.backends.triton import geometry as G  # noqa: E402
from ffnq.backends.triton import offline  # noqa: E402
from ffnq.spec import Experts, load_model  # noqa: E402


def test_geometry_splits_k_and_picks_the_row_top_k(monkeypatch):
    """The host-side choices behind v12: one token's 96 stage-1 items of MiniMax-M2 at TP2 split
    in two K parts on 264 CTAs (192 items, one round); four and six tokens with whole K, the
    measured table's (v47: the model splits them in two, 768 = three full rounds, not 1.5, but
    the solo proxy timed whole K 1.3-2.2% faster); rows >= 2 pick their top-k one row per CTA group (v18; from 3 in v17);
    stage 1 gives each x term 8 token columns at 7-8 tokens, 16 elsewhere (v17); RPG caps the CTAs
    per row of that pick, 16 by default (v18), always a power of two."""
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)
    spec = load_model("minimax-m2")
    geo = {s: G.geometry(offline.build_key(spec, 2, Experts.ALL, s)) for s in (1, 2, 3, 4, 5, 6, 7, 8, 16)}
    assert [geo[s]["KS"] for s in (1, 2, 4, 5, 6, 16)] == [2, 1, 1, 1, 1, 1]
    assert G.measured("minimax-m2", 2, 4)["KS"] == G.measured("minimax-m2", 2, 6)["KS"] == 1
    # nine tokens: 105 rounds x steps split in two against 108 whole, but the fix-up of a split
    # tile costs more than that (KSFIX, v17): whole K
    assert G.geometry(offline.build_key(spec, 2, Experts.ALL, 9))["KS"] == 1
    assert [geo[s]["ROWTOP"] for s in (1, 2, 3, 4, 5, 16)] == [False, True, True, True, True, True]
    # (v40-v41: 1, 4-5 and 7-8 tokens over 8 columns, as TP1's; device rounds 82-83)
    assert [geo[s]["SQ"] for s in (1, 4, 6, 7, 8, 16)] == [8, 8, 16, 8, 8, 16]
    assert [geo[s]["RP"] for s in (1, 2, 4, 16)] == [264, 16, 16, 16]  # at most 16 CTAs per row (v18)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "RPG=64")
    assert G.geometry(offline.build_key(spec, 2, Experts.ALL, 4))["RP"] == 64  # the grid's share
    assert G.geometry(offline.build_key(spec, 2, Experts.ALL, 1))["RP"] == 264  # no per-row pick there
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "RPG=12")
    assert G.geometry(offline.build_key(spec, 2, Experts.ALL, 4))["RP"] == 8  # a power of two
    monkeypatch.delenv("FFNQ_TRITON_TUNE")
    # a grid that is not a power of two: 192 CTAs over 4 rows is 48 each, 32 taken
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "RPG=64")
    assert G.geometry(offline.build_key(spec, 2, Experts.ALL, 4, blocks=192))["RP"] == 32
    monkeypatch.delenv("FFNQ_TRITON_TUNE")
    assert all((3072 // 128) % g["KS"] == 0 for g in geo.values())
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "KS=5")
    with pytest.raises(ValueError, match="KS=5"):
        G.geometry(offline.build_key(spec, 2, Experts.ALL, 1))
    # the measured table (configs/triton-measured.toml): TP1 one token in two K parts (dev round
    # 45), where the model, pricing stage 1 alone, keeps whole K; FFNQ_TRITON_TUNE overrides it
    monkeypatch.delenv("FFNQ_TRITON_TUNE")
    # (two tokens: whole K, the model's pick on v25's grid of 396, where 360 items are one round)
    assert [G.geometry(offline.build_key(spec, 1, Experts.ALL, s))["KS"] for s in (1, 2, 3, 4)] == [2, 1, 2, 1]
    assert G.measured("minimax-m2", 1, 1) == {"KS": 2, "CPS": 3, "NS": 3, "SQ": 1, "PK": 0}
    assert G.measured("minimax-m2", 2, 1) == {"EW": 1, "PK": 0, "SPS": 2, "SQ": 1, "X8T": 2}
    assert G.measured("minimax-m2", 2, 2) == {"EW": 1, "SPS": 2}
    # v28: items from one counter at TP1's 4-15 tokens (v27's per-stage counters were slower at 3
    # tokens; one counter gains nothing at 1-3); v36: at 16 too (timed in bursts, dev round 99);
    # v43: at 3 with stage-2 items in two halves of I (KH, v42 at 4: dev rounds 109-112); v45: TP2's
    # 3 the same (dev round 118, the solo proxy)
    geo = {(tp, s): G.geometry(offline.build_key(spec, tp, Experts.ALL, s)) for tp in (1, 2) for s in range(1, 17)}
    dq = {k: g["DQ"] for k, g in geo.items()}
    assert [s for s in range(1, 17) if dq[1, s]] == list(range(3, 17))
    assert [(tp, s) for (tp, s), g in geo.items() if g["KH"] != 1] == [(1, 3), (1, 4), (2, 3)]
    assert dq[2, 3]
    # v44: each item's header read at the end of the item before, both stages, at TP1's 5-16
    # tokens (dev rounds 113-114); TP2 unmeasured
    assert {k: g["HP"] for k, g in geo.items() if g["HP"]} == {(1, s): 3 for s in range(5, 17)}
    assert [s for s in range(1, 17) if dq[2, s]] == list(range(3, 17))  # v39 (4-16) and v45, proxies
    # five stage-1 pipeline stages, stage 2 at four, at TP1's 4-16 tokens (v31: 4-6 and 9-11, dev
    # rounds 75-77; v37: 7-8 and 12-16, dev round 100); three at 1-3 (three CTAs per SM); TP2 four,
    # but five / four at 5 and 7-16 (v39; six tokens' build would take 122 KB, one CTA per SM), at
    # 4 (v40, with 8 x columns: 92 KB) and three at 3 (v40, three CTAs per SM)
    ns = {(tp, s): G.geometry(offline.build_key(spec, tp, Experts.ALL, s)) for tp in (1, 2) for s in range(1, 17)}
    assert [s for s in range(1, 17) if ns[1, s]["NS"] == 5] == list(range(4, 17))
    assert all(ns[1, s]["NS2"] == 4 for s in range(4, 17)) and ns[1, 3]["NS"] == ns[1, 3]["NS2"] == 3
    deep = {3: (3, 3), 6: (4, 4), 1: (4, 4), 2: (4, 4)}
    assert all((ns[2, s]["NS"], ns[2, s]["NS2"]) == deep.get(s, (5, 4)) for s in range(1, 17))
    # v38: stage 1's MMA N (x terms x token columns) 16 at TP1's 4-8 tokens (dev round 104), 32 at
    # 9-16; 1-3 tokens 16 (three CTAs per SM); TP2's 1, 4 and 7-8 tokens too (v40-v41, device rounds 82-83)
    n = {(tp, s): ns[tp, s]["X8T"] * ns[tp, s]["SQ"] for tp in (1, 2) for s in range(1, 17)}
    assert [n[1, s] for s in range(1, 17)] == [16] * 8 + [32] * 8
    assert (ns[1, 4]["SQ"], ns[1, 7]["X8T"], ns[2, 7]["X8T"], n[2, 7]) == (8, 2, 2, 16)
    assert [n[2, s] for s in (1, 2, 4, 5, 6, 7, 8)] == [16, 32, 16, 32, 64, 16, 16]  # 5: four terms over 8 columns
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "KS=1")
    assert G.geometry(offline.build_key(spec, 1, Experts.ALL, 1))["KS"] == 1
    monkeypatch.setattr(G, "measured_table", lambda: {"tiny": {"tp1": {"w1": {"LL": 0}}}})
    with pytest.raises(ValueError, match=r"\['LL'\] are not build choices"):
        G.measured("tiny", 1, 1)
    # a key for one width only ("KEY@w"), over the plain key at that width
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "KS@1=2,BH@3=64,BH=128,KS@11=3")
    tp1 = {s: G.geometry(offline.build_key(spec, 1, Experts.ALL, s)) for s in (1, 2, 3, 11)}
    assert [tp1[s]["KS"] for s in (1, 2, 3, 11)] == [2, 2, 2, 3]
    assert [tp1[s]["BH"] for s in (1, 2, 3, 11)] == [128, 128, 64, 128]


def test_fp8_stage_one_on_nvidia_only(monkeypatch):
    """v14: stage 1 multiplies fp8 x terms with the fp8 weight codes on sm_90 (the scale on each K
    block's product, so no scale limit); CDNA keeps the fp16 path (its fp8 MMA is the fnuz format)."""
    from ffnq.spec import scratch_layout
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)
    spec = load_model("minimax-m2")
    key = offline.build_key(spec, 2, Experts.ALL, 4)
    lay = scratch_layout(key, G.scratch_extra(key))  # the layouts of a launch, as offline builds them
    cuda, hip = offline.constexprs_for(key, False), offline.constexprs_for(key, True)
    assert cuda["F8"] and cuda["SACC"] and cuda["SHIFT"] == 1.0 and not hip["F8"] and hip["SACC"]
    assert G.max_scale() is None
    # x's scratch holds 4 fp8 terms or the fp16 pair in the same bytes
    assert lay["x"].nbytes == 2 * 2 * 4 * spec.hidden


def test_fp8_stage_two_on_nvidia(monkeypatch):
    """v24 (A8): stage 2 multiplies fp8 act terms with the fp8 w2 codes (steps of 128, an MMA per
    stage-1 tile), the act as fp8 terms x 16 token rows per slot and a scale per stage-1 tile in
    scratch; v26: at every width, two terms (A8T). CDNA and the fp16 x path (F8=0) keep the fp16
    act; A8T takes 1, 2 or 4 terms and names anything else."""
    from ffnq.spec import scratch_layout
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)
    spec = load_model("minimax-m2")
    keys = {s: offline.build_key(spec, tp, Experts.ALL, s) for tp, s in ((1, 1), (2, 8), (2, 16))}
    assert [G.geometry(k)["A8"] for k in keys.values()] == [2, 2, 2]
    assert [G.geometry(k)["A8T"] for k in keys.values()] == [2, 2, 2]
    assert [G.geometry(k)["SQ2"] for k in keys.values()] == [4, 8, 16]
    assert offline.constexprs_for(keys[1], False)["A8"] == 2 and offline.constexprs_for(keys[1], True)["A8"] == 0
    g = G.geometry(keys[8])
    lay = scratch_layout(keys[8], G.scratch_extra(keys[8]))
    assert lay["act8"].nbytes == g["NSLOT"] * g["A8T"] * 16 * g["I_R"]  # the terms written, two by default
    assert lay["ascale"].nbytes == 4 * g["NSLOT"] * g["I_R"] // g["BN"]
    assert "act" in lay  # CDNA's fp16 act, where a build keeps A8 but the target turns it off
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "A8@16=0,A8T@8=4")
    assert "act8" not in scratch_layout(keys[16], G.scratch_extra(keys[16])) and G.geometry(keys[8])["A8T"] == 4
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "A8T=3")
    with pytest.raises(ValueError, match="A8T=3: allowed 1, 2 or 4"):
        G.geometry(keys[1])
    # SQ2: the least act columns per term (8 gives two terms 16 MMA columns: the fp8 wgmma)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "SQ2=8")
    assert [G.geometry(k)["SQ2"] for k in keys.values()] == [8, 8, 16]
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "SQ2=6")
    with pytest.raises(ValueError, match="SQ2=6: allowed 4, 8 or 16"):
        G.geometry(keys[1])
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "DQ=2")
    with pytest.raises(ValueError, match=r"DQ=2: allowed 0 \(every BLOCKS-th item\) or 1"):
        G.geometry(keys[1])
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "HP=4")
    with pytest.raises(ValueError, match=r"HP=4: allowed 0 \(off\), 1 \(stage 2\), 2 \(stage 1\) or 3"):
        G.geometry(keys[1])
    # DQ carries each CTA's claimed stage-2 item between staged launches: a second meta word per CTA
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "DQ=1")
    assert scratch_layout(keys[8], G.scratch_extra(keys[8]))["meta"].nbytes == 2 * 4 * keys[8].blocks
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "F8=0")
    assert G.geometry(keys[1])["A8"] == 0


def test_x_terms(monkeypatch):
    """X8T, x's fp8 terms (v30): two, so stage 1's MMA has half the columns, except where four
    make N = 32 from 8 token columns (7-8 tokens) and at TP2's widths whose two-term builds spill
    (configs/triton-measured.toml); TP1's 4-8 tokens (v38) and TP2's 4 and 7-8 (v40) take two over
    8 columns there (N = 16);
    other values are refused, named."""
    spec = load_model("minimax-m2")
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)

    def terms(tp):
        gs = {s: G.geometry(offline.build_key(spec, tp, Experts.ALL, s)) for s in (1, 4, 6, 7, 8, 12, 16)}
        return {s: (g["X8T"], g["SQ"]) for s, g in gs.items()}
    assert terms(1) == {1: (2, 8), 4: (2, 8), 6: (2, 8), 7: (2, 8), 8: (2, 8), 12: (2, 16), 16: (2, 16)}
    # (v40-v41: TP2's 1, 4 and 7-8 tokens two terms over 8 columns, as TP1's, device rounds 82-83)
    assert terms(2) == {1: (2, 8), 4: (2, 8), 6: (4, 16), 7: (2, 8), 8: (2, 8), 12: (2, 16), 16: (2, 16)}
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "X8T@8=2")
    assert G.geometry(offline.build_key(spec, 2, Experts.ALL, 8))["SQ"] == 8  # 2 terms x 8 columns
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "X8T=3")
    with pytest.raises(ValueError, match="X8T=3: allowed 2 or 4"):
        G.geometry(offline.build_key(spec, 1, Experts.ALL, 1))


def test_partial_logits_over_live_rows(monkeypatch):
    """PLR: phase A's partial logits as FMAs over the live row tile where it is at most PLR rows
    (v19: 1-2 tokens; v34: TP1's 3-6 tokens, v35 its 7-16, v39 TP2's 3-6, v46 its 7-16 from the
    solo proxy, where the pair proxy's spilling builds had priced it 3-4% slower; from
    configs/triton-measured.toml)."""
    spec = load_model("minimax-m2")
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)

    def fma_rows(tp):
        gs = {s: G.geometry(offline.build_key(spec, tp, Experts.ALL, s)) for s in range(1, 17)}
        return [s for s, g in gs.items() if g["RT"] <= g["PLR"]]
    assert fma_rows(1) == list(range(1, 17))
    assert fma_rows(2) == list(range(1, 17))
    # over chunks wider than 16 columns (an H20's grid of 156: 20) the table's PLR stops at two
    # rows (its FMAs spilled there, 78 SMs offline); the 16-column grids keep it
    plr = {b: [G.geometry(offline.build_key(spec, tp, Experts.ALL, s, blocks=b))["PLR"] for tp in (1, 2) for s in (2, 5, 9)]
           for b in (156, 132, 192, 228, 264)}
    assert plr[156] == plr[132] == [2] * 6 and plr[192] == plr[228] == plr[264] == [2, 8, 16] * 2
    # CDNA's TP2 builds keep the 16-row dot from 9 rows (16 rows of FMAs left gfx950 one CTA per CU)
    hip = {(tp, s): offline.constexprs_for(offline.build_key(spec, tp, Experts.ALL, s, target="gfx950"), True)["PLR"]
           for tp in (1, 2) for s in (5, 14)}
    assert hip == {(1, 5): 8, (1, 14): 16, (2, 5): 8, (2, 14): 8}
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "PLR@7=4")
    assert G.geometry(offline.build_key(spec, 1, Experts.ALL, 7))["PLR"] == 4
    assert G.geometry(offline.build_key(spec, 1, Experts.ALL, 7, blocks=156))["PLR"] == 4  # as asked


def test_dropped_keys_are_gone_and_a8_is_checked(monkeypatch):
    """RS, A8=3, PF and KROT were measured and dropped (their code lives in the commits the
    geometry names): no build carries them, and A8=3 is refused, named."""
    spec = load_model("minimax-m2")
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)
    g = G.geometry(offline.build_key(spec, 1, Experts.ALL, 4))
    assert not {"RS", "PF", "KROT", "TLG"} & set(g) and g["A8"] == 2
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "A8=3")
    with pytest.raises(ValueError, match="A8=3: allowed 0"):
        G.geometry(offline.build_key(spec, 1, Experts.ALL, 4))


def test_a_measured_register_cap(monkeypatch):
    """R in a row of configs/triton-measured.toml caps that width's registers on NVIDIA (v43: TP1's
    three tokens at 168, so three CTAs per SM fit; v45: TP2's three tokens the same);
    FFNQ_TRITON_TUNE's R<w> or R@w is over it."""
    spec = load_model("minimax-m2")

    def opts(s, hip=False, tp=1):
        key = offline.build_key(spec, tp, Experts.ALL, s)
        return G.launch_options(offline.constexprs_for(key, hip), key)

    monkeypatch.setenv("FFNQ_TRITON_TUNE", "")
    assert opts(3)["maxnreg"] == 168 and "maxnreg" not in opts(4) and "maxnreg" not in opts(3, hip=True)
    assert opts(3, tp=2)["maxnreg"] == 168 and "maxnreg" not in opts(2, tp=2)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "R3=200,R@4=160")
    assert opts(3)["maxnreg"] == 200 and opts(4)["maxnreg"] == 160 and "maxnreg" not in opts(5)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "R=150")
    assert opts(3)["maxnreg"] == opts(5)["maxnreg"] == 150


def test_early_weights_default_and_settling(monkeypatch):
    """EW (v32): TP1 builds read their weights before the PDL wait, TP2's too as
    configs/triton-measured.toml sets it there (v39), other TPs' not unless asked; the runner waits for the stream once per set of weight tensors it has not seen, and a new
    tensor at a freed one's address is a new set."""
    import torch
    from ffnq.backends.triton.runner import SettledWeights
    spec = load_model("minimax-m2")
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "")
    assert [G.geometry(offline.build_key(spec, tp, Experts.ALL, 4))["EW"] for tp in (1, 2, 4)] == [True, True, False]
    assert G.measured("minimax-m2", 2, 4)["EW"] == 1 and "EW" not in G.measured("minimax-m2", 4, 4)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "EW=0")
    assert not G.geometry(offline.build_key(spec, 1, Experts.ALL, 4))["EW"]
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
    """SPS=1 or 2: 2 by default at TP1 (v33), at TP2 from the measured table (v39), off at other
    TPs unless asked; only where phase B picks the rows (the
    route is written before barrier 2) and PS is off; an expert -> slot table per CTA in the
    scratch only then; other values refused."""

    def regions(k) -> dict:
        return {n: shape for n, _, shape in G.scratch_extra(k)}

    spec = load_model("minimax-m2")
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "")
    key = offline.build_key(spec, 1, Experts.ALL, 16)
    key2, key4 = (offline.build_key(spec, tp, Experts.ALL, 16) for tp in (2, 4))
    assert G.geometry(key2)["SPS"] == 2 and "inv" in regions(key2)
    assert G.geometry(key4)["SPS"] == 0 and "inv" not in regions(key4)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "SPS=0")
    assert G.geometry(key)["SPS"] == 0 and "inv" not in regions(key)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "")
    g = G.geometry(key)
    assert g["SPS"] == 2 and g["ROWTOP"]
    assert regions(key)["inv"] == (key.blocks, g["EP2"])
    assert G.geometry(offline.build_key(spec, 1, Experts.ALL, 2))["SPS"] == 0  # FR: every CTA's top-k
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "SPS=1,PS=1")
    assert G.geometry(key)["SPS"] == 0
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "SPS=3")
    with pytest.raises(ValueError, match="SPS=3"):
        G.geometry(key)


def test_packed_w13_by_default(monkeypatch):
    """v48: every build with experts reads w13 tile-packed (PK) but one token's (v49: the measured
    table's PK = 0, slower packed on an H200); PK=0 reads it as given; others refused."""
    spec = load_model("minimax-m2")
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)
    assert all(G.geometry(offline.build_key(spec, tp, Experts.ALL, s))["PK"] == 1 for tp in (1, 2) for s in (2, 7, 16))
    assert [G.geometry(offline.build_key(spec, tp, Experts.ALL, 1))["PK"] for tp in (1, 2)] == [0, 0]
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "PK=1")  # the override still wins over the table
    assert G.geometry(offline.build_key(spec, 1, Experts.ALL, 1))["PK"] == 1
    assert G.geometry(offline.build_key(spec, 1, Experts.NONE, 4))["PK"] == 0  # no experts: no w13 read
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "PK=0")
    assert G.geometry(offline.build_key(spec, 2, Experts.ALL, 4))["PK"] == 0
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "PK=2")
    with pytest.raises(ValueError, match="PK=2"):
        G.geometry(offline.build_key(spec, 2, Experts.ALL, 4))
