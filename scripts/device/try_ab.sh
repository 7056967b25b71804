#!/bin/bash
# One device call for switches written but not yet measured (opt-in through LILY_TRY): build; decode
# cuda-check with them on (64 steps; 192 with the cpu following the gpu's experts) and all of them off; a
# matched A/B per id (`bench decode --ablate ID`, rounds alternate the variants); a 4K kernel trace with
# them on (LILY_TRACE_CTAS passes through); prefill ids (P...) get `bench prefill --ablate ID` at PLENGTHS
# instead of the decode A/B, and a prefill cuda-check (4,100 tokens in one 4,096 chunk, routing followed).
# Usage: IDS=D47,D48 [CONTEXTS=...] [PLENGTHS=4096,32768] [ROUNDS=3] [OUT=dir] [LILY_COMMIT=rev]
#   bash scripts/device/try_ab.sh
IDS=${IDS:?IDS=D..,D.. names the opt-in switches}
C=${LILY_COMMIT:-unknown}
source "$(dirname "$0")/lib.sh"
export LILY_TRY=$IDS
check() {   # name, extra args
  local name=$1; shift
  LILY_GEMM_MIN_T=1000000 timeout 200 "$L" cuda-check --layers 4 --prompt 24 "$@" 2>&1 | tail -8 >"$OUT/check_$name.txt"
  el "cuda-check $name: $(grep -o 'cuda-check: [A-Z]*.*top-1 [0-9.]*%' "$OUT/check_$name.txt" | tail -1)"
}
check on --tokens 64
check off --tokens 64 --ablate "$IDS"
check follow --tokens 192 --follow-routing
if [[ ,$IDS =~ ,P ]]; then   # prefill ids: the deciding prefill check too (one 4,096 chunk, routing followed)
  timeout 240 "$L" cuda-check --layers 2 --tokens 8 --prompt 4100 --chunk 4096 --follow-routing 2>&1 | tail -8 \
    >"$OUT/check_prefill_4096.txt"
  el "cuda-check prefill 4100/4096: $(grep -o 'cuda-check: [A-Z]*.*top-1 [0-9.]*%' "$OUT/check_prefill_4096.txt" | tail -1)"
fi
for id in ${IDS//,/ }; do
  f=${id//=/}   # file names without '=' (the device tool returns such files only inside a tarball)
  if [[ $id == P* ]]; then
    timeout 300 "$L" bench prefill --synthetic --lengths "${PLENGTHS:-4096,32768}" --chunk 4096 --rounds "${ROUNDS:-3}" \
      --ablate "$id" --out "$OUT" --tag "ab_$f" --commit "$C" >"$OUT/ab_$f.txt" 2>&1
  else
    timeout 240 "$L" bench decode --synthetic --contexts "${CONTEXTS:-4096,32768,131072}" --tokens 128 \
      --rounds "${ROUNDS:-3}" --ablate "$id" --out "$OUT" --tag "ab_$f" --commit "$C" >"$OUT/ab_$f.txt" 2>&1
  fi
  el "A/B $id rc=$?"
  grep -E "^\| [0-9]+ \|" "$OUT/ab_$f.md"
done
LILY_KERNEL_TRACE=1 timeout 120 "$L" bench decode --synthetic --contexts 4096 --tokens 64 --rounds 1 --out "$OUT" \
  --tag trace --commit "$C" >"$OUT/trace.txt" 2>&1
el "trace rc=$?"
sed -n '/Step timeline/,/^## /p' "$OUT/trace.md" | grep -E "^\|"
