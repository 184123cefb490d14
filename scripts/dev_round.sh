#!/bin/bash
# One kernel-development round: [TP=1] scripts/dev_round.sh VARIANT... (TP 2 by default: 2 GPUs) where a variant is
# default, 128 or 256, optionally :TUNE (e.g. default 256 128:NS=6,DQ=1; TUNE as FFNQ_TRITON_TUNE, see ffnq/backends/triton/tune.py).
# Per variant: prewarm Triton's cache (parallel CPU compiles), TP minimax-m2 correctness at
# widths 1..16 + the in-kernel phase profile (scripts/triton_device.py), then `ffnq bench` at
# widths 1,2,4,8,16 (cold weights, floor and baselines in the same run). FFNQ_TRITON_TUNE (see
# ffnq/backends/triton/tune.py) passes through. Logs in $OUT/dev.log, bench reports in $OUT/dev-reports.tgz
# (not reports.tgz: gpu_round.sh writes that one, and a call may run both). WIDTHS overrides the
# bench widths, PROFILE the profiled ones.
set -o pipefail
. "$(dirname "$0")/device_env.sh"
. "$(dirname "$0")/variant.sh"
OUT=${OUT:-/tmp/ffnq-out}
R=$PWD/reports-dev
mkdir -p "$OUT" "$R"
T0=$(date +%s)
# a variant's check log: its name made safe, and short (a whole candidate tune is ~400 characters,
# over a file name's 255), with a hash of the whole so two long variants keep two logs
log_name() { local n=${1//[^A-Za-z0-9]/_}; echo "check-${n:0:60}-$(echo -n "$1" | md5sum | cut -c1-8).log"; }
TP=${TP:-2}
PROFILE=${PROFILE:-1,4,16}  # the widths profiled: their timeline builds are prewarmed too
RUN="python3 -m torch.distributed.run --standalone --nproc-per-node $TP"
PRE="python3 -m ffnq.backends.triton.offline --target sm_90 --model minimax-m2 --tp $TP"
{
nvidia-smi -L
echo "tp=$TP tune=${FFNQ_TRITON_TUNE:-default} commit=${FFNQ_COMMIT:-?}"
declare -A SEEN  # a variant listed twice (alternating runs) is compiled once
for v in "$@"; do
  [ -n "${SEEN[$v]}" ] && continue; SEEN[$v]=1
  b=$(variant_base "$v"); t=$(variant_tune "$v")
  B=$([ "$b" = default ] || echo "--blocks $b")
  ( export FFNQ_TRITON_TUNE=$t; $PRE --final both $B --jobs 8 | tail -n 3 ) &
  ( export FFNQ_TRITON_TUNE=$t; $PRE --final both $B --timeline --widths $PROFILE --jobs 4 | tail -n 1 ) &
done
wait
echo "=== prewarm done at +$(( $(date +%s) - T0 ))s"
for v in "$@"; do
  b=$(variant_base "$v"); export FFNQ_TRITON_TUNE=$(variant_tune "$v")
  echo "=== variant $v check+profile at +$(( $(date +%s) - T0 ))s"
  B=$([ "$b" = default ] || echo "--blocks $b")
  # the whole check in its own file (a tail of a killed run keeps only torchrun's traceback)
  timeout -k 5 150 $RUN scripts/triton_device.py --models minimax-m2 --bench "" --profile $PROFILE $B 2>&1 \
    | grep -v "^\s*$" | tee "$OUT/$(log_name "$v")" | tail -n 30
  [ "$b" = default ] && RN="--backend triton" || RN="--runner scripts.dev_runners:Triton$b"
  echo "=== variant $v bench at +$(( $(date +%s) - T0 ))s"
  timeout -k 5 150 python3 -m ffnq.cli bench $RN --model minimax-m2 --tp $TP --widths ${WIDTHS:-1,2,4,8,16} --rep-ms 200 \
    --out "$R" 2>&1 | tail -n 26  # the whole table at 16 widths
  tar czf "$OUT/dev-reports.tgz" -C "$PWD" reports-dev  # after each variant: a call cut short keeps them
done
echo "dev round total $(( $(date +%s) - T0 ))s"
} 2>&1 | tee "$OUT/dev.log"
