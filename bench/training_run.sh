#!/bin/bash
# bench/training_run.sh OUT: one device call's worth of training work, logs under OUT (the device tool's
# $OUT): build, the training / real-model / sharding tests (including two ranks sharing the GPU), a per-kernel
# profile of one training step, and bench.py --backward against cuEquivariance (unpack its carry first, as
# ../shared/tools/cueq-carry.sh says). About 6 minutes on an H200; the forward's tests: bench/suite_part.sh.
set -uo pipefail
out=${1:?usage: bench/training_run.sh OUT}
cd "$(dirname "$0")/.."
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-.build}
git log --oneline -1 > "$out/commit.txt" 2>/dev/null
python3 trimul_inline.py build > "$out/build.log" 2>&1
timeout 200 python3 -m pytest -q test_trimul.py -k "training or backward or d_proj or d_pair or dz_planes or grad_enabled or opcheck or sharded or \
host_layers or from_module or replace or alphafold or bias_false or chunked or host_path or eager_training or in_place or graph" > "$out/tests.log" 2>&1
for precision in medium highest; do
  timeout 40 python3 dev/backward_profile.py --shape 1,1024,128,128 --precision $precision >> "$out/profile.log" 2>&1
done
timeout 240 python3 bench.py --backward --budget 0.1 --precision highest,high,medium \
  --contenders cueq-bf16,cueq-fp32,new,new-bf16 --json "$out/backward.json" > "$out/backward.log" 2>&1
tail -n 3 "$out/tests.log"
