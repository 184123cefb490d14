"""FFNQ_TRITON_TUNE: the development overrides of the Triton build's choices, parsed and checked.

"BN=32,NS=6" sets keys at every width; "KEY@w=v" sets KEY at width w only, over a plain "KEY=v".
The value is part of the compiled variant: the offline prewarm and the runner must see the same.
A key that no code reads is refused, named: a typo, or a key whose code was dropped (see
geometry.geometry's notes), would otherwise time the default build under another name.
"""
from __future__ import annotations

import os
import re

ENV = "FFNQ_TRITON_TUNE"

# every key geometry.geometry, geometry.constexprs, geometry.launch_options, geometry.max_scale and
# runner.blocks_for read (tests/test_triton_tune.py checks the source's reads against it)
KEYS = frozenset({
    "A8", "A8T", "BH", "BN", "CHK", "COOP", "CPS", "DQ", "EW", "F8", "FENCE", "FR", "FW", "HP", "JB", "KH", "KS",
    "KSFIX", "LL", "NS", "NS2", "NSS", "PDL", "PK", "PLR", "PRE", "PS", "R", "RPG", "RTOP", "SACC", "SOLO", "SORT", "SPS",
    "SQ", "SQ2", "X8T",
})
# G<w>: width w's grid; R<w>: its register cap (ptxas maxnreg; also R@w, or R at every width)
PER_WIDTH = re.compile(r"[GR][1-9]\d*")
_ENTRY = re.compile(r"([A-Z0-9]+)(?:@([1-9]\d*))?=(-?\d+)")


def parse(raw: str, tokens: int | None = None) -> dict[str, int]:
    """The keys of ``raw`` (with ``tokens``, its "KEY@tokens" entries over the plain ones, and
    "R<tokens>" as "R");
    ValueError, one line, on an entry that is not KEY=int or KEY@width=int or a key not read."""
    t: dict[str, int] = {}
    for item in (s.strip() for s in raw.split(",")):
        if not item:
            continue
        m = _ENTRY.fullmatch(item.replace(" ", ""))
        if not m:
            raise ValueError(f"{ENV} entry {item!r}: allowed KEY=integer or KEY@width=integer")
        key, width, value = m.groups()
        if key not in KEYS and not PER_WIDTH.fullmatch(key):
            raise ValueError(f"{ENV} key {key!r}: no build reads it; allowed {', '.join(sorted(KEYS))}, "
                             f"G<width> (grid) and R<width> (registers)")
        t[f"{key}@{width}" if width else key] = int(value)
    if tokens is not None:
        t.update({k.partition("@")[0]: v for k, v in t.items() if k.partition("@")[2] == str(tokens)})
        if f"R{tokens}" in t:  # the older spelling of R@tokens, over it
            t["R"] = t[f"R{tokens}"]
    return t


def read(tokens: int | None = None) -> dict[str, int]:
    """The environment's overrides (see parse)."""
    return parse(os.environ.get(ENV, ""), tokens)


def values(key: str) -> list[int]:
    """Every value the environment gives ``key``, plain or at any width (sizes that must hold
    every width's build, such as the peer buffer's flags)."""
    return [v for k, v in read().items() if k.partition("@")[0] == key]
