// The CPU backend's gated attention (MODEL.md §2.2: q / k RMSNorm, partial RoPE, causal softmax over the cache,
// sigmoid output gate) against a direct double-precision evaluation of the same formula, at shapes that cross the
// backend's blocks: query blocks of 8 tokens (and the one-token decode form), key blocks of 128, a prompt that
// starts mid-cache.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "model/synthetic.h"
#include "model/weights.h"

namespace lily {
namespace {

struct Case {
  int T, pos0;
};

std::vector<float> rnd(size_t n, float lo, float hi, std::mt19937& g) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(g);
  return v;
}

// o[t][h] for T new tokens at positions pos0.., the cache holding pos0 earlier rows (already normalised keys).
std::vector<double> reference(const ModelConfig& c, const std::vector<float>& qn, const std::vector<float>& kn,
                              const std::vector<float>& kc0, const std::vector<float>& vc0, const std::vector<float>& q,
                              const std::vector<float>& k, const std::vector<float>& v, int T, int pos0) {
  const int nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim, rd = c.rotary_dim();
  const double eps = c.rms_norm_eps;
  auto norm_rope = [&](const float* x, const std::vector<float>& w, int pos) {
    double ss = 0;
    for (int i = 0; i < hd; ++i) ss += double(x[i]) * x[i];
    const double inv = 1.0 / std::sqrt(ss / hd + eps);
    std::vector<double> y(static_cast<size_t>(hd));
    for (int i = 0; i < hd; ++i) y[size_t(i)] = x[i] * inv * w[size_t(i)];
    for (int i = 0; i < rd / 2; ++i) {
      const double ang = pos * std::pow(double(c.rope_theta), -2.0 * i / rd);
      const double x0 = y[size_t(i)], x1 = y[size_t(i + rd / 2)];
      y[size_t(i)] = x0 * std::cos(ang) - x1 * std::sin(ang);
      y[size_t(i + rd / 2)] = x1 * std::cos(ang) + x0 * std::sin(ang);
    }
    return y;
  };
  // The whole cache after the new tokens: earlier rows as given, new keys normalised and rotated.
  const int n = pos0 + T;
  std::vector<std::vector<double>> K(size_t(n) * nkv), V(size_t(n) * nkv);
  for (int s = 0; s < n; ++s)
    for (int g = 0; g < nkv; ++g) {
      const size_t r = size_t(s) * nkv + size_t(g);
      if (s < pos0) {
        K[r].assign(kc0.begin() + int64_t(r) * hd, kc0.begin() + int64_t(r + 1) * hd);
        V[r].assign(vc0.begin() + int64_t(r) * hd, vc0.begin() + int64_t(r + 1) * hd);
      } else {
        const int64_t off = (int64_t(s - pos0) * nkv + g) * hd;
        K[r] = norm_rope(k.data() + off, kn, s);
        V[r].assign(v.begin() + off, v.begin() + off + hd);
      }
    }
  std::vector<double> o(size_t(T) * nh * hd);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < nh; ++h) {
      const float* qg = q.data() + (int64_t(t) * nh + h) * 2 * hd;
      const std::vector<double> qv = norm_rope(qg, qn, pos0 + t);
      const int g = h / (nh / nkv), len = pos0 + t + 1;
      std::vector<double> sc(static_cast<size_t>(len));
      double mx = -INFINITY;
      for (int s = 0; s < len; ++s) {
        double d = 0;
        for (int e = 0; e < hd; ++e) d += qv[size_t(e)] * K[size_t(s) * nkv + size_t(g)][size_t(e)];
        sc[size_t(s)] = d / std::sqrt(double(hd));
        mx = std::max(mx, sc[size_t(s)]);
      }
      double den = 0;
      for (double& x : sc) den += (x = std::exp(x - mx));
      for (int e = 0; e < hd; ++e) {
        double a = 0;
        for (int s = 0; s < len; ++s) a += sc[size_t(s)] * V[size_t(s) * nkv + size_t(g)][size_t(e)];
        o[(size_t(t) * nh + size_t(h)) * hd + size_t(e)] = a / den / (1.0 + std::exp(-double(qg[hd + e])));
      }
    }
  return o;
}

TEST(CpuAttention, MatchesDirectEvaluation) {
  const ModelConfig c = synthetic_config(4, 0);   // the real head shapes: 16 query heads, 2 KV heads, head_dim 256
  const int nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  auto be = make_backend(BackendOptions{});
  std::mt19937 g(7);
  // Decode (T = 1) at a key-block edge and past it; a prompt shorter than a query block; query blocks with a
  // partial last one, from position 0 and from mid-cache across key blocks.
  for (const Case cs : {Case{1, 127}, Case{1, 300}, Case{5, 0}, Case{21, 0}, Case{19, 250}}) {
    SCOPED_TRACE("T=" + std::to_string(cs.T) + " pos0=" + std::to_string(cs.pos0));
    const int cap = cs.pos0 + cs.T + 3;
    // Gains above 1 sharpen the softmax, as trained q / k norms do.
    const std::vector<float> qn = rnd(size_t(hd), 0.8f, 2.0f, g), kn = rnd(size_t(hd), 0.8f, 2.0f, g);
    std::vector<float> kc = rnd(size_t(cap) * nkv * hd, -2.5f, 2.5f, g), vc = rnd(size_t(cap) * nkv * hd, -1.f, 1.f, g);
    const std::vector<float> kc0 = kc, vc0 = vc;
    const std::vector<float> q = rnd(size_t(cs.T) * nh * 2 * hd, -1.f, 1.f, g);
    const std::vector<float> k = rnd(size_t(cs.T) * nkv * hd, -1.f, 1.f, g);
    const std::vector<float> v = rnd(size_t(cs.T) * nkv * hd, -1.f, 1.f, g);
    AttnWeights w;
    w.q_norm = {qn.data(), hd};
    w.k_norm = {kn.data(), hd};
    KvCache kv;
    kv.k = kc.data();
    kv.v = vc.data();
    kv.capacity = cap;
    std::vector<float> out(size_t(cs.T) * nh * hd, NAN);
    be->attention(c, w, kv, cs.pos0, nullptr, q.data(), k.data(), v.data(), cs.T, out.data());
    const std::vector<double> ref = reference(c, qn, kn, kc0, vc0, q, k, v, cs.T, cs.pos0);
    double worst = 0, scale = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      ASSERT_TRUE(std::isfinite(out[i])) << "output " << i;
      worst = std::max(worst, std::fabs(double(out[i]) - ref[i]));
      scale = std::max(scale, std::fabs(ref[i]));
    }
    // f32 against f64: ~1e-6 of the largest output; a wrong mask, block edge or rescale is off by > 1e-2.
    EXPECT_LT(worst, 2e-5 * scale) << "worst |diff| " << worst << " of max |ref| " << scale;
  }
}

}  // namespace
}  // namespace lily
