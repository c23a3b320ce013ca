#!/bin/bash
# bench/suite_part.sh K N [pytest args...]: run the K-th of N equal slices (1-based) of test_trimul.py's
# collected tests, in collection order. The whole suite on an H200 takes ~8 minutes (part 2 alone past 5),
# past one device call's limit after a build: run it as two calls (`bench/suite_part.sh 1 2`, then `2 2`).
# Unbuffered (-u): a run killed by a timeout still shows how far it got through a pipe. The 30 slowest tests are
# listed at the end (--durations), for trimming the suite's device time.
set -euo pipefail
part=$1 parts=$2
shift 2
cd "$(dirname "$0")/.."
mapfile -t ids < <(python3 -m pytest --collect-only -q test_trimul.py 2>/dev/null | grep '::')
total=${#ids[@]}
first=$(( (part - 1) * total / parts ))
last=$(( part * total / parts ))
echo "tests $((first + 1))-$last of $total"
exec python3 -u -m pytest -q --durations=30 "$@" "${ids[@]:first:last-first}"
