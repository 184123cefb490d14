"""tiles under the Triton interpreter: the three SORT_TOPK forms of _topk pick the same experts and
weights as a float64 oracle (highest biased score, the lowest index on a tie), ties included;
_bf16 rounds as a GPU does (to nearest even), where the interpreter's own conversion truncates."""
import os

import pytest
import torch
import triton
import triton.language as tl

from ffnq.backends.triton.tiles import _bf16, _topk

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                   reason="slow: set TRITON_INTERPRET=1 to run")]


@triton.jit
def _topk_kernel(lg_p, b_p, live_p, sel_p, w_p, R: tl.constexpr, E: tl.constexpr, K: tl.constexpr,
                 KP2: tl.constexpr, SORT: tl.constexpr):
    r = tl.arange(0, R)
    e = tl.arange(0, E)
    lg = tl.load(lg_p + r[:, None] * E + e[None, :])
    sel, w = _topk(lg, tl.load(b_p + e), e, e < E, tl.load(live_p + r) != 0, K, KP2, E, SORT)
    tl.store(sel_p + r[:, None] * E + e[None, :], sel)
    tl.store(w_p + r[:, None] * E + e[None, :], w)


def _run(lg: torch.Tensor, bias: torch.Tensor, live: torch.Tensor, k: int, sort: int):
    rows, e = lg.shape
    sel = torch.full((rows, e), -1, dtype=torch.int32)
    w = torch.full((rows, e), float("nan"))
    _topk_kernel[(1,)](lg, bias, live.to(torch.int32), sel, w, R=rows, E=e, K=k, KP2=triton.next_power_of_2(k), SORT=sort)
    return sel, w


def _oracle(lg, bias, live, k):
    s = torch.sigmoid(lg.double())
    b = s + bias.double()[None, :]
    sel = torch.zeros(lg.shape, dtype=torch.int32)
    for r in range(lg.shape[0]):
        if live[r]:
            order = sorted(range(lg.shape[1]), key=lambda i: (-b[r, i].item(), i))  # lowest index on a tie
            sel[r, order[:k]] = 1
    w = torch.where(sel > 0, s, 0.0)
    return sel, w / w.sum(1, keepdim=True).clamp_min(1e-300)


@pytest.mark.parametrize("sort", [0, 1, 2])
def test_interpreter_topk_forms_match_the_oracle_with_ties(sort):
    g = torch.Generator().manual_seed(sort)
    rows, e, k = 4, 64, 8
    lg = torch.randn(rows, e, generator=g)
    lg[1] = -3.0
    lg[1, 50:53] = 2.0
    lg[1, 10:30] = 0.25  # 3 above, then one score shared by 20 experts: places 4-8 fall inside the tie
    lg[2, ::3] = -0.5
    bias = torch.zeros(e)
    bias[40:] = 0.01 * torch.randn(e - 40, generator=g)
    live = torch.tensor([1, 1, 1, 0])
    sel, w = _run(lg, bias, live, k, sort)
    want_sel, want_w = _oracle(lg, bias, live, k)
    assert torch.equal(sel, want_sel)
    assert sel[1, 10:30].tolist() == [1] * 5 + [0] * 15  # the tie went to the lowest indices
    assert sel[:3].sum(1).tolist() == [k, k, k] and sel[3].sum() == 0
    assert torch.allclose(w.double(), want_w, rtol=1e-5, atol=1e-7)


@triton.jit
def _bf16_kernel(x_p, y_p, raw_p, N: tl.constexpr):
    o = tl.arange(0, N)
    x = tl.load(x_p + o)
    tl.store(y_p + o, _bf16(x, True))
    tl.store(raw_p + o, x.to(tl.bfloat16))


def test_bf16_rounds_to_nearest_even():
    """Random values of both signs and every magnitude, and the ties (the low 16 bits 0x8000, on
    an even and an odd bf16): the same bits as torch's round to nearest even. The interpreter's
    own conversion differs from it (it truncates), so the test can tell."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-60, 60, (4096,), generator=g).float())
    ties = (torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x40008000], dtype=torch.int64)
            .to(torch.int32).view(torch.float32))  # +-1.0 and +-1.0078125 (even, odd) plus half a bf16 step
    x = torch.cat([x, ties, torch.tensor([0.0, -0.0, 1.0, -2.5])])
    n = triton.next_power_of_2(len(x))
    x = torch.cat([x, torch.zeros(n - len(x))])
    y, raw = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    _bf16_kernel[(1,)](x, y, raw, N=n)
    want = x.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(raw.view(torch.int16), want.view(torch.int16))
