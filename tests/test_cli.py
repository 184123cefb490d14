"""The CLI: bad input through typer's CliRunner (exit 2, one line, no traceback, nothing written),
``report`` and ``info``, and a real ``ffnq qualify`` at TP2 on cpu with injection, read back."""
import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from ffnq.cli import app
from ffnq.report import write_report
from helpers import ffnq, one_report

runner = CliRunner()

BAD = [
    (["qualify", "--widths", "0-3"], "--widths '0-3'"),
    (["qualify", "--widths", "1-x"], "is not N or N-M"),
    (["qualify", "--widths", "17"], "outside 1..16"),
    (["bench", "--backend", "cuda"], "--backend 'cuda': allowed"),
    (["qualify", "--model", "llama"], "model 'llama': no such file"),
    (["qualify", "--runner", "nowhere.mod:Runner"], "cannot import nowhere.mod"),
    (["qualify", "--runner", "json:dumps"], "not a runner class"),
    (["qualify", "--experts", "some"], "--experts 'some': allowed all, local, none"),
    (["qualify", "--tp", "0"], "--tp 0: allowed 1..64"),
    (["qualify", "--tp", "100000", "--experts", "none"], "--tp 100000: allowed 1..64"),
    (["qualify", "--widths", ""], "--widths '': empty"),
    (["qualify", "--widths", "[/x]"], "'[/x]' is not N or N-M"),
    (["qualify", "--inject-rank", "\u00b2"], "--inject-rank '\u00b2': allowed 0..1"),
    (["qualify", "--timeout", "3"], "--timeout 3: qualify's cases over the timeout"),
    (["qualify", "--timeout", "inf"], "--timeout inf: allowed 1e-06..60 s"),
    (["warm", "--timeout", "1e-12"], "--timeout 1e-12: allowed"),
    (["qualify", "--deadline", "inf"], "--deadline inf: must be > 0 and finite"),
    (["qualify", "--seed", "-1"], "--seed -1: allowed 0..2^63-1"),
    (["qualify", "--rdzv-endpoint", "127.0.0.1:notaport"], "--rdzv-endpoint '127.0.0.1:notaport': need HOST:PORT"),
    (["qualify", "--rdzv-endpoint", "garbage"], "need HOST:PORT"),
    (["soak", "--kill-rank", "1", "--hang-rank", "0", "--at-step", "5"], "allowed one fault per soak"),
    (["soak", "--at-step", "5"], "--at-step 5: needs --kill-rank or --hang-rank"),
    (["soak", "--runners", "100000"], "--runners 100000: allowed"),
    (["bench", "--rep-ms", "inf"], "--rep-ms inf / --warmup-ms 200: allowed"),
    (["bench", "--warmup-ms", "nan"], "--warmup-ms nan: allowed"),
    (["bench", "--layers", "0"], "--layers 0: allowed 1..256"),
    (["qualify", "--tp", "8"], "legal tp: 1, 2, 3, 4, 6"),
    (["qualify", "--tp", "2", "--inject-rank", "2"], "--inject-rank '2': allowed 0..1"),
    (["qualify", "--timeout", "0"], "--timeout 0.0: must be > 0"),
    (["qualify", "--timeout", "-1"], "must be > 0"),
    (["qualify", "--backend", "triton"], "needs a GPU and this host has none"),
    (["bench", "--rep-ms", "0"], "--rep-ms 0 / --warmup-ms 200: allowed 0 < rep"),
    (["bench", "--burst-ms", "-1"], "--burst-ms -1 / --idle-ms 250: allowed 0..10000 ms"),
    (["bench", "--idle-ms", "60000"], "--idle-ms 60000: allowed 0..10000 ms"),
    (["bench", "--baselines", "nccl"], "--baselines 'nccl': allowed auto, none"),
    (["bench", "--baselines", "stock-symm"], "needs a GPU backend and --tp >= 2"),
    (["bench", "--baselines", "vllm"], "--baselines vllm: needs a GPU backend"),
    (["warm", "--target", "sm_80"], "--target 'sm_80': allowed sm_90, gfx942, gfx950"),
    (["warm", "--target", "sm_90", "--backend", "cpu"], "offline residency for cpu/sm_90 not available"),
    (["warm", "--target", "sm_90", "--timeout", "-1"], "--target sm_90: an offline compile launches no job; --timeout"),
    (["gate", "missing.toml"], "gate config 'missing.toml': no such file"),
    (["qualify", "--checkpoint-layer", "3"], "--checkpoint-layer 3: needs --checkpoint PATH"),
    (["bench", "--checkpoint", "/nonexistent/ck"], "checkpoint /nonexistent/ck: no .safetensors file there"),
    (["warm", "--target", "sm_90", "--checkpoint", "ck"], "--target sm_90: an offline compile launches no job; "
                                                           "--checkpoint"),
    (["qualify", "--runner", "broken_runners:Raises"], "runner 'broken_runners:Raises': importing broken_runners "
                                                      "failed: RuntimeError: no driver here; fix the module"),
    (["qualify", "--runner", "broken_syntax:Runner"], "importing broken_syntax failed: SyntaxError"),
    (["qualify", "--runner", "json:JSONDecoder"], "json:JSONDecoder is not a runner class (a subclass of "
                                                  "ffnq.runner.Runner, or a class of the original contract"),
]


@pytest.fixture
def broken_modules(tmp_path, monkeypatch):
    """Plug-in modules that fail at import: one raises, one is not Python."""
    (tmp_path / "broken_runners.py").write_text("raise RuntimeError('no driver here')\n")
    (tmp_path / "broken_syntax.py").write_text("class Runner(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_exits_2_with_one_line(tmp_path, args, message, broken_modules):
    out = tmp_path / "reports"
    r = runner.invoke(app, [*args, "--out", str(out)])
    assert r.exit_code == 2, r.output
    text = r.output.strip()
    assert message in text and len(text.splitlines()) == 1 and "Traceback" not in text
    assert not out.exists()


OUT_CASES = [(v, "a-file") for v in ("warm", "qualify", "bench", "soak", "gate", "compare")] + [
    ("qualify", "a-file/sub"), ("qualify", "/proc/ffnq-out")]


@pytest.mark.parametrize("verb, where", OUT_CASES)
def test_an_unwritable_out_is_refused_before_any_job(tmp_path, verb, where):
    """Through the console script (click's errors cut to one line there), before any rank starts."""
    (tmp_path / "a-file").write_text("x")
    out = where if where.startswith("/") else str(tmp_path / where)
    args = {"gate": ["gate", "configs/gates/cpu-tp2.toml"], "compare": ["compare", "a", "b"]}.get(
        verb, [verb, "--backend", "cpu"])
    r = ffnq(*args, "--out", out)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip()
    assert "--out" in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_gate_that_needs_a_gpu_names_its_config_on_a_cpu_host(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    r = runner.invoke(app, ["gate", "configs/gates/h200-tp1.toml", "--out", str(tmp_path / "o")])
    text = r.output.strip()
    assert r.exit_code == 2 and len(text.splitlines()) == 1 and not (tmp_path / "o").exists()
    assert text.startswith("error: gate config configs/gates/h200-tp1.toml") and "asks for --backend triton" in text
    assert "needs a GPU" in text and "use --backend cpu" not in text  # the config's value, not a flag to change


def test_an_empty_out_writes_nothing_in_the_working_directory(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "ffnq.cli", "warm", "--backend", "cpu", "--widths", "1", "--out", ""],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "--out" in r.stderr and "empty" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_an_out_under_proc_says_what_is_wrong_and_what_to_do():
    r = ffnq("warm", "--out", "/proc/forbidden")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "cannot write reports under /proc (no folder can be made there); give a folder you can write" in r.stderr
    assert "No such file or directory" not in r.stderr


def test_version_and_help_without_a_bool_metavar():
    from importlib.metadata import version

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"ffnq {version('ffnq')}"
    for args in (["--help"], ["qualify", "--help"], ["bench", "--help"], ["soak", "--help"], ["gate", "--help"]):
        r = runner.invoke(app, args, env={"COLUMNS": "160"})
        assert r.exit_code == 0 and "--help" in r.output and "<bool>" not in r.output, args


def test_the_cli_starts_without_torch_pandas_or_matplotlib():
    """`ffnq --help` and a flag typer refuses import typer only (the rest loads in a verb's body):
    run with those modules made unimportable."""
    import subprocess
    import sys

    block = "import sys; [sys.modules.__setitem__(m, None) for m in ('torch', 'pandas', 'matplotlib', 'numpy')]; "
    for args, rc, text in ((["--help"], 0, "Usage"), (["qualify", "--bad"], 2, "No such option: --bad"),
                           (["--version"], 0, "ffnq ")):
        r = subprocess.run([sys.executable, "-c", block + f"from ffnq.cli import app; app({args!r})"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == rc and text in r.stdout + r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_bad_type_is_one_line_through_the_console_script(tmp_path):
    r = ffnq("qualify", "--tp", "abc", "--out", tmp_path / "o")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--tp" in r.stderr
    assert not (tmp_path / "o").exists()


def test_malformed_gate_config(tmp_path):
    bad = tmp_path / "g.toml"
    bad.write_text("[[job]\n")
    r = runner.invoke(app, ["gate", str(bad), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "malformed TOML" in r.output and not (tmp_path / "o").exists()


def test_report_prints_a_saved_run(tmp_path):
    how = "cuda-graph, 4 weight sets per replay (cold L2), bursts of {} steps after 250 ms idle"
    df = pd.DataFrame({"width": [1, 16], "p50_us": [12.5, 40.0], "rel_err": [2e-3, 2e-3], "check": ["OK", "OK"],
                       "timing": [how.format(1000), how.format(250)]})
    path = write_report(tmp_path, "bench", "cpu", 2, df, meta={"command": "ffnq bench", "config": {}},
                        verdict="2 widths: OK")
    r = runner.invoke(app, ["report", str(path)])
    assert r.exit_code == 0 and "12.5" in r.output and "2 widths: OK" in r.output
    # bench's terminal view, as `ffnq bench` shows it: the timing method once, under the table
    assert "rel_err" not in r.output and r.output.count("cuda-graph") == 1 and "bursts of 1000" in r.output
    r = runner.invoke(app, ["report", str(path), "--json"])
    assert json.loads(r.stdout.splitlines()[0])["rows"][1] == {"width": 16, "p50_us": 40.0, "rel_err": 2e-3,
                                                               "check": "OK", "timing": how.format(250)}
    r = runner.invoke(app, ["report", str(tmp_path)])
    assert r.exit_code == 2 and "no results.json" in r.output


def test_info_lists_backends():
    r = runner.invoke(app, ["info", "--json"])
    rows = {x["item"]: x["value"] for x in json.loads(r.stdout)["rows"]}
    assert r.exit_code == 0 and rows["backend cpu"] == "yes" and "torch" in rows


def test_qualify_tp2_with_injection_end_to_end(tmp_path):
    r = ffnq("qualify", "--backend", "cpu", "--tp", "2", "--model", "tiny", "--widths", "1,3",
             "--inject-rank", "0", "--out", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "failed: OK" in r.stdout and "handshake" in r.stdout
    rep = one_report(tmp_path, "qualify")
    cases = pd.read_csv(rep / "results.csv")
    assert (cases.status == "PASS").all() and len(cases) >= 12
    assert {"correct", "correct+padding", "two-runners", "reset-mid-run", "inject-under r0", "inject-over r0",
            "recovery r0", "stale-epoch older r1", "stale-epoch newer r1"} <= set(cases.case)
    ok = cases[cases.case.str.startswith("correct")]
    assert (ok.rel_err < 1e-2).all() and (ok.wrong == 0).all() and (ok.elements > 0).all()
    over = cases.set_index("case").loc["inject-over r0"]
    assert "missing [0]" in over.fault and "r1:" in over.fault and "r0:" in over.fault  # every rank names rank 0
    doc = json.loads((rep / "results.json").read_text())
    assert doc["schema_version"] == 1 and doc["config"]["inject_ranks"] == [0] and doc["machine"]["cpus"]
    # no --seed: a fresh one, shown in the title and kept, so --seed repeats the run
    assert f"seed={doc['config']['seed']}" in r.stdout
    hs = pd.DataFrame(doc["tables"]["handshake"])
    late = hs[(hs.phase == "seam") & (hs["rank"] == 1)].iloc[0]
    assert late.waited_for == "rank 0" and late.wait_us > 150_000  # 0.3 s delay, seen by rank 1
    trace = json.loads((rep / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    tl = pd.read_csv(rep / "timeline.csv")
    assert {"case", "rank", "cta", "stamp", "t_ns", "t_common_ns"} <= set(tl.columns)
    assert (rep / "timeline.png").stat().st_size > 1000
    r = ffnq("report", rep)
    assert r.returncode == 0 and "inject-over r0" in r.stdout


def test_a_run_without_a_seed_draws_a_fresh_one():
    from ffnq.options import fresh_seed

    seeds = {fresh_seed() for _ in range(8)}
    assert len(seeds) > 1 and all(0 <= x < 2 ** 31 for x in seeds)


def test_report_command_names_a_triton_tune_override(monkeypatch):
    """A development override changes the compiled kernel, so the report's command shows it."""
    from ffnq.verbs import meta as _meta
    monkeypatch.delenv("FFNQ_TRITON_TUNE", raising=False)
    monkeypatch.setattr("sys.argv", ["ffnq", "bench", "--backend", "triton"])
    assert _meta({})["command"] == "ffnq bench --backend triton"
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "LL=0,BH=128")
    assert _meta({})["command"] == "FFNQ_TRITON_TUNE=LL=0,BH=128 ffnq bench --backend triton"


@pytest.mark.slow
def test_a_checkpoint_s_layer_is_qualified_and_named(tmp_path):
    """--checkpoint/--checkpoint-layer: a layer it lacks or a model it is not refused before any rank (exit
    2, one line, nothing written); its layer qualified on 2 ranks, named in the title and report."""
    from helpers import write_checkpoint
    from ffnq.spec import load_model

    ck = write_checkpoint(tmp_path / "ck", load_model("tiny"), layers=[3, 4])
    out = tmp_path / "reports"
    for args, message in ((["--checkpoint-layer", "7"], "--checkpoint-layer 7: checkpoint"),
                          (["--model", "minimax-m2", "--tp", "2"], "config.json hidden_size = 256")):
        r = runner.invoke(app, ["qualify", "--backend", "cpu", "--checkpoint", str(ck), *args, "--out", str(out)])
        assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not out.exists()
    r = ffnq("qualify", "--backend", "cpu", "--tp", "2", "--model", "tiny", "--checkpoint", ck, "--checkpoint-layer", "4",
             "--widths", "1,5", "--out", out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checkpoint=ck checkpoint_layer=4" in r.stdout
    doc = json.loads((one_report(out, "qualify") / "results.json").read_text())
    assert doc["config"]["checkpoint"] == str(ck.absolute()) and doc["config"]["checkpoint_layer"] == 4
    assert {c["status"] for c in doc["tables"]["results"]} == {"PASS"}
