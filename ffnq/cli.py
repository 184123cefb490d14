"""The ``ffnq`` command: the typer verbs and their flags, nothing else.

Each verb hands its values to ``ffnq.verbs`` (validate every value before anything starts: bad
input is one line on stderr, exit 2, nothing written; then launch, tables, a report folder).
Exit 0 pass, 1 a case/threshold failed or a rank died, 2 bad input or a job that could not run.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand, TyperGroup

try:  # typer >= 0.20 vendors click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click import ClickException

from ffnq.errors import Stopped, UsageError

# Nothing heavier than typer is imported before a verb's body runs: `ffnq --help` and a flag typer
# refuses (`ffnq qualify --bad`) answer without torch, pandas or matplotlib.

# ---- options shared by the verbs, defined once ------------------------------------------------------
JOB, OUT = "Job", "Output"
Backend = Annotated[str, typer.Option(help="auto (triton where a GPU is, else cpu), cpu, triton or flydsl",
                                      rich_help_panel=JOB)]
RunnerPath = Annotated[Optional[str], typer.Option("--runner", help="a plug-in runner package.module:Class "
                                                   "(replaces --backend)", rich_help_panel=JOB)]
Model = Annotated[str, typer.Option(help="a name in configs/models (tiny, minimax-m2) or a TOML path",
                                    rich_help_panel=JOB)]
Tp = Annotated[int, typer.Option("--tp", help="ranks (tensor-parallel degree)", rich_help_panel=JOB)]
ExpertsOpt = Annotated[str, typer.Option("--experts", help="all (intermediate sharded over TP), local "
                                         "(expert parallel) or none (seam + router + reduce only)",
                                         rich_help_panel=JOB)]
Widths = Annotated[str, typer.Option(help="row counts: lists and ranges, e.g. 1-4,8,16; all = 1..max_tokens",
                                     rich_help_panel=JOB)]
Timeout = Annotated[float, typer.Option("--timeout", help="the kernel's bound on every wait (seconds)",
                                        rich_help_panel=JOB)]
Seed = Annotated[Optional[int], typer.Option(help="seed of the synthetic weights (none with --checkpoint) and the "
                                             "inputs; default: a fresh one each run, shown in the title and saved "
                                             "in the report", rich_help_panel=JOB)]
BenchSeed = Annotated[Optional[int], typer.Option(
    "--seed", help="seed of the synthetic weights (none with --checkpoint) and the inputs, so of the routing and "
    "the experts a step reads; default 0, fixed so that two runs (compare, gate) time one workload",
    rich_help_panel=JOB)]
Checkpoint = Annotated[Optional[Path], typer.Option(
    "--checkpoint", help="a MiniMax-M2 safetensors checkpoint (folder or file): its --checkpoint-layer's weights "
    "in place of the synthetic ones (bench on a GPU: that layer and the next three)", rich_help_panel=JOB)]
CheckpointLayer = Annotated[Optional[int], typer.Option("--checkpoint-layer", help="the checkpoint's decoder layer "
                                                        "(default: the first it holds)", rich_help_panel=JOB)]
Deadline = Annotated[Optional[float], typer.Option("--deadline", help="the whole job's bound (seconds); "
                                                   "default: derived from the work", rich_help_panel=JOB)]
Nnodes = Annotated[int, typer.Option(help="torchrun --nnodes (ranks per node = tp / nnodes)",
                                     rich_help_panel="Launch")]
Rdzv = Annotated[Optional[str], typer.Option("--rdzv-endpoint", help="torchrun --rdzv-endpoint HOST:PORT "
                                             "(default: --standalone)", rich_help_panel="Launch")]


def _writable(out: str) -> Path:
    """--out, checked before any job runs: a folder, or one that can be made in a writable one.
    Typed as text here: an empty --out would otherwise arrive as Path('.') and write into the
    working directory without a word."""
    import errno
    import tempfile

    if not out.strip():
        raise typer.BadParameter(f"{out!r}: empty; give a folder for the reports, e.g. --out reports")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise typer.BadParameter(f"{out!r} exists and is not a folder; give a folder, e.g. --out reports")
    up = path.absolute()
    while not up.exists():
        up = up.parent
    try:  # a real probe, removed at once (os.access says yes to root anywhere, /proc included)
        Path(tempfile.mkdtemp(prefix=".ffnq-probe-", dir=up)).rmdir()
    except OSError as e:
        # a pseudo file system (/proc, /sys) answers "No such file or directory" to a mkdir: say
        # what that means here rather than repeat it
        why = "no folder can be made there" if e.errno == errno.ENOENT else (e.strerror or str(e)).lower()
        raise typer.BadParameter(f"{out!r}: cannot write reports under {up} ({why}); give a folder you can "
                                 "write, e.g. --out reports") from None
    return path


Out = Annotated[str, typer.Option("--out", metavar="DIR", help="the reports folder", callback=_writable, rich_help_panel=OUT)]
Json = Annotated[bool, typer.Option("--json", help="tables as JSON lines on stdout", rich_help_panel=OUT)]


def _flags_without_metavar(params: list) -> list:
    """An on/off flag (--json, --help) takes no value: no `<bool>` beside it in the help."""
    for p in params:
        if getattr(p, "is_bool_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


class Command(TyperCommand):
    def get_params(self, ctx):
        return _flags_without_metavar(super().get_params(ctx))


class Group(TyperGroup):
    def get_params(self, ctx):
        return _flags_without_metavar(super().get_params(ctx))


class App(typer.Typer):
    """typer, with click's own usage errors (e.g. --tp abc) cut to one line, exit 2."""

    def command(self, *args, **kwargs):
        kwargs.setdefault("cls", Command)
        return super().command(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        try:
            rc = typer.main.get_command(self).main(*args, standalone_mode=False, **kwargs)
        except typer.Abort:
            _err("aborted")
            sys.exit(130)
        except ClickException as e:
            if type(e).__name__ != "NoArgsIsHelpError":
                _err(e.format_message().splitlines()[0])
            sys.exit(e.exit_code)
        except Stopped as e:  # SIGTERM / SIGHUP during a job (launch)
            _err(e.message)
            raise
        if rc == 130:  # typer's answer to KeyboardInterrupt (Ctrl-C), the ranks ended by launch's finally
            _err("interrupted (SIGINT): the job's ranks were ended")
        sys.exit(rc or 0)


app = App(name="ffnq", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, cls=Group,
          help="Qualify and benchmark a fused, persistent decode FFN kernel (MiniMax-M2 MoE) under "
               "tensor parallelism.")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("ffnq")
        except PackageNotFoundError:  # run from a source tree that was never installed
            v = "unknown (not installed: pip install -e .)"
        typer.echo(f"ffnq {v}")
        raise typer.Exit(0)


@app.callback()
def main(version: Annotated[bool, typer.Option("--version", help="print ffnq's version and exit",
                                               callback=_version, is_eager=True)] = False) -> None:
    pass


def _err(msg: str) -> None:
    """One red line on stderr (as report.error_line, without importing report's pandas)."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)


def _guard(fn):
    """Run a verb body: UsageError -> exit 2, LaunchError -> exit 1 (one line, no traceback)."""
    try:
        return fn()
    except UsageError as e:
        _err(str(e))
        raise typer.Exit(2)
    except Exception as e:
        launch = sys.modules.get("ffnq.launch")  # only a launched job raises it: never imported before
        if launch is not None and isinstance(e, launch.LaunchError):
            _err(str(e))
            raise typer.Exit(1)
        raise


def _run(verb: str, values: dict, out: Path, json_out: bool, judge) -> None:
    """A job verb's body: options from the flags, the verb's host side, an exit code from its table."""
    def body():
        from ffnq import verbs

        opts = verbs.job_options(verb, **values)
        return judge(*getattr(verbs, f"run_{verb}")(opts, out, json_out))

    raise typer.Exit(_guard(body))


@app.command()
def qualify(
    backend: Backend = "auto", runner: RunnerPath = None, model: Model = "tiny", tp: Tp = 2,
    experts: ExpertsOpt = "all", widths: Widths = "all", timeout: Timeout = 1.0, seed: Seed = None,
    checkpoint: Checkpoint = None, checkpoint_layer: CheckpointLayer = None,
    inject_rank: Annotated[Optional[list[str]], typer.Option(
        "--inject-rank", metavar="RANK|all", help="delay this rank under and over the timeout (repeatable, or all)",
        rich_help_panel=JOB)] = None,
    deadline: Deadline = None, nnodes: Nnodes = 1, rdzv_endpoint: Rdzv = None, out: Out = "reports",
    json_out: Json = False,
):
    """Correctness against the fp64 reference, padding, epochs, injected faults and recovery.

    One row per case (PASS/FAIL with the evidence); exit 1 when any case fails.
    """
    values = dict(locals())
    _run("qualify", _job_values(values), out, json_out, lambda cases, _: int((cases.status != "PASS").any()))


@app.command()
def bench(
    backend: Backend = "auto", runner: RunnerPath = None, model: Model = "tiny", tp: Tp = 2,
    experts: ExpertsOpt = "all", widths: Widths = "1,2,4,8,16", timeout: Timeout = 1.0, seed: BenchSeed = None,
    checkpoint: Checkpoint = None, checkpoint_layer: CheckpointLayer = None,
    layers: Annotated[int, typer.Option(help="launches per step, final=True on the last", rich_help_panel=JOB)] = 1,
    rep_ms: Annotated[float, typer.Option("--rep-ms", help="timed budget per width and variant (ms)",
                                          rich_help_panel=JOB)] = 1000.0,
    warmup_ms: Annotated[float, typer.Option("--warmup-ms", help="warm-up budget per width and variant (ms)",
                                             rich_help_panel=JOB)] = 200.0,
    burst_ms: Annotated[float, typer.Option("--burst-ms", help="on a GPU, time in bursts this long, each after "
                                            "--idle-ms idle, so that no window reaches the GPU's power cap "
                                            "(0: one window)", rich_help_panel=JOB)] = 250.0,
    idle_ms: Annotated[float, typer.Option("--idle-ms", help="GPU idle before each timed burst (ms)",
                                           rich_help_panel=JOB)] = 250.0,
    baselines: Annotated[str, typer.Option(help="auto (cpu: unfused; GPU: unfused = a plain PyTorch composition "
                                           "with NCCL and, at tp > 1, stock = the same with the symm-mem "
                                           "one-shot all-reduce), none, or a list of unfused, stock, "
                                           "stock-nccl, stock-symm, vllm (vLLM's own decode step: its "
                                           "fused_moe kernel, quant and tuned config, symm-mem one-shot "
                                           "all-reduces; FFNQ_VLLM_DIR: the folder tools/extract_vllm.py writes), vllm-nccl",
                                           rich_help_panel=JOB)] = "auto",
    routing: Annotated[str, typer.Option(help="the synthetic router: uniform (the experts a width touches as "
                                         "under independent uniform routing, as decode traffic: 8 / 15.8 / 30.5 "
                                         "/ 57.2 / 101.9 of 256 at 1 / 2 / 4 / 8 / 16 rows) or skewed (a wide "
                                         "bias: ~67 at 16 rows)", rich_help_panel=JOB)] = "uniform",
    phase_split: Annotated[bool, typer.Option("--phase-split", help="also time the kernel with --experts none: "
                                              "none_p50_us (seam + router + reduce) and experts_us = p50 - that",
                                              rich_help_panel=JOB)] = False,
    phases: Annotated[bool, typer.Option("--phases", help="also a timeline build of the kernel per width: when "
                                         "the median and the latest CTA pass each phase boundary (us), over "
                                         "eager steps", rich_help_panel=JOB)] = False,
    deadline: Deadline = None, nnodes: Nnodes = 1, rdzv_endpoint: Rdzv = None, out: Out = "reports",
    json_out: Json = False,
):
    """Per-width latency (p50/p90/p99 us), per-rank skew, the baselines and (on a GPU) the floor."""
    values = dict(locals())
    _run("bench", _job_values(values), out, json_out, lambda lat, _: int((lat.check != "OK").any()))


@app.command()
def soak(
    backend: Backend = "auto", runner: RunnerPath = None, model: Model = "tiny", tp: Tp = 2,
    experts: ExpertsOpt = "all", widths: Widths = "all", timeout: Timeout = 1.0, seed: Seed = None,
    checkpoint: Checkpoint = None, checkpoint_layer: CheckpointLayer = None,
    steps: Annotated[int, typer.Option(help="random steps to run, every one checked", rich_help_panel=JOB)] = 1000,
    random_padding: Annotated[bool, typer.Option("--random-padding/--no-random-padding",
                                                 help="random padding rows every step", rich_help_panel=JOB)] = True,
    runners: Annotated[int, typer.Option(help="runners sharing one peer buffer and epoch", rich_help_panel=JOB)] = 2,
    check_every: Annotated[Optional[int], typer.Option(help="steps per reference check (default: every step on "
                                                       "cpu, 1 in 100 on a GPU; checksums every step)",
                                                       rich_help_panel=JOB)] = None,
    kill_rank: Annotated[Optional[int], typer.Option(help="chaos: this rank SIGKILLs itself at --at-step",
                                                     rich_help_panel=JOB)] = None,
    hang_rank: Annotated[Optional[int], typer.Option(help="chaos: this rank stops arriving at --at-step",
                                                     rich_help_panel=JOB)] = None,
    at_step: Annotated[Optional[int], typer.Option(help="the step of --kill-rank/--hang-rank",
                                                   rich_help_panel=JOB)] = None,
    deadline: Deadline = None, nnodes: Nnodes = 1, rdzv_endpoint: Rdzv = None, out: Out = "reports",
    json_out: Json = False,
):
    """Many random steps (width, padding, final, runner), every one checked; optional chaos.

    Exit 1 on any mismatch, stale match, fault or dead rank (named), 0 otherwise.
    """
    values = dict(locals())

    def judge(table, _):
        return 1 if table.attrs["error"] or not len(table) or table.mismatches.sum() or table.stale.sum() else 0

    _run("soak", _job_values(values), out, json_out, judge)


@app.command()
def compare(
    base: Annotated[Path, typer.Argument(help="the saved run to compare against (report folder or its results.json)")],
    new: Annotated[Path, typer.Argument(help="the run under judgement")],
    out: Out = "reports", json_out: Json = False,
):
    """Per width p50/p99 deltas against each run's noise band; changed cases and residency.

    Exit 0: informational (`ffnq gate` judges)."""
    from ffnq import verbs

    raise typer.Exit(_guard(lambda: verbs.run_compare(base, new, out, json_out)))


@app.command()
def warm(
    backend: Backend = "auto", runner: RunnerPath = None, model: Model = "tiny", tp: Tp = 2,
    experts: ExpertsOpt = "all", widths: Widths = "all", timeout: Timeout = 1.0, seed: Seed = None,
    checkpoint: Checkpoint = None, checkpoint_layer: CheckpointLayer = None,
    target: Annotated[Optional[str], typer.Option(help="offline residency for sm_90, gfx942 or gfx950 "
                                                  "(no GPU needed)", rich_help_panel=JOB)] = None,
    deadline: Deadline = None, nnodes: Nnodes = 1, rdzv_endpoint: Rdzv = None, out: Out = "reports",
    json_out: Json = False,
):
    """Compile every width: kernel, compile_s, resources, CTAs per CU, grid, resident."""
    values = _job_values(dict(locals()))
    values.pop("target")

    def judge(table, _):
        return 1 if "resident" in table and (table.resident.astype(str) == "no").any() else 0

    if target is None:
        _run("warm", values, out, json_out, judge)

    def offline():
        from ffnq import verbs

        launch_only = {"--timeout": timeout != 1.0, "--seed": seed is not None, "--deadline": deadline is not None,
                       "--checkpoint": checkpoint is not None, "--checkpoint-layer": checkpoint_layer is not None,
                       "--nnodes": nnodes != 1, "--rdzv-endpoint": rdzv_endpoint is not None}
        given = [k for k, v in launch_only.items() if v]
        if given:
            raise UsageError(f"--target {target}: an offline compile launches no job; {', '.join(given)} "
                             "do not apply")
        return judge(*verbs.run_warm_offline(backend, runner, model, tp, experts, widths, target, out, json_out))

    raise typer.Exit(_guard(offline))


@app.command()
def gate(
    config: Annotated[str, typer.Argument(help="a gate config, e.g. configs/gates/cpu-tp2.toml")],
    out: Out = "reports", json_out: Json = False,
    rebase: Annotated[bool, typer.Option("--rebase", help="then take the config's p50 budgets (p50 + --margin) and "
                                         "\\[compare] bases from this run, if its correctness checks passed")] = False,
    margin: Annotated[Optional[float], typer.Option("--margin", help="--rebase's budget over each width's p50, "
                                                    "percent \\[default: 15]")] = None,
):
    """Run what a gate config names, compare with its thresholds, write junit.xml + summary.md.

    Exit 0 pass (or rebased), 1 fail (or not rebased: a correctness check failed), 2 could not run.
    """
    def body():
        from ffnq.gate import run_gate

        if margin is not None and not rebase:
            raise UsageError(f"--margin {margin:g}: a budget margin for --rebase; add --rebase or drop it")
        if margin is not None and not (math.isfinite(margin) and margin >= 0):
            raise UsageError(f"--margin {margin:g}: need a finite percentage >= 0")
        return run_gate(config, out, json_out, (15.0 if margin is None else margin) if rebase else None)

    try:
        rc = _guard(body)
    except typer.Exit as e:  # a job that could not run is exit 2 for a gate, not 1
        rc = 2 if e.exit_code else 0
    raise typer.Exit(rc)


@app.command()
def report(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="a report folder written by ffnq")],
    json_out: Json = False,
):
    """Print a saved run again."""
    from ffnq import verbs

    raise typer.Exit(_guard(lambda: verbs.show_report(directory, json_out)))


@app.command()
def info(json_out: Json = False):
    """What this host has: backends usable, GPUs, SMs/CUs, versions of torch, triton, flydsl."""
    from ffnq import verbs

    raise typer.Exit(verbs.show_info(json_out))


def _job_values(values: dict) -> dict:
    """A verb's flags as verbs.job_options takes them (out and --json are the verb's own)."""
    values = {k: v for k, v in values.items() if k not in ("out", "json_out")}
    if not values.get("inject_rank"):
        values.pop("inject_rank", None)
    return values


if __name__ == "__main__":
    app()
