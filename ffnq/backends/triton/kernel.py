"""The fused, persistent decode-FFN kernel of one TP rank (Triton 3.6; sm_90, gfx942, gfx950).

One launch of BLOCKS co-resident CTAs (cooperative launch; the runner picks BLOCKS per width) per
step does, for one width S:

  A  seam     CTA c loads its chunk's router columns (before the wait: latency behind the
              link), pushes its column chunk of ``part`` into every peer's seam slot [e&1][rank],
              publishes flags[SEAM][c][rank] = e on every peer, waits for every peer's flag of
              chunk c (bounded), sums the chunk in rank order + residual (fp32), writes res_out,
              the chunk's per-row sum of squares and its partial logits of every expert (sum
              over the chunk of h*post_norm*router, fp32 FMA); h stays in registers for phase B
              (staged launches: fp32 scratch).
     -- grid barrier 1 --
  B  norm     every CTA: rstd per row from the per-chunk sums (fixed order: bitwise the same on
              every rank and CTA); x = h*rstd*post_norm for its chunk, divided by max|post_norm|,
              as X8T fp8 terms (each the rounding residue of the last x 16: two, ~8 mantissa
              bits like a bf16 x's, four at 7-8 tokens and TP2's 1, 4, 6; fp16 hi + lo on CDNA);
     router   one row: logits of its EPC experts = rstd * the chunks' partials summed in
              chunk order; rows >= 2: RP CTAs per row (16) sum slices of that row's partials,
              the last to arrive sums the slices in order and picks the row's top-k.
              Clears the expert phases' counters.
     -- grid barrier 2 --
  C  top-k    one row: every CTA, redundantly, on a next_pow2(S)-row tile: sigmoid, biased
              top-k (lowest index wins a tie), renormalised weights; CTA 0 writes route/route_w.
              Every CTA: the active-expert list.
     experts  stage 1 work items (active expert j, BN-row tile of I_r, K part), "swap AB": the gate/up
              tiles of w13 (fp8 codes as stored) are the A operand (M = weight rows), the x
              terms^T the B operand (N = X8T terms x SQ tokens), an fp8 x fp8 wgmma with both
              operands in shared memory (CDNA: fp8 -> fp16 codes, [x_hi | x_lo]^T); each K
              block's fp32 product times its
              block scale is added to the accumulator over the item's K range (KS > 1: the
              last arriver of a tile sums the parts in order);
              act[j] = silu(g)*u*routing weight (fp16 scratch); done1[j] += 1.
              A CTA runs every BLOCKS-th item, or (DQ) after its first the next free
              ticket of one counter for both stages (stage 2's items numbered after stage 1's).
     -- no barrier: a stage-2 item waits for done1[j] == I_R/BN --
  D  stage 2  work items (active expert j, BH-row tile of H): ypart[j]^T = sum_k scale_k (w2 tile_k) @
              act[j]^T (swap AB, fp16 operands), fp32 scratch; done2[tile] += 1.
     -- no barrier: the sum of a chunk waits for done2 of its H tiles == n_active (PS, off: a count
        per slot and tile, and the sum takes the leading slots done so far) --
  E  sum      CTA c sums ypart over j in slot order for its column chunk (deterministic), the
              MoE partial of the chunk; (SPS, TP1's default from 3 rows) each row's own K slots
              only: the route mapped by phase C's expert -> slot table, and (SPS=2) stage 2
              writes only those rows of a slot's partial;
     reduce   push the chunk to every peer's moe slot, publish REDUCE flags, wait, sum in rank
              order -> out.
  F  handshake (FINAL, a constexpr: its own compiled variant): publish HANDSHAKE flags to every peer, wait for every peer's.
     end      the epoch e is stored (so a CUDA-graph replay uses e+1 next time): by CTA 0 after
              barrier 1 in the fused launch (every CTA has read it by then), by the last CTA out
              (exit count) in staged launches.

Before the PDL wait (EW, TP1's default) every CTA issues its loads of the weights phase A and the
top-k read (router, post_norm, router_bias): nothing writes them between launches, and their
latency then runs beside the previous launch's exit. The runner waits for the stream once
before the first launch on new weight tensors (a kernel that wrote them just before need not be
visible before the wait); weights written in place between launches break that contract.

At TP1 (SOLO, its default) the seam's and the reduce's exchanges and the handshake are skipped:
with no peer they are the identity (h = part + residual, out = the sum), so no flag is written.
At TP1 up to two tokens (FR, v23) every CTA also reads the whole rows in phase A, so rstd and
its own experts' logits need no other CTA's partials: x and the logits are written there, phase
B is empty and one grid barrier (not two) precedes the top-k, which every CTA makes.

Epoch words (peer buffer "epoch", int32[4]): [0] epoch of the last launch, [1] this launch's
arrivals at the grid barriers, [3] exit count (staged launches); [2] is FlyDSL's. Flags hold
e (or -e once this rank faulted in this launch); a wait matches == e exactly. Every cross-GPU
wait is bounded by timeout_ns from the start of that phase's wait; on expiry the first faulting
CTA writes the scratch fault record and fault_box[rank] on every peer, and every later wait of
the rank is skipped (the rank-wide marker is fault[epoch] == e). Grid barriers are always passed.

STAGE = 0 runs everything in one launch. STAGE > 0 runs one part per launch with no grid
barrier (the launch boundary is the barrier), in the order STAGES below: the interpreter
(TRITON_INTERPRET=1) runs CTAs one after another, so only that split can run there. Every
publish is in a stage before its wait (1 -> 6, 5 -> 7, 7 -> 8), so several ranks in one process
can run stage by stage, interleaved (a TP2 check on a CPU).
"""
import functools
import re
import tomllib

import triton
import triton.language as tl

from ffnq.backends.triton.tune import read as read_tune

# scratch fault record fields (spec.FAULT_FIELDS)
F_VALID = tl.constexpr(0)
F_EPOCH = tl.constexpr(1)
F_PHASE = tl.constexpr(2)
F_RANK = tl.constexpr(3)
F_MASK = tl.constexpr(4)
F_WAITED = tl.constexpr(5)
F_CTA = tl.constexpr(6)
F_AT = tl.constexpr(7)
PH_SEAM = tl.constexpr(0)
PH_REDUCE = tl.constexpr(1)
PH_HANDSHAKE = tl.constexpr(2)
CLOCK_LANES = tl.constexpr(1024)  # >= threads of a CTA (32 warps x 32, 16 waves x 64)


# ---------------------------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------------------------
@triton.jit
def _memrealtime():
    # s_memrealtime is an SMEM op: wait on lgkmcnt (tl.extra.hip.memrealtime waits on vmcnt)
    return tl.inline_asm_elementwise("s_memrealtime $0\n s_waitcnt lgkmcnt(0)", "=s", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def now_ns(IS_HIP: tl.constexpr, INTERP: tl.constexpr):
    if INTERP:
        t = tl.full((), 0, tl.int64)
    elif IS_HIP:
        t = _memrealtime() * 10  # gfx9: 100 MHz constant clock
    else:
        t = _globaltimer()
    return t


@triton.jit
def now_u(IS_HIP: tl.constexpr, INTERP: tl.constexpr):
    """now_ns made CTA-uniform (a max over the CTA): every thread of a wait loop must take the
    same branch, since the loop body holds barriers (a per-thread timer read lets threads leave
    a spin at different iterations -> mismatched bar.sync -> hang or garbage).
    The tensor must span every thread: a [32] tensor is replicated per warp and its max is a
    warp shuffle only (no cross-warp step, checked in the PTX), i.e. uniform per warp, not per CTA."""
    if INTERP:
        t = tl.full((), 0, tl.int64)
    else:
        t = tl.max(tl.zeros([CLOCK_LANES], tl.int64) + now_ns(IS_HIP, INTERP), axis=0)
    return t


@triton.jit
def _backoff(IS_HIP: tl.constexpr, INTERP: tl.constexpr):
    if not INTERP:
        if IS_HIP:
            tl.inline_asm_elementwise("s_sleep 1\n v_mov_b32 $0, 0", "=v", [], dtype=tl.int32, is_pure=False,
                                      pack=1)
        else:
            tl.inline_asm_elementwise("nanosleep.u32 32;\n mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)


@triton.jit
def _wscaled(w, scale, INTERP: tl.constexpr, IS_HIP: tl.constexpr):
    """fp8 weight codes times their block's dequant scale (pre-multiplied by 2^SCALE_SHIFT, undone
    on the accumulator, exact, so that small scales stay normal in fp16), as the fp16 A operand:
    the MMA then accumulates over the whole K loop (async wgmma, no wait per K block). fp8 ->
    fp16 is exact and packed (one cvt per 2 codes), the product one packed fp16 multiply; the
    price is its rounding (<= 2^-11 relative: bf16 here put single small elements over the
    tolerance in a 100k-step H200 soak). The SACC=0 path; the interpreter keeps fp32."""
    if INTERP:
        r = w.to(tl.float32) * scale
    elif IS_HIP:
        r = w.to(tl.float16) * scale.to(tl.float16)
    else:
        # (Triton emits a scalar mul.f16 per element plus unpacking movs: the packed form by hand)
        s16 = tl.full(w.shape, 0, tl.float16) + scale.to(tl.float16)
        r = tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [w.to(tl.float16), s16],
                                      dtype=tl.float16, is_pure=True, pack=2)
    return r


@triton.jit
def _topk(lg, bias, ecols, evalid, live, K: tl.constexpr, KP2: tl.constexpr, EP2: tl.constexpr, SORT: tl.constexpr):
    """Per row of logits lg [R, EP2]: sigmoid scores, the biased top-k and the renormalised
    routing weights; rows not ``live`` select nothing. One int64 key per score (the fp32 bits
    made order-preserving in the high word, the reversed index in the low word), so one max per
    round picks the highest biased score and, among equal ones, the lowest index.
    Returns (sel [R, EP2] int32 0/1, weights [R, EP2] fp32)."""
    scores = 1.0 / (1.0 + tl.exp(-lg))
    b = tl.where(evalid[None, :], scores + bias[None, :], float("-inf"))
    bits = b.to(tl.int32, bitcast=True)
    key = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | (EP2 - 1 - ecols)[None, :].to(tl.int64)
    if SORT:
        # one partial bitonic sort (keys are unique): the K-th largest key is the threshold
        top = tl.topk(key, KP2, dim=1)  # [R, KP2], descending
        kth = tl.min(tl.where(tl.arange(0, KP2)[None, :] < K, top, 9223372036854775807), axis=1)
        sel = (key >= kth[:, None]).to(tl.int32)
    else:
        sel = tl.zeros(lg.shape, tl.int32)
        for kk in tl.static_range(K):
            hit = key == tl.max(key, axis=1)[:, None]
            sel = tl.where(hit, 1, sel)
            key = tl.where(hit, -9223372036854775807, key)
    sel = tl.where(live[:, None], sel, 0)
    w = tl.where(sel > 0, scores, 0.0)
    ws = tl.sum(w, axis=1)
    return sel, w / tl.where(ws > 0, ws, 1.0)[:, None]


@triton.jit
def _store_route(scratch, rows, pad, sel, w, ecols, SC_ROUTE: tl.constexpr, SC_ROUTEW: tl.constexpr,
                 K: tl.constexpr, KP2: tl.constexpr):
    """route/route_w of ``rows`` in expert order; a padding row gets -1 / 0."""
    rte = _as(scratch, SC_ROUTE, tl.int32) + rows[:, None] * K
    rtw = _as(scratch, SC_ROUTEW, tl.float32) + rows[:, None] * K
    pos = tl.cumsum(sel, axis=1) - 1
    tl.store(rte + pos, ecols[None, :] + tl.zeros(sel.shape, tl.int32), mask=sel > 0)
    tl.store(rtw + pos, w, mask=sel > 0)
    kc = tl.arange(0, KP2)[None, :]
    pm = pad[:, None] & (kc < K)
    tl.store(rte + kc, tl.zeros(pm.shape, tl.int32) - 1, mask=pm)
    tl.store(rtw + kc, tl.zeros(pm.shape, tl.float32), mask=pm)


@triton.jit
def _mma_sc(w, scale, x, acc, INTERP: tl.constexpr, IS_HIP: tl.constexpr, SACC: tl.constexpr):
    """acc + (w * scale) @ x for one K block (one scale). SACC: the fp8 codes go to the MMA
    exactly, in x's type: fp8 x terms (F8) take them as stored, both operands from shared memory;
    fp16 x takes them as fp16 (which Triton loads straight into the MMA's register layout); the
    scale multiplies the block's fp32 product, at the price of a wait for each K block's MMA.
    Otherwise the scale is folded into the A operand (_wscaled) and the MMA runs async."""
    if SACC:
        if INTERP:
            r = acc + tl.dot(w.to(tl.float32), x.to(tl.float32)) * scale
        else:
            r = acc + tl.dot(w.to(x.dtype), x) * scale
    else:
        r = _mma(_wscaled(w, scale, INTERP, IS_HIP), x, acc, INTERP)
    return r


@triton.jit
def _fp8(v, INTERP: tl.constexpr):
    """fp32 -> fp8 e4m3, round to nearest, saturating. The interpreter (Triton 3.6) gets the
    rounding wrong where it carries into the exponent (126.9 -> 64, -124.4 -> -64): there the
    value is rounded to 3 mantissa bits by arithmetic first, so its conversion is exact."""
    if INTERP:
        # subnormals (and 0) share 2^-6's spacing
        e = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(v), 1e-30))), -6.0)
        step = tl.exp2(e - 3.0)
        v = tl.minimum(tl.maximum(tl.floor(v / step + 0.5) * step, -448.0), 448.0)
    return v.to(tl.float8e4nv)


@triton.jit
def _xsig(post_norm, H: tl.constexpr, HP2: tl.constexpr):
    """max |post_norm|: with it |x| / xsig <= sqrt(H) (|h_i| * rstd <= sqrt(H)), in fp8 range."""
    return _xsig_of(_post_norm_all(post_norm, H, HP2))


@triton.jit
def _post_norm_all(post_norm, H: tl.constexpr, HP2: tl.constexpr):
    hh = tl.arange(0, HP2)
    return tl.load(post_norm + hh, mask=hh < H, other=0.0)


@triton.jit
def _xsig_of(pn):
    """_xsig on post_norm already read (PRE reads it before the seam's push, reduces it after)."""
    return tl.maximum(tl.max(tl.abs(pn), axis=0), 1e-30)


@triton.jit
def _store_x(scratch, offs, m2, xc, xsig, S: tl.constexpr, H: tl.constexpr, SC_X: tl.constexpr, F8: tl.constexpr,
             INTERP: tl.constexpr, X8T: tl.constexpr):
    """Stage 1's x of one column chunk (the normed rows times post_norm) into scratch."""
    if F8:
        # x / xsig as X8T fp8 terms, each the rounding residue of the last times 16 (four: ~16
        # mantissa bits in all; two: ~8, a bf16 x's): stage 1 multiplies them with the fp8
        # weight codes as they are
        xr = xc / xsig
        for t in tl.static_range(X8T):
            xt = _fp8(xr, INTERP)
            tl.store(_as(scratch, SC_X, tl.float8e4nv) + t * S * H + offs, xt, mask=m2)
            xr = (xr - xt.to(tl.float32)) * 16.0
    else:
        # x as a pair of fp16 (hi + lo): fp16 MMAs with ~22 mantissa bits of activation
        xh = xc.to(tl.float16)
        xl = (xc - xh.to(tl.float32)).to(tl.float16)
        tl.store(_as(scratch, SC_X, tl.float16) + offs, xh, mask=m2)
        tl.store(_as(scratch, SC_X, tl.float16) + S * H + offs, xl, mask=m2)


@triton.jit
def _fr_rows(part, residual, rows_r, rmask_r, H: tl.constexpr, HP2: tl.constexpr):
    """FR: the whole rows of residual and part [RT, HP2]: loads only, issued together."""
    hh = tl.arange(0, HP2)
    fo = rows_r[:, None] * H + hh[None, :]
    fm = rmask_r[:, None] & (hh < H)[None, :]
    return tl.load(residual + fo, mask=fm, other=0.0), tl.load(part + fo, mask=fm, other=0.0)


@triton.jit
def _fr_weights(post_norm, router, ecol, emask, H: tl.constexpr, HP2: tl.constexpr):
    """FR: post_norm [HP2] and the router rows of this CTA's experts [EPCP2, HP2]."""
    hh = tl.arange(0, HP2)
    return (_post_norm_all(post_norm, H, HP2),
            tl.load(router + ecol[:, None].to(tl.int64) * H + hh[None, :], mask=emask[:, None] & (hh < H)[None, :],
                    other=0.0))


@triton.jit
def _clear_sync(scratch, pid, SC_SYNC: tl.constexpr, SEG: tl.constexpr, SEGP2: tl.constexpr, NSYNC: tl.constexpr):
    """The expert phases' counters, cleared before the grid barrier that precedes their every use
    (a stale or poisoned value from an aborted launch cannot leak in)."""
    sq = pid * SEG + tl.arange(0, SEGP2)
    tl.store(_as(scratch, SC_SYNC, tl.int32) + sq, tl.zeros((SEGP2,), tl.int32),
             mask=(tl.arange(0, SEGP2) < SEG) & (sq < NSYNC))


@triton.jit
def _mma(w, x, acc, INTERP: tl.constexpr):
    """acc + w [M,K] @ x [K,N] with the weights as the A operand ("swap AB": M = weight rows,
    N = the few tokens), fp32 accumulate."""
    if INTERP:
        r = acc + tl.dot(w, x.to(tl.float32))
    else:
        r = tl.dot(w, x, acc)
    return r


@triton.jit
def _poll(ptr, SEM: tl.constexpr):
    # a scalar RMW: one thread, broadcast to the CTA, re-read every iteration (tl.load spins get
    # deleted or hoisted, see notes/triton-kernel.md)
    return tl.atomic_add(ptr, 0, sem=SEM, scope="sys")


@triton.jit
def _stamp(tl_row, col, IS_HIP: tl.constexpr, INTERP: tl.constexpr, TIMELINE: tl.constexpr):
    if TIMELINE:
        tl.store(tl_row + col, now_ns(IS_HIP, INTERP))


@triton.jit
def _as(base, off, TY: tl.constexpr):
    """A typed pointer at byte offset ``off`` of an int8 pointer."""
    return (base + off).to(tl.pointer_type(TY), bitcast=True)


@triton.jit
def _peer_base(peers, r):
    return tl.load(peers + r).to(tl.pointer_type(tl.int8))


@triton.jit
def _rank_faulted(fault, e):
    return tl.atomic_add(fault + F_EPOCH, 0, sem="relaxed", scope="gpu") == e.to(tl.int64)


@triton.jit
def _record_fault(fault, peers, e, phase, rank, mask, waited, pid, at, P_FBOX: tl.constexpr, TP: tl.constexpr,
                  WRITE_BOX: tl.constexpr, ASM: tl.constexpr = False):
    """First fault of this launch on this rank: the scratch record, then (timeouts) this rank's
    note in every peer's fault_box, all before any -e flag is published (release orders them)."""
    e64 = e.to(tl.int64)
    old = tl.atomic_xchg(fault + F_EPOCH, e64, sem="acq_rel", scope="gpu")
    if old != e64:
        z = tl.zeros((), tl.int64)
        tl.store(fault + F_PHASE, z + phase)
        tl.store(fault + F_RANK, z + rank)
        tl.store(fault + F_MASK, z + mask)
        tl.store(fault + F_WAITED, z + waited)
        tl.store(fault + F_CTA, z + pid)
        tl.store(fault + F_AT, z + at)
        if WRITE_BOX:
            for dst in tl.static_range(TP):
                box = _as(_peer_base(peers, dst), P_FBOX + rank.to(tl.int64) * 32, tl.int64)
                tl.store(box + 0, e64)
                tl.store(box + 1, z + mask)
                tl.store(box + 2, z + phase)
                tl.store(box + 3, z + waited)
        _cta_sync(ASM)
        tl.atomic_xchg(fault + F_VALID, 1, sem="release", scope="sys")


@triton.jit
def _cta_sync(ASM: tl.constexpr):
    """A CTA barrier. ASM (FL's loop only): as inline PTX, which Triton's pipeliner does not see;
    a gpu.barrier in a loop body stops that loop's software pipelining (scripts/flat_loop_probe.py)."""
    if ASM:
        tl.inline_asm_elementwise("bar.sync 0;\n mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.debug_barrier()


@triton.jit
def _fence_sys(INTERP: tl.constexpr):
    if not INTERP:
        tl.inline_asm_elementwise("fence.acq_rel.sys;\n mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _publish(peers, pid, rank, val, PHASE: tl.constexpr, P_FLAGS: tl.constexpr, TP: tl.constexpr,
             FLAGB: tl.constexpr, INTERP: tl.constexpr, FENCE: tl.constexpr):
    # FENCE: every thread fences its own pushes (in parallel), then one relaxed flag per peer: one
    # round trip to the peers, not a release (a fence) per flag each waiting for the last flag
    if FENCE:
        _fence_sys(INTERP)
    tl.debug_barrier()  # every thread's pushes happen-before the (one-thread) flags
    for dst in tl.static_range(TP):
        f = _as(_peer_base(peers, dst), P_FLAGS + ((PHASE * FLAGB + pid) * TP + rank) * 4, tl.int32)
        tl.atomic_xchg(f, val, sem="relaxed" if FENCE else "release", scope="sys")


@triton.jit
def _read(ptr, m2, LL: tl.constexpr):
    """One look at a peer's arrival: its flag (an acquire poll) or (LL) its tagged words."""
    if LL:
        v = tl.load(ptr, mask=m2, other=0, volatile=True)
    else:
        v = _poll(ptr, "acquire")
    return v


@triton.jit
def _tag(v, m2, e, LL: tl.constexpr):
    """What a look saw: the flag itself; LL: e once every word carries e, -e if one carries -e
    (the peer faulted), else 0 (not yet)."""
    t = v
    if LL:
        fl = (v >> 32).to(tl.int32)
        late = tl.sum(tl.where(m2 & (fl != e), 1, 0))
        t = e + late * 0
        if late != 0:
            t = tl.where(tl.sum(tl.where(m2 & (fl == -e), 1, 0)) != 0, -e, 0)
    return t


@triton.jit
def _wait_peers(peers, fault, pid, rank, e, timeout_ns, tl_row, offs, m2, base, PHASE: tl.constexpr,
                P_FLAGS: tl.constexpr, P_FBOX: tl.constexpr, TP: tl.constexpr, FLAGB: tl.constexpr,
                SLOT: tl.constexpr, SEEN0: tl.constexpr, IS_HIP: tl.constexpr, INTERP: tl.constexpr,
                TIMELINE: tl.constexpr, CHK: tl.constexpr, LL: tl.constexpr):
    """Wait for every peer's arrival on this rank's buffer, bounded: flags[PHASE][pid][src] == e,
    or (LL) every tagged word of this CTA's chunk ``offs`` in src's slot (base + src x SLOT bytes)
    carrying e. An arrival already there costs one look; this CTA's own none (it wrote it, before
    the CTA barrier of its send); the clock and the fault marker are read only once a peer is late,
    then every CHK looks, so a rank that has faulted in this launch takes one look only. LL:
    returns the chunk's values summed over ranks in rank order (the same sum on every rank)."""
    mine = _peer_base(peers, rank)
    t0 = now_u(IS_HIP, INTERP)
    deadline = t0 + timeout_ns
    if INTERP:  # no clock there: one look, then it counts as expired (lets a CPU test fault a wait)
        deadline = t0 - 1
    missing = tl.zeros((), tl.int32)
    neg = tl.zeros((), tl.int32) - 1
    acc = tl.zeros(offs.shape, tl.float32)
    for src in tl.static_range(TP):
        if LL:
            p = _as(mine, base + src * SLOT, tl.int64) + offs
        else:
            p = _as(mine, P_FLAGS + ((PHASE * FLAGB + pid) * TP + src) * 4, tl.int32)
        if src != rank:
            v = _read(p, m2, LL)
            tag = _tag(v, m2, e, LL)
            done = (tag == e) | (tag == -e)
            n = 0
            while not done:
                if n % CHK == 0:  # first at once: a rank that has faulted takes one look only
                    t = now_u(IS_HIP, INTERP)
                    if (t > deadline) | _rank_faulted(fault, e):
                        deadline = t0 - 1
                if deadline < t0:
                    done = True
                else:
                    _backoff(IS_HIP, INTERP)
                    v = _read(p, m2, LL)
                    tag = _tag(v, m2, e, LL)
                    done = (tag == e) | (tag == -e)
                    n += 1
            if tag != e:
                if tag == -e:
                    if neg < 0:
                        neg = src
                else:
                    missing = missing | (1 << src)
        elif LL:
            v = _read(p, m2, LL)
        if LL:
            acc += (v & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
        _stamp(tl_row, SEEN0 + src, IS_HIP, INTERP, TIMELINE)
    tl.debug_barrier()
    if (missing != 0) | (neg >= 0):
        _wait_fault(fault, peers, mine, e, PHASE, rank, missing, neg, now_u(IS_HIP, INTERP) - t0, pid, P_FBOX, TP,
                    IS_HIP, INTERP)
    return acc


@triton.jit
def _push_ll(peers, base, offs, m2, v, val, TP: tl.constexpr, INTERP: tl.constexpr):
    """LL exchange: every bf16 of v [SP, C] to every rank's buffer (region offset ``base``, this
    rank's slot) as one 8-byte word (val << 32 | bits): a reader that sees val in a word has its
    value, so no fence and no flag. A faulted rank (val < 0) fences first: its fault_box notes
    (written before) must be visible before any -e word."""
    if val < 0:
        _fence_sys(INTERP)
    word = (val.to(tl.int64) << 32) | (v.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF)
    for dst in tl.static_range(TP):
        tl.store(_as(_peer_base(peers, dst), base, tl.int64) + offs, word, mask=m2)
    tl.debug_barrier()


@triton.jit
def _send(peers, pid, rank, par, v, val, offs, m2, P_BUF: tl.constexpr, P_LL: tl.constexpr, PHASE: tl.constexpr,
          P_FLAGS: tl.constexpr, TP: tl.constexpr, MT: tl.constexpr, H: tl.constexpr, FLAGB: tl.constexpr,
          INTERP: tl.constexpr, FENCE: tl.constexpr, LL: tl.constexpr):
    """One exchange's send: this CTA's chunk v [SP, C] (bf16) to this rank's slot on every rank,
    tagged val (e, or -e after a fault): as LL words, or as values and then one flag per peer."""
    if LL:
        _push_ll(peers, P_LL + ((par * TP + rank) * MT) * H * 8, offs, m2, v, val, TP, INTERP)
    else:
        for dst in tl.static_range(TP):
            tl.store(_as(_peer_base(peers, dst), P_BUF + ((par * TP + rank) * MT) * H * 2, tl.bfloat16) + offs, v,
                     mask=m2)
        _publish(peers, pid, rank, val, PHASE, P_FLAGS, TP, FLAGB, INTERP, FENCE)


@triton.jit
def _gather(peers, fault, pid, rank, e, timeout_ns, tl_row, par, offs, m2, P_BUF: tl.constexpr, P_LL: tl.constexpr,
            PHASE: tl.constexpr, P_FLAGS: tl.constexpr, P_FBOX: tl.constexpr, TP: tl.constexpr, MT: tl.constexpr,
            H: tl.constexpr, FLAGB: tl.constexpr, SEEN0: tl.constexpr, IS_HIP: tl.constexpr, INTERP: tl.constexpr,
            TIMELINE: tl.constexpr, CHK: tl.constexpr, LL: tl.constexpr):
    """The matching receive, after a bounded wait: the fp32 sum of every rank's chunk in rank
    order (every rank sums the same values the same way)."""
    acc = _wait_peers(peers, fault, pid, rank, e, timeout_ns, tl_row, offs, m2, P_LL + (par * TP * MT) * H * 8, PHASE,
                      P_FLAGS, P_FBOX, TP, FLAGB, MT * H * 8, SEEN0, IS_HIP, INTERP, TIMELINE, CHK, LL)
    if not LL:
        mine = _peer_base(peers, rank)
        for src in tl.static_range(TP):
            buf = _as(mine, P_BUF + ((par * TP + src) * MT) * H * 2, tl.bfloat16)
            acc += tl.load(buf + offs, mask=m2, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _wait_fault(fault, peers, mine, e, PHASE: tl.constexpr, rank, missing, neg, waited, pid, P_FBOX: tl.constexpr,
                TP: tl.constexpr, IS_HIP: tl.constexpr, INTERP: tl.constexpr):
    """The fault record of a wait that missed ranks (``missing``) or saw -e from ``neg``."""
    if missing != 0:
        _record_fault(fault, peers, e, PHASE, rank, missing, waited, pid, now_ns(IS_HIP, INTERP), P_FBOX, TP,
                      True)
    else:
        # src gave up on somebody: its note in our fault_box says whom
        box = _as(mine, P_FBOX + neg.to(tl.int64) * 32, tl.int64)
        be = tl.atomic_add(box, 0, sem="acquire", scope="sys")
        bm = tl.load(box + 1)
        mask = tl.where(be == e.to(tl.int64), bm, (1 << neg).to(tl.int64))
        _record_fault(fault, peers, e, PHASE, rank, mask, waited, pid, now_ns(IS_HIP, INTERP), P_FBOX, TP,
                      False)


@triton.jit
def _grid_barrier(words, fault, e, rank, timeout_ns, pid, PHASE: tl.constexpr, BLOCKS: tl.constexpr,
                  IS_HIP: tl.constexpr, INTERP: tl.constexpr, STAGE: tl.constexpr, CHK: tl.constexpr,
                  LAST: tl.constexpr):
    """Barrier over the co-resident grid, always passed, even after a fault (bounded as a last
    resort). words[1] counts this launch's arrivals from 0: the first barrier is passed at BLOCKS,
    the LAST (LAST = n: the launch's n-th and last barrier; 0: not the last) at n x BLOCKS, whose
    last arrival sets the count back to 0 (a release; the next
    launch reads it only after this one ends: the kernel boundary or gdc_wait). A CTA still
    polling then sees the full count or the 0, both past its own arrival (a uint32 difference).
    One arrival atomic per CTA and polls of one word, and launches of any grids in any order on
    one buffer (a width may have its own grid). v20: no cost against v18's counting barrier
    (an int64 count of every launch's arrivals, which needed every grid on the buffer to divide
    the others'): TP1, side by side, 57.6 / 87.0 / 145.5 / 204.2 against 57.5 / 87.1 / 145.0 /
    204.3 us at 1 / 2 / 4 / 8 tokens (dev round 43), 139.4 / 221.3 / 257.7 / 318.9 against 139.0 /
    220.1 / 259.8 / 320.3 at 4 / 9 / 12 / 16 (dev round 44)."""
    if STAGE == 0:
        tl.debug_barrier()
        cnt = (words + 1).to(tl.pointer_type(tl.uint32), bitcast=True)
        old = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        full = LAST * BLOCKS if LAST else BLOCKS
        if LAST:
            if old == LAST * BLOCKS - 1:
                tl.atomic_xchg(cnt, 0, sem="release", scope="gpu")
        _spin_count(cnt, old + 1, old + 1, full - 1 - old, fault, e, rank, timeout_ns, pid, PHASE, IS_HIP,
                    INTERP, CHK)
        tl.debug_barrier()


@triton.jit
def _wait_count(ptr, target, fault, e, rank, timeout_ns, pid, IS_HIP: tl.constexpr, INTERP: tl.constexpr,
                CHK: tl.constexpr, ASM: tl.constexpr = False):
    """Wait until the GPU-local counter *ptr reaches target; its last value read."""
    v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    v = _spin_count(ptr, v, 0, target, fault, e, rank, timeout_ns, pid, PH_REDUCE, IS_HIP, INTERP, CHK, ASM)
    _cta_sync(ASM)
    return v


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
def _count_deadline(timeout_ns, IS_HIP: tl.constexpr, INTERP: tl.constexpr):
    """(now, the bound) of a wait for a count of this launch's own work: 4x timeout, a last resort.
    None in the interpreter: no clock there, and the staged launches finish every count first."""
    t0 = now_u(IS_HIP, INTERP)
    deadline = t0 + 4 * timeout_ns
    if INTERP:
        deadline = t0 - 1
    return t0, deadline


@triton.jit
def _spin_count(ptr, v, base, need, fault, e, rank, timeout_ns, pid, PHASE: tl.constexpr, IS_HIP: tl.constexpr,
                INTERP: tl.constexpr, CHK: tl.constexpr, ASM: tl.constexpr = False):
    """Spin until the GPU-local counter *ptr has grown by ``need`` from ``base`` (v: its last value
    read, returned updated). The count is work of other CTAs of this launch and always arrives, so
    the bound, 4x timeout, is a last resort that records a fault; the clock is read every CHK polls."""
    if v - base < need:
        t0, deadline = _count_deadline(timeout_ns, IS_HIP, INTERP)
        t = t0
        n = 0
        while (v - base < need) & (t <= deadline):
            _backoff(IS_HIP, INTERP)
            v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
            n += 1
            if n % CHK == 0:
                t = now_u(IS_HIP, INTERP)
        if v - base < need:
            _record_fault(fault, fault, e, PHASE, rank, 0, t - t0, pid, t, 0, 1, False, ASM)
    return v


@triton.jit
def _ld_acquire(ptr):
    """An acquire load at GPU scope per element (NVIDIA): each thread loads its own lanes."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _done_prefix(cnt, sl, m, t_lo, t_hi, KH: tl.constexpr, NHT: tl.constexpr, NSLP2: tl.constexpr,
                 PS: tl.constexpr, IS_HIP: tl.constexpr, INTERP: tl.constexpr):
    # one acquire read per slot and tile, all in flight together
    if (PS == 2) & (not IS_HIP) & (not INTERP):
        # PS=2: acquire loads (the chunks of a tile poll the same counters, which atomics would
        # serialize). Unlike an atomic's, a load's result is not broadcast through shared
        # memory: the vector has a lane per thread (NSLP2 >= 128, geometry), so the min below
        # crosses the warps through shared memory behind a barrier, and every warp gets the
        # same prefix (dev round 80: with 16-32 lanes each warp reduced its own copy, the warps
        # disagreed, and the sum read partials not yet written)
        q = cnt + tl.where(m, sl, 0) * NHT  # masked lanes read slot 0; their value is not used
        a = _ld_acquire(q + t_lo)
        b = a
        if t_hi != t_lo:
            b = _ld_acquire(q + t_hi)
    else:
        a = tl.atomic_add(cnt + sl * NHT + t_lo, 0, mask=m, sem="acquire", scope="gpu")
        b = tl.atomic_add(cnt + sl * NHT + t_hi, 0, mask=m, sem="acquire", scope="gpu")
    return tl.min(tl.where(((a >= KH) & (b >= KH)) | ~m, NSLP2, sl), axis=0)


@triton.jit
def _wait_prefix(cnt, t_lo, t_hi, n_sl, need, KH: tl.constexpr, NHT: tl.constexpr, NSLP2: tl.constexpr,
                 PS: tl.constexpr, fault, e, rank, timeout_ns, pid, IS_HIP: tl.constexpr, INTERP: tl.constexpr, CHK: tl.constexpr):
    """(PS) How many leading slots have all KH parts of H tiles t_lo and t_hi done (cnt: [slot][NHT]
    counters), polled until at least ``need``; bounded as _spin_count (a fault recorded, then
    ``need`` returned, as a count that timed out is passed)."""
    sl = tl.arange(0, NSLP2)
    m = sl < n_sl
    p = tl.minimum(_done_prefix(cnt, sl, m, t_lo, t_hi, KH, NHT, NSLP2, PS, IS_HIP, INTERP), n_sl)
    if p < need:
        t0, deadline = _count_deadline(timeout_ns, IS_HIP, INTERP)
        t = t0
        n = 0
        while (p < need) & (t <= deadline):
            _backoff(IS_HIP, INTERP)
            p = tl.minimum(_done_prefix(cnt, sl, m, t_lo, t_hi, KH, NHT, NSLP2, PS, IS_HIP, INTERP), n_sl)
            n += 1
            if n % CHK == 0:
                t = now_u(IS_HIP, INTERP)
        if p < need:
            _record_fault(fault, fault, e, PH_REDUCE, rank, 0, t - t0, pid, t, 0, 1, False)
            p = need
    tl.debug_barrier()
    return p


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


# ---------------------------------------------------------------------------------------------
# the kernel
# ---------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["rank", "first_expert"])
def ffn_kernel(
    part, residual, slots, out, res_out,  # [S,H] bf16, [S,H] bf16, [>=S] i64, [S,H] bf16, [S,H] bf16
    post_norm, router, router_bias,  # [H] f32, [E,H] f32, [E] f32
    w13, s13, w2, s2,  # [NLOC,2*I_R,H] fp8, [NLOC,2*I_R/128,H/128] f32, [NLOC,H,I_R] fp8, [NLOC,H/128,I_R/128]
    scratch, peers, epoch, inject,  # *i8 this width's scratch, *i64 [TP] peer buffers, *i32 words, *i32 [2]
    cfg, rank, first_expert,  # *i64 [timeout_ns] (an arg named "params" breaks the JIT binder), i32, i32
    S: tl.constexpr, H: tl.constexpr, E: tl.constexpr, EP2: tl.constexpr, K: tl.constexpr,
    KP2: tl.constexpr, I_R: tl.constexpr, MODE: tl.constexpr, NLOC: tl.constexpr, TP: tl.constexpr,
    MT: tl.constexpr, BLOCKS: tl.constexpr, NCH: tl.constexpr, NCHP2: tl.constexpr, CH: tl.constexpr,
    CHP2: tl.constexpr, EPC: tl.constexpr, EPCP2: tl.constexpr, RT: tl.constexpr, BN: tl.constexpr,
    EPS: tl.constexpr,
    P_FLAGS: tl.constexpr, P_FBOX: tl.constexpr, P_SEAM: tl.constexpr, P_MOE: tl.constexpr,
    SC_FAULT: tl.constexpr, SC_TL: tl.constexpr, SC_ROUTE: tl.constexpr, SC_ROUTEW: tl.constexpr,
    SC_H: tl.constexpr, SC_X: tl.constexpr, SC_SSQ: tl.constexpr, SC_LOGIT: tl.constexpr,
    SC_META: tl.constexpr, SC_ACT: tl.constexpr, SC_YPART: tl.constexpr,
    SC_WTAB: tl.constexpr, SC_PLOG: tl.constexpr, SC_ECTA: tl.constexpr, SC_SUB: tl.constexpr,
    SC_SYNC: tl.constexpr, SC_GPART: tl.constexpr, SC_SEL: tl.constexpr, SQ: tl.constexpr, KS: tl.constexpr, ROWTOP: tl.constexpr,
    NSL: tl.constexpr, NSYNC: tl.constexpr, SEG: tl.constexpr, SEGP2: tl.constexpr,
    SHIFT: tl.constexpr, SACC: tl.constexpr, F8: tl.constexpr, HP2: tl.constexpr, SC_ROWCNT: tl.constexpr, SC_RPART: tl.constexpr, RP: tl.constexpr, CPPP2: tl.constexpr, BH: tl.constexpr, JB: tl.constexpr, NS: tl.constexpr, NS2: tl.constexpr, NCOL: tl.constexpr,
    TIMELINE: tl.constexpr, IS_HIP: tl.constexpr, INTERP: tl.constexpr, STAGE: tl.constexpr,
    FINAL: tl.constexpr, SORT: tl.constexpr, CHK: tl.constexpr, PDL: tl.constexpr,
    FENCE: tl.constexpr, LL: tl.constexpr, P_SEAM_LL: tl.constexpr, P_MOE_LL: tl.constexpr, PRE: tl.constexpr,
    PLR: tl.constexpr, SOLO: tl.constexpr, FR: tl.constexpr, KH: tl.constexpr, A8: tl.constexpr, SQ2: tl.constexpr,
    A8T: tl.constexpr, FLAGB: tl.constexpr, DQ: tl.constexpr, HP: tl.constexpr, QOFF: tl.constexpr,
    SC_ACT8: tl.constexpr, SC_ASC: tl.constexpr, FW: tl.constexpr, X8T: tl.constexpr,
    PS: tl.constexpr, PSO: tl.constexpr, NSLP2: tl.constexpr, EW: tl.constexpr, SPS: tl.constexpr,
    SC_INV: tl.constexpr, PN: tl.constexpr, PN1: tl.constexpr, FL: tl.constexpr,
):
    SP: tl.constexpr = 16  # row tile (tl.dot needs M >= 16); rows >= S are masked / zero
    BK: tl.constexpr = 128  # K tile of the expert GEMMs: one scale block
    # timeline columns (spec.stamp_names)
    C_START: tl.constexpr = 0
    C_SEAM_ARRIVE: tl.constexpr = 1
    C_SEAM_SEEN: tl.constexpr = 2
    C_SEAM_DONE: tl.constexpr = 2 + TP
    C_ROUTER_DONE: tl.constexpr = 3 + TP
    C_EXPERTS_DONE: tl.constexpr = 4 + TP
    C_RED_ARRIVE: tl.constexpr = 5 + TP
    C_RED_SEEN: tl.constexpr = 6 + TP
    C_RED_DONE: tl.constexpr = 6 + 2 * TP
    C_HS_ARRIVE: tl.constexpr = 7 + 2 * TP
    C_HS_SEEN: tl.constexpr = 8 + 2 * TP
    C_HS_DONE: tl.constexpr = 8 + 3 * TP
    C_END: tl.constexpr = 9 + 3 * TP

    # (EW) the weights phase A and the top-k read (router, post_norm, router_bias), issued before
    # the wait below: no kernel writes them between launches, so their HBM latency (cold after
    # the last launch's expert streams) runs beside the previous launch's exit
    EWL: tl.constexpr = EW & PRE & (STAGE == 0)
    if EWL:
        pid = tl.program_id(0)
        rows = tl.arange(0, SP)
        rmask = rows < S
        ccols = pid * CH + tl.arange(0, CHP2)  # this CTA's column chunk (seam, stage 2, reduce)
        cmask = (tl.arange(0, CHP2) < CH) & (ccols < H) & (pid < NCH)
        m2 = rmask[:, None] & cmask[None, :]
        rows_r = tl.arange(0, RT)  # router/top-k row tile: next_pow2(S), not 16
        rmask_r = rows_r < S
        ecols = tl.arange(0, EP2)
        evalid = ecols < E
        ecol = pid * EPC + tl.arange(0, EPCP2)  # this CTA's experts, whose logits it makes (rows <= 4, FR)
        emask = (tl.arange(0, EPCP2) < EPC) & (ecol < E)
        if FR == 0:
            rt_c = tl.load(router + ecols[None, :].to(tl.int64) * H + ccols[:, None],
                           mask=cmask[:, None] & evalid[None, :], other=0.0)
        pn_c = tl.load(post_norm + ccols, mask=cmask, other=0.0)
        if F8:
            pn_all = _post_norm_all(post_norm, H, HP2)
        if FR:
            fr_pn, fr_rw = _fr_weights(post_norm, router, ecol, emask, H, HP2)
        bias_e = tl.load(router_bias + ecols, mask=evalid, other=0.0)
    if PDL:
        # launched early beside the previous kernel (programmatic dependent launch): wait for it
        # to finish and flush before reading anything it may write, then let the next launch get ready
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not EWL:
        pid = tl.program_id(0)
    timeout_ns = tl.load(cfg)
    fault = _as(scratch, SC_FAULT, tl.int64)
    tl_row = _as(scratch, SC_TL, tl.int64) + pid * NCOL
    sub_row = _as(scratch, SC_SUB, tl.int64) + pid * 16  # finer stamps inside the router and expert phases
    words = epoch
    # a plain L2 read (the last launch's write to it is ordered by the kernel boundary or gdc_wait):
    # unlike an atomic it does not stall here, so it overlaps the phase-A loads below
    e = tl.load(words, cache_modifier=".cg") + 1
    if FW:
        # (FW) the fault and inject words read beside the epoch, before phase A's big loads:
        # read after them, each was waited for before the next was issued (ncu, round 68)
        fe = tl.load(fault + F_EPOCH, cache_modifier=".cg")
        if not INTERP:
            who = tl.load(inject)
    e = tl.where(e <= 0, 1, e)  # 1..2^31-1: 0 is the cleared value, -e marks a fault
    par = (e & 1).to(tl.int64)
    # (EW computes them above, for its loads.) Written out twice, not as a helper: so the builds
    # without EW keep v31's SASS and those with it the SASS dev rounds 82-83 timed (a helper, or
    # one copy placed above the wait, moved both: sm_90 SASS compared offline)
    if not EWL:
        rows = tl.arange(0, SP)
        rmask = rows < S
        ccols = pid * CH + tl.arange(0, CHP2)  # this CTA's column chunk (seam, stage 2, reduce)
        cmask = (tl.arange(0, CHP2) < CH) & (ccols < H) & (pid < NCH)
        m2 = rmask[:, None] & cmask[None, :]
        rows_r = tl.arange(0, RT)  # router/top-k row tile: next_pow2(S), not 16
        rmask_r = rows_r < S
        ecols = tl.arange(0, EP2)
        evalid = ecols < E
        ecol = pid * EPC + tl.arange(0, EPCP2)  # this CTA's experts, whose logits it makes (rows <= 4, FR)
        emask = (tl.arange(0, EPCP2) < EPC) & (ecol < E)

    if F8 & ((STAGE == 2) | (STAGE == 3) | ((STAGE == 6) & (FR != 0))):  # staged launches: x's range here
        xsig = _xsig(post_norm, H, HP2)
    if not F8:
        xsig = 1.0  # (unused: the fp16 pair takes x as it is; _store_x's argument must exist)

    # ------------------------------------------------------------------------------ A: seam
    if (STAGE == 0) | (STAGE == 1):
        _stamp(tl_row, C_START, IS_HIP, INTERP, TIMELINE)
        # the reads of this phase issued together (one wait, not one round trip each)
        offs = rows[:, None] * H + ccols[None, :]
        p = tl.load(part + offs, mask=m2, other=0.0)
        if PRE & (STAGE == 0):
            # the seam's other reads issued here, beside the push (PRE; only loads: a reduction
            # here would hold the push until its bytes came): at TP1 they took ~3 us after it
            # (the same loads as the seam's below, written out: as a helper they moved the default
            # build's sm_90 schedule at 16 tokens)
            if not EWL:
                if FR == 0:  # (FR reads whole router rows instead)
                    rt_c = tl.load(router + ecols[None, :].to(tl.int64) * H + ccols[:, None],
                                   mask=cmask[:, None] & evalid[None, :], other=0.0)
                pn_c = tl.load(post_norm + ccols, mask=cmask, other=0.0)
            h = tl.load(residual + offs, mask=m2, other=0.0).to(tl.float32)
            if F8 & (not EWL):
                pn_all = _post_norm_all(post_norm, H, HP2)
            if FR:  # the whole rows and this CTA's router rows, before any store (a store would hold them)
                fr_res, fr_part = _fr_rows(part, residual, rows_r, rmask_r, H, HP2)
                if not EWL:
                    fr_pn, fr_rw = _fr_weights(post_norm, router, ecol, emask, H, HP2)
        if not FW:
            fe = tl.load(fault + F_EPOCH, cache_modifier=".cg")
        faulted = fe == e.to(tl.int64)
        if pid == 0:
            if not faulted:
                tl.store(fault + F_VALID, 0)
            if ROWTOP:  # phase B's per-row arrival counters (used after barrier 1)
                tl.store(_as(scratch, SC_ROWCNT, tl.int32) + tl.arange(0, 16), tl.zeros((16,), tl.int32))
        if not INTERP:
            if not FW:
                who = tl.load(inject)
            if who == rank + 1:
                delay = tl.load(inject + 1).to(tl.int64)
                t0 = now_u(IS_HIP, INTERP)
                t = t0
                while t - t0 < delay:
                    _backoff(IS_HIP, INTERP)
                    t = now_u(IS_HIP, INTERP)
                faulted = _rank_faulted(fault, e)  # other CTAs may have given up meanwhile
        if not SOLO:  # (SOLO: TP1 has no peer, its all-reduces are the identity)
            _send(peers, pid, rank, par, p, tl.where(faulted, -e, e), offs, m2, P_SEAM, P_SEAM_LL, PH_SEAM, P_FLAGS,
                  TP, MT, H, FLAGB, INTERP, FENCE, LL)
        _stamp(tl_row, C_SEAM_ARRIVE, IS_HIP, INTERP, TIMELINE)
    if (STAGE == 0) | (STAGE == 6):
        # this chunk's columns of the router [E, CH], loaded before the wait: its HBM latency
        # hides behind the link; the logits are split over K (chunks) so no CTA needs all of x
        offs = rows[:, None] * H + ccols[None, :]
        if PRE & (STAGE == 0):
            if F8:
                xsig = _xsig_of(pn_all)
        else:
            if FR == 0:
                rt_c = tl.load(router + ecols[None, :].to(tl.int64) * H + ccols[:, None],
                               mask=cmask[:, None] & evalid[None, :], other=0.0)
            pn_c = tl.load(post_norm + ccols, mask=cmask, other=0.0)
            if F8 & (STAGE == 0):  # x's range for its fp8 terms (phase B, stage 1), read before the link's wait too
                xsig = _xsig(post_norm, H, HP2)
            h = tl.load(residual + offs, mask=m2, other=0.0).to(tl.float32)  # so is the residual
        if SOLO:
            if STAGE == 6:
                p = tl.load(part + offs, mask=m2, other=0.0)
            h += p.to(tl.float32)  # the sum of one rank's bf16 values, as the exchange gives it
            _stamp(tl_row, C_SEAM_SEEN, IS_HIP, INTERP, TIMELINE)
        else:
            h += _gather(peers, fault, pid, rank, e, timeout_ns, tl_row, par, offs, m2, P_SEAM, P_SEAM_LL, PH_SEAM,
                         P_FLAGS, P_FBOX, TP, MT, H, FLAGB, C_SEAM_SEEN, IS_HIP, INTERP, TIMELINE, CHK, LL)
        tl.store(res_out + offs, h.to(tl.bfloat16), mask=m2)
        if FR:
            # (FR, TP1 at few rows) every CTA reads the whole rows, so rstd and its own experts'
            # logits need no other CTA's partials, and phase B's work is done here: one grid
            # barrier before the top-k, not two and a pass over every chunk's partial logits
            if not (PRE & (STAGE == 0)):
                fr_res, fr_part = _fr_rows(part, residual, rows_r, rmask_r, H, HP2)
                fr_pn, fr_rw = _fr_weights(post_norm, router, ecol, emask, H, HP2)
            hf = fr_res.to(tl.float32) + fr_part.to(tl.float32)  # [RT, HP2], as the chunk's h
            rstd_r = 1.0 / tl.sqrt_rn(tl.sum(hf * hf, axis=1) / H + EPS)  # [RT], the same in every CTA
            dot = tl.sum((hf * fr_pn[None, :])[:, None, :] * fr_rw[None, :, :], axis=2)  # [RT, EPCP2]
            if pid * EPC < E:
                tl.store(_as(scratch, SC_LOGIT, tl.float32) + rows_r[:, None] * E + ecol[None, :],
                         dot * rstd_r[:, None], mask=rmask_r[:, None] & emask[None, :])
            if pid < NCH:
                rstd = tl.sum(tl.where(rows[:, None] == rows_r[None, :], rstd_r[None, :], 0.0), axis=1)  # [SP]
                _store_x(scratch, offs, m2, h * rstd[:, None] * pn_c[None, :], xsig, S, H, SC_X, F8, INTERP, X8T)
            _clear_sync(scratch, pid, SC_SYNC, SEG, SEGP2, NSYNC)
    if ((STAGE == 0) | (STAGE == 6)) & (FR == 0):
        if STAGE == 6:  # for the staged launch of phase B (the fused launch keeps h in registers)
            tl.store(_as(scratch, SC_H, tl.float32) + offs, h, mask=m2)
        if pid < NCH:
            tl.store(_as(scratch, SC_SSQ, tl.float32) + pid * SP + rows, tl.sum(h * h, axis=1))
            # partial logits of every expert over this chunk: sum_k h*post_norm*router (exact fp32
            # FMA); rstd factors out and is applied once the chunks' sums of squares are all in
            if RT <= PLR:
                # (PLR) only the RT live rows, as FMAs summed over the chunk: the dot's 16-row tile
                # is 513 FFMA per thread at any width. In passes of at most 8 rows (pass q: group q of
                # a [16/PR, PR] split): 16 rows in one pass, a [16, CH] x [CH, E] shape, Triton 3.6
                # folds into tt.dot at its default tf32 precision, which flipped routes on the H200
                # at 11 and 16 tokens (dev round 92); 8 rows are under tt.dot's least M
                PR: tl.constexpr = RT if RT < 8 else 8
                g3 = tl.reshape(h * pn_c[None, :], (SP // PR, PR, CHP2))
                for q in tl.static_range(RT // PR):
                    hr = tl.sum(tl.where((tl.arange(0, SP // PR) == q)[:, None, None], g3, 0.0), axis=0)
                    pl = tl.sum(hr[:, :, None] * rt_c[None, :, :], axis=1)  # [PR, EP2]
                    prow = q * PR + tl.arange(0, PR)
                    tl.store(_as(scratch, SC_PLOG, tl.float32) + (pid * S + prow[:, None]) * EP2 + ecols[None, :],
                             pl, mask=(prow < S)[:, None] & evalid[None, :])
            else:
                pl = tl.dot(h * pn_c[None, :], rt_c, input_precision="ieee")
                tl.store(_as(scratch, SC_PLOG, tl.float32) + (pid * S + rows[:, None]) * EP2 + ecols[None, :], pl,
                         mask=rmask[:, None] & evalid[None, :])
    if (STAGE == 0) | (STAGE == 6):
        _stamp(tl_row, C_SEAM_DONE, IS_HIP, INTERP, TIMELINE)
    _grid_barrier(words, fault, e, rank, timeout_ns, pid, PH_SEAM, BLOCKS, IS_HIP, INTERP, STAGE, CHK, FR)
    if (STAGE == 0) & (pid == 0):
        # every CTA read the epoch before barrier 1, so it moves on here (also after a fault);
        # the next launch reads it after the kernel boundary (or gdc_wait): no exit counter
        tl.store(words, e)

    # ------------------------------------------------------------------------------ B: norm + router logits
    if ((STAGE == 0) | (STAGE == 2)) & (FR != 0):  # phase B was done in phase A
        _stamp(sub_row, 0, IS_HIP, INTERP, TIMELINE)
        _stamp(sub_row, 1, IS_HIP, INTERP, TIMELINE)
    elif (STAGE == 0) | (STAGE == 2):
        _stamp(sub_row, 0, IS_HIP, INTERP, TIMELINE)
        chs = tl.arange(0, NCHP2)
        # every load of this phase issued here, before the first use of any: a warp issues in
        # order, so a load placed after a use of an earlier load's data (a reduction, a store of
        # a result) waits for that data (v29)
        ssq = tl.load(_as(scratch, SC_SSQ, tl.float32) + chs[:, None] * SP + rows[None, :],
                      mask=(chs < NCH)[:, None], other=0.0)
        if ROWTOP:
            CPP: tl.constexpr = (NCH + RP - 1) // RP
            rr = pid // RP
            rp = _as(scratch, SC_RPART, tl.float32) + rr * (RP * EP2)
            cq = (pid % RP) * CPP + tl.arange(0, CPPP2)
            vpl = tl.load(_as(scratch, SC_PLOG, tl.float32) + (cq[:, None] * S + rr) * EP2 + ecols[None, :],
                          mask=((tl.arange(0, CPPP2) < CPP) & (cq < NCH) & (rr < S))[:, None] & evalid[None, :],
                          other=0.0)
            if not EWL:
                bias_e = tl.load(router_bias + ecols, mask=evalid, other=0.0)  # for the row's last arriver
            pad1 = tl.load(slots + rr + tl.arange(0, 1), mask=rr < S, other=0) < 0
        else:  # (the logits pass; emask is empty on a CTA past the experts)
            ssq_r = tl.load(_as(scratch, SC_SSQ, tl.float32) + chs[:, None] * SP + rows_r[None, :],
                            mask=(chs < NCH)[:, None], other=0.0)
            pls = tl.load(_as(scratch, SC_PLOG, tl.float32)
                          + (chs[:, None, None] * S + rows_r[None, :, None]) * EP2 + ecol[None, None, :],
                          mask=(chs < NCH)[:, None, None] & rmask_r[None, :, None] & emask[None, None, :],
                          other=0.0)
        ms = tl.sum(ssq, axis=0) / H
        rstd = 1.0 / tl.sqrt_rn(ms + EPS)  # [SP]
        if pid < NCH:
            offs = rows[:, None] * H + ccols[None, :]
            if STAGE == 0:  # this chunk's h and post_norm are still in registers from phase A
                hc, pn = h, pn_c
            else:
                hc = tl.load(_as(scratch, SC_H, tl.float32) + offs, mask=m2, other=0.0)
                pn = tl.load(post_norm + ccols, mask=cmask, other=0.0)
            _store_x(scratch, offs, m2, hc * rstd[:, None] * pn[None, :], xsig, S, H, SC_X, F8, INTERP, X8T)
        _clear_sync(scratch, pid, SC_SYNC, SEG, SEGP2, NSYNC)
        if ROWTOP:
            # RP CTAs per row each sum CPP chunks' partial logits of that row; the last to arrive
            # sums the RP parts in order (deterministic, the same on every rank) and picks the
            # row's top-k. One CTA per row reading all 192 chunks took 12-18 us at 8-16 rows.
            last_r = rr < 0
            if rr < S:
                tl.store(rp + (pid % RP) * EP2 + ecols, tl.sum(vpl, axis=0))
                tl.debug_barrier()
                last_r = tl.atomic_add(_as(scratch, SC_ROWCNT, tl.int32) + rr, 1, sem="acq_rel", scope="gpu") == RP - 1
                _stamp(sub_row, 10, IS_HIP, INTERP, TIMELINE)  # arrived (the profile's pick_arrive)
            if last_r:
                accl = tl.sum(tl.load(rp + tl.arange(0, RP)[:, None] * EP2 + ecols[None, :], cache_modifier=".cg"),
                              axis=0)
                r1 = rr + tl.arange(0, 1)
                lg1 = accl[None, :] * tl.sum(tl.where(rows == rr, rstd, 0.0), axis=0)
                sel1, w1 = _topk(lg1, bias_e, ecols, evalid, pad1 == 0, K, KP2, EP2, SORT)
                # one shared [E][SP] routing-weight table, and the row's picks for phase C
                tl.store(_as(scratch, SC_WTAB, tl.float32) + ecols[None, :] * SP + r1[:, None], w1)
                _stamp(sub_row, 11, IS_HIP, INTERP, TIMELINE)  # after the first store of the picks: the top-k is done
                tl.store(_as(scratch, SC_SEL, tl.int32) + r1[:, None] * EP2 + ecols[None, :], sel1)
                _store_route(scratch, r1, pad1, sel1, w1, ecols, SC_ROUTE, SC_ROUTEW, K, KP2)
        elif pid * EPC < E:
            # this CTA's experts: the chunks' partial logits summed in chunk order (the same on
            # every rank, so every rank routes the same), times rstd
            rstd_r = 1.0 / tl.sqrt_rn(tl.sum(ssq_r, axis=0) / H + EPS)  # [RT]
            lg = tl.sum(pls, axis=0) * rstd_r[:, None]
            tl.store(_as(scratch, SC_LOGIT, tl.float32) + rows_r[:, None] * E + ecol[None, :], lg,
                     mask=rmask_r[:, None] & emask[None, :])
        _stamp(sub_row, 1, IS_HIP, INTERP, TIMELINE)
    if not FR:
        _grid_barrier(words, fault, e, rank, timeout_ns, pid, PH_SEAM, BLOCKS, IS_HIP, INTERP, STAGE, CHK, 2)

    # ------------------------------------------------------------------------------ C: top-k + experts stage 1
    sync = _as(scratch, SC_SYNC, tl.int32)  # [NSL] stage-1 tiles done per slot, [NHT] stage-2 items done per H tile, [NSL*NT] split-K arrivals
    meta = _as(scratch, SC_META, tl.int32)
    NT: tl.constexpr = I_R // BN
    NHT: tl.constexpr = H // BH
    KSTEP: tl.constexpr = H // KS
    if (STAGE == 0) | (STAGE == 3):
        _stamp(sub_row, 2, IS_HIP, INTERP, TIMELINE)
        ecta = _as(scratch, SC_ECTA, tl.int32) + pid * EP2
        if ROWTOP:
            # the rows' picks from phase B -> the active experts (the same list in every CTA)
            selt = tl.load(_as(scratch, SC_SEL, tl.int32) + rows_r[:, None] * EP2 + ecols[None, :],
                           mask=rmask_r[:, None], other=0, cache_modifier=".cg")
            active = tl.max(selt, axis=0)  # [EP2]
            wtab = _as(scratch, SC_WTAB, tl.float32)
        else:
            lg = tl.load(_as(scratch, SC_LOGIT, tl.float32) + rows_r[:, None] * E + ecols[None, :],
                         mask=rmask_r[:, None] & evalid[None, :], other=0.0)
            slot = tl.load(slots + rows_r, mask=rmask_r, other=-1)
            if not EWL:
                bias_e = tl.load(router_bias + ecols, mask=evalid, other=0.0)
            sel, wsel = _topk(lg, bias_e, ecols, evalid,
                              rmask_r & (slot >= 0), K, KP2, EP2, SORT)
            active = tl.max(sel, axis=0)  # [EP2]
            # this CTA's copy of the routing weights, transposed [E][SP]: a work item reads them
            # from here (L1) instead of keeping [RT, E] tensors live
            wtab = _as(scratch, SC_WTAB, tl.float32) + pid * (EP2 * SP)
            tl.store(wtab + ecols[None, :] * SP + rows_r[:, None], wsel)
            if pid == 0:
                _store_route(scratch, rows_r, rmask_r & (slot < 0), sel, wsel, ecols, SC_ROUTE, SC_ROUTEW, K, KP2)
        if MODE == 1:
            active = tl.where((ecols >= first_expert) & (ecols < first_expert + NLOC), active, 0)
        slot_of = tl.cumsum(active, axis=0) - 1
        n_active = tl.sum(active, axis=0)
        tl.store(ecta + slot_of, ecols, mask=active > 0)
        if SPS:  # (SPS) expert -> slot (-1: none here), for the sum's reads of each row's own slots
            tl.store(_as(scratch, SC_INV, tl.int32) + pid * EP2 + ecols, tl.where(active > 0, slot_of, -1))
        tl.store(meta + pid, n_active)  # this CTA's own count (stage 2 and the sum read it back)
        tl.debug_barrier()
        _stamp(tl_row, C_ROUTER_DONE, IS_HIP, INTERP, TIMELINE)
        if MODE != 2:
            # items (slot j, BN-row tile t of I_r, K part ks), ks fastest; with KS > 1 the last
            # arriver of a (j, t) sums the parts in ks order (deterministic) and finishes the tile
            n_items = n_active * (NT * KS)
            NX: tl.constexpr = X8T if F8 else 2  # x terms: fp8 x X8T or fp16 hi + lo
            # SQ token columns per term (SQ >= S; NX x SQ >= 16, tl.dot's least N)
            rq = tl.arange(0, SQ)
            c2 = tl.arange(0, NX * SQ)
            if F8:
                xb = _as(scratch, SC_X, tl.float8e4nv)
                tw = tl.exp2((c2 // SQ) * -4.0) * xsig  # term t counts 16^-t, x was divided by xsig
            else:
                xb = _as(scratch, SC_X, tl.float16)
                tw = tl.full((NX * SQ,), 1.0 / SHIFT, tl.float32)
            act = _as(scratch, SC_ACT, tl.float16)
            gpart = _as(scratch, SC_GPART, tl.float32)
            nn = tl.arange(0, BN)
            kc2 = tl.arange(0, BK)
            xo2 = (c2 // SQ * S + c2 % SQ)[None, :] * H + kc2[:, None]  # term 0 rows, then term 1 ...
            xm2 = ((c2 % SQ) < S)[None, :]
            go = nn[:, None] * SP + rq[None, :]
            # (PN1) as PN at stage 2: the next item's first PN1 K steps asked of the L2 where this
            # item's loop issues its last load, its expert read two steps before; a CTA's last
            # stage-1 item asks for its first stage-2 item's (at 1-3 tokens each CTA's only one)
            lane = tl.arange(0, 128)
            P1S: tl.constexpr = KSTEP // BK
            P1B: tl.constexpr = P1S - NS if P1S > NS else 0
            P1A: tl.constexpr = P1B - 2 if P1B > 2 else 0
            P1N: tl.constexpr = PN1 * BK if PN1 * BK < KSTEP else KSTEP
            P1N2: tl.constexpr = PN1 * 128 if PN1 * 128 < I_R // KH else I_R // KH
            f2 = pid
            if pid < n_items:  # (FL) this CTA's first stage-2 item, every BLOCKS-th from its own
                f2 += ((n_items - pid + BLOCKS - 1) // BLOCKS) * BLOCKS
            w = pid  # while loops: the interpreter cannot range() over a runtime scalar
            if HP & 2:  # the first item's expert; each next one's is read at the end of the item before
                hej = tl.load(ecta + w // (KS * NT), mask=w < n_items, other=0)
            while w < n_items:
                nxt = _claim(sync + QOFF, DQ)  # DQ: whichever ticket is free now (see geometry)
                jt = w // KS
                kb = (w % KS) * KSTEP
                j = jt // NT
                t = jt % NT
                if HP & 2:
                    ej = hej
                    # the route weights the epilogue needs, read now, not after the loop
                    wt = tl.load(wtab + ej * SP + rq, mask=rq < S, other=0.0)  # [SQ]
                else:
                    ej = tl.load(ecta + j)
                le = ej.to(tl.int64)
                if MODE == 1:
                    le = (ej - first_expert).to(tl.int64)
                wbase = w13 + le * (2 * I_R * H) + kb
                sbase = s13 + le * ((2 * I_R // 128) * (H // 128)) + kb // 128
                r1 = t * BN + nn  # rows of w1 (gate); w3 (up) rows are I_R further
                # transposed [weight rows, NX x SQ]: columns SQ t..SQ t+SQ-1 take x term t (fp8: 4
                # terms; fp16: hi, lo), one MMA per weight tile and K step; the terms summed at the end
                acc_g = tl.zeros((BN, NX * SQ), tl.float32)
                acc_u = tl.zeros((BN, NX * SQ), tl.float32)
                pwn = lane * 0
                pej = lane * 0 - 1
                for k0 in tl.range(0, KSTEP, BK, num_stages=NS):
                    if PN1:
                        if k0 == P1A * BK:
                            pwn, pej = _pn_next(nxt, w, n_items, n_items + n_active * (NHT * KH), ecta, lane, f2,
                                                BLOCKS, DQ, KS * NT, NHT * KH, FL)
                        if k0 == P1B * BK:  # a stage-1 item's rows, or (the CTA's last) a stage-2 item's
                            _pn_w13(w13, pwn, tl.where(pwn < n_items, pej, -1), lane, first_expert, MODE, H, I_R, BN,
                                    NT, KS, KSTEP, P1N)
                            _pn_w2(w2, pwn, tl.where(pwn < n_items, -1, pej), lane, n_items, first_expert, MODE, H, I_R,
                                   BH, NHT, KH, P1N2)
                    xk = tl.load(xb + xo2 + kb + k0, mask=xm2, other=0.0)  # x terms^T tile [BK, NX*SP]
                    wg = tl.load(wbase + r1[:, None] * H + k0 + kc2[None, :])
                    wu = tl.load(wbase + (I_R + r1)[:, None] * H + k0 + kc2[None, :])
                    sg = tl.load(sbase + ((t * BN) // 128) * (H // 128) + k0 // 128) * SHIFT
                    su = tl.load(sbase + ((I_R + t * BN) // 128) * (H // 128) + k0 // 128) * SHIFT
                    acc_g = _mma_sc(wg, sg, xk, acc_g, INTERP, IS_HIP, SACC)
                    acc_u = _mma_sc(wu, su, xk, acc_u, INTERP, IS_HIP, SACC)
                if HP & 2:  # the next item and its expert, their round trips behind this epilogue
                    wn = _next_item(w, nxt, BLOCKS, DQ)
                    hej = tl.load(ecta + wn // (KS * NT), mask=wn < n_items, other=0)
                g = tl.sum(tl.reshape(acc_g * tw[None, :], (BN, NX, SQ)), axis=1)
                u = tl.sum(tl.reshape(acc_u * tw[None, :], (BN, NX, SQ)), axis=1)
                last = True
                if KS > 1:
                    gp = gpart + w.to(tl.int64) * (2 * BN * SP)
                    tl.store(gp + go, g)
                    tl.store(gp + BN * SP + go, u)
                    tl.debug_barrier()
                    last = tl.atomic_add(sync + NSL + NHT + jt, 1, sem="acq_rel", scope="gpu") == KS - 1
                    if last:
                        g = tl.zeros((BN, SQ), tl.float32)
                        u = tl.zeros((BN, SQ), tl.float32)
                        for q in tl.static_range(KS):
                            gq = gpart + (jt * KS + q).to(tl.int64) * (2 * BN * SP)
                            g += tl.load(gq + go, cache_modifier=".cg")
                            u += tl.load(gq + BN * SP + go, cache_modifier=".cg")
                if last:
                    if (HP & 2) == 0:
                        wt = tl.load(wtab + ej * SP + rq, mask=rq < S, other=0.0)  # [SQ]
                    a = g / (1.0 + tl.exp(-g)) * u * wt[None, :]
                    if A8:
                        # A8T (four) fp8 terms of a / (the tile's max / 256), as x's (_store_x): stage 2 then
                        # multiplies them with the fp8 w2 codes as stored, the tile's scale on each
                        # product (one number per K step and tile, not per token)
                        araw = tl.max(tl.max(tl.abs(a), axis=1), axis=0)
                        amax = tl.maximum(araw, 1e-30)
                        ar = a * (256.0 / amax)
                        a8 = _as(scratch, SC_ACT8, tl.float8e4nv) + r1[:, None]
                        for q in tl.static_range(A8T):
                            aq = _fp8(ar, INTERP)
                            tl.store(a8 + ((j * A8T + q) * SP + rq[None, :]).to(tl.int64) * I_R, aq)
                            ar = (ar - aq.to(tl.float32)) * 16.0
                        tl.store(_as(scratch, SC_ASC, tl.float32) + j * NT + t, amax * (1.0 / 256.0))
                    else:
                        tl.store(act + (j * SP + rq[None, :]).to(tl.int64) * I_R + r1[:, None], a.to(tl.float16))
                    tl.debug_barrier()
                    tl.atomic_add(sync + j, 1, sem="release", scope="gpu")  # one more tile of slot j done
                if HP & 2:
                    w = wn
                else:
                    w = _next_item(w, nxt, BLOCKS, DQ)
            if DQ & (STAGE == 3):  # the stage-2 item its last claim took, for the next launch
                tl.store(meta + BLOCKS + pid, w)
        _stamp(sub_row, 3, IS_HIP, INTERP, TIMELINE)
    # no grid barrier: a stage-2 item waits for its own expert's NT tiles only

    # ------------------------------------------------------------------------------ D: experts stage 2
    # work items (active expert j, BH-column tile of H): ypart[j, :S, tile] = act[j] @ w2[e_j][tile]^T,
    # numbered after the stage-1 items, so a CTA with no stage-1 item starts on stage 2 at once
    if (STAGE == 0) | (STAGE == 4):
        if MODE != 2:
            n_act = tl.load(meta + pid)
            n1 = n_act * (NT * KS)
            act = _as(scratch, SC_ACT, tl.float16)
            ecta = _as(scratch, SC_ECTA, tl.int32) + pid * EP2  # this CTA's own list (phase C)
            ypart = _as(scratch, SC_YPART, tl.float32)
            ki = tl.arange(0, 128)
            hh = tl.arange(0, BH)
            lane = tl.arange(0, 128)  # (PN) a lane a thread, as _claim's ticket
            if A8:
                # SQ2 token columns per term: the tokens' own count (at least 4), not stage 1's SQ
                # (16 below 7 tokens); A8T x SQ2 < 16 compiles to fp16 mma.sync (see geometry, SQ2)
                rq2 = tl.arange(0, SQ2)
                kn = tl.arange(0, BN)
                c8 = tl.arange(0, A8T * SQ2)
                tw8 = tl.exp2((c8 // SQ2) * -4.0)  # term t counts 16^-t
            _stamp(sub_row, 4, IS_HIP, INTERP, TIMELINE)
            if DQ & (FL == 0):
                # one queue for both stages: the item stage 1's last claim took (or pid), so the
                # CTAs free first take the first experts' stage-2 items, whose tiles are done first
                # (the fused launch, STAGE 0: w, where stage 1's loop left it). FL: stage 2 keeps
                # the static schedule below (a ticket stage 1 claimed past its items goes unused)
                if STAGE == 4:
                    w = tl.load(meta + BLOCKS + pid)
            else:
                w = pid
                if w < n1:
                    w += ((n1 - w + BLOCKS - 1) // BLOCKS) * BLOCKS
            w0 = w
            wend = n1 + n_act * (NHT * KH)
            # the rows whose partial an item writes: SPS=2 only those routed to its expert, as the
            # sum reads no other (loaded with the item's header, not beside the store, which would
            # wait for it)
            if A8:
                yrow = rq2
                yrm = rq2 < S
            else:
                yrow = rows
                yrm = rmask
            if HP & 1:  # the first item's header; each next one's is read at the end of the item before
                hej, hv, hym = _s2_header(w, wend, n1, ecta, sync, _as(scratch, SC_WTAB, tl.float32) + yrow, yrm,
                                          SP, NHT, KH, SPS)
            if FL:  # (FL) the CTA's items, every BLOCKS-th, as one pipelined loop (_s2_fl_item)
                if INTERP:  # (the interpreter cannot range() from the program id)
                    while w < wend:
                        _s2_fl_item(w, w0, n1, ecta, sync, scratch, w2, s2, ypart, first_expert, fault, e, rank,
                                    timeout_ns, pid, sub_row, hh, kn, c8, tw8, yrow, yrm, MODE, S, H, I_R, BH, BN, NT,
                                    NHT, KH, SP, A8, A8T, SQ2, NS2, SPS, PS, PSO, NSL, SC_WTAB, SC_ACT8, SC_ASC, SACC,
                                    TIMELINE, IS_HIP, INTERP, CHK, False)
                        w += BLOCKS
                else:
                    for wf in tl.range(w, wend, BLOCKS, flatten=True):
                        _s2_fl_item(wf, w0, n1, ecta, sync, scratch, w2, s2, ypart, first_expert, fault, e, rank,
                                    timeout_ns, pid, sub_row, hh, kn, c8, tw8, yrow, yrm, MODE, S, H, I_R, BH, BN, NT,
                                    NHT, KH, SP, A8, A8T, SQ2, NS2, SPS, PS, PSO, NSL, SC_WTAB, SC_ACT8, SC_ASC, SACC,
                                    TIMELINE, IS_HIP, INTERP, CHK, True)
            else:
                # KH > 1: each (j, tile) item in KH parts of I_R (the last experts' items are the tail of
                # the phase at one token; a part is 1/KH of the bytes), partials summed in phase E
                while w < wend:
                    j = (w - n1) // (NHT * KH)
                    t = (w - n1) % (NHT * KH) // KH
                    kh = (w - n1) % KH
                    kq = kh * (I_R // KH)
                    if HP & 1:
                        ej = hej
                    else:
                        ej = tl.load(ecta + j)
                    le = ej.to(tl.int64)
                    if MODE == 1:
                        le = (ej - first_expert).to(tl.int64)
                    wbase = w2 + le * (H * I_R) + (t * BH + hh)[:, None] * I_R
                    sbase = s2 + le * ((H // 128) * (I_R // 128)) + ((t * BH) // 128) * (I_R // 128)
                    if HP & 1:
                        ym = hym
                    else:
                        ym = yrm
                        if SPS == 2:
                            ym &= tl.load(_as(scratch, SC_WTAB, tl.float32) + ej * SP + yrow, mask=ym, other=0.0) != 0.0
                    if HP & 1:
                        _spin_count(sync + j, hv, 0, NT, fault, e, rank, timeout_ns, pid, PH_REDUCE, IS_HIP, INTERP, CHK)
                        tl.debug_barrier()
                    else:
                        _wait_count(sync + j, NT, fault, e, rank, timeout_ns, pid, IS_HIP, INTERP, CHK)
                    # claimed once the item's tiles are in: a CTA waiting for them (one with no
                    # stage-1 item waits from the router on) holds no next item meanwhile
                    nxt = _claim(sync + QOFF, DQ)
                    if A8:
                        a8 = (_as(scratch, SC_ACT8, tl.float8e4nv)
                              + ((j * A8T + c8 // SQ2) * SP + c8 % SQ2)[None, :].to(tl.int64) * I_R + kn[:, None])
                        asc = _as(scratch, SC_ASC, tl.float32) + j * NT
                    if TIMELINE:
                        if w == w0:
                            _stamp(sub_row, 8, IS_HIP, INTERP, TIMELINE)
                    # A8 = 2 and fp16: steps of 128 (A8: two stage-1 tiles, an MMA each); A8 = 1: one tile
                    A8K: tl.constexpr = BN if A8 == 1 else 128
                    # (PN) the next item's first PN steps asked of the L2 at the step where this loop's
                    # pipeline issues its last load (NS2 - 1 steps ahead), its expert read two steps before
                    PNS: tl.constexpr = (I_R // KH) // A8K
                    PNB: tl.constexpr = PNS - NS2 if PNS > NS2 else 0
                    PNA: tl.constexpr = PNB - 2 if PNB > 2 else 0
                    PNN: tl.constexpr = PN * A8K if PN * A8K < I_R // KH else I_R // KH
                    pwn = lane * 0
                    pej = lane * 0 - 1
                    if A8:
                        # fp8 x fp8 as stage 1: [BH, BN] w2 codes @ [BN, 4 x SQ2] act terms per stage-1 tile,
                        # each product times w2's block scale x the tile's act scale
                        yt8 = tl.zeros((BH, A8T * SQ2), tl.float32)
                        for k0 in tl.range(0, I_R // KH, A8K, num_stages=NS2):
                            if PN:
                                if k0 == PNA * A8K:
                                    pwn, pej = _pn_next(nxt, w, n1, wend, ecta, lane, 0, BLOCKS, DQ, 1, NHT * KH, False)
                                if k0 == PNB * A8K:
                                    _pn_w2(w2, pwn, pej, lane, n1, first_expert, MODE, H, I_R, BH, NHT, KH, PNN)
                            for q in tl.static_range(A8K // BN):
                                kk = kq + k0 + q * BN
                                av = tl.load(a8 + kk, cache_modifier=".cg")
                                wq = tl.load(wbase + kk + kn[None, :])
                                sc = tl.load(sbase + kk // 128) * tl.load(asc + kk // BN, cache_modifier=".cg")
                                yt8 = _mma_sc(wq, sc, av, yt8, INTERP, IS_HIP, SACC)
                        yv = tl.sum(tl.reshape(yt8 * tw8[None, :], (BH, A8T, SQ2)), axis=1)  # [BH, SQ2]
                    else:
                        yt = tl.zeros((BH, SP), tl.float32)  # transposed: [H columns, tokens]
                        for k0 in tl.range(0, I_R // KH, 128, num_stages=NS2):
                            if PN:
                                if k0 == PNA * A8K:
                                    pwn, pej = _pn_next(nxt, w, n1, wend, ecta, lane, 0, BLOCKS, DQ, 1, NHT * KH, False)
                                if k0 == PNB * A8K:
                                    _pn_w2(w2, pwn, pej, lane, n1, first_expert, MODE, H, I_R, BH, NHT, KH, PNN)
                            a = tl.load(act + (j * SP + rows[None, :]).to(tl.int64) * I_R + kq + k0 + ki[:, None],
                                        mask=rmask[None, :], other=0.0, cache_modifier=".cg")
                            wq = tl.load(wbase + kq + k0 + ki[None, :])
                            yt = _mma_sc(wq, tl.load(sbase + (kq + k0) // 128) * SHIFT, a, yt, INTERP, IS_HIP, SACC)
                        yv = yt * (1.0 / SHIFT)
                    if HP & 1:  # the successor and its header now, their round trips behind this store and release
                        wn = _next_item(w, nxt, BLOCKS, DQ)  # stage-2 items are numbered from n1
                        hej, hv, hym = _s2_header(wn, wend, n1, ecta, sync, _as(scratch, SC_WTAB, tl.float32) + yrow, yrm,
                                                  SP, NHT, KH, SPS)
                    # [BH columns of H, the rows' columns yrow]
                    tl.store(ypart + ((j * KH + kh) * S + yrow[None, :]).to(tl.int64) * H + t * BH + hh[:, None], yv,
                             mask=ym[None, :])
                    tl.debug_barrier()
                    if PS:  # per (slot, tile): phase E sums a tile's slots as they finish, in slot order
                        tl.atomic_add(sync + PSO + j * NHT + t, 1, sem="release", scope="gpu")
                    else:
                        tl.atomic_add(sync + NSL + t, 1, sem="release", scope="gpu")  # one more slot of tile t done
                    if TIMELINE:
                        if w == w0:
                            _stamp(sub_row, 9, IS_HIP, INTERP, TIMELINE)
                    if HP & 1:
                        w = wn
                    else:
                        w = _next_item(w, nxt, BLOCKS, DQ)  # stage-2 items are numbered from n1
            _stamp(sub_row, 5, IS_HIP, INTERP, TIMELINE)
    # no grid barrier: the sum of a chunk waits for its own H tiles only

    # ------------------------------------------------------------------------------ E: sum + reduce
    if (STAGE == 0) | (STAGE == 5):
        _stamp(sub_row, 6, IS_HIP, INTERP, TIMELINE)
        y = tl.zeros((SP, CHP2), tl.float32)
        if MODE != 2:
            if pid < NCH:
                # this chunk's MoE partial: the experts' parts summed in slot order (deterministic)
                n_act = tl.load(meta + pid) * KH  # partials: (slot, part of I_R) in that order
                t_lo = (pid * CH) // BH
                t_hi = (pid * CH + CH - 1) // BH  # a chunk spans at most two H tiles (CH <= BH)
                if NCH * CH > H:  # the last chunk ends past H (a grid that does not divide it)
                    t_hi = tl.minimum(pid * CH + CH - 1, H - 1) // BH
                if SPS:
                    # (SPS) each row's own slots, not every slot: route (phase B's row picks, before
                    # barrier 2) in expert order, which is slot order, mapped by phase C's table
                    kk = tl.arange(0, KP2)
                    rk = rmask[:, None] & (kk < K)[None, :]
                    rte = tl.load(_as(scratch, SC_ROUTE, tl.int32) + rows[:, None] * K + kk[None, :], mask=rk,
                                  other=-1, cache_modifier=".cg")
                    sl = tl.load(_as(scratch, SC_INV, tl.int32) + pid * EP2 + rte, mask=rte >= 0, other=-1,
                                 cache_modifier=".cg")  # [SP, KP2]
                    if SPS == 2:  # stage 2 wrote a row's partial only where its weight is not 0
                        rtw = tl.load(_as(scratch, SC_ROUTEW, tl.float32) + rows[:, None] * K + kk[None, :], mask=rk,
                                      other=0.0, cache_modifier=".cg")
                        sl = tl.where(rtw != 0.0, sl, -1)
                if not PS:
                    _wait_count(sync + NSL + t_lo, n_act, fault, e, rank, timeout_ns, pid, IS_HIP, INTERP, CHK)
                    if t_hi != t_lo:
                        _wait_count(sync + NSL + t_hi, n_act, fault, e, rank, timeout_ns, pid, IS_HIP, INTERP, CHK)
                _stamp(sub_row, 7, IS_HIP, INTERP, TIMELINE)
                ypart = _as(scratch, SC_YPART, tl.float32)
                if SPS:
                    # the K slots of each row in slot order, each as a [rows, chunk] load (one
                    # [rows, K, chunk] load held 176 registers at 3 tokens: two CTAs per SM, not three;
                    # the slots packed in an int64 before the wait, K shifts here instead of these 2K
                    # reductions, measured the same: dev round 87, f6d26ec)
                    yr = (sl * KH * S + rows[:, None]) * H  # < NSLOT x KH x S x H: int32
                    for k in tl.static_range(K):
                        yk = tl.sum(tl.where(kk[None, :] == k, yr, 0), axis=1)
                        ok = tl.sum(tl.where(kk[None, :] == k, sl, 0), axis=1) >= 0
                        for q in tl.static_range(KH):
                            y += tl.load(ypart + (yk + q * S * H)[:, None] + ccols[None, :],
                                         mask=ok[:, None] & cmask[None, :], other=0.0, cache_modifier=".cg")
                else:
                    jj = tl.arange(0, JB)
                    yo = rows[:, None] * H + ccols[None, :]
                    j0 = n_act * 0
                    n_done = n_act * 0  # (PS) the partials of the slots done so far, a prefix
                    while j0 < n_act:
                        if PS:
                            j1 = tl.minimum(j0 + JB, n_act)  # this batch's partials must be done
                            if n_done < j1:
                                n_done = _wait_prefix(sync + PSO, t_lo, t_hi, n_act // KH, (j1 + KH - 1) // KH, KH,
                                                      NHT, NSLP2, PS, fault, e, rank, timeout_ns, pid, IS_HIP, INTERP,
                                                      CHK) * KH
                        js = j0 + jj
                        v = tl.load(ypart + (js[:, None, None] * S * H).to(tl.int64) + yo[None, :, :],
                                    mask=(js < n_act)[:, None, None] & m2[None, :, :], other=0.0, cache_modifier=".cg")
                        y += tl.sum(v, axis=0)
                        j0 += JB
        _stamp(tl_row, C_EXPERTS_DONE, IS_HIP, INTERP, TIMELINE)
        offs = rows[:, None] * H + ccols[None, :]
        yb = y.to(tl.bfloat16)
        if SOLO:
            tl.store(out + offs, yb, mask=m2)
        else:
            _send(peers, pid, rank, par, yb, tl.where(_rank_faulted(fault, e), -e, e), offs, m2, P_MOE, P_MOE_LL,
                  PH_REDUCE, P_FLAGS, TP, MT, H, FLAGB, INTERP, FENCE, LL)
        _stamp(tl_row, C_RED_ARRIVE, IS_HIP, INTERP, TIMELINE)
    if (STAGE == 0) | (STAGE == 7):
        offs = rows[:, None] * H + ccols[None, :]
        if SOLO:  # out was stored with the sum
            _stamp(tl_row, C_RED_SEEN, IS_HIP, INTERP, TIMELINE)
        else:
            o = _gather(peers, fault, pid, rank, e, timeout_ns, tl_row, par, offs, m2, P_MOE, P_MOE_LL, PH_REDUCE,
                        P_FLAGS, P_FBOX, TP, MT, H, FLAGB, C_RED_SEEN, IS_HIP, INTERP, TIMELINE, CHK, LL)
            tl.store(out + offs, o.to(tl.bfloat16), mask=m2)
        _stamp(tl_row, C_RED_DONE, IS_HIP, INTERP, TIMELINE)

        # -------------------------------------------------------------------------- F: handshake, end
        if FINAL:
            if not SOLO:
                val = tl.where(_rank_faulted(fault, e), -e, e)
                _publish(peers, pid, rank, val, PH_HANDSHAKE, P_FLAGS, TP, FLAGB, INTERP, FENCE)
            _stamp(tl_row, C_HS_ARRIVE, IS_HIP, INTERP, TIMELINE)
    if (STAGE == 0) | (STAGE == 8):
        if FINAL:
            if SOLO:
                _stamp(tl_row, C_HS_SEEN, IS_HIP, INTERP, TIMELINE)
            else:
                _wait_peers(peers, fault, pid, rank, e, timeout_ns, tl_row, m2, m2, 0, PH_HANDSHAKE, P_FLAGS, P_FBOX,
                            TP, FLAGB, 0, C_HS_SEEN, IS_HIP, INTERP, TIMELINE, CHK, False)  # a flag: no chunk
            _stamp(tl_row, C_HS_DONE, IS_HIP, INTERP, TIMELINE)
        _stamp(tl_row, C_END, IS_HIP, INTERP, TIMELINE)
        if STAGE != 0:
            # staged launches (one CTA after another): the last CTA out moves the epoch on, as
            # every CTA reads it at its start (also after a fault)
            tl.debug_barrier()
            n_out = tl.atomic_add(words + 3, 1, sem="acq_rel", scope="gpu")
            if n_out == BLOCKS - 1:
                tl.atomic_xchg(words + 3, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(words, e, sem="release", scope="sys")


@triton.jit
def clock_kernel(out, IS_HIP: tl.constexpr):
    tl.store(out, now_ns(IS_HIP, False))


# ---------------------------------------------------------------------------------------------
# host-side specialisation (plain Python: shared by the runner and the offline compiler)
# ---------------------------------------------------------------------------------------------
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
# R: the width's register cap on NVIDIA, launch_options)
MEASURED_KEYS = frozenset({"BH", "BN", "CPS", "DQ", "EW", "FL", "HP", "JB", "KH", "KS", "KSFIX", "NS", "NS2", "NSS", "PLR", "PN", "PN1", "R",
                           "RPG", "RTOP", "SPS", "SQ", "X8T"})


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
    tune = choices(key)
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
    # load block, was 113.3 / 141.1 against the row pick's 113.0 / 139.5, round 50). A TP2 CTA
    # holds only its chunk of the all-reduced rows: never there
    fr = int(key.tp == 1 and key.tokens <= min(2, tune.get("FR", 2)))
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
    # 4 / 16 tokens); TP2 builds are unchanged
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
    # us against 1.3, the step 0.2-2.7 us slower at 1-16 tokens)
    # HP: an item's header (its expert; at stage 2 also its tiles' count and its rows) read at the
    # end of the item before, behind that item's epilogue, not at its own start: bit 1 stage 2,
    # bit 2 stage 1 (there with the route weights its epilogue needs read before its loop)
    hp = _allowed("HP", tune.get("HP", 0), (0, 1, 2, 3), "0 (off), 1 (stage 2), 2 (stage 1) or 3 (both)")
    # PN: at stage 2, the next item's first PN K steps (its w2 rows' first PN x 128 bytes) asked of
    # the L2 where the item's K loop issues its last load, so the next item's pipeline fills from
    # the L2 while this one drains (HP's headers gained 0-0.4%: the items' cost is that fill and
    # drain, notes/triton-kernel.md "Thirty-fourth session"). NVIDIA only (a bulk prefetch)
    pn = _allowed("PN", tune.get("PN", 0), range(9), "0 (off) to 8 (K steps of the next stage-2 item)")
    # PN1: the same in stage 1's loop (its items have twice the K steps of stage 2's at TP1), for
    # the next item of either stage: a CTA's last stage-1 item asks for its first stage-2 item's
    # rows, whose bytes need no stage-1 tile (at 1-3 tokens, one item a CTA a stage, only that)
    pn1 = _allowed("PN1", tune.get("PN1", 0), range(9), "0 (off) to 8 (K steps of the next item, from stage 1)")
    # FL: stage 2 as one loop over a CTA's items (every BLOCKS-th) and their K steps, which Triton
    # 3.6 flattens and pipelines across items (_s2_fl_item): the next item's first loads in flight
    # during this one's last steps. PN's aim without a prefetch, at the cost of DQ's counter at
    # stage 2 (an item taken from a counter is not known when its loads would be issued ahead;
    # with DQ stage 1 keeps the counter). HP's stage-2 half has no place in that loop (the pipeline
    # reads each item's header steps ahead): FL clears it and keeps HP's stage-1 half
    fl = _allowed("FL", tune.get("FL", 0), (0, 1), "0 (a loop per item) or 1 (one loop over the items)")
    if fl and (pn or not a8):
        raise ValueError(f"FFNQ_TRITON_TUNE FL=1 (width {key.tokens}): needs PN=0 and the fp8 act (A8 1 or 2); "
                         f"this build has PN={pn}, A8={a8}")
    hp = hp & 2 if fl else hp
    extra = dict(CHK=tune.get("CHK", 8),
                 PDL=bool(tune.get("PDL", 1)), FENCE=bool(tune.get("FENCE", 1)), SORT=bool(tune.get("SORT", 1)),
                 LL=bool(tune.get("LL", 1)), PRE=bool(tune.get("PRE", 1)), PLR=tune.get("PLR", 2),
                 SOLO=key.tp == 1 and bool(tune.get("SOLO", 1)), FR=fr, KH=kh, A8=a8,
                 A8T=a8t, DQ=dq, HP=hp, PN=pn if i_r else 0, PN1=pn1 if i_r else 0, FL=fl,
                 SQ2=min(16, max(_p2(key.tokens), sq2)), FW=bool(tune.get("FW", 0)), X8T=x8t,
                 EW=bool(tune.get("EW", int(key.tp == 1))))
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
                NCH=nch, NCHP2=_p2(nch), CH=ch, CHP2=max(16, _p2(ch)), EPC=epc, EPCP2=epcp2, RT=rt,
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
    if is_hip or interp:  # griddepcontrol, the fence and the bulk prefetch are sm_90 PTX
        g["PDL"] = g["FENCE"] = False
        g["PN"] = g["PN1"] = 0
    if is_hip:  # tagged words need 8-byte single-copy atomicity across the link: shown on NVLink only
        g["LL"] = False
        g["FL"] = 0  # (its barriers as sm_90 PTX; and CDNA keeps the fp16 act)
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
    return dict(opts, maxnreg=regs) if regs and not cx.get("IS_HIP") else opts


def signature(fp8: str = "fp8e4nv") -> dict:
    ptr = {"part": "*bf16", "residual": "*bf16", "slots": "*i64", "out": "*bf16", "res_out": "*bf16",
           "post_norm": "*fp32", "router": "*fp32", "router_bias": "*fp32", "w13": f"*{fp8}", "s13": "*fp32",
           "w2": f"*{fp8}", "s2": "*fp32", "scratch": "*u8", "peers": "*i64", "epoch": "*i32", "inject": "*i32",
           "cfg": "*i64", "rank": "i32", "first_expert": "i32"}
    return ptr
