// Token sampler (see sampler.h). Order of the stages follows Hugging Face's logits processors:
// penalties, then temperature, top-k, top-p, min-p, then one draw from the renormalised rest.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/common.h"

namespace lily {

void SamplingParams::validate() const {
  auto bad = [](const char* field, const std::string& why) {
    throw Error(std::string("'") + field + "' " + why);
  };
  if (!std::isfinite(temperature) || temperature < 0.0f || temperature > 100.0f)
    bad("temperature", "must be between 0 and 100");
  if (!std::isfinite(top_p) || top_p <= 0.0f || top_p > 1.0f) bad("top_p", "must be in (0, 1]");
  if (top_k < 0) bad("top_k", "must be >= 0 (0 disables it)");
  if (!std::isfinite(min_p) || min_p < 0.0f || min_p > 1.0f) bad("min_p", "must be in [0, 1]");
  if (!std::isfinite(presence_penalty) || std::fabs(presence_penalty) > 2.0f)
    bad("presence_penalty", "must be in [-2, 2]");
  if (!std::isfinite(frequency_penalty) || std::fabs(frequency_penalty) > 2.0f)
    bad("frequency_penalty", "must be in [-2, 2]");
  if (!std::isfinite(repetition_penalty) || repetition_penalty <= 0.0f || repetition_penalty > 10.0f)
    bad("repetition_penalty", "must be in (0, 10]");
}

TokenLogprob compute_logprobs(const float* logits, int n, int32_t id, int top_n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) mx = std::max(mx, logits[i]);
  double sum = 0.0;
  for (int i = 0; i < n; ++i) sum += std::exp(double(logits[i]) - mx);
  const float lse = mx + float(std::log(sum));
  TokenLogprob r;
  r.id = id;
  r.logprob = logits[id] - lse;
  if (top_n > 0) {
    top_n = std::min(top_n, n);
    std::vector<std::pair<float, int32_t>> c(n);
    for (int i = 0; i < n; ++i) c[i] = {logits[i], i};
    auto better = [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    std::partial_sort(c.begin(), c.begin() + top_n, c.end(), better);
    for (int i = 0; i < top_n; ++i) r.top.push_back({c[i].second, c[i].first - lse});
  }
  return r;
}

Sampler::Sampler(const SamplingParams& p, int n_valid, std::span<const int32_t> prompt)
    : p_(p), n_valid_(n_valid) {
  p_.validate();
  rng_.seed(p_.has_seed ? p_.seed : std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32));
  counts_.assign(n_valid_, 0);
  seen_.assign(n_valid_, 0);
  if (p_.repetition_penalty != 1.0f) {
    for (int32_t t : prompt) {
      if (t < 0 || t >= n_valid_ || seen_[t]) continue;
      seen_[t] = 1;
      touched_.push_back(t);
    }
  }
}

void Sampler::accept(int32_t id) {
  if (id < 0 || id >= n_valid_) return;
  if (!seen_[id] && counts_[id] == 0) touched_.push_back(id);
  seen_[id] = 1;
  ++counts_[id];
}

void Sampler::apply_penalties(float* logits, int n) const {
  for (int32_t t : touched_) {
    if (t >= n) continue;
    float& l = logits[t];
    if (p_.repetition_penalty != 1.0f && seen_[t])
      l = l > 0 ? l / p_.repetition_penalty : l * p_.repetition_penalty;
    if (counts_[t] > 0) l -= p_.presence_penalty + p_.frequency_penalty * float(counts_[t]);
  }
}

int32_t Sampler::sample(float* logits, int vocab, TokenLogprob* lp, int top_n) {
  const int n = std::min(vocab, n_valid_);
  LILY_CHECK(n > 0, "sampler: empty vocabulary");
  int32_t chosen = -1;
  // Logprobs describe the model, so they are taken before any logits processing.
  TokenLogprob raw;
  const bool want_lp = lp != nullptr;
  std::vector<float> raw_logits;
  if (want_lp) raw_logits.assign(logits, logits + n);

  apply_penalties(logits, n);
  if (p_.temperature == 0.0f || p_.top_k == 1) {
    chosen = 0;
    for (int i = 1; i < n; ++i)
      if (logits[i] > logits[chosen]) chosen = i;
  } else {
    cand_.clear();
    const float inv_t = 1.0f / p_.temperature;
    for (int i = 0; i < n; ++i)
      if (logits[i] > -std::numeric_limits<float>::infinity()) cand_.push_back({logits[i] * inv_t, i});
    if (cand_.empty()) cand_.push_back({0.0f, 0});
    auto better = [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    size_t keep = cand_.size();
    if (p_.top_k > 0 && size_t(p_.top_k) < keep) {
      keep = size_t(p_.top_k);
      std::partial_sort(cand_.begin(), cand_.begin() + keep, cand_.end(), better);
      cand_.resize(keep);
    } else {
      std::sort(cand_.begin(), cand_.end(), better);
    }
    // Softmax over the survivors (sorted, most likely first); probabilities overwrite the logits.
    const float mx = cand_[0].first;
    double sum = 0.0;
    for (auto& c : cand_) {
      c.first = float(std::exp(double(c.first) - mx));
      sum += c.first;
    }
    for (auto& c : cand_) c.first = float(c.first / sum);
    if (p_.top_p < 1.0f) {
      double cum = 0.0;
      size_t k = 0;
      while (k < cand_.size()) {
        cum += cand_[k].first;
        ++k;
        if (cum >= p_.top_p) break;
      }
      cand_.resize(std::max<size_t>(k, 1));
    }
    if (p_.min_p > 0.0f) {
      const float floor = p_.min_p * cand_[0].first;
      size_t k = 1;
      while (k < cand_.size() && cand_[k].first >= floor) ++k;
      cand_.resize(k);
    }
    double total = 0.0;
    for (const auto& c : cand_) total += c.first;
    // 53 random bits -> uniform double in [0, 1): identical across platforms for a given seed.
    const double u = double(rng_() >> 11) * (1.0 / 9007199254740992.0) * total;
    double acc = 0.0;
    chosen = cand_.back().second;
    for (const auto& c : cand_) {
      acc += c.first;
      if (u < acc) {
        chosen = c.second;
        break;
      }
    }
  }
  if (want_lp) *lp = compute_logprobs(raw_logits.data(), n, chosen, top_n);
  return chosen;
}

}  // namespace lily
