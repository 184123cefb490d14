"""scripts/triton_device.py's row-pick profile (kernel stamps 10 and 11) from a hand-made stamp table."""
import pytest
import torch
from helpers import script_module


@pytest.fixture(scope="module")
def device_script():
    return script_module("triton_device")


def _sub(rows):
    """rows of (barrier 1, phase end, barrier 2, arrival, top-k done) in ns; 0: not stamped."""
    sub = torch.zeros(len(rows), 16, dtype=torch.float64)
    for i, (b1, end, b2, arr, topk) in enumerate(rows):
        sub[i, [0, 1, 2, 10, 11]] = torch.tensor([b1, end, b2, arr, topk], dtype=torch.float64)
    return sub


def test_row_pick_medians_and_latest(device_script):
    sub = _sub([
        # two arrivers that are not their row's last (an older launch's stamp 11 before the arrival)
        (1000, 3600, 6000, 3400, 500),
        (1000, 3600, 6000, 3500, 500),
        # the rows' last arrivers: arrival, top-k, then the picks stored by the phase's end
        (1000, 5000, 6000, 2600, 4600),
        (1200, 5900, 6000, 3200, 5300),
        # stamps of an earlier launch (before this one's barrier 1): left out
        (9000, 9100, 9900, 100, 200),
        # a CTA past the rows: no arrival
        (1000, 1100, 6000, 0, 0),
    ])
    got = device_script.row_pick(sub)
    # torch's median is the lower middle value
    assert got["pick_arrive"] == 2.0  # of 2400, 2500, 1600, 2000 ns
    assert got["pick_last"] == 1.6  # 1600, 2000
    assert got["pick_topk"] == 2.0  # 2000, 2100
    assert got["pick_store"] == 0.4  # 400, 600
    assert got["latest"] == {"arrived": 3500.0, "picked": 5300.0}


def test_row_pick_without_the_pick_is_empty(device_script):
    """Widths whose phase B has no row pick (no stamp 11 in this launch) report nothing."""
    assert device_script.row_pick(_sub([(1000, 2000, 3000, 0, 0), (1000, 2000, 3000, 1500, 900)])) == {}
