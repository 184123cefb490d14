"""Where does a bench's p90 come from? Every replay's time beside the GPU's clocks (run on a GPU).

    python scripts/replay_spread.py [--widths 6,7,16] [--replays 1500] [--out DIR]
    python scripts/replay_spread.py --idle-ms 250,500,1000 [--burst-ms 250] [--bursts 6]

TP1, the bench's shape: one CUDA graph per width walks ROTATE_SETS_GPU weight sets (cold L2),
the same inputs every replay, replays back to back. Each replay's start and length come from its
own pair of events (start relative to one event recorded while the GPU was idle, so it maps onto
the host clock); beside it `nvidia-smi` samples the SM and memory clocks, power, temperature and
the active clock-event (throttle) reasons every 20 ms. The step is checked against the fp64
reference first. Prints per width: p50 / p90 / p99, the share of replays over 1.05 x p50, the
lag-1 autocorrelation of the samples (near 0: replay to replay; near 1: slow stretches, such as
a clock drop), and the SM clock and power over the fast and the slow replays. Writes samples.csv,
clocks.csv, summary.md and spread.png under --out.

With --idle-ms, instead: per width and idle length, --bursts bursts of --burst-ms of replays,
each the bench's own burst (ffnq.timing.time_steps: that long idle, three untimed replays), the
clocks polled through NVML (ffnq.gpu_clocks.ClockWatch) during each: how long an idle keeps a
timed window under the power cap (the bench's --idle-ms).
"""
import argparse
import csv
import io
import json
import os
import statistics
import subprocess
import time
from datetime import datetime, timezone

import torch

from ffnq import reference
from ffnq.backends.triton import TritonRunner
from ffnq.gpu_clocks import ClockWatch
from ffnq.jobs.bench import ROTATE_SETS_GPU
from ffnq.spec import Experts, load_model
from ffnq.timing import quantiles_us, time_steps
from ffnq.weights import shard, synthetic

QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"


def sampler(path: str) -> subprocess.Popen:
    """nvidia-smi writing one CSV line per 20 ms to ``path`` until terminated (drivers before the
    clock-event name know the field as clocks_throttle_reasons)."""
    q = QUERY
    if subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv"], capture_output=True).returncode:
        q = q.replace("clocks_event_reasons", "clocks_throttle_reasons")
    f = open(path, "w")
    return subprocess.Popen(["nvidia-smi", "-i", "0", f"--query-gpu={q}", "--format=csv,noheader,nounits",
                             "-lms", "20"], stdout=f, stderr=subprocess.STDOUT)


def read_clocks(path: str) -> list[dict]:
    rows = []
    for r in csv.reader(io.StringIO(open(path).read())):
        if len(r) < 6:
            continue
        try:
            t = datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append(dict(t=t, sm_mhz=float(r[1]), mem_mhz=float(r[2]), power_w=float(r[3]),
                             temp_c=float(r[4]), reasons=r[5].strip()))
        except ValueError:
            continue
    return rows


def time_replays(call, n: int) -> tuple[list[float], list[float], float]:
    """(start ms after t0, length us) of ``n`` back-to-back calls; t0 on the host clock."""
    torch.cuda.synchronize()
    e0 = torch.cuda.Event(enable_timing=True)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    t0 = time.time()
    e0.record()
    for a, b in ev:
        a.record()
        call()
        b.record()
    torch.cuda.synchronize()
    return [e0.elapsed_time(a) for a, _ in ev], [a.elapsed_time(b) * 1e3 for a, b in ev], t0


def lag1(x: list[float]) -> float:
    t = torch.tensor(x, dtype=torch.float64)
    t = t - t.mean()
    return float((t[1:] * t[:-1]).sum() / (t * t).sum())


def graph_of(r, spec, full, sets, s, dev):
    """The width's checked step, then a CUDA graph walking every weight set (the bench's step)."""
    g = torch.Generator().manual_seed(50_000 + s)
    part = torch.randn(s, spec.hidden, generator=g).to(torch.bfloat16).to(dev)
    resid = torch.randn(s, spec.hidden, generator=g).to(torch.bfloat16).to(dev)
    slots = torch.arange(s, dtype=torch.int64, device=dev)
    out, _ = r(part, resid, sets[0], slots)
    ref = reference.step([part], resid, slots, full, spec, Experts.ALL, follow=r.chosen(s))
    c = reference.compare(out, ref.out)
    assert c["rel_err"] <= reference.MAX_REL_ERR and r.fault(s) is None, (s, c["rel_err"], r.fault(s))
    for w in sets:
        r(part, resid, w, slots)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in sets:
            r(part, resid, w, slots)
    return graph, c["rel_err"]


def bursts(a, r, spec, full, sets, widths, dev, pb):
    print("NVML:", "yes" if ClockWatch(dev).nvml is not None else "no (no clock columns)", flush=True)
    rows = []
    for s in widths:
        graph, rel = graph_of(r, spec, full, sets, s, dev)
        for _ in range(20):
            graph.replay()
        n = max(5, int(a.burst_ms * 1e3 / statistics.median(time_steps(graph.replay, 20, device=dev))))
        for ms in [float(x) for x in a.idle_ms.split(",")]:
            got, watch = [], []
            for _ in range(a.bursts):  # the bench's burst (ffnq.timing): idle, 3 untimed replays, n timed
                w = ClockWatch(dev)
                got += [x / len(sets) for x in time_steps(graph.replay, n, device=dev, idle_s=ms / 1e3, watch=w)]
                watch.append(w.summary())
            q = quantiles_us(got)
            rows.append(dict(width=s, idle_ms=ms, bursts=a.bursts, replays=n, p50=q["p50_us"], p90=q["p90_us"],
                             p99=q["p99_us"], capped_pct=statistics.mean(x.get("capped_pct", float("nan")) for x in watch),
                             sm_mhz_min=min(x.get("sm_mhz_min", float("nan")) for x in watch),
                             power_w=max(x.get("power_w", float("nan")) for x in watch), rel_err=rel))
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(a.out, "bursts.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    pb.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="6,7,16")
    ap.add_argument("--replays", type=int, default=1500)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "spread"))
    ap.add_argument("--idle-ms", default="", help="burst mode: idle lengths to compare, e.g. 250,500,1000")
    ap.add_argument("--burst-ms", type=float, default=250.0)
    ap.add_argument("--bursts", type=int, default=6)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    spec = load_model("minimax-m2")
    widths = [int(x) for x in a.widths.split(",")]
    R = TritonRunner.for_device(dev)
    pb = R.open_peers(spec, 1, 0, dev, "ffnq-spread")
    full = synthetic(spec, seed=3, device=dev)
    sets = [shard(full, spec, 1, 0, Experts.ALL, device=dev)] + [
        shard(synthetic(spec, seed=3 + i, device=dev), spec, 1, 0, Experts.ALL, device=dev)
        for i in range(1, ROTATE_SETS_GPU)]
    r = R(1, 0, pb.sym, pb.peers, dev, widths=widths, experts=Experts.ALL, model=spec, timeout=0.2)
    r.warm(sets[0])
    if a.idle_ms:
        return bursts(a, r, spec, full, sets, widths, dev, pb)
    clk_path = os.path.join(a.out, "clocks.csv.raw")
    smi = sampler(clk_path)
    time.sleep(0.3)
    samples, summary = [], []
    try:
        for s in widths:
            graph, rel = graph_of(r, spec, full, sets, s, dev)
            for _ in range(200):  # warm-up, as the bench's warmup_ms
                graph.replay()
            starts, us, t0 = time_replays(graph.replay, a.replays)
            us = [x / len(sets) for x in us]
            samples += [dict(width=s, i=i, t=t0 + st / 1e3, us=u) for i, (st, u) in enumerate(zip(starts, us))]
            q = quantiles_us(us)
            summary.append(dict(width=s, rel_err=rel, p50=q["p50_us"], p90=q["p90_us"], p99=q["p99_us"],
                                slow_share=sum(u > 1.05 * q["p50_us"] for u in us) / len(us), lag1=lag1(us),
                                t_lo=t0 + starts[0] / 1e3, t_hi=t0 + starts[-1] / 1e3))
            time.sleep(0.3)  # an idle stretch between widths, visible in the clocks
    finally:
        smi.terminate()
        smi.wait()
    clocks = read_clocks(clk_path)
    os.replace(clk_path, os.path.join(a.out, "clocks.raw.txt"))
    with open(os.path.join(a.out, "samples.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(samples[0]))
        w.writeheader()
        w.writerows(samples)
    if clocks:
        with open(os.path.join(a.out, "clocks.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(clocks[0]))
            w.writeheader()
            w.writerows(clocks)

    def near(t):  # the clock sample closest in time
        return min(clocks, key=lambda c: abs(c["t"] - t)) if clocks else None

    lines = [f"# Replay spread, TP1 minimax-m2, {torch.cuda.get_device_name(dev)}, commit "
             f"{os.environ.get('FFNQ_COMMIT', '?')}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"`python scripts/replay_spread.py --widths {a.widths} --replays {a.replays}`; "
             f"{ROTATE_SETS_GPU} weight sets per replay, us per launch", "",
             "| width | p50 | p90 | p99 | share > 1.05 p50 | lag-1 autocorr | SM MHz fast / slow | W fast / slow | "
             "clock-event reasons seen |", "|---|---|---|---|---|---|---|---|---|"]
    for row in summary:
        mine = [x for x in samples if x["width"] == row["width"]]
        fast = [near(x["t"]) for x in mine if x["us"] <= 1.05 * row["p50"]]
        slow = [near(x["t"]) for x in mine if x["us"] > 1.05 * row["p50"]]
        span = [c for c in clocks if row["t_lo"] <= c["t"] <= row["t_hi"]]

        def med(cs, k):
            cs = [c[k] for c in cs if c]
            return f"{statistics.median(cs):.0f}" if cs else "-"
        reasons = sorted({c["reasons"] for c in span})
        lines.append(f"| {row['width']} | {row['p50']:.1f} | {row['p90']:.1f} | {row['p99']:.1f} | "
                     f"{row['slow_share']:.3f} | {row['lag1']:.2f} | {med(fast, 'sm_mhz')} / {med(slow, 'sm_mhz')} | "
                     f"{med(fast, 'power_w')} / {med(slow, 'power_w')} | {', '.join(reasons) or '-'} |")
    lines += ["", f"clock samples: {len(clocks)} (nvidia-smi every 20 ms); "
              f"rel_err of each width's checked step: " + ", ".join(f"{r_['rel_err']:.2e}" for r_ in summary)]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    open(os.path.join(a.out, "summary.md"), "w").write(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(len(summary), 1, figsize=(10, 3 * len(summary)), squeeze=False)
        for ax, row in zip(axes[:, 0], summary):
            mine = [x for x in samples if x["width"] == row["width"]]
            t0 = mine[0]["t"]
            ax.plot([(x["t"] - t0) * 1e3 for x in mine], [x["us"] for x in mine], ".", ms=2)
            ax.set_ylabel(f"w{row['width']} us/launch")
            span = [c for c in clocks if row["t_lo"] - 0.1 <= c["t"] <= row["t_hi"] + 0.1]
            if span:
                ax2 = ax.twinx()
                ax2.plot([(c["t"] - t0) * 1e3 for c in span], [c["sm_mhz"] for c in span], "r-", lw=1)
                ax2.set_ylabel("SM MHz", color="r")
        axes[-1, 0].set_xlabel("ms since the width's first replay")
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "spread.png"), dpi=80)
    except Exception as e:  # noqa: BLE001 (the numbers above are the result; the plot is a view)
        print("plot:", e)
    pb.close()


if __name__ == "__main__":
    main()
