"""Validate a job's options, run its ranks through torchrun under a deadline, collect records.

    cli -> launch.validate(opts) -> launch.run(job, opts) -> torchrun -> python -m ffnq.jobs.<job>

Each rank appends JSON lines to ``<tmp>/rank<r>.jsonl`` (progress, rows, done or error); rank 0
also writes every rank's rows, gathered, into ``all.jsonl`` (the only file a multi-node run
needs on this host). The temp dir is never the reports folder. torchrun runs in its own session,
so a job past its deadline is killed as a whole group; a rank that dies makes torchrun end the
others, and the error names the dead rank (from its error record, else torchrun's root cause).
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from ffnq.errors import Stopped, UsageError
from ffnq.spec import Experts, load_model

GPU_BACKENDS = ("triton", "flydsl")
BASELINES = ("unfused", "stock", "stock-nccl", "stock-symm", "vllm")
SETUP_S = 90.0  # interpreter + torch import + process group + weights, per job, on a slow 2-core host
MAX_INJECT_NS = 2**31 - 1  # inject ticks are int32
MAX_WINDOW_MS = 10_000  # a bench burst or idle longer than this is a typo, not a method
# bounds past which a value is a typo, not a method: a wait of a minute is a hang to any kernel
# (and the derived deadline grows with it); more ranks than any host has; ten minutes per variant
MAX_TIMEOUT_S, MIN_TIMEOUT_S = 60.0, 1e-6
MAX_TP, MAX_RUNNERS, MAX_LAYERS, MAX_STEPS = 64, 16, 256, 100_000_000
MAX_REP_MS, MAX_WARMUP_MS = 600_000.0, 60_000.0
RDZV = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")


class LaunchError(RuntimeError):
    """The job ran but did not finish: a rank died, or the deadline passed. ``records`` keeps
    what every rank wrote before that, so a report can still show what finished."""

    def __init__(self, message: str, records: list[dict] | None = None):
        super().__init__(message)
        self.records = records or []


def fresh_seed() -> int:
    """A seed for a run that names none: each run checks new weights and inputs, and its report
    keeps the seed (``--seed`` repeats the run)."""
    return secrets.randbelow(2 ** 31)


@dataclass
class JobOptions:
    """What every job takes; the cli fills it, each rank reads it back from JSON."""

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
    # qualify
    inject_ranks: list[int] = field(default_factory=list)
    # bench
    layers: int = 1
    rep_ms: float = 1000.0  # timed budget per width and variant (ms), converted to a step count
    warmup_ms: float = 200.0
    burst_ms: float = 250.0  # on a GPU the timed steps run in bursts this long (0: one window)...
    idle_ms: float = 250.0  # ...each after this long idle: no window reaches the power cap
    min_steps: int = 10
    max_steps: int = 1000
    baseline: bool = True  # False: time the fused step alone
    phase_split: bool = False  # also time the kernel with Experts NONE (seam + router + reduce)
    baselines: list[str] = field(default_factory=list)  # empty: auto (see ffnq.jobs.bench.baselines)
    # soak
    steps: int = 1000
    random_padding: bool = True
    runners: int = 2
    check_every: int | None = None  # None: every step on cpu, 1 in 100 on a GPU
    kill_rank: int | None = None
    hang_rank: int | None = None
    at_step: int | None = None

    def to_json(self) -> dict:
        return asdict(self)


def parse_widths(text: str | None, max_tokens: int, option: str = "--widths") -> list[int]:
    """'1-4,8,16' -> [1, 2, 3, 4, 8, 16]; 'all' or None -> 1..max_tokens. ``option`` names the
    flag in the error."""
    if text is None or text.strip() == "all":
        return list(range(1, max_tokens + 1))
    if not text.strip():
        raise UsageError(f"{option} {text!r}: empty; allowed all or N, N-M lists (e.g. 1-4,8,16)")
    out: list[int] = []
    for item in text.split(","):
        item = item.strip()
        m = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", item)
        if not m:
            raise UsageError(f"{option} {text!r}: {item!r} is not N or N-M (e.g. 1-4,8,16)")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if lo > hi or lo < 1 or hi > max_tokens:
            raise UsageError(f"{option} {text!r}: {item} outside 1..{max_tokens} (max_tokens of the model)")
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
            elif re.fullmatch(r"[0-9]+", item) and int(item) < tp:
                ranks.add(int(item))
            else:
                raise UsageError(f"--inject-rank {item!r}: allowed 0..{tp - 1} or all (tp={tp})")
    return sorted(ranks)


def resolve_backend(backend: str) -> str:
    if backend != "auto":
        return backend
    import torch

    return "triton" if torch.cuda.is_available() else "cpu"


def validate(opts: JobOptions, verb: str | None = None) -> JobOptions:
    """Every check that can fail before torchrun starts; raises UsageError (exit 2). ``verb``:
    the job (its own limits, e.g. qualify's over-timeout delays)."""
    import torch

    from ffnq.runner import BACKENDS, load_runner

    spec = load_model(opts.model)
    try:
        experts = Experts(opts.experts)
    except ValueError:
        raise UsageError(f"--experts {opts.experts!r}: allowed {', '.join(e.value for e in Experts)}") from None
    if not 1 <= opts.tp <= MAX_TP:
        raise UsageError(f"--tp {opts.tp}: allowed 1..{MAX_TP}")
    spec.check(opts.tp, experts)
    if not 0 <= opts.seed < 2 ** 63:
        raise UsageError(f"--seed {opts.seed}: allowed 0..2^63-1")
    if not opts.widths:
        opts.widths = list(range(1, spec.max_tokens + 1))
    bad = [w for w in opts.widths if not 1 <= w <= spec.max_tokens]
    if bad:
        raise UsageError(f"widths {bad}: allowed 1..{spec.max_tokens} for {spec.name}")
    if opts.checkpoint is not None:
        from ffnq.weights import check_checkpoint

        opts.checkpoint = str(Path(opts.checkpoint).absolute())  # the ranks may start elsewhere
        opts.checkpoint_layer = check_checkpoint(opts.checkpoint, opts.checkpoint_layer, spec)
    elif opts.checkpoint_layer is not None:
        raise UsageError(f"--checkpoint-layer {opts.checkpoint_layer}: needs --checkpoint PATH "
                         "(the synthetic weights have no layers)")
    if not opts.timeout_s > 0:
        raise UsageError(f"--timeout {opts.timeout_s}: must be > 0 (seconds)")
    if not MIN_TIMEOUT_S <= opts.timeout_s <= MAX_TIMEOUT_S:
        raise UsageError(f"--timeout {opts.timeout_s:g}: allowed {MIN_TIMEOUT_S:g}..{MAX_TIMEOUT_S:g} s")
    if opts.deadline_s is not None and not (opts.deadline_s > 0 and math.isfinite(opts.deadline_s)):
        raise UsageError(f"--deadline {opts.deadline_s}: must be > 0 and finite (seconds)")
    bad = [r for r in opts.inject_ranks if not 0 <= r < opts.tp]
    if bad:
        raise UsageError(f"--inject-rank {bad[0]}: allowed 0..{opts.tp - 1} or all (tp={opts.tp})")
    if (opts.inject_ranks or (verb == "qualify" and opts.tp > 1)) and \
            over_delay_ns(opts.timeout_s) <= 1.5 * opts.timeout_s * 1e9:
        # qualify's stale-epoch cases delay the last rank past the timeout at every tp > 1
        raise UsageError(f"--timeout {opts.timeout_s:g}: qualify's cases over the timeout need a delay above 1.5 x "
                         f"timeout in int32 ns (< {MAX_INJECT_NS / 1e9:.2f} s); use --timeout <= 1.4")
    if not (0 < opts.rep_ms <= MAX_REP_MS and 0 <= opts.warmup_ms <= MAX_WARMUP_MS):
        raise UsageError(f"--rep-ms {opts.rep_ms:g} / --warmup-ms {opts.warmup_ms:g}: allowed 0 < rep <= "
                         f"{MAX_REP_MS:g} and 0 <= warmup <= {MAX_WARMUP_MS:g} (ms)")
    if not 0 <= opts.burst_ms <= MAX_WINDOW_MS or not 0 <= opts.idle_ms <= MAX_WINDOW_MS:
        raise UsageError(f"--burst-ms {opts.burst_ms:g} / --idle-ms {opts.idle_ms:g}: allowed 0..{MAX_WINDOW_MS} ms "
                         "each (--burst-ms 0: one timed window)")
    bad = [b for b in opts.baselines if b not in BASELINES]
    if bad:
        raise UsageError(f"--baselines {bad[0]!r}: allowed auto, none, or a list of {', '.join(BASELINES)}")
    if "vllm" in opts.baselines:
        if opts.backend not in GPU_BACKENDS:
            raise UsageError("--baselines vllm: needs a GPU backend (vLLM's fused_moe is a Triton GPU kernel)")
        from ffnq.baselines.vllm import kernel_path

        kernel_path()  # a one-line error before any rank starts when the fetched copy is missing
    for b in ("stock", "stock-symm"):
        if b in opts.baselines and (opts.tp < 2 or opts.backend not in GPU_BACKENDS):
            raise UsageError(f"--baselines {b}: needs a GPU backend and --tp >= 2 (symmetric memory)")
    if any(b.startswith("stock") or b == "vllm" for b in opts.baselines) and opts.experts == "none":
        raise UsageError("--baselines stock*/vllm: the composition needs --experts all or local")
    for name in ("kill_rank", "hang_rank"):
        r = getattr(opts, name)
        if r is not None and not 0 <= r < opts.tp:
            raise UsageError(f"--{name.replace('_', '-')} {r}: allowed 0..{opts.tp - 1} (tp={opts.tp})")
    if (opts.kill_rank is not None or opts.hang_rank is not None) and opts.at_step is None:
        raise UsageError("--kill-rank/--hang-rank need --at-step K")
    if opts.kill_rank is not None and opts.hang_rank is not None:
        raise UsageError(f"--kill-rank {opts.kill_rank} and --hang-rank {opts.hang_rank}: allowed one fault per soak")
    if opts.at_step is not None and opts.kill_rank is None and opts.hang_rank is None:
        raise UsageError(f"--at-step {opts.at_step}: needs --kill-rank or --hang-rank (the fault it places)")
    if opts.at_step is not None and not 0 <= opts.at_step < opts.steps:
        raise UsageError(f"--at-step {opts.at_step}: allowed 0..{opts.steps - 1} (--steps {opts.steps})")
    if not (1 <= opts.steps <= MAX_STEPS and 1 <= opts.runners <= MAX_RUNNERS):
        raise UsageError(f"--steps {opts.steps} / --runners {opts.runners}: allowed 1..{MAX_STEPS} / 1..{MAX_RUNNERS}")
    if not 1 <= opts.layers <= MAX_LAYERS:
        raise UsageError(f"--layers {opts.layers}: allowed 1..{MAX_LAYERS}")
    if opts.nnodes < 1 or opts.tp % opts.nnodes:
        raise UsageError(f"--nnodes {opts.nnodes}: must be >= 1 and divide --tp {opts.tp}")
    if opts.nnodes > 1 and not opts.rdzv_endpoint:
        raise UsageError(f"--nnodes {opts.nnodes}: needs --rdzv-endpoint HOST:PORT")
    if opts.rdzv_endpoint is not None:
        m = RDZV.fullmatch(opts.rdzv_endpoint)
        if not (m and 1 <= int(m[1]) <= 65535):
            raise UsageError(f"--rdzv-endpoint {opts.rdzv_endpoint!r}: need HOST:PORT, port 1..65535")
    if opts.backend not in BACKENDS and ":" not in opts.backend:
        raise UsageError(f"--backend {opts.backend!r}: allowed auto, {', '.join(BACKENDS)} "
                         f"(or --runner package.module:Class)")
    if opts.backend == "triton":  # a bad override or measured table fails here, not in every rank's build
        from ffnq.backends.triton.geometry import measured_table
        from ffnq.backends.triton.tune import read as read_tune

        try:
            read_tune()
            measured_table()
        except ValueError as e:
            raise UsageError(str(e)) from None
    per_node = opts.tp // opts.nnodes
    interp = opts.backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    if interp and per_node != 1:
        raise UsageError(f"--tp {opts.tp}: TRITON_INTERPRET=1 (triton on the cpu) runs one rank only")
    if opts.backend in GPU_BACKENDS and not interp:
        if not torch.cuda.is_available():
            raise UsageError(f"--backend {opts.backend}: needs a GPU and this host has none (use --backend cpu)")
        if per_node > torch.cuda.device_count():
            raise UsageError(f"--tp {opts.tp}: {per_node} ranks on this host but only "
                             f"{torch.cuda.device_count()} GPU(s)")
    cls = load_runner(opts.backend)
    if opts.backend not in GPU_BACKENDS:  # a plug-in: ask it where rank 0 would run
        try:
            dev = torch.device(cls.default_device(0))
        except Exception as e:  # noqa: BLE001 - a plug-in's own failure is bad input here
            raise UsageError(f"--runner {opts.backend}: default_device failed ({e})") from None
        if dev.type == "cuda" and (not torch.cuda.is_available() or per_node > torch.cuda.device_count()):
            raise UsageError(f"--runner {opts.backend}: runs on cuda; {per_node} ranks here but "
                             f"{torch.cuda.device_count()} GPU(s)")
    return opts


def under_delay_ns(timeout_s: float) -> int:
    return int(0.3 * timeout_s * 1e9)


def over_delay_ns(timeout_s: float) -> int:
    return min(int(2.5 * timeout_s * 1e9), MAX_INJECT_NS)


def deadline_for(job: str, opts: JobOptions) -> float:
    """Seconds the whole job may take: setup plus a generous bound on its own work."""
    if opts.deadline_s:
        return opts.deadline_s
    w, t = len(opts.widths), opts.timeout_s
    if job == "qualify":
        injected = len(opts.inject_ranks) + (1 if opts.tp > 1 else 0)
        work = 2 * w * 3.0 + 40 + injected * (3 * t + 2 * over_delay_ns(t) / 1e9 + 10)
    elif job == "soak":  # a last resort: the kernel's bounded waits end a faulted soak first
        work = 60 + opts.steps * 0.1 + 5 * t
    elif job == "bench":
        variants = 1 + (max(len(opts.baselines), 3) if opts.baseline else 0)
        bursts = math.ceil(opts.rep_ms / opts.burst_ms) if opts.burst_ms else 0
        per = (opts.rep_ms + opts.warmup_ms + bursts * opts.idle_ms) / 1e3 * variants + 3.0 * opts.layers
        if opts.backend in GPU_BACKENDS:  # each further weight set's check (an oracle step and the launches)
            from ffnq.jobs.bench import ROTATE_SETS_GPU

            per += (ROTATE_SETS_GPU - 1) * (1.0 + 0.1 * opts.layers)
        work = w * per * 3
    else:
        work = 30 + 10 * w
    return SETUP_S + work + checkpoint_load_s(job, opts)


CHECKPOINT_READ_GBPS = 0.5  # a slow disk's read rate, for the deadline's share of a checkpoint's reads


def checkpoint_load_s(job: str, opts: JobOptions) -> float:
    """The deadline's allowance for reading --checkpoint: every rank of a node reads its layer
    (bench on a GPU: four layers, its weight sets) from one disk."""
    if not opts.checkpoint:
        return 0.0
    from ffnq.jobs.bench import ROTATE_SETS_GPU

    spec = load_model(opts.model)
    layer_gb = spec.experts * 3 * spec.intermediate * spec.hidden / 1e9
    sets = ROTATE_SETS_GPU if job == "bench" and opts.backend in GPU_BACKENDS else 1
    return 30 + opts.tp // opts.nnodes * sets * layer_gb / CHECKPOINT_READ_GBPS


def torchrun_command(job: str, opts: JobOptions, opts_file: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if opts.nnodes > 1 or opts.rdzv_endpoint:
        cmd += ["--nnodes", str(opts.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", opts.rdzv_endpoint or ""]
    else:
        cmd += ["--standalone"]
    cmd += ["--nproc-per-node", str(opts.tp // opts.nnodes), "-m", f"ffnq.jobs.{job}", str(opts_file)]
    return cmd


def job_env(tag: str) -> dict:
    env = dict(os.environ)
    env.update(FFNQ_TAG=tag, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1")
    return env


@dataclass
class JobResult:
    tables: dict[str, pd.DataFrame]
    command: list[str]
    wall_s: float
    tag: str
    records: list[dict] = field(default_factory=list)  # every rank's rows (merged), as written


def read_records(result_dir: Path) -> list[dict]:
    recs = []
    for f in sorted(result_dir.glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a torn last line of a killed rank
    return recs


def run(job: str, opts: JobOptions, progress: bool = True) -> JobResult:
    """Run ``python -m ffnq.jobs.<job>`` on every rank; tables of rows by name."""
    from ffnq.dist import sweep

    deadline = deadline_for(job, opts)
    tag = "j" + secrets.token_hex(4)
    with tempfile.TemporaryDirectory(prefix="ffnq-job-") as tmp:
        result_dir = Path(tmp)
        opts_file = result_dir / "options.json"
        opts_file.write_text(json.dumps({"job": job, "result_dir": str(result_dir), **opts.to_json()}))
        cmd = torchrun_command(job, opts, opts_file)
        log = (result_dir / "torchrun.log").open("w")
        t0 = time.monotonic()
        with _terminated_as_exit():
            proc = subprocess.Popen(cmd, env=job_env(tag), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_die_with_parent())
            try:
                rc = _wait(proc, result_dir, t0 + deadline, job, progress)
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
                log.close()
                sweep(tag)
        wall = time.monotonic() - t0
        recs = read_records(result_dir)
        if rc is None:
            raise LaunchError(f"{job} passed its deadline of {deadline:g} s (--deadline): "
                              f"{_unfinished(recs, opts.tp)}; the job was killed", recs)
        if rc != 0:
            raise LaunchError(_failure(job, rc, recs, opts.tp, (result_dir / "torchrun.log").read_text()), recs)
        merged = result_dir / "all.jsonl"
        if merged.exists():
            recs = [json.loads(line) for line in merged.read_text().splitlines() if line.strip()]
        rows: dict[str, list] = {}
        for r in recs:
            if r.get("kind") == "row":
                rows.setdefault(r["table"], []).append(r["data"])
        return JobResult({k: pd.DataFrame(v) for k, v in rows.items()}, cmd, wall, tag, recs)


def _die_with_parent():
    """The preexec_fn that makes torchrun take SIGTERM when ffnq dies, even by SIGKILL, which no
    handler sees (torchrun then ends its ranks); None off Linux. libc is looked up here, in the
    parent: between fork and exec the child only calls it (an import there can deadlock). The
    signal follows the forking thread's exit, so only the main thread arms it."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    prctl, parent, term = ctypes.CDLL(None, use_errno=True).prctl, os.getpid(), int(signal.SIGTERM)

    def arm() -> None:
        prctl(1, term)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # ffnq died before the call: nobody would signal
            os._exit(1)
    return arm


@contextmanager
def _terminated_as_exit():
    """SIGTERM and SIGHUP end this process through Stopped (SystemExit(128 + signal)) while a job
    runs, so run's ``finally`` kills the ranks: they run in a session of their own (no terminal
    signal reaches them), and the default action would end ffnq at once and leave them running (a
    CI job cancelled, ``timeout`` around ffnq). Only the main thread can take signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def end(sig, frame):
        raise Stopped(sig)

    old = {s: signal.signal(s, end) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _wait(proc, result_dir: Path, end: float, job: str, progress: bool) -> int | None:
    """Poll the job and rank 0's progress until it exits (rc) or the deadline (None)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TextColumn("{task.fields[what]}"), TimeElapsedColumn(), console=console, transient=True,
                   disable=not (progress and console.is_terminal))
    rank0 = result_dir / "rank0.jsonl"
    with bar:
        task = bar.add_task(f"{job}: starting ranks", total=None, what="")
        seen = 0
        while True:
            try:
                return proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > end:
                _kill_group(proc)
                return None
            if rank0.exists():
                lines = rank0.read_text().splitlines()
                for line in lines[seen:]:
                    try:
                        r = json.loads(line)
                    except json.JSONDecodeError:
                        break
                    seen += 1
                    if r.get("kind") == "progress":
                        bar.update(task, description=job, completed=r["done"], total=r["total"], what=r.get("what", ""))


def _kill_group(proc) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _last(recs: list[dict], tp: int) -> dict[int, dict]:
    """The last record of each rank."""
    last: dict[int, dict] = {}
    for r in recs:
        if "rank" in r:
            last[r["rank"]] = r
    return last


def _unfinished(recs: list[dict], tp: int) -> str:
    last = _last(recs, tp)
    waiting = [r for r in range(tp) if last.get(r, {}).get("kind") != "done"]
    where = ", ".join(f"rank {r} at {_where(last.get(r))}" for r in waiting)
    return f"rank(s) {', '.join(map(str, waiting))} had not finished ({where})"


def _where(rec: dict | None) -> str:
    if rec is None:
        return "start-up"
    if rec.get("kind") == "start":
        return "set-up (process group, peer buffers, weights)"
    if rec.get("kind") == "progress":
        return f"{rec.get('what') or 'step'} ({rec['done']}/{rec['total']})"
    return rec.get("kind", "?")


def _failure(job: str, rc: int, recs: list[dict], tp: int, log: str) -> str:
    errors = [r for r in recs if r.get("kind") == "error"]
    if errors:
        first = min(errors, key=lambda r: r.get("t", 0))
        return f"{job}: rank {first['rank']} failed: {first['message']}"
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", log, re.S)
    if m:
        code = int(m[2])
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return f"{job}: rank {m[1]} died ({how}); torchrun ended the others. {_unfinished(recs, tp)}"
    tail = " | ".join(log.strip().splitlines()[-3:])
    return f"{job}: torchrun exited {rc}; {_unfinished(recs, tp)}; log: {tail}"


def command_line(cmd: list[str]) -> str:
    return shlex.join(cmd)
