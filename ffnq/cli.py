"""The ``ffnq`` command: warm, qualify, bench, gate, report, info.

Each verb builds JobOptions, validates every value before anything starts (bad input: one line
on stderr, exit 2, nothing written), runs its ranks through torchrun (ffnq.launch), shows the
tables and writes a report folder. Exit 0 pass, 1 a case/threshold failed or a rank died.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

try:  # typer >= 0.20 vendors click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click import ClickException

from ffnq.errors import Stopped, UsageError

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
# a bench's seed when none is given (`ffnq bench`, a gate's bench job): one workload, so two runs
# (compare, a gate's base) read the same experts; the checks (qualify, soak) draw a fresh one
BENCH_SEED = 0
BenchSeed = Annotated[int, typer.Option("--seed", help="seed of the synthetic weights (none with --checkpoint) and "
                                        "the inputs, so of the routing and the experts a step reads; fixed by "
                                        "default, so that two runs (compare, gate) time one workload",
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
def _writable(out: Path) -> Path:
    """--out, checked before any job runs: a folder, or one that can be made in a writable one."""
    import tempfile

    if out.exists() and not out.is_dir():
        raise typer.BadParameter(f"{str(out)!r} exists and is not a folder")
    up = out.absolute()
    while not up.exists():
        up = up.parent
    try:  # a real probe, removed at once (os.access says yes to root anywhere, /proc included)
        Path(tempfile.mkdtemp(prefix=".ffnq-probe-", dir=up)).rmdir()
    except OSError as e:
        raise typer.BadParameter(f"{str(out)!r}: cannot write there ({up}: {e.strerror})") from None
    return out


Out = Annotated[Path, typer.Option("--out", help="the reports folder", callback=_writable, rich_help_panel=OUT)]
Json = Annotated[bool, typer.Option("--json", help="tables as JSON lines on stdout", rich_help_panel=OUT)]


class App(typer.Typer):
    """typer, with click's own usage errors (e.g. --tp abc) cut to one line, exit 2."""

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
            _err(f"stopped by {e.name}: the job's ranks were ended")
            raise
        if rc == 130:  # typer's answer to KeyboardInterrupt (Ctrl-C), the ranks ended by launch's finally
            _err("interrupted (SIGINT): the job's ranks were ended")
        sys.exit(rc or 0)


app = App(name="ffnq", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
          help="Qualify and benchmark a fused, persistent decode FFN kernel (MiniMax-M2 MoE) under "
               "tensor parallelism.")


def _err(msg: str) -> None:
    from rich.markup import escape

    from ffnq.report import err_console

    # escaped: a value the user typed ("[/x]") is text, not markup
    err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)


def _guard(fn):
    """Run a verb body: UsageError -> exit 2, LaunchError -> exit 1 (one line, no traceback)."""
    from ffnq.launch import LaunchError

    try:
        return fn()
    except UsageError as e:
        _err(str(e))
        raise typer.Exit(2)
    except LaunchError as e:
        _err(str(e))
        raise typer.Exit(1)


def _options(backend, runner, model, tp, experts, widths, timeout, seed, nnodes, rdzv_endpoint, deadline,
             verb: str | None = None, checkpoint: Path | None = None, checkpoint_layer: int | None = None, **kw):
    from ffnq.launch import JobOptions, fresh_seed, parse_widths, resolve_backend, validate
    from ffnq.spec import load_model

    spec = load_model(model)
    opts = JobOptions(backend=runner or resolve_backend(backend), model=model, tp=tp, experts=experts,
                      widths=parse_widths(widths, spec.max_tokens), timeout_s=timeout,
                      seed=fresh_seed() if seed is None else seed, nnodes=nnodes,
                      rdzv_endpoint=rdzv_endpoint, deadline_s=deadline,
                      checkpoint=None if checkpoint is None else str(checkpoint),
                      checkpoint_layer=checkpoint_layer, **kw)
    return validate(opts, verb)


def _weights(opts) -> str:
    """The weights' source for a title: nothing for the synthetic ones (the seed says it)."""
    if not opts.checkpoint:
        return ""
    return f" checkpoint={Path(opts.checkpoint).name} checkpoint_layer={opts.checkpoint_layer}"


def parse_baselines(text: str) -> dict:
    """--baselines auto | none | a,b -> JobOptions fields."""
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    if names in ([], ["auto"]):
        return {"baseline": True, "baselines": []}
    if names == ["none"]:
        return {"baseline": False, "baselines": []}
    return {"baseline": True, "baselines": names}


def _meta(opts, result=None) -> dict:
    from ffnq.report import command_line, git_commit, machine_info

    return {"command": command_line(["ffnq", *sys.argv[1:]]), "machine": machine_info(), "git_commit": git_commit(),
            "config": opts.to_json() if hasattr(opts, "to_json") else opts,
            "torchrun": shlex.join(result.command) if result else None,
            "wall_s": round(result.wall_s, 2) if result else None}


def _saved(path, json_out) -> None:
    from ffnq.report import console, err_console

    (err_console if json_out else console).print(f"report: {path}", highlight=False, soft_wrap=True)


# ---- verbs --------------------------------------------------------------------------------------------

def run_qualify(opts, out: Path, json_out: bool):
    """Launch qualify, show its tables, write its report; (cases, report path)."""
    from ffnq import launch
    from ffnq.jobs.qualify import summarize
    from ffnq.report import handshake, show_table, write_report

    res = launch.run("qualify", opts, progress=not json_out)
    cases = summarize(res.tables["cases"])
    tl = res.tables.get("timeline")
    hs = handshake(tl[tl.case.str.startswith("inject-under")], opts.tp) if tl is not None else None
    failed = int((cases.status != "PASS").sum())
    verdict = f"{len(cases)} cases, {failed} failed: " + ("FAILED" if failed else "OK")
    cols = ["case", "width", "status", "rel_err", "wrong", "elements", "route_agree", "fault", "wall_ms", "evidence"]
    show_table(cases, json_out=json_out, columns=cols,
               title=f"qualify {opts.backend} tp{opts.tp} {opts.model}{_weights(opts)} experts={opts.experts} "
                     f"timeout={opts.timeout_s:g}s seed={opts.seed}")
    if hs is not None and not hs.empty:
        show_table(hs, json_out=json_out, title="handshake: arrival, wait and skew per rank and phase (us)")
    path = write_report(out, "qualify", opts.backend, opts.tp, cases, meta=_meta(opts, res), verdict=verdict,
                        tables={"handshake": hs, "clock": res.tables.get("clock")}, timeline=tl)
    _footer(verdict, json_out)
    _saved(path, json_out)
    return cases, path


def _bench_view(lat: "pandas.DataFrame", json_out: bool) -> tuple[list[str] | None, str | None]:
    """A bench table's columns and caption on the terminal: the latencies and their ratios; steps,
    clocks, touched experts, rel_err and each width's timing method stay in the report (and in
    --json, which gets every column)."""
    if json_out:
        return None, None
    rest = {"steps", "sm_mhz", "touched_experts", "rel_err", "timing"}
    how = None
    if "timing" in lat and lat.timing.notna().any():
        how = f"timing: {lat.timing.dropna().iloc[0]} (each width's in the report)"
    return [c for c in lat.columns if c not in rest], how


def run_bench(opts, out: Path, json_out: bool):
    """Launch bench, show its table, write its report; (per-width table, report path)."""
    from ffnq import launch
    from ffnq.jobs.bench import summarize
    from ffnq.report import show_table, write_report

    res = launch.run("bench", opts, progress=not json_out)
    lat = summarize(res.tables["latency"])
    bad = lat[lat.check != "OK"]
    verdict = f"{len(lat)} widths, {len(bad)} failed the check before timing: " + ("FAILED" if len(bad) else "OK")
    cols, how = _bench_view(lat, json_out)
    show_table(lat, json_out=json_out, columns=cols, caption=how,
               title=f"bench {opts.backend} tp{opts.tp} {opts.model}{_weights(opts)} experts={opts.experts} "
                     f"layers={opts.layers} seed={opts.seed} (us per step)")
    path = write_report(out, "bench", opts.backend, opts.tp, lat, meta=_meta(opts, res), verdict=verdict,
                        tables={"per_rank": res.tables["latency"]}, notes=capped_note(lat))
    _footer(verdict, json_out)
    _saved(path, json_out)
    return lat, path


def capped_note(lat) -> list[str]:
    """A line naming the widths timed partly under a clock cap (power or thermal), if any."""
    if "capped_pct" not in lat or not (lat.capped_pct > 0).any():
        return []
    hit = lat[lat.capped_pct > 0]
    return [f"Clock cap: at widths {', '.join(map(str, hit.width))} a power or thermal cap held the clocks down "
            f"during up to {hit.capped_pct.max():.0f}% of the timed windows (NVML; sm_mhz: the slowest rank's median SM "
            "clock), so their quantiles include lowered clocks; a shorter --burst-ms or a longer --idle-ms keeps "
            "the windows under it."]


def run_warm(opts, out: Path, json_out: bool):
    """Launch warm, show its table, write its report; (per-width table, report path)."""
    from ffnq import launch
    from ffnq.jobs.warm import summarize

    res = launch.run("warm", opts, progress=not json_out)
    table = summarize(res.tables["warm"])
    return table, _warm_report(table, opts.backend, opts.tp, opts.model + _weights(opts), None, opts, res, out,
                               json_out)


def _warm_report(table, be, tp, model, target, opts, res, out, json_out):
    from ffnq.report import show_table, write_report

    bad = table[table.resident.astype(str) == "no"] if "resident" in table else table.iloc[:0]
    verdict = f"{len(table)} widths, {len(bad)} not resident or not compiled: " + ("FAILED" if len(bad) else "OK")
    show_table(table, json_out=json_out, title=f"warm {be} tp{tp} {model}" + (f" target {target}" if target else ""))
    path = write_report(out, "warm", be + (f"-{target}" if target else ""), tp, table, meta=_meta(opts, res),
                        verdict=verdict)
    _footer(verdict, json_out)
    _saved(path, json_out)
    return path


@app.command()
def qualify(
    backend: Backend = "auto", runner: RunnerPath = None, model: Model = "tiny", tp: Tp = 2,
    experts: ExpertsOpt = "all", widths: Widths = "all", timeout: Timeout = 1.0, seed: Seed = None,
    checkpoint: Checkpoint = None, checkpoint_layer: CheckpointLayer = None,
    inject_rank: Annotated[Optional[list[str]], typer.Option(
        "--inject-rank", help="delay this rank under and over the timeout (repeatable, or all)",
        rich_help_panel=JOB)] = None,
    deadline: Deadline = None, nnodes: Nnodes = 1, rdzv_endpoint: Rdzv = None, out: Out = Path("reports"),
    json_out: Json = False,
):
    """Correctness against the fp64 reference, padding, epochs, injected faults and recovery.

    One row per case (PASS/FAIL with the evidence); exit 1 when any case fails.
    """
    def body():
        from ffnq import launch

        opts = _options(backend, runner, model, tp, experts, widths, timeout, seed, nnodes, rdzv_endpoint,
                        deadline, verb="qualify", checkpoint=checkpoint, checkpoint_layer=checkpoint_layer,
                        inject_ranks=launch.parse_inject(inject_rank, tp))
        cases, _ = run_qualify(opts, out, json_out)
        return 1 if (cases.status != "PASS").any() else 0

    rc = _guard(body)
    raise typer.Exit(rc)


@app.command()
def bench(
    backend: Backend = "auto", runner: RunnerPath = None, model: Model = "tiny", tp: Tp = 2,
    experts: ExpertsOpt = "all", widths: Widths = "1,2,4,8,16", timeout: Timeout = 1.0, seed: BenchSeed = BENCH_SEED,
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
    baselines: Annotated[str, typer.Option(help="auto (cpu: unfused; GPU: unfused = NCCL + torch._grouped_mm "
                                           "composition and, at tp > 1, stock = the same with the symm-mem "
                                           "one-shot all-reduce), none, or a list of unfused, stock, "
                                           "stock-nccl, stock-symm, vllm (the NCCL composition with vLLM's "
                                           "fused_moe kernel for the experts; FFNQ_VLLM_MOE names a fetched "
                                           "copy of it)",
                                           rich_help_panel=JOB)] = "auto",
    phase_split: Annotated[bool, typer.Option("--phase-split", help="also time the kernel with --experts none: "
                                              "none_p50_us (seam + router + reduce) and experts_us = p50 - that",
                                              rich_help_panel=JOB)] = False,
    deadline: Deadline = None, nnodes: Nnodes = 1, rdzv_endpoint: Rdzv = None, out: Out = Path("reports"),
    json_out: Json = False,
):
    """Per-width latency (p50/p90/p99 us), per-rank skew, the baselines and (on a GPU) the floor."""
    def body():
        opts = _options(backend, runner, model, tp, experts, widths, timeout, seed, nnodes, rdzv_endpoint,
                        deadline, checkpoint=checkpoint, checkpoint_layer=checkpoint_layer, layers=layers,
                        rep_ms=rep_ms, warmup_ms=warmup_ms, burst_ms=burst_ms, idle_ms=idle_ms, phase_split=phase_split,
                        **parse_baselines(baselines))
        lat, _ = run_bench(opts, out, json_out)
        return 1 if (lat.check != "OK").any() else 0

    raise typer.Exit(_guard(body))


def run_soak(opts, out: Path, json_out: bool):
    """Launch soak; on a fault or a dead rank still report every step that finished."""
    from ffnq import launch
    from ffnq.jobs.soak import summarize
    from ffnq.report import show_table, write_report

    error = None
    try:
        res = launch.run("soak", opts, progress=not json_out)
        recs, meta = res.records, _meta(opts, res)
    except launch.LaunchError as e:
        error, recs, meta = str(e), e.records, _meta(opts) | {"error": str(e)}
    table, bad = summarize(recs, opts.tp, error)
    n = int(table.mismatches.sum()) if len(table) else 0
    verdict = (f"{int(table.steps.min()) if len(table) else 0} steps, {n} mismatches, "
               f"{int(table.stale.sum()) if len(table) else 0} stale: "
               + ("FAILED" if error or n else "OK") + (f" ({error})" if error else ""))
    show_table(table, json_out=json_out, title=f"soak {opts.backend} tp{opts.tp} {opts.model}{_weights(opts)} "
               f"widths={','.join(map(str, opts.widths))} runners={opts.runners} seed={opts.seed}")
    path = write_report(out, "soak", opts.backend, opts.tp, table, meta=meta, verdict=verdict,
                        tables={"mismatches": bad})
    if error:
        _err(error)
    _footer(verdict, json_out)
    _saved(path, json_out)
    return table, error


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
    deadline: Deadline = None, nnodes: Nnodes = 1, rdzv_endpoint: Rdzv = None, out: Out = Path("reports"),
    json_out: Json = False,
):
    """Many random steps (width, padding, final, runner), every one checked; optional chaos.

    Exit 1 on any mismatch, stale match, fault or dead rank (named), 0 otherwise.
    """
    def body():
        if check_every is not None and check_every < 1:
            raise UsageError(f"--check-every {check_every}: must be >= 1")
        opts = _options(backend, runner, model, tp, experts, widths, timeout, seed, nnodes, rdzv_endpoint,
                        deadline, checkpoint=checkpoint, checkpoint_layer=checkpoint_layer, steps=steps,
                        random_padding=random_padding, runners=runners,
                        check_every=check_every, kill_rank=kill_rank, hang_rank=hang_rank, at_step=at_step)
        table, error = run_soak(opts, out, json_out)
        return 1 if error or not len(table) or table.mismatches.sum() or table.stale.sum() else 0

    raise typer.Exit(_guard(body))


@app.command()
def compare(
    base: Annotated[Path, typer.Argument(help="the saved run to compare against (report folder or its results.json)")],
    new: Annotated[Path, typer.Argument(help="the run under judgement")],
    out: Out = Path("reports"), json_out: Json = False,
):
    """Per width p50/p99 deltas against each run's noise band; changed cases and residency.

    Exit 0: informational (`ffnq gate` judges)."""
    def body():
        from ffnq import compare as cmp
        from ffnq.report import console, err_console, show_table, write_report

        b, n = cmp.load(base), cmp.load(new)
        table = cmp.compare(b, n)
        notes = [f"noise band: {cmp.__doc__.split('Verdict')[0].split('band built from')[1].strip()}"]
        keys = ("backend", "model", "tp", "experts", "layers")
        diff = {k: (b.get("config", {}).get(k), n.get("config", {}).get(k)) for k in keys
                if b.get("config", {}).get(k) != n.get("config", {}).get(k)}
        if diff:
            notes.append(f"the runs differ in {diff}: compare with care")
        gpus = table[(table.kind == "machine") & (table.verdict == "changed")]
        if len(gpus):
            notes.append(f"the runs ran on other GPU models ({gpus.base.iloc[0]} -> {gpus.new.iloc[0]}): their "
                         "latencies are the machines', not the kernel's")
        other = table[(table.kind == "weights") & (table.verdict == "changed")]
        if len(other):
            notes.append(f"the runs read other weights ({other.base.iloc[0]} -> {other.new.iloc[0]}): the workload "
                         "rows say whether their steps touched as many experts")
        verdict = f"{len(table)} rows: " + (cmp.counts(table) or "no change")
        show_table(table, json_out=json_out, title=f"compare {b['job']}: {Path(base).name} -> {Path(new).name}")
        # the plot is drawn inside the report's temp folder: one that fails leaves no half-written report
        plots = {"latency.png": lambda f: cmp.plot(b["tables"]["results"], n["tables"]["results"], f,
                                                   (Path(base).name, Path(new).name))} if b["job"] == "bench" else {}
        path = write_report(out, "compare", b.get("config", {}).get("backend", "x"), b.get("config", {}).get("tp", 0),
                            table, meta=_meta({"base": str(base), "new": str(new)}) | {"config": n.get("config", {})},
                            verdict=verdict, notes=notes, plots=plots)
        for line in notes:
            (err_console if json_out else console).print(f"# {line}", highlight=False, soft_wrap=True)
        _footer(verdict, json_out)
        _saved(path, json_out)
        return 0

    raise typer.Exit(_guard(body))


@app.command()
def warm(
    backend: Backend = "auto", runner: RunnerPath = None, model: Model = "tiny", tp: Tp = 2,
    experts: ExpertsOpt = "all", widths: Widths = "all", timeout: Timeout = 1.0, seed: Seed = None,
    checkpoint: Checkpoint = None, checkpoint_layer: CheckpointLayer = None,
    target: Annotated[Optional[str], typer.Option(help="offline residency for sm_90, gfx942 or gfx950 "
                                                  "(no GPU needed)", rich_help_panel=JOB)] = None,
    deadline: Deadline = None, nnodes: Nnodes = 1, rdzv_endpoint: Rdzv = None, out: Out = Path("reports"),
    json_out: Json = False,
):
    """Compile every width: kernel, compile_s, resources, CTAs per CU, grid, resident."""
    def body():
        from ffnq.jobs.warm import offline

        if target is not None:
            launch_only = {"--timeout": timeout != 1.0, "--seed": seed is not None, "--deadline": deadline is not None,
                           "--checkpoint": checkpoint is not None, "--checkpoint-layer": checkpoint_layer is not None,
                           "--nnodes": nnodes != 1, "--rdzv-endpoint": rdzv_endpoint is not None}
            given = [k for k, v in launch_only.items() if v]
            if given:
                raise UsageError(f"--target {target}: an offline compile launches no job; {', '.join(given)} "
                                 "do not apply")
            table, be = offline(backend, runner, model, tp, experts, widths, target)
            opts = {"backend": be, "model": model, "tp": tp, "experts": experts, "target": target}
            _warm_report(table, be, tp, model, target, opts, None, out, json_out)
        else:
            opts = _options(backend, runner, model, tp, experts, widths, timeout, seed, nnodes, rdzv_endpoint,
                            deadline, checkpoint=checkpoint, checkpoint_layer=checkpoint_layer)
            table, _ = run_warm(opts, out, json_out)
        return 1 if "resident" in table and (table.resident.astype(str) == "no").any() else 0

    raise typer.Exit(_guard(body))


@app.command()
def gate(
    config: Annotated[str, typer.Argument(help="a gate config, e.g. configs/gates/cpu-tp2.toml")],
    out: Out = Path("reports"), json_out: Json = False,
):
    """Run what a gate config names, compare with its thresholds, write junit.xml + summary.md.

    Exit 0 pass, 1 fail, 2 could not run.
    """
    from ffnq.gate import run_gate

    def body():
        return run_gate(config, out, json_out)

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
    def body():
        from ffnq.report import load_report, show_table

        doc = load_report(directory)
        t = doc["tables"]
        cols, how = _bench_view(t["results"], json_out) if doc["job"] == "bench" else (None, None)
        show_table(t["results"], json_out=json_out, columns=cols, caption=how,
                   title=f"{doc['job']}: {doc.get('command', '')}")
        for name, df in t.items():
            if name not in ("results", "per_rank", "clock") and not df.empty:
                show_table(df, json_out=json_out, title=name)
        _footer(doc.get("verdict", ""), json_out)
        return 0

    raise typer.Exit(_guard(body))


@app.command()
def info(json_out: Json = False):
    """What this host has: backends usable, GPUs, SMs/CUs, versions of torch, triton, flydsl."""
    import pandas as pd

    from ffnq.report import machine_info, show_table
    from ffnq.runner import BACKENDS, load_runner

    m = machine_info()
    rows = [{"item": k, "value": v} for k, v in m.items() if k != "gpus"]
    for i, g in enumerate(m["gpus"]):
        rows.append({"item": f"gpu {i}", "value": f"{g['name']}, {g['arch']}, {g['sms']} SMs/CUs, "
                                                  f"{g['memory_gib']} GiB"})
    for name in BACKENDS:
        try:
            load_runner(name)
            ok = "yes" if name == "cpu" or m["gpus"] else "importable, no GPU here"
        except UsageError as e:
            ok = f"no ({e})"
        rows.append({"item": f"backend {name}", "value": ok})
    show_table(pd.DataFrame(rows), json_out=json_out, title="ffnq info")


def _footer(verdict: str, json_out: bool) -> None:
    from ffnq.report import console, err_console

    (err_console if json_out else console).print(f"# {verdict}", highlight=False)


if __name__ == "__main__":
    app()
