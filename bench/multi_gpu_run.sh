#!/bin/bash
# bench/multi_gpu_run.sh OUT "P ..." [SHAPES] [--backward] [--tests] [--exchanges "ring channels"] [--budget SECONDS]
# One device call of the multi-GPU issue's run on a machine of several GPUs (NCCL, one rank per GPU; the
# machine's NCCL settings as they are): the build (linking .carry's kernel objects where carried:
# bench/carry.sh); with --tests the sharded and distributed tests (NCCL at 2, 4
# and all GPUs); then for each P of the list bench/distributed.py under torchrun on P of the GPUs, both
# directions, bf16 in/out, medium, normalized gate (with --backward the training step too), by each exchange of
# --exchanges (default: the rule's, shard_exchange_for). Every rank's records
# go to OUT/distributed.jsonl as measured (a failure or timeout keeps what came before it); OUT/summary.md is
# the table (efficiency against P = 1 where P = 1 ran, against the fused one-GPU forward given as
# FUSED="4096=38.4,8192=257"). The steps share the budget (default 570 s of a call's 600): each torchrun gets
# the time left over the runs left, the group's timeout 60 s, so a rank that fails cannot hold the others
# longer. Six files under OUT: run.txt (commit, GPUs, topology, NCCL settings), build.log, tests.log,
# distributed.log, distributed.jsonl, summary.md. The commit: $COMMIT if set (the device's git metadata may
# be stale), else bench.py's git_commit ("-dirty" with uncommitted changes or untracked files).
#   bench/multi_gpu_run.sh $OUT "1 2 4 8" "1,4096,128,128;1,8192,128,128" --tests
#   bench/multi_gpu_run.sh $OUT "8" "1,16384,128,128"
#   bench/multi_gpu_run.sh $OUT "2 8" "1,8192,128,128" --exchanges "ring channels"
set -uo pipefail
usage='usage: bench/multi_gpu_run.sh OUT "P ..." [SHAPES] [--backward] [--tests] [--exchanges "X ..."] [--budget S]'
out=$(realpath -m "${1:?$usage}")
worlds=${2:?$usage}
shift 2
shapes="1,4096,128,128;1,8192,128,128"
backward="" tests="" budget=570 exchanges=rule
while [ $# -gt 0 ]; do
  case "$1" in
    --backward) backward=--backward ;;
    --tests) tests=1 ;;
    --budget) budget=$2; shift ;;
    --exchanges) exchanges=$2; shift ;;
    -*) echo "$usage" >&2; exit 2 ;;
    *) shapes=$1 ;;
  esac
  shift
done
start=$SECONDS
left() { echo $((budget - (SECONDS - start))); }
mkdir -p "$out"
cd "$(dirname "$0")/.."
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-.build}
source bench/carry.sh
commit=${COMMIT:-$(python3 -c "import bench; print(bench.git_commit())" 2>&1 | tail -n 1)}
{
  echo "date: $(date -u +%FT%TZ)"; echo "commit: $commit"; echo "worlds: $worlds; shapes: $shapes $backward"
  echo "exchanges: $exchanges"
  nvidia-smi -L; nvidia-smi topo -m; env | grep '^NCCL_' | sort
} > "$out/run.txt" 2>&1
echo "commit $commit; $(nvidia-smi -L 2>/dev/null | wc -l) GPUs"
if ! timeout $(( $(left) < 240 ? $(left) : 240 )) python3 trimul_inline.py build > "$out/build.log" 2>&1; then
  tail -20 "$out/build.log"; exit 1
fi
if [ -n "$tests" ]; then
  timeout $(( $(left) < 300 ? $(left) : 300 )) python3 -m pytest -q -rs test_trimul.py \
    -k "nccl_one_rank_per_gpu or sharded or distributed" > "$out/tests.log" 2>&1
  echo "tests (rc $?): $(tail -n 1 "$out/tests.log")"
  grep -E "^(FAILED|SKIPPED)" "$out/tests.log" | head -10
fi
runs=0
for p in $worlds; do for x in $exchanges; do runs=$((runs + 2)); done; done
for p in $worlds; do
  for x in $exchanges; do
    for direction in outgoing incoming; do
      slot=$(( $(left) / runs ))
      runs=$((runs - 1))
      name="P=$p $direction $x"
      if [ "$slot" -lt 30 ]; then
        echo "$name: skipped, ${slot} s left for it"; continue
      fi
      chosen=""
      [ "$x" != rule ] && chosen="--exchange $x"
      echo "== $name ($slot s)" >> "$out/distributed.log"
      timeout "$slot" torchrun --nproc-per-node="$p" bench/distributed.py --shapes "$shapes" --dtype bf16 \
        --direction "$direction" $chosen $backward --timeout 60 --commit "$commit" \
        --jsonl "$out/distributed.jsonl" >> "$out/distributed.log" 2>&1
      rc=$?
      sed -n "/^== $name /,\$p" "$out/distributed.log" | grep -E "P=$p |^links"
      [ "$rc" -ne 0 ] && sed -n "/^== $name /,\$p" "$out/distributed.log" | \
        grep -E "Error|error|Killed|Timeout" | tail -3 && echo "$name: rc $rc"
    done
  done
done
python3 bench/distributed.py --summarize "$out/distributed.jsonl" --fused "${FUSED:-}" > "$out/summary.md" 2>&1
cat "$out/summary.md"
