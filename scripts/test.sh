#!/usr/bin/env bash
# Builds lily and runs every test suite (C++ unit tests + Python differential and end-to-end tests).
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${LILY_PRESET:-default}"
cmake --preset "$preset" -DPython3_EXECUTABLE="$(command -v python3)" >/dev/null
cmake --build --preset "$preset" -j "$(nproc)"
ctest --preset "$preset" "$@"
