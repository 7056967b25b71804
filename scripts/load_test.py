#!/usr/bin/env python3
"""Server load test (a benchmark script, not a CI test): starts `lily serve` on a model, sends N
sequential and then C concurrent streamed chat completions with the official openai client, and
reports errors, latency and the server's RSS before and after.

Usage: scripts/load_test.py --lily-bin build/lily [--model DIR] [--sequential 100] [--concurrent 16]
                            [--max-tokens 16] [--out docs/benchmarks]
Without --model it writes the built-in demo model to a temporary directory.
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request

from openai import OpenAI


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_healthy(url, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit("server exited during start-up")
        try:
            with urllib.request.urlopen(url + "/health") as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.1)
    raise SystemExit("server did not become healthy")


def one_request(client, model, i, max_tokens):
    t0 = time.time()
    text, usage = "", None
    stream = client.chat.completions.create(
        model=model, stream=True, max_tokens=max_tokens, seed=i,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": f"Request {i}: tell me something."}])
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += (c.delta.content or "") + (getattr(c.delta, "reasoning_content", None) or "")
    if usage is None or usage.completion_tokens < 1:
        raise RuntimeError(f"request {i}: no usage / no tokens")
    return time.time() - t0, usage.completion_tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lily-bin", default="build/lily")
    ap.add_argument("--model")
    ap.add_argument("--sequential", type=int, default=100)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--server-args", default="", help="extra lily serve arguments, e.g. '--cache-mb 64'")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if not model:
        model = os.path.join(tmp.name, "demo")
        subprocess.run([args.lily_bin, "make-demo", "--out", model], check=True, capture_output=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([args.lily_bin, "serve", "--model", model, "--port", str(port), "--quiet"]
                            + args.server_args.split(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc)
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        served = client.models.list().data[0].id
        one_request(client, served, -1, args.max_tokens)   # warm-up
        rss_before = rss_mib(proc.pid)
        errors, seq_lat, tokens = [], [], 0
        t0 = time.time()
        for i in range(args.sequential):
            try:
                lat, n = one_request(client, served, i, args.max_tokens)
                seq_lat.append(lat)
                tokens += n
            except Exception as e:  # counted and reported, never hidden
                errors.append(f"sequential {i}: {e}")
        seq_wall = time.time() - t0
        rss_mid = rss_mib(proc.pid)
        t1 = time.time()
        conc_lat = []
        with concurrent.futures.ThreadPoolExecutor(args.concurrent) as ex:
            futs = [ex.submit(one_request, client, served, 1000 + i, args.max_tokens) for i in range(args.concurrent)]
            for i, f in enumerate(futs):
                try:
                    lat, n = f.result()
                    conc_lat.append(lat)
                    tokens += n
                except Exception as e:
                    errors.append(f"concurrent {i}: {e}")
        conc_wall = time.time() - t1
        rss_after = rss_mib(proc.pid)
        alive = proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "commit": commit, "model": model if args.model else "built-in demo model",
        "command": "scripts/load_test.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v),
        "sequential": args.sequential, "concurrent": args.concurrent, "max_tokens": args.max_tokens,
        "errors": errors, "server_alive_after": alive, "completion_tokens": tokens,
        "sequential_wall_s": round(seq_wall, 2),
        "sequential_latency_s_median": round(statistics.median(seq_lat), 3) if seq_lat else None,
        "concurrent_wall_s": round(conc_wall, 2),
        "concurrent_latency_s_max": round(max(conc_lat), 3) if conc_lat else None,
        "rss_mib_before": round(rss_before, 1), "rss_mib_after_sequential": round(rss_mid, 1),
        "rss_mib_after": round(rss_after, 1),
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "-" + "".join(ch for ch in args.server_args if ch.isalnum()) if args.server_args else ""
    stem = out / f"server-load-{res['date'][:10]}{suffix}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    md = [f"# Server load test ({res['date']})", "",
          f"- machine: {res['machine']}; commit {commit}; model: {res['model']}",
          f"- command: `{res['command']}`", "",
          "| requests | wall s | latency s | errors | RSS MiB before → after |", "|---|---|---|---|---|",
          f"| {args.sequential} sequential streamed | {res['sequential_wall_s']} | median {res['sequential_latency_s_median']} | "
          f"{sum(e.startswith('sequential') for e in errors)} | {res['rss_mib_before']} → {res['rss_mib_after_sequential']} |",
          f"| {args.concurrent} concurrent streamed | {res['concurrent_wall_s']} | max {res['concurrent_latency_s_max']} | "
          f"{sum(e.startswith('concurrent') for e in errors)} | {res['rss_mib_after_sequential']} → {res['rss_mib_after']} |",
          "", f"Server alive afterwards: {alive}; completion tokens in all: {tokens}."]
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    if errors or not alive:
        raise SystemExit(f"{len(errors)} errors")


if __name__ == "__main__":
    main()
