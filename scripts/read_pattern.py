"""Does the weights' layout cap the expert phase's read rate? (run on a GPU machine.)

    python scripts/read_pattern.py [--reps 20]

Times, in one process, loops shaped like the kernel's expert stages over expert weights several
times the L2 (each launch reads every byte once, from HBM), and prints GB/s of bytes read:
  floor       ffnq.floor's read kernel: contiguous 16-byte loads, grid-strided
  s1 row      stage 1 as built: per K step a [64 gate rows x BK] and a [64 up rows x BK] fp8 tile of
              the row-major [2 I, H] weights (rows H bytes apart), fp8 x fp8 MMA against a [BK, 16]
              x tile, each K block's product times its scale
  s1 pack     the same tiles stored tile after tile (each [64 x BK] tile 8 KB contiguous)
  s2 row      stage 2 as built: [64 rows of H x 128] fp8 tiles of the row-major [H, I] weights,
              codes -> fp16, fp16 MMA against a [128, 16] fp16 act tile
  s2 pack     the same tiles stored tile after tile
The grid is the kernel's (2 CTAs of 4 warps per SM), items handed out grid-strided as the kernel
does. Checks each variant's sums against torch first (a loop that reads the wrong bytes is not
timed).
"""
import argparse
import statistics

import torch
import triton
import triton.language as tl

from ffnq import floor
from ffnq.timing import steps_for, time_steps


@triton.jit
def stage_loop(w, s, x, out, n_items, NT: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, PACK: tl.constexpr, GU: tl.constexpr, CONV: tl.constexpr, NS: tl.constexpr):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    nn = tl.arange(0, BN)
    kc = tl.arange(0, BK)
    cc = tl.arange(0, 16)
    tot = tl.zeros((BN, 16), tl.float32)
    it = pid
    while it < n_items:
        e = it // NT
        t = it % NT
        base = w + e.to(tl.int64) * (ROWS * K)
        sb = s + e * (ROWS // BN) * (K // BK)
        acc_g = tl.zeros((BN, 16), tl.float32)
        acc_u = tl.zeros((BN, 16), tl.float32)
        for k0 in tl.range(0, K, BK, num_stages=NS):
            if PACK:  # tile (row block rb, K block kb) is the (rb * K/BK + kb)-th BN x BK block
                og = ((t * (K // BK) + k0 // BK) * (BN * BK)).to(tl.int64) + nn[:, None] * BK + kc[None, :]
                ou = og + (ROWS // 2) * K
            else:
                og = (t * BN + nn)[:, None].to(tl.int64) * K + k0 + kc[None, :]
                ou = og + (ROWS // 2) * K
            xk = tl.load(x + (k0 + kc)[:, None] * 16 + cc[None, :])
            sg = tl.load(sb + t * (K // BK) + k0 // BK)
            wg = tl.load(base + og)
            if CONV:
                wg = wg.to(tl.float16)
            acc_g += tl.dot(wg, xk) * sg
            if GU:
                su = tl.load(sb + (t + ROWS // 2 // BN) * (K // BK) + k0 // BK)
                wu = tl.load(base + ou)
                acc_u += tl.dot(wu, xk) * su
        tot += acc_g + acc_u
        it += nprog
    tl.store(out + pid * (BN * 16) + nn[:, None] * 16 + cc[None, :], tot)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ns", type=int, default=4)
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    grid = 2 * sms
    H, I = 3072, 1536
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(dev)}: {sms} SMs, grid {grid}", flush=True)
    print(f"floor read kernel: {floor.hbm_read_gbps(dev) / 1e3:.3f} TB/s", flush=True)
    f8 = torch.float8_e4m3fn
    # (name, rows per expert, K, tile rows, BK, gate+up, fp16 conversion, pipeline stages)
    cases = [("s1", 2 * I, H, 64, 128, True, False, a.ns), ("s1", 2 * I, H, 64, 128, True, False, 6),
             ("s1", 2 * I, H, 64, 256, True, False, 3), ("s2", H, I, 64, 128, False, True, a.ns)]
    for name, rows, K, BN, BK, gu, conv, ns in cases:
        nt = rows // BN // (2 if gu else 1)  # items per expert
        per_e = rows * K
        n_e = -(-(4 * 50 << 20) // per_e)  # several L2s of weights
        n_e = -(-n_e * nt // grid) * grid // nt if (n_e * nt) % grid else n_e  # whole rounds where it can
        wrow = (torch.randn(n_e, rows, K, device=dev) * 0.5).to(f8)
        # packed: [e, row block, K block, BN, BK]
        wpack = wrow.view(n_e, rows // BN, BN, K // BK, BK).permute(0, 1, 3, 2, 4).contiguous()
        sc = torch.rand(n_e, rows // BN, K // BK, device=dev) + 0.5
        xt = (torch.randn(K, 16, device=dev)).to(torch.float16 if conv else f8)
        n_items = n_e * nt
        out = torch.empty(grid, BN, 16, device=dev)
        # every CTA's tiles summed: the sum over all experts and tiles of (w tile * scale) @ x
        wf = wrow.float().view(n_e, rows // BN, BN, K // BK, BK) * sc[:, :, None, :, None]
        want = torch.einsum("erbkc,kcn->bn", wf, xt.float().view(K // BK, BK, 16))
        for pack in (False, True):
            buf = wpack if pack else wrow
            args = dict(NT=nt, K=K, ROWS=rows, BN=BN, BK=BK, PACK=pack, GU=gu, CONV=conv, NS=ns)

            def run():
                stage_loop[(grid,)](buf, sc, xt, out, n_items, **args, num_warps=4)

            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            got = out.sum(0)
            err = ((got - want).abs().max() / want.abs().max()).item()
            label = f"{name} {'pack' if pack else 'row '} BK={BK} NS={ns}"
            if not err < 1e-2:
                print(f"{label}: WRONG (rel err {err:.3g}), not timed", flush=True)
                continue
            first = time_steps(run, 1, device=dev, graph=True)[0]
            for _ in range(steps_for(first, 200, 1, 10_000)):
                run()
            us = statistics.median(time_steps(run, a.reps, device=dev, graph=True))
            nbytes = buf.numel()
            print(f"{label}: {n_items} items of {nbytes // n_items // 1024} KB over {grid} CTAs, "
                  f"{nbytes / 2**20:.0f} MB in {us:.1f} us = {nbytes / us / 1e6:.3f} TB/s (rel err {err:.1e})",
                  flush=True)
        del wrow, wpack, wf


if __name__ == "__main__":
    main()
