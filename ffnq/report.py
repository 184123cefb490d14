"""Tables on the terminal and report folders on disk, from DataFrames.

Every table goes through ``show_table`` (a rich Table, or JSON with --json). A report folder
``<out>/<utc-stamp>-<job>-<backend>-tp<N>/`` is written into a hidden temp dir beside it and
renamed into place at the end, so an interrupted run leaves nothing half-written:

    summary.md     verdict, command, commit, machine, config, the tables in Markdown
    results.csv    the job's main table (one row per case / width)
    results.json   schema_version, command line, machine info, git commit, config, every table
    timeline.csv   per case, rank, CTA and stamp: raw ns and ns on rank 0's clock
    trace.json     Chrome trace (Perfetto): pid = rank, tid = CTA, phases as "X" spans
    latency.png    latency against width, fused beside the unfused baseline (bench)
    timeline.png   a Gantt per rank of the timeline cases (qualify)
"""
from __future__ import annotations

import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import pandas as pd
from rich.console import Console
from rich.table import Table

from ffnq.timeline import CLOCK_NOTE, chrome_trace, plot_timeline

SCHEMA_VERSION = 1
console = Console()
if not console.is_terminal:  # piped or captured: wide enough that tables keep one line per row
    console = Console(width=200)
err_console = Console(stderr=True)
WRAP = ("fault", "evidence", "value", "detail", "resources", "error")  # the only columns allowed to fold



# ---- terminal ------------------------------------------------------------------------------------

def error_line(msg: str) -> None:
    """One red line on stderr; a value the user typed ("[/x]") is text, not markup."""
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)


def footer(verdict: str, json_out: bool) -> None:
    """The verdict's line after a job's tables (on stderr with --json: stdout is the tables)."""
    (err_console if json_out else console).print(f"# {verdict}", highlight=False)


def saved(path, json_out: bool) -> None:
    (err_console if json_out else console).print(f"report: {path}", highlight=False, soft_wrap=True)


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) < 1e-2 or abs(v) >= 1e6:
            return f"{v:.2e}"
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"
    return str(v)


def _whole_cols(df: pd.DataFrame, cols: list[str]) -> set[str]:
    """Float columns whose values are all whole numbers: a width or a count that pandas made float
    (a mixed table's blanks are NaN), printed as 10, not 10.0 beside 9."""
    out = set()
    for c in cols:
        v = df[c]
        if pd.api.types.is_float_dtype(v):
            v = v.dropna()
            if len(v) and bool(((v % 1) == 0).all()) and bool((v.abs() < 1e15).all()):
                out.add(c)
    return out


def _cell(v, whole: bool) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else str(int(v)) if whole else _fmt(v)


def show_table(df: pd.DataFrame, *, json_out: bool = False, title: str | None = None,
               columns: list[str] | None = None, caption: str | None = None) -> None:
    """The one output function: a rich Table (``caption`` under it), or the rows as JSON on stdout."""
    cols = [c for c in (columns or list(df.columns)) if c in df.columns]
    if json_out:
        sys.stdout.write(json.dumps({"title": title, "rows": _records(df[cols])}, default=str) + "\n")
        return
    # a long text that every row repeats is said once, under the table: as a column it took the
    # width the numbers need (bench's timing method squeezed p50 to "11" for 112.4)
    same = [c for c in cols if len(df) > 1 and not pd.api.types.is_numeric_dtype(df[c])
            and df[c].astype(str).nunique() == 1 and len(str(df[c].iloc[0])) > 30]  # (cells may be unhashable)
    cols = [c for c in cols if c not in same]
    caption = "; ".join([f"{c}: {df[c].iloc[0]}" for c in same] + ([caption] if caption else [])) or None
    t = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    whole = _whole_cols(df, cols)
    text = {c: [_cell(v, c in whole) for v in df[c]] for c in cols}
    for c in cols:
        num = pd.api.types.is_numeric_dtype(df[c])
        wide = max(map(len, text[c]), default=1)
        # nothing is cut at the terminal's edge (rich crops a table its unwrappable cells overfill:
        # "24" for 2428.9): long texts (a timing method naming each width's burst) fold first, and
        # on a narrow terminal a number folds onto a second line rather than lose digits
        t.add_column(c, justify="right" if num else "left", overflow="fold",
                     no_wrap=c not in WRAP and not num and wide <= 30)
    for i in range(len(df)):
        cells = []
        for c in cols:
            s = text[c][i]
            if c == "status" or c == "result":
                color = "green" if s in ("PASS", "OK") else "yellow" if s == "SKIP" else "bold red"
                s = f"[{color}]{s}[/]"
            cells.append(s)
        t.add_row(*cells)
    console.print(t)


def _records(df: pd.DataFrame) -> list[dict]:
    return json.loads(df.to_json(orient="records"))


def markdown(df: pd.DataFrame, columns: list[str] | None = None) -> str:
    cols = [c for c in (columns or list(df.columns)) if c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    whole = _whole_cols(df, cols)
    for row in df[cols].itertuples(index=False):
        lines.append("| " + " | ".join(_cell(v, c in whole).replace("|", "/") for c, v in zip(cols, row)) + " |")
    return "\n".join(lines)


# ---- files -----------------------------------------------------------------------------------------

# environment that changes what runs: a development override of the Triton build, the fetched
# vLLM kernel and its launch config of baseline (d), and a plug-in runner's region names
RUN_ENV = ("FFNQ_TRITON_TUNE", "FFNQ_VLLM_MOE", "FFNQ_VLLM_MOE_CONFIG", "FFNQ_RUNNER_MAP")


def command_line(argv: list[str]) -> str:
    """The command as it ran, the RUN_ENV variables set for it in front (a report made under an
    override must not read as the default build's)."""
    return shlex.join([*(f"{k}={v}" for k in RUN_ENV if (v := os.environ.get(k))), *argv])


def git_commit() -> str:
    """HEAD (with -dirty), or FFNQ_COMMIT where the tree has no .git (a copy on a device host)."""
    if os.environ.get("FFNQ_COMMIT"):
        return os.environ["FFNQ_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else what platform knows; "" if neither says)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import torch

    info = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "cpu_model": cpu_model(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "hip": getattr(torch.version, "hip", None), "gpus": []}
    for mod in ("triton", "flydsl"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: not installed for our purpose
            info[mod] = None
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append({"name": p.name, "sms": p.multi_processor_count,
                                 "memory_gib": round(p.total_memory / 2**30, 1),
                                 "arch": getattr(p, "gcnArchName", None) or f"sm_{p.major}{p.minor}"})
    return info


def report_name(job: str, backend: str, tp: int) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")[:-4]
    tag = backend.rpartition(":")[2].lower() if ":" in backend else backend
    return f"{stamp}-{job}-{tag}-tp{tp}"


def write_report(out: Path, job: str, backend: str, tp: int, results: pd.DataFrame, *, meta: dict,
                 tables: dict[str, pd.DataFrame] | None = None, verdict: str = "",
                 notes: list[str] | None = None, timeline: pd.DataFrame | None = None,
                 extra_files: dict[str, str] | None = None,
                 plots: dict[str, Callable[[Path], None]] | None = None) -> Path:
    """Write the whole folder under a temp name, then rename it into place; returns its path.
    ``plots``: file name -> a function that draws it there (inside the temp folder, so a plot
    that fails leaves no folder behind)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    final = out / report_name(job, backend, tp)
    tmp = out / f".tmp-{final.name}"
    tmp.mkdir()
    try:
        tables = {k: v for k, v in (tables or {}).items() if v is not None and not v.empty}
        results.to_csv(tmp / "results.csv", index=False)
        doc = {"schema_version": SCHEMA_VERSION, "job": job, "verdict": verdict, **meta,
               "tables": {"results": _records(results)} | {k: _records(v) for k, v in tables.items()}}
        (tmp / "results.json").write_text(json.dumps(doc, indent=1, default=str))
        if timeline is not None and not timeline.empty:
            timeline.to_csv(tmp / "timeline.csv", index=False)
            (tmp / "trace.json").write_text(json.dumps(chrome_trace(timeline)))
            plot_timeline(timeline, tmp / "timeline.png")
        if "p50_us" in results:
            plot_latency(results, tmp / "latency.png", meta.get("config", {}))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        for name, draw in (plots or {}).items():
            draw(tmp / name)
        (tmp / "summary.md").write_text(summary_md(job, verdict, meta, results, tables, notes or [],
                                                   timeline is not None and not timeline.empty))
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def summary_md(job, verdict, meta, results, tables, notes, has_timeline) -> str:
    cfg = meta.get("config", {})
    m = meta.get("machine", {})
    lines = [f"# ffnq {job}: {verdict}", "",
             f"- command: `{meta.get('command', '')}`", f"- git commit: `{meta.get('git_commit', '')}`",
             f"- machine: {m.get('host')}, {m.get('cpus')} cpus ({m.get('cpu_model') or 'model unknown'}), "
             f"torch {m.get('torch')}, "
             f"gpus: {', '.join(g['name'] for g in m.get('gpus', [])) or 'none'}",
             "- config: " + ", ".join(f"{k}={v}" for k, v in cfg.items() if k != "result_dir"), ""]
    lines += [f"## {job}", "", markdown(results), ""]
    for name, df in tables.items():
        lines += [f"## {name}", "", markdown(df), ""]
    if job == "bench" and not has_timeline:
        lines += ["## timeline", "", "none: bench times whole steps and records no per-CTA stamps, so this "
                  "folder has no timeline.csv or trace.json (qualify's timeline cases write them).", ""]
    if has_timeline:
        lines += ["## clocks", "", CLOCK_NOTE, "", "timeline.csv holds every stamp; trace.json opens in "
                  "Perfetto (ui.perfetto.dev): a process per rank, a thread per CTA.", ""]
    lines += notes
    return "\n".join(lines) + "\n"


def plot_latency(results: pd.DataFrame, path: Path, cfg: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    baselines = [c for c in results.columns if c.endswith("_p50_us") and c != "p50_us"]
    curves = [("p50_us", "fused p50", "o-")] + [(c, f"{c[:-7]} p50", "s--") for c in baselines]
    for col, label, style in curves + [("floor_us", "floor", "k:")]:
        if col in results and results[col].notna().any():
            ax.plot(results.width, results[col], style, label=label)
    if "p90_us" in results:
        ax.fill_between(results.width, results.p50_us, results.p90_us, alpha=0.2, label="fused p50..p90")
    ax.set_xticks(sorted(int(w) for w in results.width.dropna().unique()))  # the widths run, no 2.5
    ax.set_xlabel("width (tokens)")
    ax.set_ylabel("latency per step (us)")
    ax.set_title(f"{cfg.get('backend')} tp{cfg.get('tp')} {cfg.get('model')} layers={cfg.get('layers', 1)}")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def load_report(path: Path) -> dict:
    """A saved report's results.json, with its tables as DataFrames. Its structure is checked
    here, once: a dict with a job and tables, tables.results and every other table a list of rows
    (JSON objects); anything else is one UsageError naming the folder, not a traceback later."""
    from ffnq.errors import UsageError

    f = Path(path) / "results.json"
    if not f.is_file():
        raise UsageError(f"report {path}: no results.json there (a folder written by ffnq)")
    try:
        doc = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"report {path}: results.json is malformed ({e})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"report {path}: results.json holds a JSON {type(doc).__name__}; need an object with "
                         "schema_version, job and tables")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise UsageError(f"report {path}: schema_version {doc.get('schema_version')}, this ffnq reads {SCHEMA_VERSION}")
    if not isinstance(doc.get("job"), str) or not doc["job"]:
        raise UsageError(f"report {path}: results.json has no job (need a name: bench, qualify, warm, ...)")
    if not isinstance(doc.get("config", {}), dict):
        raise UsageError(f"report {path}: config in results.json is a {type(doc['config']).__name__}; need an object")
    tables = doc.get("tables")
    if not isinstance(tables, dict) or "results" not in tables:
        raise UsageError(f"report {path}: results.json has no tables.results (need tables = {{results: [rows]}})")
    for name, rows in tables.items():
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise UsageError(f"report {path}: table {name} in results.json is not a list of rows (JSON objects)")
    doc["tables"] = {k: pd.DataFrame(v) for k, v in tables.items()}
    return doc
