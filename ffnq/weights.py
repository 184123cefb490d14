"""One layer's FFN weights: synthetic FP8 (deterministic from a seed), a safetensors loader
for a real MiniMax-M2 checkpoint layer, and the per-rank shard a runner reads.

Conventions (those of the released checkpoints): expert weights are float8_e4m3fn with one
fp32 scale per 128x128 block, the scale being the dequant multiplier (``weight_scale_inv``),
so ``W = q.float() * scale`` blockwise. w1 is the gate projection, w3 the up projection
([intermediate, hidden] each), w2 the down projection ([hidden, intermediate]). The router
(``gate``) and its selection bias (``e_score_correction_bias``) are fp32.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ffnq.errors import UsageError, shown
from ffnq.spec import Experts, ModelSpec

FP8 = torch.float8_e4m3fn
Q_STD = 16.0  # spread of the synthetic fp8 codes: uses the mantissa, far from e4m3's 448


@dataclass
class FullWeights:
    """Every expert of one layer (what the reference reads)."""

    post_norm: torch.Tensor  # [H] fp32
    router: torch.Tensor  # [E, H] fp32
    router_bias: torch.Tensor  # [E] fp32, selection only
    w1: torch.Tensor  # [E, I, H] fp8
    s1: torch.Tensor  # [E, I/128, H/128] fp32
    w3: torch.Tensor  # [E, I, H] fp8
    s3: torch.Tensor
    w2: torch.Tensor  # [E, H, I] fp8
    s2: torch.Tensor  # [E, H/128, I/128] fp32


@dataclass
class RankWeights:
    """One rank's shard, with the attribute names the original runner reads."""

    post_norm: torch.Tensor  # [H] fp32
    router: torch.Tensor  # [E, H] fp32 (replicated)
    router_bias: torch.Tensor  # [E] fp32
    w13: torch.Tensor  # [E_r, 2*I_r, H] fp8: this rank's rows of w1, then of w3
    s13: torch.Tensor  # [E_r, 2*I_r/128, H/128] fp32
    w2: torch.Tensor  # [E_r, H, I_r] fp8
    s2: torch.Tensor  # [E_r, H/128, I_r/128] fp32
    first_expert: int = 0  # global id of local expert 0 (LOCAL); 0 otherwise
    experts: Experts = Experts.ALL


def dequant(q: torch.Tensor, scale: torch.Tensor, block: int, dtype=torch.float32) -> torch.Tensor:
    """Blockwise ``q * scale`` over the last two dims (both multiples of ``block``)."""
    *lead, R, C = q.shape
    blocks = q.to(dtype).view(*lead, R // block, block, C // block, block)
    return (blocks * scale.to(dtype)[..., :, None, :, None]).view(*lead, R, C)


def _expert(g: torch.Generator, rows: int, cols: int, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    q = (torch.randn(rows, cols, generator=g, device=device) * Q_STD).clamp(-448, 448).to(FP8)
    # dequantized entries ~ N(0, 1/cols) so every projection keeps activations near unit scale
    s = torch.rand(rows // block, cols // block, generator=g, device=device) + 0.5
    return q, s / (Q_STD * cols ** 0.5)


# the selection bias's spread (uniform in +-spread/2) by routing. "uniform": the experts a width's
# rows touch are within 1% of independent uniform routing's 256 * (1 - (1 - 8/256)^w) (MiniMax-M2:
# 8 / 15.8 / 30.3 / 57.1 / 100.6 of 256 at 1 / 2 / 4 / 8 / 16 rows, against 8 / 15.8 / 30.5 / 57.2 /
# 101.9), as real decode traffic does, while the bias still reorders the top-8 in 78% of rows.
# "skewed": a bias 10x wider favours some experts in every row (1.0 reordered), so 16 rows touch
# ~67 experts: fewer bytes than decode reads, a named case, never the default workload.
ROUTING = {"uniform": 0.05, "skewed": 0.5}


def synthetic(spec: ModelSpec, seed: int = 0, device: str | torch.device = "cpu",
              routing: str = "uniform") -> FullWeights:
    """Deterministic for (spec, seed, device type, routing). Each expert has its own generator, so
    any expert can be regenerated alone."""
    dev = torch.device(device)
    H, E, I, B = spec.hidden, spec.experts, spec.intermediate, spec.block
    g = torch.Generator(device=dev).manual_seed(seed)
    post_norm = torch.rand(H, generator=g, device=dev) + 0.5
    router = torch.randn(E, H, generator=g, device=dev) / H ** 0.5
    router_bias = (torch.rand(E, generator=g, device=dev) - 0.5) * ROUTING[routing]
    parts = {k: [] for k in ("w1", "s1", "w3", "s3", "w2", "s2")}
    for e in range(E):
        ge = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + 7919 * e + 1)
        for w, s, (r, c) in (("w1", "s1", (I, H)), ("w3", "s3", (I, H)), ("w2", "s2", (H, I))):
            q, sc = _expert(ge, r, c, B, dev)
            parts[w].append(q)
            parts[s].append(sc)
    return FullWeights(post_norm, router, router_bias, **{k: torch.stack(v) for k, v in parts.items()})


def shard(full: FullWeights, spec: ModelSpec, tp: int, rank: int, experts: Experts,
          device: str | torch.device | None = None) -> RankWeights:
    """This rank's part: ALL slices every expert's intermediate, LOCAL takes whole experts,
    NONE keeps only what the seam and router read."""
    spec.check(tp, experts)
    if not 0 <= rank < tp:
        raise UsageError(f"rank {rank}: allowed 0..{tp - 1}")
    dev = device or full.router.device
    B = spec.block
    first = 0
    if experts is Experts.ALL:
        n = spec.intermediate // tp
        rows, brows = slice(rank * n, (rank + 1) * n), slice(rank * n // B, (rank + 1) * n // B)
        w13 = torch.cat([full.w1[:, rows], full.w3[:, rows]], 1)
        s13 = torch.cat([full.s1[:, brows], full.s3[:, brows]], 1)
        w2, s2 = full.w2[:, :, rows], full.s2[:, :, brows]
    elif experts is Experts.LOCAL:
        n = spec.experts // tp
        first = rank * n
        ex = slice(first, first + n)
        w13 = torch.cat([full.w1[ex], full.w3[ex]], 1)
        s13 = torch.cat([full.s1[ex], full.s3[ex]], 1)
        w2, s2 = full.w2[ex], full.s2[ex]
    else:
        H = spec.hidden
        w13 = torch.empty(0, 0, H, dtype=FP8)
        s13 = torch.empty(0, 0, H // B)
        w2, s2 = torch.empty(0, H, 0, dtype=FP8), torch.empty(0, H // B, 0)

    def put(t):
        return t.contiguous().to(dev)

    return RankWeights(put(full.post_norm), put(full.router), put(full.router_bias), put(w13), put(s13),
                       put(w2), put(s2), first, experts)


# ---- real checkpoints -------------------------------------------------------------------------

def layer_names(layer: int, expert: int | None = None) -> dict[str, str]:
    """MiniMax-M2 safetensors tensor names of one decoder layer's FFN."""
    p = f"model.layers.{layer}"
    if expert is None:
        return {
            "post_norm": f"{p}.post_attention_layernorm.weight",
            "router": f"{p}.block_sparse_moe.gate.weight",
            "router_bias": f"{p}.block_sparse_moe.e_score_correction_bias",
        }
    e = f"{p}.block_sparse_moe.experts.{expert}"
    return {k: f"{e}.{w}.weight" for k, w in (("w1", "w1"), ("w3", "w3"), ("w2", "w2"))} | {
        f"s{k[1]}": f"{e}.{k}.weight_scale_inv" for k in ("w1", "w3", "w2")}


_INDEXED: dict[tuple, dict[str, Path]] = {}  # a process's reads of one checkpoint's headers, by its files' stats


def _index(path: str | Path) -> tuple[Path, dict[str, Path]]:
    """A checkpoint folder (or one .safetensors file): every tensor name -> the file holding it
    (headers only; read once per process while the files' sizes and times stay as they were: a
    bench on a GPU loads four layers, and a real checkpoint has 126 files)."""
    from safetensors import safe_open

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not files[0].is_file():
        raise UsageError(f"checkpoint {path}: no .safetensors file there")
    files = [f.resolve() for f in files]
    key = tuple((str(f), st.st_mtime_ns, st.st_size) for f, st in ((f, f.stat()) for f in files))
    if key in _INDEXED:
        return path, _INDEXED[key]
    where: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(f, "pt") as st:
                where.update({k: f for k in st.keys()})
        except Exception as e:  # noqa: BLE001 - a file that is not safetensors is bad input here
            raise UsageError(f"checkpoint {f}: not a readable .safetensors file ({e})") from None
    _INDEXED.clear()  # one checkpoint at a time
    _INDEXED[key] = where
    return path, where


def checkpoint_layers(path: str | Path) -> list[int]:
    """The decoder layers whose FFN (post-attention norm) a checkpoint holds, in order."""
    return _layers(_index(path)[1])


def _layers(where: dict[str, Path]) -> list[int]:
    found = (re.fullmatch(r"model\.layers\.([0-9]+)\.post_attention_layernorm\.weight", n) for n in where)
    return sorted(int(m[1]) for m in found if m)


def _shapes(spec: ModelSpec) -> dict[str, tuple]:
    """Each FFN tensor's shape in a checkpoint of ``spec`` (one expert's for the experts')."""
    H, E, I, B = spec.hidden, spec.experts, spec.intermediate, spec.block
    return {"post_norm": (H,), "router": (E, H), "router_bias": (E,), "w1": (I, H), "w3": (I, H), "w2": (H, I),
            "s1": (-(-I // B), -(-H // B)), "s3": (-(-I // B), -(-H // B)), "s2": (-(-H // B), -(-I // B))}


# config.json keys of the released checkpoints -> the ModelSpec field each must equal
CONFIG_KEYS = {"hidden_size": "hidden", "num_local_experts": "experts", "num_experts_per_tok": "top_k",
               "intermediate_size": "intermediate", "rms_norm_eps": "eps"}


def save_checkpoint(where: str | Path, layers: dict[int, FullWeights], spec: ModelSpec, files: int = 2,
                    config: dict | None = None) -> Path:
    """The inverse of load_layer: ``layers`` (decoder layer -> its weights) written under
    MiniMax-M2's tensor names into ``files`` .safetensors files, with a config.json of ``spec``'s
    dims (``config`` over them). A checkpoint of synthetic layers for the loader's own runs."""
    from safetensors.torch import save_file

    where = Path(where)
    where.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer, full in layers.items():
        tensors |= {n: getattr(full, k).cpu() for k, n in layer_names(layer).items()}
        for e in range(spec.experts):
            tensors |= {n: getattr(full, k)[e].contiguous().cpu() for k, n in layer_names(layer, e).items()}
    names = sorted(tensors)
    step = -(-len(names) // files)
    for i in range(files):
        save_file({n: tensors[n] for n in names[i * step:(i + 1) * step]},
                  where / f"model-{i + 1:05d}-of-{files:05d}.safetensors")
    conf = {key: getattr(spec, f) for key, f in CONFIG_KEYS.items()} | {"use_routing_bias": True}
    (where / "config.json").write_text(json.dumps(conf | (config or {})))
    return where


def _layer_tensors(layer: int, spec: ModelSpec) -> list[tuple[str, int | None, str]]:
    """(field, expert or None, tensor name) of every FFN tensor of a layer, norm and router first."""
    return [(k, None, n) for k, n in layer_names(layer).items()] + [
        (k, e, n) for e in range(spec.experts) for k, n in layer_names(layer, e).items()]


def check_checkpoint(path: str | Path, layer: int | None, spec: ModelSpec) -> int:
    """Before any rank starts, from the headers alone: the layer's FFN tensors are all there with
    ``spec``'s shapes, the experts FP8 e4m3 and their scales fp32, and the folder's config.json (if
    any) describes ``spec``. Each problem is one UsageError naming the value and what is allowed.
    Returns the layer (None: the first the checkpoint holds)."""
    from safetensors import safe_open

    path, where = _index(path)
    layers = _layers(where)
    if layer is None:
        layer = layers[0] if layers else 0
    if layer not in layers:
        have = f"layers {layers[0]}..{layers[-1]}" if layers else "no decoder layer's FFN"
        raise UsageError(f"--checkpoint-layer {layer}: checkpoint {path} holds {have}")
    cfg = path / "config.json" if path.is_dir() else None
    if cfg and cfg.is_file():
        try:
            conf = json.loads(cfg.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise UsageError(f"checkpoint {path}: config.json is not readable JSON ({str(e).splitlines()[0][:100]})"
                             ) from None
        if not isinstance(conf, dict):
            raise UsageError(f"checkpoint {path}: config.json holds a JSON {type(conf).__name__}, not an object "
                             "of the model's keys")
        for key, field_ in CONFIG_KEYS.items():
            if key in conf and conf[key] != getattr(spec, field_):
                raise UsageError(f"checkpoint {path}: config.json {key} = {shown(conf[key])}, --model {spec.name} has "
                                 f"{field_} = {getattr(spec, field_)}")
        if conf.get("use_routing_bias") is False:  # the kernel and the oracle always add the selection bias
            raise UsageError(f"checkpoint {path}: config.json use_routing_bias = false; ffnq's router adds "
                             "e_score_correction_bias (MiniMax-M2's sigmoid + bias routing)")
    want = _shapes(spec)
    names = _layer_tensors(layer, spec)
    head = {}
    for f in dict.fromkeys(where[n] for _, _, n in names if n in where):  # each file's header read once
        with safe_open(f, "pt") as st:
            head |= {n: (tuple(st.get_slice(n).get_shape()), st.get_slice(n).get_dtype())
                     for _, _, n in names if where.get(n) == f}
    for key, _, n in names:  # the norm's and router's shapes name a wrong model first
        if n not in head:
            raise UsageError(f"checkpoint {path}: tensor {n} missing (layer {layer}, --model {spec.name})")
        shape, dtype = head[n]
        if shape != want[key]:
            raise UsageError(f"checkpoint {path}: {n} has shape {shape}, --model {spec.name} needs {want[key]}")
        if key in ("w1", "w3", "w2") and dtype != "F8_E4M3":
            raise UsageError(f"checkpoint {path}: {n} is {dtype}, the experts must be F8_E4M3 (float8_e4m3fn)")
        if key in ("s1", "s3", "s2") and dtype != "F32":
            raise UsageError(f"checkpoint {path}: {n} is {dtype}, the block scales must be F32")
    extra = f"model.layers.{layer}.block_sparse_moe.experts.{spec.experts}.w1.weight"
    if extra in where:
        raise UsageError(f"checkpoint {path}: layer {layer} has more than {spec.experts} experts "
                         f"(--model {spec.name} has {spec.experts})")
    return layer


def load_layer(path: str | Path, layer: int, spec: ModelSpec, device: str | torch.device = "cpu") -> FullWeights:
    """One layer from a checkpoint folder (or one .safetensors file), read onto ``device``, each
    file that holds a part of it opened once (check_checkpoint has vetted it before a job starts)."""
    from safetensors import safe_open

    path, where = _index(path)
    names = _layer_tensors(layer, spec)
    missing = [n for _, _, n in names if n not in where]
    if missing:
        raise UsageError(f"checkpoint {path}: tensor {missing[0]} missing (layer {layer})")
    got = {}
    for f in dict.fromkeys(where[n] for _, _, n in names):  # each file opened once (126 in a real checkpoint)
        with safe_open(f, "pt", device=str(device)) as st:
            got |= {n: st.get_tensor(n) for _, _, n in names if where[n] == f}
    base = {k: got[n].float() for k, e, n in names if e is None}
    parts = {k: [] for k in ("w1", "s1", "w3", "s3", "w2", "s2")}
    for k, e, n in names:
        if e is not None:
            parts[k].append(got[n])
    full = FullWeights(**base, **{k: torch.stack(v) for k, v in parts.items()})
    want = {"router": (spec.experts, spec.hidden), "w1": (spec.experts, spec.intermediate, spec.hidden),
            "w2": (spec.experts, spec.hidden, spec.intermediate)}
    for k, shape in want.items():
        if tuple(getattr(full, k).shape) != shape:
            raise UsageError(f"checkpoint {path}: {k} has shape {tuple(getattr(full, k).shape)}, "
                             f"{spec.name} needs {shape}")
    if full.w1.dtype != FP8:
        raise UsageError(f"checkpoint {path}: expert weights are {full.w1.dtype}, need {FP8}")
    return full
