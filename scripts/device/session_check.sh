#!/bin/bash
# One device call that validates every CUDA path against the CPU backend, then takes quick speed
# readings: kernel tests (prefill GEMM + MoE, prefill GDN + attention), whole-model cuda-check with the
# prefill GEMM held back (decode-path changes alone), with everything on (prefill paths at chunk 128),
# on the demo model; on a decode failure, the same check with each decode id off; then the kernel
# benches and one round of bench decode / bench prefill (ablating DABL, default all of DIDS together;
# PABL for prefill). Logs to $OUT. Usage: [QUICK=1] [SKIP16K=1] session_check.sh [nobench]
DIDS=${DIDS:-D9,D10,D11,D12,D13,D14,D31,D33}
source "$(dirname "$0")/lib.sh"
for t in gemm attn sample; do
  if "$L" --help 2>&1 | grep -q "cuda-test-$t"; then
    timeout 120 "$L" cuda-test-$t >"$OUT/test_$t.txt" 2>&1
    el "cuda-test-$t rc=$?"; grep -E "FAIL|summary|PASS" "$OUT/test_$t.txt" | tail -12
  fi
done
el "cuda-check decode paths (GEMM prefill held back)"
LILY_GEMM_MIN_T=1000000 timeout 200 "$L" cuda-check --layers 4 --tokens 64 --prompt 24 2>&1 | tail -7 | tee "$OUT/check_decode.txt"
if ! grep -q "cuda-check: PASS" "$OUT/check_decode.txt"; then
  for id in ${DIDS//,/ }; do
    el "cuda-check -$id"
    LILY_GEMM_MIN_T=1000000 timeout 200 "$L" cuda-check --layers 4 --tokens 64 --prompt 24 --ablate "$id" 2>&1 | tail -3
  done
fi
el "cuda-check decode paths with the generic persistent MoE instance (--ablate D31)"
LILY_GEMM_MIN_T=1000000 timeout 200 "$L" cuda-check --layers 4 --tokens 64 --prompt 24 --ablate D31 2>&1 | tail -1 |
  tee "$OUT/check_decode_d31off.txt"
el "cuda-check decode paths with the MoE computing its own router logits (--ablate D39)"
LILY_GEMM_MIN_T=1000000 timeout 200 "$L" cuda-check --layers 4 --tokens 64 --prompt 24 --ablate D39 2>&1 | tail -1 |
  tee "$OUT/check_decode_d39off.txt"
el "cuda-check decode paths, the step captured again mid-generation (D44's short-context graph ends at 40 positions)"
LILY_ATTN_SHORT_MAX=40 LILY_GEMM_MIN_T=1000000 timeout 200 "$L" cuda-check --layers 4 --tokens 64 --prompt 24 2>&1 | tail -1 |
  tee "$OUT/check_decode_recapture.txt"
el "cuda-check decode paths, 192 positions, cpu following the gpu's experts (D24's rounding apart from router near-ties)"
LILY_GEMM_MIN_T=1000000 timeout 200 "$L" cuda-check --layers 4 --tokens 192 --prompt 24 --follow-routing 2>&1 | tail -8 |
  tee "$OUT/check_decode_follow.txt"
# The two unfollowed prefill lines below are informational on random weights: a router near-tie
# (8th vs 9th expert within ~1e-3) flips with any rounding change and then the logits part; they FAIL
# at f32 since session 3 and with fp16 emulation since session 6 (P11/P12 rounding). The line with
# the CPU following the GPU's experts is the one that decides (docs/CUDA.md, session 5 and 6 notes).
el "cuda-check all paths, prompt 300 in chunks of 128 (informational: own routing)"
timeout 240 "$L" cuda-check --layers 4 --tokens 64 --prompt 300 --chunk 128 2>&1 | tail -7 | tee "$OUT/check_prefill.txt"
if [ -z "$QUICK" ]; then
  el "same, CPU reference rounding matmul operands like the GPU GEMM (fp16), the standard bounds (informational: own routing)"
  timeout 240 "$L" cuda-check --layers 4 --tokens 64 --prompt 300 --chunk 128 --cpu-emulate fp16 2>&1 |
    tail -7 | tee "$OUT/check_prefill_emul.txt"
fi
el "same, f32 reference following the gpu's expert choices (routing flips counted apart; this one decides)"
timeout 240 "$L" cuda-check --layers 4 --tokens 64 --prompt 300 --chunk 128 --follow-routing 2>&1 | tail -8 |
  tee "$OUT/check_prefill_follow.txt"
el "prefill in one 4,096-token chunk (P17/P18: gate/up at M-tile 128 on the 4-warpgroup kernel; P19, P21), routing followed"
timeout 240 "$L" cuda-check --layers 2 --tokens 8 --prompt 4100 --chunk 4096 --follow-routing 2>&1 | tail -8 |
  tee "$OUT/check_prefill_4096.txt"
# The cuda default chunk since session 32 is 16,384 tokens. Its attention over a whole chunk against the cpu, as a
# kernel case (the 4-layer model check at 16,400 tokens ran past 290 s on the cpu reference, session 33 calls 1-2),
# then one GDN layer and its MoE over 16,400 tokens at model level (--vocab 4096: the cpu's lm_head at every position
# of 16K tokens would take minutes).
if [ -z "$SKIP16K" ]; then   # SKIP16K=1: not these two (~4 min; prefill paths only)
el "attention over one 16,384-token chunk (the default prefill path) against the cpu, at pos0 0 and 2000"
timeout 240 "$L" cuda-test-attn --only attn --attn-T 16384 --variant "kv16 flash (T>=16)" >"$OUT/test_attn_16384.txt" 2>&1
el "cuda-test-attn --attn-T 16384 rc=$?"; grep -E "T=16384|cuda-test-attn:" "$OUT/test_attn_16384.txt"
el "prefill in one 16,384-token chunk, one GDN layer and its MoE, routing followed"
timeout 240 "$L" cuda-check --layers 1 --vocab 4096 --tokens 4 --prompt 16400 --chunk 16384 --follow-routing 2>&1 | tail -8 |
  tee "$OUT/check_prefill_16384.txt"
fi
if [ -n "$LONGCHECK" ]; then
  el "same, prompt 700 in chunks of 512 (T >= 256: P7 skinny projections on the GEMM)"
  timeout 240 "$L" cuda-check --layers 4 --tokens 32 --prompt 700 --chunk 512 --cpu-emulate fp16 2>&1 |
    tail -7 | tee "$OUT/check_prefill_emul512.txt"
  if [ -n "$LONGABL" ]; then
    el "same with --ablate $LONGABL"
    timeout 240 "$L" cuda-check --layers 4 --tokens 32 --prompt 700 --chunk 512 --cpu-emulate fp16 --ablate "$LONGABL" 2>&1 |
      tail -7 | tee "$OUT/check_prefill_emul512_abl.txt"
  fi
fi
"$L" make-demo --out /tmp/demo >/dev/null 2>&1 &&
  timeout 120 "$L" cuda-check --model /tmp/demo --tokens 64 --prompt 40 --chunk 16 2>&1 | tail -6 | tee "$OUT/check_demo.txt"
[ "$1" = "nobench" ] && exit 0
el "kernel benches"
timeout 100 "$L" cuda-test-gemm --bench >"$OUT/bench_gemm.txt" 2>&1; tail -25 "$OUT/bench_gemm.txt"
timeout 100 "$L" cuda-test-attn --bench >"$OUT/bench_attn.txt" 2>&1; grep -E "T= 4096|pos0" "$OUT/bench_attn.txt" | head -20
el "bench prefill"
timeout 150 "$L" bench prefill --synthetic --lengths ${PLENGTHS:-4096,32768} --rounds ${BROUNDS:-1} --ablate "${PABL:-P4c}" \
  --out "$OUT" --tag prefill-quick --commit "${LILY_COMMIT:-unknown}" 2>&1 | grep -v "^bench:" | tail -30
el "bench decode"
timeout 200 "$L" bench decode --contexts ${DCONTEXTS:-4096,131072} --tokens 128 --rounds ${BROUNDS:-1} --ablate "${DABL:-${DIDS//,/+}}" \
  --profile-context 4096 --out "$OUT" --tag decode-quick --commit "${LILY_COMMIT:-unknown}" 2>&1 | grep -v "^bench:" | tail -45
el "done"
