#!/bin/bash
# bench/kernel_facts.sh OUT: one device call of facts for the next kernel work, logs under OUT: ncu (clocks left
# alone) on the training step's slow passes at (1,1024,128,128) medium (d_proj, z_rows; gated_planes, which moves
# as many bytes at bandwidth, for contrast) and highest's split pass (contract_backward wgmma_f16x3), then the per-kernel CUDA time of the forward at N = 8192, bf16 in/out
# (issue 25's 250 ms target: which pass holds the ~60 ms beside the contraction). Where ncu cannot read the
# counters (gVisor machines) its logs say so and the rest still runs. About 5 minutes after a build.
set -uo pipefail
out=${1:?usage: bench/kernel_facts.sh OUT}
cd "$(dirname "$0")/.."
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-.build}
python3 trimul_inline.py build > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
for spec in d_proj_kernel:medium z_rows_kernel:medium gated_planes_kernel:medium split_kernel:highest; do
  kernel=${spec%%:*} precision=${spec##*:}
  timeout 120 ncu --clock-control none --kernel-name "regex:$kernel" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats \
    python3 dev/backward_profile.py --shape 1,1024,128,128 --precision $precision --rows 3 > "$out/ncu-$kernel.txt" 2>&1
  echo "$kernel: $(grep -E 'Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy' "$out/ncu-$kernel.txt" | tr -s ' ' | head -4 | tr '\n' ';')"
done
timeout 240 python3 bench.py --profile --bf16-inputs --contenders new-bf16 --shapes 1,8192,128,128 \
  --precision medium --budget 2 > "$out/profile-8192.log" 2>&1
grep -v -i warn "$out/profile-8192.log" | tail -14
