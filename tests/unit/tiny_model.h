// A tiny random model with f32 weights (real per-head dims, small counts) built in memory, shared
// by the forward-pass, decode-loop and engine tests.
#pragma once
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "model/weights.h"

namespace lily {

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

}  // namespace lily
