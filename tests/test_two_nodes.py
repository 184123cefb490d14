"""Two ffnq node processes on this host meet at a c10d rendezvous (cpu backend, gloo, one rank
each) and run one qualify across them: what `--nnodes 2 --rdzv-endpoint HOST:PORT` does on two
machines, here on one."""
import json
import socket
import subprocess
import time

import pytest

from helpers import ffnq_cmd, one_report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes_share_one_tag() -> bool:
    """The cpu peer buffers are named by the job's tag: every node must take rank 0's, not the
    one its own launcher drew."""
    import os
    from unittest import mock

    import ffnq.dist as d

    def bcast(obj, src=0):
        obj[0] = "rank0s"
    with mock.patch.dict(os.environ, {"FFNQ_TAG": "this-nodes"}), \
            mock.patch.object(d.dist, "is_initialized", lambda: True), \
            mock.patch.object(d.dist, "get_world_size", lambda: 2), \
            mock.patch.object(d.dist, "broadcast_object_list", bcast):
        return d.shared_tag() == "rank0s"


@pytest.mark.slow
@pytest.mark.skipif(not _nodes_share_one_tag(), reason="ffnq.dist.shared_tag keeps each node's own FFNQ_TAG, so "
                    "the nodes' cpu peer buffers are named apart and never meet")
def test_qualify_across_two_nodes(tmp_path):
    endpoint = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([*ffnq_cmd(), "qualify", "--backend", "cpu", "--tp", "2", "--nnodes", "2",
                               "--rdzv-endpoint", endpoint, "--widths", "1,2", "--out", str(tmp_path / f"node{n}")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(2)]
    end = time.monotonic() + 400
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, end - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert [p.returncode for p in procs] == [0, 0], outs
    for n in range(2):
        doc = json.loads((one_report(tmp_path / f"node{n}", "qualify") / "results.json").read_text())
        assert {c["status"] for c in doc["tables"]["results"]} == {"PASS"}
        assert "--nnodes 2" in doc["torchrun"] and f"--rdzv-endpoint {endpoint}" in doc["torchrun"]
    # node 0 holds every rank's rows (rank 0 gathers them); both ran the injected and stale cases
    cases = json.loads((one_report(tmp_path / "node0", "qualify") / "results.json").read_text())["tables"]["results"]
    assert {"correct", "stale-epoch older r1", "recovery stale-epoch newer"} <= {c["case"] for c in cases}
