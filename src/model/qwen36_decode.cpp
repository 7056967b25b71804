// Decode loops of Qwen36 (D2): one decode step = layers → lm_head → on-device token choice writing
// the next id into the input slot → device-side position increment. When the backend can capture,
// the step is recorded once and replayed per token. generate_greedy collects ids in backend memory
// and copies them once at the end; generate (sampling) hands each id to the host through a pinned
// two-slot ring, one step behind the device, so the host never waits inside a step.
#include <algorithm>
#include <string>

#include "core/common.h"
#include "model/qwen36.h"

namespace lily {

namespace {
// One decode step attending over `len` positions: replayed from the captured step (D2), captured first when
// none is held or the backend wants another variant for this length (D44); run eagerly when `cap` is false.
template <class Step>
void decode_step(Backend& be, int64_t len, bool cap, int& variant, Step&& step) {
  const int v = cap ? be.capture_variant(len) : -1;
  if (v >= 0 && v != variant && be.begin_capture(v)) {
    step();
    be.end_capture();
    variant = v;
  }
  if (variant >= 0) be.replay();
  else step();
}
}  // namespace

void Qwen36::generate_greedy(Qwen36State& st, int32_t first_token, int n, std::vector<int32_t>& out) {
  if (n <= 0) return;
  const ModelConfig& c = w_.config;
  if (first_token < 0 || first_token >= c.vocab_size)
    throw Error("token id " + std::to_string(first_token) + " out of range [0, " +
                std::to_string(c.vocab_size) + ")");
  if (st.pos + n > st.capacity)
    throw Error("context length exceeded: " + std::to_string(st.pos) + " + " + std::to_string(n) +
                " tokens > capacity " + std::to_string(st.capacity));
  const int32_t pos = st.pos;
  be_.copy_from_host(tok_, &first_token, 4);
  be_.copy_from_host(pos_dev_, &pos, 4);
  int32_t* hist = be_.alloc_i32(n);   // generated ids, in backend memory
  auto step = [&] {
    run_layers(st, 1);
    be_.matmul(w_.lm_head, xn_, 1, logits_);
    be_.argmax(logits_, 1, c.vocab_size, tok_);
    be_.increment(pos_dev_, 1);
  };
  // The first step runs eagerly: it sizes every backend workspace before a capture.
  step();
  be_.copy(hist, tok_, 4);
  st.pos += 1;
  const bool cap = n > 1 && be_.can_capture();
  int variant = -1;   // of the captured step; -1: none
  for (int i = 1; i < n; ++i) {
    decode_step(be_, int64_t(st.pos) + 1, cap, variant, step);
    be_.copy(hist + i, tok_, 4);
    st.pos += 1;
  }
  const size_t base = out.size();
  out.resize(base + n);
  be_.copy_to_host(out.data() + base, hist, 4LL * n);
  be_.free(hist);
}

Qwen36::~Qwen36() {
  if (ring_) be_.free_host(ring_);
}

int Qwen36::generate(Qwen36State& st, int32_t first_token, int n, const SampleConfig& cfg,
                     std::span<const int32_t> seen, const TokenFn& on_token) {
  const ModelConfig& c = w_.config;
  if (first_token < 0 || first_token >= c.vocab_size)
    throw Error("token id " + std::to_string(first_token) + " out of range [0, " +
                std::to_string(c.vocab_size) + ")");
  return decode_loop(st, first_token, nullptr, n, cfg, seen, on_token);
}

int Qwen36::generate_from_logits(Qwen36State& st, float* logits, int n, const SampleConfig& cfg,
                                 std::span<const int32_t> seen, const TokenFn& on_token) {
  LILY_CHECK(logits != nullptr, "generate_from_logits: no logits");
  return decode_loop(st, -1, logits, n, cfg, seen, on_token);
}

int Qwen36::decode_loop(Qwen36State& st, int32_t first_token, float* logits, int n, const SampleConfig& cfg,
                        std::span<const int32_t> seen, const TokenFn& on_token) {
  if (n <= 0) return 0;
  const ModelConfig& c = w_.config;
  const int V = c.vocab_size;
  const bool feed_first = logits == nullptr;
  const int need = (feed_first ? 1 : 0) + n - 1;   // tokens the state may consume
  if (st.pos + need > st.capacity)
    throw Error("context length exceeded: " + std::to_string(st.pos) + " + " + std::to_string(need) +
                " tokens > capacity " + std::to_string(st.capacity));
  if (!sample_cfg_) {
    sample_cfg_ = reinterpret_cast<SampleConfig*>(be_.alloc_i32((sizeof(SampleConfig) + 3) / 4));
    sample_counts_ = be_.alloc_i32(V);
    ring_ = static_cast<int32_t*>(be_.alloc_host(2 * sizeof(int32_t)));
  }
  // Per-request sampler state: parameters (with the draw counter) and penalty counts.
  be_.copy_from_host(sample_cfg_, &cfg, sizeof(SampleConfig));
  if (cfg.repetition_penalty != 1.0f && !seen.empty()) {
    std::vector<int32_t> counts(V, 0);
    for (int32_t t : seen)
      if (t >= 0 && t < V) counts[t] = 1;
    be_.copy_from_host(sample_counts_, counts.data(), 4LL * V);
  } else {
    be_.fill_zero(sample_counts_, 4LL * V);
  }
  const int32_t pos = st.pos;
  be_.copy_from_host(pos_dev_, &pos, 4);

  // Each step consumes tok_ (the previous pick) and leaves the next pick there.
  auto step = [&] {
    run_layers(st, 1);
    be_.matmul(w_.lm_head, xn_, 1, logits_);
    be_.sample(logits_, V, sample_cfg_, sample_counts_, tok_);
    be_.increment(pos_dev_, 1);
  };
  auto publish = [&](int k) {   // pick k -> ring slot k % 2
    be_.copy_to_host_async(ring_ + (k & 1), tok_, 4);
    be_.record_event(k & 1);
  };
  int steps = 0;       // decode steps queued = tokens consumed since the start
  const bool cap = be_.can_capture();
  int variant = -1;    // of the captured step; -1: none
  // Pick 0.
  if (feed_first) {
    be_.copy_from_host(tok_, &first_token, 4);
    step();            // eager: sizes every backend workspace before a capture
    st.pos += 1;
  } else {
    be_.copy_from_host(logits_, logits, 4LL * V);
    be_.sample(logits_, V, sample_cfg_, sample_counts_, tok_);
  }
  publish(0);
  int produced = 1;    // picks queued
  auto produce = [&] { // queues the step that feeds pick produced-1 and makes pick `produced`
    if (!feed_first && steps == 0) {
      step();          // the first full step runs eagerly (workspace sizes)
    } else {
      decode_step(be_, int64_t(st.pos) + 1, cap, variant, step);
    }
    st.pos += 1;       // host mirror of pos_dev_ (the cpu backend reads it per step)
    ++steps;
    publish(produced);
    ++produced;
  };
  try {
    for (int i = 0;; ++i) {
      if (produced < n) produce();   // keep the next step in flight while the host looks at pick i
      be_.wait_event(i & 1);
      const int32_t id = ring_[i & 1];
      if (!on_token(id) || i + 1 >= n) break;
    }
  } catch (...) {
    be_.synchronize();
    throw;
  }
  be_.synchronize();
  if (!feed_first) be_.copy_to_host(logits, logits_, 4LL * V);
  return steps;
}

}  // namespace lily
