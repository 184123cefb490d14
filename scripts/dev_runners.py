"""Runner variants for kernel-development rounds (``ffnq bench --runner scripts.dev_runners:Triton256``
from the repo root); the shipped runner is ffnq.backends.triton.TritonRunner."""
from ffnq.backends.triton.runner import TritonRunner


class Triton256(TritonRunner):
    BLOCKS = 256
    GRID_FROM_DEVICE = False


class Triton128(TritonRunner):
    BLOCKS = 128
    GRID_FROM_DEVICE = False


class Triton264(TritonRunner):
    # every CTA slot of an H200 (132 SMs x 2): the default since v19
    BLOCKS = 264
    GRID_FROM_DEVICE = False


class Triton228(TritonRunner):
    # an H100 PCIe's grid (114 SMs x 2), run on an H200: the kernel at a grid of other devices
    BLOCKS = 228
    GRID_FROM_DEVICE = False


class Triton156(TritonRunner):
    # an H20's grid (78 SMs x 2): fewer CTAs than the 192 seam chunks of 16 columns
    BLOCKS = 156
    GRID_FROM_DEVICE = False
