"""Runner variants for kernel-development rounds (``ffnq bench --runner scripts.dev_runners:Triton256``
from the repo root); the shipped runner is ffnq.backends.triton.TritonRunner."""
from ffnq.backends.triton.runner import TritonRunner


class Triton256(TritonRunner):
    BLOCKS = 256  # 2 CTAs per SM on an H200 (132 SMs): twice the warps streaming weights
