"""The handshake timeline of a run: per rank and CTA, a stamp at every phase boundary.

Ranks' clocks are first put on one axis (``t_common_ns``, the job's records). From that:
``handshake`` makes the terminal's table (arrival, wait, whom it waited for and skew per rank
and phase), ``chrome_trace`` a Perfetto trace and ``plot_timeline`` a Gantt per rank.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

# stamp pairs that bound each span of the trace (from, to)
SPANS = [("seam push", "start", "seam_arrive"), ("seam wait", "seam_arrive", "seam_done"),
         ("router", "seam_done", "router_done"), ("experts", "router_done", "experts_done"),
         ("reduce push", "experts_done", "reduce_arrive"), ("reduce wait", "reduce_arrive", "reduce_done"),
         ("handshake push", "reduce_done", "handshake_arrive"),
         ("handshake wait", "handshake_arrive", "handshake_done")]
PHASES = ("seam", "reduce", "handshake")
CLOCK_NOTE = ("Ranks' clocks are put on one axis by a measured offset: right after a common barrier "
              "every rank reads runner.clock_ns() and the values are all-gathered; offset_ns of a rank "
              "is the median over 9 rounds of (its reading - rank 0's). t_common_ns = t_ns - offset_ns. "
              "The error is the barrier's exit skew (gloo on one host: tens of us).")


def phase_profile(stamps, names: list[str]) -> dict[str, tuple[float, float]]:
    """One launch's timeline ``stamps`` [CTAs, len(names)] (ns on one clock, 0 where a CTA did not
    stamp): per stamp, when the median CTA and the latest CTA passed it, in us from the first CTA's
    start, in the order the median CTA passed them. A stamp before that start is an earlier
    launch's, left in a region no launch clears: not this launch's."""
    t = pd.DataFrame(stamps.tolist() if hasattr(stamps, "tolist") else stamps, columns=names).astype("int64")
    t0 = t["start"].where(t["start"] != 0).min()
    t = t.where(t >= t0)
    out = {n: (float((c.median() - t0) / 1e3), float((c.max() - t0) / 1e3)) for n, c in t.items() if c.notna().any()}
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


def handshake(timeline: pd.DataFrame, tp: int) -> pd.DataFrame:
    """Per case, rank and phase: arrival (us after the case's first start on any rank), the longest
    wait over CTAs (us), for whom it waited (the peer seen last), and skew against the first rank
    to arrive at that phase (us). On rank 0's clock (t_common_ns)."""
    if timeline is None or timeline.empty:
        return pd.DataFrame()
    rows = []
    for case, g in timeline.groupby("case", sort=False):
        t0 = g.loc[g.stamp == "start", "t_common_ns"].min()
        for ph in PHASES:
            per = []
            for rank, gr in g.groupby("rank"):
                arr = gr[gr.stamp == f"{ph}_arrive"]
                if arr.empty:
                    continue
                done = gr[gr.stamp == f"{ph}_done"].set_index("cta").t_common_ns
                a = arr.set_index("cta").t_common_ns
                wait = (done - a).dropna()
                last = _waited_for(gr, ph, int(rank))
                per.append({"case": case, "rank": int(rank), "phase": ph, "arrive_us": (a.min() - t0) / 1e3,
                            "wait_us": wait.max() / 1e3 if len(wait) else float("nan"),
                            "waited_for": f"rank {last.removeprefix(f'{ph}_seen')}" if last else "-",
                            "_a": a.min()})
            first = min((p["_a"] for p in per), default=0)
            for p in per:
                p["skew_us"] = (p.pop("_a") - first) / 1e3
                rows.append(p)
    return pd.DataFrame(rows)


def _waited_for(gr: pd.DataFrame, ph: str, rank: int) -> str:
    """The peer whose flag took longest to appear: every CTA's 'seen' stamps of the other ranks in
    time order from the first arrival; the stamp after the largest gap names it (a late peer holds
    up every CTA, whether they scan in turn, as on cpu, or in parallel). The rank's own flag is
    left out: a rank that arrived last would otherwise be shown waiting for itself."""
    seen = gr[gr.stamp.str.startswith(f"{ph}_seen") & (gr.stamp != f"{ph}_seen{rank}")].sort_values("t_common_ns")
    arr = gr.loc[gr.stamp == f"{ph}_arrive", "t_common_ns"]
    if seen.empty:
        return ""
    prev = arr.min() if len(arr) else seen.t_common_ns.min()
    best, who = -1, ""
    for stamp, t in zip(seen.stamp, seen.t_common_ns):
        if t - prev > best:
            best, who = t - prev, stamp
        prev = max(prev, t)
    return who


def chrome_trace(timeline: pd.DataFrame) -> dict:
    """Chrome trace events: one process per rank, one thread per CTA, a span per phase."""
    t0 = timeline.t_common_ns.min()
    ev = []
    for rank in sorted(timeline["rank"].unique()):
        ev.append({"name": "process_name", "ph": "M", "pid": int(rank), "args": {"name": f"rank {rank}"}})
        for cta in sorted(timeline.loc[timeline["rank"] == rank, "cta"].unique()):
            ev.append({"name": "thread_name", "ph": "M", "pid": int(rank), "tid": int(cta),
                       "args": {"name": f"CTA {cta}"}})
    for (case, rank, cta), g in timeline.groupby(["case", "rank", "cta"], sort=False):
        t = dict(zip(g.stamp, g.t_common_ns))
        for name, a, b in SPANS:
            if a in t and b in t and t[b] >= t[a]:
                ev.append({"name": name, "cat": case, "ph": "X", "pid": int(rank), "tid": int(cta),
                           "ts": (t[a] - t0) / 1e3, "dur": (t[b] - t[a]) / 1e3, "args": {"case": case}})
        for stamp, v in t.items():
            if "_seen" in stamp:
                ev.append({"name": stamp.replace("_seen", " saw rank "), "cat": case, "ph": "i", "s": "t",
                           "pid": int(rank), "tid": int(cta), "ts": (v - t0) / 1e3})
    return {"traceEvents": ev, "displayTimeUnit": "ns",
            "otherData": {"clock": CLOCK_NOTE, "ts_unit": "us on rank 0's clock"}}


def plot_timeline(timeline: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(timeline.case))[:6]
    fig, axes = plt.subplots(len(cases), 1, figsize=(10, 1.6 + 1.4 * len(cases)), squeeze=False)
    colors = dict(zip([s[0] for s in SPANS], plt.cm.tab10.colors))
    for ax, case in zip(axes[:, 0], cases):
        g = timeline[timeline.case == case]
        t0 = g.t_common_ns.min()
        labels = []
        for y, ((rank, cta), gc) in enumerate(g.groupby(["rank", "cta"])):
            t = dict(zip(gc.stamp, gc.t_common_ns))
            for name, a, b in SPANS:
                if a in t and b in t and t[b] >= t[a]:
                    ax.barh(y, (t[b] - t[a]) / 1e6, left=(t[a] - t0) / 1e6, color=colors[name], label=name)
            labels.append(f"r{rank} c{cta}")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(case, fontsize=9, loc="left")
        ax.set_xlabel("ms (rank 0's clock)")
    handles, names = axes[0, 0].get_legend_handles_labels()
    uniq = dict(zip(names, handles))
    fig.legend(uniq.values(), uniq.keys(), loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
