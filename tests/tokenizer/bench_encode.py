"""Encode throughput of lily vs HF `tokenizers`, single thread, on the same few-MB mixed text.

usage: python3 tests/tokenizer/bench_encode.py --lily-bin build/lily --tokenizer DIR_OR_JSON [--mb 4]
The text mixes Python sources of the installed standard library (code, English) with the seeded
multilingual corpus of the differential tests; it is written to a temporary file, never committed.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import sysconfig
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from tok_corpus import make_corpus  # noqa: E402


def build_text(mb):
    parts, size = [], 0
    multi = "\n".join(make_corpus(seed=4321, n=4000))
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for i, f in enumerate(sorted(stdlib.glob("*.py"))):
        parts.append(f.read_text(encoding="utf-8", errors="replace"))
        if i % 8 == 0:
            parts.append(multi[(i * 9973) % len(multi):][:20000])
        size = sum(len(p.encode()) for p in parts)
        if size >= mb * 1e6:
            break
    return "\n".join(parts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lily-bin", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    text = build_text(a.mb)
    nbytes = len(text.encode())
    tj = pathlib.Path(a.tokenizer)
    hf = Tokenizer.from_file(str(tj / "tokenizer.json" if tj.is_dir() else tj))
    times, cpu = [], []
    for _ in range(a.repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        ids = hf.encode(text, add_special_tokens=False).ids
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False) as f:
        f.write(text)
    try:
        out = subprocess.run([a.lily_bin, "tokenize", "--tokenizer", a.tokenizer, "--bench", f.name,
                              "--repeat", str(a.repeat)], capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    lily = json.loads(out.stdout)
    assert lily["tokens"] == len(ids), (lily["tokens"], len(ids))
    print(json.dumps({
        "bytes": nbytes, "tokens": len(ids),
        "hf_first_mb_per_s": round(nbytes / 1e6 / times[0], 2),
        "hf_best_mb_per_s": round(nbytes / 1e6 / min(times), 2),
        "hf_best_cpu_mb_per_s": round(nbytes / 1e6 / min(cpu), 2),
        "lily_first_mb_per_s": round(lily["first_mb_per_s"], 2),
        "lily_best_mb_per_s": round(lily["best_mb_per_s"], 2),
        "lily_best_cpu_mb_per_s": round(lily["best_cpu_mb_per_s"], 2)}))


if __name__ == "__main__":
    main()
