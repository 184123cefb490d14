"""How far the bench's bf16 baselines move the router's biased scores, and how many rows flip.

The baselines all-reduce the o_proj partials in bf16 (NCCL or symm-mem), so h is rounded to bf16
before the fp32 norm and router; the oracle sums in fp64. On minimax-m2 shapes with a synthetic
router (CPU generator), 4096 rows of TP2 inputs: the largest move of a biased score, the rows whose
top-k differs, and their k-th / (k+1)-th gaps. reference.BF16_TIE_EPS is set from this.
Usage: python scripts/bf16_route_flips.py [ROWS]
"""
import sys

import torch
import torch.nn.functional as F

from ffnq.spec import load_model


def main(n: int = 4096) -> None:
    spec = load_model("minimax-m2")
    H, E, k = spec.hidden, spec.experts, spec.top_k
    g = torch.Generator().manual_seed(0)
    post_norm = torch.rand(H, generator=g) + 0.5
    router = torch.randn(E, H, generator=g) / H ** 0.5
    bias = (torch.rand(E, generator=g) - 0.5) * 0.5  # as ffnq.weights.synthetic draws them
    gi = torch.Generator().manual_seed(1)
    parts = [(torch.randn(n, H, generator=gi) / 2 ** 0.5).bfloat16() for _ in range(2)]
    res = torch.randn(n, H, generator=gi).bfloat16()
    h64 = res.double() + parts[0].double() + parts[1].double()
    x64 = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + spec.eps) * post_norm.double()
    ref = torch.sigmoid(x64 @ router.double().T) + bias.double()
    hb = (parts[0].float() + parts[1].float()).bfloat16().float() + res.float()  # bf16 all-reduce, fp32 add
    base = torch.sigmoid(F.rms_norm(hb, (H,), post_norm, spec.eps) @ router.T) + bias
    move = (base.double() - ref).abs()
    top = torch.topk(ref, k + 1, -1).values
    gap = top[:, k - 1] - top[:, k]
    flip = (torch.topk(base, k, -1).indices.sort(-1).values != torch.topk(ref, k, -1).indices.sort(-1).values).any(-1)
    print(f"rows {n}: largest move of a biased score {move.max():.3g} (p99.99 {move.flatten().quantile(0.9999):.3g}); "
          f"rows flipped {int(flip.sum())} ({100 * flip.float().mean():.1f}%), their largest gap {gap[flip].max():.3g}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
