"""ffnq.jobs.records in one process (no process group): a rank's JSON lines read back as written,
gather puts rank 0's rows in all.jsonl, the collectives reduce to this rank's own value, and main
records start/done or the error around a job's body."""
import json
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ffnq.jobs import records
from ffnq.jobs.records import Records, clock_offsets, max_over_ranks


def lines(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text().splitlines()]


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


def test_main_records_start_rows_and_done_or_the_error(tmp_path, monkeypatch):
    for var in ("RANK", "FFNQ_TEST_DIE_RANK", "FFNQ_TEST_HANG_RANK"):
        monkeypatch.delenv(var, raising=False)
    opts = tmp_path / "opts.json"
    opts.write_text(json.dumps({"result_dir": str(tmp_path), "x": 7}))
    monkeypatch.setattr(sys, "argv", ["job", str(opts)])
    threads = torch.get_num_threads()
    seen = []
    try:
        records.main(lambda o, rec: (rec.row("t", {"x": o["x"]}), seen.append(rec)))
        assert seen[0].file.closed  # the rank's file, closed on the way out
        assert [g["kind"] for g in lines(tmp_path / "rank0.jsonl")] == ["start", "row", "done"]
        assert lines(tmp_path / "all.jsonl")[0]["data"] == {"x": 7}

        def body(o, rec):
            raise ValueError("bad width\nsecond line")

        with pytest.raises(ValueError, match="bad width"):
            records.main(body)
    finally:
        torch.set_num_threads(threads)
    err = lines(tmp_path / "rank0.jsonl")[-1]
    assert err["kind"] == "error" and err["message"] == "ValueError: bad width" and "Traceback" in err["trace"]
