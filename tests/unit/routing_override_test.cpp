// cpu_tools::set_routing_override (the reference following another backend's expert choices, used by
// `lily cuda-check --follow-routing`): forcing the backend's own top-k changes nothing, forcing other
// experts changes the output and is counted with the router's margin, an empty entry keeps the own
// routing, a wrong size is an error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "core/common.h"
#include "tiny_model.h"

namespace lily {
namespace {

class RoutingOverride : public ::testing::Test {
 protected:
  TinyModel tiny;
  std::unique_ptr<Backend> be = make_backend(BackendOptions{});
  const ModelConfig& c = tiny.w->config;
  const MoeWeights& w = tiny.w->layers[0].mlp;
  static constexpr int T = 5;
  std::vector<float> x;

  void SetUp() override {
    std::mt19937 rng(7);
    std::normal_distribution<float> d(0.f, 1.f);
    x.resize(size_t(T) * c.hidden_size);
    for (auto& v : x) v = d(rng);
  }
  std::vector<float> run() {
    std::vector<float> out(size_t(T) * c.hidden_size);
    be->moe(c, w, x.data(), T, out.data());
    return out;
  }
  // The router's top-k per token, computed here from the f32 router weights (ties: lower index).
  std::vector<int32_t> own_topk(bool lowest = false) {
    const int E = c.num_experts, k = c.num_experts_per_tok, H = c.hidden_size;
    const float* g = static_cast<const float*>(w.gate.data);
    std::vector<int32_t> ids;
    for (int t = 0; t < T; ++t) {
      std::vector<double> l(E);
      for (int e = 0; e < E; ++e) {
        double s = 0;
        for (int h = 0; h < H; ++h) s += double(g[int64_t(e) * H + h]) * x[size_t(t) * H + h];
        l[e] = s;
      }
      std::vector<int> o(E);
      std::iota(o.begin(), o.end(), 0);
      std::stable_sort(o.begin(), o.end(), [&](int a, int b) { return lowest ? l[a] < l[b] : l[a] > l[b]; });
      ids.insert(ids.end(), o.begin(), o.begin() + k);
    }
    return ids;
  }
};

TEST_F(RoutingOverride, OwnRoutingChangesNothing) {
  const std::vector<float> ref = run();
  cpu_tools::set_routing_override(*be, {own_topk()});
  const std::vector<float> got = run();
  EXPECT_EQ(cpu_tools::routing_override_left(*be), 0u);
  const cpu_tools::RoutingStats st = cpu_tools::routing_stats(*be);
  EXPECT_EQ(st.tokens, T);
  EXPECT_EQ(st.differing, 0);
  for (size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(got[i], ref[i], 1e-6f * (1 + std::fabs(ref[i]))) << i;
}

TEST_F(RoutingOverride, OtherExpertsAreUsedAndCounted) {
  const std::vector<float> ref = run();
  cpu_tools::set_routing_override(*be, {own_topk(true), {}});   // the least likely experts, then own
  const std::vector<float> forced = run();
  const cpu_tools::RoutingStats st = cpu_tools::routing_stats(*be);
  EXPECT_EQ(st.tokens, T);
  EXPECT_EQ(st.differing, T);
  EXPECT_GE(st.max_gap, 0.0);
  double diff = 0, mag = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, double(std::fabs(forced[i] - ref[i])));
    mag = std::max(mag, double(std::fabs(ref[i])));
  }
  EXPECT_GT(diff, 1e-3 * mag);   // other experts, other output
  EXPECT_EQ(cpu_tools::routing_override_left(*be), 1u);
  const std::vector<float> again = run();   // the empty entry: own routing
  EXPECT_EQ(cpu_tools::routing_override_left(*be), 0u);
  for (size_t i = 0; i < ref.size(); ++i) ASSERT_EQ(again[i], ref[i]) << i;
}

TEST_F(RoutingOverride, WrongSizeOrIdIsAnError) {
  cpu_tools::set_routing_override(*be, {std::vector<int32_t>(3, 0)});
  EXPECT_THROW(run(), Error);
  std::vector<int32_t> bad = own_topk();
  bad[0] = c.num_experts;   // out of range
  cpu_tools::set_routing_override(*be, {bad});
  EXPECT_THROW(run(), Error);
}

}  // namespace
}  // namespace lily
