"""What every job takes, and the parsers every layer may use.

    cli / gate -> verbs.job_options -> <Job>Options.validate() -> launch.run -> each rank reads it back

``JobOptions`` holds the options every job shares and the checks that can fail before torchrun
starts (a ``UsageError``: one line, exit 2). Each job subclasses it beside its rank code
(``ffnq.jobs.<job>``) with its own fields, its own checks (``check``) and its own share of the
deadline (``work_s``). Nothing here imports torch at module level: the parsers serve the cli's
start-up and the offline compile paths too.
"""
from __future__ import annotations

import math
import os
import re
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ffnq.errors import UsageError, cut, shown
from ffnq.spec import Experts, load_model

GPU_BACKENDS = ("triton", "flydsl")
SETUP_S = 90.0  # interpreter + torch import + process group + weights, per job, on a slow 2-core host
# bounds past which a value is a typo, not a method: a wait of a minute is a hang to any kernel
# (and the derived deadline grows with it); more ranks than any host has
MAX_TIMEOUT_S, MIN_TIMEOUT_S = 60.0, 1e-6
MAX_TP = 64
RDZV = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")
CHECKPOINT_READ_GBPS = 0.5  # a slow disk's read rate, for the deadline's share of a checkpoint's reads
def fresh_seed() -> int:
    """A seed for a run that names none: each run checks new weights and inputs, and its report
    keeps the seed (``--seed`` repeats the run)."""
    return secrets.randbelow(2 ** 31)


def parse_widths(text: str | None, max_tokens: int, option: str = "--widths") -> list[int]:
    """'1-4,8,16' -> [1, 2, 3, 4, 8, 16]; 'all' or None -> 1..max_tokens. ``option`` names the
    flag in the error."""
    if text is None or text.strip() == "all":
        return list(range(1, max_tokens + 1))
    if not text.strip():
        raise UsageError(f"{option} {shown(text)}: empty; allowed all or N, N-M lists (e.g. 1-4,8,16)")
    out: list[int] = []
    for item in text.split(","):
        item = item.strip()
        m = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", item)
        if not m:
            raise UsageError(f"{option} {shown(text)}: {shown(item, 30)} is not N or N-M (e.g. 1-4,8,16)")
        big = max(len(m[1]), len(m[2] or "")) > 9  # past any width (and int()'s 4300-digit limit)
        lo, hi = (0, 0) if big else (int(m[1]), int(m[2] or m[1]))
        if big or lo > hi or lo < 1 or hi > max_tokens:
            raise UsageError(f"{option} {shown(text)}: {cut(item, 30)} outside 1..{max_tokens} (max_tokens of the "
                             "model)")
        out += [w for w in range(lo, hi + 1) if w not in out]
    return sorted(out)


def parse_inject(values: list[str] | None, tp: int) -> list[int]:
    """--inject-rank R (repeatable) or 'all' -> sorted ranks, each < tp."""
    ranks: set[int] = set()
    for v in values or []:
        for item in str(v).split(","):
            item = item.strip()
            if item == "all":
                ranks |= set(range(tp))
            elif re.fullmatch(r"[0-9]{1,9}", item) and int(item) < tp:
                ranks.add(int(item))
            else:
                raise UsageError(f"--inject-rank {shown(item)}: allowed 0..{tp - 1} or all (tp={tp})")
    return sorted(ranks)


def parse_baselines(text: str) -> dict:
    """--baselines auto | none | a,b -> the bench options' ``baseline`` and ``baselines``."""
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    if names in ([], ["auto"]):
        return {"baseline": True, "baselines": []}
    if names == ["none"]:
        return {"baseline": False, "baselines": []}
    return {"baseline": True, "baselines": names}


def resolve_backend(backend: str) -> str:
    """'auto' -> triton where a GPU is, else cpu; any other name as given."""
    if backend != "auto":
        return backend
    import torch

    return "triton" if torch.cuda.is_available() else "cpu"


@dataclass
class JobOptions:
    """What every job takes; the cli or a gate fills it, each rank reads it back from JSON."""

    backend: str = "cpu"  # a backend name or package.module:Class
    model: str = "tiny"
    tp: int = 2
    experts: str = "all"
    widths: list[int] = field(default_factory=list)  # empty: every width of the model
    timeout_s: float = 1.0  # the kernel's bound on every wait
    seed: int = 0
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    deadline_s: float | None = None  # the job's own bound; None: derived from the work
    checkpoint: str | None = None  # a safetensors checkpoint whose layer's weights replace the synthetic
    checkpoint_layer: int | None = None  # its decoder layer (None: the first it holds)

    job = "job"  # the module ffnq.jobs.<job> each rank runs

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def gpu(self) -> bool:
        return self.backend in GPU_BACKENDS

    # ---- what a job adds (its subclass) ----
    def check(self) -> None:
        """The job's own checks, after the shared ones; raises UsageError."""

    def work_s(self) -> float:
        """A generous bound on the job's own work (seconds), setup excluded."""
        return 30 + 10 * len(self.widths)

    def weight_sets(self) -> int:
        """Layers of weights each rank loads (the deadline's share of a checkpoint's reads)."""
        return 1

    # ---- shared ----
    def deadline(self) -> float:
        """Seconds the whole job may take: setup plus its work plus reading a checkpoint."""
        if self.deadline_s:
            return self.deadline_s
        return SETUP_S + self.work_s() + self.checkpoint_load_s()

    def checkpoint_load_s(self) -> float:
        """The deadline's allowance for reading --checkpoint: every rank of a node reads its
        layers from one disk."""
        if not self.checkpoint:
            return 0.0
        spec = load_model(self.model)
        layer_gb = spec.experts * 3 * spec.intermediate * spec.hidden / 1e9
        return 30 + self.tp // self.nnodes * self.weight_sets() * layer_gb / CHECKPOINT_READ_GBPS

    def validate(self) -> "JobOptions":
        """Every check that can fail before torchrun starts; raises UsageError (exit 2)."""
        spec = load_model(self.model)
        try:
            experts = Experts(self.experts)
        except ValueError:
            raise UsageError(f"--experts {shown(self.experts)}: allowed {', '.join(e.value for e in Experts)}") from None
        if not 1 <= self.tp <= MAX_TP:
            raise UsageError(f"--tp {self.tp}: allowed 1..{MAX_TP}")
        spec.check(self.tp, experts)
        if not 0 <= self.seed < 2 ** 63:
            raise UsageError(f"--seed {self.seed}: allowed 0..2^63-1")
        if not self.widths:
            self.widths = list(range(1, spec.max_tokens + 1))
        bad = [w for w in self.widths if not 1 <= w <= spec.max_tokens]
        if bad:
            raise UsageError(f"widths {cut(bad)}: allowed 1..{spec.max_tokens} for {spec.name}")
        if self.checkpoint is not None:
            from ffnq.weights import check_checkpoint

            self.checkpoint = str(Path(self.checkpoint).absolute())  # the ranks may start elsewhere
            self.checkpoint_layer = check_checkpoint(self.checkpoint, self.checkpoint_layer, spec)
        elif self.checkpoint_layer is not None:
            raise UsageError(f"--checkpoint-layer {self.checkpoint_layer}: needs --checkpoint PATH "
                             "(the synthetic weights have no layers)")
        if not self.timeout_s > 0:
            raise UsageError(f"--timeout {self.timeout_s}: must be > 0 (seconds)")
        if not MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S:
            raise UsageError(f"--timeout {self.timeout_s:g}: allowed {MIN_TIMEOUT_S:g}..{MAX_TIMEOUT_S:g} s")
        if self.deadline_s is not None and not (self.deadline_s > 0 and math.isfinite(self.deadline_s)):
            raise UsageError(f"--deadline {self.deadline_s}: must be > 0 and finite (seconds)")
        self.check()
        self._check_launch()
        self._check_backend()
        return self

    def _check_launch(self) -> None:
        if self.nnodes < 1 or self.tp % self.nnodes:
            raise UsageError(f"--nnodes {self.nnodes}: must be >= 1 and divide --tp {self.tp}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise UsageError(f"--nnodes {self.nnodes}: needs --rdzv-endpoint HOST:PORT")
        if self.rdzv_endpoint is not None:
            m = RDZV.fullmatch(self.rdzv_endpoint)
            if not (m and 1 <= int(m[1]) <= 65535):
                raise UsageError(f"--rdzv-endpoint {shown(self.rdzv_endpoint)}: need HOST:PORT, port 1..65535")

    def _check_backend(self) -> None:
        import torch

        from ffnq.runner import BACKENDS, load_runner

        if self.backend not in BACKENDS and ":" not in self.backend:
            raise UsageError(f"--backend {shown(self.backend)}: allowed auto, {', '.join(BACKENDS)} "
                             f"(or --runner package.module:Class)")
        cls = load_runner(self.backend)
        try:  # a bad override or measured table fails here, not in every rank's build
            cls.check_build()
        except UsageError:
            raise
        except ValueError as e:
            raise UsageError(str(e)) from None
        per_node = self.tp // self.nnodes
        interp = self.backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
        if interp and per_node != 1:
            raise UsageError(f"--tp {self.tp}: TRITON_INTERPRET=1 (triton on the cpu) runs one rank only")
        if self.gpu and not interp:
            if not torch.cuda.is_available():
                raise UsageError(f"--backend {self.backend}: needs a GPU and this host has none", use="--backend cpu")
            if per_node > torch.cuda.device_count():
                raise UsageError(f"--tp {self.tp}: {per_node} ranks on this host but only "
                                 f"{torch.cuda.device_count()} GPU(s)")
        if not self.gpu:  # a plug-in: ask it where rank 0 would run
            try:
                dev = torch.device(cls.default_device(0))
            except Exception as e:  # noqa: BLE001 - a plug-in's own failure is bad input here
                raise UsageError(f"--runner {cut(self.backend)}: default_device failed ({cut(e, 200)})") from None
            if dev.type == "cuda" and (not torch.cuda.is_available() or per_node > torch.cuda.device_count()):
                raise UsageError(f"--runner {self.backend}: runs on cuda; {per_node} ranks here but "
                                 f"{torch.cuda.device_count()} GPU(s)")
