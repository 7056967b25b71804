// The sample op on the cpu backend: the reference of the rule in docs/CUDA.md "Sampling on the
// device". Straightforward (sort the candidates), but with exactly the arithmetic of
// backend/sample_math.h, so the cuda kernels pick the same ids. Compiled with -ffp-contract=off.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/sample_math.h"

namespace lily {

using namespace smath;

void cpu_sample(const float* logits, int n, SampleConfig* cfg, int32_t* counts, int32_t* id) {
  const SampleConfig& c = *cfg;
  const int nv = c.n_valid > 0 && c.n_valid < n ? c.n_valid : n;
  thread_local std::vector<float> lb;
  thread_local std::vector<uint32_t> key;
  lb.assign(logits, logits + nv);
  for (int j = 0; j < std::min(c.n_bias, kMaxLogitBias); ++j)   // in list order, like the host Sampler
    if (c.bias_id[j] >= 0 && c.bias_id[j] < nv) lb[c.bias_id[j]] = f_add(lb[c.bias_id[j]], c.bias[j]);
  key.assign(n, 0u);
  uint64_t best = 0;
  for (int i = 0; i < nv; ++i) {
    key[i] = logit_key(penalise(lb[i], counts[i], c.repetition_penalty, c.presence_penalty,
                                c.frequency_penalty));
    if (key[i]) best = std::max(best, full_key(key[i], uint32_t(i)));
  }
  auto finish = [&](int32_t pick) {
    *id = pick;
    counts[pick] = (counts[pick] | 1) + 2;
    cfg->step += 1;
  };
  const uint32_t mk = uint32_t(best >> 32);
  const int32_t argmax = best ? int32_t(full_key_id(best)) : 0;
  const float inv_t = c.temperature > 0.0f ? f_div(1.0f, c.temperature) : 0.0f;
  if (mk == 0 || c.temperature == 0.0f || c.top_k == 1 || !(inv_t <= 3.40282347e38f)) return finish(argmax);

  const uint32_t kp = min_key_with_x(mk, inv_t, kXMin);   // candidates: key >= kp (weight > 0)
  int np = 0;
  for (int i = 0; i < nv; ++i) np += key[i] >= kp;
  const int k_eff = c.top_k > 0 && c.top_k < np ? c.top_k : 0;
  const uint64_t r = draw_bits(c.seed, c.step);
  const float lmin = c.log_min_p;
  if (k_eff == 0 && !(c.top_p < 1.0f)) {
    // No ordering needed: one draw over the kept weights in index order.
    uint64_t total = 0;
    for (int i = 0; i < nv; ++i)
      if (key[i] >= kp) {
        const float x = rel_x(key[i], mk, inv_t);
        if (x >= lmin) total += weight(x);
      }
    const uint64_t u = mulhi64(r, total);
    uint64_t acc = 0;
    for (int i = 0; i < nv; ++i)
      if (key[i] >= kp) {
        const float x = rel_x(key[i], mk, inv_t);
        if (x >= lmin && (acc += weight(x)) > u) return finish(i);
      }
    return finish(argmax);   // unreachable: the best token is always kept
  }
  // Candidates in descending (key, then lower id) order; cumulative weights.
  thread_local std::vector<uint64_t> cand;
  cand.clear();
  uint64_t z = 0;
  for (int i = 0; i < nv; ++i)
    if (key[i] >= kp) {
      cand.push_back(full_key(key[i], uint32_t(i)));
      if (k_eff == 0) z += weight(rel_x(key[i], mk, inv_t));
    }
  auto desc = [](uint64_t a, uint64_t b) { return a > b; };
  if (k_eff > 0) {
    std::nth_element(cand.begin(), cand.begin() + (k_eff - 1), cand.end(), desc);
    cand.resize(k_eff);
  }
  std::sort(cand.begin(), cand.end(), desc);
  std::vector<uint64_t> cum(cand.size());
  uint64_t acc = 0;
  for (size_t j = 0; j < cand.size(); ++j) cum[j] = acc += weight(rel_x(uint32_t(cand[j] >> 32), mk, inv_t));
  if (k_eff > 0) z = cum.back();
  size_t keep = cand.size();
  if (c.top_p < 1.0f) {
    const uint64_t target = top_p_target(c.top_p, z);
    size_t j = 0;
    while (j + 1 < cand.size() && cum[j] < target) ++j;
    keep = std::min(keep, j + 1);
  }
  size_t m = 1;
  while (m < keep && rel_x(uint32_t(cand[m] >> 32), mk, inv_t) >= lmin) ++m;
  keep = m;
  const uint64_t u = mulhi64(r, cum[keep - 1]);
  size_t j = 0;
  while (j + 1 < keep && cum[j] <= u) ++j;
  finish(int32_t(full_key_id(cand[j])));
}

}  // namespace lily
