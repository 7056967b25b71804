"""Output parser vs mlx-lm's Qwen3-Coder tool parser (mlx_lm.tool_parsers.qwen3_coder, derived from
Qwen's own qwen3coder_tool_parser.py): well-formed model outputs with reasoning, content and parallel
XML tool calls, values drawn from the domain where both parsers' documented rules agree. Arguments
must be equal JSON (types included); reasoning/content must be the parts the generator wrote; every
chunking of the stream must give the same result."""
import json
import random
import subprocess

import pytest

qwen3_coder = pytest.importorskip("mlx_lm.tool_parsers.qwen3_coder", reason="mlx-lm not installed")

TOOLS = [
    {"type": "function", "function": {"name": "edit_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "line": {"type": "integer"}, "scale": {"type": "number"},
        "dry_run": {"type": "boolean"}, "patch": {"type": "object"}, "ranges": {"type": "array"},
        "meta": {"description": "no type"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "k": {"type": "integer"}}}}},
]
WORDS = ["alpha", "β", "数据", "naïve", "x<y", "a > b", "{braces}", "'q'", "\"dq\"", "tab\tsep", "🚀", "100%",
         "path/to/file.py", "<b>", "back\\slash"]


def text(rng, n=None):
    return "".join(rng.choice(WORDS) + rng.choice([" ", "\n", ""]) for _ in range(n or rng.randint(1, 6))).strip()


def nested(rng, depth=0):
    r = rng.random()
    if depth > 2 or r < 0.3:
        return rng.choice([1, -7, 2.5, "s", text(rng, 2), True, False, None, 1e-05])
    if r < 0.65:
        return [nested(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {text(rng, 1): nested(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def value_text(rng, ptype):
    """Raw parameter text the model might write for a parameter of this schema type."""
    if ptype == "string":
        return text(rng)
    if ptype == "integer":
        return rng.choice([str(rng.randint(-10**6, 10**6)), "0", "3.0", "-12"])
    if ptype == "number":
        return rng.choice([repr(rng.uniform(-1e3, 1e3)), str(rng.randint(-50, 50)), "2.0", "1e-3", "0.1"])
    if ptype == "boolean":
        return rng.choice(["true", "false", "True", "False"])
    if ptype == "object":
        obj = {text(rng, 1): nested(rng) for _ in range(rng.randint(0, 3))}
        return rng.choice([json.dumps(obj, ensure_ascii=False), json.dumps(obj, indent=2), repr(obj)])
    if ptype == "array":
        arr = [nested(rng) for _ in range(rng.randint(0, 4))]
        return rng.choice([json.dumps(arr, ensure_ascii=False), repr(arr), repr(tuple(arr))])
    # untyped: structured JSON or plain text
    return rng.choice([json.dumps({"k": nested(rng)}), text(rng)])


def make_output(rng):
    reasoning = text(rng, rng.randint(1, 10))
    content = text(rng) if rng.random() < 0.5 else ""
    calls = []
    for _ in range(rng.randint(1, 3)):
        tool = rng.choice(TOOLS)["function"]
        props = tool["parameters"]["properties"]
        names = rng.sample(list(props), rng.randint(0, len(props)))
        if rng.random() < 0.2:
            names.append("undeclared")
        params = [(n, value_text(rng, props.get(n, {}).get("type", "string" if n == "undeclared" else None)))
                  for n in names]
        calls.append((tool["name"], params))
    out = reasoning + "\n</think>\n\n" + (content + "\n\n" if content else "")
    blocks = []
    for name, params in calls:
        b = f"<tool_call>\n<function={name}>\n"
        for k, v in params:
            b += f"<parameter={k}>\n{v}\n</parameter>\n"
        blocks.append(b + "</function>\n</tool_call>")
    return out + "\n".join(blocks), reasoning, content, blocks


def mlx_calls(blocks):
    calls = []
    for b in blocks:
        inner = b[len("<tool_call>"):-len("</tool_call>")]
        parsed = qwen3_coder.parse_tool_call(inner, TOOLS)
        calls.append({"name": parsed["name"], "arguments": json.loads(json.dumps(parsed["arguments"]))})
    return calls


CASES = [make_output(random.Random(seed)) for seed in range(80)]


@pytest.fixture(scope="module")
def lily_parsed(lily_bin, tmp_path_factory):
    d = tmp_path_factory.mktemp("parser")
    inp, out = d / "in.jsonl", d / "out.jsonl"
    chunks = [0, 1, 3, 7]
    with open(inp, "w", encoding="utf-8") as f:
        for text_, *_ in CASES:
            for c in chunks:
                f.write(json.dumps({"text": text_, "tools": TOOLS, "starts_in_reasoning": True, "chunk": c},
                                   ensure_ascii=False) + "\n")
    subprocess.run([lily_bin, "template", "--parse", "--input", str(inp), "--output", str(out)],
                   check=True, timeout=120)
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == len(CASES) * len(chunks)
    return [rows[i * len(chunks):(i + 1) * len(chunks)] for i in range(len(CASES))]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_matches_mlx_lm(lily_parsed, i):
    _, reasoning, content, blocks = CASES[i]
    whole, *streamed = lily_parsed[i]
    assert "error" not in whole
    assert whole["reasoning"] == reasoning
    assert whole["content"] == content
    got = [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in whole["tool_calls"]]
    assert got == mlx_calls(blocks)
    # Type-exact: 2 vs 2.0 vs True must not be confused (== above would equate 1 and True).
    assert json.dumps(got) == json.dumps(mlx_calls(blocks))
    for s in streamed:
        assert s["reasoning"] == whole["reasoning"] and s["content"] == whole["content"]
        assert [(c["name"], c["arguments"]) for c in s["tool_calls"]] == \
               [(c["name"], c["arguments"]) for c in whole["tool_calls"]]
