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
  std::unique_ptr<LmState> state;       // capacity == tokens.size()
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

  // Longest snapshot whose tokens are a prefix of `tokens` (nullptr if none). Marks it used.
  const Snapshot* find(std::span<const int32_t> tokens);
  bool contains(std::span<const int32_t> tokens) const;
  // Copies `state` (exactly at tokens.size()) into a new snapshot, evicting least recently used
  // ones to stay within budget. Returns false (and stores nothing) if it cannot fit at all. The
  // snapshot is built completely before it becomes visible.
  bool insert(LanguageModel& lm, std::span<const int32_t> tokens, const LmState& state,
              std::span<const float> logits);
  void clear();

  int64_t budget() const { return budget_; }
  SessionCacheStats stats() const;

 private:
  void evict_until(int64_t need);

  int64_t budget_;
  int64_t bytes_ = 0;
  uint64_t clock_ = 0;
  std::vector<std::unique_ptr<Snapshot>> snaps_;
  SessionCacheStats counters_;
};

}  // namespace lily
