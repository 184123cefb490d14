"""scripts/flat_loop_probe.py (sm_90, offline): what one pipelined loop over a CTA's items needs
from Triton 3.6: a data edge from an item's counter wait to its act's address (or the wait orders
nothing), items fixed by the step index (a carried item id loads nothing ahead) and no CTA
barrier in the body (then nothing is pipelined), which a barrier as inline PTX is not (the removed
FL, a7867f2)."""
from helpers import script_module


def _probe():
    return script_module("flat_loop_probe")


def test_what_one_loop_over_the_items_needs():
    p = _probe()
    nested, flat, dep = p.schedule(p.nested), p.schedule(p.flat), p.schedule(p.flat, dep=True)
    carried, barrier = p.schedule(p.carried), p.schedule(p.carried, dep=True)
    # the per-item loop and the one loop with items fixed by the step: three steps loaded ahead
    assert nested["ahead"] == flat["ahead"] == dep["ahead"] == 3
    assert not nested["spin_in_loop"] and nested["spin_before_act"] is None
    # a wait with no data edge lands after the body's loads: it would not order them
    assert flat["spin_in_loop"] and flat["spin_before_act"] is False
    assert dep["spin_in_loop"] and dep["spin_before_act"] is True
    # an item carried across steps: nothing ahead; a barrier in the body: no copies at all
    assert carried["ahead"] == 0 and carried["copies"] > 0
    assert barrier["copies"] == 0
    # Triton's own flattening of the per-item loops: pipelined with the release's barrier as PTX
    fused_gpu, fused_asm = p.schedule(p.fused), p.schedule(p.fused, dep=True)
    assert fused_gpu["copies"] == 0
    assert fused_asm["ahead"] == 3 and fused_asm["spin_in_loop"] and fused_asm["spin_before_act"] is True
