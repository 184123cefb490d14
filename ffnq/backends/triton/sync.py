"""The fused kernel's synchronisation (device helpers): the clocks, flags published to every peer,
bounded waits on peers and on this GPU's own counters, the fault record and fault box, and the grid
barrier. Every wait is bounded by the launch's timeout; a spin polls with an atomic (a plain
tl.load has no side effect, so the compiler deletes a spin on it or hoists the load out)."""
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
    return tl.inline_asm_elementwise("s_memrealtime $0\n s_waitcnt lgkmcnt(0)", "=s", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


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
            tl.inline_asm_elementwise("s_sleep 1\n v_mov_b32 $0, 0", "=v", [], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("nanosleep.u32 32;\n mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                      pack=1)


@triton.jit
def _clear_sync(scratch, pid, SC_COUNTERS: tl.constexpr, CLEAR_SPAN: tl.constexpr, CLEAR_SPAN_P2: tl.constexpr,
                COUNTERS: tl.constexpr):
    """The expert phases' counters, cleared before the grid barrier that precedes their every use
    (a stale or poisoned value from an aborted launch cannot leak in)."""
    sq = pid * CLEAR_SPAN + tl.arange(0, CLEAR_SPAN_P2)
    tl.store(_as(scratch, SC_COUNTERS, tl.int32) + sq, tl.zeros((CLEAR_SPAN_P2,), tl.int32),
             mask=(tl.arange(0, CLEAR_SPAN_P2) < CLEAR_SPAN) & (sq < COUNTERS))


@triton.jit
def _poll(ptr, SEM: tl.constexpr):
    # a scalar RMW: one thread, broadcast to the CTA, re-read every iteration (not a tl.load spin)
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
def _record_fault(fault, peers, e, phase, rank, mask, waited, pid, at, PEER_FAULT_BOX: tl.constexpr, TP: tl.constexpr,
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
                box = _as(_peer_base(peers, dst), PEER_FAULT_BOX + rank.to(tl.int64) * 32, tl.int64)
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
def _publish(peers, pid, rank, val, PHASE: tl.constexpr, PEER_FLAGS: tl.constexpr, TP: tl.constexpr,
             FLAG_CTAS: tl.constexpr, INTERP: tl.constexpr, FENCE: tl.constexpr):
    # FENCE: every thread fences its own pushes (in parallel), then one relaxed flag per peer: one
    # round trip to the peers, not a release (a fence) per flag each waiting for the last flag
    if FENCE:
        _fence_sys(INTERP)
    tl.debug_barrier()  # every thread's pushes happen-before the (one-thread) flags
    for dst in tl.static_range(TP):
        f = _as(_peer_base(peers, dst), PEER_FLAGS + ((PHASE * FLAG_CTAS + pid) * TP + rank) * 4, tl.int32)
        tl.atomic_xchg(f, val, sem="relaxed" if FENCE else "release", scope="sys")


@triton.jit
def _read(ptr, m2, TAGGED_WORDS: tl.constexpr):
    """One look at a peer's arrival: its flag (an acquire poll) or (TAGGED_WORDS) its tagged words."""
    if TAGGED_WORDS:
        v = tl.load(ptr, mask=m2, other=0, volatile=True)
    else:
        v = _poll(ptr, "acquire")
    return v


@triton.jit
def _tag(v, m2, e, TAGGED_WORDS: tl.constexpr):
    """What a look saw: the flag itself; TAGGED_WORDS: e once every word carries e, -e if one carries -e
    (the peer faulted), else 0 (not yet)."""
    t = v
    if TAGGED_WORDS:
        fl = (v >> 32).to(tl.int32)
        late = tl.sum(tl.where(m2 & (fl != e), 1, 0))
        t = e + late * 0
        if late != 0:
            t = tl.where(tl.sum(tl.where(m2 & (fl == -e), 1, 0)) != 0, -e, 0)
    return t


@triton.jit
def _expire(n, t0, deadline, fault, e, IS_HIP: tl.constexpr, INTERP: tl.constexpr, POLLS_PER_CLOCK: tl.constexpr):
    """A wait's deadline after its n-th look: every POLLS_PER_CLOCK looks (the first at once, so a rank that
    has faulted takes one look only) the clock and the fault marker are read, and past the
    deadline or once faulted the wait has expired (t0 - 1)."""
    if n % POLLS_PER_CLOCK == 0:
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
def _look(p, m2, e, TAGGED_WORDS: tl.constexpr, VALS: tl.constexpr):
    """One look at a source (_read) and its tag (_tag); VALS (tagged words): the words' values as bf16, not
    the 64-bit words (what _wait_rows carries: a CTA holds 4096 words a row)."""
    v = _read(p, m2, TAGGED_WORDS)
    if VALS:
        x = (v & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        x = v
    return x, _tag(v, m2, e, TAGGED_WORDS)


@triton.jit
def _poll_source(p, m2, e, t0, deadline, fault, IS_HIP: tl.constexpr, INTERP: tl.constexpr,
                 POLLS_PER_CLOCK: tl.constexpr, TAGGED_WORDS: tl.constexpr, VALS: tl.constexpr):
    """Look at one source until it carries e or -e or the wait expires (_expire): its last look
    (_look) and tag, and the deadline (t0 - 1 once expired)."""
    v, tag = _look(p, m2, e, TAGGED_WORDS, VALS)
    done = (tag == e) | (tag == -e)
    n = 0
    while not done:
        deadline = _expire(n, t0, deadline, fault, e, IS_HIP, INTERP, POLLS_PER_CLOCK)
        if deadline < t0:
            done = True
        else:
            _backoff(IS_HIP, INTERP)
            v, tag = _look(p, m2, e, TAGGED_WORDS, VALS)
            done = (tag == e) | (tag == -e)
            n += 1
    return v, tag, deadline


@triton.jit
def _wait_peers(peers, fault, pid, rank, e, timeout_ns, tl_row, offs, m2, base, PHASE: tl.constexpr,
                PEER_FLAGS: tl.constexpr, PEER_FAULT_BOX: tl.constexpr, TP: tl.constexpr, FLAG_CTAS: tl.constexpr,
                SLOT_BYTES: tl.constexpr, SEEN_COL: tl.constexpr, IS_HIP: tl.constexpr, INTERP: tl.constexpr,
                TIMELINE: tl.constexpr, POLLS_PER_CLOCK: tl.constexpr, TAGGED_WORDS: tl.constexpr):
    """Wait for every peer's arrival on this rank's buffer, bounded: flags[PHASE][pid][src] == e,
    or (TAGGED_WORDS) every tagged word of this CTA's chunk ``offs`` in src's slot (base + src x SLOT_BYTES)
    carrying e. An arrival already there costs one look; this CTA's own none (it wrote it, before
    the CTA barrier of its send); the clock and the fault marker are read only once a peer is late,
    then every POLLS_PER_CLOCK looks, so a rank that has faulted in this launch takes one look only. TAGGED_WORDS:
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
        if TAGGED_WORDS:
            p = _as(mine, base + src * SLOT_BYTES, tl.int64) + offs
        else:
            p = _as(mine, PEER_FLAGS + ((PHASE * FLAG_CTAS + pid) * TP + src) * 4, tl.int32)
        if src != rank:
            v, tag, deadline = _poll_source(p, m2, e, t0, deadline, fault, IS_HIP, INTERP, POLLS_PER_CLOCK,
                                            TAGGED_WORDS, False)
            missing, neg = _late(tag, e, src, missing, neg)
        elif TAGGED_WORDS:
            v = _read(p, m2, TAGGED_WORDS)
        if TAGGED_WORDS:
            acc += (v & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
        _stamp(tl_row, SEEN_COL + src, IS_HIP, INTERP, TIMELINE)
    tl.debug_barrier()
    if (missing != 0) | (neg >= 0):
        _wait_fault(fault, peers, mine, e, PHASE, rank, missing, neg, now_u(IS_HIP, INTERP) - t0, pid, PEER_FAULT_BOX,
                    TP, IS_HIP, INTERP)
    return acc


@triton.jit
def _push_ll(peers, base, offs, m2, v, val, TP: tl.constexpr, INTERP: tl.constexpr):
    """Tagged-word exchange: every bf16 of v [ROW_PAD, C] to every rank's buffer (region offset ``base``, this
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
def _send(peers, pid, rank, par, v, val, offs, m2, PEER_BUF: tl.constexpr, PEER_TAGGED: tl.constexpr,
          PHASE: tl.constexpr, PEER_FLAGS: tl.constexpr, TP: tl.constexpr, MAX_TOKENS: tl.constexpr,
          HIDDEN: tl.constexpr, FLAG_CTAS: tl.constexpr, INTERP: tl.constexpr, FENCE: tl.constexpr,
          TAGGED_WORDS: tl.constexpr):
    """One exchange's send: this CTA's chunk v [ROW_PAD, C] (bf16) to this rank's slot on every rank,
    tagged val (e, or -e after a fault): as tagged words, or as values and then one flag per peer."""
    if TAGGED_WORDS:
        _push_ll(peers, PEER_TAGGED + ((par * TP + rank) * MAX_TOKENS) * HIDDEN * 8, offs, m2, v, val, TP, INTERP)
    else:
        for dst in tl.static_range(TP):
            tl.store(_as(_peer_base(peers, dst), PEER_BUF + ((par * TP + rank) * MAX_TOKENS) * HIDDEN * 2,
                         tl.bfloat16) + offs, v,
                     mask=m2)
        _publish(peers, pid, rank, val, PHASE, PEER_FLAGS, TP, FLAG_CTAS, INTERP, FENCE)


@triton.jit
def _gather(peers, fault, pid, rank, e, timeout_ns, tl_row, par, offs, m2, PEER_BUF: tl.constexpr,
            PEER_TAGGED: tl.constexpr, PHASE: tl.constexpr, PEER_FLAGS: tl.constexpr, PEER_FAULT_BOX: tl.constexpr,
            TP: tl.constexpr, MAX_TOKENS: tl.constexpr, HIDDEN: tl.constexpr, FLAG_CTAS: tl.constexpr,
            SEEN_COL: tl.constexpr, IS_HIP: tl.constexpr, INTERP: tl.constexpr, TIMELINE: tl.constexpr,
            POLLS_PER_CLOCK: tl.constexpr, TAGGED_WORDS: tl.constexpr):
    """The matching receive, after a bounded wait: the fp32 sum of every rank's chunk in rank
    order (every rank sums the same values the same way)."""
    acc = _wait_peers(peers, fault, pid, rank, e, timeout_ns, tl_row, offs, m2,
                      PEER_TAGGED + (par * TP * MAX_TOKENS) * HIDDEN * 8, PHASE, PEER_FLAGS, PEER_FAULT_BOX, TP,
                      FLAG_CTAS, MAX_TOKENS * HIDDEN * 8, SEEN_COL, IS_HIP, INTERP, TIMELINE, POLLS_PER_CLOCK,
                      TAGGED_WORDS)
    if not TAGGED_WORDS:
        mine = _peer_base(peers, rank)
        for src in tl.static_range(TP):
            buf = _as(mine, PEER_BUF + ((par * TP + src) * MAX_TOKENS) * HIDDEN * 2, tl.bfloat16)
            acc += tl.load(buf + offs, mask=m2, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _wait_rows(peers, fault, pid, rank, e, timeout_ns, offs, m2, own, base, PHASE: tl.constexpr,
               PEER_FAULT_BOX: tl.constexpr, TP: tl.constexpr, SLOT_BYTES: tl.constexpr, IS_HIP: tl.constexpr,
               INTERP: tl.constexpr, POLLS_PER_CLOCK: tl.constexpr):
    """(FULL_ROWS at TP > 1) Every rank's whole rows ``offs`` [ROW_TILE, HIDDEN_P2] summed in rank order (the
    seam's sum of each chunk, for every chunk), once each peer's tagged words in its slot (base +
    src x SLOT_BYTES) all carry e, bounded as _wait_peers (a rank that has faulted takes one
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
            p = _as(mine, base + src * SLOT_BYTES, tl.int64) + offs
            x, tag, deadline = _poll_source(p, m2, e, t0, deadline, fault, IS_HIP, INTERP, POLLS_PER_CLOCK, True, True)
            missing, neg = _late(tag, e, src, missing, neg)
            acc += x.to(tl.float32)
    tl.debug_barrier()
    if (missing != 0) | (neg >= 0):
        _wait_fault(fault, peers, mine, e, PHASE, rank, missing, neg, now_u(IS_HIP, INTERP) - t0, pid, PEER_FAULT_BOX,
                    TP, IS_HIP, INTERP)
    return acc


@triton.jit
def _wait_fault(fault, peers, mine, e, PHASE: tl.constexpr, rank, missing, neg, waited, pid,
                PEER_FAULT_BOX: tl.constexpr, TP: tl.constexpr, IS_HIP: tl.constexpr, INTERP: tl.constexpr):
    """The fault record of a wait that missed ranks (``missing``) or saw -e from ``neg``."""
    if missing != 0:
        _record_fault(fault, peers, e, PHASE, rank, missing, waited, pid, now_ns(IS_HIP, INTERP), PEER_FAULT_BOX, TP,
                      True)
    else:
        # src gave up on somebody: its note in our fault_box says whom
        box = _as(mine, PEER_FAULT_BOX + neg.to(tl.int64) * 32, tl.int64)
        be = tl.atomic_add(box, 0, sem="acquire", scope="sys")
        bm = tl.load(box + 1)
        mask = tl.where(be == e.to(tl.int64), bm, (1 << neg).to(tl.int64))
        _record_fault(fault, peers, e, PHASE, rank, mask, waited, pid, now_ns(IS_HIP, INTERP), PEER_FAULT_BOX, TP,
                      False)


@triton.jit
def _grid_barrier(words, fault, e, rank, timeout_ns, pid, PHASE: tl.constexpr, BLOCKS: tl.constexpr,
                  IS_HIP: tl.constexpr, INTERP: tl.constexpr, STAGE: tl.constexpr, POLLS_PER_CLOCK: tl.constexpr,
                  LAST: tl.constexpr):
    """Barrier over the co-resident grid, always passed, even after a fault (bounded as a last
    resort). words[1] counts this launch's arrivals from 0: the first barrier is passed at BLOCKS,
    the LAST (LAST = n: the launch's n-th and last barrier; 0: not the last) at n x BLOCKS, whose
    last arrival sets the count back to 0 (a release; the next launch reads it only after this one
    ends: the kernel boundary or gdc_wait). A CTA still polling then sees the full count or the 0,
    both past its own arrival (a uint32 difference). One arrival atomic per CTA and polls of one
    word; launches of any grids in any order on one buffer (a width may have its own grid), at the
    cost of a count of every launch's arrivals (which needed every grid to divide the others'):
    57.6 against 57.5 us at 1 token, 318.9 against 320.3 at 16."""
    if STAGE == 0:
        tl.debug_barrier()
        cnt = (words + 1).to(tl.pointer_type(tl.uint32), bitcast=True)
        old = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        full = LAST * BLOCKS if LAST else BLOCKS
        if LAST:
            if old == LAST * BLOCKS - 1:
                tl.atomic_xchg(cnt, 0, sem="release", scope="gpu")
        _spin_count(cnt, old + 1, old + 1, full - 1 - old, fault, e, rank, timeout_ns, pid, PHASE, IS_HIP, INTERP,
                    POLLS_PER_CLOCK)
        tl.debug_barrier()


@triton.jit
def _wait_count(ptr, target, fault, e, rank, timeout_ns, pid, IS_HIP: tl.constexpr, INTERP: tl.constexpr,
                POLLS_PER_CLOCK: tl.constexpr):
    """Wait until the GPU-local counter *ptr reaches target."""
    v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    _spin_count(ptr, v, 0, target, fault, e, rank, timeout_ns, pid, PH_REDUCE, IS_HIP, INTERP, POLLS_PER_CLOCK)
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
                INTERP: tl.constexpr, POLLS_PER_CLOCK: tl.constexpr):
    """Spin until the GPU-local counter *ptr has grown by ``need`` from ``base`` (v: its last value
    read). The count is work of other CTAs of this launch and always arrives, so the bound, 4x
    timeout, is a last resort that records a fault; the clock is read every POLLS_PER_CLOCK polls."""
    if v - base < need:
        t0, deadline = _count_deadline(timeout_ns, IS_HIP, INTERP)
        t = t0
        n = 0
        while (v - base < need) & (t <= deadline):
            _backoff(IS_HIP, INTERP)
            v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
            n += 1
            if n % POLLS_PER_CLOCK == 0:
                t = now_u(IS_HIP, INTERP)
        if v - base < need:
            _record_fault(fault, fault, e, PHASE, rank, 0, t - t0, pid, t, 0, 1, False)


@triton.jit
def _ld_acquire(ptr):
    """An acquire load at GPU scope per element (NVIDIA): each thread loads its own lanes."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _done_prefix(cnt, sl, m, t_lo, t_hi, DOWN_KSPLIT: tl.constexpr, DOWN_TILES: tl.constexpr, SLOTS_P2: tl.constexpr,
                 SUM_AS_DONE: tl.constexpr, IS_HIP: tl.constexpr, INTERP: tl.constexpr):
    # one acquire read per slot and tile, all in flight together
    if (SUM_AS_DONE == 2) & (not IS_HIP) & (not INTERP):
        # SUM_AS_DONE=2: acquire loads (the chunks of a tile poll the same counters, which
        # atomics would serialize). Unlike an atomic's, a load's result is not broadcast through
        # shared memory: the vector has a lane per thread (SLOTS_P2 >= 128, geometry), so the min
        # below crosses the warps through shared memory behind a barrier, and every warp gets the
        # same prefix (with 16-32 lanes each warp reduced its own copy, the warps disagreed, and
        # the sum read partials not yet written)
        q = cnt + tl.where(m, sl, 0) * DOWN_TILES  # masked lanes read slot 0; their value is not used
        a = _ld_acquire(q + t_lo)
        b = a
        if t_hi != t_lo:
            b = _ld_acquire(q + t_hi)
    else:
        a = tl.atomic_add(cnt + sl * DOWN_TILES + t_lo, 0, mask=m, sem="acquire", scope="gpu")
        b = tl.atomic_add(cnt + sl * DOWN_TILES + t_hi, 0, mask=m, sem="acquire", scope="gpu")
    return tl.min(tl.where(((a >= DOWN_KSPLIT) & (b >= DOWN_KSPLIT)) | ~m, SLOTS_P2, sl), axis=0)


@triton.jit
def _wait_prefix(cnt, t_lo, t_hi, n_sl, need, DOWN_KSPLIT: tl.constexpr, DOWN_TILES: tl.constexpr,
                 SLOTS_P2: tl.constexpr, SUM_AS_DONE: tl.constexpr, fault, e, rank, timeout_ns, pid,
                 IS_HIP: tl.constexpr, INTERP: tl.constexpr, POLLS_PER_CLOCK: tl.constexpr):
    """(SUM_AS_DONE) How many leading slots have all DOWN_KSPLIT parts of H tiles t_lo and t_hi done (cnt:
    [slot][DOWN_TILES] counters), polled until at least ``need``; bounded as _spin_count (a fault recorded,
    then ``need`` returned, as a count that timed out is passed)."""
    sl = tl.arange(0, SLOTS_P2)
    m = sl < n_sl
    p = tl.minimum(_done_prefix(cnt, sl, m, t_lo, t_hi, DOWN_KSPLIT, DOWN_TILES, SLOTS_P2, SUM_AS_DONE, IS_HIP, INTERP),
                   n_sl)
    if p < need:
        t0, deadline = _count_deadline(timeout_ns, IS_HIP, INTERP)
        t = t0
        n = 0
        while (p < need) & (t <= deadline):
            _backoff(IS_HIP, INTERP)
            p = tl.minimum(_done_prefix(cnt, sl, m, t_lo, t_hi, DOWN_KSPLIT, DOWN_TILES, SLOTS_P2, SUM_AS_DONE, IS_HIP,
                                        INTERP), n_sl)
            n += 1
            if n % POLLS_PER_CLOCK == 0:
                t = now_u(IS_HIP, INTERP)
        if p < need:
            _record_fault(fault, fault, e, PH_REDUCE, rank, 0, t - t0, pid, t, 0, 1, False)
            p = need
    tl.debug_barrier()
    return p
