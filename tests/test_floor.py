"""ffnq.floor off a GPU: floor_us is touched expert-shard bytes over the read bandwidth plus two
link latencies, in microseconds, checked against hand-computed numbers; link_latency_us has no
link term without a process group (TP1). The bandwidth and link measurements need a GPU and are
not run here."""
import pytest
import torch
import torch.distributed as dist

from ffnq.floor import floor_us, link_latency_us


def test_floor_by_hand():
    # 3 experts x 1 MB at 2000 GB/s = 3e6 B / 2e6 B/us = 1.5 us, plus 2 x 3 us of link
    assert floor_us(3, 1_000_000, 2000.0, 3.0) == pytest.approx(7.5)
    # 8 x 7 MB at 4500 GB/s, one link of 2.5 us: 56e6 / 4.5e6 + 5
    assert floor_us(8, 7_000_000, 4500.0, 2.5) == pytest.approx(56 / 4.5 + 5.0)


def test_floor_terms_scale_as_they_should():
    base = floor_us(4, 2_000_000, 1000.0, 0.0)
    assert base == pytest.approx(8.0)
    assert floor_us(8, 2_000_000, 1000.0, 0.0) == pytest.approx(2 * base)  # twice the bytes
    assert floor_us(4, 2_000_000, 2000.0, 0.0) == pytest.approx(base / 2)  # twice the bandwidth
    assert floor_us(4, 2_000_000, 1000.0, 1.25) - base == pytest.approx(2.5)  # two link latencies


def test_floor_takes_a_mean_of_touched_experts_and_none():
    """The bench passes the mean over weight sets (fractional); with no experts (or none touched)
    the floor is the link alone."""
    assert floor_us(2.5, 4_000_000, 1000.0, 0.0) == pytest.approx(10.0)
    assert floor_us(0, 4_000_000, 1000.0, 1.5) == pytest.approx(3.0)


def test_no_link_term_without_a_process_group():
    assert not dist.is_initialized()
    assert link_latency_us(256, torch.device("cpu")) == 0.0
    assert link_latency_us(3072, torch.device("cpu")) == 0.0
