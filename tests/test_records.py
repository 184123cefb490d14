"""ffnq.jobs.records in one process (no process group): a rank's JSON lines read back as written,
gather puts rank 0's rows in all.jsonl, the collectives reduce to this rank's own value, and main
records start/done or the error around a job's body."""
import json
import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ffnq.jobs import records
from ffnq.jobs.records import Records, clock_offsets, max_over_ranks


def lines(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text().splitlines()]


@pytest.fixture
def one_rank_job(tmp_path, monkeypatch):
    """records.main's argv and environment as torchrun gives a lone rank 0 (its options file:
    result_dir = tmp_path, x = 7); torch's thread count, which main sets, restored after."""
    for var in ("RANK", "FFNQ_TEST_DIE_RANK", "FFNQ_TEST_HANG_RANK"):
        monkeypatch.delenv(var, raising=False)
    opts = tmp_path / "opts.json"
    opts.write_text(json.dumps({"result_dir": str(tmp_path), "x": 7}))
    monkeypatch.setattr(sys, "argv", ["job", str(opts)])
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_records_read_back_as_written(tmp_path):
    rec = Records(str(tmp_path), 3)
    x = random.random()
    rec.progress(2, 5, "width 4")
    rec.row("latency", {"width": 4, "p50_us": x, "where": tmp_path})  # not JSON: written as str
    rec.write("done", note="ok")
    got = lines(tmp_path / "rank3.jsonl")
    assert [g["kind"] for g in got] == ["progress", "row", "done"] and {g["rank"] for g in got} == {3}
    assert (got[0]["done"], got[0]["total"], got[0]["what"]) == (2, 5, "width 4")
    assert got[1]["table"] == "latency" and got[1]["data"] == {"width": 4, "p50_us": x, "where": str(tmp_path)}
    assert got[2]["note"] == "ok" and isinstance(got[2]["t"], float)
    Records(str(tmp_path), 3).write("start")  # a second writer appends
    assert [g["kind"] for g in lines(tmp_path / "rank3.jsonl")] == ["progress", "row", "done", "start"]


def test_gather_without_a_group_writes_rank0_rows_only(tmp_path):
    assert not dist.is_initialized()
    rec = Records(str(tmp_path), 0)
    rows = [{"width": w, "v": random.random()} for w in (1, 2)]
    rec.progress(0, 2)
    for r in rows:
        rec.row("t", r)
    rec.gather()
    assert [g["data"] for g in lines(tmp_path / "all.jsonl")] == rows  # rows only, in order
    assert not (tmp_path / "all.jsonl.tmp").exists()
    (tmp_path / "r1").mkdir()
    other = Records(str(tmp_path / "r1"), 1)
    other.row("t", rows[0])
    other.gather()
    assert not (tmp_path / "r1" / "all.jsonl").exists()  # only rank 0 writes it


def test_collectives_without_a_group_are_this_ranks_own():
    x = random.uniform(-5, 5)
    assert max_over_ranks(x) == x
    assert clock_offsets(lambda: random.randrange(1 << 40)) == [0]


def test_main_records_start_rows_and_done_or_the_error(tmp_path, one_rank_job):
    seen = []
    records.main(lambda o, rec: (rec.row("t", {"x": o["x"]}), seen.append(rec)))
    assert seen[0].file.closed  # the rank's file, closed on the way out
    assert [g["kind"] for g in lines(tmp_path / "rank0.jsonl")] == ["start", "row", "done"]
    assert lines(tmp_path / "rank0.jsonl")[0]["pid"] == os.getpid()
    assert lines(tmp_path / "all.jsonl")[0]["data"] == {"x": 7}

    def body(o, rec):
        raise ValueError("bad width\nsecond line")

    with pytest.raises(ValueError, match="bad width"):
        records.main(body)
    err = lines(tmp_path / "rank0.jsonl")[-1]
    assert err["kind"] == "error" and err["message"] == "ValueError: bad width" and "Traceback" in err["trace"]


def test_main_marks_bad_input_and_lost_peers(tmp_path, one_rank_job):
    """An error record says whether it is bad input (exit 2) or what a lost peer causes here
    (never the verdict while the lost rank can be named)."""
    from ffnq.errors import RankFault, UsageError

    fault = RankFault({"rank": 0, "phase_name": "seam", "epoch": 3, "missing_ranks": [1], "waited_ns": 10**9})
    from ffnq.jobs.rank import runner_error

    cases = [(runner_error("x", "warm", RuntimeError("no")), True, False), (UsageError("grids differ"), False, False),
             (RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:5"), False, True),
             (fault, False, True), (ValueError("a kernel's own bug"), False, False)]
    for exc, usage, lost in cases:
        def body(o, rec, exc=exc):
            rec.phase("correct w=3")
            raise exc
        with pytest.raises(type(exc)):
            records.main(body)
        err = lines(tmp_path / "rank0.jsonl")[-1]
        assert (err["usage"], err["peer_loss"], err["phase"]) == (usage, lost, "correct w=3"), err
        beat = json.loads((tmp_path / "rank0.beat").read_text())
        assert beat["final"] == "error" and beat["pid"] == os.getpid()
    assert err["kind"] == "error" and lines(tmp_path / "rank0.jsonl")[-3]["missing"] == [1]
    assert lines(tmp_path / "rank0.jsonl")[-9]["message"] == "UsageError: runner x: warm failed: RuntimeError: no"


def test_main_writes_a_usage_errors_flag_apart_from_its_line(tmp_path, one_rank_job):
    """A UsageError(what, use) on a rank (raised there, or a runner's, as rank.runner_error names
    it): the record's message is "UsageError: " + what and ``use`` is its own field, so the
    launcher rebuilds UsageError(what, use) (test_launch); other errors' records carry no ``use``."""
    from ffnq.errors import UsageError
    from ffnq.jobs.rank import runner_error

    gpu = UsageError("--backend triton: needs a GPU and this host has none", use="--backend cpu")
    said = "runner triton: __init__ failed: --backend triton: needs a GPU and this host has none"
    cases = [(runner_error("triton", "__init__", gpu), f"UsageError: {said}", "--backend cpu", True),
             (gpu, f"UsageError: {gpu.what}", "--backend cpu", False),
             (UsageError("grids differ"), "UsageError: grids differ", None, False),
             (ValueError("bad width (use --widths 4)"), "ValueError: bad width (use --widths 4)", None, False)]
    for exc, message, use, usage in cases:
        def body(o, rec, exc=exc):
            raise exc
        with pytest.raises(type(exc)):
            records.main(body)
        err = lines(tmp_path / "rank0.jsonl")[-1]
        assert (err["message"], err.get("use"), err["usage"]) == (message, use, usage), err
        assert ("use" in err) == (use is not None)
    assert str(cases[0][0]) == f"{said} (use --backend cpu)" and cases[0][0].use == "--backend cpu"


def test_heartbeat_carries_the_phase_the_call_and_the_counts(tmp_path):
    rec = Records(str(tmp_path), 2, beat=True)
    try:
        rec.counts = lambda: {"steps": 41}
        rec.progress(3, 9, "run w=16")
        with rec.call("run", 16, 4.5):
            time.sleep(3 * records.BEAT_S)
            b = json.loads((tmp_path / "rank2.beat").read_text())
        assert (b["rank"], b["phase"], b["call_case"], b["call_width"], b["call_deadline_s"]) == (2, "run w=16", "run",
                                                                                               16, 4.5)
        assert 0 < b["call_s"] < 4.5 and b["counts"] == {"steps": 41} and b["pid"] == os.getpid()
        time.sleep(2 * records.BEAT_S)
        assert "call_case" not in json.loads((tmp_path / "rank2.beat").read_text())
    finally:
        rec.close("done")
    assert json.loads((tmp_path / "rank2.beat").read_text())["final"] == "done"
    assert not rec._thread.is_alive()


def test_call_deadline_follows_the_slowest_call():
    assert records.call_deadline_s(1.0, None) == 1.0 + records.FIRST_CALL_S
    assert records.call_deadline_s(1.0, 0.05, 2.5) == pytest.approx(1.0 + 2.5 + records.STEP_SLACK_S + 0.5)


def test_each_runner_s_first_call_at_a_width_gets_the_first_call_s_allowance():
    d, a, b = records.CallDeadlines(1.0), object(), object()
    first = 1.0 + records.FIRST_CALL_S
    assert d.deadline_s(a, 4) == first
    d.took(0.05)
    d.took(0.01)  # the slowest call sets the pace
    later = 1.0 + records.STEP_SLACK_S + records.SLOW_FACTOR * 0.05
    assert d.deadline_s(a, 4) == pytest.approx(later)
    assert d.deadline_s(a, 8) == first and d.deadline_s(b, 4) == first
    assert d.deadline_s(b, 4, delay_s=2.5) == pytest.approx(later + 2.5)
