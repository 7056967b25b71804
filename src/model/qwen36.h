// The Qwen3.6-35B-A3B forward pass (qwen3_5_moe), written once against backend.h. Prefill runs in
// bounded chunks; decode is the same call with one token. State (KV cache, conv and recurrent state)
// lives in the backend and is owned by a Qwen36State.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/weights.h"

namespace lily {

class Qwen36;

// Everything a sequence carries between calls. Created by Qwen36::new_state.
struct Qwen36State {
  int pos = 0;                         // tokens consumed so far
  int capacity = 0;                    // max tokens (KV capacity)
  std::vector<GdnState> gdn;           // one per linear-attention layer (nullptrs elsewhere)
  std::vector<KvCache> kv;             // one per full-attention layer (empty elsewhere)
  Backend* backend = nullptr;
  ~Qwen36State();
  Qwen36State() = default;
  Qwen36State(const Qwen36State&) = delete;
  Qwen36State& operator=(const Qwen36State&) = delete;
};

struct ModelOptions {
  int max_chunk = 512;                 // prefill chunk size (P5)
};
// The prefill chunk a backend runs best with when none is asked for (P5, measured): 16,384 tokens on
// cuda (session 32's matched sweep on H200: +5.5 / +5.3 / +5.0 / +3.9 / +3.0 % over 4,096 at 8K / 16K / 32K / 64K / 128K
// for 2.5 GB more workspace; 32,768 gained < 1 % more for ~6 GB), 512 on the cpu.
inline int default_prefill_chunk(const std::string& backend_name) { return backend_name == "cuda" ? 16384 : 512; }

class Qwen36 {
 public:
  // `host` stays alive as long as the model (it owns the mmap'd files).
  Qwen36(std::shared_ptr<const ModelWeights> host, Backend& backend, ModelOptions opt = {});
  ~Qwen36();

  const ModelConfig& config() const { return w_.config; }
  Backend& backend() { return be_; }
  int max_chunk() const { return opt_.max_chunk; }

  // A zeroed state able to hold `capacity` tokens.
  std::unique_ptr<Qwen36State> new_state(int capacity);
  // Resets to position 0 (zeroes recurrent and conv state).
  void reset(Qwen36State& st);
  // Copies src into dst (same capacity or larger); used for prefix snapshots. Copies only the
  // first src.pos KV rows.
  void copy_state(const Qwen36State& src, Qwen36State& dst);

  // Consumes `tokens` (any length; processed in chunks of max_chunk). If logits_out is non-null it
  // receives host f32 logits: for every token ([T, vocab]) when all_logits, else only for the last
  // token ([vocab]). Throws lily::Error if the state's capacity would be exceeded.
  void forward(Qwen36State& st, std::span<const int32_t> tokens, float* logits_out,
               bool all_logits = false);

  // Bytes of backend memory one state of `capacity` tokens takes.
  int64_t state_bytes(int capacity) const;

  // Greedy decode of n tokens after `first_token` (which is fed first); appends the generated ids
  // to out. Uses a captured decode step (D2) when the backend supports it (qwen36_decode.cpp).
  void generate_greedy(Qwen36State& st, int32_t first_token, int n, std::vector<int32_t>& out);

  // Decode loop with sampling on the backend (D2, qwen36_decode.cpp): each step feeds the previous
  // pick, runs layers → lm_head → the sample op (which writes the next pick into the input slot)
  // as one captured graph, and the picks reach the host through a pinned two-slot ring with
  // events: step i+1 is queued before the host waits for pick i, so there is no host
  // synchronisation inside a step. on_token(id) is called for every pick in order; returning
  // false stops; at most n picks are made. `seen`: tokens that count as seen for the repetition
  // penalty (the prompt). cfg.step is usually 0.
  //
  // The state consumed exactly picks[0, c) after the start (c is returned): c = n - 1 when n
  // picks were made (the last pick is never fed, as in a host loop), else c = the number of picks
  // accepted, because the step feeding the last accepted pick was already queued when the host
  // saw it. st.pos advances by c (+1 for first_token).
  //
  // generate: feeds first_token, then decodes. generate_from_logits: the first pick is sampled
  // from `logits` (host [vocab]: the logits after the state's last token); on return `logits`
  // holds the logits after the state's last consumed token.
  using TokenFn = std::function<bool(int32_t)>;
  int generate(Qwen36State& st, int32_t first_token, int n, const SampleConfig& cfg,
               std::span<const int32_t> seen, const TokenFn& on_token);
  int generate_from_logits(Qwen36State& st, float* logits, int n, const SampleConfig& cfg,
                           std::span<const int32_t> seen, const TokenFn& on_token);

 private:
  void forward_chunk(Qwen36State& st, const int32_t* tokens_host, int T, float* logits_out,
                     bool all_logits);
  // Runs embed → layers → final norm for the T tokens already in tok_ (positions st.pos…), leaving
  // the normalised hidden states in xn_. Enqueues backend ops only (capturable).
  void run_layers(Qwen36State& st, int T);
  int decode_loop(Qwen36State& st, int32_t first_token, float* logits, int n, const SampleConfig& cfg,
                  std::span<const int32_t> seen, const TokenFn& on_token);

  std::shared_ptr<const ModelWeights> host_;
  Backend& be_;
  ModelOptions opt_;
  ModelWeights w_;                     // views into backend memory
  // Activation buffers sized for max_chunk tokens (allocated once).
  int32_t* tok_ = nullptr;             // [max_chunk]
  int32_t* pos_dev_ = nullptr;         // [1] position of tok_[0], in backend memory
  float *h_ = nullptr, *xn_ = nullptr, *r_ = nullptr;                // [C, H]
  float *proj1_ = nullptr, *proj2_ = nullptr;                        // [C, 8192], [C, 4096]
  float *pa_ = nullptr, *pb_ = nullptr;                              // [C, nv] / [C, kv*hd]
  float *mix_ = nullptr;                                             // [C, 4096]
  float* logits_ = nullptr;            // [logits_rows_, vocab]
  int logits_rows_ = 1;
  // Device sampling (allocated on first use): parameters, penalty counts, pinned id ring.
  SampleConfig* sample_cfg_ = nullptr;
  int32_t* sample_counts_ = nullptr;   // [vocab]
  int32_t* ring_ = nullptr;            // host, [2]
};

}  // namespace lily
