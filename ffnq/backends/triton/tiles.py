"""The fused kernel's arithmetic on tiles (device helpers): the block-scaled expert MMAs ("swap AB":
the weight rows are M), fp32 -> fp8 terms of x, the sigmoid+bias top-k and its route, and the whole
rows and router rows FULL_ROWS reads."""
import triton
import triton.language as tl

from ffnq.backends.triton.sync import _as


@triton.jit
def _wscaled(w, scale, INTERP: tl.constexpr, IS_HIP: tl.constexpr):
    """fp8 weight codes times their block's dequant scale (pre-multiplied by SCALE_MUL = 2^8, undone
    on the accumulator, exact, so that small scales stay normal in fp16), as the fp16 A operand:
    the MMA then accumulates over the whole K loop (async wgmma, no wait per K block). fp8 ->
    fp16 is exact and packed (one cvt per 2 codes), the product one packed fp16 multiply; the
    price is its rounding (<= 2^-11 relative: bf16 here put single small elements over the
    tolerance in a 100k-step H200 soak). The SCALE_ON_PRODUCT=0 path; the interpreter keeps fp32."""
    if INTERP:
        r = w.to(tl.float32) * scale
    elif IS_HIP:
        r = w.to(tl.float16) * scale.to(tl.float16)
    else:
        # (Triton emits a scalar mul.f16 per element plus unpacking movs: the packed form by hand)
        s16 = tl.full(w.shape, 0, tl.float16) + scale.to(tl.float16)
        r = tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [w.to(tl.float16), s16], dtype=tl.float16,
                                      is_pure=True, pack=2)
    return r


@triton.jit
def _topk(lg, bias, ecols, evalid, live, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, EXPERTS_P2: tl.constexpr,
          SORT_TOPK: tl.constexpr):
    """Per row of logits lg [R, EP2]: sigmoid scores, the biased top-k and the renormalised
    routing weights; rows not ``live`` select nothing. One int64 key per score (the fp32 bits
    made order-preserving in the high word, the reversed index in the low word), so one max per
    round picks the highest biased score and, among equal ones, the lowest index.
    Returns (sel [R, EP2] int32 0/1, weights [R, EP2] fp32)."""
    scores = 1.0 / (1.0 + tl.exp(-lg))
    b = tl.where(evalid[None, :], scores + bias[None, :], float("-inf"))
    bits = b.to(tl.int32, bitcast=True)
    key = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | (EXPERTS_P2 - 1 - ecols)[None, :].to(tl.int64)
    if SORT_TOPK == 2:
        # the partial bitonic sort on the fp32 biased scores (half the shuffles of the int64 keys):
        # the K-th largest score is the threshold; the scores above it are in, and of those equal
        # to it the lowest indices, as many as are still missing (the int64 keys' order exactly,
        # but -0.0 ties +0.0 here, as IEEE compares them)
        top = tl.topk(b, TOP_K_P2, dim=1)  # [R, KP2], descending
        kth = tl.min(tl.where(tl.arange(0, TOP_K_P2)[None, :] < TOP_K, top, float("inf")), axis=1)
        gt = b > kth[:, None]
        eq = (b == kth[:, None]).to(tl.int32)
        need = TOP_K - tl.sum(gt.to(tl.int32), axis=1)
        sel = (gt | ((eq > 0) & (tl.cumsum(eq, axis=1) <= need[:, None]))).to(tl.int32)
    elif SORT_TOPK:
        # one partial bitonic sort (keys are unique): the K-th largest key is the threshold
        top = tl.topk(key, TOP_K_P2, dim=1)  # [R, KP2], descending
        kth = tl.min(tl.where(tl.arange(0, TOP_K_P2)[None, :] < TOP_K, top, 9223372036854775807), axis=1)
        sel = (key >= kth[:, None]).to(tl.int32)
    else:
        sel = tl.zeros(lg.shape, tl.int32)
        for kk in tl.static_range(TOP_K):
            hit = key == tl.max(key, axis=1)[:, None]
            sel = tl.where(hit, 1, sel)
            key = tl.where(hit, -9223372036854775807, key)
    sel = tl.where(live[:, None], sel, 0)
    w = tl.where(sel > 0, scores, 0.0)
    ws = tl.sum(w, axis=1)
    return sel, w / tl.where(ws > 0, ws, 1.0)[:, None]


@triton.jit
def _store_route(scratch, rows, pad, sel, w, ecols, SC_ROUTE: tl.constexpr, SC_ROUTE_W: tl.constexpr,
                 TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr):
    """route/route_w of ``rows`` in expert order; a padding row gets -1 / 0."""
    rte = _as(scratch, SC_ROUTE, tl.int32) + rows[:, None] * TOP_K
    rtw = _as(scratch, SC_ROUTE_W, tl.float32) + rows[:, None] * TOP_K
    pos = tl.cumsum(sel, axis=1) - 1
    tl.store(rte + pos, ecols[None, :] + tl.zeros(sel.shape, tl.int32), mask=sel > 0)
    tl.store(rtw + pos, w, mask=sel > 0)
    kc = tl.arange(0, TOP_K_P2)[None, :]
    pm = pad[:, None] & (kc < TOP_K)
    tl.store(rte + kc, tl.zeros(pm.shape, tl.int32) - 1, mask=pm)
    tl.store(rtw + kc, tl.zeros(pm.shape, tl.float32), mask=pm)


@triton.jit
def _mma_sc(w, scale, x, acc, INTERP: tl.constexpr, IS_HIP: tl.constexpr, SCALE_ON_PRODUCT: tl.constexpr):
    """acc + (w * scale) @ x for one K block (one scale). SCALE_ON_PRODUCT: the fp8 codes go to the MMA
    exactly, in x's type: fp8 x terms (FP8_X) take them as stored, both operands from shared memory;
    fp16 x takes them as fp16 (which Triton loads straight into the MMA's register layout); the
    scale multiplies the block's fp32 product, at the price of a wait for each K block's MMA.
    Otherwise the scale is folded into the A operand (_wscaled) and the MMA runs async."""
    if SCALE_ON_PRODUCT:
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
def _bf16(v, INTERP: tl.constexpr):
    """fp32 -> bf16, round to nearest even. The interpreter (Triton 3.6) truncates (half its
    conversions differ from a GPU's; res_out's error ~1.3x qualify's bound): there the low 16 bits
    are rounded by integer arithmetic first, so its truncation keeps the rounded value."""
    if INTERP:
        b = v.to(tl.int32, bitcast=True)
        v = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def _xsig(post_norm, HIDDEN: tl.constexpr, HIDDEN_P2: tl.constexpr):
    """max |post_norm|: with it |x| / xsig <= sqrt(H) (|h_i| * rstd <= sqrt(H)), in fp8 range."""
    return _xsig_of(_post_norm_all(post_norm, HIDDEN, HIDDEN_P2))


@triton.jit
def _post_norm_all(post_norm, HIDDEN: tl.constexpr, HIDDEN_P2: tl.constexpr):
    hh = tl.arange(0, HIDDEN_P2)
    return tl.load(post_norm + hh, mask=hh < HIDDEN, other=0.0)


@triton.jit
def _xsig_of(pn):
    """_xsig on post_norm already read (PRE reads it before the seam's push, reduces it after)."""
    return tl.maximum(tl.max(tl.abs(pn), axis=0), 1e-30)


@triton.jit
def _store_x(scratch, offs, m2, xc, xsig, TOKENS: tl.constexpr, HIDDEN: tl.constexpr, SC_X_TERMS: tl.constexpr,
             FP8_X: tl.constexpr, INTERP: tl.constexpr, X_TERMS: tl.constexpr):
    """Stage 1's x of one column chunk (the normed rows times post_norm) into scratch."""
    if FP8_X:
        # x / xsig as X8T fp8 terms, each the rounding residue of the last times 16 (four: ~16
        # mantissa bits in all; two: ~8, a bf16 x's): stage 1 multiplies them with the fp8
        # weight codes as they are
        xr = xc / xsig
        for t in tl.static_range(X_TERMS):
            xt = _fp8(xr, INTERP)
            tl.store(_as(scratch, SC_X_TERMS, tl.float8e4nv) + t * TOKENS * HIDDEN + offs, xt, mask=m2)
            xr = (xr - xt.to(tl.float32)) * 16.0
    else:
        # x as a pair of fp16 (hi + lo): fp16 MMAs with ~22 mantissa bits of activation
        xh = xc.to(tl.float16)
        xl = (xc - xh.to(tl.float32)).to(tl.float16)
        tl.store(_as(scratch, SC_X_TERMS, tl.float16) + offs, xh, mask=m2)
        tl.store(_as(scratch, SC_X_TERMS, tl.float16) + TOKENS * HIDDEN + offs, xl, mask=m2)


@triton.jit
def _fr_rows(part, residual, rows_r, rmask_r, HIDDEN: tl.constexpr, HIDDEN_P2: tl.constexpr):
    """FULL_ROWS: the whole rows of residual and part [ROW_TILE, HIDDEN_P2]: loads only, issued together."""
    hh = tl.arange(0, HIDDEN_P2)
    fo = rows_r[:, None] * HIDDEN + hh[None, :]
    fm = rmask_r[:, None] & (hh < HIDDEN)[None, :]
    return tl.load(residual + fo, mask=fm, other=0.0), tl.load(part + fo, mask=fm, other=0.0)


@triton.jit
def _fr_weights(post_norm, router, ecol, emask, HIDDEN: tl.constexpr, HIDDEN_P2: tl.constexpr):
    """FULL_ROWS: post_norm [HIDDEN_P2] and the router rows of this CTA's experts [CTA_EXPERTS_P2, HIDDEN_P2]."""
    hh = tl.arange(0, HIDDEN_P2)
    return (_post_norm_all(post_norm, HIDDEN, HIDDEN_P2),
            tl.load(router + ecol[:, None].to(tl.int64) * HIDDEN + hh[None, :],
                    mask=emask[:, None] & (hh < HIDDEN)[None, :],
                    other=0.0))


@triton.jit
def _mma(w, x, acc, INTERP: tl.constexpr):
    """acc + w [M,K] @ x [K,N] with the weights as the A operand ("swap AB": M = weight rows,
    N = the few tokens), fp32 accumulate."""
    if INTERP:
        r = acc + tl.dot(w, x.to(tl.float32))
    else:
        r = tl.dot(w, x, acc)
    return r
