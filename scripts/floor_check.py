"""How steady is the floor's HBM read rate? (ffnq.floor.hbm_read_gbps, run on a GPU machine.)

    python scripts/floor_check.py [--rounds 6] [--idle 3]

Each round idles the GPU ``--idle`` seconds, then measures the read rate as the bench measured it
up to 2026-12-01 (no warm-up, 10 samples) and as it does now (WARMUP_MS of reads, SAMPLES
samples), and the same again right after; prints one line per round and the spread of each.
``--move``: before each measurement a held block of a random 1-24 GB and an empty allocator
cache, so the read buffers land on other memory each time (as in a new bench process).
"""
import argparse
import statistics
import time

import torch

from ffnq import floor

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--idle", type=float, default=3.0)
ap.add_argument("--move", action="store_true")
a = ap.parse_args()
g = torch.Generator().manual_seed(0)
dev = torch.device("cuda", 0)
rows = {"cold, 10 samples": [], "warm-up, median": [], "again, 10 samples": []}
for i in range(a.rounds):
    time.sleep(a.idle)
    got = []
    for kw in (dict(warmup_ms=0, samples=10), {}, dict(warmup_ms=0, samples=10)):
        hold = None
        if a.move:
            torch.cuda.empty_cache()
            hold = torch.empty(int(torch.randint(1, 25, (1,), generator=g)) << 30, dtype=torch.uint8, device=dev)
        got.append(floor.hbm_read_gbps(dev, **kw))
        del hold
    for k, v in zip(rows, got):
        rows[k].append(v)
    print(f"round {i}: " + "  ".join(f"{k} {v:7.1f} GB/s" for k, v in zip(rows, got)), flush=True)
for k, v in rows.items():
    print(f"{k:20s} min {min(v):7.1f} median {statistics.median(v):7.1f} max {max(v):7.1f} GB/s "
          f"spread {(max(v) - min(v)) / statistics.median(v) * 100:.1f}%")
