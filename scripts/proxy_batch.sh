#!/bin/bash
# Several proxy rounds in one device call (a warm machine goes back after 30 s idle, and each start
# costs a minute or more): scripts/proxy_batch.sh GROUP...
# A GROUP is one string, "[VAR=value ...] VARIANT...": its leading VAR=value words (PROXY, WIDTHS)
# are scripts/proxy_round.sh's environment, the rest its variants, e.g.
#   scripts/proxy_batch.sh "PROXY=solo WIDTHS=1,2 default default:FR=1 default default:FR=1" \
#                          "WIDTHS=3 198 198:KH=2,R=168 198 198:KH=2,R=168"
# The groups run in turn, one that fails does not stop the next. Each group's log and report
# folders go into $OUT/batch.tgz (group N under N/), rewritten after every group so that a call
# cut short keeps the groups done; its timed and checked lines are printed here.
set -o pipefail -o noglob
# first: its commit guard stops a wrong FFNQ_COMMIT before any group runs
. "$(dirname "$0")/device_env.sh"
OUT=${OUT:-/tmp/ffnq-out}
ROUND=${PROXY_ROUND:-$(dirname "$0")/proxy_round.sh}  # the tests stand a stub in
D=$(mktemp -d)
mkdir -p "$OUT"
n=0
for g in "$@"; do
  n=$((n + 1)); envs=(); vars=()
  for w in $g; do
    if [ ${#vars[@]} -eq 0 ] && [[ $w =~ ^[A-Z_][A-Z0-9_]*= ]]; then envs+=("$w"); else vars+=("$w"); fi
  done
  echo "##### group $n: $g"
  if [ ${#vars[@]} -eq 0 ]; then
    echo "group $n names no variant: skipped"
    continue
  fi
  mkdir -p "$D/$n"
  env "${envs[@]}" OUT="$D/$n" "$ROUND" "${vars[@]}" > /dev/null 2>&1
  echo "group $n rc=$?"
  grep -hE "GPU 0|proxy=|timed|bytes w=|floor:|profile w=|PASS|FAIL|rror|=== variant|total" "$D/$n/proxy.log" 2>/dev/null
  tar czf "$OUT/batch.tgz" -C "$D" .
done
