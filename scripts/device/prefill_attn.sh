#!/bin/bash
# One device call for the prefill mixers (P4 GDN prefill, P6 flash attention): build, the kernel
# test against the CPU backend, the whole-model parity check through the prefill paths, then the
# kernel bench. Logs go to $OUT. Usage: prefill_attn.sh [build-dir]
set -o pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
B=${1:-/root/work/build}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
bash "$SRC/scripts/device/build.sh" "$B" 2>&1 | tail -5 || exit 1
L="$B/lily"
timeout 300 "$L" cuda-test-attn 2>&1 | tee "$OUT/cuda_test_attn.txt" | grep -E "FAIL|summary|^  |cuda-test-attn:"
# chunk 32: the 96-token prompt goes through both prefill paths (T = 32 >= the flash threshold).
timeout 240 "$L" cuda-check --layers 4 --tokens 64 --prompt 96 --chunk 32 2>&1 | tail -6 | tee "$OUT/check_prefill.txt"
# chunk 128 over 300 tokens: GDN through the chunked form (P4c, T >= 64) incl. a partial chunk; then forced.
timeout 240 "$L" cuda-check --layers 4 --tokens 64 --prompt 300 --chunk 128 2>&1 | tail -6 | tee "$OUT/check_prefill_chunked.txt"
LILY_GDN_CHUNKED=1 timeout 240 "$L" cuda-check --layers 4 --tokens 64 --prompt 96 --chunk 32 2>&1 | tail -4 | tee -a "$OUT/check_prefill_chunked.txt"
timeout 240 "$L" cuda-test-attn --bench 2>&1 | tee "$OUT/bench_attn.txt"
