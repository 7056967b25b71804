// Sampler and stop-string tests: empirical distributions against the textbook definitions of each
// truncation rule (HF logits processors / OpenAI penalty formulas), seeds, logprobs, hold-back.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "core/common.h"
#include "engine/sampler.h"
#include "engine/stop_matcher.h"

namespace lily {
namespace {

// Draws `n` samples with fresh copies of `logits` and returns empirical frequencies per id.
std::vector<double> frequencies(Sampler& s, const std::vector<float>& logits, int n) {
  std::vector<double> f(logits.size(), 0.0);
  for (int i = 0; i < n; ++i) {
    auto l = logits;
    f[s.sample(l.data(), int(l.size()))] += 1.0 / n;
  }
  return f;
}

std::vector<double> softmax(const std::vector<double>& x) {
  double mx = -1e300;
  for (double v : x) mx = std::max(mx, v);
  std::vector<double> p(x.size());
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += p[i] = std::exp(x[i] - mx);
  for (double& v : p) v /= s;
  return p;
}

const std::vector<float> kLogits = {2.0f, 1.0f, 0.5f, 0.0f, -1.0f, -3.0f};

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "id " << i;
}

TEST(Sampler, GreedyPicksArgmaxLowestOnTies) {
  SamplingParams p;
  p.temperature = 0.0f;
  Sampler s(p, 4, {});
  std::vector<float> l = {1.0f, 3.0f, 3.0f, 2.0f};
  EXPECT_EQ(s.sample(l.data(), 4), 1);
}

TEST(Sampler, TemperatureMatchesSoftmax) {
  SamplingParams p;
  p.temperature = 0.7f;
  p.has_seed = true;
  p.seed = 1;
  Sampler s(p, int(kLogits.size()), {});
  std::vector<double> x;
  for (float v : kLogits) x.push_back(v / 0.7);
  expect_close(frequencies(s, kLogits, 40000), softmax(x), 0.01);
}

TEST(Sampler, TopKTopPMinPTruncate) {
  // Probabilities at T=1: ~[0.574, 0.211, 0.128, 0.078, 0.029, 0.004].
  auto base = softmax({2.0, 1.0, 0.5, 0.0, -1.0, -3.0});
  auto renorm = [&](int keep) {
    std::vector<double> w(base.size(), 0.0);
    double s = 0;
    for (int i = 0; i < keep; ++i) s += base[i];
    for (int i = 0; i < keep; ++i) w[i] = base[i] / s;
    return w;
  };
  SamplingParams p;
  p.has_seed = true;
  p.seed = 7;
  p.top_k = 3;
  {
    Sampler s(p, 6, {});
    expect_close(frequencies(s, kLogits, 40000), renorm(3), 0.01);
  }
  p.top_k = 0;
  p.top_p = 0.8f;   // 0.574 + 0.211 = 0.785 < 0.8, so the third token is kept too
  {
    Sampler s(p, 6, {});
    expect_close(frequencies(s, kLogits, 40000), renorm(3), 0.01);
  }
  p.top_p = 1.0f;
  p.min_p = 0.3f;   // floor 0.172: keeps ids 0 and 1
  {
    Sampler s(p, 6, {});
    expect_close(frequencies(s, kLogits, 40000), renorm(2), 0.01);
  }
}

TEST(Sampler, TopPOnALargeFlatVocabularyKeepsTheExactNucleus) {
  // One peaked token (id 20000, logit 10) over 20,000 flat ones: Z = e^10 + 20000. Nucleus for
  // top_p 0.9 = the peak plus the lowest ids of the flat tokens (ties go to lower ids) until the
  // mass reaches 0.9 Z: 0.9 * 42026.47 - 22026.47 = 15797.3 -> 15,798 flat tokens (ids 0..15797).
  std::vector<float> l(20001, 0.0f);
  l[20000] = 10.0f;
  SamplingParams p;
  p.top_p = 0.9f;
  p.has_seed = true;
  p.seed = 11;
  Sampler s(p, 20001, {});
  int peak = 0, max_flat = -1;
  const int n = 3000;   // seeded, so deterministic; ±0.03 is 3 sd and half the no-top-p shift (0.058)
  for (int i = 0; i < n; ++i) {
    auto x = l;
    const int id = s.sample(x.data(), int(x.size()));
    if (id == 20000) ++peak;
    else max_flat = std::max(max_flat, id);
  }
  const double e10 = std::exp(10.0);
  EXPECT_NEAR(double(peak) / n, e10 / (e10 + 15798), 0.03);
  EXPECT_LE(max_flat, 15797);
  EXPECT_GT(max_flat, 15000);
}

TEST(Sampler, PenaltiesFollowOpenAiAndCtrlFormulas) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.has_seed = true;
  p.seed = 3;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  p.repetition_penalty = 1.5f;
  const std::vector<int32_t> prompt = {3, 4};
  Sampler s(p, 6, prompt);
  s.accept(0);
  s.accept(0);
  s.accept(4);
  // Expected logits written out by hand from the formulas.
  std::vector<double> x = {2.0, 1.0, 0.5, 0.0, -1.0, -3.0};
  x[0] = 2.0 / 1.5 - (0.5 + 0.25 * 2);   // generated twice, positive logit divided
  x[3] = 0.0;                            // in prompt only: 0 stays 0
  x[4] = -1.0 * 1.5 - (0.5 + 0.25 * 1);  // prompt + generated once, negative logit multiplied
  expect_close(frequencies(s, kLogits, 40000), softmax(x), 0.01);
}

TEST(Sampler, LogitBiasShiftsLogitsBeforeSampling) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.logit_bias = {{0, -100.0f}, {4, 5.5f}};   // ban the argmax; 4 goes from -1 to 4.5
  Sampler s(p, 6, {});
  auto l = kLogits;
  EXPECT_EQ(s.sample(l.data(), 6), 4);
  p.temperature = 1.0f;
  p.has_seed = true;
  p.logit_bias = {{5, 2.0f}};
  Sampler t(p, 6, {});
  expect_close(frequencies(t, kLogits, 40000), softmax({2.0, 1.0, 0.5, 0.0, -1.0, -1.0}), 0.01);
  p.logit_bias = {{1, 101.0f}};
  EXPECT_THROW(p.validate(), Error);
}

TEST(Sampler, SeedIsReproducibleAndSeedsDiffer) {
  SamplingParams p;
  p.has_seed = true;
  p.seed = 42;
  auto run = [&](uint64_t seed) {
    p.seed = seed;
    Sampler s(p, 6, {});
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) {
      auto l = kLogits;
      out.push_back(s.sample(l.data(), 6));
    }
    return out;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
}

TEST(Sampler, NeverPicksIdsPastTheTokenizerVocabulary) {
  SamplingParams p;
  p.temperature = 0.0f;
  Sampler s(p, 3, {});
  std::vector<float> l = {0.0f, 1.0f, 0.5f, 9.0f, 9.0f};
  EXPECT_EQ(s.sample(l.data(), 5), 1);
}

TEST(Sampler, LogprobsAreLogSoftmaxOfRawLogits) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.presence_penalty = 2.0f;
  Sampler s(p, 6, {});
  s.accept(0);   // penalised for sampling, but logprobs still describe the model
  auto l = kLogits;
  TokenLogprob lp;
  const int32_t id = s.sample(l.data(), 6, &lp, 3);
  auto ref = softmax({2.0, 1.0, 0.5, 0.0, -1.0, -3.0});
  EXPECT_EQ(id, 1);   // 2 - 2 = 0 < 1
  EXPECT_NEAR(lp.logprob, std::log(ref[1]), 1e-5);
  ASSERT_EQ(lp.top.size(), 3u);
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(lp.top[k].id, k);
    EXPECT_NEAR(lp.top[k].logprob, std::log(ref[k]), 1e-5);
  }
}

TEST(Sampler, RejectsOutOfRangeValues) {
  SamplingParams p;
  p.top_p = 0.0f;
  EXPECT_THROW(p.validate(), Error);
  p = {};
  p.temperature = -1.0f;
  EXPECT_THROW(p.validate(), Error);
  p = {};
  p.presence_penalty = 3.0f;
  EXPECT_THROW(p.validate(), Error);
  p = {};
  p.repetition_penalty = 0.0f;
  EXPECT_THROW(p.validate(), Error);
  p = {};
  EXPECT_NO_THROW(p.validate());
}

// Feeds text in every possible split and checks the released text and the stop decision.
void check_stop(const std::vector<std::string>& stops, const std::string& text,
                const std::string& want, bool want_stop) {
  for (size_t cut1 = 0; cut1 <= text.size(); ++cut1) {
    for (size_t cut2 = cut1; cut2 <= text.size(); ++cut2) {
      StopMatcher m(stops);
      std::string got = m.push(text.substr(0, cut1));
      got += m.push(text.substr(cut1, cut2 - cut1));
      got += m.push(text.substr(cut2));
      got += m.flush();
      EXPECT_EQ(got, want) << "splits " << cut1 << "," << cut2;
      EXPECT_EQ(m.stopped(), want_stop);
    }
  }
}

TEST(StopMatcher, StopsBeforeTheStringInEverySplit) {
  check_stop({"STOP"}, "hello STOP world", "hello ", true);
  check_stop({"STOP"}, "hello STO", "hello STO", false);
  check_stop({"ab", "b c"}, "xa b cd", "xa ", true);
  check_stop({"\n\n"}, "line\nnext\n\nrest", "line\nnext", true);
  check_stop({}, "anything", "anything", false);
}

TEST(StopMatcher, HoldsBackOnlyPossiblePrefixes) {
  StopMatcher m({"</end>"});
  EXPECT_EQ(m.push("abc</e"), "abc");   // "</e" might be the start of the stop string
  EXPECT_EQ(m.push("x"), "</ex");       // it was not
  EXPECT_EQ(m.push("<"), "");
  EXPECT_EQ(m.push("/end> tail"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched(), "</end>");
}

TEST(StopMatcher, KeepsUtf8Whole) {
  // "é" is two bytes; the stop string starts with a different two-byte letter sharing no prefix.
  StopMatcher m({"\xc3\xa8nd"});
  EXPECT_EQ(m.push("caf\xc3\xa9 \xc3\xa8"), "caf\xc3\xa9 ");
  EXPECT_EQ(m.flush(), "\xc3\xa8");
}

}  // namespace
}  // namespace lily
