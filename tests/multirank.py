"""Run a function on N ranks in real processes (gloo), for tests of the engine.

Each rank gets RANK/WORLD_SIZE/MASTER_* like torchrun gives, so the code under test sees the
same environment; the parent kills every rank past the deadline and sweeps /dev/shm.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import secrets
import socket
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world, port, tag, q, args, kwargs):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), FFNQ_TAG=tag, OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if world > 1:
            dist.init_process_group("gloo")
        q.put((rank, "ok", fn(rank, world, *args, **kwargs)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 120.0, **kwargs) -> list:
    """fn(rank, world, *args, **kwargs) on every rank; returns the results by rank."""
    from ffnq.dist import sweep

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port, tag = _free_port(), "t" + secrets.token_hex(3)
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, tag, q, args, kwargs)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        import time

        end = time.monotonic() + timeout
        while len(out) < world:
            try:
                rank, status, val = q.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead:  # died without a word (killed, or crashed at start): fail fast, named
                    raise RuntimeError(f"rank(s) {dead} died with exit code(s) {[procs[r].exitcode for r in dead]}")
                if time.monotonic() > end:
                    raise TimeoutError(f"ranks {sorted(set(range(world)) - set(out))} did not finish in {timeout}s")
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed: {val}")
            out[rank] = val
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        sweep(tag)
    return [out[r] for r in range(world)]
