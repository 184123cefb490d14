"""Model spec, build key, Experts modes, legality, and the memory layouts of one rank.

Two memory spaces per rank (sizes in bytes, offsets 128-byte aligned):

* the **peer buffer** (``sym``), one per rank for the life of a job, written by every rank:
  ``flags`` int32 [PHASES][blocks][tp] (flag of source rank ``src`` for CTA ``c`` of a phase,
  holding the epoch it arrived at), ``fault_box`` int64 [tp][FAULT_BOX] (a faulted rank's
  note to each peer), ``seam`` / ``moe`` bf16 [2][tp][max_tokens][hidden] (pushed rows,
  double-buffered by ``epoch & 1``), and ``epoch`` int32 [EPOCH_WORDS] (this rank's epoch,
  shared by every runner built on this buffer unless given another);
* the **scratch** of one width, local to the rank: ``fault`` int64 [FAULT_FIELDS], ``timeline``
  int64 [blocks][len(stamps)], ``route`` int32 [s][top_k] (chosen experts, -1 for padding),
  ``route_w`` fp32 [s][top_k], plus whatever a backend adds.
"""
from __future__ import annotations

import math
import re
import tomllib
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from enum import Enum, IntEnum
from pathlib import Path

import torch

from ffnq.errors import UsageError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
ALIGN = 128
EPOCH_WORDS = 4  # [epoch, grid-barrier arrivals, FlyDSL's barrier generation, staged exit count]


class Experts(str, Enum):
    ALL = "all"  # every expert, intermediate dim sharded over TP
    LOCAL = "local"  # expert parallel: this rank's whole experts
    NONE = "none"  # no expert work: isolates seam + router + reduce


class Phase(IntEnum):
    SEAM = 0
    REDUCE = 1
    HANDSHAKE = 2


PHASES = len(Phase)
# fault record (scratch "fault", int64): valid is 1 when a wait expired in this launch
FAULT_FIELDS = ("valid", "epoch", "phase", "rank", "missing_mask", "waited_ns", "cta", "at_ns")
# a faulted rank's note in each peer's fault_box[src]: lets a rank that was itself late learn
# that it was the one missing
FAULT_BOX = ("epoch", "missing_mask", "phase", "waited_ns")


def stamp_names(tp: int) -> list[str]:
    """Timeline columns per CTA (ns): phase boundaries, plus when each peer's flag was seen."""
    names = ["start"]
    for ph in Phase:
        p = ph.name.lower()
        names += [f"{p}_arrive"] + [f"{p}_seen{r}" for r in range(tp)] + [f"{p}_done"]
        if ph is Phase.SEAM:
            names += ["router_done", "experts_done"]
    return names + ["end"]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    experts: int
    top_k: int
    intermediate: int  # per expert, before TP sharding
    eps: float = 1e-6
    block: int = 128
    max_tokens: int = 16

    def __post_init__(self):
        check_fields(f"model {self.name}", asdict(self))
        object.__setattr__(self, "eps", float(self.eps))  # a TOML `eps = 1` is an int

    def check(self, tp: int, experts: Experts) -> None:
        """Raise UsageError for a TP this model's block size or expert count forbids."""
        if tp < 1:
            raise UsageError(f"tp={tp}: must be >= 1")
        if experts is Experts.ALL:
            per = self.intermediate / tp
            if per != int(per) or int(per) % self.block:
                ok = [t for t in range(1, 9) if self.intermediate % (t * self.block) == 0]
                raise UsageError(
                    f"tp={tp} with --experts all: {self.name}'s intermediate {self.intermediate}/{tp}"
                    f" = {per:g} per rank is not a multiple of the {self.block} block; legal tp: "
                    f"{', '.join(map(str, ok))} (or --experts local)")
        elif experts is Experts.LOCAL and self.experts % tp:
            raise UsageError(
                f"tp={tp} with --experts local: {self.name}'s {self.experts} experts do not split "
                f"evenly over {tp} ranks")

    def intermediate_per_rank(self, tp: int, experts: Experts) -> int:
        return self.intermediate // tp if experts is Experts.ALL else self.intermediate

    def experts_per_rank(self, tp: int, experts: Experts) -> int:
        return self.experts // tp if experts is Experts.LOCAL else self.experts

    def expert_bytes(self, tp: int, experts: Experts) -> int:
        """FP8 bytes of one expert's shard on one rank (w1, w3 and w2)."""
        return 3 * self.hidden * self.intermediate_per_rank(tp, experts)


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # it becomes part of every kernel's name


def is_int(v) -> bool:
    """A TOML integer: not true (a bool is an int to Python), not 256.0."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite TOML integer or float."""
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _field_problem(f: str, v) -> str | None:
    """What is wrong with one field's value (what is allowed), or None."""
    if f == "name":
        return None if isinstance(v, str) and NAME.fullmatch(v) else "need a non-empty name of letters, digits, - or _"
    if f == "eps":
        return None if is_number(v) and v > 0 else "need a finite number > 0"
    # an int only: 256.0 or true would pass the range checks and fail later, in a rank
    return None if is_int(v) and v >= 1 else "need an integer >= 1"


def check_fields(where: str, vals: dict) -> None:
    """Every field's type and range, then the ones that bound each other; UsageError naming ``where``."""
    for f, v in vals.items():
        problem = _field_problem(f, v)
        if problem:
            raise UsageError(f"{where}: {f} = {v!r}: {problem}")
    if vals["hidden"] % vals["block"] or vals["intermediate"] % vals["block"]:
        raise UsageError(
            f"{where}: hidden ({vals['hidden']}) and intermediate ({vals['intermediate']}) "
            f"must be multiples of the block ({vals['block']})")
    if vals["top_k"] > vals["experts"]:
        raise UsageError(f"{where}: top_k ({vals['top_k']}) > experts ({vals['experts']})")


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A name in configs/models (``tiny``, ``minimax-m2``) or a path to a TOML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = CONFIGS / "models" / f"{name_or_path}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONFIGS / "models").glob("*.toml"))
        raise UsageError(f"model {str(name_or_path)!r}: no such file; known models: {', '.join(known)}")
    where = f"model config {path}"
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{where}: malformed ({e})") from None
    except OSError as e:
        raise UsageError(f"{where}: cannot read it ({e.strerror})") from None
    required = [f.name for f in fields(ModelSpec) if f.default is MISSING]
    defaults = {f.name: f.default for f in fields(ModelSpec) if f.default is not MISSING}
    unknown = sorted(set(raw) - set(required) - set(defaults))
    missing = [f for f in required if f not in raw]
    if unknown or missing:
        what = f"unknown field(s) {', '.join(unknown)}" if unknown else f"missing field(s) {', '.join(missing)}"
        raise UsageError(f"{where}: malformed: {what}; required {', '.join(required)}, optional "
                         f"{', '.join(defaults)}")
    vals = defaults | raw
    check_fields(where, vals)  # named by the file, not by the name inside it
    return ModelSpec(**vals)


@dataclass(frozen=True)
class FfnBuild:
    """What one compiled kernel is specialised for (one width of one rank)."""

    tokens: int
    tp: int
    experts: Experts = Experts.ALL
    timeline: bool = False
    model: ModelSpec = field(default_factory=lambda: load_model("tiny"))
    timeout_ns: int = 1_000_000_000  # bound on every wait
    blocks: int = 1  # CTAs in the persistent grid
    # CTA slots per phase in the peer buffer's flags: the largest grid launched on that buffer
    # (a width may have its own grid); the flags' layout is compiled in, so it is part of the build
    flag_blocks: int = 0

    @property
    def flags(self) -> int:
        return max(self.flag_blocks, self.blocks)

    def __post_init__(self):
        if not 1 <= self.tokens <= self.model.max_tokens:
            raise UsageError(f"width {self.tokens}: allowed 1..{self.model.max_tokens} for {self.model.name}")
        if self.timeout_ns <= 0:
            raise UsageError(f"timeout {self.timeout_ns} ns: must be > 0")
        self.model.check(self.tp, self.experts)

    def describe(self) -> dict:
        d = asdict(self)
        d["experts"] = self.experts.value
        d["model"] = self.model.name
        return d


def kernel_name(key: FfnBuild) -> str:
    return (f"ffn_{key.model.name.replace('-', '_')}_s{key.tokens}_tp{key.tp}_{key.experts.value}"
            + ("_tl" if key.timeline else ""))


@dataclass(frozen=True)
class Region:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def make_layout(items: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> dict[str, Region]:
    out, off = {}, 0
    for name, dtype, shape in items:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out[name] = Region(off, nbytes, dtype, tuple(shape))
        off += -(-nbytes // ALIGN) * ALIGN
    return out


def layout_bytes(layout: dict[str, Region]) -> int:
    last = max(layout.values(), key=lambda r: r.offset)
    return -(-(last.offset + last.nbytes) // ALIGN) * ALIGN


def peer_layout(model: ModelSpec, tp: int, blocks: int) -> dict[str, Region]:
    rows = (2, tp, model.max_tokens, model.hidden)
    return make_layout([
        ("flags", torch.int32, (PHASES, blocks, tp)),
        ("fault_box", torch.int64, (tp, len(FAULT_BOX))),
        ("epoch", torch.int32, (EPOCH_WORDS,)),
        ("seam", torch.bfloat16, rows),
        ("moe", torch.bfloat16, rows),
        # the same exchanges as tagged words (Triton LL): each value beside its epoch in one
        # 8-byte store, so a reader polls the data itself and a writer needs no fence or flag
        ("seam_ll", torch.int64, rows),
        ("moe_ll", torch.int64, rows),
    ])


def scratch_layout(key: FfnBuild, extra: list | None = None) -> dict[str, Region]:
    """Named regions of one width's scratch; ``extra`` adds a backend's own."""
    return make_layout([
        ("fault", torch.int64, (len(FAULT_FIELDS),)),
        ("timeline", torch.int64, (key.blocks, len(stamp_names(key.tp)))),
        ("route", torch.int32, (key.tokens, key.model.top_k)),
        ("route_w", torch.float32, (key.tokens, key.model.top_k)),
    ] + list(extra or []))


def scratch_bytes(key: FfnBuild, extra: list | None = None) -> int:
    return layout_bytes(scratch_layout(key, extra))


def view(buf: torch.Tensor, region: Region) -> torch.Tensor:
    """A typed, shaped view of a region inside a uint8 buffer."""
    return buf[region.offset: region.offset + region.nbytes].view(region.dtype).view(region.shape)


def with_tokens(key: FfnBuild, tokens: int) -> FfnBuild:
    return replace(key, tokens=tokens)


def decode_fault(raw: torch.Tensor, tp: int) -> dict | None:
    """The scratch fault record as a dict, or None when no wait expired."""
    vals = [int(v) for v in raw.cpu().tolist()]
    rec = dict(zip(FAULT_FIELDS, vals))
    if not rec["valid"]:
        return None
    rec["phase_name"] = Phase(rec["phase"]).name.lower() if rec["phase"] in iter(Phase) else str(rec["phase"])
    rec["missing_ranks"] = [r for r in range(tp) if rec["missing_mask"] >> r & 1]
    return rec
