#!/bin/bash
# One device call (~5 min) for the fp16 KV cache (D18, branch kv16): build, the attention kernel
# test against the CPU (fp16-cache and f32-cache variants; cache contents bound 2^-11), whole-model
# parity with the fp16 cache through the decode path (default check) and the flash prefill (300
# tokens in chunks of 128; the CPU reference rounds GEMM operands like the GPU, as session_check.sh
# does, because plain f32 misses the cosine bound there already without D18), the same with D18 off
# only when that fails, then decode at 4K and 128K with D18 on vs off; with U4=1 also 128K with the
# opt-in 4-positions-per-warp fp16 split kernel (LILY_ATTN_KV16_U4=1). Logs go to $OUT.
# Usage: kv16_check.sh [build-dir]
B=${1:-/root/work/build}
BUILD_LOG=kv16_build.txt
source "$(dirname "$0")/lib.sh"
timeout 100 "$L" cuda-test-attn --only attn >"$OUT/kv16_test_attn.txt" 2>&1
el "cuda-test-attn rc=$?"
grep -E "FAIL|summary|^  |cuda-test-attn:" "$OUT/kv16_test_attn.txt" | tail -24
timeout 60 "$L" cuda-check --tokens 64 2>&1 | tail -6 | tee "$OUT/kv16_check_default.txt"
el "cuda-check default"
timeout 75 "$L" cuda-check --tokens 64 --prompt 300 --chunk 128 --cpu-emulate fp16 2>&1 | tail -6 |
  tee "$OUT/kv16_check_chunk128.txt"
el "cuda-check prompt 300 chunk 128"
if ! grep -q "cuda-check: PASS" "$OUT/kv16_check_default.txt" ||
   ! grep -q "cuda-check: PASS" "$OUT/kv16_check_chunk128.txt"; then
  echo "--- a check failed: the same with D18 off (f32 cache) for comparison"
  timeout 60 "$L" cuda-check --tokens 64 --ablate D18 2>&1 | tail -3
  timeout 75 "$L" cuda-check --tokens 64 --prompt 300 --chunk 128 --cpu-emulate fp16 --ablate D18 2>&1 | tail -3
fi
timeout 180 "$L" bench decode --contexts 4096,131072 --tokens 64 --rounds 3 --ablate D18 --profile-context 0 \
  --out "$OUT" --tag kv16-decode --commit "${LILY_COMMIT:-kv16}" 2>&1 | grep -v "^bench:" | tail -12
el "bench decode"
if [ -n "$U4" ]; then
  LILY_ATTN_KV16_U4=1 timeout 120 "$L" bench decode --contexts 131072 --tokens 64 --rounds 2 --profile-context 0 \
    --out "$OUT/u4" --tag kv16-u4-decode --commit "${LILY_COMMIT:-kv16}" 2>&1 | grep -v "^bench:" | tail -4
  el "bench decode U4"
fi
