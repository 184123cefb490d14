"""One build of the fused kernel, specialised on the host (plain Python, shared by TritonRunner
and the offline compiler): its build keys (kernel.py's table: defaults, configs/triton-measured.toml's
row, FFNQ_TRITON_TUNE over both), tile geometry and chunking, scratch regions, constexprs and launch
options, and the checks on what was compiled (no fp32 product at tf32 precision)."""
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
# The SCALE_ON_PRODUCT=0 path multiplies fp8 codes by (block scale x 2^SCALE_SHIFT) in fp16 so that
# small scales stay normal; 448 x scale x 2^8 must stay below fp16's 65504: scales < 0.57
# (TritonRunner.warm checks the weights it is given when that path is built).
SCALE_SHIFT = 8
MAX_SCALE = 65504.0 / (448.0 * 2 ** SCALE_SHIFT)


# an fp32 tt.dot at tf32 precision (10-bit mantissas): the kernel's fp32 products (the router's
# partial logits) must be exact, and Triton folds a broadcast-multiply-sum of [16, K] x [K, N] fp32
# tiles into such a dot (LOGIT_FMA_ROWS over 16 rows in one pass flipped routes at 11 and 16 tokens).
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
    """The largest block scale the built weight path takes (None: any; the default paths, FP8_X
    and SCALE_ON_PRODUCT, multiply the fp32 product of each K block by its scale)."""
    t = read_tune()
    return None if t.get("SCALE_ON_PRODUCT", 1) or t.get("FP8_X", 1) else MAX_SCALE
ARG_NAMES = ("part", "residual", "slots", "out", "res_out", "post_norm", "router", "router_bias", "w13", "s13", "w2",
             "s2", "scratch", "peers", "epoch", "inject", "cfg", "rank", "first_expert")


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _allowed(key: str, value: int, allowed, meaning: str) -> int:
    """``value`` of FFNQ_TRITON_TUNE's ``key`` if it is one of ``allowed``; else ValueError, one
    line naming it and what is allowed (``meaning``)."""
    if value not in allowed:
        raise ValueError(f"FFNQ_TRITON_TUNE {key}={value}: allowed {meaning}")
    return value


# the keys configs/triton-measured.toml may set: tile and schedule choices, not protocol switches
# (CTAS_PER_SM: the width's grid on NVIDIA, read by TritonRunner.blocks_for; MAXNREG: the width's
# register cap on NVIDIA, launch_options; PACKED_W13: the w13 layout stage 1 reads, which the runner
# gives each build as it asks)
MEASURED_KEYS = frozenset({
    "CTAS_PER_SM", "DOWN_KSPLIT", "DOWN_STAGES", "DOWN_TILE", "EARLY_HEADER", "EARLY_WEIGHTS", "LOGIT_FMA_ROWS",
    "MAXNREG", "PACKED_W13", "PACKED_W2", "ROW_PICK_FROM", "ROW_PICK_MAX_CTAS", "SUM_BATCH", "SUM_OWN_SLOTS", "UP_KSPLIT",
    "UP_KSPLIT_FIXUP", "UP_NARROW_FROM", "UP_STAGES", "UP_STAGES_NARROW", "UP_TILE", "W2_PACK_ROWS", "WORK_QUEUE",
    "X_TERMS",
})


def _sort_topk(tune: dict):
    """SORT_TOPK: 1 (True, the default) a partial bitonic sort of int64 keys (score, reversed index),
    2 the same sort of the fp32 scores and the ties at the threshold by index, 0 TOP_K rounds of max."""
    v = _allowed("SORT_TOPK", tune.get("SORT_TOPK", 1), (0, 1, 2),
                 "0 (rounds of max), 1 (sort of int64 keys) or 2 (sort of fp32 scores)")
    return v if v == 2 else bool(v)


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
    """Tile sizes, chunking and choices of one build (a spec.FfnBuild): every build key of
    kernel.py's table, from its default, the measured table's row and FFNQ_TRITON_TUNE."""
    m, blocks = key.model, key.blocks
    hidden, n_experts = m.hidden, m.experts
    mode = key.experts.value
    i_r = m.intermediate_per_rank(key.tp, key.experts) if mode != "none" else 0
    nloc = m.experts_per_rank(key.tp, key.experts)
    nch = max(1, min(blocks, hidden // 16))
    ch = -(-hidden // nch)
    # only non-empty chunks: 156 CTAs over 3072 columns are chunks of 20, of which 154 hold
    # columns (the last two would sum H tiles past the last and wait out their bound)
    nch = -(-hidden // ch)
    epc = -(-n_experts // blocks)
    epcp2 = _p2(epc)
    nslot = min(key.tokens * m.top_k, nloc) if mode != "none" else 0
    asked = read_tune(key.tokens)  # FFNQ_TRITON_TUNE's keys: kept as asked where a rule caps the table's
    tune = {**measured(m.name, key.tp, key.tokens), **asked}  # choices(key)
    # UP_TILE: 64 gate + 64 up rows of one expert (the M of an sm_90 warp-group MMA), halved
    # until it divides the intermediate and a 128-wide scale block
    bn = tune.get("UP_TILE", 64)
    while bn > 16 and i_r and (i_r % bn or 128 % bn):
        bn //= 2
    # DOWN_TILE: 64 rows at one or two tokens (twice the items to spread over the grid: 0.6-1.4 us
    # faster), 128 from three (64 was 2.4-5.1% slower at 4-16 tokens)
    bh = tune.get("DOWN_TILE", 64 if key.tokens <= 2 else 128)
    # at most one 128-row scale block of w2 a tile: stage 2 takes one block scale a K step
    _allowed("DOWN_TILE", bh, (16, 32, 64, 128), "16, 32, 64 or 128 rows (one w2 scale block at most)")
    # SUM_BATCH: slots summed per batch of loads in phase E (a power of two; the loads of one
    # batch are in flight together): 2048 fp32 a batch, 8 slots at 16-column chunks
    jb = tune.get("SUM_BATCH", max(1, min(8, 2048 // (16 * max(16, _p2(ch))))))
    if jb < 1 or jb & (jb - 1):
        raise ValueError(f"FFNQ_TRITON_TUNE SUM_BATCH={jb}: must be a power of two")
    nt = i_r // bn if i_r else 1
    # UP_KSPLIT: split the stage-1 items in K while a width's items would leave CTAs idle (one
    # token at TP2: 96 items of 393 KB), in whole scale blocks. The model: the grid's rounds of
    # items x each item's K steps, + 3 steps of pipeline fill, + UP_KSPLIT_FIXUP steps for a split
    # tile's fix-up (its parts written, re-read and summed by the last arriver), at the most slots
    # the width can touch; ties go to fewer parts. The fix-up's 4: TP2's nine tokens in two parts
    # took 155 against 142 us whole, which the model without it priced 105 against 108 steps. The
    # model prices stage 1 alone, so where a split lets stage 2 overlap it the measured table
    # overrides it (TP1 one token: 2 parts, 53.4 against 55.8 us whole)
    ks = tune.get("UP_KSPLIT", 0)
    if not ks:
        fix = tune.get("UP_KSPLIT_FIXUP", 4)
        cost = {k: -(-nslot * nt * k // blocks) * ((hidden // 128) // k + 3) + (fix if k > 1 else 0)
                for k in (1, 2, 3, 4, 6) if (hidden // 128) % k == 0}
        ks = min(cost, key=lambda k: (cost[k], k))
    if (hidden // 128) % ks:
        raise ValueError(
            f"FFNQ_TRITON_TUNE UP_KSPLIT={ks}: must divide the {hidden // 128} K blocks of the hidden size")
    rt = _p2(key.tokens)
    # SOLO: a build without its exchanges (their identity at TP1: 1.6-3.6 us faster at 1-16
    # tokens); SOLO=2 at any TP, one rank's build timed alone on one GPU (its output is that
    # rank's own partial, never the all-reduce)
    solo = key.tp == 1 and bool(tune.get("SOLO", 1)) or tune.get("SOLO") == 2
    # FULL_ROWS=n: up to n tokens (at most 2: the rows are held whole in registers) every CTA
    # reads the whole rows for rstd and its own experts' logits: one grid barrier, not two, and
    # no row pick (TP1: 48.2 against 51.5 us at one token, 80.7 against 83.0 at two). At TP > 1
    # a CTA's chunk of the all-reduced rows is not the whole rows, so each CTA also waits for
    # every peer's whole rows (their tagged words) and sums them; one token only there (at two,
    # minimax-m2's TP2 build spills 92-112 B at 255 registers), off unless asked (both ranks on
    # one GPU: 3.4-4.7 us slower)
    most = 2 if key.tp == 1 or solo else 1
    fr = int(key.tokens <= min(most, tune.get("FULL_ROWS", 2 if key.tp == 1 else 0)))
    if fr and key.tp > 1 and not tune.get("TAGGED_WORDS", 1) and not solo:
        raise ValueError("FFNQ_TRITON_TUNE FULL_ROWS at TP > 1 reads the peers' rows as tagged words: it needs "
                         "TAGGED_WORDS=1")
    # ROW_PICK: from a row tile of ROW_PICK_FROM rows phase B picks each row's top-k (the row's
    # last arriving CTA) instead of every CTA on the whole tile after barrier 2: 3-4 us faster at
    # 3-4 tokens, 1.2-1.4 at 2
    rowtop = rt >= tune.get("ROW_PICK_FROM", 2) and not fr
    # ROW_PICK_CTAS: CTAs per row in that pick, at most ROW_PICK_MAX_CTAS (the grid's share, 64
    # at 4 rows, left the row's last arriver 64 slices to read: 16 was 0.7-1.3 us faster at 4
    # tokens), rounded down to a power of two (the last arriver's tl.arange over the slices)
    rp = max(1, blocks // rt)
    if rowtop:
        rp = 1 << (max(1, min(rp, tune.get("ROW_PICK_MAX_CTAS", 16))).bit_length() - 1)
    # FP8_X: fp8 x terms need |x| / max|post_norm| <= sqrt(H) inside e4m3's 448 (H <= 200704);
    # asking for them (the default) also asks for the scale on each K block's product, which a
    # larger H keeps on the fp16 path: the same rule as max_scale()
    f8 = bool(tune.get("FP8_X", 1))
    sacc = bool(tune.get("SCALE_ON_PRODUCT", 1)) or f8
    f8 = f8 and hidden <= 448 ** 2

    # UP_COLS, stage 1's token columns per x term: from width UP_NARROW_FROM on the fewest that
    # hold the width and make tl.dot's N (terms x columns) at least 16, else 16 (UP_NARROW_FROM=0:
    # always 16). From 7 by default: 8 columns at 7-8 tokens were 1.7-2.5% faster at TP2, slower
    # at 1-4 and 6 (the build spills); the table takes 8 columns lower where measured faster
    def cols(terms: int) -> int:
        return max(_p2(key.tokens), 16 // terms) if 0 < tune.get("UP_NARROW_FROM", 7) <= key.tokens else 16

    # X_TERMS: x's fp8 terms (4: ~16 mantissa bits; 2: ~8, a bf16 x's). Two halve stage 1's MMA
    # columns and its accumulators' registers (TP1 at 4 / 12 / 16 tokens: 249 / 225 / 225
    # registers to 178 / 190 / 182): 280.3-281.6 against 290.5-293.8 us at 16 tokens, max rel_err
    # 0.0020 against 0.0018. Four where they make N = 32 from 8 token columns
    x8t = _allowed("X_TERMS", tune.get("X_TERMS", 4 if cols(4) == 8 else 2), (2, 4), "2 or 4 fp8 terms of x")
    sq = cols(x8t if f8 else 2)
    # DOWN_KSPLIT: stage-2 items in parts of the intermediate (whole 128-wide scale blocks), each
    # its own partial: the last round's items end ~6 us apart, not ~12, where that tail shows
    # (TP1 3-4 tokens: 94.0 against 95.1 us at 3); elsewhere the parts cost more than it saves
    kh = tune.get("DOWN_KSPLIT", 1)
    if i_r and (i_r // 128) % kh:
        raise ValueError(f"FFNQ_TRITON_TUNE DOWN_KSPLIT={kh}: must divide the {i_r // 128} K blocks of the "
                         f"intermediate size")
    # DOWN_FP8: stage 2 fp8 x fp8 as stage 1 (the act as fp8 terms over a scale per stage-1 tile,
    # written by that tile's maker): no fp8 -> fp16 conversion of w2 in the loop, which alone
    # reads 3.92 / 4.10 TB/s at 64 / 128 rows against the fp16 loop's 3.30 / 3.01 (289.2 against
    # 309.0 us at 16 tokens). Steps of 128 (an MMA per stage-1 tile); steps of one tile (1) were
    # slower at 1-4 tokens. NVIDIA's fp8 path only (FP8_X)
    a8 = _allowed("DOWN_FP8", tune.get("DOWN_FP8", 2) if f8 and i_r > 0 and 128 % bn == 0 else 0, (0, 1, 2),
                  "0 (fp16 act), 1 or 2 (fp8 act terms in steps of one stage-1 tile or of 128)")
    # DOWN_ACT_TERMS: the act's fp8 terms (4: ~16 bits; 2: ~8, a bf16 act's; 1: one code an
    # element). Four spill at 9-16 tokens (302.7 against 289.2 us at 16); max rel_err over 1-16
    # tokens 0.00179 against 0.00173 (each element keeps its own exponent under the tile's scale)
    a8t = _allowed("DOWN_ACT_TERMS", tune.get("DOWN_ACT_TERMS", 2), (1, 2, 4), "1, 2 or 4 fp8 terms")
    # WORK_QUEUE: a CTA's items after its first from one counter for both stages (a ticket claimed
    # at a stage-1 item's start, at a stage-2 item's once its tiles are in) instead of every
    # BLOCKS-th: a CTA slowed by its SM's share of the HBM takes fewer items, and the CTAs leaving
    # stage 1 first take the first slots' stage-2 items, whose tiles were claimed first (263.1
    # against 267.0 us at 16 tokens, 1-3% at 4-14; nothing to even out where a stage's items fit
    # one round, 1-2 tokens)
    dq = _allowed("WORK_QUEUE", tune.get("WORK_QUEUE", 0), (0, 1), "0 (every BLOCKS-th item) or 1 (one counter)")
    # DOWN_MIN_COLS: stage 2's act token columns per term are at least this many. With two terms, 4
    # makes the MMA's N 8, which Triton 3.6 lowers to fp16 mma.sync behind a conversion of every w2
    # code (1-4 tokens); 8 gives N = 16 and the fp8 wgmma, measured no faster (47.0 against 46.8 us
    # at one token, a stage-2 item the same 10.2-10.5 us): that stage is bound by its bytes in flight
    sq2 = _allowed("DOWN_MIN_COLS", tune.get("DOWN_MIN_COLS", 4), (4, 8, 16),
                   "4, 8 or 16 (stage 2's least act token columns)")
    # EARLY_HEADER: an item's header (its expert; at stage 2 also its tiles' count and its rows)
    # read at the end of the item before, behind that item's epilogue, not at its own start: bit 0
    # stage 2, bit 1 stage 1 (there with the route weights its epilogue needs read before its loop)
    hp = _allowed("EARLY_HEADER", tune.get("EARLY_HEADER", 0), (0, 1, 2, 3),
                  "0 (off), 1 (stage 2), 2 (stage 1) or 3 (both)")
    # PACKED_W13: stage 1 reads w13 tile-packed by the runner (runner.packed_w13: each K step's gate
    # and up blocks one contiguous 2 x UP_TILE x 128 bytes, not 128 bytes of each of 2 x UP_TILE
    # rows H apart): the loop alone 4-6% faster on an H100, TP1 354.0 against 364.9 us at 16
    # tokens. The runner keeps one packed copy of each w13 (PackedWeights)
    pk = _allowed("PACKED_W13", tune.get("PACKED_W13", 1), (0, 1),
                  "0 (w13 as given) or 1 (w13 tile-packed by the runner)")
    # PACKED_W2: stage 2 (fp8 act terms) reads w2 tile-packed by the runner (runner.packed_w2: a
    # loop step reads its DOWN_TILE rows of one contiguous [W2_PACK_ROWS, UP_TILE] block, not
    # UP_TILE bytes of each of DOWN_TILE rows INTER apart): 2-3.5% faster at
    # every TP1 width on an H100, 479.5 against 496.8 us at 16 tokens, 58.1 against 59.2 at one.
    # Off at TP > 1 until timed there (TP2's 3-token final build spills 4 B under its 168 registers)
    pk2 = _allowed("PACKED_W2", tune.get("PACKED_W2", int(key.tp == 1)), (0, 1),
                   "0 (w2 as given) or 1 (w2 tile-packed by the runner)")
    pk2 = pk2 if i_r and a8 else 0  # only stage 2 on the fp8 act reads it
    # W2_PACK_ROWS: the rows of the packed w2's tiles; 128 serves every DOWN_TILE (a 64-row item
    # reads its 64 rows of each [128, UP_TILE] block, 4 KB runs), so the runner keeps one w2 copy
    # for all widths, not one per tile height (1.2 GB a minimax-m2 TP1 weight set)
    w2r = _allowed("W2_PACK_ROWS", tune.get("W2_PACK_ROWS", 128), (16, 32, 64, 128),
                   "16, 32, 64 or 128 rows (a multiple of DOWN_TILE)")
    if pk2 and (w2r % bh or hidden % w2r):
        raise ValueError(f"FFNQ_TRITON_TUNE W2_PACK_ROWS={w2r}: allowed a multiple of DOWN_TILE ({bh}) that "
                         f"divides the hidden size ({hidden})")
    # LOGIT_FMA_ROWS' FMAs hold [rows, CHUNK_P2, EXPERTS] products: over chunks of more than 16
    # columns (a grid under H / 16 CTAs: an H20's 156) they spilled from four rows (16-656 B at
    # 4-16 tokens, sm_90 on 78 SMs; none with the 16-row dot), so there the table's value stops at
    # two rows; FFNQ_TRITON_TUNE's is taken as asked
    plr = tune.get("LOGIT_FMA_ROWS", 2)
    chp2 = max(16, _p2(ch))  # the chunk's column tile
    if chp2 > 16 and "LOGIT_FMA_ROWS" not in asked:
        plr = min(plr, 2)
    # the protocol's switches (kernel.py's table): POLLS_PER_CLOCK, PDL, FENCE, SORT_TOPK,
    # TAGGED_WORDS, EARLY_SEAM_READS, EARLY_FAULT_WORDS; EARLY_WEIGHTS on at TP1 (the table sets it
    # at TP2): the router done 1.3-1.8 us sooner after the PDL wait
    extra = dict(POLLS_PER_CLOCK=tune.get("POLLS_PER_CLOCK", 8), PDL=bool(tune.get("PDL", 1)),
                 FENCE=bool(tune.get("FENCE", 1)), SORT_TOPK=_sort_topk(tune),
                 TAGGED_WORDS=bool(tune.get("TAGGED_WORDS", 1)), EARLY_SEAM_READS=bool(tune.get("EARLY_SEAM_READS", 1)),
                 LOGIT_FMA_ROWS=plr, SOLO=solo, FULL_ROWS=fr, DOWN_KSPLIT=kh, DOWN_FP8=a8, DOWN_ACT_TERMS=a8t,
                 WORK_QUEUE=dq, EARLY_HEADER=hp, DOWN_COLS=min(16, max(_p2(key.tokens), sq2)),
                 EARLY_FAULT_WORDS=bool(tune.get("EARLY_FAULT_WORDS", 0)), X_TERMS=x8t,
                 EARLY_WEIGHTS=bool(tune.get("EARLY_WEIGHTS", int(key.tp == 1))), PACKED_W13=pk if i_r else 0,
                 PACKED_W2=pk2, W2_PACK_ROWS=w2r if pk2 else 0)
    nsl, nht = max(1, nslot), hidden // bh
    # SUM_AS_DONE: phase E sums each H tile's slots as their stage-2 items finish (one counter per
    # slot and tile), not after the tile's last slot (one counter per tile); 2: its polls as
    # acquire loads, not atomics. Correct, and no faster
    ps = _allowed("SUM_AS_DONE", tune.get("SUM_AS_DONE", 0), (0, 1, 2),
                  "0 (off), 1 or 2 (polled by atomics or by loads)")
    ps = ps if nslot > 0 else 0
    # SUM_OWN_SLOTS: phase E reads each row's own TOP_K slots (route, mapped to slots), not every
    # active slot's partial in batches of SUM_BATCH (at 16 tokens 68 slots, ~13 MB: the sum ~7
    # us); 2 also leaves stage 2's rows of other experts unwritten (1.6 of 13.4 MB at 16 tokens).
    # Only where phase B picks the rows (ROW_PICK: the route is written before barrier 2) and
    # SUM_AS_DONE is off. At TP1 281.0 against 294.4 us at 16 tokens (the sum 1.0-1.3 us against
    # 6.9-7.2, stage 2 done 3-4 us sooner); reads only (1): 289.6
    sps = _allowed("SUM_OWN_SLOTS", tune.get("SUM_OWN_SLOTS", 2 if key.tp == 1 else 0), (0, 1, 2),
                   "0 (every slot), 1 (each row's own slots) or 2 (1, and stage 2 writes only those)")
    # (phase E's offsets into the partials are int32: [MAX_SLOTS x DOWN_KSPLIT, TOKENS, HIDDEN])
    sps = sps if rowtop and nslot > 0 and not ps and nslot * kh * key.tokens * hidden < 2 ** 31 else 0
    # the counters region: [SLOTS] stage-1 tiles per slot, [DOWN_TILES] stage-2 items per H tile,
    # [SLOTS x UP_TILES] split-K arrivals, SUM_AS_DONE's [SLOTS x DOWN_TILES], the work queue's ticket
    pso = nsl + nht + (nsl * nt if ks > 1 else 0)
    qoff = pso + (nsl * nht if ps else 0)
    nsync = qoff + dq
    seg = -(-nsync // blocks)
    # UP_STAGES_NARROW: the depth at up to 4 token columns, where shared memory holds more stages
    ns = tune.get("UP_STAGES", tune.get("UP_STAGES_NARROW", NUM_STAGES_EXPERTS) if sq <= 4 else NUM_STAGES_EXPERTS)
    # DOWN_STAGES: stage 2's pipeline depth, stage 1's unless asked (a stage-2 step holds about half
    # the bytes of a stage-1 step, so the same shared memory holds more of them)
    return dict(DOWN_TILE=bh, SUM_BATCH=jb, UP_COLS=sq, UP_STAGES=ns, DOWN_STAGES=tune.get("DOWN_STAGES", ns),
                HIDDEN=hidden, EXPERTS=n_experts, EXPERTS_P2=_p2(n_experts), TOP_K=m.top_k, TOP_K_P2=_p2(m.top_k),
                INTER=i_r, EXPERT_MODE=MODES[mode], LOCAL_EXPERTS=nloc, TP=key.tp, MAX_TOKENS=m.max_tokens,
                BLOCKS=blocks, CHUNKS=nch, CHUNKS_P2=_p2(nch), CHUNK=ch, CHUNK_P2=chp2, CTA_EXPERTS=epc,
                CTA_EXPERTS_P2=epcp2, ROW_TILE=rt, UP_TILE=bn, EPS=float(m.eps), MAX_SLOTS=nslot, UP_KSPLIT=ks,
                ROW_PICK=rowtop, SLOTS=nsl, COUNTERS=nsync, QUEUE_AT=qoff, SUM_AS_DONE=ps, SLOT_TILE_AT=pso,
                SUM_OWN_SLOTS=sps, SLOTS_P2=max(_p2(nsl), 32 * NUM_WARPS) if ps == 2 else _p2(nsl), CLEAR_SPAN=seg,
                CLEAR_SPAN_P2=_p2(seg), SCALE_ON_PRODUCT=sacc, FP8_X=f8, HIDDEN_P2=_p2(hidden),
                SCALE_MUL=1.0 if sacc else float(2 ** SCALE_SHIFT), ROW_PICK_CTAS=rp, PICK_CHUNKS_P2=_p2(-(-nch // rp)),
                **extra)


def scratch_extra(key) -> list:
    """The kernel's own scratch regions (beside spec's fault/timeline/route/route_w)."""
    import torch
    g = geometry(key)
    tokens, hidden = key.tokens, g["HIDDEN"]
    out = [("h", torch.float32, (tokens, hidden)), ("x", torch.float16, (2, tokens, hidden)), ("ssq", torch.float32,
        (g["CHUNKS"], 16)),
           ("logits", torch.float32, (16, g["EXPERTS"])), ("meta", torch.int32, (key.blocks * (1 + g["WORK_QUEUE"]),)),
           ("wtab", torch.float32, (key.blocks, g["EXPERTS_P2"], 16)),
           ("plog", torch.float32, (g["CHUNKS"], tokens, g["EXPERTS_P2"])), ("ecta", torch.int32,
                                                                             (key.blocks, g["EXPERTS_P2"])),
           ("sub", torch.int64, (key.blocks, 16)), ("sync", torch.int32, (g["COUNTERS"],)),
           ("sel", torch.int32, (tokens, g["EXPERTS_P2"])), ("rowcnt", torch.int32, (16,)),
           ("rpart", torch.float32, (tokens, g["ROW_PICK_CTAS"], g["EXPERTS_P2"]))]
    if g["MAX_SLOTS"]:
        # act: fp16 (CDNA keeps it where a build asks for DOWN_FP8: constexprs turns it off there)
        out.append(("act", torch.float16, (g["MAX_SLOTS"], 16, g["INTER"])))
        if g["DOWN_FP8"]:  # DOWN_ACT_TERMS fp8 terms x 16 token rows per slot, a scale per stage-1 tile
            out.append(("act8", torch.uint8, (g["MAX_SLOTS"], g["DOWN_ACT_TERMS"], 16, g["INTER"])))
            out.append(("ascale", torch.float32, (g["MAX_SLOTS"], g["INTER"] // g["UP_TILE"])))
        out.append(("ypart", torch.float32, (g["MAX_SLOTS"] * g["DOWN_KSPLIT"], tokens, hidden)))
        if g["UP_KSPLIT"] > 1:
            out.append(("gpart", torch.float32, (g["MAX_SLOTS"] * (g["INTER"] // g["UP_TILE"]) * g["UP_KSPLIT"], 2,
                                                 g["UP_TILE"], 16)))
        if g["SUM_OWN_SLOTS"]:  # each CTA's expert -> slot table (phase C), for phase E
            out.append(("inv", torch.int32, (key.blocks, g["EXPERTS_P2"])))
    return out


def constexprs(key, layout: dict, peer: dict, is_hip: bool, interp: bool = False, stage: int = 0,
               final: bool = False) -> dict:
    """Every constexpr of ffn_kernel for one build. ``layout``/``peer``: spec scratch/peer layouts."""
    from ffnq.spec import stamp_names
    g = geometry(key)
    g.pop("MAX_SLOTS")
    sc = {"SC_FAULT": "fault", "SC_TIMELINE": "timeline", "SC_ROUTE": "route", "SC_ROUTE_W": "route_w",
          "SC_H_ROWS": "h",
          "SC_X_TERMS": "x", "SC_SUMSQ": "ssq", "SC_LOGITS": "logits", "SC_META": "meta",
          "SC_ACT": "act", "SC_DOWN_PARTS": "ypart", "SC_ROUTE_TABLE": "wtab", "SC_PART_LOGITS": "plog",
          "SC_ACTIVE": "ecta",
          "SC_SUBSTAMPS": "sub", "SC_COUNTERS": "sync", "SC_UP_PARTS": "gpart", "SC_PICKS": "sel",
          "SC_ROW_ARRIVALS": "rowcnt",
          "SC_ROW_PARTS": "rpart", "SC_ACT_FP8": "act8", "SC_ACT_SCALE": "ascale", "SC_EXPERT_SLOT": "inv"}
    g.update({k: (layout[v].offset if v in layout else 0) for k, v in sc.items()})
    if is_hip:  # CDNA: deeper pipelining spills VGPRs (464 VGPRs + 71 spills at 4 stages, gfx942, 8 tokens)
        g["UP_STAGES"] = g["DOWN_STAGES"] = NUM_STAGES_HIP
        # and the fp8 MMA of MI300 (gfx942) takes the fnuz format, not the OCP e4m3 of these
        # weights (FP8_X compiles there to fp16 MFMAs behind conversions); gfx950 has OCP fp8 MFMAs
        # but no run yet: CDNA keeps the fp16 path (exact fp8 -> fp16 codes, scale on the product)
        g["FP8_X"], g["DOWN_FP8"], g["PACKED_W2"] = False, 0, 0
        g["UP_COLS"] = max(g["UP_COLS"], 8)  # two fp16 x terms: N = 2 x UP_COLS >= 16
        if key.tp > 1:
            # TP2's partial logits as FMAs over 16 rows took 260 VGPRs at 14-15 tokens on gfx950:
            # one CTA per CU, and 264 CTAs do not fit its 256 CUs; CDNA keeps the 16-row dot
            # there, FMAs up to 8 rows
            g["LOGIT_FMA_ROWS"] = min(g["LOGIT_FMA_ROWS"], 8)
    if is_hip or interp:  # griddepcontrol and the fence are sm_90 PTX
        g["PDL"] = g["FENCE"] = False
    if is_hip:  # tagged words need 8-byte single-copy atomicity across the link: shown on NVLink only
        g["TAGGED_WORDS"] = False
        if g["FULL_ROWS"] and key.tp > 1 and not g["SOLO"]:
            raise ValueError("FFNQ_TRITON_TUNE FULL_ROWS at TP > 1 needs the tagged-word exchange, which CDNA builds "
                             "leave off")
    g.update(PEER_FLAGS=peer["flags"].offset, PEER_FAULT_BOX=peer["fault_box"].offset, PEER_SEAM=peer["seam"].offset,
             PEER_MOE=peer["moe"].offset, PEER_SEAM_TAGGED=peer["seam_ll"].offset,
             PEER_MOE_TAGGED=peer["moe_ll"].offset,
             STAMP_COLS=len(stamp_names(key.tp)), TOKENS=key.tokens, TIMELINE=bool(key.timeline),
             FLAG_CTAS=key.flags,  # the peer flags' CTA slots per phase (spec.peer_layout): >= the grid
             IS_HIP=bool(is_hip), INTERP=bool(interp), STAGE=int(stage), FINAL=bool(final))
    return g


def launch_options(cx: dict, key) -> dict:
    """The launch options of build ``key`` with constexprs ``cx`` (part of the compiled variant;
    the HIP backend knows no launch_pdl, so it is named only where asked for). A register cap
    (ptxas's maxnreg, NVIDIA only): the width's MAXNREG (configs/triton-measured.toml's row, or
    FFNQ_TRITON_TUNE "MAXNREG=n" / "MAXNREG@w=n": 168 registers per thread let 3 CTAs of 128
    threads fit an SM's 64K registers, with a grid of 3 x SMs, "GRID@w=396")."""
    tune = read_tune()
    # COOPERATIVE=0 (development): a plain launch, the grid's residency left to warm's check
    opts = dict(launch_cooperative_grid=bool(tune.get("COOPERATIVE", 1)),
                **({"launch_pdl": True} if cx.get("PDL") else {}))
    tune = choices(key)  # the width's row under FFNQ_TRITON_TUNE's MAXNREG and MAXNREG@w
    regs = tune.get("MAXNREG")
    if not regs and cx.get("SOLO") and key.tp > 1 and tune.get("CTAS_PER_SM", 2) > 2:
        # SOLO=2, one TP > 1 rank's build alone on one GPU: without the exchanges' code it takes
        # other registers (TP2's three tokens 176, not the shipped 168), so where the shipped
        # build holds CTAS_PER_SM CTAs per SM the cap keeps that many (64K registers an SM)
        regs = 65536 // (tune["CTAS_PER_SM"] * NUM_WARPS * 32) // 8 * 8
    return dict(opts, maxnreg=regs) if regs and not cx.get("IS_HIP") else opts


def signature(fp8: str = "fp8e4nv") -> dict:
    ptr = {"part": "*bf16", "residual": "*bf16", "slots": "*i64", "out": "*bf16", "res_out": "*bf16",
           "post_norm": "*fp32", "router": "*fp32", "router_bias": "*fp32", "w13": f"*{fp8}", "s13": "*fp32",
           "w2": f"*{fp8}", "s2": "*fp32", "scratch": "*u8", "peers": "*i64", "epoch": "*i32", "inject": "*i32",
           "cfg": "*i64", "rank": "i32", "first_expert": "i32"}
    return ptr
