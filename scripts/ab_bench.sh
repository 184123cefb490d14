#!/bin/bash
# Two commits' kernels side by side on one machine: FFNQ_COMMIT=<this tree's commit>
# scripts/ab_bench.sh OTHER [ROUNDS] benches this tree and commit OTHER (from this copy's .git,
# unpacked under /tmp) alternately, ROUNDS times each (default 2), TP ${TP:-1} minimax-m2 at
# ${WIDTHS:-1-16}, one `ffnq bench` per run (floor and baseline (b) in each), then `ffnq compare`
# of each round's pair (OTHER's run the base: per-width deltas against each run's noise band).
# Each run's report names its own commit. Reports in $OUT/ab-reports.tgz, log in $OUT/ab.log.
# The device copy's .git holds no commit made after the session's start: for a later OTHER, pass
# the file of `git archive -o ab-base.tar OTHER ffnq configs` made here instead (an untracked file
# git does not ignore travels with the tree, whose copy is limited to 64 MiB: the whole tree's
# archive, reports included, is not; its commit is read from the archive).
set -o pipefail
. "$(dirname "$0")/device_env.sh"
[ -n "${1:-}" ] || { echo "usage: FFNQ_COMMIT=<this tree's commit> scripts/ab_bench.sh OTHER_COMMIT [ROUNDS]"; exit 2; }
# the device copy's .git may be older than its tree: without FFNQ_COMMIT this tree's reports would
# name a stale commit
[ -n "${FFNQ_COMMIT:-}" ] || { echo "ab_bench.sh: FFNQ_COMMIT is unset, allowed: this tree's full commit"; exit 2; }
ARCHIVE=
if [ -f "$1" ]; then
  OTHER=$(git get-tar-commit-id < "$1") && [ -n "$OTHER" ] \
    || { echo "ab_bench.sh: $1 is not a git archive of a commit, allowed: a commit or \`git archive -o FILE COMMIT\`"; exit 2; }
  ARCHIVE=$(realpath "$1")
else
  OTHER=$(git rev-parse --verify --quiet "$1^{commit}") || { echo "ab_bench.sh: $1 is not a commit this copy's .git holds"; exit 2; }
fi
[[ "${2:-2}" =~ ^[1-9][0-9]*$ ]] || { echo "ab_bench.sh: ROUNDS=$2, allowed: a whole number >= 1"; exit 2; }
HERE=$PWD OUT=${OUT:-/tmp/ffnq-out} TP=${TP:-1} R=$PWD/reports-ab B=/tmp/ab-$OTHER
mkdir -p "$OUT" "$R" "$B"
{
nvidia-smi -L
echo "this tree ${FFNQ_COMMIT:-?} against $OTHER, tp=$TP widths=${WIDTHS:-1-16} rounds=${2:-2}"
if [ -n "$ARCHIVE" ]; then tar xf "$ARCHIVE" -C "$B"; else git archive "$OTHER" | tar x -C "$B"; fi
for d in "$HERE" "$B"; do  # both commits' builds into Triton's cache, in parallel
  (cd "$d" && PYTHONPATH=$d python3 -m ffnq.backends.triton.offline --target sm_90 --final both \
     --model minimax-m2 --tp "$TP" --jobs 7 | tail -n 1) &
done
wait
for i in $(seq "${2:-2}"); do
  runs=()
  for d in "$HERE" "$B"; do
    c=$([ "$d" = "$HERE" ] && echo "$FFNQ_COMMIT" || echo "$OTHER")
    echo "=== round $i: $c"
    log=$(cd "$d" && PYTHONPATH=$d FFNQ_COMMIT=$c timeout -k 5 200 python3 -m ffnq.cli bench --backend triton \
            --model minimax-m2 --tp "$TP" --widths "${WIDTHS:-1-16}" --rep-ms 200 --out "$R" 2>&1)
    echo "$log" | tail -n 22
    runs+=("$(echo "$log" | sed -n 's/^report: //p' | tail -n 1)")
    tar czf "$OUT/ab-reports.tgz" -C "$HERE" reports-ab
  done
  if [ -n "${runs[0]}" ] && [ -n "${runs[1]}" ]; then
    echo "=== round $i: ffnq compare ${runs[1]##*/} -> ${runs[0]##*/}"
    # the rows judged faster or slower, the count line and the report's folder
    PYTHONPATH=$HERE python3 -m ffnq.cli compare "${runs[1]}" "${runs[0]}" --out "$R" 2>&1 \
      | grep -E "faster|slower|^# |^report"
    tar czf "$OUT/ab-reports.tgz" -C "$HERE" reports-ab
  fi
done
} 2>&1 | tee "$OUT/ab.log"
