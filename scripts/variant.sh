# Sourced by scripts/dev_round.sh and scripts/proxy_round.sh: a variant is BASE[:TUNE], BASE a build
# ("default", or a grid / block count) and TUNE an FFNQ_TRITON_TUNE string (ffnq/backends/triton/tune.py).
variant_base() { echo "${1%%:*}"; }
variant_tune() { [ "$1" = "${1%%:*}" ] || echo "${1#*:}"; }
