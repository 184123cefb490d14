#!/bin/bash
# One device round through the real CLI: scripts/gpu_round.sh STEP... (run from the repo root on
# the device machine, by the device tool). Steps run in order, each under its own time limit;
# a failing step does not stop the next. This round's report folders land in $OUT/reports.tgz (one
# file, since the tool brings back at most 8, 16 MiB each: the committed reports/ is larger), logs
# in $OUT/round.log.
#   prewarm (both) prewarm1 prewarm2   fill Triton's cache for TP1/TP2 minimax-m2 with parallel CPU compiles
#   warm2 qualify2 bench2 soak2 gate2   TP2 on 2 GPUs      warm1 qualify1 bench1 soak1 gate1   TP1
#   bench1c   TP1 bench timed in one window per width (--burst-ms 0), the method before bursts
#   vllm2 vllm2s   TP2 bench beside (b) and (d) = (b) with vLLM's fused_moe kernel (default / small-M config)
#   tp2on1   TP2's builds on one GPU (both ranks in one process, half the grid each: scripts/tp2_one_gpu.py;
#            TP2_TIME=1,4,16 also times those widths there, a side-by-side proxy)
#   ckpt1    --checkpoint on one GPU: a synthetic two-layer MiniMax-M2 checkpoint, TP1 qualify and bench on it
#   SOAK_STEPS (default 100000) sets the soak's length
set -o pipefail
. "$(dirname "$0")/device_env.sh"
OUT=${OUT:-/tmp/ffnq-out}
R=$PWD/reports
mkdir -p "$OUT" "$R"
STAMP=$(mktemp)  # the report folders newer than this are this round's
pack() { find reports -mindepth 1 -maxdepth 1 -newer "$STAMP" -print0 | tar czf "$OUT/reports.tgz" --null -T -; }
FF="python3 -m ffnq.cli"
M="--backend triton --model minimax-m2"
T0=$(date +%s)
step() {  # step NAME LIMIT_S CMD...
  local name=$1 lim=$2; shift 2
  local t=$(date +%s)
  echo "=== $name (limit ${lim}s) at +$(( t - T0 ))s: $*"
  timeout -k 10 "$lim" "$@"
  echo "=== $name rc=$? in $(( $(date +%s) - t ))s"
  pack  # after every step: a round cut short keeps what finished
}
{
nvidia-smi -L
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
# the code that runs is FFNQ_COMMIT (the reports record it); the device copy's .git may be older
echo "commit ${FFNQ_COMMIT:-unset} (FFNQ_COMMIT); the device copy's git HEAD: $(git log -1 --format='%h %s' 2>/dev/null)"
echo "FFNQ_TRITON_TUNE=${FFNQ_TRITON_TUNE:-(unset: the default build)}"
for s in "$@"; do
  case $s in
    prewarm) step $s 150 bash -c "python3 -m ffnq.backends.triton.offline --target sm_90 --final both --model minimax-m2 --tp 1 --jobs 8 & python3 -m ffnq.backends.triton.offline --target sm_90 --final both --model minimax-m2 --tp 2 --jobs 8; wait" ;;
    prewarm1) step $s 120 python3 -m ffnq.backends.triton.offline --target sm_90 --final both --model minimax-m2 --tp 1 --jobs 14 ;;
    prewarm2) step $s 120 python3 -m ffnq.backends.triton.offline --target sm_90 --final both --model minimax-m2 --tp 2 --jobs 14 ;;
    warm1) step $s 120 $FF warm $M --tp 1 --out "$R" ;;
    warm2) step $s 120 $FF warm $M --tp 2 --out "$R" ;;
    qualify1) step $s 240 $FF qualify $M --tp 1 --inject-rank all --out "$R" ;;
    qualify2) step $s 240 $FF qualify $M --tp 2 --inject-rank all --out "$R" ;;
    bench1) step $s 150 $FF bench $M --tp 1 --widths 1-16 --rep-ms 300 --out "$R" ;;
    bench1c) step $s 150 $FF bench $M --tp 1 --widths 1-16 --rep-ms 300 --burst-ms 0 --out "$R" ;;  # one window, as before 2026-12-04
    bench2) step $s 200 $FF bench $M --tp 2 --widths 1-16 --rep-ms 300 --out "$R" ;;
    soak1) step $s 320 $FF soak $M --tp 1 --steps ${SOAK_STEPS:-100000} --widths 1-16 --random-padding --runners 2 --deadline 300 --out "$R" ;;
    soak2) step $s 320 $FF soak $M --tp 2 --steps ${SOAK_STEPS:-100000} --widths 1-16 --random-padding --runners 2 --deadline 300 --out "$R" ;;
    gate1)  # the config whose budgets were measured on this GPU model (each refuses another: exit 2)
      case $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1) in
        *H100*) G=configs/gates/h100-tp1.toml ;;
        *) G=configs/gates/h200-tp1.toml ;;
      esac
      step $s 300 $FF gate $G --out "$R" ;;
    vllm2|vllm2s)  # baseline (d): vLLM's fused_moe from third_party/ (git-ignored; carry it); vllm2s: small-M config
      [ $s = vllm2s ] && export FFNQ_VLLM_MOE_CONFIG='{"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "GROUP_SIZE_M": 1, "num_stages": 4}'
      export FFNQ_VLLM_MOE=$PWD/third_party/vllm_fused_moe_kernel.py
      step $s 150 $FF bench $M --tp 2 --widths 1,2,4,8,16 --rep-ms 300 --baselines unfused,vllm --out "$R"
      unset FFNQ_VLLM_MOE FFNQ_VLLM_MOE_CONFIG ;;
    gate2) step $s 300 $FF gate configs/gates/h200x2-tp2.toml --out "$R" ;;
    tp2on1) step $s 240 bash -c "python3 -m ffnq.backends.triton.offline --target sm_90 --final both --model minimax-m2 --tp 2 --blocks \$(python3 -c 'import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)') --jobs 14 | tail -n 1 && python3 scripts/tp2_one_gpu.py --out $R ${TP2_TIME:+--time $TP2_TIME}" ;;
    ckpt1)  # --checkpoint on the GPU: two synthetic layers written as a MiniMax-M2 checkpoint, then TP1
      # qualify and bench on them, and bench on synthetic weights beside (same builds, other weights)
      CK=/tmp/ffnq-ckpt-m2
      step $s-write 300 python3 -c "from ffnq.spec import load_model; from ffnq.weights import save_checkpoint, synthetic; \
m = load_model('minimax-m2'); save_checkpoint('$CK', {l: synthetic(m, 100 + l, 'cuda') for l in (5, 6)}, m)"
      step $s-qualify 240 $FF qualify $M --tp 1 --checkpoint $CK --checkpoint-layer 6 --widths 1,4,16 --out "$R"
      step $s-bench 200 $FF bench $M --tp 1 --checkpoint $CK --widths 1,4,16 --rep-ms 300 --out "$R"
      step $s-synthetic 150 $FF bench $M --tp 1 --widths 1,4,16 --rep-ms 300 --out "$R" ;;
    *) echo "unknown step $s" ;;
  esac
done
echo "round total $(( $(date +%s) - T0 ))s"
} 2>&1 | tee "$OUT/round.log"
pack
