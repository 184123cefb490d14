"""One TP2 rank's fused kernel on one GPU, its exchanges and handshake the identity (SOLO=2): a
side-by-side proxy for TP2 build choices where no two-GPU machine is lent. Unlike
scripts/tp2_one_gpu.py (both ranks on one GPU, each on half the grid, sharing one HBM), this is
the build rank 0 ships (its grid, CTAs per SM and the measured table's choices), alone on the
whole HBM, less the exchanges' code: so its registers differ (offline, minimax-m2: fewer at most
widths; where the shipped build holds three CTAs per SM, TP2's three tokens, geometry caps them so
three still fit). It misses what the exchanges cost: two link latencies and the peer's skew a
step (~7-13 us at TP2, about the same for every variant), and under FR its wait for the peer's
rows. So compare variants of one call; never read a step time here as a 2xH200 figure.

    FFNQ_TRITON_TUNE=... python scripts/tp2_solo.py [--widths 1-16] [--time 1,4,16] [--profile 1,16] [--floor]
                                                   [--blocks 0]

(``--device cpu`` with TRITON_INTERPRET=1: the checks in Triton's interpreter, as the tests run
them; no timing there.)

Per width, a fresh random step against the fp64 reference of what the build computes: the
residual plus rank 0's own part (no seam sum), and the MoE output of rank 0's shard of every
chosen expert (the reference's weights with rank 1's intermediate rows zeroed), routing and
route weights compared, outputs NaN-poisoned before the step. ``--time``: those widths timed as
tp2_one_gpu.py times them (a CUDA graph over the bench's rotating weight sets, the median of 200
replays). ``--profile``: those widths' timeline builds profiled as scripts/triton_device.py profiles
a 2xH200 round (per phase the median over CTAs, us, and each phase's latest CTA from the median
start; the same rotating weight sets), less the exchanges' splits (no exchange here): where a TP2
step's time goes before and after its first weight byte, links aside. ``--floor``: the bytes
counted (METHOD.md): this GPU's HBM read rate by the bench's read kernel, and per timed width the
experts the timed step touches (the mean over the weight sets, as the bench's floor) and the
step over those bytes' read time (``x_bytes``; no link in it: a solo step has none); per
profiled width the experts its last launch touched over its expert phase (top-k done to stage 2
done, latest CTAs), as TB/s and as a share of the read rate. Writes
<out>/<stamp>-tp2-solo-triton-tp2/; exit 1 on a failed check, 2 on bad input.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from types import SimpleNamespace

import pandas as pd
import torch

from tp2_one_gpu import cold_step_us, inputs, poisoned, timed_inputs

from ffnq import reference, report
from ffnq.backends import symm
from ffnq.backends.triton import TritonRunner, tune
from ffnq.errors import UsageError
from ffnq.floor import hbm_read_gbps
from ffnq.jobs import bench
from ffnq.launch import parse_widths
from ffnq.spec import Experts, load_model
from ffnq.weights import shard, synthetic

TP, RANK = 2, 0


class Solo:
    """Rank 0's runner alone, with tp2_one_gpu.Pair's launch (its parts, weights and outputs
    lists, of which it takes rank 0's)."""

    def __init__(self, spec, widths, blocks, timeout, dev, timeline=False):
        cls = TritonRunner.with_grid(blocks)
        self.buf = torch.zeros(cls.peer_bytes(spec, TP), dtype=torch.uint8, device=dev)
        symm.BUFFERS[self.buf.data_ptr()] = self.buf
        peers = torch.tensor([self.buf.data_ptr()] * TP, dtype=torch.int64, device=dev)  # never read (SOLO)
        self.r = cls(TP, RANK, self.buf.data_ptr(), peers, dev, widths=widths, model=spec, timeout=timeout,
                     timeline=timeline)
        self.dev = dev

    def close(self):
        symm.BUFFERS.pop(self.buf.data_ptr(), None)

    def launch(self, parts, resid, ws, slots, outs, final=False):
        s = self.r.check_inputs(parts[RANK], resid, slots)
        self.r._launch(s, self.r._args(s, parts[RANK], resid, slots, *outs[RANK], ws[RANK]), final)


def own_shard_only(full, spec):
    """``full`` with every intermediate row but rank 0's zeroed in w1 and w3 (fp8 code 0 is 0.0):
    the reference's MoE output is then rank 0's partial, what a SOLO build returns."""
    n = spec.intermediate // TP
    w1, w3 = full.w1.clone(), full.w3.clone()
    for w in (w1, w3):
        w.view(torch.uint8)[:, n:] = 0
    return dataclasses.replace(full, w1=w1, w3=w3)


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def check(solo, s, seed, expect, spec, ws, cache) -> dict:
    parts, resid, slots = inputs(spec, s, seed, solo.dev)
    outs = poisoned(parts, resid)
    solo.launch(parts, resid, ws, slots, outs)
    sync(solo.dev)
    r, (out, res) = solo.r, outs[RANK]
    ref = reference.step(parts[RANK:RANK + 1], resid, slots, expect, spec, Experts.ALL, cache=cache,
                         follow=r.chosen(s))
    keep = torch.nonzero(slots >= 0).flatten()
    c, cr = reference.compare(out, ref.out, rows=keep), reference.compare(res, ref.res_out)
    row = dict(rel_err=round(c["rel_err"], 5), res_rel=round(cr["rel_err"], 5), wrong=c["wrong"] + cr["wrong"],
               route_ok=bool(torch.equal(r.chosen(s), ref.chosen)),
               route_w_err=float((r.chosen_weights(s).double().cpu() - ref.weights.cpu()).abs().max()),
               pad_zero=bool((out[slots < 0].float() == 0).all()), fault=r.fault(s) is not None)
    row["ok"] = (c["rel_err"] <= reference.MAX_REL_ERR and cr["rel_err"] <= reference.MAX_REL_ERR and row["wrong"] == 0
                 and row["route_ok"] and row["route_w_err"] <= 1e-4 and row["pad_zero"] and not row["fault"])
    return row


def profile_rows(spec, widths, blocks, timeout, dev, wsets, read_gbps: float | None = None) -> list[dict]:
    """triton_device.profile of the SOLO timeline builds of ``widths``, one row per width: its
    phases (the exchanges' push/wait splits left out: SOLO stamps no exchange) and "latest", each
    phase's last CTA from the median start. With ``read_gbps``: the expert phase's bytes (the
    experts the profiled launch routed to) and rate against it."""
    import triton_device as td

    tl = Solo(spec, widths, blocks, timeout, dev, timeline=True)
    try:
        tl.r.warm(wsets[0][RANK])
        # its stamp names and inputs are a TP2 rank's; one process, no group to wait for
        got = td.profile(tl.r, spec, [w[RANK] for w in wsets], dev, world=TP, rank=RANK,
                         sync=lambda: torch.cuda.synchronize(dev))
        if read_gbps:
            for s in widths:
                got[s].update(expert_rate(got[s], touched(tl.r.chosen(s)), spec, read_gbps))
    finally:
        tl.close()
    return [dict(check="profile (SOLO proxy, us)", width=s,
                 **{k: v for k, v in got[s].items() if not k.startswith(("seam_", "red_"))}) for s in widths]


def _bench_job(spec) -> SimpleNamespace:
    """What ffnq.jobs.bench's floor reads of a job, for rank 0's shard of every expert (Experts ALL)."""
    return SimpleNamespace(experts=Experts.ALL, model=spec, tp=TP)


def touched(route: torch.Tensor) -> int:
    """Distinct experts of a route [s, k] (padding rows -1), as the bench's floor counts them."""
    return bench.touched(_bench_job(None), route)


def expert_rate(prof: dict, n_experts: int, spec, read_gbps: float) -> dict:
    """The profiled launch's expert bytes over its expert phase (latest CTAs: top-k done to
    stage 2 done), TB/s and its share of the read rate."""
    mb = n_experts * spec.expert_bytes(TP, Experts.ALL) / 1e6
    us = prof["latest"]["stage2"] - prof["latest"]["topk"]
    return dict(experts=n_experts, expert_mb=round(mb, 1), expert_tbps=round(mb / us, 2),
                of_read=round(mb / us / (read_gbps / 1e3), 3))


def bytes_row(spec, s, wsets, dev, step_us: float, read_gbps: float) -> dict:
    """The timed step's experts (cold_step_us's inputs: the bench's floor of rank 0's own part over
    the sets, with no link) and the step over their bytes' read time."""
    parts, resid, slots = timed_inputs(spec, s, dev)
    f = bench.floor_row(_bench_job(spec), (read_gbps, 0.0), (parts[RANK:RANK + 1], resid, slots),
                        [w[RANK] for w in wsets])
    return dict(experts=round(f["touched_experts"], 2), expert_mb=round(f["weight_bytes"] / 1e6, 1),
                read_us=round(f["floor_us"], 1), x_bytes=round(step_us / f["floor_us"], 3))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="minimax-m2")
    ap.add_argument("--widths", default="1-16")
    ap.add_argument("--timeout", type=float, default=0.2)
    ap.add_argument("--blocks", type=int, default=0, help="every width's grid (default: the shipped one)")
    ap.add_argument("--out", default="reports")
    ap.add_argument("--time", default="", help="widths to time with cold weights, e.g. 1,4,16")
    ap.add_argument("--profile", default="", help="widths to profile with the in-kernel timeline, e.g. 1,16")
    ap.add_argument("--floor", action="store_true", help="the HBM read rate, and each timed / profiled width's "
                    "step and expert phase against its bytes' read time")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the interpreter's checks")
    a = ap.parse_args()
    try:  # every input read before any GPU work
        spec = load_model(a.model)
        widths = parse_widths(a.widths, spec.max_tokens)
        timed = parse_widths(a.time, spec.max_tokens, "--time") if a.time.strip() else []
        prof = parse_widths(a.profile, spec.max_tokens, "--profile") if a.profile.strip() else []
        spec.check(TP, Experts.ALL)
        if a.device == "cpu" and (os.environ.get("TRITON_INTERPRET") != "1" or timed or prof or a.floor):
            raise UsageError("--device cpu: runs the checks in Triton's interpreter only (TRITON_INTERPRET=1, "
                             "no --time, --profile or --floor)")
        if a.floor and not (timed or prof):
            raise UsageError("--floor: counts the bytes of timed or profiled widths; name them (--time, --profile)")
        os.environ[tune.ENV] = ",".join(t for t in (os.environ.get(tune.ENV, ""), "SOLO=2") if t)
        tune.read()
        if a.device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda: this host has no CUDA GPU (the checks alone: --device cpu with "
                             "TRITON_INTERPRET=1)")
    except (UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    sms, name = None, "cpu (Triton's interpreter)"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        sms, name = torch.cuda.get_device_properties(dev).multi_processor_count, torch.cuda.get_device_name(dev)
    full = synthetic(spec, seed=3, device=dev)
    ws = [shard(full, spec, TP, RANK, Experts.ALL, device=dev)]
    expect = own_shard_only(full, spec)
    del full
    solo = Solo(spec, widths, a.blocks, a.timeout, dev)
    rows = []
    try:
        t0 = time.perf_counter()
        solo.r.warm(ws[0], compute_units=sms)  # refuses a grid that is not resident
        grids = sorted({solo.r.keys[s].blocks for s in widths})
        print(f"{name}: rank {RANK} of TP{TP} alone (SOLO=2), grids {grids}"
              + (f" resident on {sms} SMs" if sms else "") + f", warm {time.perf_counter() - t0:.1f}s", flush=True)
        cache: dict = {}
        for s in widths:
            rows.append(dict(check="step", width=s, **check(solo, s, 1000 * s + 7, expect, spec, ws, cache)))
        read_gbps = None
        if timed or prof:
            del expect
            cache.clear()
            wsets = [ws] + [[shard(synthetic(spec, seed=3 + i, device=dev), spec, TP, RANK, Experts.ALL, device=dev)]
                            for i in range(1, bench.ROTATE_SETS_GPU)]
            if a.floor:
                read_gbps = hbm_read_gbps(dev)
                print(f"   floor: HBM read {read_gbps / 1e3:.2f} TB/s (the bench's read kernel, after its warm-up)",
                      flush=True)
                rows.append(dict(check="HBM read rate (TB/s)", read_tbps=round(read_gbps / 1e3, 3)))
            for s in timed:
                us = cold_step_us(solo, spec, s, wsets)
                d = solo.r.describe(s)
                regs, spills = d.get("n_regs"), d.get("n_spills")
                print(f"   timed w={s}: {us:.1f} us per step ({len(wsets)} weight sets, SOLO proxy; grid "
                      f"{solo.r.keys[s].blocks}, {regs} registers, {spills} spilled)", flush=True)
                row = dict(check="step time, cold weights (SOLO proxy)", width=s, step_us=round(us, 1),
                           grid=solo.r.keys[s].blocks, regs=regs, spills=spills)
                if read_gbps:
                    row.update(bytes_row(spec, s, wsets, dev, us, read_gbps))
                    print(f"   bytes w={s}: {row['experts']} experts, {row['expert_mb']} MB, read in {row['read_us']} us: "
                          f"step {row['x_bytes']}x that", flush=True)
                rows.append(row)
        for row in profile_rows(spec, prof, a.blocks, a.timeout, dev, wsets, read_gbps) if prof else []:
            print(f"   profile w={row['width']} (us, median over CTAs; SOLO proxy): "
                  f"{json.dumps({k: v for k, v in row.items() if k not in ('check', 'width')})}", flush=True)
            rows.append(row)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        solo.close()
    df = pd.DataFrame(rows)
    checks = df["ok"].dropna().astype(bool)
    passed = int(checks.sum())
    verdict = f"{'PASS' if passed == len(checks) else 'FAIL'} {passed}/{len(checks)}"
    meta = {"command": report.command_line(["python", *sys.argv]), "git_commit": report.git_commit(),
            "machine": report.machine_info(), "tune": os.environ[tune.ENV],
            "config": {"model": a.model, "tp": TP, "rank": RANK, "solo": True, "timeout_s": a.timeout,
                       "widths": a.widths}}
    notes = [f"Rank {RANK}'s TP{TP} build alone on one GPU with its exchanges and handshake as the identity "
             "(SOLO=2): its output is its own partial, checked against that; step_us leaves out both link "
             "latencies and the peer's skew, so it compares build choices of one call, not a 2xH200 step time."]
    path = report.write_report(a.out, "tp2-solo", "triton", TP, df, meta=meta, verdict=verdict, notes=notes)
    print(df.to_string(index=False))
    print(f"{verdict}: {path}", flush=True)
    return 0 if passed == len(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
