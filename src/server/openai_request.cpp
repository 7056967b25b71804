// OpenAI request parsing and validation (see openai_request.h).
#include "server/openai_request.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/common.h"
#include "server/api_error.h"

namespace lily {
namespace {

using OJ = nlohmann::ordered_json;

// The field, or nullptr when absent or JSON null (OpenAI clients send explicit nulls).
const OJ* opt(const OJ& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

bool get_bool(const OJ& body, const char* name, bool def) {
  const OJ* v = opt(body, name);
  if (!v) return def;
  if (!v->is_boolean()) throw bad_request(name, std::string("'") + name + "' must be a boolean");
  return v->get<bool>();
}

double get_number(const OJ& body, const char* name, double def) {
  const OJ* v = opt(body, name);
  if (!v) return def;
  if (!v->is_number()) throw bad_request(name, std::string("'") + name + "' must be a number");
  return v->get<double>();
}

int64_t get_int(const OJ& body, const char* name, int64_t def, int64_t lo, int64_t hi) {
  const OJ* v = opt(body, name);
  if (!v) return def;
  if (!v->is_number_integer() && !(v->is_number_float() && v->get<double>() == double(int64_t(v->get<double>()))))
    throw bad_request(name, std::string("'") + name + "' must be an integer");
  const int64_t x = v->is_number_integer() ? v->get<int64_t>() : int64_t(v->get<double>());
  if (x < lo || x > hi)
    throw bad_request(name, std::string("'") + name + "' must be between " + std::to_string(lo) +
                                " and " + std::to_string(hi));
  return x;
}

void check_model(const OJ& body, const ApiContext& c) {
  const OJ* m = opt(body, "model");
  if (!m) return;
  if (!m->is_string()) throw bad_request("model", "'model' must be a string");
  const std::string name = m->get<std::string>();
  if (name != c.model_name && name != "default")
    throw ApiError(404, "The model '" + name + "' does not exist; this server serves '" +
                            c.model_name + "'", "model", "model_not_found");
}

// Sampling fields, the stop list and max_tokens shared by both endpoints.
void parse_common(const OJ& body, const ApiContext& c, SamplingParams base, ApiRequest& r) {
  if (!body.is_object()) throw bad_request("", "the request body must be a JSON object");
  check_model(body, c);
  if (const OJ* n = opt(body, "n"); n && !(n->is_number_integer() && n->get<int64_t>() == 1))
    throw bad_request("n", "only n = 1 is supported");
  if (const OJ* bo = opt(body, "best_of"); bo && !(bo->is_number_integer() && bo->get<int64_t>() == 1))
    throw bad_request("best_of", "only best_of = 1 is supported");
  r.stream = get_bool(body, "stream", false);
  if (const OJ* so = opt(body, "stream_options")) {
    if (!so->is_object()) throw bad_request("stream_options", "'stream_options' must be an object");
    if (!r.stream) throw bad_request("stream_options", "'stream_options' is only allowed with stream: true");
    r.include_usage = get_bool(*so, "include_usage", false);
  }
  SamplingParams& s = r.gen.sampling;
  s = base;
  s.temperature = float(get_number(body, "temperature", s.temperature));
  s.top_p = float(get_number(body, "top_p", s.top_p));
  s.top_k = int(get_int(body, "top_k", s.top_k, -1, 1 << 30));
  if (s.top_k < 0) s.top_k = 0;   // vLLM / llama.cpp use -1 for "off"
  s.min_p = float(get_number(body, "min_p", s.min_p));
  s.presence_penalty = float(get_number(body, "presence_penalty", s.presence_penalty));
  s.frequency_penalty = float(get_number(body, "frequency_penalty", s.frequency_penalty));
  s.repetition_penalty = float(get_number(body, "repeat_penalty", s.repetition_penalty));
  s.repetition_penalty = float(get_number(body, "repetition_penalty", s.repetition_penalty));
  if (opt(body, "seed")) {
    s.has_seed = true;
    s.seed = uint64_t(get_int(body, "seed", 0, INT64_MIN, INT64_MAX));
  }
  if (const OJ* lb = opt(body, "logit_bias")) {
    if (!lb->is_object()) throw bad_request("logit_bias", "'logit_bias' must map token ids to numbers");
    for (const auto& [key, v] : lb->items()) {
      char* end = nullptr;
      const long id = std::strtol(key.c_str(), &end, 10);
      if (key.empty() || *end || !v.is_number() || id < 0 || id >= c.tok.vocab_size())
        throw bad_request("logit_bias", "'logit_bias' keys must be token ids in [0, " +
                                            std::to_string(c.tok.vocab_size()) + ") with numeric values");
      s.logit_bias.push_back({int32_t(id), v.get<float>()});
    }
  }
  try {
    s.validate();
  } catch (const Error& e) {
    const std::string msg = e.what();
    const std::string param = msg.size() > 2 ? msg.substr(1, msg.find('\'', 1) - 1) : "";
    throw bad_request(param, msg);
  }

  int64_t max_tokens = get_int(body, "max_tokens", -1, 1, INT32_MAX);
  const int64_t mct = get_int(body, "max_completion_tokens", -1, 1, INT32_MAX);
  if (mct > 0) max_tokens = max_tokens > 0 ? std::min(max_tokens, mct) : mct;
  r.gen.max_tokens = max_tokens > 0 ? int(max_tokens) : c.defaults.max_tokens;

  if (const OJ* st = opt(body, "stop")) {
    if (st->is_string()) {
      r.gen.stop.push_back(st->get<std::string>());
    } else if (st->is_array()) {
      if (st->size() > 16) throw bad_request("stop", "at most 16 stop strings are supported");
      for (const auto& x : *st) {
        if (!x.is_string()) throw bad_request("stop", "'stop' must be a string or a list of strings");
        r.gen.stop.push_back(x.get<std::string>());
      }
    } else {
      throw bad_request("stop", "'stop' must be a string or a list of strings");
    }
  }
  if (const OJ* ids = opt(body, "stop_token_ids")) {
    if (!ids->is_array()) throw bad_request("stop_token_ids", "'stop_token_ids' must be a list of integers");
    for (const auto& x : *ids) {
      if (!x.is_number_integer()) throw bad_request("stop_token_ids", "'stop_token_ids' must be a list of integers");
      r.gen.stop_ids.push_back(x.get<int32_t>());
    }
  }
  r.gen.ignore_eos = get_bool(body, "ignore_eos", false);
  r.return_token_ids = get_bool(body, "return_token_ids", false);
  if (const OJ* rf = opt(body, "response_format")) {
    if (!rf->is_object() || rf->value("type", "") != "text")
      throw bad_request("response_format", "only response_format {\"type\": \"text\"} is supported");
  }
}

void check_prompt_length(const ApiRequest& r, const ApiContext& c, const char* param) {
  const int n = int(r.gen.prompt.size());
  if (n >= c.ctx)
    throw bad_request(param,
                      "This model's maximum context length is " + std::to_string(c.ctx) +
                          " tokens, but the prompt has " + std::to_string(n) +
                          " tokens (at least one output token must fit)",
                      "context_length_exceeded");
}

}  // namespace

SamplingDefaults load_sampling_defaults(const std::string& model_dir) {
  SamplingParams base;   // Qwen3.5/3.6 generation_config.json values when the file is absent
  base.temperature = 1.0f;
  base.top_p = 0.95f;
  base.top_k = 20;
  std::ifstream f(model_dir + "/generation_config.json");
  if (f) {
    OJ g;
    try {
      g = OJ::parse(f);
    } catch (const std::exception& e) {
      throw Error(model_dir + "/generation_config.json: invalid JSON: " + e.what());
    }
    if (g.contains("temperature") && g["temperature"].is_number()) base.temperature = g["temperature"].get<float>();
    if (g.contains("top_p") && g["top_p"].is_number()) base.top_p = g["top_p"].get<float>();
    if (g.contains("top_k") && g["top_k"].is_number_integer()) base.top_k = g["top_k"].get<int>();
    if (g.contains("min_p") && g["min_p"].is_number()) base.min_p = g["min_p"].get<float>();
    if (g.contains("repetition_penalty") && g["repetition_penalty"].is_number())
      base.repetition_penalty = g["repetition_penalty"].get<float>();
    if (g.contains("do_sample") && g["do_sample"].is_boolean() && !g["do_sample"].get<bool>())
      base.temperature = 0.0f;
  }
  SamplingDefaults d;
  d.completion = base;
  // Model card, Qwen3.6-35B-A3B: thinking "general" adds presence_penalty 1.5; non-thinking
  // "general" uses T 0.7, top_p 0.8, top_k 20, presence_penalty 1.5 (FRONTEND.md §3.6).
  d.thinking = base;
  d.thinking.presence_penalty = 1.5f;
  d.instruct = base;
  d.instruct.temperature = 0.7f;
  d.instruct.top_p = 0.8f;
  d.instruct.top_k = 20;
  d.instruct.presence_penalty = 1.5f;
  return d;
}

ChatTemplateOptions parse_template_options(const OJ& body) {
  ChatTemplateOptions o;
  if (const OJ* re = opt(body, "reasoning_effort")) {
    if (!re->is_string()) throw bad_request("reasoning_effort", "'reasoning_effort' must be a string");
    const std::string v = re->get<std::string>();
    if (v == "none" || v == "minimal") o.enable_thinking = false;
    else if (v != "low" && v != "medium" && v != "high")
      throw bad_request("reasoning_effort", "'reasoning_effort' must be none, minimal, low, medium or high");
  }
  if (const OJ* k = opt(body, "chat_template_kwargs")) {
    if (!k->is_object())
      throw bad_request("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    o.enable_thinking = get_bool(*k, "enable_thinking", o.enable_thinking);
    o.preserve_thinking = get_bool(*k, "preserve_thinking", o.preserve_thinking);
  }
  o.add_generation_prompt = get_bool(body, "add_generation_prompt", true);
  return o;
}

std::string render_request_prompt(const OJ& body, const ChatTemplateOptions& o) {
  const OJ* msgs = opt(body, "messages");
  if (!msgs || !msgs->is_array()) throw bad_request("messages", "'messages' must be a list of messages");
  if (msgs->empty()) throw bad_request("messages", "'messages' must not be empty");
  for (size_t i = 0; i < msgs->size(); ++i) {
    const OJ& m = (*msgs)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw bad_request(where, where + " must be an object with a string 'role'");
    const OJ* content = opt(m, "content");
    if (content && !content->is_string() && !content->is_array())
      throw bad_request(where + ".content", where + ".content must be a string or a list of parts");
    if (content && content->is_array()) {
      for (const auto& part : *content) {
        const std::string type = part.is_object() ? part.value("type", "") : "";
        if (type != "text")
          throw bad_request(where + ".content",
                            "unsupported content part type '" + type +
                                "': this server is text-only (images, audio and files are not supported)");
        if (!part.contains("text") || !part["text"].is_string())
          throw bad_request(where + ".content", "a text part needs a string 'text'");
      }
    }
  }
  OJ tools;
  if (const OJ* t = opt(body, "tools")) {
    if (!t->is_array()) throw bad_request("tools", "'tools' must be a list");
    for (const auto& x : *t)
      if (!x.is_object() || x.value("type", "") != "function" || !x.contains("function") ||
          !x["function"].is_object() || !x["function"].contains("name") || !x["function"]["name"].is_string())
        throw bad_request("tools", "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}");
    if (!t->empty()) tools = *t;
  }
  if (const OJ* tc = opt(body, "tool_choice")) {
    const bool ok = tc->is_string() && (*tc == "auto" || *tc == "none");
    if (!ok)
      throw bad_request("tool_choice", "only tool_choice \"auto\" and \"none\" are supported");
    if (*tc == "none") tools = OJ();
  }
  try {
    return render_chat(*msgs, tools, o);
  } catch (const Error& e) {
    throw bad_request("messages", e.what());
  }
}

ApiRequest parse_chat_request(const OJ& body, const ApiContext& c) {
  ApiRequest r;
  r.chat = true;
  if (!body.is_object()) throw bad_request("", "the request body must be a JSON object");
  const ChatTemplateOptions topt = parse_template_options(body);
  parse_common(body, c, topt.enable_thinking ? c.defaults.thinking : c.defaults.instruct, r);
  r.logprobs = get_bool(body, "logprobs", false);
  const int64_t top = get_int(body, "top_logprobs", 0, 0, 20);
  if (top > 0 && !r.logprobs) throw bad_request("top_logprobs", "'top_logprobs' requires 'logprobs': true");
  r.gen.logprobs = r.logprobs ? int(top) : -1;
  r.prompt_text = render_request_prompt(body, topt);
  r.gen.prompt = c.tok.encode(r.prompt_text, true);
  check_prompt_length(r, c, "messages");
  r.gen.parse_output = true;
  const std::string tail = "<think>\n";
  r.gen.starts_in_reasoning = r.prompt_text.size() >= tail.size() &&
                              r.prompt_text.compare(r.prompt_text.size() - tail.size(), tail.size(), tail) == 0;
  if (const OJ* t = opt(body, "tools"); t && t->is_array() && !(opt(body, "tool_choice") && body["tool_choice"] == "none"))
    r.gen.tools = nlohmann::json::parse(t->dump());
  return r;
}

ApiRequest parse_completion_request(const OJ& body, const ApiContext& c) {
  ApiRequest r;
  r.chat = false;
  parse_common(body, c, c.defaults.completion, r);
  const OJ* p = opt(body, "prompt");
  if (!p) throw bad_request("prompt", "'prompt' is required");
  const int n_vocab = c.tok.vocab_size();
  auto take_ids = [&](const OJ& arr) {
    for (const auto& x : arr) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= n_vocab)
        throw bad_request("prompt", "token ids in 'prompt' must be integers in [0, " +
                                        std::to_string(n_vocab) + ")");
      r.gen.prompt.push_back(x.get<int32_t>());
    }
  };
  if (p->is_string()) {
    r.prompt_text = p->get<std::string>();
  } else if (p->is_array() && !p->empty() && (*p)[0].is_number()) {
    take_ids(*p);
  } else if (p->is_array() && p->size() == 1 && (*p)[0].is_string()) {
    r.prompt_text = (*p)[0].get<std::string>();
  } else if (p->is_array() && p->size() == 1 && (*p)[0].is_array()) {
    take_ids((*p)[0]);
  } else if (p->is_array() && p->size() > 1) {
    throw bad_request("prompt", "only one prompt per request is supported");
  } else {
    throw bad_request("prompt", "'prompt' must be a string, a list of token ids or a one-element list");
  }
  if (r.gen.prompt.empty()) r.gen.prompt = c.tok.encode(r.prompt_text, true);
  else r.prompt_text = c.tok.decode(r.gen.prompt, false);
  if (r.gen.prompt.empty()) throw bad_request("prompt", "'prompt' must not be empty");
  check_prompt_length(r, c, "prompt");
  if (const OJ* lp = opt(body, "logprobs")) {
    if (lp->is_boolean()) {
      r.logprobs = lp->get<bool>();
      r.gen.logprobs = r.logprobs ? 0 : -1;
    } else {
      r.gen.logprobs = int(get_int(body, "logprobs", -1, 0, 20));
      r.logprobs = true;
    }
  }
  r.echo = get_bool(body, "echo", false);
  if (const OJ* sfx = opt(body, "suffix"); sfx && !(sfx->is_string() && sfx->get<std::string>().empty()))
    throw bad_request("suffix", "'suffix' is not supported");
  return r;
}

}  // namespace lily
