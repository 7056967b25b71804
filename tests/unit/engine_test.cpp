// Engine tests with a fake model whose logits hash the whole consumed sequence (so any wrong
// state restore changes the output) and a byte-level fake tokenizer with the Qwen special tokens:
// prefix reuse in a 10-turn agent conversation vs cold runs, stop handling, tool-call streaming.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "core/common.h"
#include "engine/engine.h"
#include "model/qwen36.h"
#include "tiny_model.h"
#include "server/openai_response.h"
#include "tokenizer/chat_template.h"

namespace lily {
namespace {

const std::vector<std::string> kSpecials = {"<|im_start|>", "<|im_end|>", "<think>", "</think>",
                                            "<tool_call>", "</tool_call>", "<|endoftext|>"};

class FakeTokenizer : public Tokenizer {
 public:
  FakeTokenizer() : stops_{id_of("<|im_end|>"), id_of("<|endoftext|>")} {}
  static int32_t id_of(const std::string& s) {
    for (size_t i = 0; i < kSpecials.size(); ++i)
      if (kSpecials[i] == s) return int32_t(256 + i);
    return -1;
  }
  std::vector<int32_t> encode(std::string_view text, bool parse_special) const override {
    std::vector<int32_t> out;
    for (size_t i = 0; i < text.size();) {
      bool hit = false;
      if (parse_special)
        for (size_t k = 0; k < kSpecials.size() && !hit; ++k)
          if (text.substr(i, kSpecials[k].size()) == kSpecials[k]) {
            out.push_back(int32_t(256 + k));
            i += kSpecials[k].size();
            hit = true;
          }
      if (!hit) out.push_back(static_cast<unsigned char>(text[i++]));
    }
    return out;
  }
  std::string decode(std::span<const int32_t> ids, bool skip_special) const override {
    std::string s;
    for (int32_t id : ids)
      if (!(skip_special && is_special(id))) s += token_bytes(id);
    return s;
  }
  std::string token_bytes(int32_t id) const override {
    return id < 256 ? std::string(1, char(id)) : kSpecials[id - 256];
  }
  int32_t token_id(std::string_view t) const override { return id_of(std::string(t)); }
  int vocab_size() const override { return 256 + int(kSpecials.size()); }
  bool is_special(int32_t id) const override {
    return id == id_of("<|im_start|>") || id == id_of("<|im_end|>") || id == id_of("<|endoftext|>");
  }
  const std::vector<int32_t>& stop_ids() const override { return stops_; }

 private:
  std::vector<int32_t> stops_;
};

// Mirrors the hybrid model: KV rows (one token id per row, kept across reset like real KV memory)
// and a recurrent hash. Logits depend on both, so restoring a snapshot whose KV rows were
// overwritten, or the wrong recurrent state, changes the output.
struct FakeState : LmState {
  std::vector<int32_t> kv;
  uint64_t rec = 0;
  int p = 0, cap = 0;
  int pos() const override { return p; }
  int capacity() const override { return cap; }
};

uint64_t mix(uint64_t h, uint64_t v) { return (h ^ (v + 1)) * 1099511628211ull; }

// Logits are a pseudo-random function of the state. With a script, the token script[k] gets a
// large logit once `script_from` tokens were consumed (k = pos - script_from).
class FakeLm : public LanguageModel {
 public:
  int vocab_size() const override { return 270; }   // padded past the tokenizer's 263
  int max_chunk() const override { return 16; }
  std::unique_ptr<LmState> new_state(int capacity) override {
    auto s = std::make_unique<FakeState>();
    s->cap = capacity;
    s->kv.assign(capacity, -1);
    return s;
  }
  void reset(LmState& st) override {
    auto& s = static_cast<FakeState&>(st);
    s.rec = 0;
    s.p = 0;
  }
  void copy_state(const LmState& src, LmState& dst) override {
    auto& d = static_cast<FakeState&>(dst);
    auto& s = static_cast<const FakeState&>(src);
    ASSERT_GE(d.cap, s.p);
    std::copy(s.kv.begin(), s.kv.begin() + s.p, d.kv.begin());
    d.rec = s.rec;
    d.p = s.p;
  }
  void forward(LmState& st, std::span<const int32_t> tokens, float* logits) override {
    auto& s = static_cast<FakeState&>(st);
    if (s.p + int(tokens.size()) > s.cap) throw Error("fake: capacity exceeded");
    for (int32_t t : tokens) {
      s.kv[s.p++] = t;
      s.rec = mix(s.rec, uint64_t(t));
    }
    consumed += int64_t(tokens.size());
    ++calls;
    if (!logits) return;
    uint64_t h = s.rec;
    for (int i = 0; i < s.p; ++i) h = mix(h, uint64_t(s.kv[i]) * 31);
    for (int i = 0; i < vocab_size(); ++i) {
      uint64_t x = (h + uint64_t(i) * 0x9e3779b97f4a7c15ull);
      x ^= x >> 31;
      x *= 0xbf58476d1ce4e5b9ull;
      x ^= x >> 29;
      logits[i] = float(x % 10000) / 1000.0f - 5.0f;
    }
    const int k = s.p - script_from;
    if (!script.empty() && k >= 0 && k < int(script.size())) logits[script[k]] = 100.0f;
  }
  int64_t state_bytes(int capacity) const override { return 4LL * capacity + 1000; }
  std::unique_ptr<LmState> copy_recurrent(const LmState& src) override {
    if (!shared) return nullptr;
    auto& s = static_cast<const FakeState&>(src);
    auto d = std::make_unique<FakeState>();
    d->rec = s.rec;
    d->p = s.p;
    return d;
  }
  void restore_recurrent(const LmState& snap, LmState& dst) override {
    auto& s = static_cast<const FakeState&>(snap);
    auto& d = static_cast<FakeState&>(dst);
    d.rec = s.rec;
    d.p = s.p;
  }
  std::unique_ptr<LmState> materialize(const LmState& snap, const LmState& kv_src) override {
    auto& s = static_cast<const FakeState&>(snap);
    auto& k = static_cast<const FakeState&>(kv_src);
    auto d = std::make_unique<FakeState>();
    d->kv.assign(k.kv.begin(), k.kv.begin() + s.p);
    d->cap = s.p;
    d->rec = s.rec;
    d->p = s.p;
    ++materialized;
    return d;
  }
  int64_t recurrent_bytes() const override { return shared ? 1000 : 0; }

  std::vector<int32_t> script;
  int script_from = 0;
  bool shared = true;
  int64_t consumed = 0, calls = 0, materialized = 0;
};

GenerationRequest greedy(std::vector<int32_t> prompt, int max_tokens) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0.0f;
  r.max_tokens = max_tokens;
  return r;
}

TEST(Engine, GreedyMatchesADirectLoopAndStopsAtStopIds) {
  auto tok = std::make_shared<FakeTokenizer>();
  FakeLm lm;
  Engine eng(lm, tok, {});
  auto req = greedy(tok->encode("hello there", true), 40);
  req.ignore_eos = true;
  auto r = eng.generate(req);
  // Reference: argmax over the tokenizer's ids, one forward per token.
  auto st = lm.new_state(100);
  std::vector<float> l(270);
  lm.forward(*st, req.prompt, l.data());
  std::vector<int32_t> want;
  for (int i = 0; i < 40; ++i) {
    int32_t best = 0;
    for (int j = 1; j < 263; ++j)
      if (l[j] > l[best]) best = j;
    want.push_back(best);
    lm.forward(*st, {&best, 1}, l.data());
  }
  EXPECT_EQ(r.tokens, want);
  EXPECT_EQ(r.finish_reason, "length");
  EXPECT_EQ(r.completion_tokens, 40);

  // Force <|im_end|> as the 3rd token: it ends the output, counts as a token, adds no text.
  lm.script = {'a', 'b', FakeTokenizer::id_of("<|im_end|>")};
  lm.script_from = int(req.prompt.size());
  eng.reset_sessions();
  auto r2 = eng.generate(greedy(req.prompt, 40));
  EXPECT_EQ(r2.finish_reason, "stop");
  EXPECT_EQ(r2.text, "ab");
  EXPECT_EQ(r2.completion_tokens, 3);
}

TEST(Engine, StopStringsAreHeldBackAndNeverStreamed) {
  auto tok = std::make_shared<FakeTokenizer>();
  FakeLm lm;
  Engine eng(lm, tok, {});
  auto prompt = tok->encode("q", true);
  const std::string out = "hello STOP world";
  lm.script = tok->encode(out, false);
  lm.script_from = int(prompt.size());
  auto req = greedy(prompt, 100);
  req.stop = {"STOP", "xyz"};
  std::string streamed;
  auto r = eng.generate(req, [&](const GenerationEvent& e) {
    streamed += e.text;
    EXPECT_EQ(streamed.find("ST"), std::string::npos);   // a stop prefix is never streamed
  });
  EXPECT_EQ(r.text, "hello ");
  EXPECT_EQ(streamed, "hello ");
  EXPECT_EQ(r.finish_reason, "stop");
  EXPECT_EQ(r.stop_reason, "STOP");
}

TEST(Engine, RejectsTooLongPromptsWithoutTouchingState) {
  auto tok = std::make_shared<FakeTokenizer>();
  FakeLm lm;
  EngineOptions o;
  o.ctx = 32;
  Engine eng(lm, tok, o);
  EXPECT_THROW(eng.generate(greedy(std::vector<int32_t>(32, 'a'), 4)), Error);
  EXPECT_THROW(eng.generate(greedy({}, 4)), Error);
  EXPECT_THROW(eng.generate(greedy({300}, 4)), Error);   // not a tokenizer id
  EXPECT_EQ(lm.consumed, 0);
  // A prompt that fits is clipped to the room left and reports "length".
  auto req = greedy(std::vector<int32_t>(28, 'a'), 100);
  req.ignore_eos = true;
  auto r = eng.generate(req);
  EXPECT_EQ(r.completion_tokens, 4);
  EXPECT_EQ(r.finish_reason, "length");
}

TEST(Engine, CancelStopsAtTheNextToken) {
  auto tok = std::make_shared<FakeTokenizer>();
  FakeLm lm;
  Engine eng(lm, tok, {});
  std::atomic<bool> cancel{false};
  auto req = greedy(tok->encode("x", true), 50);
  req.ignore_eos = true;
  req.cancel = &cancel;
  int events = 0;
  auto r = eng.generate(req, [&](const GenerationEvent& e) {
    if (!e.ping && ++events == 5) cancel = true;
  });
  EXPECT_EQ(r.finish_reason, "cancelled");
  EXPECT_EQ(r.completion_tokens, 5);
  // The next request still works and reuses the consistent live state.
  auto r2 = eng.generate(greedy(tok->encode("x", true), 3));
  EXPECT_EQ(r2.cached_tokens, 1);
  EXPECT_FALSE(r2.tokens.empty());
}

TEST(Engine, ToolCallStreamingMatchesFinalCalls) {
  auto tok = std::make_shared<FakeTokenizer>();
  FakeLm lm;
  Engine eng(lm, tok, {});
  const auto tools = nlohmann::json::parse(R"([{"type":"function","function":{"name":"get_weather",
    "parameters":{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}}}}}])");
  auto prompt = tok->encode("<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n<think>\n", true);
  lm.script = tok->encode(
      "plan it\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
      "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>",
      true);
  lm.script_from = int(prompt.size());
  auto req = greedy(prompt, 200);
  req.parse_output = true;
  req.starts_in_reasoning = true;
  req.tools = tools;
  req.tool_id_seed = 5;
  std::string reasoning, content;
  std::map<int, std::string> args, names, ids;
  auto r = eng.generate(req, [&](const GenerationEvent& e) {
    reasoning += e.parsed.reasoning;
    content += e.parsed.content;
    for (const auto& d : e.parsed.tool_calls) {
      args[d.index] += d.arguments;
      names[d.index] += d.name;
      ids[d.index] += d.id;
    }
  });
  EXPECT_EQ(r.finish_reason, "tool_calls");
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].name, "get_weather");
  EXPECT_EQ(nlohmann::json::parse(r.tool_calls[0].arguments_json),
            nlohmann::json::parse(R"({"city": "Paris", "days": 2})"));
  EXPECT_EQ(names[0], "get_weather");
  EXPECT_EQ(ids[0], r.tool_calls[0].id);
  EXPECT_EQ(args[0], r.tool_calls[0].arguments_json);
  EXPECT_EQ(reasoning, r.reasoning);
  EXPECT_EQ(r.reasoning.find("plan it"), 0u);
  EXPECT_EQ(content, r.content);
  EXPECT_EQ(r.content.find("<tool_call>"), std::string::npos);
  EXPECT_GT(r.reasoning_tokens, 0);
  EXPECT_LT(r.reasoning_tokens, r.completion_tokens);
}

TEST(Engine, ToolCallsBecomeOpenAiChunksAndMessages) {
  auto tok = std::make_shared<FakeTokenizer>();
  FakeLm lm;
  Engine eng(lm, tok, {});
  ApiRequest api;
  api.chat = true;
  api.stream = true;
  api.include_usage = true;
  api.gen.prompt = tok->encode("<|im_start|>user\nfiles?<|im_end|>\n<|im_start|>assistant\n<think>\n", true);
  api.gen.sampling.temperature = 0.0f;
  api.gen.max_tokens = 300;
  api.gen.parse_output = true;
  api.gen.starts_in_reasoning = true;
  api.gen.tools = nlohmann::json::parse(R"([{"type":"function","function":{"name":"ls","parameters":
    {"type":"object","properties":{"dir":{"type":"string"},"all":{"type":"boolean"}}}}}])");
  lm.script = tok->encode(
      "look\n</think>\n\nChecking.\n\n<tool_call>\n<function=ls>\n<parameter=dir>\nsrc\n</parameter>\n"
      "<parameter=all>\ntrue\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=ls>\n"
      "<parameter=dir>\ndocs\n</parameter>\n</function>\n</tool_call><|im_end|>", true);
  lm.script_from = int(api.gen.prompt.size());
  ChunkWriter w(api, "chatcmpl-x", 1, "demo", *tok);
  std::string sse = w.start();
  auto r = eng.generate(api.gen, [&](const GenerationEvent& e) { sse += w.on_event(e); });
  sse += w.finish(r);

  // Reassemble the stream the way OpenAI clients do.
  std::vector<nlohmann::json> chunks;
  size_t at = 0;
  while ((at = sse.find("data: ", at)) != std::string::npos) {
    const size_t end = sse.find("\n\n", at);
    const std::string data = sse.substr(at + 6, end - at - 6);
    at = end;
    if (data == "[DONE]") break;
    chunks.push_back(nlohmann::json::parse(data));
  }
  ASSERT_GE(chunks.size(), 4u);
  EXPECT_EQ(chunks[0]["choices"][0]["delta"]["role"], "assistant");
  std::string reasoning, content, finish;
  std::map<int, nlohmann::json> calls;
  for (const auto& c : chunks) {
    EXPECT_EQ(c["id"], "chatcmpl-x");
    if (c["choices"].empty()) continue;
    const auto& ch = c["choices"][0];
    const auto& d = ch["delta"];
    int kinds = d.contains("content") + d.contains("reasoning_content") + d.contains("tool_calls");
    EXPECT_LE(kinds, 1) << c.dump();   // one kind of delta per chunk
    if (d.contains("reasoning_content")) {
      EXPECT_EQ(d["reasoning"], d["reasoning_content"]);
      reasoning += d["reasoning_content"].get<std::string>();
    }
    if (d.contains("content")) content += d["content"].get<std::string>();
    if (d.contains("tool_calls"))
      for (const auto& tc : d["tool_calls"]) {
        auto& call = calls[tc["index"].get<int>()];
        if (tc.contains("id")) {
          EXPECT_FALSE(call.contains("id"));
          call["id"] = tc["id"];
          EXPECT_EQ(tc["type"], "function");
        }
        if (tc["function"].contains("name")) call["name"] = tc["function"]["name"];
        call["arguments"] = call.value("arguments", "") + tc["function"]["arguments"].get<std::string>();
      }
    if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
  }
  EXPECT_EQ(finish, "tool_calls");
  EXPECT_TRUE(chunks.back()["choices"].empty());
  EXPECT_EQ(chunks.back()["usage"]["completion_tokens"], r.completion_tokens);
  EXPECT_EQ(reasoning, "look");
  EXPECT_EQ(content, r.content);
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(nlohmann::json::parse(calls[0]["arguments"].get<std::string>()),
            nlohmann::json::parse(R"({"dir": "src", "all": true})"));
  EXPECT_EQ(nlohmann::json::parse(calls[1]["arguments"].get<std::string>()),
            nlohmann::json::parse(R"({"dir": "docs"})"));
  EXPECT_NE(calls[0]["id"], calls[1]["id"]);

  // The non-streamed message carries the same calls.
  const auto msg = chat_response(api, r, "chatcmpl-x", 1, "demo", *tok)["choices"][0];
  EXPECT_EQ(msg["finish_reason"], "tool_calls");
  ASSERT_EQ(msg["message"]["tool_calls"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(msg["message"]["tool_calls"][i]["id"], calls[i]["id"]);
    EXPECT_EQ(msg["message"]["tool_calls"][i]["function"]["name"], "ls");
    EXPECT_EQ(msg["message"]["tool_calls"][i]["function"]["arguments"], calls[i]["arguments"]);
  }
  EXPECT_EQ(msg["message"]["reasoning_content"], "look");
}

// Largest turn boundary (end of "<|im_end|>\n" or end of prompt) of `prev` that still prefixes `cur`.
size_t reusable_boundary(const std::vector<int32_t>& prev, const std::vector<int32_t>& cur) {
  size_t lcp = 0;
  while (lcp < prev.size() && lcp < cur.size() && prev[lcp] == cur[lcp]) ++lcp;
  if (lcp == prev.size()) return lcp;
  const int32_t im_end = FakeTokenizer::id_of("<|im_end|>");
  for (size_t b = lcp; b >= 2; --b)
    if (prev[b - 2] == im_end && prev[b - 1] == '\n') return b;
  return 0;
}

TEST(Engine, TenTurnAgentConversationPrefillsOnlyNewTokens) {
  auto tok = std::make_shared<FakeTokenizer>();
  FakeLm warm_lm, cold_lm;
  EngineOptions cold_opt;
  cold_opt.prefix_reuse = false;
  Engine warm(warm_lm, tok, {}), cold(cold_lm, tok, cold_opt);
  const auto tools = nlohmann::ordered_json::parse(R"([{"type":"function","function":{"name":"ls",
    "description":"list files","parameters":{"type":"object","properties":{"dir":{"type":"string"}}}}}])");
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  messages.push_back({{"role", "system"}, {"content", "You are terse."}});
  messages.push_back({{"role", "user"}, {"content", "Look around."}});
  std::vector<int32_t> prev;
  for (int turn = 0; turn < 10; ++turn) {
    ChatTemplateOptions topt;
    const auto prompt = tok->encode(render_chat(messages, tools, topt), true);
    auto req = greedy(prompt, 12);
    req.parse_output = true;
    req.starts_in_reasoning = true;
    req.tools = tools;
    const int64_t before = warm_lm.consumed;
    const auto s0 = warm.stats();
    auto w = warm.generate(req);
    const auto s1 = warm.stats();
    auto c = cold.generate(req);
    EXPECT_EQ(w.tokens, c.tokens) << "turn " << turn;
    EXPECT_EQ(w.text, c.text) << "turn " << turn;
    EXPECT_EQ(c.cached_tokens, 0);
    // Only the tokens after the reused prefix went through the model (plus the decode steps).
    EXPECT_EQ(s1.prefill_tokens - s0.prefill_tokens, int64_t(prompt.size()) - w.cached_tokens);
    EXPECT_EQ(warm_lm.consumed - before,
              (s1.prefill_tokens - s0.prefill_tokens) + (s1.decode_tokens - s0.decode_tokens));
    EXPECT_EQ(s1.decode_tokens - s0.decode_tokens, w.completion_tokens - 1) << "turn " << turn;
    if (turn > 0) {
      const size_t want = reusable_boundary(prev, prompt);
      EXPECT_GE(size_t(w.cached_tokens), want) << "turn " << turn;
      EXPECT_GT(want, prev.size() / 2) << "turn " << turn;
    }
    prev = prompt;
    // The client replays the turn as OpenAI clients do: content, reasoning and a tool call.
    nlohmann::ordered_json am = {{"role", "assistant"}, {"content", w.content},
                                 {"reasoning_content", w.reasoning}};
    am["tool_calls"] = nlohmann::ordered_json::array(
        {{{"id", "call_" + std::to_string(turn)}, {"type", "function"},
          {"function", {{"name", "ls"}, {"arguments", "{\"dir\": \"d" + std::to_string(turn) + "\"}"}}}}});
    messages.push_back(am);
    messages.push_back({{"role", "tool"}, {"tool_call_id", "call_" + std::to_string(turn)},
                        {"content", "file" + std::to_string(turn) + ".txt"}});
    if (turn % 4 == 3) messages.push_back({{"role", "user"}, {"content", "Continue."}});
  }
  const auto s = warm.stats();
  EXPECT_GT(s.cached_tokens, s.prefill_tokens);   // most of the conversation was reused
  EXPECT_GT(s.cache.snapshots, 0);
  EXPECT_LT(warm_lm.consumed * 2, cold_lm.consumed);
}

}  // namespace
}  // namespace lily

namespace lily {
namespace {

TEST(Engine, InterleavedConversationsKeepTheirPrefixes) {
  // Two conversations alternate on one engine: each one's KV rows are overwritten by the other,
  // so its shared snapshot must be made self-contained before that happens.
  for (bool shared : {true, false}) {
    auto tok = std::make_shared<FakeTokenizer>();
    FakeLm warm_lm, cold_lm;
    warm_lm.shared = shared;
    EngineOptions cold_opt;
    cold_opt.prefix_reuse = false;
    Engine warm(warm_lm, tok, {}), cold(cold_lm, tok, cold_opt);
    std::string conv[2] = {"<|im_start|>user\nQuestion from Alice<|im_end|>\n<|im_start|>assistant\n<think>\n",
                           "<|im_start|>user\nQuestion from Bob<|im_end|>\n<|im_start|>assistant\n<think>\n"};
    size_t prev[2] = {0, 0};
    for (int turn = 0; turn < 8; ++turn) {
      const int c = turn % 2;
      const auto prompt = tok->encode(conv[c], true);
      auto w = warm.generate(greedy(prompt, 10));
      auto k = cold.generate(greedy(prompt, 10));
      EXPECT_EQ(w.tokens, k.tokens) << "shared " << shared << " turn " << turn;
      EXPECT_GE(size_t(w.cached_tokens), prev[c]) << "shared " << shared << " turn " << turn;
      prev[c] = prompt.size();
      conv[c] += "ok\n</think>\n\n" + std::to_string(turn) + "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
                 "<|im_start|>assistant\n<think>\n";
    }
    if (shared) EXPECT_GT(warm_lm.materialized, 0);
    else EXPECT_EQ(warm_lm.materialized, 0);
  }
}

TEST(Engine, SharedSnapshotsCostOnlyTheRecurrentState) {
  auto tok = std::make_shared<FakeTokenizer>();
  FakeLm lm;
  Engine eng(lm, tok, {});
  auto prompt = tok->encode(std::string(300, 'x') + "<|im_end|>\n" + std::string(300, 'y'), true);
  eng.generate(greedy(prompt, 2));
  const auto st = eng.stats().cache;
  EXPECT_EQ(st.snapshots, 2);   // the turn boundary and the end of the prompt
  // recurrent part (1000) + logits (270 floats) + tokens, independent of the 600-token length
  EXPECT_EQ(st.bytes, 2 * (1000 + 270 * 4) + 4 * (302 + int64_t(prompt.size())));
}

}  // namespace
}  // namespace lily

namespace lily {
namespace {

// The device decode loop (LanguageModel::generate, D2) forced on the cpu backend with a real tiny
// Qwen36: the same code path as on cuda. Its live-state record must stay exact: the follow-up
// request reusing the live state must decode exactly like a cold engine.
struct DeviceEngines {
  TinyModel tiny;
  std::unique_ptr<Backend> be = make_backend(BackendOptions{});
  Qwen36 model{tiny.w, *be, ModelOptions{16}};
  std::unique_ptr<LanguageModel> lm = make_qwen36_lm(model);
  std::shared_ptr<FakeTokenizer> tok = std::make_shared<FakeTokenizer>();
  std::unique_ptr<Engine> eng(int device, bool reuse) {
    EngineOptions o;
    o.ctx = 256;
    o.device_sampling = device;
    o.prefix_reuse = reuse;
    return std::make_unique<Engine>(*lm, tok, o);
  }
};

TEST(EngineDevice, GreedyMatchesTheHostLoop) {
  DeviceEngines d;
  auto host = d.eng(0, true), dev = d.eng(1, true);
  auto req = greedy(d.tok->encode("hello there", true), 24);
  req.ignore_eos = true;
  const auto a = host->generate(req);
  const auto b = dev->generate(req);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(b.finish_reason, "length");
  EXPECT_EQ(dev->stats().decode_tokens, 23);   // the last pick is never fed
}

TEST(EngineDevice, LiveStateRecordStaysExactForEveryStopReason) {
  DeviceEngines d;
  const auto prompt = d.tok->encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", true);
  // The greedy continuation, to place stop ids and stop strings on it.
  std::vector<int32_t> seq;
  {
    auto e = d.eng(0, false);
    auto req = greedy(prompt, 20);
    req.ignore_eos = true;
    seq = e->generate(req).tokens;
  }
  ASSERT_EQ(seq.size(), 20u);
  for (int mode = 0; mode < 5; ++mode) {
    auto dev = d.eng(1, true);
    auto cold = d.eng(0, false);
    GenerationRequest req = greedy(prompt, 12);
    req.ignore_eos = true;
    std::atomic<bool> cancel{false};
    int events = 0;
    EventSink sink;
    size_t want_tokens = 12;
    if (mode == 1) {   // stop id at pick 4
      req.stop_ids = {seq[4]};
      want_tokens = size_t(std::find(seq.begin(), seq.end(), seq[4]) - seq.begin()) + 1;
    } else if (mode == 2) {   // cancel after 5 picks
      req.cancel = &cancel;
      sink = [&](const GenerationEvent& e) {
        if (!e.ping && ++events == 5) cancel = true;
      };
      want_tokens = 5;
    } else if (mode == 3) {   // sampling with a seed and penalties
      req.sampling.temperature = 0.9f;
      req.sampling.top_p = 0.9f;
      req.sampling.top_k = 30;
      req.sampling.presence_penalty = 0.5f;
      req.sampling.repetition_penalty = 1.2f;
      req.sampling.has_seed = true;
      req.sampling.seed = 4;
      want_tokens = 0;
    } else if (mode == 4) {   // max_tokens = 1: nothing is fed back
      req.max_tokens = 1;
      want_tokens = 1;
    }
    const auto r = dev->generate(req, sink);
    if (want_tokens) {
      EXPECT_EQ(r.tokens.size(), want_tokens) << "mode " << mode;
    }
    if (mode == 0) {
      EXPECT_EQ(r.tokens, std::vector<int32_t>(seq.begin(), seq.begin() + 12));
    }
    const bool all = r.finish_reason == "length";
    const int consumed = int(r.tokens.size()) - (all ? 1 : 0);
    EXPECT_EQ(dev->stats().decode_tokens, consumed) << "mode " << mode;
    // Follow-up turn: the prompt extends everything sampled; the live state is reused as far as
    // it really got, and decoding matches a cold engine token for token.
    std::vector<int32_t> next = prompt;
    next.insert(next.end(), r.tokens.begin(), r.tokens.end());
    for (int32_t t : d.tok->encode("<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n", true)) next.push_back(t);
    auto req2 = greedy(next, 8);
    req2.ignore_eos = true;
    const auto w = dev->generate(req2);
    const auto c = cold->generate(req2);
    EXPECT_EQ(w.tokens, c.tokens) << "mode " << mode;
    EXPECT_GE(w.cached_tokens, int(prompt.size()) + consumed) << "mode " << mode;
  }
}

TEST(EngineDevice, StopStringsAreHeldBack) {
  DeviceEngines d;
  const auto prompt = d.tok->encode("abc", true);
  std::string text;
  {
    auto e = d.eng(0, false);
    auto req = greedy(prompt, 16);
    req.ignore_eos = true;
    text = e->generate(req).text;
  }
  // Stop on the first printable ASCII character of the greedy text (the fake decodes bytes 1:1).
  size_t at = 0;
  while (at < text.size() && !(text[at] > ' ' && text[at] < 127)) ++at;
  if (at == text.size()) GTEST_SKIP() << "no printable character in the greedy text";
  const std::string stop = text.substr(at, 1);
  const size_t first = at;
  auto dev = d.eng(1, true);
  auto req = greedy(prompt, 16);
  req.ignore_eos = true;
  req.stop = {stop};
  std::string streamed;
  const auto r = dev->generate(req, [&](const GenerationEvent& e) { streamed += e.text; });
  EXPECT_EQ(r.finish_reason, "stop");
  EXPECT_EQ(r.text, text.substr(0, first));
  EXPECT_EQ(streamed, r.text);
}

}  // namespace
}  // namespace lily
