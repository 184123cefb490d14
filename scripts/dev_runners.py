"""Runner variants for kernel-development rounds (``ffnq bench --runner scripts.dev_runners:Triton256``
from the repo root); the shipped runner is ffnq.backends.triton.TritonRunner."""
from ffnq.backends.triton.runner import TritonRunner


class Triton256(TritonRunner):
    BLOCKS = 256


class Triton128(TritonRunner):
    BLOCKS = 128


class Triton264(TritonRunner):
    # every CTA slot of an H200 (132 SMs x 2): the default since v19
    BLOCKS = 264
