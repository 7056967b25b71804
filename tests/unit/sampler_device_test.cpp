// The backend sample op (D2) on the cpu backend, against the host Sampler's semantics: greedy and
// top_k = 1 are the argmax, penalties and logit_bias act like the host's (greedy picks equal the
// host Sampler's on random logits and histories), seeds reproduce, and the draw frequencies match
// the renormalised top-k / top-p / min-p distributions within a statistical bound. Also the
// Qwen36 decode loop with sampling: greedy equals generate_greedy, and the consumed-token count.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/sample_math.h"
#include "core/common.h"
#include "engine/sampler.h"
#include "model/qwen36.h"
#include "tiny_model.h"

namespace lily {
namespace {

struct Op {
  std::unique_ptr<Backend> be = make_backend(BackendOptions{});
  SampleConfig cfg;
  std::vector<int32_t> counts;
  int32_t pick(const std::vector<float>& logits) {
    if (counts.size() != logits.size()) counts.assign(logits.size(), 0);
    int32_t id = -1;
    be->sample(logits.data(), int(logits.size()), &cfg, counts.data(), &id);
    return id;
  }
};

SampleConfig config(float t, float top_p = 1.0f, int top_k = 0, float min_p = 0.0f, uint64_t seed = 7) {
  return make_sample_config(t, top_p, top_k, min_p, 0.0f, 0.0f, 1.0f, seed, 0);
}

TEST(SampleOp, GreedyAndTopK1AreTheArgmaxLowestOnTies) {
  Op op;
  op.cfg = config(0.0f);
  EXPECT_EQ(op.pick({1.0f, 3.0f, 3.0f, -2.0f}), 1);
  op.cfg = config(0.9f, 1.0f, 1);
  EXPECT_EQ(op.pick({1.0f, 3.0f, 3.0f, -2.0f}), 1);
  op.cfg = config(0.0f);
  EXPECT_EQ(op.pick({-INFINITY, NAN, -5.0f, -INFINITY}), 2);
  EXPECT_EQ(op.pick({-0.0f, 0.0f}), 0);   // -0 == +0: lowest index
}

TEST(SampleOp, RecordsThePickAndAdvancesTheStep) {
  Op op;
  op.cfg = config(0.0f);
  op.counts = {0, 1, 0};   // token 1 seen in the prompt
  EXPECT_EQ(op.pick({0.0f, 5.0f, 1.0f}), 1);
  EXPECT_EQ(op.pick({0.0f, 5.0f, 1.0f}), 1);
  EXPECT_EQ(op.counts, (std::vector<int32_t>{0, 5, 0}));   // seen + generated twice
  EXPECT_EQ(op.cfg.step, 2u);
}

// Greedy picks equal the host Sampler's for random logits, penalties, biases and histories.
TEST(SampleOp, GreedyWithPenaltiesMatchesTheHostSampler) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const int V = 50;
    SamplingParams p;
    p.temperature = 0.0f;
    p.presence_penalty = std::uniform_real_distribution<float>(-2, 2)(rng);
    p.frequency_penalty = std::uniform_real_distribution<float>(-2, 2)(rng);
    p.repetition_penalty = std::uniform_real_distribution<float>(0.5f, 2.0f)(rng);
    for (int b = 0; b < 3; ++b) p.logit_bias.push_back({int32_t(rng() % V), float(int(rng() % 9) - 4)});
    std::vector<int32_t> prompt;
    for (int i = 0; i < 6; ++i) prompt.push_back(int32_t(rng() % V));
    Sampler host(p, V, prompt);
    Op op;
    op.cfg = make_sample_config(0.0f, 1.0f, 0, 0.0f, p.presence_penalty, p.frequency_penalty,
                                p.repetition_penalty, 1, 0);
    for (const auto& [id, b] : p.logit_bias) {
      op.cfg.bias_id[op.cfg.n_bias] = id;
      op.cfg.bias[op.cfg.n_bias++] = b;
    }
    op.counts.assign(V, 0);
    for (int32_t t : prompt) op.counts[t] = 1;
    for (int step = 0; step < 8; ++step) {
      std::vector<float> l(V);
      for (auto& x : l) x = std::normal_distribution<float>(0.0f, 2.0f)(rng);
      std::vector<float> scratch = l;
      const int32_t want = host.sample(scratch.data(), V);
      host.accept(want);
      ASSERT_EQ(op.pick(l), want) << "trial " << trial << " step " << step;
    }
  }
}

TEST(SampleOp, PenaltiesAndBiasChangeWhatTheyShould) {
  Op op;
  const std::vector<float> l = {2.0f, 1.8f, 0.5f};
  op.cfg = make_sample_config(0.0f, 1.0f, 0, 0.0f, 0.5f, 0.0f, 1.0f, 1, 0);
  op.counts = {2, 0, 0};   // token 0 generated once: presence 0.5 -> 1.5 < 1.8
  EXPECT_EQ(op.pick(l), 1);
  op.cfg = make_sample_config(0.0f, 1.0f, 0, 0.0f, 0.0f, 0.1f, 1.0f, 1, 0);
  op.counts = {2 * 2, 0, 0};   // twice: 2.0 - 0.2 = 1.8 ties token 1: lowest id wins
  EXPECT_EQ(op.pick(l), 0);
  op.counts = {2 * 3, 0, 0};   // three times: 1.7 < 1.8
  EXPECT_EQ(op.pick(l), 1);
  op.cfg = make_sample_config(0.0f, 1.0f, 0, 0.0f, 0.0f, 0.0f, 1.5f, 1, 0);
  op.counts = {1, 0, 0};   // seen in the prompt: 2.0 / 1.5 < 1.8
  EXPECT_EQ(op.pick(l), 1);
  op.cfg = make_sample_config(0.0f, 1.0f, 0, 0.0f, 0.0f, 0.0f, 1.0f, 1, 0);
  op.cfg.bias_id[0] = 2;
  op.cfg.bias[0] = 5.0f;
  op.cfg.n_bias = 1;
  op.counts = {0, 0, 0};
  EXPECT_EQ(op.pick(l), 2);
}

TEST(SampleOp, NeverPicksPastNValid) {
  Op op;
  op.cfg = config(1.0f);
  op.cfg.n_valid = 4;
  std::vector<float> l = {0.0f, 0.0f, 0.0f, 0.0f, 50.0f, 50.0f};
  for (int i = 0; i < 200; ++i) EXPECT_LT(op.pick(l), 4);
}

TEST(SampleOp, SameSeedSameSequence) {
  std::mt19937 rng(5);
  std::vector<std::vector<float>> rows(60, std::vector<float>(1000));
  for (auto& r : rows)
    for (auto& x : r) x = std::normal_distribution<float>(0.0f, 3.0f)(rng);
  auto run = [&](uint64_t seed, float top_p, int top_k) {
    Op op;
    op.cfg = make_sample_config(0.9f, top_p, top_k, 0.0f, 0.3f, 0.1f, 1.1f, seed, 0);
    std::vector<int32_t> out;
    for (const auto& r : rows) out.push_back(op.pick(r));
    return out;
  };
  for (auto [tp, tk] : {std::pair{1.0f, 0}, {0.9f, 0}, {1.0f, 40}, {0.8f, 20}}) {
    EXPECT_EQ(run(11, tp, tk), run(11, tp, tk));
    EXPECT_NE(run(11, tp, tk), run(12, tp, tk));
  }
}

// Expected distribution under the host Sampler's rules, in double precision.
std::vector<double> expected(const std::vector<float>& l, float t, float top_p, int top_k, float min_p) {
  const int V = int(l.size());
  std::vector<int> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
  const int k = top_k > 0 && top_k < V ? top_k : V;
  std::vector<double> w(V, 0.0);
  double z = 0;
  for (int j = 0; j < k; ++j) z += w[order[j]] = std::exp((double(l[order[j]]) - l[order[0]]) / t);
  int keep = k;
  if (top_p < 1.0f) {
    double cum = 0;
    for (int j = 0; j < k; ++j)
      if ((cum += w[order[j]]) >= top_p * z) {
        keep = j + 1;
        break;
      }
  }
  int m = 1;
  while (m < keep && w[order[m]] >= min_p) ++m;
  keep = m;
  std::vector<double> p(V, 0.0);
  double tot = 0;
  for (int j = 0; j < keep; ++j) tot += w[order[j]];
  for (int j = 0; j < keep; ++j) p[order[j]] = w[order[j]] / tot;
  return p;
}

TEST(SampleOp, DrawFrequenciesFollowTheTruncatedSoftmax) {
  const std::vector<float> l = {1.0f, 2.5f, 0.2f, 2.0f, -1.0f, 0.9f, 2.2f, -3.0f};
  struct Case {
    float t, top_p;
    int top_k;
    float min_p;
  };
  for (const Case& c : {Case{1.0f, 1.0f, 0, 0.0f}, Case{0.7f, 1.0f, 3, 0.0f}, Case{1.0f, 0.7f, 0, 0.0f},
                        Case{1.3f, 0.9f, 5, 0.0f}, Case{1.0f, 1.0f, 0, 0.3f}, Case{2.0f, 0.95f, 0, 0.1f}}) {
    Op op;
    op.cfg = config(c.t, c.top_p, c.top_k, c.min_p, 99);
    const int N = 20000;
    std::vector<int> hits(l.size(), 0);
    for (int i = 0; i < N; ++i) {
      hits[op.pick(l)]++;
      std::fill(op.counts.begin(), op.counts.end(), 0);
    }
    const auto p = expected(l, c.t, c.top_p, c.top_k, c.min_p);
    for (size_t i = 0; i < l.size(); ++i) {
      const double f = double(hits[i]) / N;
      const double sd = std::sqrt(p[i] * (1 - p[i]) / N);
      EXPECT_NEAR(f, p[i], 5 * sd + 1e-9) << "token " << i << " t " << c.t << " top_p " << c.top_p
                                          << " top_k " << c.top_k << " min_p " << c.min_p;
    }
  }
}

// The fixed-point weights: exact at 0, monotone enough, zero below the cut.
TEST(SampleOp, FixedPointWeights) {
  EXPECT_EQ(smath::weight(0.0f), uint64_t(1) << 44);
  EXPECT_EQ(smath::weight(-31.0f), 0u);
  EXPECT_GE(smath::weight(-30.0f), 1u);
  for (float x = -29.0f; x < 0.0f; x += 0.37f) {   // relative 1e-5, or 2 units of 2^-44 (rounding down)
    const double want = std::ldexp(std::exp(double(x)), 44);
    EXPECT_NEAR(double(smath::weight(x)), want, 1e-5 * want + 2.0) << x;
  }
}

// ---- the decode loop with sampling (Qwen36::generate) on the cpu backend --------------------

class DecodeLoop : public ::testing::Test {
 protected:
  TinyModel tiny;
  std::unique_ptr<Backend> be = make_backend(BackendOptions{});
  int V() const { return tiny.w->config.vocab_size; }
  std::vector<int32_t> prompt = {5, 17, 42, 99, 3, 250, 7};
};

TEST_F(DecodeLoop, GreedyEqualsGenerateGreedy) {
  Qwen36 m(tiny.w, *be, ModelOptions{8});
  auto a = m.new_state(64), b = m.new_state(64);
  m.forward(*a, {prompt.data(), prompt.size() - 1}, nullptr);
  m.forward(*b, {prompt.data(), prompt.size() - 1}, nullptr);
  std::vector<int32_t> want, got;
  m.generate_greedy(*a, prompt.back(), 20, want);
  const int c = m.generate(*b, prompt.back(), 20, config(0.0f), {}, [&](int32_t id) {
    got.push_back(id);
    return true;
  });
  EXPECT_EQ(got, want);
  EXPECT_EQ(c, 19);
  EXPECT_EQ(b->pos, a->pos);
}

// The state consumed exactly the returned number of picks: its logits equal a replay of them.
TEST_F(DecodeLoop, ConsumedCountIsExact) {
  Qwen36 m(tiny.w, *be, ModelOptions{8});
  for (int stop_after : {1, 2, 5, 12}) {
    auto st = m.new_state(64);
    std::vector<float> logits(V());
    m.forward(*st, prompt, logits.data());
    std::vector<int32_t> picks;
    const SampleConfig cfg = make_sample_config(0.8f, 0.9f, 0, 0.0f, 0.2f, 0.0f, 1.1f, 3, 0);
    const int n = 12;
    const int c = m.generate_from_logits(*st, logits.data(), n, cfg, prompt, [&](int32_t id) {
      picks.push_back(id);
      return int(picks.size()) < stop_after;
    });
    ASSERT_EQ(int(picks.size()), stop_after);
    EXPECT_EQ(c, stop_after == n ? n - 1 : stop_after);
    EXPECT_EQ(st->pos, int(prompt.size()) + c);
    auto ref = m.new_state(64);
    std::vector<int32_t> seq = prompt;
    seq.insert(seq.end(), picks.begin(), picks.begin() + c);
    std::vector<float> want(V());
    m.forward(*ref, seq, want.data());
    for (int i = 0; i < V(); ++i) ASSERT_NEAR(logits[i], want[i], 1e-4f * (1 + std::fabs(want[i]))) << i;
  }
}

TEST_F(DecodeLoop, SeededSamplingIsReproducible) {
  Qwen36 m(tiny.w, *be, ModelOptions{8});
  auto run = [&](uint64_t seed) {
    auto st = m.new_state(64);
    std::vector<float> logits(V());
    m.forward(*st, prompt, logits.data());
    std::vector<int32_t> picks;
    m.generate_from_logits(*st, logits.data(), 16, make_sample_config(1.2f, 1.0f, 0, 0.0f, 0, 0, 1, seed, 0),
                           {}, [&](int32_t id) {
                             picks.push_back(id);
                             return true;
                           });
    return picks;
  };
  EXPECT_EQ(run(5), run(5));
  EXPECT_NE(run(5), run(6));
}

}  // namespace
}  // namespace lily
