"""Bench reports of one dev round side by side: python3 scripts/side_by_side.py [--metric x_floor] NAME=DIR...

One column per report (a variant's run, named NAME), one row per width; then each column over the
mean of the columns named like the first (the base, e.g. the default's two runs). Where each run
drew its own seed (touched experts differ from run to run), compare x_floor (p50 over the floor of
that run's own touched experts), not p50.
"""
import argparse
from pathlib import Path

import pandas as pd

from ffnq.report import load_report


def table(runs: list[tuple[str, Path]], metric: str) -> pd.DataFrame:
    cols = {}
    for name, d in runs:
        r = load_report(d)["tables"]["results"].set_index("width")
        key = name
        while key in cols:  # a variant run twice: name, name', name''
            key += "'"
        cols[key] = r[metric]
    return pd.DataFrame(cols)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="NAME=DIR: a bench report folder and the variant it ran")
    ap.add_argument("--metric", default="x_floor", help="a results column (x_floor, p50_us, touched_experts...)")
    a = ap.parse_args()
    runs = []
    for r in a.runs:
        name, sep, d = r.rpartition("=")  # a name may hold "=" (PN=3), a folder does not
        if not sep or not Path(d).is_dir():
            ap.error(f"{r!r}: need NAME=DIR, DIR a bench report folder")
        runs.append((name, Path(d)))
    t = table(runs, a.metric)
    base_name = runs[0][0]
    base = t[[c for c in t.columns if c.rstrip("'") == base_name]].mean(axis=1)
    pd.set_option("display.width", 250)
    print(f"{a.metric}, one column a run:")
    print(t.round(3).to_string())
    print(f"\nover {base_name}'s mean (1.000 = the same; above: slower):")
    print(t.div(base, axis=0).round(3).to_string())


if __name__ == "__main__":
    main()
