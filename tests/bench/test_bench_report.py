"""scripts/bench_report.py: merge of lily / llama-bench / BENCHMARK-shaped inputs, ratios, ablations.

Every number here is a made-up fixture (round values chosen so the expected ratios are exact); none
is a measurement.
"""
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import bench_report  # noqa: E402

LENGTHS = bench_report.PROTOCOL_LENGTHS


def lily_doc(phase, values, ablate_values=None, ablate_id="P1"):
    res = [{"engine": "lily", "phase": phase, "length": L, "tok_s_median": v, "tok_s_min": v * 0.9,
            "tok_s_max": v * 1.1, "rounds": 3, "ablate": [], "peak_device_bytes": 2 ** 30}
           for L, v in zip(LENGTHS, values)]
    for L, v in (ablate_values or {}).items():
        res.append({"engine": "lily", "phase": phase, "length": L, "tok_s_median": v, "tok_s_min": v,
                    "tok_s_max": v, "rounds": 3, "ablate": [ablate_id]})
    return {"date": "FIXTURE", "machine": "FIXTURE GPU", "commit": "abc1234", "command": "lily bench",
            "model": "FIXTURE model", "results": res}


def llama_tests(phase, values):
    out = []
    for L, v in zip(LENGTHS, values):
        t = {"build_commit": "llamafix", "gpu_info": "FIXTURE GPU", "model_type": "FIXTURE Q4_0",
             "n_ubatch": 2048, "flash_attn": True, "avg_ts": v, "stddev_ts": 0.0,
             "samples_ts": [v * 0.95, v, v * 1.05]}
        if phase == "prefill":
            t.update(n_prompt=L, n_gen=0, n_depth=0)
        else:
            t.update(n_prompt=0, n_gen=128, n_depth=L)
        out.append(t)
    # Tests the report must ignore: prompt processing at a depth, and a combined pp+tg test.
    out.append({"n_prompt": 512, "n_gen": 0, "n_depth": 4096, "avg_ts": 1.0, "samples_ts": [1.0]})
    out.append({"n_prompt": 512, "n_gen": 128, "n_depth": 0, "avg_ts": 1.0, "samples_ts": [1.0]})
    return out


@pytest.fixture
def inputs(tmp_path):
    lily_pre = [2000.0 * (i + 1) for i in range(10)]
    llama_pre = [1000.0 * (i + 1) for i in range(10)]          # lily / llama = 2.0 at every length
    lily_dec = [300.0] * 10
    llama_dec = [200.0] * 9 + [600.0]                          # 1.5 ... 1.5, then 0.5
    hf = {"date": "FIXTURE", "machine": "FIXTURE GPU", "commit": "", "command": "hf_bench.py",
          "model": "FIXTURE", "transformers": "0.0-fixture",
          "results": [{"engine": "transformers", "phase": "prefill", "length": 256, "tok_s_median": 500.0,
                       "tok_s_min": 400.0, "tok_s_max": 600.0, "rounds": 3, "ablate": []},
                      {"engine": "transformers", "phase": "prefill", "length": 131072, "tok_s_median": 0.0,
                       "rounds": 0, "ablate": [], "error": "OOM"}]}
    files = {
        "lily_prefill.json": lily_doc("prefill", lily_pre, {512: 2000.0}),
        "lily_decode.json": lily_doc("decode", lily_dec),
        "llama_prefill.json": llama_tests("prefill", llama_pre),
        "llama_decode.json": llama_tests("decode", llama_dec),
        "hf.json": hf,
    }
    paths = []
    for name, doc in files.items():
        p = tmp_path / name
        p.write_text(json.dumps(doc))
        paths.append(str(p))
    return paths


def test_llama_bench_conversion(inputs):
    results, meta = bench_report.load_source(inputs[2])
    assert len(results) == 10 and all(r["phase"] == "prefill" for r in results)
    r = results[0]
    assert r["engine"] == "llama.cpp" and r["length"] == 256
    assert r["tok_s_median"] == pytest.approx(1000.0)
    assert r["tok_s_min"] == pytest.approx(950.0) and r["tok_s_max"] == pytest.approx(1050.0)
    assert meta["commit"] == "llamafix"
    dec, _ = bench_report.load_source(inputs[3])
    assert [r["length"] for r in dec] == LENGTHS and all(r["tokens"] == 128 for r in dec)


def test_ratios_and_headline(inputs):
    doc = bench_report.build(inputs)
    s = doc["summary"]["llama.cpp"]
    pre, dec = s["prefill"], s["decode"]
    assert pre["lengths_compared"] == 10 and pre["all_protocol_lengths"]
    assert all(v == pytest.approx(2.0) for v in pre["ratio_per_length"].values())
    assert pre["ratio_mean"] == pytest.approx(2.0) and pre["faster_at_every_length"]
    assert dec["ratio_per_length"]["131072"] == pytest.approx(0.5)
    assert dec["ratio_mean"] == pytest.approx((9 * 1.5 + 0.5) / 10)
    assert not dec["faster_at_every_length"] and dec["slowest_ratio_length"] == 131072
    # transformers: only the 256 row (the OOM row is dropped), ratio 2000 / 500.
    t = doc["summary"]["transformers"]["prefill"]
    assert t["ratio_per_length"] == {"256": pytest.approx(4.0)} and not t["all_protocol_lengths"]
    assert "decode" not in doc["summary"]["transformers"]


def test_ablation_table(inputs):
    doc = bench_report.build(inputs)
    (a,) = doc["ablations"]
    assert a["ablate"] == ["P1"] and a["length"] == 512
    assert a["all_on_tok_s"] == pytest.approx(4000.0)
    assert a["speedup_from_optimization"] == pytest.approx(2.0)


def test_duplicates_keep_first(inputs, tmp_path):
    again = tmp_path / "again.json"
    again.write_text(json.dumps(lily_doc("prefill", [1.0] * 10)))
    doc = bench_report.build(inputs + [str(again)])
    lily = bench_report.table(doc["results"], "lily", "prefill")
    assert lily[256]["tok_s_median"] == pytest.approx(2000.0)
    assert any("duplicate" in n for n in doc["notes"])


def test_version_override_only_fills_unknown(inputs, tmp_path):
    doc = bench_report.build(inputs, versions={"llama.cpp": "0c1e570", "lily": "nope"})
    assert doc["engines"]["llama.cpp"]["commit"] == "llamafix"   # the file's own commit wins
    assert doc["engines"]["lily"]["commit"] != "nope"
    raw = json.loads(pathlib.Path(inputs[2]).read_text())
    for t in raw:
        t["build_commit"] = "unknown"
    p = tmp_path / "llama_unknown.json"
    p.write_text(json.dumps(raw))
    doc = bench_report.build([inputs[0], str(p)], versions={"llama.cpp": "0c1e570"})
    assert doc["engines"]["llama.cpp"]["commit"] == "0c1e570"


def test_rejects_unknown_shape(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"foo": 1}))
    with pytest.raises(ValueError):
        bench_report.load_source(p)


def test_command_line_writes_three_files(inputs, tmp_path):
    out = tmp_path / "out"
    missing = str(tmp_path / "absent.json")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_report.py"), *inputs, missing,
                    "--skip-missing", "--out", str(out), "--tag", "r.1"], check=True, capture_output=True)
    doc = json.loads((out / "r.1.json").read_text())
    for key in ("date", "machine", "commit", "command", "model", "results"):
        assert key in doc
    for r in doc["results"]:
        for key in ("engine", "phase", "length", "tok_s_median", "tok_s_min", "tok_s_max", "rounds", "ablate"):
            assert key in r
    md = (out / "r.1.md").read_text()
    assert "mean ratio **2.00**" in md and "faster at every length: **no**" in md
    pytest.importorskip("matplotlib")
    assert (out / "r.1.png").stat().st_size > 1000


KERNEL_MD = """# Decode benchmark (FIXTURE)

- commit: abc1234
- command: `lily bench decode --contexts 4096`
- device-to-device copy: 4000 GB/s (read+write); active weights 1.667 GB/token

| context | variant | tok/s (median) |
|---:|---|---:|
| 4096 | all on | 100.0 |

## Per-op time, one eager instrumented step at context 4096 (CUDA events)

| op | calls/token | ms/token | share | GB/s |
|---|---:|---:|---:|---:|
| moe | 40 | 0.5000 | 50.0% | 2000 |
| **sum of ops** | | 1.0000 | | |

Expert load balance: FIXTURE
"""

PREFILL_MD = """# Prefill benchmark (FIXTURE)

- commit: abc1234
- command: `lily bench prefill --profile-length 4096`
- GPU board power limit: 700 W (NVML)

| op (prefill of 4096 tokens) | calls | ms | share | useful TFLOP/s | % of 790 |
|---|---:|---:|---:|---:|---:|
| moe_prefill.down | 40 | 10.000 | 20.0% | 316.0 | 40.0% |
"""


def test_kernel_tables(inputs, tmp_path):
    dec = tmp_path / "dec.md"
    dec.write_text(KERNEL_MD)
    pre = tmp_path / "pre.md"
    pre.write_text(PREFILL_MD)
    k = bench_report.kernel_tables(dec)
    assert k["commit"] == "abc1234" and k["command"] == "lily bench decode --contexts 4096"
    assert k["ceilings"] == ["device-to-device copy: 4000 GB/s (read+write); active weights 1.667 GB/token"]
    assert len(k["tables"]) == 1 and k["tables"][0]["heading"].startswith("Per-op time")
    assert k["tables"][0]["rows"][2] == "| moe | 40 | 0.5000 | 50.0% | 2000 |" and len(k["tables"][0]["rows"]) == 4
    p = bench_report.kernel_tables(pre)
    assert p["ceilings"][0] == "GPU board power limit: 700 W (NVML)" and p["ceilings"][1].startswith(
        "matrix rate ceiling 790 TFLOP/s")
    bad = tmp_path / "bad.md"
    bad.write_text("# nothing\n\n| context | tok/s |\n")
    with pytest.raises(ValueError, match="no per-op table"):
        bench_report.kernel_tables(bad)
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_report.py"), *inputs, "--kernels", str(dec),
                    "--kernels", str(pre), "--note", "FIXTURE note", "--out", str(out), "--tag", "k"],
                   check=True, capture_output=True)
    md = (out / "k.md").read_text()
    assert "## Main kernels: achieved rate against the measured ceilings" in md
    assert "| moe_prefill.down | 40 | 10.000 | 20.0% | 316.0 | 40.0% |" in md and "4000 GB/s" in md
    assert len(json.loads((out / "k.json").read_text())["kernels"]) == 2 and "- FIXTURE note" in md


def test_ablation_matched_within_its_run(inputs, tmp_path):
    # An ablation run with its own all-on row: the speed-up uses that row, not the main sweep's (a matched ablation).
    abl = tmp_path / "ablate.json"
    doc = lily_doc("prefill", [], {2048: 3000.0})
    doc["results"].append({"engine": "lily", "phase": "prefill", "length": 2048, "tok_s_median": 6600.0,
                           "rounds": 3, "ablate": []})
    abl.write_text(json.dumps(doc))
    out = bench_report.build(inputs + [str(abl)])
    a = [x for x in out["ablations"] if x["length"] == 2048][0]
    assert a["all_on_tok_s"] == pytest.approx(6600.0) and a["matched"] and a["source"] == "ablate.json"
    assert a["speedup_from_optimization"] == pytest.approx(2.2)
    # the main sweep's all-on row stays the table's (the first file wins)
    assert bench_report.table(out["results"], "lily", "prefill")[2048]["tok_s_median"] == pytest.approx(8000.0)
    # the fixture's P1 row at 512 has its all-on in its own file (lily_prefill.json): matched there too
    b = [x for x in out["ablations"] if x["length"] == 512][0]
    assert b["matched"] and b["all_on_tok_s"] == pytest.approx(4000.0)


def test_ablation_without_its_own_all_on_is_marked(inputs, tmp_path):
    abl = tmp_path / "lone.json"
    abl.write_text(json.dumps(lily_doc("prefill", [], {1024: 3000.0}, ablate_id="P4")))
    out = bench_report.build(inputs + [str(abl)])
    a = [x for x in out["ablations"] if x["ablate"] == ["P4"]][0]
    assert not a["matched"] and a["all_on_tok_s"] == pytest.approx(6000.0)
    assert "not matched" in bench_report.markdown(out)


def test_baseline_version_before_the_lily_commit_that_ran_it(inputs, tmp_path):
    hf = tmp_path / "hf2.json"
    doc = json.loads(pathlib.Path(inputs[-1]).read_text())
    doc.update(version="transformers 9.9", commit="abc1234")
    hf.write_text(json.dumps(doc))
    md = bench_report.markdown(bench_report.build(inputs[:-1] + [str(hf)]))
    assert "| transformers | transformers 9.9 (run by lily abc1234) |" in md
    assert "| lily | abc1234 |" in md
