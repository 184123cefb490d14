"""Bad input is one line and exit 2, before or at the ranks' start: a runner whose construction
or warm-up raises, a checkpoint whose config.json is not JSON, a value thousands of characters
long (cut in the message)."""
from __future__ import annotations

import json

import pytest

from ffnq.errors import UsageError
from ffnq.options import cut, parse_inject, parse_widths, shown
from ffnq.spec import load_model
from helpers import ffnq, write_checkpoint


@pytest.mark.parametrize("runner, where, what", [
    ("bad_runners:InitRaises", "__init__", "RuntimeError: no device context for this build"),
    ("bad_runners:WarmRaises", "warm", "ValueError: kernel image failed to load")])
def test_a_runner_that_raises_before_its_first_step_is_bad_input(tmp_path, runner, where, what):
    r = ffnq("qualify", "--runner", runner, "--widths", "1,2", "--out", tmp_path / "out")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"runner {runner}: {where} failed: {what}" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_whose_config_is_not_json_is_one_line(tmp_path):
    from ffnq.weights import check_checkpoint

    spec = load_model("tiny")
    ck = write_checkpoint(tmp_path / "ck", spec, layers=[0])
    (ck / "config.json").write_text("{hidden_size: 256,")
    with pytest.raises(UsageError, match=r"config.json is not readable JSON \(Expecting property name"):
        check_checkpoint(ck, None, spec)
    (ck / "config.json").write_text("[1, 2]")
    with pytest.raises(UsageError, match="config.json holds a JSON list, not an object"):
        check_checkpoint(ck, None, spec)
    (ck / "config.json").write_text(json.dumps({"hidden_size": "x" * 5000}))
    with pytest.raises(UsageError) as e:
        check_checkpoint(ck, None, spec)
    assert len(str(e.value)) < 300 + len(str(ck)) and "..." in str(e.value)
    (ck / "config.json").write_text("{")
    r = ffnq("qualify", "--backend", "cpu", "--checkpoint", ck, "--out", tmp_path / "out")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "config.json is not readable JSON" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("text", [",".join(str(w % 16 + 1) for w in range(20_001)) + ",x",
                                  ",".join(["1"] * 20_001) + ",17", "9" * 40_000])
def test_a_huge_value_is_cut_in_the_message(text):
    with pytest.raises(UsageError) as e:
        parse_widths(text, 16)
    msg = str(e.value)
    assert len(msg) < 200 and "\n" not in msg and "..." in msg, msg
    with pytest.raises(UsageError) as e:
        parse_inject([text], 2)
    assert len(str(e.value)) < 200


def test_cut_and_shown():
    assert cut("short") == "short" and len(cut("x" * 1000)) == 60 and cut("x" * 1000).endswith("...")
    assert cut("a\nb") == "a\\nb" and shown("a" * 100).startswith("'aaa") and len(shown("a" * 100)) == 60


def test_the_cli_cuts_a_huge_widths_list(tmp_path):
    r = ffnq("qualify", "--backend", "cpu", "--widths", ",".join(["1"] * 20_001) + ",99", "--out", tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and len(r.stderr) < 300, r.stderr[:500]
