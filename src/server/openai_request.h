// OpenAI request bodies -> engine requests: validation with OpenAI-style errors naming the field,
// chat template rendering, per-mode sampling defaults (FRONTEND.md §3.6, §5).
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace lily {

// Sampling defaults before a request's own values: generation_config.json, then a per-mode profile.
struct SamplingDefaults {
  SamplingParams thinking;     // chat, thinking on
  SamplingParams instruct;     // chat, thinking off
  SamplingParams completion;   // /v1/completions (generation_config.json only)
  int max_tokens = -1;         // -1: until the context is full
};

// Model-card profiles (Qwen3.6-35B-A3B) over generation_config.json from `model_dir` when present.
SamplingDefaults load_sampling_defaults(const std::string& model_dir);

struct ApiRequest {
  GenerationRequest gen;
  bool chat = true;
  bool stream = false;
  bool include_usage = false;
  bool logprobs = false;           // logprobs requested (chat: bool; completions: int)
  bool echo = false;               // completions: prepend the prompt text
  bool return_token_ids = false;   // extension (vLLM name): choice.token_ids
  std::string prompt_text;         // rendered prompt (chat) or prompt string (completions)
};

struct ApiContext {
  const Tokenizer& tok;
  const SamplingDefaults& defaults;
  std::string model_name;
  int ctx = 0;
};

// Throw ApiError (400/404) on malformed bodies. body must be the parsed JSON object.
ApiRequest parse_chat_request(const nlohmann::ordered_json& body, const ApiContext& c);
ApiRequest parse_completion_request(const nlohmann::ordered_json& body, const ApiContext& c);

// Template options from chat_template_kwargs / reasoning_effort (shared with /apply-template).
ChatTemplateOptions parse_template_options(const nlohmann::ordered_json& body);
// Renders body.messages + body.tools, mapping template errors to 400.
std::string render_request_prompt(const nlohmann::ordered_json& body, const ChatTemplateOptions& o);

}  // namespace lily
