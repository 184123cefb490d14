"""ffnq.gpu_clocks against a fake NVML (no GPU here): what a window's polls say, a watch used
for several bursts, and nothing at all off NVIDIA. Also time_steps' bursts, which the watch
brackets."""
import time
from types import SimpleNamespace

import pytest

from ffnq.verbs import capped_note
from ffnq.gpu_clocks import CAP_REASONS, ClockWatch, idle, nvml_handle
from ffnq.timing import time_steps


def fake_nvml(states):
    """An NVML whose every poll returns the next (SM MHz, mW, reasons) of ``states`` (the last repeats)."""
    it = iter(states)
    last = [states[0]]

    def state():
        last[0] = next(it, last[0])
        return last[0]
    now = {}

    def clock(h, which):
        assert which == "SM"
        now["s"] = state()
        return now["s"][0]
    return SimpleNamespace(NVML_CLOCK_SM="SM", nvmlDeviceGetClockInfo=clock,
                           nvmlDeviceGetPowerUsage=lambda h: now["s"][1],
                           nvmlDeviceGetCurrentClocksEventReasons=lambda h: now["s"][2])


def test_polls_give_the_median_clock_the_slowest_and_the_capped_share():
    states = [(1980, 500_000, 0x0), (1980, 690_000, 0x0), (1215, 700_000, 0x4), (960, 705_000, 0x4 | 0x1)]
    w = ClockWatch("cpu", nvml=(fake_nvml(states), "h"))
    for _ in states:
        w.poll()
    s = w.summary()
    assert s["sm_mhz"] == pytest.approx((1980 + 1215) / 2) and s["sm_mhz_min"] == 960
    assert s["power_w"] == pytest.approx(695.0) and s["capped_pct"] == 50.0


def test_idle_and_application_clocks_are_not_caps():
    assert not CAP_REASONS & (0x1 | 0x2 | 0x10 | 0x100)
    assert all(CAP_REASONS & bit for bit in (0x4, 0x8, 0x20, 0x40, 0x80))


def test_a_watch_polls_while_each_window_runs_and_adds_them_up():
    w = ClockWatch("cpu", period_s=0.001, nvml=(fake_nvml([(1980, 400_000, 0)]), "h"))
    with w:
        time.sleep(0.02)
    first = len(w.polls)
    assert first >= 3  # polls during the window, plus one at its end
    with w:  # the next burst: the thread starts again, the polls add up
        time.sleep(0.02)
    assert len(w.polls) >= first + 3 and w.summary()["capped_pct"] == 0.0


def test_a_query_the_gpu_does_not_answer_ends_the_polls_not_the_bench():
    def refuse(h):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
    m = fake_nvml([(1980, 400_000, 0)])
    m.nvmlDeviceGetPowerUsage = refuse
    w = ClockWatch("cpu", period_s=0.001, nvml=(m, "h"))
    with w:
        time.sleep(0.01)
    assert w.summary() == {} and not w._thread.is_alive()


def test_off_nvidia_nothing_is_polled_and_idle_does_not_wait():
    assert nvml_handle("cpu") is None
    w = ClockWatch("cpu")
    with w:
        pass
    assert w.summary() == {}
    t = time.perf_counter()
    idle(5.0, "cpu")  # only a GPU's power state needs the rest
    assert time.perf_counter() - t < 0.5


class Brackets:
    """A stand-in watch that counts the windows it brackets."""

    def __init__(self):
        self.windows = 0

    def __enter__(self):
        self.windows += 1

    def __exit__(self, *exc):
        pass


@pytest.mark.parametrize("steps, burst, windows", [(7, 3, 3), (6, 3, 2), (4, 0, 1), (4, 10, 1)])
def test_time_steps_takes_its_samples_in_bursts(steps, burst, windows):
    calls, w = [], Brackets()
    s = time_steps(lambda: calls.append(1), steps, burst=burst, idle_s=5.0, watch=w)
    assert len(s) == len(calls) == steps and w.windows == windows  # no lead calls, no idle on cpu


def test_capped_note_names_the_widths_under_a_cap():
    import pandas as pd

    lat = pd.DataFrame({"width": [1, 7, 16], "capped_pct": [0.0, 12.5, 40.0]})
    (line,) = capped_note(lat)
    assert "widths 7, 16" in line and "40%" in line
    assert capped_note(lat.assign(capped_pct=0.0)) == [] and capped_note(lat.drop(columns="capped_pct")) == []
