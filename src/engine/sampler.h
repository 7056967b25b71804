// Token sampler on host logits: penalties, temperature, top-k, top-p, min-p, seeded RNG, logprobs.
#pragma once
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace lily {

// Sampling settings of one request. Defaults are "neutral" (plain softmax sampling); the engine
// fills per-mode defaults (FRONTEND.md §3.6) before a request's own values.
struct SamplingParams {
  float temperature = 1.0f;          // 0 = greedy (argmax of the penalised logits)
  float top_p = 1.0f;                // (0, 1]
  int top_k = 0;                     // 0 = off
  float min_p = 0.0f;                // [0, 1]
  float presence_penalty = 0.0f;     // OpenAI: on generated tokens, [-2, 2]
  float frequency_penalty = 0.0f;    // OpenAI: on generated tokens, [-2, 2]
  float repetition_penalty = 1.0f;   // CTRL / HF: on prompt + generated tokens, > 0
  bool has_seed = false;
  uint64_t seed = 0;
  std::vector<std::pair<int32_t, float>> logit_bias;   // OpenAI: added to the logits, [-100, 100]

  // Throws lily::Error naming the field when a value is out of range.
  void validate() const;
};

struct TopLogprob {
  int32_t id = 0;
  float logprob = 0.0f;
};

// Logprob of the chosen token under the model's raw distribution (log-softmax of the logits before
// penalties and truncation) and the n most likely alternatives.
struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0.0f;
  std::vector<TopLogprob> top;
};

class Sampler {
 public:
  // n_valid: ids >= n_valid are never sampled (the model's vocabulary may be padded past the
  // tokenizer's). prompt: for repetition_penalty.
  Sampler(const SamplingParams& p, int n_valid, std::span<const int32_t> prompt);

  // Picks the next token from logits[0, vocab). The logits buffer is used as scratch. If lp is
  // non-null it receives the chosen token's logprob and top_n alternatives.
  int32_t sample(float* logits, int vocab, TokenLogprob* lp = nullptr, int top_n = 0);

  // Records a generated token (feeds the penalties).
  void accept(int32_t id);

 private:
  void apply_penalties(float* logits, int n) const;

  SamplingParams p_;
  int n_valid_;
  std::mt19937_64 rng_;
  std::vector<int32_t> counts_;         // generated-token counts (presence / frequency)
  std::vector<uint8_t> seen_;           // prompt + generated (repetition)
  std::vector<int32_t> touched_;        // ids with counts_ > 0 or seen_ set
  std::vector<std::pair<float, int32_t>> cand_;   // scratch
};

// Log-softmax of logits[0, n) at id, and the top_n (id, logprob) pairs, most likely first.
TokenLogprob compute_logprobs(const float* logits, int n, int32_t id, int top_n);

}  // namespace lily
