#!/bin/bash
# Where the persistent MoE decode kernel (D19) spends its time: Nsight Compute, full section set with
# source correlation, on one launch of moe_persist_kernel inside the replayed decode graph (full-size
# synthetic model, context 4096), then the SASS/CUDA source page with warp-stall samples per line as
# CSV and the 40 lines with the most stall samples. Written in session 3 for the next one: run after
# build.sh (the build has -lineinfo). Not yet run: the ncu page/print flags may need adjusting to the
# device's ncu version (its --help is saved to $OUT/ncu_help.txt for that).
# Usage: moe_profile.sh [build-dir] [kernel-regex]
set -o pipefail
export PATH=/usr/local/cuda/bin:$PATH
B=${1:-/root/work/build}
K=${2:-moe_persist}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
"$NCU" --help >"$OUT/ncu_help.txt" 2>&1
timeout 240 "$NCU" --kernel-name "regex:$K" --launch-skip 60 --launch-count 1 --set full --import-source yes \
  -f -o /tmp/moe_profile "$B/lily" bench decode --contexts 4096 --tokens 16 --rounds 1 --profile-context 0 \
  --out /tmp/moe_profile_bench >"$OUT/moe_profile_run.txt" 2>&1
echo "ncu profile rc=$?"
"$NCU" -i /tmp/moe_profile.ncu-rep --page details --csv >"$OUT/moe_profile_details.csv" 2>&1
echo "details rc=$?"
"$NCU" -i /tmp/moe_profile.ncu-rep --page source --csv --print-source cuda,sass >"$OUT/moe_profile_source.csv" 2>&1 ||
  "$NCU" -i /tmp/moe_profile.ncu-rep --page source --csv >"$OUT/moe_profile_source.csv" 2>&1
echo "source rc=$?"
python3 - "$OUT/moe_profile_source.csv" <<'PY'
import csv, io, sys
txt = open(sys.argv[1], errors="replace").read()
start = txt.find('"')
rows = list(csv.reader(io.StringIO(txt[start:]))) if start >= 0 else []
if not rows:
    sys.exit("no CSV rows in the source page")
hdr = rows[0]
col = next((i for i, h in enumerate(hdr) if "Stall" in h and "Sampl" in h), None)
if col is None:
    sys.exit(f"no stall-sample column; columns: {hdr[:12]}")
def num(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0
body = [r for r in rows[1:] if len(r) == len(hdr)]
total = sum(num(r[col]) for r in body) or 1.0
print(f"{len(body)} source rows, {total:.0f} stall samples ({hdr[col]})")
for r in sorted(body, key=lambda r: -num(r[col]))[:40]:
    print(f"{100 * num(r[col]) / total:5.1f}%  " + " | ".join(c[:90] for c in r[:3]))
PY
