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
  for (const auto& [id, b] : logit_bias)
    if (id < 0 || !std::isfinite(b) || std::fabs(b) > 100.0f)
      bad("logit_bias", "maps token ids (>= 0) to values in [-100, 100]");
}

namespace {

using Cand = std::pair<float, int32_t>;   // (score, id)

// Most likely first; equal scores by lower id, so results never depend on scan order.
bool better(const Cand& a, const Cand& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// The k best (score, id) of x[0, n) in order, by one scan with a bounded heap: for a 248K
// vocabulary almost every element fails the first comparison, so this costs about n compares.
void top_k_scan(const float* x, int n, int k, std::vector<Cand>& out) {
  out.clear();
  if (k <= 0) return;
  for (int i = 0; i < n; ++i) {
    if (!(x[i] > -std::numeric_limits<float>::infinity())) continue;   // -inf and NaN
    const Cand c{x[i], i};
    if (int(out.size()) < k) {
      out.push_back(c);
      std::push_heap(out.begin(), out.end(), better);   // heap top = worst kept
    } else if (better(c, out.front())) {
      std::pop_heap(out.begin(), out.end(), better);
      out.back() = c;
      std::push_heap(out.begin(), out.end(), better);
    }
  }
  std::sort_heap(out.begin(), out.end(), better);
}

}  // namespace

TokenLogprob compute_logprobs(const float* logits, int n, int32_t id, int top_n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) mx = std::max(mx, logits[i]);
  double sum = 0.0;
  for (int i = 0; i < n; ++i) sum += std::exp(logits[i] - mx);
  const float lse = mx + float(std::log(sum));
  TokenLogprob r;
  r.id = id;
  r.logprob = logits[id] - lse;
  if (top_n > 0) {
    std::vector<Cand> c;
    top_k_scan(logits, n, std::min(top_n, n), c);
    for (const auto& [v, i] : c) r.top.push_back({i, v - lse});
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
  for (const auto& [id, b] : p_.logit_bias)
    if (id < n) logits[id] += b;
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
    const float inv_t = 1.0f / p_.temperature;
    double z = 0.0;   // normaliser of the survivors of top-k
    if (p_.top_k > 0 && p_.top_k < n) {
      top_k_scan(logits, n, p_.top_k, cand_);
      if (cand_.empty()) cand_.push_back({0.0f, 0});
      const float mx = cand_[0].first;
      for (auto& c : cand_) z += c.first = std::exp((c.first - mx) * inv_t);
    } else {
      // No top-k: probabilities of the whole vocabulary, kept in the (scratch) logits buffer.
      float mx = -std::numeric_limits<float>::infinity();
      for (int i = 0; i < n; ++i) mx = std::max(mx, logits[i]);
      for (int i = 0; i < n; ++i) {
        logits[i] = logits[i] > -std::numeric_limits<float>::infinity() ? std::exp((logits[i] - mx) * inv_t) : 0.0f;
        z += logits[i];
      }
      // Only tokens above a threshold can be in the nucleus / pass min-p: lower the threshold
      // until the tokens above it carry at least top_p of the mass, then sort just those.
      const bool truncating = p_.top_p < 1.0f || p_.min_p > 0.0f;
      float thr = 0.0f;
      if (truncating) {
        thr = p_.min_p > 0.0f ? p_.min_p : 1e-2f;   // relative to the most likely token (exp(0) = 1)
        while (thr > 0.0f) {
          double mass = 0.0;
          for (int i = 0; i < n; ++i) mass += logits[i] >= thr ? logits[i] : 0.0f;
          if (mass >= double(p_.top_p) * z || p_.min_p > 0.0f) break;
          thr = thr > 1e-12f ? thr * 1e-3f : 0.0f;
        }
      }
      if (!truncating) {   // plain sampling: one draw straight from the weights
        const double u = double(rng_() >> 11) * (1.0 / 9007199254740992.0) * z;
        double acc = 0.0;
        chosen = -1;
        for (int i = 0; i < n && chosen < 0; ++i)
          if ((acc += logits[i]) > u && logits[i] > 0.0f) chosen = i;
        if (chosen < 0) chosen = int32_t(std::max_element(logits, logits + n) - logits);
        if (want_lp) *lp = compute_logprobs(raw_logits.data(), n, chosen, top_n);
        return chosen;
      }
      cand_.clear();
      for (int i = 0; i < n; ++i)
        if (logits[i] > 0.0f && logits[i] >= thr) cand_.push_back({logits[i], i});
      if (cand_.empty()) cand_.push_back({1.0f, 0});
      std::sort(cand_.begin(), cand_.end(), better);
    }
    if (p_.top_p < 1.0f) {   // smallest most-likely-first prefix holding top_p of the mass
      double cum = 0.0;
      size_t k = 0;
      while (k < cand_.size()) {
        cum += cand_[k].first;
        ++k;
        if (cum >= double(p_.top_p) * z) break;
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
