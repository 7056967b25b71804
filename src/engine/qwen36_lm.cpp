// LanguageModel adapter over the Qwen36 forward pass.
#include "engine/language_model.h"

#include <random>

#include "core/common.h"
#include "engine/sampler.h"
#include "model/qwen36.h"

namespace lily {
namespace {

class Qwen36LmState : public LmState {
 public:
  explicit Qwen36LmState(std::unique_ptr<Qwen36State> s) : s_(std::move(s)) {}
  int pos() const override { return s_->pos; }
  int capacity() const override { return s_->capacity; }
  Qwen36State& get() { return *s_; }
  const Qwen36State& get() const { return *s_; }

 private:
  std::unique_ptr<Qwen36State> s_;
};

class Qwen36Lm : public LanguageModel {
 public:
  explicit Qwen36Lm(Qwen36& m) : m_(m) {}
  int vocab_size() const override { return m_.config().vocab_size; }
  int max_chunk() const override { return m_.max_chunk(); }
  std::unique_ptr<LmState> new_state(int capacity) override {
    return std::make_unique<Qwen36LmState>(m_.new_state(capacity));
  }
  void reset(LmState& st) override { m_.reset(cast(st)); }
  void copy_state(const LmState& src, LmState& dst) override {
    LILY_CHECK(dst.capacity() >= src.pos(), "copy_state: destination state too small");
    m_.copy_state(static_cast<const Qwen36LmState&>(src).get(), cast(dst));
  }
  void forward(LmState& st, std::span<const int32_t> tokens, float* logits_last) override {
    m_.forward(cast(st), tokens, logits_last, false);
  }
  int64_t state_bytes(int capacity) const override { return m_.state_bytes(capacity); }

  std::unique_ptr<LmState> copy_recurrent(const LmState& src) override {
    const Qwen36State& s = static_cast<const Qwen36LmState&>(src).get();
    const ModelConfig& c = m_.config();
    Backend& be = m_.backend();
    auto st = std::make_unique<Qwen36State>();   // no KV rows: capacity 0, pos = src.pos
    st->backend = &be;
    st->pos = s.pos;
    st->gdn.resize(c.num_hidden_layers);
    st->kv.resize(c.num_hidden_layers);
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      if (c.is_full_attention[l]) continue;
      st->gdn[l].conv = be.alloc(conv_floats());
      st->gdn[l].S = be.alloc(s_floats());
    }
    copy_gdn(s, *st);
    return std::make_unique<Qwen36LmState>(std::move(st));
  }
  void restore_recurrent(const LmState& snap, LmState& dst) override {
    const Qwen36State& s = static_cast<const Qwen36LmState&>(snap).get();
    Qwen36State& d = cast(dst);
    LILY_CHECK(d.capacity >= s.pos, "restore_recurrent: state too small");
    copy_gdn(s, d);
    d.pos = s.pos;
  }
  std::unique_ptr<LmState> materialize(const LmState& snap, const LmState& kv_src) override {
    const Qwen36State& s = static_cast<const Qwen36LmState&>(snap).get();
    const Qwen36State& k = static_cast<const Qwen36LmState&>(kv_src).get();
    LILY_CHECK(k.pos >= s.pos || k.capacity >= s.pos, "materialize: KV source too short");
    const ModelConfig& c = m_.config();
    auto st = m_.new_state(s.pos);
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      if (!c.is_full_attention[l]) continue;
      LILY_CHECK(st->kv[l].type == k.kv[l].type, "materialize: KV caches of different element types");
      const int64_t bytes = int64_t(kv_elem_bytes(k.kv[l].type)) * s.pos * c.num_key_value_heads * c.head_dim;
      if (bytes) {
        m_.backend().copy(st->kv[l].k, k.kv[l].k, bytes);
        m_.backend().copy(st->kv[l].v, k.kv[l].v, bytes);
      }
    }
    copy_gdn(s, *st);
    st->pos = s.pos;
    return std::make_unique<Qwen36LmState>(std::move(st));
  }
  DeviceLoop device_loop(const SamplingParams& p) const override {
    if (p.logit_bias.size() > size_t(kMaxLogitBias)) return DeviceLoop::kNone;
    return m_.backend().can_capture() ? DeviceLoop::kPreferred : DeviceLoop::kAvailable;
  }
  int generate(LmState& st, float* logits, int max_tokens, const SamplingParams& p, int n_valid,
               std::span<const int32_t> prompt, const std::function<bool(int32_t)>& on_token) override {
    LILY_CHECK(p.logit_bias.size() <= size_t(kMaxLogitBias), "generate: too many logit_bias entries");
    uint64_t seed = p.seed;
    if (!p.has_seed) seed = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
    SampleConfig c = make_sample_config(p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty,
                                        p.frequency_penalty, p.repetition_penalty, seed, n_valid);
    for (const auto& [id, b] : p.logit_bias) {
      c.bias_id[c.n_bias] = id;
      c.bias[c.n_bias] = b;
      ++c.n_bias;
    }
    return m_.generate_from_logits(cast(st), logits, max_tokens, c, prompt, on_token);
  }
  int64_t recurrent_bytes() const override {
    const ModelConfig& c = m_.config();
    int64_t n = 0;
    for (int l = 0; l < c.num_hidden_layers; ++l)
      if (!c.is_full_attention[l]) n += conv_floats() + s_floats();
    return 4 * n;
  }

 private:
  static Qwen36State& cast(LmState& s) { return static_cast<Qwen36LmState&>(s).get(); }
  int64_t conv_floats() const {
    const ModelConfig& c = m_.config();
    return int64_t(c.linear_conv_kernel_dim - 1) * c.conv_dim();
  }
  int64_t s_floats() const {
    const ModelConfig& c = m_.config();
    return int64_t(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim;
  }
  // Recurrent and conv state of every Gated DeltaNet layer.
  void copy_gdn(const Qwen36State& src, Qwen36State& dst) {
    const ModelConfig& c = m_.config();
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      if (c.is_full_attention[l]) continue;
      m_.backend().copy(dst.gdn[l].conv, src.gdn[l].conv, 4 * conv_floats());
      m_.backend().copy(dst.gdn[l].S, src.gdn[l].S, 4 * s_floats());
    }
  }
  Qwen36& m_;
};

}  // namespace

std::unique_ptr<LanguageModel> make_qwen36_lm(Qwen36& model) {
  return std::make_unique<Qwen36Lm>(model);
}

}  // namespace lily
