// Forward-pass invariants on a random in-memory model: chunked prefill equals one-shot prefill,
// prefill(N) + decode equals prefill(N+1), state copies resume identically, bad input is rejected.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/backend.h"
#include "core/common.h"
#include "model/qwen36.h"

namespace lily {
namespace {

// A tiny model with f32 weights (real per-head dims, small counts) built in memory.
struct TinyModel {
  std::shared_ptr<ModelWeights> w = std::make_shared<ModelWeights>();
  std::mt19937 rng{1234};

  const float* vec(int64_t n, float mean, float sd) {
    auto v = std::make_shared<std::vector<float>>(size_t(n));
    std::normal_distribution<float> d(mean, sd);
    for (auto& x : *v) x = d(rng);
    w->f32_arena.push_back(v);
    return v->data();
  }
  FVec fvec(int64_t n, float mean, float sd) { return {vec(n, mean, sd), n}; }
  QMatrix mat(int64_t rows, int64_t cols, float sd) {
    QMatrix m;
    m.type = WType::kF32;
    m.rows = rows;
    m.cols = cols;
    m.data = vec(rows * cols, 0.0f, sd);
    return m;
  }
  QStack stack(int64_t n, int64_t rows, int64_t cols, float sd) {
    QStack s;
    s.first = mat(n * rows, cols, sd);
    s.first.rows = rows;
    s.n = n;
    s.data_stride = rows * cols * 4;
    return s;
  }

  TinyModel() {
    ModelConfig& c = w->config;
    c.model_type = "qwen3_5_moe_text";
    c.hidden_size = 128;
    c.num_hidden_layers = 4;
    c.is_full_attention = {false, false, false, true};
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 256;
    c.linear_num_key_heads = 2;
    c.linear_num_value_heads = 4;
    c.linear_key_head_dim = 128;
    c.linear_value_head_dim = 128;
    c.linear_conv_kernel_dim = 4;
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 64;
    c.shared_expert_intermediate_size = 64;
    c.vocab_size = 300;
    c.max_position_embeddings = 4096;
    const int64_t H = c.hidden_size;
    const float sd = 1.0f / std::sqrt(float(H));
    w->embed_tokens = mat(c.vocab_size, H, 1.0f);
    w->lm_head = mat(c.vocab_size, H, sd);
    w->norm = fvec(H, 1.0f, 0.1f);
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      LayerWeights L;
      L.full_attention = c.is_full_attention[l];
      L.input_layernorm = fvec(H, 1.0f, 0.1f);
      L.post_attention_layernorm = fvec(H, 1.0f, 0.1f);
      if (L.full_attention) {
        const int64_t qd = int64_t(c.num_attention_heads) * c.head_dim;
        const int64_t kvd = int64_t(c.num_key_value_heads) * c.head_dim;
        L.self_attn.q_proj = mat(2 * qd, H, sd);
        L.self_attn.k_proj = mat(kvd, H, sd);
        L.self_attn.v_proj = mat(kvd, H, sd);
        L.self_attn.o_proj = mat(H, qd, 1.0f / std::sqrt(float(qd)));
        L.self_attn.q_norm = fvec(c.head_dim, 1.0f, 0.1f);
        L.self_attn.k_norm = fvec(c.head_dim, 1.0f, 0.1f);
      } else {
        GdnWeights& g = L.linear_attn;
        g.in_proj_qkv = mat(c.conv_dim(), H, sd);
        g.in_proj_z = mat(c.linear_value_dim(), H, sd);
        g.in_proj_a = mat(c.linear_num_value_heads, H, sd);
        g.in_proj_b = mat(c.linear_num_value_heads, H, sd);
        g.conv1d = fvec(int64_t(c.conv_dim()) * c.linear_conv_kernel_dim, 0.0f, 0.5f);
        g.A_log = fvec(c.linear_num_value_heads, 0.0f, 0.5f);
        g.dt_bias = fvec(c.linear_num_value_heads, 0.0f, 0.5f);
        g.norm = fvec(c.linear_value_head_dim, 1.0f, 0.1f);
        g.out_proj = mat(H, c.linear_value_dim(), 1.0f / std::sqrt(float(c.linear_value_dim())));
      }
      MoeWeights& m = L.mlp;
      const int64_t I = c.moe_intermediate_size;
      m.gate = mat(c.num_experts, H, 1.0f);
      m.experts_gate = stack(c.num_experts, I, H, sd);
      m.experts_up = stack(c.num_experts, I, H, sd);
      m.experts_down = stack(c.num_experts, H, I, 1.0f / std::sqrt(float(I)));
      m.shared_gate_proj = mat(c.shared_expert_intermediate_size, H, sd);
      m.shared_up_proj = mat(c.shared_expert_intermediate_size, H, sd);
      m.shared_down_proj = mat(H, c.shared_expert_intermediate_size, 1.0f / std::sqrt(float(I)));
      m.shared_expert_gate = mat(1, H, sd);
      w->layers.push_back(L);
    }
  }
};

std::vector<int32_t> random_tokens(int n, int vocab, unsigned seed) {
  std::mt19937 r(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(r() % unsigned(vocab));
  return t;
}

float max_rel_diff(const float* a, const float* b, int64_t n) {
  float mx = 0, scale = 1e-6f;
  for (int64_t i = 0; i < n; ++i) {
    mx = std::max(mx, std::fabs(a[i] - b[i]));
    scale = std::max(scale, std::fabs(b[i]));
  }
  return mx / scale;
}

class ForwardTest : public ::testing::Test {
 protected:
  TinyModel tiny;
  std::unique_ptr<Backend> be = make_backend(BackendOptions{});
  int V() const { return tiny.w->config.vocab_size; }
};

TEST_F(ForwardTest, ChunkedPrefillEqualsOneShot) {
  const auto toks = random_tokens(70, V(), 1);
  std::vector<float> a(toks.size() * V()), b(toks.size() * V());
  {
    Qwen36 m(tiny.w, *be, ModelOptions{128});
    auto st = m.new_state(128);
    m.forward(*st, toks, a.data(), true);
    EXPECT_EQ(st->pos, 70);
  }
  {
    Qwen36 m(tiny.w, *be, ModelOptions{16});   // crosses 4 chunk boundaries
    auto st = m.new_state(128);
    m.forward(*st, toks, b.data(), true);
  }
  EXPECT_LT(max_rel_diff(b.data(), a.data(), int64_t(a.size())), 1e-5f);
  float spread = 0;   // logits must actually vary (a constant model would pass trivially)
  for (int i = 1; i < V(); ++i) spread = std::max(spread, std::fabs(a[i] - a[0]));
  EXPECT_GT(spread, 1e-2f);
}

TEST_F(ForwardTest, PrefillThenDecodeEqualsLongerPrefill) {
  const auto toks = random_tokens(41, V(), 2);
  Qwen36 m(tiny.w, *be, ModelOptions{32});
  std::vector<float> full(V()), step(V());
  auto st1 = m.new_state(64);
  m.forward(*st1, toks, full.data());
  auto st2 = m.new_state(64);
  m.forward(*st2, std::span<const int32_t>(toks).first(40), nullptr);
  m.forward(*st2, std::span<const int32_t>(toks).subspan(40), step.data());
  EXPECT_LT(max_rel_diff(step.data(), full.data(), V()), 1e-5f);
}

TEST_F(ForwardTest, CopiedStateResumesIdentically) {
  const auto toks = random_tokens(30, V(), 3);
  Qwen36 m(tiny.w, *be, ModelOptions{8});
  auto st = m.new_state(64);
  m.forward(*st, std::span<const int32_t>(toks).first(20), nullptr);
  auto snap = m.new_state(20);
  m.copy_state(*st, *snap);
  std::vector<float> a(V()), b(V());
  m.forward(*st, std::span<const int32_t>(toks).subspan(20), a.data());
  auto resumed = m.new_state(64);
  m.copy_state(*snap, *resumed);
  EXPECT_EQ(resumed->pos, 20);
  m.forward(*resumed, std::span<const int32_t>(toks).subspan(20), b.data());
  EXPECT_EQ(max_rel_diff(a.data(), b.data(), V()), 0.0f);
  // reset() then the same prompt again gives the same logits as a fresh state.
  m.reset(*st);
  m.forward(*st, toks, b.data());
  EXPECT_EQ(max_rel_diff(a.data(), b.data(), V()), 0.0f);
}

TEST_F(ForwardTest, RejectsOverflowAndBadIds) {
  Qwen36 m(tiny.w, *be, ModelOptions{8});
  auto st = m.new_state(4);
  const auto toks = random_tokens(5, V(), 4);
  EXPECT_THROW(m.forward(*st, toks, nullptr), Error);
  EXPECT_EQ(st->pos, 0);
  std::vector<int32_t> bad = {1, V()};
  EXPECT_THROW(m.forward(*st, bad, nullptr), Error);
}

}  // namespace
}  // namespace lily
