"""ffnq.dist: without a process group every collective is this process's own value; on real ranks
all_ranks gathers in rank order and shared_tag is rank 0's; shared-memory peer segments are
mapped, leave no name behind, and sweep removes only the given tag's."""
import os
import secrets

import pytest
import torch
import torch.distributed as dist

from ffnq.dist import SHM, ShmPeers, address_view, all_ranks, init_from_env, segment_path, shared_tag, sweep
from multirank import run_ranks


def test_single_process_needs_no_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "FFNQ_TAG"):
        monkeypatch.delenv(var, raising=False)
    assert init_from_env() == (0, 1) and not dist.is_initialized()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_from_env("gloo", 1.0) == (0, 1) and not dist.is_initialized()
    x = secrets.randbelow(1 << 40)
    assert all_ranks(x) == [x]
    a, b = shared_tag(), shared_tag()
    assert len(a) == 8 and set(a) <= set("0123456789abcdef") and a != b  # fresh per call without a launcher's tag
    monkeypatch.setenv("FFNQ_TAG", "launcher7")
    assert shared_tag() == "launcher7"
    for rank, world in (("2", "2"), ("-1", "2"), ("0", "0")):  # set by hand, not by torchrun
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", world)
        with pytest.raises(ValueError, match=rf"^RANK={rank} with WORLD_SIZE={world}: allowed 0..WORLD_SIZE-1"):
            init_from_env()
        assert not dist.is_initialized()


def test_segments_map_and_leave_no_name(tmp_path):
    tag = "t" + secrets.token_hex(4)
    shm = ShmPeers(tag, 0, 1, 4096)
    assert not segment_path(tag, 0).exists()  # unlinked once every rank has mapped it
    assert segment_path(tag, 0) == SHM / f"ffnq-{tag}-r0"
    data = torch.randint(1, 256, (4096,), dtype=torch.uint8)
    view = address_view(shm.addresses[0], 4096)
    view.copy_(data)
    assert torch.equal(torch.frombuffer(bytearray(shm.maps[0][:]), dtype=torch.uint8), data)
    del view
    shm.close()
    assert shm.maps == []


def test_sweep_removes_only_its_tags_segments():
    tag, other = "t" + secrets.token_hex(4), "t" + secrets.token_hex(4)
    made = [segment_path(tag, r) for r in range(3)] + [segment_path(other, 0)]
    for p in made:
        p.write_bytes(os.urandom(16))
    try:
        assert sorted(sweep(tag)) == sorted(p.name for p in made[:3])
        assert not any(p.exists() for p in made[:3]) and made[3].exists()
        assert sweep(tag) == []
    finally:
        made[3].unlink(missing_ok=True)


def gather_and_tag(rank, world, values):
    os.environ.pop("FFNQ_TAG")  # no launcher's tag: rank 0 draws one and broadcasts it
    return all_ranks(values[rank]), shared_tag(), init_from_env()


@pytest.mark.slow  # 15 s
def test_ranks_gather_in_order_and_share_rank0s_tag():
    values = [secrets.randbelow(1 << 40) for _ in range(2)]
    got = run_ranks(gather_and_tag, 2, values, timeout=120)
    assert [g[0] for g in got] == [values, values]
    assert got[0][1] == got[1][1] and len(got[0][1]) == 8
    assert [g[2] for g in got] == [(0, 2), (1, 2)]
