"""Residency of a persistent grid: static occupancy formulas (sm_90, CDNA3 gfx942, CDNA4 gfx950)
from a compiled kernel's resources, and the live query through the driver.

Static sm_90 (H100/H200; constants from NVIDIA CCCL arch_traits for sm_90): 64 Ki registers per
SM and per block, 255 per thread, allocation unit 256 registers per warp, warp allocation
granularity 4, 2048 threads and 32 blocks per SM, 228 KiB shared memory per SM with 1 KiB
reserved per block, allocation unit 128 B.

Static CDNA (wave64, 4 SIMDs per CU, at most 8 waves per SIMD, 512 unified VGPR+AGPR per lane,
granule 8, AGPRs start at a 4-aligned offset; LDS 64 KiB per CU on gfx942, 160 KiB on gfx950).
Triton's LDS is dynamic (``metadata.shared``): LLVM's ``; Occupancy`` ignores it, we add it.
"""
from __future__ import annotations

import ctypes
import math

CUS = {"sm_90": 132, "gfx942": 304, "gfx950": 256}  # H200, MI300X, MI355X
LDS_PER_CU = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}


def occupancy_sm90(n_regs: int, dyn_smem: int, threads: int, static_smem: int = 0) -> tuple[int, dict]:
    """Max resident CTAs per SM on sm_90, and the limit of each resource."""
    warps = math.ceil(threads / 32)
    regs_warp = math.ceil(max(n_regs, 1) * 32 / 256) * 256
    if regs_warp * warps > 65536 or n_regs > 255:
        return 0, {"regs": 0}
    by_regs = ((65536 // regs_warp) // 4 * 4) // warps
    smem = math.ceil((static_smem + dyn_smem + 1024) / 128) * 128
    by_smem = (228 * 1024) // smem
    by_threads = 2048 // (warps * 32)
    lim = {"regs": by_regs, "smem": by_smem, "threads": by_threads, "blocks": 32}
    return min(lim.values()), lim


def occupancy_cdna(vgpr: int, agpr: int, num_warps: int, lds: int, arch: str = "gfx942",
                   llvm_occupancy: int | None = None) -> tuple[int, dict]:
    """Max resident workgroups per CU on gfx942/gfx950 (``num_warps`` wave64 waves per WG)."""
    total = (math.ceil(vgpr / 4) * 4 + agpr) if agpr else vgpr
    total = max(8, math.ceil(total / 8) * 8)
    if total > 512:
        return 0, {"vgpr": 0}
    waves_simd = min(8, 512 // total)
    if llvm_occupancy:  # LLVM's figure also counts SGPRs and scratch; never above ours
        waves_simd = min(waves_simd, llvm_occupancy)
    per_simd = math.ceil(num_warps / 4)
    by_vgpr = waves_simd // per_simd
    by_lds = LDS_PER_CU.get(arch, 64 * 1024) // lds if lds else 10**6
    by_waves = (8 * 4) // num_warps  # 32 waves per CU
    lim = {"vgpr": by_vgpr, "lds": by_lds, "waves": by_waves}
    return min(lim.values()), lim


def check(kernel: str, per_cu: int, cus: int, grid: int) -> None:
    """Raise when the grid cannot be co-resident (a persistent kernel would hang or be refused)."""
    if per_cu * cus < grid:
        raise RuntimeError(f"kernel {kernel}: grid of {grid} CTAs cannot be resident: {per_cu} CTAs per SM/CU "
                           f"x {cus} SMs/CUs = {per_cu * cus}")


# ---- live query -------------------------------------------------------------------------------
def _ctypes_occupancy(lib: str, name: str, function: int, threads: int, shared: int) -> int:
    n = ctypes.c_int(0)
    err = getattr(ctypes.CDLL(lib), name)(ctypes.byref(n), ctypes.c_void_p(function), ctypes.c_int(threads),
                                          ctypes.c_size_t(shared))
    if err:
        raise RuntimeError(f"{name} failed: {err}")
    return n.value


def live_ctas_per_cu(function: int, threads: int, shared: int, hip: bool = False) -> int:
    """The driver's cuOccupancyMaxActiveBlocksPerMultiprocessor (or the HIP module variant) for a
    loaded kernel handle (Triton's ``CompiledKernel.function`` after ``_init_handles``)."""
    if hip:
        return _ctypes_occupancy("libamdhip64.so", "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor", function,
                                 threads, shared)
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        cu = None
    if cu is not None:
        err, n = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(cu.CUfunction(function), threads, shared)
        if int(err) != 0:
            raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed: {err}")
        return int(n)
    return _ctypes_occupancy("libcuda.so.1", "cuOccupancyMaxActiveBlocksPerMultiprocessor", function, threads,
                             shared)
