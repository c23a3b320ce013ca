#!/bin/bash
# bench/suite_part.sh K N [pytest args...]: run the K-th of N equal slices (1-based) of test_trimul.py's
# collected tests, in collection order. The whole suite on an H200 takes ~8 minutes (part 2 alone past 5),
# past one device call's limit after a build: run it as two calls (`bench/suite_part.sh 1 2`, then `2 2`).
# Unbuffered (-u): a run killed by a timeout still shows how far it got through a pipe. The 30 slowest tests are
# listed at the end (--durations), for trimming the suite's device time.
# IDS=FILE: the test ids in FILE instead of the whole collection, e.g. the tests that skip without a GPU (the
# rest run in CI), listed here on the CPU (~6 min, no device time) and run in one call (~6 min on an H100):
#   python3 -m pytest -v -p no:cacheprovider test_trimul.py | grep ' SKIPPED' | sed 's/ SKIPPED.*//' > .carry/gpu_ids
#   IDS=.carry/gpu_ids bench/suite_part.sh 1 1      (on the device, with .carry carried)
set -euo pipefail
part=$1 parts=$2
shift 2
cd "$(dirname "$0")/.."
if [ -n "${IDS:-}" ]; then
  mapfile -t ids < "$IDS"
else
  mapfile -t ids < <(python3 -m pytest --collect-only -q test_trimul.py 2>/dev/null | grep '::')
fi
total=${#ids[@]}
first=$(( (part - 1) * total / parts ))
last=$(( part * total / parts ))
echo "tests $((first + 1))-$last of $total"
exec python3 -u -m pytest -q --durations=30 "$@" "${ids[@]:first:last-first}"
