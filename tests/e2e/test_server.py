"""End-to-end tests of `lily serve` on the built-in demo model, driven by the official openai client
(plus raw HTTP where the client hides the wire format). References: `lily run` greedy ids and logits,
the Hugging Face `tokenizers` library on the demo tokenizer.json, and a cold server for prefix reuse."""
import concurrent.futures
import json
import os
import pathlib
import socket
import subprocess
import time

import numpy as np
import openai
import pytest

try:
    import httpx
except ImportError:   # newer openai releases depend on the httpx2 fork (same API)
    import httpx2 as httpx


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, lily_bin, model_dir, *extra, env=None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(pathlib.Path(model_dir).parent / f"serve-{self.port}.log", "w+")
        self.proc = subprocess.Popen(
            [lily_bin, "serve", "--model", str(model_dir), "--port", str(self.port), "--quiet", *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.time() + 60
        while time.time() < deadline:
            assert self.proc.poll() is None, f"server exited: {self.logs()}"
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not become healthy: " + self.logs())

    def logs(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def client(self, key="none"):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=60)

    def post(self, path, body, **kw):
        return httpx.post(self.base + path, json=body, timeout=60, **kw)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def server(lily_bin, demo_dir):
    s = Server(lily_bin, demo_dir, "--ctx", "4096", "--chunk", "32", "--max-body-mb", "1",
               "--ping-interval", "0.2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cold_server(lily_bin, demo_dir):
    s = Server(lily_bin, demo_dir, "--ctx", "4096", "--chunk", "32", "--no-prefix-cache")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


GREEDY = dict(temperature=0, presence_penalty=0)
HELLO = [{"role": "user", "content": "Tell me a story about a cat."}]


def chat(client, messages=HELLO, **kw):
    args = {**GREEDY, "max_tokens": 12, **kw}
    return client.chat.completions.create(model="demo", messages=messages, **args)


def test_health_models_and_name(server, client):
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]   # the model directory's name


def test_chat_usage_counts_prompt_tokens(server, client):
    r = chat(client, max_tokens=7, extra_body={"return_token_ids": True})
    prompt = server.post("/apply-template", {"messages": HELLO}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    n_prompt = len(server.post("/tokenize", {"content": prompt}).json()["tokens"])
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == len(r.choices[0].token_ids) == 7
    assert r.usage.total_tokens == n_prompt + 7
    assert r.choices[0].finish_reason == "length"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_tokenize_matches_hf_tokenizers(server, demo_dir):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    for text in ["Hello world, the cat sat.", "<|im_start|>user\nhi<|im_end|>\n", "naïve café 12345 \n\n x"]:
        ids = server.post("/tokenize", {"content": text}).json()["tokens"]
        assert ids == hf.encode(text).ids, text
        assert server.post("/detokenize", {"tokens": ids}).json()["content"] == hf.decode(ids, skip_special_tokens=False)


def test_temperature_zero_equals_lily_run(server, client, lily_bin, demo_dir, tmp_path):
    ids = [5, 17, 250, 3, 99, 42]
    r = client.completions.create(model="demo", prompt=ids, max_tokens=10, temperature=0, logprobs=3,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    dump = tmp_path / "logits.bin"
    out = subprocess.run([lily_bin, "run", "--model", str(demo_dir), "--prompt-ids", ",".join(map(str, ids)),
                          "-n", "10", "--quiet", "--dump-logits", str(dump)],
                         check=True, capture_output=True, text=True).stdout
    want = [int(x) for x in out.split("generated:")[1].strip().split(",")]
    got = r.choices[0].token_ids
    assert got == want
    # Logprobs: log-softmax of the logits `lily run` computed for the same positions.
    meta = json.loads(pathlib.Path(str(dump) + ".json").read_text())
    logits = np.fromfile(dump, dtype=np.float32).reshape(meta["rows"], meta["vocab"])
    lp = r.choices[0].logprobs
    for k in range(10):
        row = logits[len(ids) - 1 + k].astype(np.float64)
        ref = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        assert abs(lp.token_logprobs[k] - ref[want[k]]) < 2e-3
        # The legacy format keys alternatives by token text, so partial-UTF-8 tokens can collide.
        top3 = np.sort(ref)[::-1][:3]
        vals = sorted(lp.top_logprobs[k].values(), reverse=True)
        assert 1 <= len(vals) <= 3 and vals[0] == pytest.approx(top3[0], abs=2e-3)
        assert all(np.min(np.abs(top3 - v)) < 2e-3 for v in vals)


def test_stream_reassembles_to_non_stream(client):
    for kw in [dict(), dict(extra_body={"chat_template_kwargs": {"enable_thinking": False}}),
               dict(reasoning_effort="none")]:
        full = chat(client, max_tokens=24, **kw)
        chunks = list(chat(client, max_tokens=24, stream=True, stream_options={"include_usage": True}, **kw))
        first = chunks[0].choices[0].delta
        assert first.role == "assistant"
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                            for c in chunks if c.choices)
        reasoning2 = "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks if c.choices)
        msg = full.choices[0].message
        assert content == (msg.content or "")
        assert reasoning == reasoning2 == (getattr(msg, "reasoning_content", None) or "")
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == [full.choices[0].finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        assert all(c.usage is None for c in chunks[:-1])
        if kw:   # thinking off: the prompt ends after an empty think block, output is content
            assert reasoning == ""


def test_seed_determinism(client):
    a = chat(client, temperature=1.0, seed=1234, max_tokens=16)
    b = chat(client, temperature=1.0, seed=1234, max_tokens=16)
    c = chat(client, temperature=1.0, seed=999, max_tokens=16)
    text = lambda r: (getattr(r.choices[0].message, "reasoning_content", "") or "") + (r.choices[0].message.content or "")
    assert text(a) == text(b)
    assert text(a) != text(c)


def test_stop_strings_and_stop_ids(client):
    base = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=30, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    text = base.choices[0].text
    stop = text[10:13]
    assert len(stop) == 3 and stop.strip()
    cut = text.index(stop)
    r = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=30, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[:cut]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="demo", prompt="Once upon a time", max_tokens=30, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == text[:cut]
    # A stop token id ends generation and is counted.
    third = base.choices[0].token_ids[2]
    r = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=30, temperature=0,
                                  extra_body={"stop_token_ids": [third], "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == base.choices[0].token_ids.index(third) + 1


def test_max_completion_tokens_gives_length(client):
    r = chat(client, max_completion_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = chat(client, max_tokens=9, max_completion_tokens=4)
    assert r.usage.completion_tokens == 4


def test_tools_request_is_served(server, client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    r = chat(client, tools=tools, max_tokens=8)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    prompt = server.post("/apply-template", {"messages": HELLO, "tools": tools}).json()["prompt"]
    assert '{"type": "function", "function": {"name": "get_weather", "description": "Weather"' in prompt


def error_of(resp):
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("body,status,param", [
    ({"messages": []}, 400, "messages"),
    ({}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": HELLO, "model": "gpt-4"}, 404, "model"),
    ({"messages": HELLO, "temperature": "hot"}, 400, "temperature"),
    ({"messages": HELLO, "temperature": -1}, 400, "temperature"),
    ({"messages": HELLO, "top_p": 1.5}, 400, "top_p"),
    ({"messages": HELLO, "presence_penalty": 5}, 400, "presence_penalty"),
    ({"messages": HELLO, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": HELLO, "max_tokens": "ten"}, 400, "max_tokens"),
    ({"messages": HELLO, "n": 2}, 400, "n"),
    ({"messages": HELLO, "stop": 5}, 400, "stop"),
    ({"messages": HELLO, "stream": "yes"}, 400, "stream"),
    ({"messages": HELLO, "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": HELLO, "top_logprobs": 3}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "word " * 5000}]}, 400, "messages"),
    ({"messages": [{"role": "assistant", "content": "no user turn"}]}, 400, "messages"),
])
def test_malformed_chat_requests(server, body, status, param):
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = error_of(r)
    assert err["param"] == param
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_more_error_paths(server, client):
    r = httpx.post(server.base + "/v1/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "JSON" in error_of(r)["message"]
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 5000}]})
    assert error_of(r)["code"] == "context_length_exceeded"
    r = server.post("/v1/completions", {"prompt": [1, 2, 100000]})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"
    r = server.post("/v1/completions", {"prompt": ["a", "b"]})
    assert r.status_code == 400
    r = httpx.post(server.base + "/v1/completions", content=b"x" * (2 << 20), timeout=10)
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    r = httpx.get(server.base + "/v1/nothing")
    assert r.status_code == 404
    with pytest.raises(openai.BadRequestError):
        chat(client, messages=[])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HELLO)
    assert chat(client).choices[0].finish_reason == "length"   # still serving


def test_eight_concurrent_clients_all_served(server, client):
    want = chat(client, max_tokens=16)
    want_text = (want.choices[0].message.reasoning_content or "") + (want.choices[0].message.content or "")

    def one(i):
        if i % 2:
            return chat(server.client(), max_tokens=16)
        chunks = list(chat(server.client(), max_tokens=16, stream=True))
        return "".join((getattr(c.choices[0].delta, "reasoning_content", None) or "") +
                       (c.choices[0].delta.content or "") for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(10) as ex:
        results = list(ex.map(one, range(10)))
    for i, r in enumerate(results):
        text = r if isinstance(r, str) else (r.choices[0].message.reasoning_content or "") + (r.choices[0].message.content or "")
        assert text == want_text, i


def metric(server, name):
    for line in httpx.get(server.base + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(name + " missing")


def disconnect_mid_stream(server, body):
    """Reads 5 SSE events of a streamed chat request, drops the connection, and checks that the
    server counts exactly one cancellation within seconds (long before the request could finish)."""
    before = metric(server, "lily_requests_cancelled_total")
    t0 = time.time()
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=30) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n >= 5:
                break
    deadline = time.time() + 10
    while metric(server, "lily_requests_cancelled_total") <= before and time.time() < deadline:
        time.sleep(0.05)
    assert metric(server, "lily_requests_cancelled_total") == before + 1
    assert time.time() - t0 < 8


def test_disconnect_cancels_and_server_keeps_serving(server, client):
    # 3000 tokens would take far longer than the 8 s the helper allows.
    disconnect_mid_stream(server, {"messages": HELLO, "max_tokens": 3000, "stream": True, "ignore_eos": True,
                                   **GREEDY})
    assert chat(client).choices[0].finish_reason == "length"


def test_keepalive_pings_during_chunked_prefill(server):
    body = {"messages": [{"role": "user", "content": "many words here " * 40}], "max_tokens": 2,
            "stream": True}
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = list(r.iter_lines())
    assert r.headers["content-type"].startswith("text/event-stream")
    assert any(l.startswith(": ping") for l in lines)
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"


def test_metrics_exposes_counters(server, client):
    chat(client)
    text = httpx.get(server.base + "/metrics").text
    for name in ["lily_requests_total", "lily_prompt_tokens_cached_total", "lily_prefill_tokens_per_second",
                 "lily_decode_tokens_per_second", "lily_cache_hits_total", "lily_generation_tokens_total"]:
        assert f"# TYPE {name} " in text
    assert metric(server, "lily_requests_total") > 0
    assert metric(server, "lily_prompt_tokens_cached_total") > 0


def test_api_key_and_timeout(lily_bin, demo_dir):
    s = Server(lily_bin, demo_dir, "--ctx", "8192", "--timeout", "1", env={"LILY_API_KEY": "sekret"})
    try:
        assert httpx.get(s.base + "/health").status_code == 200   # public
        with pytest.raises(openai.AuthenticationError):
            chat(s.client("wrong"))
        assert httpx.get(s.base + "/v1/models").status_code == 401
        assert error_of(httpx.get(s.base + "/v1/models"))["code"] == "invalid_api_key"
        ok = s.client("sekret")
        assert chat(ok).choices[0].finish_reason == "length"
        auth = {"Authorization": "Bearer sekret"}
        long = {"messages": HELLO, "max_tokens": 4000, "ignore_eos": True}
        r = s.post("/v1/chat/completions", long, headers=auth)
        assert r.status_code == 504 and error_of(r)["code"] == "timeout"
        # Once streaming has started the error arrives as an SSE event, then [DONE].
        with httpx.stream("POST", s.base + "/v1/chat/completions", json={**long, "stream": True},
                          headers=auth, timeout=30) as resp:
            assert resp.status_code == 200
            data = [l[6:] for l in resp.iter_lines() if l.startswith("data: ")]
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["error"]["code"] == "timeout"
        assert len(data) > 3   # some tokens were streamed before the deadline
        assert chat(ok).choices[0].finish_reason == "length"
    finally:
        s.stop()


@pytest.mark.parametrize("preserve", [False, True])
def test_ten_turn_agent_conversation_reuses_prefix(server, cold_server, preserve):
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                             "required": ["path"]}}}]
    warm, cold = server.client(), cold_server.client()
    im_end = server.post("/tokenize", {"content": "<|im_end|>"}).json()["tokens"]
    nl = server.post("/tokenize", {"content": "\n"}).json()["tokens"]
    assert len(im_end) == 1 and len(nl) == 1
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Fix the failing test in the repo."}]
    prev = None
    for turn in range(10):
        kw = dict(messages=messages, tools=tools, max_tokens=10,
                  extra_body={"chat_template_kwargs": {"preserve_thinking": preserve}})
        w, c = chat(warm, **kw), chat(cold, **kw)
        wm, cm = w.choices[0].message, c.choices[0].message
        assert (wm.content, getattr(wm, "reasoning_content", None)) == (cm.content, getattr(cm, "reasoning_content", None)), turn
        assert c.usage.prompt_tokens_details.cached_tokens == 0
        prompt = server.post("/tokenize", {"messages": messages, "tools": tools,
                                           "chat_template_kwargs": {"preserve_thinking": preserve}}).json()["tokens"]
        assert w.usage.prompt_tokens == len(prompt)
        if prev is not None:
            lcp = next((i for i, (a, b) in enumerate(zip(prev, prompt)) if a != b), min(len(prev), len(prompt)))
            boundary = lcp if lcp == len(prev) else max(
                [b for b in range(2, lcp + 1) if prev[b - 2] == im_end[0] and prev[b - 1] == nl[0]] or [0])
            cached = w.usage.prompt_tokens_details.cached_tokens
            assert cached >= boundary > len(prev) // 2, (turn, cached, boundary, len(prev))
            if preserve:   # history is re-rendered exactly: the whole previous prompt is reused
                assert cached >= len(prev), (turn, cached, len(prev))
        prev = prompt
        messages.append({"role": "assistant", "content": wm.content or "",
                         "reasoning_content": getattr(wm, "reasoning_content", None) or "",
                         "tool_calls": [{"id": f"call_{turn}", "type": "function",
                                         "function": {"name": "read_file",
                                                      "arguments": json.dumps({"path": f"src/f{turn}.py"})}}]})
        messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": f"contents of f{turn}"})
        if turn % 4 == 3:
            messages.append({"role": "user", "content": "Keep going."})


def test_chat_logprobs_stream_matches_non_stream(client):
    full = chat(client, max_tokens=8, logprobs=True, top_logprobs=2)
    lps = full.choices[0].logprobs.content
    assert len(lps) == 8
    for e in lps:   # greedy without penalties picks the model's most likely token
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-6)
        assert bytes(e.bytes) == bytes(e.top_logprobs[0].bytes)
    streamed = [e for c in chat(client, max_tokens=8, logprobs=True, top_logprobs=2, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [bytes(e.bytes) for e in streamed] == [bytes(e.bytes) for e in lps]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in lps], abs=1e-5)


def test_sigterm_stops_promptly_during_a_stream(lily_bin, demo_dir):
    s = Server(lily_bin, demo_dir, "--ctx", "8192")
    body = {"messages": HELLO, "max_tokens": 8000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", s.base + "/v1/chat/completions", json=body, timeout=30) as r:
        it = r.iter_lines()
        while not next(it).startswith("data: "):
            pass
        t0 = time.time()
        s.proc.terminate()
        s.proc.wait(15)
        assert time.time() - t0 < 5   # the running generation was cancelled, not finished
    assert s.proc.returncode == 0
    s.log.close()


def test_sigterm_with_an_idle_keep_alive_client(lily_bin, demo_dir):
    s = Server(lily_bin, demo_dir, "--keep-alive", "1")
    with httpx.Client(base_url=s.base, timeout=10) as c:   # keeps its connection open after the request
        assert c.get("/v1/models").status_code == 200
        t0 = time.time()
        s.proc.terminate()
        s.proc.wait(15)
        assert time.time() - t0 < 4   # --keep-alive bounds the wait on the idle connection (was 5 s)
    assert s.proc.returncode == 0
    s.log.close()


def test_health_is_503_while_loading(lily_bin, demo_dir, tmp_path):
    # The weights file is a FIFO nobody writes to: loading blocks, the API must already answer.
    d = tmp_path / "slow"
    d.mkdir()
    for f in demo_dir.iterdir():
        if f.name != "model.safetensors":
            (d / f.name).write_bytes(f.read_bytes())
    os.mkfifo(d / "model.safetensors")
    port = free_port()
    proc = subprocess.Popen([lily_bin, "serve", "--model", str(d), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while True:
            try:
                r = httpx.get(base + "/health", timeout=1)
                break
            except httpx.TransportError:
                assert time.time() < deadline and proc.poll() is None
                time.sleep(0.05)
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(base + "/v1/chat/completions", json={"messages": HELLO}, timeout=5)
        assert r.status_code == 503 and error_of(r)["code"] == "model_loading"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "interrupted while loading" in err


def test_reasoning_accepted_under_both_names(server):
    def render(field):
        msgs = [{"role": "user", "content": "list files"},
                {"role": "assistant", "content": "", field: "I should call ls.",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "ls", "arguments": "{\"dir\": \".\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}]
        r = server.post("/apply-template", {"messages": msgs})
        assert r.status_code == 200, r.text
        return r.json()["prompt"]
    a, b = render("reasoning_content"), render("reasoning")
    assert a == b
    assert "<think>\nI should call ls.\n</think>" in a
    assert "<parameter=dir>\n.\n</parameter>" in a   # string arguments were JSON-parsed


def test_logit_bias(client):
    base = client.completions.create(model="demo", prompt="The", max_tokens=3, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    first = base.choices[0].token_ids[0]
    banned = client.completions.create(model="demo", prompt="The", max_tokens=3, temperature=0,
                                       logit_bias={str(first): -100},
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    assert banned.choices[0].token_ids[0] != first
    forced = client.completions.create(model="demo", prompt="The", max_tokens=4, temperature=0.8,
                                       logit_bias={"65": 100},
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    assert forced.choices[0].token_ids == [65] * 4
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt="The", max_tokens=2, logit_bias={"65": 500})
