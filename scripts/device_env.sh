# Sourced first by every device script (gpu_round, dev_round, device_round, ncu_round, ab_bench):
# what everything they start on a lent machine needs.
# NVLink multicast off in NCCL, torch's symmetric memory and NVSHMEM: a program using it can put
# the host's shared GPUs out of service (the device library's KINDS.md); exported, so every
# torchrun worker and subprocess inherits it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# this tree's package first; unbuffered output, so a log cut short by a timeout keeps its last
# lines; matplotlib with no display
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MPLBACKEND=Agg
. "$(dirname "${BASH_SOURCE[0]}")/commit_guard.sh"
