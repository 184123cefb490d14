"""warm's table: a width's compile time only where the runner measured one, the offline compile of
every width in parallel with progress, and why a grid is the size it is."""
import sys

import pandas as pd
import pytest

from ffnq.jobs import warm


@pytest.fixture
def fake_backend(tmp_path, monkeypatch):
    """A backend offline module whose warm_table takes a moment per width."""
    (tmp_path / "fake_offline.py").write_text(
        "import os, time\n"
        "def warm_table(spec, tp, mode, target, widths):\n"
        "    time.sleep(0.2)\n"
        "    return [{'width': w, 'kernel': f'k{w}', 'compile_s': 0.2, 'grid': 264, 'cus': 304, 'ctas_per_cu': 1,\n"
        "             'resident': True, 'pid': os.getpid()} for w in widths]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fake_offline"
    sys.modules.pop("fake_offline", None)


@pytest.mark.parametrize("inner", [1, 64], ids=["widths-in-parallel", "one-width-at-a-time"])
def test_every_width_once_in_order_with_a_line_per_width(fake_backend, capsys, inner):
    rows = warm.compile_widths(fake_backend, (None, 2, None, "gfx942"), [16, 1, 3, 8], "fake gfx942", inner=inner)
    assert [r["width"] for r in rows] == [16, 1, 3, 8]
    err = capsys.readouterr().err  # not a terminal: one line per width, with the time left
    assert err.count("warm fake gfx942: width ") == 4 and "(4/4;" in err and "s left)" in err


def test_a_grid_note_says_why():
    n = warm.grid_note("triton", "gfx942", {"grid": 264, "cus": 304})
    assert "CDNA builds keep the grid tuned on an H200" in n and "40 CUs stay idle" in n
    assert "needs 2 CTAs per CU" in warm.grid_note("triton", "gfx950", {"grid": 264, "cus": 256})
    assert warm.grid_note("triton", "sm_90", {"grid": 264, "cus": 132}).startswith("grid = 2 CTAs x 132 SMs")
    assert "FlydslRunner.BLOCKS" in warm.grid_note("flydsl", "gfx942", {"grid": 128, "cus": 304})


def test_a_runner_without_per_width_times_shows_none_not_an_even_split():
    rows = pd.DataFrame([{"width": w, "rank": r, "kernel": f"k{w}", "compile_s": None, "resources": "",
                          "ctas_per_cu": "n/a", "cus": "n/a", "grid": 4, "resident": "n/a",
                          "note": "compile_s: no per-width time from this runner; warm() took 1.50 s for all 2 widths"}
                         for w in (1, 2) for r in (0, 1)])
    t = warm.summarize(rows)
    assert t.compile_s.isna().all() and t.note.iloc[0].endswith("took 1.50 s for all 2 widths")
    timed = warm.summarize(rows.assign(compile_s=[0.1, 0.3, 0.2, 0.2], note=""))
    assert timed.compile_s.tolist() == [0.3, 0.2] and "note" not in timed  # the slowest rank's
