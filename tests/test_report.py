"""report: tables on the terminal, the folder written atomically and read back."""
import json
import re

import pandas as pd
import pytest

from ffnq import report
from ffnq.errors import UsageError
from ffnq.timeline import handshake
from ffnq.report import SCHEMA_VERSION, load_report, markdown, show_table, write_report


from test_timeline import fake_timeline


def test_write_report_atomic_and_read_back(tmp_path):
    res = pd.DataFrame({"case": ["correct"], "width": [4], "status": ["PASS"], "rel_err": [2e-3]})
    tl = fake_timeline(0)
    meta = {"command": "ffnq qualify", "machine": {"host": "h", "cpus": 2, "gpus": []}, "git_commit": "abc",
            "config": {"backend": "cpu", "tp": 2}}
    path = write_report(tmp_path, "qualify", "cpu", 2, res, meta=meta, verdict="1 cases, 0 failed: OK",
                        tables={"handshake": handshake(tl, 2)}, timeline=tl)
    assert path.name.endswith("-qualify-cpu-tp2") and [p.name for p in tmp_path.iterdir()] == [path.name]
    assert {p.name for p in path.iterdir()} >= {"summary.md", "results.csv", "results.json", "timeline.csv",
                                                 "trace.json", "timeline.png"}
    doc = load_report(path)
    assert doc["schema_version"] == SCHEMA_VERSION and doc["git_commit"] == "abc"
    assert doc["tables"]["results"].status.tolist() == ["PASS"]
    assert pd.read_csv(path / "results.csv").width.tolist() == [4]
    assert "OK" in (path / "summary.md").read_text() and "median" in (path / "summary.md").read_text()


def test_write_report_leaves_nothing_on_failure(tmp_path):
    class Boom(pd.DataFrame):
        def to_csv(self, *a, **k):
            raise OSError("disk full")

    with pytest.raises(OSError):
        write_report(tmp_path, "bench", "cpu", 2, Boom({"width": [1]}), meta={})
    assert list(tmp_path.iterdir()) == []


def test_load_report_refuses_a_foreign_folder(tmp_path):
    with pytest.raises(UsageError, match="no results.json"):
        load_report(tmp_path)
    (tmp_path / "results.json").write_text("{")
    with pytest.raises(UsageError, match="malformed"):
        load_report(tmp_path)


@pytest.mark.parametrize("text, match", [
    ("[1, 2]", "results.json holds a JSON list; need an object with schema_version, job and tables"),
    ('{"schema_version": 1, "job": "bench"}', r"no tables.results \(need tables = \{results: \[rows\]\}\)"),
    ('{"schema_version": 1, "job": "bench", "tables": {"per_rank": []}}', "no tables.results"),
    ('{"schema_version": 1, "job": "bench", "tables": 5}', "no tables.results"),
    ('{"schema_version": 1, "job": "bench", "tables": {"results": 5}}', "table results in results.json is not a list"),
    ('{"schema_version": 1, "job": "bench", "tables": {"results": [1]}}', "table results .* list of rows"),
    ('{"schema_version": 1, "job": "bench", "tables": {"results": [], "x": {"a": 1}}}', "table x .* list of rows"),
    ('{"schema_version": 1, "tables": {"results": []}}', "results.json has no job"),
    ('{"schema_version": 1, "job": "bench", "config": "x", "tables": {"results": []}}',
     "config in results.json is a str"),
])
def test_load_report_refuses_a_malformed_structure(tmp_path, text, match):
    (tmp_path / "results.json").write_text(text)
    with pytest.raises(UsageError, match=rf"^report {re.escape(str(tmp_path))}: .*{match}"):
        load_report(tmp_path)


def test_load_report_refuses_bytes_that_are_not_utf8(tmp_path):
    (tmp_path / "results.json").write_bytes(b'{"job": "caf\xe9"}')
    with pytest.raises(UsageError, match="results.json is malformed"):
        load_report(tmp_path)


@pytest.mark.slow
def test_report_verb_on_a_malformed_folder_is_one_line_exit_2(tmp_path):
    from helpers import ffnq

    (tmp_path / "results.json").write_text('{"schema_version": 1, "job": "bench"}')
    r = ffnq("report", tmp_path)
    assert r.returncode == 2 and "no tables.results" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_write_report_draws_its_plots_before_the_folder_is_in_place(tmp_path):
    drawn = write_report(tmp_path / "ok", "compare", "cpu", 2, pd.DataFrame({"a": [1]}), meta={},
                         plots={"p.png": lambda f: f.write_bytes(b"png")})
    assert (drawn / "p.png").read_bytes() == b"png"

    def boom(f):
        raise AttributeError("no p50_us")

    with pytest.raises(AttributeError):
        write_report(tmp_path / "bad", "compare", "cpu", 2, pd.DataFrame({"a": [1]}), meta={}, plots={"p.png": boom})
    assert list((tmp_path / "bad").iterdir()) == []


def test_show_table_json_and_markdown(capsys):
    df = pd.DataFrame({"width": [1, 2], "p50_us": [3.5, float("nan")]})
    show_table(df, json_out=True, title="t")
    doc = json.loads(capsys.readouterr().out)
    assert doc["rows"][0] == {"width": 1, "p50_us": 3.5} and doc["rows"][1]["p50_us"] is None
    assert markdown(df).splitlines()[2] == "| 1 | 3.5 |"


def test_command_line_names_the_environment_that_changes_the_build(monkeypatch):
    """A report shows an override of the Triton build in its command: a check made under
    FFNQ_TRITON_TUNE must not read as the default build's."""
    for k in report.RUN_ENV:
        monkeypatch.delenv(k, raising=False)
    assert report.command_line(["python", "tools/ptx_signature.py", "--out", "a b"]) == \
        "python tools/ptx_signature.py --out 'a b'"
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "EW=1,DQ@4=1")
    assert report.command_line(["python", "x.py"]) == "FFNQ_TRITON_TUNE=EW=1,DQ@4=1 python x.py"


def test_whole_number_columns_print_as_integers():
    """A mixed table's width column is float (NaN where a row has none): 9 and 10, not 9 and 10.0;
    a measured column keeps its decimals."""
    df = pd.DataFrame({"check": ["step", "step", "rate"], "width": [9, 10, None], "p50_us": [47.0, 101.5, None]})
    md = markdown(df)
    assert "| step | 9 | 47.0 |" in md and "| step | 10 | 101.5 |" in md and "| rate | - | - |" in md
    assert "10.0" not in md


def test_show_table_keeps_every_digit_and_says_a_repeated_text_once(capsys, monkeypatch):
    """Bench's table on a 100-column terminal: each p50 whole (no "11" for 112.4), the timing
    method that every row repeats said once under the table, not a column squeezing the numbers."""
    from rich.console import Console
    monkeypatch.setattr(report, "console", Console(width=100, force_terminal=False))
    how = "cuda-graph, 4 weight sets per replay (cold L2), bursts of 1000 steps after 250 ms idle"
    df = pd.DataFrame({c: [112.4 + i, 1234.5 + i] for i, c in enumerate(
        ["p50_us", "p90_us", "p99_us", "unfused_p50_us", "floor_us", "weights_gbps", "sm_mhz", "capped_pct"])})
    df.insert(0, "width", [4, 16])
    df["timing"] = how
    show_table(df, title="bench")
    out = capsys.readouterr().out
    for v in ("112.4", "1234.5", "119.4", "1241.5"):
        assert v in out, out
    assert out.count("cuda-graph") == 1 and "timing: cuda-graph" in out.replace("\\n", " ")


def test_show_table_takes_cells_that_are_lists_or_dicts(capsys):
    """A cell holding a list or a dict (unhashable) is printed as text, not a TypeError."""
    show_table(pd.DataFrame({"width": [1, 2], "detail": [{"a": 1}, [1, 2]]}), title="t")
    out = capsys.readouterr().out
    assert "{'a': 1}" in out and "[1, 2]" in out


def test_machine_info_names_the_cpu_model():
    m = report.machine_info()
    assert isinstance(m["cpu_model"], str) and m["cpu_model"]


def test_a_bench_report_says_it_has_no_timeline(tmp_path):
    lat = pd.DataFrame({"width": [1, 2, 4, 16], "p50_us": [10.0, 11.0, 12.0, 20.0], "p90_us": [11.0, 12.0, 13.0, 22.0],
                        "unfused_p50_us": [20.0, 21.0, 22.0, 30.0], "check": ["OK"] * 4})
    path = write_report(tmp_path, "bench", "cpu", 2, lat, meta={"config": {"backend": "cpu", "tp": 2}},
                        verdict="4 widths: OK")
    text = (path / "summary.md").read_text()
    assert "## timeline" in text and "no timeline.csv or trace.json" in text and not (path / "trace.json").exists()


def test_the_latency_plot_ticks_are_the_widths_run(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    lat = pd.DataFrame({"width": [1, 2, 4, 16], "p50_us": [10.0, 11.0, 12.0, 20.0],
                        "unfused_p50_us": [20.0, 21.0, 22.0, 30.0]})
    report.plot_latency(lat, tmp_path / "latency.png", {"backend": "cpu", "tp": 2, "model": "tiny"})
    ax = figs[0].axes[0]
    assert list(ax.get_xticks()) == [1, 2, 4, 16]
    legend = ax.get_legend()  # beside the axes, over no curve
    assert legend.get_bbox_to_anchor().x0 > ax.get_window_extent().x1 - 1
