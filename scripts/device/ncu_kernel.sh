#!/bin/bash
# Nsight Compute on single launches of prefill kernels inside `lily bench prefill` (full-size synthetic model):
# the full section set with source correlation, clocks left alone (--clock-control none, METHOD.md), then per
# kernel the details page and a stall summary (ncu_stalls.py). Session 13 found P32 / P33 / P34 this way.
# Usage: [BENCH=decode] ncu_kernel.sh [build-dir] [kernel-regex] [launch-skip] [launch-count] [length]
#   e.g. ncu_kernel.sh /root/work/build 'gemm_moe_rs4|attn_flash_wg' 12 4 4096 (template arguments are demangled as
#   '(int)64': the MoE down GEMM is 'gemm_kernel<\(int\)64, \(int\)0, \(int\)2')
#   BENCH=decode: inside `lily bench decode` at context `length` (graph kernel nodes are profiled one by one,
#   so PDL overlap with the neighbours is gone: stall reasons of the kernel alone).
set -o pipefail
export PATH=/usr/local/cuda/bin:$PATH
B=${1:-/root/work/build}
K=${2:-gemm_moe_rs4}
SKIP=${3:-20}
COUNT=${4:-2}
LEN=${5:-4096}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
timeout "${NCU_TIMEOUT:-300}" "$NCU" --clock-control none --kernel-name-base demangled --kernel-name "regex:$K" \
  --launch-skip "$SKIP" --launch-count "$COUNT" --set full --import-source yes -f -o /tmp/ncu_kernel \
  "$B/lily" bench "${BENCH:-prefill}" $([ "${BENCH:-prefill}" = decode ] && echo "--contexts $LEN --tokens 16" || echo "--lengths $LEN") \
  --rounds 1 --out /tmp/ncu_kernel_bench >"$OUT/ncu_kernel_run.txt" 2>&1
echo "ncu rc=$?"
"$NCU" -i /tmp/ncu_kernel.ncu-rep --page details --csv >"$OUT/ncu_kernel_details.csv" 2>&1
"$NCU" -i /tmp/ncu_kernel.ncu-rep --page source --csv --print-source sass >"$OUT/ncu_kernel_source.csv" 2>&1
# The source page holds one section per profiled launch, each starting with a "Kernel Name" line.
python3 - "$OUT/ncu_kernel_source.csv" "$OUT" <<'PY'
import sys
lines = open(sys.argv[1], errors="replace").read().splitlines()
starts = [i for i, l in enumerate(lines) if l.startswith('"Kernel Name"')] + [len(lines)]
for n, (a, b) in enumerate(zip(starts, starts[1:])):
    open(f"{sys.argv[2]}/ncu_kernel_source_{n}.csv", "w").write("\n".join(lines[a:b]) + "\n")
    print(f"launch {n}: {lines[a][:150]}")
PY
for f in "$OUT"/ncu_kernel_source_*.csv; do
  [ -e "$f" ] || continue   # no launch matched (ncu's run log lists the demangled names, e.g. gemm_kernel<(int)64, ...)
  python3 "$HERE/ncu_stalls.py" "$f" 40 >"${f%.csv}_stalls.txt" 2>&1
  head -3 "${f%.csv}_stalls.txt"
done
