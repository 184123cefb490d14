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
              (PK) w13 as the runner packs it: each K step's gate and up blocks contiguous.
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
B is empty and one grid barrier (not two) precedes the top-k, which every CTA makes. At TP > 1
FR is off unless asked for (FFNQ_TRITON_TUNE=FR=1; one token; not timed yet): there each CTA also
waits for every peer's whole row, tagged words in its seam slot, and sums it with its own in rank
order (sync._wait_rows).

Epoch words (peer buffer "epoch", int32[4]): [0] epoch of the last launch, [1] this launch's
arrivals at the grid barriers, [3] exit count (staged launches); [2] is FlyDSL's. Flags hold
e (or -e once this rank faulted in this launch); a wait matches == e exactly. Every cross-GPU
wait is bounded by timeout_ns from the start of that phase's wait; on expiry the first faulting
CTA writes the scratch fault record and fault_box[rank] on every peer, and every later wait of
the rank is skipped (the rank-wide marker is fault[epoch] == e). Grid barriers are always passed.

STAGE = 0 runs everything in one launch. STAGE > 0 runs one part per launch with no grid
barrier (the launch boundary is the barrier), in the order geometry.STAGES: the interpreter
(TRITON_INTERPRET=1) runs CTAs one after another, so only that split can run there. Every
publish is in a stage before its wait (1 -> 6, 5 -> 7, 7 -> 8), so several ranks in one process
can run stage by stage, interleaved (a TP2 check on a CPU).
"""
import triton
import triton.language as tl

from ffnq.backends.triton.sync import (F_EPOCH, F_VALID, PH_HANDSHAKE, PH_REDUCE, PH_SEAM, _as, _backoff,
    _clear_sync, _gather, _grid_barrier, _publish, _rank_faulted, _send, _spin_count, _stamp, _wait_count,
    _wait_peers, _wait_prefix, _wait_rows, now_ns, now_u)
from ffnq.backends.triton.tiles import (_fp8, _fr_rows, _fr_weights, _mma_sc, _post_norm_all, _store_route, _store_x,
    _topk, _xsig, _xsig_of)
from ffnq.backends.triton.items import _claim, _next_item, _s2_header


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
    SC_INV: tl.constexpr, PK: tl.constexpr,
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
            if SOLO | (TP == 1):
                hf = fr_res.to(tl.float32) + fr_part.to(tl.float32)  # [RT, HP2], as the chunk's h
            else:
                # (TP > 1, LL) every peer's whole rows, once all their tagged words are in (this
                # CTA's chunk is), summed in rank order with this rank's own: the chunk's h again
                fc = tl.arange(0, HP2)
                hf = fr_res.to(tl.float32) + _wait_rows(
                    peers, fault, pid, rank, e, timeout_ns, rows_r[:, None] * H + fc[None, :],
                    rmask_r[:, None] & (fc < H)[None, :], fr_part, P_SEAM_LL + (par * TP * MT) * H * 8, PH_SEAM,
                    P_FBOX, TP, MT * H * 8, IS_HIP, INTERP, CHK)
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
                if PK:
                    # (PK) w13 tile-packed by the runner (runner.packed_w13): each K step's [BN, 128]
                    # gate block and then its up block one contiguous 2 x BN x 128 bytes
                    pbase = w13 + le * (2 * I_R * H) + (t * (H // BK) + kb // BK) * (2 * BN * BK)
                    blk = nn[:, None] * BK + kc2[None, :]
                    for k0 in tl.range(0, KSTEP, BK, num_stages=NS):
                        xk = tl.load(xb + xo2 + kb + k0, mask=xm2, other=0.0)  # x terms^T tile [BK, NX*SP]
                        wg = tl.load(pbase + (k0 // BK) * (2 * BN * BK) + blk)
                        wu = tl.load(pbase + (k0 // BK) * (2 * BN * BK) + BN * BK + blk)
                        sg = tl.load(sbase + ((t * BN) // 128) * (H // 128) + k0 // 128) * SHIFT
                        su = tl.load(sbase + ((I_R + t * BN) // 128) * (H // 128) + k0 // 128) * SHIFT
                        acc_g = _mma_sc(wg, sg, xk, acc_g, INTERP, IS_HIP, SACC)
                        acc_u = _mma_sc(wu, su, xk, acc_u, INTERP, IS_HIP, SACC)
                else:
                    for k0 in tl.range(0, KSTEP, BK, num_stages=NS):
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
            if A8:
                # SQ2 token columns per term: the tokens' own count (at least 4), not stage 1's SQ
                # (16 below 7 tokens); A8T x SQ2 < 16 compiles to fp16 mma.sync (see geometry, SQ2)
                rq2 = tl.arange(0, SQ2)
                kn = tl.arange(0, BN)
                c8 = tl.arange(0, A8T * SQ2)
                tw8 = tl.exp2((c8 // SQ2) * -4.0)  # term t counts 16^-t
            _stamp(sub_row, 4, IS_HIP, INTERP, TIMELINE)
            if DQ:
                # one queue for both stages: the item stage 1's last claim took (or pid), so the
                # CTAs free first take the first experts' stage-2 items, whose tiles are done first
                # (the fused launch, STAGE 0: w, where stage 1's loop left it)
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
                if A8:
                    # fp8 x fp8 as stage 1: [BH, BN] w2 codes @ [BN, 4 x SQ2] act terms per stage-1 tile,
                    # each product times w2's block scale x the tile's act scale
                    yt8 = tl.zeros((BH, A8T * SQ2), tl.float32)
                    # A8 = 2: steps of 128 (two stage-1 tiles, an MMA each); A8 = 1: steps of one tile
                    A8K: tl.constexpr = BN if A8 == 1 else 128
                    for k0 in tl.range(0, I_R // KH, A8K, num_stages=NS2):
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
