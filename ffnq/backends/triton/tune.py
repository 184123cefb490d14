"""FFNQ_TRITON_TUNE: overrides of the Triton build's choices, parsed and checked.

"UP_TILE=32,UP_STAGES=6" sets keys at every width; "KEY@w=v" sets KEY at width w only, over a
plain "KEY=v". Every key is a build key of the kernel (kernel.py's docstring has the table). The
value is part of the compiled variant: ``ffnq warm --target`` and the runner must see the same.
A key that no code reads is refused, named: a typo would otherwise time the default build under
another name. The short names of earlier releases (BN, KS, CPS, G<w>, R<w> ...) are accepted and
read as the names they stand for (ALIASES).
"""
from __future__ import annotations

import os
import re

ENV = "FFNQ_TRITON_TUNE"

# every key geometry.geometry, geometry.constexprs, geometry.launch_options, geometry.max_scale and
# runner.blocks_for read (tests/test_triton_tune.py checks the source's reads against it)
KEYS = frozenset({
    "COOPERATIVE", "CTAS_PER_SM", "DOWN_ACT_TERMS", "DOWN_FP8", "DOWN_KSPLIT", "DOWN_MIN_COLS", "DOWN_STAGES",
    "DOWN_TILE", "EARLY_FAULT_WORDS", "EARLY_HEADER", "EARLY_SEAM_READS", "EARLY_WEIGHTS", "FENCE", "FP8_X",
    "FULL_ROWS", "GRID", "LOGIT_FMA_ROWS", "MAXNREG", "PACKED_W13", "PACKED_W2", "PDL", "POLLS_PER_CLOCK", "ROW_PICK_FROM",
    "ROW_PICK_MAX_CTAS", "SCALE_ON_PRODUCT", "SOLO", "SORT_TOPK", "SUM_AS_DONE", "SUM_BATCH", "SUM_OWN_SLOTS",
    "TAGGED_WORDS", "UP_KSPLIT", "UP_KSPLIT_FIXUP", "UP_NARROW_FROM", "UP_STAGES", "UP_STAGES_NARROW",
    "UP_TILE", "W2_PACK_ROWS", "WORK_QUEUE", "X_TERMS",
})
# the earlier short names, read as the keys they stand for
ALIASES = {
    "A8": "DOWN_FP8", "A8T": "DOWN_ACT_TERMS", "BH": "DOWN_TILE", "BN": "UP_TILE", "CHK": "POLLS_PER_CLOCK",
    "COOP": "COOPERATIVE", "CPS": "CTAS_PER_SM", "DQ": "WORK_QUEUE", "EW": "EARLY_WEIGHTS", "F8": "FP8_X",
    "FR": "FULL_ROWS", "FW": "EARLY_FAULT_WORDS", "HP": "EARLY_HEADER", "JB": "SUM_BATCH", "KH": "DOWN_KSPLIT",
    "KS": "UP_KSPLIT", "KSFIX": "UP_KSPLIT_FIXUP", "LL": "TAGGED_WORDS", "NS": "UP_STAGES", "NS2": "DOWN_STAGES",
    "NSS": "UP_STAGES_NARROW", "PK": "PACKED_W13", "PLR": "LOGIT_FMA_ROWS", "PRE": "EARLY_SEAM_READS",
    "PS": "SUM_AS_DONE", "R": "MAXNREG", "RPG": "ROW_PICK_MAX_CTAS", "RTOP": "ROW_PICK_FROM",
    "SACC": "SCALE_ON_PRODUCT", "SORT": "SORT_TOPK", "SPS": "SUM_OWN_SLOTS", "SQ": "UP_NARROW_FROM",
    "SQ2": "DOWN_MIN_COLS", "X8T": "X_TERMS",
}
# the earlier per-width spellings: G<w> (GRID@w) and R<w> (MAXNREG@w)
_PER_WIDTH = re.compile(r"([GR])([1-9]\d*)")
_ENTRY = re.compile(r"([A-Z][A-Z0-9_]*)(?:@([1-9]\d*))?=(-?\d+)")


def parse(raw: str, tokens: int | None = None) -> dict[str, int]:
    """The keys of ``raw`` (with ``tokens``, its "KEY@tokens" entries over the plain ones);
    ValueError, one line, on an entry that is not KEY=int or KEY@width=int or a key not read."""
    t: dict[str, int] = {}
    for item in (s.strip() for s in raw.split(",")):
        if not item:
            continue
        m = _ENTRY.fullmatch(item.replace(" ", ""))
        if not m:
            raise ValueError(f"{ENV} entry {item!r}: allowed KEY=integer or KEY@width=integer")
        key, width, value = m.groups()
        old = _PER_WIDTH.fullmatch(key)
        if old and not width:
            key, width = {"G": "GRID", "R": "MAXNREG"}[old[1]], old[2]
        key = ALIASES.get(key, key)
        if key not in KEYS:
            raise ValueError(f"{ENV} key {m[1]!r}: no build reads it; allowed {', '.join(sorted(KEYS))}")
        t[f"{key}@{width}" if width else key] = int(value)
    if tokens is not None:
        t.update({k.partition("@")[0]: v for k, v in t.items() if k.partition("@")[2] == str(tokens)})
    return t


def read(tokens: int | None = None) -> dict[str, int]:
    """The environment's overrides (see parse)."""
    return parse(os.environ.get(ENV, ""), tokens)


def values(key: str) -> list[int]:
    """Every value the environment gives ``key``, plain or at any width (sizes that must hold
    every width's build, such as the peer buffer's flags)."""
    return [v for k, v in read().items() if k.partition("@")[0] == key]
