"""Chat-template parity: `lily template` vs the model's own Jinja template rendered by Python jinja2
with Hugging Face's settings (sandboxed, trim_blocks, lstrip_blocks, loopcontrols, tojson via
json.dumps(ensure_ascii=False), raise_exception). Outputs must be byte-identical and the same
conversations rejected."""
import json
import pathlib
import subprocess

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from conversations import MEDIA_CASES, handwritten, normalise_for_jinja, random_cases

TEMPLATE_REL = pathlib.Path("reference/qwen3.6-35b-a3b/chat_template.jinja")


class TemplateRaised(Exception):
    pass


def hf_environment():
    def raise_exception(message):
        raise TemplateRaised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def jinja_render(template, request):
    """Returns ("text", str), ("raise", message) for raise_exception, or ("error", repr) otherwise."""
    r = normalise_for_jinja(request)
    kwargs = {"messages": r.get("messages")}
    kwargs["tools"] = r.get("tools")
    for key in ("add_generation_prompt", "enable_thinking", "preserve_thinking"):
        if key in r:
            kwargs[key] = r[key]
    try:
        return "text", template.render(**kwargs)
    except TemplateRaised as e:
        return "raise", str(e)
    except Exception as e:  # noqa: BLE001 - any other template failure (TypeError, UndefinedError)
        return "error", repr(e)


ALL_CASES = handwritten() + random_cases(48)


@pytest.fixture(scope="module")
def template(shared_dir):
    path = pathlib.Path(shared_dir) / TEMPLATE_REL
    if not path.exists():
        pytest.skip(f"reference chat template not found at {path}")
    return hf_environment().from_string(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def lily_outputs(lily_bin, tmp_path_factory):
    cases = ALL_CASES + MEDIA_CASES
    d = tmp_path_factory.mktemp("template")
    inp, out = d / "in.jsonl", d / "out.jsonl"
    with open(inp, "w", encoding="utf-8") as f:
        for _, request in cases:
            f.write(json.dumps(request, ensure_ascii=False) + "\n")
    subprocess.run([lily_bin, "template", "--input", str(inp), "--output", str(out)], check=True, timeout=120)
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(cases), "lily template must answer every input line"
    return {name: json.loads(line) for (name, _), line in zip(cases, lines)}


def test_case_count():
    assert len(ALL_CASES) >= 60
    names = [n for n, _ in ALL_CASES]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name,request_", ALL_CASES, ids=[n for n, _ in ALL_CASES])
def test_parity(template, lily_outputs, name, request_):
    kind, expected = jinja_render(template, request_)
    got = lily_outputs[name]
    if kind == "text":
        assert "error" not in got, f"lily rejected a conversation jinja renders: {got['error']}"
        assert got["text"] == expected
    elif kind == "raise":
        assert got.get("error") == expected, f"expected template error {expected!r}, got {got!r}"
    else:
        assert "error" in got, f"jinja failed ({expected}) but lily rendered {got.get('text')!r}"


@pytest.mark.parametrize("name,request_", MEDIA_CASES, ids=[n for n, _ in MEDIA_CASES])
def test_media_rejected(template, lily_outputs, name, request_):
    got = lily_outputs[name]
    assert "error" in got, "text-only engine must reject media parts"
    assert "not supported" in got["error"]


def test_error_cases_really_fail_in_jinja(template):
    """Guards the generator: every error_* case must fail in the reference too."""
    for name, request in ALL_CASES:
        if name.startswith("error_"):
            assert jinja_render(template, request)[0] != "text", name
