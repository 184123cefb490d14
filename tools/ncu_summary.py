"""Summarise the SASS table that `ncu --page source --csv --print-source sass` prints:
the kernel's warp-stall mix, its hottest instructions, and per loop (a run of instructions with
the same execution count above the kernel's entry count, i.e. a loop body) the SASS length, the
share of samples and the stall mix. Usage: python tools/ncu_summary.py w1-sass.csv [TOP]
"""
import sys

import pandas as pd

SAMPLES = "Warp Stall Sampling (All Samples)"
EXEC = "Instructions Executed"


def load(path: str) -> pd.DataFrame:
    d = pd.read_csv(path, skiprows=1)
    stalls = [c for c in d.columns if c.startswith("stall_") and "Not Issued" not in c]
    for c in stalls + [SAMPLES, EXEC]:
        d[c] = pd.to_numeric(d[c], errors="coerce").fillna(0)
    d.attrs["stalls"] = stalls
    return d


def mix(d: pd.DataFrame, n: int = 6) -> str:
    s = d[d.attrs["stalls"]].sum()
    s = (100 * s / max(1.0, d[SAMPLES].sum())).sort_values(ascending=False).head(n)
    return ", ".join(f"{k[6:]} {v:.1f}%" for k, v in s.items())


def loops(d: pd.DataFrame) -> list[tuple[int, int]]:
    """Runs of >= 40 instructions sharing one execution count above the entry count."""
    entry = d[EXEC].iloc[0]
    out, start = [], 0
    for i in range(1, len(d) + 1):
        if i == len(d) or d[EXEC].iloc[i] != d[EXEC].iloc[start]:
            if i - start >= 40 and d[EXEC].iloc[start] > entry:
                out.append((start, i))
            start = i
    return out


def main() -> None:
    d = load(sys.argv[1])
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    tot = d[SAMPLES].sum()
    print(f"{sys.argv[1]}: {len(d)} SASS instructions, {int(tot)} warp samples; stalls: {mix(d)}")
    for a, b in loops(d):
        x = d.iloc[a:b]
        gmma = int(x.Source.str.contains("GMMA").sum())
        print(f"loop [{a}, {b}): {b - a} instructions x {int(x[EXEC].iloc[0])} warp executions, {gmma} (Q/H)GMMA, "
              f"{100 * x[SAMPLES].sum() / tot:.1f}% of samples; stalls: {mix(x, 4)}")
    print("hottest instructions:")
    for i, r in d.sort_values(SAMPLES, ascending=False).head(top).iterrows():
        why = ", ".join(f"{c[6:]} {int(r[c])}" for c in d.attrs["stalls"] if r[c] > 0.1 * r[SAMPLES])
        print(f"  [{i}] {100 * r[SAMPLES] / tot:4.1f}%  {r.Source.strip()[:64]:64s} {why}")


if __name__ == "__main__":
    main()
