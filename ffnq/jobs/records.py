"""What every job's rank shares: options in, JSON-line records out, clock offsets, the entry.

A rank appends to ``<result_dir>/rank<r>.jsonl``: ``progress`` (done/total/what), ``row``
(table name + one dict), then ``done`` or ``error`` (the exception, one line). At the end
rank 0 gathers every rank's rows into ``all.jsonl`` for the launcher.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ffnq.dist import barrier

CLOCK_ROUNDS = 9  # barrier + clock_ns samples; the median is the offset


class Records:
    def __init__(self, result_dir: str, rank: int):
        self.rank = rank
        self.dir = Path(result_dir)
        self.file = (self.dir / f"rank{rank}.jsonl").open("a", buffering=1)
        self.rows: list[dict] = []

    def write(self, kind: str, **data) -> None:
        self.file.write(json.dumps({"kind": kind, "rank": self.rank, "t": time.time(), **data}, default=str) + "\n")
        self.file.flush()

    def progress(self, done: int, total: int, what: str = "") -> None:
        self.write("progress", done=done, total=total, what=what)

    def row(self, table: str, data: dict) -> None:
        rec = {"kind": "row", "rank": self.rank, "table": table, "data": data}
        self.rows.append(rec)
        self.file.write(json.dumps(rec, default=str) + "\n")

    def close(self) -> None:
        self.file.close()

    def gather(self) -> None:
        """Collective: rank 0 writes every rank's rows to all.jsonl."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            got = [None] * dist.get_world_size()
            dist.all_gather_object(got, self.rows)
        else:
            got = [self.rows]
        if self.rank == 0:
            tmp = self.dir / "all.jsonl.tmp"
            tmp.write_text("".join(json.dumps(r, default=str) + "\n" for rows in got for r in rows))
            tmp.rename(self.dir / "all.jsonl")


def clock_offsets(clock_ns: Callable[[], int], rounds: int = CLOCK_ROUNDS) -> list[int]:
    """Collective: offset_ns[r] = median over rounds of (clock on r - clock on rank 0), each read
    right after a common barrier. Its error is the barrier's exit skew (gloo: tens of us)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [0]
    world = dist.get_world_size()
    samples = []
    for _ in range(rounds):
        barrier()
        t = torch.tensor([clock_ns()], dtype=torch.int64)
        got = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(got, t)
        samples.append([int(g) - int(got[0]) for g in got])
    return [int(torch.tensor([s[r] for s in samples]).median()) for r in range(world)]


def max_over_ranks(x: float) -> float:
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)
    return x


def main(body: Callable[[dict, Records], None]) -> None:
    """The entry of ``python -m ffnq.jobs.<job> OPTIONS.json`` on one rank."""
    opts = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ.get("RANK", 0))
    rec = Records(opts["result_dir"], rank)
    torch.set_num_threads(1)
    die = os.environ.get("FFNQ_TEST_DIE_RANK")  # test hook: this rank dies (SIGKILL) at start
    if die is not None and int(die) == rank:
        os.kill(os.getpid(), 9)
    hang = os.environ.get("FFNQ_TEST_HANG_RANK")  # test hook: this rank never arrives
    if hang is not None and int(hang) == rank:
        rec.progress(0, 1, "hanging (FFNQ_TEST_HANG_RANK)")
        time.sleep(3600)
    rec.write("start")
    try:
        body(opts, rec)
        rec.gather()
        rec.write("done")
    except SystemExit:  # ended from outside (torchrun after another rank died): not this rank's fault
        raise
    except BaseException as e:  # noqa: BLE001 - recorded for the launcher, then re-raised
        msg = str(e).splitlines()[0] if str(e) else ""
        rec.write("error", message=f"{type(e).__name__}: {msg}", trace=traceback.format_exc())
        raise
    finally:
        rec.close()
        if dist.is_initialized():
            dist.destroy_process_group()
