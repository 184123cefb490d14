"""Correctness of the Triton runner against the fp64 reference at TP1 (one process).

On a GPU: the compiled fused kernel. With TRITON_INTERPRET=1 on a CPU: the staged kernel in the
interpreter. Usage: python scripts/triton_check.py [--model tiny] [--widths 1,2,16] [--experts all]
"""
import argparse
import json
import sys
import time

import torch

from ffnq import reference
from ffnq.backends.triton import TritonRunner
from ffnq.spec import Experts, load_model
from ffnq.weights import shard, synthetic


def check_width(r, full, spec, w, s, dev, gen, experts, pad_rows=()):
    H = spec.hidden
    part = (torch.randn(s, H, generator=gen) ).to(torch.bfloat16)
    resid = (torch.randn(s, H, generator=gen)).to(torch.bfloat16)
    slots = torch.arange(s, dtype=torch.int64)
    for p in pad_rows:
        if p < s:
            slots[p] = -1
    out, res = r(part.to(dev), resid.to(dev), w, slots.to(dev), final=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    # a near-tie row may pick either side: the oracle follows the kernel's admissible pick
    ref = reference.step([part], resid, slots, full, spec, experts, follow=r.chosen(s).cpu())
    keep = slots >= 0
    c = reference.compare(out.cpu(), ref.out, rows=torch.nonzero(keep).flatten() if keep.any() else None)
    cr = reference.compare(res.cpu(), ref.res_out)
    route = r.view(s, "route").cpu()
    route_ok = bool((route == ref.chosen.int()).all())
    rw = r.view(s, "route_w").cpu().double()
    rw_err = float((rw - ref.weights).abs().max())
    pad_zero = bool((out.cpu()[~keep].float() == 0).all()) if (~keep).any() else True
    f = r.fault(s)
    return dict(s=s, rel_err=c["rel_err"], wrong=c["wrong"], res_rel=cr["rel_err"], route_ok=route_ok,
                rw_err=rw_err, pad_zero=pad_zero, fault=f is not None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--widths", default="1,2,16")
    ap.add_argument("--experts", default="all")
    a = ap.parse_args()
    spec = load_model(a.model)
    experts = Experts(a.experts)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    widths = [int(x) for x in a.widths.split(",")]
    full = synthetic(spec, seed=1)
    w = shard(full, spec, 1, 0, experts, device=dev)
    pb = TritonRunner.open_peers(spec, 1, 0, dev, "chk")
    r = TritonRunner(1, 0, pb.sym, pb.peers, dev, widths=widths, experts=experts, model=spec, timeout=0.5)
    t0 = time.time()
    r.warm(w)
    print(f"warm {time.time()-t0:.1f}s", flush=True)
    gen = torch.Generator().manual_seed(7)
    ok = True
    for s in widths:
        t0 = time.time()
        row = check_width(r, full, spec, w, s, dev, gen, experts, pad_rows=(1,) if s > 2 else ())
        row["t_s"] = round(time.time() - t0, 1)
        row["epoch"] = int(r.epoch[0])
        good = row["rel_err"] <= 1e-2 and row["route_ok"] and row["pad_zero"] and not row["fault"] \
            and row["res_rel"] <= 1e-2
        ok &= good
        print(("PASS " if good else "FAIL ") + json.dumps(row), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
