import re

import pytest

from ffnq.errors import UsageError
from ffnq.spec import (Experts, FfnBuild, ModelSpec, Phase, kernel_name, layout_bytes, load_model, peer_layout,
                       scratch_layout, stamp_names)


def test_models_load_with_real_shapes():
    m = load_model("minimax-m2")
    assert (m.hidden, m.experts, m.top_k, m.intermediate, m.block, m.eps, m.max_tokens) == (
        3072, 256, 8, 1536, 128, 1e-6, 16)
    assert m.expert_bytes(2, Experts.ALL) == 3 * 3072 * 768  # 7.08 MB per chosen expert at TP2
    assert load_model("tiny").intermediate_per_rank(2, Experts.ALL) % 128 == 0


@pytest.mark.parametrize("tp,ok", [(1, True), (2, True), (3, True), (4, True), (5, False), (8, False)])
def test_tp_legality_follows_the_block(tp, ok):
    m = load_model("minimax-m2")
    if ok:
        m.check(tp, Experts.ALL)
    else:
        with pytest.raises(UsageError, match=rf"tp={tp} with --experts all: .* legal tp: 1, 2, 3, 4, 6 \(or --experts local\)"):
            m.check(tp, Experts.ALL)


def test_local_needs_experts_divisible_by_tp():
    m = load_model("minimax-m2")
    m.check(8, Experts.LOCAL)  # EP8: 32 whole experts per rank
    with pytest.raises(UsageError, match="256 experts do not split evenly over 3"):
        m.check(3, Experts.LOCAL)


def test_bad_model_inputs(tmp_path):
    with pytest.raises(UsageError, match="known models: .*minimax-m2.*tiny"):
        load_model("nope")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = 'x'\nhidden = 3000\nexperts = 4\ntop_k = 2\nintermediate = 256\n")
    with pytest.raises(UsageError, match="multiples of the block"):
        load_model(bad)
    bad.write_text("name = [")
    with pytest.raises(UsageError, match="malformed"):
        load_model(bad)
    bad.write_text("name = 'x'\nhidden = 256\n")
    with pytest.raises(UsageError, match="malformed: missing field.s. experts, top_k, intermediate; required"):
        load_model(bad)
    bad.write_text(TINY + "colour = 1\n")
    with pytest.raises(UsageError, match="malformed: unknown field.s. colour; required .*optional eps, block"):
        load_model(bad)


TINY = "name = 'x'\nhidden = 256\nexperts = 32\ntop_k = 8\nintermediate = 1536\n"


@pytest.mark.parametrize("line, match", [
    # each field typed and in range at load, not a TypeError or a silent float in a rank later
    ("max_tokens = 2.5", "max_tokens = 2.5: need an integer >= 1"),
    ("hidden = 256.0", "hidden = 256.0: need an integer >= 1"),
    ("experts = true", "experts = True: need an integer >= 1"),
    ("top_k = 0", "top_k = 0: need an integer >= 1"),
    ("block = -128", "block = -128: need an integer >= 1"),
    ("intermediate = '1536'", "intermediate = '1536': need an integer >= 1"),
    ("name = 5", "name = 5: need a non-empty name"),
    ("name = ''", "name = '': need a non-empty name"),
    ("name = 'a/b'", "name = 'a/b': need a non-empty name of letters, digits, - or _"),
    ("eps = 'x'", "eps = 'x': need a finite number > 0"),
    ("eps = -1.0", "eps = -1.0: need a finite number > 0"),
    ("eps = 0", "eps = 0: need a finite number > 0"),
    ("eps = nan", "eps = nan: need a finite number > 0"),
    ("eps = inf", "eps = inf: need a finite number > 0"),
])
def test_model_fields_are_typed_and_ranged_at_load(tmp_path, line, match):
    bad = tmp_path / "m.toml"
    key = line.split(" ")[0]
    bad.write_text("".join(x + "\n" for x in TINY.splitlines() if not x.startswith(key + " ")) + line + "\n")
    with pytest.raises(UsageError, match=rf"^model config {re.escape(str(bad))}: {match}") as e:
        load_model(bad)
    assert "\n" not in str(e.value)


def test_model_file_not_utf8_or_int_eps(tmp_path):
    bad = tmp_path / "m.toml"
    bad.write_bytes(TINY.encode() + b"# caf\xe9\n")
    with pytest.raises(UsageError, match=r"m\.toml: malformed \('utf-8' codec"):
        load_model(bad)
    bad.write_text(TINY + "eps = 1\n")  # a whole number is still a number
    assert load_model(bad).eps == 1.0 and isinstance(load_model(bad).eps, float)


def test_build_key_and_layouts():
    m = load_model("tiny")
    with pytest.raises(UsageError, match="width 17: allowed 1..16"):
        FfnBuild(tokens=17, tp=2, model=m)
    key = FfnBuild(tokens=5, tp=2, model=m, blocks=4, timeline=True)
    assert kernel_name(key) == "ffn_tiny_s5_tp2_all_tl"
    lay = scratch_layout(key)
    assert lay["route"].shape == (5, 8) and lay["timeline"].shape == (4, len(stamp_names(2)))
    offs = sorted((r.offset, r.offset + r.nbytes) for r in lay.values())
    assert all(a[1] <= b[0] for a, b in zip(offs, offs[1:])), "regions overlap"
    assert all(r.offset % 128 == 0 for r in lay.values())
    peer = peer_layout(m, 2, 4)
    assert peer["flags"].shape == (len(Phase), 4, 2) and peer["seam"].shape == (2, 2, 16, 256)
    assert layout_bytes(peer) >= 2 * 2 * 2 * 16 * 256 * 2


def test_stamp_names_cover_every_phase_and_peer():
    names = stamp_names(3)
    for p in Phase:
        for r in range(3):
            assert f"{p.name.lower()}_seen{r}" in names
    assert names[0] == "start" and names[-1] == "end" and len(set(names)) == len(names)


def test_model_spec_validates():
    with pytest.raises(UsageError, match="top_k"):
        ModelSpec("x", 256, 4, 8, 256)
    with pytest.raises(UsageError, match=r"model x: hidden = 256\.0: need an integer >= 1"):
        ModelSpec("x", 256.0, 4, 2, 256)
