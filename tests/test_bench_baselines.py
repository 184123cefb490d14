"""bench_baselines: which baselines a bench builds, the launch configs it would sweep, what each says it is."""
from types import SimpleNamespace

import torch

from ffnq.jobs import bench_baselines as bb
from ffnq.spec import Experts, load_model
from ffnq.weights import shard, synthetic


def test_the_sweep_is_benchmark_moe_s_space_where_decode_tells_configs_apart():
    space = bb.sweep_space()
    assert len(space) == 48
    assert {c["BLOCK_SIZE_M"] for c in space} == {16, 32, 64} and {c["GROUP_SIZE_M"] for c in space} == {1}
    assert {c["BLOCK_SIZE_N"] for c in space} == {128, 256} and {c["BLOCK_SIZE_K"] for c in space} == {128}
    assert {c["num_stages"] for c in space} == {2, 3, 4, 5} and {c["num_warps"] for c in space} == {4, 8}


def test_cpu_builds_the_unfused_loop_and_says_what_it_is():
    m = load_model("tiny")
    w = shard(synthetic(m, 1), m, 1, 0, Experts.ALL)
    job = SimpleNamespace(device=torch.device("cpu"), tp=1, experts=Experts.ALL, model=m)
    made = bb.make(job, [], [w])
    assert [name for name, _ in made] == ["unfused"]
    said = bb.described([("fused", [object()])] + made)
    assert list(said) == ["unfused"] and "not a tuned stack" in said["unfused"]
    # a GPU bench with --experts none times no composition (there is nothing to compose)
    gpu_none = SimpleNamespace(device=torch.device("cuda"), tp=1, experts=Experts.NONE, model=m)
    assert bb.make(gpu_none, ["unfused", "vllm"], [w]) == []


def test_every_vllm_variant_is_judged_at_vllm_s_tolerance():
    assert set(bb.REL_ERR_OF) == {b for b in bb.BASELINES if b.startswith("vllm")}
    assert all(bb.REL_ERR_OF[b] > bb.BASELINE_REL_ERR for b in bb.REL_ERR_OF)
