"""How steady is the floor's HBM read rate? (ffnq.floor.hbm_read_gbps, run on a GPU machine.)

    python scripts/floor_check.py [--rounds 6] [--idle 3]

Each round idles the GPU ``--idle`` seconds, then measures the read rate as the bench measured it
up to 2026-12-01 (no warm-up, 10 samples) and as it does now (WARMUP_MS of reads, SAMPLES
samples), and the same again right after; prints one line per round and the spread of each.
"""
import argparse
import statistics
import time

import torch

from ffnq import floor

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--idle", type=float, default=3.0)
a = ap.parse_args()
dev = torch.device("cuda", 0)
rows = {"cold, 10 samples": [], "warm-up, median": [], "again, 10 samples": []}
for i in range(a.rounds):
    time.sleep(a.idle)
    got = [floor.hbm_read_gbps(dev, warmup_ms=0, samples=10), floor.hbm_read_gbps(dev),
           floor.hbm_read_gbps(dev, warmup_ms=0, samples=10)]
    for k, v in zip(rows, got):
        rows[k].append(v)
    print(f"round {i}: " + "  ".join(f"{k} {v:7.1f} GB/s" for k, v in zip(rows, got)), flush=True)
for k, v in rows.items():
    print(f"{k:20s} min {min(v):7.1f} median {statistics.median(v):7.1f} max {max(v):7.1f} GB/s "
          f"spread {(max(v) - min(v)) / statistics.median(v) * 100:.1f}%")
