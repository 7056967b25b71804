// Byte-level BPE merging (see bpe_model.h). Merge order follows Hugging Face `tokenizers`: always
// apply the lowest-rank adjacent pair, leftmost first among equal ranks.
#include "tokenizer/bpe_model.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <queue>

#include "core/common.h"

namespace lily {

// ---- byte-level table --------------------------------------------------------------------------

ByteLevelTable::ByteLevelTable() {
  to_byte.fill(-1);
  // Printable bytes keep their code point; the other 68 get 256, 257, ... in byte order (GPT-2).
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    to_char[size_t(b)] = printable ? char32_t(b) : char32_t(next++);
    to_byte[to_char[size_t(b)]] = int16_t(b);
  }
}

std::string ByteLevelTable::encode(std::string_view bytes) const {
  std::string out;
  for (char ch : bytes) {
    const char32_t c = to_char[uint8_t(ch)];
    if (c < 0x80) {
      out += char(c);
    } else {
      out += char(0xC0 | (c >> 6));
      out += char(0x80 | (c & 0x3F));
    }
  }
  return out;
}

bool ByteLevelTable::decode(std::string_view text, std::string& out) const {
  std::string r;
  r.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const auto c = uint8_t(text[i]);
    char32_t cp;
    if (c < 0x80) {
      cp = c;
      i += 1;
    } else if ((c & 0xE0) == 0xC0 && i + 1 < text.size()) {
      cp = char32_t(c & 0x1F) << 6 | (uint8_t(text[i + 1]) & 0x3F);
      i += 2;
    } else {
      return false;   // table chars are all below U+0800
    }
    if (cp >= to_byte.size() || to_byte[cp] < 0) return false;
    r += char(to_byte[cp]);
  }
  out = std::move(r);
  return true;
}

const ByteLevelTable& byte_level() {
  static const ByteLevelTable t;
  return t;
}

// ---- model -------------------------------------------------------------------------------------

namespace {
inline uint64_t mix(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  return k;
}
}  // namespace

BpeModel::BpeModel(std::vector<std::string> vocab_bytes, const std::vector<Merge>& merges,
                   bool ignore_merges)
    : vocab_(std::move(vocab_bytes)), ignore_merges_(ignore_merges) {
  static std::atomic<uint64_t> next_instance{1};
  instance_id_ = next_instance++;
  byte_id_.fill(-1);
  for (size_t id = 0; id < vocab_.size(); ++id)
    if (vocab_[id].size() == 1 && byte_id_[uint8_t(vocab_[id][0])] < 0)
      byte_id_[uint8_t(vocab_[id][0])] = int32_t(id);
  size_t cap = 16;
  while (cap < merges.size() * 2) cap <<= 1;
  table_.assign(cap, Slot{kEmpty, 0, 0});
  mask_ = cap - 1;
  for (size_t r = 0; r < merges.size(); ++r) {
    const uint64_t key = uint64_t(uint32_t(merges[r].left)) << 32 | uint32_t(merges[r].right);
    for (uint64_t h = mix(key) & mask_;; h = (h + 1) & mask_) {
      if (table_[h].key == kEmpty) {
        table_[h] = Slot{key, int32_t(r), merges[r].merged};
        break;
      }
      if (table_[h].key == key) break;   // duplicate merge: the first (lowest rank) wins, as in HF
    }
  }
  if (ignore_merges_)
    for (size_t id = 0; id < vocab_.size(); ++id)
      if (!vocab_[id].empty()) by_bytes_.emplace(vocab_[id], int32_t(id));
}

inline void BpeModel::lookup(int32_t a, int32_t b, int32_t& rank, int32_t& merged) const {
  const uint64_t key = uint64_t(uint32_t(a)) << 32 | uint32_t(b);
  for (uint64_t h = mix(key) & mask_;; h = (h + 1) & mask_) {
    const Slot& s = table_[h];
    if (s.key == key) {
      rank = s.rank;
      merged = s.merged;
      return;
    }
    if (s.key == kEmpty) {
      rank = INT32_MAX;
      merged = -1;
      return;
    }
  }
}

void BpeModel::merge_small(std::vector<int32_t>& syms) const {
  size_t n = syms.size();
  if (n < 2) return;
  // Only called for n <= kSmallWord: fixed arrays on the stack, no allocation.
  int32_t rank[kSmallWord], merged[kSmallWord];
  for (size_t i = 0; i + 1 < n; ++i) lookup(syms[i], syms[i + 1], rank[i], merged[i]);
  while (n > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < n; ++i)
      if (rank[i] < rank[best]) best = i;
    if (rank[best] == INT32_MAX) break;
    syms[best] = merged[best];
    // Remove symbol best+1 and pair best+1 by shifting the tails left.
    for (size_t i = best + 1; i + 1 < n; ++i) syms[i] = syms[i + 1];
    for (size_t i = best + 1; i + 2 < n; ++i) {
      rank[i] = rank[i + 1];
      merged[i] = merged[i + 1];
    }
    --n;
    if (best > 0) lookup(syms[best - 1], syms[best], rank[best - 1], merged[best - 1]);
    if (best + 1 < n) lookup(syms[best], syms[best + 1], rank[best], merged[best]);
  }
  syms.resize(n);
}

void BpeModel::merge_heap(std::vector<int32_t>& syms) const {
  const int n = int(syms.size());
  std::vector<int> prev(static_cast<size_t>(n)), next(static_cast<size_t>(n));
  std::vector<char> alive(size_t(n), 1);
  for (int i = 0; i < n; ++i) {
    prev[size_t(i)] = i - 1;
    next[size_t(i)] = i + 1 < n ? i + 1 : -1;
  }
  struct Cand {
    int32_t rank, pos, merged;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<>> heap;
  auto push = [&](int pos) {
    const int nx = next[size_t(pos)];
    if (pos < 0 || nx < 0) return;
    int32_t r, m;
    lookup(syms[size_t(pos)], syms[size_t(nx)], r, m);
    if (r != INT32_MAX) heap.push(Cand{r, pos, m});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    const auto p = size_t(c.pos);
    if (!alive[p] || next[p] < 0) continue;
    // Stale entry: the pair at this position changed since it was queued.
    int32_t r, m;
    lookup(syms[p], syms[size_t(next[p])], r, m);
    if (r != c.rank || m != c.merged) continue;
    const int right = next[p];
    syms[p] = c.merged;
    alive[size_t(right)] = 0;
    next[p] = next[size_t(right)];
    if (next[p] >= 0) prev[size_t(next[p])] = c.pos;
    push(prev[p]);
    push(c.pos);
  }
  size_t w = 0;
  for (int i = 0; i >= 0 && i < n; i = next[size_t(i)]) syms[w++] = syms[size_t(i)];
  syms.resize(w);
}

void BpeModel::encode_word_reference(std::string_view word, std::vector<int32_t>& out) const {
  std::vector<int32_t> syms;
  for (char ch : word)
    if (byte_id_[uint8_t(ch)] >= 0) syms.push_back(byte_id_[uint8_t(ch)]);   // no unk: HF drops it
  if (syms.size() > 1) merge_heap(syms);
  out.insert(out.end(), syms.begin(), syms.end());
}

namespace {

// Direct-mapped, per-thread word cache: text is Zipfian, so most pre-tokens were seen recently and
// one cache-line probe replaces several random probes into the merge table. Per thread so that
// concurrent encoders never lock; words or results too long for a slot are simply not cached.
struct CacheSlot {
  uint64_t tag;   // hash | 1; 0 = empty
  uint8_t key_len, n_ids;
  char key[26];
  int32_t ids[7];
};
static_assert(sizeof(CacheSlot) == 64);
constexpr size_t kCacheSlots = size_t(1) << 15;

struct WordCache {
  uint64_t owner = 0;
  std::unique_ptr<CacheSlot[]> slots;
  CacheSlot* for_model(uint64_t id) {
    if (!slots) slots.reset(new CacheSlot[kCacheSlots]);
    if (owner != id) {
      for (size_t i = 0; i < kCacheSlots; ++i) slots[i].tag = 0;
      owner = id;
    }
    return slots.get();
  }
};

inline uint64_t hash_word(std::string_view w) {
  uint64_t h = 0x9E3779B97F4A7C15ULL ^ w.size();
  size_t i = 0;
  for (; i + 8 <= w.size(); i += 8) {
    uint64_t v;
    std::memcpy(&v, w.data() + i, 8);
    h = mix(h ^ v) * 0x9E3779B97F4A7C15ULL;
  }
  uint64_t v = 0;
  std::memcpy(&v, w.data() + i, w.size() - i);
  return mix(h ^ v ^ (uint64_t(w.size()) << 56)) | 1;
}

}  // namespace

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() == 1) {
    if (byte_id_[uint8_t(word[0])] >= 0) out.push_back(byte_id_[uint8_t(word[0])]);
    return;
  }
  if (ignore_merges_) {
    if (auto it = by_bytes_.find(std::string(word)); it != by_bytes_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  CacheSlot* slot = nullptr;
  uint64_t tag = 0;
  if (word.size() <= sizeof(CacheSlot::key)) {
    thread_local WordCache cache;
    tag = hash_word(word);
    slot = &cache.for_model(instance_id_)[tag & (kCacheSlots - 1)];
    if (slot->tag == tag && slot->key_len == word.size() && !std::memcmp(slot->key, word.data(), word.size())) {
      out.insert(out.end(), slot->ids, slot->ids + slot->n_ids);
      return;
    }
  }
  thread_local std::vector<int32_t> syms;
  syms.clear();
  for (char ch : word)
    if (byte_id_[uint8_t(ch)] >= 0) syms.push_back(byte_id_[uint8_t(ch)]);
  if (syms.size() <= kSmallWord) merge_small(syms);
  else merge_heap(syms);
  out.insert(out.end(), syms.begin(), syms.end());
  if (slot && syms.size() <= std::size(slot->ids)) {
    slot->tag = tag;
    slot->key_len = uint8_t(word.size());
    slot->n_ids = uint8_t(syms.size());
    std::memcpy(slot->key, word.data(), word.size());
    std::copy(syms.begin(), syms.end(), slot->ids);
  }
}

}  // namespace lily
