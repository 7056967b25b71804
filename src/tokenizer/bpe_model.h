// Byte-level BPE core: vocabulary as raw bytes, merge table by rank, per-word merging with a cache.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace lily {

// GPT-2 byte <-> printable-character table used by Hugging Face ByteLevel components.
struct ByteLevelTable {
  std::array<char32_t, 256> to_char{};   // byte -> code point
  std::array<int16_t, 324> to_byte{};    // code point (< 324) -> byte, -1 if not a mapped char
  ByteLevelTable();
  // The byte-level spelling of raw bytes (UTF-8 of the mapped code points).
  std::string encode(std::string_view bytes) const;
  // Raw bytes of a byte-level spelling; false (out untouched) if some char is not in the table.
  bool decode(std::string_view text, std::string& out) const;
};
const ByteLevelTable& byte_level();

class BpeModel {
 public:
  // vocab[i] = raw bytes of id i ("" for ids the model does not define). merges: (left id, right
  // id, merged id) in rank order. ignore_merges: a whole word found in the vocabulary is one token.
  struct Merge {
    int32_t left, right, merged;
  };
  BpeModel(std::vector<std::string> vocab_bytes, const std::vector<Merge>& merges, bool ignore_merges);

  // Appends the ids of one pre-token (raw bytes) to `out`.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  // The plain algorithm without cache or fast paths; kept as the reference for tests.
  void encode_word_reference(std::string_view word, std::vector<int32_t>& out) const;

  const std::string& bytes_of(int32_t id) const { return vocab_[size_t(id)]; }
  size_t size() const { return vocab_.size(); }

 private:
  struct Slot {
    uint64_t key;   // (left << 32) | right, kEmpty when unused
    int32_t rank;
    int32_t merged;
  };
  static constexpr uint64_t kEmpty = ~uint64_t(0);

  // Rank and result of merging (a, b); rank = INT32_MAX when the pair does not merge.
  inline void lookup(int32_t a, int32_t b, int32_t& rank, int32_t& merged) const;
  static constexpr size_t kSmallWord = 48;
  void merge_small(std::vector<int32_t>& syms) const;   // O(n^2), fastest for short words
  void merge_heap(std::vector<int32_t>& syms) const;    // O(n log n) for long words

  std::vector<std::string> vocab_;
  std::array<int32_t, 256> byte_id_{};   // id of each single byte, -1 if absent
  std::vector<Slot> table_;
  uint64_t mask_ = 0;
  bool ignore_merges_ = false;
  std::unordered_map<std::string, int32_t> by_bytes_;   // only for ignore_merges

  // Each thread keeps a direct-mapped cache of recent words (see encode_word); the id tells a
  // thread's cache which model it was filled for.
  uint64_t instance_id_ = 0;
};

}  // namespace lily
