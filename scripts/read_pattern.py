"""Does the weights' layout cap the expert phase's read rate? (run on a GPU machine.)

    python scripts/read_pattern.py [--reps 20] [--pack]

Times, in one process, loops shaped like the kernel's expert stages over expert weights several
times the L2 (each launch reads every byte once, from HBM), and prints TB/s of bytes read, beside
the floor's read kernel (ffnq.floor: contiguous 16-byte loads, grid-strided):
  s1   stage 1: per K step BK columns of a [64 gate rows] and a [64 up rows] fp8 tile of the
       row-major [2 I, H] weights (rows H bytes apart), as BK / SUB sub-tiles, each an fp8 x fp8
       MMA against a [SUB, N] x tile times its own scale (SUB = 128: one scale block, the
       kernel's numerics; N: 16 at 1-4 tokens, 64 at 16)
  s2   stage 2: [BN rows of H] tiles of the row-major [H, I] weights, codes -> fp16, fp16 MMA
       against a [SUB, 16] fp16 act tile (as built); s2 fp8: the act as four fp8 terms (N = 4 x
       token columns) against the fp8 codes, no conversion (what stage 1 does with x)
  row / pack   the weights row-major as stored, or each [64 x SUB] tile stored contiguously
The grid is the kernel's (2 CTAs of 4 warps per SM), items handed out grid-strided as the kernel
does. Each variant's sums are checked against torch first (a loop that reads the wrong bytes is
not timed). Device rounds 37-39: see notes/triton-kernel.md, "Version 24".
"""
import argparse

import torch
import triton
import triton.language as tl

from ffnq import floor
from ffnq.timing import warm_median_us


@triton.jit
def stage_loop(w, s, x, out, n_items, NT: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, SUB: tl.constexpr, N: tl.constexpr, PACK: tl.constexpr, GU: tl.constexpr,
               CONV: tl.constexpr, NS: tl.constexpr):
    # a K step loads BK columns of each tile as BK / SUB sub-tiles, each its own MMA times its
    # own scale (SUB = 128: one scale block, as the kernel's numerics need)
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    nn = tl.arange(0, BN)
    kc = tl.arange(0, SUB)
    cc = tl.arange(0, N)
    tot = tl.zeros((BN, N), tl.float32)
    it = pid
    while it < n_items:
        e = it // NT
        t = it % NT
        base = w + e.to(tl.int64) * (ROWS * K)
        sb = s + e * (ROWS // BN) * (K // SUB)
        acc_g = tl.zeros((BN, N), tl.float32)
        acc_u = tl.zeros((BN, N), tl.float32)
        for k0 in tl.range(0, K, BK, num_stages=NS):
            for q in tl.static_range(BK // SUB):
                kq = k0 + q * SUB
                if PACK:  # tile (row block rb, K block kb) is the (rb * K/SUB + kb)-th BN x SUB block
                    og = ((t * (K // SUB) + kq // SUB) * (BN * SUB)).to(tl.int64) + nn[:, None] * SUB + kc[None, :]
                else:
                    og = (t * BN + nn)[:, None].to(tl.int64) * K + kq + kc[None, :]
                xk = tl.load(x + cc[None, :] * K + (kq + kc)[:, None])  # K-major, as the kernel stores x and act
                wg = tl.load(base + og)
                if CONV:
                    wg = wg.to(tl.float16)
                acc_g += tl.dot(wg, xk) * tl.load(sb + t * (K // SUB) + kq // SUB)
                if GU:
                    wu = tl.load(base + og + (ROWS // 2) * K)
                    acc_u += tl.dot(wu, xk) * tl.load(sb + (t + ROWS // 2 // BN) * (K // SUB) + kq // SUB)
        tot += acc_g + acc_u
        it += nprog
    tl.store(out + pid * (BN * N) + nn[:, None] * N + cc[None, :], tot)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--pack", action="store_true", help="also time the tile-packed layout")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    grid = 2 * sms
    H, I = 3072, 1536
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(dev)}: {sms} SMs, grid {grid}", flush=True)
    print(f"floor read kernel: {floor.hbm_read_gbps(dev) / 1e3:.3f} TB/s", flush=True)
    f8 = torch.float8_e4m3fn
    # (name, tile rows BN, BK, SUB, token columns N, pipeline stages, (rows per expert, K, gate+up,
    # weights -> fp16 against fp16 x)); s2 fp8: the act as fp8 terms (4 x tokens columns), no conversion
    s1, s2, s2f8 = (2 * I, H, True, False), (H, I, False, True), (H, I, False, False)
    cases = [("s1", 64, 128, 128, 16, 4, s1), ("s1", 64, 128, 128, 64, 4, s1),
             ("s2", 64, 128, 128, 16, 4, s2), ("s2", 128, 128, 128, 16, 4, s2),
             ("s2 fp8", 64, 128, 128, 16, 4, s2f8), ("s2 fp8", 128, 128, 128, 16, 4, s2f8),
             ("s2 fp8", 128, 128, 128, 64, 4, s2f8),
             # the act's scale per 64-row stage-1 tile: a K step of 128 as two MMAs, each its own scale
             ("s2 fp8", 64, 128, 64, 16, 4, s2f8), ("s2 fp8", 128, 128, 64, 16, 4, s2f8),
             ("s2 fp8", 128, 128, 64, 32, 4, s2f8), ("s2 fp8", 128, 128, 64, 64, 4, s2f8)]
    for name, BN, BK, SUB, N, ns, (rows, K, gu, conv) in cases:
        nt = rows // BN // (2 if gu else 1)  # items per expert
        per_e = rows * K
        n_e = -(-(4 * 50 << 20) // per_e)  # several L2s of weights
        n_e = -(-n_e * nt // grid) * grid // nt  # whole rounds of the grid where nt divides them
        wrow = (torch.randn(n_e, rows, K, device=dev) * 0.5).to(f8)
        sc = torch.rand(n_e, rows // BN, K // SUB, device=dev) + 0.5
        xt = (torch.randn(N, K, device=dev)).to(torch.float16 if conv else f8)  # [tokens, K]
        n_items = n_e * nt
        out = torch.empty(grid, BN, N, device=dev)
        # every CTA's tiles summed: the sum over all experts and tiles of (w sub-tile * scale) @ x
        wf = wrow.float().view(n_e, rows // BN, BN, K // SUB, SUB) * sc[:, :, None, :, None]
        want = torch.einsum("erbkc,kcn->bn", wf, xt.float().t().reshape(K // SUB, SUB, N))
        for pack in (False, True) if a.pack else (False,):
            # packed: [e, row block, K block, BN, SUB]
            buf = wrow.view(n_e, rows // BN, BN, K // SUB, SUB).permute(0, 1, 3, 2, 4).contiguous() if pack else wrow
            args = dict(NT=nt, K=K, ROWS=rows, BN=BN, BK=BK, SUB=SUB, N=N, PACK=pack, GU=gu, CONV=conv, NS=ns)

            def run():
                return stage_loop[(grid,)](buf, sc, xt, out, n_items, **args, num_warps=4)

            out.fill_(float("nan"))
            ck = run()
            torch.cuda.synchronize()
            got = out.sum(0)
            err = ((got - want).abs().max() / want.abs().max()).item()
            label = (f"{name} {'pack' if pack else 'row '} BN={BN} BK={BK} SUB={SUB} N={N} NS={ns} "
                     f"({ck.n_regs} regs, {ck.metadata.shared // 1024} KB smem)")
            if not err < 1e-2:
                print(f"{label}: WRONG (rel err {err:.3g}), not timed", flush=True)
                continue
            us = warm_median_us(run, a.reps, warmup_ms=200, device=dev, graph=True)
            nbytes = buf.numel()
            print(f"{label}: {n_items} items of {nbytes // n_items // 1024} KB, "
                  f"{nbytes / 2**20:.0f} MB in {us:.1f} us = {nbytes / us / 1e6:.3f} TB/s (rel err {err:.1e})",
                  flush=True)
        del wrow, buf, wf


if __name__ == "__main__":
    main()
