"""Peer buffers of the GPU backends: torch symmetric memory (a plain device buffer at TP1 with
no process group). ``BUFFERS`` maps every address this process handed out to the tensor that
owns it, so a runner can view its own buffer from the address alone."""
from __future__ import annotations

import torch

from ffnq.errors import UsageError
from ffnq.dist import PeerBuffer

BUFFERS: dict[int, torch.Tensor] = {}


def open_peers(nbytes: int, tp: int, rank: int, device) -> PeerBuffer:
    """Collective over the default process group (when there is one)."""
    import torch.distributed as dist

    dev = torch.device(device)
    if tp == 1 and not (dist.is_available() and dist.is_initialized()):
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        addr = buf.data_ptr()
        BUFFERS[addr] = buf
        return PeerBuffer(addr, torch.tensor([addr], dtype=torch.int64, device=dev), nbytes,
                          close=lambda: BUFFERS.pop(addr, None), keep=[buf])
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=dev)
    buf.zero_()
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    ptrs = [int(p) for p in hdl.buffer_ptrs]
    if len(ptrs) != tp:
        raise UsageError(f"peer buffers: {len(ptrs)} ranks in the process group, tp={tp}")
    torch.cuda.synchronize(dev)
    dist.barrier()  # every rank's buffer is zeroed before anyone writes a flag into it
    addr = ptrs[rank]
    BUFFERS[addr] = BUFFERS[buf.data_ptr()] = buf

    def close():
        BUFFERS.pop(addr, None)
        BUFFERS.pop(buf.data_ptr(), None)

    return PeerBuffer(addr, torch.tensor(ptrs, dtype=torch.int64, device=dev), nbytes, close=close,
                      keep=[buf, hdl])


def view(address: int, nbytes: int, who: str) -> torch.Tensor:
    buf = BUFFERS.get(int(address))
    if buf is None:
        raise UsageError(f"peer buffer at {int(address):#x}: not opened by {who}.open_peers")
    return buf.view(torch.uint8)[:nbytes]
