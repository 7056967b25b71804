#!/bin/bash
# One device call: when do the split-KV decode kernel's K rows arrive (trace phase 5, µs after the kernel's first CTA
# entered) under each prefetch arrangement? A 4K decode trace per variant: the defaults; D43 off (no K / V prefetch,
# the loads alone); D13 off (no weight prefetch anywhere); the attention's o_proj prefetch skipped (LILY_PF_SKIP=2);
# D73 (the K / V prefetch as two bulk copies per CTA). Prints each variant's attn.split table and step time.
# Usage: [OUT=dir] [LILY_COMMIT=rev] bash scripts/device/attn_kv_probe.sh
C=${LILY_COMMIT:-unknown}
source "$(dirname "$0")/lib.sh"
probe() {   # name, then env assignments / bench args
  local name=$1; shift
  env LILY_KERNEL_TRACE=1 "$@" timeout 60 "$L" bench decode --synthetic --contexts 4096 --tokens 64 --rounds 1 \
    --out "$OUT" --tag "probe_$name" --commit "$C" >"$OUT/probe_$name.txt" 2>&1
  el "probe $name rc=$?"
  grep -E "^\| 4096 \|" "$OUT/probe_$name.md"
  sed -n '/attn.split (/,/^$/p' "$OUT/probe_$name.md"
}
probe defaults
probe d43off LILY_ABLATE=D43
probe d13off LILY_ABLATE=D13
probe pfskip2 LILY_PF_SKIP=2
probe d73 LILY_TRY=D73
