#!/bin/bash
# One device round of the Triton backend. Usage (repo root): scripts/device_round.sh tp1|tp2|debug [extra args]
#   tp1: 1 GPU, tiny + minimax-m2, widths 1..16, correctness + CUDA-graph timing.
#   tp2: 2 GPUs (torchrun), the same plus Experts local/none on tiny and injection under/over the timeout.
#   debug: 2 GPUs: compute-sanitizer on a TP1 run, then the TP2 injection cases with launch blocking.
# Triton's cache is filled first by parallel CPU-only compiles (ffnq.backends.triton.offline): same
# cache key as a launch, so warm() then only loads.
set -o pipefail
. "$(dirname "$0")/device_env.sh"
export OUT=${OUT:-/tmp/ffnq-out}
mkdir -p "$OUT"
MODE=${1:-tp1}; shift || true
PY=${PY:-python3}
nvidia-smi -L
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
T0=$(date +%s)
pre() { timeout 300 $PY -m ffnq.backends.triton.offline --target sm_90 --final both "$@" > "$OUT/prewarm_$(echo "$@" | tr ' ,' '__').log" 2>&1; }
if [ "$MODE" = debug ]; then
  # compute-sanitizer on TP1, then TP2 with launch blocking and per-step progress (FFNQ_VERBOSE)
  pre --model minimax-m2 --tp 1 --widths 1,4 --jobs 4 & pre --model tiny --tp 2 --widths 4 --jobs 2 &
  pre --model tiny --tp 2 --timeline --widths 4 --jobs 2 & wait
  timeout 200 compute-sanitizer --tool memcheck --print-limit 20 $PY scripts/triton_device.py --models minimax-m2 \
    --widths 1,4 --bench "" 2>&1 | grep -v "Host Frame" | tail -60
  CUDA_LAUNCH_BLOCKING=1 FFNQ_VERBOSE=1 timeout 120 $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
    scripts/triton_device.py --models tiny --widths 4 --bench "" --inject 2>&1 | grep -v "frame #" | tail -80
elif [ "$MODE" = tp1 ]; then
  pre --model tiny --tp 1 --jobs 5 & pre --model minimax-m2 --tp 1 --jobs 9 &
  pre --model minimax-m2 --tp 1 --timeline --widths 1,16 --jobs 2 & wait
  echo "prewarm $(( $(date +%s) - T0 ))s"; tail -n 2 "$OUT"/prewarm_*.log
  timeout 420 $PY scripts/triton_device.py --models tiny,minimax-m2 --profile 1,16 "$@" 2>&1 | tee "$OUT/tp1.log"
else
  pre --model tiny --tp 2 --jobs 4 & pre --model minimax-m2 --tp 2 --jobs 8 &
  pre --model tiny --tp 2 --experts local --widths 1-16 --jobs 2 & pre --model tiny --tp 2 --experts none --jobs 2 &
  pre --model tiny --tp 2 --timeline --widths 4 --jobs 1 & pre --model minimax-m2 --tp 2 --timeline --widths 1,16 --jobs 2 &
  wait
  echo "prewarm $(( $(date +%s) - T0 ))s"; tail -q -n 1 "$OUT"/prewarm_*.log
  RUN="$PY -m torch.distributed.run --standalone --nproc-per-node 2"
  timeout 300 $RUN scripts/triton_device.py --models tiny --experts all,local,none --inject "$@" 2>&1 | tee "$OUT/tp2_tiny.log"
  timeout 300 $RUN scripts/triton_device.py --models minimax-m2 --experts all --profile 1,16 "$@" 2>&1 | tee "$OUT/tp2_m2.log"
fi
echo "device_round $MODE total $(( $(date +%s) - T0 ))s"
