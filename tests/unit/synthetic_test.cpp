// Synthetic full-size weights: real shapes and dtypes, zero-mean groups with the intended spread
// (a group's weights are scale·q + bias with q uniform on 0..15: mean 0 needs bias = -7.5·scale).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "core/common.h"
#include "model/synthetic.h"

namespace lily {
namespace {

// Mean and standard deviation of the dequantised weights of `rows` rows of an affine matrix.
void weight_stats(const QMatrix& m, int64_t rows, double& mean, double& sd) {
  const int per = 32 / m.bits();
  const auto* d = static_cast<const uint32_t*>(m.data);
  const auto* s = static_cast<const uint16_t*>(m.scales);
  const auto* b = static_cast<const uint16_t*>(m.biases);
  double sum = 0, sq = 0;
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < m.cols; ++k) {
      const uint32_t w = d[r * (m.cols / per) + k / per];
      const int q = int((w >> (m.bits() * (k % per))) & ((1u << m.bits()) - 1));
      const int64_t g = r * (m.cols / 64) + k / 64;
      const double v = double(bf16_to_f32(s[g])) * q + bf16_to_f32(b[g]);
      sum += v;
      sq += v * v;
      ++n;
    }
  mean = sum / double(n);
  sd = std::sqrt(sq / double(n) - mean * mean);
}

TEST(Synthetic, ShapesFollowTheRealConfig) {
  SyntheticOptions o;
  o.layers = 4;
  o.vocab = 512;
  o.threads = 2;
  const ModelWeights w = make_synthetic_weights(o);
  const ModelConfig& c = w.config;
  ASSERT_EQ(w.layers.size(), 4u);
  EXPECT_FALSE(w.layers[0].full_attention);
  EXPECT_TRUE(w.layers[3].full_attention);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(w.layers[0].linear_attn.in_proj_qkv.rows, 8192);
  EXPECT_EQ(w.layers[0].linear_attn.out_proj.cols, 4096);
  EXPECT_EQ(w.layers[3].self_attn.q_proj.rows, 8192);
  EXPECT_EQ(w.layers[3].self_attn.k_proj.rows, 512);
  EXPECT_EQ(w.layers[0].mlp.gate.type, WType::kAffine8);
  EXPECT_EQ(w.layers[0].mlp.shared_expert_gate.type, WType::kAffine8);
  EXPECT_EQ(w.layers[0].mlp.experts_down.n, 256);
  EXPECT_EQ(w.layers[0].mlp.experts_down.first.cols, 512);
  EXPECT_EQ(w.layers[0].mlp.experts_gate.data_stride, 512LL * 2048 / 2);
  EXPECT_EQ(w.lm_head.rows, 512);
  EXPECT_EQ(w.layers[0].linear_attn.conv1d.n, 8192LL * 4);
}

TEST(Synthetic, WeightsAreZeroMeanWithFanInSpread) {
  SyntheticOptions o;
  o.layers = 1;
  o.vocab = 256;
  o.threads = 2;
  const ModelWeights w = make_synthetic_weights(o);
  double mean = 0, sd = 0;
  weight_stats(w.layers[0].linear_attn.in_proj_qkv, 256, mean, sd);
  const double want = 1.0 / std::sqrt(2048.0);
  EXPECT_NEAR(mean, 0.0, 0.02 * want);
  EXPECT_NEAR(sd, want, 0.15 * want);
  weight_stats(w.layers[0].mlp.experts_down.expert(17), 256, mean, sd);
  EXPECT_NEAR(mean, 0.0, 0.02 / std::sqrt(512.0));
  EXPECT_NEAR(sd, 1.0 / std::sqrt(512.0), 0.15 / std::sqrt(512.0));
  weight_stats(w.layers[0].mlp.gate, 64, mean, sd);   // 8-bit router
  EXPECT_NEAR(mean, 0.0, 0.02 * want);
  EXPECT_NEAR(sd, want, 0.15 * want);
}

TEST(Synthetic, SameSeedSameWeightsAnyThreadCount) {
  SyntheticOptions a, b;
  a.layers = b.layers = 1;
  a.vocab = b.vocab = 128;
  a.threads = 1;
  b.threads = 2;
  const ModelWeights wa = make_synthetic_weights(a), wb = make_synthetic_weights(b);
  const auto& qa = wa.layers[0].linear_attn.in_proj_z;
  const auto& qb = wb.layers[0].linear_attn.in_proj_z;
  EXPECT_EQ(0, std::memcmp(qa.data, qb.data, size_t(qa.rows * qa.cols / 2)));
  EXPECT_EQ(0, std::memcmp(qa.scales, qb.scales, size_t(qa.rows * qa.cols / 64 * 2)));
}

}  // namespace
}  // namespace lily
