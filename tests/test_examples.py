"""examples/my_runner.py, the plug-in runner a kernel team copies, passes ffnq's checks as shipped."""
import json
from pathlib import Path

import pandas as pd
import pytest

from helpers import ffnq, one_report

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_my_runner_qualifies_by_import_path(tmp_path):
    r = ffnq("qualify", "--runner", "examples.my_runner:MyRunner", "--tp", "2", "--widths", "2", "--inject-rank", "0",
             "--out", tmp_path, env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr
    rep = one_report(tmp_path, "qualify")
    assert rep.name.endswith("-qualify-myrunner-tp2")
    cases = pd.read_csv(rep / "results.csv")
    assert (cases.status == "PASS").all() and {"inject-over r0", "stale-epoch older r1"} <= set(cases.case)


def test_my_runner_times_each_width_in_warm(tmp_path):
    r = ffnq("warm", "--runner", "examples.my_runner:MyRunner", "--tp", "2", "--widths", "1,4", "--out", tmp_path,
             env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads((one_report(tmp_path, "warm") / "results.json").read_text())["tables"]["results"]
    assert [w["kernel"] for w in rows] == ["my_ffn_tiny_s1_tp2_all", "my_ffn_tiny_s4_tp2_all"]
    assert all(isinstance(w["compile_s"], float) for w in rows) and "note" not in rows[0]
