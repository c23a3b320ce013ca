#!/bin/bash
# bench/multi_gpu_run.sh OUT P [SHAPES] [--backward]: one device call of the multi-GPU issue's run on a machine of
# P GPUs (NCCL, one rank per GPU; the machine's NCCL settings as they are), logs and JSON under OUT: the build, the
# NCCL tests (test_sharded_nccl_one_rank_per_gpu), then bench/distributed.py under torchrun for each shape, both
# directions, bf16 in/out, medium: forward time (and with --backward the training step), bytes sent per rank,
# the share of transfers hidden, per-rank peak memory and the point-to-point bandwidth between ranks 0 and 1.
# P = 1 runs the one-GPU baseline of the same shapes (bench.py's long forward). SHAPES: bench.py's format, default
# "1,4096,128,128;1,8192,128,128". A call is ten minutes at most: split long lists of shapes over several calls.
#   bench/multi_gpu_run.sh $OUT 8 "1,8192,128,128"
#   bench/multi_gpu_run.sh $OUT 8 "1,16384,128,128"
set -uo pipefail
out=${1:?usage: bench/multi_gpu_run.sh OUT P [SHAPES] [--backward]}
gpus=${2:?usage: bench/multi_gpu_run.sh OUT P [SHAPES] [--backward]}
shapes=${3:-"1,4096,128,128;1,8192,128,128"}
backward=${4:-}
cd "$(dirname "$0")/.."
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-.build}
git log --oneline -1 > "$out/commit.txt" 2>/dev/null
nvidia-smi topo -m > "$out/topology.txt" 2>&1
python3 trimul_inline.py build > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
if [ "$gpus" -gt 1 ]; then
  timeout 180 python3 -m pytest -q test_trimul.py -k "nccl_one_rank_per_gpu" > "$out/nccl-tests.log" 2>&1
  tail -n 1 "$out/nccl-tests.log"
  for direction in outgoing incoming; do
    timeout 240 torchrun --nproc-per-node="$gpus" bench/distributed.py --shapes "$shapes" --dtype bf16 \
      --direction "$direction" $backward --json "$out/distributed-P$gpus-$direction.json" \
      > "$out/distributed-P$gpus-$direction.log" 2>&1
    grep -E "P=|bandwidth" "$out/distributed-P$gpus-$direction.log"
  done
else
  timeout 400 python3 bench.py --shapes "$shapes" --bf16-inputs --contenders new-bf16 --precision medium \
    --json "$out/one-gpu.json" > "$out/one-gpu.log" 2>&1
  grep -v -i warn "$out/one-gpu.log" | tail -12
fi
