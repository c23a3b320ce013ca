#!/bin/bash
# bench/position_gemm_run.sh OUT: one device call for the position_gemm kernels (bench/NOTES.md, sessions 42-43):
# builds, runs position_gemm's tests with the register-file and
# serialized-wgmma rules under a timeout (a wrong setmaxnreg hand-over would hang, not fail), then
# dev/rows_gemm_probe.py for each position_gemm kernel of the build, and ncu's speed-of-light and memory sections
# on each one's rows GEMM at P = 2^20, K = 384, N = 512 (where ncu cannot read the counters its log says so);
# logs under OUT. About 8 minutes on a fresh machine. The working tree is the device's copy: nothing to revert.
set -uo pipefail
out=${1:?usage: bench/position_gemm_run.sh OUT}
cd "$(dirname "$0")/.."
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-.build}
python3 trimul_inline.py build > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
grep "^position_gemm" "$out/build.log"
timeout 300 python3 -m pytest -q test_trimul.py \
  -k "position_gemm or fits_the_register_file or no_wgmma_kernel_is_serialized" > "$out/tests.log" 2>&1
echo "tests: rc $? ($(tail -n 1 "$out/tests.log"))"
grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -20
kernels=$(python3 -c "import trimul_inline as ti; print(' '.join(e.name for e in ti.kernel_registry()
                                                              if e.role == 'position_gemm' and e.name != 'cublas'))" 2>/dev/null)
for kernel in $kernels; do
  timeout 240 python3 dev/rows_gemm_probe.py --kernel "$kernel" > "$out/probe-$kernel.log" 2>&1
  echo "probe $kernel: rc $?"
  grep -E "ok$|FAIL|C=|err" "$out/probe-$kernel.log" | grep -v -i warn
done
for kernel in $kernels; do
  timeout 120 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis -k regex:gemm_kernel -c 1 python3 -c "
import torch, trimul_inline as ti
rows, w = torch.randn(1 << 20, 384, device='cuda'), torch.randn(512, 384, device='cuda')
ti._extension().position_gemm('$kernel', rows, w, None, ti._PRECISION_CODE['highest'])
torch.cuda.synchronize()" > "$out/ncu-$kernel.txt" 2>&1
  echo "ncu $kernel: rc $?"
  grep -E "Duration|Throughput|Busy|Bandwidth|Hit Rate|ERR" "$out/ncu-$kernel.txt" | tr -s ' ' | head -16
done
