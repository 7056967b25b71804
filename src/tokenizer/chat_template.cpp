// Native renderer of the Qwen3.6 chat template: a line-by-line transcription of
// shared/reference/qwen3.6-35b-a3b/chat_template.jinja under jinja2 with Hugging Face's settings.
#include "tokenizer/chat_template.h"

#include <string_view>

#include "core/common.h"
#include "tokenizer/json_py.h"

namespace lily {

namespace {

using OJson = nlohmann::ordered_json;

const char kToolsHeader[] = "# Tools\n\nYou have access to the following functions:\n\n<tools>";
// Verbatim from the template's tools branch.
const char kToolsFooter[] =
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
    "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\n"
    "Reminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> "
    "block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be "
    "specified\n- You may provide optional reasoning for your function call in natural language "
    "BEFORE the function call, but NOT after\n- If there is no function call available, answer the "
    "question like normal with your current knowledge and do not tell the user about function "
    "calls\n</IMPORTANT>";

// Python str.isspace() code points (what jinja's `trim` filter strips via str.strip()).
bool is_py_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
         c == 0x202f || c == 0x205f || c == 0x3000;
}

// Decodes the code point starting at s[i]; returns its byte length (1 for invalid bytes).
size_t decode_utf8(std::string_view s, size_t i, char32_t& cp) {
  unsigned char c = s[i];
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (n == 0 || i + n > s.size()) {
    cp = 0xfffd;
    return 1;
  }
  cp = n == 1 ? c : n == 2 ? (c & 0x1f) : n == 3 ? (c & 0x0f) : (c & 0x07);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
  return n;
}

std::string py_strip(std::string_view s) {
  size_t b = 0;
  while (b < s.size()) {
    char32_t cp;
    size_t n = decode_utf8(s, b, cp);
    if (!is_py_space(cp)) break;
    b += n;
  }
  size_t e = s.size();
  while (e > b) {
    size_t start = e - 1;
    while (start > b && (static_cast<unsigned char>(s[start]) & 0xc0) == 0x80) --start;
    char32_t cp;
    size_t n = decode_utf8(s, start, cp);
    if (start + n != e || !is_py_space(cp)) break;
    e = start;
  }
  return std::string(s.substr(b, e - b));
}

std::string lstrip_newlines(std::string_view s) {
  size_t b = s.find_first_not_of('\n');
  return b == std::string_view::npos ? std::string() : std::string(s.substr(b));
}

std::string rstrip_newlines(std::string_view s) {
  size_t e = s.find_last_not_of('\n');
  return e == std::string_view::npos ? std::string() : std::string(s.substr(0, e + 1));
}

// Python truthiness of a JSON value (jinja `if x`).
bool truthy(const OJson& v) {
  switch (v.type()) {
    case OJson::value_t::null: return false;
    case OJson::value_t::boolean: return v.get<bool>();
    case OJson::value_t::number_integer: return v.get<int64_t>() != 0;
    case OJson::value_t::number_unsigned: return v.get<uint64_t>() != 0;
    case OJson::value_t::number_float: return v.get<double>() != 0;
    case OJson::value_t::string: return !v.get_ref<const std::string&>().empty();
    default: return !v.empty();
  }
}

const OJson* field(const OJson& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

bool field_equals(const OJson& obj, const char* key, const char* value) {
  const OJson* f = field(obj, key);
  return f && f->is_string() && f->get_ref<const std::string&>() == value;
}

[[noreturn]] void reject_media(const char* kind, bool is_system) {
  if (is_system) throw Error(std::string("System message cannot contain ") + kind + "s.");
  throw Error(std::string(kind) + " content parts are not supported: this engine is text-only");
}

// The template's render_content macro (vision placeholders rejected: text-only engine).
std::string render_content(const OJson* content, bool is_system) {
  if (!content || content->is_null()) return "";
  if (content->is_string()) return content->get<std::string>();
  if (!content->is_array()) throw Error("Unexpected content type.");
  std::string out;
  for (const OJson& item : *content) {
    if (item.is_object()) {
      if (item.contains("image") || item.contains("image_url") || field_equals(item, "type", "image"))
        reject_media("image", is_system);
      if (item.contains("video") || field_equals(item, "type", "video")) reject_media("video", is_system);
      if (item.contains("text")) {
        out += py_str(item["text"]);
        continue;
      }
      if (item.contains("input_audio") || item.contains("audio") ||
          field_equals(item, "type", "input_audio") || field_equals(item, "type", "audio"))
        reject_media("audio", is_system);
      throw Error("Unexpected item type in content.");
    }
    if (item.is_string()) {
      // jinja's `'image' in item` is a substring test on a string part; `item.text` is undefined.
      const std::string& s = item.get_ref<const std::string&>();
      if (s.find("image") != std::string::npos) reject_media("image", is_system);
      if (s.find("video") != std::string::npos) reject_media("video", is_system);
      if (s.find("text") != std::string::npos) continue;
    }
    throw Error("Unexpected item type in content.");
  }
  return out;
}

std::string role_of(const OJson& m) {
  const OJson* r = field(m, "role");
  if (!r || !r->is_string()) return "";
  const std::string& s = r->get_ref<const std::string&>();
  return s == "developer" ? "system" : s;   // OpenAI `developer` is a system prompt
}

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

// Python str.split(sep) pieces that the template uses: the first and the last.
std::string split_first(const std::string& s, const std::string& sep) {
  size_t p = s.find(sep);
  return p == std::string::npos ? s : s.substr(0, p);
}
std::string split_last(const std::string& s, const std::string& sep) {
  size_t p = s.rfind(sep);
  return p == std::string::npos ? s : s.substr(p + sep.size());
}

// Arguments as the template iterates them (`|items` needs a mapping). OpenAI clients send a JSON
// string, which is parsed first (QwenLM/Qwen3-Coder#444); "" and null mean no arguments.
OJson arguments_object(const OJson& args) {
  if (args.is_object()) return args;
  if (args.is_null()) return OJson::object();
  if (args.is_string()) {
    const std::string& s = args.get_ref<const std::string&>();
    if (py_strip(s).empty()) return OJson::object();
    OJson parsed = OJson::parse(s, nullptr, false);
    if (parsed.is_object()) return parsed;
    throw Error("tool call arguments must be a JSON object, got: " + s.substr(0, 200));
  }
  throw Error("tool call arguments must be an object or a JSON string");
}

void render_tool_calls(const OJson& calls, const std::string& content, std::string& out) {
  bool first = true;
  for (const OJson& call : calls) {
    const OJson* fn = &call;
    if (const OJson* f = field(call, "function")) fn = f;
    const OJson* name = field(*fn, "name");
    if (!name || !name->is_string()) throw Error("tool call without a string function name");
    const std::string& n = name->get_ref<const std::string&>();
    if (first) out += py_strip(content).empty() ? "<tool_call>\n<function=" : "\n\n<tool_call>\n<function=";
    else out += "\n<tool_call>\n<function=";
    out += n + ">\n";
    first = false;
    if (const OJson* args = field(*fn, "arguments")) {
      OJson obj = arguments_object(*args);
      for (auto it = obj.begin(); it != obj.end(); ++it) {
        out += "<parameter=" + it.key() + ">\n";
        out += it.value().is_string() ? it.value().get<std::string>() : json_py_dumps(it.value());
        out += "\n</parameter>\n";
      }
    }
    out += "</function>\n</tool_call>";
  }
}

}  // namespace

std::string render_chat(const OJson& messages, const OJson& tools, const ChatTemplateOptions& opt) {
  if (!messages.is_array()) throw Error("messages must be an array");
  if (messages.empty()) throw Error("No messages provided.");
  if (tools.is_string() && !tools.get_ref<const std::string&>().empty())
    throw Error("tools must be an array of tool definitions");
  const size_t n = messages.size();
  std::string out;

  // System turn, with the tool definitions when there are any.
  const bool first_is_system = role_of(messages[0]) == "system";
  if (tools.is_array() && !tools.empty()) {
    out += "<|im_start|>system\n";
    out += kToolsHeader;
    for (const OJson& tool : tools) out += "\n" + json_py_dumps(tool);
    out += "\n</tools>";
    out += kToolsFooter;
    if (first_is_system) {
      std::string content = py_strip(render_content(field(messages[0], "content"), true));
      if (!content.empty()) out += "\n\n" + content;
    }
    out += "<|im_end|>\n";
  } else if (first_is_system) {
    out += "<|im_start|>system\n" + py_strip(render_content(field(messages[0], "content"), true)) +
           "<|im_end|>\n";
  }

  // The last user turn that is a real query (not only tool responses): assistant turns after it
  // keep their reasoning.
  bool multi_step_tool = true;
  size_t last_query_index = n - 1;
  for (size_t k = 0; k < n && multi_step_tool; ++k) {
    size_t i = n - 1 - k;
    const OJson& m = messages[i];
    if (!field_equals(m, "role", "user")) continue;
    std::string content = py_strip(render_content(field(m, "content"), false));
    if (!(starts_with(content, "<tool_response>") && ends_with(content, "</tool_response>"))) {
      multi_step_tool = false;
      last_query_index = i;
    }
  }
  if (multi_step_tool) throw Error("No user query found in messages.");

  for (size_t i = 0; i < n; ++i) {
    const OJson& m = messages[i];
    std::string content = py_strip(render_content(field(m, "content"), false));
    const std::string role = role_of(m);
    if (role == "system") {
      if (i != 0) throw Error("System message must be at the beginning.");
    } else if (role == "user") {
      out += "<|im_start|>user\n" + content + "<|im_end|>\n";
    } else if (role == "assistant") {
      std::string reasoning;
      const OJson* rc = field(m, "reasoning_content");
      if (!rc || !rc->is_string()) {
        const OJson* r = field(m, "reasoning");   // the other field name in use (FRONTEND.md P5)
        if (r && r->is_string()) rc = r;
      }
      if (rc && rc->is_string()) {
        reasoning = rc->get<std::string>();
      } else if (content.find("</think>") != std::string::npos) {
        reasoning = lstrip_newlines(split_last(rstrip_newlines(split_first(content, "</think>")), "<think>"));
        content = lstrip_newlines(split_last(content, "</think>"));
      }
      reasoning = py_strip(reasoning);
      if (opt.preserve_thinking || i > last_query_index)
        out += "<|im_start|>assistant\n<think>\n" + reasoning + "\n</think>\n\n" + content;
      else
        out += "<|im_start|>assistant\n" + content;
      if (const OJson* calls = field(m, "tool_calls")) {
        if (calls->is_string() && !calls->get_ref<const std::string&>().empty())
          throw Error("tool_calls must be an array");
        if (calls->is_array()) render_tool_calls(*calls, content, out);
      }
      out += "<|im_end|>\n";
    } else if (role == "tool") {
      if (i > 0 && truthy(messages[i - 1]) && role_of(messages[i - 1]) != "tool") out += "<|im_start|>user";
      out += "\n<tool_response>\n" + content + "\n</tool_response>";
      if (i + 1 == n || role_of(messages[i + 1]) != "tool") out += "<|im_end|>\n";
    } else {
      throw Error("Unexpected message role.");
    }
  }

  if (opt.add_generation_prompt) {
    out += "<|im_start|>assistant\n";
    out += opt.enable_thinking ? "<think>\n" : "<think>\n\n</think>\n\n";
  }
  return out;
}

}  // namespace lily
