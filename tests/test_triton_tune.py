"""FFNQ_TRITON_TUNE is parsed once, per width, and a key no build reads is refused, named."""
import re
from pathlib import Path

import pytest

from ffnq.backends.triton import tune
from helpers import ffnq


def test_plain_keys_and_one_widths_keys_over_them():
    raw = "UP_KSPLIT@1=2, DOWN_TILE@3=64,DOWN_TILE=128,UP_KSPLIT@11=3,GRID@1=396,MAXNREG@1=168"
    assert tune.parse(raw) == {"UP_KSPLIT@1": 2, "DOWN_TILE@3": 64, "DOWN_TILE": 128, "UP_KSPLIT@11": 3,
                               "GRID@1": 396, "MAXNREG@1": 168}
    assert tune.parse(raw, 3)["DOWN_TILE"] == 64 and tune.parse(raw, 2)["DOWN_TILE"] == 128
    assert tune.parse(raw, 11)["UP_KSPLIT"] == 3 and "UP_KSPLIT" not in tune.parse(raw, 2)
    assert tune.parse(raw, 1)["GRID"] == 396 and "GRID" not in tune.parse(raw, 2)
    assert tune.parse("") == {} and tune.parse(" , ") == {}


def test_the_short_names_of_earlier_releases_still_read():
    """BN, KS@w, G<w>, R<w> ... are read as the keys they stand for."""
    assert tune.parse("BN=32,KS@1=2,G1=396,R3=168,R@4=160,CPS@2=3") == {
        "UP_TILE": 32, "UP_KSPLIT@1": 2, "GRID@1": 396, "MAXNREG@3": 168, "MAXNREG@4": 160, "CTAS_PER_SM@2": 3}
    assert set(tune.ALIASES.values()) <= tune.KEYS


@pytest.mark.parametrize("raw, named", [
    ("KROT=1", "key 'KROT': no build reads it"),  # a key whose code was dropped
    ("UP_TILE=32,UP_STAGES_NARROW=5,TLG=1", "key 'TLG'"),
    ("bn=32", "entry 'bn=32'"),
    ("UP_TILE", "entry 'UP_TILE'"),
    ("UP_TILE=3.5", "entry 'UP_TILE=3.5'"),
    ("UP_TILE@x=2", "entry 'UP_TILE@x=2'"),
    ("G0=132", "key 'G0'"),
])
def test_a_bad_entry_is_refused_named(raw, named):
    with pytest.raises(ValueError, match=re.escape(f"FFNQ_TRITON_TUNE {named}")):
        tune.parse(raw)


def test_the_keys_are_the_ones_the_builds_read():
    """KEYS against the source's reads: a key added to the kernel without KEYS would be refused,
    and a key left in KEYS after its code is dropped would be silently ignored."""
    pytest.importorskip("triton")
    from ffnq.backends.triton import geometry as G

    src = Path(G.__file__).parent
    read = set(re.findall(r'\btune\.get\("([A-Z0-9_]+)"', "".join(p.read_text() for p in src.glob("*.py"))))
    read |= set(re.findall(r'\bover\.get\("([A-Z0-9_]+)"', (src / "runner.py").read_text()))
    assert read == tune.KEYS
    assert G.MEASURED_KEYS <= tune.KEYS


def test_cps_sets_a_widths_grid_and_the_flags_hold_it(monkeypatch):
    """CTAS_PER_SM@5=3 takes 3 x SMs at five tokens (as configs/triton-measured.toml's
    CTAS_PER_SM does), and the peer buffer's flags are sized for that grid."""
    pytest.importorskip("triton")
    from ffnq.backends.triton import TritonRunner
    from ffnq.spec import load_model

    spec = load_model("minimax-m2")
    r = TritonRunner.for_sms(100)
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "CTAS_PER_SM@5=3")
    assert [r.blocks_for(w, spec, 2) for w in (4, 5, 6)] == [200, 300, 200]
    assert r.flag_blocks() >= 300
    monkeypatch.setenv("FFNQ_TRITON_TUNE", "CTAS_PER_SM=1,GRID@6=150")
    assert [r.blocks_for(w, spec, 2) for w in (5, 6)] == [100, 150]


def test_the_command_refuses_a_bad_override_before_any_rank(tmp_path):
    pytest.importorskip("triton")
    r = ffnq("bench", "--backend", "triton", "--out", tmp_path / "reports", env={"FFNQ_TRITON_TUNE": "KROT=1"})
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "FFNQ_TRITON_TUNE key 'KROT'" in r.stderr
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize("table, named", [
    ({"minimax-m3": {"tp1": {"w1": {}}}}, r"\[minimax-m3\]: model 'minimax-m3'"),
    ({"minimax-m2": {"tp 1": {"w1": {}}}}, r"\[minimax-m2.tp 1\]"),
    ({"minimax-m2": {"tp1": {"w17": {}}}}, r"\[minimax-m2.tp1.w17\]: need .* width 1..16"),
    ({"minimax-m2": {"tp1": {"UP_KSPLIT": 2}}}, r"\[minimax-m2.tp1.UP_KSPLIT\]"),
])
def test_a_misspelt_measured_row_is_refused_named(table, named):
    """configs/triton-measured.toml: a row no build would look up is an error, not a no-op."""
    pytest.importorskip("triton")
    from ffnq.backends.triton import geometry as G

    with pytest.raises(ValueError, match=named):
        G.check_measured(table)
    G.measured_table.cache_clear()
    assert G.check_measured(G.measured_table())  # the shipped table
