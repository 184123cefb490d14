"""Runners that fail before any step: their construction or warm-up raises. ffnq must refuse
them as bad input (exit 2, one line naming the runner), not end a job that ran (exit 1)."""
from ffnq.backends.cpu import CpuRunner


class InitRaises(CpuRunner):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("no device context for this build")


class WarmRaises(CpuRunner):
    def warm(self, weights, compute_units=None):
        raise ValueError("kernel image failed to load\nsecond line of a long driver log")
