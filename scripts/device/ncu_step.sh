#!/bin/bash
# Per-kernel device time and DRAM traffic of one captured decode step (full-size synthetic model,
# context 4096) with Nsight Compute, written to $OUT/ncu_step.csv. Run after build.sh.
# NCU_SKIP / NCU_COUNT: kernels skipped / profiled (one step is ~185 kernels at main after 426caf8),
# NCU_TIMEOUT: seconds; NCU_FILTER: a regex of kernel names (skip/count then count those only).
set -o pipefail
export PATH=/usr/local/cuda/bin:$PATH
B=${1:-/root/work/build}
OUT=${OUT:-/tmp/out}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
FILTER=()
[ -n "$NCU_FILTER" ] && FILTER=(--kernel-name "regex:$NCU_FILTER")
timeout "${NCU_TIMEOUT:-400}" "$NCU" --clock-control none "${FILTER[@]}" --launch-skip "${NCU_SKIP:-6000}" --launch-count "${NCU_COUNT:-460}" \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active \
  --csv --page raw "$B/lily" bench decode --contexts 4096 --tokens 8 --rounds 1 --profile-context 0 \
  --out /tmp/ncu_bench >"$OUT/ncu_step.csv" 2>"$OUT/ncu_err.txt"
echo "ncu rc=$? lines=$(wc -l <"$OUT/ncu_step.csv")"
tail -3 "$OUT/ncu_err.txt"
