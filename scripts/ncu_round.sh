#!/bin/bash
# Nsight Compute on one launch of the fused kernel at TP1 (one GPU, so no peer waits under the
# profiler's replay): memory throughput, warp states and the per-instruction stall samples, to
# see where a CTA's time goes inside a phase. scripts/ncu_round.sh WIDTH... (minimax-m2, Experts
# ALL) -> $OUT/ncu.tgz: per width the details page, the SASS table with its source lines and its
# summary (scripts/ncu_summary.py: stall mix overall and per loop body, hottest instructions).
set -o pipefail
. "$(dirname "$0")/device_env.sh"
OUT=${OUT:-/tmp/ffnq-out}
D=$OUT/ncu
mkdir -p "$D"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
T0=$(date +%s)
for s in "$@"; do
  echo "=== ncu width $s at +$(( $(date +%s) - T0 ))s"
  timeout -k 5 150 "$NCU" --clock-control none -k regex:ffn_kernel --launch-count 1 --import-source yes \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SourceCounters --section LaunchStats --section Occupancy \
    -f -o "$D/w$s" python3 scripts/triton_check.py --model minimax-m2 --widths "$s" 2>&1 | tail -n 5
  "$NCU" -i "$D/w$s.ncu-rep" --page details > "$D/w$s-details.txt" 2>&1
  "$NCU" -i "$D/w$s.ncu-rep" --page source --csv --print-source sass > "$D/w$s-sass.csv" 2>&1
  "$NCU" -i "$D/w$s.ncu-rep" --page source --csv --print-source cuda > "$D/w$s-src.csv" 2>&1
  python3 scripts/ncu_summary.py "$D/w$s-sass.csv" > "$D/w$s-stalls.txt" 2>&1 && head -n 4 "$D/w$s-stalls.txt"
  ls -la "$D" | tail -n 4
done
rm -f "$D"/*.ncu-rep
tar czf "$OUT/ncu.tgz" -C "$OUT" ncu
