// Text stages before BPE: UTF-8 repair, NFC normalisation (ICU) and the regex pre-tokenizer (PCRE2).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lily {

// Replaces every ill-formed UTF-8 subsequence with U+FFFD using the Unicode "maximal subpart"
// rule (the same one as Rust's String::from_utf8_lossy and Python's errors="replace"), so decode()
// agrees with Hugging Face byte for byte.
std::string utf8_lossy(std::string_view bytes);

// Length of the longest prefix of `bytes` that ends on a code-point boundary and after which the
// remaining tail could still become valid UTF-8 with more bytes. Used by the streaming decoder to
// hold back only a genuinely incomplete trailing sequence.
size_t utf8_stable_prefix(std::string_view bytes);

// True when `s` is well-formed UTF-8.
bool utf8_valid(std::string_view s);

// Canonical composition (NFC). Returns `s` unchanged (no copy into `out`) when it is already NFC;
// in that case the function returns false and `out` is untouched.
bool nfc_normalize(std::string_view s, std::string& out);

// Splits text into pre-tokens with a Hugging Face `Split` regex (behaviour "Isolated": every match
// and every gap between matches is a piece). Compiled once with PCRE2 (UTF, UCP, JIT).
class RegexSplitter {
 public:
  explicit RegexSplitter(const std::string& pattern);
  ~RegexSplitter();
  RegexSplitter(const RegexSplitter&) = delete;
  RegexSplitter& operator=(const RegexSplitter&) = delete;

  // Calls fn(offset, length) for consecutive pieces covering all of `text` (valid UTF-8 required).
  template <class Fn>
  void split(std::string_view text, Fn&& fn) const {
    size_t pos = 0, gap = 0;
    while (pos < text.size()) {
      size_t b, e;
      if (!next_match(text, pos, b, e)) break;
      if (b > gap) fn(gap, b - gap);
      fn(b, e - b);
      gap = e;
      pos = e;
    }
    if (text.size() > gap) fn(gap, text.size() - gap);
  }

  const std::string& pattern() const { return pattern_; }

 private:
  // Next non-empty match at or after `pos`; false when none is left.
  bool next_match(std::string_view text, size_t pos, size_t& b, size_t& e) const;
  std::string pattern_;
  void* code_ = nullptr;   // pcre2_code_8*
};

}  // namespace lily
