#!/bin/bash
# One device call: build, CUDA-vs-CPU parity checks, then the decode benchmark. Logs and results go
# to $OUT (what the device tool brings back). Usage: check_and_bench.sh [quick|full]
set -o pipefail
MODE=${1:-quick}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
B=/root/work/build
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$SRC"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee /tmp/gpu.txt
t0=$(date +%s)
bash scripts/device/build.sh "$B" 2>&1 | tee "$OUT/build.txt" || exit 1
echo "build: $(( $(date +%s) - t0 )) s"
L="$B/lily"
if [ "$MODE" != "bench" ]; then
  timeout 240 "$L" cuda-check --layers 4 --tokens 64 --prompt 24 2>&1 | tail -25 | tee "$OUT/check_synthetic.txt"
  "$L" make-demo --out /tmp/demo >/dev/null 2>&1 &&
    timeout 120 "$L" cuda-check --model /tmp/demo --tokens 64 --prompt 24 2>&1 | tail -12 | tee "$OUT/check_demo.txt"
fi
if [ "$MODE" = "quick" ]; then
  timeout 300 "$L" bench decode --contexts 4096,131072 --tokens 128 --rounds 1 --out "$OUT" --tag quick --ablate "${ABLATE:-D3}" \
    --commit "${LILY_COMMIT:-unknown}" 2>&1 | tail -60
else
  timeout 240 "$L" bench decode --tokens 128 --rounds 3 \
    --contexts "${CONTEXTS:-256,512,1024,2048,4096,8192,16384,32768,65536,131072}" --out "$OUT" --tag decode \
    --commit "${LILY_COMMIT:-unknown}" 2>&1 | grep -v "^bench:" | tail -40
  timeout 300 "$L" bench decode --tokens 128 --rounds 3 --ablate "${ABLATE:-D2,D3,D3b,D6,D7,D8}" \
    --contexts 4096,32768,131072 --profile-context 131072 --out "$OUT" --tag ablations \
    --commit "${LILY_COMMIT:-unknown}" 2>&1 | grep -v "^bench:" | tail -60
fi
