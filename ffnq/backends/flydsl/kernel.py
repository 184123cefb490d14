"""The fused, persistent decode-FFN kernel of one TP rank, in FlyDSL (AMD gfx942 / gfx950).

Same phases and protocol as the cpu backend and the Triton kernel; written SIMT-style on raw
addresses (every tensor is an int64 device address, turned into a global pointer with
``fx.inttoptr``), one compiled kernel per width S. A grid of BLOCKS workgroups of THREADS
(wave64) threads, all co-resident (FlyDSL has no cooperative launch: the offline and live
residency checks are what keep the grid barriers from hanging):

  A  seam     CTA c pushes its column chunk of ``part`` (raw bf16) into every peer's seam slot
              [e&1][rank], thread 0 publishes flags[SEAM][c][rank] = e on every peer (system-scope
              release exchange), waits for every peer's flag of chunk c (system-scope acquire
              loads, s_sleep between polls, bounded by timeout_ns on s_memrealtime), then sums the
              chunk in rank order + residual (fp32): res_out, h (fp32 scratch), and the chunk's
              per-row sum of squares.
     -- grid barrier 1 --
  B  norm     rstd per row from the per-chunk sums (fixed order: bitwise the same on every rank
              and CTA); x = h*rstd*post_norm for the CTA's chunk (fp32 scratch);
     router   fp32 logits of the CTA's EPC experts for every row (8 lanes per (row, expert) dot).
     -- grid barrier 2 --
  C  top-k    every CTA, redundantly, one wave per row: sigmoid, biased top-k by wave butterfly
              argmax (lowest index wins a tie), renormalised un-biased weights, the active-expert
              list (ballot + popcount) and a [slot][row] weight table in LDS; CTA 0 writes
              route/route_w (sorted by expert, -1 / 0 for padding rows).
     experts  stage 1 work items (active expert j, 32-row tile of I_R): 8 lanes per weight row,
              16 fp8 codes per lane per 128-wide k block, decoded in registers (bit operations:
              exact for every e4m3fn code), block scale applied per 128x128 block, fp32 FMA, only
              for the rows routed to the expert; act = silu(g)*u*routing weight (fp32 scratch).
     -- grid barrier 3 --
  D  stage 2  CTA c: the MoE partial of its column chunk, 8 lanes per column, over the active
              experts and their routed rows;
     reduce   push the chunk (bf16) to every peer's moe slot, publish REDUCE flags, wait, sum in
              rank order -> out.
  E  handshake (final != 0): publish HANDSHAKE flags, wait for every peer's.
     end      the last CTA out stores the epoch e (so a graph replay uses e + 1 next time).

Epoch words (peer buffer "epoch", int32[4]): [0] epoch of the last launch, [1] grid-barrier
arrival count, [2] grid-barrier generation, [3] exit count. Flags hold e, or -e once this rank
faulted in this launch; a wait matches == e exactly. On expiry the first faulting wait writes the
scratch fault record and this rank's note in every peer's fault_box, and every later wait of the
rank is skipped (the rank-wide marker is fault[epoch] == e). Grid barriers are always passed
(bounded at 4x the timeout as a last resort). No trap anywhere.

Time: s_memrealtime (100 MHz constant clock on gfx9) x 10 = ns; timeline stamps, inject delays
and timeout_ns are all nanoseconds, so the runner converts nothing.

Not done in this SIMT version (see docs/flydsl.md): MFMA for the expert GEMMs and the
hardware fp8 converts (gfx942's v_cvt_pk_f32_fp8 reads FNUZ, not the checkpoints' e4m3fn).
"""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import llvm as llvm_d
from flydsl._mlir.dialects import rocdl as rocdl_d
from flydsl.compiler.ast_rewriter import ASTRewriter
from flydsl.expr import const_expr

from ffnq.spec import FAULT_FIELDS, Phase, stamp_names

THREADS = 256  # 4 waves of 64
WAVE = 64
LANES_PER_DOT = 8  # lanes that share one dot product (router, stage 1, stage 2)
MODES = {"all": 0, "local": 1, "none": 2}

F = {name: i for i, name in enumerate(FAULT_FIELDS)}
ACQ = fx.AtomicOrdering.Acquire
REL = fx.AtomicOrdering.Release
ACQREL = fx.AtomicOrdering.AcqRel
RELAXED = fx.AtomicOrdering.Monotonic
AGENT = fx.rocdl.SyncScope.Agent  # one GPU (every XCD); None = LLVM system scope (peers over XGMI)
GLOBAL = fx.AddressSpace.Global
NEG_INF = float("-inf")


def _dev(fn):
    """A device helper with dynamic control flow: give it the kernel's AST rewrite (if/while/for
    on traced values become scf ops). Plain Python otherwise, inlined where it is called."""
    return ASTRewriter.transform(fn)


# ---------------------------------------------------------------------------------------------
# memory and clock helpers (addresses are fx.Int64 byte addresses)
# ---------------------------------------------------------------------------------------------
def _ptr(ty, addr, align=None):
    a = align or max(1, ty.width // 8)
    return fx.inttoptr(fx.PointerType.get(elem_ty=ty.ir_type, address_space=GLOBAL, alignment=a), addr)


def _ld(ty, addr):
    return fx.generic_load(_ptr(ty, addr))


def _st(ty, addr, v):
    fx.generic_store(_ptr(ty, addr), ty(v) if not isinstance(v, ty) else v)


def _ld_vec(ty, n, addr):
    """n elements of ty at a 16-byte aligned address (one dwordx4 for 16 bytes)."""
    return fx.generic_load(_ptr(ty, addr, 16), dtype=ty, count=n)


def _ld_acq(ty, addr, scope=None):
    """Atomic acquire load; scope None = system (the flags that peers write over XGMI)."""
    return fx.generic_load(_ptr(ty, addr), memory_order=ACQ, syncscope=scope)


def _xchg(ty, addr, v, ordering, scope=None):
    return fx.atomic_xchg(_ptr(ty, addr), ty(v), ordering=ordering, syncscope=scope)


def _now_ns():
    t = llvm_d.call_intrinsic(ir.IntegerType.get_signless(64), "llvm.amdgcn.s.memrealtime", [], [], [])
    return fx.Int64(t) * 10  # 100 MHz constant clock


def _cta_release(scope=None):
    """Every wave makes its own writes visible at ``scope`` (None = system) before a CTA barrier
    after which one thread publishes. Needed: FlyDSL's gpu.barrier is a bare s_barrier (checked
    in the ISA: no s_waitcnt vmcnt before it), and a release by thread 0 only waits for its own
    wave's stores."""
    fx.memory_fence(syncscope=scope, ordering=REL)


def _cta_acquire(scope=None):
    """Every wave, after the CTA barrier that follows one thread's acquire, invalidates its
    caches for ``scope`` before reading what the peers / other CTAs wrote."""
    fx.memory_fence(syncscope=scope, ordering=ACQ)


def _backoff():
    rocdl_d.s_sleep(1)


def _i64(v):
    return fx.Int64(v)


def _lds_ld(arr, idx):
    return fx.ptr_load(arr.ptr + idx)


def _lds_st(arr, idx, v):
    fx.ptr_store(v, arr.ptr + idx)


F32_SIGN = -(2**31)
FP8_EM_F32 = 0x07F00000  # an e4m3 code's exponent+mantissa bits, moved to f32 bits 20..26
TWO_120 = float(2.0**120)


def fp8_bits(t):
    """f32 bits of 2^-120 x the e4m3fn code in the top byte of int32 ``t``: sign stays at bit 31,
    exponent+mantissa move from bits 24..30 to 20..26. Read as a float that is the code's value
    times 2^-120 for normal and subnormal codes alike (an e4m3 subnormal becomes an f32 denormal,
    exactly). Works on DSL Int32 and on numpy int32 arrays (tests check all 256 codes)."""
    return (t & F32_SIGN) | ((t >> 4) & FP8_EM_F32)


def _fp8x4_to_f32(w):
    """Four e4m3fn codes packed in an Int32 (byte i = element i) -> four fp32 times 2^-120; the
    caller folds 2^120 into the block scale. Needs f32 denormals kept (the kernel descriptor's
    .amdhsa_float_denorm_mode_32 3, checked offline); exact for every finite code."""
    out = []
    for i in range(4):
        t = w << (24 - 8 * i) if i < 3 else w
        out.append(fp8_bits(t).bitcast(fx.Float32))
    return out



def _sigmoid(x):
    return 1.0 / (1.0 + fx.exp(-x))


def _silu(x):
    return x / (1.0 + fx.exp(-x))


def _xor_sum8(v):
    """Sum over the 8 lanes of a dot group (lanes 8g..8g+7 of a wave)."""
    for o in (1, 2, 4):
        v = v + v.shuffle_xor(o, WAVE)
    return v


# ---------------------------------------------------------------------------------------------
# protocol helpers (mirror _record_fault / _publish / _wait_peers / _grid_barrier of the Triton
# kernel); thread 0 of a CTA runs them, the rest wait at the CTA barrier after
# ---------------------------------------------------------------------------------------------
def _peer(peers, r):
    return _ld(fx.Int64, peers + _i64(r) * 8)


def _rank_faulted(fault, e):
    return _ld_acq(fx.Int64, fault + 8 * F["epoch"], AGENT) == _i64(e)


@_dev
def _record_fault(fault, peers, e, phase, rank, mask, waited, pid, at, P_FBOX, TP, write_box):
    """First fault of this launch on this rank: the scratch record, then (timeouts) this rank's
    note in every peer's fault_box, before the valid bit and before any -e flag (release)."""
    e64 = _i64(e)
    old = fx.atomic_xchg(_ptr(fx.Int64, fault + 8 * F["epoch"]), e64, ordering=ACQREL, syncscope=AGENT)
    if old != e64:
        _st(fx.Int64, fault + 8 * F["phase"], _i64(phase))
        _st(fx.Int64, fault + 8 * F["rank"], _i64(rank))
        _st(fx.Int64, fault + 8 * F["missing_mask"], _i64(mask))
        _st(fx.Int64, fault + 8 * F["waited_ns"], _i64(waited))
        _st(fx.Int64, fault + 8 * F["cta"], _i64(pid))
        _st(fx.Int64, fault + 8 * F["at_ns"], _i64(at))
        if const_expr(write_box):
            for dst in fx.range_constexpr(TP):
                box = _peer(peers, dst) + P_FBOX + _i64(rank) * 32
                _st(fx.Int64, box, e64)
                _st(fx.Int64, box + 8, _i64(mask))
                _st(fx.Int64, box + 16, _i64(phase))
                _st(fx.Int64, box + 24, _i64(waited))
        _xchg(fx.Int64, fault + 8 * F["valid"], 1, REL)


def _publish(peers, pid, rank, val, PHASE, P_FLAGS, TP, BLOCKS):
    """flags[PHASE][pid][rank] = val on every peer: system-scope release (orders the pushes)."""
    for dst in fx.range_constexpr(TP):
        f = _peer(peers, dst) + P_FLAGS + ((_i64(pid) + PHASE * BLOCKS) * TP + _i64(rank)) * 4
        _xchg(fx.Int32, f, val, REL)


@_dev
def _wait_peers(peers, fault, pid, rank, e, timeout_ns, tl_row, PHASE, P_FLAGS, P_FBOX, TP, BLOCKS, SEEN0,
                TIMELINE):
    """Wait for flags[PHASE][pid][src] == e for every src on this rank's buffer, bounded.
    Skipped (one look only) once the rank has faulted in this launch."""
    mine = _peer(peers, rank)
    t0 = _now_ns()
    deadline = t0 + timeout_ns
    if _rank_faulted(fault, e):
        deadline = t0 - 1
    missing = fx.Int32(0)
    neg = fx.Int32(-1)
    for src in fx.range_constexpr(TP):
        f = mine + P_FLAGS + ((_i64(pid) + PHASE * BLOCKS) * TP + src) * 4
        v = _ld_acq(fx.Int32, f)
        t = t0
        done = (v == e) | (v == -e)
        while done == 0:
            _backoff()
            v = _ld_acq(fx.Int32, f)
            t = _now_ns()
            done = (v == e) | (v == -e) | (t > deadline) | _rank_faulted(fault, e)
        if const_expr(TIMELINE):
            _st(fx.Int64, tl_row + 8 * (SEEN0 + src), _now_ns())
        if v != e:
            if v == -e:
                if neg < 0:
                    neg = fx.Int32(src)
            else:
                missing = missing | (1 << src)
        if _rank_faulted(fault, e):
            deadline = t0 - 1
    now = _now_ns()
    if missing != 0:
        _record_fault(fault, peers, e, PHASE, rank, missing, now - t0, pid, now, P_FBOX, TP, True)
    else:
        if neg >= 0:
            # src gave up on somebody: its note in our fault_box says whom
            box = mine + P_FBOX + _i64(neg) * 32
            be = _ld_acq(fx.Int64, box)
            bm = _ld(fx.Int64, box + 8)
            mask = (be == _i64(e)).select(bm, fx.Int64(1) << _i64(neg))
            _record_fault(fault, peers, e, PHASE, rank, mask, now - t0, pid, now, P_FBOX, TP, False)


@_dev
def _grid_barrier(words, fault, peers, e, rank, timeout_ns, pid, tid, PHASE, BLOCKS, P_FBOX):
    """Generation barrier over the co-resident grid (agent scope): words[1] counts arrivals,
    words[2] is the generation. Always passed, even after a fault (bounded as a last resort)."""
    _cta_release(AGENT)
    fx.gpu.barrier()
    if tid == 0:
        g0 = _ld_acq(fx.Int32, words + 8, AGENT)
        old = fx.atomic_add(_ptr(fx.Int32, words + 4), fx.Int32(1), ordering=ACQREL, syncscope=AGENT)
        if old == BLOCKS - 1:
            _xchg(fx.Int32, words + 4, 0, RELAXED, AGENT)
            fx.atomic_add(_ptr(fx.Int32, words + 8), fx.Int32(1), ordering=REL, syncscope=AGENT)
        else:
            t0 = _now_ns()
            deadline = t0 + 4 * timeout_ns
            g = _ld_acq(fx.Int32, words + 8, AGENT)
            t = t0
            while (g == g0) & (t <= deadline):
                _backoff()
                g = _ld_acq(fx.Int32, words + 8, AGENT)
                t = _now_ns()
            if g == g0:
                _record_fault(fault, peers, e, PHASE, rank, 0, t - t0, pid, t, P_FBOX, 1, False)
    fx.gpu.barrier()
    _cta_acquire(AGENT)


# ---------------------------------------------------------------------------------------------
# host-side specialisation (plain Python)
# ---------------------------------------------------------------------------------------------
def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def geometry(key) -> dict:
    """Chunking of one build (an spec.FfnBuild) for this SIMT kernel."""
    m, blocks = key.model, key.blocks
    H, E, K, S = m.hidden, m.experts, m.top_k, key.tokens
    mode = key.experts.value
    i_r = m.intermediate_per_rank(key.tp, key.experts) if mode != "none" else 0
    nloc = m.experts_per_rank(key.tp, key.experts)
    ch = -(-H // blocks)  # columns per CTA (seam, stage 2, reduce)
    nch = -(-H // ch)
    lanes_groups = THREADS // LANES_PER_DOT
    if ch > lanes_groups:
        raise ValueError(f"hidden {H} over {blocks} CTAs: {ch} columns per CTA > {lanes_groups}")
    if H % 128 or (i_r and i_r % 128):
        raise ValueError("hidden and the per-rank intermediate must be multiples of 128")
    epc = -(-E // blocks)  # router experts per CTA
    nslot = min(S * K, nloc) if mode != "none" else 0
    return dict(S=S, H=H, E=E, K=K, I_R=i_r, MODE=MODES[mode], NLOC=nloc, TP=key.tp, MT=m.max_tokens,
                BLOCKS=blocks, CH=ch, NCH=nch, EPC=epc, EPL=-(-E // WAVE), NSLOT=nslot, EPS=float(m.eps))


def scratch_extra(key) -> list:
    """The kernel's own scratch regions (beside spec's fault/timeline/route/route_w)."""
    import torch
    g = geometry(key)
    S, H = g["S"], g["H"]
    out = [("h", torch.float32, (S, H)), ("x", torch.float32, (S, H)), ("ssq", torch.float32, (g["NCH"], S)),
           ("logits", torch.float32, (S, g["E"]))]
    if g["NSLOT"]:
        out.append(("act", torch.float32, (g["NSLOT"], S, g["I_R"])))
    return out


ARG_NAMES = ("part", "residual", "slots", "out", "res_out", "post_norm", "router", "router_bias", "w13", "s13",
             "w2", "s2", "scratch", "peers", "epoch", "inject", "timeout_ns", "rank", "first_expert", "final")


def build(key, layout: dict, peer: dict, name: str):
    """The @flyc.jit launcher of one width: (part, ..., final, stream) -> one launch of the grid.
    ``layout``/``peer``: spec scratch/peer layouts (name -> Region)."""
    g = geometry(key)
    S, H, E, K, I_R, MODE, TP, MT, BLOCKS = (g[k] for k in ("S", "H", "E", "K", "I_R", "MODE", "TP", "MT", "BLOCKS"))
    CH, NCH, EPC, EPL, NSLOT, EPS = (g[k] for k in ("CH", "NCH", "EPC", "EPL", "NSLOT", "EPS"))
    NT = I_R // 128 if I_R else 0  # 128-wide blocks of I_R (scale blocks; stage-2 k blocks)
    TILE1 = THREADS // LANES_PER_DOT  # stage-1 tile: 32 weight rows, one per dot group
    NT1 = I_R // TILE1 if I_R else 0
    KB_H = H // 128
    TIMELINE = bool(key.timeline)
    cols = {n: i for i, n in enumerate(stamp_names(TP))}
    NCOL = len(cols)
    C_START, C_END = cols["start"], cols["end"]
    C_SEAM_ARRIVE, C_SEAM_SEEN, C_SEAM_DONE = cols["seam_arrive"], cols["seam_seen0"], cols["seam_done"]
    C_ROUTER_DONE, C_EXPERTS_DONE = cols["router_done"], cols["experts_done"]
    C_RED_ARRIVE, C_RED_SEEN, C_RED_DONE = cols["reduce_arrive"], cols["reduce_seen0"], cols["reduce_done"]
    C_HS_ARRIVE, C_HS_SEEN, C_HS_DONE = cols["handshake_arrive"], cols["handshake_seen0"], cols["handshake_done"]
    PH_SEAM, PH_REDUCE, PH_HS = int(Phase.SEAM), int(Phase.REDUCE), int(Phase.HANDSHAKE)
    P_FLAGS, P_FBOX, P_SEAM, P_MOE = (peer[n].offset for n in ("flags", "fault_box", "seam", "moe"))
    SC = {n: (layout[n].offset if n in layout else 0)
          for n in ("fault", "timeline", "route", "route_w", "h", "x", "ssq", "logits", "act")}
    ROWB = MT * H * 2  # bytes of one rank's rows in a seam/moe slot
    NSL = max(1, NSLOT)
    ROWS_PER_WAVE = -(-S // (THREADS // WAVE))

    @fx.struct
    class Smem:
        bcast: fx.Array[fx.Int32, 4, 16]  # [0] active experts
        rstd: fx.Array[fx.Float32, 16, 16]
        hsq: fx.Array[fx.Float32, S * CH, 16]  # h^2 of the CTA's chunk (seam row sums)
        rt: fx.Array[fx.Int32, S * K, 16]  # chosen experts per row, sorted; -1 for padding rows
        rw: fx.Array[fx.Float32, S * K, 16]
        aflag: fx.Array[fx.Int32, EPL * WAVE, 16]  # expert active on this rank
        eslot: fx.Array[fx.Int32, EPL * WAVE, 16]  # its slot in elist
        elist: fx.Array[fx.Int32, NSL, 16]
        ewt: fx.Array[fx.Float32, NSL * S, 16]  # routing weight of (slot, row), 0 when not routed

    @flyc.kernel(name=name)
    def ffn_kernel(part: fx.Int64, residual: fx.Int64, slots: fx.Int64, out: fx.Int64, res_out: fx.Int64,
                   post_norm: fx.Int64, router: fx.Int64, router_bias: fx.Int64, w13: fx.Int64, s13: fx.Int64,
                   w2: fx.Int64, s2: fx.Int64, scratch: fx.Int64, peers: fx.Int64, epoch: fx.Int64,
                   inject: fx.Int64, timeout_ns: fx.Int64, rank: fx.Int32, first_expert: fx.Int32,
                   final: fx.Int32):
        tid = fx.thread_idx.x
        pid = fx.block_idx.x
        lane = fx.lane_id()
        wave = tid // WAVE
        grp = tid // LANES_PER_DOT  # dot group: 8 lanes
        ks = tid % LANES_PER_DOT
        lds = fx.SharedAllocator().allocate(Smem).peek()
        fault = scratch + SC["fault"]
        tl_row = scratch + SC["timeline"] + _i64(pid) * (NCOL * 8)
        words = epoch
        e = fx.atomic_add(_ptr(fx.Int32, words), fx.Int32(0), ordering=RELAXED, syncscope=AGENT) + 1
        e = (e <= 0).select(fx.Int32(1), e)  # 1..2^31-1: 0 is the cleared value, -e marks a fault
        par = _i64(e & 1)
        mine = _peer(peers, rank)
        c0 = pid * CH  # first column of this CTA's chunk
        hbase = scratch + SC["h"]
        xbase = scratch + SC["x"]

        # ------------------------------------------------------------------------------ A: seam
        if const_expr(TIMELINE):
            if tid == 0:
                _st(fx.Int64, tl_row + 8 * C_START, _now_ns())
        if tid == 0:
            if pid == 0:
                if _ld_acq(fx.Int64, fault + 8 * F["epoch"], AGENT) != _i64(e):
                    _st(fx.Int64, fault + 8 * F["valid"], fx.Int64(0))
            who = _ld(fx.Int32, inject)
            if who == rank + 1:
                delay = _i64(_ld(fx.Int32, inject + 4))
                ti0 = _now_ns()
                ti = ti0
                while ti - ti0 < delay:
                    _backoff()
                    ti = _now_ns()
        for i in range(tid, S * CH, THREADS):
            r = i // CH
            col = c0 + i % CH
            if col < H:
                off = (_i64(r) * H + _i64(col)) * 2
                v = _ld(fx.Int16, part + off)
                for dst in fx.range_constexpr(TP):
                    _st(fx.Int16, _peer(peers, dst) + P_SEAM + (par * TP + _i64(rank)) * ROWB + off, v)
        _cta_release()  # every wave's pushes are out (system scope) before the one-thread publish
        fx.gpu.barrier()
        if tid == 0:
            val = _rank_faulted(fault, e).select(-e, e)
            _publish(peers, pid, rank, val, PH_SEAM, P_FLAGS, TP, BLOCKS)
            if const_expr(TIMELINE):
                _st(fx.Int64, tl_row + 8 * C_SEAM_ARRIVE, _now_ns())
            _wait_peers(peers, fault, pid, rank, e, timeout_ns, tl_row, PH_SEAM, P_FLAGS, P_FBOX, TP, BLOCKS,
                        C_SEAM_SEEN, TIMELINE)
        fx.gpu.barrier()
        _cta_acquire()
        for i in range(tid, S * CH, THREADS):
            r = i // CH
            col = c0 + i % CH
            hv = fx.Float32(0.0)
            if col < H:
                off = _i64(r) * H + _i64(col)
                hv = _ld(fx.BFloat16, residual + off * 2).to(fx.Float32)
                for src in fx.range_constexpr(TP):  # rank order: every rank sums the same way
                    hv = hv + _ld(fx.BFloat16, mine + P_SEAM + (par * TP + src) * ROWB + off * 2).to(fx.Float32)
                _st(fx.BFloat16, res_out + off * 2, hv.to(fx.BFloat16))
                _st(fx.Float32, hbase + off * 4, hv)
            _lds_st(lds.hsq, i, hv * hv)
        fx.gpu.barrier()
        if tid < S:
            acc = fx.Float32(0.0)
            for c in fx.range_constexpr(CH):
                acc = acc + _lds_ld(lds.hsq, tid * CH + c)
            if pid < NCH:
                _st(fx.Float32, scratch + SC["ssq"] + (_i64(pid) * S + _i64(tid)) * 4, acc)
        if const_expr(TIMELINE):
            if tid == 0:
                _st(fx.Int64, tl_row + 8 * C_SEAM_DONE, _now_ns())
        _grid_barrier(words, fault, peers, e, rank, timeout_ns, pid, tid, PH_SEAM, BLOCKS, P_FBOX)

        # ------------------------------------------------------------------------------ B: norm + router
        if tid < S:
            ms = fx.Float32(0.0)
            for c in range(0, NCH):
                ms = ms + _ld(fx.Float32, scratch + SC["ssq"] + (_i64(c) * S + _i64(tid)) * 4)
            _lds_st(lds.rstd, tid, fx.rsqrt(ms / H + EPS))
        fx.gpu.barrier()
        for i in range(tid, S * CH, THREADS):
            r = i // CH
            col = c0 + i % CH
            if col < H:
                off = _i64(r) * H + _i64(col)
                pn = _ld(fx.Float32, post_norm + _i64(col) * 4)
                xv = _ld(fx.Float32, hbase + off * 4) * _lds_ld(lds.rstd, r) * pn
                _st(fx.Float32, xbase + off * 4, xv)
        for p0 in range(0, S * EPC, THREADS // LANES_PER_DOT):
            p = p0 + grp
            pv = p < S * EPC
            pc = pv.select(p, fx.Int32(0))
            r = pc // EPC
            ex = pid * EPC + pc % EPC
            ev = ex < E
            exc = ev.select(ex, fx.Int32(0))
            rs = _lds_ld(lds.rstd, r)
            acc = fx.Float32(0.0)
            for i in range(0, H // 32):
                k = _i64(i * 32 + ks * 4)
                hv = _ld_vec(fx.Float32, 4, hbase + (_i64(r) * H + k) * 4)
                pn = _ld_vec(fx.Float32, 4, post_norm + k * 4)
                rv = _ld_vec(fx.Float32, 4, router + (_i64(exc) * H + k) * 4)
                for q in fx.range_constexpr(4):
                    acc = acc + hv[q] * rs * pn[q] * rv[q]
            acc = _xor_sum8(acc)
            if pv & ev & (ks == 0):
                _st(fx.Float32, scratch + SC["logits"] + (_i64(r) * E + _i64(exc)) * 4, acc)
        _grid_barrier(words, fault, peers, e, rank, timeout_ns, pid, tid, PH_SEAM, BLOCKS, P_FBOX)

        # ------------------------------------------------------------------------------ C: top-k
        for i in range(tid, EPL * WAVE, THREADS):
            _lds_st(lds.aflag, i, fx.Int32(0))
        for i in range(tid, NSL * S, THREADS):
            _lds_st(lds.ewt, i, fx.Float32(0.0))
        for rr in fx.range_constexpr(ROWS_PER_WAVE):
            r = wave + rr * (THREADS // WAVE)
            rv_ = r < S
            rc = rv_.select(r, fx.Int32(0))
            bq = []
            sq = []
            eq = []
            for q in fx.range_constexpr(EPL):
                ex = lane + q * WAVE
                exv = ex < E
                exc = exv.select(ex, fx.Int32(0))
                sc = _sigmoid(_ld(fx.Float32, scratch + SC["logits"] + (_i64(rc) * E + _i64(exc)) * 4))
                b = sc + _ld(fx.Float32, router_bias + _i64(exc) * 4)
                bq.append(exv.select(b, fx.Float32(NEG_INF)))
                sq.append(sc)
                eq.append(ex)
            idx = []
            scs = []
            for kk in fx.range_constexpr(K):
                bv = bq[0]
                bi = eq[0]
                bs = sq[0]
                for q in fx.range_constexpr(1, EPL):
                    take = bq[q] > bv  # strict: the lower expert index keeps a tie
                    bv = take.select(bq[q], bv)
                    bi = take.select(eq[q], bi)
                    bs = take.select(sq[q], bs)
                for o in fx.range_constexpr(6):
                    ov = bv.shuffle_xor(1 << o, WAVE)
                    oi = bi.shuffle_xor(1 << o, WAVE)
                    os_ = bs.shuffle_xor(1 << o, WAVE)
                    take = (ov > bv) | ((ov == bv) & (oi < bi))
                    bv = take.select(ov, bv)
                    bi = take.select(oi, bi)
                    bs = take.select(os_, bs)
                idx.append(bi)
                scs.append(bs)
                for q in fx.range_constexpr(EPL):
                    bq[q] = (eq[q] == bi).select(fx.Float32(NEG_INF), bq[q])
            wsum = scs[0]
            for kk in fx.range_constexpr(1, K):
                wsum = wsum + scs[kk]
            slot = _ld(fx.Int64, slots + _i64(rc) * 8)
            live = rv_ & (slot >= 0)
            if rv_ & (lane == 0):
                for kk in fx.range_constexpr(K):
                    pos = fx.Int32(0)
                    for jj in fx.range_constexpr(K):
                        if const_expr(jj != kk):
                            pos = pos + (idx[jj] < idx[kk]).select(fx.Int32(1), fx.Int32(0))
                    ev_ = live.select(idx[kk], fx.Int32(-1))
                    wv_ = live.select(scs[kk] / wsum, fx.Float32(0.0))
                    _lds_st(lds.rt, r * K + pos, ev_)
                    _lds_st(lds.rw, r * K + pos, wv_)
                    if pid == 0:
                        _st(fx.Int32, scratch + SC["route"] + (_i64(r) * K + _i64(pos)) * 4, ev_)
                        _st(fx.Float32, scratch + SC["route_w"] + (_i64(r) * K + _i64(pos)) * 4, wv_)
        fx.gpu.barrier()
        # the rank's active experts (LOCAL: only its own), in expert order
        for i in range(tid, S * K, THREADS):
            ex = _lds_ld(lds.rt, i)
            mine_e = ex >= 0
            if const_expr(MODE == 1):
                mine_e = mine_e & (ex >= first_expert) & (ex < first_expert + g["NLOC"])
            if const_expr(MODE == 2):
                mine_e = ex < -1
            if mine_e:
                _lds_st(lds.aflag, ex, fx.Int32(1))
        fx.gpu.barrier()
        if wave == 0:
            base = fx.Int32(0)
            lt = (fx.Int64(1) << _i64(lane)) - 1
            for c in fx.range_constexpr(EPL):
                ex = lane + c * WAVE
                a = _lds_ld(lds.aflag, ex) != 0
                m = fx.Int64(rocdl_d.ballot(ir.IntegerType.get_signless(64), a.ir_value()))
                pos = base + fx.Int32(fx.ctpop(m & lt))
                if a:
                    _lds_st(lds.elist, pos, ex)
                    _lds_st(lds.eslot, ex, pos)
                base = base + fx.Int32(fx.ctpop(m))
            if lane == 0:
                _lds_st(lds.bcast, 0, base)
        fx.gpu.barrier()
        for i in range(tid, S * K, THREADS):
            ex = _lds_ld(lds.rt, i)
            exc = (ex >= 0).select(ex, fx.Int32(0))
            if (ex >= 0) & (_lds_ld(lds.aflag, exc) != 0):
                _lds_st(lds.ewt, _lds_ld(lds.eslot, exc) * S + i // K, _lds_ld(lds.rw, i))
        fx.gpu.barrier()
        n_act = _lds_ld(lds.bcast, 0)
        if const_expr(TIMELINE):
            if tid == 0:
                _st(fx.Int64, tl_row + 8 * C_ROUTER_DONE, _now_ns())

        # ------------------------------------------------------------------------------ C: experts stage 1
        if const_expr(MODE != 2):
            act = scratch + SC["act"]
            for w in range(pid, n_act * NT1, BLOCKS):  # work item: (active expert j, 32-row tile t)
                j = w // NT1
                t = w % NT1
                ex = _lds_ld(lds.elist, j)
                le = _i64(ex)
                if const_expr(MODE == 1):
                    le = _i64(ex - first_expert)
                wbase = w13 + le * (2 * I_R * H)
                sbase = s13 + le * ((2 * I_R // 128) * KB_H * 4)
                rg = _i64(t * TILE1 + grp)  # this dot group's w1 (gate) row; w3 (up) is I_R further
                sgrow = sbase + _i64(t // (128 // TILE1)) * (KB_H * 4)  # its 128-row scale block
                surow = sgrow + NT * (KB_H * 4)
                for r in fx.range_constexpr(S):
                    wr = _lds_ld(lds.ewt, j * S + r)
                    if wr != 0.0:  # only the rows routed to this expert (uniform branch)
                        accg = fx.Float32(0.0)
                        accu = fx.Float32(0.0)
                        for kb in range(0, KB_H):
                            k0 = _i64(kb * 128 + ks * 16)
                            wg = _ld_vec(fx.Int32, 4, wbase + rg * H + k0)
                            wu = _ld_vec(fx.Int32, 4, wbase + (rg + I_R) * H + k0)
                            dg = fx.Float32(0.0)
                            du = fx.Float32(0.0)
                            for q in fx.range_constexpr(4):
                                xv = _ld_vec(fx.Float32, 4, xbase + (_i64(r * H) + k0 + q * 4) * 4)
                                fg = _fp8x4_to_f32(wg[q])
                                fu = _fp8x4_to_f32(wu[q])
                                for c in fx.range_constexpr(4):
                                    dg = dg + fg[c] * xv[c]
                                    du = du + fu[c] * xv[c]
                            sg = _ld(fx.Float32, sgrow + _i64(kb) * 4)
                            su = _ld(fx.Float32, surow + _i64(kb) * 4)
                            accg = accg + dg * (sg * TWO_120)
                            accu = accu + du * (su * TWO_120)
                        accg = _xor_sum8(accg)
                        accu = _xor_sum8(accu)
                        if ks == 0:
                            a = _silu(accg) * accu * wr
                            _st(fx.Float32, act + ((_i64(j) * S + r) * I_R + rg) * 4, a)
        _grid_barrier(words, fault, peers, e, rank, timeout_ns, pid, tid, PH_REDUCE, BLOCKS, P_FBOX)

        # ------------------------------------------------------------------------------ D: stage 2 + reduce
        cl = grp  # this thread's column within the chunk
        col = c0 + cl
        cv = (cl < CH) & (col < H)
        colc = cv.select(col, fx.Int32(0))
        y = [fx.Float32(0.0)] * S
        if const_expr(MODE != 2):
            act = scratch + SC["act"]
            for j in range(0, n_act):
                ex = _lds_ld(lds.elist, j)
                le = _i64(ex)
                if const_expr(MODE == 1):
                    le = _i64(ex - first_expert)
                wrow = w2 + (le * H + _i64(colc)) * I_R
                srow = s2 + (le * KB_H + _i64(colc // 128)) * (NT * 4)
                for r in fx.range_constexpr(S):
                    wr = _lds_ld(lds.ewt, j * S + r)
                    if wr != 0.0:
                        acc = fx.Float32(0.0)
                        for kb in range(0, NT):
                            k0 = _i64(kb * 128 + ks * 16)
                            wq = _ld_vec(fx.Int32, 4, wrow + k0)
                            d = fx.Float32(0.0)
                            for q in fx.range_constexpr(4):
                                av = _ld_vec(fx.Float32, 4, act + ((_i64(j) * S + r) * I_R + k0 + q * 4) * 4)
                                fw = _fp8x4_to_f32(wq[q])
                                for c in fx.range_constexpr(4):
                                    d = d + fw[c] * av[c]
                            acc = acc + d * (_ld(fx.Float32, srow + _i64(kb) * 4) * TWO_120)
                        y[r] = y[r] + acc
        for r in fx.range_constexpr(S):
            yr = _xor_sum8(y[r])
            if cv & (ks == 0):
                off = (_i64(r) * H + _i64(col)) * 2
                for dst in fx.range_constexpr(TP):
                    _st(fx.BFloat16, _peer(peers, dst) + P_MOE + (par * TP + _i64(rank)) * ROWB + off,
                        yr.to(fx.BFloat16))
        if const_expr(TIMELINE):
            if tid == 0:
                _st(fx.Int64, tl_row + 8 * C_EXPERTS_DONE, _now_ns())
        _cta_release()
        fx.gpu.barrier()
        if tid == 0:
            val = _rank_faulted(fault, e).select(-e, e)
            _publish(peers, pid, rank, val, PH_REDUCE, P_FLAGS, TP, BLOCKS)
            if const_expr(TIMELINE):
                _st(fx.Int64, tl_row + 8 * C_RED_ARRIVE, _now_ns())
            _wait_peers(peers, fault, pid, rank, e, timeout_ns, tl_row, PH_REDUCE, P_FLAGS, P_FBOX, TP, BLOCKS,
                        C_RED_SEEN, TIMELINE)
        fx.gpu.barrier()
        _cta_acquire()
        for i in range(tid, S * CH, THREADS):
            r = i // CH
            ocol = c0 + i % CH
            if ocol < H:
                off = _i64(r) * H + _i64(ocol)
                o = fx.Float32(0.0)
                for src in fx.range_constexpr(TP):
                    o = o + _ld(fx.BFloat16, mine + P_MOE + (par * TP + src) * ROWB + off * 2).to(fx.Float32)
                _st(fx.BFloat16, out + off * 2, o.to(fx.BFloat16))
        if const_expr(TIMELINE):
            if tid == 0:
                _st(fx.Int64, tl_row + 8 * C_RED_DONE, _now_ns())

        # ------------------------------------------------------------------------------ E: handshake, end
        if tid == 0:
            if final != 0:
                val = _rank_faulted(fault, e).select(-e, e)
                _publish(peers, pid, rank, val, PH_HS, P_FLAGS, TP, BLOCKS)
                if const_expr(TIMELINE):
                    _st(fx.Int64, tl_row + 8 * C_HS_ARRIVE, _now_ns())
                _wait_peers(peers, fault, pid, rank, e, timeout_ns, tl_row, PH_HS, P_FLAGS, P_FBOX, TP, BLOCKS,
                            C_HS_SEEN, TIMELINE)
                if const_expr(TIMELINE):
                    _st(fx.Int64, tl_row + 8 * C_HS_DONE, _now_ns())
            if const_expr(TIMELINE):
                _st(fx.Int64, tl_row + 8 * C_END, _now_ns())
            # last CTA out moves the epoch on (also after a fault)
            n_out = fx.atomic_add(_ptr(fx.Int32, words + 12), fx.Int32(1), ordering=ACQREL, syncscope=AGENT)
            if n_out == BLOCKS - 1:
                _xchg(fx.Int32, words + 12, 0, RELAXED, AGENT)
                _xchg(fx.Int32, words, e, REL)

    @flyc.jit
    def launch(part: fx.Int64, residual: fx.Int64, slots: fx.Int64, out: fx.Int64, res_out: fx.Int64,
               post_norm: fx.Int64, router: fx.Int64, router_bias: fx.Int64, w13: fx.Int64, s13: fx.Int64,
               w2: fx.Int64, s2: fx.Int64, scratch: fx.Int64, peers: fx.Int64, epoch: fx.Int64,
               inject: fx.Int64, timeout_ns: fx.Int64, rank: fx.Int32, first_expert: fx.Int32, final: fx.Int32,
               stream: fx.Stream = fx.Stream(None)):
        ffn_kernel(part, residual, slots, out, res_out, post_norm, router, router_bias, w13, s13, w2, s2, scratch,
                   peers, epoch, inject, timeout_ns, rank, first_expert, final).launch(
            grid=(BLOCKS, 1, 1), block=(THREADS, 1, 1), stream=stream)

    return launch, g


def build_clock():
    """A one-thread launcher that stores s_memrealtime x 10 (ns) at an address (Runner.clock_ns)."""

    @flyc.kernel(name="ffn_clock")
    def clock_kernel(out: fx.Int64):
        _st(fx.Int64, out, _now_ns())

    @flyc.jit
    def launch_clock(out: fx.Int64, stream: fx.Stream = fx.Stream(None)):
        clock_kernel(out).launch(grid=(1, 1, 1), block=(1, 1, 1), stream=stream)

    return launch_clock
