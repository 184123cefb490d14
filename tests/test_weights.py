import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ffnq.errors import UsageError
from ffnq.reference import route
from ffnq.spec import Experts, load_model
from ffnq.weights import FP8, check_checkpoint, checkpoint_layers, dequant, layer_names, load_layer, shard, synthetic
from helpers import write_checkpoint

M = load_model("tiny")


@pytest.fixture(scope="module")
def full():
    return synthetic(M, seed=11)


def test_synthetic_is_deterministic_and_fp8(full):
    again = synthetic(M, seed=11)
    other = synthetic(M, seed=12)
    assert full.w1.dtype == FP8 and full.s1.dtype == torch.float32 and full.router.dtype == torch.float32
    assert full.w1.shape == (32, 1536, 256) and full.s1.shape == (32, 12, 2)
    assert full.w2.shape == (32, 256, 1536) and full.s2.shape == (32, 2, 12)
    assert torch.equal(full.w1.view(torch.uint8), again.w1.view(torch.uint8))
    assert not torch.equal(full.w1.view(torch.uint8), other.w1.view(torch.uint8))
    # codes use the fp8 range without saturating, and every block has its own scale
    q = full.w1.float()
    assert q.abs().max() < 448 and q.std() > 4
    assert full.s1.unique().numel() == full.s1.numel()


def test_dequant_is_blockwise(full):
    d = dequant(full.w1[3], full.s1[3], 128)
    # element by element on both sides of every block edge (rows 126-129 and 254-255 of the first
    # three row blocks, columns 126-129): an off-by-one in the block index changes a scale here
    q, sc = full.w1[3].float(), full.s1[3]
    for i in (0, 126, 127, 128, 129, 254, 255, 256, 257, 1535):
        for j in (0, 126, 127, 128, 129, 255):
            assert d[i, j] == q[i, j] * sc[i // 128, j // 128], (i, j)
    # unit-scale projections: x ~ N(0,1) keeps ~unit scale through w1
    x = torch.randn(64, 256)
    assert 0.5 < (x @ d.T).std() < 2.0


@pytest.mark.parametrize("routing, least", [("uniform", 0.2), ("skewed", 0.5)])
def test_bias_changes_topk_in_many_rows(routing, least):
    """The selection bias matters: the uniform router's narrow bias (decode-like spread of experts)
    still reorders the top-k of a fifth of the rows at least, the skewed one's of most."""
    w = synthetic(M, seed=11, routing=routing)
    x = torch.randn(512, M.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    biased, _, _ = route(x, w, M)
    plain = torch.topk(torch.sigmoid(x @ w.router.double().T), M.top_k).indices
    differs = (biased.sort(-1).values != plain.sort(-1).values).any(-1).float().mean()
    assert differs > least, f"bias reorders only {differs:.0%} of rows"


def test_shards_rebuild_the_full_layer(full):
    tp = 2
    sh = [shard(full, M, tp, r, Experts.ALL) for r in range(tp)]
    I = M.intermediate // tp
    w1 = torch.cat([s.w13[:, :I] for s in sh], 1)
    w3 = torch.cat([s.w13[:, I:] for s in sh], 1)
    w2 = torch.cat([s.w2 for s in sh], 2)
    for a, b in ((w1, full.w1), (w3, full.w3), (w2, full.w2)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(torch.cat([s.s2 for s in sh], 2), full.s2)
    loc = [shard(full, M, 4, r, Experts.LOCAL) for r in range(4)]
    assert [s.first_expert for s in loc] == [0, 8, 16, 24]
    assert torch.equal(loc[2].w13[1, :M.intermediate].view(torch.uint8), full.w1[17].view(torch.uint8))
    assert shard(full, M, 2, 1, Experts.NONE).w13.numel() == 0
    with pytest.raises(UsageError, match="rank 2"):
        shard(full, M, 2, 2, Experts.ALL)


def test_loader_reads_minimax_tensor_names(full, tmp_path):
    layer = 7
    tensors = {}
    for k, n in layer_names(layer).items():
        tensors[n] = getattr(full, k)
    for e in range(M.experts):
        for k, n in layer_names(layer, e).items():
            tensors[n] = getattr(full, k)[e].contiguous()
    assert "model.layers.7.block_sparse_moe.experts.3.w2.weight_scale_inv" in tensors
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[: len(names) // 2]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[len(names) // 2:]}, tmp_path / "model-00002-of-00002.safetensors")
    got = load_layer(tmp_path, layer, M)
    for k in ("w1", "w3", "w2"):
        assert torch.equal(getattr(got, k).view(torch.uint8), getattr(full, k).view(torch.uint8))
    for k in ("s1", "s3", "s2", "router", "router_bias", "post_norm"):
        assert torch.equal(getattr(got, k), getattr(full, k))
    with pytest.raises(UsageError, match="tensor model.layers.8.post_attention_layernorm.weight missing"):
        load_layer(tmp_path, 8, M)
    with pytest.raises(UsageError, match="no .safetensors"):
        load_layer(tmp_path / "nothing", layer, M)


@pytest.mark.slow  # 12 s
def test_checkpoint_checked_from_its_headers(tmp_path):
    ck = write_checkpoint(tmp_path / "ck", M, layers=[2, 3])
    assert checkpoint_layers(ck) == [2, 3]
    check_checkpoint(ck, 3, M)  # passes: nothing raised
    got = load_layer(ck, 3, M)
    assert torch.equal(got.router, synthetic(M, 3).router)  # layer L was written from seed L
    with pytest.raises(UsageError, match="--checkpoint-layer 5: checkpoint .* holds layers 2..3"):
        check_checkpoint(ck, 5, M)
    with pytest.raises(UsageError, match="config.json hidden_size = 256, --model minimax-m2 has hidden = 3072"):
        check_checkpoint(ck, 2, load_model("minimax-m2"))
    (ck / "config.json").unlink()  # a checkpoint without one: the tensors' shapes still say it
    with pytest.raises(UsageError, match="post_attention_layernorm.weight has shape .256,., --model minimax-m2 "
                                         "needs .3072,."):
        check_checkpoint(ck, 2, load_model("minimax-m2"))


W1 = "model.layers.0.block_sparse_moe.experts.{}.w1.weight"


@pytest.mark.parametrize("change, message", [
    ({"config": {"use_routing_bias": False}}, "use_routing_bias = false"),
    ({"config": {"num_experts_per_tok": 4}}, "num_experts_per_tok = 4, --model tiny has top_k = 8"),
    ({W1.format(5): torch.zeros(M.intermediate, M.hidden, dtype=torch.bfloat16)}, "w1.weight is BF16, the experts"),
    ({W1.format(5).replace("weight", "weight_scale_inv"): torch.ones(12, 2, dtype=torch.float16)}, "must be F32"),
    ({W1.format(M.experts): torch.zeros(M.intermediate, M.hidden, dtype=FP8)}, "more than 32 experts"),
], ids=["no-routing-bias", "top-k", "bf16-experts", "fp16-scales", "extra-expert"])
def test_a_checkpoint_that_is_not_the_model_is_refused(tmp_path, change, message):
    config = change.pop("config", None)
    ck = write_checkpoint(tmp_path / "ck", M, layers=[0], config=config, **change)
    with pytest.raises(UsageError, match=message):
        check_checkpoint(ck, 0, M)


def test_a_missing_tensor_or_file_is_named(tmp_path):
    ck = write_checkpoint(tmp_path / "ck", M, layers=[0])
    (ck / "model-00001-of-00002.safetensors").unlink()  # the experts' first half
    with pytest.raises(UsageError, match="tensor model.layers.0.* missing .layer 0, --model tiny."):
        check_checkpoint(ck, 0, M)
    (tmp_path / "junk.safetensors").write_text("not a checkpoint")
    with pytest.raises(UsageError, match="junk.safetensors: not a readable .safetensors file"):
        check_checkpoint(tmp_path / "junk.safetensors", 0, M)


def test_a_checkpoints_headers_are_read_once_per_process_until_its_files_change(tmp_path, monkeypatch):
    """A bench on a GPU loads four layers of one checkpoint: the headers of its files (126 in a real
    one) are read once; a checkpoint rewritten in place is read again."""
    import safetensors

    ck = write_checkpoint(tmp_path / "ck", M, layers=[2, 3])
    opened = []
    real = safetensors.safe_open

    def counting(f, *a, **k):
        opened.append(Path(f).name)
        return real(f, *a, **k)

    monkeypatch.setattr(safetensors, "safe_open", counting)
    assert checkpoint_layers(ck) == [2, 3]
    n = len(opened)
    assert n >= 1 and checkpoint_layers(ck) == [2, 3] and len(opened) == n
    got = load_layer(ck, 2, M)
    assert len(opened) <= 2 * n  # the files holding the layer's tensors, no header pass
    write_checkpoint(tmp_path / "ck", M, layers=[4])
    for f in (tmp_path / "ck").glob("*.safetensors"):  # a rewrite within the clock's step still counts
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1))
    assert checkpoint_layers(ck) == [4]
    assert torch.equal(got.router, synthetic(M, 2).router)
