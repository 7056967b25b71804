#!/usr/bin/env python3
"""Merges benchmark runs of several engines into one BENCHMARK.md-shaped report: JSON, markdown, PNG.

Inputs (any number, any order; the engine is read from each file):
  * lily JSON from `lily bench prefill` / `lily bench decode` (BENCHMARK.md shape: a "results" list);
  * any other file in that shape (scripts/device/hf_bench.py writes engine "transformers");
  * llama.cpp `llama-bench -o json` output (a list of tests; `-o jsonl` also works): a test with
    n_gen == 0 is prefill at length n_prompt, a test with n_prompt == 0 is decode of n_gen tokens
    at depth n_depth (context length); others (pp at a depth, pg) are ignored.
Outputs OUT/TAG.json (BENCHMARK.md shape, plus "summary", "ablations", "sources"), OUT/TAG.md and
OUT/TAG.png (a panel per phase with results, prefill and/or decode tok/s vs length, log2 x-axis, one line per engine).

Ratio per length = lily tok/s / baseline tok/s (medians, all optimizations on); headline = the
arithmetic mean of the per-length ratios over the lengths both engines measured, plus "faster at
every length" (every compared ratio > 1, and said whether all ten protocol lengths were compared).

With --kernels FILE.md (repeatable; a `lily bench prefill --profile-length` or `lily bench decode` markdown file)
the report also carries each file's per-op table (time, share, achieved TFLOP/s or GB/s) with the ceiling that file
measured or assumed (the decode run's device-to-device copy bandwidth, the prefill table's "% of" matrix rate).

Usage: bench_report.py FILE... [--out DIR] [--tag NAME] [--kernels FILE.md]...
"""
import argparse
import datetime
import json
import pathlib
import re
import statistics
import sys

PROTOCOL_LENGTHS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
PHASES = ("prefill", "decode")
ENGINE_ORDER = ["lily", "llama.cpp", "transformers", "mlx-lm"]   # table and legend order


def engine_key(name):
    return (ENGINE_ORDER.index(name) if name in ENGINE_ORDER else len(ENGINE_ORDER), name)


def _stats(samples):
    samples = [float(x) for x in samples]
    return {"tok_s_median": statistics.median(samples), "tok_s_min": min(samples),
            "tok_s_max": max(samples), "rounds": len(samples)}


def from_llama_bench(tests, path):
    """llama-bench JSON tests -> (results, meta)."""
    results, meta = [], {}
    for t in tests:
        n_p, n_g, depth = int(t.get("n_prompt", 0)), int(t.get("n_gen", 0)), int(t.get("n_depth", 0) or 0)
        if n_g == 0 and n_p > 0 and depth == 0:
            phase, length = "prefill", n_p
        elif n_p == 0 and n_g > 0:
            phase, length = "decode", depth
        else:
            continue
        samples = t.get("samples_ts") or [t["avg_ts"]]
        r = {"engine": "llama.cpp", "phase": phase, "length": length, **_stats(samples), "ablate": []}
        if phase == "decode":
            r["tokens"] = n_g
        for k in ("n_ubatch", "n_batch", "flash_attn", "n_gpu_layers", "type_k", "type_v"):
            if k in t:
                r[k] = t[k]
        results.append(r)
        for k, mk in (("build_commit", "commit"), ("build_number", "build_number"), ("gpu_info", "machine"),
                      ("cpu_info", "host"), ("model_type", "model"), ("model_size", "model_size_bytes"),
                      ("model_filename", "model_file"), ("test_time", "date"), ("backends", "backends")):
            if k in t and mk not in meta:
                meta[mk] = t[k]
    if not results:
        raise ValueError(f"{path}: llama-bench output without a plain prefill or decode test")
    meta["command"] = "llama-bench -o json"
    return results, meta


def load_source(path):
    """One input file -> (results, meta). Raises ValueError on an unknown shape."""
    path = pathlib.Path(path)
    text = path.read_text().strip()
    if not text:
        raise ValueError(f"{path}: empty")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = [json.loads(line) for line in text.splitlines() if line.strip()]   # jsonl
    if isinstance(doc, dict) and "results" in doc:
        meta = {k: v for k, v in doc.items() if k != "results" and not isinstance(v, (list, dict))}
        results = []
        for r in doc["results"]:
            missing = [k for k in ("engine", "phase", "length", "tok_s_median") if k not in r]
            if missing:
                raise ValueError(f"{path}: result without {missing}: {r}")
            if r.get("error"):          # e.g. an OOM recorded by hf_bench.py: a note, not a table row
                meta.setdefault("_errors", []).append(f"{r['engine']} {r['phase']} {r['length']}: {r['error']}")
                continue
            if not r.get("ablate") and "chunk" in r and "chunk" in meta and r["chunk"] != meta["chunk"]:
                # a row of a chunk sweep (lily bench prefill --chunks): a tuning record, not a report row
                meta.setdefault("_errors", []).append(
                    f"{pathlib.Path(path).name}: {r['engine']} {r['phase']} {r['length']} at chunk {r['chunk']} (a chunk "
                    f"sweep row) left out: the report's rows run at chunk {meta['chunk']}")
                continue
            r = dict(r)
            r.setdefault("tok_s_min", r["tok_s_median"])
            r.setdefault("tok_s_max", r["tok_s_median"])
            r.setdefault("rounds", 1)
            r.setdefault("ablate", [])
            results.append(r)
        return results, meta
    if isinstance(doc, list) and all(isinstance(t, dict) and "avg_ts" in t for t in doc):
        return from_llama_bench(doc, path)
    raise ValueError(f"{path}: neither a BENCHMARK.md-shaped JSON nor llama-bench output")


def merge(sources, every=None):
    """[(path, results, meta)] -> (results, engines meta, notes). Earlier files win on duplicates; `every` (a list)
    also receives the duplicates (each row with its source), for ablations matched within one file."""
    seen, merged, engines, notes = set(), [], {}, []
    for path, results, meta in sources:
        notes += meta.pop("_errors", [])
        for r in results:
            key = (r["engine"], r["phase"], int(r["length"]), tuple(r.get("ablate", [])))
            if every is not None:
                every.append(dict(r, source=str(path)))
            if key in seen:
                notes.append(f"{pathlib.Path(path).name}: duplicate {key}: the tables keep the earlier file's row (this "
                             "one is only the all-on of its own file's ablations)")
                continue
            seen.add(key)
            merged.append(dict(r, source=str(path)))
            e = engines.setdefault(r["engine"], {"sources": []})
            if str(path) not in e["sources"]:
                e["sources"].append(str(path))
                for k, v in meta.items():
                    e.setdefault(k, v)
    merged.sort(key=lambda r: (PHASES.index(r["phase"]) if r["phase"] in PHASES else 9, engine_key(r["engine"]),
                               len(r.get("ablate", [])), r.get("ablate", []), r["length"]))
    engines = {k: engines[k] for k in sorted(engines, key=engine_key)}
    return merged, engines, notes


def table(results, engine, phase, ablate=()):
    return {int(r["length"]): r for r in results
            if r["engine"] == engine and r["phase"] == phase and tuple(r.get("ablate", [])) == tuple(ablate)}


def summarize(results):
    """Per baseline and phase: ratio per length, mean ratio, faster at every length."""
    engines = sorted({r["engine"] for r in results} - {"lily"}, key=engine_key)
    out = {}
    for b in engines:
        for phase in PHASES:
            lily, base = table(results, "lily", phase), table(results, b, phase)
            common = sorted(set(lily) & set(base))
            if not common:
                continue
            ratios = {L: lily[L]["tok_s_median"] / base[L]["tok_s_median"] for L in common}
            out.setdefault(b, {})[phase] = {
                "ratio_per_length": {str(L): ratios[L] for L in common},
                "ratio_mean": sum(ratios.values()) / len(ratios),
                "faster_at_every_length": all(x > 1 for x in ratios.values()),
                "lengths_compared": len(common),
                "all_protocol_lengths": set(PROTOCOL_LENGTHS) <= set(common),
                "slowest_ratio_length": min(common, key=lambda L: ratios[L]),
            }
    return out


def ablations(results, every=()):
    """Each ablated lily variant against the all-on run of the same phase and length: the one measured in the same
    file (the same run, variants alternating: a matched ablation) when `every` holds it, else the report's all-on
    row (marked matched: False)."""
    rows = []
    for r in results:
        if r["engine"] != "lily" or not r.get("ablate"):
            continue
        same = [b for b in every if b.get("source") == r.get("source") and b["engine"] == "lily"
                and b["phase"] == r["phase"] and int(b["length"]) == int(r["length"]) and not b.get("ablate")]
        base = same[0] if same else table(results, "lily", r["phase"]).get(int(r["length"]))
        if not base:
            continue
        rows.append({"ablate": r["ablate"], "phase": r["phase"], "length": int(r["length"]),
                     "all_on_tok_s": base["tok_s_median"], "ablated_tok_s": r["tok_s_median"],
                     "speedup_from_optimization": base["tok_s_median"] / r["tok_s_median"],
                     "matched": bool(same), "source": pathlib.Path(r.get("source", "")).name})
    return rows


def fmt_ts(r):
    if r is None:
        return "—"
    return f"{r['tok_s_median']:,.1f} ({r['tok_s_min']:,.1f}–{r['tok_s_max']:,.1f})"


def markdown(doc):
    lines = [f"# Benchmark report ({doc['date']})", "",
             f"- machine: {doc['machine']}", f"- commit: {doc['commit']}", f"- model: {doc['model']}",
             f"- command: `{doc['command']}`", ""]
    lines += ["## Engines", "", "| engine | version / commit | command | date | files |", "|---|---|---|---|---|"]
    for name, e in doc["engines"].items():
        # An engine's own version first: a baseline's "commit" may be the lily commit of the script that ran it.
        ver = e.get("version") or e.get("commit") or e.get("transformers") or ""
        if e.get("version") and e.get("commit") and e["commit"] not in e["version"]:
            ver += f" (run by lily {e['commit']})"
        lines.append(f"| {name} | {ver} | `{e.get('command', '')}` | {e.get('date', '')} | "
                     f"{', '.join(pathlib.Path(s).name for s in e['sources'])} |")
    lines.append("")
    engines = [e for e in doc["engines"] if e != "lily"]
    summary = doc["summary"]
    for phase in PHASES:
        lily = table(doc["results"], "lily", phase)
        bases = {b: table(doc["results"], b, phase) for b in engines}
        bases = {b: t for b, t in bases.items() if t}
        if not lily and not bases:
            continue
        lengths = sorted(set(lily).union(*[set(t) for t in bases.values()]) if bases else set(lily))
        what = "prompt length" if phase == "prefill" else "context length"
        hdr = f"| {what} | lily tok/s (median, min–max) |"
        sep = "|---:|---:|"
        for b in bases:
            hdr += f" {b} tok/s | lily / {b} |"
            sep += "---:|---:|"
        mem = phase == "prefill" and any("peak_device_bytes" in r and r["peak_device_bytes"] for r in lily.values())
        if mem:
            hdr += " lily peak device MiB |"
            sep += "---:|"
        lines += [f"## {phase.capitalize()}", "", hdr, sep]
        for L in lengths:
            row = f"| {L:,} | {fmt_ts(lily.get(L))} |"
            for b, t in bases.items():
                ratio = summary.get(b, {}).get(phase, {}).get("ratio_per_length", {}).get(str(L))
                row += f" {fmt_ts(t.get(L))} | {'' if ratio is None else f'{ratio:.2f}'} |"
            if mem:
                pk = lily.get(L, {}).get("peak_device_bytes")
                row += f" {pk / 2**20:,.0f} |" if pk else " |"
            lines.append(row)
        lines.append("")
        for b in bases:
            s = summary.get(b, {}).get(phase)
            if s:
                lines.append(f"- {phase}, lily / {b}: mean ratio **{s['ratio_mean']:.2f}** over {s['lengths_compared']} "
                             f"lengths; faster at every length: **{'yes' if s['faster_at_every_length'] else 'no'}**"
                             + ("" if s["all_protocol_lengths"] else " (not all ten protocol lengths compared)")
                             + f"; lowest ratio at {s['slowest_ratio_length']:,}.")
        lines.append("")
    if doc["ablations"]:
        lines += ["## Ablations (lily, one optimization off)", "",
                  "All on and without are medians of the same run (variants alternating per round) unless the row "
                  "says otherwise.", "",
                  "| switched off | phase | length | all on tok/s | without tok/s | speed-up from the optimization | run |",
                  "|---|---|---:|---:|---:|---:|---|"]
        for a in doc["ablations"]:
            run = a.get("source", "") if a.get("matched", True) else "all on from the main run (not matched)"
            lines.append(f"| {','.join(a['ablate'])} | {a['phase']} | {a['length']:,} | {a['all_on_tok_s']:,.1f} | "
                         f"{a['ablated_tok_s']:,.1f} | {a['speedup_from_optimization']:.2f}× | {run} |")
        lines.append("")
    lines += kernels_markdown(doc.get("kernels", []))
    extra = [f"- {name} {k.replace('_', ' ')}: {v}" for name, e in doc["engines"].items() for k, v in e.items()
             if k in ("expert_balance", "workspace_note", "gdn_kernel", "notes") and v]
    if extra or doc["notes"]:
        lines += ["## Notes", ""] + extra + [f"- {n}" for n in doc["notes"]] + [""]
    return "\n".join(lines) + "\n"


def kernel_tables(path):
    """The per-op table(s) of a lily bench markdown file, with its command, commit and ceiling lines."""
    lines = pathlib.Path(path).read_text().splitlines()
    meta = {"source": pathlib.Path(path).name, "command": "", "commit": "", "ceilings": [], "tables": []}
    for ln in lines:
        m = re.match(r"- (command|commit): (.*)", ln)
        if m:
            meta[m.group(1)] = m.group(2).strip().strip("`")
        elif ln.startswith("- ") and any(k in ln for k in ("copy:", "copy bandwidth", "power limit", "floor")):
            meta["ceilings"].append(ln[2:])
    heading = ""
    i = 0
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("## "):
            heading = ln[3:].strip()
        if ln.startswith("| op"):
            table = []
            while i < len(lines) and lines[i].startswith("|"):
                table.append(lines[i])
                i += 1
            m = re.search(r"% of ([0-9.,]+)", table[0])
            if m:
                meta["ceilings"].append(f"matrix rate ceiling {m.group(1)} TFLOP/s (the bf16 tensor-core rate the run "
                                        "was given, `--peak-tflops`)")
            meta["tables"].append({"heading": heading, "rows": table})
            continue
        i += 1
    if not meta["tables"]:
        raise ValueError(f"{path}: no per-op table (a line starting with '| op')")
    return meta


def kernels_markdown(kernels):
    if not kernels:
        return []
    out = ["## Main kernels: achieved rate against the measured ceilings", ""]
    for k in kernels:
        out.append(f"From `{k['source']}` (commit {k['commit'] or '?'}; `{k['command']}`).")
        out += [""] + [f"- ceiling: {c}" for c in k["ceilings"]] + [""]
        for t in k["tables"]:
            if t["heading"]:
                out += [f"*{t['heading']}*", ""]
            out += t["rows"] + [""]
    return out


def plot(doc, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    engines = list(doc["engines"])
    # One panel per phase that has results (a prefill-only report gets no empty decode panel).
    phases = [ph for ph in PHASES if any(table(doc["results"], e, ph) for e in engines)] or list(PHASES)
    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4.5), squeeze=False)
    styles = ["o-", "s--", "^-.", "d:", "v-"]
    for ax, phase in zip(axes[0], phases):
        for i, e in enumerate(engines):
            rs = sorted(table(doc["results"], e, phase).values(), key=lambda r: r["length"])
            if not rs:
                continue
            ax.errorbar([r["length"] for r in rs], [r["tok_s_median"] for r in rs],
                        yerr=[[r["tok_s_median"] - r["tok_s_min"] for r in rs],
                              [r["tok_s_max"] - r["tok_s_median"] for r in rs]],
                        fmt=styles[i % len(styles)], label=e, capsize=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt length (tokens)" if phase == "prefill" else "context length (tokens)")
        ax.set_ylabel("tok/s")
        ax.set_title(f"{phase} ({doc['machine']})", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(doc["model"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def build(paths, command="", versions=None):
    """versions: {engine: version} for engines whose own output lacks it (a llama.cpp built from a
    source archive reports build_commit "unknown"); it replaces a missing or "unknown" commit."""
    sources = []
    for p in paths:
        results, meta = load_source(p)
        sources.append((p, results, meta))
    every = []
    results, engines, notes = merge(sources, every)
    for name, ver in (versions or {}).items():
        if name in engines and engines[name].get("commit") in (None, "", "unknown"):
            engines[name]["commit"] = ver
    if not results:
        raise ValueError("no results in the inputs")
    lily = engines.get("lily", {})
    first = lily or next(iter(engines.values()))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {"date": date, "machine": first.get("machine", "unknown"), "commit": lily.get("commit", ""),
            "command": command, "model": first.get("model", ""), "engines": engines,
            "results": results, "summary": summarize(results), "ablations": ablations(results, every),
            "notes": notes}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="result files (lily, llama-bench, hf_bench.py)")
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--tag", default="report")
    ap.add_argument("--skip-missing", action="store_true", help="ignore inputs that do not exist or do not parse")
    ap.add_argument("--note", action="append", default=[], metavar="TEXT", help="a line for the report's notes")
    ap.add_argument("--kernels", action="append", default=[], metavar="FILE.md",
                    help="a lily bench markdown file whose per-op table (achieved rates) goes into the report")
    ap.add_argument("--version", action="append", default=[], metavar="ENGINE=VER",
                    help="version of an engine whose output says 'unknown' (e.g. llama.cpp=0c1e57098)")
    args = ap.parse_args()
    versions = {}
    for v in args.version:
        if "=" not in v:
            ap.error(f"--version wants ENGINE=VER, got {v!r}")
        k, val = v.split("=", 1)
        versions[k] = val
    paths = []
    for p in args.inputs:
        try:
            load_source(p)
            paths.append(p)
        except (OSError, ValueError) as e:
            if not args.skip_missing:
                raise
            print(f"skipped {p}: {e}", file=sys.stderr)
    doc = build(paths, " ".join(["scripts/bench_report.py"] + sys.argv[1:]), versions)
    doc["kernels"] = [kernel_tables(k) for k in args.kernels]
    doc["notes"] = list(args.note) + doc["notes"]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = markdown(doc)
    (out / f"{args.tag}.md").write_text(md)
    plot(doc, out / f"{args.tag}.png")
    print(md)


if __name__ == "__main__":
    main()
