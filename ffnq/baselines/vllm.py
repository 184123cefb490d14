"""Bench baseline (d): one decode step of the FFN as vLLM runs it for MiniMax-M2 (FP8 block
experts, TritonExperts), every launch vLLM makes, in vLLM's order, with its tuned launch config:

    seam all-reduce     torch symm-mem one-shot (``vllm``), where vLLM's custom all-reduce is one-shot
                        at these sizes; NCCL (``vllm-nccl``); none at tp=1
    add + RMSNorm       one launch (vLLM's fused_add_rms_norm)
    router GEMM         fp32 cuBLAS on the bf16 x (vLLM's fp32 GateLinear)
    top-k               one launch: sigmoid, top_k of score + bias, renormalised (vLLM's topk_sigmoid)
    activation quant    vLLM's Triton _per_token_group_quant_fp8 (1 x 128 e4m3)
    block alignment     none while tokens * top_k * 4 <= experts: vLLM's naive block assignment
                        (vllm/model_executor/layers/fused_moe/fused_moe.py, _prepare_expert_assignment;
                        one block per (token, expert) pair, expert_ids = topk_ids; only without an
                        expert map, so Experts.LOCAL always aligns); otherwise one launch
                        (vLLM's moe_align_block_size is CUDA; this tree has no Triton variant)
    GEMM 1              vLLM's fused_moe_kernel (W8A8 block FP8)
    SiLU * up + quant   one launch (vLLM's silu_and_mul_per_block_quant)
    GEMM 2              vLLM's fused_moe_kernel, the routing weight applied in it
    sum over top_k      one launch (vLLM's moe_sum)
    MoE all-reduce      as the seam's; moe_sum writes straight into the symmetric buffer

Nine launches at tp=1 (eight where the naive assignment skips the alignment; cuBLAS may split
the router GEMM in two), as many as vLLM's own decode step makes, plus the all-reduces at tp>1.
Why this and not vLLM's kernel in eager torch glue: that composition ran ~80 kernels a step
(alignment ~30 torch ops, 28-49 us at one token; activation quant ~17 ops; ~31 us of fp32
norm/router glue; two NCCL all-reduces) and made the fused step look 3.5x faster than vLLM where
~1.1-1.3x is what a vLLM user sees. ``gemms(width)`` times the two fused_moe_kernel launches alone.

Launch config, per width M as vLLM picks it (try_get_optimal_moe_config): the tuned file
E=<experts>,N=<w2.shape[2]>,device_name=<GPU>,dtype=fp8_w8a8,block_shape=[128,128].json at the
closest batch key; else vLLM's get_default_config; ``adopt(sweep(...))`` replaces it with the best
of benchmark_moe.py's search space timed on this GPU. ``config_name(width)`` says which ran.
vLLM 0.34.0 ships no tuned file for MiniMax-M2's TP1/TP2 shapes (E=256, N=1536 / 768).

vLLM's code is not part of ffnq (tools/extract_vllm.py writes it to third_party/vllm, ignored by git):
  FFNQ_VLLM_DIR   a folder holding fused_moe.py (fused_moe_kernel, imports reduced to triton),
                  fp8_quant.py (_per_token_group_quant_fp8; optional: without it ffnq's kernel of
                  the same arithmetic runs), configs/*.json (optional), SOURCE.txt (release)
  FFNQ_VLLM_MOE   the fused_moe.py file itself (its folder is then FFNQ_VLLM_DIR unless set)
  FFNQ_VLLM_MOE_CONFIG  a JSON launch config for every width (as vLLM's override_config)
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
from itertools import product
from pathlib import Path

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from ffnq import reference
from ffnq.baselines import vllm_glue as glue
from ffnq.errors import UsageError
from ffnq.spec import Experts
from ffnq.weights import FP8

ENV, ENV_DIR, ENV_CONFIG = "FFNQ_VLLM_MOE", "FFNQ_VLLM_DIR", "FFNQ_VLLM_MOE_CONFIG"
NAIVE_FACTOR = 4  # vLLM's SPARSITY_FACTOR: naive while tokens * top_k * 4 <= experts
VARIANTS = {"vllm": "symm", "vllm-nccl": "nccl"}  # bench's baseline name -> VllmMoe(allreduce=...)


def vllm_dir() -> Path | None:
    d = os.environ.get(ENV_DIR) or (str(Path(os.environ[ENV]).parent) if os.environ.get(ENV) else "")
    return Path(d) if d else None


def kernel_path() -> Path:
    """The fetched kernel file; a one-line UsageError when it is not there."""
    via_dir = not os.environ.get(ENV) and os.environ.get(ENV_DIR)
    p = str(Path(os.environ[ENV_DIR]) / "fused_moe.py") if via_dir else os.environ.get(ENV, "")
    name = f"{ENV_DIR}/fused_moe.py" if via_dir else ENV
    if not p or not Path(p).is_file():
        raise UsageError(f"--baselines vllm: {name}={p!r} is not a file; set {ENV_DIR} to the folder "
                         "tools/extract_vllm.py writes (or FFNQ_VLLM_MOE to its fused_moe.py)")
    if "def fused_moe_kernel(" not in Path(p).read_text():
        raise UsageError(f"--baselines vllm: {name}={p} holds no fused_moe_kernel")
    return Path(p)


@functools.lru_cache(maxsize=None)
def _load(path: Path, name: str):
    """One module object per file: every weight set's step shares the JIT'd kernels."""
    spec = importlib.util.spec_from_file_location(f"ffnq_vllm_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def load_kernel():
    return _load(kernel_path().resolve(), "fused_moe_kernel")


def load_quant():
    """vLLM's _per_token_group_quant_fp8 from FFNQ_VLLM_DIR/fp8_quant.py, or None."""
    d = vllm_dir()
    p = d / "fp8_quant.py" if d else None
    return _load(p.resolve(), "_per_token_group_quant_fp8") if p and p.is_file() else None


def release() -> str:
    d = vllm_dir()
    src = d / "SOURCE.txt" if d else None
    if src and src.is_file():
        for line in src.read_text().splitlines():
            if line.startswith("release:"):
                return "vLLM " + line.split(":", 1)[1].strip()
    return "vLLM (fetched)"


# ---- launch configs, as vLLM picks them ---------------------------------------------------

def device_file_name(device) -> str:
    """vLLM's get_device_name_as_file_name, with its H200-family rule."""
    name = torch.cuda.get_device_name(device).replace(" ", "_")
    return "NVIDIA_H200" if "H200" in name.split("_") else name


def config_file_name(E: int, N: int, device_name: str, block: int) -> str:
    """vLLM's get_config_file_name; N is w2.shape[2] (the intermediate after SiLU * up, per rank)."""
    return f"E={E},N={N},device_name={device_name},dtype=fp8_w8a8,block_shape=[{block},{block}].json"


def default_config(M: int, block: int) -> dict:
    """vLLM's get_default_config for block FP8 on CUDA (fused_moe.py)."""
    small = M <= 8 and block % 64 == 0
    return {"BLOCK_SIZE_M": 16 if M <= 64 else 64, "BLOCK_SIZE_N": 64 if small else block, "BLOCK_SIZE_K": block,
            "GROUP_SIZE_M": 1 if M <= 16 else 32, "num_warps": 4,
            "num_stages": (4 if M <= 4 else 3) if small else 3}


def closest(configs: dict[int, dict], M: int) -> int:
    """The batch key vLLM takes for M: the closest one."""
    return min(configs, key=lambda k: abs(k - M))


def search_space(block: int = 128, dedupe: bool = True) -> list[dict]:
    """vLLM's benchmarks/kernels/benchmark_moe.py get_configs_compute_bound (CUDA), pruned as it
    prunes for block FP8 (BLOCK_SIZE_K a multiple of block_k, BLOCK_SIZE_N of block_n): 640.
    ``dedupe``: drop the ones the launch makes equal (BLOCK_SIZE_K is clamped to the block): 320."""
    out = []
    for st, bm, bn, bk, nw, g in product([2, 3, 4, 5], [16, 32, 64, 128, 256], [32, 64, 128, 256], [64, 128, 256],
                                         [4, 8], [1, 16, 32, 64]):
        if bk % block or bn % block or (dedupe and bk > block):
            continue
        out.append({"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": g,
                    "num_warps": nw, "num_stages": st})
    return out


def sweep(time_us, widths, space: list[dict] | None = None) -> dict[int, tuple[dict, float]]:
    """benchmark_moe.py's tune loop: per width the config of ``space`` (default search_space())
    that ``time_us(width, config)`` (microseconds) finds fastest; configs that fail to compile
    for lack of resources are skipped, as there. width -> (config, us), for ``VllmMoe.adopt``.
    A ``time_us`` for bench: ``moe.set_config(width, config, "trial")``, one eager step (it
    compiles and makes the width's buffers), then the step (or ``moe.gemms(width)``) timed as
    every variant is; benchmark_moe.py times the whole fused_experts call under a CUDA graph."""
    space = space or search_space()
    best = {}
    for s in widths:
        for cfg in space:
            try:
                t = time_us(s, cfg)
            except triton.runtime.errors.OutOfResources:
                continue
            if s not in best or t < best[s][1]:
                best[s] = (dict(cfg), t)
    return best


# a config_name (VllmMoe.config_name) that stands for a tuned file's entry: read from the file at a
# batch key, or bench's sweep for that file at one width; then the config as KEY=int,...
_TUNED_NAME = re.compile(r"(?:vLLM tuned (E=[^ ]+\.json) key (\d+)|sweep of \d+ benchmark_moe\.py configs for "
                         r"(E=[^ ]+\.json), best at M=(\d+) \([\d.]+ us\)): (.+)")


def tuned_entry(config_name: str) -> tuple[str, str, dict] | None:
    """(tuned file, batch key, config) that a ``VllmMoe.config_name`` stands for (tools/extract_vllm.py
    --configs-from writes it back); None for vLLM's default config or an override. ValueError (the
    config's text) where the config is not KEY=int,..."""
    m = _TUNED_NAME.fullmatch(config_name)
    if not m:
        return None
    try:
        cfg = {k: int(v) for k, v in (kv.split("=", 1) for kv in m.group(5).split(","))}
    except ValueError:
        raise ValueError(m.group(5)) from None
    return m.group(1) or m.group(3), m.group(2) or m.group(4), cfg


class _Width:
    """One width's buffers and launches (every shape fixed: a CUDA graph captures the step)."""


class VllmMoe:
    """vLLM's decode step of the MoE FFN (see the module docstring)."""

    def __init__(self, w, spec, tp, experts, device, allreduce: str = "symm", kernel=None, quant="auto"):
        if experts is Experts.NONE:
            raise ValueError("the vLLM composition needs experts (all or local)")
        if allreduce not in ("symm", "nccl"):
            raise ValueError(f"allreduce={allreduce!r}: symm or nccl")
        self.spec, self.tp, self.allreduce, self.device = spec, tp, allreduce, torch.device(device)
        self.kernel = kernel or load_kernel()
        self.args = set(self.kernel.arg_names)
        self.quant = load_quant() if quant == "auto" else quant
        self.first = w.first_expert if experts is Experts.LOCAL else 0
        self.n = w.w13.shape[0]
        # vLLM aligns over the global experts under an expert map, and only then
        self.n_align = spec.experts if experts is Experts.LOCAL else self.n
        self.naive_ok = experts is Experts.ALL and "naive_block_assignment" in self.args
        self.w13, self.s13, self.w2, self.s2 = w.w13, w.s13, w.w2, w.s2
        self.inter = w.w2.shape[2]
        self.post_norm, self.bias = w.post_norm.float(), w.router_bias.float()
        self.router_t = w.router.float().t()
        cuda = self.device.type == "cuda"
        self.cap = torch.cuda.get_device_capability(self.device) if cuda else None
        self.dev_name = device_file_name(self.device) if cuda else self.device.type
        self.file = config_file_name(self.n, self.inter, self.dev_name, spec.block)
        d = vllm_dir()
        f = d / "configs" / self.file if d else None
        self.tuned = {int(k): v for k, v in json.loads(f.read_text()).items() if k.isdigit()} \
            if f and f.is_file() else None
        self.override = json.loads(os.environ.get(ENV_CONFIG) or "{}")
        self.configs: dict[int, tuple[dict, str]] = {}
        self._w: dict[int, _Width] = {}
        self.group = dist.group.WORLD.group_name if tp > 1 else None
        if tp > 1 and allreduce == "symm":
            import torch.distributed._symmetric_memory as symm_mem

            # two buffers: the MoE sum is written into its buffer while a slower peer may still
            # read this rank's seam buffer (a one-shot all-reduce has no closing barrier)
            n = spec.max_tokens * spec.hidden
            self.stage = [symm_mem.empty(n, dtype=torch.bfloat16, device=self.device) for _ in range(2)]
            for t in self.stage:
                symm_mem.rendezvous(t, self.group)

    # ---- config --------------------------------------------------------------------------

    def config(self, width: int) -> dict:
        return self._config(width)[0]

    def config_name(self, width: int) -> str:
        """Which launch config width ``width`` runs, and where it came from."""
        cfg, src = self._config(width)
        return f"{src}: " + ",".join(f"{k}={v}" for k, v in cfg.items())

    def _config(self, M: int) -> tuple[dict, str]:
        if M not in self.configs:
            b = self.spec.block
            if self.override:
                got = (default_config(M, b) | self.override, f"{ENV_CONFIG} over vLLM get_default_config(M={M})")
            elif self.tuned:
                k = closest(self.tuned, M)
                got = (dict(self.tuned[k]), f"vLLM tuned {self.file} key {k}")
            else:
                got = (default_config(M, b), f"vLLM get_default_config(M={M}) (no tuned {self.file})")
            self.configs[M] = got
        return self.configs[M]

    def set_config(self, width: int, cfg: dict, source: str) -> None:
        """Run ``width`` with ``cfg`` from now on (its buffers are made again at the next step)."""
        self.configs[width] = (dict(cfg), source)
        self._w.pop(width, None)

    def adopt(self, best: dict[int, tuple[dict, float]], space_size: int | None = None) -> None:
        """Take ``sweep``'s result: width -> (config, us)."""
        n = f"{space_size} " if space_size else ""
        for s, (cfg, us) in best.items():
            # the file named: tuned_entry reads it back from a report
            self.set_config(s, cfg, f"sweep of {n}benchmark_moe.py configs for {self.file}, best at M={s} ({us:.1f} us)")

    @property
    def describe(self) -> str:
        quant = "vLLM _per_token_group_quant_fp8" if self.quant is not None else "ffnq's 1x128 fp8 quant"
        ar = ("no all-reduce" if self.tp == 1 else
              "symm-mem one-shot all-reduce x2" if self.allreduce == "symm" else "NCCL all-reduce x2")
        naive = (f"naive block assignment while tokens*{self.spec.top_k}*{NAIVE_FACTOR} <= {self.n_align}, else "
                 if self.naive_ok else "")
        # the sources without their per-width part (config_name(width) has each width's config)
        srcs = sorted({re.sub(r"\(M=\d+\)|key \d+|, best at M=\d+ \([\d.]+ us\)", "", src).replace("  ", " ").strip()
                       for _, src in (self.configs.values() or [self._config(1)])})
        cfgs = " / ".join(srcs) + ", per width"
        return (f"{release()} fused_moe_kernel x2 (W8A8 FP8 block {self.spec.block}, routing weight in GEMM 2), "
                f"{quant}, {naive}ffnq's one-launch align; ffnq Triton add+RMSNorm, sigmoid top-k, "
                f"SiLU*up+quant, moe_sum; fp32 cuBLAS router; {ar}; config {cfgs}")

    # ---- the step --------------------------------------------------------------------------

    def _width(self, s: int) -> _Width:
        b = self._w.get(s)
        if b is None:
            b = self._w[s] = self._build(s)
        return b

    def _build(self, s: int) -> _Width:
        m, dev, k = self.spec, self.device, self.spec.top_k
        cfg = self.config(s)
        H, I, P, bm = m.hidden, self.inter, s * k, cfg["BLOCK_SIZE_M"]
        b = _Width()
        b.cfg = cfg

        def e(*shape, dtype=torch.bfloat16):
            return torch.empty(*shape, dtype=dtype, device=dev)

        b.res, b.x, b.x32, b.logits = e(s, H), e(s, H), e(s, H, dtype=torch.float32), e(s, m.experts, dtype=torch.float32)
        b.wts, b.ids = e(s, k, dtype=torch.float32), e(s, k, dtype=torch.int32)
        b.xq, b.xs = e(s, H, dtype=FP8), e(s, H // m.block, dtype=torch.float32)
        b.c1, b.c3 = torch.zeros(s, k, 2 * I, dtype=torch.bfloat16, device=dev), torch.zeros(s, k, H, dtype=torch.bfloat16, device=dev)
        b.aq, b.as_ = e(P, I, dtype=FP8), e(P, I // m.block, dtype=torch.float32)
        b.naive = self.naive_ok and s * k * NAIVE_FACTOR <= self.n_align
        if b.naive:
            b.sorted, b.eids = None, b.ids.view(-1)
            b.ntp = torch.full((1,), P * bm, dtype=torch.int32, device=dev)  # a constant of the width
        else:
            size = glue.align_size(P, self.n_align, bm)
            b.sorted, b.eids = e(size, dtype=torch.int32), e(triton.cdiv(size, bm), dtype=torch.int32)
            b.ntp = e(1, dtype=torch.int32)
        if self.tp > 1 and self.allreduce == "symm":
            b.y, b.out = self.stage[1][: s * H].view(s, H), e(s, H)
        else:
            b.y = e(s, H)
        b.g1 = self._launch(b.xq, b.xs, self.w13, self.s13, b.c1, None, b, k)
        b.g2 = self._launch(b.aq, b.as_, self.w2, self.s2, b.c3, b.wts.view(-1), b, 1)
        return b

    def _launch(self, A, As, B, Bs, C, topk_w, b, top_k: int):
        """(grid, kwargs) of one fused_moe_kernel launch, as vLLM's invoke_fused_moe_triton_kernel
        makes it (fp8 W8A8, block scales), by the fetched kernel's own argument names."""
        cfg = dict(b.cfg)
        cfg.pop("SPLIT_K", None)
        use_tma = bool(cfg.pop("USE_TMA", True))
        blk = self.spec.block
        bm, bn = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"]
        bk = min(cfg.pop("BLOCK_SIZE_K"), blk)
        M, numel = A.shape[0], A.shape[0] * top_k
        if b.sorted is not None:
            em = b.sorted.numel()
            if M < bm:  # vLLM's small-batch bound on the blocks worth launching
                em = min(em, M * top_k * bm)
        else:
            em = numel * bm
        hopper = self.cap is not None and self.cap[0] in (9, 10)
        tma_b = (use_tma and "USE_TMA_B" in self.args and hopper and B.is_contiguous()
                 and B.shape[1] % bn == 0 and B.shape[2] % bk == 0)
        desc = None
        if tma_b:
            from triton.tools.tensor_descriptor import TensorDescriptor

            triton.set_allocator(lambda size, align, stream: torch.empty(size, device=B.device, dtype=torch.int8))
            desc = TensorDescriptor.from_tensor(B, [1, bn, bk])
        args = dict(
            a_ptr=A, b_ptr=B, b_desc=desc, c_ptr=C, b_bias_ptr=None, a_scale_ptr=As, b_scale_ptr=Bs,
            topk_weights_ptr=topk_w, sorted_token_ids_ptr=b.sorted, expert_ids_ptr=b.eids,
            num_tokens_post_padded_ptr=b.ntp, a_desc=None, N=B.shape[1], K=B.shape[2], EM=em, num_valid_tokens=numel,
            stride_am=A.stride(0), stride_ak=A.stride(1), stride_be=B.stride(0), stride_bk=B.stride(2),
            stride_bn=B.stride(1), stride_cm=C.stride(1), stride_cn=C.stride(2), stride_asm=As.stride(0),
            stride_ask=As.stride(1), stride_bse=Bs.stride(0), stride_bsk=Bs.stride(2), stride_bsn=Bs.stride(1) if Bs.shape[1] > 1 else 0,
            stride_bbe=0, stride_bbn=0, group_n=blk, group_k=blk, naive_block_assignment=b.sorted is None,
            SPLIT_K=1, MUL_ROUTED_WEIGHT=topk_w is not None, top_k=top_k, compute_type=tl.bfloat16,
            use_fp8_w8a8=True, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False, HAS_BIAS=False,
            SWAP_AB=self.cap == (9, 0) and bm < 64 and bn >= 64, USE_TD=False, USE_TMA_B=tma_b, USE_TMA_A=False,
            C_IS_SORTED=False, BLOCK_SIZE_K=bk, **cfg)
        meta = {"num_warps", "num_stages", "num_ctas", "maxnreg"}
        missing = [n for n in self.kernel.arg_names if n not in args]
        kw = {k: v for k, v in args.items() if k in self.args or k in meta}
        if missing and not self._defaults_cover(missing):
            raise UsageError(f"the fetched fused_moe_kernel takes arguments ffnq does not know: {sorted(missing)}")
        return (triton.cdiv(em, bm) * triton.cdiv(B.shape[1], bn),), kw

    def _defaults_cover(self, names) -> bool:
        import inspect

        fn = getattr(self.kernel, "fn", None)
        if fn is None:
            return False
        ps = inspect.signature(fn).parameters
        return all(ps[n].default is not inspect.Parameter.empty for n in names if n in ps)

    def _quant_x(self, b) -> None:
        if self.quant is None:
            glue.group_quant_fp8(b.x, self.spec.block, b.xq, b.xs)
            return
        s, H = b.x.shape
        blk = self.spec.block
        args = dict(y_ptr=b.x, y_q_ptr=b.xq, y_s_ptr=b.xs, group_size=blk, y_num_columns=H, y_row_stride=b.x.stride(0),
                    eps=glue.EPS, fp8_min=-glue.FP8_MAX, fp8_max=glue.FP8_MAX, use_ue8m0=False,
                    BLOCK=triton.next_power_of_2(blk))
        names = set(self.quant.arg_names)
        # vLLM's launch: one program per group, num_warps min(max(BLOCK // 256, 1), 8), num_stages 1
        self.quant[(s * H // blk,)](**{k: v for k, v in args.items() if k in names},
                                    num_warps=min(max(args["BLOCK"] // 256, 1), 8), num_stages=1)

    def _seam(self, part, b):
        if self.tp == 1:
            return part
        if self.allreduce == "symm":
            buf = self.stage[0][: part.numel()].view_as(part)
            return torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf, part, "sum", self.group, b.res)
        b.res.copy_(part)
        dist.all_reduce(b.res)
        return b.res

    def __call__(self, part, residual, weights, slots, final=False):
        m, s = self.spec, part.shape[0]
        b = self._width(s)
        # the seam's sum lands in res (the norm kernel overwrites it with h, in place, row by row)
        add_in = self._seam(part, b)
        glue.add_rms_norm(add_in, residual, self.post_norm, m.eps, b.res, b.x, b.x32)
        torch.mm(b.x32, self.router_t, out=b.logits)
        glue.topk_sigmoid(b.logits, self.bias, slots, m.top_k, b.wts, b.ids)
        self._slots = slots  # for chosen(): no op here, so a captured step times none
        self._quant_x(b)
        if b.sorted is not None:
            glue.align(b.ids.view(-1), b.cfg["BLOCK_SIZE_M"], self.first, self.n, b.sorted, b.eids, b.ntp)
        self._gemms(b)
        glue.moe_sum(b.c3, b.ids, self.first, self.n, b.y)
        return self._reduce(b), b.res

    def _gemms(self, b) -> None:
        (grid1, kw1), (grid2, kw2) = b.g1, b.g2
        self.kernel[grid1](**kw1)
        glue.silu_mul_quant(b.c1.view(-1, b.c1.shape[-1]), self.spec.block, b.aq, b.as_)
        self.kernel[grid2](**kw2)

    def _reduce(self, b):
        if self.tp == 1:
            return b.y
        if self.allreduce == "symm":
            return torch.ops.symm_mem.one_shot_all_reduce_out(b.y, "sum", self.group, b.out)
        dist.all_reduce(b.y)
        return b.y

    def gemms(self, width: int):
        """The two fused_moe_kernel launches of ``width`` alone, on the aligned ids and quantized
        activations its last step left (a step of that width must have run): the best a vLLM
        user could get from these kernels, for ``vllm_kernel_us``."""
        b = self._w.get(width)
        if b is None:
            raise RuntimeError(f"gemms({width}): no step of width {width} has run")
        (grid1, kw1), (grid2, kw2) = b.g1, b.g2

        def run():
            self.kernel[grid1](**kw1)
            self.kernel[grid2](**kw2)
        return run

    def chosen(self, width: int) -> torch.Tensor:
        """The experts of the last step, [s, k] int64 sorted, -1 on a padding row (as Runner.chosen)."""
        return reference.picks(self._w[width].ids.long(), self._slots[:width])
