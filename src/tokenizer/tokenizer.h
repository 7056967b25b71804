// Byte-level BPE tokenizer read from a Hugging Face tokenizer.json (Qwen2 / Qwen3.5-3.6 kinds).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace lily {

class Tokenizer {
 public:
  // Loads DIR/tokenizer.json (+ tokenizer_config.json and generation_config.json when present),
  // or a tokenizer.json path. Throws lily::Error naming the file on problems.
  static std::shared_ptr<Tokenizer> load(const std::string& path);
  virtual ~Tokenizer() = default;

  // parse_special: added/special tokens written in the text become their ids (HF default);
  // false treats them as plain text.
  virtual std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const = 0;
  // Ids the tokenizer does not define (>= vocab_size(), negative, holes) are skipped, as in HF.
  virtual std::string decode(std::span<const int32_t> ids, bool skip_special = false) const = 0;
  // Raw bytes of one token (may be a partial UTF-8 sequence); "" for an unknown id.
  virtual std::string token_bytes(int32_t id) const = 0;
  // A token as spelled in tokenizer.json (byte-level form, e.g. "Ġhello") or an added token's
  // content (e.g. "<think>"); -1 if absent.
  virtual int32_t token_id(std::string_view token) const = 0;
  virtual int vocab_size() const = 0;                            // ids are < vocab_size()
  virtual bool is_special(int32_t id) const = 0;
  // Stop ids: generation_config.json eos_token_id(s) united with the tokenizer's eos token.
  virtual const std::vector<int32_t>& stop_ids() const = 0;
};

// Turns a stream of token ids into text without ever emitting a partial UTF-8 sequence.
class StreamDecoder {
 public:
  // skip_special: drop true special tokens (is_special), like decode(ids, true).
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special = false)
      : tok_(tok), skip_special_(skip_special) {}
  // Newly completed text (possibly empty). Concatenating every push() and a final flush() gives
  // exactly decode(ids, skip_special); only a trailing incomplete UTF-8 sequence is held back.
  std::string push(int32_t id);
  std::string flush();            // whatever is pending (invalid bytes become U+FFFD)
 private:
  const Tokenizer& tok_;
  bool skip_special_ = false;
  std::string pending_;
};

}  // namespace lily
