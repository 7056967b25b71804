#!/bin/bash
# Builds, on this host, the lily binary a device call can run instead of building there: the CUDA backend for sm_90a,
# no front-end (as scripts/device/build.sh builds it on the device), the CUDA runtime linked statically. Objects go to
# build-device/, the binary and BUILT_FROM (commit, uncommitted changes, nvcc) to build-prebuilt/ (both git-ignored).
# A device call carries build-prebuilt (`carry: ["build-prebuilt", ...]`, ~25 MB of the 64 MiB) and sets
# LILY_PREBUILT=build-prebuilt for the scripts that source lib.sh.
set -eo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
B="$SRC/build-device"
P="$SRC/build-prebuilt"
mkdir -p "$B" "$P"
cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLILY_TESTS=OFF -DLILY_CUDA=ON -DLILY_WITH_FRONTEND=OFF \
  -DLILY_CUDART_STATIC=ON >"$B/cmake.log" 2>&1 || { tail -30 "$B/cmake.log"; exit 1; }
cmake --build "$B" -j"$(nproc)" --target lily
cp "$B/lily" "$P/lily"
dirty=$(git -C "$SRC" diff --quiet HEAD -- src tools CMakeLists.txt || echo ' + uncommitted changes')
echo "$(git -C "$SRC" rev-parse --short HEAD)$dirty, built $(date -u +%FT%TZ) on the host, $(/usr/local/cuda/bin/nvcc --version | tail -1)" \
  >"$P/BUILT_FROM"
ls -la "$P/lily"
cat "$P/BUILT_FROM"
