"""The built-in demo model (`lily make-demo`) checked against references nobody here wrote: Hugging
Face `tokenizers` must load and round-trip its tokenizer.json (and agree with `lily tokenize`), and
mlx-lm must load its weights and produce the same logits as `lily run` (f32 copy, tight bound)."""
import filecmp
import json
import pathlib
import subprocess
import time

import numpy as np
import pytest

TEXTS = [
    "Hello world, the engine reads a prompt and predicts the next token!",
    "  leading spaces, tabs\tand\nnew lines\r\n\n  ",
    "Numbers 12345 and 3.14159; punctuation?! (brackets) [x] {y}",
    "naïve café — Ünïcödé, 日本語のテキスト, ภาษาไทย, हिन्दी, emoji 🙂👍",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\nok\n</think>\n\nHello<|im_end|>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><tool_response>42</tool_response>",
    "I'm sure they'll say it's John's, we've done it, you'd see; DON'T SHOUT",
]


def make_demo(lily_bin, out, seed=0):
    t0 = time.monotonic()
    subprocess.run([lily_bin, "make-demo", "--out", str(out), "--seed", str(seed)], check=True,
                   capture_output=True, timeout=60)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def demo(lily_bin, tmp_path_factory):
    d = tmp_path_factory.mktemp("demo") / "model"
    make_demo(lily_bin, d)
    return d


def test_deterministic_and_fast(lily_bin, demo, tmp_path):
    secs = make_demo(lily_bin, tmp_path / "again")
    assert secs < 2.0
    cmp = filecmp.dircmp(demo, tmp_path / "again")
    assert sorted(cmp.common) == sorted(["config.json", "generation_config.json", "model.safetensors",
                                         "tokenizer.json", "tokenizer_config.json"])
    for f in cmp.common:
        assert filecmp.cmp(demo / f, tmp_path / "again" / f, shallow=False), f
    make_demo(lily_bin, tmp_path / "other", seed=5)
    assert not filecmp.cmp(demo / "model.safetensors", tmp_path / "other" / "model.safetensors", shallow=False)
    assert filecmp.cmp(demo / "tokenizer.json", tmp_path / "other" / "tokenizer.json", shallow=False)


def test_hf_tokenizers_loads_and_round_trips(demo):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(demo / "tokenizer.json"))
    cfg = json.loads((demo / "config.json").read_text())
    gen = json.loads((demo / "generation_config.json").read_text())
    assert tok.get_vocab_size(with_added_tokens=True) == cfg["text_config"]["vocab_size"]
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert gen["eos_token_id"] == [im_end, eot]
    assert cfg["text_config"]["eos_token_id"] == eot
    for t in TEXTS:
        ids = tok.encode(t).ids
        assert max(ids) < cfg["text_config"]["vocab_size"]
        assert tok.decode(ids, skip_special_tokens=False) == t
    # Specials are single ids; think/tool markers are not "special", so a skip-special decode keeps them.
    ids = tok.encode("<|im_start|>a<think>b</think><|im_end|>").ids
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == im_end
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b</think>"
    # The BPE merges actually apply (fewer tokens than bytes on ordinary English).
    english = TEXTS[0]
    assert len(tok.encode(english).ids) < 0.6 * len(english.encode())


def test_lily_tokenize_matches_hf(lily_bin, demo, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(demo / "tokenizer.json"))
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    p = subprocess.run([lily_bin, "tokenize", "--tokenizer", str(demo), "--input", str(inp)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    assert len(rows) == len(TEXTS)
    for t, r in zip(TEXTS, rows):
        assert r["ids"] == tok.encode(t).ids, t


def test_mlx_lm_loads_demo_and_agrees_with_lily(lily_bin, demo, tmp_path):
    pytest.importorskip("mlx_lm", reason="mlx-lm (pip install mlx[cpu] mlx-lm) is the reference here")
    import mlx.core as mx
    from mlx_lm import load

    # f32 copy (scales, biases and small tensors upcast) so both sides compute in f32.
    f32 = tmp_path / "demo_f32"
    f32.mkdir()
    for f in demo.iterdir():
        if f.suffix == ".json":
            (f32 / f.name).write_bytes(f.read_bytes())
    w = mx.load(str(demo / "model.safetensors"))
    mx.save_safetensors(str(f32 / "model.safetensors"),
                        {k: v.astype(mx.float32) if v.dtype == mx.bfloat16 else v for k, v in w.items()},
                        metadata={"format": "mlx"})
    prompt = [5, 77, 301, 12, 250, 9, 400, 33]
    model, _ = load(str(f32))
    ref = np.array(model(mx.array([prompt])).astype(mx.float32))[0]
    dump = tmp_path / "logits.bin"
    p = subprocess.run([lily_bin, "run", "--model", str(f32), "--prompt-ids", ",".join(map(str, prompt)), "-n", "1",
                        "--dump-logits", str(dump), "--quiet"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    got = np.fromfile(dump, dtype=np.float32).reshape(-1, ref.shape[-1])[: len(prompt)]
    assert np.isfinite(got).all()
    assert ref.std() > 1.0  # logits vary: the demo is not a constant model
    err = np.abs(got - ref).max()
    assert err < 1e-3 * max(1.0, np.abs(ref).max()), f"max |lily - mlx| = {err}"
    assert (got.argmax(-1) == ref.argmax(-1)).all()
