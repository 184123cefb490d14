"""The two ways ffnq refuses: bad input (exit 2) and a rank that faulted (exit 1)."""
from __future__ import annotations


class UsageError(ValueError):
    """Bad input: one line naming the value and what is allowed. The CLI exits 2 on it."""


class RankFault(RuntimeError):
    """A bounded wait expired: the fault record names the missing rank(s)."""

    def __init__(self, record: dict):
        self.record = record
        missing = record.get("missing_ranks", [])
        super().__init__(
            f"rank {record.get('rank')} faulted in phase {record.get('phase_name')} at epoch "
            f"{record.get('epoch')}: waited {record.get('waited_ns', 0) / 1e6:.1f} ms for "
            f"rank(s) {', '.join(map(str, missing)) or '?'}"
        )
