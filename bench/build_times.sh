#!/bin/bash
# bench/build_times.sh [BUILD_DIR]: the README's two build times, in one process tree: a cold build of the
# extension and kernel library into an empty BUILD_DIR, then an edit to one contraction kernel (a comment
# appended to kernels/contract_tiled.cu, restored on exit) until `bench.py --kernels tiled` prints its row.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-$(mktemp -d)}
if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ]; then echo "$dir is not empty: a cold build needs an empty folder" >&2; exit 1; fi
export TORCH_EXTENSIONS_DIR=$dir
now() { date +%s%N; }
seconds() { local ns=$(( $(now) - $1 )); printf "%d.%01d" $(( ns / 1000000000 )) $(( ns % 1000000000 / 100000000 )); }
start=$(now)
TRIMUL_VERBOSE=1 python3 trimul_inline.py build
cold=$(seconds "$start")
saved=$(mktemp)
cp kernels/contract_tiled.cu "$saved"
trap 'cp "$saved" kernels/contract_tiled.cu' EXIT
echo "// an edit $(now)" >> kernels/contract_tiled.cu
start=$(now)
TRIMUL_VERBOSE=1 python3 bench.py --kernels tiled --contenders new --shapes 1,256,128,128 --precision highest --budget 0.1
edit=$(seconds "$start")
echo "cold build: ${cold} s; edit to kernels/contract_tiled.cu until bench.py printed its row: ${edit} s ($(nproc) cores)"
