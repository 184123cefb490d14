"""ffnq gate CONFIG --rebase: a gate config's p50 budgets and [compare] bases taken from this run.

The budgets become each bench width's p50 plus a margin (15% by default, rounded up to a whole
us): one GPU's run-to-run spread is ~1% and two machines of one model differ by up to ~3%, so
15% passes another host of the model and fails a real regression. The run's bench and qualify
reports become the [compare] bases: their results.json is copied into the folders the config
names, or into ref/NAME-VERB/ next to it. Only a run whose correctness checks all passed rebases
(a base with a FAIL in it would blind the next run's no_new_fail to that case). The config is
edited line by line, its comments kept, and re-read before it replaces the old one.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import tomllib
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from ffnq.errors import UsageError

VERBS = ("bench", "qualify")  # the jobs whose reports a gate compares against


class NotRebased(Exception):
    """This run cannot be a gate's base (a correctness check failed): the gate exits 1."""


CORRECT = {"resident": True, "qualify_all_pass": True, "soak_clean": True}  # and bench's fp64 check: the
# thresholds (ffnq.gate.checks) a run must pass, whatever its config judges, to be a base


def check_rebase(cfg: dict) -> None:
    """Refuse a rebase that could not write anything, before any job runs (the CLI checks --margin)."""
    if not any(v in VERBS for v, _ in cfg["jobs"]):
        raise UsageError(f"gate config {cfg['path']}: --rebase takes budgets and bases from a bench or qualify "
                         f"job; this config runs {', '.join(v for v, _ in cfg['jobs'])}")


def budgets(table: pd.DataFrame, margin_pct: float) -> dict[int, int]:
    """Width -> p50 budget in us: the bench's p50 x (1 + margin), rounded up."""
    timed = table[pd.notna(table.p50_us)] if "p50_us" in table else table.iloc[:0]
    return {int(w): math.ceil(float(us) * (1 + margin_pct / 100) - 1e-9) for w, us in zip(timed.width, timed.p50_us)}


def _section(lines: list[str], name: str) -> tuple[int, int] | None:
    """(header index, end index) of [name] in a TOML file's lines, or None."""
    head = next((i for i, ln in enumerate(lines) if re.match(rf"\s*\[{name}\]\s*(#.*)?$", ln)), None)
    if head is None:
        return None
    end = next((i for i in range(head + 1, len(lines)) if re.match(r"\s*\[", lines[i])), len(lines))
    return head, end


def _set(lines: list[str], section: str, key: str, line: str) -> None:
    """Replace key's line in [section], or add it under the header (the section too if absent)."""
    span = _section(lines, section)
    if span is None:
        lines += ["", f"[{section}]", line]
        return
    head, end = span
    at = next((i for i in range(head + 1, end) if re.match(rf"\s*{key}\s*=", lines[i])), None)
    if at is None:
        lines.insert(head + 1, line)
    else:
        lines[at] = line


def rewrite(text: str, budget: dict[int, int] | None, bases: dict[str, str], source: str, margin_pct: float,
            compared: str | None = None) -> str:
    """The config's text with p50_us_max = budget (if given, from source's bench) and [compare]
    VERB = bases[VERB] (its header naming compared, or source)."""
    lines = text.splitlines()
    if budget:
        table = ", ".join(f'"{w}" = {us}' for w, us in sorted(budget.items()))
        _set(lines, "thresholds", "p50_us_max",
             f"p50_us_max = {{ {table} }}  # p50 + {margin_pct:g}% of {source}")
    for verb, path in bases.items():
        _set(lines, "compare", verb, f"{verb} = {json.dumps(path)}")
    span = _section(lines, "compare")
    if span:  # its bases are this run's now, new or rewritten in place
        lines[span[0]] = f"[compare]  # {compared or source}"
    return "\n".join(lines) + "\n"


def _source(path: str) -> str:
    """'a run on GPU, date, commit c' from a report's results.json."""
    doc = json.loads((Path(path) / "results.json").read_text())
    gpus = (doc.get("machine") or {}).get("gpus") or []
    where = gpus[0]["name"] if gpus else f"{(doc.get('options') or {}).get('backend', 'cpu')} backend"
    return f"a run on {where}, {str(doc.get('utc', ''))[:10]}, commit {str(doc.get('git_commit', '?'))[:7]}"


def _spelled(path: Path) -> str:
    """A base folder as the config names it: relative to here when under it (load_gate reads a
    relative path from the working directory first), else absolute."""
    rel = os.path.relpath(path.resolve(), Path.cwd())
    return rel if not rel.startswith("..") else str(path.resolve())


def rebase(cfg: dict, runs: list[tuple[str, pd.DataFrame, str]], margin_pct: float, failed: list[str],
           bench_widths: set[int], reload: Callable[[Path], object]) -> list[str]:
    """Rewrite cfg's config from this run's jobs (verb, table, report folder); the lines to print.
    failed: the run's failed correctness checks (any: NotRebased, nothing written); bench_widths:
    the widths the config's bench jobs run (a budget each); reload(config) raises UsageError where
    the rewritten config would not load as a gate, and everything is put back."""
    if failed:
        raise NotRebased(f"gate config {cfg['path']}: not rebased: this run failed {'; '.join(failed)}")
    last = {verb: (table, path) for verb, table, path in runs if verb in VERBS}  # a verb's last job
    timed = budgets(last["bench"][0], margin_pct) if "bench" in last else None
    if timed == {}:
        raise NotRebased(f"gate config {cfg['path']}: not rebased: its bench timed no width")
    config = Path(cfg["path"])
    bases, copies = {}, []
    for verb, (_, path) in last.items():
        if verb in cfg["compare"]:
            folder = Path(cfg["compare"][verb])
        else:
            folder = config.parent / "ref" / f"{config.stem}-{verb}"
            bases[verb] = _spelled(folder)
        copies.append((verb, Path(path) / "results.json", folder))
    runs_of = {verb: _source(path) for verb, (_, path) in last.items()}
    source = runs_of.get("bench") or runs_of["qualify"]
    compared = source if len(set(runs_of.values())) == 1 else "; ".join(f"{v}: {s}" for v, s in runs_of.items())
    budget = None if timed is None else {w: us for w, us in timed.items() if w in bench_widths}
    was = config.read_text()
    text = rewrite(was, budget, bases, source, margin_pct, compared)
    new = tomllib.loads(text)  # what the edit must have set, read back before anything is written
    if (budget and new["thresholds"]["p50_us_max"] != {str(w): us for w, us in budget.items()}) or any(
            new["compare"][v] != p for v, p in bases.items()):
        raise UsageError(f"gate config {config}: not rebased: its p50_us_max or [compare] is written in a form "
                         "this edit does not take (one line each); set them by hand")
    old = {config: was} | {f / "results.json": (f / "results.json").read_bytes()
                                          for _, _, f in copies if (f / "results.json").is_file()}
    # the outermost folder each new base creates (ref/ itself, the first time)
    made = {next(a for a in [*reversed(f.parents), f] if not a.exists()) for _, _, f in copies if not f.exists()}
    try:
        for _, src, folder in copies:  # each file whole or not at all: a copy, then a rename over the old one
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, folder / "results.json.tmp")
            os.replace(folder / "results.json.tmp", folder / "results.json")
        tmp = config.with_name(config.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, config)
        reload(config)  # the config, its new bases in place, loads as the next gate will
    except (OSError, UsageError) as e:  # put back what was there: no half-rebased gate
        for f, was in old.items():
            f.write_text(was) if isinstance(was, str) else f.write_bytes(was)
        for f in made:
            shutil.rmtree(f, ignore_errors=True)
        raise UsageError(f"gate config {config}: not rebased ({e})") from None
    said = [f"rebased {config}: " + (", ".join(f"w={w} p50 <= {us} us" for w, us in sorted(budget.items()))
                                     if budget else "no bench job: budgets kept")]
    return said + [f"  [compare] {verb}: {folder} <- {src.parent}" for verb, src, folder in copies]
