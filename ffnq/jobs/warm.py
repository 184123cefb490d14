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
            row = {"width": s, "rank": job.rank, "kernel": d.get("kernel", ""),
                   "compile_s": d.get("compile_s", wall / len(opts["widths"])),
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
        first["compile_s"] = float(pd.to_numeric(g.compile_s, errors="coerce").max())
        first["resident"] = "no" if "no" in res else ("yes" if res == {"yes"} else "n/a")
        first.pop("rank", None)
        out.append(first)
    cols = ["width", "kernel", "compile_s", "resources", "ctas_per_cu", "cus", "grid", "resident"]
    return pd.DataFrame(out)[cols]


def offline(backend: str, runner: str | None, model: str, tp: int, experts: str, widths: str, target: str):
    """The offline residency table of a GPU backend for ``target``; (DataFrame, backend)."""
    import importlib

    from ffnq.spec import Experts, load_model

    if target not in TARGETS:
        raise UsageError(f"--target {target!r}: allowed {', '.join(TARGETS)}")
    be = runner or backend
    if be == "auto":
        be = "triton"
    if be not in ("triton", "flydsl"):
        raise UsageError(f"offline residency for {be}/{target} not available: only the triton and flydsl "
                         f"backends have one (use --backend triton or flydsl)")
    spec = load_model(model)
    try:
        mode = Experts(experts)
    except ValueError:
        raise UsageError(f"--experts {experts!r}: allowed {', '.join(e.value for e in Experts)}") from None
    spec.check(tp, mode)
    ws = parse_widths(widths, spec.max_tokens)
    try:
        mod = importlib.import_module(f"ffnq.backends.{be}.offline")
        table = mod.warm_table(spec, tp, mode, target, ws)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"offline residency for {be}/{target} not available: {e}") from None
    df = table if isinstance(table, pd.DataFrame) else pd.DataFrame(list(table))
    if "resident" in df:  # the offline table says True/False; a width that failed to compile is not resident
        df["resident"] = [("yes" if v is True or v == "yes" else "no" if v in (False, "no") else str(v))
                          for v in df.resident]
        if "error" in df:
            df.loc[df.error.fillna("").astype(str) != "", "resident"] = "no"
    return shape(df), be


def shape(df: pd.DataFrame) -> pd.DataFrame:
    """warm's columns; every other fact of a row goes into ``resources`` as k=v."""
    cols = ["width", "kernel", "compile_s", "resources", "ctas_per_cu", "cus", "grid", "resident"]
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
