"""A qualify case's verdict on one rank, and the table of cases over every rank.

FAIL on any problem; else NOT CHECKED where a check could not read what it needs (a runner of
the original contract exposes only some regions): never PASS; else PASS. Over ranks a case is
PASS only when every rank passed and every rank wrote its row.
"""
from __future__ import annotations

import pandas as pd

NOT_CHECKED = "NOT CHECKED"


def judged(ev: dict, problems: list[str]) -> dict:
    """A case's status: FAIL on any problem; else NOT CHECKED where a check could not read what it
    needs (never PASS); else PASS. The evidence names both."""
    unread = ev["not_checked"] = list(dict.fromkeys(ev.get("not_checked") or []))
    ev["status"] = "FAIL" if problems else NOT_CHECKED if unread else "PASS"
    ev["evidence"] = "; ".join(problems + ([f"not checked: {', '.join(unread)}"] if unread else []))
    for k in ("worst_txt", "route_txt", "agree_txt", "over_bound"):
        ev.pop(k, None)
    return ev


def compact_fault(f) -> str:
    if not f:
        return ""
    if isinstance(f, str):
        return f
    return (f"r{f.get('rank')}:{f.get('phase_name')} e{f.get('epoch')} missing {f.get('missing_ranks')} "
            f"after {f.get('waited_ns', 0) / 1e6:.0f}ms")


def _at_margin(g: pd.DataFrame, col: str) -> float:
    """``col`` of the rank's row nearest its bound (rel_err / rel_bound largest)."""
    if col not in g or "margin" not in g or g["margin"].isna().all():
        return float(g[col].max()) if col in g else float("nan")
    return float(g.loc[g["margin"].idxmax(), col])


def summarize(cases: pd.DataFrame, tp: int | None = None) -> pd.DataFrame:
    """One row per case: PASS only when every rank passed (and, given ``tp``, every rank wrote its
    row: a case some rank did not finish, in a job cut short, is a FAIL); errors at the rank
    nearest its bound, counts summed."""
    rows = []
    for (case, width), g in cases.groupby(["case", "width"], sort=False):
        bad = g[g.status != "PASS"]
        num = lambda k: g[k].fillna(0) if k in g else pd.Series([0])  # noqa: E731
        said: dict[str, list[str]] = {}  # a text several ranks give, said once ("r0, r1: ...")
        for r, e in zip(bad["rank"], bad["evidence"].fillna("")):
            if e:
                said.setdefault(e, []).append(f"r{r}")
        evidence = [f"{', '.join(ranks)}: {e}" for e, ranks in said.items()]
        missing = sorted(set(range(tp)) - set(g["rank"])) if tp else []
        if missing:
            evidence.append(f"no row from rank(s) {', '.join(map(str, missing))}: the job was cut short")
        rows.append({
            "case": case, "width": int(width),
            "status": "FAIL" if (g.status == "FAIL").any() or missing else NOT_CHECKED if len(bad) else "PASS",
            "rel_err": _at_margin(g, "rel_err"), "rel_bound": _at_margin(g, "rel_bound"),
            "wrong": int(num("wrong").sum()), "disagree": int(num("disagree").sum()),
            "elements": int(num("elements").sum()),
            "route_agree": "not checked" if g.evidence.fillna("").str.contains("not checked: .*route", regex=True).any()
                           else f"{int(num('route_rows').sum() - num('route_mismatch').sum())}/{int(num('route_rows').sum())}"
                           + (f" ({int(num('route_excused').sum())} tie)" if num("route_excused").sum() else ""),
            "route_mismatch": int(num("route_mismatch").sum()),
            "fault": "; ".join(f for f in g["fault"].fillna("") if f),
            "wall_ms": float(g.wall_ms.max()),
            "evidence": "; ".join(evidence),
        })
    return pd.DataFrame(rows)
