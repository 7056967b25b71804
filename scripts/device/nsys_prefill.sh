#!/bin/bash
# Is the prefill paced by the GPU or by the host? Nsight Systems over a plain `bench prefill` (no per-op profile,
# no queue-filling spin: the run as measured), then nsys_prefill.py on the GPU kernel trace and the CUDA API trace:
# per forward (a run of kernels without a gap of more than 2 ms), the GPU span, the sum of kernel times, the idle
# time between kernels, and the lag from each launch call's return to its kernel's start (a queue kept ahead by the
# host shows lags of milliseconds; a host-paced one, lags of microseconds and idle gaps). Session 23's question
# (docs/CUDA.md): kernel savings of 1-2 ms per 4K prefill did not show in its wall time.
# Usage: nsys_prefill.sh [build-dir] [length]   (run after build.sh; results in $OUT)
set -o pipefail
export PATH=/usr/local/cuda/bin:$PATH
B=${1:-/root/work/build}
LEN=${2:-4096}
OUT=${OUT:-/tmp/out}
HERE=$(cd "$(dirname "$0")" && pwd)
NSYS=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda*/bin/nsys 2>/dev/null | head -1)
[ -z "$NSYS" ] && { echo "nsys_prefill: nsys not found, skipped"; exit 0; }
mkdir -p "$OUT"
timeout 200 "$NSYS" profile -t cuda -o /tmp/nsys_prefill --force-overwrite true \
  "$B/lily" bench prefill --synthetic --lengths "$LEN" --chunk 4096 --rounds 3 --out /tmp/nsys_prefill_bench \
  >"$OUT/nsys_prefill_run.txt" 2>&1
echo "nsys profile rc=$?"
for r in cuda_gpu_trace cuda_api_trace; do
  timeout 120 "$NSYS" stats --report "$r" --format csv -o "$OUT/nsys_prefill" /tmp/nsys_prefill.nsys-rep \
    >>"$OUT/nsys_prefill_run.txt" 2>&1
  echo "nsys stats $r rc=$?"
done
python3 "$HERE/nsys_prefill.py" "$OUT"/nsys_prefill_cuda_gpu_trace.csv "$OUT"/nsys_prefill_cuda_api_trace.csv \
  2>&1 | tee "$OUT/nsys_prefill_summary.txt"
