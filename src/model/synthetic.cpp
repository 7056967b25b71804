// Synthetic full-size weights (see synthetic.h). Values come from a counter-based hash so that
// every thread fills its own slice independently and the result does not depend on thread count.
#include "model/synthetic.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "core/common.h"

namespace lily {

namespace {

uint64_t mix(uint64_t z) {   // splitmix64 finaliser
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

class Builder {
 public:
  Builder(ModelWeights& w, uint64_t seed, int threads)
      : w_(w), seed_(seed), threads_(threads > 0 ? threads : std::max(1u, std::thread::hardware_concurrency())) {}

  // Runs f(i) for i in [0, n) over all threads.
  template <class F>
  void parallel(int64_t n, F&& f) {
    std::vector<std::thread> ts;
    const int64_t per = (n + threads_ - 1) / threads_;
    for (int t = 0; t < threads_; ++t) {
      const int64_t lo = t * per, hi = std::min(n, lo + per);
      if (lo >= hi) break;
      ts.emplace_back([&, lo, hi] {
        for (int64_t i = lo; i < hi; ++i) f(i);
      });
    }
    for (auto& t : ts) t.join();
  }

  void* buffer(int64_t bytes) {
    auto v = std::make_shared<std::vector<float>>((bytes + 3) / 4);
    w_.f32_arena.push_back(v);
    return v->data();
  }

  // Affine matrix [rows, cols] (rows*count for a stack), `bits` 4 or 8, weight std `std_`.
  QMatrix affine(int64_t rows, int64_t cols, int bits, double std_dev, int64_t count = 1) {
    QMatrix m;
    m.type = bits == 4 ? WType::kAffine4 : WType::kAffine8;
    m.rows = rows;
    m.cols = cols;
    m.group_size = 64;
    const int64_t total_rows = rows * count, words = total_rows * cols * bits / 32, groups = total_rows * cols / 64;
    auto* d = static_cast<uint32_t*>(buffer(words * 4));
    auto* s = static_cast<uint16_t*>(buffer(groups * 2));
    auto* b = static_cast<uint16_t*>(buffer(groups * 2));
    const uint64_t key = next_key();
    parallel((words + 4095) / 4096, [&](int64_t blk) {
      for (int64_t i = blk * 4096; i < std::min(words, (blk + 1) * 4096); ++i)
        d[i] = uint32_t(mix(key + uint64_t(i) * 0x9E3779B97F4A7C15ull));
    });
    // Uniform codes on [0, 2^bits): mean (2^bits-1)/2, std ≈ 2^bits/sqrt(12).
    const double levels = double((1 << bits) - 1);
    const double code_std = (levels + 1) / std::sqrt(12.0);
    const float mag = float(std_dev / code_std);
    const uint64_t skey = next_key();
    parallel((groups + 4095) / 4096, [&](int64_t blk) {
      for (int64_t g = blk * 4096; g < std::min(groups, (blk + 1) * 4096); ++g) {
        const uint64_t r = mix(skey + uint64_t(g) * 0x9E3779B97F4A7C15ull);
        // Random sign and a ±25% spread per group; the bias centres the codes so the mean is 0.
        const float sc = (r & 1 ? 1.f : -1.f) * mag * float(0.75 + 0.5 * double(r >> 40) / double(1ull << 24));
        const uint16_t sb = f32_to_bf16(sc);
        s[g] = sb;
        b[g] = f32_to_bf16(-bf16_to_f32(sb) * float(levels / 2));
      }
    });
    m.data = d;
    m.scales = s;
    m.biases = b;
    return m;
  }

  QStack stack(int64_t n, int64_t rows, int64_t cols, double std_dev) {
    QStack st;
    st.first = affine(rows, cols, 4, std_dev, n);
    st.n = n;
    st.data_stride = rows * cols / 2;
    st.sb_stride = rows * (cols / 64) * 2;
    return st;
  }

  // f32 vector with values uniform in [lo, hi).
  FVec vec(int64_t n, float lo, float hi) {
    auto* p = static_cast<float*>(buffer(n * 4));
    const uint64_t key = next_key();
    for (int64_t i = 0; i < n; ++i)
      p[i] = lo + (hi - lo) * float(double(mix(key + uint64_t(i)) >> 40) / double(1ull << 24));
    return {p, n};
  }

 private:
  uint64_t next_key() { return mix(seed_ + 0x632BE59BD9B4E019ull * ++counter_); }
  ModelWeights& w_;
  uint64_t seed_, counter_ = 0;
  int threads_;
};

}  // namespace

ModelConfig synthetic_config(int layers, int vocab) {
  if (layers < 1 || layers > 40) throw Error("synthetic model: --layers must be in [1, 40]");
  ModelConfig c;
  c.model_type = "qwen3_5_moe_text";
  c.hidden_size = 2048;
  c.num_hidden_layers = layers;
  for (int i = 0; i < layers; ++i) c.is_full_attention.push_back((i + 1) % 4 == 0);
  c.num_attention_heads = 16;
  c.num_key_value_heads = 2;
  c.head_dim = 256;
  c.attn_output_gate = true;
  c.linear_num_key_heads = 16;
  c.linear_num_value_heads = 32;
  c.linear_key_head_dim = 128;
  c.linear_value_head_dim = 128;
  c.linear_conv_kernel_dim = 4;
  c.num_experts = 256;
  c.num_experts_per_tok = 8;
  c.moe_intermediate_size = 512;
  c.shared_expert_intermediate_size = 512;
  c.vocab_size = vocab > 0 ? vocab : 248320;
  c.rms_norm_eps = 1e-6f;
  c.max_position_embeddings = 262144;
  c.rope_theta = 1e7f;
  c.partial_rotary_factor = 0.25f;
  c.tie_word_embeddings = false;
  c.eos_token_ids = {248044};
  c.quant.present = true;
  c.quant.group_size = 64;
  c.quant.bits = 4;
  return c;
}

ModelWeights make_synthetic_weights(const SyntheticOptions& opt) {
  ModelWeights w;
  w.config = synthetic_config(opt.layers, opt.vocab);
  const ModelConfig& c = w.config;
  Builder b(w, opt.seed, opt.threads);
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  const double in_std = 1.0 / std::sqrt(double(H));
  w.embed_tokens = b.affine(c.vocab_size, H, 4, 1.0);
  w.lm_head = b.affine(c.vocab_size, H, 4, in_std);
  w.norm = b.vec(H, 0.9f, 1.1f);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights L;
    L.full_attention = c.is_full_attention[l];
    L.input_layernorm = b.vec(H, 0.9f, 1.1f);
    L.post_attention_layernorm = b.vec(H, 0.9f, 1.1f);
    if (L.full_attention) {
      const int64_t qd = int64_t(c.num_attention_heads) * c.head_dim, kvd = int64_t(c.num_key_value_heads) * c.head_dim;
      AttnWeights& a = L.self_attn;
      a.q_proj = b.affine(2 * qd, H, 4, in_std);
      a.k_proj = b.affine(kvd, H, 4, in_std);
      a.v_proj = b.affine(kvd, H, 4, in_std);
      a.o_proj = b.affine(H, qd, 4, 1.0 / std::sqrt(double(qd)));
      a.q_norm = b.vec(c.head_dim, 0.9f, 1.1f);
      a.k_norm = b.vec(c.head_dim, 0.9f, 1.1f);
    } else {
      GdnWeights& g = L.linear_attn;
      const int64_t nv = c.linear_num_value_heads, vd = c.linear_value_dim();
      g.in_proj_qkv = b.affine(c.conv_dim(), H, 4, in_std);
      g.in_proj_z = b.affine(vd, H, 4, in_std);
      g.in_proj_a = b.affine(nv, H, 4, in_std);
      g.in_proj_b = b.affine(nv, H, 4, in_std);
      g.conv1d = b.vec(int64_t(c.conv_dim()) * c.linear_conv_kernel_dim, -0.5f, 0.5f);
      g.A_log = b.vec(nv, 0.f, 2.7f);          // A = exp(A_log) in [1, 15), as the reference init
      g.dt_bias = b.vec(nv, -6.f, -2.f);       // softplus^-1 of dt in ~[2e-3, 0.13]
      g.norm = b.vec(c.linear_value_head_dim, 0.9f, 1.1f);
      g.out_proj = b.affine(H, vd, 4, 1.0 / std::sqrt(double(vd)));
    }
    MoeWeights& m = L.mlp;
    m.gate = b.affine(E, H, 8, in_std);
    m.shared_expert_gate = b.affine(1, H, 8, in_std);
    m.experts_gate = b.stack(E, I, H, in_std);
    m.experts_up = b.stack(E, I, H, in_std);
    m.experts_down = b.stack(E, H, I, 1.0 / std::sqrt(double(I)));
    m.shared_gate_proj = b.affine(c.shared_expert_intermediate_size, H, 4, in_std);
    m.shared_up_proj = b.affine(c.shared_expert_intermediate_size, H, 4, in_std);
    m.shared_down_proj = b.affine(H, c.shared_expert_intermediate_size, 4,
                                  1.0 / std::sqrt(double(c.shared_expert_intermediate_size)));
    w.layers.push_back(std::move(L));
  }
  return w;
}

}  // namespace lily
