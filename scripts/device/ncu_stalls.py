#!/usr/bin/env python3
"""Summarises an Nsight Compute source page (ncu -i REP --page source --csv --print-source sass): the warp-stall
samples by reason over the whole kernel, its executed instructions, and the N SASS lines with the most samples
(address, instruction, top three reasons). Usage: ncu_stalls.py SOURCE.csv [N]. Written in session 13
(docs/CUDA.md); scripts/device/ncu_kernel.sh produces its input."""
import csv, io, sys
lines = open(sys.argv[1], errors="replace").read().splitlines()
i = next(k for k, l in enumerate(lines) if l.startswith('"Address"'))
rows = list(csv.reader(io.StringIO("\n".join(lines[i:]))))
hdr = rows[0]
def num(v):
    try: return float(v.replace(",", ""))
    except ValueError: return 0.0
body, seen = [], set()
for r in rows[1:]:   # ncu may print a line twice; keep one per address
    if len(r) == len(hdr) and r[0] not in seen:
        seen.add(r[0])
        body.append(r)
col = hdr.index("Warp Stall Sampling (All Samples)")
total = sum(num(r[col]) for r in body) or 1
print(f"{len(body)} sass rows, {total:.0f} samples")
sc = [j for j, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
agg = {hdr[j]: sum(num(r[j]) for r in body) for j in sc}
st = sum(agg.values()) or 1
print("  ".join(f"{k[6:]} {100*v/st:.1f}%" for k, v in sorted(agg.items(), key=lambda kv: -kv[1]) if v > 0.005*st))
ie = hdr.index("Instructions Executed")
print("instructions executed:", sum(num(r[ie]) for r in body))
n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
for r in sorted(body, key=lambda r: -num(r[col]))[:n]:
    top = sorted(((hdr[j][6:], num(r[j])) for j in sc), key=lambda kv: -kv[1])[:3]
    print(f"{100*num(r[col])/total:5.1f}% {r[0]} {r[1][:80]:80s} " + " ".join(f"{k}:{int(v)}" for k, v in top))
