"""timeline: the handshake table and the Chrome trace from per-CTA phase stamps."""
import json

import pandas as pd
import pytest

from ffnq.spec import stamp_names
from ffnq.timeline import chrome_trace, handshake, phase_profile


def fake_timeline(late_rank: int, delay_ns: int = 300_000_000, tp: int = 2, ctas: int = 2) -> pd.DataFrame:
    """Ranks that scan their peers' flags in turn; ``late_rank`` arrives ``delay_ns`` late."""
    rows = []
    for r in range(tp):
        for c in range(ctas):
            t = 1_000 + (delay_ns if r == late_rank else 0)
            stamps = {"start": 0, "seam_arrive": t}
            for src in range(tp):  # its own flag at once, the late rank's after the delay
                late = src == late_rank and r != late_rank
                stamps[f"seam_seen{src}"] = delay_ns + 5_000 if late else t + 100 * (src + 1)
            stamps["seam_done"] = max(v for k, v in stamps.items() if "seen" in k) + 10
            for n, v in stamps.items():
                rows.append({"case": "inject-under r1", "rank": r, "cta": c, "stamp": n, "t_ns": v + 7 * r,
                             "t_common_ns": v})
    return pd.DataFrame(rows)


def test_handshake_blames_the_late_rank():
    hs = handshake(fake_timeline(1), 2).set_index("rank")
    assert hs.loc[0, "waited_for"] == "rank 1" and hs.loc[0, "wait_us"] > 290_000
    assert hs.loc[1, "skew_us"] == pytest.approx(300_000, rel=1e-3) and hs.loc[0, "skew_us"] == 0
    assert hs.loc[1, "wait_us"] < 10


def test_handshake_never_names_the_rank_itself():
    # the late rank finds its peer's flag at once and its own (polled last, as on cpu) 5 us later
    tl = fake_timeline(1)
    own = (tl["rank"] == 1) & (tl.stamp == "seam_seen1")
    tl.loc[own, "t_common_ns"] += 5_000
    hs = handshake(tl, 2).set_index("rank")
    assert hs.loc[1, "waited_for"] == "rank 0" and hs.loc[0, "waited_for"] == "rank 1"


def test_chrome_trace_is_spans_per_rank_and_cta():
    tr = chrome_trace(fake_timeline(1))
    spans = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in spans} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    wait = [e for e in spans if e["name"] == "seam wait" and e["pid"] == 0]
    assert wait and all(e["dur"] > 290_000 for e in wait)  # us
    assert json.loads(json.dumps(tr))["displayTimeUnit"] == "ns"


def test_stamp_names_cover_the_trace_spans():
    from ffnq.timeline import SPANS

    names = set(stamp_names(2))
    assert all(a in names and b in names for _, a, b in SPANS)




def test_phase_profile_median_and_latest_cta_from_the_first_start():
    """Per stamp: the median and the latest CTA, in us from the earliest start; a CTA that did not
    stamp (0) is left out, a stamp no CTA wrote is absent; in the median CTA's order."""
    names = ["start", "seam_done", "router_done", "end"]
    t0 = 5_000_000
    stamps = [[t0, t0 + 3000, t0 + 7000, t0 + 40000],
              [t0 + 1000, t0 + 2000, 0, t0 + 42000],
              [t0 + 500, t0 + 4000, t0 + 9000, 0]]
    got = phase_profile(stamps, names)
    assert list(got) == names
    assert got["start"] == (0.5, 1.0)
    assert got["seam_done"] == (3.0, 4.0)
    assert got["router_done"] == (8.0, 9.0)  # the CTA with no stamp is not a 0
    assert got["end"] == (41.0, 42.0)
    assert "router_done" not in phase_profile([[t0, t0 + 1, 0, t0 + 2]], names)
