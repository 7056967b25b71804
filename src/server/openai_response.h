// Engine results -> OpenAI response objects and SSE chunks (FRONTEND.md §4.6).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "server/openai_request.h"

namespace lily {

// JSON text for the wire: invalid UTF-8 (e.g. a partial token in logprobs) becomes U+FFFD.
std::string dump_json(const nlohmann::ordered_json& j);
std::string sse_event(const nlohmann::ordered_json& j);   // "data: {...}\n\n"

nlohmann::ordered_json usage_json(const GenerationResult& r);

nlohmann::ordered_json chat_response(const ApiRequest& req, const GenerationResult& r,
                                     const std::string& id, int64_t created,
                                     const std::string& model, const Tokenizer& tok);
nlohmann::ordered_json completion_response(const ApiRequest& req, const GenerationResult& r,
                                           const std::string& id, int64_t created,
                                           const std::string& model, const Tokenizer& tok);

// Turns the event stream of one request into SSE "data:" events.
class ChunkWriter {
 public:
  ChunkWriter(const ApiRequest& req, std::string id, int64_t created, std::string model,
              const Tokenizer& tok);
  std::string start();                              // chat: the role chunk
  std::string on_event(const GenerationEvent& ev);  // zero or more events
  std::string finish(const GenerationResult& r);    // finish chunk, usage chunk, [DONE]

 private:
  nlohmann::ordered_json chunk(nlohmann::ordered_json choice) const;
  nlohmann::ordered_json take_logprobs();

  const ApiRequest& req_;
  std::string id_, model_;
  int64_t created_;
  const Tokenizer& tok_;
  std::vector<TokenLogprob> pending_lp_;
  bool echoed_ = false;
};

}  // namespace lily
