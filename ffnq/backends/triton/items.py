"""The fused kernel's expert work items (device helpers): a CTA's next item (every BLOCKS-th, or
DQ's shared counter), a stage-2 item's header issued a round early (HP), the next item's first
weight rows asked of the L2 (PN, PN1), and FL's stage-2 item as the body of one pipelined loop."""
import triton
import triton.language as tl

from ffnq.backends.triton.sync import _as, _cta_sync, _stamp, _wait_count
from ffnq.backends.triton.tiles import _mma_sc


@triton.jit
def _claim(ctr, DQ: tl.constexpr):
    """(DQ) Take the next ticket of the work counter *ctr without a CTA barrier: one thread's
    atomic, as a [128] tensor (a scalar atomic is broadcast through shared memory behind a
    barrier, which would stall here). Issued at an item's start (a stage-2 item's once its
    tiles are in), read (_next_item) at its end: the latency hides behind the item's loads.
    Without DQ: nothing (a placeholder)."""
    r = 0
    if DQ:
        lane = tl.arange(0, 128)
        r = tl.atomic_add(ctr + lane * 0, tl.where(lane == 0, 1, 0), mask=lane == 0, sem="relaxed", scope="gpu")
    return r


@triton.jit
def _next_item(w, claimed, BLOCKS: tl.constexpr, DQ: tl.constexpr):
    """A CTA's next item: every BLOCKS-th, or (DQ) the ticket _claim took (lane 0's; the masked
    lanes hold 0), counted after each CTA's own first item; the items of both stages are
    numbered in one sequence, stage 2's after stage 1's."""
    if DQ:
        lane = tl.arange(0, 128)
        w = BLOCKS + tl.max(tl.where(lane == 0, claimed, 0), axis=0)
    else:
        w += BLOCKS
    return w


@triton.jit
def _s2_header(w, wend, n1, ecta, sync, wrow, yrm, SP: tl.constexpr, NHT: tl.constexpr, KH: tl.constexpr,
               SPS: tl.constexpr):
    """(HP) A stage-2 item's header, all issued together: its expert, its tiles' count as now (an
    acquire read, so the spin on it can start from a count already in), and the rows its partial
    writes (wrow: the route weights' row pointers of expert 0). Past the last item: zeros, no read."""
    j = (w - n1) // (NHT * KH)
    live = w < wend
    ej = tl.load(ecta + j, mask=live, other=0)
    v = tl.atomic_add(sync + j, 0, mask=live, sem="acquire", scope="gpu")
    ym = yrm & live
    if SPS == 2:
        ym &= tl.load(wrow + ej * SP, mask=ym, other=0.0) != 0.0
    return ej, v, ym


@triton.jit
def _pn_next(nxt, w, n1, wend, ecta, lane, first2, BLOCKS: tl.constexpr, DQ: tl.constexpr, PER1: tl.constexpr,
             PER2: tl.constexpr, FIRST2: tl.constexpr):
    """(PN, PN1) This CTA's next item and its expert, in warp 0's lanes (expert -1 elsewhere and
    past the last item; items 0..n1-1 are stage 1's, PER1 an expert, n1..wend-1 stage 2's, PER2),
    read inside a K loop with no CTA barrier (one would stop its pipelining): the ticket _claim
    took is in lane 0 of warp 0 (its [128] tensor: a lane a thread), and a warp shuffle hands it
    to the warp's other lanes. FIRST2 (FL with DQ): a ticket past stage 1's items is not this
    CTA's next item; its first stage-2 item, every BLOCKS-th, is (first2)."""
    if DQ:
        tk = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 0x1f, 0xffffffff;", "=r,r", [nxt],
                                       dtype=tl.int32, is_pure=False, pack=1)
        wn = BLOCKS + tk
        if FIRST2:
            wn = tl.where(wn < n1, wn, first2)
    else:
        wn = w + BLOCKS + lane * 0
    j = tl.where(wn < n1, wn // PER1, (wn - n1) // PER2)
    return wn, tl.load(ecta + j, mask=(lane < 32) & (wn < wend), other=-1)


@triton.jit
def _l2_prefetch(ptr, go, NB: tl.constexpr):
    """Ask the L2 for NB bytes at each ptr where go (a bulk prefetch: no registers or shared
    memory held, nothing waited for)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global "
                              "[$1], $3; mov.u32 $0, 0; }", "=r,l,r,r",
                              [ptr, go.to(tl.int32), tl.full(ptr.shape, NB, tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pn_w2(w2, wn, ej, lane, n1, first_expert, MODE: tl.constexpr, H: tl.constexpr, I_R: tl.constexpr,
           BH: tl.constexpr, NHT: tl.constexpr, KH: tl.constexpr, NB: tl.constexpr):
    """(PN) The first NB bytes of each w2 row of stage-2 item wn (expert ej, from _pn_next) asked
    of the L2, warp 0's 32 lanes BH/32 rows each."""
    t = (wn - n1) % (NHT * KH) // KH
    kq = (wn - n1) % KH * (I_R // KH)
    le = ej.to(tl.int64)
    if MODE == 1:
        le = (ej - first_expert).to(tl.int64)
    RPL: tl.constexpr = BH // 32 if BH >= 32 else 1  # rows a lane
    for r in tl.static_range(RPL):
        row = lane * RPL + r
        _l2_prefetch(w2 + le * (H * I_R) + (t * BH + row).to(tl.int64) * I_R + kq, (ej >= 0) & (row < BH), NB)


@triton.jit
def _pn_w13(w13, wn, ej, lane, first_expert, MODE: tl.constexpr, H: tl.constexpr, I_R: tl.constexpr,
            BN: tl.constexpr, NT: tl.constexpr, KS: tl.constexpr, KSTEP: tl.constexpr, NB: tl.constexpr):
    """(PN1) The first NB bytes of each w1 and w3 row of stage-1 item wn (expert ej, from
    _pn_next) at its K part asked of the L2, warp 0's 32 lanes 2 BN/32 rows each."""
    t = wn // KS % NT
    le = ej.to(tl.int64)
    if MODE == 1:
        le = (ej - first_expert).to(tl.int64)
    RPL: tl.constexpr = 2 * BN // 32 if BN >= 16 else 1  # rows a lane: BN of w1 (gate), then BN of w3
    for r in tl.static_range(RPL):
        q = lane * RPL + r
        row = t * BN + q % BN + (q // BN) * I_R
        _l2_prefetch(w13 + le * (2 * I_R * H) + row.to(tl.int64) * H + (wn % KS) * KSTEP, (ej >= 0) & (q < 2 * BN),
                     NB)


@triton.jit
def _s2_fl_item(w, w0, n1, ecta, sync, scratch, w2, s2, ypart, first_expert, fault, e, rank, timeout_ns, pid,
                sub_row, hh, kn, c8, tw8, yrow, yrm, MODE: tl.constexpr, S: tl.constexpr, H: tl.constexpr,
                I_R: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, NHT: tl.constexpr,
                KH: tl.constexpr, SP: tl.constexpr, A8: tl.constexpr, A8T: tl.constexpr, SQ2: tl.constexpr,
                NS2: tl.constexpr, SPS: tl.constexpr, PS: tl.constexpr, PSO: tl.constexpr, NSL: tl.constexpr,
                SC_WTAB: tl.constexpr, SC_ACT8: tl.constexpr, SC_ASC: tl.constexpr, SACC: tl.constexpr,
                TIMELINE: tl.constexpr, IS_HIP: tl.constexpr, INTERP: tl.constexpr, CHK: tl.constexpr,
                ASM: tl.constexpr):
    """(FL) One stage-2 item (fp8 act terms, A8) as the body of a loop over all of a CTA's items,
    which Triton flattens with their K loops into one software-pipelined loop: the next item's
    first loads are issued during this item's last steps (no fill and drain a seam). That needs
    the item's id from the loop index (no DQ ticket), no gpu.barrier in the body (ASM: its
    barriers as inline PTX), and the act's address through the wait's value (never taken), so
    the pipeliner issues an item's act loads after the wait for its tiles, not before. Its header,
    K loop and epilogue are the per-item loop's A8 path without HP's and PN's hooks, written
    apart so the default builds keep their code (one of the two goes once FL is measured)."""
    j = (w - n1) // (NHT * KH)
    t = (w - n1) % (NHT * KH) // KH
    kh = (w - n1) % KH
    kq = kh * (I_R // KH)
    ej = tl.load(ecta + j)
    le = ej.to(tl.int64)
    if MODE == 1:
        le = (ej - first_expert).to(tl.int64)
    wbase = w2 + le * (H * I_R) + (t * BH + hh)[:, None] * I_R
    sbase = s2 + le * ((H // 128) * (I_R // 128)) + ((t * BH) // 128) * (I_R // 128)
    ym = yrm
    if SPS == 2:
        ym &= tl.load(_as(scratch, SC_WTAB, tl.float32) + ej * SP + yrow, mask=ym, other=0.0) != 0.0
    v = _wait_count(sync + j, NT, fault, e, rank, timeout_ns, pid, IS_HIP, INTERP, CHK, ASM)
    a8 = (_as(scratch, SC_ACT8, tl.float8e4nv) + (v < 0).to(tl.int64) * 16
          + ((j * A8T + c8 // SQ2) * SP + c8 % SQ2)[None, :].to(tl.int64) * I_R + kn[:, None])
    asc = _as(scratch, SC_ASC, tl.float32) + j * NT
    if TIMELINE:
        if w == w0:
            _stamp(sub_row, 8, IS_HIP, INTERP, TIMELINE)
    A8K: tl.constexpr = BN if A8 == 1 else 128
    yt8 = tl.zeros((BH, A8T * SQ2), tl.float32)
    for k0 in tl.range(0, I_R // KH, A8K, num_stages=NS2):
        for q in tl.static_range(A8K // BN):
            kk = kq + k0 + q * BN
            av = tl.load(a8 + kk, cache_modifier=".cg")
            wq = tl.load(wbase + kk + kn[None, :])
            sc = tl.load(sbase + kk // 128) * tl.load(asc + kk // BN, cache_modifier=".cg")
            yt8 = _mma_sc(wq, sc, av, yt8, INTERP, IS_HIP, SACC)
    yv = tl.sum(tl.reshape(yt8 * tw8[None, :], (BH, A8T, SQ2)), axis=1)  # [BH, SQ2]
    tl.store(ypart + ((j * KH + kh) * S + yrow[None, :]).to(tl.int64) * H + t * BH + hh[:, None], yv,
             mask=ym[None, :])
    _cta_sync(ASM)
    if PS:
        tl.atomic_add(sync + PSO + j * NHT + t, 1, sem="release", scope="gpu")
    else:
        tl.atomic_add(sync + NSL + t, 1, sem="release", scope="gpu")
    if TIMELINE:
        if w == w0:
            _stamp(sub_row, 9, IS_HIP, INTERP, TIMELINE)
