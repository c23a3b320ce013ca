#!/bin/bash
# bench/ab_backward.sh OUT DIFF...: one device call's A/B of backward-kernel patches (dev/*.diff): the per-kernel
# profile of a training step at (1,1024,128,128), medium (or --precision), with the kernels as committed, then
# with each patch applied alone (only the files it touches rebuild), after that precision's training tests and
# the f16x3 tests on it; logs under OUT.
# A+B (patches joined by '+') applies them together. --precision P (after OUT): profile and test at P instead;
# --shapes "S;S" (after OUT, after --precision if both): profile each shape in turn instead of (1,1024,128,128).
# --forward (last of the options): also the inference forward's geomean at that precision (bench.py, ModelNew
# only) per tree, and the register-row kernels', the default output kernels' and the fused forward's tests, for
# a patch that touches the forward's kernels too.
#   bench/ab_backward.sh $OUT dev/backward_tile64.diff dev/d_proj_register_sums.diff
#   bench/ab_backward.sh $OUT dev/a.diff dev/b.diff dev/a.diff+dev/b.diff
#   bench/ab_backward.sh $OUT --precision highest dev/c.diff
#   bench/ab_backward.sh $OUT --shapes "1,768,128,128;1,1024,128,128" dev/a.diff
#   bench/ab_backward.sh $OUT --shapes "1,768,128,128" --forward dev/input.diff
set -uo pipefail
out=${1:?usage: bench/ab_backward.sh OUT [--precision P] DIFF...}
shift
precision=medium
if [ "${1:-}" = --precision ]; then precision=$2; shift 2; fi
shapes=1,1024,128,128
if [ "${1:-}" = --shapes ]; then shapes=$2; shift 2; fi
forward=0
if [ "${1:-}" = --forward ]; then forward=1; shift; fi
cd "$(dirname "$0")/.."
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-.build}
profile() {
  IFS=';' read -r -a shape_list <<< "$shapes"
  for shape in "${shape_list[@]}"; do
    echo "-- $shape"
    timeout 60 python3 dev/backward_profile.py --shape "$shape" --precision $precision --rows 14 2>&1 |
      grep -v -i warn
  done
  if [ $forward = 1 ]; then
    echo "-- forward"
    timeout 120 python3 bench.py --precision $precision --contenders new --budget 0.2 2>&1 | grep "^geomean"
  fi
}
python3 trimul_inline.py build > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
profile > "$out/committed.log"
apply() { git apply "$1" 2>/dev/null || patch -p1 < "$1" > /dev/null; }
revert() { git apply -R "$1" 2>/dev/null || patch -R -p1 < "$1" > /dev/null; }
for spec in "$@"; do
  IFS=+ read -r -a diffs <<< "$spec"
  name=$(for d in "${diffs[@]}"; do basename "$d" .diff; done | paste -sd+)
  applied=()
  for diff in "${diffs[@]}"; do
    apply "$diff" && applied+=("$diff") || { echo "$name: $diff does not apply"; break; }
  done
  if [ ${#applied[@]} -ne ${#diffs[@]} ]; then
    for ((i = ${#applied[@]} - 1; i >= 0; i--)); do revert "${applied[i]}"; done
    continue
  fi
  if python3 trimul_inline.py build >> "$out/build.log" 2>&1; then
    tests="(training and ($precision or bitwise)) or f16x3"
    [ $forward = 1 ] && tests="$tests or register_row or default_output or fused_matches or fused_reduced"
    timeout 240 python3 -m pytest -q test_trimul.py -k "$tests" > "$out/$name-tests.log" 2>&1
    echo "$name: $(tail -n 1 "$out/$name-tests.log")"
    profile > "$out/$name.log"
  else
    echo "$name: does not build"
  fi
  for ((i = ${#diffs[@]} - 1; i >= 0; i--)); do revert "${diffs[i]}"; done
done
for log in "$out"/*.log; do
  case $log in *-tests.log|*/build.log) continue ;; esac
  echo "== $(basename "$log" .log)"; grep -A 8 -e "^-- " "$log"
done
