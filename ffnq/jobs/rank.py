"""What every job does on one rank before its own work: process group, peer buffers, weights,
runners, and fresh inputs.

Inputs come from (seed, case, step) alone, so every rank can regenerate every other rank's
``part`` and compute the fp64 reference itself, with no extra communication.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ffnq.dist import all_ranks, init_from_env, shared_tag
from ffnq.errors import UsageError
from ffnq.runner import PeerBuffer, Runner, load_runner
from ffnq.spec import Experts, ModelSpec, load_model
from ffnq.weights import FullWeights, RankWeights, load_layer, shard, synthetic


@dataclass
class RankJob:
    rank: int
    tp: int
    model: ModelSpec
    runner_cls: type[Runner]
    experts: Experts
    timeout: float
    seed: int
    device: torch.device
    peers: PeerBuffer
    full: FullWeights
    weights: RankWeights
    runners: list[Runner] = field(default_factory=list)
    checkpoint: str | None = None  # where full came from (None: synthetic from seed)
    layer: int | None = None
    routing: str = "uniform"  # the synthetic router's (weights.ROUTING)
    backend: str = ""  # the name the runner was loaded by (a backend or package.module:Class)

    def runner(self, widths=None, timeline: bool = False, epoch: torch.Tensor | None = None,
               experts: Experts | None = None, **build) -> Runner:
        """A runner of this job; one whose construction or ``warm`` raises is bad input (a
        UsageError naming the runner: exit 2), not a failed job."""
        try:
            r = self.runner_cls(self.tp, self.rank, self.peers.sym, self.peers.peers, self.device, widths=widths,
                                experts=experts or self.experts, timeline=timeline, epoch=epoch, model=self.model,
                                timeout=self.timeout, **build)
        except Exception as e:  # noqa: BLE001 - a plug-in's own failure, named
            raise runner_error(self.backend, "__init__", e) from e
        warm = r.warm

        def guarded_warm(*args, **kwargs):
            try:
                return warm(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - as above
                raise runner_error(self.backend, "warm", e) from e

        r.warm = guarded_warm
        self.runners.append(r)
        return r

    def compute_units(self) -> int | None:
        """SMs (CUs) of this rank's GPU, for the runners' residency check; None off a GPU."""
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).multi_processor_count
        return None

    def inputs(self, s: int, case: int, step: int = 0, padding: int = 0):  # case, step: ints
        return step_inputs(self.model, self.tp, self.seed, s, case, step, padding, self.device)

    def close(self) -> None:
        self.runners.clear()
        self.peers.close()


def step_inputs(model: ModelSpec, tp: int, seed: int, s: int, case: int, step: int = 0, padding: int = 0,
                device: torch.device | str = "cpu"):
    """Every rank's part, the residual and slots of one check; ``padding`` rows get slot -1
    (spread over the width, never all of it unless padding >= s)."""
    if padding < 0:
        raise ValueError(f"padding {padding}: allowed >= 0 rows")
    g = torch.Generator().manual_seed((seed * 1_000_003 + case * 10_007 + step * 101 + s) & 0x7FFF_FFFF)
    H = model.hidden
    parts = [(torch.randn(s, H, generator=g) / tp ** 0.5).bfloat16() for _ in range(tp)]
    residual = torch.randn(s, H, generator=g).bfloat16()
    slots = torch.randperm(4 * s, generator=g)[:s].to(torch.int64)
    if padding:
        slots[torch.randperm(s, generator=g)[: min(padding, s)]] = -1
    return [p.to(device) for p in parts], residual.to(device), slots.to(device)


def from_options(opts: dict) -> RankJob:
    """setup() from a job's JobOptions (as each rank reads them back)."""
    return setup(opts["backend"], opts["model"], opts["experts"], opts["timeout_s"], opts["seed"],
                 checkpoint=opts.get("checkpoint"), layer=opts.get("checkpoint_layer"),
                 routing=opts.get("routing", "uniform"))


def setup(backend: str, model: str | ModelSpec, experts: str | Experts = "all", timeout: float = 1.0,
          seed: int = 0, dist_timeout_s: float = 120.0, checkpoint: str | None = None,
          layer: int | None = None, routing: str = "uniform") -> RankJob:
    """Collective: every rank of the job calls it with the same arguments. The weights: synthetic
    from ``seed``, or ``layer`` of ``checkpoint`` (vetted by launch.validate)."""
    runner_cls = load_runner(backend)
    spec = load_model(model) if isinstance(model, str) else model
    experts = Experts(experts)
    # the device first: NCCL wants each rank's GPU set before the process group exists
    device = runner_cls.default_device(int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0))))
    runner_cls = runner_cls.for_device(device)  # e.g. the grid from this GPU's SMs
    rank, tp = init_from_env(runner_cls.DIST_BACKEND, dist_timeout_s)
    grids = all_ranks(runner_cls.BLOCKS)  # every rank's buffers and launches take one grid
    if len(set(grids)) > 1:
        raise UsageError("the ranks' GPUs differ in compute units, so their grids differ ("
                         + ", ".join(f"rank {r}: {g} CTAs" for r, g in enumerate(grids))
                         + "): run one TP group on GPUs of one kind")
    spec.check(tp, experts)
    seed = all_ranks(seed)[0]  # rank 0's: nodes launched apart may each have drawn their own
    full = load_layer(checkpoint, layer, spec, device) if checkpoint else synthetic(spec, seed, device, routing)
    weights = shard(full, spec, tp, rank, experts)
    peers = runner_cls.open_peers(spec, tp, rank, device, shared_tag())
    return RankJob(rank, tp, spec, runner_cls, experts, timeout, seed, device, peers, full, weights,
                   checkpoint=checkpoint, layer=layer, routing=routing, backend=backend)


def runner_error(name: str, where: str, e: Exception) -> UsageError:
    """A runner's own failure in ``__init__`` or ``warm``, one line naming it (a UsageError
    raised there keeps its words, prefixed, and its flag to change)."""
    usage = isinstance(e, UsageError)
    said = e.what if usage else str(e)
    what = said.splitlines()[0] if said else ""
    kind = "" if usage else f"{type(e).__name__}: "
    err = UsageError(f"runner {name}: {where} failed: {kind}{what}", use=e.use if usage else None)
    err.bad_input = True  # records.main marks it so: the launcher ends the job as exit 2
    return err
