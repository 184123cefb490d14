"""warm, one rank: compile and load every width; per width what the runner reports.

Columns: width, kernel, compile_s, resources (the rest of runner.describe), ctas_per_cu
(runner.residency, the driver's answer), cus, grid, resident (ctas_per_cu * cus >= grid).
Where the backend has no occupancy query (cpu) the residency columns say n/a. ``offline`` runs
a GPU backend's offline residency for a target (no GPU needed) in this process.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import pandas as pd

from ffnq.dist import barrier
from ffnq.errors import UsageError
from ffnq.jobs.rank import from_options
from ffnq.jobs.records import Records, main
from ffnq.options import JobOptions, parse_widths

KNOWN = ("kernel", "compile_s", "grid", "ctas_per_cu", "cus", "resident")
TARGETS = ("sm_90", "gfx942", "gfx950")


@dataclass
class WarmOptions(JobOptions):
    job = "warm"


def body(opts: dict, rec: Records) -> None:
    job = from_options(opts)
    try:
        r = job.runner(opts["widths"])
        rec.progress(0, 1, "compiling every width")
        t0 = time.perf_counter()
        r.warm(job.weights)  # residency is judged below, width by width, rather than refused
        wall = time.perf_counter() - t0
        cus = job.compute_units()
        for s in opts["widths"]:
            d = dict(r.describe(s) or {})
            ctas = r.residency.get(s)
            grid = d.get("grid", getattr(r, "BLOCKS", None))
            # a runner that times no width by itself (one warm() for all) shows "-", and its whole
            # warm() once in the note: an even split would invent per-width numbers
            per_width = d.get("compile_s")
            row = {"width": s, "rank": job.rank, "kernel": d.get("kernel", ""),
                   "compile_s": per_width,
                   "note": "" if per_width is not None else
                           f"compile_s: no per-width time from this runner; warm() took {wall:.2f} s for "
                           f"all {len(opts['widths'])} widths",
                   "resources": ", ".join(f"{k}={v}" for k, v in d.items() if k not in KNOWN),
                   "ctas_per_cu": ctas if ctas is not None else "n/a", "cus": cus if cus else "n/a", "grid": grid,
                   "resident": ("yes" if ctas * cus >= grid else "no") if ctas is not None and cus else "n/a"}
            rec.row("warm", row)
        rec.progress(1, 1, "done")
    finally:
        barrier()
        job.close()


def summarize(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per width: the slowest rank's compile time; resident only if every rank is."""
    out = []
    for s, g in rows.groupby("width", sort=True):
        first = g.iloc[0].to_dict()
        res = set(g.resident.astype(str))
        first["compile_s"] = float(pd.to_numeric(g.compile_s, errors="coerce").max())  # NaN: none reported
        first["resident"] = "no" if "no" in res else ("yes" if res == {"yes"} else "n/a")
        first.pop("rank", None)
        out.append(first)
    cols = ["width", "kernel", "compile_s", "resources", "ctas_per_cu", "cus", "grid", "resident", "note"]
    df = pd.DataFrame(out)
    return df[[c for c in cols if c in df and (c != "note" or df[c].fillna("").astype(str).str.len().any())]]


# processes one width's offline build runs by itself: Triton compiles the plain and the
# handshake (final) variant of each width in parallel (offline.warm_table); FlyDSL has one build
INNER_JOBS = {"triton": 2, "flydsl": 1}


def offline(backend: str, runner: str | None, model: str, tp: int, experts: str, widths: str, target: str,
            progress: bool = True):
    """The offline residency table of a GPU backend for ``target``; (DataFrame, backend). Widths
    compile in parallel processes, one width per task, with a progress bar per width on a
    terminal (a line per finished width elsewhere)."""
    import importlib

    from ffnq.spec import Experts, load_model

    if target not in TARGETS:
        raise UsageError(f"--target {target!r}: allowed {', '.join(TARGETS)}")
    be = runner or backend
    if be == "auto":
        be = "triton"
    if be not in ("triton", "flydsl"):
        raise UsageError(f"offline residency for {be}/{target} not available: only the triton and flydsl "
                         f"backends have one", use="--backend triton or flydsl")
    spec = load_model(model)
    try:
        mode = Experts(experts)
    except ValueError:
        raise UsageError(f"--experts {experts!r}: allowed {', '.join(e.value for e in Experts)}") from None
    spec.check(tp, mode)
    ws = parse_widths(widths, spec.max_tokens)
    module = f"ffnq.backends.{be}.offline"
    try:
        getattr(importlib.import_module(module), "warm_table")
        rows = compile_widths(module, (spec, tp, mode, target), ws, f"{be} {target}", INNER_JOBS.get(be, 1),
                              progress)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"offline residency for {be}/{target} not available: {e}") from None
    df = pd.DataFrame(rows)
    if "resident" in df:  # the offline table says True/False; a width that failed to compile is not resident
        df["resident"] = [("yes" if v is True or v == "yes" else "no" if v in (False, "no") else str(v))
                          for v in df.resident]
        if "error" in df:
            df.loc[df.error.fillna("").astype(str) != "", "resident"] = "no"
    df["note"] = [grid_note(be, target, r) for r in df.to_dict("records")]
    return shape(df), be


def _one_width(module: str, args: tuple, width: int) -> tuple[list[dict], float]:
    """One pool task: the backend's warm_table for one width; (its rows, wall seconds)."""
    import importlib

    t0 = time.perf_counter()
    rows = importlib.import_module(module).warm_table(*args, [width])
    return list(rows.to_dict("records") if isinstance(rows, pd.DataFrame) else rows), time.perf_counter() - t0


def compile_widths(module: str, args: tuple, widths: list[int], label: str, inner: int = 1,
                   progress: bool = True) -> list[dict]:
    """Every width through ``module``.warm_table(*args, [width]): as many widths at once as the
    cores allow (each takes ``inner`` processes itself), a bar per width in flight (elapsed, and
    the time left going by the widths done so far) under one for the whole table (elapsed, ETA).
    Rows in width order. Even one width at a time goes to a worker process: this one keeps the
    bars moving meanwhile."""
    import multiprocessing as mp
    import os
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    from rich.console import Console
    from rich.progress import (BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    console = Console(stderr=True)
    live = progress and console.is_terminal
    workers = max(1, min(len(widths), (os.cpu_count() or 1) // max(1, inner)))
    done: dict[int, list[dict]] = {}
    took: list[float] = []
    t_start = time.monotonic()

    def said(width: int, wall: float) -> None:
        """A line per finished width where no bar is drawn (CI logs, a pipe)."""
        if progress and not live:
            n = len(done)
            left = (len(widths) - n) * (sum(took) / len(took)) / workers
            console.print(f"warm {label}: width {width} compiled in {wall:.1f} s ({n}/{len(widths)}; "
                          f"{time.monotonic() - t_start:.0f} s so far, about {left:.0f} s left)", highlight=False,
                          soft_wrap=True)

    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                   TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console,
                   disable=not live)
    with bar:
        whole = bar.add_task(f"warm {label}", total=len(widths), count=f"0/{len(widths)} widths")
        todo = list(widths)
        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("fork")) as ex:
            running = {}  # future -> (width, its task, start)
            while todo or running:
                while todo and len(running) < workers:  # a bounded window: submitted = started
                    w = todo.pop(0)
                    task = bar.add_task(f"  width {w}", total=None, count="")
                    running[ex.submit(_one_width, module, args, w)] = (w, task, time.monotonic())
                finished, _ = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                mean = sum(took) / len(took) if took else None
                for f, (w, task, t0) in list(running.items()):
                    if f in finished:
                        rows, wall = f.result()
                        del running[f]
                        done[w], took = rows, took + [wall]
                        bar.update(task, total=1, completed=1, description=f"  width {w}: {wall:.1f} s")
                        bar.update(whole, advance=1, count=f"{len(done)}/{len(widths)} widths")
                        said(w, wall)
                    elif mean:  # the bar of a width in flight fills by the mean of those done
                        el = time.monotonic() - t0
                        bar.update(task, total=max(mean, el), completed=el)
    return [r for w in widths for r in done[w]]


def grid_note(backend: str, target: str, row: dict) -> str:
    """Why a width's grid is the size it is against this target's CUs (the table's note)."""
    grid, cus = row.get("grid"), row.get("cus")
    if not grid or not cus:
        return ""
    unit = "SMs" if target.startswith("sm_") else "CUs"
    if backend == "triton" and target.startswith("sm_"):
        per = grid / cus
        return (f"grid = {per:g} CTAs x {cus} {unit} (TritonRunner: 2 per SM, 3 where configs/triton-measured.toml "
                "measured it faster)")
    if backend == "triton":
        return (f"grid {grid} on {cus} {unit}: CDNA builds keep the grid tuned on an H200 (2 x 132 SMs, "
                f"TritonRunner.BLOCKS), never tuned on AMD; at 1 CTA per CU "
                + (f"{cus - grid} CUs stay idle" if grid <= cus else f"it needs {-(-grid // cus)} CTAs per CU"))
    if backend == "flydsl":
        return (f"grid {grid} on {cus} {unit}: FlydslRunner.BLOCKS, sized to fit MI355X's 256 and MI300X's 304 CUs "
                "at 1 CTA per CU")
    return ""


def shape(df: pd.DataFrame) -> pd.DataFrame:
    """warm's columns; every other fact of a row goes into ``resources`` as k=v."""
    cols = ["width", "kernel", "compile_s", "resources", "ctas_per_cu", "cus", "grid", "resident", "note"]
    keep = set(cols) | {"error", "target"}
    rows = []
    for r in df.to_dict("records"):
        extra = {k: v for k, v in r.items() if k not in keep and v is not None and v == v}
        # (a column only some rows have comes back from pandas as floats: 225.0)
        r["resources"] = ", ".join(f"{k}={int(v) if isinstance(v, float) and v.is_integer() else v}"
                                   for k, v in extra.items())
        rows.append(r)
    out = pd.DataFrame(rows)
    has_err = "error" in out and out.error.fillna("").astype(str).str.len().any()
    return out[[c for c in cols if c in out] + (["error"] if has_err else [])]


if __name__ == "__main__":
    main(body)
