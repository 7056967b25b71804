// OutputParser: reasoning/content split, XML tool calls with schema-typed values, the malformed
// cases of FRONTEND.md §3.4, prompt streaming, and streaming == whole on every case.
#include <gtest/gtest.h>

#include <random>

#include "tokenizer/output_parser.h"

namespace lily {
namespace {

using json = nlohmann::json;

// Everything a parse produced, with tool-call deltas re-assembled per index.
struct Result {
  std::string reasoning, content;
  std::vector<ToolCall> calls;
  std::vector<ToolCall> streamed;   // from the deltas: id/name of the header, concatenated arguments
};

void absorb(Result& r, const ParseDelta& d) {
  r.reasoning += d.reasoning;
  r.content += d.content;
  for (const auto& t : d.tool_calls) {
    if (!t.id.empty()) {
      ASSERT_EQ(size_t(t.index), r.streamed.size()) << "header deltas must come in index order";
      ASSERT_TRUE(t.arguments.empty()) << "the first delta of a call carries no arguments";
      r.streamed.push_back({t.id, t.name, ""});
    } else {
      ASSERT_EQ(size_t(t.index) + 1, r.streamed.size()) << "argument fragment before its header";
      r.streamed.back().arguments_json += t.arguments;
    }
  }
}

Result parse_chunks(const std::string& text, const std::vector<size_t>& cuts, bool reasoning, const json& tools) {
  OutputParser p(reasoning, tools, 42);
  Result r;
  size_t prev = 0;
  for (size_t c : cuts) {
    absorb(r, p.push(std::string_view(text).substr(prev, c - prev)));
    prev = c;
  }
  absorb(r, p.push(std::string_view(text).substr(prev)));
  absorb(r, p.finish());
  r.calls = p.tool_calls();
  EXPECT_EQ(r.reasoning, p.reasoning());
  EXPECT_EQ(r.content, p.content());
  return r;
}

void expect_same(const Result& a, const Result& b, const std::string& how) {
  EXPECT_EQ(a.reasoning, b.reasoning) << how;
  EXPECT_EQ(a.content, b.content) << how;
  ASSERT_EQ(a.calls.size(), b.calls.size()) << how;
  for (size_t i = 0; i < a.calls.size(); ++i) {
    EXPECT_EQ(a.calls[i].id, b.calls[i].id) << how;
    EXPECT_EQ(a.calls[i].name, b.calls[i].name) << how;
    EXPECT_EQ(a.calls[i].arguments_json, b.calls[i].arguments_json) << how;
  }
}

// Parses whole, per character and in random chunks; all must agree. Returns the whole-text result.
Result parse(const std::string& text, bool reasoning = true, const json& tools = nullptr) {
  Result whole = parse_chunks(text, {}, reasoning, tools);
  std::vector<size_t> every;
  for (size_t i = 1; i < text.size(); ++i) every.push_back(i);
  expect_same(whole, parse_chunks(text, every, reasoning, tools), "per-character push");
  std::mt19937 rng(7);
  for (int trial = 0; trial < 8; ++trial) {
    std::vector<size_t> cuts;
    for (size_t i = 1; i < text.size(); i += 1 + rng() % 9) cuts.push_back(i);
    expect_same(whole, parse_chunks(text, cuts, reasoning, tools), "random chunks");
  }
  // The streamed deltas rebuild exactly the final calls.
  EXPECT_EQ(whole.streamed.size(), whole.calls.size());
  for (size_t i = 0; i < std::min(whole.streamed.size(), whole.calls.size()); ++i) {
    EXPECT_EQ(whole.streamed[i].id, whole.calls[i].id);
    EXPECT_EQ(whole.streamed[i].name, whole.calls[i].name);
    EXPECT_EQ(whole.streamed[i].arguments_json, whole.calls[i].arguments_json);
    EXPECT_TRUE(json::accept(whole.calls[i].arguments_json)) << whole.calls[i].arguments_json;
  }
  return whole;
}

const json kTools = json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
    "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
    "limit": {"type": ["integer", "null"]}, "note": {"type": "string"},
    "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "untyped": {"description": "x"}}}}},
  {"type": "function", "function": {"name": "run_python", "parameters": {"type": "object", "properties": {
    "code": {"type": "string"}, "timeout": {"type": "number"}}}}},
  {"name": "now", "parameters": {"type": "object", "properties": {}}}
])");

std::string call(const std::string& name, const std::vector<std::pair<std::string, std::string>>& params) {
  std::string s = "<tool_call>\n<function=" + name + ">\n";
  for (const auto& [k, v] : params) s += "<parameter=" + k + ">\n" + v + "\n</parameter>\n";
  return s + "</function>\n</tool_call>";
}

TEST(OutputParser, ReasoningThenContent) {
  Result r = parse("Let me think.\nStep two.\n</think>\n\nHello!");
  EXPECT_EQ(r.reasoning, "Let me think.\nStep two.");
  EXPECT_EQ(r.content, "Hello!");
  EXPECT_TRUE(r.calls.empty());
}

TEST(OutputParser, ThinkingOffIsAllContent) {
  Result r = parse("  Plain answer.\n\nSecond paragraph.", false);
  EXPECT_EQ(r.reasoning, "");
  EXPECT_EQ(r.content, "  Plain answer.\n\nSecond paragraph.");
}

TEST(OutputParser, ExplicitThinkAtStart) {
  Result a = parse("\n<think>\nabc\n</think>\n\nxyz", false);
  EXPECT_EQ(a.reasoning, "abc");
  EXPECT_EQ(a.content, "xyz");
  Result b = parse("<think>\nabc\n</think>\n\nxyz", true);   // prompt's <think> repeated by the model
  EXPECT_EQ(b.reasoning, "abc");
  EXPECT_EQ(b.content, "xyz");
  Result c = parse("x <think> y", false);   // only at the very start
  EXPECT_EQ(c.content, "x <think> y");
}

TEST(OutputParser, TruncatedReasoning) {
  Result r = parse("still thinking about </thi");
  EXPECT_EQ(r.reasoning, "still thinking about </thi");
  EXPECT_EQ(r.content, "");
  EXPECT_EQ(parse("").reasoning, "");
  EXPECT_EQ(parse("<thi", false).content, "<thi");
}

TEST(OutputParser, StrayCloseTagInContentStaysContent) {
  EXPECT_EQ(parse("answer</think>more", false).content, "answer</think>more");
}

TEST(OutputParser, ToolCallWithSchemaTypes) {
  Result r = parse("need weather\n</think>\n\n" + call("get_weather", {{"city", "Paris"}, {"days", "2"}}), true, kTools);
  EXPECT_EQ(r.reasoning, "need weather");
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].name, "get_weather");
  EXPECT_EQ(r.calls[0].arguments_json, R"({"city": "Paris", "days": 2})");
  EXPECT_EQ(r.calls[0].id.rfind("call_", 0), 0u);
  EXPECT_EQ(r.calls[0].id.size(), 29u);
}

TEST(OutputParser, ValueConversions) {
  Result r = parse(call("get_weather", {{"city", "42"},
                                         {"days", "seven"},
                                         {"ratio", "2.0"},
                                         {"ratio", "0.25"},
                                         {"metric", "True"},
                                         {"opts", "{\"b\": 1, \"a\": [true, null]}"},
                                         {"opts", "{not json}"},
                                         {"tags", "[\"x\", \"ü\"]"},
                                         {"limit", "null"},
                                         {"note", "null"},
                                         {"either", "5"},
                                         {"untyped", "17"},
                                         {"unknown", "3"}}),
                   false, kTools);
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].arguments_json,
            R"({"city": "42", "days": "seven", "ratio": 2, "ratio": 0.25, "metric": true, )"
            R"("opts": {"b": 1, "a": [true, null]}, "opts": "{not json}", "tags": ["x", "ü"], "limit": null, )"
            R"("note": "null", "either": 5, "untyped": "17", "unknown": "3"})");
}

TEST(OutputParser, LenientStructuredValues) {
  Result r = parse(call("get_weather", {{"days", "2.0"},
                                         {"days", "2.5"},
                                         {"opts", "{\"code\": \"line1\nline2\"}"},
                                         {"opts", "{'a': 'it\\'s', 'b': True, 'c': None, 'd': (1, 2)}"},
                                         {"tags", "('x', -1.5)"},
                                         {"opts", "{'a': x}"},
                                         {"untyped", "{\"k\": [1]}"}}),
                   false, kTools);
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].arguments_json,
            R"({"days": 2, "days": "2.5", "opts": {"code": "line1\nline2"}, )"
            R"("opts": {"a": "it's", "b": true, "c": null, "d": [1, 2]}, "tags": ["x", -1.5], "opts": "{'a': x}", )"
            R"("untyped": {"k": [1]}})");
}

TEST(OutputParser, UnknownFunctionAndNoToolsKeepStrings) {
  Result a = parse(call("mystery", {{"n", "1"}}), false, kTools);
  ASSERT_EQ(a.calls.size(), 1u);
  EXPECT_EQ(a.calls[0].arguments_json, R"({"n": "1"})");
  Result b = parse(call("get_weather", {{"days", "1"}}), false, nullptr);
  ASSERT_EQ(b.calls.size(), 1u);
  EXPECT_EQ(b.calls[0].arguments_json, R"({"days": "1"})");
}

TEST(OutputParser, OddToolDefinitionsNeverThrow) {
  const json odd = json::parse(R"([5, "x", null, {"function": null}, {"function": {"name": 7}},
      {"function": {"name": "f", "parameters": []}}, {"function": {"name": "g", "parameters": {"properties": 3}}},
      {"function": {"name": "h", "parameters": {"properties": {"n": 9, "m": {"type": 4}}}}}])");
  for (const char* fn : {"f", "g", "h"}) {
    Result r = parse(call(fn, {{"n", "1"}, {"m", "2"}}), false, odd);
    ASSERT_EQ(r.calls.size(), 1u) << fn;
    EXPECT_EQ(r.calls[0].arguments_json, R"({"n": "1", "m": "2"})") << fn;
  }
  Result s = parse(call("f", {{"n", "1"}}), false, json::parse(R"({"not": "an array"})"));
  EXPECT_EQ(s.calls.size(), 1u);
}

TEST(OutputParser, NoParameters) {
  Result r = parse(call("now", {}), false, kTools);
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].arguments_json, "{}");
}

TEST(OutputParser, ParallelCallsAndTextBefore) {
  Result r = parse("r\n</think>\n\nI'll check both.\n\n" + call("get_weather", {{"city", "Paris"}}) + "\n" +
                       call("get_weather", {{"city", "Lyon"}, {"days", "3"}}),
                   true, kTools);
  EXPECT_EQ(r.content, "I'll check both.");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0].arguments_json, R"({"city": "Paris"})");
  EXPECT_EQ(r.calls[1].arguments_json, R"({"city": "Lyon", "days": 3})");
  EXPECT_NE(r.calls[0].id, r.calls[1].id);
}

TEST(OutputParser, MultilineValuesStripOneNewlineEachSide) {
  Result r = parse(call("run_python", {{"code", "\nimport os\n\nprint(os.getcwd())\n"}}), false, kTools);
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(json::parse(r.calls[0].arguments_json)["code"], "\nimport os\n\nprint(os.getcwd())\n");
}

TEST(OutputParser, CallInsideReasoningEndsIt) {
  Result r = parse("I should call it.\n\n" + call("now", {}) + "\n", true, kTools);
  EXPECT_EQ(r.reasoning, "I should call it.");
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].name, "now");
}

TEST(OutputParser, MissingParameterCloser) {
  Result r = parse("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n4\n"
                   "</function>\n</tool_call>",
                   false, kTools);
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].arguments_json, R"({"city": "Paris", "days": 4})");
}

TEST(OutputParser, MissingFunctionAndCallClosers) {
  Result a = parse("<tool_call>\n<function=now>\n</tool_call>", false, kTools);
  ASSERT_EQ(a.calls.size(), 1u);
  Result b = parse("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n", false, kTools);
  ASSERT_EQ(b.calls.size(), 1u);
  EXPECT_EQ(b.calls[0].arguments_json, R"({"city": "Rome"})");
  // Next call starts without any closer of the previous one.
  Result c = parse("<tool_call>\n<function=now>\n<tool_call>\n<function=now>\n</function>\n</tool_call>", false, kTools);
  EXPECT_EQ(c.calls.size(), 2u);
  EXPECT_EQ(c.content, "");
  // </function> present, </tool_call> missing, text follows.
  Result d = parse("<tool_call>\n<function=now>\n</function>\nDone.", false, kTools);
  ASSERT_EQ(d.calls.size(), 1u);
  EXPECT_EQ(d.content, "Done.");
}

TEST(OutputParser, LiteralTagsInsideValueStayInValue) {
  const std::string code = "s = '</function>' + '<tool_call>'\nt = '</tool_call>'  # end";
  Result r = parse(call("run_python", {{"code", code}}), false, kTools);
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(json::parse(r.calls[0].arguments_json)["code"], code);
}

TEST(OutputParser, TruncatedInsideValueKeepsPartialCall) {
  Result r = parse("<tool_call>\n<function=run_python>\n<parameter=timeout>\n5\n</parameter>\n<parameter=code>\npri",
                   false, kTools);
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].arguments_json, R"({"timeout": 5, "code": "pri"})");
}

TEST(OutputParser, TruncatedBeforeFunctionNameIsContent) {
  Result r = parse("Checking.\n<tool_call>\n<func", false, kTools);
  EXPECT_TRUE(r.calls.empty());
  EXPECT_EQ(r.content, "Checking.\n<tool_call>\n<func");
}

TEST(OutputParser, NonXmlCallStaysContent) {
  const std::string hermes = "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
  Result r = parse("Sure. " + hermes, false, kTools);
  EXPECT_TRUE(r.calls.empty());
  EXPECT_EQ(r.content, "Sure. " + hermes);
  Result s = parse("about <tool_call> tags </think>\n\nok", true, kTools);   // inside reasoning
  EXPECT_EQ(s.reasoning, "about <tool_call> tags");
  EXPECT_EQ(s.content, "ok");
}

TEST(OutputParser, TextAfterCallIsContent) {
  Result r = parse(call("now", {}) + "\n\nAnything else?", false, kTools);
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.content, "Anything else?");
}

TEST(OutputParser, UnicodeEverywhere) {
  Result r = parse("思考中… 🤔\n</think>\n\nRéponse: ✓\n\n" + call("get_weather", {{"city", "Zürich 東京"}}), true, kTools);
  EXPECT_EQ(r.reasoning, "思考中… 🤔");
  EXPECT_EQ(r.content, "Réponse: ✓");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].arguments_json, "{\"city\": \"Zürich 東京\"}");
}

TEST(OutputParser, StreamingIsPrompt) {
  OutputParser c(false, nullptr, 1);
  EXPECT_EQ(c.push("Hello wor").content, "Hello wor");
  EXPECT_EQ(c.push("ld <").content, "ld");      // " <" could start <tool_call>
  EXPECT_EQ(c.push("b> x").content, " <b> x");
  EXPECT_EQ(c.push("<tool_").content, "");
  EXPECT_EQ(c.push("box>").content, "<tool_box>");
  OutputParser r(true, nullptr, 1);
  EXPECT_EQ(r.push("abc").reasoning, "abc");
  EXPECT_EQ(r.push(" def\n</th").reasoning, " def");
  ParseDelta d = r.push("ink>\n\nHi");
  EXPECT_EQ(d.reasoning, "");
  EXPECT_EQ(d.content, "Hi");
  EXPECT_FALSE(r.in_reasoning());
}

TEST(OutputParser, ToolDeltasArriveAsParametersComplete) {
  OutputParser p(false, kTools, 3);
  ParseDelta d1 = p.push("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa");
  ASSERT_EQ(d1.tool_calls.size(), 1u);
  EXPECT_EQ(d1.tool_calls[0].name, "get_weather");
  EXPECT_EQ(d1.tool_calls[0].arguments, "");
  ParseDelta d2 = p.push("ris\n</parameter>\n<parameter=days>\n2\n</parameter>\n");
  ASSERT_EQ(d2.tool_calls.size(), 1u);
  EXPECT_EQ(d2.tool_calls[0].arguments, R"({"city": "Paris", "days": 2)");
  EXPECT_TRUE(p.tool_calls().empty());
  ParseDelta d3 = p.push("</function>\n</tool_call>");
  ASSERT_EQ(d3.tool_calls.size(), 1u);
  EXPECT_EQ(d3.tool_calls[0].arguments, "}");
  EXPECT_EQ(p.tool_calls().size(), 1u);
  EXPECT_TRUE(p.finish().empty());
}

TEST(OutputParser, RandomIdsDifferAcrossParsers) {
  OutputParser a(false, nullptr), b(false, nullptr);
  a.push(call("now", {}));
  b.push(call("now", {}));
  ASSERT_EQ(a.tool_calls().size(), 1u);
  ASSERT_EQ(b.tool_calls().size(), 1u);
  EXPECT_NE(a.tool_calls()[0].id, b.tool_calls()[0].id);
}

// Random soup of tag fragments and text: never throws, and every split agrees with the whole.
TEST(OutputParser, FuzzNeverThrowsAndSplitsAgree) {
  const std::vector<std::string> pieces = {
      "<tool_call>", "</tool_call>", "<function=now>", "<function=get_weather>", "<parameter=city>",
      "<parameter=days>", "</parameter>", "</function>", "<think>", "</think>", "\n", "\n\n", " ", "x",
      "Paris", "42", "<", "</", "<tool", "</func", "é", "{\"a\": 1}", "<function=", ">"};
  std::mt19937 rng(99);
  for (int trial = 0; trial < 200; ++trial) {
    std::string text;
    int n = 1 + int(rng() % 30);
    for (int i = 0; i < n; ++i) text += pieces[rng() % pieces.size()];
    bool reasoning = rng() % 2;
    SCOPED_TRACE(text);
    EXPECT_NO_THROW(parse(text, reasoning, kTools));
  }
}

}  // namespace
}  // namespace lily
