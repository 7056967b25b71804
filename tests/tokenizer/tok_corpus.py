"""Seeded generator of the tokenizer differential-test corpus (nothing large is committed).

The strings aim at the places where byte-level BPE tokenizers disagree: scripts with combining marks
(the Qwen3.5 `\\p{M}` rule), emoji and ZWJ sequences, long whitespace runs, digit runs, special-token
look-alikes and NFC/NFD variants.
"""
import random
import unicodedata

# Code point ranges per script; only code points Python's Unicode database knows are used, so the
# Unicode-version skew between ICU, Oniguruma and Python cannot produce false alarms.
SCRIPTS = {
    "thai": (0x0E01, 0x0E5B),
    "devanagari": (0x0900, 0x097F),
    "bengali": (0x0980, 0x09FE),
    "tamil": (0x0B82, 0x0BFA),
    "cjk": (0x4E00, 0x9FA5),
    "hiragana": (0x3041, 0x309F),
    "katakana": (0x30A0, 0x30FF),
    "hangul": (0xAC00, 0xD7A3),
    "jamo": (0x1100, 0x11FF),
    "arabic": (0x0600, 0x06FF),
    "hebrew": (0x0591, 0x05F4),
    "cyrillic": (0x0400, 0x04FF),
    "greek": (0x0370, 0x03FF),
    "latin_ext": (0x00C0, 0x024F),
    "georgian": (0x10A0, 0x10FF),
    "myanmar": (0x1000, 0x109F),
    "ethiopic": (0x1200, 0x137C),
    "math": (0x2200, 0x22FF),
    "fullwidth": (0xFF01, 0xFF5E),
}
COMBINING = [(0x0300, 0x036F), (0x0483, 0x0489), (0x0591, 0x05BD), (0x064B, 0x065F), (0x0900, 0x0903),
             (0x093A, 0x094F), (0x0E31, 0x0E31), (0x0E34, 0x0E3A), (0x0E47, 0x0E4E), (0x1AB0, 0x1ABE),
             (0x20D0, 0x20F0), (0xFE20, 0xFE2F)]
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\r", "\n\n", " \n", "\u00a0", "\u3000", "\u2009", "\u0085",
          "\u2028", "\u200b", "\u000b", "\u000c", "\u202f", "\u1680"]
EMOJI = ["😀", "🎉", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🇯🇵", "🇺🇸", "🧑🏿‍💻", "✈︎", "👩‍❤️‍💋‍👨", "🐍",
         "⌚", "🫠", "☕", "1️⃣", "#️⃣", "🤷‍♀️", "🦀", "🙏"]
LOOKALIKES = ["<|im_start", "<|im_end|>", "<|im_start|>", "<think>", "</think>", "<|endoftext|>",
              "<tool_call>", "</tool_call>", "<|im_end", "|im_start|>", "<<|im_start|>>", "<think",
              "<|vision_pad|>", "<tool_response>", "<|fim_prefix|>", "< think>", "<THINK>", "<|im_sep|>",
              "<|endoftext|><|endoftext|>", "<think></think>"]
WORDS = ["the", "The", "transformers", "hello", "world", "don't", "I'm", "we'LL", "they'Re", "IT'S",
         "naïve", "café", "Straße", "İstanbul", "ﬁnance", "x'ſ", "Ǆemal", "ǅ", "µs", "K", "Å", "Ω"]
CODE = [
    "def f(x):\n    return x**2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    '{"key": [1, 2.5e-3, null, true], "s": "a\\nb"}',
    "SELECT * FROM t WHERE id >= 42 AND name LIKE '%x%';",
    "    if err != nil {\n        return nil, err\n    }\n",
    "#include <stdio.h>\nint main(){printf(\"%d\\n\", 0x1F);}",
    "x = [i for i in range(10) if i % 2 == 0]\r\n",
    "<div class=\"a\">&nbsp;&lt;tag&gt;</div>",
    "$ ls -la | grep '^d' && echo \"done\" >> /tmp/log.txt",
    "fn main() { let v: Vec<u8> = vec![0xff; 16]; }",
]
SAMPLES = [
    "สวัสดีครับ ผมชื่ออเล็กซ์", "नमस्ते दुनिया, यह एक परीक्षण है।", "你好，世界！今天是2026年8月13日 🎉",
    "안녕하세요 세계", "مرحبا بالعالم، كيف حالك؟", "שָׁלוֹם עוֹלָם", "Привет, мир!", "Γειά σου Κόσμε",
    "こんにちは、世界。カタカナ", "transformers", "人工智能", "ग्राहकों क्षत्रिय", "ক্ষমা করবেন", "தமிழ்நாடு",
    "ประเทศไทย์ก็", "e\u0301te\u0301", "A\u030a", "\u1100\u1161\u11a8", "Z̸̢͉̤a̶͓̓l̷͕̐g̵̱̈́o̴̜͝",
]


def _rand_script(rng, n):
    lo, hi = SCRIPTS[rng.choice(sorted(SCRIPTS))]
    out = []
    while len(out) < n:
        c = chr(rng.randint(lo, hi))
        if unicodedata.category(c) != "Cn":
            out.append(c)
    return "".join(out)


def _rand_combining(rng):
    lo, hi = rng.choice(COMBINING)
    return chr(rng.randint(lo, hi))


def _with_marks(rng, s):
    out = []
    for c in s:
        out.append(c)
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            out.append(_rand_combining(rng))
    return "".join(out)


def _digits(rng):
    kind = rng.random()
    if kind < 0.6:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 40)))
    if kind < 0.8:
        return "".join(chr(rng.choice([0x0660, 0x06F0, 0x0966, 0xFF10, 0x0E50]) + rng.randint(0, 9))
                       for _ in range(rng.randint(1, 12)))
    return rng.choice(["3.14159", "1,000,000", "½ + ¼ = ¾", "x² + y³", "Ⅻ", "1e-9", "-42", "0x7FFF"])


def _fragment(rng):
    k = rng.random()
    if k < 0.18:
        return _rand_script(rng, rng.randint(1, 20))
    if k < 0.28:
        return _with_marks(rng, _rand_script(rng, rng.randint(1, 8)))
    if k < 0.38:
        return rng.choice(EMOJI) * rng.randint(1, 3)
    if k < 0.48:
        return rng.choice(SPACES) * rng.randint(1, 6)
    if k < 0.56:
        return _digits(rng)
    if k < 0.64:
        return rng.choice(LOOKALIKES)
    if k < 0.74:
        return rng.choice(WORDS)
    if k < 0.82:
        return rng.choice(CODE)
    if k < 0.90:
        return rng.choice(SAMPLES)
    return "".join(chr(rng.randint(0x21, 0x7E)) for _ in range(rng.randint(1, 12)))


def _variant(rng, s):
    """NFC/NFD/NFKD forms and case changes of a string."""
    form = rng.choice(["NFC", "NFD", "NFKD", "NFKC", None, None])
    if form:
        s = unicodedata.normalize(form, s)
    if rng.random() < 0.1:
        s = s.upper()
    return s


def make_corpus(seed=1234, n=2400):
    rng = random.Random(seed)
    out = list(SAMPLES) + LOOKALIKES + EMOJI + WORDS + CODE
    out += [unicodedata.normalize("NFD", s) for s in SAMPLES]
    # Long runs: whitespace (the `\s+(?!\S)` look-ahead), repeated letters and digits.
    out += [" " * 1000 + "x", "\n" * 500, "\t \n" * 300 + "end", "a" * 3000, "9" * 500, "ab" * 800,
            "😀" * 200, "ก" * 400 + "ั" * 50, " " * 2 + "\n" * 3 + " " * 4 + "y", "", " ", "\n", "'s"]
    while len(out) < n:
        s = "".join(_fragment(rng) + (rng.choice(SPACES) if rng.random() < 0.4 else "")
                    for _ in range(rng.randint(1, 12)))
        out.append(_variant(rng, s))
    return out
