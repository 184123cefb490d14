"""The FlyDSL backend (AMD gfx942 / gfx950): the fused persistent kernel written in FlyDSL.

Verified here, with no AMD GPU: offline compile of every width for gfx942 and gfx950 and static
residency (offline.py). Execution and numerics need an AMD GPU; the runner refuses without one.
"""
from ffnq.backends.flydsl.runner import FlydslRunner

__all__ = ["FlydslRunner"]
