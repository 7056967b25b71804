"""`lily bench prefill` on the CPU backend (the path CI can run): valid BENCHMARK.md-shaped JSON,
the --max-seconds guard, and a report built from it by scripts/bench_report.py."""
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def bench_cmd(lily_bin, tmp_path):
    """`lily bench prefill` on the CPU backend over a fresh demo model (the caller adds lengths, rounds, ...)."""
    demo = tmp_path / "demo"
    subprocess.run([lily_bin, "make-demo", "--out", str(demo)], check=True, capture_output=True)
    return [lily_bin, "bench", "prefill", "--backend", "cpu", "--threads", "2", "--model", str(demo)]


def test_bench_prefill_cpu_json(lily_bin, tmp_path):
    cmd = bench_cmd(lily_bin, tmp_path) + [
        "--lengths", "16,32", "--rounds", "3", "--decode-tokens", "2", "--ablate", "D1",
        "--out", str(tmp_path), "--tag", "p", "--commit", 'quote"and\\backslash']
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["commit"] == 'quote"and\\backslash'
    assert doc["chunk"] == 512 and doc["skipped_lengths"] == []
    rows = doc["results"]
    assert len(rows) == 2 * 2 * 2   # phases x lengths x variants
    for r in rows:
        assert r["engine"] == "lily" and r["rounds"] == 3 and r["tok_s_min"] <= r["tok_s_median"] <= r["tok_s_max"]
    assert {tuple(r["ablate"]) for r in rows} == {(), ("D1",)}

    # A budget that the first length already spends: the first still runs, the second is skipped.
    cmd2 = cmd[:cmd.index("--lengths")] + ["--lengths", "16,4096", "--rounds", "1", "--max-seconds", "1e-6",
                                           "--out", str(tmp_path), "--tag", "q"]
    subprocess.run(cmd2, check=True, capture_output=True, timeout=300)
    doc2 = json.loads((tmp_path / "q.json").read_text())
    assert doc2["skipped_lengths"] == [4096] and [r["length"] for r in doc2["results"]] == [16]

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_report.py"), str(tmp_path / "p.json"),
                          "--out", str(tmp_path), "--tag", "r"], check=True, capture_output=True, text=True)
    assert "## Ablations" in out.stdout


def run_small(lily_bin, tmp_path, tag, *args):
    """`lily bench prefill` at 16 and 48 tokens, one round, chunk 16, plus `args`; returns its JSON document."""
    cmd = bench_cmd(lily_bin, tmp_path) + ["--lengths", "16,48", "--rounds", "1", "--chunk", "16", *args,
                                           "--out", str(tmp_path), "--tag", tag, "--commit", "t"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    doc = json.loads((tmp_path / f"{tag}.json").read_text())
    assert doc["chunk"] == 16
    return doc


def test_bench_prefill_p5_off_is_one_chunk(lily_bin, tmp_path):
    # --ablate P5: the variant runs a model whose chunk is the longest length (the whole prompt in one forward call).
    doc = run_small(lily_bin, tmp_path, "p5", "--ablate", "P5")
    assert {(r["length"], tuple(r["ablate"]), r["chunk"]) for r in doc["results"]} == {
        (16, (), 16), (48, (), 16), (16, ("P5",), 48), (48, ("P5",), 48)}
    md = (tmp_path / "p5.md").read_text()
    assert "- P5 off: the whole prompt as one chunk (a model with buffers and workspace for 48 tokens)" in md


def test_bench_prefill_chunk_sweep(lily_bin, tmp_path):
    # --chunks: each extra chunk size is its own variant (its own model), matched against --chunk in the same rounds;
    # the report leaves those rows out (they are a tuning record, not the engine's configuration).
    doc = run_small(lily_bin, tmp_path, "ch", "--chunks", "16,32,48")
    assert sorted((r["length"], r["chunk"]) for r in doc["results"]) == [
        (16, 16), (16, 32), (16, 48), (48, 16), (48, 32), (48, 48)]
    assert all(r["ablate"] == [] for r in doc["results"])
    md = (tmp_path / "ch.md").read_text()
    assert "| prefill | 48 | chunk 32 |" in md and "| prefill | 48 | all on |" in md
    # Another chunk only moves where the prompt is cut: the last-token logits agree with the --chunk run's.
    for r in doc["results"]:
        if r["chunk"] != 16:
            assert r["logits_cosine_vs_first"] >= 0.9999 and r["argmax_same_as_first"], r
    assert "chunk 48 at 48: cosine" in md
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_report.py"), str(tmp_path / "ch.json"),
                    "--out", str(tmp_path), "--tag", "r"], check=True, capture_output=True, text=True)
    rep = json.loads((tmp_path / "r.json").read_text())
    assert sorted(r["length"] for r in rep["results"] if r["engine"] == "lily") == [16, 48]
    assert "at chunk 32 (a chunk sweep row) left out" in (tmp_path / "r.md").read_text()
