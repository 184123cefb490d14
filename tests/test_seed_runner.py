"""A runner of the original design's contract, qualified by import path unchanged.

examples/seed_contract_runner.py imports torch, not ffnq: ffnq.runner.load_runner wraps it
(SeedRunner), opens its peer buffers and shared epoch, and reads only what that contract
exposes. What a check cannot read is "not checked", never passed."""
import ast
import json
from pathlib import Path

import pytest
import torch

from ffnq import reference
from ffnq.errors import UsageError
from ffnq.runner import NotReadable, Runner, load_runner, runner_map
from helpers import ffnq, one_report
from multirank import run_ranks

ROOT = Path(__file__).resolve().parent.parent
SEED = "examples.seed_contract_runner:FfnRunner"


def test_the_example_is_written_to_the_contract_alone():
    tree = ast.parse((ROOT / "examples" / "seed_contract_runner.py").read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m.split(".")[0] == "ffnq" for m in mods), mods
    import examples.seed_contract_runner as seed

    assert not issubclass(seed.FfnRunner, Runner)


def test_load_runner_adapts_a_class_of_the_original_contract(monkeypatch):
    monkeypatch.delenv("FFNQ_RUNNER_MAP", raising=False)
    cls = load_runner(SEED)
    assert issubclass(cls, Runner) and cls.BLOCKS == 4 and cls.DIST_BACKEND in ("gloo", "cpu:gloo,cuda:nccl")
    assert cls.backend == SEED


@pytest.mark.parametrize("text, match", [("route", "need KEY=VALUE"), ("flags=f", "need KEY=VALUE with KEY one of"),
                                         ("device=tpu", "allowed cpu or cuda"), ("peer_bytes=-1", "byte count")])
def test_a_malformed_region_map_is_refused(text, match):
    with pytest.raises(UsageError, match=match):
        runner_map(text)


def _steps(rank, world, name, regions=""):
    """Two ranks through ffnq's own set-up: steps checked against the oracle, the regions the
    checks read, an injected late rank named by both, and a correct step after the reset."""
    import os

    os.environ["FFNQ_RUNNER_MAP"] = regions
    from ffnq.jobs.rank import setup

    # a 1 s bound: at 0.3 s two ranks scheduled apart on loaded cores faulted a checked step
    job = setup(name, "tiny", "all", timeout=1.0, seed=4)
    main, tl = job.runner([1, 3]), job.runner([3], timeline=True)
    for r in (main, tl):
        r.warm(job.weights)
    out = {"readable": {n: main.readable(n) for n in ("fault", "route", "route_w", "timeline", "seam", "flags")},
           "shared_epoch": main.epoch.data_ptr() == tl.epoch.data_ptr()}
    errs = []
    for s, case in ((1, 1), (3, 2)):
        parts, residual, slots = job.inputs(s, case, 0, padding=1 if s == 3 else 0)
        o, res = main(parts[rank], residual, job.weights, slots, final=True)
        if main.readable("fault"):
            assert main.fault(s) is None, (s, main.fault(s))
        follow = main.chosen(s) if main.readable("route") else None
        ref = reference.step(parts, residual, slots, job.full, job.model, job.experts, follow=follow)
        errs.append(reference.compare(o, ref.out)["rel_err"])
        if follow is not None:
            assert torch.equal(main.chosen(s), ref.chosen)
    out["rel_err"] = max(errs)
    tl.inject.copy_(torch.tensor([2, int(1.8e9)], dtype=torch.int32))  # rank 1 late past the timeout
    parts, residual, slots = job.inputs(3, 3)
    tl(parts[rank], residual, job.weights, slots, final=True)
    tl.inject.zero_()
    try:
        out["fault"] = tl.fault(3)
    except NotReadable as e:
        out["fault"] = f"not readable: {e}"
    for r in (main, tl):
        r.reset()
    out["epoch_after_reset"] = int(main.epoch[0])
    parts, residual, slots = job.inputs(3, 4)
    o, _ = main(parts[rank], residual, job.weights, slots, final=True)
    ref = reference.step(parts, residual, slots, job.full, job.model, job.experts, follow=main.chosen(3)
                         if main.readable("route") else None)
    out["after_reset_rel_err"] = reference.compare(o, ref.out)["rel_err"]
    job.close()
    return out


def test_two_ranks_step_fault_and_recover_through_the_adapter():
    got = run_ranks(_steps, 2, SEED, timeout=240)
    for rank, g in enumerate(got):
        assert g["readable"] == {"fault": True, "route": True, "route_w": True, "timeline": True, "seam": False,
                                 "flags": False}
        assert g["shared_epoch"] and g["rel_err"] < reference.MAX_REL_ERR and g["after_reset_rel_err"] < 1e-2
        assert g["fault"]["valid"] == 1 and g["fault"]["missing_ranks"] == [1], (rank, g["fault"])
        assert g["epoch_after_reset"] == 0


@pytest.mark.slow
def test_a_region_the_runner_lacks_is_not_readable_never_a_pass():
    got = run_ranks(_steps, 2, SEED, "fault=,route=none_such", timeout=240)
    for g in got:
        assert not g["readable"]["fault"] and not g["readable"]["route"] and g["readable"]["timeline"]
        assert g["fault"].startswith("not readable: fault:")
        assert g["rel_err"] < reference.MAX_REL_ERR  # the outputs are still checked


def _qualify_knows_not_checked() -> bool:
    import ffnq.jobs.qualify as q

    return "NotReadable" in Path(q.__file__).read_text()


@pytest.mark.slow
@pytest.mark.skipif(not _qualify_knows_not_checked(), reason="ffnq/jobs/qualify.py does not report a region a "
                    "runner lacks as NOT CHECKED yet (it stops at the first one)")
@pytest.mark.parametrize("regions", ["", "fault="], ids=["all-regions", "no-fault-record"])
def test_qualify_by_import_path(tmp_path, regions):
    r = ffnq("qualify", "--runner", SEED, "--tp", "2", "--widths", "1,3", "--inject-rank", "all", "--out", tmp_path,
             env={"PYTHONPATH": str(ROOT), "FFNQ_RUNNER_MAP": regions}, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr  # not everything could be checked: not a pass
    cases = {c["case"]: c for c in json.loads((one_report(tmp_path, "qualify") / "results.json").read_text())
             ["tables"]["results"]}
    assert {c["status"] for c in cases.values()} <= {"PASS", "NOT CHECKED"}
    # its peer buffer's layout is its own: no stale tags can be planted there
    assert cases["stale-epoch older r1"]["status"] == "NOT CHECKED"
    assert "not checked" in cases["stale-epoch older r1"]["evidence"]
    if regions == "":
        assert all(c["status"] == "PASS" for k, c in cases.items() if not k.startswith("stale-epoch ")), cases
        agree, rows = cases["correct"]["route_agree"].split("/")
        assert cases["inject-over r0"]["fault"] and agree == rows != "0"  # its route region is read
    else:  # without a fault record, nothing that judges one passes
        for k in ("inject-over r0", "inject-over r1", "correct", "recovery r0"):
            assert cases[k]["status"] == "NOT CHECKED" and "fault record" in cases[k]["evidence"], cases[k]
