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

// messages: OpenAI-style array; tools: array of tool definitions or null. Throws lily::Error with
// the template's own message on invalid conversations (no user message, misplaced system, unknown
// role, media content).
std::string render_chat(const nlohmann::json& messages, const nlohmann::json& tools,
                        const ChatTemplateOptions& opt);

}  // namespace lily
