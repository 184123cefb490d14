#!/bin/bash
# TP2's builds side by side on one GPU (no 2-GPU machine lent): [WIDTHS=3-8] scripts/proxy_round.sh VARIANT...
# where a variant is GRID[:TUNE]: GRID each rank's grid ("default": the device's SMs, one CTA per SM
# per rank, two per SM as on 2xH200; 198 on an H200: three per SM, as a CPS=3 build), TUNE as
# FFNQ_TRITON_TUNE (ffnq/backends/triton/tune.py). Per variant, in the order given (list one twice to
# alternate): scripts/tp2_one_gpu.py's checks at WIDTHS (default 1-16), then those widths' paired step
# timed with cold weights. The step times are a proxy (two ranks share one HBM and L2, each with twice
# a real rank's items per CTA): compare variants of one call, never against a 2xH200 figure. Nor is
# each build the shipped one: at half the grid each CTA holds twice the router's and seam's share, so
# more registers (TP2's 2-6 tokens spill 4-656 B at a grid of 132, nothing at 264; device round 83).
# Each timed line names its build's registers and spills: where the proxy's build spills and the
# shipped one does not (offline --blocks), the comparison times the spill, not the choice.
# PROXY=solo times scripts/tp2_solo.py instead: rank 0's TP2 build alone on the whole GPU at its shipped
# grid ("default"; GRID as --blocks otherwise), its exchanges the identity (SOLO=2): the shipped builds
# and a whole HBM, without the links' cost (about the same for every variant).
# PROFILE=1,16 (solo only) also profiles those widths' timeline builds (tp2_solo.py --profile): per phase
# the median over CTAs and each phase's latest CTA, as a 2xH200 dev round's profile, links aside.
# FLOOR=1 (solo only) counts the bytes (tp2_solo.py --floor): the HBM read rate, each timed width's step
# over its experts' read time, each profiled width's expert phase as TB/s.
# Logs in $OUT/proxy.log, this call's report folders in $OUT/proxy-reports.tgz (the device tool brings back
# 8 files).
set -o pipefail
. "$(dirname "$0")/device_env.sh"
. "$(dirname "$0")/variant.sh"
OUT=${OUT:-/tmp/ffnq-out}
R=$PWD/reports-proxy/$(date -u +%Y%m%dT%H%M%S)  # this call's own: two calls in one device command pack apart
mkdir -p "$OUT" "$R"
T0=$(date +%s)
W=${WIDTHS:-1-16}
{
nvidia-smi -L
echo "widths=$W commit=${FFNQ_COMMIT:-?}"
SMS=$(python3 -c 'import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)')
SCRIPT=scripts/tp2_one_gpu.py DEF=$SMS
[ "${PROXY:-pair}" = solo ] && SCRIPT=scripts/tp2_solo.py DEF=0  # 0: the shipped grid
[ -n "$PROFILE$FLOOR" ] && [ "${PROXY:-pair}" != solo ] && { echo "PROFILE, FLOOR: the solo proxy only (PROXY=solo)"; exit 2; }
echo "proxy=${PROXY:-pair} ($SCRIPT)"
grid() { [ "$1" = default ] && echo "$DEF" || echo "$1"; }
declare -A SEEN  # a variant listed twice is compiled once
for v in "$@"; do
  [ -n "${SEEN[$v]}" ] && continue; SEEN[$v]=1
  b=$(variant_base "$v"); t=$(variant_tune "$v")
  [ "${PROXY:-pair}" = solo ] && t="${t:+$t,}SOLO=2"  # the build tp2_solo.py launches
  ( export FFNQ_TRITON_TUNE=$t; python3 -m ffnq.backends.triton.offline --target sm_90 --final both --model minimax-m2 \
      --tp 2 --widths "$W" --blocks "$(grid "$b")" --jobs 8 | tail -n 1
    [ -n "$PROFILE" ] && python3 -m ffnq.backends.triton.offline --target sm_90 --model minimax-m2 --tp 2 \
      --widths "$PROFILE" --timeline --blocks "$(grid "$b")" --jobs 4 | tail -n 1 ) &
done
wait
echo "=== prewarm done at +$(( $(date +%s) - T0 ))s"
for v in "$@"; do
  b=$(variant_base "$v"); export FFNQ_TRITON_TUNE=$(variant_tune "$v")
  echo "=== variant $v at +$(( $(date +%s) - T0 ))s"
  timeout -k 5 240 python3 "$SCRIPT" --widths "$W" --time "$W" ${PROFILE:+--profile $PROFILE} ${FLOOR:+--floor} \
    --blocks "$(grid "$b")" --out "$R" 2>&1 | grep -E "timed|bytes w=|floor:|profile w=|PASS|FAIL|rror|resident|fit"
  tar czf "$OUT/proxy-reports.tgz" -C "$R" .  # after each variant: a call cut short keeps them
done
echo "proxy round total $(( $(date +%s) - T0 ))s"
} 2>&1 | tee "$OUT/proxy.log"
