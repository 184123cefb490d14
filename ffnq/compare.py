"""ffnq compare BASE NEW: did this run get slower or less safe than a saved one?

Latency (bench reports): per width, the fused p50 and p99 and every baseline's p50. A delta is
judged against a noise band built from each run's own repeated samples: the standard error of
a run's median is about 0.98 (p90 - p50) / sqrt(steps) (the normal approximation of the
median's spread, with (p90 - p50) / 1.28 estimating the sample spread), the p99's three times
that; band = 3 x sqrt(se_base^2 + se_new^2), but never under 2% of the base (RUN_TO_RUN_PCT):
two runs of one kernel on two machines of one GPU model differ by about 1% at every width
while each run's own band is far narrower, a spread that one run's samples cannot show.
Verdict: ``faster`` / ``slower`` beyond the band,
else ``same``. Where both reports carry the fused step's SM clock (NVML, ffnq.gpu_clocks), a
``clock`` row per width says whether it moved by more than CLOCK_PCT: an H200 at its power cap
ran this kernel at 960-1965 MHz, and a latency delta beside a clock delta is the machine's.
Likewise a ``workload`` row per width where both carry the experts a step touched: two runs of
other seeds route their tokens to other experts, and at TP1's 12 tokens 54.8 against 60.2 experts
moved the p50 by 9% (H200, 2026-12-05); a latency delta beside a changed workload is the inputs'.
A width timed in one report only is a ``new`` or ``gone`` row (a gate fails a gone one: the base's
width no longer judged). Qualify reports: a case that changed status (``regressed`` PASS -> FAIL,
``fixed``, ``new``, ``gone``). Warm reports: a width whose residency or CTAs per CU changed.
Every job: a ``machine`` row where both reports name their host's GPUs, ``changed`` where the GPU
models differ (an H100's p50 is no regression of an H200's: its HBM reads 3.11 TB/s, not 4.4); a
``weights`` row where either run read a checkpoint (``--checkpoint``), ``changed`` where the two
read other weights (the ``workload`` rows then say whether their steps read as many bytes).
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from ffnq.errors import UsageError
from ffnq.report import load_report

BAND_SIGMAS = 3.0
RUN_TO_RUN_PCT = 2.0  # machine-to-machine spread the samples of one run cannot show
CLOCK_PCT = 2.0  # SM clocks further apart than this (a power cap on one run) explain a latency delta
COLUMNS = ["kind", "key", "metric", "base", "new", "delta_pct", "band_pct", "verdict"]
# the results columns each job's comparison reads (a bench whose every width failed its check
# before timing has no p50_us: it reads as untimed, NaN)
NEEDS = {"bench": ("width",), "qualify": ("case", "width", "status"), "warm": ("width",)}


def load(path: str | Path) -> dict:
    """A report folder (or its results.json) whose results table has what its job's comparison
    needs: refused here, before anything is compared or written, not by a KeyError midway."""
    p = Path(path)
    folder = p.parent if p.name == "results.json" else p
    doc = load_report(folder)
    doc["folder"] = str(folder)
    job, t = doc["job"], doc["tables"]["results"]
    if job not in NEEDS:
        return doc  # compare() names the jobs it compares
    if t.empty:
        raise UsageError(f"report {folder}: its {job} results table is empty; nothing to compare")
    missing = [c for c in NEEDS[job] if c not in t]
    if missing:
        raise UsageError(f"report {folder}: the {job} results table has no {', '.join(missing)} column; "
                         f"compare needs {', '.join(NEEDS[job])}")
    if job == "bench" and "p50_us" not in t:
        t["p50_us"] = float("nan")
    for c in [c for c in t.columns if c == "width" or c.endswith(("_us", "steps")) or c == "sm_mhz"]:
        num = pd.to_numeric(t[c], errors="coerce")  # a null (an untimed width) is NaN, not a string
        if (num.isna() & t[c].notna()).any():
            raise UsageError(f"report {folder}: column {c} of the results table holds "
                             f"{t[c][num.isna() & t[c].notna()].iloc[0]!r}; need numbers")
        t[c] = num
    w = t.width  # bench and warm rows are keyed by width alone; qualify's by case and width
    if (w.isna() | (w % 1 != 0)).any() or (job != "qualify" and w.duplicated().any()):
        raise UsageError(f"report {folder}: results table widths {w.tolist()}: need whole numbers"
                         + ("" if job == "qualify" else ", one row per width"))
    return doc


def _se(row, metric: str) -> float:
    """The standard error of one run's ``metric`` (us) from its own samples: the fused step's
    p50/p99 from its p90 and steps, a baseline's ``<name>_p50_us`` from its ``<name>_p90_us`` and
    ``<name>_steps`` (NaN where the report has no spread: the RUN_TO_RUN_PCT floor alone)."""
    pre = "" if metric in ("p50_us", "p99_us") else metric[: -len("p50_us")]
    n = row.get(f"{pre}steps")
    spread = row.get(f"{pre}p90_us", float("nan")) - row.get(f"{pre}p50_us", float("nan"))
    if not n or n != n or spread != spread:
        return float("nan")
    return 0.98 * max(spread, 0.0) / math.sqrt(n) * (3.0 if metric == "p99_us" else 1.0)


def latency_rows(base: pd.DataFrame, new: pd.DataFrame) -> list[dict]:
    rows = []
    b, n = base.set_index("width"), new.set_index("width")
    metrics = ["p50_us", "p99_us"] + [c for c in base.columns if c.endswith("_p50_us") and c in new.columns]
    for w in sorted(set(b.index) ^ set(n.index)):
        gone = w in b.index
        rows.append({"kind": "latency", "key": f"w={int(w)}", "metric": "p50_us",
                     "base": b.loc[w].get("p50_us") if gone else None, "new": None if gone else n.loc[w].get("p50_us"),
                     "delta_pct": None, "band_pct": None, "verdict": "gone" if gone else "new"})
    for w in sorted(set(b.index) & set(n.index)):
        rb, rn = b.loc[w], n.loc[w]
        for m in metrics:
            vb, vn = rb.get(m), rn.get(m)
            if vb is None or vn is None or vb != vb or vn != vn:
                continue
            se = math.sqrt(_se(rb, m) ** 2 + _se(rn, m) ** 2)
            band = max(BAND_SIGMAS * se if se == se else 0.0, RUN_TO_RUN_PCT / 100 * vb)
            delta = vn - vb
            verdict = "slower" if delta > band else "faster" if delta < -band else "same"
            rows.append({"kind": "latency", "key": f"w={int(w)}", "metric": m, "base": vb, "new": vn,
                         "delta_pct": 100 * delta / vb, "band_pct": 100 * band / vb, "verdict": verdict})
        vb, vn = rb.get("sm_mhz"), rn.get("sm_mhz")
        if vb is not None and vn is not None and vb == vb and vn == vn:  # why two runs differ, when they do
            delta = 100 * (vn - vb) / vb
            rows.append({"kind": "clock", "key": f"w={int(w)}", "metric": "sm_mhz", "base": vb, "new": vn,
                         "delta_pct": delta, "band_pct": CLOCK_PCT,
                         "verdict": "changed" if abs(delta) > CLOCK_PCT else "same"})
        vb, vn = rb.get("touched_experts"), rn.get("touched_experts")
        if vb is not None and vn is not None and vb == vb and vn == vn and vb > 0:  # the bytes each step read
            delta = 100 * (vn - vb) / vb
            rows.append({"kind": "workload", "key": f"w={int(w)}", "metric": "touched_experts", "base": vb,
                         "new": vn, "delta_pct": delta, "band_pct": 0.0,
                         "verdict": "same" if vn == vb else "changed"})
    return rows


# cases renamed, not changed: (old name, width) -> the name reports use since. Width 1's padding
# case (its one row padded) was "correct+padding" until bb27572; a base written before is still
# a base for it (2xH200's gate base is such a report)
RENAMED = {("correct+padding", 1): "all-padding"}


def qualify_rows(base: pd.DataFrame, new: pd.DataFrame) -> list[dict]:
    key = lambda t: {f"{RENAMED.get((c, int(w)), c)} @{int(w)}": s  # noqa: E731
                     for c, w, s in zip(t.case, t.width, t.status)}
    kb, kn = key(base), key(new)
    rows = []
    for k in sorted(set(kb) | set(kn)):
        sb, sn = kb.get(k), kn.get(k)
        if sb == sn:
            continue
        verdict = ("new" if sb is None else "gone" if sn is None else
                   "regressed" if sb == "PASS" else "fixed" if sn == "PASS" else "changed")
        rows.append({"kind": "qualify", "key": k, "metric": "status", "base": sb, "new": sn,
                     "delta_pct": None, "band_pct": None, "verdict": verdict})
    return rows


def warm_rows(base: pd.DataFrame, new: pd.DataFrame) -> list[dict]:
    rows = []
    b, n = base.set_index("width"), new.set_index("width")
    for w in sorted(set(b.index) & set(n.index)):
        for m in ("resident", "ctas_per_cu"):
            vb, vn = str(b.loc[w].get(m)), str(n.loc[w].get(m))
            if vb != vn:
                rows.append({"kind": "residency", "key": f"w={int(w)}", "metric": m, "base": vb, "new": vn,
                             "delta_pct": None, "band_pct": None,
                             "verdict": "regressed" if m == "resident" and vn == "no" else "changed"})
    return rows


def gpu_models(doc: dict) -> str | None:
    """The GPU models of a report's host ("NVIDIA H200"; "no GPU"), None where it does not say."""
    m = doc.get("machine")
    if not isinstance(m, dict) or not isinstance(m.get("gpus"), list):
        return None
    return ", ".join(sorted({str(g["name"]) for g in m["gpus"] if isinstance(g, dict) and g.get("name")})) or "no GPU"


def machine_rows(base: dict, new: dict) -> list[dict]:
    gb, gn = gpu_models(base), gpu_models(new)
    if gb is None or gn is None:
        return []
    return [{"kind": "machine", "key": "gpus", "metric": "model", "base": gb, "new": gn, "delta_pct": None,
             "band_pct": None, "verdict": "same" if gb == gn else "changed"}]


def weights_source(doc: dict) -> str | None:
    """What a report's job read as weights ("checkpoint NAME layer N"; "synthetic"), None where it
    does not say."""
    conf = doc.get("config")
    if not isinstance(conf, dict) or "checkpoint" not in conf:
        return None
    if not conf["checkpoint"]:
        return "synthetic"
    return f"checkpoint {Path(str(conf['checkpoint'])).name} layer {conf.get('checkpoint_layer')}"


def weights_rows(base: dict, new: dict) -> list[dict]:
    wb, wn = weights_source(base), weights_source(new)
    if wb is None or wn is None or wb == wn == "synthetic":  # the seed's weights: the workload rows tell
        return []
    return [{"kind": "weights", "key": "weights", "metric": "source", "base": wb, "new": wn, "delta_pct": None,
             "band_pct": None, "verdict": "same" if wb == wn else "changed"}]


def compare(base: dict, new: dict) -> pd.DataFrame:
    jb, jn = base.get("job"), new.get("job")
    if jb != jn:
        raise UsageError(f"compare: a {jb} report against a {jn} report; compare two of one job")
    tb, tn = base["tables"]["results"], new["tables"]["results"]
    rows = {"bench": latency_rows, "qualify": qualify_rows, "warm": warm_rows}.get(jb)
    if rows is None:
        raise UsageError(f"compare: {jb} reports are not compared (bench, qualify, warm are)")
    if jb == "bench" and not (tb.p50_us.notna().any() or tn.p50_us.notna().any()):
        raise UsageError(f"compare {base.get('folder', 'base')} -> {new.get('folder', 'new')}: neither report "
                         "timed a width (no p50_us); nothing to compare")
    return pd.DataFrame(machine_rows(base, new) + weights_rows(base, new) + rows(tb, tn), columns=COLUMNS)


def counts(table: pd.DataFrame) -> str:
    """Verdicts counted per kind of row, e.g. "latency: 28 same, 2 slower; clock: 10 same" (a
    clock row's "same" is not a latency's)."""
    return "; ".join(f"{kind}: " + ", ".join(f"{n} {v}" for v, n in sorted(g.verdict.value_counts().items()))
                     for kind, g in table.groupby("kind", sort=False))


def plot(base: pd.DataFrame, new: pd.DataFrame, path: Path, labels: tuple[str, str]) -> None:
    """p50 (and p99) against width for both runs; the legend beside the axes, never over a curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for t, label, style in ((base, labels[0], "o--"), (new, labels[1], "s-")):
        ax.plot(t.width, t.p50_us, style, label=f"{label} p50")
        if "p99_us" in t:
            ax.plot(t.width, t.p99_us, style, alpha=0.4, label=f"{label} p99")
    widths = sorted(set(base.width.dropna().astype(int)) | set(new.width.dropna().astype(int)))
    ax.set_xticks(widths)
    ax.set_xlabel("width (tokens)")
    ax.set_ylabel("latency per step (us)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
