"""prefetch under the Triton interpreter: an item's L2 prefetch runs cover exactly the weight bytes
its loop reads (no byte missed, none twice, none of another item), for w13 and w2 as given and
tile-packed (runner.packed_w13 / packed_w2), split K parts included. The runs are found by laying
each weight out as its own logical byte index and packing that as the runner packs the weight."""
import os

import pytest
import torch
import triton
import triton.language as tl

from ffnq.backends.triton.prefetch import _down_runs, _up_runs
from ffnq.backends.triton.runner import packed_w13, packed_w2

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                   reason="slow: set TRITON_INTERPRET=1 to run")]

E, HIDDEN, INTER = 4, 512, 256  # a local expert's w13 [2 INTER, HIDDEN], w2 [HIDDEN, INTER]


@triton.jit
def _runs_kernel(ecta, off_p, nb_p, live_p, w, first_expert, STAGE: tl.constexpr, N: tl.constexpr,
                 HIDDEN: tl.constexpr, INTER: tl.constexpr, EXPERT_MODE: tl.constexpr, UP_TILE: tl.constexpr,
                 UP_KSPLIT: tl.constexpr, PACKED_W13: tl.constexpr, DOWN_TILE: tl.constexpr,
                 DOWN_KSPLIT: tl.constexpr, PACKED_W2: tl.constexpr, W2_PACK_ROWS: tl.constexpr):
    r = tl.arange(0, N)
    if STAGE == 1:
        off = _up_runs(w, ecta, first_expert, HIDDEN, INTER, EXPERT_MODE, UP_TILE, UP_KSPLIT, PACKED_W13)
        tl.store(off_p + r, off)
        tl.store(nb_p + r, tl.full((N,), HIDDEN // UP_KSPLIT, tl.int32))
        tl.store(live_p + r, tl.full((N,), 1, tl.int32))
    else:
        off, nb, live = _down_runs(w, ecta, first_expert, HIDDEN, INTER, EXPERT_MODE, UP_TILE, DOWN_TILE,
                                   DOWN_KSPLIT, PACKED_W2, W2_PACK_ROWS)
        tl.store(off_p + r, off)
        tl.store(nb_p + r, nb)
        tl.store(live_p + r, live.to(tl.int32))


def _bytes_of(layout: torch.Tensor, stage, w, ecta, first_expert=0, mode=0, n=128, **k) -> torch.Tensor:
    """The logical indices of the bytes item ``w``'s runs cover, through ``layout`` (a weight's
    logical index at each byte of its layout in memory), sorted; a byte covered twice stays twice."""
    off = torch.full((n,), -1, dtype=torch.int64)
    nb = torch.zeros(n, dtype=torch.int32)
    live = torch.zeros(n, dtype=torch.int32)
    _runs_kernel[(1,)](torch.tensor(ecta, dtype=torch.int32), off, nb, live, w, first_expert, STAGE=stage, N=n,
                       HIDDEN=HIDDEN, INTER=INTER, EXPERT_MODE=mode, **k)
    flat = layout.reshape(-1)
    got = [flat[o:o + b] for o, b, v in zip(off.tolist(), nb.tolist(), live.tolist()) if v]
    assert all(b % 16 == 0 and o % 16 == 0 for o, b, v in zip(off.tolist(), nb.tolist(), live.tolist()) if v)
    return torch.cat(got).sort().values


def _index(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(E * rows * cols, dtype=torch.int64).view(E, rows, cols)


@pytest.mark.parametrize("packed", [0, 1])
@pytest.mark.parametrize("up_tile,ksplit", [(64, 1), (64, 2), (32, 4)])
def test_interpreter_stage1_runs_are_the_items_bytes(packed, up_tile, ksplit):
    idx = _index(2 * INTER, HIDDEN)
    layout = packed_w13(idx, up_tile) if packed else idx
    ecta = [2, 0, 3]  # the CTA's active experts, by slot
    tiles, part = INTER // up_tile, HIDDEN // ksplit
    seen = []
    for w in range(len(ecta) * tiles * ksplit):
        jt, ks = divmod(w, ksplit)
        j, t = divmod(jt, tiles)
        tile = torch.arange(t * up_tile, (t + 1) * up_tile)
        rows = torch.cat([tile, INTER + tile])  # its gate rows and its up rows
        want = idx[ecta[j]][rows][:, ks * part:(ks + 1) * part].reshape(-1).sort().values
        got = _bytes_of(layout, 1, w, ecta, n=2 * up_tile, UP_TILE=up_tile, UP_KSPLIT=ksplit, PACKED_W13=packed,
                        DOWN_TILE=64, DOWN_KSPLIT=1, PACKED_W2=0, W2_PACK_ROWS=128)
        assert torch.equal(got, want), (w, packed)
        seen.append(got)
    every = torch.cat(seen)
    assert every.numel() == every.unique().numel() == len(ecta) * 2 * INTER * HIDDEN  # each byte once


@pytest.mark.parametrize("packed", [0, 1])
@pytest.mark.parametrize("down_tile,ksplit", [(64, 1), (64, 2), (128, 1), (32, 2)])
def test_interpreter_stage2_runs_are_the_items_bytes(packed, down_tile, ksplit):
    up_tile, pack_rows = 64, 128
    idx = _index(HIDDEN, INTER)
    layout = packed_w2(idx, pack_rows, up_tile) if packed else idx
    ecta = [5, 7]  # local experts 1 and 3 of a rank whose first is 4 (EXPERT_MODE 1)
    tiles, part = HIDDEN // down_tile, INTER // ksplit
    seen = []
    for v in range(len(ecta) * tiles * ksplit):
        j, rest = divmod(v, tiles * ksplit)
        t, kh = divmod(rest, ksplit)
        want = idx[ecta[j] - 4][t * down_tile:(t + 1) * down_tile, kh * part:(kh + 1) * part].reshape(-1).sort().values
        got = _bytes_of(layout, 2, v, ecta, first_expert=4, mode=1, n=128 if packed else down_tile, UP_TILE=up_tile,
                        UP_KSPLIT=1, PACKED_W13=0, DOWN_TILE=down_tile, DOWN_KSPLIT=ksplit, PACKED_W2=packed,
                        W2_PACK_ROWS=pack_rows)
        assert torch.equal(got, want), (v, packed)
        seen.append(got)
    every = torch.cat(seen)
    assert every.numel() == every.unique().numel() == len(ecta) * HIDDEN * INTER
