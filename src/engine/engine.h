// The generation loop: prefix reuse from session snapshots, chunked prefill with progress
// callbacks, sampling, stop ids / stop strings, reasoning and tool-call parsing, usage counts.
// An Engine is single-threaded (batch 1); the server serialises requests onto one worker.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/language_model.h"
#include "engine/sampler.h"
#include "engine/session_cache.h"
#include "tokenizer/output_parser.h"
#include "tokenizer/tokenizer.h"

namespace lily {

struct EngineOptions {
  int ctx = 8192;                       // tokens of the working state (prompt + output)
  int64_t cache_bytes = 2048LL << 20;   // snapshot budget (0 = no snapshots)
  int snapshot_every = 2048;            // also snapshot every N prompt tokens (0 = off)
  bool prefix_reuse = true;             // false = every request starts cold (testing, A/B)
  bool shared_kv_snapshots = true;      // snapshots keep only the recurrent state when possible
  // Decode with sampling inside the model's backend (D2: captured steps, ids handed over
  // asynchronously) for requests without logprobs: -1 where the model prefers it (cuda), 0 never,
  // 1 whenever available (e.g. the cpu backend: tests of the same code path).
  int device_sampling = -1;
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int max_tokens = -1;                  // -1: until the context is full
  std::vector<std::string> stop;        // stop strings (never part of the output)
  std::vector<int32_t> stop_ids;        // in addition to the tokenizer's stop ids
  bool ignore_eos = false;              // drop the tokenizer's stop ids
  int logprobs = -1;                    // -1 off; else number of top alternatives (0..20)
  bool parse_output = false;            // split reasoning / content / tool calls (chat)
  bool starts_in_reasoning = false;     // the prompt ended inside <think>
  nlohmann::json tools;                 // the request's tools (types drive argument conversion)
  uint64_t tool_id_seed = 0;            // 0 = random tool-call ids
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  const std::atomic<bool>* cancel = nullptr;   // set by the caller to stop at the next token
};

// What became final in one step. Chat consumers read `parsed`; raw completions read `text`.
struct GenerationEvent {
  bool ping = false;                    // progress during prefill (nothing else set)
  int prefill_done = 0, prefill_total = 0;
  std::string text;                     // released output text (after stop-string hold-back)
  ParseDelta parsed;                    // the same text split (parse_output only)
  std::vector<int32_t> tokens;          // tokens sampled in this step
  std::vector<TokenLogprob> logprobs;   // for those tokens (when requested)
};
using EventSink = std::function<void(const GenerationEvent&)>;

struct GenerationResult {
  std::string text;                     // all released text
  std::string reasoning, content;       // parse_output only
  std::vector<ToolCall> tool_calls;     // parse_output only
  std::vector<int32_t> tokens;          // every sampled token, including a final stop id
  std::vector<TokenLogprob> logprobs;
  // stop | length | tool_calls | cancelled | timeout
  std::string finish_reason;
  std::string stop_reason;              // matched stop string, if any
  int prompt_tokens = 0, cached_tokens = 0, completion_tokens = 0, reasoning_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
};

struct EngineStats {
  int64_t requests = 0;
  int64_t prompt_tokens = 0, cached_tokens = 0, prefill_tokens = 0, decode_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  SessionCacheStats cache;
};

class Engine {
 public:
  Engine(LanguageModel& lm, std::shared_ptr<const Tokenizer> tok, EngineOptions opt);

  // Runs one request to completion, calling sink (on this thread) as output becomes final. Throws
  // lily::Error for requests that cannot run (e.g. prompt longer than the context) before
  // touching any state.
  GenerationResult generate(const GenerationRequest& req, const EventSink& sink = {});

  // Drops every snapshot and the live sequence.
  void reset_sessions();
  EngineStats stats() const;
  int context_length() const { return opt_.ctx; }
  const Tokenizer& tokenizer() const { return *tok_; }
  LanguageModel& model() { return lm_; }

 private:
  // Makes live_ hold the longest reusable prefix of prompt; returns its length.
  int restore_prefix(const std::vector<int32_t>& prompt);
  // Consumes prompt[from, end) into live_ in segments, snapshotting at turn boundaries. Returns
  // false if cancelled or past the deadline.
  bool prefill(const GenerationRequest& req, int from, const EventSink& sink);
  void forward_live(std::span<const int32_t> tokens);
  // After a failed forward or decode: forgets the live state and snapshots sharing its KV rows.
  void drop_live();
  // The decode loop inside the model (LanguageModel::generate); `take` handles each pick and says
  // whether to go on. Keeps live_tokens_ / live_kv_ equal to what the state really consumed.
  void decode_on_device(const GenerationRequest& req, int max_tokens, int n_valid,
                        const std::function<bool(int32_t)>& take);
  // Makes the session cache give up (or copy out) shared snapshots whose KV rows are about to be
  // rewritten from position q with `incoming`, then records the new KV history.
  void overwrite_kv(int q, std::span<const int32_t> incoming, const Snapshot* protect = nullptr);

  LanguageModel& lm_;
  std::shared_ptr<const Tokenizer> tok_;
  EngineOptions opt_;
  SessionCache cache_;
  std::unique_ptr<LmState> live_;        // the working sequence
  std::vector<int32_t> live_tokens_;     // what live_ has consumed
  std::vector<int32_t> live_kv_;         // tokens whose KV rows live_ holds (may exceed pos)
  bool live_valid_ = false;              // false after a failed forward (state unknown)
  std::vector<float> logits_;            // logits after live_tokens_.back()
  std::vector<float> scratch_;
  int32_t im_end_ = -1, newline_ = -1;   // turn boundary = "<|im_end|>" "\n"
  EngineStats stats_;
};

}  // namespace lily
