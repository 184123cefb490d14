"""Runner variants for kernel-development rounds (``ffnq bench --runner scripts.dev_runners:Triton256``
from the repo root); the shipped runner is ffnq.backends.triton.TritonRunner, whose grid follows
the GPU (2 CTAs per SM). Each of these keeps its own grid: 264 = an H200's or H100 SXM's (the
default there since v19), 228 = an H100 PCIe's, 156 = an H20's (fewer CTAs than the seam's 192
chunks of 16 columns), 256 and 128 = earlier defaults."""
from ffnq.backends.triton.runner import TritonRunner

for _blocks in (128, 156, 228, 256, 264):
    globals()[f"Triton{_blocks}"] = type(f"Triton{_blocks}", (TritonRunner,),
                                         {"BLOCKS": _blocks, "GRID_FROM_DEVICE": False})
