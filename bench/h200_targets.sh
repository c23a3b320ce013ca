#!/bin/bash
# bench/h200_targets.sh OUT: one device call of the single-GPU targets that are stated for an H200, logs under
# OUT (the device tool's $OUT); exits 3 at once, having run nothing, on any other GPU (a call for an H200 may be
# served by an H100: then it costs the machine's start only). Where .carry/ holds them it unpacks the kernel
# objects and cuEquivariance (bench/carry.sh).
# Then, each under its own timeout: issue 24's training table against cuEquivariance (~3 min), issue 25's N = 8192
# forward (~1 min), and the split forward at N = 12288 with the card's real free memory (~1.5 min). Files under
# OUT: run.txt (commit, GPU, nvcc), backward.log, n8192.log, split_n12288.log.
# PROXY=1: the same runs on any GPU (an H100 when no H200 comes), run.txt saying so: a check of the targets'
# comparisons against cuEquivariance on the same card at the current commit, not the H200's numbers.
#   COMMIT=<sha> bench/h200_targets.sh $OUT        (the device's git metadata may be stale: pass COMMIT)
set -uo pipefail
out=$(realpath -m "${1:?usage: bench/h200_targets.sh OUT}")
cd "$(dirname "$0")/.."
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [[ "$gpu" != *H200* && "${PROXY:-0}" != 1 ]]; then
  echo "not an H200 ($gpu): nothing run"
  exit 3
fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-.build}
source bench/carry.sh
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
{ echo "commit ${COMMIT:-$(git log --oneline -1 2>/dev/null)}"; echo "gpu $gpu"; nvcc --version | tail -1
  [[ "$gpu" != *H200* ]] && echo "proxy: not an H200, the targets' numbers are the H200's"; } > "$out/run.txt"
python3 trimul_inline.py build > "$out/build.log" 2>&1
timeout 220 python3 bench.py --backward --budget 0.1 --precision medium,highest \
  --contenders new,new-bf16,cueq-bf16,cueq-fp32 > "$out/backward.log" 2>&1
timeout 120 python3 bench.py --shapes 1,8192,128,128 --bf16-inputs --gate-input normalized \
  --contenders new-bf16 > "$out/n8192.log" 2>&1
timeout 150 python3 dev/split_forward_ab.py --n 12288 --real > "$out/split_n12288.log" 2>&1
cat "$out/run.txt"
grep -A 12 "median us per training step" "$out/backward.log"
tail -n 2 "$out/n8192.log"
grep "^N=" "$out/split_n12288.log"
