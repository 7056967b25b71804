#!/bin/bash
# Builds the lily binary with the CUDA backend on the device machine, outside the carried tree
# (reused within a lease). Usage: scripts/device/build.sh [build-dir]
set -o pipefail
export PATH=/usr/local/cuda/bin:$PATH
B=${1:-/root/work/build}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$B"
# The device has no tokenizer/server libraries: on this copy of the tree, set aside tool mains that
# need them but are not guarded by LILY_HAVE_FRONTEND.
for f in "$SRC"/tools/cmd_*.cpp; do
  if ! grep -q LILY_HAVE_FRONTEND "$f" && grep -qE '"(server|engine|tokenizer)/' "$f"; then
    echo "device build: skipping $(basename "$f") (needs the front-end)"
    mv "$f" "$f.skipped"
  fi
done
# EXTRA_CUDA_FLAGS (e.g. -DLILY_SB_EAGER): a variant binary for a two-binary A/B (two_binary_ab.sh).
cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLILY_TESTS=OFF -DLILY_CUDA=ON \
  ${EXTRA_CUDA_FLAGS:+"-DCMAKE_CUDA_FLAGS=$EXTRA_CUDA_FLAGS"} >"$B/cmake.log" 2>&1 ||
  { tail -40 "$B/cmake.log"; exit 1; }
cmake --build "$B" -j"$(nproc)" --target lily 2>&1 | grep -E "error|FAILED|undefined reference" | head -60
test -x "$B/lily" || { echo "build failed"; exit 1; }
echo "built $B/lily"
