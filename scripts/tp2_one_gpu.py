"""TP2's fused kernel on one GPU: both ranks in one process, each a cooperative grid of half the
device's CTA slots (132 CTAs on an H200), launched on two streams so the two grids are resident
together; the peer buffers are two buffers of the same GPU. Where no two-GPU machine is lent this
is the only way to run the TP2 builds (the seam and reduce exchanges, the handshake, the fault
protocol) on hardware. It checks correctness; its step times (``--time``) only compare builds
side by side: two ranks share one HBM and one L2, each on half the SMs, and the links are local
stores, so they say nothing of 2xH200.

    python scripts/tp2_one_gpu.py [--widths 1-16] [--timeout 0.2] [--out reports] [--time 1,4,16]

Per width: a fresh random step (one padding row from 3 tokens) against the fp64 reference on
both ranks (outputs poisoned with NaN before the step, routing compared, no fault), the final
(handshake) build at every 4th width; then the same inputs twice (bitwise equal), a CUDA graph
of both ranks' launches replayed on fresh inputs, rank 1 held at kernel start under and over the
timeout (under: correct, no fault; over: both ranks record rank 1 missing, no hang) and a reset.
Writes <out>/<stamp>-tp2-on-one-gpu-triton-tp2/ (results.csv, summary.md); exit 1 on a failure.
``--time``: those widths' paired step timed as the bench times a width (a CUDA graph of one step
on each of the bench's weight sets, so the experts come from HBM; the median of 200 replays).
Both ranks still share one GPU: a figure to compare build choices side by side in one call,
not a TP2 time. Nor are the builds the shipped ones: at half the grid each CTA holds twice the
router's and seam's share, and the builds take more registers (TP2's 2-6 tokens spill at 132,
not at 264), so each timed line names its build's registers and spills. The grids must be
resident together, both variants (plain and handshake) counted: a pair that does not fit is
refused before any step.
"""
from __future__ import annotations

import argparse
import sys
import time

import pandas as pd
import torch

from ffnq import reference, report
from ffnq.backends import symm
from ffnq.backends.triton import TritonRunner
from ffnq.errors import UsageError
from ffnq.jobs.bench import ROTATE_SETS_GPU
from ffnq.jobs.rank import step_inputs
from ffnq.launch import parse_widths
from ffnq.spec import Experts, load_model
from ffnq.timing import StepTimer, quantiles_us
from ffnq.weights import shard, synthetic

TP = 2


class Pair:
    """Two ranks' runners on one device, stepped together on two streams."""

    def __init__(self, spec, widths, blocks, timeout, dev):
        cls = TritonRunner.with_grid(blocks)
        nb = cls.peer_bytes(spec, TP)
        self.bufs = [torch.zeros(nb, dtype=torch.uint8, device=dev) for _ in range(TP)]
        for b in self.bufs:
            symm.BUFFERS[b.data_ptr()] = b
        peers = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64, device=dev)
        self.rs = [cls(TP, k, self.bufs[k].data_ptr(), peers, dev, widths=widths, model=spec, timeout=timeout)
                   for k in range(TP)]
        self.streams = [torch.cuda.Stream(dev) for _ in range(TP)]
        self.dev = dev

    def close(self):
        for b in self.bufs:
            symm.BUFFERS.pop(b.data_ptr(), None)

    def launch(self, parts, resid, ws, slots, outs, final=False):
        """Both ranks' launches, each on its stream, joined to the current stream; writes into
        ``outs`` (per rank: out, res_out) so a caller can poison them first."""
        cur = torch.cuda.current_stream(self.dev)
        ev = cur.record_event()
        for k, (r, st) in enumerate(zip(self.rs, self.streams)):
            st.wait_event(ev)
            with torch.cuda.stream(st):
                # the runner's launch with our outputs (its __call__ allocates fresh ones; these
                # are poisoned by the caller, so a row the kernel skips shows as NaN)
                s = r.check_inputs(parts[k], resid, slots)
                r._launch(s, r._args(s, parts[k], resid, slots, *outs[k], ws[k]), final)
        for st in self.streams:
            cur.wait_stream(st)


def inputs(spec, s, seed, dev, pad=True):
    """The jobs' inputs (ffnq.jobs.rank.step_inputs): one padding row from 3 tokens."""
    return step_inputs(spec, TP, 0, s, seed, padding=int(pad and s >= 3), device=dev)


def poisoned(parts, resid):
    return [(torch.full_like(p, float("nan")), torch.full_like(resid, float("nan"))) for p in parts]


def judge(pair, s, parts, resid, slots, outs, full, spec, cache) -> dict:
    """Both ranks' outputs against the fp64 reference (each rank's routing followed on near ties)."""
    keep = torch.nonzero(slots >= 0).flatten()
    row = dict(rel_err=0.0, res_rel=0.0, wrong=0, route_ok=True, pad_zero=True, same_on_ranks=True, faults=[])
    for k, r in enumerate(pair.rs):
        ref = reference.step(parts, resid, slots, full, spec, Experts.ALL, cache=cache, follow=r.chosen(s))
        c = reference.compare(outs[k][0], ref.out, rows=keep)
        cr = reference.compare(outs[k][1], ref.res_out)
        row["rel_err"] = max(row["rel_err"], c["rel_err"])
        row["res_rel"] = max(row["res_rel"], cr["rel_err"])
        row["wrong"] += c["wrong"] + cr["wrong"]
        row["route_ok"] &= bool(torch.equal(r.chosen(s), ref.chosen))
        row["pad_zero"] &= bool((outs[k][0][slots < 0].float() == 0).all())
        f = r.fault(s)
        if f is not None:
            row["faults"].append(dict(f, rank=k))
    row["same_on_ranks"] = bool(torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]))
    row["ok"] = (row["rel_err"] <= reference.MAX_REL_ERR and row["res_rel"] <= reference.MAX_REL_ERR
                 and row["wrong"] == 0 and row["route_ok"] and row["pad_zero"] and row["same_on_ranks"]
                 and not row["faults"])
    row["rel_err"], row["res_rel"] = round(row["rel_err"], 5), round(row["res_rel"], 5)
    return row


def step_check(pair, s, seed, full, spec, ws, cache, final=False) -> dict:
    parts, resid, slots = inputs(spec, s, seed, pair.dev)
    outs = poisoned(parts, resid)
    pair.launch(parts, resid, ws, slots, outs, final)
    torch.cuda.synchronize(pair.dev)
    return judge(pair, s, parts, resid, slots, outs, full, spec, cache)


def graph_check(pair, s, full, spec, ws, cache, steps=8) -> dict:
    """A CUDA graph of ``steps`` paired launches (as the bench replays them), run on fresh inputs
    copied into its static ones; the last step checked, the replay timed as a sanity figure."""
    parts, resid, slots = inputs(spec, s, 70 + s, pair.dev, pad=False)
    outs = poisoned(parts, resid)
    pair.launch(parts, resid, ws, slots, outs)  # warm the streams before capture
    torch.cuda.synchronize(pair.dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(steps):
            pair.launch(parts, resid, ws, slots, outs)
    new_parts, new_resid, _ = inputs(spec, s, 90 + s, pair.dev, pad=False)
    for p, q in zip(parts, new_parts):
        p.copy_(q)
    resid.copy_(new_resid)
    for o in outs:
        o[0].fill_(float("nan")), o[1].fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize(pair.dev)
    row = judge(pair, s, parts, resid, slots, outs, full, spec, cache)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(10):
        g.replay()
    t1.record()
    torch.cuda.synchronize(pair.dev)
    row["graph_step_us"] = round(t0.elapsed_time(t1) * 1e3 / (10 * steps), 1)
    return row


def timed_inputs(spec, s, dev):
    """The inputs cold_step_us times width ``s`` on (no padding row)."""
    return inputs(spec, s, 60 + s, dev, pad=False)


def cold_step_us(pair, spec, s, wsets, samples: int = 200) -> float:
    """p50 us of one paired step with the weights rotating over ``wsets`` (each more than the L2
    holds), replayed as a CUDA graph of one step per set, as the bench times a width: a
    side-by-side proxy for build choices, not a 2xH200 step time."""
    parts, resid, slots = timed_inputs(spec, s, pair.dev)
    outs = poisoned(parts, resid)

    def cycle():
        for w in wsets:
            pair.launch(parts, resid, w, slots, outs)
    cycle()  # every set read once, eagerly, before the capture (TritonRunner.settle's contract)
    torch.cuda.synchronize(pair.dev)
    samples_us = StepTimer(cycle, device=pair.dev, graph=True)(samples, warmup=20)
    return quantiles_us(samples_us)["p50_us"] / len(wsets)


def rotating_sets(spec, ws, dev) -> list:
    """Both ranks' shards of set 0 (``ws``) and of as many more synthetic sets as the bench
    rotates (ffnq.jobs.bench.ROTATE_SETS_GPU), each set made once and sharded for every rank."""
    sets = [ws]
    for i in range(1, ROTATE_SETS_GPU):
        full = synthetic(spec, seed=3 + i, device=dev)
        sets.append([shard(full, spec, TP, k, Experts.ALL, device=dev) for k in range(TP)])
        del full
    return sets


def inject_checks(pair, s, full, spec, ws, cache, timeout) -> list[dict]:
    """Rank 1 held at kernel start (every CTA spins on the clock) under and over the timeout."""
    rows = []
    for case, delay in (("under", int(timeout * 0.2e9)), ("over", int(timeout * 3e9))):
        for r in pair.rs:
            r.reset()
            r.inject.copy_(torch.tensor([2, delay], dtype=torch.int32))
        t0 = time.perf_counter()
        row = step_check(pair, s, 500 + len(rows), full, spec, ws, cache, final=True)
        row["wall_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        if case == "over":
            missing = [f.get("missing_ranks") for f in row["faults"]]
            row["ok"] = len(missing) == TP and all(m == [1] for m in missing)
        rows.append(dict(check=f"inject rank 1 {case} the timeout ({delay / 1e6:.0f} ms)", width=s, **row))
        for r in pair.rs:
            r.inject.zero_()
    for r in pair.rs:
        r.reset()
    rows.append(dict(check="after reset", width=s, **step_check(pair, s, 777, full, spec, ws, cache, final=True)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="minimax-m2")
    ap.add_argument("--widths", default="1-16")
    ap.add_argument("--timeout", type=float, default=0.2)
    ap.add_argument("--blocks", type=int, default=0, help="each rank's grid (default: the device's SMs)")
    ap.add_argument("--out", default="reports")
    ap.add_argument("--time", default="",
                    help="widths to time with cold weights (the bench's rotating sets), e.g. 1,4,16")
    a = ap.parse_args()
    # the model and both lists read before any step: a bad --time would otherwise end a whole round of checks
    try:
        spec = load_model(a.model)
        widths = parse_widths(a.widths, spec.max_tokens)
        timed = parse_widths(a.time, spec.max_tokens, "--time") if a.time.strip() else []
        if not torch.cuda.is_available():
            raise UsageError("this host has no CUDA GPU: both ranks run on one (the CPU's TP2 checks are "
                             "tests/test_triton_offline.py's, TRITON_INTERPRET=1)")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    blocks = a.blocks or sms  # two grids of one CTA per SM each: the two CTA slots of every SM
    full = synthetic(spec, seed=3, device=dev)
    ws = [shard(full, spec, TP, k, Experts.ALL, device=dev) for k in range(TP)]
    pair = Pair(spec, widths, blocks, a.timeout, dev)
    t0 = time.perf_counter()
    for r, w in zip(pair.rs, ws):
        r.warm(w)
    per = min(pair.rs[0].residency.values()) if pair.rs[0].residency else None
    print(f"{torch.cuda.get_device_name(dev)}: {sms} SMs, two grids of {blocks}, {per} CTAs/SM resident, "
          f"warm {time.perf_counter() - t0:.1f}s", flush=True)
    if per is not None and per * sms < TP * blocks:
        print(f"two grids of {blocks} do not fit {per} x {sms} CTA slots", file=sys.stderr)
        return 2
    cache: dict = {}
    rows = []
    try:
        for s in widths:
            rows.append(dict(check="step", width=s, **step_check(pair, s, 1000 * s + 1, full, spec, ws, cache,
                                                               final=s % 4 == 0)))
        s = widths[-1]
        parts, resid, slots = inputs(spec, s, 4242, dev)
        a1, a2 = poisoned(parts, resid), poisoned(parts, resid)
        pair.launch(parts, resid, ws, slots, a1)
        pair.launch(parts, resid, ws, slots, a2)
        torch.cuda.synchronize(dev)
        same = all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a1, a2))
        rows.append(dict(check="same inputs twice: bitwise equal", width=s, ok=same))
        for s in sorted({widths[0], widths[len(widths) // 2], widths[-1]}):
            rows.append(dict(check="CUDA graph replay", width=s, **graph_check(pair, s, full, spec, ws, cache)))
        rows += inject_checks(pair, 4 if 4 in widths else widths[0], full, spec, ws, cache, a.timeout)
        if timed:
            del full
            cache.clear()
            wsets = rotating_sets(spec, ws, dev)
            for s in timed:
                us = cold_step_us(pair, spec, s, wsets)
                # the build at this grid, not the shipped grid's: its per-CTA share of the router
                # and seam grows as the grid shrinks, and with it the registers (TP2's 2-6 tokens
                # spill 4-656 B at 132 where their builds at 264 spill nothing: offline, device round 83)
                d = pair.rs[0].describe(s)  # (n_spills: Triton's, the local memory in 4-byte words)
                regs, spills = d.get("n_regs"), d.get("n_spills")
                print(f"   timed w={s}: {us:.1f} us per paired step ({len(wsets)} weight sets, proxy; "
                      f"this grid's build: {regs} registers, {spills} spilled)", flush=True)
                # a figure, not a check: no "ok", so the verdict counts only what can fail
                rows.append(dict(check="step time, cold weights (proxy)", width=s, step_us=round(us, 1),
                                 regs=regs, spills=spills))
    finally:
        pair.close()
    df = pd.DataFrame(rows)
    df["faults"] = df.get("faults", pd.Series(dtype=object)).map(
        lambda f: "" if not isinstance(f, list) or not f else "; ".join(
            f"rank {x['rank']}: ranks {x['missing_ranks']} missing in {x['phase_name']}" for x in f))
    checks = df["ok"].dropna().astype(bool)
    passed = int(checks.sum())
    verdict = f"{'PASS' if passed == len(checks) else 'FAIL'} {passed}/{len(checks)}"
    meta = {"command": report.command_line(["python", *sys.argv]), "git_commit": report.git_commit(),
            "machine": report.machine_info(),
            "config": {"model": a.model, "tp": TP, "ranks_on_one_gpu": TP, "grid_per_rank": blocks,
                       "timeout_s": a.timeout, "widths": a.widths}}
    notes = ["Both ranks run in one process on one GPU, each on half of its CTA slots, so this checks the "
             "TP2 builds (exchanges, handshake, fault protocol) on hardware at a grid of "
             f"{blocks}, not the shipped grid of {TritonRunner.CTAS_PER_SM * sms}; graph_step_us and step_us are two "
             "ranks sharing one HBM and L2, not a 2xH200 step time (step_us rows are figures, not checks)."]
    path = report.write_report(a.out, "tp2-on-one-gpu", "triton", TP, df, meta=meta, verdict=verdict, notes=notes)
    print(df.drop(columns=[c for c in ("faults",) if not df[c].astype(bool).any()]).to_string(index=False))
    print(f"{verdict}: {path}", flush=True)
    return 0 if passed == len(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
