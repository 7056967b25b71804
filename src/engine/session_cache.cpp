// Prefix snapshot store (see session_cache.h).
#include "engine/session_cache.h"

#include <algorithm>

namespace lily {

static bool is_prefix(std::span<const int32_t> p, std::span<const int32_t> of) {
  return p.size() <= of.size() && std::equal(p.begin(), p.end(), of.begin());
}

const Snapshot* SessionCache::find(std::span<const int32_t> tokens, std::span<const int32_t> live_kv) {
  Snapshot* best = nullptr;
  for (auto& s : snaps_)
    if ((!best || s->tokens.size() > best->tokens.size()) && is_prefix(s->tokens, tokens) &&
        (!s->shared_kv || is_prefix(s->tokens, live_kv)))
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
  while (bytes_ + need > budget_) {
    Snapshot* lru = nullptr;
    for (auto& s : snaps_)
      if (!s->pinned && (!lru || s->last_used < lru->last_used)) lru = s.get();
    if (!lru) return;
    erase(lru);
    ++counters_.evicted;
  }
}

bool SessionCache::insert(LanguageModel& lm, std::span<const int32_t> tokens, const LmState& state,
                          std::span<const float> logits, bool shared) {
  if (tokens.empty() || state.pos() != int(tokens.size())) return false;
  for (auto& s : snaps_) {
    if (s->tokens.size() == tokens.size() && is_prefix(s->tokens, tokens)) {
      s->last_used = ++clock_;
      return true;
    }
  }
  const int n = int(tokens.size());
  shared = shared && lm.recurrent_bytes() > 0;
  const int64_t bytes = (shared ? lm.recurrent_bytes() : lm.state_bytes(n)) +
                        int64_t(logits.size()) * 4 + int64_t(tokens.size()) * 4;
  if (bytes > budget_) return false;
  evict_until(bytes);
  auto snap = std::make_unique<Snapshot>();
  snap->tokens.assign(tokens.begin(), tokens.end());
  if (shared) {
    snap->state = lm.copy_recurrent(state);
    snap->shared_kv = snap->state != nullptr;
  }
  if (!snap->state) {
    snap->state = lm.new_state(n);
    lm.copy_state(state, *snap->state);
  }
  snap->logits.assign(logits.begin(), logits.end());
  snap->bytes = bytes;
  snap->last_used = ++clock_;
  snaps_.push_back(std::move(snap));
  bytes_ += bytes;
  ++counters_.inserted;
  return true;
}

void SessionCache::erase(Snapshot* s) {
  for (auto it = snaps_.begin(); it != snaps_.end(); ++it)
    if (it->get() == s) {
      bytes_ -= s->bytes;
      snaps_.erase(it);
      return;
    }
}

void SessionCache::before_kv_overwrite(LanguageModel& lm, const LmState& live,
                                       std::span<const int32_t> live_kv, int q,
                                       std::span<const int32_t> incoming, const Snapshot* protect) {
  // Shared snapshots longer than q survive only if the incoming tokens equal their own.
  std::vector<Snapshot*> doomed;
  for (auto& s : snaps_) {
    if (!s->shared_kv || int(s->tokens.size()) <= q || !is_prefix(s->tokens, live_kv)) continue;
    const size_t n = std::min(incoming.size(), s->tokens.size() - size_t(q));
    if (!std::equal(incoming.begin(), incoming.begin() + n, s->tokens.begin() + q)) doomed.push_back(s.get());
  }
  if (doomed.empty()) return;
  Snapshot* keep = *std::max_element(doomed.begin(), doomed.end(), [](auto* a, auto* b) {
    return a->tokens.size() < b->tokens.size();
  });
  for (Snapshot* s : doomed)
    if (s != keep) {
      erase(s);
      ++counters_.evicted;
    }
  // Promote the longest: copy its KV rows out of the working state while they are still there.
  const int n = int(keep->tokens.size());
  const int64_t full = lm.state_bytes(n) + int64_t(keep->logits.size()) * 4 + int64_t(n) * 4;
  std::unique_ptr<LmState> st;
  if (full <= budget_) {
    keep->pinned = true;
    Snapshot* prot = nullptr;
    for (auto& s : snaps_)
      if (s.get() == protect) prot = s.get();
    if (prot) prot->pinned = true;
    evict_until(full - keep->bytes);
    keep->pinned = false;
    if (prot) prot->pinned = false;
    try {
      if (bytes_ + full - keep->bytes <= budget_) st = lm.materialize(*keep->state, live);
    } catch (const std::exception&) {
      st.reset();   // out of memory for the copy: the snapshot is simply lost
    }
  }
  if (!st) {
    erase(keep);
    ++counters_.evicted;
    return;
  }
  keep->state = std::move(st);
  keep->shared_kv = false;
  bytes_ += full - keep->bytes;
  keep->bytes = full;
}

void SessionCache::drop_shared() {
  for (size_t i = 0; i < snaps_.size();) {
    if (snaps_[i]->shared_kv) {
      bytes_ -= snaps_[i]->bytes;
      snaps_.erase(snaps_.begin() + long(i));
    } else {
      ++i;
    }
  }
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
