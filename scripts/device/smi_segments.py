#!/usr/bin/env python3
"""Summarise an nvidia-smi log (--query-gpu=timestamp,clocks.sm,...,power.draw,...,clocks_throttle_reasons.active
--format=csv -lms 20) as runs of one state: idle (SM clock below 1 GHz), full (busy, no throttle reason) or capped
(busy with the software power cap active, reason bit 0x4); per run its start, samples, mean power and SM clock range.
Columns are found by name, so the query's order does not matter. Usage: smi_segments.py smi.csv [min-samples]"""
import csv
import sys


def main():
    rows = list(csv.reader(open(sys.argv[1], errors="replace")))
    min_n = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    head = [h.strip().lower() for h in rows[0]]
    c_clk = next(i for i, h in enumerate(head) if h.startswith("clocks.current.sm") or h.startswith("clocks.sm"))
    c_pw = next(i for i, h in enumerate(head) if h.startswith("power.draw"))
    c_rs = next(i for i, h in enumerate(head) if "reasons" in h)
    runs = []
    for r in rows[1:]:
        try:
            t, clk, pw, rs = r[0].strip(), int(r[c_clk].split()[0]), float(r[c_pw].split()[0]), int(r[c_rs].strip(), 16)
        except (ValueError, IndexError):
            continue
        state = "idle" if clk < 1000 else ("capped" if rs & 0x4 else "full")
        if not runs or runs[-1][0] != state:
            runs.append([state, t, []])
        runs[-1][2].append((clk, pw))
    print(f"{'state':7} {'start':24} {'samples':>7} {'mean W':>7} {'SM MHz min-max':>15}")
    for state, t, s in runs:
        if len(s) < min_n:
            continue
        clks = [c for c, _ in s]
        print(f"{state:7} {t:24} {len(s):7d} {sum(p for _, p in s) / len(s):7.0f} {min(clks):7d}-{max(clks):<7d}")


if __name__ == "__main__":
    main()
