"""Does a one-token expert wave stream faster with TMA loads? (run on a GPU machine.)

    python scripts/wave_probe.py [--reps 30] [--sets 4]

At one token each of the kernel's 396 CTAs (3 per SM) runs one stage-1 item (64 gate + 64 up rows
of an expert x half of K: 197 KB) and then one stage-2 item (64 rows of w2 x all of I: 98 KB), so
each stage is a single wave whose ramp and tail are a large part of it. The whole kernel's stage
1 moves ~3.2-3.5 TB/s there (dev round 105's profile), the loop alone over many items 4.1
(scripts/read_pattern.py). This probe times the wave alone, shaped as the kernel's: the weights
as pointer loads (what the kernel does: cp.async pipelined by Triton) against TMA loads from a
host tensor descriptor, at 3 and 4 pipeline stages, one item per CTA ("wave", 8 experts) and
several items per CTA ("steady", every weight set in one launch). Each launch reads a weight set
the L2 does not hold (``--sets`` sets, replayed in turn in one CUDA graph); each variant's item
sums are checked against torch before it is timed.
"""
import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ffnq import floor
from ffnq.timing import warm_median_us

H, I, TOPK = 3072, 1536, 8


@triton.jit
def expert_items(w, wd, s, x, out, n_items, NT: tl.constexpr, KS: tl.constexpr, K: tl.constexpr,
                 ROWS: tl.constexpr, BN: tl.constexpr, N: tl.constexpr, GU: tl.constexpr, TMA: tl.constexpr,
                 NS: tl.constexpr):
    # item = (expert e, row tile t, K part p); a K step of 128 is one scale block: one MMA per tile
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    nn = tl.arange(0, BN)
    kc = tl.arange(0, 128)
    cc = tl.arange(0, N)
    KP: tl.constexpr = K // KS
    it = pid
    while it < n_items:
        e = it // (NT * KS)
        t = (it // KS) % NT
        p = it % KS
        row = e * ROWS + t * BN
        sb = s + (e * (ROWS // BN) + t) * (K // 128)
        acc = tl.zeros((BN, N), tl.float32)
        kb = p * KP
        wb = w + row.to(tl.int64) * K + kb
        xb = x + kb
        sb += kb // 128
        for k0 in tl.range(0, KP, 128, num_stages=NS):  # (from 0, as the kernel: Triton pipelines it)
            xk = tl.load(xb + cc[None, :] * K + (k0 + kc)[:, None])  # K-major, as the kernel stores x
            if TMA:
                wg = wd.load([row, kb + k0])
            else:
                wg = tl.load(wb + nn[:, None] * K + k0 + kc[None, :])
            acc += tl.dot(wg, xk) * tl.load(sb + k0 // 128)
            if GU:
                if TMA:
                    wu = wd.load([row + ROWS // 2, kb + k0])
                else:
                    wu = tl.load(wb + (ROWS // 2 + nn)[:, None] * K + k0 + kc[None, :])
                acc += tl.dot(wu, xk) * tl.load(sb + (NT * (K // 128)) + k0 // 128)
        tl.store(out + it * (BN * N) + nn[:, None] * N + cc[None, :], acc)
        it += nprog


def want(wset: torch.Tensor, sc: torch.Tensor, xt: torch.Tensor, nt: int, ks: int, bn: int, gu: bool) -> torch.Tensor:
    """Each item's [BN, N] sum in fp32, from torch: [experts x NT x KS, BN, N]."""
    ne, rows, K = wset.shape
    n = xt.shape[0]
    wf = wset.float().view(ne, rows // bn, bn, ks, K // ks // 128, 128) * sc.view(ne, rows // bn, 1, ks, -1, 1)
    per = torch.einsum("erbpkc,pkcn->erpbn", wf, xt.float().t().reshape(ks, K // ks // 128, 128, n))
    per = per[:, :nt] + per[:, nt:] if gu else per
    return per.reshape(-1, bn, n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sets", type=int, default=4, help="weight sets replayed in turn (each cold in the L2)")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    grid = 3 * sms
    torch.manual_seed(0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    print(f"{torch.cuda.get_device_name(dev)}: {sms} SMs, grid {grid}", flush=True)
    print(f"floor read kernel: {floor.hbm_read_gbps(dev) / 1e3:.3f} TB/s", flush=True)
    f8, N, BN = torch.float8_e4m3fn, 16, 64
    # (stage, rows per expert, K, gate+up, K parts): one token's items, 384 of each stage
    for stage, rows, K, gu, ks in (("stage 1", 2 * I, H, True, 2), ("stage 2", H, I, False, 1)):
        nt = rows // BN // (2 if gu else 1)
        sets = [((torch.randn(TOPK, rows, K, device=dev) * 0.5).to(f8),
                 torch.rand(TOPK, rows // BN, K // 128, device=dev) + 0.5) for _ in range(a.sets)]
        xt = torch.randn(N, K, device=dev).to(f8)
        per_set = TOPK * nt * ks
        allw = torch.cat([w for w, _ in sets])  # "steady": every set's experts in one launch
        alls = torch.cat([s for _, s in sets])
        for mode in ("wave", "steady"):
            groups = [(w, s) for w, s in sets] if mode == "wave" else [(allw, alls)]
            n_items = per_set if mode == "wave" else per_set * a.sets
            outs = [torch.empty(n_items, BN, N, device=dev) for _ in groups]
            for tma in (False, True):
                for ns in (3, 4):
                    descs = [TensorDescriptor.from_tensor(w.view(-1, K), [BN, 128]) for w, _ in groups]
                    args = dict(NT=nt, KS=ks, K=K, ROWS=rows, BN=BN, N=N, GU=gu, TMA=tma, NS=ns)

                    def run():
                        for (w, s), d, o in zip(groups, descs, outs):
                            k = expert_items[(grid,)](w, d, s, xt, o, n_items, **args, num_warps=4)
                        return k

                    for o in outs:
                        o.fill_(float("nan"))
                    ck = run()
                    torch.cuda.synchronize()
                    ref = want(*groups[0], xt, nt, ks, BN, gu)
                    err = ((outs[0] - ref).abs().max() / ref.abs().max()).item()
                    label = (f"{stage} {mode:6s} {'tma' if tma else 'ptr'} NS={ns} ({ck.n_regs} regs, "
                             f"{ck.metadata.shared // 1024} KB smem)")
                    if not err < 1e-2:
                        print(f"{label}: WRONG (rel err {err:.3g}), not timed", flush=True)
                        continue
                    us = warm_median_us(run, a.reps, warmup_ms=200, device=dev, graph=True) / len(groups)
                    nbytes = groups[0][0].numel()
                    print(f"{label}: {n_items} items of {nbytes // n_items // 1024} KB over {grid} CTAs, "
                          f"{nbytes / 2**20:.1f} MB in {us:.1f} us = {nbytes / us / 1e6:.3f} TB/s "
                          f"(rel err {err:.1e})", flush=True)
        del sets, allw, alls


if __name__ == "__main__":
    main()
