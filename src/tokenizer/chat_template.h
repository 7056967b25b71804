// Native renderer of the Qwen3.6 chat template (shared/reference/qwen3.6-35b-a3b/chat_template.jinja),
// byte-identical to jinja2 with Hugging Face's settings.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace lily {

struct ChatTemplateOptions {
  bool add_generation_prompt = true;
  bool enable_thinking = true;
  bool preserve_thinking = false;
};

// messages: OpenAI-style array; tools: array of tool definitions or null. Takes ordered_json so
// tool definitions keep the request's key order (the template serialises them with json.dumps):
// parse request bodies with nlohmann::ordered_json. Throws lily::Error with the template's own
// message on invalid conversations (no user message, misplaced system, unknown role) and on media
// content (text-only engine). `developer` is rendered as `system`; an assistant `reasoning` field
// is used when `reasoning_content` is absent; string tool-call `arguments` are JSON-parsed.
std::string render_chat(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                        const ChatTemplateOptions& opt);

}  // namespace lily
