#!/bin/bash
# A change that has no runtime switch (a compile-time form, e.g. D52: -DLILY_SB_EAGER builds the form without it) measured against the
# default build in one device call: builds the default binary (lib.sh, $B) and a variant with
# EXTRA_CUDA_FLAGS=$FLAGS_B ($B_B), then ROUNDS rounds of `bench decode --rounds 1` per binary, the order of the
# two alternating per round; prints per context each round's tok/s and the medians.
# Usage: FLAGS_B=-DLILY_SB_EAGER [CONTEXTS=4096,32768,131072] [ROUNDS=3] [OUT=dir] [LILY_COMMIT=rev]
#   bash scripts/device/two_binary_ab.sh
FLAGS_B=${FLAGS_B:?FLAGS_B names the variant build\'s CUDA flags}
C=${LILY_COMMIT:-unknown}
source "$(dirname "$0")/lib.sh"
B_B=${B_B:-/root/work/build_b}
EXTRA_CUDA_FLAGS="$FLAGS_B" bash scripts/device/build.sh "$B_B" >"$OUT/build_b.txt" 2>&1 || { tail -20 "$OUT/build_b.txt"; exit 1; }
el "built variant ($FLAGS_B)"
CTX=${CONTEXTS:-4096,32768,131072}
for r in $(seq 1 "${ROUNDS:-3}"); do
  if (( r % 2 )); then order="A B"; else order="B A"; fi
  for v in $order; do
    bin=$L; [ "$v" = B ] && bin=$B_B/lily
    timeout 120 "$bin" bench decode --synthetic --contexts "$CTX" --tokens 128 --rounds 1 --out "$OUT" \
      --tag "tb_${v}_r$r" --commit "$C" >"$OUT/tb_${v}_r$r.txt" 2>&1
    grep -E "^\| [0-9]+ \| all on \|" "$OUT/tb_${v}_r$r.md" | awk -v v=$v -v r=$r -F'|' '{gsub(/ /,"",$2); gsub(/ /,"",$4); print v, r, $2, $4}' >>"$OUT/tb_all.txt"
  done
done
el "rounds done"
python3 - "$OUT/tb_all.txt" "$FLAGS_B" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
ctx = sorted({int(r[2]) for r in rows})
print(f"| context | default (A) tok/s, median | {sys.argv[2]} (B) | A / B | A rounds | B rounds |")
print("|---:|---:|---:|---:|---|---|")
for c in ctx:
    a = [float(r[3]) for r in rows if r[0] == "A" and int(r[2]) == c]
    b = [float(r[3]) for r in rows if r[0] == "B" and int(r[2]) == c]
    ma, mb = st.median(a), st.median(b)
    print(f"| {c} | {ma:.1f} | {mb:.1f} | {ma / mb:.4f} | {' / '.join(f'{x:.1f}' for x in a)} | {' / '.join(f'{x:.1f}' for x in b)} |")
PY
