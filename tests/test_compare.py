"""ffnq compare and the relative gate: verdicts against the noise band, status changes, and a
saved cpu run against one made slower on purpose."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from ffnq.compare import compare, counts, latency_rows, load, qualify_rows, warm_rows
from ffnq.errors import UsageError

TESTS = Path(__file__).parent


def bench_table(p50, p90, steps=100):
    return pd.DataFrame({"width": [1, 2], "p50_us": p50, "p90_us": p90, "p99_us": [x * 1.1 for x in p90],
                         "steps": [steps, steps], "unfused_p50_us": [200.0, 300.0]})


def test_latency_verdicts_follow_the_noise_band():
    base = bench_table([100.0, 150.0], [110.0, 160.0])
    rows = {(r["key"], r["metric"]): r for r in latency_rows(base, bench_table([101.0, 180.0], [111.0, 190.0]))}
    # band = 3 * sqrt(2) * 0.98 * 10 / sqrt(100) = 4.2 us: +1 us is noise, +30 us is not
    assert rows[("w=1", "p50_us")]["verdict"] == "same"
    assert rows[("w=2", "p50_us")]["verdict"] == "slower"
    assert abs(rows[("w=2", "p50_us")]["delta_pct"] - 20.0) < 1e-9
    faster = latency_rows(base, bench_table([80.0, 150.0], [90.0, 160.0]))
    assert faster[0]["verdict"] == "faster" and faster[0]["metric"] == "p50_us"
    assert {r["metric"] for r in faster} == {"p50_us", "p99_us", "unfused_p50_us"}


def test_a_clock_row_says_when_the_sm_clocks_differ():
    """Reports with the fused step's SM clock get a clock row per width: a latency delta beside a
    clock delta (one run under a power cap) is the machine's, not the kernel's."""
    base = bench_table([100.0, 150.0], [101.0, 151.0]).assign(sm_mhz=[1980.0, 1980.0])
    new = bench_table([100.5, 165.0], [101.5, 166.0]).assign(sm_mhz=[1965.0, 1215.0])
    clock = {r["key"]: r for r in latency_rows(base, new) if r["kind"] == "clock"}
    assert clock["w=1"]["verdict"] == "same" and clock["w=2"]["verdict"] == "changed"
    assert abs(clock["w=2"]["delta_pct"] + 38.64) < 0.01
    assert not [r for r in latency_rows(base.drop(columns="sm_mhz"), new) if r["kind"] == "clock"]
    table = pd.DataFrame(latency_rows(base, new))
    assert counts(table) == "latency: 4 same, 2 slower; clock: 1 changed, 1 same"  # w=2: p50, p99


def test_a_workload_row_says_when_the_steps_read_other_experts(monkeypatch):
    """Runs of two seeds route to other experts (TP1 at 12 tokens: 54.8 against 60.2, the p50 9%
    apart on an H200): compare says so per width, and the relative gate judges no p50 of a
    width whose workload changed (SKIP, naming both counts), only those whose workload held."""
    from ffnq import compare as cmp
    from ffnq.gate import relative_checks

    base = bench_table([100.0, 150.0], [101.0, 151.0]).assign(touched_experts=[8.0, 15.0])
    new = bench_table([100.0, 165.0], [101.0, 166.0]).assign(touched_experts=[8.0, 16.5])
    work = {r["key"]: r for r in latency_rows(base, new) if r["kind"] == "workload"}
    assert work["w=1"]["verdict"] == "same" and work["w=2"]["verdict"] == "changed"
    assert abs(work["w=2"]["delta_pct"] - 10.0) < 1e-9
    assert counts(pd.DataFrame(latency_rows(base, new))) == "latency: 4 same, 2 slower; workload: 1 changed, 1 same"
    assert not [r for r in latency_rows(base.drop(columns="touched_experts"), new) if r["kind"] == "workload"]
    monkeypatch.setattr(cmp, "load", lambda p: {"job": "bench", "tables": {"results": {"b": base, "n": new}[p]}})
    rows = {r["check"]: r for r in relative_checks("bench", "b", "n", {"max_slower_pct": 5})}
    assert rows["vs base p50 w=1"]["result"] == "PASS" and rows["vs base p50 w=2"]["result"] == "SKIP"
    assert "touched experts 15 -> 16.5: another seed" in rows["vs base p50 w=2"]["value"]
    new.loc[1, "touched_experts"] = 15.0  # the same workload: +10% is judged, and fails
    assert {r["check"]: r["result"] for r in relative_checks("bench", "b", "n", {"max_slower_pct": 5})} == {
        "vs base p50 w=1": "PASS", "vs base p50 w=2": "FAIL"}


def test_a_machine_row_says_when_the_gpu_models_differ(monkeypatch):
    """Two reports name their hosts' GPUs: compare says whether the models differ (the count does
    not matter: TP1 ran on one GPU of a 2-GPU host), and the relative gate fails a bench judged
    against another model's base, its p50 rows SKIP (an H100's p50 is no H200 regression)."""
    from ffnq import compare as cmp
    from ffnq.gate import relative_checks

    doc = lambda t, *names: {"job": "bench", "tables": {"results": t},  # noqa: E731
                             "machine": {"gpus": [{"name": n, "sms": 132} for n in names]}}
    t = bench_table([100.0, 150.0], [101.0, 151.0])
    r = compare(doc(t, "NVIDIA H200"), doc(t, "NVIDIA H200", "NVIDIA H200")).iloc[0]
    assert (r.kind, r.key, r.metric, r.base, r.new, r.verdict) == ("machine", "gpus", "model", "NVIDIA H200",
                                                                   "NVIDIA H200", "same")
    other = compare(doc(t, "NVIDIA H200"), doc(t, "NVIDIA H100 80GB HBM3"))
    assert other.iloc[0].verdict == "changed" and counts(other).startswith("machine: 1 changed; latency:")
    assert compare(doc(t), doc(t, "NVIDIA H200")).iloc[0].base == "no GPU"
    assert "machine" not in set(compare({"job": "bench", "tables": {"results": t}}, doc(t, "NVIDIA H200")).kind)

    docs = {"b": doc(t, "NVIDIA H200"), "n": doc(bench_table([140.0, 210.0], [141.0, 211.0]), "NVIDIA H100 80GB HBM3")}
    monkeypatch.setattr(cmp, "load", lambda p: docs[p])
    rows = {r["check"]: r for r in relative_checks("bench", "b", "n", {"max_slower_pct": 5})}
    assert rows["vs base GPU"]["result"] == "FAIL"
    assert rows["vs base GPU"]["value"] == "NVIDIA H100 80GB HBM3 (base NVIDIA H200)"
    assert {k: r["result"] for k, r in rows.items() if k != "vs base GPU"} == {"vs base p50 w=1": "SKIP",
                                                                              "vs base p50 w=2": "SKIP"}
    assert "on another GPU" in rows["vs base p50 w=2"]["value"]
    docs["n"]["machine"]["gpus"][0]["name"] = "NVIDIA H200"  # the same model: +40% is judged, and fails
    assert {r["check"]: r["result"] for r in relative_checks("bench", "b", "n", {"max_slower_pct": 5})} == {
        "vs base p50 w=1": "FAIL", "vs base p50 w=2": "FAIL"}


def test_status_and_residency_changes():
    q = lambda st: pd.DataFrame({"case": ["correct", "inject-over r1"], "width": [4, 16], "status": st})  # noqa: E731
    rows = qualify_rows(q(["PASS", "PASS"]), q(["PASS", "FAIL"]))
    assert [(r["key"], r["verdict"]) for r in rows] == [("inject-over r1 @16", "regressed")]
    assert qualify_rows(q(["FAIL", "PASS"]), q(["PASS", "PASS"]))[0]["verdict"] == "fixed"
    # a base written before width 1's padding case was renamed all-padding still judges it; at
    # wider widths correct+padding is its own case
    old = pd.DataFrame({"case": ["correct+padding", "correct+padding"], "width": [1, 4], "status": ["PASS", "PASS"]})
    now = pd.DataFrame({"case": ["all-padding", "correct+padding"], "width": [1, 4], "status": ["FAIL", "PASS"]})
    assert [(r["key"], r["verdict"]) for r in qualify_rows(old, now)] == [("all-padding @1", "regressed")]
    assert qualify_rows(old, now.assign(status="PASS")) == []
    w = lambda res, c: pd.DataFrame({"width": [1], "resident": [res], "ctas_per_cu": [c]})  # noqa: E731
    assert [r["verdict"] for r in warm_rows(w("yes", 2), w("no", 0))] == ["regressed", "changed"]
    assert warm_rows(w("yes", 2), w("yes", 2)) == []


def test_a_width_in_one_run_only_is_named_and_a_gone_one_fails_the_gate(monkeypatch):
    """A relative gate must not pass by judging nothing: a width the base timed and this run did
    not fails, and runs with no width in common fail; a case the base passed and this run lost,
    or a new failing one, fails no_new_fail as PASS -> FAIL does."""
    from ffnq import compare as cmp
    from ffnq.gate import relative_checks

    base, new = bench_table([100.0, 150.0], [101.0, 151.0]), bench_table([100.0, 150.0], [101.0, 151.0])
    rows = {r["key"]: r["verdict"] for r in latency_rows(base, new.assign(width=[2, 3])) if r["metric"] == "p50_us"}
    assert rows == {"w=1": "gone", "w=2": "faster", "w=3": "new"}  # new w=2 holds 100 us, the base 150

    def gate(b, n, verb="bench", th=None):
        monkeypatch.setattr(cmp, "load", lambda p: {"job": verb, "tables": {"results": {"b": b, "n": n}[p]}})
        return {r["check"]: r["result"] for r in relative_checks(verb, "b", "n", th or {"max_slower_pct": 5})}

    assert gate(base, new) == {"vs base p50 w=1": "PASS", "vs base p50 w=2": "PASS"}
    assert gate(base, new.iloc[:1]) == {"vs base p50 w=1": "PASS", "vs base p50 w=2": "FAIL"}
    assert gate(base, new.assign(width=[5, 6])) == {"vs base p50 w=1": "FAIL", "vs base p50 w=2": "FAIL",
                                                    "vs base p50": "FAIL"}
    q = lambda case, st: pd.DataFrame({"case": case, "width": [4] * len(case), "status": st})  # noqa: E731
    lost = gate(q(["correct", "recovery"], ["PASS", "PASS"]), q(["correct"], ["PASS"]), "qualify", {"no_new_fail": True})
    assert lost == {"vs base recovery @4 status": "FAIL"}
    added = gate(q(["correct"], ["PASS"]), q(["correct", "x"], ["PASS", "FAIL"]), "qualify", {"no_new_fail": True})
    assert added == {"vs base x @4 status": "FAIL"}
    assert gate(q(["correct"], ["PASS"]), q(["correct", "x"], ["PASS", "PASS"]), "qualify",
                {"no_new_fail": True}) == {"vs base x @4 status": "PASS"}


def saved(folder: Path, job: str, rows) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps({"schema_version": 1, "job": job, "tables": {"results": rows}}))
    return folder


@pytest.mark.parametrize("job, rows, match", [
    ("bench", [{"p50_us": 1.0}], "the bench results table has no width column; compare needs width"),
    ("qualify", [{"width": 1, "case": "correct"}], "the qualify results table has no status column"),
    ("warm", [{"resident": "yes"}], "the warm results table has no width column"),
    ("bench", [], "its bench results table is empty; nothing to compare"),
    ("qualify", [], "its qualify results table is empty; nothing to compare"),
    ("bench", [{"width": "a", "p50_us": 1.0}], "column width of the results table holds 'a'; need numbers"),
    ("bench", [{"width": 1, "p50_us": "fast"}], "column p50_us .* holds 'fast'; need numbers"),
    ("bench", [{"width": 1.5, "p50_us": 1.0}], r"results table widths \[1.5\]: need whole numbers, one row per width"),
    ("warm", [{"width": 1}, {"width": 1}], r"results table widths \[1, 1\]: need whole numbers, one row per width"),
])
def test_a_results_table_compare_cannot_read_is_refused_at_load(tmp_path, job, rows, match):
    folder = saved(tmp_path / "r", job, rows)
    for path in (folder, folder / "results.json"):
        with pytest.raises(UsageError, match=rf"^report {re.escape(str(folder))}: {match}"):
            load(path)


def test_benches_that_timed_nothing_are_not_compared(tmp_path):
    """No p50_us anywhere (every width failed its check before timing) is nothing to compare; one
    untimed side against a timed one still compares (the plot and the rows read NaN)."""
    untimed = load(saved(tmp_path / "u", "bench", [{"width": 1}]))
    with pytest.raises(UsageError, match=r"compare .*u -> .*u: neither report timed a width \(no p50_us\)"):
        compare(untimed, untimed)
    timed = load(saved(tmp_path / "t", "bench", [{"width": 1, "p50_us": 10.0, "p90_us": 11.0, "steps": 50}]))
    assert compare(timed, untimed).empty and untimed["tables"]["results"].p50_us.isna().all()


def test_compare_verb_refuses_a_malformed_table_before_writing(tmp_path):
    r = saved(tmp_path / "r", "bench", [{"width": 1}])
    p = ffnq("compare", str(r), str(r), "--out", str(tmp_path / "out"), tmp=tmp_path)
    assert p.returncode == 2 and "nothing to compare" in p.stderr, p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    saved(r, "bench", [{"p50_us": 1.0}])
    p = ffnq("compare", str(r), str(r), "--out", str(tmp_path / "out"), tmp=tmp_path)
    assert p.returncode == 2 and "no width column" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "out").exists()


def ffnq(*args, tmp: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "ffnq.cli", *args], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp)


@pytest.mark.slow
def test_relative_gate_catches_a_slower_run(tmp_path):
    common = ["--tp", "2", "--model", "tiny", "--widths", "1,2", "--rep-ms", "300", "--baselines", "none"]
    p = ffnq("bench", "--backend", "cpu", *common, "--out", str(tmp_path / "base"), tmp=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    base = next((tmp_path / "base").glob("*-bench-cpu-tp2"))
    cfg = tmp_path / "slower.toml"
    cfg.write_text(f"""name = "slower"
[options]
runner = "slow_runner:Slow"
model = "tiny"
tp = 2
[[job]]
verb = "bench"
widths = "1,2"
rep_ms = 300
baselines = "none"
[thresholds]
max_slower_pct = 5
[compare]
bench = "{base}"
""")
    p = ffnq("gate", str(cfg), "--out", str(tmp_path / "gate"), tmp=tmp_path)
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    gate = next((tmp_path / "gate").glob("*-gate-*"))
    junit = (gate / "junit.xml").read_text()
    assert junit.count("<testcase") >= 2 and 'name="vs base p50 w=1"' in junit and "<failure" in junit
    # the compare verb shows the same verdict, with a plot of both curves
    new = next((tmp_path / "gate").glob("*-bench-*"))
    p = ffnq("compare", str(base), str(new), "--out", str(tmp_path / "cmp"), "--json", tmp=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.JSONDecoder().raw_decode(p.stdout)[0]["rows"]
    assert {r["verdict"] for r in rows if r["metric"] == "p50_us"} == {"slower"}
    assert (next((tmp_path / "cmp").glob("*-compare-*")) / "latency.png").is_file()


@pytest.mark.slow
def test_bench_phase_split_places_the_experts(tmp_path):
    p = ffnq("bench", "--backend", "cpu", "--tp", "2", "--model", "tiny", "--widths", "4", "--rep-ms", "200",
             "--baselines", "none", "--phase-split", "--json", "--out", str(tmp_path), tmp=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    row = json.JSONDecoder().raw_decode(p.stdout)[0]["rows"][0]
    assert row["check"] == "OK" and 0 < row["none_p50_us"] < row["p50_us"]
    assert abs(row["experts_us"] - (row["p50_us"] - row["none_p50_us"])) < 1e-6


def test_compare_names_the_gpu_models_of_two_committed_runs(tmp_path):
    """The TP1 gates' reference runs, one on an H200 and one on an H100: every width is slower on
    the H100, and compare says whose the delta is."""
    refs = TESTS.parent / "configs" / "gates" / "ref"
    h200, h100 = refs / "h200-tp1-bench", refs / "h100-tp1-bench"
    p = ffnq("compare", str(h200), str(h100), "--out", str(tmp_path / "cmp"), tmp=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "the runs ran on other GPU models (NVIDIA H200 -> NVIDIA H100 80GB HBM3)" in " ".join(p.stdout.split())
    doc = json.loads((next((tmp_path / "cmp").glob("*-compare-*")) / "results.json").read_text())
    rows = doc["tables"]["results"]
    assert rows[0] == {"kind": "machine", "key": "gpus", "metric": "model", "base": "NVIDIA H200",
                       "new": "NVIDIA H100 80GB HBM3", "delta_pct": None, "band_pct": None, "verdict": "changed"}
    assert {r["verdict"] for r in rows if r["metric"] == "p50_us"} == {"slower"}


def test_compare_names_the_weights_each_run_read(tmp_path):
    """One bench on a checkpoint's layer, one on synthetic weights: compare names both sources,
    and a run against itself has nothing changed."""
    doc = json.loads((TESTS.parent / "configs" / "gates" / "ref" / "h100-tp1-bench" / "results.json").read_text())
    synth, ckpt = tmp_path / "synthetic-bench", tmp_path / "ckpt-bench"
    for folder, source in ((synth, None), (ckpt, "/data/ffnq-ckpt-m2")):
        folder.mkdir()
        doc["config"] |= {"checkpoint": source, "checkpoint_layer": 5 if source else None}
        (folder / "results.json").write_text(json.dumps(doc))
    p = ffnq("compare", str(synth), str(ckpt), "--out", str(tmp_path / "cmp"), tmp=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "the runs read other weights (synthetic -> checkpoint ffnq-ckpt-m2 layer 5)" in " ".join(p.stdout.split())
    rows = json.loads((next((tmp_path / "cmp").glob("*-compare-*")) / "results.json").read_text())["tables"]["results"]
    assert [r for r in rows if r["kind"] == "weights"] == [
        {"kind": "weights", "key": "weights", "metric": "source", "base": "synthetic",
         "new": "checkpoint ffnq-ckpt-m2 layer 5", "delta_pct": None, "band_pct": None, "verdict": "changed"}]
    same = compare(load(ckpt), load(ckpt))
    assert same[same.kind == "weights"].verdict.tolist() == ["same"]
    assert compare(load(synth), load(synth)).query("kind == 'weights'").empty  # synthetic: the workload rows tell


def test_a_baseline_s_delta_is_judged_against_its_own_noise():
    """Two cpu runs of one build: the unfused loop's p50 moved 30% with a spread (p90 - p50) of
    40% over 20 steps, which is noise, not a speedup; the same move over a tight spread is one."""
    from ffnq.compare import latency_rows

    base = pd.DataFrame([{"width": 4, "p50_us": 100.0, "p90_us": 101.0, "steps": 500,
                          "unfused_p50_us": 1000.0, "unfused_p90_us": 1400.0, "unfused_steps": 20}])
    noisy = base.assign(unfused_p50_us=700.0)
    row = [r for r in latency_rows(base, noisy) if r["metric"] == "unfused_p50_us"][0]
    assert row["verdict"] == "same" and row["band_pct"] > 30
    tight = base.assign(unfused_p90_us=1001.0, unfused_steps=500)
    row = [r for r in latency_rows(tight, tight.assign(unfused_p50_us=700.0)) if r["metric"] == "unfused_p50_us"][0]
    assert row["verdict"] == "faster"


def test_the_compare_plot_keeps_its_legend_off_the_curves_and_ticks_the_widths(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from ffnq import compare as cmp

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    base = pd.DataFrame({"width": [1, 2, 8], "p50_us": [10.0, 11.0, 15.0], "p99_us": [12.0, 13.0, 18.0]})
    cmp.plot(base, base.assign(p50_us=[9.0, 10.0, 14.0]), tmp_path / "latency.png", ("base", "new"))
    ax = figs[0].axes[0]
    assert list(ax.get_xticks()) == [1, 2, 8]
    assert ax.get_legend().get_bbox_to_anchor().x0 > ax.get_window_extent().x1 - 1
    assert "lent" not in cmp.__doc__ and "rounds" not in cmp.__doc__  # the band's note is the reader's, not ours
