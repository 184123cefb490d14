"""One build of the fused kernel, specialised on the host (plain Python, shared by TritonRunner
and the offline compiler): its choices (configs/triton-measured.toml's row under FFNQ_TRITON_TUNE),
tile geometry and chunking, scratch regions, constexprs and launch options, and the checks on
what was compiled (no fp32 product at tf32 precision)."""
import functools
import re
import tomllib

from ffnq.backends.triton.tune import read as read_tune


MODES = {"all": 0, "local": 1, "none": 2}
STAGES = (1, 6, 2, 3, 4, 5, 7, 8)  # seam push/publish, seam wait+sum, router, top-k+stage 1, stage 2,
#                                    sum+reduce push/publish, reduce wait+out (+handshake publish), handshake wait+end
NUM_WARPS = 4  # warps per CTA, as TritonRunner and offline builds launch it
NUM_STAGES_EXPERTS = 4  # software-pipeline depth of the two expert GEMM loops (bytes in flight per SM)
NUM_STAGES_HIP = 2
# The SACC=0 path (FFNQ_TRITON_TUNE="SACC=0") multiplies fp8 codes by (block scale x 2^SCALE_SHIFT)
# in fp16 so that small scales stay normal; 448 x scale x 2^8 must stay below fp16's 65504:
# scales < 0.57 (TritonRunner.warm checks the weights it is given when that path is built).
SCALE_SHIFT = 8
MAX_SCALE = 65504.0 / (448.0 * 2 ** SCALE_SHIFT)


# an fp32 tt.dot at tf32 precision (10-bit mantissas): the kernel's fp32 products (the router's
# partial logits) must be exact, and Triton folds a broadcast-multiply-sum of [16, K] x [K, N] fp32
# tiles into such a dot (PLR over 16 rows in one pass: routes flipped on the H200, dev round 92).
# Checked wherever a build is compiled: offline rows and TritonRunner.warm.
TF32_DOT = re.compile(r"tt\.dot [^\n]*inputPrecision = tf32 : tensor<[0-9x]+xf32")


def tf32_dots(ttgir: str) -> int:
    """How many fp32 tt.dot ops of a TTGIR listing run at tf32 precision."""
    return len(TF32_DOT.findall(ttgir))


def check_exact(kernel: str, ttgir: str) -> None:
    """Raise when a build's fp32 products would run at tf32 precision."""
    n = tf32_dots(ttgir)
    if n:
        raise RuntimeError(f"kernel {kernel}: {n} fp32 tt.dot at tf32 precision in the TTGIR: allowed none "
                           f"(fp32 products stay exact)")


def max_scale() -> float | None:
    """The largest block scale the built weight path takes (None: any; the default paths, fp8
    (F8) and SACC, multiply the fp32 product of each K block by its scale)."""
    t = read_tune()
    return None if t.get("SACC", 1) or t.get("F8", 1) else MAX_SCALE
ARG_NAMES = ("part", "residual", "slots", "out", "res_out", "post_norm", "router", "router_bias", "w13", "s13",
             "w2", "s2", "scratch", "peers", "epoch", "inject", "cfg", "rank", "first_expert")


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _allowed(key: str, value: int, allowed, meaning: str) -> int:
    """``value`` of FFNQ_TRITON_TUNE's ``key`` if it is one of ``allowed``; else ValueError, one
    line naming it and what is allowed (``meaning``)."""
    if value not in allowed:
        raise ValueError(f"FFNQ_TRITON_TUNE {key}={value}: allowed {meaning}")
    return value


# the keys configs/triton-measured.toml may set: tile and schedule choices, not protocol switches
# (CPS: CTAs per SM, the width's grid on NVIDIA; the runner reads it, TritonRunner.blocks_for;
# R: the width's register cap on NVIDIA, launch_options; PK: the w13 layout stage 1 reads, which
# the runner gives each build as its PK asks)
MEASURED_KEYS = frozenset({"BH", "BN", "CPS", "DQ", "EW", "HP", "JB", "KH", "KS", "KSFIX", "NS", "NS2", "NSS", "PK", "PLR",
                           "R", "RPG", "RTOP", "SPS", "SQ", "X8T"})


@functools.cache
def measured_table() -> dict:
    from ffnq.spec import CONFIGS
    path = CONFIGS / "triton-measured.toml"
    return check_measured(tomllib.loads(path.read_text())) if path.is_file() else {}


def check_measured(table: dict) -> dict:
    """``table`` if every row is [model.tp<N>.w<width>] of a shipped model and one of its widths
    (a misspelt row would be looked up by no build); ValueError naming the first that is not.
    Its keys are checked where a row is read (measured)."""
    from ffnq.errors import UsageError
    from ffnq.spec import load_model
    for model, tps in table.items():
        try:
            spec = load_model(model)
        except UsageError as e:
            raise ValueError(f"configs/triton-measured.toml [{model}]: {e}") from None
        for tp, rows in tps.items():
            ok_tp = re.fullmatch(r"tp[1-9]\d*", tp) and isinstance(rows, dict)
            for w in rows if ok_tp else [None]:
                n = re.fullmatch(r"w([1-9]\d*)", w or "")
                if not ok_tp or not n or int(n[1]) > spec.max_tokens or not isinstance(rows[w], dict):
                    raise ValueError(f"configs/triton-measured.toml [{model}.{tp}{f'.{w}' if w else ''}]: need "
                                     f"[{model}.tp<N>.w<width>] tables, width 1..{spec.max_tokens}")
    return table


def measured(model: str, tp: int, tokens: int) -> dict:
    """The choices measured faster than the geometry's model for one width
    (configs/triton-measured.toml; FFNQ_TRITON_TUNE overrides them)."""
    row = measured_table().get(model, {}).get(f"tp{tp}", {}).get(f"w{tokens}", {})
    bad = sorted(set(row) - MEASURED_KEYS)
    if bad:
        raise ValueError(f"configs/triton-measured.toml [{model}.tp{tp}.w{tokens}]: keys {bad} are not "
                         f"build choices ({', '.join(sorted(MEASURED_KEYS))})")
    return {k: int(v) for k, v in row.items()}


def most_measured(name: str, default: int) -> int:
    """The largest value of a key over every row of configs/triton-measured.toml (the peer
    buffer's flags are sized for the largest grid of any model, TP and width)."""
    rows = (w for m in measured_table().values() for t in m.values() for w in t.values())
    return max([default, *(int(r[name]) for r in rows if name in r)])


def choices(key) -> dict:
    """One build's choices: its row of configs/triton-measured.toml, FFNQ_TRITON_TUNE over it."""
    return {**measured(key.model.name, key.tp, key.tokens), **read_tune(key.tokens)}


def geometry(key) -> dict:
    """Tile sizes and chunking of one build (an spec.FfnBuild)."""
    m, blocks = key.model, key.blocks
    H, E = m.hidden, m.experts
    mode = key.experts.value
    i_r = m.intermediate_per_rank(key.tp, key.experts) if mode != "none" else 0
    nloc = m.experts_per_rank(key.tp, key.experts)
    nch = max(1, min(blocks, H // 16))
    ch = -(-H // nch)
    # only non-empty chunks: 156 CTAs over 3072 columns are chunks of 20, of which 154 hold columns
    # (CTAs 154-155 summed H tiles past the last and waited out their bound: dev round 46)
    nch = -(-H // ch)
    epc = -(-E // blocks)
    epcp2 = _p2(epc)
    nslot = min(key.tokens * m.top_k, nloc) if mode != "none" else 0
    asked = read_tune(key.tokens)  # FFNQ_TRITON_TUNE's keys: kept as asked where a rule caps the table's
    tune = {**measured(m.name, key.tp, key.tokens), **asked}  # choices(key)
    # stage-1 tile rows: 64 gate + 64 up rows of one expert (the M of an sm_90 warp-group MMA)
    bn = tune.get("BN", 64)
    while bn > 16 and i_r and (i_r % bn or 128 % bn):
        bn //= 2
    # stage-2 tile rows: 64 at one or two tokens (twice the items to spread over the grid, dev
    # rounds 14 and 16: 0.6-1.4 us faster), 128 from 3 (64 was 4-7 us slower at 8-16 tokens)
    bh = tune.get("BH", 64 if key.tokens <= 2 else 128)
    # slots summed per load in phase E (JB: a power of two; the loads of one batch are in flight
    # together, so fewer batches shorten the sum at many slots)
    jb = tune.get("JB", max(1, min(8, 2048 // (16 * max(16, _p2(ch))))))
    if jb < 1 or jb & (jb - 1):
        raise ValueError(f"FFNQ_TRITON_TUNE JB={jb}: must be a power of two")
    nt = i_r // bn if i_r else 1
    # split K of the stage-1 items while a width's items leave CTAs idle (one token: 96 items
    # of 393 KB at TP2), so every CTA streams weights; the parts must be whole scale blocks
    # (the whole grid's rounds of items x each item's K steps plus ~3 steps of pipeline fill,
    # plus KSFIX steps for the fix-up of a split tile (its parts written, re-read and summed by
    # the last arriver), at the most slots this width can touch; ties go to fewer parts). KSFIX=4
    # (v17): at TP2 nine tokens split in two parts were 8% slower than whole K (155 vs 142 us,
    # dev round 36), which the model without it had at 105 against 108 steps. The model prices
    # stage 1 alone, so where a split lets stage 2 overlap it the measured table overrides it
    # (configs/triton-measured.toml: TP1 one token, two parts)
    ks = tune.get("KS", 0)
    if not ks:
        fix = tune.get("KSFIX", 4)
        cost = {k: -(-nslot * nt * k // blocks) * ((H // 128) // k + 3) + (fix if k > 1 else 0)
                for k in (1, 2, 3, 4, 6) if (H // 128) % k == 0}
        ks = min(cost, key=lambda k: (cost[k], k))
    if (H // 128) % ks:
        raise ValueError(f"FFNQ_TRITON_TUNE KS={ks}: must divide the {H // 128} K blocks of the hidden size")
    rt = _p2(key.tokens)
    # the row tile from which phase B picks each row's top-k (RT CTA groups, the last arriver of a
    # row) instead of every CTA on the whole tile after barrier 2: from 2 rows by default (v17 from
    # 4: 3-4 us faster at 3-4 tokens, TP2 dev round 34, where 2 rows were 0.9 us slower with 128
    # CTAs per row; v18 from 2 with 16 per row: 1.2-1.4 us faster at 2 tokens, TP1 rounds 37-38)
    # FR=n: at TP1 up to n tokens (at most 2: the rows are held whole in registers) every CTA
    # reads the whole rows for rstd and its own experts' logits (one grid barrier, not two, and
    # the every-CTA top-k; no row pick). v23 (dev round 51, TP1 side by side: 48.2 against 51.5
    # us at one token, 80.7 against 83.0 at two; at 3-4 tokens its first form, a reduction per
    # load block, was 113.3 / 141.1 against the row pick's 113.0 / 139.5, round 50). At TP > 1
    # (off unless asked: not timed yet) a CTA's chunk of the all-reduced rows is not the whole rows,
    # so each CTA also waits for every peer's whole rows (their LL words: LL only) and sums them;
    # one token only there: at two, minimax-m2's TP2 build spills 92-112 B at 255 registers
    # SOLO (below, with the other protocol switches): a build without its exchanges
    solo = key.tp == 1 and bool(tune.get("SOLO", 1)) or tune.get("SOLO") == 2
    most = 2 if key.tp == 1 or solo else 1
    fr = int(key.tokens <= min(most, tune.get("FR", 2 if key.tp == 1 else 0)))
    if fr and key.tp > 1 and not tune.get("LL", 1) and not solo:
        raise ValueError("FFNQ_TRITON_TUNE FR at TP > 1 reads the peers' rows as LL words: it needs LL=1")
    rowtop = rt >= tune.get("RTOP", 2) and not fr
    # CTAs per row in that pick: at most RPG (v18: 16; the grid's share, 64 at 4 rows, left the
    # row's last arriver 64 slices to read: 16 was 0.7-1.3 us faster at 4 tokens, 0.5-0.8 at 8, TP1
    # rounds 37-38), rounded down to a power of two (the last arriver's tl.arange over the slices)
    rp = max(1, blocks // rt)
    if rowtop:
        rp = 1 << (max(1, min(rp, tune.get("RPG", 16))).bit_length() - 1)
    # fp8 x terms need |x| / max|post_norm| <= sqrt(H) inside e4m3's 448 (H <= 200704); asking
    # for them (the default) also asks for the scale on each K block's product, which a larger H
    # keeps on the fp16 path: the same rule as max_scale()
    f8 = bool(tune.get("F8", 1))
    sacc = bool(tune.get("SACC", 1)) or f8
    f8 = f8 and H <= 448 ** 2
    # stage 1's token columns per x term: from width SQ on the fewest that hold the width and make
    # tl.dot's N (terms x SQ) at least 16, else 16 (SQ=0: always). From 7 by default (v17): 8
    # columns at 7-8 tokens were 1.7-2.5% faster at TP2 (dev rounds 33-35); at 5 within the
    # spread, at 6 slower (the build spills), at 1-4 slower (round 33)
    def cols(terms: int) -> int:
        return max(_p2(key.tokens), 16 // terms) if 0 < tune.get("SQ", 7) <= key.tokens else 16

    # X8T: x's fp8 terms (4: ~16 mantissa bits; 2: ~8, a bf16 x's). Two halve stage 1's MMA
    # columns (terms x SQ) and its accumulators' registers (TP1 at 4 / 12 / 16 tokens: 249 / 225
    # / 225 registers to 178 / 190 / 182). v30, two by default (dev round 71, TP1 side by side
    # twice, p50 us at 1 / 2 / 4 / 6 / 12 / 16 tokens): 45.7, 45.6 / 69.7, 69.2 / 119.2, 119.2 /
    # 149.9, 149.9 / 221.8, 222.5 / 281.6, 280.3 against 46.3, 46.3 / 69.1, 69.1 / 119.8, 119.7 /
    # 151.2, 151.2 / 235.9, 238.0 / 293.8, 290.5; max rel_err over 1-16 tokens 0.00200 against
    # 0.00179. Four where they make N = 32 from 8 token columns (7-8 tokens, SQ from 7): two made
    # N = 16 there, 175.6, 175.7 against 173.9, 173.9 at 8 tokens. TP2's one, four and six
    # tokens keep four (configs/triton-measured.toml: their two-term builds spill). v38: TP1's 4-8
    # tokens two terms over 8 columns (N = 16), 0.4-1.2% faster timed in bursts (dev round 104;
    # the 8-token pair above was timed in one window, before the bench timed in bursts)
    x8t = _allowed("X8T", tune.get("X8T", 4 if cols(4) == 8 else 2), (2, 4), "2 or 4 fp8 terms of x")
    sq = cols(x8t if f8 else 2)
    # CHK: polls of a wait between its clock/fault checks; PDL: programmatic dependent launch
    # (sm_90); LL: the seam and reduce exchanges as tagged words; PRE: the seam's reads of the
    # router, post_norm and residual issued before the push; PLR=n: the seam's partial logits over
    # the live rows, not a 16-row dot, up to a row tile of n. Both v19 (TP1 dev round 43, one
    # call: 2.5-3.1 us faster at 1-2 tokens, 0.7-1.2 at 4-16). SOLO: TP1 without its exchanges
    # (the identity with no peer), v22 (dev round 49: 2.0 / 1.6 / 2.3 / 3.6 us faster at 1 / 2 /
    # 4 / 16 tokens); TP2 builds are unchanged. SOLO=2 drops them at any TP: a development proxy
    # (scripts/tp2_solo.py) that times one TP2 rank's build on one GPU, its output that rank's own
    # partial, never the all-reduce
    # KH: stage-2 items in KH parts of I_R (whole 128-wide scale blocks), each its own partial.
    # Measured, not adopted (dev round 52, TP1, KH=2: 53.8 / 85.1 / 141.6 against 47.8 / 79.9 /
    # 137.3 us at 1 / 2 / 4 tokens): an item took half the time (4.9 against 8.5 us at one token)
    # but stage 2 after stage 1's end grew from 9.5 to 14.3 us, and the sum read twice the parts.
    # v42-v43: TP1's three and four tokens take it (configs/triton-measured.toml: the tail of the
    # last round halves; at 2 and 5-16 tokens the items' own cost outweighs that, dev rounds 109-112)
    kh = tune.get("KH", 1)
    if i_r and (i_r // 128) % kh:
        raise ValueError(f"FFNQ_TRITON_TUNE KH={kh}: must divide the {i_r // 128} K blocks of I_R")
    # A8: stage 2 fp8 x fp8 as stage 1 (the act as four fp8 terms over a scale per stage-1 tile,
    # written by that tile's maker): no fp8 -> fp16 conversion of w2 in the loop. Alone on one
    # H200 (scripts/read_pattern.py, device round 40) such a loop read 3.92 / 4.10 TB/s at 64 /
    # 128 rows against the fp16 loop's 3.30 / 3.01. v24: A8=2 (steps of 128, an MMA per stage-1
    # tile) up to 8 tokens, TP1 side by side (dev rounds 53-54): 1 / 2 / 4 / 8 tokens 47.5 / 76.6 /
    # 123.8 / 180.6 against 47.7 / 79.9 / 136.9 / 191.5 us, and 47.9 / 77.4 / 126.6 / 201.5 against
    # 48.2 / 80.3 / 139.4 / 197.7 in a round noisy from 8 tokens; at 12 / 16 266.4 / 328.7 against
    # 273.6 / 325.2 (round 53 at 16: 308.7 against 311.0; 12-52 bytes of spills from 9 tokens), so 9-16
    # kept fp16 in v24-v25 (v26: two terms, below). A8=1 (steps of one tile, no spills) was slower at 1-4. NVIDIA fp8 path only (F8)
    # A8T: the act's fp8 terms (4: ~16 bits; 2: ~8, a bf16 act's; 1: one fp8 code per element).
    # v26: two terms at every width, A8 from 9 tokens too (dev round 58, TP1 side by side, p50
    # us): 1 / 4 / 8 / 9 / 12 / 14 / 16 tokens 46.2 / 123.0 / 175.9 / 203.0 / 238.5 / 261.5 /
    # 289.2 against v25's 46.3 / 124.0 / 180.4 / 217.3 / 247.2 / 271.1 / 309.0 (four terms at
    # 9-16: 220.4 / 249.9 / 272.0 / 302.7, with spills); max rel_err over 1-16 tokens 0.00179
    # against 0.00173 (each element keeps its own exponent under the tile's scale)
    a8 = _allowed("A8", tune.get("A8", 2) if f8 and i_r > 0 and 128 % bn == 0 else 0, (0, 1, 2),
                  "0 (fp16 act), 1 or 2 (fp8 act terms in steps of one stage-1 tile or of 128)")
    a8t = _allowed("A8T", tune.get("A8T", 2), (1, 2, 4), "1, 2 or 4 fp8 terms")
    # DQ: a CTA's items after its first taken from one counter for both stages (stage 2's items
    # numbered after stage 1's; a ticket claimed at a stage-1 item's start, at a stage-2 item's
    # once its tiles are in) instead of every BLOCKS-th: a CTA slowed by its SM's share of the HBM
    # takes fewer items, and the CTAs leaving stage 1 first take the first slots' stage-2 items,
    # whose tiles were claimed first. v27 had a counter per stage (each CTA's first stage-2 item
    # its own every-BLOCKS-th): 1-3% faster at TP1's 4-14 tokens, no gain at 16. v28, one counter
    # (dev rounds 62-63, named DQ=2 there; scripts/ab_bench.sh beside v27): the same as v27's at
    # 4-15 tokens (configs/triton-measured.toml); at 16 2.3% faster in the graph profile but not
    # in a bench timed across the GPU's power cap, and 1.5% faster in one timed in bursts (v36,
    # dev round 99), so 4-16; at 1-3 no gain (a stage's items fit one round; in bursts, dev round
    # 101: 46.0 / 70.5 / 96.9 against 45.8 / 70.9 / 96.8 us, and with three K parts at 1-3 tokens
    # 48.8 / 71.8 / 97.8). TP2, not measured, keeps the every-BLOCKS-th schedule
    dq = _allowed("DQ", tune.get("DQ", 0), (0, 1), "0 (every BLOCKS-th item) or 1 (one counter)")
    # SQ2: stage 2's act token columns per term are at least this many. With two terms, 4 makes the
    # MMA's N 8, which Triton 3.6 lowers to fp16 mma.sync behind a conversion of every w2 code (the
    # 1-4 token builds); 8 gives N = 16 and the fp8 wgmma. Measured, not adopted (dev round 69, TP1
    # side by side twice, p50 us at 1 / 2 / 3 / 4 tokens): 47.0, 47.0 / 69.9, 70.9 / 101.2, 101.2 /
    # 122.3, 122.5 against 46.8, 46.8 / 70.9, 70.9 / 101.6, 101.6 / 122.7, 122.6, a stage-2 item the
    # same 10.2-10.5 us at one token: that stage is bound by its bytes in flight, not the conversion
    sq2 = _allowed("SQ2", tune.get("SQ2", 4), (4, 8, 16), "4, 8 or 16 (stage 2's least act token columns)")
    # EW: the weights phase A and the top-k read (router, post_norm, router_bias) issued before the
    # PDL wait, so their HBM latency runs beside the previous launch's exit (the runner waits
    # for the stream once per new weights: TritonRunner.settle). v32, TP1 (dev round 82, side by
    # side twice, p50 us): 45.9, 45.9 / 70.3, 71.1 / 120.9, 120.8 / 178.5, 178.6 / 293.7, 294.3
    # against 46.2, 46.2 / 71.3, 71.0 / 121.0, 121.0 / 183.1, 182.3 / 294.3, 294.8 at 1 / 2 / 4 /
    # 8 / 16 tokens; the profile's router done 1.3-1.8 us sooner after the wait. Through the CLI
    # beside v31 (dev round 83, twice): 46.0, 45.9 / 70.3, 70.2 against 46.3, 46.3 / 70.6, 71.4 at
    # 1 / 2 tokens, 3-16 within the spread both ways (8 tokens' gain above did not come back).
    # Other TPs off unless configs/triton-measured.toml sets it (TP2 since v39, in the one-GPU proxy)
    # Measured and dropped, their code in the commits named: RS=1 / A8=3, each accumulator kept in
    # units of the last block's scale (a9ac92e; dev round 55: 0.2-1.6% slower, rel_err 0.0030-0.0034
    # against 0.0017); PF, the stage-2 item's w2 rows prefetched to the L2 before its wait (23bca0f;
    # dev round 88: 2-8% slower); KROT, each item's K loop started at a block set by its tile
    # (7c88b67; dev round 102: 0.2-2% slower); TLG, the FR barrier as tagged logits (4dd9cee; dev
    # round 105: 1.2-1.4 us slower at 1-2 tokens); BSP, the grid barriers released through 16 flag
    # words (one count polled by every CTA's atomic was thought to queue), and BLD, their polls as one
    # lane's load (04d1cf9; dev round 106: barrier 1 from the last arrival to the last CTA out 1.5-2.3
    # us against 1.3, the step 0.2-2.7 us slower at 1-16 tokens); PN / PN1, the next item's first K
    # steps asked of the L2 (bulk prefetches) where the stage-2 / stage-1 item's loop issues its
    # last load, and FL, stage 2 as one loop over a CTA's items that Triton flattens and pipelines
    # across items (a7867f2; dev rounds 115-116, TP1's x_floor side by side twice against the
    # default's: PN=3 0.1-8.4% higher at every width, PN1=3 1.0-6.5%, FL 2.7-4.8% at 3-16 tokens
    # and within 1% at 1-2; the TP2 proxy, device round 91: FL 2.2-4.7% slower at 4-16 tokens);
    # TS, a tapered stage 1: the slots past the grid's whole rounds of items in TS K parts, so the
    # items the schedule ends on are short (a6a2138; dev rounds 127-128, TP2's solo proxy on an
    # H100, twice: TS=2 0.3-2.0 us and TS=4 0.2-2.3 us slower at 3-16 tokens; at four tokens stage
    # 1's last CTA ended 4.6 us sooner and stage 2's at the same 85.2 us: the HBM, not the tail,
    # bounds the expert phase there)
    # HP: an item's header (its expert; at stage 2 also its tiles' count and its rows) read at the
    # end of the item before, behind that item's epilogue, not at its own start: bit 1 stage 2,
    # bit 2 stage 1 (there with the route weights its epilogue needs read before its loop)
    hp = _allowed("HP", tune.get("HP", 0), (0, 1, 2, 3), "0 (off), 1 (stage 2), 2 (stage 1) or 3 (both)")
    # PK: stage 1 reads w13 tile-packed by the runner (runner.packed_w13: each K step's gate and up
    # blocks one contiguous 2 x BN x 128 bytes, not 128 bytes of each of 2 x BN rows H apart). The
    # loop alone 4-6% faster at TP2's shapes on an H100, w2 packed the same way ~1% (dev rounds
    # 131-132, scripts/wave_probe.py --pack). v48, on by default (H100, side by side): TP2's solo
    # proxy (dev round 133, twice, p50 us) 1 token 41.0, 40.9 against 40.7, 40.9; 2 58.8, 59.9 /
    # 61.2, 60.4; 3 73.6, 73.7 / 74.9, 74.8; 4 86.5, 86.6 / 90.0, 89.9; 6 107.5 / 112.1; 8 125.5 /
    # 130.0; 12 156.3 / 161.5, 161.3; 16 181.3 / 187.7; TP1 through the CLI bench (dev round 134)
    # 59.1 / 89.4 / 153.5 / 232.2 / 354.0 against 59.0 / 90.9 / 157.4 / 238.8 / 364.9 at 1 / 2 /
    # 4 / 8 / 16 tokens. The runner keeps one packed copy of each w13 (PackedWeights). On an H200
    # one token was slower packed (TP1 1.4 us, TP2's solo proxy 0.3-0.7; dev rounds 137-138), so
    # the measured table keeps w13 as given there (v49)
    pk = _allowed("PK", tune.get("PK", 1), (0, 1), "0 (w13 as given) or 1 (w13 tile-packed by the runner)")
    # PLR's FMAs hold [rows, CHP2, E] products: over chunks of more than 16 columns (a grid under
    # H / 16 CTAs: an H20's 156, the pair proxy's 132) they spilled from four rows (sm_90 offline,
    # 78 SMs, the table's PLR: 16-656 B at TP1's and TP2's 4-16 tokens; none with the 16-row dot),
    # so there the table's PLR stops at two rows; FFNQ_TRITON_TUNE's PLR is taken as asked
    plr = tune.get("PLR", 2)
    chp2 = max(16, _p2(ch))  # the chunk's column tile
    if chp2 > 16 and "PLR" not in asked:
        plr = min(plr, 2)
    extra = dict(CHK=tune.get("CHK", 8),
                 PDL=bool(tune.get("PDL", 1)), FENCE=bool(tune.get("FENCE", 1)), SORT=bool(tune.get("SORT", 1)),
                 LL=bool(tune.get("LL", 1)), PRE=bool(tune.get("PRE", 1)), PLR=plr,
                 SOLO=solo, FR=fr, KH=kh, A8=a8,
                 A8T=a8t, DQ=dq, HP=hp,
                 SQ2=min(16, max(_p2(key.tokens), sq2)), FW=bool(tune.get("FW", 0)), X8T=x8t,
                 EW=bool(tune.get("EW", int(key.tp == 1))), PK=pk if i_r else 0)
    nsl, nht = max(1, nslot), H // bh
    # PS: phase E sums each H tile's slots as their stage-2 items finish (one counter per slot and
    # tile), not after the tile's last slot (one counter per tile)
    # (PS=2: its polls as acquire loads, not atomics; dev round 81: correct, no faster, notes/triton-kernel.md)
    ps = _allowed("PS", tune.get("PS", 0), (0, 1, 2), "0 (off), 1 or 2 (polled by atomics or by loads)")
    ps = ps if nslot > 0 else 0
    # SPS: phase E reads each row's own K slots (route, mapped to slots), not every active slot's
    # partial in batches of JB (at 16 tokens 68 slots: ~13 MB, the sum ~7 us, dev round 82);
    # SPS=2 also leaves stage 2's rows of other experts unwritten (16 tokens: 1.6 of 13.4 MB).
    # Only where phase B picks the rows (ROWTOP: the route is written before barrier 2) and PS is
    # off. v33, SPS=2 at TP1 (dev round 84, side by side twice, p50 us at 3 / 4 / 8 / 12 / 16
    # tokens): 99.8, 99.9 / 119.7, 119.8 / 178.9, 178.6 / 231.7, 232.6 / 281.0, 280.9 against
    # 99.8, 99.9 / 121.0, 121.0 / 180.5, 181.0 / 237.2, 235.6 / 294.4, 293.1; the profile at 16
    # tokens: the sum 1.0-1.3 us (median) against 6.9-7.2, stage 2 done 3-4 us sooner (fewer
    # writes beside the weight stream). SPS=1 (reads only) 101.1, 101.4 at 3 tokens, 289.6, 289.2
    # at 16. Other TPs off unless configs/triton-measured.toml sets it (TP2 since v39)
    sps = _allowed("SPS", tune.get("SPS", 2 if key.tp == 1 else 0), (0, 1, 2),
                   "0 (every slot), 1 (each row's own slots) or 2 (1, and stage 2 writes only those)")
    # (phase E's offsets into the partials are int32: [NSLOT x KH, S, H])
    sps = sps if rowtop and nslot > 0 and not ps and nslot * kh * key.tokens * H < 2 ** 31 else 0
    pso = nsl + nht + (nsl * nt if ks > 1 else 0)
    qoff = pso + (nsl * nht if ps else 0)
    nsync = qoff + dq
    seg = -(-nsync // blocks)
    # NSS: the pipeline depth at up to 4 tokens, where SQ=4 leaves shared memory for more stages
    ns = tune.get("NS", tune.get("NSS", NUM_STAGES_EXPERTS) if sq <= 4 else NUM_STAGES_EXPERTS)
    # NS2: stage 2's pipeline depth, stage 1's unless asked (a stage-2 step holds about half
    # the bytes of a stage-1 step, so the same shared memory holds more of them)
    return dict(BH=bh, JB=jb, SQ=sq, NS=ns, NS2=tune.get("NS2", ns), H=H, E=E, EP2=_p2(E), K=m.top_k,
                KP2=_p2(m.top_k), I_R=i_r, MODE=MODES[mode], NLOC=nloc, TP=key.tp, MT=m.max_tokens, BLOCKS=blocks,
                NCH=nch, NCHP2=_p2(nch), CH=ch, CHP2=chp2, EPC=epc, EPCP2=epcp2, RT=rt,
                BN=bn, EPS=float(m.eps), NSLOT=nslot, KS=ks, ROWTOP=rowtop, NSL=nsl,
                NSYNC=nsync, QOFF=qoff, PS=ps, PSO=pso, SPS=sps,
                NSLP2=max(_p2(nsl), 32 * NUM_WARPS) if ps == 2 else _p2(nsl), SEG=seg, SEGP2=_p2(seg), SACC=sacc, F8=f8, HP2=_p2(H), SHIFT=1.0 if sacc else float(2 ** SCALE_SHIFT),
                RP=rp, CPPP2=_p2(-(-nch // rp)), **extra)


def scratch_extra(key) -> list:
    """The kernel's own scratch regions (beside spec's fault/timeline/route/route_w)."""
    import torch
    g = geometry(key)
    S, H = key.tokens, g["H"]
    out = [("h", torch.float32, (S, H)), ("x", torch.float16, (2, S, H)), ("ssq", torch.float32, (g["NCH"], 16)),
           ("logits", torch.float32, (16, g["E"])), ("meta", torch.int32, (key.blocks * (1 + g["DQ"]),)),
           ("wtab", torch.float32, (key.blocks, g["EP2"], 16)),
           ("plog", torch.float32, (g["NCH"], S, g["EP2"])), ("ecta", torch.int32, (key.blocks, g["EP2"])),
           ("sub", torch.int64, (key.blocks, 16)), ("sync", torch.int32, (g["NSYNC"],)),
           ("sel", torch.int32, (S, g["EP2"])), ("rowcnt", torch.int32, (16,)),
           ("rpart", torch.float32, (S, g["RP"], g["EP2"]))]
    if g["NSLOT"]:
        # act: fp16 (CDNA keeps it where a tune asks for A8: constexprs turns A8 off there)
        out.append(("act", torch.float16, (g["NSLOT"], 16, g["I_R"])))
        if g["A8"]:  # A8T fp8 terms x 16 token rows per slot, a scale per stage-1 tile
            out.append(("act8", torch.uint8, (g["NSLOT"], g["A8T"], 16, g["I_R"])))
            out.append(("ascale", torch.float32, (g["NSLOT"], g["I_R"] // g["BN"])))
        out.append(("ypart", torch.float32, (g["NSLOT"] * g["KH"], S, H)))
        if g["KS"] > 1:
            out.append(("gpart", torch.float32, (g["NSLOT"] * (g["I_R"] // g["BN"]) * g["KS"], 2, g["BN"], 16)))
        if g["SPS"]:  # each CTA's expert -> slot table (phase C), for phase E
            out.append(("inv", torch.int32, (key.blocks, g["EP2"])))
    return out


def constexprs(key, layout: dict, peer: dict, is_hip: bool, interp: bool = False, stage: int = 0,
               final: bool = False) -> dict:
    """Every constexpr of ffn_kernel for one build. ``layout``/``peer``: spec scratch/peer layouts."""
    from ffnq.spec import stamp_names
    g = geometry(key)
    g.pop("NSLOT")
    sc = {"SC_FAULT": "fault", "SC_TL": "timeline", "SC_ROUTE": "route", "SC_ROUTEW": "route_w", "SC_H": "h",
          "SC_X": "x", "SC_SSQ": "ssq", "SC_LOGIT": "logits", "SC_META": "meta",
          "SC_ACT": "act", "SC_YPART": "ypart", "SC_WTAB": "wtab", "SC_PLOG": "plog", "SC_ECTA": "ecta",
          "SC_SUB": "sub", "SC_SYNC": "sync", "SC_GPART": "gpart", "SC_SEL": "sel", "SC_ROWCNT": "rowcnt",
          "SC_RPART": "rpart", "SC_ACT8": "act8", "SC_ASC": "ascale", "SC_INV": "inv"}
    g.update({k: (layout[v].offset if v in layout else 0) for k, v in sc.items()})
    if is_hip:  # CDNA: deeper pipelining spills VGPRs (464 VGPR + 71 spills at NS=4, gfx942 s=8)
        g["NS"] = g["NS2"] = NUM_STAGES_HIP
        # and the fp8 MMA of MI300 (gfx942) takes the fnuz format, not the OCP e4m3 of these
        # weights (F8 compiles there to fp16 MFMAs behind conversions); gfx950 has OCP fp8 MFMAs
        # but no run yet: CDNA keeps the fp16 path (exact fp8 -> fp16 codes, scale on the product)
        g["F8"], g["A8"] = False, 0
        g["SQ"] = max(g["SQ"], 8)  # two fp16 x terms: N = 2 x SQ >= 16
        if key.tp > 1:
            # TP2's partial logits as FMAs over 16 rows (v46, timed on an H100 only) took 260
            # VGPRs at 14-15 tokens on gfx950: one CTA per CU, 264 do not fit its 256 (CI's
            # offline warm); CDNA keeps the 16-row dot there, FMAs up to 8 rows (v39)
            g["PLR"] = min(g["PLR"], 8)
    if is_hip or interp:  # griddepcontrol and the fence are sm_90 PTX
        g["PDL"] = g["FENCE"] = False
    if is_hip:  # tagged words need 8-byte single-copy atomicity across the link: shown on NVLink only
        g["LL"] = False
        if g["FR"] and key.tp > 1 and not g["SOLO"]:
            raise ValueError("FFNQ_TRITON_TUNE FR at TP > 1 needs the LL exchange, which CDNA builds leave off")
    g.update(P_FLAGS=peer["flags"].offset, P_FBOX=peer["fault_box"].offset, P_SEAM=peer["seam"].offset,
             P_MOE=peer["moe"].offset, P_SEAM_LL=peer["seam_ll"].offset, P_MOE_LL=peer["moe_ll"].offset,
             NCOL=len(stamp_names(key.tp)), S=key.tokens, TIMELINE=bool(key.timeline),
             FLAGB=key.flags,  # the peer flags' CTA slots per phase (spec.peer_layout): >= the grid
             IS_HIP=bool(is_hip), INTERP=bool(interp), STAGE=int(stage), FINAL=bool(final))
    return g


def launch_options(cx: dict, key) -> dict:
    """The launch options of build ``key`` with constexprs ``cx`` (part of the compiled variant;
    the HIP backend knows no launch_pdl, so it is named only where asked for). A register cap
    (ptxas's maxnreg, NVIDIA only): the width's R (configs/triton-measured.toml's row, or
    FFNQ_TRITON_TUNE "R=n" / "R@w=n"), or FFNQ_TRITON_TUNE "R1=168" (at most 168 registers per
    thread at width 1, so that 3 CTAs of 128 threads fit an SM's 64K registers, with a grid of
    3 x SMs, "G1=396") over it."""
    tune = read_tune()
    # COOP=0 (development): a plain launch, the grid's residency left to warm's check
    opts = dict(launch_cooperative_grid=bool(tune.get("COOP", 1)), **({"launch_pdl": True} if cx.get("PDL") else {}))
    tune = choices(key)  # the width's row under FFNQ_TRITON_TUNE's R, R@w and R<w> (tune.parse)
    regs = tune.get("R")
    if not regs and cx.get("SOLO") and key.tp > 1 and tune.get("CPS", 2) > 2:
        # SOLO=2, the one-GPU proxy of a TP > 1 rank: without the exchanges' code its build takes
        # other registers (TP2's three tokens 176, not the shipped 168), so where the shipped
        # build holds CPS CTAs per SM the cap keeps that many (64K registers an SM)
        regs = 65536 // (tune["CPS"] * NUM_WARPS * 32) // 8 * 8
    return dict(opts, maxnreg=regs) if regs and not cx.get("IS_HIP") else opts


def signature(fp8: str = "fp8e4nv") -> dict:
    ptr = {"part": "*bf16", "residual": "*bf16", "slots": "*i64", "out": "*bf16", "res_out": "*bf16",
           "post_norm": "*fp32", "router": "*fp32", "router_bias": "*fp32", "w13": f"*{fp8}", "s13": "*fp32",
           "w2": f"*{fp8}", "s2": "*fp32", "scratch": "*u8", "peers": "*i64", "epoch": "*i32", "inject": "*i32",
           "cfg": "*i64", "rank": "i32", "first_expert": "i32"}
    return ptr
