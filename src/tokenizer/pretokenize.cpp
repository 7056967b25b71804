// UTF-8 repair, NFC via ICU and the PCRE2 pre-tokenizer (see pretokenize.h).
#include "tokenizer/pretokenize.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>

#include "core/common.h"

namespace lily {

// ---- UTF-8 -------------------------------------------------------------------------------------

namespace {

// Length of the well-formed sequence starting at s[i] (1..4), or -k where k (>= 1) is the length of
// the maximal subpart of an ill-formed one. `incomplete` is set when the sequence is a valid prefix
// cut short by the end of input. Follows Table 3-7 of the Unicode standard.
int utf8_step(std::string_view s, size_t i, bool& incomplete) {
  incomplete = false;
  const auto c = uint8_t(s[i]);
  if (c < 0x80) return 1;
  int need;
  uint8_t lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return -1;
  }
  for (int k = 1; k <= need; ++k) {
    if (i + k >= s.size()) {
      incomplete = true;
      return -k;
    }
    const auto d = uint8_t(s[i + k]);
    if (d < lo || d > hi) return -k;
    lo = 0x80;
    hi = 0xBF;
  }
  return need + 1;
}

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

}  // namespace

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    size_t run = i;
    bool inc;
    int n;
    while (run < s.size() && (n = utf8_step(s, run, inc)) > 0) run += size_t(n);
    out.append(s.data() + i, run - i);
    i = run;
    if (i < s.size()) {
      n = utf8_step(s, i, inc);
      out.append(kReplacement);
      i += size_t(-n);
    }
  }
  return out;
}

size_t utf8_stable_prefix(std::string_view s) {
  // Only the last (at most 3) bytes can be an incomplete sequence; find where it would start.
  size_t start = s.size();
  for (size_t k = 1; k <= 3 && k <= s.size(); ++k) {
    const auto c = uint8_t(s[s.size() - k]);
    if ((c & 0xC0) != 0x80) {
      start = s.size() - k;
      break;
    }
  }
  if (start == s.size()) return s.size();
  bool inc;
  const int n = utf8_step(s, start, inc);
  return (n < 0 && inc) ? start : s.size();
}

bool utf8_valid(std::string_view s) {
  size_t i = 0;
  bool inc;
  while (i < s.size()) {
    const auto c = uint8_t(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    const int n = utf8_step(s, i, inc);
    if (n < 0) return false;
    i += size_t(n);
  }
  return true;
}

// ---- NFC ---------------------------------------------------------------------------------------

bool nfc_normalize(std::string_view s, std::string& out) {
  // Every code point below U+0300 is NFC-stable and starts no composition, so text whose bytes are
  // all < 0xCC (the lead byte of U+0300) needs no work; that covers ASCII and most Latin text.
  bool simple = true;
  for (char ch : s)
    if (uint8_t(ch) >= 0xCC) {
      simple = false;
      break;
    }
  if (simple) return false;
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(err);
  LILY_CHECK(U_SUCCESS(err), "ICU NFC normaliser unavailable");
  const icu::StringPiece sp(s.data(), int32_t(s.size()));
  if (nfc->isNormalizedUTF8(sp, err) && U_SUCCESS(err)) return false;
  err = U_ZERO_ERROR;
  out.clear();
  icu::StringByteSink<std::string> sink(&out, int32_t(s.size()));
  nfc->normalizeUTF8(0, sp, sink, nullptr, err);
  LILY_CHECK(U_SUCCESS(err), "ICU NFC normalisation failed");
  return true;
}

// ---- regex pre-tokenizer -----------------------------------------------------------------------

namespace {

// Per-thread match data and JIT stack: pcre2 match data may not be shared between threads, and the
// default 32 KiB JIT stack is too small for look-ahead over very long whitespace runs.
struct MatchScratch {
  pcre2_match_data_8* md = pcre2_match_data_create_8(4, nullptr);
  pcre2_match_context_8* mc = pcre2_match_context_create_8(nullptr);
  pcre2_jit_stack_8* js = pcre2_jit_stack_create_8(64 * 1024, 8 * 1024 * 1024, nullptr);
  MatchScratch() { pcre2_jit_stack_assign_8(mc, nullptr, js); }
  ~MatchScratch() {
    pcre2_jit_stack_free_8(js);
    pcre2_match_context_free_8(mc);
    pcre2_match_data_free_8(md);
  }
};

MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}

}  // namespace

RegexSplitter::RegexSplitter(const std::string& pattern) : pattern_(pattern) {
  // PCRE2's UCP `\s` is Unicode White_Space (U+0085 and U+00A0 included), as in Oniguruma (HF).
  const std::string& p = pattern;
  int err = 0;
  PCRE2_SIZE off = 0;
  auto* code = pcre2_compile_8(reinterpret_cast<PCRE2_SPTR8>(p.data()), p.size(),
                               PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
  if (!code) {
    PCRE2_UCHAR8 msg[256];
    pcre2_get_error_message_8(err, msg, sizeof msg);
    throw Error("pre-tokenizer regex does not compile at offset " + std::to_string(off) + ": " +
                reinterpret_cast<char*>(msg) + " (pattern " + pattern + ")");
  }
  // JIT is an optimisation only: without it pcre2_match interprets the same pattern.
  pcre2_jit_compile_8(code, PCRE2_JIT_COMPLETE);
  code_ = code;
}

RegexSplitter::~RegexSplitter() { pcre2_code_free_8(static_cast<pcre2_code_8*>(code_)); }

bool RegexSplitter::next_match(std::string_view text, size_t pos, size_t& b, size_t& e) const {
  auto& s = scratch();
  auto* code = static_cast<pcre2_code_8*>(code_);
  while (pos < text.size()) {
    const int rc = pcre2_match_8(code, reinterpret_cast<PCRE2_SPTR8>(text.data()), text.size(), pos,
                                 PCRE2_NO_UTF_CHECK, s.md, s.mc);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR8 msg[256];
      pcre2_get_error_message_8(rc, msg, sizeof msg);
      throw Error(std::string("pre-tokenizer regex failed: ") + reinterpret_cast<char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer_8(s.md);
    b = ov[0];
    e = ov[1];
    if (e > b) return true;
    // Empty match: HF skips it; retry one code point further on.
    pos = b + 1;
    while (pos < text.size() && (uint8_t(text[pos]) & 0xC0) == 0x80) ++pos;
  }
  return false;
}

}  // namespace lily
