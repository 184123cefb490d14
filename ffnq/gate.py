"""ffnq gate CONFIG: run the jobs a gate config names, compare with its thresholds, write JUnit.

A config (configs/gates/*.toml):

    name = "cpu-tp2"
    device = "H200"           # optional: every GPU the jobs use must name this (exit 2 before any
                              # job runs where one does not: budgets hold for one GPU model)
    [options]                 # every job's options (the verbs' long names, '-' or '_')
    backend = "cpu"
    [[job]]                   # in order; a job's keys override [options]
    verb = "qualify"          # warm | qualify | bench | soak
    widths = "1-4,16"
    [[job]]
    verb = "soak"             # steps, runners, check_every, random_padding: soak's own keys
    steps = 1500
    [thresholds]
    resident = true           # every warm width resident (n/a: no occupancy query, not judged)
    qualify_all_pass = true   # every qualify case PASS
    soak_clean = true         # the soak ran every step on every rank: no mismatch, stale match,
                              # rank disagreement or fault, and no rank died or hung
    p50_us_max = 2000         # every bench width; or a table { "1" = 500, "16" = 2000 }
    speedup_unfused_min = 1.0 # bench p50 beats the unfused baseline by at least this factor
    speedup_stock_min = 1.0   # likewise for the stock composition (GPU)
    speedup_vllm_min = 1.0    # likewise for vLLM's decode step (a bench job with baselines = "...,vllm")
    max_slower_pct = 5        # relative: no width's p50 more than 5% slower than [compare]'s
                              # report, beyond the noise band (ffnq.compare)
    no_new_fail = true        # relative: no qualify case PASS in [compare]'s report, FAIL now
    [compare]                 # the last good runs, per job (report folders)
    bench = "reports/...-bench-triton-tp2"
    qualify = "reports/...-qualify-triton-tp2"

`ffnq gate CONFIG --rebase [--margin 15]` then rewrites the config from this run: p50_us_max per
bench width = p50 + margin, [compare] = its bench and qualify reports (ffnq.gate_rebase).

Exit 0 every check passed, 1 a check failed, 2 the gate could not run (config missing or
malformed, bad options, a threshold that would judge nothing, a job that died or passed its
deadline). A check with nothing to judge in this run (resident where no width has an occupancy
query: cpu) is SKIP, never PASS: counted apart, and a gate whose every check is SKIP judged
nothing: exit 2, after writing its report. Each job writes its own report;
the gate's folder holds junit.xml, summary.md, results.csv/json (one row per check).
"""
from __future__ import annotations

import contextlib
import tomllib
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

import pandas as pd

from ffnq.errors import UsageError
from ffnq.errors import cut, shown
from ffnq.gate_rebase import CORRECT, NotRebased, check_rebase, rebase
from ffnq.spec import is_int, is_number

VERBS = ("warm", "qualify", "bench", "soak")
SECTIONS = {"name", "device", "options", "job", "thresholds", "compare"}
THRESHOLDS = {"resident", "qualify_all_pass", "soak_clean", "p50_us_max", "speedup_unfused_min", "speedup_stock_min",
              "speedup_stock_nccl_min", "speedup_stock_symm_min", "speedup_vllm_min", "speedup_vllm_nccl_min",
              "max_slower_pct", "no_new_fail"}
SWITCHES = {"resident": "warm", "qualify_all_pass": "qualify", "soak_clean": "soak", "no_new_fail": None}


# each option's TOML type, as the verb's own flag takes it; the ranges are launch.validate's
OPTION_TYPES = {
    **dict.fromkeys(("tp", "seed", "layers", "nnodes", "checkpoint_layer", "steps", "runners", "check_every"),
                    ("an integer", is_int)),
    "random_padding": ("true or false", lambda v: isinstance(v, bool)),
    **dict.fromkeys(("timeout", "rep_ms", "warmup_ms", "burst_ms", "idle_ms", "deadline"), ("a finite number", is_number)),
    **dict.fromkeys(("backend", "runner", "model", "experts", "baselines", "rdzv_endpoint", "checkpoint", "routing"),
                    ("a string", lambda v: isinstance(v, str))),
    "widths": ("a string such as '1-4,16' or an integer", lambda v: isinstance(v, str) or is_int(v)),
    "inject_rank": ("a rank, 'all', or a list of them",
                    lambda v: all(isinstance(x, str) or is_int(x) for x in (v if isinstance(v, list) else [v]))),
}
OPTION_KEYS = set(OPTION_TYPES)  # a gate job may set exactly the options typed above


def _check_options(p: Path, where: str, opts: dict) -> None:
    for k, v in opts.items():
        if k in OPTION_TYPES and not OPTION_TYPES[k][1](v):
            raise UsageError(f"gate config {p}: {where} {k} = {shown(v)}: need {OPTION_TYPES[k][0]}")


def _table(p: Path, cfg: dict, key: str) -> dict:
    """A top-level [key] table ({} when absent); anything else is refused, not read as one."""
    v = cfg.get(key, {})
    if not isinstance(v, dict):
        raise UsageError(f"gate config {p}: {key} = {shown(v)}: need a [{key}] table")
    return v


def load_gate(path: str | Path, rebasing: bool = False) -> dict:
    """A gate config, checked whole (exit 2 on anything it cannot judge). rebasing: its bench and
    qualify jobs will write their [compare] bases (gate --rebase), so a relative threshold may
    come before its base."""
    p = Path(path)
    if not p.is_file():
        known = sorted(str(x) for x in (Path(__file__).resolve().parent.parent / "configs" / "gates").glob("*.toml"))
        raise UsageError(f"gate config {str(path)!r}: no such file; shipped: {', '.join(known)}")
    try:
        cfg = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"gate config {p}: malformed TOML ({e})") from None
    bad = set(cfg) - SECTIONS
    if bad:  # a misspelt section ([threshold]) would leave its checks out without a word
        raise UsageError(f"gate config {p}: unknown key(s) or section(s) {cut(', '.join(sorted(bad)))}; allowed "
                         f"{', '.join(sorted(SECTIONS))}")
    if not isinstance(cfg.get("name", ""), str):
        raise UsageError(f"gate config {p}: name = {shown(cfg['name'])}: need a string")
    device = cfg.get("device")
    if device is not None and not (isinstance(device, str) and device.strip()):
        raise UsageError(f"gate config {p}: device = {shown(device)}: need a GPU model's name, e.g. 'H200'")
    norm = lambda d: {k.replace("-", "_"): v for k, v in d.items()}  # noqa: E731
    base = norm(_table(p, cfg, "options"))
    _check_options(p, "[options]", base)
    jobs = cfg.get("job", [])
    if not isinstance(jobs, list) or not jobs:
        raise UsageError(f"gate config {p}: needs at least one [[job]] with verb = {' | '.join(VERBS)}")
    out = []
    for i, j in enumerate(jobs):
        if not isinstance(j, dict):
            raise UsageError(f"gate config {p}: job {i + 1} = {shown(j)}: need a [[job]] table with verb = "
                             f"{' | '.join(VERBS)}")
        j = norm(j)
        verb = j.pop("verb", None)
        if verb not in VERBS:
            raise UsageError(f"gate config {p}: job {i + 1} verb {shown(verb)}; allowed {', '.join(VERBS)}")
        _check_options(p, f"job {i + 1}", j)
        opts = base | j
        bad = set(opts) - OPTION_KEYS
        if bad:
            raise UsageError(f"gate config {p}: unknown option(s) {cut(', '.join(sorted(bad)))}; allowed "
                             f"{', '.join(sorted(OPTION_KEYS))}")
        out.append((verb, opts))
    th = norm(_table(p, cfg, "thresholds"))
    bad = set(th) - THRESHOLDS
    if bad:
        raise UsageError(f"gate config {p}: unknown threshold(s) {cut(', '.join(sorted(bad)))}; allowed "
                         f"{', '.join(sorted(THRESHOLDS))}")
    cmp = _table(p, cfg, "compare")
    for verb, rel in cmp.items():
        if not isinstance(rel, str):
            raise UsageError(f"gate config {p}: [compare] {verb} = {shown(rel)}: need a report folder (a string)")
        path = (p.parent.parent.parent / rel) if not Path(rel).is_absolute() and not Path(rel).exists() else Path(rel)
        if verb not in VERBS or not (path / "results.json").is_file():
            raise UsageError(f"gate config {p}: [compare] {verb} = {shown(rel)}: need a job name ({', '.join(VERBS)}) "
                             f"and a report folder with results.json")
        cmp[verb] = str(path)
    _check_thresholds(p, th, out, set(cmp) | ({v for v, _ in out} & {"bench", "qualify"} if rebasing else set()))
    _check_bases(p, cmp)
    return {"name": cfg.get("name", p.stem), "path": str(p), "device": device, "jobs": out, "thresholds": th,
            "compare": cmp}


def check_device(cfg: dict, jobs: list) -> None:
    """A config that names its device runs only where every GPU its jobs use is one: its p50
    budgets and [compare] bases hold for one GPU model (an H200's budgets fail every width of an
    H100 after minutes of jobs, for a reason no check names)."""
    from ffnq.options import GPU_BACKENDS

    want = cfg["device"]
    if want is None:
        return
    if not any(o.backend in GPU_BACKENDS for _, o in jobs):
        raise UsageError(f"gate config {cfg['path']}: device = {want!r}: its jobs run on "
                         f"{', '.join(sorted({o.backend for _, o in jobs}))}, not on a GPU backend")
    import torch

    ranks = max(o.tp // o.nnodes for _, o in jobs)  # the GPUs of this node the jobs use: 0..ranks-1
    names = [torch.cuda.get_device_name(i) for i in range(min(ranks, torch.cuda.device_count()))] \
        if torch.cuda.is_available() else []
    bad = [f"GPU {i} is {n}" for i, n in enumerate(names) if want.lower() not in n.lower()]
    if not names or bad:
        raise UsageError(f"gate config {cfg['path']}: device = {want!r}, but "
                         + ("; ".join(bad) if names else "this host has no GPU")
                         + ": run a gate whose budgets were measured on this host's GPU")


def _check_thresholds(p: Path, th: dict, jobs: list[tuple[str, dict]], cmp: set[str]) -> None:
    """Refuse, before any job runs, a threshold that would judge nothing: of the wrong type or out
    of range (a budget of -5 us or nan fails every width, a speedup minimum of -1 passes every
    one), for a job (or a [compare] base) the config does not have, or a p50 budget for a width no
    bench job runs; and a config with no threshold on."""
    verbs = {v for v, _ in jobs}
    # a slowdown of 0% beyond the noise is a bound; a budget or a speedup minimum of 0 is none
    need = lambda key: "a finite number " + (">= 0" if key == "max_slower_pct" else "> 0")  # noqa: E731
    num = lambda key, v: is_number(v) and (v >= 0 if key == "max_slower_pct" else v > 0)  # noqa: E731

    def need_job(key: str, verb: str) -> None:
        if verb not in verbs:
            raise UsageError(f"gate config {p}: threshold {key} judges the {verb} job, which this config does not "
                             "have")

    for key, v in th.items():
        if key in SWITCHES:
            if not isinstance(v, bool):
                raise UsageError(f"gate config {p}: threshold {key} = {shown(v)}: allowed true or false")
            if v and SWITCHES[key]:
                need_job(key, SWITCHES[key])
            continue
        if key == "p50_us_max" and isinstance(v, dict):
            ran = {w for verb, o in jobs if verb == "bench" for w in _widths(o)}
            for w, us in v.items():
                if not (str(w).isdigit() and int(w) in ran) or not num(key, us):
                    raise UsageError(f"gate config {p}: p50_us_max {{ {shown(w)} = {shown(us)} }}: need a width a bench job "
                                     f"runs ({', '.join(map(str, sorted(ran))) or 'none'}) = a finite number of us "
                                     "> 0")
        elif not num(key, v):
            raise UsageError(f"gate config {p}: threshold {key} = {shown(v)}: need {need(key)}")
        need_job(key, "bench")
        if key == "max_slower_pct" and "bench" not in cmp:
            raise UsageError(f"gate config {p}: threshold {key} judges the bench [compare] base, which this config "
                             "does not have ([compare] bench = a report folder)")
    if th.get("no_new_fail") and not ({"qualify", "warm"} & set(cmp)):
        raise UsageError(f"gate config {p}: threshold no_new_fail needs a [compare] qualify or warm base")
    for verb in cmp:
        if verb not in verbs:
            raise UsageError(f"gate config {p}: [compare] {verb}: this config has no {verb} job to compare")
    if not any(v is not False for v in th.values()):
        raise UsageError(f"gate config {p}: no threshold is on; allowed {', '.join(sorted(THRESHOLDS))}")


def _check_bases(p: Path, cmp: dict) -> None:
    """Read every [compare] base now: one that compare cannot use (malformed, another job's, a
    bench that timed nothing) is a config error before any job runs, not after every one did."""
    from ffnq.compare import load

    for verb, path in cmp.items():
        doc = load(path)
        if doc["job"] != verb:
            raise UsageError(f"gate config {p}: [compare] {verb} = {path}: a {doc['job']} report; need a {verb} one")
        if verb == "bench" and not doc["tables"]["results"].p50_us.notna().any():
            raise UsageError(f"gate config {p}: [compare] bench = {path}: no width was timed there (no p50_us); "
                             "need a bench that timed its widths")


def relative_checks(verb: str, base_path: str, new_path: str, th: dict) -> list[dict]:
    """One row per compared row (ffnq.compare) that the relative thresholds judge."""
    from ffnq.compare import compare, load

    rows = []
    table = compare(load(base_path), load(new_path))
    pct = th.get("max_slower_pct")
    # a base timed on another GPU model judges nothing of this run's p50 (the config's `device` key
    # refuses such a host before any job runs; without it, the mismatch fails here)
    gpus = next((r for _, r in table.iterrows() if r.kind == "machine" and r.verdict == "changed"), None)
    if verb == "bench" and pct is not None and gpus is not None:
        rows.append({"check": "vs base GPU", "job": verb, "result": "FAIL", "value": f"{gpus.new} (base {gpus.base})",
                     "threshold": "the base's GPU model", "report": new_path})
    # widths whose steps read other experts than the base's (another seed): no verdict on their p50
    other = {r.key: f"{r.base:g} -> {r.new:g}" for _, r in table.iterrows()
             if r.kind == "workload" and r.verdict == "changed"}
    for _, r in table.iterrows():
        if r.kind == "latency" and r.metric == "p50_us" and pct is not None and r.verdict != "new":
            row = {"check": f"vs base p50 {r.key}", "job": verb, "report": new_path}
            if gpus is not None and r.verdict != "gone":
                row.update(result="SKIP", value=f"{r.new:.1f} us vs {r.base:.1f}, on another GPU",
                           threshold="the base's GPU model")
            elif r.key in other:
                row.update(result="SKIP", value=f"{r.new:.1f} us vs {r.base:.1f}, other inputs (touched experts "
                                                f"{other[r.key]}: another seed)", threshold="the base's workload")
            elif r.verdict == "gone":  # a width the base judged that this run did not time
                row.update(result="FAIL", value=f"not timed in this run (base {r.base:.1f} us)",
                           threshold="every base width timed")
            else:
                bad = r.verdict == "slower" and r.delta_pct > float(pct)
                row.update(result="FAIL" if bad else "PASS",
                           value=f"{r.new:.1f} us vs {r.base:.1f} ({r.delta_pct:+.1f}%, noise {r.band_pct:.1f}%, "
                                 f"{r.verdict})", threshold=f"<= +{float(pct):g}% beyond noise")
            rows.append(row)
        if r.kind in ("qualify", "residency") and th.get("no_new_fail"):
            # a case the base passed and this run lost, or a new one that fails, is as bad as PASS -> FAIL
            bad = r.verdict == "regressed" or (r.verdict == "gone" and r.base == "PASS") or (
                r.verdict == "new" and r.new != "PASS")
            said = {"gone": f"{r.base} -> not in this run", "new": f"not in the base -> {r.new}"}
            rows.append({"check": f"vs base {r.key} {r.metric}", "job": verb, "result": "FAIL" if bad else "PASS",
                         "value": said.get(r.verdict, f"{r.base} -> {r.new}"), "threshold": "no PASS -> FAIL",
                         "report": new_path})
    if verb == "bench" and pct is not None and not any(r.kind == "latency" and r.verdict not in ("gone", "new")
                                                       for _, r in table.iterrows()):
        rows.append({"check": "vs base p50", "job": verb, "result": "FAIL", "value": "no width timed in both runs",
                     "threshold": f"<= +{float(pct):g}% beyond noise", "report": new_path})
    if verb == "qualify" and th.get("no_new_fail") and not any(r["job"] == verb for r in rows):
        rows.append({"check": "vs base qualify statuses", "job": verb, "result": "PASS",
                     "value": "no case changed status", "threshold": "no PASS -> FAIL", "report": new_path})
    return rows


def _widths(o: dict) -> list[int]:
    """A gate job's widths (its model's every width by default)."""
    from ffnq.options import parse_widths
    from ffnq.spec import load_model

    return parse_widths(str(o.get("widths", "all")), load_model(o.get("model", "tiny")).max_tokens)


def job_options(opts: dict, verb: str):
    """A gate job's options -> the verb's validated options (the same checks as the verb's flags)."""
    from ffnq.verbs import job_options as for_verb

    # load_gate checked every value's type (OPTION_TYPES): only a number may need a cast (TOML 2 -> 2.0)
    kw = {k: float(v) if OPTION_TYPES[k][1] is is_number else v for k, v in opts.items() if k != "widths"}
    return for_verb(verb, widths=str(opts.get("widths", "all")), **kw)


def checks(verb: str, table: pd.DataFrame, th: dict, report: str) -> list[dict]:
    """One row per threshold this job's table is judged by: PASS, FAIL, or SKIP where the run gave
    it nothing to judge (a check that cannot fail is no PASS)."""
    rows = []

    def add(name, ok, value, limit):
        rows.append({"check": name, "job": verb, "result": "SKIP" if ok is None else "PASS" if ok else "FAIL",
                     "value": value, "threshold": limit, "report": report})

    if verb == "warm" and th.get("resident"):
        res = table.resident.astype(str) if "resident" in table else pd.Series("n/a", index=table.index)
        bad = table[res == "no"].width.tolist()
        na = table[~res.isin(["yes", "no"])].width.tolist()
        if len(na) == len(table):  # no width had an occupancy query (cpu): nothing was judged
            add("every width resident", None, "not judged: no occupancy query (resident n/a)", "all widths")
        else:
            add("every width resident", not bad, f"not resident: {bad or 'none'}" + (f"; n/a: {na}" if na else ""),
                "all widths")
    if verb == "qualify" and th.get("qualify_all_pass") and not len(table):
        add("every qualify case PASS", None, "not judged: no case ran", "all PASS")
    elif verb == "qualify" and th.get("qualify_all_pass"):
        bad = table[table.status != "PASS"]
        widths = bad.width if "width" in bad else [0] * len(bad)
        names = [f"{c} w={int(w)}" if w == w and int(w) else str(c) for c, w in zip(bad.case, widths)]
        more = f" and {len(names) - 8} more" if len(names) > 8 else ""
        add("every qualify case PASS", bad.empty,
            f"{len(table) - len(bad)}/{len(table)} PASS" + (f"; failed: {', '.join(names[:8])}{more}" if names else ""),
            "all PASS")
    if verb == "soak" and th.get("soak_clean"):
        error = table.attrs.get("error")
        n = {c: int(table[c].sum()) if c in table else 0 for c in ("mismatches", "stale", "disagree", "faults")}
        steps = int(table.steps.min()) if "steps" in table and len(table) else 0
        ok = not error and len(table) and not any(n.values())
        add("soak clean", bool(ok), f"{steps} steps on every rank, {n['mismatches']} mismatches, {n['stale']} stale, "
            f"{n['disagree']} disagreements, {n['faults']} faults" + (f"; {error}" if error else ""),
            "none, every step")
    if verb == "bench":
        limit = th.get("p50_us_max")
        if limit is not None:
            for _, r in table.iterrows():
                lim = limit.get(str(int(r.width))) if isinstance(limit, dict) else limit
                if lim is None:
                    continue
                p50 = r.get("p50_us")
                add(f"p50 w={int(r.width)}", p50 == p50 and p50 is not None and p50 <= float(lim),
                    f"{p50:.1f} us" if p50 == p50 else f"not timed ({r.get('check')})", f"<= {float(lim):g} us")
        for base in ("unfused", "stock", "stock_nccl", "stock_symm", "vllm", "vllm_nccl"):
            lo = th.get(f"speedup_{base}_min")
            if lo is None:
                continue
            for _, r in table.iterrows():
                sp = r.get(f"speedup_{base}", float("nan"))
                add(f"speedup_{base} w={int(r.width)}", sp == sp and sp >= float(lo),
                    f"{sp:.2f}x" if sp == sp else "no baseline", f">= {float(lo):g}x")
        if "check" in table and len(table):
            bad = table[table.check != "OK"].width.tolist()
            add("bench correct before timing", not bad, f"failed widths: {bad or 'none'}", "all OK")
    return rows


def junit(name: str, rows: pd.DataFrame, wall_s: float) -> str:
    fails, skips = int((rows.result == "FAIL").sum()), int((rows.result == "SKIP").sum())
    counts = f'tests="{len(rows)}" failures="{fails}" skipped="{skips}"'
    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<testsuites name={quoteattr("ffnq gate " + name)} {counts} time="{wall_s:.1f}">',
           f'  <testsuite name={quoteattr(name)} {counts} errors="0" time="{wall_s:.1f}">']
    for _, r in rows.iterrows():
        out.append(f'    <testcase classname={quoteattr("ffnq." + r.job)} name={quoteattr(r.check)}>')
        if r.result == "SKIP":
            out.append(f"      <skipped message={quoteattr(str(r.value))}/>")
        elif r.result != "PASS":
            msg = f"{r.value} (threshold {r.threshold})"
            out.append(f"      <failure message={quoteattr(msg)}>{escape(msg + '; report ' + str(r.report))}</failure>")
        out.append(f"      <system-out>{escape(str(r.value))}</system-out>")
        out.append("    </testcase>")
    out += ["  </testsuite>", "</testsuites>"]
    return "\n".join(out) + "\n"


def rebase_gate(cfg: dict, runs: list[tuple[str, pd.DataFrame, str]], margin_pct: float) -> list[str]:
    """gate --rebase after the run (verb, table, report folder per job): ffnq.gate_rebase, given
    the run's failed correctness checks and the widths the config's bench jobs run."""
    failed = [f"{r['check']} ({r['value']})" for verb, table, path in runs
              for r in checks(verb, table, CORRECT, path) if r["result"] == "FAIL"]
    widths = {w for verb, o in cfg["jobs"] if verb == "bench" for w in _widths(o)}
    return rebase(cfg, runs, margin_pct, failed, widths, load_gate)


@contextlib.contextmanager
def _the_configs(cfg: dict, i: int, verb: str):
    """A job's UsageError as the config's: the verb's words name a flag to change (its ``use``);
    in a gate the value is the config's job's."""
    try:
        yield
    except UsageError as e:
        raise UsageError(f"gate config {cfg['path']}: job {i + 1} ({verb}) asks for {e.what}; run this gate where "
                         f"its jobs can run, or pick another in configs/gates/") from None


def run_gate(config: str, out: Path, json_out: bool, rebase_margin: float | None = None) -> int:
    """Run a gate; with rebase_margin (a percentage), then rewrite its config from this run
    (ffnq.gate_rebase): exit 0 once rebased, whatever its budgets said of this run."""
    import time

    from ffnq.report import error_line, footer, saved, show_table, write_report
    from ffnq.verbs import meta, run_bench, run_qualify, run_soak, run_warm

    cfg = load_gate(config, rebasing=rebase_margin is not None)
    if rebase_margin is not None:
        check_rebase(cfg)
    jobs = []  # every job validated before any runs
    for i, (verb, o) in enumerate(cfg["jobs"]):
        with _the_configs(cfg, i, verb):
            jobs.append((verb, job_options(o, verb)))
    check_device(cfg, jobs)
    t0 = time.monotonic()
    rows, runs = [], []
    runners = {"warm": run_warm, "qualify": run_qualify, "bench": run_bench, "soak": run_soak}
    for i, (verb, opts) in enumerate(jobs):
        with _the_configs(cfg, i, verb):  # what a job refuses as it runs (a GPU, vLLM's kernels)
            table, path = runners[verb](opts, out, json_out)
        runs.append((verb, table, str(path)))
        rows += checks(verb, table, cfg["thresholds"], str(path))
        if verb in cfg["compare"]:
            rows += relative_checks(verb, cfg["compare"][verb], str(path), cfg["thresholds"])
    df = pd.DataFrame(rows, columns=["check", "job", "result", "value", "threshold", "report"])
    if df.empty:
        raise UsageError(f"gate config {cfg['path']}: no [thresholds] apply to its jobs; nothing to judge")
    fails, skips = int((df.result == "FAIL").sum()), int((df.result == "SKIP").sum())
    # every check SKIP: the gate judged nothing, which is no pass (exit 2, as a config whose
    # thresholds judge nothing), though its report says which checks and why
    idle = skips == len(df)
    verdict = (f"gate {cfg['name']}: {len(df)} checks, {fails} failed, {skips} skipped: "
               + ("FAILED" if fails else "NOTHING JUDGED" if idle else "OK"))
    show_table(df, json_out=json_out, title=f"gate {cfg['name']} ({cfg['path']})",
               columns=["check", "job", "result", "value", "threshold"])
    first = jobs[0][1]
    info = meta({"gate": cfg["name"], "config": cfg["path"], "thresholds": cfg["thresholds"],
                  "jobs": [[v, o.to_json()] for v, o in jobs]})
    path = write_report(out, "gate", first.backend, first.tp, df, meta=info, verdict=verdict,
                        extra_files={"junit.xml": junit(cfg["name"], df, time.monotonic() - t0)})
    footer(verdict, json_out)
    saved(path, json_out)
    if rebase_margin is not None:
        try:
            for line in rebase_gate(cfg, runs, rebase_margin):
                footer(line, json_out)
        except NotRebased as e:
            error_line(str(e))
            return 1
        return 0
    if idle:
        error_line(f"gate config {cfg['path']}: every check was skipped ({'; '.join(sorted(set(df.value)))}); "
             "nothing judged")
        return 2
    return 1 if fails else 0
