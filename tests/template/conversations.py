"""Conversation generator for the chat-template parity tests: hand-written edge cases plus seeded
random agent loops. Each case is (name, request) where request has the fields `lily template` reads."""
import copy
import json
import random

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city — données météo 🌤",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                "days": {"type": "integer", "minimum": 1, "maximum": 14, "default": 1},
                "units": {"type": "string", "enum": ["metric", "imperial"]},
            },
            "required": ["city"],
        },
    },
}

SEARCH = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the knowledge base.\nReturns ranked passages.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {
                    "type": "object",
                    "properties": {
                        "tags": {"type": "array", "items": {"type": "string"}},
                        "date_range": {
                            "type": "object",
                            "properties": {"from": {"type": "string", "format": "date"},
                                           "to": {"type": "string", "format": "date"}},
                        },
                        "min_score": {"type": "number", "default": 0.5, "exclusiveMinimum": 1e-07},
                    },
                },
                "limit": {"type": ["integer", "null"], "default": None},
                "exact": {"type": "boolean", "default": False},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}

PYTHON = {
    "type": "function",
    "function": {
        "name": "run_python",
        "description": "Execute code\tin a sandbox; output is truncated at 1e+20 bytes",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string"},
                "timeout": {"type": "number", "default": 30.0, "maximum": 1e16, "minimum": 0.0001},
                "env": {"type": "object", "additionalProperties": {"type": "string"}},
            },
            "required": ["code"],
        },
    },
}

# Key order that differs from alphabetical and a bare (non-OpenAI-wrapped) tool, both kept as given.
ODD = {"function": {"parameters": {"type": "object", "properties": {}}, "name": "ping",
                    "description": "控制字符 \u001f, tab\t, quote \", backslash \\, nbsp\u00a0, 1/3 ≈ 0.333"},
       "type": "function"}
BARE = {"name": "now", "description": "current time", "parameters": {"type": "object", "properties": {}}}

ALL_TOOLS = [WEATHER, SEARCH, PYTHON]


def call(name, args, cid="call_1", as_string=False):
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False) if as_string else args}}


def req(messages, tools=None, agp=True, thinking=True, preserve=False):
    return {"messages": messages, "tools": tools, "add_generation_prompt": agp,
            "enable_thinking": thinking, "preserve_thinking": preserve}


def U(text):
    return {"role": "user", "content": text}


def S(text):
    return {"role": "system", "content": text}


def A(text, **kw):
    m = {"role": "assistant", "content": text}
    m.update(kw)
    return m


def T(text, cid="call_1"):
    return {"role": "tool", "tool_call_id": cid, "content": text}


def weather_loop(**akw):
    return [
        S("Be brief."),
        U("Weather in Paris and Lyon?"),
        A("", tool_calls=[call("get_weather", {"city": "Paris", "days": 2}, "c1"),
                          call("get_weather", {"city": "Lyon"}, "c2")], **akw),
        T('{"c":21}', "c1"),
        T('{"c":23}', "c2"),
    ]


def handwritten():
    cases = [
        ("single_user", req([U("Hello")])),
        ("single_user_no_gen_prompt", req([U("Hello")], agp=False)),
        ("thinking_off", req([U("Hello")], thinking=False)),
        ("system_user", req([S("You are helpful."), U("Hi!")])),
        ("system_whitespace_trimmed", req([S("  \n\tBe terse.\n\n "), U("  Hi  \n")])),
        ("system_empty", req([S(""), U("Hi")])),
        ("system_empty_with_tools", req([S("   "), U("Hi")], tools=[WEATHER])),
        ("tools_no_system", req([U("Weather?")], tools=[WEATHER])),
        ("tools_with_system", req([S("Use tools wisely."), U("Weather?")], tools=ALL_TOOLS)),
        ("tools_odd_key_order_and_bare", req([U("ping")], tools=[ODD, BARE])),
        ("tools_empty_list", req([S("sys"), U("x")], tools=[])),
        ("multi_turn_plain", req([U("a"), A("b"), U("c"), A("d"), U("e")])),
        ("multi_turn_reasoning_content_stripped_before_last_query",
         req([U("q1"), A("ans1", reasoning_content="think1"), U("q2")])),
        ("reasoning_field_alias", req([U("q1"), A("ans1", reasoning="alt-field thought")], preserve=True)),
        ("reasoning_content_after_last_query", req([U("q"), A("partial", reasoning_content="  r  \n")], agp=False)),
        ("reasoning_in_content_think_tags",
         req([U("q"), A("<think>\nI should greet.\n</think>\n\nHello!")], agp=False)),
        ("reasoning_in_content_no_open_tag", req([U("q"), A("just thought\n</think>\n\nvisible")], agp=False)),
        ("reasoning_in_content_multiple_close",
         req([U("q"), A("<think>a</think>b</think>\n\nc")], agp=False, preserve=True)),
        ("reasoning_in_content_history_stripped",
         req([U("q1"), A("<think>\nold\n</think>\n\nold answer"), U("q2")])),
        ("reasoning_content_wins_over_tags",
         req([U("q"), A("<think>x</think>y", reasoning_content="rc")], agp=False)),
        ("reasoning_content_non_string_falls_back",
         req([U("q"), A("<think>tagged</think>body", reasoning_content=None)], agp=False)),
        ("preserve_thinking_all_turns",
         req([U("q1"), A("a1", reasoning_content="r1"), U("q2"), A("a2", reasoning_content="r2"), U("q3")],
             preserve=True)),
        ("preserve_thinking_empty_reasoning", req([U("q1"), A("a1"), U("q2")], preserve=True)),
        ("tool_loop_basic", req(weather_loop(), tools=[WEATHER])),
        ("tool_loop_with_reasoning", req(weather_loop(reasoning_content="need tool"), tools=[WEATHER])),
        ("tool_loop_string_arguments",
         req([U("Search it"), A("Let me look.", tool_calls=[call("search_docs", {
             "query": "gdn state", "filters": {"tags": ["a", "b"], "min_score": 0.75}, "limit": None,
             "exact": True}, as_string=True)]), T("[]")], tools=ALL_TOOLS)),
        ("tool_call_content_and_calls",
         req([U("Run"), A("Running code now.", tool_calls=[call("run_python", {"code": "print(1)\nprint(2)"})]),
              T("1\n2")], tools=ALL_TOOLS)),
        ("tool_call_whitespace_content",
         req([U("Run"), A("  \n ", tool_calls=[call("run_python", {"code": "x"})]), T("ok")], tools=ALL_TOOLS)),
        ("tool_call_null_content",
         req([U("Run"), A(None, tool_calls=[call("run_python", {"code": "x"})]), T("ok")], tools=ALL_TOOLS)),
        ("tool_call_without_function_wrapper",
         req([U("t"), A("", tool_calls=[{"name": "now", "arguments": {}}]), T("12:00")], tools=[BARE])),
        ("tool_call_no_arguments_key",
         req([U("t"), A("", tool_calls=[{"type": "function", "function": {"name": "now"}}]), T("12:00")],
             tools=[BARE])),
        ("tool_call_value_types",
         req([U("v"), A("", tool_calls=[call("run_python", {
             "code": "", "timeout": 2.5, "int": 7, "neg": -3, "big": 12345678901234, "f1": 1.0, "f2": 1e-05,
             "f3": 1e16, "f4": 123456789.125, "f5": -0.0, "t": True, "f": False, "n": None,
             "arr": [1, "two", [3.5, {"k": "ü"}]], "obj": {"z": 1, "a": {"nested": ["x", None]}},
             "uni": "日本語 🚀", "esc": "line1\nline2\t\"q\" \\ \u0001"})]), T("done")], tools=[PYTHON])),
        ("multi_step_agent_loop",
         req([S("agent"), U("fix the bug"),
              A("", reasoning_content="look first", tool_calls=[call("search_docs", {"query": "bug"})]),
              T("<result>found</result>"),
              A("found it", reasoning_content="now run", tool_calls=[call("run_python", {"code": "fix()"})]),
              T("ok"),
              A("Fixed.", reasoning_content="done")], tools=ALL_TOOLS, agp=False)),
        ("agent_loop_then_new_query",
         req([U("q1"), A("", reasoning_content="r", tool_calls=[call("now", {})]), T("t"),
              A("It is t.", reasoning_content="r2"), U("q2")], tools=[BARE])),
        ("user_message_that_is_tool_response_text",
         req([U("real question"), A("", tool_calls=[call("now", {})]),
              U("<tool_response>\nmanual\n</tool_response>"), A("ok", reasoning_content="kept")],
             tools=[BARE], agp=False)),
        ("tool_first_message_after_system_skips_header",
         req([S("s"), T("orphan result"), U("q")])),
        ("tool_results_separated_by_user", req([U("a"), T("r1"), U("b"), T("r2"), T("r3")])),
        ("content_parts_text", req([{"role": "user", "content": [{"type": "text", "text": "part one, "},
                                                                  {"type": "text", "text": "part two"}]}])),
        ("content_parts_untyped_text", req([{"role": "user", "content": [{"text": "  padded  "}]}])),
        ("content_parts_in_system_and_tool",
         req([{"role": "system", "content": [{"type": "text", "text": "sys part"}]}, U("u"),
              {"role": "tool", "content": [{"type": "text", "text": "tool part"}]}], tools=[BARE])),
        ("content_empty_string_user", req([U(""), U("real")])),
        ("content_missing", req([{"role": "user"}, U("x")])),
        ("unicode_everywhere",
         req([S("Réponds en français. 🇫🇷"), U("Ça va? 你好 مرحبا \u200b zero-width"),
              A("Très bien ! 😀", reasoning_content="Unicode pensée ∑∫")], preserve=True)),
        ("unicode_whitespace_trim",
         req([U("\u3000\u00a0 ideographic and nbsp \u2003\u2028"), A("\u0085next-line trimmed\u205f")], agp=False)),
        ("zero_width_not_trimmed", req([U("\u200bnot whitespace\u200b"), A("\ufeffbom\ufeff")], agp=False)),
        ("newlines_inside_content", req([U("line1\n\nline2\r\nline3"), A("a\n\n\nb")], agp=False)),
        ("assistant_last_without_gen_prompt", req([U("q"), A("final answer")], agp=False)),
        ("assistant_prefill_with_gen_prompt", req([U("q"), A("x")], agp=True)),
        ("thinking_off_with_history", req([U("q1"), A("a1", reasoning_content="r1"), U("q2")], thinking=False)),
        ("thinking_off_tools", req(weather_loop(), tools=[WEATHER], thinking=False)),
        ("developer_role_mapped", req([{"role": "developer", "content": "Dev instructions"}, U("hi")])),
        ("developer_role_with_tools", req([{"role": "developer", "content": "Dev"}, U("hi")], tools=[WEATHER])),
        ("fields_omitted", {"messages": [U("defaults")]}),
        ("fields_omitted_with_tools", {"messages": [U("defaults")], "tools": [BARE]}),
        ("tools_as_mapping_ignored", req([U("x")], tools={"not": "a list"})),
        ("tool_call_arguments_empty_string",
         req([U("t"), A("", tool_calls=[{"function": {"name": "now", "arguments": ""}}]), T("t")], tools=[BARE]),
         ),
        ("content_part_text_non_string",
         req([{"role": "user", "content": [{"type": "text", "text": 5}, {"text": None},
                                           {"text": ["a", {"b": 1.0, "c": "it's"}]}, {"text": True}]}])),
        ("tool_message_first", req([T("early result"), U("q")])),
        ("tools_with_non_object_items", req([U("q")], tools=["just a string", 3.5, None, WEATHER])),
        ("reasoning_content_empty_string_keeps_tags",
         req([U("q"), A("<think>x</think>y", reasoning_content="")], agp=False)),
        ("reasoning_content_number_falls_back_to_tags",
         req([U("q"), A("<think>x</think>y", reasoning_content=5)], agp=False)),
        ("empty_tool_calls_list", req([U("q"), A("hi", tool_calls=[]), U("again")])),
        ("tool_calls_mapping_ignored", req([U("q"), A("hi", tool_calls={"name": "x"})], agp=False)),
        ("think_tags_in_user_content_untouched", req([U("<think>user text</think> rest")])),
        ("nested_think_in_reasoning_split",
         req([U("q"), A("\n\n<think>\n\nouter <think> inner\n\n</think>\n\n\nanswer\n")], agp=False)),
        # Error cases: the template's own raise_exception messages.
        ("error_no_messages", req([])),
        ("error_only_system", req([S("s")])),
        ("error_only_tool_responses",
         req([U("<tool_response>\nx\n</tool_response>"), A("y")])),
        ("error_system_not_first", req([U("a"), S("late system")])),
        ("error_developer_not_first", req([U("a"), {"role": "developer", "content": "late"}])),
        ("error_unknown_role", req([U("a"), {"role": "critic", "content": "hmm"}])),
        ("error_missing_role", req([U("a"), {"content": "no role"}])),
        ("error_content_mapping", req([{"role": "user", "content": {"text": "dict"}}])),
        ("error_content_number", req([U("ok"), {"role": "assistant", "content": 42}])),
        ("error_unknown_part_type", req([{"role": "user", "content": [{"type": "thing", "data": 1}]}])),
        ("error_system_image", req([{"role": "system", "content": [{"type": "image", "image": "x.png"}]},
                                    U("q")], tools=[BARE])),
        ("error_system_video_no_tools", req([{"role": "system", "content": [{"type": "video", "video": "v"}]},
                                             U("q")])),
        ("error_tool_call_without_name", req([U("q"), A("", tool_calls=[{"function": {"arguments": {}}}])])),
    ]
    return cases


# Media parts are rendered by the template as vision placeholders; a text-only engine must refuse.
MEDIA_CASES = [
    ("media_image_url", req([{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                                           {"type": "image_url", "image_url": {"url": "x"}}]}])),
    ("media_image", req([{"role": "user", "content": [{"type": "image", "image": "file.png"}]}])),
    ("media_video", req([{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}])),
    ("media_audio", req([{"role": "user", "content": [{"type": "input_audio",
                                                       "input_audio": {"data": "", "format": "wav"}}]}])),
]


def random_cases(n, seed=1234):
    """Seeded random agent conversations mixing every feature the template branches on."""
    rng = random.Random(seed)
    words = ["alpha", "βeta", "γάμμα", "delta 🚀", "épée", "naïve", "漢字", "  pad  ", "\n", "x\ty", "\"q\"",
             "back\\slash", "<b>tag</b>", "</think>"]

    def text(k=None):
        return "".join(rng.choice(words) + rng.choice([" ", "", "\n"]) for _ in range(k or rng.randint(0, 6)))

    def args():
        pool = {"code": text(), "timeout": rng.choice([1, 2.5, 0.1, 1e-06, 3.0, 1e17]),
                "env": {"K": text(2), "L": rng.choice(["", "v"])}, "query": text(3),
                "filters": {"tags": [text(1) for _ in range(rng.randint(0, 3))], "min_score": rng.random()},
                "limit": rng.choice([None, 5, 0]), "exact": rng.choice([True, False]), "city": text(1)}
        keys = rng.sample(list(pool), rng.randint(0, 4))
        return {k: pool[k] for k in keys}

    cases = []
    for i in range(n):
        msgs = []
        if rng.random() < 0.6:
            msgs.append(S(text()))
        for _ in range(rng.randint(1, 3)):
            msgs.append(U(text() or "q"))
            for _ in range(rng.randint(0, 3)):
                kw = {}
                r = rng.random()
                if r < 0.3:
                    kw["reasoning_content"] = text()
                elif r < 0.45:
                    kw["reasoning"] = text()
                content = text()
                if rng.random() < 0.2:
                    content = "<think>\n" + text() + "\n</think>\n\n" + content
                ncalls = rng.choice([0, 0, 1, 1, 2, 3])
                if ncalls:
                    kw["tool_calls"] = [call(rng.choice(["run_python", "search_docs", "get_weather"]), args(),
                                             f"c{j}", as_string=rng.random() < 0.5) for j in range(ncalls)]
                msgs.append(A(content if rng.random() > 0.1 else None, **kw))
                for j in range(ncalls):
                    msgs.append(T(text() or "{}", f"c{j}"))
        tools = rng.choice([None, [], ALL_TOOLS, [ODD, WEATHER], [BARE]])
        cases.append((f"random_{i:02d}", req(msgs, tools=tools, agp=rng.random() < 0.7,
                                             thinking=rng.random() < 0.7, preserve=rng.random() < 0.3)))
    return cases


def normalise_for_jinja(request):
    """The documented input normalisations lily applies before the template logic runs (developer ->
    system, `reasoning` -> `reasoning_content`, JSON-string arguments parsed), applied so the stock
    template can serve as the reference."""
    r = copy.deepcopy(request)
    for m in r.get("messages") or []:
        if not isinstance(m, dict):
            continue
        if m.get("role") == "developer":
            m["role"] = "system"
        if not isinstance(m.get("reasoning_content"), str) and isinstance(m.get("reasoning"), str):
            m["reasoning_content"] = m["reasoning"]
        calls = m.get("tool_calls")
        for tc in calls if isinstance(calls, list) else []:
            fn = tc.get("function", tc) if isinstance(tc, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
    return r
