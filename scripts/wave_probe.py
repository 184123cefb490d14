"""Does a one-token expert wave stream faster with TMA loads? (run on a GPU machine.)

    python scripts/wave_probe.py [--reps 30] [--sets 4] [--shapes E:KS:BH,...] [--pack E:KS:IR:CPS,...]
        [--fused E:IR:BN:S:CPS,...]

At one token each of the kernel's 396 CTAs (3 per SM) runs one stage-1 item (64 gate + 64 up rows
of an expert x half of K: 197 KB) and then one stage-2 item (64 rows of w2 x all of I: 98 KB), so
each stage is a single wave whose ramp and tail are a large part of it. The whole kernel's stage
1 moves ~3.2-3.5 TB/s there (dev round 105's profile), the loop alone over many items 4.1
(scripts/read_pattern.py). This probe times the wave alone, shaped as the kernel's: the weights
as pointer loads (what the kernel does: cp.async pipelined by Triton) against TMA loads from a
host tensor descriptor, at 3 and 4 pipeline stages, one item per CTA ("wave", 8 experts) and
several items per CTA ("steady", every weight set in one launch); and both stages' waves as one
sequence with no wait between them ("both": each CTA's stage-1 item, then a stage-2 item), the
most a schedule that overlaps the two stages could reach. ``--pack``: stage 1's items with the
weights row-major (the kernel's reads: 128 B of each of 128 rows a K step) against tile-packed
(each K step's gate and up blocks one contiguous 16 KB), any width's shape and grid. Each launch reads a weight set
the L2 does not hold (``--sets`` sets, replayed in turn in one CUDA graph); each variant's item
sums are checked against torch before it is timed.
"""
import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ffnq import floor
from ffnq.backends.triton.runner import packed_w13
from ffnq.timing import warm_median_us

H, I, TOPK = 3072, 1536, 8
F8, N, BN = torch.float8_e4m3fn, 16, 64  # fp8 codes; x's token columns (two terms x 8); stage-1 tile rows


@triton.jit
def _item(w, wd, s, x, out, it, NT: tl.constexpr, KS: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr,
          BN: tl.constexpr, N: tl.constexpr, GU: tl.constexpr, TMA: tl.constexpr, NS: tl.constexpr,
          PACK: tl.constexpr = False):
    # item = (expert e, row tile t, K part p); a K step of 128 is one scale block: one MMA per tile
    nn = tl.arange(0, BN)
    kc = tl.arange(0, 128)
    cc = tl.arange(0, N)
    KP: tl.constexpr = K // KS
    e = it // (NT * KS)
    t = (it // KS) % NT
    p = it % KS
    row = e * ROWS + t * BN
    kb = p * KP
    sb = s + (e * (ROWS // BN) + t) * (K // 128) + kb // 128
    wb = w + row.to(tl.int64) * K + kb
    xb = x + kb
    acc = tl.zeros((BN, N), tl.float32)
    # (PACK) tile-packed weights (packed()): each K step's [BN, 128] block (gate, then up) contiguous
    GP: tl.constexpr = 2 if GU else 1
    pb = w + ((e * NT + t).to(tl.int64) * (K // 128) + kb // 128) * (GP * BN * 128)
    blk = nn[:, None] * 128 + kc[None, :]
    for k0 in tl.range(0, KP, 128, num_stages=NS):  # (from 0, as the kernel: Triton pipelines it)
        xk = tl.load(xb + cc[None, :] * K + (k0 + kc)[:, None])  # K-major, as the kernel stores x
        if TMA:
            wg = wd.load([row, kb + k0])
        elif PACK:
            wg = tl.load(pb + (k0 // 128) * (GP * BN * 128) + blk)
        else:
            wg = tl.load(wb + nn[:, None] * K + k0 + kc[None, :])
        acc += tl.dot(wg, xk) * tl.load(sb + k0 // 128)
        if GU:
            if TMA:
                wu = wd.load([row + ROWS // 2, kb + k0])
            elif PACK:
                wu = tl.load(pb + (k0 // 128) * (GP * BN * 128) + BN * 128 + blk)
            else:
                wu = tl.load(wb + (ROWS // 2 + nn)[:, None] * K + k0 + kc[None, :])
            acc += tl.dot(wu, xk) * tl.load(sb + (NT * (K // 128)) + k0 // 128)
    tl.store(out + it * (BN * N) + nn[:, None] * N + cc[None, :], acc)


@triton.jit
def expert_items(w, wd, s, x, out, n_items, NT: tl.constexpr, KS: tl.constexpr, K: tl.constexpr,
                 ROWS: tl.constexpr, BN: tl.constexpr, N: tl.constexpr, GU: tl.constexpr, TMA: tl.constexpr,
                 NS: tl.constexpr, PACK: tl.constexpr = False):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    it = pid
    while it < n_items:
        _item(w, wd, s, x, out, it, NT, KS, K, ROWS, BN, N, GU, TMA, NS, PACK)
        it += nprog


def packed(w: torch.Tensor, bn: int, gu: bool) -> torch.Tensor:
    """``w`` [experts, rows, K] with each item's K-step blocks contiguous: [experts, tile, K / 128,
    (gate, up), bn, 128] (gu: the first rows / 2 are the gate rows, the rest the up rows; the
    runner's own layout, packed_w13), else [experts, tile, K / 128, bn, 128]."""
    ne, rows, k = w.shape
    if gu:
        return packed_w13(w, bn).view(ne, rows // 2 // bn, k // 128, 2, bn, 128)
    return w.view(ne, rows // bn, bn, k // 128, 128).permute(0, 1, 3, 2, 4).contiguous()


@triton.jit
def both_stages(w1, wd1, s1, x1, out1, n1, w2, wd2, s2, x2, out2, n2, NT1: tl.constexpr, KS1: tl.constexpr,
                K1: tl.constexpr, NT2: tl.constexpr, K2: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr,
                N: tl.constexpr, TMA: tl.constexpr, NS: tl.constexpr, BH: tl.constexpr = 64):
    # stage 1's items then stage 2's in one sequence, with no wait between them: the bound of
    # any schedule that overlaps the two stages (the kernel's stage-2 item waits for its expert)
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    it = pid
    while it < n1 + n2:
        if it < n1:
            _item(w1, wd1, s1, x1, out1, it, NT1, KS1, K1, ROWS, BN, N, True, TMA, NS)
        else:
            _item(w2, wd2, s2, x2, out2, it - n1, NT2, 1, K2, ROWS, BH, N, False, TMA, NS)
        it += nprog


@triton.jit
def fused_items(w1, s1, x, w2, s2, out, n_items, NT: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                N: tl.constexpr, S: tl.constexpr, HB: tl.constexpr, NS: tl.constexpr, NS2: tl.constexpr):
    # (--fused) item = (expert e, BN-row tile t of I_R): its gate and up tiles over the whole K
    # (w1 tile-packed), then at once its act rows times w2's BN columns of every H row (w2 packed
    # per item: [H, BN] contiguous, HB rows a step): no wait for a whole expert, an [S, H] partial
    # per item for a sum to add up
    nn = tl.arange(0, BN)
    kc = tl.arange(0, 128)
    cc = tl.arange(0, N)
    hh = tl.arange(0, HB)
    blk = nn[:, None] * 128 + kc[None, :]
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    it = pid
    while it < n_items:
        e = it // NT
        t = it % NT
        pb = w1 + (it.to(tl.int64) * (K // 128)) * (2 * BN * 128)
        sb = s1 + (e * (2 * NT) + t) * (K // 128)
        acc_g = tl.zeros((BN, N), tl.float32)
        acc_u = tl.zeros((BN, N), tl.float32)
        for k0 in tl.range(0, K, 128, num_stages=NS):
            xk = tl.load(x + cc[None, :] * K + (k0 + kc)[:, None])
            wg = tl.load(pb + (k0 // 128) * (2 * BN * 128) + blk)
            wu = tl.load(pb + (k0 // 128) * (2 * BN * 128) + BN * 128 + blk)
            acc_g += tl.dot(wg, xk) * tl.load(sb + k0 // 128)
            acc_u += tl.dot(wu, xk) * tl.load(sb + NT * (K // 128) + k0 // 128)
        a = (acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(tl.float16)  # [BN, N]
        db = w2 + it.to(tl.int64) * (K * BN)
        for h0 in tl.range(0, K, HB, num_stages=NS2):
            wd = tl.load(db + (h0 + hh)[:, None] * BN + nn[None, :])  # [HB, BN]
            sc = tl.load(s2 + it * (K // 128) + (h0 + hh) // 128)  # [HB]: each row's block scale
            y = tl.dot(wd.to(tl.float16) * sc.to(tl.float16)[:, None], a)  # [HB, N]
            tl.store(out + (it.to(tl.int64) * S + cc[None, :]) * K + (h0 + hh)[:, None], y, mask=cc[None, :] < S)
        it += nprog


def want_fused(w1: torch.Tensor, s1: torch.Tensor, x: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
               bn: int, S: int) -> torch.Tensor:
    """fused_items' partials from torch: [items, S, H] (w1 packed [e, nt, K/128, 2, bn, 128], s1
    [e, 2 nt, K/128]; w2 [items, H, bn], s2 [items, H/128])."""
    ne, nt, kb = w1.shape[:3]
    g_u = w1.float() * s1.view(ne, 2, nt, kb).permute(0, 2, 3, 1)[..., None, None]
    per = torch.einsum("etkgbc,nkc->etgbn", g_u, x.float().view(x.shape[0], kb, 128))  # [e, nt, 2, bn, N]
    g, u = per[:, :, 0], per[:, :, 1]
    a = (g / (1 + torch.exp(-g)) * u).half().float().reshape(ne * nt, bn, -1)
    wd = w2.float() * s2.repeat_interleave(128, dim=1)[..., None]
    return torch.einsum("ihb,ibn->inh", wd, a)[:, :S]


def want(wset: torch.Tensor, sc: torch.Tensor, xt: torch.Tensor, nt: int, ks: int, bn: int, gu: bool) -> torch.Tensor:
    """Each item's [BN, N] sum in fp32, from torch: [experts x NT x KS, BN, N]."""
    ne, rows, K = wset.shape
    n = xt.shape[0]
    wf = wset.float().view(ne, rows // bn, bn, ks, K // ks // 128, 128) * sc.view(ne, rows // bn, 1, ks, -1, 1)
    per = torch.einsum("erbpkc,pkcn->erpbn", wf, xt.float().t().reshape(ks, K // ks // 128, 128, n))
    per = per[:, :nt] + per[:, nt:] if gu else per
    return per.reshape(-1, bn, n)


def _timed(label: str, run, checks, nbytes: int, reps: int, dev, per: int) -> float | None:
    """Check ``run``'s items against torch (``checks``: (out, want) pairs), then its median
    replay time over ``per`` launches; None (printed WRONG) where a check fails."""
    for o, _ in checks:
        o.fill_(float("nan"))
    ck = run()
    torch.cuda.synchronize()
    err = max(((o - r).abs().max() / r.abs().max()).item() for o, r in checks)
    label = f"{label} ({ck.n_regs} regs, {ck.metadata.shared // 1024} KB smem)"
    if not err < 1e-2:
        print(f"{label}: WRONG (rel err {err:.3g}), not timed", flush=True)
        return None
    us = warm_median_us(run, reps, warmup_ms=200, device=dev, graph=True) / per
    print(f"{label}: {nbytes / 2**20:.1f} MB in {us:.1f} us = {nbytes / us / 1e6:.3f} TB/s (rel err {err:.1e})",
          flush=True)
    return us


def weight_sets(sets: int, experts: int, rows: int, K: int, bn: int, dev) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``sets`` sets of fp8 weights [experts, rows, K] and their block scales [experts, rows / bn, K / 128]."""
    return [((torch.randn(experts, rows, K, device=dev) * 0.5).to(F8),
             torch.rand(experts, rows // bn, K // 128, device=dev) + 0.5) for _ in range(sets)]


def descriptors(sets, rows: int) -> list[TensorDescriptor]:
    """One TMA descriptor of [rows, 128] blocks over each set's weights, seen as one matrix."""
    return [TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [rows, 128]) for w, _ in sets]


def time_both(label: str, w1, w2, x1, x2, ks: int, bh: int, tma: bool, grid: int, reps: int, dev) -> float | None:
    """Both stages' items as one sequence with no wait between them (both_stages), each set in
    turn: stage 1 in ``ks`` K parts, stage-2 items of ``bh`` rows."""
    ne = w1[0][0].shape[0]
    nt1, nt2 = I // BN, H // bh
    n1, n2 = ne * nt1 * ks, ne * nt2
    outs = [(torch.empty(n1, BN, N, device=dev), torch.empty(n2, bh, N, device=dev)) for _ in w1]
    checks = [(outs[0][0], want(*w1[0], x1, nt1, ks, BN, True)), (outs[0][1], want(*w2[0], x2, nt2, 1, bh, False))]
    d1, d2 = descriptors(w1, BN), descriptors(w2, bh)

    def run():
        for i, ((a1, s1), (a2, s2)) in enumerate(zip(w1, w2)):
            k = both_stages[(grid,)](a1, d1[i], s1, x1, outs[i][0], n1, a2, d2[i], s2, x2, outs[i][1], n2, NT1=nt1,
                                     KS1=ks, K1=H, NT2=nt2, K2=I, ROWS=H, BN=BN, N=N, TMA=tma, NS=3, BH=bh,
                                     num_warps=4)
        return k

    assert 2 * I == H  # one ROWS for both: w13 has 2 I rows, w2 H
    return _timed(label, run, checks, w1[0][0].numel() + w2[0][0].numel(), reps, dev, len(w1))


def shapes(a, dev, grid: int) -> None:
    """--shapes E:KS:BH,...: per shape (E experts, stage 1 in KS parts of K, stage-2 items of BH
    rows: a width's items as its build makes them), each stage alone and both as one sequence,
    the kernel's loads (pointer, 3 stages)."""
    for shape in a.shapes.split(","):
        ne, ks, bh = map(int, shape.split(":"))
        w1, w2 = weight_sets(a.sets, ne, 2 * I, H, BN, dev), weight_sets(a.sets, ne, H, I, bh, dev)
        x1, x2 = torch.randn(N, H, device=dev).to(F8), torch.randn(N, I, device=dev).to(F8)
        head = f"{ne} experts, KS={ks}, BH={bh}:"
        t = []
        # (stage, its sets, x, items per expert, K parts, K, rows per expert, item rows, gate+up)
        for stage, ws, x, nt, kp, K, rows, bn, gu in ((1, w1, x1, I // BN, ks, H, 2 * I, BN, True),
                                                     (2, w2, x2, H // bh, 1, I, H, bh, False)):
            n = ne * nt * kp
            outs = [torch.empty(n, bn, N, device=dev) for _ in ws]
            d = descriptors(ws, bn)
            args = dict(NT=nt, KS=kp, K=K, ROWS=rows, BN=bn, N=N, GU=gu, TMA=False, NS=3)

            def run(ws=ws, x=x, n=n, outs=outs, d=d, args=args):
                for i, (w, s) in enumerate(ws):
                    k = expert_items[(grid,)](w, d[i], s, x, outs[i], n, **args, num_warps=4)
                return k

            t.append(_timed(f"{head} stage {stage} ({n} items)", run, [(outs[0], want(*ws[0], x, nt, kp, bn, gu))],
                            ws[0][0].numel(), a.reps, dev, a.sets))
        t.append(time_both(f"{head} both, no wait between", w1, w2, x1, x2, ks, bh, False, grid, a.reps, dev))
        if None not in t:
            print(f"{head} the two waves {t[0] + t[1]:.1f} us, as one sequence {t[2]:.1f} us", flush=True)
        del w1, w2


def pack_waves(a, dev, sms: int) -> None:
    """--pack: a stage's items read row-major against tile-packed (see the option), NS 3 to 5."""
    for shape in a.pack.split(","):
        ne, ks, ir, cps, *st = map(int, shape.split(":"))
        stage = st[0] if st else 1
        grid = cps * sms
        # stage 1: w13 [2 I_R, H], gate and up tiles of BN rows, K = H in KS parts; stage 2: w2 [H, I_R],
        # tiles of BH = 128 rows of H, K = I_R whole (the kernel's stage-2 items from three tokens)
        gu, bn, rows, K = (True, BN, 2 * ir, H) if stage == 1 else (False, 128, H, ir)
        ks = ks if stage == 1 else 1
        nt = (rows // 2 if gu else rows) // bn
        sets = weight_sets(a.sets, ne, rows, K, bn, dev)
        xt = torch.randn(N, K, device=dev).to(F8)
        for mode in ("wave", "steady"):
            groups = sets if mode == "wave" else [(torch.cat([w for w, _ in sets]), torch.cat([s for _, s in sets]))]
            n_items = ne * nt * ks * (1 if mode == "wave" else a.sets)
            outs = [torch.empty(n_items, bn, N, device=dev) for _ in groups]
            checks = [(outs[0], want(*groups[0], xt, nt, ks, bn, gu))]
            for pack in (False, True):
                ws = [packed(w, bn, gu) if pack else w for w, _ in groups]
                for ns in (3, 4, 5):
                    args = dict(NT=nt, KS=ks, K=K, ROWS=rows, BN=bn, N=N, GU=gu, TMA=False, NS=ns, PACK=pack)

                    def run(ws=ws, args=args):
                        for w, (_, s), o in zip(ws, groups, outs):
                            k = expert_items[(grid,)](w, w, s, xt, o, n_items, **args, num_warps=4)
                        return k

                    _timed(f"stage {stage} {ne} experts I_R={ir} KS={ks} grid {grid} {mode:6s} "
                           f"{'packed' if pack else 'rows  '} NS={ns}: {n_items} items of "
                           f"{groups[0][0].numel() // n_items // 1024} KB", run, checks,
                           groups[0][0].numel(), a.reps, dev, len(groups))
                del ws
            del groups, outs, checks
        del sets


def fused(a, dev, sms: int) -> None:
    """--fused: stage 1 and the down projection in one item (fused_items) against the two stages
    as the kernel runs them now, each alone (stage 1 tile-packed, whole K; stage 2 128-row tiles of
    w2 row-major, K whole), wave (one launch per cold set)."""
    for shape in a.fused.split(","):
        ne, ir, bn, S, cps = map(int, shape.split(":"))
        grid, nt = cps * sms, ir // bn
        n = ne * nt
        sets = [((torch.randn(ne, 2 * ir, H, device=dev) * 0.5).to(F8),
                 torch.rand(ne, 2 * nt, H // 128, device=dev) + 0.5,
                 (torch.randn(n, H, bn, device=dev) * 0.5).to(F8),
                 torch.rand(n, H // 128, device=dev) + 0.5) for _ in range(a.sets)]
        w1p = [packed(w1, bn, True) for w1, *_ in sets]
        x = torch.randn(N, H, device=dev).to(F8)
        outs = [torch.empty(n, S, H, device=dev) for _ in sets]
        head = f"{ne} experts I_R={ir} BN={bn} S={S} grid {grid}: {n} items of {3 * bn * H // 1024} KB"
        nbytes = 3 * ir * H * ne
        for hb in (128, 256):
            for ns2 in (3, 4):
                def run(hb=hb, ns2=ns2):
                    for i, (_, s1, w2, s2) in enumerate(sets):
                        k = fused_items[(grid,)](w1p[i], s1, x, w2, s2, outs[i], n, NT=nt, K=H, BN=bn, N=N, S=S,
                                                 HB=hb, NS=3, NS2=ns2, num_warps=4)
                    return k

                _timed(f"{head}, fused HB={hb} NS2={ns2}", run,
                       [(outs[0], want_fused(w1p[0], sets[0][1], x, sets[0][2], sets[0][3], bn, S))], nbytes,
                       a.reps, dev, a.sets)
        # the same bytes as two waves, each stage alone, as the kernel's items (stage 2: w2 [H, I_R])
        t = []
        w2r = [((torch.randn(ne, H, ir, device=dev) * 0.5).to(F8), torch.rand(ne, H // 128, ir // 128, device=dev) + 0.5)
               for _ in range(a.sets)]
        for stage, ws, xs, rows, K, b, gu, pk in ((1, [(p, s1) for p, (_, s1, *_) in zip(w1p, sets)], x, 2 * ir, H,
                                                   bn, True, True),
                                                  (2, w2r, torch.randn(N, ir, device=dev).to(F8), H, ir, 128, False,
                                                   False)):
            nti = (rows // 2 if gu else rows) // b
            ni = ne * nti
            o = [torch.empty(ni, b, N, device=dev) for _ in ws]
            args = dict(NT=nti, KS=1, K=K, ROWS=rows, BN=b, N=N, GU=gu, TMA=False, NS=3, PACK=pk)

            def run(ws=ws, o=o, xs=xs, args=args, ni=ni):
                for i, (w, s) in enumerate(ws):
                    k = expert_items[(grid,)](w, w, s, xs, o[i], ni, **args, num_warps=4)
                return k

            ref = want(sets[0][0], sets[0][1], xs, nti, 1, b, gu) if stage == 1 else want(*ws[0], xs, nti, 1, b, gu)
            t.append(_timed(f"{head}, stage {stage} alone ({ni} items)", run, [(o[0], ref)],
                            ws[0][0].numel(), a.reps, dev, a.sets))
        if None not in t:
            print(f"{head}: the two waves {t[0] + t[1]:.1f} us", flush=True)
        del sets, w1p, w2r, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sets", type=int, default=4, help="weight sets replayed in turn (each cold in the L2)")
    ap.add_argument("--shapes", default="", help="E:KS:BH,... (e.g. 8:2:64,15:1:64,21:2:128): only these "
                                                 "widths' stages, alone and as one sequence")
    ap.add_argument("--pack", default="", help="E:KS:IR:CPS[:STAGE],... (e.g. 8:2:768:2, TP2's one token): only "
                    "one stage's items of E experts (stage 1, the default: K in KS parts; I_R intermediate rows; "
                    "CPS CTAs per SM; stage 2: 128-row tiles of w2, K whole), row-major (as the kernel reads them) "
                    "against tile-packed (each K step's blocks contiguous: stage 1's gate and up 16 KB, stage 2's "
                    "16 KB), as a wave (one launch per set) and steady (every set in one launch)")
    ap.add_argument("--fused", default="", help="E:IR:BN:S:CPS,... (e.g. 8:768:32:1:2, TP2's one token): "
                    "stage 1 with the down projection in one item of BN rows of I_R (w2 packed per item), "
                    "against the two stages alone")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    grid = 3 * sms
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(dev)}: {sms} SMs, grid {grid} (3 CTAs of 4 warps per SM)", flush=True)
    print(f"floor read kernel: {floor.hbm_read_gbps(dev) / 1e3:.3f} TB/s", flush=True)
    if a.shapes:
        shapes(a, dev, grid)
        return
    if a.pack:
        pack_waves(a, dev, sms)
        return
    if a.fused:
        fused(a, dev, sms)
        return
    # one token's items, 384 of each stage: (rows per expert, K, gate+up, K parts)
    stages = {"stage 1": (2 * I, H, True, 2), "stage 2": (H, I, False, 1)}
    data = {}
    for stage, (rows, K, gu, ks) in stages.items():
        nt = rows // BN // (2 if gu else 1)
        sets = weight_sets(a.sets, TOPK, rows, K, BN, dev)
        xt = torch.randn(N, K, device=dev).to(F8)
        data[stage] = (sets, xt)
        per_set = TOPK * nt * ks
        for mode in ("wave", "steady"):  # steady: every set's experts in one launch
            groups = sets if mode == "wave" else [(torch.cat([w for w, _ in sets]), torch.cat([s for _, s in sets]))]
            n_items = per_set * (1 if mode == "wave" else a.sets)
            outs = [torch.empty(n_items, BN, N, device=dev) for _ in groups]
            checks = [(outs[0], want(*groups[0], xt, nt, ks, BN, gu))]
            descs = descriptors(groups, BN)
            for tma in (False, True):
                for ns in (3, 4):
                    args = dict(NT=nt, KS=ks, K=K, ROWS=rows, BN=BN, N=N, GU=gu, TMA=tma, NS=ns)

                    def run():
                        for (w, s), d, o in zip(groups, descs, outs):
                            k = expert_items[(grid,)](w, d, s, xt, o, n_items, **args, num_warps=4)
                        return k

                    _timed(f"{stage} {mode:6s} {'tma' if tma else 'ptr'} NS={ns}: {n_items} items of "
                           f"{groups[0][0].numel() // n_items // 1024} KB", run, checks, groups[0][0].numel(),
                           a.reps, dev, len(groups))
            del groups, outs, checks
    # both stages' waves as one sequence with no wait between them (each CTA's stage-1 item, then
    # a stage-2 item): what a schedule overlapping the stages could reach at most
    (sets1, x1), (sets2, x2) = data["stage 1"], data["stage 2"]
    n1, n2 = TOPK * (I // BN) * 2, TOPK * (H // BN)
    for tma in (False, True):
        time_both(f"both   wave   {'tma' if tma else 'ptr'} NS=3: {n1} + {n2} items", sets1, sets2, x1, x2, 2, BN,
                  tma, grid, a.reps, dev)


if __name__ == "__main__":
    main()
