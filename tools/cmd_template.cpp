// `lily template`: renders conversations from a JSONL file with the native chat template, one
// {"text"} or {"error"} line per input line (parity tests drive it against jinja2); with --parse,
// runs the output parser on model outputs instead (differential tests against mlx-lm's parser).
#ifdef LILY_HAVE_FRONTEND
#include <fstream>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "command.h"
#include "core/common.h"
#include "core/options.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/output_parser.h"

namespace lily {
namespace {

using OJson = nlohmann::ordered_json;

// Missing switches take the template's meaning of an undefined variable: no generation prompt,
// thinking on, history reasoning not preserved.
bool get_bool(const OJson& req, const char* key, bool def) {
  auto it = req.find(key);
  if (it == req.end() || it->is_null()) return def;
  if (!it->is_boolean()) throw Error(std::string("field '") + key + "' must be a boolean");
  return it->get<bool>();
}

std::string render_line(const std::string& line) {
  OJson out;
  try {
    OJson req = OJson::parse(line);
    if (!req.is_object()) throw Error("each input line must be a JSON object");
    ChatTemplateOptions opt;
    opt.add_generation_prompt = get_bool(req, "add_generation_prompt", false);
    opt.enable_thinking = get_bool(req, "enable_thinking", true);
    opt.preserve_thinking = get_bool(req, "preserve_thinking", false);
    OJson messages = req.contains("messages") ? req["messages"] : OJson();
    OJson tools = req.contains("tools") ? req["tools"] : OJson();
    out["text"] = render_chat(messages, tools, opt);
  } catch (const Error& e) {
    out = OJson{{"error", e.what()}};
  } catch (const nlohmann::json::exception& e) {
    out = OJson{{"error", std::string("invalid JSON: ") + e.what()}};
  }
  return out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// {"text", "tools", "starts_in_reasoning", "chunk"} -> {"reasoning", "content", "tool_calls"}; chunk > 0
// pushes the text in pieces of that many bytes, as a stream would.
std::string parse_line(const std::string& line) {
  OJson out;
  try {
    OJson req = OJson::parse(line);
    if (!req.is_object() || !req.contains("text") || !req["text"].is_string())
      throw Error("each input line must be an object with a string 'text'");
    const std::string text = req["text"].get<std::string>();
    const int64_t chunk = req.value("chunk", int64_t(0));
    OutputParser p(get_bool(req, "starts_in_reasoning", true), req.contains("tools") ? req["tools"] : OJson());
    for (size_t i = 0; i < text.size(); i += chunk > 0 ? size_t(chunk) : text.size())
      p.push(std::string_view(text).substr(i, chunk > 0 ? size_t(chunk) : text.size()));
    p.finish();
    out["reasoning"] = p.reasoning();
    out["content"] = p.content();
    out["tool_calls"] = OJson::array();
    for (const ToolCall& c : p.tool_calls())
      out["tool_calls"].push_back({{"id", c.id}, {"name", c.name}, {"arguments", c.arguments_json}});
  } catch (const Error& e) {
    out = OJson{{"error", e.what()}};
  } catch (const nlohmann::json::exception& e) {
    out = OJson{{"error", std::string("invalid JSON: ") + e.what()}};
  }
  return out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

int template_main(int argc, char** argv) {
  Options o("template",
            "Render chat requests (JSONL: messages, tools, add_generation_prompt, enable_thinking,\n"
            "preserve_thinking) with the built-in Qwen3.6 template; writes {\"text\"} or {\"error\"} per line.",
            {{"input", "-", "input JSONL file (- = stdin)", ""},
             {"output", "-", "output JSONL file (- = stdout)", ""},
             {"parse", "false",
              "read model outputs {text, tools, starts_in_reasoning, chunk}; write {reasoning, content, tool_calls}",
              "", true}});
  if (!o.parse(argc, argv)) return 0;
  std::ifstream fin;
  std::istream* in = &std::cin;
  if (o.str("input") != "-") {
    fin.open(o.str("input"));
    if (!fin) throw Error("cannot open input file " + o.str("input"));
    in = &fin;
  }
  std::ofstream fout;
  std::ostream* out = &std::cout;
  if (o.str("output") != "-") {
    fout.open(o.str("output"), std::ios::binary);
    if (!fout) throw Error("cannot create output file " + o.str("output"));
    out = &fout;
  }
  std::string line;
  while (std::getline(*in, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    *out << (o.flag("parse") ? parse_line(line) : render_line(line)) << '\n';
  }
  out->flush();
  if (!*out) throw Error("failed writing " + o.str("output"));
  return 0;
}

RegisterCommand reg({"template", "render chat conversations with the built-in template (JSONL)", template_main});

}  // namespace
}  // namespace lily
#endif  // LILY_HAVE_FRONTEND
