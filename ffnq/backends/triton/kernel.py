"""The fused, persistent decode-FFN kernel of one TP rank (Triton 3.6; sm_90, gfx942, gfx950).

``ffn_kernel`` runs a decoder layer's whole MoE FFN for TOKENS rows in one launch of BLOCKS
co-resident CTAs (a cooperative launch; the runner sizes the grid per width); ``launch`` is its
host wrapper. The phases, in order:

  A  seam     CTA c pushes its column chunk of ``part`` into every peer's seam slot, waits
              (bounded) for every peer's chunk, sums them in rank order + residual in fp32 ->
              res_out (h), and writes the chunk's per-row sum of squares and partial router
              logits (sum over the chunk of h * post_norm * router: exact fp32 FMAs). The
              router columns, post_norm and residual are read before the wait (the link's
              latency hides their HBM reads).
     -- grid barrier 1 --
  B  norm     rstd per row from the chunks' sums of squares in chunk order (bitwise the same
              on every rank and CTA); x = h * rstd * post_norm / max|post_norm| as X_TERMS fp8
              terms, each the rounding residue of the last x 16 (fp16 hi + lo on CDNA).
     router   each CTA's experts' logits; from ROW_PICK_FROM rows instead, ROW_PICK_CTAS CTAs a
              row sum slices of that row's partials and the last to arrive sums them in order
              and picks the row's top-k. Clears the expert phases' counters.
     -- grid barrier 2 (none at the FULL_ROWS widths: phase A read the whole rows) --
  C  top-k    sigmoid + bias top-k (the lowest index wins a tie), renormalised weights ->
              route, route_w; every CTA's list of the active experts (the local ones at
              EXPERT_MODE 1).
     stage 1  gate/up items (active expert, UP_TILE rows of the intermediate, K part), "swap
              AB": the fp8 weight tile as stored is the MMA's M side, the x terms^T its N side
              (X_TERMS x UP_COLS columns); each 128-wide K block's fp32 product times its block
              scale. act = silu(g) * u * routing weight -> scratch (DOWN_FP8: as fp8 terms over
              a scale per tile); the expert's tile counter += 1.
     -- no barrier: a stage-2 item waits for its expert's INTER / UP_TILE tiles --
  D  stage 2  down items (active expert, DOWN_TILE rows of H, part of the intermediate): the
              expert's partial [tokens, DOWN_TILE] -> fp32 scratch; the tile's counter += 1.
     -- no barrier: a chunk's sum waits for its (at most two) H tiles --
  E  sum      CTA c sums its chunk of the experts' partials in slot order (deterministic: a
              replay is bitwise the same);
     reduce   pushes the bf16 chunk to every peer, waits, sums in rank order -> out.
  F  handshake (FINAL, its own compiled variant: the step's last launch) a flag to and from
              every peer.

Items: a CTA takes every BLOCKS-th item of both stages (stage 2's numbered after stage 1's, so a
CTA with no stage-1 item starts stage 2 at once), or with WORK_QUEUE after its first the next
ticket of one shared counter.

Protocol. Epoch words (peer buffer "epoch", int32[4]): [0] the last launch's epoch, [1] this
launch's grid-barrier arrivals, [3] the exit count of staged launches ([2] is FlyDSL's). A
launch's epoch e is the stored one + 1 (1..2^31-1; CTA 0 stores it after barrier 1, when every
CTA has read it). Flags and tagged words carry e, or -e once this rank faulted in this launch; a
wait matches == e exactly. Every cross-GPU wait is bounded by timeout_ns from the start of that
wait; on expiry the first faulting CTA writes the scratch fault record and its note in every
peer's fault_box, and every later wait of the rank takes one look. Grid barriers and counter
waits are always passed (bounded by 4 x timeout as a last resort). At TP1 (SOLO) the exchanges
are the identity and are skipped. Weights read before the PDL wait (EARLY_WEIGHTS) must not be
written between launches; the runner waits for the stream once before the first launch on new
weight tensors.

STAGE = 0 runs everything in one launch. STAGE > 0 runs one part per launch, with the launch
boundary as the barrier, in geometry.STAGES order: the interpreter (TRITON_INTERPRET=1) runs CTAs
one after another, so only that split runs there, and several ranks in one process can run stage
by stage, interleaved.

Build keys. geometry.geometry sets each from its default, configs/triton-measured.toml's row for
the model, TP and width, and FFNQ_TRITON_TUNE over both ("KEY=v", "KEY@width=v"; tune.py). The
times are p50 per step of minimax-m2 on one H200 at TP1 unless said otherwise ("TP2" without a
GPU pair: one TP2 rank's build timed on one GPU); "a vs b" is the choice against the other.

| key | meaning | default | why |
|---|---|---|---|
| UP_TILE | stage-1 tile rows (gate and up rows of one expert) | 64 | the M of an sm_90 warp-group MMA |
| UP_KSPLIT | K parts of a stage-1 item; the last arriver of a tile sums them in order | a cost model (rounds of items x K steps + 3 for the fill + UP_KSPLIT_FIXUP); table: 2 at 1 token | one token: 53.4 us in 2 parts vs 55.8 whole, 56.2 in 3; TP2 4 and 6 tokens whole K 89.6 / 112.0 vs 90.8 / 114.4 in the model's 2 |
| UP_KSPLIT_FIXUP | K steps the model charges a split tile's fix-up | 4 | TP2 nine tokens split in 2 took 155 vs 142 us whole, where the model without it chose the split (105 vs 108 steps) |
| UP_STAGES | stage 1's software-pipeline depth | 4, CDNA 2; table: TP1 5 at 1 token, 3 at 2 (three CTAs per SM), 4 at 3, 5 at 4-16 | 5 stages (102 KB, still two CTAs per SM) 0.6-0.7% faster at 7-16 tokens (252.0 vs 253.6 us at 16), 55.2 vs 55.9 us at one token on an H100; 4 on gfx942 took 464 VGPRs and 71 spills |
| UP_STAGES_NARROW | UP_STAGES where stage 1 has at most 4 token columns | 4 | 5 stages at 1-4 tokens were no faster at TP1 or TP2, before one token ran two CTAs per SM with w2 tile-packed (now its UP_STAGES is 5: 55.2 vs 55.9 us on an H100) |
| DOWN_STAGES | stage 2's pipeline depth | UP_STAGES; table 4 where that is 5 | 5 was 0.3-0.7% slower at 4-16 tokens (260.7 vs 259.8 us at 16) |
| UP_NARROW_FROM | from this width stage 1 takes the fewest token columns per x term that make N >= 16, else 16 | 7; table 1 at TP1 1-3 (TP2 1, 3), 4 at 4-6 (TP2 4-5) | 8 columns at 4 tokens 113.8 vs 114.8 us; at TP2 7-8 tokens 1.7-2.5% faster |
| X_TERMS | fp8 terms of x (2: ~8 mantissa bits, a bf16's; 4: ~16) | 2, or 4 where four terms over 8 columns make N = 32; table 2 at TP1 5-8, TP2 1, 4, 7-8, and 4 at TP2 6 | 2 terms halve stage 1's accumulators (249 to 178 registers at 4 tokens): 280.3-281.6 vs 290.5-293.8 us at 16; max rel_err 0.0020 vs 0.0018 |
| FP8_X | x as fp8 terms, an fp8 x fp8 stage 1 (0: an fp16 x pair and fp8 -> fp16 weights) | 1; CDNA 0 | TP2 65.3 vs 72.9 us at 1 token, 198.5 vs 243.1 at 16; gfx942's fp8 MMA reads the fnuz format |
| SCALE_ON_PRODUCT | the block scale times each K block's fp32 product (0: folded into fp16 weights) | 1 (always with FP8_X) | the folded path rounds each weight to fp16 and takes only scales < 0.57 (448 x scale x 2^8 < 65504) |
| DOWN_TILE | stage-2 tile rows of H | 64 up to 2 tokens, else 128 | 64 rows at 1-2 tokens: twice the items over the grid, 0.6-1.4 us faster; at 4-16 2.4-5.1% slower |
| DOWN_KSPLIT | parts of the intermediate per stage-2 item, each its own partial | 1; table 2 at TP1 3-4 tokens, TP2 3 | the last round's items end ~6 us apart, not ~12: 94.0 vs 95.1 us at 3 tokens, 113.7 vs 114.3 at 4; at 5-16 the parts cost more (170.0 vs 166.4 at 8) |
| DOWN_FP8 | stage 2 on fp8 act terms x the fp8 w2 codes (1: steps of one stage-1 tile, 2: of 128; 0: fp16 act) | 2 where FP8_X; CDNA 0 | the loop alone reads 3.92 / 4.10 TB/s at 64 / 128 rows vs 3.30 / 3.01 on fp16 act; 289.2 vs 309.0 us at 16 tokens |
| DOWN_ACT_TERMS | fp8 terms of act | 2 | 4 terms spill at 9-16 tokens: 302.7 vs 289.2 us at 16; max rel_err 0.00179 vs 0.00173 |
| PACKED_W2 | stage 2 reads w2 tile-packed by the runner (runner.packed_w2; only with DOWN_FP8) | 1 at TP1, else 0 | an item's DOWN_TILE rows one contiguous stream, each step one DOWN_TILE x UP_TILE block, not UP_TILE bytes of each of DOWN_TILE rows INTER apart: on an H100 58.1 / 92.7 / 162.2 / 275.0 / 479.5 vs 59.2 / 95.0 / 166.4 / 284.5 / 496.8 us at 1 / 2 / 4 / 8 / 16 tokens; TP2 not yet timed (its 3-token final build spills 4 B under the 168-register cap) |
| W2_PACK_ROWS | rows of the packed w2's tiles (PACKED_W2); a DOWN_TILE below it reads its rows of each block | 128 | one packed w2 for every width: 64-row items (1-2 tokens) read 4 KB of each [128, UP_TILE] block, so a runner serving 1-16 tokens keeps one w2 copy, not two (minimax-m2 TP1: 1.2 GB a weight set); on an H100 56.7 / 90.8-91.3 vs 56.6-56.7 / 91.1 us at 1 / 2 tokens with 64-row packs |
| DOWN_MIN_COLS | least act token columns per term in stage 2 | 4 | 8 (N = 16: the fp8 wgmma at 1-4 tokens) was 47.0 vs 46.8 us at 1 token: stage 2 is bound by its bytes in flight |
| WORK_QUEUE | a CTA's items after its first from one counter for both stages | 0; table 1 at 3-16 tokens (TP1, TP2) | a CTA slowed by its SM's share of the HBM takes fewer: 263.1 vs 267.0 us at 16 tokens, 1-3% at 4-14; no gain where a stage's items fit one round (1-2) |
| EARLY_HEADER | an item's header read at the end of the item before (bit 0: stage 2, bit 1: stage 1) | 0; table 3 at TP1 1 and 5-16 | 0-0.4% faster at every width 5-16 (251.4 vs 252.0 us at 16), never slower; one token on an H100 53.2-53.3 vs 53.8 us; 2-4 tokens no gain |
| PACKED_W13 | stage 1 reads w13 tile-packed by the runner (runner.packed_w13) | 1; table 0 at 1 token | each K step's gate and up blocks one contiguous 16 KB: 4-6% faster loop on an H100 (354.0 vs 364.9 us at 16); one token on an H200 45.2 as given vs 46.6 packed |
| LOGIT_FMA_ROWS | phase A's partial logits as FMAs over the live rows up to this row tile (else a 16-row fp32 dot) | 2; table 8 at 3-6 tokens, 16 at 7-16; 2 on chunks wider than 16 columns | the dot costs 513 FFMA a thread at any width: 117.6 vs 119.5 us at 4 tokens, 259.8 vs 261.6 at 16; wider chunks spill (16-656 B) |
| ROW_PICK_FROM | from this row tile phase B picks each row's top-k (ROW_PICK) instead of every CTA after barrier 2 | 2 | 3-4 us faster at 3-4 tokens, 1.2-1.4 at 2 |
| ROW_PICK_MAX_CTAS | most CTAs per row in that pick (a power of two) | 16 | the last arriver reads fewer slices: 0.7-1.3 us faster than 64 a row at 4 tokens |
| FULL_ROWS | up to this many tokens (at most 2) every CTA reads the whole rows: rstd and its experts' logits without barrier 2 | 2 at TP1, 0 at TP > 1 (1 token there, TAGGED_WORDS only) | 48.2 vs 51.5 us at 1 token, 80.7 vs 83.0 at 2; at TP2 (both ranks on one GPU) 3.4-4.7 us slower |
| SUM_OWN_SLOTS | phase E sums each row's own TOP_K slots, not every active slot (2: stage 2 writes only those rows) | 2 at TP1, table 2 at TP2, else 0; only with ROW_PICK | at 16 tokens the sum 1.0-1.3 us vs 6.9-7.2 (68 slots, 13 MB): 281.0 vs 294.4 us |
| SUM_AS_DONE | phase E sums each slot as its stage-2 items finish (2: polled by loads) | 0 | correct, no faster |
| SUM_BATCH | slots per batch of phase E's loads (a power of two) | 8 at 16-column chunks (2048 fp32 a batch) | a batch's loads are in flight together |
| EARLY_WEIGHTS | phase A's weights and the top-k's reads issued before the PDL wait | 1 at TP1, table 1 at TP2 | the router done 1.3-1.8 us sooner: 45.9 vs 46.2 us at 1 token, 178.5 vs 183.1 at 8 |
| EARLY_SEAM_READS | the seam's router, post_norm and residual reads issued beside the push | 1 | with LOGIT_FMA_ROWS: 2.5-3.1 us faster at 1-2 tokens, 0.7-1.2 at 4-16 |
| EARLY_FAULT_WORDS | the fault and inject words read beside the epoch, before phase A's loads | 0 | 2.5% and 1.7% of one token's stall samples, yet 46.2 vs 46.3 us at 1 token: within the noise at 1-4 |
| SOLO | no exchanges (their identity at TP1; 2: at any TP, one rank's build alone on one GPU) | 1 at TP1 | 2.0 / 1.6 / 2.3 / 3.6 us faster at 1 / 2 / 4 / 16 tokens |
| TAGGED_WORDS | the exchanges as 8-byte words (epoch << 32 / value): no fence, no flag | 1; CDNA 0 (single-copy atomicity shown on NVLink only) | TP2 47.2 vs 52.8 us at 1 token, 184 vs 189 at 16: a push 0.77 vs 2.3 us |
| FENCE | a flag publish as one fence per thread and relaxed flags, not a release per flag | 1; sm_90 only | TP2 55.5 vs 60.1 us at 1 token: one round trip to the peers, not one a flag |
| PDL | programmatic dependent launch (the next launch's prologue beside this one's end) | 1; sm_90 only | TP2 64.6 vs 65.2 us at 1 token, 199.5 vs 201.1 at 16 |
| POLLS_PER_CLOCK | polls of a wait between its clock and fault checks | 8 | a clock read is a CTA-wide max (a barrier): TP2 64.7 vs 65.2 us at 1 token |
| SORT_TOPK | the top-k as one partial bitonic sort of int64 keys (2: of the fp32 scores, ties at the threshold by index; 0: TOP_K rounds of max) | 1 | one token's top-k 2.05 vs 3.07 us; the step 0.2-0.6 us faster. 2 (half the shuffles; checked against a float64 oracle with ties): 59.1 / 94.7 vs 59.2 / 94.6-95.0 us at 1 / 2 tokens on an H100, within the spread |
| CTAS_PER_SM | the grid is CTAS_PER_SM x the device's SMs (NVIDIA; CDNA keeps 264) | 2; table 3 at TP1 2, TP2 3 | two warp groups an SM stream weights (256 vs 128 CTAs: 10-16% faster); three where the build fits them: 69.2 vs 76.6 us at 2 tokens; one token two with 4 stages, 54.3-54.5 vs 56.8-56.9 us with three and 3 stages on an H100; three tokens two with 4 stages, 130.6 vs 132.2 us with three and 3 stages capped at 168 registers |
| GRID | one width's grid | CTAS_PER_SM x SMs | development: the grid barrier takes launches of any grids on one buffer |
| MAXNREG | ptxas's register cap (NVIDIA) | none; table 168 at TP2 3 | 168 x 128 threads x 3 CTAs fit an SM's 64K registers (180 uncapped: two a SM): 94.0 vs 95.0 us |
| COOPERATIVE | a cooperative launch | 1 | the grid barriers need every CTA resident; the launch refuses a grid that is not (0: warm's check only, which another process on the GPU can void: a hang until the barrier's bound). 0 was 0.2-0.6 us faster on an H100 (56.3-56.4 vs 56.6-56.7 us at 1 token, 468.9-469.1 vs 469.7-469.8 at 16), not worth the guarantee |

The other constexprs are derived: the model's shape (TOKENS, HIDDEN, EXPERTS, TOP_K, INTER: the
intermediate rows per rank, LOCAL_EXPERTS, EXPERT_MODE 0 all / 1 local / 2 none, TP, MAX_TOKENS,
EPS), *_P2 (the next power of two), CHUNKS x CHUNK (the column chunks of H, one a CTA),
CTA_EXPERTS (experts whose logits a CTA makes), ROW_TILE (next_pow2(TOKENS)), ROW_PICK and
ROW_PICK_CTAS / PICK_CHUNKS_P2 (the row pick), UP_COLS / DOWN_COLS (token columns per term), SLOTS
(the expert slots a width can touch), the counters' layout (COUNTERS, SLOT_TILE_AT, QUEUE_AT,
CLEAR_SPAN), SCALE_MUL (2^8 on the folded-scale path, else 1), PEER_* and SC_* (byte offsets of
the peer buffer's and the scratch's regions), FLAG_CTAS (the peer flags' CTA slots a phase),
STAMP_COLS, TIMELINE, IS_HIP, INTERP, STAGE, FINAL.
"""
import triton
import triton.language as tl

from ffnq.backends.triton.sync import (F_EPOCH, F_VALID, PH_HANDSHAKE, PH_REDUCE, PH_SEAM, _as, _backoff,
    _clear_sync, _gather, _grid_barrier, _publish, _rank_faulted, _send, _spin_count, _stamp, _wait_count,
    _wait_peers, _wait_prefix, _wait_rows, now_ns, now_u)
from ffnq.backends.triton.tiles import (_bf16, _fp8, _fr_rows, _fr_weights, _mma_sc, _post_norm_all, _store_route, _store_x,
    _topk, _xsig, _xsig_of)
from ffnq.backends.triton.items import _claim, _next_item, _s2_header


@triton.jit(do_not_specialize=["rank", "first_expert"])
def ffn_kernel(
    part, residual, slots, out, res_out,  # [T,H] bf16, [T,H] bf16, [>=T] i64, [T,H] bf16, [T,H] bf16
    post_norm, router, router_bias,  # [H] f32, [E,H] f32, [E] f32
    w13, s13, w2, s2,  # [L,2I,H] fp8, [L,2I/128,H/128] f32, [L,H,I] fp8, [L,H/128,I/128] f32 (L local experts)
    scratch, peers, epoch, inject,  # *i8 this width's scratch, *i64 [TP] peer buffers, *i32 words, *i32 [2]
    cfg, rank, first_expert,  # *i64 [timeout_ns] (an argument named "params" breaks the JIT binder), i32, i32
    # shape
    TOKENS: tl.constexpr, HIDDEN: tl.constexpr, HIDDEN_P2: tl.constexpr, EXPERTS: tl.constexpr,
    EXPERTS_P2: tl.constexpr, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, INTER: tl.constexpr,
    EXPERT_MODE: tl.constexpr, LOCAL_EXPERTS: tl.constexpr, TP: tl.constexpr, MAX_TOKENS: tl.constexpr,
    EPS: tl.constexpr,
    # grid and work split
    BLOCKS: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, CHUNK: tl.constexpr, CHUNK_P2: tl.constexpr,
    CTA_EXPERTS: tl.constexpr, CTA_EXPERTS_P2: tl.constexpr, ROW_TILE: tl.constexpr, ROW_PICK: tl.constexpr,
    ROW_PICK_CTAS: tl.constexpr, PICK_CHUNKS_P2: tl.constexpr, SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr,
    # stage 1 (gate/up)
    UP_TILE: tl.constexpr, UP_KSPLIT: tl.constexpr, UP_STAGES: tl.constexpr, UP_COLS: tl.constexpr,
    X_TERMS: tl.constexpr, FP8_X: tl.constexpr, SCALE_ON_PRODUCT: tl.constexpr, SCALE_MUL: tl.constexpr,
    PACKED_W13: tl.constexpr,
    # stage 2 (down)
    DOWN_TILE: tl.constexpr, DOWN_KSPLIT: tl.constexpr, DOWN_STAGES: tl.constexpr, DOWN_COLS: tl.constexpr,
    DOWN_FP8: tl.constexpr, DOWN_ACT_TERMS: tl.constexpr, PACKED_W2: tl.constexpr, W2_PACK_ROWS: tl.constexpr,
    # schedule
    WORK_QUEUE: tl.constexpr, EARLY_HEADER: tl.constexpr, EARLY_WEIGHTS: tl.constexpr, EARLY_SEAM_READS: tl.constexpr,
    EARLY_FAULT_WORDS: tl.constexpr, LOGIT_FMA_ROWS: tl.constexpr, FULL_ROWS: tl.constexpr,
    SUM_OWN_SLOTS: tl.constexpr, SUM_AS_DONE: tl.constexpr, SUM_BATCH: tl.constexpr, SORT_TOPK: tl.constexpr,
    # protocol
    SOLO: tl.constexpr, TAGGED_WORDS: tl.constexpr, FENCE: tl.constexpr, PDL: tl.constexpr,
    POLLS_PER_CLOCK: tl.constexpr, FLAG_CTAS: tl.constexpr,
    # the counters region of scratch (int32 words)
    COUNTERS: tl.constexpr, SLOT_TILE_AT: tl.constexpr, QUEUE_AT: tl.constexpr, CLEAR_SPAN: tl.constexpr,
    CLEAR_SPAN_P2: tl.constexpr,
    # byte offsets of the peer buffer's regions
    PEER_FLAGS: tl.constexpr, PEER_FAULT_BOX: tl.constexpr, PEER_SEAM: tl.constexpr, PEER_MOE: tl.constexpr,
    PEER_SEAM_TAGGED: tl.constexpr, PEER_MOE_TAGGED: tl.constexpr,
    # byte offsets of the scratch regions
    SC_FAULT: tl.constexpr, SC_TIMELINE: tl.constexpr, SC_ROUTE: tl.constexpr, SC_ROUTE_W: tl.constexpr,
    SC_H_ROWS: tl.constexpr, SC_X_TERMS: tl.constexpr, SC_SUMSQ: tl.constexpr, SC_LOGITS: tl.constexpr,
    SC_META: tl.constexpr, SC_ACT: tl.constexpr, SC_DOWN_PARTS: tl.constexpr, SC_ROUTE_TABLE: tl.constexpr,
    SC_PART_LOGITS: tl.constexpr, SC_ACTIVE: tl.constexpr, SC_SUBSTAMPS: tl.constexpr, SC_COUNTERS: tl.constexpr,
    SC_UP_PARTS: tl.constexpr, SC_PICKS: tl.constexpr, SC_ROW_ARRIVALS: tl.constexpr, SC_ROW_PARTS: tl.constexpr,
    SC_ACT_FP8: tl.constexpr, SC_ACT_SCALE: tl.constexpr, SC_EXPERT_SLOT: tl.constexpr,
    # the variant
    TIMELINE: tl.constexpr, STAMP_COLS: tl.constexpr, IS_HIP: tl.constexpr, INTERP: tl.constexpr, STAGE: tl.constexpr,
    FINAL: tl.constexpr,
):
    ROW_PAD: tl.constexpr = 16  # row tile (tl.dot needs M >= 16); rows >= TOKENS are masked / zero
    K_BLOCK: tl.constexpr = 128  # K tile of the expert GEMMs: one scale block
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

    # (EARLY_WEIGHTS) the weights phase A and the top-k read (router, post_norm, router_bias),
    # issued before the PDL wait below: no kernel writes them between launches, so their HBM
    # latency (cold after the last launch's expert streams) runs beside the previous launch's exit
    EARLY_LOADS: tl.constexpr = EARLY_WEIGHTS & EARLY_SEAM_READS & (STAGE == 0)
    if EARLY_LOADS:
        pid = tl.program_id(0)
        rows = tl.arange(0, ROW_PAD)
        rmask = rows < TOKENS
        ccols = pid * CHUNK + tl.arange(0, CHUNK_P2)  # this CTA's column chunk (seam, stage 2, reduce)
        cmask = (tl.arange(0, CHUNK_P2) < CHUNK) & (ccols < HIDDEN) & (pid < CHUNKS)
        m2 = rmask[:, None] & cmask[None, :]
        rows_r = tl.arange(0, ROW_TILE)  # router/top-k row tile: next_pow2(TOKENS), not 16
        rmask_r = rows_r < TOKENS
        ecols = tl.arange(0, EXPERTS_P2)
        evalid = ecols < EXPERTS
        ecol = pid * CTA_EXPERTS + tl.arange(0, CTA_EXPERTS_P2)  # this CTA's experts, whose logits it makes
        emask = (tl.arange(0, CTA_EXPERTS_P2) < CTA_EXPERTS) & (ecol < EXPERTS)
        if FULL_ROWS == 0:
            rt_c = tl.load(router + ecols[None, :].to(tl.int64) * HIDDEN + ccols[:, None],
                           mask=cmask[:, None] & evalid[None, :], other=0.0)
        pn_c = tl.load(post_norm + ccols, mask=cmask, other=0.0)
        if FP8_X:
            pn_all = _post_norm_all(post_norm, HIDDEN, HIDDEN_P2)
        if FULL_ROWS:
            fr_pn, fr_rw = _fr_weights(post_norm, router, ecol, emask, HIDDEN, HIDDEN_P2)
        bias_e = tl.load(router_bias + ecols, mask=evalid, other=0.0)
    if PDL:
        # launched early beside the previous kernel (programmatic dependent launch): wait for it
        # to finish and flush before reading anything it may write, then let the next launch get ready
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not EARLY_LOADS:
        pid = tl.program_id(0)
    timeout_ns = tl.load(cfg)
    fault = _as(scratch, SC_FAULT, tl.int64)
    tl_row = _as(scratch, SC_TIMELINE, tl.int64) + pid * STAMP_COLS
    sub_row = _as(scratch, SC_SUBSTAMPS, tl.int64) + pid * 16  # finer stamps inside the router and expert phases
    words = epoch
    # a plain L2 read (the last launch's write to it is ordered by the kernel boundary or gdc_wait):
    # unlike an atomic it does not stall here, so it overlaps the phase-A loads below
    e = tl.load(words, cache_modifier=".cg") + 1
    if EARLY_FAULT_WORDS:
        # (EARLY_FAULT_WORDS) the fault and inject words read beside the epoch, before phase A's
        # big loads: read after them, each was waited for before the next was issued (2.5% and
        # 1.7% of one token's stall samples)
        fe = tl.load(fault + F_EPOCH, cache_modifier=".cg")
        if not INTERP:
            who = tl.load(inject)
    e = tl.where(e <= 0, 1, e)  # 1..2^31-1: 0 is the cleared value, -e marks a fault
    par = (e & 1).to(tl.int64)
    # (EARLY_LOADS computes them above, for its loads.) Written out twice, not as a helper: a
    # helper, or one copy placed above the wait, moves the sm_90 schedule of both kinds of build
    if not EARLY_LOADS:
        rows = tl.arange(0, ROW_PAD)
        rmask = rows < TOKENS
        ccols = pid * CHUNK + tl.arange(0, CHUNK_P2)  # this CTA's column chunk (seam, stage 2, reduce)
        cmask = (tl.arange(0, CHUNK_P2) < CHUNK) & (ccols < HIDDEN) & (pid < CHUNKS)
        m2 = rmask[:, None] & cmask[None, :]
        rows_r = tl.arange(0, ROW_TILE)  # router/top-k row tile: next_pow2(TOKENS), not 16
        rmask_r = rows_r < TOKENS
        ecols = tl.arange(0, EXPERTS_P2)
        evalid = ecols < EXPERTS
        ecol = pid * CTA_EXPERTS + tl.arange(0, CTA_EXPERTS_P2)  # this CTA's experts, whose logits it makes
        emask = (tl.arange(0, CTA_EXPERTS_P2) < CTA_EXPERTS) & (ecol < EXPERTS)

    if FP8_X & ((STAGE == 2) | (STAGE == 3) | ((STAGE == 6) & (FULL_ROWS != 0))):  # staged launches: x's range here
        xsig = _xsig(post_norm, HIDDEN, HIDDEN_P2)
    if not FP8_X:
        xsig = 1.0  # (unused: the fp16 pair takes x as it is; _store_x's argument must exist)

    # ------------------------------------------------------------------------------ A: seam
    if (STAGE == 0) | (STAGE == 1):
        _stamp(tl_row, C_START, IS_HIP, INTERP, TIMELINE)
        # the reads of this phase issued together (one wait, not one round trip each)
        offs = rows[:, None] * HIDDEN + ccols[None, :]
        p = tl.load(part + offs, mask=m2, other=0.0)
        if EARLY_SEAM_READS & (STAGE == 0):
            # (EARLY_SEAM_READS) the seam's other reads issued here, beside the push (only loads: a
            # reduction here would hold the push until its bytes came): after it they took ~3 us
            # at TP1 (the same loads as the seam's below, written out: as a helper they moved the
            # sm_90 schedule at 16 tokens)
            if not EARLY_LOADS:
                if FULL_ROWS == 0:  # (FULL_ROWS reads whole router rows instead)
                    rt_c = tl.load(router + ecols[None, :].to(tl.int64) * HIDDEN + ccols[:, None],
                                   mask=cmask[:, None] & evalid[None, :], other=0.0)
                pn_c = tl.load(post_norm + ccols, mask=cmask, other=0.0)
            h = tl.load(residual + offs, mask=m2, other=0.0).to(tl.float32)
            if FP8_X & (not EARLY_LOADS):
                pn_all = _post_norm_all(post_norm, HIDDEN, HIDDEN_P2)
            if FULL_ROWS:  # the whole rows and this CTA's router rows, before any store (a store would hold them)
                fr_res, fr_part = _fr_rows(part, residual, rows_r, rmask_r, HIDDEN, HIDDEN_P2)
                if not EARLY_LOADS:
                    fr_pn, fr_rw = _fr_weights(post_norm, router, ecol, emask, HIDDEN, HIDDEN_P2)
        if not EARLY_FAULT_WORDS:
            fe = tl.load(fault + F_EPOCH, cache_modifier=".cg")
        faulted = fe == e.to(tl.int64)
        if pid == 0:
            if not faulted:
                tl.store(fault + F_VALID, 0)
            if ROW_PICK:  # phase B's per-row arrival counters (used after barrier 1)
                tl.store(_as(scratch, SC_ROW_ARRIVALS, tl.int32) + tl.arange(0, 16), tl.zeros((16,), tl.int32))
        if not INTERP:
            if not EARLY_FAULT_WORDS:
                who = tl.load(inject)
            if who == rank + 1:
                delay = tl.load(inject + 1).to(tl.int64)
                t0 = now_u(IS_HIP, INTERP)
                t = t0
                while t - t0 < delay:
                    _backoff(IS_HIP, INTERP)
                    t = now_u(IS_HIP, INTERP)
                faulted = _rank_faulted(fault, e)  # other CTAs may have given up meanwhile
        if not SOLO:  # (SOLO: at TP1 there is no peer, the all-reduces are the identity)
            _send(peers, pid, rank, par, p, tl.where(faulted, -e, e), offs, m2, PEER_SEAM, PEER_SEAM_TAGGED, PH_SEAM,
                  PEER_FLAGS, TP, MAX_TOKENS, HIDDEN, FLAG_CTAS, INTERP, FENCE, TAGGED_WORDS)
        _stamp(tl_row, C_SEAM_ARRIVE, IS_HIP, INTERP, TIMELINE)
    if (STAGE == 0) | (STAGE == 6):
        # this chunk's columns of the router [EXPERTS, CHUNK], loaded before the wait: its HBM
        # latency hides behind the link; the logits are split over K (chunks) so no CTA needs all
        # of x
        offs = rows[:, None] * HIDDEN + ccols[None, :]
        if EARLY_SEAM_READS & (STAGE == 0):
            if FP8_X:
                xsig = _xsig_of(pn_all)
        else:
            if FULL_ROWS == 0:
                rt_c = tl.load(router + ecols[None, :].to(tl.int64) * HIDDEN + ccols[:, None],
                               mask=cmask[:, None] & evalid[None, :], other=0.0)
            pn_c = tl.load(post_norm + ccols, mask=cmask, other=0.0)
            if FP8_X & (STAGE == 0):  # x's range for its fp8 terms (phase B, stage 1), read before the link's wait too
                xsig = _xsig(post_norm, HIDDEN, HIDDEN_P2)
            h = tl.load(residual + offs, mask=m2, other=0.0).to(tl.float32)  # so is the residual
        if SOLO:
            if STAGE == 6:
                p = tl.load(part + offs, mask=m2, other=0.0)
            h += p.to(tl.float32)  # the sum of one rank's bf16 values, as the exchange gives it
            _stamp(tl_row, C_SEAM_SEEN, IS_HIP, INTERP, TIMELINE)
        else:
            h += _gather(peers, fault, pid, rank, e, timeout_ns, tl_row, par, offs, m2, PEER_SEAM, PEER_SEAM_TAGGED,
                         PH_SEAM, PEER_FLAGS, PEER_FAULT_BOX, TP, MAX_TOKENS, HIDDEN, FLAG_CTAS, C_SEAM_SEEN, IS_HIP,
                         INTERP, TIMELINE, POLLS_PER_CLOCK, TAGGED_WORDS)
        tl.store(res_out + offs, _bf16(h, INTERP), mask=m2)
        if FULL_ROWS:
            # (FULL_ROWS) every CTA reads the whole rows, so rstd and its own experts' logits need
            # no other CTA's partials, and phase B's work is done here: one grid barrier before
            # the top-k, not two and a pass over every chunk's partial logits
            if not (EARLY_SEAM_READS & (STAGE == 0)):
                fr_res, fr_part = _fr_rows(part, residual, rows_r, rmask_r, HIDDEN, HIDDEN_P2)
                fr_pn, fr_rw = _fr_weights(post_norm, router, ecol, emask, HIDDEN, HIDDEN_P2)
            if SOLO | (TP == 1):
                hf = fr_res.to(tl.float32) + fr_part.to(tl.float32)  # [ROW_TILE, HIDDEN_P2], as the chunk's h
            else:
                # (TP > 1, TAGGED_WORDS) every peer's whole rows, once all their tagged words are
                # in (this CTA's chunk is), summed in rank order with this rank's own: h again
                fc = tl.arange(0, HIDDEN_P2)
                hf = fr_res.to(tl.float32) + _wait_rows(
                    peers, fault, pid, rank, e, timeout_ns, rows_r[:, None] * HIDDEN + fc[None, :],
                    rmask_r[:, None] & (fc < HIDDEN)[None, :], fr_part,
                    PEER_SEAM_TAGGED + (par * TP * MAX_TOKENS) * HIDDEN * 8, PH_SEAM,
                    PEER_FAULT_BOX, TP, MAX_TOKENS * HIDDEN * 8, IS_HIP, INTERP, POLLS_PER_CLOCK)
            rstd_r = 1.0 / tl.sqrt_rn(tl.sum(hf * hf, axis=1) / HIDDEN + EPS)  # [ROW_TILE], the same in every CTA
            dot = tl.sum((hf * fr_pn[None, :])[:, None, :] * fr_rw[None, :, :], axis=2)  # [ROW_TILE, CTA_EXPERTS_P2]
            if pid * CTA_EXPERTS < EXPERTS:
                tl.store(_as(scratch, SC_LOGITS, tl.float32) + rows_r[:, None] * EXPERTS + ecol[None, :],
                         dot * rstd_r[:, None], mask=rmask_r[:, None] & emask[None, :])
            if pid < CHUNKS:
                rstd = tl.sum(tl.where(rows[:, None] == rows_r[None, :], rstd_r[None, :], 0.0), axis=1)  # [ROW_PAD]
                _store_x(scratch, offs, m2, h * rstd[:, None] * pn_c[None, :], xsig, TOKENS, HIDDEN, SC_X_TERMS, FP8_X,
                         INTERP, X_TERMS)
            _clear_sync(scratch, pid, SC_COUNTERS, CLEAR_SPAN, CLEAR_SPAN_P2, COUNTERS)
    if ((STAGE == 0) | (STAGE == 6)) & (FULL_ROWS == 0):
        if STAGE == 6:  # for the staged launch of phase B (the fused launch keeps h in registers)
            tl.store(_as(scratch, SC_H_ROWS, tl.float32) + offs, h, mask=m2)
        if pid < CHUNKS:
            tl.store(_as(scratch, SC_SUMSQ, tl.float32) + pid * ROW_PAD + rows, tl.sum(h * h, axis=1))
            # partial logits of every expert over this chunk: sum_k h*post_norm*router (exact fp32
            # FMA); rstd factors out and is applied once the chunks' sums of squares are all in
            if ROW_TILE <= LOGIT_FMA_ROWS:
                # (LOGIT_FMA_ROWS) only the ROW_TILE live rows, as FMAs summed over the chunk: the
                # dot's 16-row tile is 513 FFMA per thread at any width. In passes of at most 8 rows
                # (pass q: group q of a [16 / PASS_ROWS, PASS_ROWS] split): 16 rows in one pass, a
                # [16, CHUNK] x [CHUNK, EXPERTS] shape, Triton 3.6 folds into tt.dot at its default
                # tf32 precision, which flipped routes at 11 and 16 tokens; 8 rows are under
                # tt.dot's least M
                PASS_ROWS: tl.constexpr = ROW_TILE if ROW_TILE < 8 else 8
                g3 = tl.reshape(h * pn_c[None, :], (ROW_PAD // PASS_ROWS, PASS_ROWS, CHUNK_P2))
                for q in tl.static_range(ROW_TILE // PASS_ROWS):
                    hr = tl.sum(tl.where((tl.arange(0, ROW_PAD // PASS_ROWS) == q)[:, None, None], g3, 0.0), axis=0)
                    pl = tl.sum(hr[:, :, None] * rt_c[None, :, :], axis=1)  # [PASS_ROWS, EXPERTS_P2]
                    prow = q * PASS_ROWS + tl.arange(0, PASS_ROWS)
                    tl.store(_as(scratch, SC_PART_LOGITS, tl.float32)
                             + (pid * TOKENS + prow[:, None]) * EXPERTS_P2 + ecols[None, :],
                             pl, mask=(prow < TOKENS)[:, None] & evalid[None, :])
            else:
                pl = tl.dot(h * pn_c[None, :], rt_c, input_precision="ieee")
                tl.store(_as(scratch, SC_PART_LOGITS, tl.float32)
                         + (pid * TOKENS + rows[:, None]) * EXPERTS_P2 + ecols[None, :], pl,
                         mask=rmask[:, None] & evalid[None, :])
    if (STAGE == 0) | (STAGE == 6):
        _stamp(tl_row, C_SEAM_DONE, IS_HIP, INTERP, TIMELINE)
    _grid_barrier(words, fault, e, rank, timeout_ns, pid, PH_SEAM, BLOCKS, IS_HIP, INTERP, STAGE,
                  POLLS_PER_CLOCK, FULL_ROWS)
    if (STAGE == 0) & (pid == 0):
        # every CTA read the epoch before barrier 1, so it moves on here (also after a fault);
        # the next launch reads it after the kernel boundary (or gdc_wait): no exit counter
        tl.store(words, e)

    # ------------------------------------------------------------------------------ B: norm + router logits
    if ((STAGE == 0) | (STAGE == 2)) & (FULL_ROWS != 0):  # phase B was done in phase A
        _stamp(sub_row, 0, IS_HIP, INTERP, TIMELINE)
        _stamp(sub_row, 1, IS_HIP, INTERP, TIMELINE)
    elif (STAGE == 0) | (STAGE == 2):
        _stamp(sub_row, 0, IS_HIP, INTERP, TIMELINE)
        chs = tl.arange(0, CHUNKS_P2)
        # every load of this phase issued here, before the first use of any: a warp issues in
        # order, so a load placed after a use of an earlier load's data (a reduction, a store of
        # a result) waits for that data
        ssq = tl.load(_as(scratch, SC_SUMSQ, tl.float32) + chs[:, None] * ROW_PAD + rows[None, :],
                      mask=(chs < CHUNKS)[:, None], other=0.0)
        if ROW_PICK:
            PICK_CHUNKS: tl.constexpr = (CHUNKS + ROW_PICK_CTAS - 1) // ROW_PICK_CTAS
            rr = pid // ROW_PICK_CTAS
            rp = _as(scratch, SC_ROW_PARTS, tl.float32) + rr * (ROW_PICK_CTAS * EXPERTS_P2)
            cq = (pid % ROW_PICK_CTAS) * PICK_CHUNKS + tl.arange(0, PICK_CHUNKS_P2)
            vpl = tl.load(_as(scratch, SC_PART_LOGITS, tl.float32)
                          + (cq[:, None] * TOKENS + rr) * EXPERTS_P2 + ecols[None, :],
                          mask=((tl.arange(0, PICK_CHUNKS_P2) < PICK_CHUNKS) & (cq < CHUNKS)
                                & (rr < TOKENS))[:, None] & evalid[None, :],
                          other=0.0)
            if not EARLY_LOADS:
                bias_e = tl.load(router_bias + ecols, mask=evalid, other=0.0)  # for the row's last arriver
            pad1 = tl.load(slots + rr + tl.arange(0, 1), mask=rr < TOKENS, other=0) < 0
        else:  # (the logits pass; emask is empty on a CTA past the experts)
            ssq_r = tl.load(_as(scratch, SC_SUMSQ, tl.float32) + chs[:, None] * ROW_PAD + rows_r[None, :],
                            mask=(chs < CHUNKS)[:, None], other=0.0)
            pls = tl.load(_as(scratch, SC_PART_LOGITS, tl.float32)
                          + (chs[:, None, None] * TOKENS + rows_r[None, :, None]) * EXPERTS_P2 + ecol[None, None, :],
                          mask=(chs < CHUNKS)[:, None, None] & rmask_r[None, :, None] & emask[None, None, :],
                          other=0.0)
        ms = tl.sum(ssq, axis=0) / HIDDEN
        rstd = 1.0 / tl.sqrt_rn(ms + EPS)  # [ROW_PAD]
        if pid < CHUNKS:
            offs = rows[:, None] * HIDDEN + ccols[None, :]
            if STAGE == 0:  # this chunk's h and post_norm are still in registers from phase A
                hc, pn = h, pn_c
            else:
                hc = tl.load(_as(scratch, SC_H_ROWS, tl.float32) + offs, mask=m2, other=0.0)
                pn = tl.load(post_norm + ccols, mask=cmask, other=0.0)
            _store_x(scratch, offs, m2, hc * rstd[:, None] * pn[None, :], xsig, TOKENS, HIDDEN, SC_X_TERMS, FP8_X,
                     INTERP, X_TERMS)
        _clear_sync(scratch, pid, SC_COUNTERS, CLEAR_SPAN, CLEAR_SPAN_P2, COUNTERS)
        if ROW_PICK:
            # ROW_PICK_CTAS CTAs per row each sum PICK_CHUNKS chunks' partial logits of that row;
            # the last to arrive sums the parts in order (deterministic, the same on every rank)
            # and picks the row's top-k. One CTA per row reading all 192 chunks took 12-18 us at
            # 8-16 rows.
            last_r = rr < 0
            if rr < TOKENS:
                tl.store(rp + (pid % ROW_PICK_CTAS) * EXPERTS_P2 + ecols, tl.sum(vpl, axis=0))
                tl.debug_barrier()
                last_r = tl.atomic_add(_as(scratch, SC_ROW_ARRIVALS, tl.int32) + rr, 1, sem="acq_rel",
                                       scope="gpu") == ROW_PICK_CTAS - 1
                _stamp(sub_row, 10, IS_HIP, INTERP, TIMELINE)  # arrived (the profile's pick_arrive)
            if last_r:
                accl = tl.sum(tl.load(rp + tl.arange(0, ROW_PICK_CTAS)[:, None] * EXPERTS_P2 + ecols[None, :],
                                      cache_modifier=".cg"), axis=0)
                r1 = rr + tl.arange(0, 1)
                lg1 = accl[None, :] * tl.sum(tl.where(rows == rr, rstd, 0.0), axis=0)
                sel1, w1 = _topk(lg1, bias_e, ecols, evalid, pad1 == 0, TOP_K, TOP_K_P2, EXPERTS_P2, SORT_TOPK)
                # one shared [EXPERTS][ROW_PAD] routing-weight table, and the row's picks for phase C
                tl.store(_as(scratch, SC_ROUTE_TABLE, tl.float32) + ecols[None, :] * ROW_PAD + r1[:, None], w1)
                _stamp(sub_row, 11, IS_HIP, INTERP, TIMELINE)  # after the first store of the picks: the top-k is done
                tl.store(_as(scratch, SC_PICKS, tl.int32) + r1[:, None] * EXPERTS_P2 + ecols[None, :], sel1)
                _store_route(scratch, r1, pad1, sel1, w1, ecols, SC_ROUTE, SC_ROUTE_W, TOP_K, TOP_K_P2)
        elif pid * CTA_EXPERTS < EXPERTS:
            # this CTA's experts: the chunks' partial logits summed in chunk order (the same on
            # every rank, so every rank routes the same), times rstd
            rstd_r = 1.0 / tl.sqrt_rn(tl.sum(ssq_r, axis=0) / HIDDEN + EPS)  # [ROW_TILE]
            lg = tl.sum(pls, axis=0) * rstd_r[:, None]
            tl.store(_as(scratch, SC_LOGITS, tl.float32) + rows_r[:, None] * EXPERTS + ecol[None, :], lg,
                     mask=rmask_r[:, None] & emask[None, :])
        _stamp(sub_row, 1, IS_HIP, INTERP, TIMELINE)
    if not FULL_ROWS:
        _grid_barrier(words, fault, e, rank, timeout_ns, pid, PH_SEAM, BLOCKS, IS_HIP, INTERP, STAGE,
                      POLLS_PER_CLOCK, 2)

    # ------------------------------------------------------------------------------ C: top-k + experts stage 1
    # [SLOTS] stage-1 tiles done per slot, [DOWN_TILES] stage-2 items done per H tile, [SLOTS x UP_TILES]
    # split-K arrivals, then SUM_AS_DONE's [SLOTS x DOWN_TILES] and the WORK_QUEUE ticket
    sync = _as(scratch, SC_COUNTERS, tl.int32)
    meta = _as(scratch, SC_META, tl.int32)
    UP_TILES: tl.constexpr = INTER // UP_TILE
    DOWN_TILES: tl.constexpr = HIDDEN // DOWN_TILE
    UP_K_PART: tl.constexpr = HIDDEN // UP_KSPLIT
    if (STAGE == 0) | (STAGE == 3):
        _stamp(sub_row, 2, IS_HIP, INTERP, TIMELINE)
        ecta = _as(scratch, SC_ACTIVE, tl.int32) + pid * EXPERTS_P2
        if ROW_PICK:
            # the rows' picks from phase B -> the active experts (the same list in every CTA)
            selt = tl.load(_as(scratch, SC_PICKS, tl.int32) + rows_r[:, None] * EXPERTS_P2 + ecols[None, :],
                           mask=rmask_r[:, None], other=0, cache_modifier=".cg")
            active = tl.max(selt, axis=0)  # [EXPERTS_P2]
            wtab = _as(scratch, SC_ROUTE_TABLE, tl.float32)
        else:
            lg = tl.load(_as(scratch, SC_LOGITS, tl.float32) + rows_r[:, None] * EXPERTS + ecols[None, :],
                         mask=rmask_r[:, None] & evalid[None, :], other=0.0)
            slot = tl.load(slots + rows_r, mask=rmask_r, other=-1)
            if not EARLY_LOADS:
                bias_e = tl.load(router_bias + ecols, mask=evalid, other=0.0)
            sel, wsel = _topk(lg, bias_e, ecols, evalid,
                              rmask_r & (slot >= 0), TOP_K, TOP_K_P2, EXPERTS_P2, SORT_TOPK)
            active = tl.max(sel, axis=0)  # [EXPERTS_P2]
            # this CTA's copy of the routing weights, transposed [EXPERTS][ROW_PAD]: a work item
            # reads them from here (L1) instead of keeping [ROW_TILE, EXPERTS] tensors live
            wtab = _as(scratch, SC_ROUTE_TABLE, tl.float32) + pid * (EXPERTS_P2 * ROW_PAD)
            tl.store(wtab + ecols[None, :] * ROW_PAD + rows_r[:, None], wsel)
            if pid == 0:
                _store_route(scratch, rows_r, rmask_r & (slot < 0), sel, wsel, ecols, SC_ROUTE, SC_ROUTE_W,
                             TOP_K, TOP_K_P2)
        if EXPERT_MODE == 1:
            active = tl.where((ecols >= first_expert) & (ecols < first_expert + LOCAL_EXPERTS), active, 0)
        slot_of = tl.cumsum(active, axis=0) - 1
        n_active = tl.sum(active, axis=0)
        tl.store(ecta + slot_of, ecols, mask=active > 0)
        if SUM_OWN_SLOTS:  # expert -> slot (-1: none here), for the sum's reads of each row's own slots
            tl.store(_as(scratch, SC_EXPERT_SLOT, tl.int32) + pid * EXPERTS_P2 + ecols,
                     tl.where(active > 0, slot_of, -1))
        tl.store(meta + pid, n_active)  # this CTA's own count (stage 2 and the sum read it back)
        tl.debug_barrier()
        _stamp(tl_row, C_ROUTER_DONE, IS_HIP, INTERP, TIMELINE)
        if EXPERT_MODE != 2:
            # items (slot j, UP_TILE-row tile t of the intermediate, K part ks), ks fastest; with
            # UP_KSPLIT > 1 the last arriver of a (j, t) sums the parts in ks order (deterministic)
            # and finishes the tile
            n_items = n_active * (UP_TILES * UP_KSPLIT)
            X_PARTS: tl.constexpr = X_TERMS if FP8_X else 2  # x terms: X_TERMS fp8 or fp16 hi + lo
            # UP_COLS token columns per term (UP_COLS >= TOKENS; X_PARTS x UP_COLS >= 16, tl.dot's least N)
            rq = tl.arange(0, UP_COLS)
            c2 = tl.arange(0, X_PARTS * UP_COLS)
            if FP8_X:
                xb = _as(scratch, SC_X_TERMS, tl.float8e4nv)
                tw = tl.exp2((c2 // UP_COLS) * -4.0) * xsig  # term t counts 16^-t, x was divided by xsig
            else:
                xb = _as(scratch, SC_X_TERMS, tl.float16)
                tw = tl.full((X_PARTS * UP_COLS,), 1.0 / SCALE_MUL, tl.float32)
            act = _as(scratch, SC_ACT, tl.float16)
            gpart = _as(scratch, SC_UP_PARTS, tl.float32)
            nn = tl.arange(0, UP_TILE)
            kc2 = tl.arange(0, K_BLOCK)
            # term 0 rows, then term 1 ...
            xo2 = (c2 // UP_COLS * TOKENS + c2 % UP_COLS)[None, :] * HIDDEN + kc2[:, None]
            xm2 = ((c2 % UP_COLS) < TOKENS)[None, :]
            go = nn[:, None] * ROW_PAD + rq[None, :]
            w = pid  # while loops: the interpreter cannot range() over a runtime scalar
            if EARLY_HEADER & 2:  # the first item's expert; each next one's is read at the end of the item before
                hej = tl.load(ecta + w // (UP_KSPLIT * UP_TILES), mask=w < n_items, other=0)
            while w < n_items:
                nxt = _claim(sync + QUEUE_AT, WORK_QUEUE)  # WORK_QUEUE: whichever ticket is free now
                jt = w // UP_KSPLIT
                kb = (w % UP_KSPLIT) * UP_K_PART
                j = jt // UP_TILES
                t = jt % UP_TILES
                if EARLY_HEADER & 2:
                    ej = hej
                    # the route weights the epilogue needs, read now, not after the loop
                    wt = tl.load(wtab + ej * ROW_PAD + rq, mask=rq < TOKENS, other=0.0)  # [UP_COLS]
                else:
                    ej = tl.load(ecta + j)
                le = ej.to(tl.int64)
                if EXPERT_MODE == 1:
                    le = (ej - first_expert).to(tl.int64)
                wbase = w13 + le * (2 * INTER * HIDDEN) + kb
                sbase = s13 + le * ((2 * INTER // 128) * (HIDDEN // 128)) + kb // 128
                r1 = t * UP_TILE + nn  # rows of w1 (gate); w3 (up) rows are INTER further
                # transposed [weight rows, X_PARTS x UP_COLS]: columns UP_COLS t .. UP_COLS (t+1) - 1
                # take x term t, one MMA per weight tile and K step; the terms summed at the end
                acc_g = tl.zeros((UP_TILE, X_PARTS * UP_COLS), tl.float32)
                acc_u = tl.zeros((UP_TILE, X_PARTS * UP_COLS), tl.float32)
                if PACKED_W13:
                    # (PACKED_W13) w13 tile-packed by the runner (runner.packed_w13): each K step's
                    # [UP_TILE, 128] gate block and then its up block one contiguous 2 x UP_TILE x 128 bytes
                    pbase = (w13 + le * (2 * INTER * HIDDEN)
                             + (t * (HIDDEN // K_BLOCK) + kb // K_BLOCK) * (2 * UP_TILE * K_BLOCK))
                    blk = nn[:, None] * K_BLOCK + kc2[None, :]
                    for k0 in tl.range(0, UP_K_PART, K_BLOCK, num_stages=UP_STAGES):
                        # x terms^T tile [K_BLOCK, X_PARTS x UP_COLS]
                        xk = tl.load(xb + xo2 + kb + k0, mask=xm2, other=0.0)
                        wg = tl.load(pbase + (k0 // K_BLOCK) * (2 * UP_TILE * K_BLOCK) + blk)
                        wu = tl.load(pbase + (k0 // K_BLOCK) * (2 * UP_TILE * K_BLOCK) + UP_TILE * K_BLOCK + blk)
                        sg = tl.load(sbase + ((t * UP_TILE) // 128) * (HIDDEN // 128) + k0 // 128) * SCALE_MUL
                        su = tl.load(sbase + ((INTER + t * UP_TILE) // 128) * (HIDDEN // 128) + k0 // 128) * SCALE_MUL
                        acc_g = _mma_sc(wg, sg, xk, acc_g, INTERP, IS_HIP, SCALE_ON_PRODUCT)
                        acc_u = _mma_sc(wu, su, xk, acc_u, INTERP, IS_HIP, SCALE_ON_PRODUCT)
                else:
                    for k0 in tl.range(0, UP_K_PART, K_BLOCK, num_stages=UP_STAGES):
                        # x terms^T tile [K_BLOCK, X_PARTS x UP_COLS]
                        xk = tl.load(xb + xo2 + kb + k0, mask=xm2, other=0.0)
                        wg = tl.load(wbase + r1[:, None] * HIDDEN + k0 + kc2[None, :])
                        wu = tl.load(wbase + (INTER + r1)[:, None] * HIDDEN + k0 + kc2[None, :])
                        sg = tl.load(sbase + ((t * UP_TILE) // 128) * (HIDDEN // 128) + k0 // 128) * SCALE_MUL
                        su = tl.load(sbase + ((INTER + t * UP_TILE) // 128) * (HIDDEN // 128) + k0 // 128) * SCALE_MUL
                        acc_g = _mma_sc(wg, sg, xk, acc_g, INTERP, IS_HIP, SCALE_ON_PRODUCT)
                        acc_u = _mma_sc(wu, su, xk, acc_u, INTERP, IS_HIP, SCALE_ON_PRODUCT)
                if EARLY_HEADER & 2:  # the next item and its expert, their round trips behind this epilogue
                    wn = _next_item(w, nxt, BLOCKS, WORK_QUEUE)
                    hej = tl.load(ecta + wn // (UP_KSPLIT * UP_TILES), mask=wn < n_items, other=0)
                g = tl.sum(tl.reshape(acc_g * tw[None, :], (UP_TILE, X_PARTS, UP_COLS)), axis=1)
                u = tl.sum(tl.reshape(acc_u * tw[None, :], (UP_TILE, X_PARTS, UP_COLS)), axis=1)
                last = True
                if UP_KSPLIT > 1:
                    gp = gpart + w.to(tl.int64) * (2 * UP_TILE * ROW_PAD)
                    tl.store(gp + go, g)
                    tl.store(gp + UP_TILE * ROW_PAD + go, u)
                    tl.debug_barrier()
                    last = tl.atomic_add(sync + SLOTS + DOWN_TILES + jt, 1, sem="acq_rel", scope="gpu") == UP_KSPLIT - 1
                    if last:
                        g = tl.zeros((UP_TILE, UP_COLS), tl.float32)
                        u = tl.zeros((UP_TILE, UP_COLS), tl.float32)
                        for q in tl.static_range(UP_KSPLIT):
                            gq = gpart + (jt * UP_KSPLIT + q).to(tl.int64) * (2 * UP_TILE * ROW_PAD)
                            g += tl.load(gq + go, cache_modifier=".cg")
                            u += tl.load(gq + UP_TILE * ROW_PAD + go, cache_modifier=".cg")
                if last:
                    if (EARLY_HEADER & 2) == 0:
                        wt = tl.load(wtab + ej * ROW_PAD + rq, mask=rq < TOKENS, other=0.0)  # [UP_COLS]
                    a = g / (1.0 + tl.exp(-g)) * u * wt[None, :]
                    if DOWN_FP8:
                        # DOWN_ACT_TERMS fp8 terms of a / (the tile's max / 256), as x's (_store_x):
                        # stage 2 then multiplies them with the fp8 w2 codes as stored, the tile's
                        # scale on each product (one number per K step and tile, not per token)
                        araw = tl.max(tl.max(tl.abs(a), axis=1), axis=0)
                        amax = tl.maximum(araw, 1e-30)
                        ar = a * (256.0 / amax)
                        a8 = _as(scratch, SC_ACT_FP8, tl.float8e4nv) + r1[:, None]
                        for q in tl.static_range(DOWN_ACT_TERMS):
                            aq = _fp8(ar, INTERP)
                            tl.store(a8 + ((j * DOWN_ACT_TERMS + q) * ROW_PAD + rq[None, :]).to(tl.int64) * INTER, aq)
                            ar = (ar - aq.to(tl.float32)) * 16.0
                        tl.store(_as(scratch, SC_ACT_SCALE, tl.float32) + j * UP_TILES + t, amax * (1.0 / 256.0))
                    else:
                        tl.store(act + (j * ROW_PAD + rq[None, :]).to(tl.int64) * INTER + r1[:, None], a.to(tl.float16))
                    tl.debug_barrier()
                    tl.atomic_add(sync + j, 1, sem="release", scope="gpu")  # one more tile of slot j done
                if EARLY_HEADER & 2:
                    w = wn
                else:
                    w = _next_item(w, nxt, BLOCKS, WORK_QUEUE)
            if WORK_QUEUE & (STAGE == 3):  # the stage-2 item its last claim took, for the next launch
                tl.store(meta + BLOCKS + pid, w)
        _stamp(sub_row, 3, IS_HIP, INTERP, TIMELINE)
    # no grid barrier: a stage-2 item waits for its own expert's UP_TILES tiles only

    # ------------------------------------------------------------------------------ D: experts stage 2
    # work items (active expert j, DOWN_TILE-column tile of H): ypart[j, :TOKENS, tile] =
    # act[j] @ w2[e_j][tile]^T, numbered after the stage-1 items, so a CTA with no stage-1 item
    # starts on stage 2 at once
    if (STAGE == 0) | (STAGE == 4):
        if EXPERT_MODE != 2:
            n_act = tl.load(meta + pid)
            n1 = n_act * (UP_TILES * UP_KSPLIT)
            act = _as(scratch, SC_ACT, tl.float16)
            ecta = _as(scratch, SC_ACTIVE, tl.int32) + pid * EXPERTS_P2  # this CTA's own list (phase C)
            ypart = _as(scratch, SC_DOWN_PARTS, tl.float32)
            ki = tl.arange(0, 128)
            hh = tl.arange(0, DOWN_TILE)
            if DOWN_FP8:
                # DOWN_COLS token columns per term: the tokens' own count (at least DOWN_MIN_COLS),
                # not stage 1's UP_COLS; DOWN_ACT_TERMS x DOWN_COLS < 16 compiles to fp16 mma.sync
                rq2 = tl.arange(0, DOWN_COLS)
                kn = tl.arange(0, UP_TILE)
                c8 = tl.arange(0, DOWN_ACT_TERMS * DOWN_COLS)
                tw8 = tl.exp2((c8 // DOWN_COLS) * -4.0)  # term t counts 16^-t
            _stamp(sub_row, 4, IS_HIP, INTERP, TIMELINE)
            if WORK_QUEUE:
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
            wend = n1 + n_act * (DOWN_TILES * DOWN_KSPLIT)
            # the rows whose partial an item writes: SUM_OWN_SLOTS=2 only those routed to its
            # expert, as the sum reads no other (loaded with the item's header, not beside the
            # store, which would wait for it)
            if DOWN_FP8:
                yrow = rq2
                yrm = rq2 < TOKENS
            else:
                yrow = rows
                yrm = rmask
            if EARLY_HEADER & 1:  # the first item's header; each next one's is read at the end of the item before
                hej, hv, hym = _s2_header(w, wend, n1, ecta, sync, _as(scratch, SC_ROUTE_TABLE, tl.float32) + yrow, yrm,
                                          ROW_PAD, DOWN_TILES, DOWN_KSPLIT, SUM_OWN_SLOTS)
            # DOWN_KSPLIT > 1: each (j, tile) item in DOWN_KSPLIT parts of the intermediate (the
            # last round's items are the tail of the phase; a part is 1/DOWN_KSPLIT of the bytes),
            # partials summed in phase E
            while w < wend:
                j = (w - n1) // (DOWN_TILES * DOWN_KSPLIT)
                t = (w - n1) % (DOWN_TILES * DOWN_KSPLIT) // DOWN_KSPLIT
                kh = (w - n1) % DOWN_KSPLIT
                kq = kh * (INTER // DOWN_KSPLIT)
                if EARLY_HEADER & 1:
                    ej = hej
                else:
                    ej = tl.load(ecta + j)
                le = ej.to(tl.int64)
                if EXPERT_MODE == 1:
                    le = (ej - first_expert).to(tl.int64)
                wbase = w2 + le * (HIDDEN * INTER) + (t * DOWN_TILE + hh)[:, None] * INTER
                sbase = s2 + le * ((HIDDEN // 128) * (INTER // 128)) + ((t * DOWN_TILE) // 128) * (INTER // 128)
                if EARLY_HEADER & 1:
                    ym = hym
                else:
                    ym = yrm
                    if SUM_OWN_SLOTS == 2:
                        ym &= tl.load(_as(scratch, SC_ROUTE_TABLE, tl.float32) + ej * ROW_PAD + yrow, mask=ym,
                                      other=0.0) != 0.0
                if EARLY_HEADER & 1:
                    _spin_count(sync + j, hv, 0, UP_TILES, fault, e, rank, timeout_ns, pid, PH_REDUCE, IS_HIP, INTERP,
                                POLLS_PER_CLOCK)
                    tl.debug_barrier()
                else:
                    _wait_count(sync + j, UP_TILES, fault, e, rank, timeout_ns, pid, IS_HIP, INTERP, POLLS_PER_CLOCK)
                # claimed once the item's tiles are in: a CTA waiting for them (one with no
                # stage-1 item waits from the router on) holds no next item meanwhile
                nxt = _claim(sync + QUEUE_AT, WORK_QUEUE)
                if DOWN_FP8:
                    a8 = (_as(scratch, SC_ACT_FP8, tl.float8e4nv)
                          + ((j * DOWN_ACT_TERMS + c8 // DOWN_COLS) * ROW_PAD + c8 % DOWN_COLS)[None, :].to(tl.int64)
                          * INTER + kn[:, None])
                    asc = _as(scratch, SC_ACT_SCALE, tl.float32) + j * UP_TILES
                    if PACKED_W2:
                        # (PACKED_W2) runner.packed_w2: W2_PACK_ROWS rows one contiguous
                        # W2_PACK_ROWS x INTER bytes, each [W2_PACK_ROWS, UP_TILE] K block in turn;
                        # a smaller DOWN_TILE reads its rows' contiguous part of each block
                        PACK_TILES: tl.constexpr = W2_PACK_ROWS // DOWN_TILE
                        wpk = (w2 + le * (HIDDEN * INTER) + (t // PACK_TILES) * (W2_PACK_ROWS * INTER)
                               + ((t % PACK_TILES) * DOWN_TILE + hh)[:, None] * UP_TILE + kn[None, :])
                if TIMELINE:
                    if w == w0:
                        _stamp(sub_row, 8, IS_HIP, INTERP, TIMELINE)
                if DOWN_FP8:
                    # fp8 x fp8 as stage 1: [DOWN_TILE, UP_TILE] w2 codes @ [UP_TILE, DOWN_ACT_TERMS x
                    # DOWN_COLS] act terms per stage-1 tile, each product times w2's block scale x the
                    # tile's act scale
                    yt8 = tl.zeros((DOWN_TILE, DOWN_ACT_TERMS * DOWN_COLS), tl.float32)
                    # DOWN_FP8 = 2: steps of 128 (two stage-1 tiles, an MMA each); 1: steps of one tile
                    DOWN_K_STEP: tl.constexpr = UP_TILE if DOWN_FP8 == 1 else 128
                    for k0 in tl.range(0, INTER // DOWN_KSPLIT, DOWN_K_STEP, num_stages=DOWN_STAGES):
                        for q in tl.static_range(DOWN_K_STEP // UP_TILE):
                            kk = kq + k0 + q * UP_TILE
                            av = tl.load(a8 + kk, cache_modifier=".cg")
                            if PACKED_W2:  # kk is a multiple of UP_TILE: its block starts kk x W2_PACK_ROWS in
                                wq = tl.load(wpk + kk * W2_PACK_ROWS)
                            else:
                                wq = tl.load(wbase + kk + kn[None, :])
                            sc = tl.load(sbase + kk // 128) * tl.load(asc + kk // UP_TILE, cache_modifier=".cg")
                            yt8 = _mma_sc(wq, sc, av, yt8, INTERP, IS_HIP, SCALE_ON_PRODUCT)
                    # [DOWN_TILE, DOWN_COLS]
                    yv = tl.sum(tl.reshape(yt8 * tw8[None, :], (DOWN_TILE, DOWN_ACT_TERMS, DOWN_COLS)), axis=1)
                else:
                    yt = tl.zeros((DOWN_TILE, ROW_PAD), tl.float32)  # transposed: [H columns, tokens]
                    for k0 in tl.range(0, INTER // DOWN_KSPLIT, 128, num_stages=DOWN_STAGES):
                        a = tl.load(act + (j * ROW_PAD + rows[None, :]).to(tl.int64) * INTER + kq + k0 + ki[:, None],
                                    mask=rmask[None, :], other=0.0, cache_modifier=".cg")
                        wq = tl.load(wbase + kq + k0 + ki[None, :])
                        yt = _mma_sc(wq, tl.load(sbase + (kq + k0) // 128) * SCALE_MUL, a, yt, INTERP, IS_HIP,
                                     SCALE_ON_PRODUCT)
                    yv = yt * (1.0 / SCALE_MUL)
                # the successor and its header now, their round trips behind this store and release
                if EARLY_HEADER & 1:
                    wn = _next_item(w, nxt, BLOCKS, WORK_QUEUE)  # stage-2 items are numbered from n1
                    hej, hv, hym = _s2_header(wn, wend, n1, ecta, sync,
                                              _as(scratch, SC_ROUTE_TABLE, tl.float32) + yrow, yrm,
                                              ROW_PAD, DOWN_TILES, DOWN_KSPLIT, SUM_OWN_SLOTS)
                # [DOWN_TILE columns of H, the rows' columns yrow]
                tl.store(ypart + ((j * DOWN_KSPLIT + kh) * TOKENS + yrow[None, :]).to(tl.int64) * HIDDEN
                         + t * DOWN_TILE + hh[:, None], yv, mask=ym[None, :])
                tl.debug_barrier()
                if SUM_AS_DONE:  # per (slot, tile): phase E sums a tile's slots as they finish, in slot order
                    tl.atomic_add(sync + SLOT_TILE_AT + j * DOWN_TILES + t, 1, sem="release", scope="gpu")
                else:
                    tl.atomic_add(sync + SLOTS + t, 1, sem="release", scope="gpu")  # one more slot of tile t done
                if TIMELINE:
                    if w == w0:
                        _stamp(sub_row, 9, IS_HIP, INTERP, TIMELINE)
                if EARLY_HEADER & 1:
                    w = wn
                else:
                    w = _next_item(w, nxt, BLOCKS, WORK_QUEUE)  # stage-2 items are numbered from n1
            _stamp(sub_row, 5, IS_HIP, INTERP, TIMELINE)
    # no grid barrier: the sum of a chunk waits for its own H tiles only

    # ------------------------------------------------------------------------------ E: sum + reduce
    if (STAGE == 0) | (STAGE == 5):
        _stamp(sub_row, 6, IS_HIP, INTERP, TIMELINE)
        y = tl.zeros((ROW_PAD, CHUNK_P2), tl.float32)
        if EXPERT_MODE != 2:
            if pid < CHUNKS:
                # this chunk's MoE partial: the experts' parts summed in slot order (deterministic)
                n_act = tl.load(meta + pid) * DOWN_KSPLIT  # partials: (slot, part of the intermediate) in that order
                t_lo = (pid * CHUNK) // DOWN_TILE
                t_hi = (pid * CHUNK + CHUNK - 1) // DOWN_TILE  # a chunk spans at most two H tiles (CHUNK <= DOWN_TILE)
                if CHUNKS * CHUNK > HIDDEN:  # the last chunk ends past H (a grid that does not divide it)
                    t_hi = tl.minimum(pid * CHUNK + CHUNK - 1, HIDDEN - 1) // DOWN_TILE
                if SUM_OWN_SLOTS:
                    # (SUM_OWN_SLOTS) each row's own slots, not every slot: route (phase B's row
                    # picks, before barrier 2) in expert order, which is slot order, mapped by phase
                    # C's table
                    kk = tl.arange(0, TOP_K_P2)
                    rk = rmask[:, None] & (kk < TOP_K)[None, :]
                    rte = tl.load(_as(scratch, SC_ROUTE, tl.int32) + rows[:, None] * TOP_K + kk[None, :], mask=rk,
                                  other=-1, cache_modifier=".cg")
                    # [ROW_PAD, TOP_K_P2]
                    sl = tl.load(_as(scratch, SC_EXPERT_SLOT, tl.int32) + pid * EXPERTS_P2 + rte, mask=rte >= 0,
                                 other=-1, cache_modifier=".cg")
                    if SUM_OWN_SLOTS == 2:  # stage 2 wrote a row's partial only where its weight is not 0
                        rtw = tl.load(_as(scratch, SC_ROUTE_W, tl.float32) + rows[:, None] * TOP_K + kk[None, :],
                                      mask=rk, other=0.0, cache_modifier=".cg")
                        sl = tl.where(rtw != 0.0, sl, -1)
                if not SUM_AS_DONE:
                    _wait_count(sync + SLOTS + t_lo, n_act, fault, e, rank, timeout_ns, pid, IS_HIP, INTERP,
                                POLLS_PER_CLOCK)
                    if t_hi != t_lo:
                        _wait_count(sync + SLOTS + t_hi, n_act, fault, e, rank, timeout_ns, pid, IS_HIP, INTERP,
                                    POLLS_PER_CLOCK)
                _stamp(sub_row, 7, IS_HIP, INTERP, TIMELINE)
                ypart = _as(scratch, SC_DOWN_PARTS, tl.float32)
                if SUM_OWN_SLOTS:
                    # the TOP_K slots of each row in slot order, each as a [rows, chunk] load (one
                    # [rows, TOP_K, chunk] load held 176 registers at 3 tokens: two CTAs per SM, not
                    # three; the slots packed in an int64 before the wait, TOP_K shifts here instead
                    # of these 2 TOP_K reductions, measured the same)
                    # < slots x DOWN_KSPLIT x TOKENS x HIDDEN: int32
                    yr = (sl * DOWN_KSPLIT * TOKENS + rows[:, None]) * HIDDEN
                    for k in tl.static_range(TOP_K):
                        yk = tl.sum(tl.where(kk[None, :] == k, yr, 0), axis=1)
                        ok = tl.sum(tl.where(kk[None, :] == k, sl, 0), axis=1) >= 0
                        for q in tl.static_range(DOWN_KSPLIT):
                            y += tl.load(ypart + (yk + q * TOKENS * HIDDEN)[:, None] + ccols[None, :],
                                         mask=ok[:, None] & cmask[None, :], other=0.0, cache_modifier=".cg")
                else:
                    jj = tl.arange(0, SUM_BATCH)
                    yo = rows[:, None] * HIDDEN + ccols[None, :]
                    j0 = n_act * 0
                    n_done = n_act * 0  # (SUM_AS_DONE) the partials of the slots done so far, a prefix
                    while j0 < n_act:
                        if SUM_AS_DONE:
                            j1 = tl.minimum(j0 + SUM_BATCH, n_act)  # this batch's partials must be done
                            if n_done < j1:
                                n_done = _wait_prefix(sync + SLOT_TILE_AT, t_lo, t_hi, n_act // DOWN_KSPLIT,
                                                      (j1 + DOWN_KSPLIT - 1) // DOWN_KSPLIT, DOWN_KSPLIT,
                                                      DOWN_TILES, SLOTS_P2, SUM_AS_DONE, fault, e, rank, timeout_ns,
                                                      pid, IS_HIP, INTERP,
                                                      POLLS_PER_CLOCK) * DOWN_KSPLIT
                        js = j0 + jj
                        v = tl.load(ypart + (js[:, None, None] * TOKENS * HIDDEN).to(tl.int64) + yo[None, :, :],
                                    mask=(js < n_act)[:, None, None] & m2[None, :, :], other=0.0, cache_modifier=".cg")
                        y += tl.sum(v, axis=0)
                        j0 += SUM_BATCH
        _stamp(tl_row, C_EXPERTS_DONE, IS_HIP, INTERP, TIMELINE)
        offs = rows[:, None] * HIDDEN + ccols[None, :]
        yb = _bf16(y, INTERP)
        if SOLO:
            tl.store(out + offs, yb, mask=m2)
        else:
            _send(peers, pid, rank, par, yb, tl.where(_rank_faulted(fault, e), -e, e), offs, m2, PEER_MOE,
                  PEER_MOE_TAGGED, PH_REDUCE, PEER_FLAGS, TP, MAX_TOKENS, HIDDEN, FLAG_CTAS, INTERP, FENCE,
                  TAGGED_WORDS)
        _stamp(tl_row, C_RED_ARRIVE, IS_HIP, INTERP, TIMELINE)
    if (STAGE == 0) | (STAGE == 7):
        offs = rows[:, None] * HIDDEN + ccols[None, :]
        if SOLO:  # out was stored with the sum
            _stamp(tl_row, C_RED_SEEN, IS_HIP, INTERP, TIMELINE)
        else:
            o = _gather(peers, fault, pid, rank, e, timeout_ns, tl_row, par, offs, m2, PEER_MOE, PEER_MOE_TAGGED,
                        PH_REDUCE, PEER_FLAGS, PEER_FAULT_BOX, TP, MAX_TOKENS, HIDDEN, FLAG_CTAS, C_RED_SEEN, IS_HIP,
                        INTERP, TIMELINE, POLLS_PER_CLOCK, TAGGED_WORDS)
            tl.store(out + offs, _bf16(o, INTERP), mask=m2)
        _stamp(tl_row, C_RED_DONE, IS_HIP, INTERP, TIMELINE)

        # -------------------------------------------------------------------------- F: handshake, end
        if FINAL:
            if not SOLO:
                val = tl.where(_rank_faulted(fault, e), -e, e)
                _publish(peers, pid, rank, val, PH_HANDSHAKE, PEER_FLAGS, TP, FLAG_CTAS, INTERP, FENCE)
            _stamp(tl_row, C_HS_ARRIVE, IS_HIP, INTERP, TIMELINE)
    if (STAGE == 0) | (STAGE == 8):
        if FINAL:
            if SOLO:
                _stamp(tl_row, C_HS_SEEN, IS_HIP, INTERP, TIMELINE)
            else:
                # a flag: no chunk
                _wait_peers(peers, fault, pid, rank, e, timeout_ns, tl_row, m2, m2, 0, PH_HANDSHAKE, PEER_FLAGS,
                            PEER_FAULT_BOX, TP, FLAG_CTAS, 0, C_HS_SEEN, IS_HIP, INTERP, TIMELINE, POLLS_PER_CLOCK,
                            False)
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


def launch(blocks: int, args: list, constexprs: dict, num_warps: int, options: dict | None = None,
           num_stages: int | None = 2):
    """One launch of ffn_kernel on a grid of ``blocks`` CTAs: ``args`` its 19 arguments in order,
    ``constexprs`` one build's (geometry.constexprs), ``options`` its launch options
    (geometry.launch_options: the cooperative launch, PDL, the register cap). A staged launch
    under the interpreter passes ``num_stages=None`` (the JIT's default)."""
    stages = {} if num_stages is None else {"num_stages": num_stages}
    return ffn_kernel[(blocks,)](*args, **constexprs, num_warps=num_warps, **stages, **(options or {}))


@triton.jit
def clock_kernel(out, IS_HIP: tl.constexpr):
    """The device clock in ns (the runner's clock_ns: the timeline's common time base)."""
    tl.store(out, now_ns(IS_HIP, False))
