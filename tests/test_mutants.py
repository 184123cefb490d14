"""Qualify the qualifier: every planted-bug runner in mutants.py must FAIL `ffnq qualify` at TP2
on cpu, caught by the case named here; the correct cpu runner passes the same matrix (the CLI
tests run it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mutants

pytestmark = pytest.mark.slow  # the planted-bug sweep: 22 qualify runs, 1288 s

TESTS = Path(__file__).parent
# mutant -> a case (prefix of the case name) that must be among the FAILs
CAUGHT_BY = {
    "BiasAsWeight": "correct",
    "BiasIgnored": "correct",
    "NoRenorm": "correct",
    "RouterBf16": "correct",
    "PaddingToExperts": "correct+padding",
    "EpochAtLeast": "stale-epoch newer",
    "EpochStuck": "correct",
    "InjectIgnored": "inject-over",
    "TimeoutIgnored": "inject-over",
    "EpsWrong": "correct small-rms",
    "OwnPartTwice": "correct",
    "ReduceSkipsLast": "correct",
    "LastChunkShort": "correct",
    "SiluOnUp": "correct",
    "ResetKeepsScratch": "recovery",
    "RouteWeightsUnwritten": "correct",
    "ScaleColumnsShifted": "correct",
    "LastRowUnwritten": "correct",
    "FirstWeightsKept": "other-weights",
    "OutputTwoPercentHigh": "correct",
    "OutputsOnce": "correct+padding",
    "EveryNthWrong": "run",  # only a long enough run of checked steps meets its 50th call
    "OneRankScaled": "correct",  # rank 1 disagrees with rank 0, and is over its step's bound
    "CallNeverReturns": "cut short",  # the host's watchdog names rank 1, its case and width
}


def test_every_mutant_has_an_expected_catch():
    assert set(CAUGHT_BY) == set(mutants.ALL)
    for cls in mutants.ALL.values():
        assert cls.__doc__ and len(cls.__doc__.splitlines()) == 1


def qualify(runner: str, tmp_path: Path) -> tuple[int, list[dict], str]:
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "ffnq.cli", "qualify", "--runner", runner, "--tp", "2", "--model", "tiny",
           "--widths", "1,5,16", "--inject-rank", "all", "--out", str(tmp_path), "--json"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    doc, _ = json.JSONDecoder().raw_decode(p.stdout) if p.stdout.strip() else ({"rows": []}, 0)
    return p.returncode, doc["rows"], p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CAUGHT_BY))
def test_qualify_fails_the_mutant(name, tmp_path):
    rc, rows, err = qualify(f"mutants:{name}", tmp_path)
    assert rc == 1, (rc, err[-2000:])
    failed = [r for r in rows if r["status"] == "FAIL"]
    assert any(r["case"].startswith(CAUGHT_BY[name]) for r in failed), [r["case"] for r in failed]
    # a FAIL carries its smallest evidence: where, expected and got, or the fault record
    assert all(r["evidence"] or r["fault"] for r in failed)
    if name == "LastRowUnwritten":  # caught by the poison: the row reads NaN, whatever was there
        assert any("got nan" in r["evidence"] for r in failed), [r["evidence"] for r in failed]
    if name == "OneRankScaled":
        assert any("ranks disagree" in r["evidence"] for r in failed), [r["evidence"] for r in failed]
    if name == "CallNeverReturns":  # named: the rank, its case and width; every case before it kept
        cut = next(r for r in failed if r["case"] == "cut short")["evidence"]
        assert "rank 1 hung in a runner call" in cut and "w=16" in cut, cut
        assert any(r["status"] == "PASS" for r in rows)
