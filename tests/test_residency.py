"""Static residency formulas: CTAs per SM (sm_90) and workgroups per CU (CDNA) from registers,
shared memory and threads, and the refusal of a grid that cannot be resident."""
import pytest

from ffnq import residency


def test_static_formulas():
    # sm_90: 255 regs x 128 threads -> 2 CTAs/SM; 64 regs -> 8 by registers (16 by threads)
    assert residency.occupancy_sm90(255, 0, 128)[0] == 2
    assert residency.occupancy_sm90(64, 0, 128)[0] == 8
    assert residency.occupancy_sm90(32, 200 * 1024, 128)[0] == 1  # shared memory bound
    # CDNA: 128 VGPRs -> 4 waves/SIMD; a 4-wave WG takes one wave per SIMD -> 4 WGs/CU
    assert residency.occupancy_cdna(128, 0, 4, 0)[0] == 4
    assert residency.occupancy_cdna(128, 0, 4, 40 * 1024, "gfx942")[0] == 1  # LDS bound on 64 KiB
    assert residency.occupancy_cdna(128, 0, 4, 40 * 1024, "gfx950")[0] == 4
    with pytest.raises(RuntimeError, match="cannot be resident"):
        residency.check("k", 0, 132, 128)
