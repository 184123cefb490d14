"""The fused kernel's L2 prefetch of an expert item's weights (device helpers; sm_90, PREFETCH_AHEAD).

A CTA streams an item's weights through its software pipeline: at most UP_STAGES K steps in
flight, which at one token caps a CTA near 12-14 GB/s and leaves the HBM short of its read rate
while one or two waves of items run. ``cp.async.bulk.prefetch.L2`` hands a whole item's bytes to
the SM's copy engine in one instruction a thread: they flow into L2 at the HBM's rate while the
CTA's own loads (which then hit L2 or a line already on its way) run behind them. A prefetch is a
hint: nothing waits on it and no result depends on it, so a wrong one costs time, never
correctness; tests/test_triton_prefetch.py checks that an item's runs are exactly the bytes its
loop reads. Off on CDNA and in the interpreter (sm_90 PTX)."""
import triton
import triton.language as tl


@triton.jit
def _l2_prefetch(ptr, nbytes, live):
    """One bulk prefetch into L2 per live element: ``nbytes`` (int32, a multiple of 16) from ``ptr``
    (16-byte aligned). Predicated in the asm: inline asm has no mask."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptr, live.to(tl.int32), nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _up_runs(w, ecta, first_expert, HIDDEN: tl.constexpr, INTER: tl.constexpr, EXPERT_MODE: tl.constexpr,
             UP_TILE: tl.constexpr, UP_KSPLIT: tl.constexpr, PACKED_W13: tl.constexpr):
    """Stage-1 item ``w``'s bytes of w13 as 2 x UP_TILE runs of HIDDEN / UP_KSPLIT bytes: their
    offsets from w13 [2 x UP_TILE] int64 (as given: the K part of each gate row, then of each up
    row INTER further; packed, runner.packed_w13: one contiguous span cut in as many runs)."""
    K_BLOCK: tl.constexpr = 128
    UP_TILES: tl.constexpr = INTER // UP_TILE
    UP_K_PART: tl.constexpr = HIDDEN // UP_KSPLIT
    jt = w // UP_KSPLIT
    kb = (w % UP_KSPLIT) * UP_K_PART
    t = jt % UP_TILES
    le = tl.load(ecta + jt // UP_TILES).to(tl.int64)
    if EXPERT_MODE == 1:
        le -= first_expert
    r = tl.arange(0, 2 * UP_TILE)
    if PACKED_W13:
        off = (le * (2 * INTER * HIDDEN) + (t * (HIDDEN // K_BLOCK) + kb // K_BLOCK) * (2 * UP_TILE * K_BLOCK)
               + r * UP_K_PART)
    else:
        off = le * (2 * INTER * HIDDEN) + (t * UP_TILE + r % UP_TILE + (r // UP_TILE) * INTER) * HIDDEN + kb
    return off


@triton.jit
def _down_runs(v, ecta, first_expert, HIDDEN: tl.constexpr, INTER: tl.constexpr, EXPERT_MODE: tl.constexpr,
               UP_TILE: tl.constexpr, DOWN_TILE: tl.constexpr, DOWN_KSPLIT: tl.constexpr, PACKED_W2: tl.constexpr,
               W2_PACK_ROWS: tl.constexpr):
    """Stage-2 item ``v`` (counted from the first stage-2 item)'s bytes of w2: (offsets from w2
    [128 or DOWN_TILE] int64, each run's bytes, which runs are live). Packed (runner.packed_w2): one
    DOWN_TILE x UP_TILE run of each of the item's [W2_PACK_ROWS, UP_TILE] K blocks; as given: the
    K part of each of its DOWN_TILE rows."""
    DOWN_TILES: tl.constexpr = HIDDEN // DOWN_TILE
    DOWN_K_PART: tl.constexpr = INTER // DOWN_KSPLIT
    j = v // (DOWN_TILES * DOWN_KSPLIT)
    t = v % (DOWN_TILES * DOWN_KSPLIT) // DOWN_KSPLIT
    kq = (v % DOWN_KSPLIT) * DOWN_K_PART
    le = tl.load(ecta + j).to(tl.int64)
    if EXPERT_MODE == 1:
        le -= first_expert
    if PACKED_W2:
        PIECES: tl.constexpr = DOWN_K_PART // UP_TILE
        PACK_TILES: tl.constexpr = W2_PACK_ROWS // DOWN_TILE
        tl.static_assert(PIECES <= 128)
        q = tl.arange(0, 128)
        off = (le * (HIDDEN * INTER) + (t // PACK_TILES) * (W2_PACK_ROWS * INTER)
               + (kq + q * UP_TILE) * W2_PACK_ROWS + (t % PACK_TILES) * (DOWN_TILE * UP_TILE))
        return off, tl.full((128,), DOWN_TILE * UP_TILE, tl.int32), q < PIECES
    else:
        r = tl.arange(0, DOWN_TILE)
        return (le * (HIDDEN * INTER) + (t * DOWN_TILE + r) * INTER + kq, tl.full((DOWN_TILE,), DOWN_K_PART, tl.int32),
                r >= 0)


@triton.jit
def _prefetch_item(w, n1, wend, ecta, w13, w2, first_expert,
                   HIDDEN: tl.constexpr, INTER: tl.constexpr, EXPERT_MODE: tl.constexpr,
                   UP_TILE: tl.constexpr, UP_KSPLIT: tl.constexpr, PACKED_W13: tl.constexpr,
                   DOWN_TILE: tl.constexpr, DOWN_KSPLIT: tl.constexpr, PACKED_W2: tl.constexpr,
                   W2_PACK_ROWS: tl.constexpr, IS_HIP: tl.constexpr, INTERP: tl.constexpr):
    """Prefetch item ``w``'s weight bytes into L2 (kernel.py's numbering: stage-1 items below ``n1``,
    stage 2's up to ``wend``; past it nothing). The block scales (a few hundred bytes) are left to
    the loop."""
    if (not IS_HIP) and (not INTERP):
        if w < n1:
            off = _up_runs(w, ecta, first_expert, HIDDEN, INTER, EXPERT_MODE, UP_TILE, UP_KSPLIT, PACKED_W13)
            _l2_prefetch(w13 + off, tl.full((2 * UP_TILE,), HIDDEN // UP_KSPLIT, tl.int32), off >= 0)
        elif w < wend:
            off, nb, live = _down_runs(w - n1, ecta, first_expert, HIDDEN, INTER, EXPERT_MODE, UP_TILE, DOWN_TILE,
                                       DOWN_KSPLIT, PACKED_W2, W2_PACK_ROWS)
            _l2_prefetch(w2 + off, nb, live)
