#!/usr/bin/env python3
"""Summarise an nsys trace of `lily bench prefill` (nsys_prefill.sh): is the GPU or the host the pace?

Input: the csv exports of the cuda_gpu_trace and cuda_api_trace reports. Kernels are grouped into forwards (runs
with no gap above 2 ms between one kernel's end and the next one's start); for each forward of at least 50 kernels:
GPU span, sum of kernel durations, idle time between kernels, the largest gaps, the lag from each kernel's
launch call returning on the host to the kernel starting on the GPU (matched by correlation id), and the host's
span from the forward's first launch call to its last with the time spent inside CUDA API calls. Column names are
looked up by substring, so minor differences between nsys versions do not matter.
Usage: nsys_prefill.py GPU_TRACE.csv API_TRACE.csv
"""
import csv
import statistics
import sys


def rows(path):
    with open(path, newline="", errors="replace") as f:
        lines = f.read().splitlines()
    # nsys stats may print notes before the header: start at the first line with a Start column.
    start = next((i for i, l in enumerate(lines) if "Start" in l and "," in l), None)
    if start is None:
        return [], []
    r = list(csv.reader(lines[start:]))
    return r[0], r[1:]


def col(header, *keys):
    for k in keys:
        for i, h in enumerate(header):
            if k.lower() in h.lower():
                return i
    raise KeyError(f"no column like {keys} in {header}")


def main():
    gh, g = rows(sys.argv[1])
    ah, a = rows(sys.argv[2]) if len(sys.argv) > 2 else ([], [])
    if not g:
        print("nsys_prefill: empty GPU trace")
        return
    gs, gd, gc, gn = col(gh, "Start"), col(gh, "Duration"), col(gh, "CorrId", "Corr"), col(gh, "Name")
    kern = []   # (start, end, corr, name): kernels only (memcpy / memset rows have no grid)
    grid = next((i for i, h in enumerate(gh) if "grd" in h.lower() or "grid" in h.lower()), None)
    for r in g:
        try:
            s, d = int(float(r[gs])), int(float(r[gd]))
        except (ValueError, IndexError):
            continue
        if grid is not None and not r[grid].strip():
            continue
        kern.append((s, s + d, r[gc], r[gn]))
    kern.sort()
    launch_end, launch_start = {}, {}
    api = []   # (start, end, name): every CUDA API call of the host thread(s)
    if a:
        as_, ad, ac, an = col(ah, "Start"), col(ah, "Duration"), col(ah, "CorrId", "Corr"), col(ah, "Name")
        for r in a:
            try:
                st, en = int(float(r[as_])), int(float(r[as_])) + int(float(r[ad]))
            except (ValueError, IndexError):
                continue
            api.append((st, en, r[an]))
            if "Launch" in r[an]:
                launch_start[r[ac]], launch_end[r[ac]] = st, en
    groups, cur = [], [kern[0]]
    for k in kern[1:]:
        if k[0] - cur[-1][1] > 2_000_000:
            groups.append(cur)
            cur = []
        cur.append(k)
    groups.append(cur)
    print(f"{len(kern)} kernels, {len(groups)} groups (gap > 2 ms); forwards of >= 50 kernels:")
    for n, grp in enumerate(groups):
        if len(grp) < 50:
            continue
        span = grp[-1][1] - grp[0][0]
        busy = sum(e - s for s, e, _, _ in grp)
        gaps = [(grp[i + 1][0] - grp[i][1], grp[i][3], grp[i + 1][3]) for i in range(len(grp) - 1)]
        idle = sum(max(0, x) for x, _, _ in gaps)
        lags = [k[0] - launch_end[k[2]] for k in grp if k[2] in launch_end]
        print(f"forward {n}: {len(grp)} kernels, span {span / 1e6:.3f} ms, kernels {busy / 1e6:.3f} ms, "
              f"idle between kernels {idle / 1e6:.3f} ms (negative gaps = overlap, not counted)")
        if lags:
            q = statistics.quantiles(lags, n=10)
            print(f"  launch-return -> kernel-start lag: median {statistics.median(lags) / 1e3:.1f} us, "
                  f"p10 {q[0] / 1e3:.1f}, p90 {q[-1] / 1e3:.1f}, min {min(lags) / 1e3:.1f} us "
                  f"({len(lags)} matched; small lags with idle gaps = host-paced)")
        ls = [launch_start[k[2]] for k in grp if k[2] in launch_start]
        if ls:
            h0, h1 = min(ls), max(launch_end[k[2]] for k in grp if k[2] in launch_end)
            in_api = sum(e - s for s, e, _ in api if s >= h0 and e <= h1)
            print(f"  host: first launch call to last {(h1 - h0) / 1e6:.3f} ms, {in_api / 1e6:.3f} ms of it inside "
                  f"CUDA API calls; the GPU's last kernel ends {(grp[-1][1] - h1) / 1e6:.3f} ms after the last launch call")
        for x, p, nx in sorted(gaps, reverse=True)[:5]:
            print(f"  gap {x / 1e3:.1f} us: {p[:60]} -> {nx[:60]}")


if __name__ == "__main__":
    main()
