"""End-to-end tests of the server's device-sampling decode loop (`--device-sampling on`: sampling in
Backend::sample, ids handed to the host through Qwen36::generate's ring), forced on the cpu backend so
that CI covers the path the cuda backend takes by default. The reference is the same server binary
with `--device-sampling off` (host Sampler, one forward per token) and prefix reuse disabled: greedy
picks do not depend on where the token is chosen, and the rule is the same for penalties."""
import concurrent.futures
import json

import openai
import pytest

try:
    import httpx
except ImportError:   # newer openai releases depend on the httpx2 fork (same API)
    import httpx2 as httpx

from test_server import Server, disconnect_mid_stream

CTX = 512


@pytest.fixture(scope="module")
def dev(lily_bin, demo_dir):
    """Device sampling forced on, prefix reuse on (the configuration under test)."""
    s = Server(lily_bin, demo_dir, "--ctx", str(CTX), "--chunk", "32", "--device-sampling", "on")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def host(lily_bin, demo_dir):
    """Reference: host sampling, every request cold."""
    s = Server(lily_bin, demo_dir, "--ctx", str(CTX), "--chunk", "32", "--device-sampling", "off",
               "--no-prefix-cache")
    yield s
    s.stop()


HELLO = [{"role": "user", "content": "Tell me a story about a cat."}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def chat(client, messages=HELLO, **kw):
    args = {"temperature": 0, "max_tokens": 16, **kw}
    return client.chat.completions.create(model="demo", messages=messages, **args)


def text_of(r):
    m = r.choices[0].message
    return (getattr(m, "reasoning_content", None) or "") + (m.content or "")


def stream_text(chunks):
    return "".join((getattr(c.choices[0].delta, "reasoning_content", None) or "") +
                   (c.choices[0].delta.content or "") for c in chunks if c.choices)


def complete(client, prompt, **kw):
    args = {"temperature": 0, "max_tokens": 16, **kw}
    extra = {"return_token_ids": True, "ignore_eos": True, **args.pop("extra_body", {})}
    return client.completions.create(model="demo", prompt=prompt, extra_body=extra, **args)


@pytest.mark.parametrize("kw", [
    dict(presence_penalty=0),
    dict(),                                                   # thinking defaults: presence_penalty 1.5
    dict(extra_body=NO_THINK),                                # instruct defaults: top_k 20, top_p 0.8
    dict(frequency_penalty=0.7, extra_body={"repetition_penalty": 1.3}),
], ids=["plain", "presence", "instruct", "freq+rep"])
def test_greedy_chat_matches_host_path(dev, host, kw):
    d, h = dev.client(), host.client()
    want = chat(h, max_tokens=24, **kw)
    got = chat(d, max_tokens=24, **kw)
    assert text_of(got) == text_of(want)
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage.completion_tokens == want.usage.completion_tokens
    chunks = list(chat(d, max_tokens=24, stream=True, stream_options={"include_usage": True}, **kw))
    assert stream_text(chunks) == text_of(want)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [want.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens


def test_greedy_token_ids_match_host_path(dev, host):
    for prompt in ["Once upon a time", [5, 17, 250, 3, 99, 42]]:
        want = complete(host.client(), prompt, max_tokens=48)
        got = complete(dev.client(), prompt, max_tokens=48)
        assert got.choices[0].token_ids == want.choices[0].token_ids
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 48


def test_seeded_sampling_is_reproducible(dev, host):
    c = dev.client()
    kw = dict(temperature=0.9, top_p=0.95, max_tokens=24, extra_body={**NO_THINK, "top_k": 40})
    a = chat(c, seed=1234, **kw)
    b = chat(c, seed=1234, **kw)
    s = stream_text(chat(c, seed=1234, stream=True, **kw))
    assert text_of(a) == text_of(b) == s
    others = {text_of(chat(c, seed=seed, **kw)) for seed in (7, 99, 31337)}
    assert others - {text_of(a)}   # a different seed gives a different text
    # The device draws from a hash of (seed, step), the host Sampler from mt19937 (docs/SERVER.md):
    # the same seed gives another text on the host path, which shows the device loop ran; with
    # logprobs the dev server takes the host path and gives the host's text.
    h = chat(host.client(), seed=1234, **kw)
    assert text_of(h) != text_of(a)
    assert text_of(chat(c, seed=1234, logprobs=True, **kw)) == text_of(h)
    # Plain temperature sampling (no truncation) and min_p, through the completions endpoint.
    for extra in [dict(temperature=1.0), dict(temperature=0.7, extra_body={"min_p": 0.05})]:
        x = complete(c, "Once upon a time", max_tokens=20, seed=5, **extra)
        y = complete(c, "Once upon a time", max_tokens=20, seed=5, **extra)
        assert x.choices[0].token_ids == y.choices[0].token_ids


def test_logit_bias_on_device(dev, host):
    c = dev.client()
    forced = complete(c, "The", max_tokens=4, temperature=0.8, logit_bias={"65": 100})
    assert forced.choices[0].token_ids == [65] * 4
    base = complete(c, "The", max_tokens=3)
    first = base.choices[0].token_ids[0]
    banned = complete(c, "The", max_tokens=3, logit_bias={str(first): -100})
    assert banned.choices[0].token_ids[0] != first
    assert banned.choices[0].token_ids == complete(host.client(), "The", max_tokens=3,
                                                   logit_bias={str(first): -100}).choices[0].token_ids


def test_stop_strings_stop_ids_and_max_tokens(dev, host):
    c = dev.client()
    base = complete(host.client(), "Once upon a time", max_tokens=30)
    text, ids = base.choices[0].text, base.choices[0].token_ids
    stop = text[10:13]
    assert len(stop) == 3 and stop.strip()
    cut = text.index(stop)
    r = complete(c, "Once upon a time", max_tokens=30, stop=[stop])
    assert r.choices[0].text == text[:cut] and r.choices[0].finish_reason == "stop"
    streamed = list(complete(c, "Once upon a time", max_tokens=30, stop=stop, stream=True))
    assert "".join(x.choices[0].text for x in streamed if x.choices) == text[:cut]
    assert [x.choices[0].finish_reason for x in streamed if x.choices and x.choices[0].finish_reason] == ["stop"]
    third = ids[2]
    r = complete(c, "Once upon a time", max_tokens=30, extra_body={"stop_token_ids": [third]})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == ids.index(third) + 1
    assert r.choices[0].token_ids == ids[:ids.index(third) + 1]
    for n in (1, 2, 3):
        r = complete(c, "Once upon a time", max_tokens=n)
        assert r.choices[0].finish_reason == "length" and r.choices[0].token_ids == ids[:n]
    # The end-of-sequence token ends a chat turn (finish "stop") the same way on both paths.
    want = chat(host.client(), max_tokens=200, extra_body=NO_THINK)
    got = chat(c, max_tokens=200, extra_body=NO_THINK)
    assert (text_of(got), got.choices[0].finish_reason, got.usage.completion_tokens) == \
           (text_of(want), want.choices[0].finish_reason, want.usage.completion_tokens)


def test_generation_fills_the_context(dev, host):
    for room in (40, 1):   # no max_tokens: generation stops when the context is full
        prompt = [(i * 37) % 240 + 5 for i in range(CTX - room)]
        want = complete(host.client(), prompt, max_tokens=None)
        got = complete(dev.client(), prompt, max_tokens=None)
        assert got.choices[0].finish_reason == want.choices[0].finish_reason == "length"
        assert got.usage.completion_tokens == room
        assert got.choices[0].token_ids == want.choices[0].token_ids


def test_continuation_reuses_the_decoded_state(dev, host):
    # After a device decode the live state holds the prompt plus every pick that was fed back
    # (all but the last). A prompt that extends it resumes there and must equal a cold prefill.
    p = [7, 300, 12, 45, 100, 3]
    first = complete(dev.client(), p, max_tokens=12).choices[0].token_ids
    for ext in [p + first[:-1], p + first, p + first + [42, 43], p + first[:5]]:
        got = complete(dev.client(), ext, max_tokens=8)
        want = complete(host.client(), ext, max_tokens=8)
        assert got.choices[0].token_ids == want.choices[0].token_ids, len(ext)
        assert got.usage.prompt_tokens_details.cached_tokens >= len(p)
        if ext == p + first[:-1]:   # resumes from the live state with its last logits
            assert got.choices[0].token_ids[0] == first[-1]
        # Re-run the first request so that the live state is the decoded one again.
        complete(dev.client(), p, max_tokens=12)


@pytest.mark.parametrize("end", ["length", "stop_id", "eos"])
def test_multi_turn_conversation_reuses_prefix(dev, host, end):
    # Turns end on max_tokens, on a stop id, or on <|im_end|> (pushed by logit_bias on odd turns):
    # the device loop may have consumed the final pick, reuse must stay exact in every case.
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Write a short poem about the sea."}]
    im_end = dev.post("/tokenize", {"content": "<|im_end|>"}).json()["tokens"][0]
    extra = dict(NO_THINK) if end == "eos" else {}
    if end == "stop_id":
        first = chat(host.client(), messages=messages, max_tokens=12, extra_body={"return_token_ids": True})
        extra["stop_token_ids"] = [first.choices[0].token_ids[6]]
    prev_len = 0
    for turn in range(4):
        kw = dict(messages=messages, max_tokens=12, presence_penalty=1.0, extra_body=extra)
        if end == "eos" and turn % 2:
            kw["logit_bias"] = {str(im_end): 100}
        w, c = chat(dev.client(), **kw), chat(host.client(), **kw)
        assert text_of(w) == text_of(c), turn
        assert w.choices[0].finish_reason == c.choices[0].finish_reason, turn
        assert w.usage.prompt_tokens == c.usage.prompt_tokens
        assert c.usage.prompt_tokens_details.cached_tokens == 0
        if turn:
            assert w.usage.prompt_tokens_details.cached_tokens > prev_len // 2, turn
        if end == "eos" and turn % 2:
            assert w.choices[0].finish_reason == "stop" and w.usage.completion_tokens == 1
        prev_len = w.usage.prompt_tokens
        m = w.choices[0].message
        messages.append({"role": "assistant", "content": m.content or "",
                         "reasoning_content": getattr(m, "reasoning_content", None) or ""})
        messages.append({"role": "user", "content": f"Again, with {turn + 2} verses."})


def test_logprobs_requests_use_the_host_path(dev, host):
    kw = dict(max_tokens=8, logprobs=True, top_logprobs=3, presence_penalty=0)
    got, want = chat(dev.client(), **kw), chat(host.client(), **kw)
    a, b = got.choices[0].logprobs.content, want.choices[0].logprobs.content
    assert len(a) == len(b) == 8
    assert [bytes(e.bytes) for e in a] == [bytes(e.bytes) for e in b]
    assert [e.logprob for e in a] == pytest.approx([e.logprob for e in b], abs=1e-5)
    assert all(len(e.top_logprobs) == 3 for e in a)
    streamed = [e for ch in chat(dev.client(), stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [bytes(e.bytes) for e in streamed] == [bytes(e.bytes) for e in b]
    r = dev.client().completions.create(model="demo", prompt="Once upon a time", max_tokens=5,
                                        temperature=0, logprobs=2)
    assert len(r.choices[0].logprobs.token_logprobs) == 5
    # A device-path request right after still matches the reference.
    assert text_of(chat(dev.client())) == text_of(chat(host.client()))


def test_disconnect_mid_stream_keeps_serving(dev, host):
    disconnect_mid_stream(dev, {"messages": HELLO, "max_tokens": 900, "stream": True, "ignore_eos": True,
                                "temperature": 0.8, "seed": 3})
    # Served correctly afterwards, also several clients at once (requests are serialised).
    want = text_of(chat(host.client()))

    def one(i):
        if i % 2:
            return text_of(chat(dev.client()))
        return stream_text(chat(dev.client(), stream=True))

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        assert list(ex.map(one, range(4))) == [want] * 4
    assert httpx.get(dev.base + "/health").json() == {"status": "ok"}


def test_deadline_ends_a_device_decode(lily_bin, demo_dir):
    s = Server(lily_bin, demo_dir, "--ctx", "8192", "--timeout", "1", "--device-sampling", "on")
    try:
        long = {"messages": HELLO, "max_tokens": 6000, "ignore_eos": True, "temperature": 0.7}
        r = s.post("/v1/chat/completions", long)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        with httpx.stream("POST", s.base + "/v1/chat/completions", json={**long, "stream": True},
                          timeout=30) as resp:
            data = [l[6:] for l in resp.iter_lines() if l.startswith("data: ")]
        assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["code"] == "timeout"
        assert len(data) > 3
        with s.client() as c:   # closed: an idle keep-alive connection delays SIGTERM by up to --keep-alive (2 s)
            assert chat(c).choices[0].finish_reason == "length"
    finally:
        s.stop()
