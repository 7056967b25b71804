// OpenAI response and SSE chunk construction (see openai_response.h).
#include "server/openai_response.h"

namespace lily {
namespace {

using OJ = nlohmann::ordered_json;

OJ token_entry(const Tokenizer& tok, int32_t id, float logprob) {
  const std::string b = tok.token_bytes(id);
  OJ bytes = OJ::array();
  for (unsigned char ch : b) bytes.push_back(int(ch));
  return {{"token", b}, {"logprob", logprob}, {"bytes", bytes}};
}

// Chat form: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}.
OJ chat_logprobs(const Tokenizer& tok, const std::vector<TokenLogprob>& lps) {
  OJ content = OJ::array();
  for (const auto& lp : lps) {
    OJ e = token_entry(tok, lp.id, lp.logprob);
    OJ top = OJ::array();
    for (const auto& t : lp.top) top.push_back(token_entry(tok, t.id, t.logprob));
    e["top_logprobs"] = top;
    content.push_back(e);
  }
  return {{"content", content}};
}

// Legacy completions form: parallel arrays.
OJ completion_logprobs(const Tokenizer& tok, const std::vector<TokenLogprob>& lps, size_t offset0) {
  OJ tokens = OJ::array(), lp = OJ::array(), top = OJ::array(), offs = OJ::array();
  size_t off = offset0;
  for (const auto& x : lps) {
    const std::string b = tok.token_bytes(x.id);
    tokens.push_back(b);
    lp.push_back(x.logprob);
    OJ t = OJ::object();
    for (const auto& a : x.top) {
      // Keys are token text; partial UTF-8 tokens all print as U+FFFD, keep the likeliest one.
      const std::string key = OJ::parse(dump_json(OJ(tok.token_bytes(a.id)))).get<std::string>();
      if (!t.contains(key)) t[key] = a.logprob;
    }
    top.push_back(t);
    offs.push_back(off);
    off += b.size();
  }
  return {{"tokens", tokens}, {"token_logprobs", lp}, {"top_logprobs", top}, {"text_offset", offs}};
}

OJ tool_calls_json(const std::vector<ToolCall>& calls) {
  OJ a = OJ::array();
  for (const auto& c : calls)
    a.push_back({{"id", c.id}, {"type", "function"},
                 {"function", {{"name", c.name}, {"arguments", c.arguments_json}}}});
  return a;
}

}  // namespace

std::string dump_json(const OJ& j) { return j.dump(-1, ' ', false, OJ::error_handler_t::replace); }

std::string sse_event(const OJ& j) { return "data: " + dump_json(j) + "\n\n"; }

OJ usage_json(const GenerationResult& r) {
  return {{"prompt_tokens", r.prompt_tokens},
          {"completion_tokens", r.completion_tokens},
          {"total_tokens", r.prompt_tokens + r.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", r.cached_tokens}}},
          {"completion_tokens_details", {{"reasoning_tokens", r.reasoning_tokens}}}};
}

OJ chat_response(const ApiRequest& req, const GenerationResult& r, const std::string& id,
                 int64_t created, const std::string& model, const Tokenizer& tok) {
  OJ msg = {{"role", "assistant"}};
  msg["content"] = r.content.empty() && !r.tool_calls.empty() ? OJ() : OJ(r.content);
  if (!r.reasoning.empty()) {
    msg["reasoning_content"] = r.reasoning;
    msg["reasoning"] = r.reasoning;
  }
  if (!r.tool_calls.empty()) msg["tool_calls"] = tool_calls_json(r.tool_calls);
  OJ choice = {{"index", 0}, {"message", msg}};
  choice["logprobs"] = req.logprobs ? chat_logprobs(tok, r.logprobs) : OJ();
  choice["finish_reason"] = r.finish_reason;
  if (req.return_token_ids) choice["token_ids"] = r.tokens;
  return {{"id", id},       {"object", "chat.completion"}, {"created", created},
          {"model", model}, {"system_fingerprint", "lily"}, {"choices", OJ::array({choice})},
          {"usage", usage_json(r)}};
}

OJ completion_response(const ApiRequest& req, const GenerationResult& r, const std::string& id,
                       int64_t created, const std::string& model, const Tokenizer& tok) {
  const std::string prefix = req.echo ? req.prompt_text : "";
  OJ choice = {{"index", 0}, {"text", prefix + r.text}};
  choice["logprobs"] = req.logprobs ? completion_logprobs(tok, r.logprobs, prefix.size()) : OJ();
  choice["finish_reason"] = r.finish_reason;
  if (req.return_token_ids) choice["token_ids"] = r.tokens;
  return {{"id", id},       {"object", "text_completion"},  {"created", created},
          {"model", model}, {"system_fingerprint", "lily"}, {"choices", OJ::array({choice})},
          {"usage", usage_json(r)}};
}

ChunkWriter::ChunkWriter(const ApiRequest& req, std::string id, int64_t created, std::string model,
                         const Tokenizer& tok)
    : req_(req), id_(std::move(id)), model_(std::move(model)), created_(created), tok_(tok) {}

OJ ChunkWriter::chunk(OJ choice) const {
  OJ c = {{"id", id_},
          {"object", req_.chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created_},
          {"model", model_},
          {"system_fingerprint", "lily"},
          {"choices", OJ::array({std::move(choice)})}};
  if (req_.include_usage) c["usage"] = OJ();
  return c;
}

OJ ChunkWriter::take_logprobs() {
  if (!req_.logprobs || pending_lp_.empty()) return OJ();
  OJ j = req_.chat ? chat_logprobs(tok_, pending_lp_) : completion_logprobs(tok_, pending_lp_, 0);
  pending_lp_.clear();
  return j;
}

std::string ChunkWriter::start() {
  if (!req_.chat) {
    if (!req_.echo) return {};
    echoed_ = true;
    return sse_event(chunk({{"index", 0}, {"text", req_.prompt_text}, {"logprobs", OJ()},
                            {"finish_reason", OJ()}}));
  }
  return sse_event(chunk({{"index", 0},
                          {"delta", {{"role", "assistant"}, {"content", ""}}},
                          {"logprobs", OJ()},
                          {"finish_reason", OJ()}}));
}

std::string ChunkWriter::on_event(const GenerationEvent& ev) {
  if (ev.ping) return ": ping " + std::to_string(ev.prefill_done) + "/" + std::to_string(ev.prefill_total) + "\n\n";
  pending_lp_.insert(pending_lp_.end(), ev.logprobs.begin(), ev.logprobs.end());
  std::string out;
  if (!req_.chat) {
    if (ev.text.empty()) return {};
    OJ ch = {{"index", 0}, {"text", ev.text}};
    ch["logprobs"] = take_logprobs();
    ch["finish_reason"] = OJ();
    return sse_event(chunk(ch));
  }
  auto delta_chunk = [&](OJ delta) {
    OJ ch = {{"index", 0}, {"delta", std::move(delta)}};
    ch["logprobs"] = take_logprobs();
    ch["finish_reason"] = OJ();
    out += sse_event(chunk(ch));
  };
  // One kind per delta (reasoning under both field names, content, tool calls).
  if (!ev.parsed.reasoning.empty())
    delta_chunk({{"reasoning_content", ev.parsed.reasoning}, {"reasoning", ev.parsed.reasoning}});
  if (!ev.parsed.content.empty()) delta_chunk({{"content", ev.parsed.content}});
  for (const auto& d : ev.parsed.tool_calls) {
    OJ call = {{"index", d.index}};
    if (!d.id.empty()) {
      call["id"] = d.id;
      call["type"] = "function";
    }
    OJ fn = OJ::object();
    if (!d.name.empty()) fn["name"] = d.name;
    fn["arguments"] = d.arguments;
    call["function"] = fn;
    delta_chunk({{"tool_calls", OJ::array({call})}});
  }
  return out;
}

std::string ChunkWriter::finish(const GenerationResult& r) {
  OJ ch = {{"index", 0}};
  if (req_.chat) ch["delta"] = OJ::object();
  else ch["text"] = "";
  ch["logprobs"] = take_logprobs();
  ch["finish_reason"] = r.finish_reason;
  if (req_.return_token_ids) ch["token_ids"] = r.tokens;
  std::string out = sse_event(chunk(ch));
  if (req_.include_usage) {
    OJ u = chunk(OJ());
    u["choices"] = OJ::array();
    u["usage"] = usage_json(r);
    out += sse_event(u);
  }
  return out + "data: [DONE]\n\n";
}

}  // namespace lily
