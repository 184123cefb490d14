"""The fused kernel's synchronisation (device helpers): the clocks, flags published to every peer,
bounded waits on peers and on this GPU's own counters, the fault record and fault box, and the grid
barrier. Every wait is bounded by the launch's timeout; a spin polls with an atomic (a plain
tl.load spin is deleted or hoisted by the compiler: notes/triton-kernel.md)."""
import triton
import triton.language as tl


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
def _clear_sync(scratch, pid, SC_SYNC: tl.constexpr, SEG: tl.constexpr, SEGP2: tl.constexpr, NSYNC: tl.constexpr):
    """The expert phases' counters, cleared before the grid barrier that precedes their every use
    (a stale or poisoned value from an aborted launch cannot leak in)."""
    sq = pid * SEG + tl.arange(0, SEGP2)
    tl.store(_as(scratch, SC_SYNC, tl.int32) + sq, tl.zeros((SEGP2,), tl.int32),
             mask=(tl.arange(0, SEGP2) < SEG) & (sq < NSYNC))


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
                  WRITE_BOX: tl.constexpr):
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
        tl.debug_barrier()
        tl.atomic_xchg(fault + F_VALID, 1, sem="release", scope="sys")


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
def _expire(n, t0, deadline, fault, e, IS_HIP: tl.constexpr, INTERP: tl.constexpr, CHK: tl.constexpr):
    """A wait's deadline after its n-th look: every CHK looks (the first at once, so a rank that
    has faulted takes one look only) the clock and the fault marker are read, and past the
    deadline or once faulted the wait has expired (t0 - 1)."""
    if n % CHK == 0:
        t = now_u(IS_HIP, INTERP)
        if (t > deadline) | _rank_faulted(fault, e):
            deadline = t0 - 1
    return deadline


@triton.jit
def _late(tag, e, src, missing, neg):
    """A wait's verdict on ``src``: missing (no e seen by the deadline) or, first of its kind, the
    rank that published -e (it has faulted)."""
    if tag != e:
        if tag == -e:
            if neg < 0:
                neg = src
        else:
            missing = missing | (1 << src)
    return missing, neg


@triton.jit
def _look(p, m2, e, LL: tl.constexpr, VALS: tl.constexpr):
    """One look at a source (_read) and its tag (_tag); VALS (LL): the words' values as bf16, not
    the 64-bit words (what _wait_rows carries: a CTA holds 4096 words a row)."""
    v = _read(p, m2, LL)
    if VALS:
        x = (v & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        x = v
    return x, _tag(v, m2, e, LL)


@triton.jit
def _poll_source(p, m2, e, t0, deadline, fault, IS_HIP: tl.constexpr, INTERP: tl.constexpr, CHK: tl.constexpr,
                 LL: tl.constexpr, VALS: tl.constexpr):
    """Look at one source until it carries e or -e or the wait expires (_expire): its last look
    (_look) and tag, and the deadline (t0 - 1 once expired)."""
    v, tag = _look(p, m2, e, LL, VALS)
    done = (tag == e) | (tag == -e)
    n = 0
    while not done:
        deadline = _expire(n, t0, deadline, fault, e, IS_HIP, INTERP, CHK)
        if deadline < t0:
            done = True
        else:
            _backoff(IS_HIP, INTERP)
            v, tag = _look(p, m2, e, LL, VALS)
            done = (tag == e) | (tag == -e)
            n += 1
    return v, tag, deadline


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
            v, tag, deadline = _poll_source(p, m2, e, t0, deadline, fault, IS_HIP, INTERP, CHK, LL, False)
            missing, neg = _late(tag, e, src, missing, neg)
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
def _wait_rows(peers, fault, pid, rank, e, timeout_ns, offs, m2, own, base, PHASE: tl.constexpr,
               P_FBOX: tl.constexpr, TP: tl.constexpr, SLOT: tl.constexpr, IS_HIP: tl.constexpr,
               INTERP: tl.constexpr, CHK: tl.constexpr):
    """(FR at TP > 1, LL) Every rank's whole rows ``offs`` [RT, HP2] summed in rank order (the
    seam's sum of each chunk, for every chunk), once each peer's tagged words in its slot (base +
    src x SLOT bytes) all carry e, bounded as _wait_peers (a rank that has faulted takes one
    look; the first fault is the one recorded). This rank's own term is ``own`` (its part, bf16):
    its slot's other chunks are other CTAs' pushes, maybe not made yet. _wait_peers' _poll_source,
    a look keeping the words' values as bf16 (_look's VALS): carried as 64-bit words they spilled
    minimax-m2's TP2 build."""
    mine = _peer_base(peers, rank)
    t0 = now_u(IS_HIP, INTERP)
    deadline = t0 + timeout_ns
    if INTERP:
        deadline = t0 - 1
    missing = tl.zeros((), tl.int32)
    neg = tl.zeros((), tl.int32) - 1
    acc = tl.zeros(offs.shape, tl.float32)
    for src in tl.static_range(TP):
        if src == rank:
            acc += own.to(tl.float32)
        else:
            p = _as(mine, base + src * SLOT, tl.int64) + offs
            x, tag, deadline = _poll_source(p, m2, e, t0, deadline, fault, IS_HIP, INTERP, CHK, True, True)
            missing, neg = _late(tag, e, src, missing, neg)
            acc += x.to(tl.float32)
    tl.debug_barrier()
    if (missing != 0) | (neg >= 0):
        _wait_fault(fault, peers, mine, e, PHASE, rank, missing, neg, now_u(IS_HIP, INTERP) - t0, pid, P_FBOX, TP,
                    IS_HIP, INTERP)
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
                CHK: tl.constexpr):
    """Wait until the GPU-local counter *ptr reaches target."""
    v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    _spin_count(ptr, v, 0, target, fault, e, rank, timeout_ns, pid, PH_REDUCE, IS_HIP, INTERP, CHK)
    tl.debug_barrier()


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
                INTERP: tl.constexpr, CHK: tl.constexpr):
    """Spin until the GPU-local counter *ptr has grown by ``need`` from ``base`` (v: its last value
    read). The count is work of other CTAs of this launch and always arrives, so the bound, 4x
    timeout, is a last resort that records a fault; the clock is read every CHK polls."""
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
            _record_fault(fault, fault, e, PHASE, rank, 0, t - t0, pid, t, 0, 1, False)


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
