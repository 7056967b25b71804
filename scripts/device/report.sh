#!/bin/bash
# One device call: the end-to-end benchmark report (shared/design/BENCHMARK.md). Stages, in order:
#   build    scripts/device/build.sh (incremental when the machine is warm)
#   prefill  lily bench prefill, ten lengths, 3 rounds, full-size synthetic model; a 4K per-op profile (kernel
#            rates; PREFILL_PROFILE=0 skips it); + --ablate $ABLATE_PREFILL at $ABLATE_PREFILL_LENGTHS when set
#   decode   lily bench decode, ten contexts, 3 rounds (+ --ablate $ABLATE_DECODE at $ABLATE_DECODE_CONTEXTS when set)
#   llama    .baseline/run_llama.sh when present (llama.cpp CUDA, llama-bench JSON)
#   hf       scripts/device/hf_bench.py (transformers, random bf16 weights) at the lengths that fit
#   report   scripts/bench_report.py: report.{json,md,png} (with the per-op tables of decode.md / prefill_profile.md)
# Each stage gets a time budget and the whole call respects REPORT_BUDGET seconds (default 540): a stage
# starts only if its minimum fits in what is left, and gets at most what is left. Results land in $OUT:
# report.json, report.md, report.png, log.txt and raw.tar.gz (every input JSON/markdown and stage log).
# Everything does not fit in one 9-minute call (llama.cpp alone is ~5 min with its GGUF): split it,
# e.g. STAGES=build,prefill,decode,llama then STAGES=hf,report; the report merges every result left
# in $REPORT_WORK (default /tmp/lily-report) by earlier calls on the same warm machine, and
# scripts/bench_report.py can also be rerun anywhere on the JSON files inside raw.tar.gz.
# Env: STAGES (default build,prefill,decode,llama,hf,report), LENGTHS, ROUNDS, CHUNK, CONFIG (the
# published config.json, for hf; searched in the usual places when unset), LILY_COMMIT,
# ABLATE_PREFILL, ABLATE_PREFILL_LENGTHS (default 2048), ABLATE_DECODE, ABLATE_DECODE_CONTEXTS (4096,32768,131072;
# 64 tokens per measurement), HF_DECODE_TOKENS (128),
# HF_ROUNDS (3), and per-stage budgets T_PREFILL T_DECODE T_LLAMA T_HF (seconds).
set -o pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
cd "$SRC"
B=${BUILD:-/root/work/build}
OUT=${OUT:-/tmp/out}
W=${REPORT_WORK:-/tmp/lily-report}
mkdir -p "$OUT" "$W"
STAGES=${STAGES:-build,prefill,decode,llama,hf,report}
LENGTHS=${LENGTHS:-256,512,1024,2048,4096,8192,16384,32768,65536,131072}
ROUNDS=${ROUNDS:-3}
CHUNK=${CHUNK:-0}   # 0 = the backend's default (16384 on cuda since session 32)
BUDGET=${REPORT_BUDGET:-540}
COMMIT=${LILY_COMMIT:-$(git -C "$SRC" rev-parse --short HEAD 2>/dev/null || echo unknown)}
T0=$(date +%s)
LOG="$OUT/log.txt"
: >"$LOG"
say() { echo "[report +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
has() { [[ ",$STAGES," == *",$1,"* ]]; }
# Runs a stage when at least $2 s are left; its budget is min($3, what is left - 15 s for the report).
stage_budget() {
  local min=$1 want=$2 l
  l=$(( $(left) - 15 ))
  if (( l < min )); then echo 0; else echo $(( want < l ? want : l )); fi
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
say "commit $COMMIT, budget ${BUDGET}s, stages $STAGES"
say "estimates: build 10-150 s (warm/cold), prefill 60-200 s (20K-5K tok/s), decode ~70 s, llama.cpp ~see run_llama.sh, hf ~150 s"

if has build; then
  bash scripts/device/build.sh "$B" >"$W/build.txt" 2>&1 || { tail -30 "$W/build.txt" | tee -a "$LOG"; say "build failed"; exit 1; }
  say "build done"
fi
L="$B/lily"

if has prefill; then
  T=$(stage_budget 40 "${T_PREFILL:-200}")
  if (( T > 0 )); then
    say "prefill: budget ${T}s (lengths $LENGTHS, $ROUNDS rounds, chunk $CHUNK)"
    # The binary's own guard stops starting lengths at 85% of the budget (model build counts too).
    timeout $(( T + 30 )) "$L" bench prefill --lengths "$LENGTHS" --rounds "$ROUNDS" --chunk "$CHUNK" \
      --max-seconds $(( T * 85 / 100 )) --out "$W" --tag prefill --commit "$COMMIT" >"$W/prefill.txt" 2>&1
    say "prefill rc=$?: $(grep -c 'tokens ' "$W/prefill.txt") lengths logged"
    grep -E "^bench prefill" "$W/prefill.txt" | tail -14 | tee -a "$LOG"
  else say "prefill: skipped (budget)"; fi
  if [ "${PREFILL_PROFILE:-1}" = 1 ]; then   # the per-op table (kernel rates) of one 4K prefill, for the report
    T=$(stage_budget 40 90)
    if (( T > 0 )); then
      timeout $(( T + 30 )) "$L" bench prefill --lengths 4096 --rounds 1 --chunk "$CHUNK" --profile-length 4096 \
        --out "$W" --tag prefill_profile --commit "$COMMIT" >"$W/prefill_profile.txt" 2>&1
      say "prefill profile rc=$?"
    fi
  fi
  if [ -n "$ABLATE_PREFILL" ]; then
    T=$(stage_budget 40 120)
    if (( T > 0 )); then
      timeout $(( T + 30 )) "$L" bench prefill --lengths "${ABLATE_PREFILL_LENGTHS:-2048}" --rounds "$ROUNDS" \
        --chunk "$CHUNK" --ablate "$ABLATE_PREFILL" --max-seconds $(( T * 85 / 100 )) --out "$W" \
        --tag prefill_ablate --commit "$COMMIT" >"$W/prefill_ablate.txt" 2>&1
      say "prefill ablations rc=$?"
    fi
  fi
fi

if has decode; then
  T=$(stage_budget 60 "${T_DECODE:-150}")
  if (( T > 0 )); then
    say "decode: budget ${T}s (contexts $LENGTHS, $ROUNDS rounds, 128 tokens)"
    timeout "$T" "$L" bench decode --contexts "$LENGTHS" --tokens 128 --rounds "$ROUNDS" --out "$W" --tag decode \
      --commit "$COMMIT" >"$W/decode.txt" 2>&1
    say "decode rc=$? (124 = hit its budget)"
    grep -E "^bench: ctx" "$W/decode.txt" | tail -12 | tee -a "$LOG"
  else say "decode: skipped (budget)"; fi
  if [ -n "$ABLATE_DECODE" ]; then
    T=$(stage_budget 60 150)
    if (( T > 0 )); then
      # Each measurement decodes N, 32 and 32 + N tokens (the steady ms/token) after a warm-up; D7 off (one split per KV head) takes
      # minutes per round at 64K and beyond (session 31): leave it out of ABLATE_DECODE_CONTEXTS past 32K.
      timeout "$T" "$L" bench decode --contexts "${ABLATE_DECODE_CONTEXTS:-4096,32768,131072}" --tokens 64 \
        --rounds "$ROUNDS" \
        --ablate "$ABLATE_DECODE" --profile-context 0 --out "$W" --tag decode_ablate --commit "$COMMIT" \
        >"$W/decode_ablate.txt" 2>&1
      say "decode ablations rc=$?"
    fi
  fi
fi

if has llama; then
  if [ -f .baseline/run_llama.sh ]; then
    T=$(stage_budget 60 "${T_LLAMA:-330}")
    if (( T > 0 )); then
      say "llama.cpp: budget ${T}s"
      mkdir -p "$W/llama"
      # run_llama.sh (never committed) reads OUT, LENGTHS (space-separated) and REPS; it writes the raw
      # llama-bench JSON as llama_{prefill,decode}.json and a BENCHMARK-shaped llama_summary.json.
      OUT="$W/llama" LENGTHS="${LENGTHS//,/ }" REPS="$ROUNDS" timeout "$T" bash .baseline/run_llama.sh \
        >"$W/llama.txt" 2>&1
      say "llama.cpp rc=$?"
      tail -24 "$W/llama.txt" | tee -a "$LOG"
    else say "llama.cpp: skipped (budget)"; fi
  else
    say "llama.cpp: .baseline/run_llama.sh not present, skipped"
  fi
fi

if has hf; then
  if [ -z "$CONFIG" ]; then
    for c in "$SRC/shared/reference/qwen3.6-35b-a3b/config.json" "$SRC/../shared/reference/qwen3.6-35b-a3b/config.json" \
             "$SRC/.baseline/config.json" /root/work/config.json "$SRC/config.json"; do
      [ -f "$c" ] && { CONFIG=$c; break; }
    done
  fi
  T=$(stage_budget 60 "${T_HF:-150}")
  if [ -z "$CONFIG" ]; then say "hf: no config.json found (set CONFIG), skipped"
  elif ! python3 -c "import torch, transformers" 2>/dev/null; then say "hf: torch/transformers missing, skipped"
  elif (( T > 0 )); then
    say "hf: budget ${T}s (config $CONFIG)"
    # Model build (~70 GB of random bf16 on the GPU) comes out of the budget before --max-seconds starts.
    timeout "$T" python3 scripts/device/hf_bench.py --config "$CONFIG" --out "$W/hf.json" --lengths "$LENGTHS" \
      --rounds "${HF_ROUNDS:-3}" --decode-tokens "${HF_DECODE_TOKENS:-128}" --max-seconds $(( T * 60 / 100 )) \
      --commit "$COMMIT" >"$W/hf.txt" 2>&1
    say "hf rc=$?"
    grep -E "^hf_bench" "$W/hf.txt" | tail -16 | tee -a "$LOG"
  else say "hf: skipped (budget)"; fi
fi

# The report merges every result in $W, also those of an earlier call on the same (warm) machine.
# Main runs first: on duplicates (e.g. the all-on rows of an ablation run) the first file wins.
INPUTS=()
for f in "$W"/prefill.json "$W"/decode.json "$W"/llama/llama_prefill.json "$W"/llama/llama_decode.json "$W"/hf.json \
         "$W"/prefill_ablate.json "$W"/decode_ablate.json; do
  [ -s "$f" ] && INPUTS+=("$f")
done
if [ ! -s "$W/llama/llama_prefill.json" ] && [ ! -s "$W/llama/llama_decode.json" ] && [ -s "$W/llama/llama_summary.json" ]; then
  INPUTS+=("$W/llama/llama_summary.json")
fi
if has report && (( ${#INPUTS[@]} > 0 )); then
  VERS=()   # llama.cpp built from a source archive reports build_commit "unknown"
  [ -s .baseline/LLAMA_COMMIT ] && VERS=(--version "llama.cpp=$(tr -d '[:space:]' <.baseline/LLAMA_COMMIT)")
  KERN=()   # per-op tables (achieved TFLOP/s, GB/s) of the decode sweep and the prefill profile
  for f in "$W"/decode.md "$W"/prefill_profile.md; do
    grep -q '^| op' "$f" 2>/dev/null && KERN+=(--kernels "$f")
  done
  python3 scripts/bench_report.py "${INPUTS[@]}" "${VERS[@]}" "${KERN[@]}" --skip-missing --out "$OUT" --tag report >"$W/report.txt" 2>&1
  say "report rc=$?"
  grep -E "mean ratio|faster" "$OUT/report.md" | tee -a "$LOG"
fi
tar -C "$W" -czf "$OUT/raw.tar.gz" --exclude='*.f32' --exclude='*.gguf' . 2>/dev/null
say "done in $(( $(date +%s) - T0 )) s; \$OUT: $(ls "$OUT" | tr '\n' ' ')"
