"""Bench baseline (d) ``vllm``: the stock composition with vLLM's Triton fused_moe kernel for the
experts (issue 11: a public fused-MoE kernel timed beside the fused step).

    h   = NCCL all_reduce(part) + residual; x = F.rms_norm(h); fp32 router, sigmoid, biased top-k
    y   = vLLM fused_moe_kernel (block FP8 W8A8: x quantized per 1x128 group, weights as stored)
          twice, SiLU-gated in between, the routing weight applied by the second launch
    out = NCCL all_reduce(y)

vLLM's code is not part of ffnq: FFNQ_VLLM_MOE names a Python file holding ``fused_moe_kernel``
from a fetched copy of vllm/model_executor/layers/fused_moe/fused_moe.py (the Triton kernel
only; its imports reduced to triton and triton.language). The host side here is ffnq's own:
the block alignment (vLLM's moe_align_block_size is a CUDA op) and the per-group activation
quantization, both in torch on the device, fixed-shape, so the step captures into a CUDA graph.
FFNQ_VLLM_MOE_CONFIG (JSON) overrides the launch config; the default is vLLM's own default for
block FP8 (get_default_config).
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ffnq.errors import UsageError
from ffnq.baselines.stock import Stock
from ffnq.weights import FP8

ENV, ENV_CONFIG = "FFNQ_VLLM_MOE", "FFNQ_VLLM_MOE_CONFIG"
DEFAULT_CONFIG = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32,
                  "num_warps": 4, "num_stages": 3}
FP8_MAX = torch.finfo(FP8).max


def kernel_path() -> Path:
    """The fetched kernel file; a one-line UsageError when it is not there."""
    p = os.environ.get(ENV, "")
    if not p or not Path(p).is_file():
        raise UsageError(f"--baselines vllm: {ENV}={p!r} is not a file; set it to a fetched copy of vLLM's "
                         "fused_moe_kernel (vllm/model_executor/layers/fused_moe/fused_moe.py)")
    if "def fused_moe_kernel(" not in Path(p).read_text():
        raise UsageError(f"--baselines vllm: {ENV}={p} holds no fused_moe_kernel")
    return Path(p)


def load_kernel():
    spec = importlib.util.spec_from_file_location("ffnq_vllm_fused_moe", kernel_path())
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.fused_moe_kernel


def config() -> dict:
    return DEFAULT_CONFIG | json.loads(os.environ.get(ENV_CONFIG) or "{}")


def align(ids: torch.Tensor, n_experts: int, block_m: int):
    """moe_align_block_size's contract, in torch: the flattened (token, k) indices grouped by
    expert, each expert's run padded to a multiple of block_m with the sentinel ids.numel();
    the expert of each block; the padded length. Shapes depend only on the inputs' shapes."""
    flat = ids.flatten()
    n = flat.numel()
    dev = flat.device
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    e = flat[order]
    rank_in = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[e]
    size = n + n_experts * (block_m - 1)
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids[(ends - padded)[e] + rank_in] = order.to(torch.int32)
    starts = torch.arange(size // block_m, device=dev) * block_m
    expert_ids = torch.searchsorted(ends, starts, right=True).clamp(max=n_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


def quant_groups(x: torch.Tensor, group: int = 128):
    """Per-token 1 x group FP8 e4m3 quantization (vLLM's per_token_group_quant_fp8): codes and
    fp32 scales [rows, cols / group]."""
    r, c = x.shape
    g = x.float().view(r, c // group, group)
    scale = g.abs().amax(-1).clamp(min=1e-10) / FP8_MAX
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(r, c), scale


class VllmMoe(Stock):
    """The (b) composition with vLLM's fused_moe_kernel for the experts; FP8 weights as stored."""

    def __init__(self, w, spec, tp, experts, device, allreduce: str = "nccl", kernel=None):
        self.kernel = kernel or load_kernel()
        # the launch's meta-parameters; K blocks at most one scale block (as vLLM clamps them)
        self.launch = config()
        self.bk = min(self.launch.pop("BLOCK_SIZE_K"), spec.block)
        super().__init__(w, spec, tp, experts, device, allreduce=allreduce)

    def _prepare(self, w):
        self.w13, self.s13, self.w2, self.s2 = w.w13, w.s13, w.w2, w.s2
        self.half = w.w13.shape[1] // 2

    def _gemm(self, a, a_scale, b, b_scale, c, top_k, sorted_ids, expert_ids, ntp, topk_w=None):
        """One fused_moe_kernel launch as vLLM's invoke_fused_moe_kernel makes it (block FP8)."""
        bm = self.launch["BLOCK_SIZE_M"]
        em = sorted_ids.numel()
        if a.shape[0] < bm:  # vLLM's small-batch bound on the blocks worth launching
            em = min(em, a.shape[0] * top_k * bm)
        n, k = b.shape[1], b.shape[2]
        grid = (triton.cdiv(em, bm) * triton.cdiv(n, self.launch["BLOCK_SIZE_N"]),)
        self.kernel[grid](
            a, b, c, a_scale, b_scale, topk_w, sorted_ids, expert_ids, ntp,
            n, k, em, a.shape[0] * top_k,
            a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1), c.stride(1), c.stride(2),
            a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(2), b_scale.stride(1),
            self.spec.block, self.spec.block,
            MUL_ROUTED_WEIGHT=topk_w is not None, top_k=top_k, compute_type=tl.bfloat16,
            use_fp8_w8a8=True, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
            BLOCK_SIZE_K=self.bk, **self.launch)

    def _experts(self, x, local, wts, s):
        m = self.spec
        sorted_ids, expert_ids, ntp = align(local, self.n, self.launch["BLOCK_SIZE_M"])
        xq, xs = quant_groups(x.to(torch.bfloat16), m.block)
        gu = torch.empty(s, m.top_k, self.w13.shape[1], dtype=torch.bfloat16, device=x.device)
        self._gemm(xq, xs, self.w13, self.s13, gu, m.top_k, sorted_ids, expert_ids, ntp)
        a = (F.silu(gu[..., : self.half]) * gu[..., self.half:]).view(s * m.top_k, self.half)
        aq, as_ = quant_groups(a, m.block)
        ys = torch.empty(s * m.top_k, 1, m.hidden, dtype=torch.bfloat16, device=x.device)
        self._gemm(aq, as_, self.w2, self.s2, ys, 1, sorted_ids, expert_ids, ntp,
                   topk_w=wts.flatten().float().contiguous())
        return ys.view(s, m.top_k, m.hidden).float().sum(1)
