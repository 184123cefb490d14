"""The Triton runner on a GPU (skipped without CUDA). Multi-GPU qualification runs through the
jobs; these are the single-process checks."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
triton = pytest.importorskip("triton")

from ffnq import symm
from ffnq import reference  # noqa: E402
from ffnq.backends.triton import TritonRunner  # noqa: E402
from ffnq.spec import Experts, Phase, load_model, view  # noqa: E402
from ffnq.weights import shard, synthetic  # noqa: E402

DEV = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def tiny():
    spec = load_model("tiny")
    full = synthetic(spec, seed=11, device=DEV)
    return spec, full


def _inputs(spec, s, seed, tp=1):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(s, spec.hidden, generator=g).to(torch.bfloat16).to(DEV) for _ in range(tp)]
    resid = torch.randn(s, spec.hidden, generator=g).to(torch.bfloat16).to(DEV)
    slots = torch.arange(s, dtype=torch.int64, device=DEV)
    if s >= 3:
        slots[1] = -1
    return parts, resid, slots


@pytest.mark.parametrize("experts", [Experts.ALL, Experts.NONE])
def test_tp1_matches_reference(tiny, experts):
    spec, full = tiny
    w = shard(full, spec, 1, 0, experts, device=DEV)
    pb = TritonRunner.open_peers(spec, 1, 0, DEV, "t")
    widths = [1, 3, 16]
    r = TritonRunner(1, 0, pb.sym, pb.peers, DEV, widths=widths, experts=experts, model=spec)
    r.warm(w, compute_units=torch.cuda.get_device_properties(DEV).multi_processor_count)
    for s in widths:
        assert r.residency[s] >= 1 and r.describe(s)["n_regs"] > 0
        parts, resid, slots = _inputs(spec, s, 100 + s)
        for final in (False, True):
            out, res = r(parts[0], resid, w, slots, final=final)
            torch.cuda.synchronize()
            ref = reference.step(parts, resid, slots, full, spec, experts)
            keep = slots >= 0
            assert reference.compare(out, ref.out, rows=torch.nonzero(keep).flatten())["rel_err"] <= 1e-2
            assert reference.compare(res, ref.res_out)["rel_err"] <= 1e-2
            nt = ~ref.near_tie
            assert torch.equal(r.view(s, "route").long()[nt], ref.chosen[nt])
            assert (out[~keep] == 0).all()
            assert r.fault(s) is None
    pb.close()


def test_graph_replay_moves_the_epoch(tiny):
    spec, full = tiny
    w = shard(full, spec, 1, 0, Experts.ALL, device=DEV)
    pb = TritonRunner.open_peers(spec, 1, 0, DEV, "g")
    r = TritonRunner(1, 0, pb.sym, pb.peers, DEV, widths=[2], model=spec)
    r.warm(w)
    parts, resid, slots = _inputs(spec, 2, 7)
    eager, _ = r(parts[0], resid, w, slots)
    torch.cuda.synchronize()
    e0 = int(r.epoch[0])
    g = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st), torch.cuda.graph(g):
        outs = [r(parts[0], resid, w, slots)[0] for _ in range(3)]
    torch.cuda.current_stream().wait_stream(st)
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    assert int(r.epoch[0]) == e0 + 6
    assert all(torch.equal(o, eager) for o in outs)
    assert r.fault(2) is None
    pb.close()


def test_capture_of_weights_not_yet_packed_is_named(tiny):
    """PACKED_W13: a first launch on new weights packs w13 with torch copies, which a CUDA-graph
    capture must not record: named, not captured; after one eager step the capture works."""
    from ffnq.errors import UsageError
    spec, full = tiny
    w = shard(full, spec, 1, 0, Experts.ALL, device=DEV)
    pb = TritonRunner.open_peers(spec, 1, 0, DEV, "p")
    r = TritonRunner(1, 0, pb.sym, pb.peers, DEV, widths=[2], model=spec)
    r.warm(w)
    fresh = shard(synthetic(spec, seed=12, device=DEV), spec, 1, 0, Experts.ALL, device=DEV)
    parts, resid, slots = _inputs(spec, 2, 8)
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with pytest.raises(UsageError, match="w13 is not packed"):
        with torch.cuda.stream(st), torch.cuda.graph(torch.cuda.CUDAGraph()):
            r(parts[0], resid, fresh, slots)
    torch.cuda.synchronize()
    eager, _ = r(parts[0], resid, fresh, slots)  # (the refused capture launched nothing)
    g = torch.cuda.CUDAGraph()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st), torch.cuda.graph(g):
        out, _ = r(parts[0], resid, fresh, slots)
    torch.cuda.current_stream().wait_stream(st)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    pb.close()


def test_residency_refusal(tiny):
    spec, full = tiny
    w = shard(full, spec, 1, 0, Experts.ALL, device=DEV)
    pb = TritonRunner.open_peers(spec, 1, 0, DEV, "r")
    r = TritonRunner(1, 0, pb.sym, pb.peers, DEV, widths=[1], model=spec)
    with pytest.raises(RuntimeError, match="cannot be resident"):
        r.warm(w, compute_units=1)  # a 1-SM device cannot hold 128 CTAs
    pb.close()


def test_missing_rank_is_named_without_hang(tiny):
    """TP2 simulated on one GPU: rank 0 runs alone (rank 1 never arrives) -> bounded seam wait,
    fault naming rank 1; then rank 1 runs and learns from fault_box that it was the missing one."""
    spec, full = tiny
    nb = TritonRunner.peer_bytes(spec, 2)
    bufs = [torch.zeros(nb, dtype=torch.uint8, device=DEV) for _ in range(2)]
    for b in bufs:
        symm.BUFFERS[b.data_ptr()] = b
    peers = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=DEV)
    rs = [TritonRunner(2, k, bufs[k].data_ptr(), peers, DEV, widths=[2], model=spec, timeout=0.01, timeline=True)
          for k in range(2)]
    ws = [shard(full, spec, 2, k, Experts.ALL, device=DEV) for k in range(2)]
    for k in range(2):
        rs[k].warm(ws[k])
    parts, resid, slots = _inputs(spec, 2, 3, tp=2)
    rs[0](parts[0], resid, ws[0], slots, final=True)
    torch.cuda.synchronize()
    f0 = rs[0].fault(2)
    assert f0 is not None and f0["phase"] == Phase.SEAM and f0["missing_ranks"] == [1]
    assert 0.005e9 < f0["waited_ns"] < 1e9
    assert int(rs[0].epoch[0]) == 1  # the launch still ended and moved the epoch on
    box = view(bufs[1], rs[0].peer_regions["fault_box"])[0].tolist()
    assert box[0] == 1 and box[1] == 2
    rs[1](parts[1], resid, ws[1], slots, final=True)
    torch.cuda.synchronize()
    f1 = rs[1].fault(2)
    assert f1 is not None and f1["missing_ranks"] == [1]
    for b in bufs:
        symm.BUFFERS.pop(b.data_ptr(), None)
