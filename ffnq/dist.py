"""Process group from torchrun's environment, and shared-memory peer buffers for the cpu backend.

A cpu peer buffer is a file in /dev/shm that every rank maps. Each rank unlinks its own file as
soon as every rank has mapped every file, so a rank killed later leaves nothing behind; the
launcher sweeps ``ffnq-<tag>-*`` for a job that died before that point.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import secrets
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

SHM = Path("/dev/shm")
PREFIX = "ffnq-"


@dataclass
class PeerBuffer:
    """One rank's view of the job's peer buffers; ``close`` releases them (collective-free)."""

    sym: int
    peers: torch.Tensor  # int64 [tp], addresses as mapped in this process
    nbytes: int
    close: Callable[[], None] = lambda: None
    keep: list = field(default_factory=list)  # objects that must outlive the addresses


def init_from_env(backend: str = "gloo", timeout_s: float = 60.0) -> tuple[int, int]:
    """(rank, world) from torchrun's variables; a single process needs none of them."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:  # a hand-set environment; torchrun's always holds
        raise ValueError(f"RANK={rank} with WORLD_SIZE={world}: allowed 0..WORLD_SIZE-1 (WORLD_SIZE >= 1)")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return rank, world


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_ranks(x: int) -> list[int]:
    """Every rank's ``x``, in rank order (a list of one without a process group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        # a cpu tensor: gloo in the jobs' "cpu:gloo,cuda:nccl" groups, as records' reductions
        t = torch.tensor([int(x)], dtype=torch.int64)
        out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t)
        return [int(o) for o in out]
    return [int(x)]


def shared_tag() -> str:
    """One tag for the whole job: rank 0's launcher's (FFNQ_TAG; each node's ffnq draws its own),
    else one rank 0 draws, broadcast."""
    obj = [os.environ.get("FFNQ_TAG") or secrets.token_hex(4)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(obj, src=0)
    return obj[0]


def segment_path(tag: str, rank: int) -> Path:
    return SHM / f"{PREFIX}{tag}-r{rank}"


class ShmPeers:
    """Every rank's segment mapped here; ``addresses[r]`` is rank r's as seen by this process."""

    def __init__(self, tag: str, rank: int, world: int, nbytes: int):
        self.maps: list[mmap.mmap] = []
        own = segment_path(tag, rank)
        fd = os.open(own, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)  # tmpfs pages read as zero
        finally:
            os.close(fd)
        try:
            barrier()  # every segment exists
            for r in range(world):
                fd = os.open(segment_path(tag, r), os.O_RDWR)
                try:
                    self.maps.append(mmap.mmap(fd, nbytes))
                finally:
                    os.close(fd)
            barrier()  # every rank has mapped every segment: the names can go
        finally:
            own.unlink(missing_ok=True)
        self.arrays = [(ctypes.c_uint8 * nbytes).from_buffer(m) for m in self.maps]
        self.addresses = [ctypes.addressof(a) for a in self.arrays]
        self.nbytes = nbytes

    def close(self) -> None:
        self.arrays.clear()  # ctypes views pin the maps; drop them first
        for m in self.maps:
            try:
                m.close()
            except BufferError:  # a tensor still views it; the OS unmaps at exit
                pass
        self.maps.clear()


def sweep(tag: str) -> list[str]:
    """Remove segments a dead job left behind; returns their names."""
    gone = []
    for p in SHM.glob(f"{PREFIX}{tag}-r*"):
        p.unlink(missing_ok=True)
        gone.append(p.name)
    return gone


def address_view(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over memory mapped at ``address`` in this process."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)
