// Incremental parser of model output: splits reasoning (<think>…</think>) from content and turns
// Qwen XML tool calls into OpenAI tool_calls (FRONTEND.md §3.3–3.4, §4.7 P3/P4).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace lily {

// One complete call in OpenAI form; arguments_json is the JSON text of the arguments object.
struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments_json;
};

// What became final since the previous push()/finish(). Text fields are never partial UTF-8 as long
// as the pushed text is not.
struct ParseDelta {
  std::string reasoning;   // text inside <think>…</think>
  std::string content;     // user-visible text
  // Streamed tool-call deltas in OpenAI form (vLLM shape): the first delta of a call carries index,
  // id and name with empty arguments; later ones carry argument fragments ("{", "\"p\": v", ", …",
  // "}") that concatenate to ToolCall::arguments_json.
  struct ToolDelta {
    int index = 0;
    std::string id, name, arguments;
  };
  std::vector<ToolDelta> tool_calls;

  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

// Never throws on model output: anything that cannot be parsed stays content (or reasoning).
// Pushing the whole text at once or in any split gives the same concatenated result.
class OutputParser {
 public:
  // starts_in_reasoning: the prompt ended with "<think>\n" (thinking on). tools: the request's tools
  // array (each parameter's JSON-schema type drives value conversion) or null. id_seed: 0 draws
  // tool-call ids ("call_" + 24 hex) from std::random_device; any other value makes them
  // deterministic (tests).
  OutputParser(bool starts_in_reasoning, const nlohmann::json& tools, uint64_t id_seed = 0);
  ~OutputParser();
  OutputParser(OutputParser&&) noexcept;
  OutputParser& operator=(OutputParser&&) noexcept;

  ParseDelta push(std::string_view text);   // decoded text so far, in pieces of any size
  ParseDelta finish();                      // end of generation: flush held-back text

  const std::vector<ToolCall>& tool_calls() const;   // complete calls parsed so far
  const std::string& reasoning() const;              // everything emitted as reasoning
  const std::string& content() const;                // everything emitted as content
  bool in_reasoning() const;                         // currently inside the think block

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lily
