// Prefix snapshots for the hybrid model: recurrent state cannot be rewound, so the engine keeps
// exact-position copies of the whole sequence state (at turn boundaries, end of prompt, every N
// tokens) and resumes a request from the longest one whose tokens prefix its own. LRU by bytes.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "engine/language_model.h"

namespace lily {

struct Snapshot {
  std::vector<int32_t> tokens;          // the exact sequence the state has consumed
  // Full: capacity == tokens.size(). Shared: recurrent part only; its KV rows are those of the
  // engine's working state, usable while that state's KV history starts with `tokens`.
  std::unique_ptr<LmState> state;
  bool shared_kv = false;
  bool pinned = false;                  // never evicted (while being restored or promoted)
  std::vector<float> logits;            // logits after the last token [vocab]
  int64_t bytes = 0;                    // state + logits + tokens
  uint64_t last_used = 0;
};

struct SessionCacheStats {
  int64_t snapshots = 0, bytes = 0, budget = 0;
  int64_t inserted = 0, evicted = 0, hits = 0, misses = 0;
};

class SessionCache {
 public:
  explicit SessionCache(int64_t budget_bytes) : budget_(budget_bytes) {}

  // Longest snapshot whose tokens are a prefix of `tokens` (nullptr if none); shared ones count
  // only if their tokens also prefix `live_kv` (the working state's KV history). Marks it used.
  const Snapshot* find(std::span<const int32_t> tokens, std::span<const int32_t> live_kv);
  bool contains(std::span<const int32_t> tokens) const;
  // Copies `state` (exactly at tokens.size()) into a new snapshot (shared: recurrent part only,
  // when the model supports it), evicting least recently used ones to stay within budget. Returns
  // false (and stores nothing) if it cannot fit. The snapshot is complete before it is visible.
  bool insert(LanguageModel& lm, std::span<const int32_t> tokens, const LmState& state,
              std::span<const float> logits, bool shared);
  // Call before the working state's KV rows from position q on are rewritten with `incoming`.
  // Shared snapshots that would lose their KV rows are dropped, except the longest, which is made
  // self-contained (its rows copied from `live`) if the budget allows.
  // `protect` (may be null) is never evicted by this call.
  void before_kv_overwrite(LanguageModel& lm, const LmState& live, std::span<const int32_t> live_kv,
                           int q, std::span<const int32_t> incoming, const Snapshot* protect = nullptr);
  void drop_shared();   // the working state's KV rows are unknown (failed forward)
  void clear();

  int64_t budget() const { return budget_; }
  SessionCacheStats stats() const;

 private:
  void evict_until(int64_t need);
  void erase(Snapshot* s);

  int64_t budget_;
  int64_t bytes_ = 0;
  uint64_t clock_ = 0;
  std::vector<std::unique_ptr<Snapshot>> snaps_;
  SessionCacheStats counters_;
};

}  // namespace lily
