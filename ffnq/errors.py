"""How ffnq refuses or stops: bad input (exit 2), a rank that faulted (exit 1), a signal (128 + it)."""
from __future__ import annotations

import signal


SHOWN_CHARS = 60  # a value quoted in an error message: one line, at most this long


def cut(text: str, n: int = SHOWN_CHARS) -> str:
    """``text`` on one line, cut to ``n`` characters with '...' (an error message quotes a user's
    value, not 40,000 characters of it)."""
    text = str(text).replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= n else text[: n - 3] + "..."


def shown(value, n: int = SHOWN_CHARS) -> str:
    """A user's value as an error message quotes it: its repr, one line, cut to ``n``."""
    return cut(repr(value), n)


def with_use(what: str, use: str | None) -> str:
    """A bad-input line as the user reads it: ``what``, then "(use FLAG)" where a flag is named."""
    return f"{what} (use {use})" if use else what


class UsageError(ValueError):
    """Bad input: one line naming the value and what is allowed. The CLI exits 2 on it. ``use``: the
    flag to change, said after the line as "(use --backend cpu)"; ``what`` is the line without it
    (a gate's job names its config's value, not a flag)."""

    def __init__(self, what: str, use: str | None = None):
        self.what, self.use = what, use
        super().__init__(with_use(what, use))


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


class Stopped(SystemExit):
    """SIGTERM or SIGHUP while a job ran: exit 128 + the signal, once the ranks are ended.
    ``where``: how long the job ran and where each rank was (launch fills it in), so a CI job's
    ``timeout`` says whether the job hung in set-up, in a compile or was merely slow."""

    def __init__(self, sig: int):
        self.name = signal.Signals(sig).name
        self.where = ""
        super().__init__(128 + sig)

    @property
    def message(self) -> str:
        return f"stopped by {self.name}" + (f" {self.where}" if self.where else "") + ": the job's ranks were ended"
