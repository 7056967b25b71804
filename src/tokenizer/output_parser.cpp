// Incremental reasoning / content / XML tool-call parser (see output_parser.h). A small state machine
// over a buffer of not-yet-final text: each mode looks for its tags and holds back only a suffix that
// could still become one, so streaming is prompt and any split of the input gives the same result.
#include "tokenizer/output_parser.h"

#include <algorithm>
#include <cstdio>
#include <random>

#include "tokenizer/json_py.h"
#include "tokenizer/output_parser_values.h"

namespace lily {

namespace {

using OJson = nlohmann::ordered_json;

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kCallOpen = "<tool_call>";
constexpr std::string_view kCallClose = "</tool_call>";
constexpr std::string_view kFuncOpen = "<function=";
constexpr std::string_view kFuncClose = "</function>";
constexpr std::string_view kParamOpen = "<parameter=";
constexpr std::string_view kParamClose = "</parameter>";
constexpr size_t kMaxNameLen = 256;   // a longer "<function=..." header is not a tag

bool is_ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

size_t skip_ws(std::string_view s, size_t i = 0) {
  while (i < s.size() && is_ws(s[i])) ++i;
  return i;
}

size_t rstrip_len(std::string_view s) {
  size_t e = s.size();
  while (e > 0 && is_ws(s[e - 1])) --e;
  return e;
}

std::string trim(std::string_view s) {
  size_t b = skip_ws(s);
  return std::string(s.substr(b, rstrip_len(s) - std::min(b, rstrip_len(s))));
}

// s is non-empty and shorter than tag and tag starts with it: more input could complete the tag.
bool is_proper_prefix(std::string_view s, std::string_view tag) {
  return !s.empty() && s.size() < tag.size() && tag.substr(0, s.size()) == s;
}

// Length of the longest suffix of s that is a proper prefix of one of the tags.
size_t partial_tag_suffix(std::string_view s, std::initializer_list<std::string_view> tags) {
  size_t best = 0;
  for (std::string_view tag : tags)
    for (size_t n = std::min(s.size(), tag.size() - 1); n > best; --n)
      if (s.substr(s.size() - n) == tag.substr(0, n)) {
        best = n;
        break;
      }
  return best;
}

}  // namespace

struct OutputParser::Impl {
  enum class Mode { kReasoning, kContent, kCall };
  enum class Sub { kExpectFunction, kBody, kValue, kAfterFunction };

  nlohmann::json tools;
  std::mt19937_64 rng;
  Mode mode;
  Sub sub = Sub::kExpectFunction;
  std::string buf;                   // text not yet final
  bool content_at_start = true;      // an explicit "<think>" may still open the output
  bool reasoning_at_start = true;    // leading whitespace / a repeated "<think>" are dropped
  bool content_lstrip_nl = false;    // just after </think>: drop the template's "\n\n"
  bool content_lstrip_ws = false;    // just after a tool call: drop separators
  Mode call_from = Mode::kContent;   // where a malformed "<tool_call>" text goes back to
  std::string ws_before_call;        // whitespace dropped before "<tool_call>" (restored on fallback)
  // The call being parsed.
  std::string param_name;
  const nlohmann::json* props = nullptr;   // the function's parameter schemas, or null
  size_t value_scan = 0;                   // value terminators were searched up to here
  std::string pending_id, pending_name;    // listed in tool_calls() only once complete
  int n_params = 0;
  std::string args_json;

  std::vector<ToolCall> calls;
  std::string reasoning_all, content_all;
  ParseDelta delta;

  Impl(bool starts_in_reasoning, const nlohmann::json& t, uint64_t seed)
      : tools(t), rng(seed ? seed : (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}()),
        mode(starts_in_reasoning ? Mode::kReasoning : Mode::kContent) {}

  void emit_reasoning(std::string_view s) {
    delta.reasoning += s;
    reasoning_all += s;
  }
  void emit_content(std::string_view s) {
    if (s.empty()) return;
    delta.content += s;
    content_all += s;
    content_at_start = false;
  }
  void emit_args(std::string_view frag) {
    int index = int(calls.size());
    args_json += frag;
    auto& tc = delta.tool_calls;
    if (!tc.empty() && tc.back().index == index && tc.back().id.empty()) tc.back().arguments += frag;
    else tc.push_back({index, "", "", std::string(frag)});
  }
  void consume(size_t n) { buf.erase(0, n); }

  std::string new_id() {
    char hex[32];
    std::snprintf(hex, sizeof hex, "%016llx%08llx", static_cast<unsigned long long>(rng()),
                  static_cast<unsigned long long>(rng() & 0xffffffffu));
    return std::string("call_") + hex;
  }

  // "<tool_call>" ends the current mode; whitespace right before it is the model's separator.
  void enter_call(size_t tag_pos) {
    std::string_view before(buf.data(), tag_pos);
    size_t keep = rstrip_len(before);
    if (mode == Mode::kReasoning) emit_reasoning(before.substr(0, keep));
    else emit_content(before.substr(0, keep));
    ws_before_call = std::string(before.substr(keep));
    call_from = mode;
    consume(tag_pos + kCallOpen.size());
    mode = Mode::kCall;
    sub = Sub::kExpectFunction;
  }

  // Not a call after all: the tag goes back to the mode it came from as plain text.
  void call_fallback() {
    mode = call_from;
    std::string text = ws_before_call + std::string(kCallOpen);
    if (mode == Mode::kReasoning) {
      reasoning_at_start = false;
      emit_reasoning(text);
    } else {
      emit_content(text);
    }
  }

  void start_call(std::string name) {
    props = nullptr;
    if (tools.is_array())
      for (const auto& tool : tools) {
        const nlohmann::json& fn = tool.is_object() && tool.contains("function") ? tool["function"] : tool;
        if (!fn.is_object()) continue;
        auto n = fn.find("name");
        if (n == fn.end() || !n->is_string() || n->get_ref<const std::string&>() != name) continue;
        auto p = fn.find("parameters");
        if (p != fn.end() && p->is_object()) {
          auto pr = p->find("properties");
          if (pr != p->end() && pr->is_object()) props = &*pr;
        }
        break;
      }
    n_params = 0;
    args_json.clear();
    pending_id = new_id();
    pending_name = std::move(name);
    delta.tool_calls.push_back({int(calls.size()), pending_id, pending_name, ""});
    sub = Sub::kBody;
  }

  void finish_param(std::string value) {
    if (!value.empty() && value.front() == '\n') value.erase(0, 1);
    if (!value.empty() && value.back() == '\n') value.pop_back();
    const nlohmann::json* schema = nullptr;
    if (props) {
      auto it = props->find(param_name);
      if (it != props->end()) schema = &*it;
    }
    std::string frag = n_params == 0 ? "{" : ", ";
    frag += json_py_dumps(param_name) + ": " + convert_tool_value(value, schema);
    ++n_params;
    emit_args(frag);
    sub = Sub::kBody;
  }

  void close_call() {
    emit_args(n_params == 0 ? "{}" : "}");
    calls.push_back({pending_id, pending_name, args_json});
    mode = Mode::kContent;
    content_lstrip_ws = true;
  }

  bool step(bool final);
  bool step_reasoning(bool final);
  bool step_content(bool final);
  bool step_call(bool final);
  bool step_value(bool final);

  void run(bool final) {
    while (step(final)) {
    }
  }
};

bool OutputParser::Impl::step(bool final) {
  switch (mode) {
    case Mode::kReasoning: return step_reasoning(final);
    case Mode::kContent: return step_content(final);
    case Mode::kCall: return step_call(final);
  }
  return false;
}

bool OutputParser::Impl::step_reasoning(bool final) {
  if (reasoning_at_start) {
    size_t b = skip_ws(buf);
    std::string_view rest = std::string_view(buf).substr(b);
    if (rest.empty()) {
      if (final) consume(buf.size());
      return false;
    }
    if (!final && is_proper_prefix(rest, kThinkOpen)) return false;
    if (rest.substr(0, kThinkOpen.size()) == kThinkOpen) {
      consume(b + kThinkOpen.size());   // the model repeated the prompt's <think>
      return true;
    }
    consume(b);
    reasoning_at_start = false;
    return true;
  }
  size_t p_end = buf.find(kThinkClose), p_call = buf.find(kCallOpen);
  if (p_call != std::string::npos && (p_end == std::string::npos || p_call < p_end)) {
    enter_call(p_call);   // a call inside the think block ends reasoning (FRONTEND.md §3.3)
    return true;
  }
  if (p_end != std::string::npos) {
    emit_reasoning(std::string_view(buf).substr(0, rstrip_len(std::string_view(buf).substr(0, p_end))));
    consume(p_end + kThinkClose.size());
    mode = Mode::kContent;
    content_at_start = false;
    content_lstrip_nl = true;
    return true;
  }
  if (final) {
    emit_reasoning(std::string_view(buf).substr(0, rstrip_len(buf)));
    consume(buf.size());
    return false;
  }
  size_t cut = buf.size() - partial_tag_suffix(buf, {kThinkClose, kCallOpen});
  cut = rstrip_len(std::string_view(buf).substr(0, cut));
  emit_reasoning(std::string_view(buf).substr(0, cut));
  consume(cut);
  return false;
}

bool OutputParser::Impl::step_content(bool final) {
  if (content_lstrip_nl || content_lstrip_ws) {
    size_t b = content_lstrip_ws ? skip_ws(buf) : buf.find_first_not_of('\n');
    if (b == std::string::npos) b = buf.size();
    consume(b);
    if (buf.empty()) return false;
    content_lstrip_nl = content_lstrip_ws = false;
    return true;
  }
  if (content_at_start) {
    size_t b = skip_ws(buf);
    std::string_view rest = std::string_view(buf).substr(b);
    if (!final && (rest.empty() || is_proper_prefix(rest, kThinkOpen))) return false;
    content_at_start = false;
    if (rest.substr(0, kThinkOpen.size()) == kThinkOpen) {
      consume(b + kThinkOpen.size());   // the model opened a think block itself
      mode = Mode::kReasoning;
      reasoning_at_start = true;
    }
    return true;
  }
  size_t p = buf.find(kCallOpen);
  if (p != std::string::npos) {
    enter_call(p);
    return true;
  }
  if (final) {
    emit_content(buf);
    consume(buf.size());
    return false;
  }
  size_t cut = buf.size() - partial_tag_suffix(buf, {kCallOpen});
  cut = rstrip_len(std::string_view(buf).substr(0, cut));
  emit_content(std::string_view(buf).substr(0, cut));
  consume(cut);
  return false;
}

bool OutputParser::Impl::step_call(bool final) {
  std::string_view s(buf);
  size_t b = sub == Sub::kValue ? 0 : skip_ws(s);
  std::string_view rest = s.substr(b);
  switch (sub) {
    case Sub::kExpectFunction: {
      if (rest.substr(0, kFuncOpen.size()) == kFuncOpen) {
        size_t gt = rest.find('>');
        size_t nl = rest.find('\n');
        bool bad = (nl != std::string_view::npos && nl < gt) ||
                   (gt == std::string_view::npos ? rest.size() > kMaxNameLen + kFuncOpen.size()
                                                  : gt > kMaxNameLen + kFuncOpen.size());
        std::string name = gt == std::string_view::npos ? "" : trim(rest.substr(kFuncOpen.size(), gt - kFuncOpen.size()));
        if (!bad && gt != std::string_view::npos && !name.empty()) {
          consume(b + gt + 1);
          start_call(std::move(name));
          return true;
        }
        if (!bad && gt == std::string_view::npos && !final) return false;
      } else if (!final && (rest.empty() || is_proper_prefix(rest, kFuncOpen))) {
        return false;
      }
      call_fallback();
      return true;
    }
    case Sub::kBody: {
      if (rest.substr(0, kParamOpen.size()) == kParamOpen) {
        size_t gt = rest.find('>');
        if (gt == std::string_view::npos && !final && rest.size() <= kMaxNameLen + kParamOpen.size()) return false;
        if (gt != std::string_view::npos) {
          param_name = trim(rest.substr(kParamOpen.size(), gt - kParamOpen.size()));
          consume(b + gt + 1);
          sub = Sub::kValue;
          value_scan = 0;
          return true;
        }
      } else if (rest.substr(0, kFuncClose.size()) == kFuncClose) {
        consume(b + kFuncClose.size());
        sub = Sub::kAfterFunction;
        return true;
      } else if (rest.substr(0, kCallClose.size()) == kCallClose) {
        consume(b + kCallClose.size());   // </function> missing
        close_call();
        return true;
      } else if (rest.substr(0, kCallOpen.size()) == kCallOpen) {
        close_call();   // both closers missing: the next call starts
        content_lstrip_ws = false;
        enter_call(b);
        return true;
      } else if (!final && (rest.empty() || is_proper_prefix(rest, kParamOpen) || is_proper_prefix(rest, kFuncClose) ||
                            is_proper_prefix(rest, kCallClose) || is_proper_prefix(rest, kCallOpen))) {
        return false;
      }
      if (final) {   // truncated inside the call: keep what was complete
        consume(buf.size());
        close_call();
        return false;
      }
      // Stray text between parameters is not part of any value: skip to the next tag.
      size_t lt = rest.find('<', 1);
      consume(lt == std::string_view::npos ? buf.size() : b + lt);
      return true;
    }
    case Sub::kValue: return step_value(final);
    case Sub::kAfterFunction: {
      if (rest.substr(0, kCallClose.size()) == kCallClose) {
        consume(b + kCallClose.size());
        close_call();
        return true;
      }
      if (!final && (rest.empty() || is_proper_prefix(rest, kCallClose))) return false;
      close_call();   // </tool_call> missing: whatever follows is content or the next call
      return true;
    }
  }
  return false;
}

// Ends a parameter value at </parameter>, or leniently at the next <parameter=, or at a
// </function> / </tool_call> that is followed by the end of the call structure (so the same text
// inside a value, e.g. code, stays part of it).
bool OutputParser::Impl::step_value(bool final) {
  std::string_view s(buf);
  size_t pos = value_scan;
  while (true) {
    size_t best = std::string_view::npos;
    std::string_view tag;
    for (std::string_view t : {kParamClose, kParamOpen, kFuncClose, kCallClose}) {
      size_t p = s.find(t, pos);
      if (p < best) best = p, tag = t;
    }
    if (best == std::string_view::npos) break;
    bool structural = true;
    if (tag == kFuncClose || tag == kCallClose) {
      std::string_view next = tag == kFuncClose ? kCallClose : kCallOpen;
      std::string_view after = s.substr(skip_ws(s, best + tag.size()));
      if (after.empty() || is_proper_prefix(after, next)) {
        if (!final) {
          value_scan = best;
          return false;
        }
      } else if (after.substr(0, next.size()) != next) {
        structural = false;
      }
    }
    if (!structural) {
      pos = best + 1;
      continue;
    }
    std::string value(s.substr(0, best));
    consume(tag == kParamClose ? best + tag.size() : best);
    finish_param(std::move(value));
    return true;
  }
  if (final) {
    std::string value = buf;
    consume(buf.size());
    finish_param(std::move(value));
    close_call();
    return false;
  }
  value_scan = s.size() >= kParamClose.size() ? s.size() - kParamClose.size() + 1 : 0;
  return false;
}

OutputParser::OutputParser(bool starts_in_reasoning, const nlohmann::json& tools, uint64_t id_seed)
    : impl_(std::make_unique<Impl>(starts_in_reasoning, tools, id_seed)) {}
OutputParser::~OutputParser() = default;
OutputParser::OutputParser(OutputParser&&) noexcept = default;
OutputParser& OutputParser::operator=(OutputParser&&) noexcept = default;

ParseDelta OutputParser::push(std::string_view text) {
  impl_->buf += text;
  impl_->run(false);
  return std::exchange(impl_->delta, ParseDelta{});
}

ParseDelta OutputParser::finish() {
  impl_->run(true);
  return std::exchange(impl_->delta, ParseDelta{});
}

const std::vector<ToolCall>& OutputParser::tool_calls() const { return impl_->calls; }
const std::string& OutputParser::reasoning() const { return impl_->reasoning_all; }
const std::string& OutputParser::content() const { return impl_->content_all; }
bool OutputParser::in_reasoning() const { return impl_->mode == Impl::Mode::kReasoning; }

}  // namespace lily
