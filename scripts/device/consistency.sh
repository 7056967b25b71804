#!/bin/bash
# One device call (< 3 min): builds lily (incremental when warm), then scripts/device/consistency.py —
# lily (CUDA whole-chunk, CUDA one token per chunk, CPU) vs HF transformers f32/bf16, teacher-forced
# over 192 positions on a 4-layer full-width random MLX 4-bit model. Writes $OUT/consistency.json,
# $OUT/consistency.md and $OUT/consistency_log.txt; exit status 0 = BENCHMARK.md target met.
# Env: CONFIG (the published config.json; searched in the usual places when unset), LAYERS (4),
# VOCAB (0 = real), BUILD (/root/work/build).
set -o pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
cd "$SRC"
B=${BUILD:-/root/work/build}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
if [ -z "$CONFIG" ]; then
  for c in "$SRC/shared/reference/qwen3.6-35b-a3b/config.json" "$SRC/../shared/reference/qwen3.6-35b-a3b/config.json" \
           "$SRC/.baseline/config.json" /root/work/config.json "$SRC/config.json"; do
    [ -f "$c" ] && { CONFIG=$c; break; }
  done
fi
[ -n "$CONFIG" ] || { echo "consistency: no config.json (set CONFIG=path)"; exit 2; }
if [ ! -x "$B/lily" ] || [ "${REBUILD:-1}" = 1 ]; then
  bash scripts/device/build.sh "$B" >"$OUT/consistency_build.txt" 2>&1 || { tail -30 "$OUT/consistency_build.txt"; exit 1; }
fi
echo "consistency: lily built in $(( $(date +%s) - T0 )) s"
timeout "${T_CONSISTENCY:-170}" python3 scripts/device/consistency.py --config "$CONFIG" --lily "$B/lily" --out "$OUT" \
  --layers "${LAYERS:-4}" --vocab "${VOCAB:-0}" 2>&1 | tee "$OUT/consistency_log.txt"
rc=${PIPESTATUS[0]}
echo "consistency: rc=$rc in $(( $(date +%s) - T0 )) s"
exit "$rc"
