#!/usr/bin/env python3
"""CPU throughput, lily vs mlx-lm (mlx[cpu]) side by side on the same MLX 4-bit checkpoint bytes.

For each model (built with scripts/make_tiny_models.py's own machinery if absent) and each round,
both engines run every prompt length, in alternating order (round 0 lily first, round 1 mlx-lm
first, ...). Per length: prefill tok/s (wall time from the first token fed to the last prompt
token's logits), then decode tok/s of N greedy tokens after that context. lily runs as
`lily bench prefill --rounds 1` (its own warm-up per length, fresh state); mlx-lm runs in this
process through its model call with the prompt cache (prefill in steps of mlx-lm's default 2048,
cache state evaluated after each step, as generate_step does) and its own generate_step for decode.
Both engines get the same token ids. CPU time (all threads) is recorded as a secondary metric
because the machine is shared. Writes OUT/TAG.json, OUT/TAG.md and OUT/TAG.png.

Usage: bench_cpu_vs_mlx.py --lily-bin build/lily [--models tiny-bf16,mini-bf16] [--lengths ...]
"""
import argparse
import datetime
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import make_tiny_models  # noqa: E402

MLX_PREFILL_STEP = 2048   # mlx_lm.generate's default prefill_step_size


def sh(cmd):
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()


def machine():
    model = sh("lscpu | sed -n 's/^Model name:[ ]*//p'") or "unknown cpu"
    return f"{model}, {os.cpu_count()} logical CPUs"


def mlx_prefill(model, ids):
    cache = make_prompt_cache(model)
    prompt = mx.array(ids)
    w0, c0 = time.perf_counter(), time.process_time()
    pos = 0
    while len(ids) - pos > MLX_PREFILL_STEP:
        model(prompt[pos:pos + MLX_PREFILL_STEP][None], cache=cache)
        mx.eval([c.state for c in cache])
        pos += MLX_PREFILL_STEP
    logits = model(prompt[pos:][None], cache=cache)[0, -1]
    mx.eval(logits)
    w1, c1 = time.perf_counter(), time.process_time()
    return cache, int(mx.argmax(logits).item()), w1 - w0, c1 - c0


def mlx_decode(model, cache, first, n):
    """n greedy tokens after `first` through mlx-lm's own generate_step (n forward steps, as lily)."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = []
    for tok, _ in generate_step(mx.array([first]), model, max_tokens=n, prompt_cache=cache):
        out.append(int(tok))
    w1, c1 = time.perf_counter(), time.process_time()
    mx.synchronize()   # generate_step leaves one speculative step in flight (not timed)
    assert len(out) == n, f"mlx-lm generated {len(out)} tokens, wanted {n}"
    return w1 - w0, c1 - c0


def run_mlx(model, ids, lengths, n_dec, warm):
    res = {}
    for L in lengths:
        if warm:   # short warm-up: mlx-lm on mlx[cpu] runs ~10 tok/s here, a full one would double the run
            cache, first, _, _ = mlx_prefill(model, ids[:min(L, 64)])
            mlx_decode(model, cache, first, min(n_dec, 4))
        cache, first, tp, cp = mlx_prefill(model, ids[:L])
        td, cd = mlx_decode(model, cache, first, n_dec)
        res[L] = {"prefill": (L / tp, cp), "decode": (n_dec / td, cd)}
        del cache
    return res


def run_lily(args, model_dir, ids_file, lengths, n_dec, out_dir):
    cmd = [args.lily_bin, "bench", "prefill", "--model", str(model_dir), "--backend", "cpu",
           "--threads", str(args.threads), "--lengths", ",".join(map(str, lengths)), "--rounds", "1",
           "--decode-tokens", str(n_dec), "--ids", str(ids_file), "--chunk", str(args.chunk),
           "--out", str(out_dir), "--tag", "lily"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    data = json.loads((pathlib.Path(out_dir) / "lily.json").read_text())
    res = {L: {} for L in lengths}
    peak = 0
    for r in data["results"]:
        res[r["length"]][r["phase"]] = (r["tok_s_median"], r["cpu_s_median"])
        peak = max(peak, r["peak_host_bytes"])
    return res, peak, " ".join(cmd)


def summarize(samples):
    v = [s[0] for s in samples]
    return {"tok_s_median": statistics.median(v), "tok_s_min": min(v), "tok_s_max": max(v),
            "cpu_s_median": statistics.median(s[1] for s in samples), "rounds": len(v),
            "tok_s_rounds": v}


def bench_model(args, name, tmp):
    model_dir = pathlib.Path(args.model_dir) / name
    if not (model_dir / "config.json").exists():
        print(f"building {name} in {model_dir}", file=sys.stderr)
        make_tiny_models.build_model(name, args.model_dir)
    lengths = [int(x) for x in args.lengths.split(",")]
    vocab = make_tiny_models.SPECS[name]["vocab"]
    ids = np.random.default_rng(args.seed).integers(0, vocab, max(lengths)).astype(np.int32)
    ids_file = pathlib.Path(tmp) / f"{name}-ids.bin"
    ids.tofile(ids_file)
    ids = ids.tolist()
    model, _ = load_model(model_dir)
    mx.eval(model.parameters())
    samples = {(e, p, L): [] for e in ("lily", "mlx-lm") for p in ("prefill", "decode") for L in lengths}
    loads, lily_peak, lily_cmd = [], 0, ""
    for r in range(args.rounds):
        order = ["lily", "mlx-lm"] if r % 2 == 0 else ["mlx-lm", "lily"]
        load0 = os.getloadavg()[0]
        for eng in order:
            t0 = time.time()
            if eng == "lily":
                res, peak, lily_cmd = run_lily(args, model_dir, ids_file, lengths, args.decode_tokens, tmp)
                lily_peak = max(lily_peak, peak)
            else:
                res = run_mlx(model, ids, lengths, args.decode_tokens, warm=(r == 0))
            for L in lengths:
                for p in ("prefill", "decode"):
                    samples[(eng, p, L)].append(res[L][p])
            print(f"{name} round {r} {eng}: {time.time() - t0:.1f} s  " +
                  "  ".join(f"{L}:{res[L]['prefill'][0]:.4g}/{res[L]['decode'][0]:.4g}" for L in lengths),
                  file=sys.stderr)
        loads.append([load0, os.getloadavg()[0]])
    results, ratios = [], {"prefill": {}, "decode": {}}
    for p in ("prefill", "decode"):
        for L in lengths:
            s = {e: summarize(samples[(e, p, L)]) for e in ("lily", "mlx-lm")}
            for e in ("lily", "mlx-lm"):
                results.append({"engine": e, "phase": p, "length": L, **s[e], "ablate": [],
                                **({"tokens": args.decode_tokens} if p == "decode" else {})})
            ratios[p][L] = {"wall": s["lily"]["tok_s_median"] / s["mlx-lm"]["tok_s_median"],
                            "cpu": s["mlx-lm"]["cpu_s_median"] / s["lily"]["cpu_s_median"]}
    summary = {}
    for p in ("prefill", "decode"):
        w = [ratios[p][L]["wall"] for L in lengths]
        c = [ratios[p][L]["cpu"] for L in lengths]
        summary[p] = {"ratio_wall_per_length": {str(L): ratios[p][L]["wall"] for L in lengths},
                      "ratio_cpu_time_per_length": {str(L): ratios[p][L]["cpu"] for L in lengths},
                      "ratio_wall_mean": sum(w) / len(w), "ratio_cpu_time_mean": sum(c) / len(c),
                      "faster_at_every_length": all(x > 1 for x in w)}
    return {"model": name, "model_dir": str(model_dir), "spec": make_tiny_models.SPECS[name],
            "lengths": lengths, "results": results, "summary": summary,
            "load_average_per_round": loads, "lily_peak_host_bytes": lily_peak,
            "mlx_process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "lily_command": lily_cmd}


def markdown(doc):
    out = [f"# CPU throughput: lily vs mlx-lm ({doc['date']})", "",
           f"- machine: {doc['machine']}", f"- commit: {doc['commit']}",
           f"- command: `{doc['command']}`", f"- baseline: mlx {doc['mlx_version']}, mlx-lm "
           f"{doc['mlx_lm_version']} (mlx[cpu]), same checkpoint files", f"- method: {doc['method']}", ""]
    for m in doc["models"]:
        s = m["spec"]
        out += [f"## {m['model']}", "",
                f"hidden {s['hidden']}, {s['layers']} layers, {s['experts']} experts (top {s['top_k']}), "
                f"expert inter {s['moe_inter']}, vocab {s['vocab']}, {s['dtype']} scales; MLX 4-bit group 64. "
                f"Load average (1 min) at start/end of each round: "
                + ", ".join(f"{a:.1f}/{b:.1f}" for a, b in m["load_average_per_round"]) + ".", ""]
        for p in ("prefill", "decode"):
            hdr = "prompt length" if p == "prefill" else f"context ({m['results'][-1].get('tokens', '')} tokens)"
            out += [f"### {p}", "",
                    f"| {hdr} | lily tok/s (median, min–max) | mlx-lm tok/s (median, min–max) | ratio (wall) "
                    "| lily CPU s | mlx-lm CPU s | ratio (CPU time) |", "|---:|---:|---:|---:|---:|---:|---:|"]
            rows = {(r["engine"], r["length"]): r for r in m["results"] if r["phase"] == p}
            sm = m["summary"][p]
            for L in m["lengths"]:
                a, b = rows[("lily", L)], rows[("mlx-lm", L)]
                out.append(f"| {L} | {a['tok_s_median']:.1f} ({a['tok_s_min']:.1f}–{a['tok_s_max']:.1f}) | "
                           f"{b['tok_s_median']:.1f} ({b['tok_s_min']:.1f}–{b['tok_s_max']:.1f}) | "
                           f"{sm['ratio_wall_per_length'][str(L)]:.2f} | {a['cpu_s_median']:.3f} | "
                           f"{b['cpu_s_median']:.3f} | {sm['ratio_cpu_time_per_length'][str(L)]:.2f} |")
            out += ["", f"Mean ratio lily / mlx-lm: {sm['ratio_wall_mean']:.2f} (wall), "
                    f"{sm['ratio_cpu_time_mean']:.2f} (CPU time). Faster at every length: "
                    f"{'yes' if sm['faster_at_every_length'] else 'no'}.", ""]
    return "\n".join(out) + "\n"


def plot(doc, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    fig, axes = plt.subplots(len(doc["models"]), 2, figsize=(11, 4 * len(doc["models"])), squeeze=False)
    for i, m in enumerate(doc["models"]):
        for j, p in enumerate(("prefill", "decode")):
            ax = axes[i][j]
            for e, style in (("lily", "o-"), ("mlx-lm", "s--")):
                rs = [r for r in m["results"] if r["engine"] == e and r["phase"] == p]
                ax.errorbar([r["length"] for r in rs], [r["tok_s_median"] for r in rs],
                            yerr=[[r["tok_s_median"] - r["tok_s_min"] for r in rs],
                                  [r["tok_s_max"] - r["tok_s_median"] for r in rs]],
                            fmt=style, label=e, capsize=3)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")   # the engines can differ by orders of magnitude
            ax.set_xlabel("prompt length" if p == "prefill" else "context length")
            ax.set_ylabel("tok/s")
            ax.set_title(f"{m['model']}: {p} (CPU)")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lily-bin", required=True)
    ap.add_argument("--models", default="tiny-bf16,mini-bf16")
    ap.add_argument("--model-dir", default="/tmp/lily-bench-models",
                    help="where the checkpoints are (built there if absent)")
    ap.add_argument("--lengths", default="256,512,1024,2048")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="lily CPU threads (0 = all)")
    ap.add_argument("--chunk", type=int, default=512, help="lily prefill chunk")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--tag", default=None, help="file stem (default cpu-DATE-COMMIT)")
    ap.add_argument("--replot", default=None, help="only redraw the PNG of this results JSON")
    args = ap.parse_args()
    if args.replot:
        path = pathlib.Path(args.replot)
        plot(json.loads(path.read_text()), path.with_suffix(".png"))
        return
    if args.rounds < 3:
        print("note: BENCHMARK.md asks for at least 3 rounds", file=sys.stderr)
    mx.set_default_device(mx.cpu)
    commit = sh(f"git -C {ROOT} rev-parse --short HEAD")
    date = datetime.datetime.now(datetime.timezone.utc)
    import mlx_lm
    doc = {"date": date.strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(), "commit": commit,
           "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
           "mlx_version": mx.__version__, "mlx_lm_version": mlx_lm.__version__,
           "method": "alternating engine order per round; prefill tok/s = L / wall time to the last "
                     "prompt token's logits (fresh state); decode tok/s = N greedy tokens after that "
                     "context; ratio (wall) = lily tok/s / mlx-lm tok/s; ratio (CPU time) = mlx-lm "
                     "CPU s / lily CPU s (> 1: lily needs less CPU time)",
           "models": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            doc["models"].append(bench_model(args, name, tmp))
    # Flat BENCHMARK.md shape as well: one results list over all models.
    doc["model"] = ", ".join(m["model"] for m in doc["models"])
    doc["results"] = [dict(r, model=m["model"]) for m in doc["models"] for r in m["results"]]
    stem = pathlib.Path(args.out) / (args.tag or f"cpu-{date:%Y-%m-%d}-{commit}")
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(doc))
    plot(doc, stem.with_suffix(".png"))
    print(markdown(doc))


if __name__ == "__main__":
    main()
