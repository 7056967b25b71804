#!/bin/bash
# One device call for the decode-step fusions (D9 norm/add folding, D10 fused router + top-k,
# D11 warp-parallel split-KV merge, D12 GDN over 4 CTAs per head, D13 L2 prefetch one launch
# ahead, D14 one-wave GEMV batches, (D15, D16: removed, slower),
# D17 MoE down loads before its PDL wait, D19 persistent MoE kernel): build, cuda-check with all of
# them on (synthetic full-width model: GDN + attention layers, decode path eager and as a captured
# graph; demo model: fallback paths), on a failure the same check with each one off, then bench decode at
# 4K/32K/128K with each id ablated on its own and all four together. Usage: decode_ab.sh [check]
set -o pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
B=${B:-/root/work/build}
OUT=${OUT:-/tmp/out}
IDS=${IDS:-D9,D10,D11,D12,D13,D14,D17,D19}
mkdir -p "$OUT"
cd "$SRC"
t0=$(date +%s)
bash scripts/device/build.sh "$B" 2>&1 | tee "$OUT/build.txt" || exit 1
echo "build: $(( $(date +%s) - t0 )) s"
L="$B/lily"
echo "== cuda-check, all on"
timeout 200 "$L" cuda-check --layers 4 --tokens 64 --prompt 24 2>&1 | tail -12 | tee "$OUT/check_on.txt"
echo "== cuda-check, all on, 1,000-token prompt (32 KV splits: several per merge warp), small vocab"
timeout 200 "$L" cuda-check --layers 4 --vocab 4096 --tokens 16 --prompt 1000 2>&1 | tail -6 | tee "$OUT/check_long.txt"
echo "== cuda-check, all on, LILY_MMA_Q4=all (mma kernels with the folded residual and D10 routing)"
LILY_MMA_Q4=all timeout 200 "$L" cuda-check --layers 4 --tokens 32 --prompt 24 2>&1 | tail -6 | tee "$OUT/check_mma.txt"
if ! grep -q "cuda-check: PASS" "$OUT/check_on.txt"; then   # localise: which id, switched off, passes
  for id in ${IDS//,/ }; do
    echo "== cuda-check, -$id"
    timeout 200 "$L" cuda-check --layers 4 --tokens 64 --prompt 24 --ablate "$id" 2>&1 | tail -5 |
      tee "$OUT/check_off_$id.txt"
  done
fi
"$L" make-demo --out /tmp/demo >/dev/null 2>&1 &&
  timeout 120 "$L" cuda-check --model /tmp/demo --tokens 64 --prompt 24 2>&1 | tail -6 | tee "$OUT/check_demo.txt"
[ "$1" = "check" ] && exit 0
ALL=${IDS//,/+}
timeout 420 "$L" bench decode --contexts "${CONTEXTS:-4096,32768,131072}" --tokens 128 --rounds "${ROUNDS:-2}" \
  --ablate "$IDS,$ALL" --profile-context 4096 --out "$OUT" --tag decode-ab --commit "${LILY_COMMIT:-unknown}" 2>&1 |
  grep -v "^bench:" | tail -70
# The per-op breakdown once more without the prefetches (D13, D16): they move HBM traffic between
# ops, so an op's time in the breakdown above includes traffic issued for later ops.
timeout 200 "$L" bench decode --contexts 4096 --tokens 64 --rounds 1 --profile-ablate "${PROFILE_ABLATE:-D13}" \
  --profile-context 4096 --out "$OUT/noprefetch" --tag decode-noprefetch --commit "${LILY_COMMIT:-unknown}" 2>&1 |
  grep -v "^bench:" | grep -A40 "Per-op"
