# Sourced by the device scripts. The device copy's .git is older than its tree, so the reports
# take the code's commit from FFNQ_COMMIT, computed where the tree was committed. Refuse a value
# this copy's .git knows while the tree differs from it: that is the stale HEAD, not what runs.
if [ -n "${FFNQ_COMMIT:-}" ] && git cat-file -e "${FFNQ_COMMIT}^{commit}" 2>/dev/null \
   && ! git diff --quiet "$FFNQ_COMMIT" -- ffnq scripts configs 2>/dev/null; then
  echo "FFNQ_COMMIT=$FFNQ_COMMIT: the tree here differs from that commit (git diff is not empty);" \
       "pass the commit of this tree, made where it was committed"
  exit 2
fi
