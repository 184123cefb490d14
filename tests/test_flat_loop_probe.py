"""scripts/flat_loop_probe.py: in one pipelined loop over a CTA's items, only a data edge from the
item's counter wait to its act's address keeps the wait before the act load (sm_90, offline)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _probe():
    spec = importlib.util.spec_from_file_location("flat_loop_probe", ROOT / "scripts" / "flat_loop_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_only_a_data_edge_orders_the_wait_before_the_act_load():
    p = _probe()
    nested, flat, dep = p.schedule(p.nested), p.schedule(p.flat), p.schedule(p.flat, dep=True)
    # the weights are pipelined in all three forms (cp.async into a ring of stages)
    assert all(r["async_copies"] > 0 for r in (nested, flat, dep))
    assert not nested["spin_in_loop"] and nested["spin_before_act"] is None
    # Triton 3.6 puts a wait with no data edge after the body's loads: it would not order them
    assert flat["spin_in_loop"] and flat["spin_before_act"] is False
    assert dep["spin_in_loop"] and dep["spin_before_act"] is True
