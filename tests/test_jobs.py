"""The jobs on real ranks (torchrun, cpu, TP2): bench and warm end to end, a planted bug that
qualify must catch, a rank that dies and a rank that hangs; plus the merge functions."""
import json
import time

import pandas as pd
import pytest

from ffnq.jobs import bench, qualify, qualify_cases
from ffnq.timing import StepTimer, quantiles_us, steps_for, time_steps, warm_median_us
from helpers import ffnq, one_report


def test_warm_median_sizes_its_warm_up_from_one_sample():
    """warm_median_us: one sample to size the warm-up, ``warmup_ms`` of calls, then the median."""
    calls = []
    us = warm_median_us(lambda: (calls.append(1), time.sleep(0.002)), 5, warmup_ms=20)
    assert 1500 < us < 50_000
    assert 1 + 1 + 5 <= len(calls) <= 1 + 10 + 5  # up to 20 ms of >= 2 ms calls between the samples


def test_time_steps_and_budgets():
    s = time_steps(lambda: time.sleep(0.002), 5)
    assert len(s) == 5 and all(1900 < x < 200_000 for x in s)  # us
    q = quantiles_us([1.0, 2.0, 3.0, 4.0, 100.0])
    assert q["p50_us"] == 3.0 and q["p90_us"] > q["p50_us"] and q["steps"] == 5
    assert steps_for(1000.0, 50, 3, 100) == 50 and steps_for(1e6, 50, 3, 100) == 3 and steps_for(1, 1e3, 3, 100) == 100


def test_time_steps_warms_up_untimed():
    calls = []
    s = time_steps(lambda: calls.append(1), 5, warmup=3)
    assert len(s) == 5 and len(calls) == 8


def test_step_timer_times_one_step_again_and_again():
    """One StepTimer serves the bench's estimate and its samples: on cpu each sample is one call,
    warm-up calls are untimed, and the step is set up once (on a GPU: one capture)."""
    calls = []
    t = StepTimer(lambda: calls.append(1))
    assert t.mode == "wall-clock" and len(t(3)) == 3 and len(calls) == 3
    s = t(5, warmup=2, burst=2)
    assert len(s) == 5 and len(calls) == 3 + 2 + 5 and all(x >= 0 for x in s)


@pytest.mark.slow
def test_bench_estimate_and_samples_share_one_timer(tmp_path):
    """Each (width, variant) of a bench makes one timer, asks it for the 3-call estimate, then for
    the warm-up and samples (and the fused step's for one more call, checked): the step is captured
    once on a GPU, and the estimate is timed as the samples are (an eager Triton step at one token
    took 2-4x its replay)."""
    import rankfns
    from multirank import run_ranks

    got = run_ranks(rankfns.bench_timers, 1, str(tmp_path), timeout=240)[0]
    assert len(got["made"]) == 2 * 2  # widths 1 and 2, fused and the unfused baseline
    for asked in got["made"]:
        assert asked[0] == (3, 0) and asked[1][1] >= 1 and 3 <= asked[1][0] <= 20
    # the fused step's timer makes one more call after its samples, whose outputs are checked
    assert sorted(asked[2:] for asked in got["made"]) == [[], [], [(1, 0)], [(1, 0)]]
    assert {r["check"] for r in got["rows"]} == {"OK"} and {r["timing"] for r in got["rows"]} == {"wall-clock"}


def test_qualify_summary_merges_ranks():
    rows = pd.DataFrame([
        {"case": "correct", "width": 2, "rank": 0, "status": "PASS", "rel_err": 1e-3, "wrong": 0, "elements": 10,
         "route_rows": 2, "route_mismatch": 0, "route_excused": 0, "fault": "", "wall_ms": 3.0, "evidence": ""},
        {"case": "correct", "width": 2, "rank": 1, "status": "FAIL", "rel_err": 5e-2, "wrong": 4, "elements": 10,
         "route_rows": 2, "route_mismatch": 1, "route_excused": 1, "fault": "", "wall_ms": 4.0,
         "evidence": "out[0,1] expected 1 got 2"},
    ])
    m = qualify_cases.summarize(rows).iloc[0]
    assert m.status == "FAIL" and m.rel_err == 5e-2 and m.wrong == 4 and m.elements == 20
    assert m.route_agree == "3/4 (1 tie)" and m.evidence == "r1: out[0,1] expected 1 got 2" and m.wall_ms == 4.0


def test_bench_summary_slowest_rank_and_speedup():
    rows = pd.DataFrame([
        {"width": 1, "variant": v, "rank": r, "check": "OK", "rel_err": 1e-3, "p50_us": p, "p90_us": p + 1,
         "p99_us": p + 2, "steps": 10}
        for v, r, p in (("fused", 0, 10.0), ("fused", 1, 12.0), ("unfused", 0, 30.0), ("unfused", 1, 36.0))])
    m = bench.summarize(rows).iloc[0]
    assert m.p50_us == 12.0 and m.skew_us == 2.0 and m.unfused_p50_us == 36.0 and m.speedup_unfused == 3.0
    assert "followed" not in m
    rows["followed"] = [0, 0, 0, 1]  # rank 1's baseline broke a near tie its own way
    assert bench.summarize(rows).iloc[0].followed == "unfused 1"


def test_bench_summary_keeps_the_slowest_clock_and_any_cap():
    """sm_mhz: the fused step's slowest rank; capped_pct: the most of any variant and rank (a
    baseline timed under a cap skews its speedup as much as the fused step's own)."""
    rows = pd.DataFrame([
        {"width": 16, "variant": v, "rank": r, "check": "OK", "rel_err": 1e-3, "p50_us": 10.0, "p90_us": 11.0,
         "p99_us": 12.0, "steps": 10, "sm_mhz": mhz, "capped_pct": cap}
        for v, r, mhz, cap in (("fused", 0, 1980.0, 0.0), ("fused", 1, 1845.0, 0.0), ("unfused", 0, 1215.0, 30.0))])
    m = bench.summarize(rows).iloc[0]
    assert m.sm_mhz == 1845.0 and m.capped_pct == 30.0


def test_bench_summary_of_a_step_without_weights_has_no_x_floor():
    """--experts none reads no weights (floor 0): no x_floor or weights_gbps, not inf."""
    rows = pd.DataFrame([{"width": 1, "variant": "fused", "rank": 0, "check": "OK", "rel_err": 1e-3, "p50_us": 9.2,
                          "p90_us": 9.3, "p99_us": 9.3, "steps": 10, "floor_us": 0.0, "touched_experts": 0.0,
                          "weight_bytes": 0.0}])
    m = bench.summarize(rows).iloc[0]
    assert m.floor_us == 0.0 and "x_floor" not in m and "weights_gbps" not in m
    rows.loc[0, ["floor_us", "weight_bytes"]] = 4.6, 1e7
    m = bench.summarize(rows).iloc[0]
    assert m.x_floor == pytest.approx(2.0) and m.weights_gbps == pytest.approx(1e7 / 9.2 / 1e3)


def test_bench_deadline_counts_the_idle_before_each_burst():
    from ffnq.jobs.bench import BenchOptions

    one = BenchOptions(widths=[1], baseline=False, rep_ms=1000, burst_ms=0)
    four = BenchOptions(widths=[1], baseline=False, rep_ms=1000, burst_ms=250, idle_ms=500)
    assert four.deadline() - one.deadline() == pytest.approx(4 * 0.5 * 3)


@pytest.mark.slow
def test_bench_floor_is_the_mean_over_the_weight_sets():
    """A timed step runs every weight set, each with its own router: the floor's bytes are the
    mean of the sets' touched experts (from the fp64 routing of each set), not set 0's."""
    from types import SimpleNamespace

    import torch

    from ffnq import reference
    from ffnq.spec import Experts, load_model
    from ffnq.weights import shard, synthetic

    m = load_model("tiny")
    fulls = [synthetic(m, seed, routing="skewed") for seed in (3, 1003)]  # skewed: the sets touch apart
    sets = [shard(f, m, 2, 0, Experts.ALL) for f in fulls]
    job = SimpleNamespace(model=m, tp=2, experts=Experts.ALL, weights=sets[0])
    g = torch.Generator().manual_seed(11)
    parts = [torch.randn(4, m.hidden, generator=g).bfloat16() for _ in range(2)]
    residual = torch.randn(4, m.hidden, generator=g).bfloat16()
    slots = torch.tensor([0, 1, -1, 3])  # a padding row selects nothing
    n = [len(torch.unique(c[c >= 0])) for c in
         (reference.step(parts, residual, slots, f, m).chosen for f in fulls)]
    assert n[0] != n[1]  # the sets route apart, so set 0 alone would be a different floor
    row = bench.floor_row(job, (2000.0, 3.0), (parts, residual, slots), sets)
    per = m.expert_bytes(2, Experts.ALL)
    assert row["touched_per_set"] == f"{n[0]}/{n[1]}" and row["touched_experts"] == sum(n) / 2
    assert row["floor_us"] == pytest.approx(sum(n) / 2 * per / 2e6 + 6.0)
    assert row["weight_bytes"] == sum(n) / 2 * per


def test_bench_tp2_layers(tmp_path):
    r = ffnq("bench", "--backend", "cpu", "--tp", "2", "--widths", "1,4", "--layers", "2", "--rep-ms", "100",
             "--warmup-ms", "20", "--baselines", "unfused,stock-nccl", "--json", "--out", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(r.stdout.splitlines()[0])["rows"]
    assert [x["width"] for x in rows] == [1, 4]
    for x in rows:
        assert x["check"] == "OK" and x["rel_err"] < 1e-2 and x["steps"] >= 10
        assert 0 < x["p50_us"] <= x["p90_us"] <= x["p99_us"] and x["skew_us"] >= 0
        assert x["speedup_unfused"] == pytest.approx(x["unfused_p50_us"] / x["p50_us"])
        assert x["speedup_stock_nccl"] == pytest.approx(x["stock_nccl_p50_us"] / x["p50_us"])
    rep = one_report(tmp_path, "bench")
    assert (rep / "latency.png").stat().st_size > 1000
    per_rank = pd.DataFrame(json.loads((rep / "results.json").read_text())["tables"]["per_rank"])
    assert set(per_rank["rank"]) == {0, 1} and set(per_rank.variant) == {"fused", "unfused", "stock-nccl"}
    assert (per_rank.layers == 2).all()
    # no --seed: bench times seed 0's workload, so two runs (compare, gate) read the same experts
    assert json.loads((rep / "results.json").read_text())["config"]["seed"] == 0


def test_bench_phases_every_boundary_in_step_order(tmp_path):
    """--phases: a timeline build's phase boundaries per width, each rank's stamps from its first
    CTA's start, the slowest rank's in the table, in the order a step passes them."""
    from ffnq.spec import stamp_names
    r = ffnq("bench", "--backend", "cpu", "--tp", "2", "--widths", "2", "--rep-ms", "30", "--warmup-ms", "10",
             "--baselines", "none", "--phases", "--out", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "phases: when the median and the latest CTA" in r.stdout
    ph = pd.DataFrame(json.loads((one_report(tmp_path, "bench") / "results.json").read_text())["tables"]["phases"])
    assert set(ph.width) == {2} and set(ph.stamp) == set(stamp_names(2))
    assert ph.stamp.iloc[0] == "start" and ph.stamp.iloc[-1] == "end"
    assert (ph.median_us.diff().dropna() >= 0).all() and (ph.latest_us >= ph.median_us).all()
    order = list(ph.stamp)
    assert order.index("router_done") < order.index("experts_done") < order.index("reduce_done")


def test_bench_phases_take_a_runners_finer_stamps_of_this_launch_only():
    """A runner's PHASE_STAMPS (the Triton kernel's stamps inside a phase) join the timeline's; a
    column left from an earlier launch (before this one's start) is not this launch's."""
    import types
    import torch
    from ffnq.spec import stamp_names
    names = stamp_names(1)

    class Stub:
        PHASE_STAMPS = ("sub", {3: "stage1_done", 5: "stage2_done", 7: "never"})

        def __init__(self):
            self.launches = 0

        def __call__(self, *args, **kwargs):
            self.launches += 1
            return None, None

        def readable(self, name, width=None):
            return True

        def view(self, s, name):
            t0 = 10_000_000 * self.launches
            if name == "timeline":  # two CTAs: start 0 / 1 us, end 50 / 52 us
                t = torch.zeros(2, len(names), dtype=torch.int64)
                t[:, names.index("start")] = torch.tensor([t0, t0 + 1000])
                t[:, names.index("end")] = torch.tensor([t0 + 50_000, t0 + 52_000])
                return t
            sub = torch.zeros(2, 16, dtype=torch.int64)
            sub[:, 3] = torch.tensor([t0 + 20_000, t0 + 24_000])
            sub[:, 5] = torch.tensor([t0 + 40_000, t0 + 44_000])
            sub[:, 7] = t0 - 5_000_000  # stale: an earlier launch's
            return sub

    job = types.SimpleNamespace(tp=1, rank=0, device=torch.device("cpu"))
    r = Stub()
    rows = bench.phase_rows(job, r, 2, ([None], None, None), ["weights"], 1)
    assert r.launches == bench.PHASE_SKIP + bench.PHASE_STEPS
    got = {x["stamp"]: (x["median_us"], x["latest_us"]) for x in rows}
    assert [x["stamp"] for x in rows] == ["start", "stage1_done", "stage2_done", "end"]
    assert got["stage1_done"] == (22.0, 24.0) and got["end"] == (51.0, 52.0) and got["start"] == (0.5, 1.0)


def test_warm_tp2(tmp_path):
    r = ffnq("warm", "--backend", "cpu", "--tp", "2", "--widths", "1-3,16", "--out", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    t = pd.read_csv(one_report(tmp_path, "warm") / "results.csv", keep_default_na=False)
    assert t.width.tolist() == [1, 2, 3, 16] and (t.resident == "n/a").all() and (t.ctas_per_cu == "n/a").all()
    assert t.kernel[0] == "ffn_tiny_s1_tp2_all" and (t.grid > 0).all()


@pytest.mark.slow
def test_qualify_catches_a_planted_bug(tmp_path):
    """Padding rows sent to experts: the padded cases FAIL with the evidence, the others PASS."""
    r = ffnq("qualify", "--runner", "mutants:PaddingToExperts", "--tp", "2", "--widths", "3", "--out", tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    cases = pd.read_csv(one_report(tmp_path, "qualify") / "results.csv").set_index("case")
    assert cases.loc["correct", "status"] == "PASS"
    assert cases.loc["correct+padding", "status"] == "FAIL"
    assert "nonzero in padding rows" in cases.loc["correct+padding", "evidence"]


@pytest.mark.slow
def test_bench_holds_the_kernel_to_the_qualify_standard_not_a_baselines(tmp_path):
    """A fused step 2% off the oracle is within a bf16 baseline's 3e-2 but not the kernel's 1e-2:
    bench must refuse to time it (the check, not the timing, is the verdict)."""
    r = ffnq("bench", "--runner", "mutants:OutputTwoPercentHigh", "--tp", "2", "--widths", "2", "--rep-ms", "50",
             "--baselines", "none", "--out", tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    row = pd.read_csv(one_report(tmp_path, "bench") / "results.csv").iloc[0]
    assert row.check == "FAIL" and 1.5e-2 < row.rel_err < 3e-2, row.to_dict()
    assert "p50_us" not in row or pd.isna(row.p50_us)  # not timed


@pytest.mark.slow
def test_bench_checks_what_it_timed(tmp_path):
    """A runner whose first call at a width is right and whose later calls hand back those outputs
    untouched passes the check before timing; the timed step's outputs, poisoned and made again by
    one more timed call, must equal the checked step's, so the width FAILs (and names why)."""
    r = ffnq("bench", "--runner", "mutants:OutputsOnce", "--tp", "2", "--widths", "1,3", "--rep-ms", "50",
             "--baselines", "none", "--out", tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    t = pd.read_csv(one_report(tmp_path, "bench") / "results.csv")
    assert (t.check == "FAIL").all() and t.detail.str.contains("timed step's outputs differ").all(), t.to_dict()


@pytest.mark.slow
def test_a_dead_rank_is_named(tmp_path):
    t0 = time.monotonic()
    r = ffnq("qualify", "--backend", "cpu", "--tp", "2", "--widths", "1", "--out", tmp_path,
             env={"FFNQ_TEST_DIE_RANK": "1"})
    assert r.returncode == 1 and "rank 1 died" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60  # fast: not the job's deadline
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_ranks_with_different_grids_are_refused(tmp_path):
    """The grid follows each rank's GPU (TritonRunner: 2 CTAs per SM); ranks whose GPUs differ
    would size their peer buffers and flags apart, so the job stops before building any."""
    r = ffnq("qualify", "--runner", "mixed_grid:MixedGrid", "--tp", "2", "--widths", "1", "--out", tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "rank 0: 4 CTAs, rank 1: 5 CTAs" in r.stderr and "GPUs of one kind" in r.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_a_hung_job_is_killed_at_its_deadline(tmp_path):
    t0 = time.monotonic()
    r = ffnq("qualify", "--backend", "cpu", "--tp", "2", "--widths", "1", "--deadline", "12", "--out", tmp_path,
             env={"FFNQ_TEST_HANG_RANK": "0"})
    assert r.returncode == 1 and "deadline of 12 s" in r.stderr and "rank 0 at hanging" in r.stderr
    assert time.monotonic() - t0 < 40



def test_jobs_give_warm_the_gpus_compute_units(monkeypatch):
    """bench, qualify and soak warm their runners with the GPU's SM count, so a width whose grid
    cannot be co-resident fails at warm with its kernel named (residency.check), before a launch."""
    import inspect
    from types import SimpleNamespace

    import torch

    from ffnq.jobs import soak
    from ffnq.jobs.rank import RankJob

    job = RankJob.__new__(RankJob)
    job.device = torch.device("cpu")
    assert job.compute_units() is None
    job.device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    assert job.compute_units() == 132
    for mod in (bench, qualify, soak):
        warms = [ln for ln in inspect.getsource(mod).splitlines() if ".warm(" in ln]
        assert warms and all("compute_units()" in ln for ln in warms), (mod.__name__, warms)


@pytest.mark.slow
def test_bench_checks_every_weight_set_it_times(tmp_path):
    """bench on a GPU times each width over four weight sets; check_set holds every width on each
    further set to its own fp64 oracle first, so a runner that reads stale weights is refused
    there (timed, it would read L2-warm bytes the floor counts as HBM reads)."""
    import rankfns
    from multirank import run_ranks

    for got in run_ranks(rankfns.bench_check_set, 2, str(tmp_path), timeout=240):
        assert got["good"] == {} and got["outs"] == {1: [1, 1], 3: [3, 3]}  # each width's checked outputs
        assert set(got["stale"]) == {1, 3} and all(v for v in got["stale"].values()), got


def test_bench_judges_the_kernel_by_the_steps_own_bound():
    """bench's check of the kernel under test is qualify's: rel_err within the step's rel_bound,
    so an error twice the bound fails there though it is under the old round 1e-2."""
    import torch
    from ffnq import reference
    from ffnq.spec import Experts, load_model
    from ffnq.weights import synthetic
    spec = load_model("tiny")
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(2, spec.hidden, generator=g).bfloat16()]
    ref = reference.step(parts, torch.randn(2, spec.hidden, generator=g).bfloat16(), torch.tensor([0, 1]),
                         synthetic(spec, 1), spec, Experts.ALL)
    assert 0 < ref.rel_bound_out < reference.MAX_REL_ERR / 2

    def off_by(x, rel):  # x plus noise of norm rel x ||x||
        n = torch.randn(x.shape, generator=g, dtype=torch.float64)
        return (x.double() + n * rel * x.double().norm() / n.norm()).to(x.dtype)

    def check(rel_out):
        c = reference.compare(off_by(ref.out, rel_out), ref.out)
        c2 = reference.compare(ref.res_out, ref.res_out)
        return bench.kernel_ok(None, c, c2, ref)

    assert check(0.0) and check(0.5 * ref.rel_bound_out)
    assert not check(2 * ref.rel_bound_out)
    assert not bench.kernel_ok({"phase": "seam"}, reference.compare(ref.out, ref.out),
                               reference.compare(ref.res_out, ref.res_out), ref)
