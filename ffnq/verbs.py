"""Each verb's host side: options -> launch -> summarize -> tables and a report folder.

    cli (typer) --.
                   >-- verbs.job_options -> verbs.run_<job> -> launch.run -> ranks -> DataFrames -> report
    gate ---------'

``cli`` and ``gate`` both call these functions, so a gate's job is exactly the verb's run.
"""
from __future__ import annotations

import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from ffnq.errors import UsageError
from ffnq.options import JobOptions, fresh_seed, parse_baselines, parse_inject, parse_widths, resolve_backend
from ffnq.report import footer, saved, show_table, write_report

VERBS = ("warm", "qualify", "bench", "soak")


def options_class(verb: str) -> type[JobOptions]:
    """The options dataclass of a job; each lives with the job's rank code."""
    if verb == "warm":
        from ffnq.jobs.warm import WarmOptions as cls
    elif verb == "qualify":
        from ffnq.jobs.qualify import QualifyOptions as cls
    elif verb == "bench":
        from ffnq.jobs.bench import BenchOptions as cls
    elif verb == "soak":
        from ffnq.jobs.soak import SoakOptions as cls
    else:
        raise UsageError(f"verb {verb!r}: allowed {', '.join(VERBS)}")
    return cls


def job_options(verb: str, *, backend: str = "auto", runner: str | None = None, model: str = "tiny", tp: int = 2,
                experts: str = "all", widths: str | int | None = "all", timeout: float = 1.0,
                seed: int | None = None, deadline: float | None = None, nnodes: int = 1,
                rdzv_endpoint: str | None = None, checkpoint: str | Path | None = None,
                checkpoint_layer: int | None = None, inject_rank: list | str | int | None = None,
                baselines: str | None = None, **job_fields) -> JobOptions:
    """A verb's validated options from the values a user gave (flags or a gate config's keys);
    keys that the verb's job does not take are dropped (a gate's [options] serve every job)."""
    from dataclasses import fields

    from ffnq.spec import load_model

    cls = options_class(verb)
    spec = load_model(model)
    names = {f.name for f in fields(cls)}
    kw = {k: v for k, v in job_fields.items() if k in names}
    if "inject_ranks" in names:
        kw["inject_ranks"] = parse_inject(inject_rank if isinstance(inject_rank, list) else
                                          [] if inject_rank is None else [inject_rank], tp)
    if "baselines" in names:
        kw |= parse_baselines(baselines or "auto")
    if seed is None and verb != "bench":  # a check draws fresh weights and inputs; a bench one workload
        seed = fresh_seed()
    if seed is not None:
        kw["seed"] = seed
    opts = cls(backend=runner or resolve_backend(backend), model=model, tp=tp, experts=experts,
               widths=parse_widths(None if widths is None else str(widths), spec.max_tokens),
               timeout_s=timeout, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, deadline_s=deadline,
               checkpoint=None if checkpoint is None else str(checkpoint), checkpoint_layer=checkpoint_layer, **kw)
    return opts.validate()


def meta(opts, result=None) -> dict:
    """What a report says of its run: command, UTC time, machine, commit, config, torchrun."""
    from ffnq.report import command_line, git_commit, machine_info

    return {"command": command_line(["ffnq", *sys.argv[1:]]),
            "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(), "git_commit": git_commit(),
            "config": opts.to_json() if hasattr(opts, "to_json") else opts,
            "torchrun": shlex.join(result.command) if result else None,
            "wall_s": round(result.wall_s, 2) if result else None}


def _weights(opts) -> str:
    """The weights' source for a title: nothing for the synthetic ones (the seed says it)."""
    if not opts.checkpoint:
        return ""
    return f" checkpoint={Path(opts.checkpoint).name} checkpoint_layer={opts.checkpoint_layer}"


def run_qualify(opts, out: Path, json_out: bool):
    """Launch qualify, show its tables, write its report; (cases, report path). A job cut short
    (a rank died or hung, the deadline passed) after a case finished still reports every case
    that finished, each case some rank did not finish as FAIL, and a last ``cut short`` FAIL row
    saying why, with where each rank was (table ``ranks``); before any, it raises as it was."""
    from ffnq import launch
    from ffnq.jobs.qualify_cases import summarize
    from ffnq.report import error_line
    from ffnq.timeline import handshake

    error, ranks = None, None
    try:
        res = launch.run(opts, progress=not json_out)
        tabs, info = res.tables, meta(opts, res)
    except launch.LaunchError as e:
        error, tabs, info = str(e), launch.tables(e.records), meta(opts) | {"error": str(e)}
        ranks = pd.DataFrame(e.ranks) if e.ranks else None
        if "cases" not in tabs:  # no case finished (a rank died setting up): nothing to keep
            raise
    cases = summarize(tabs["cases"], opts.tp)
    tl = tabs.get("timeline")
    hs = None
    if error:
        done = int((cases.status == "PASS").sum())
        cases = pd.concat([cases, pd.DataFrame([{"case": "cut short", "width": 0, "status": "FAIL",
                                                 "evidence": error}])], ignore_index=True)
        verdict = (f"cut short after {len(cases) - 1} cases ({done} PASS), {int((cases.status != 'PASS').sum())} "
                   f"failed: FAILED ({error})")
    else:
        hs = handshake(tl[tl.case.str.startswith("inject-under")], opts.tp) if tl is not None else None
        failed, unchecked = int((cases.status == "FAIL").sum()), int((cases.status == "NOT CHECKED").sum())
        verdict = (f"{len(cases)} cases, {failed} failed" + (f", {unchecked} not checked" if unchecked else "")
                   + ": " + ("FAILED" if failed else "NOT ALL CHECKED" if unchecked else "OK"))
    cols = ["case", "width", "status", "rel_err", "rel_bound", "wrong", "disagree", "elements", "route_agree", "fault",
            "wall_ms", "evidence"]
    show_table(cases, json_out=json_out, columns=[c for c in cols if c in cases],
               title=f"qualify {opts.backend} tp{opts.tp} {opts.model}{_weights(opts)} experts={opts.experts} "
                     f"timeout={opts.timeout_s:g}s seed={opts.seed}")
    if hs is not None and not hs.empty:
        show_table(hs, json_out=json_out, title="handshake: arrival, wait and skew per rank and phase (us)")
    if ranks is not None:
        show_table(ranks, json_out=json_out, title="ranks: how each ended and where it was")
    # a cut-short run keeps its timeline as a table: no plot, so the report is written at once
    path = write_report(out, "qualify", opts.backend, opts.tp, cases, meta=info, verdict=verdict,
                        tables={"handshake": hs, "clock": tabs.get("clock"), "ranks": ranks,
                                "timeline": tl if error else None}, timeline=None if error else tl)
    if error:
        error_line(error)
    footer(verdict, json_out)
    saved(path, json_out)
    return cases, path


def bench_view(lat: pd.DataFrame, json_out: bool) -> tuple[list[str] | None, str | None]:
    """A bench table's columns and caption on the terminal: the latencies and their ratios; steps,
    clocks, rel_err and each width's timing method stay in the report (and in
    --json, which gets every column)."""
    if json_out:
        return None, None
    rest = {"steps", "sm_mhz", "rel_err", "timing"}
    how = None
    if "timing" in lat and lat.timing.notna().any():
        how = f"timing: {lat.timing.dropna().iloc[0]} (each width's in the report)"
    # a baseline's spread and step count serve compare's noise band, its config the report
    return [c for c in lat.columns if c not in rest and not c.endswith(("_p90_us", "_steps", "_config"))], how


def capped_note(lat: pd.DataFrame) -> list[str]:
    """A line naming the widths timed partly under a clock cap (power or thermal), if any."""
    if "capped_pct" not in lat or not (lat.capped_pct > 0).any():
        return []
    hit = lat[lat.capped_pct > 0]
    return [f"Clock cap: at widths {', '.join(map(str, hit.width))} a power or thermal cap held the clocks down "
            f"during up to {hit.capped_pct.max():.0f}% of the timed windows (NVML; sm_mhz: the slowest rank's median SM "
            "clock), so their quantiles include lowered clocks; a shorter --burst-ms or a longer --idle-ms keeps "
            "the windows under it."]


def run_bench(opts, out: Path, json_out: bool):
    """Launch bench, show its table, write its report; (per-width table, report path)."""
    from ffnq import launch
    from ffnq.jobs.bench import summarize, summarize_phases

    res = launch.run(opts, progress=not json_out)
    lat = summarize(res.tables["latency"])
    bad = lat[lat.check != "OK"]
    verdict = f"{len(lat)} widths, {len(bad)} failed the check before timing: " + ("FAILED" if len(bad) else "OK")
    cols, how = bench_view(lat, json_out)
    show_table(lat, json_out=json_out, columns=cols, caption=how,
               title=f"bench {opts.backend} tp{opts.tp} {opts.model}{_weights(opts)} experts={opts.experts} "
                     f"layers={opts.layers} seed={opts.seed} (us per step)")
    what = res.tables.get("baselines")
    if what is not None and not what.empty:
        show_table(what, json_out=json_out, title="baselines: what each is")
    ph = res.tables.get("phases")
    if ph is not None and not ph.empty:
        ph = summarize_phases(ph)
        show_table(ph, json_out=json_out, title="phases: when the median and the latest CTA pass each boundary",
                   caption="us from the first CTA's start, median of eager timeline steps (no graph: no launch gap)")
    path = write_report(out, "bench", opts.backend, opts.tp, lat, meta=meta(opts, res), verdict=verdict,
                        tables={"baselines": what, "phases": ph, "per_rank": res.tables["latency"]},
                        notes=capped_note(lat))
    footer(verdict, json_out)
    saved(path, json_out)
    return lat, path


def run_warm(opts, out: Path, json_out: bool):
    """Launch warm, show its table, write its report; (per-width table, report path)."""
    from ffnq import launch
    from ffnq.jobs.warm import summarize

    res = launch.run(opts, progress=not json_out)
    table = summarize(res.tables["warm"])
    return table, warm_report(table, opts.backend, opts.tp, opts.model + _weights(opts), None, opts, res, out,
                              json_out)


def run_warm_offline(backend: str, runner: str | None, model: str, tp: int, experts: str, widths: str,
                     target: str, out: Path, json_out: bool):
    """A GPU backend's offline compile and residency for ``target`` in this process (no GPU)."""
    from ffnq.jobs.warm import offline

    table, be = offline(backend, runner, model, tp, experts, widths, target)
    opts = {"backend": be, "model": model, "tp": tp, "experts": experts, "target": target}
    return table, warm_report(table, be, tp, model, target, opts, None, out, json_out)


def warm_report(table, be, tp, model, target, opts, res, out, json_out):
    bad = table[table.resident.astype(str) == "no"] if "resident" in table else table.iloc[:0]
    verdict = f"{len(table)} widths, {len(bad)} not resident or not compiled: " + ("FAILED" if len(bad) else "OK")
    show_table(table, json_out=json_out, title=f"warm {be} tp{tp} {model}" + (f" target {target}" if target else ""))
    path = write_report(out, "warm", be + (f"-{target}" if target else ""), tp, table, meta=meta(opts, res),
                        verdict=verdict)
    footer(verdict, json_out)
    saved(path, json_out)
    return path


def run_soak(opts, out: Path, json_out: bool):
    """Launch soak, show its table, write its report; (per-rank table, report path). A fault or a
    dead rank still reports every step that finished, its error in ``table.attrs["error"]`` (None
    when the job ran through): the CLI's and the gate's verdicts read it."""
    from ffnq import launch
    from ffnq.jobs.soak import summarize
    from ffnq.report import error_line

    error, ranks = None, None
    try:
        res = launch.run(opts, progress=not json_out)
        recs, info = res.records, meta(opts, res)
    except launch.LaunchError as e:
        error, recs, info = str(e), e.records, meta(opts) | {"error": str(e)}
        ranks = pd.DataFrame(e.ranks) if e.ranks else None
    table, bad = summarize(recs, opts.tp, error)
    n = int(table.mismatches.sum()) if len(table) else 0
    verdict = (f"{int(table.steps.min()) if len(table) else 0} steps, {n} mismatches, "
               f"{int(table.stale.sum()) if len(table) else 0} stale: "
               + ("FAILED" if error or n else "OK") + (f" ({error})" if error else ""))
    show_table(table, json_out=json_out, title=f"soak {opts.backend} tp{opts.tp} {opts.model}{_weights(opts)} "
               f"widths={','.join(map(str, opts.widths))} runners={opts.runners} seed={opts.seed}")
    path = write_report(out, "soak", opts.backend, opts.tp, table, meta=info, verdict=verdict,
                        tables={"mismatches": bad, "ranks": ranks})
    if error:
        error_line(error)
    footer(verdict, json_out)
    saved(path, json_out)
    table.attrs["error"] = error
    return table, path


def run_compare(base: Path, new: Path, out: Path, json_out: bool) -> int:
    """Per width p50/p99 deltas against each run's noise band; changed cases and residency."""
    from ffnq import compare as cmp
    from ffnq.report import console, err_console

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
                        table, meta=meta({"base": str(base), "new": str(new)}) | {"config": n.get("config", {})},
                        verdict=verdict, notes=notes, plots=plots)
    for line in notes:
        (err_console if json_out else console).print(f"# {line}", highlight=False, soft_wrap=True)
    footer(verdict, json_out)
    saved(path, json_out)
    return 0


def show_report(directory: Path, json_out: bool) -> int:
    """Print a saved run again."""
    from ffnq.report import load_report

    doc = load_report(directory)
    t = doc["tables"]
    cols, how = bench_view(t["results"], json_out) if doc["job"] == "bench" else (None, None)
    show_table(t["results"], json_out=json_out, columns=cols, caption=how,
               title=f"{doc['job']}: {doc.get('command', '')}")
    for name, df in t.items():
        if name not in ("results", "per_rank", "clock") and not df.empty:
            show_table(df, json_out=json_out, title=name)
    footer(doc.get("verdict", ""), json_out)
    return 0


def show_info(json_out: bool) -> int:
    """What this host has: backends usable, GPUs, SMs/CUs, versions of torch, triton, flydsl."""
    from ffnq.report import machine_info
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
    return 0
