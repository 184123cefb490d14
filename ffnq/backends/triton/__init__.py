"""The Triton backend: one fused, persistent kernel per width (sm_90; gfx942/gfx950 from the same source)."""
from ffnq.backends.triton.runner import TritonRunner

__all__ = ["TritonRunner"]
