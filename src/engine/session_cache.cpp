// Prefix snapshot store (see session_cache.h).
#include "engine/session_cache.h"

#include <algorithm>

namespace lily {

static bool is_prefix(std::span<const int32_t> p, std::span<const int32_t> of) {
  return p.size() <= of.size() && std::equal(p.begin(), p.end(), of.begin());
}

const Snapshot* SessionCache::find(std::span<const int32_t> tokens) {
  Snapshot* best = nullptr;
  for (auto& s : snaps_)
    if ((!best || s->tokens.size() > best->tokens.size()) && is_prefix(s->tokens, tokens))
      best = s.get();
  if (best) {
    best->last_used = ++clock_;
    ++counters_.hits;
  } else {
    ++counters_.misses;
  }
  return best;
}

bool SessionCache::contains(std::span<const int32_t> tokens) const {
  for (const auto& s : snaps_)
    if (s->tokens.size() == tokens.size() && is_prefix(s->tokens, tokens)) return true;
  return false;
}

void SessionCache::evict_until(int64_t need) {
  while (!snaps_.empty() && bytes_ + need > budget_) {
    auto lru = std::min_element(snaps_.begin(), snaps_.end(), [](const auto& a, const auto& b) {
      return a->last_used < b->last_used;
    });
    bytes_ -= (*lru)->bytes;
    snaps_.erase(lru);
    ++counters_.evicted;
  }
}

bool SessionCache::insert(LanguageModel& lm, std::span<const int32_t> tokens, const LmState& state,
                          std::span<const float> logits) {
  if (tokens.empty() || state.pos() != int(tokens.size())) return false;
  for (auto& s : snaps_) {
    if (s->tokens.size() == tokens.size() && is_prefix(s->tokens, tokens)) {
      s->last_used = ++clock_;
      return true;
    }
  }
  const int n = int(tokens.size());
  const int64_t bytes =
      lm.state_bytes(n) + int64_t(logits.size()) * 4 + int64_t(tokens.size()) * 4;
  if (bytes > budget_) return false;
  evict_until(bytes);
  auto snap = std::make_unique<Snapshot>();
  snap->tokens.assign(tokens.begin(), tokens.end());
  snap->state = lm.new_state(n);
  lm.copy_state(state, *snap->state);
  snap->logits.assign(logits.begin(), logits.end());
  snap->bytes = bytes;
  snap->last_used = ++clock_;
  snaps_.push_back(std::move(snap));
  bytes_ += bytes;
  ++counters_.inserted;
  return true;
}

void SessionCache::clear() {
  snaps_.clear();
  bytes_ = 0;
}

SessionCacheStats SessionCache::stats() const {
  SessionCacheStats s = counters_;
  s.snapshots = int64_t(snaps_.size());
  s.bytes = bytes_;
  s.budget = budget_;
  return s;
}

}  // namespace lily
