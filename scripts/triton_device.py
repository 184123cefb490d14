"""One device round for the Triton backend (run by scripts/device_round.sh; TP>1 under torchrun).

Per model: warm every width (live residency), correctness against the fp64 reference at every
width (fresh random inputs, a padding row, routing compared), a replay/stale check, optional
injection under/over the timeout with the timeline (TP>1), recovery after reset, and CUDA-graph
timing of a few widths. Prints one compact table (rank 0) and writes JSON under $OUT.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ffnq import reference
from ffnq.backends.triton import TritonRunner
from ffnq.jobs.bench import ROTATE_SETS_GPU
from ffnq.spec import Experts, load_model, stamp_names
from ffnq.timing import time_steps
from ffnq.weights import shard, synthetic

RANK = int(os.environ.get("RANK", 0))
WORLD = int(os.environ.get("WORLD_SIZE", 1))
OUT = os.environ.get("OUT", "/tmp")
ROWS = []


def log(*a):
    if RANK == 0:
        print(*a, flush=True)


def gather(obj):
    if WORLD == 1:
        return [obj]
    got = [None] * WORLD
    dist.all_gather_object(got, obj)
    return got


def barrier():
    torch.cuda.synchronize()
    if WORLD > 1:
        dist.barrier()


def inputs(spec, s, seed, pad=True, world=None):
    """One step's inputs: ``world`` ranks' parts (this job's WORLD unless given), the residual, slots."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(s, spec.hidden, generator=g).to(torch.bfloat16) for _ in range(world or WORLD)]
    resid = torch.randn(s, spec.hidden, generator=g).to(torch.bfloat16)
    slots = torch.arange(s, dtype=torch.int64)
    if pad and s >= 3:
        slots[s // 2] = -1
    return parts, resid, slots


VERBOSE = os.environ.get("FFNQ_VERBOSE") == "1"


def check(r, full, spec, w, s, seed, dev, experts, final=False):
    if VERBOSE:
        print(f"[rank {RANK}] check s={s} final={final} timeline={r.timeline} inject={r.inject.tolist()}", flush=True)
    parts, resid, slots = inputs(spec, s, seed)
    p, q, sl = parts[RANK].to(dev), resid.to(dev), slots.to(dev)
    barrier()  # ranks start a step together (the host-side reference below takes uneven time)
    out, res = r(p, q, w, sl, final=final)
    torch.cuda.synchronize()
    ref = reference.step([p.to(dev) for p in parts], resid.to(dev), slots.to(dev), full, spec, experts,
                         follow=r.chosen(s))
    keep = (slots >= 0).to(dev)
    c = reference.compare(out, ref.out, rows=torch.nonzero(keep).flatten())
    cr = reference.compare(res, ref.res_out)
    route = r.chosen(s)
    route_ok = bool((route == ref.chosen).all())
    rw_err = float((r.view(s, "route_w").double() - ref.weights).abs().max())
    pad_zero = bool((out[~keep].float() == 0).all()) if (~keep).any() else True
    f = r.fault(s)
    ok = c["rel_err"] <= 1e-2 and cr["rel_err"] <= 1e-2 and route_ok and pad_zero and f is None and rw_err < 1e-4
    return dict(ok=ok, rel_err=round(c["rel_err"], 5), wrong=c["wrong"], res_rel=round(cr["rel_err"], 5),
                route_ok=route_ok, rw_err=rw_err, pad_zero=pad_zero, fault=f, epoch=int(r.epoch[0]),
                touched=int(torch.unique(ref.chosen[keep.cpu()]).numel()) if keep.any() else 0)


def bench(r, spec, w, s, dev, calls=20, reps=7):
    parts, resid, slots = inputs(spec, s, 99 + s, pad=False)
    p, q, sl = parts[RANK].to(dev), resid.to(dev), slots.to(dev)
    for _ in range(3):
        r(p, q, w, sl)
    barrier()
    ts = [x / calls for x in time_steps(lambda: [r(p, q, w, sl) for _ in range(calls)], reps, barrier=barrier,
                                        device=dev, graph=True)]
    f = r.fault(s)
    # eager single launch, host clock (includes Python launch overhead)
    barrier()
    t0 = time.perf_counter()
    r(p, q, w, sl)
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t0) * 1e6
    return dict(us_p50=round(statistics.median(ts), 2), us_min=round(min(ts), 2), fault=f is not None,
                eager_us=round(eager, 1))


def med_us(v) -> float:
    """The median of ``v`` (ns) in us, to 0.01."""
    return round(float(v.median()) / 1e3, 2)


def row_pick(sub) -> dict:
    """Phase B's row pick (widths where it runs: kernel stamps 10, a CTA's arrival at its row's
    counter, and 11, its row's last arriver's top-k done), us: "pick_arrive" barrier 1 to the
    arrival (median over the row CTAs), "pick_last" the same for the rows' last arrivers, "pick_topk"
    their arrival to the top-k done, "pick_store" from there to the phase's end (stamp 1); "latest"
    the absolute times (ns) of the last arrival and the last top-k. Stamps of an earlier launch
    (not between this launch's barrier 1 and barrier 2) are left out."""
    b1, b2 = sub[:, 0], sub[:, 2]
    arr = (sub[:, 10] >= b1) & (sub[:, 10] <= b2) & (b1 > 0)
    last = arr & (sub[:, 11] >= sub[:, 10]) & (sub[:, 11] <= b2)
    if not last.any():
        return {}
    return {"pick_arrive": med_us(sub[arr, 10] - b1[arr]), "pick_last": med_us(sub[last, 10] - b1[last]),
            "pick_topk": med_us(sub[last, 11] - sub[last, 10]), "pick_store": med_us(sub[last, 1] - sub[last, 11]),
            "latest": {"arrived": float(sub[arr, 10].max()), "picked": float(sub[last, 11].max())}}


def profile(rt, spec, sets, dev, world=None, rank=None, sync=None):
    """Per-phase medians over CTAs (us) from the in-kernel timeline and the kernel's finer stamps
    (scratch "sub"), plus the latest CTA's end of each phase relative to the median start. Timed as
    the bench times: a CUDA graph of 2 x len(sets) launches walking the weight sets (cold L2), the
    stamps read from its last launch; "launch_us" is the graph's time per launch, "span" the last
    launch's first CTA start to last CTA end, "gap" the difference (launch, prologue, exit; with
    several weight sets also the sets' own differences, as the span is the last set's).
    ``world``, ``rank``, ``sync``: the runner's TP, rank and the barrier between steps (this job's
    WORLD, RANK and barrier unless given: scripts/tp2_solo.py runs one TP2 rank in one process)."""
    world = world or WORLD
    rank = RANK if rank is None else rank
    sync = sync or barrier
    cols = {n: i for i, n in enumerate(stamp_names(world))}
    out = {}
    for s in rt.widths:
        parts, resid, slots = inputs(spec, s, 31 + s, pad=False, world=world)
        p, q, sl = parts[rank].to(dev), resid.to(dev), slots.to(dev)
        calls = [w for _ in range(2) for w in sets]
        for w in sets:
            rt(p, q, w, sl)
        sync()
        ts = [x / len(calls) for x in time_steps(lambda: [rt(p, q, w, sl) for w in calls], 10, barrier=sync,
                                                 device=dev, graph=True)]
        t = rt.view(s, "timeline").cpu().double()
        sub = rt.view(s, "sub").cpu().double()
        start, end = t[:, cols["start"]], t[:, cols["end"]]  # every CTA
        pick = row_pick(sub)  # phase B's CTAs, before the filter below (a row's last arriver need own no chunk)
        own = sub[:, 7] > 0  # the CTAs that own a column chunk (they stamp the wait before the sum)
        t, sub = t[own], sub[own]
        # stage 2 starts right after stage 1 (no barrier 3: per-expert counters); "tiles" is the
        # sum's wait for its H tiles' stage-2 items (no barrier 4)
        seq = [("start", t[:, cols["start"]]), ("seam", t[:, cols["seam_done"]]), ("bar1", sub[:, 0]),
               ("logits", sub[:, 1]), ("bar2", sub[:, 2]), ("topk", t[:, cols["router_done"]]),
               ("stage1", sub[:, 3]), ("stage2", sub[:, 5]), ("to_sum", sub[:, 6]), ("tiles", sub[:, 7]),
               ("sum", t[:, cols["experts_done"]]), ("reduce", t[:, cols["reduce_done"]]), ("end", t[:, cols["end"]])]
        t0 = float(seq[0][1].median())
        row = {}
        for (_, a), (name, b) in zip(seq, seq[1:]):
            row[name] = med_us(b - a)
        row["total"] = med_us(seq[-1][1] - seq[0][1])
        # a CTA's first stage-2 item: its wait for the expert's stage 1 (from the CTA's own stage-1
        # end), then the item itself (kernel stamps 8 and 9; CTAs without an item left out)
        s2 = sub[:, 9] >= sub[:, 3]
        if s2.any():
            row["s2_wait"] = med_us(sub[s2, 8] - sub[s2, 3])
            row["s2_item"] = med_us(sub[s2, 9] - sub[s2, 8])
        # the two exchanges split: push + publish, wait for the last peer's flag, the rest
        for key, ph, before in (("seam", "seam", "start"), ("red", "reduce", "experts_done")):
            arrive = t[:, cols[f"{ph}_arrive"]]
            seen = torch.stack([t[:, cols[f"{ph}_seen{r}"]] for r in range(world)]).max(dim=0).values
            for name, a, b in (("push", t[:, cols[before]], arrive), ("wait", arrive, seen),
                               ("rest", seen, t[:, cols[f"{ph}_done"]])):
                row[f"{key}_{name}"] = med_us(b - a)
        row["latest"] = {name: round((float(v.max()) - t0) / 1e3, 1) for name, v in seq[1:]}
        row.update({k: v for k, v in pick.items() if k != "latest"})
        row["latest"].update({k: round((v - t0) / 1e3, 1) for k, v in pick.get("latest", {}).items()})
        if s2.any():
            row["latest"]["s2_waited"] = round((float(sub[s2, 8].max()) - t0) / 1e3, 1)
        span = (float(end.max()) - float(start.min())) / 1e3
        row["launch_us"] = round(statistics.median(ts), 2)
        row["span"] = round(span, 2)
        row["gap"] = round(row["launch_us"] - span, 2)
        row["start_spread"] = round((float(start.median()) - float(start.min())) / 1e3, 2)
        row["end_spread"] = round((float(end.max()) - float(end.median())) / 1e3, 2)
        out[s] = row
    return out


def inject_cases(r_tl, full, spec, w, dev, experts, timeout_s):
    """TP>1: the last rank delays under and over the timeout; recovery after reset."""
    s = r_tl.widths[0]
    late = WORLD - 1
    out = []
    cols = {n: i for i, n in enumerate(stamp_names(WORLD))}
    for name, delay in (("under", int(timeout_s * 0.2e9)), ("over", int(timeout_s * 3e9))):
        r_tl.reset()
        r_tl.inject.copy_(torch.tensor([late + 1, delay], dtype=torch.int32))
        barrier()
        t0 = time.perf_counter()
        res = check(r_tl, full, spec, w, s, 500 + len(out), dev, experts, final=True)
        wall = time.perf_counter() - t0
        tl = r_tl.view(s, "timeline").cpu()
        wait_ns = int((tl[:, cols[f"seam_seen{late}"]] - tl[:, cols["seam_arrive"]]).median())
        f = res["fault"]
        row = dict(case=name, rank=RANK, delay_ms=delay / 1e6, wall_ms=round(wall * 1e3, 1),
                   seam_wait_ms=round(wait_ns / 1e6, 3), fault=f)
        if name == "under":
            row["ok"] = res["ok"] and f is None and (RANK == late or wait_ns > delay * 0.5)
            row["rel_err"] = res["rel_err"]
        else:
            row["ok"] = f is not None and f.get("missing_ranks") == [late]
        out.append(row)
        r_tl.inject.zero_()
        barrier()
    # recovery
    r_tl.reset()
    res = check(r_tl, full, spec, w, s, 777, dev, experts, final=True)
    out.append(dict(case="recover", rank=RANK, ok=res["ok"], rel_err=res["rel_err"], fault=res["fault"]))
    return out


def run_model(name, widths, bench_widths, experts, dev, timeout_s, do_inject, sms, prof=()):
    spec = load_model(name)
    t0 = time.perf_counter()
    full = synthetic(spec, seed=3, device=dev)
    w = shard(full, spec, WORLD, RANK, experts, device=dev)
    pb = TritonRunner.open_peers(spec, WORLD, RANK, dev, f"ffnq-{name}")
    r = TritonRunner(WORLD, RANK, pb.sym, pb.peers, dev, widths=widths, experts=experts, model=spec,
                     timeout=timeout_s)
    t1 = time.perf_counter()
    warm_err = None
    try:
        r.warm(w, compute_units=sms)
    except RuntimeError as e:
        warm_err = str(e)
    t2 = time.perf_counter()
    log(f"== {name} tp{WORLD} {experts.value}: weights {t1 - t0:.1f}s warm {t2 - t1:.1f}s {warm_err or ''}")
    for s in widths:
        d = r.describe(s)
        if s in (widths[0], widths[-1]) or d.get("n_spills"):
            log(f"   s={s} regs={d.get('n_regs')} spills={d.get('n_spills')} shared={d.get('shared_bytes')} "
                f"ctas/sm={d.get('ctas_per_cu')} grid={r.keys[s].blocks} compile_s={d.get('compile_s')}")
    r.reset()
    res = {}
    for s in widths:
        res[s] = check(r, full, spec, w, s, 1000 * s + 1, dev, experts, final=(s % 4 == 0))
    # replay check: same inputs twice -> bitwise the same out
    s = widths[-1]
    parts, resid, slots = inputs(spec, s, 4242)
    o1, _ = r(parts[RANK].to(dev), resid.to(dev), w, slots.to(dev))
    o2, _ = r(parts[RANK].to(dev), resid.to(dev), w, slots.to(dev))
    torch.cuda.synchronize()
    same = bool(torch.equal(o1, o2))
    allr = gather(res)
    for s in widths:
        rows = [a[s] for a in allr]
        ok = all(x["ok"] for x in rows)
        worst = max(rows, key=lambda x: x["rel_err"])
        ROWS.append(dict(model=name, tp=WORLD, experts=experts.value, width=s, ok=ok, **{k: worst[k] for k in (
            "rel_err", "wrong", "res_rel", "route_ok", "rw_err", "pad_zero", "touched")},
            faults=[x["fault"] for x in rows if x["fault"]]))
    log(f"   correctness: {sum(x['ok'] for x in ROWS if x['model'] == name and x['experts'] == experts.value)}"
        f"/{len(widths)} widths pass; max rel_err "
        f"{max(x['rel_err'] for x in ROWS if x['model'] == name and x['experts'] == experts.value):.4g}; "
        f"replay identical={same}")
    for x in ROWS:
        if x["model"] == name and x["experts"] == experts.value and not x["ok"]:
            log("   FAIL", json.dumps(x, default=str))
    b = {}
    for s in bench_widths:
        if s in widths:
            b[s] = bench(r, spec, w, s, dev)
    ball = gather(b)
    for s in b:
        per = [a[s] for a in ball]
        touched = res[s]["touched"] or spec.top_k
        floor_us = touched * spec.expert_bytes(WORLD, experts) / 4.0e6
        log(f"   bench s={s:2d}: p50 {max(x['us_p50'] for x in per):8.2f} us/step (graph, max over ranks; "
            f"min {min(x['us_min'] for x in per):.2f}) eager {per[0]['eager_us']:.0f} us; touched~{touched} "
            f"floor@4TB/s {floor_us:.1f} us; faults={any(x['fault'] for x in per)}")
        ROWS.append(dict(model=name, tp=WORLD, experts=experts.value, width=s, bench=per, floor_us=floor_us))
    if prof:
        rp = TritonRunner(WORLD, RANK, pb.sym, pb.peers, dev, widths=prof, experts=experts, model=spec,
                          timeline=True, timeout=timeout_s)
        rp.warm(w)
        sets = [w] + [shard(synthetic(spec, seed=3 + i, device=dev), spec, WORLD, RANK, experts, device=dev)
                      for i in range(1, ROTATE_SETS_GPU)]  # as the bench: cold L2
        pr = gather(profile(rp, spec, sets, dev))
        del sets
        for s in prof:
            log(f"   profile s={s:2d} (us, median over CTAs; rank 0): {json.dumps(pr[0][s])}")
        ROWS.append(dict(model=name, tp=WORLD, profile=pr))
    inj = None
    if do_inject and WORLD > 1 and experts is Experts.ALL:
        rt = TritonRunner(WORLD, RANK, pb.sym, pb.peers, dev, widths=[4], experts=experts, model=spec,
                          timeline=True, timeout=timeout_s)
        rt.warm(w)
        inj = gather(inject_cases(rt, full, spec, w, dev, experts, timeout_s))
        for rows in zip(*inj):
            log("   inject", rows[0]["case"], "ok" if all(x["ok"] for x in rows) else "FAIL",
                json.dumps([{k: v for k, v in x.items() if k != "case"} for x in rows], default=str))
            ROWS.append(dict(model=name, tp=WORLD, inject=rows))
    barrier()
    del r
    pb.close()
    return


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,minimax-m2")
    ap.add_argument("--widths", default="1-16")
    ap.add_argument("--bench", default="1,2,4,8,16")
    ap.add_argument("--experts", default="all")
    ap.add_argument("--timeout", type=float, default=0.2)
    ap.add_argument("--inject", action="store_true")
    ap.add_argument("--profile", default="", help="widths to profile with the timeline (model minimax-m2 only)")
    ap.add_argument("--blocks", type=int, default=None, help="grid size (default: the device's, as the jobs take it)")
    a = ap.parse_args()
    lo, _, hi = a.widths.partition("-")
    widths = list(range(int(lo), int(hi or lo) + 1)) if "," not in a.widths else [int(x) for x in a.widths.split(",")]
    bw = [int(x) for x in a.bench.split(",") if x]
    dev = torch.device("cuda", RANK)
    torch.cuda.set_device(dev)
    global TritonRunner
    TritonRunner = TritonRunner.with_grid(a.blocks) if a.blocks else TritonRunner.for_device(dev)
    if WORLD > 1:
        dist.init_process_group("nccl", device_id=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    log(f"device {torch.cuda.get_device_name(dev)} sms={sms} grid={TritonRunner.BLOCKS} (a width's own below) "
        f"world={WORLD} torch {torch.__version__}")
    for name in a.models.split(","):
        for ex in a.experts.split(","):
            try:
                prof = [int(x) for x in a.profile.split(",") if x] if name == "minimax-m2" else []
                run_model(name, widths, bw, Experts(ex), dev, a.timeout, a.inject, sms, prof)
            except Exception as e:  # noqa: BLE001
                import traceback
                print(f"[rank {RANK}] {name} {ex}: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
    with open(os.path.join(OUT, f"triton_tp{WORLD}_rank{RANK}.json"), "w") as f:
        json.dump(ROWS, f, indent=1, default=str)
    if WORLD > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
