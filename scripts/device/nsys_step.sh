#!/bin/bash
# Per-kernel times inside the replayed decode graph (Nsight Systems, --cuda-graph-trace=node: the
# kernels run as in production, PDL overlap included, unlike ncu_step.sh which serialises them):
# bench decode at context 4096 (full-size synthetic model), then the kernel summary as CSV in
# $OUT/nsys_step_cuda_gpu_kern_sum.csv. Instances / tokens = calls per token. Run after build.sh.
# Usage: nsys_step.sh [build-dir] [context]
set -o pipefail
export PATH=/usr/local/cuda/bin:$PATH
B=${1:-/root/work/build}
CTX=${2:-4096}
OUT=${OUT:-/tmp/out}
NSYS=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda*/bin/nsys 2>/dev/null | head -1)
[ -z "$NSYS" ] && { echo "nsys_step: nsys not found, skipped"; exit 0; }
mkdir -p "$OUT"
timeout 150 "$NSYS" profile --cuda-graph-trace=node -t cuda -o /tmp/nsys_step --force-overwrite true \
  "$B/lily" bench decode --contexts "$CTX" --tokens 256 --rounds 1 --profile-context 0 --out /tmp/nsys_bench \
  >"$OUT/nsys_profile.txt" 2>&1
echo "nsys profile rc=$?"
timeout 90 "$NSYS" stats --report cuda_gpu_kern_sum --format csv -o "$OUT/nsys_step" /tmp/nsys_step.nsys-rep \
  >>"$OUT/nsys_profile.txt" 2>&1
echo "nsys stats rc=$?"
head -30 "$OUT"/nsys_step*kern_sum*.csv 2>/dev/null | cut -c1-220
