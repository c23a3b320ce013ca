# bench/carry.sh, sourced by the device scripts after they cd to the repository root and set
# TORCH_EXTENSIONS_DIR: unpacks what .carry/ holds (the device tool's carry: [".carry"]). The kernel objects
# (.carry/objects.tar.xz, made here from plan_build's object list) go where the build looks for them, so the
# build links them in ~30 s instead of compiling for ~110 s (an object's file name is the hash of its sources,
# flags and toolkit identity: one that does not match is compiled). cuEquivariance (.carry/cueq.tar.xz,
# ../shared/tools/cueq-carry.sh) goes onto PYTHONPATH for bench.py's cueq contenders.
if [ -f .carry/objects.tar.xz ]; then
  mkdir -p "$TORCH_EXTENSIONS_DIR/objects" && tar -C "$TORCH_EXTENSIONS_DIR/objects" -xJf .carry/objects.tar.xz
fi
if [ -f .carry/cueq.tar.xz ]; then
  mkdir -p /tmp/cueq-site && tar -C /tmp/cueq-site -xJf .carry/cueq.tar.xz
  export PYTHONPATH=/tmp/cueq-site${PYTHONPATH:+:$PYTHONPATH}
fi
