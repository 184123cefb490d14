"""gate: config loading and refusals, thresholds, JUnit; real gates pass (0), fail (1), can't run (2)."""
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd
import pytest

from ffnq.errors import UsageError
from ffnq.gate import checks, job_options, junit, load_gate
from helpers import ffnq, one_report

GATES = Path(__file__).resolve().parent.parent / "configs" / "gates"
SMALL = """
name = "small"
[options]
backend = "cpu"
model = "tiny"
tp = 2
[[job]]
verb = "qualify"
widths = "1,3"
inject_rank = "1"
[[job]]
verb = "bench"
widths = "2"
rep_ms = 100
warmup_ms = 20
[thresholds]
qualify_all_pass = true
p50_us_max = {P50}
speedup_unfused_min = 0.05
"""


@pytest.mark.parametrize("name", ["cpu-tp2", "h200-tp1", "h200x2-tp2"])
def test_shipped_gates_load(name):
    cfg = load_gate(GATES / f"{name}.toml")
    assert [v for v, _ in cfg["jobs"]] == ["warm", "qualify", "bench"]
    assert {"qualify_all_pass", "p50_us_max", "speedup_unfused_min"} <= set(cfg["thresholds"])


def test_cpu_gate_options_validate():
    cfg = load_gate(GATES / "cpu-tp2.toml")
    opts = [job_options(o) for _, o in cfg["jobs"]]
    assert opts[1].inject_ranks == [0, 1] and opts[1].widths == list(range(1, 17)) and opts[2].rep_ms == 500


@pytest.mark.parametrize("text, match", [
    ("name = ", "malformed TOML"), ("name = 'x'", "at least one"), ("[[job]]\nverb = 'fly'", "verb 'fly'"),
    ("[[job]]\nverb = 'bench'\ncolour = 1", "unknown option"),
    ("[[job]]\nverb = 'bench'\n[thresholds]\nfast = true", "unknown threshold"),
    # a misspelt section, or a threshold that would judge nothing, is refused before any job runs
    ("[[job]]\nverb = 'bench'\n[threshold]\np50_us_max = 9", r"unknown key\(s\) or section\(s\) threshold;"),
    ("[[job]]\nverb = 'bench'\n[thresholds]\nqualify_all_pass = true", "qualify_all_pass judges the qualify job"),
    ("[[job]]\nverb = 'bench'\n[thresholds]\nresident = 'yes'", "resident = 'yes': allowed true or false"),
    ("[[job]]\nverb = 'bench'\n[thresholds]\np50_us_max = '9'", "p50_us_max = '9': need a number"),
    ("[[job]]\nverb = 'bench'\nwidths = '1,16'\n[thresholds]\np50_us_max = { '1' = 9, '8' = 9 }",
     r"p50_us_max \{ '8' = 9 \}: need a width a bench job runs \(1, 16\)"),
    ("[[job]]\nverb = 'qualify'\n[thresholds]\nspeedup_unfused_min = 1.0", "judges the bench job"),
    ("[[job]]\nverb = 'bench'\n[thresholds]\nmax_slower_pct = 5", r"\[compare\] bench = a report folder"),
    ("[[job]]\nverb = 'qualify'\n[thresholds]\nno_new_fail = true", "needs a \\[compare\\] qualify or warm"),
    ("[[job]]\nverb = 'bench'\n[thresholds]\nresident = false", "no threshold is on"),
    ("[[job]]\nverb = 'bench'", "no threshold is on"),
])
def test_bad_configs_refused(tmp_path, text, match):
    f = tmp_path / "g.toml"
    f.write_text(text)
    with pytest.raises(UsageError, match=match):
        load_gate(f)
    with pytest.raises(UsageError, match="no such file"):
        load_gate(tmp_path / "missing.toml")


def test_a_compare_base_without_its_job_is_refused(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "results.json").write_text("{}")
    f = tmp_path / "g.toml"
    f.write_text(f"[[job]]\nverb = 'qualify'\n[thresholds]\nqualify_all_pass = true\n"
                 f"[compare]\nbench = '{tmp_path / 'base'}'\n")
    with pytest.raises(UsageError, match=r"\[compare\] bench: this config has no bench job"):
        load_gate(f)


def test_checks_judge_each_threshold():
    bench = pd.DataFrame({"width": [1, 16], "p50_us": [10.0, 90.0], "speedup_unfused": [2.0, 0.9],
                          "check": ["OK", "OK"]})
    rows = pd.DataFrame(checks("bench", bench, {"p50_us_max": {"1": 20, "16": 50}, "speedup_unfused_min": 1.0}, "r"))
    assert rows.set_index("check").result.to_dict() == {
        "p50 w=1": "PASS", "p50 w=16": "FAIL", "speedup_unfused w=1": "PASS", "speedup_unfused w=16": "FAIL",
        "bench correct before timing": "PASS"}
    q = pd.DataFrame({"case": ["a", "b"], "status": ["PASS", "FAIL"]})
    assert checks("qualify", q, {"qualify_all_pass": True}, "r")[0]["result"] == "FAIL"
    w = pd.DataFrame({"width": [1, 2], "resident": ["yes", "no"]})
    assert checks("warm", w, {"resident": True}, "r")[0]["result"] == "FAIL"
    doc = ET.fromstring(junit("g", rows, 1.0))
    assert doc.get("tests") == "5" and doc.get("failures") == "2"
    assert len(doc.findall(".//failure")) == 2


def test_gate_passes_then_fails_on_an_impossible_threshold(tmp_path):
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL.replace("{P50}", "500000"))
    r = ffnq("gate", cfg, "--out", tmp_path / "ok")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"gate small: \d+ checks, 0 failed: OK", r.stdout), r.stdout
    g = one_report(tmp_path / "ok", "gate")
    assert ET.parse(g / "junit.xml").getroot().get("failures") == "0"
    assert one_report(tmp_path / "ok", "qualify") and one_report(tmp_path / "ok", "bench")

    # (both jobs benches, so qualify_all_pass would judge nothing: a config error of its own)
    cfg.write_text(SMALL.replace("{P50}", "0.001").replace('verb = "qualify"', 'verb = "bench"')
                   .replace("qualify_all_pass = true\n", ""))
    r = ffnq("gate", cfg, "--out", tmp_path / "bad")
    assert r.returncode == 1, r.stdout + r.stderr
    junit_xml = ET.parse(one_report(tmp_path / "bad", "gate") / "junit.xml").getroot()
    assert int(junit_xml.get("failures")) >= 1 and "FAILED" in (one_report(tmp_path / "bad", "gate") / "summary.md").read_text()


def test_gate_that_cannot_run_exits_2(tmp_path):
    cfg = tmp_path / "g.toml"
    cfg.write_text(SMALL.replace("{P50}", "1").replace('inject_rank = "1"', 'inject_rank = "5"'))
    r = ffnq("gate", cfg, "--out", tmp_path / "out")
    assert r.returncode == 2 and "--inject-rank '5'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    r = ffnq("gate", tmp_path / "none.toml", "--out", tmp_path / "out")
    assert r.returncode == 2 and "no such file" in r.stderr
