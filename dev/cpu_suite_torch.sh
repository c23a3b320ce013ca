#!/usr/bin/env bash
# The CPU suite under another torch than this machine's, by default the GPU machine's (2.11.0): catches what a
# torch version changes (custom-op autograd, fake tensors, compile) before device time is spent on it. The
# torch wheel goes into its own venv without its CUDA library packages; their libraries and headers come from
# the main venv's (same CUDA major), found through LD_LIBRARY_PATH and CPATH.
#
#   dev/cpu_suite_torch.sh [VERSION] [MAIN_VENV] [pytest args...]    (default 2.11.0 /work/venv)
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-2.11.0}
main_venv=${2:-/work/venv}
shift $(( $# < 2 ? $# : 2 ))
venv=/tmp/torch-$version
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --no-deps "torch==$version"
  "$venv/bin/pip" install -q filelock typing-extensions sympy networkx jinja2 fsspec ninja pytest
fi
nvidia=$("$main_venv/bin/python" -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))")/nvidia
export LD_LIBRARY_PATH=$(ls -d "$nvidia"/*/lib | tr '\n' ':')${LD_LIBRARY_PATH:-}
export CPATH=$(ls -d "$nvidia"/*/include | tr '\n' ':')${CPATH:-}
export TORCH_EXTENSIONS_DIR=/tmp/build-torch-$version
"$venv/bin/python" -m pytest -q test_trimul.py -p no:cacheprovider "$@"
