"""gate --rebase: budgets from a run's p50s, its reports as the bases, comments kept, nothing
written from a run that failed a correctness check; the CLI's refusals."""
import json
import re
import shutil
import tomllib
from pathlib import Path

import pandas as pd
import pytest

from ffnq.gate import load_gate, rebase_gate
from ffnq.gate_rebase import NotRebased, budgets, rewrite
from helpers import ffnq, one_report

REF = Path(__file__).resolve().parent.parent / "configs" / "gates" / "ref"
CONFIG = """# my gate: why its jobs are these
name = "mine"

[options]
backend = "triton"
tp = 1

[[job]]
verb = "qualify"
widths = "1,2"

[[job]]
verb = "bench"
widths = "1,2,4,8,16"

[thresholds]
qualify_all_pass = true
p50_us_max = 500         # a first guess
max_slower_pct = 5       # beyond the runs' noise
"""


def test_budgets_are_p50_plus_the_margin_rounded_up():
    t = pd.DataFrame({"width": [1, 2, 4], "p50_us": [100.0, 56.01, float("nan")]})
    assert budgets(t, 15) == {1: 115, 2: 65}  # 100 x 1.15 is 115, not 116; an untimed width has none
    assert budgets(t, 0) == {1: 100, 2: 57}


def test_rewrite_sets_the_budget_line_and_adds_the_bases_keeping_the_rest():
    text = rewrite(CONFIG, {1: 66, 2: 105}, {"bench": "gates/ref/mine-bench", "qualify": "gates/ref/mine-qualify"},
                   "a run on H100, 2026-12-07, commit abc1234", 15)
    doc = tomllib.loads(text)
    assert doc["thresholds"] == {"qualify_all_pass": True, "p50_us_max": {"1": 66, "2": 105}, "max_slower_pct": 5}
    assert doc["compare"] == {"bench": "gates/ref/mine-bench", "qualify": "gates/ref/mine-qualify"}
    old, new = CONFIG.splitlines(), text.splitlines()
    assert [a for a, b in zip(old, new) if a != b] == ["p50_us_max = 500         # a first guess"]
    assert "# p50 + 15% of a run on H100, 2026-12-07, commit abc1234" in text
    # rebased again: each line in place, no second [compare] or budget
    again = rewrite(text, {1: 70, 2: 110}, {}, "a run on H100, 2026-12-08, commit def5678", 10)
    assert again.count("[compare]") == again.count("p50_us_max") == 1
    assert tomllib.loads(again)["thresholds"]["p50_us_max"] == {"1": 70, "2": 110}
    assert "[compare]  # a run on H100, 2026-12-08" in again and len(again.splitlines()) == len(new)


def _runs(tmp_path, status="PASS"):
    """This 'run': the shipped H100 reference reports, copied as if just written."""
    runs = []
    for verb in ("qualify", "bench"):
        shutil.copytree(REF / f"h100-tp1-{verb}", tmp_path / "reports" / verb)
        doc = json.loads((tmp_path / "reports" / verb / "results.json").read_text())
        table = pd.DataFrame(doc["tables"]["results"])
        if verb == "qualify":
            table.loc[0, "status"] = status
        runs.append((verb, table, str(tmp_path / "reports" / verb)))
    return runs


def test_rebase_writes_the_budgets_and_the_bases_next_to_the_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gates").mkdir()
    (tmp_path / "gates" / "mine.toml").write_text(CONFIG)
    runs = _runs(tmp_path)
    with pytest.raises(Exception, match="max_slower_pct judges the bench \\[compare\\] base"):
        load_gate(tmp_path / "gates" / "mine.toml")  # a relative threshold before its base: only to rebase
    said = rebase_gate(load_gate(tmp_path / "gates" / "mine.toml", rebasing=True), runs, 15)
    cfg = load_gate(tmp_path / "gates" / "mine.toml")
    p50 = {str(int(r.width)): r.p50_us for _, r in runs[1][1].iterrows()}
    assert cfg["thresholds"]["p50_us_max"] == {w: -(-v * 1.15 // 1) for w, v in p50.items()}
    assert set(cfg["compare"]) == {"bench", "qualify"}
    for verb in ("bench", "qualify"):
        assert (tmp_path / "gates" / "ref" / f"mine-{verb}" / "results.json").read_bytes() == \
            (tmp_path / "reports" / verb / "results.json").read_bytes()
    text = (tmp_path / "gates" / "mine.toml").read_text()
    assert 'bench = "gates/ref/mine-bench"' in text and "# my gate: why its jobs are these" in text
    assert said[0].startswith("rebased ") and "w=1 p50 <= " in said[0]


def test_a_run_that_failed_a_check_rebases_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.toml").write_text(CONFIG)
    with pytest.raises(NotRebased, match=r"not rebased: this run failed every qualify case PASS \(36/37 PASS; "
                                         r"failed: correct w=1\)"):
        rebase_gate(load_gate(tmp_path / "mine.toml", rebasing=True), _runs(tmp_path, status="FAIL"), 15)
    assert (tmp_path / "mine.toml").read_text() == CONFIG and not (tmp_path / "ref").exists()


def test_gate_rebase_refusals_exit_2_on_one_line(tmp_path):
    cfg = tmp_path / "g.toml"
    cfg.write_text('name = "idle"\n[options]\nbackend = "cpu"\nmodel = "tiny"\ntp = 2\n'
                   '[[job]]\nverb = "warm"\nwidths = "1"\n[thresholds]\nresident = true\n')
    for args, said in ((["--margin", "10"], "--margin 10: a budget margin for --rebase"),
                       (["--rebase", "--margin", "-1"], "error: --margin -1: need a finite percentage >= 0\n"),
                       (["--rebase", "--margin", "nan"], "error: --margin nan: need a finite percentage >= 0\n"),
                       (["--rebase"], "--rebase takes budgets and bases from a bench or qualify job; this config "
                                      "runs warm")):
        r = ffnq("gate", cfg, "--out", tmp_path / "out", *args)
        assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert not (tmp_path / "out").exists()


@pytest.mark.slow  # 2 x ~80 s
def test_a_gate_rebased_on_its_run_then_passes_against_it(tmp_path):
    """A first guess that fails every width; --rebase takes this run's p50s and reports (exit 0,
    the config rewritten); the next run is judged by them, its qualify against the base's."""
    from test_gate import SMALL

    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL.replace("{P50}", "0.001") + "no_new_fail = true\n")
    r = ffnq("gate", cfg, "--out", tmp_path / "one", "--rebase", "--margin", "400", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"gate small: \d+ checks, [1-9]\d* failed", r.stdout) and "rebased " in r.stdout
    doc = tomllib.loads(cfg.read_text())
    bench = json.loads((one_report(tmp_path / "one", "bench") / "results.json").read_text())
    (row,) = bench["tables"]["results"]
    assert doc["thresholds"]["p50_us_max"] == {"2": -(-row["p50_us"] * 5 // 1)}
    assert doc["compare"] == {"qualify": "ref/small-qualify", "bench": "ref/small-bench"}
    r = ffnq("gate", cfg, "--out", tmp_path / "two", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "vs base qualify statuses" in r.stdout or "vs base correct" in r.stdout


def test_a_rewrite_that_would_not_load_is_put_back_whole(tmp_path, monkeypatch):
    """reload refusing the rewritten config (the gate's own load, here made to fail) leaves the
    config, an existing base and the folders it would have made as they were."""
    from ffnq.errors import UsageError
    from ffnq.gate_rebase import rebase

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.toml").write_text(CONFIG)
    runs = _runs(tmp_path)
    cfg = load_gate(tmp_path / "mine.toml", rebasing=True)
    shutil.copytree(REF / "h200-tp1-qualify", tmp_path / "old-qualify")  # an existing base, rewritten in place
    cfg["compare"]["qualify"] = str(tmp_path / "old-qualify")
    before = (tmp_path / "old-qualify" / "results.json").read_bytes()

    def reload(path):
        raise UsageError("refused")

    with pytest.raises(UsageError, match=r"not rebased \(refused\)"):
        rebase(cfg, runs, 15, [], {1, 2, 4, 8, 16}, reload)
    assert (tmp_path / "mine.toml").read_text() == CONFIG and not (tmp_path / "ref").exists()
    assert (tmp_path / "old-qualify" / "results.json").read_bytes() == before
