"""options: the parsers, the checks before torchrun starts, each job's deadline."""
import pytest

from ffnq.errors import UsageError
from ffnq.jobs.bench import BenchOptions
from ffnq.jobs.qualify import QualifyOptions, over_delay_ns, under_delay_ns
from ffnq.launch import job_env
from ffnq.options import parse_inject, parse_widths


def test_widths_lists_and_ranges():
    assert parse_widths("1-4,8,16", 16) == [1, 2, 3, 4, 8, 16]
    assert parse_widths("3,1-2,2", 16) == [1, 2, 3]
    assert parse_widths("all", 4) == [1, 2, 3, 4]


@pytest.mark.parametrize("text", ["0", "17", "4-2", "1-x", "1,,2", "-3", "1.5"])
def test_widths_refused_with_the_value(text):
    with pytest.raises(UsageError, match="--widths"):
        parse_widths(text, 16)


def test_widths_error_names_the_option():
    with pytest.raises(UsageError, match=r"^--time '1-20': 1-20 outside 1\.\.16"):
        parse_widths("1-20", 16, "--time")


def test_inject_ranks():
    assert parse_inject(["all"], 3) == [0, 1, 2]
    assert parse_inject(["1", "0,1"], 2) == [0, 1]
    with pytest.raises(UsageError, match=r"--inject-rank '2': allowed 0\.\.1"):
        parse_inject(["2"], 2)


@pytest.mark.parametrize("kw, match", [
    (dict(tp=0), "--tp 0"), (dict(tp=8), "tp=8"), (dict(experts="some"), "--experts 'some'"),
    (dict(widths=[0]), r"widths \[0\]"), (dict(timeout_s=0), "--timeout 0"), (dict(timeout_s=-1), "--timeout -1"),
    (dict(inject_ranks=[2]), "--inject-rank 2"), (dict(backend="nope"), "--backend 'nope'"),
    (dict(backend="triton"), "needs a GPU"), (dict(backend="no.such:Runner"), "cannot import"),
    (dict(model="nope"), "model 'nope'"), (dict(nnodes=2), "needs --rdzv-endpoint"), (dict(layers=0), "--layers 0"),
    (dict(timeout_s=3.0, inject_ranks=[0]), "int32 ns"), (dict(deadline_s=0), "--deadline 0"),
])
def test_validate_refuses_before_anything_runs(kw, match):
    with pytest.raises(UsageError, match=match):
        (BenchOptions if 'layers' in kw else QualifyOptions)(**kw).validate()


def test_validate_fills_widths():
    assert QualifyOptions(tp=2).validate().widths == list(range(1, 17))


def test_env_and_delays():
    env = job_env("jtag")
    assert env["FFNQ_TAG"] == "jtag" and env["OMP_NUM_THREADS"] == "1" and env["NCCL_NVLS_ENABLE"] == "0"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert under_delay_ns(1.0) == 300_000_000 < 1e9 < 1.5e9 < over_delay_ns(1.0) < 2**31
    o = QualifyOptions(widths=[1, 2], inject_ranks=[0, 1])
    assert o.deadline() > 2 * over_delay_ns(1.0) / 1e9
    assert QualifyOptions(deadline_s=7).deadline() == 7


def test_the_deadline_allows_for_reading_a_checkpoint():
    """Each rank of a node reads its layer (a GPU bench: its four weight sets' layers) from one
    disk: 3.6 GB a MiniMax-M2 layer, at 0.5 GB/s."""
    m2 = dict(model="minimax-m2", tp=2, widths=[1])
    base = BenchOptions(backend="triton", **m2).deadline()
    cpu = QualifyOptions(checkpoint="ck", checkpoint_layer=0, **m2).deadline() - QualifyOptions(**m2).deadline()
    gpu = BenchOptions(backend="triton", checkpoint="ck", checkpoint_layer=0, **m2).deadline() - base
    assert cpu == pytest.approx(30 + 2 * 3.62 / 0.5, rel=0.01) and gpu == pytest.approx(30 + 8 * 3.62 / 0.5, rel=0.01)


def test_triton_interpreter_is_one_rank(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(UsageError, match="runs one rank only"):
        QualifyOptions(backend="triton", tp=2).validate()


