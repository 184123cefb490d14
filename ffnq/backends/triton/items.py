"""The fused kernel's expert work items (device helpers): a CTA's next item (every BLOCKS-th, or
WORK_QUEUE's shared counter), and a stage-2 item's header issued an item early (EARLY_HEADER)."""
import triton
import triton.language as tl


@triton.jit
def _claim(ctr, WORK_QUEUE: tl.constexpr):
    """(WORK_QUEUE) Take the next ticket of the work counter *ctr without a CTA barrier: one thread's
    atomic, as a [128] tensor (a scalar atomic is broadcast through shared memory behind a
    barrier, which would stall here). Issued at an item's start (a stage-2 item's once its
    tiles are in), read (_next_item) at its end: the latency hides behind the item's loads.
    Without WORK_QUEUE: nothing (a placeholder)."""
    r = 0
    if WORK_QUEUE:
        lane = tl.arange(0, 128)
        r = tl.atomic_add(ctr + lane * 0, tl.where(lane == 0, 1, 0), mask=lane == 0, sem="relaxed", scope="gpu")
    return r


@triton.jit
def _next_item(w, claimed, BLOCKS: tl.constexpr, WORK_QUEUE: tl.constexpr):
    """A CTA's next item: every BLOCKS-th, or (WORK_QUEUE) the ticket _claim took (lane 0's; the masked
    lanes hold 0), counted after each CTA's own first item; the items of both stages are
    numbered in one sequence, stage 2's after stage 1's."""
    if WORK_QUEUE:
        lane = tl.arange(0, 128)
        w = BLOCKS + tl.max(tl.where(lane == 0, claimed, 0), axis=0)
    else:
        w += BLOCKS
    return w


@triton.jit
def _s2_header(w, wend, n1, ecta, sync, wrow, yrm, ROW_PAD: tl.constexpr, DOWN_TILES: tl.constexpr,
               DOWN_KSPLIT: tl.constexpr, SUM_OWN_SLOTS: tl.constexpr):
    """(EARLY_HEADER) A stage-2 item's header, all issued together: its expert, its tiles' count as now (an
    acquire read, so the spin on it can start from a count already in), and the rows its partial
    writes (wrow: the route weights' row pointers of expert 0). Past the last item: zeros, no read."""
    j = (w - n1) // (DOWN_TILES * DOWN_KSPLIT)
    live = w < wend
    ej = tl.load(ecta + j, mask=live, other=0)
    v = tl.atomic_add(sync + j, 0, mask=live, sem="acquire", scope="gpu")
    ym = yrm & live
    if SUM_OWN_SLOTS == 2:
        ym &= tl.load(wrow + ej * ROW_PAD, mask=ym, other=0.0) != 0.0
    return ej, v, ym
