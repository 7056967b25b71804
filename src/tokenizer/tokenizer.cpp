// Hugging Face tokenizer.json loader and the byte-level BPE Tokenizer / StreamDecoder implementation.
#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/common.h"
#include "tokenizer/bpe_model.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/tokenizer_json.h"

namespace lily {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The GPT-2 split pattern HF's ByteLevel pre-tokenizer uses when `use_regex` is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

json read_json(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw Error("cannot open " + p.string());
  try {
    return json::parse(f);
  } catch (const json::exception& e) {
    throw Error(p.string() + ": invalid JSON: " + e.what());
  }
}

bool is_type(const json& j, const char* type) {
  return j.is_object() && j.contains("type") && j["type"] == type;
}

// Added tokens are matched as whole units before normalisation and BPE, leftmost-longest (HF
// AddedVocabulary semantics). A byte trie: tokens are few, text is long, so a first-byte filter
// skips almost every position.
class AddedMatcher {
 public:
  void add(const std::string& s, int32_t id) {
    int node = 0;
    for (char ch : s) {
      const uint64_t key = uint64_t(node) << 8 | uint8_t(ch);
      auto it = edges_.find(key);
      if (it == edges_.end()) {
        it = edges_.emplace(key, int(terminal_.size())).first;
        terminal_.push_back(-1);
      }
      node = it->second;
    }
    terminal_[size_t(node)] = id;
    first_[uint8_t(s[0])] = true;
  }
  // Longest token starting at `pos`: returns its length (0 if none) and its id.
  size_t match_at(std::string_view text, size_t pos, int32_t& id) const {
    int node = 0;
    size_t best = 0;
    for (size_t i = pos; i < text.size(); ++i) {
      auto it = edges_.find(uint64_t(node) << 8 | uint8_t(text[i]));
      if (it == edges_.end()) break;
      node = it->second;
      if (terminal_[size_t(node)] >= 0) {
        best = i + 1 - pos;
        id = terminal_[size_t(node)];
      }
    }
    return best;
  }
  bool may_start(char c) const { return first_[uint8_t(c)]; }
  bool empty() const { return terminal_.size() == 1; }

 private:
  std::unordered_map<uint64_t, int> edges_;
  std::vector<int32_t> terminal_{-1};
  bool first_[256] = {};
};

class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(const fs::path& file);

  std::vector<int32_t> encode(std::string_view text, bool parse_special) const override;
  std::string decode(std::span<const int32_t> ids, bool skip_special) const override;
  // Unknown ids (e.g. the padded embedding rows past the tokenizer) have no bytes: HF's decode
  // skips them silently, and a sampled padding row must not abort a stream.
  std::string token_bytes(int32_t id) const override {
    return id >= 0 && size_t(id) < bytes_.size() ? bytes_[size_t(id)] : std::string();
  }
  int32_t token_id(std::string_view token) const override {
    auto it = by_spelling_.find(std::string(token));
    return it == by_spelling_.end() ? -1 : it->second;
  }
  int vocab_size() const override { return int(bytes_.size()); }
  bool is_special(int32_t id) const override { return id >= 0 && size_t(id) < special_.size() && special_[size_t(id)]; }
  const std::vector<int32_t>& stop_ids() const override { return stop_ids_; }

 private:
  void load_model(const json& model, TokenizerJson& tj, const std::string& where);
  void load_pre_tokenizer(const json& pt, const std::string& where);
  void load_normalizer(const json& n, const std::string& where);
  void load_stop_ids(const fs::path& dir);
  void encode_segment(std::string_view seg, std::vector<int32_t>& out) const;

  std::unique_ptr<BpeModel> bpe_;
  std::unique_ptr<RegexSplitter> splitter_;   // null: the whole segment is one pre-token
  bool nfc_ = false;
  AddedMatcher added_;
  std::vector<std::string> bytes_;   // raw bytes per id (vocab and added tokens)
  std::vector<uint8_t> special_;
  std::unordered_map<std::string, int32_t> by_spelling_;
  std::vector<int32_t> stop_ids_;
};

BpeTokenizer::BpeTokenizer(const fs::path& file) {
  TokenizerJson tj = read_tokenizer_json(file.string());
  const json& j = tj.doc;
  const std::string where = file.string();
  if (!j.contains("model")) throw Error(where + ": no \"model\" section");
  load_model(j["model"], tj, where);
  load_normalizer(j.value("normalizer", json()), where);
  load_pre_tokenizer(j.value("pre_tokenizer", json()), where);

  const json dec = j.value("decoder", json());
  if (!dec.is_null() && !is_type(dec, "ByteLevel"))
    throw Error(where + ": decoder type " + dec.value("type", std::string("?")) + " is not supported (ByteLevel only)");

  special_.assign(bytes_.size(), 0);
  for (const auto& t : j.value("added_tokens", json::array())) {
    const std::string content = t.at("content").get<std::string>();
    const int32_t id = t.at("id").get<int32_t>();
    if (id < 0) throw Error(where + ": added token " + content + " has a negative id");
    if (t.value("lstrip", false) || t.value("rstrip", false) || t.value("single_word", false))
      throw Error(where + ": added token " + content + " uses lstrip/rstrip/single_word, which lily does not support");
    if (content.empty()) throw Error(where + ": empty added token (id " + std::to_string(id) + ")");
    if (size_t(id) >= bytes_.size()) {
      bytes_.resize(size_t(id) + 1);
      special_.resize(size_t(id) + 1, 0);
    }
    // HF decodes added tokens through the ByteLevel decoder too: mapped when every char is in the
    // byte table, raw UTF-8 otherwise.
    if (!byte_level().decode(content, bytes_[size_t(id)])) bytes_[size_t(id)] = content;
    special_[size_t(id)] = t.value("special", false) ? 1 : 0;
    by_spelling_[content] = id;
    added_.add(content, id);
  }
  load_stop_ids(file.parent_path());
}

void BpeTokenizer::load_model(const json& m, TokenizerJson& tj, const std::string& where) {
  if (m.contains("type") && m["type"] != "BPE")
    throw Error(where + ": model type " + m["type"].dump() + " is not supported (BPE only)");
  if (m.value("byte_fallback", false)) throw Error(where + ": BPE byte_fallback is not supported");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.contains(k) && m[k].is_string() && !m[k].get<std::string>().empty())
      throw Error(where + std::string(": BPE ") + k + " is not supported");
  if (!tj.has_vocab) throw Error(where + ": model.vocab missing");
  const auto& bl = byte_level();
  std::vector<std::string> vocab;
  by_spelling_.reserve(tj.vocab.size() + 64);
  for (auto& [tok, id] : tj.vocab) {
    if (size_t(id) >= vocab.size()) vocab.resize(size_t(id) + 1);
    if (!bl.decode(tok, vocab[size_t(id)])) vocab[size_t(id)] = tok;
    by_spelling_[std::move(tok)] = id;
  }
  tj.vocab.clear();
  auto id_of = [&](const std::string& t) {
    auto it = by_spelling_.find(t);
    if (it == by_spelling_.end()) throw Error(where + ": merge token " + t + " is not in the vocabulary");
    return it->second;
  };
  std::vector<BpeModel::Merge> merges;
  merges.reserve(tj.merges.size());
  std::string both;
  for (const auto& [a, b] : tj.merges) {
    both.assign(a).append(b);
    merges.push_back({id_of(a), id_of(b), id_of(both)});
  }
  tj.merges.clear();
  bytes_ = vocab;
  bpe_ = std::make_unique<BpeModel>(std::move(vocab), merges, m.value("ignore_merges", false));
}

void BpeTokenizer::load_normalizer(const json& n, const std::string& where) {
  if (n.is_null()) return;
  if (is_type(n, "NFC")) {
    nfc_ = true;
  } else if (is_type(n, "Sequence")) {
    for (const auto& s : n.at("normalizers")) load_normalizer(s, where);
  } else {
    throw Error(where + ": normalizer " + n.dump() + " is not supported (NFC only)");
  }
}

void BpeTokenizer::load_pre_tokenizer(const json& pt, const std::string& where) {
  if (pt.is_null()) return;
  if (is_type(pt, "Sequence")) {
    for (const auto& s : pt.at("pretokenizers")) load_pre_tokenizer(s, where);
    return;
  }
  std::string pattern;
  if (is_type(pt, "ByteLevel")) {
    if (pt.value("add_prefix_space", false))
      throw Error(where + ": ByteLevel add_prefix_space=true is not supported");
    if (!pt.value("use_regex", true)) return;   // byte mapping only: BpeModel works on raw bytes
    pattern = kGpt2Pattern;
  } else if (is_type(pt, "Split")) {
    if (pt.value("behavior", std::string()) != "Isolated" || pt.value("invert", false))
      throw Error(where + ": Split pre-tokenizer must be behavior=Isolated, invert=false");
    const json& p = pt.at("pattern");
    if (p.contains("Regex")) {
      pattern = p["Regex"].get<std::string>();
    } else {
      // A literal string: quote it for PCRE2.
      pattern = "\\Q" + p.at("String").get<std::string>() + "\\E";
    }
  } else {
    throw Error(where + ": pre-tokenizer " + pt.value("type", std::string("?")) + " is not supported");
  }
  if (splitter_) throw Error(where + ": more than one splitting pre-tokenizer is not supported");
  splitter_ = std::make_unique<RegexSplitter>(pattern);
}

void BpeTokenizer::load_stop_ids(const fs::path& dir) {
  auto add = [&](int32_t id) {
    if (id >= 0 && std::find(stop_ids_.begin(), stop_ids_.end(), id) == stop_ids_.end()) stop_ids_.push_back(id);
  };
  const fs::path gen = dir / "generation_config.json";
  if (fs::exists(gen)) {
    const json g = read_json(gen);
    if (g.contains("eos_token_id")) {
      const json& e = g["eos_token_id"];
      if (e.is_number_integer()) add(e.get<int32_t>());
      else if (e.is_array()) for (const auto& x : e) add(x.get<int32_t>());
      else if (!e.is_null()) throw Error(gen.string() + ": eos_token_id must be an integer or a list");
    }
  }
  const fs::path cfg = dir / "tokenizer_config.json";
  if (fs::exists(cfg)) {
    const json c = read_json(cfg);
    if (c.contains("eos_token") && !c["eos_token"].is_null()) {
      const json& e = c["eos_token"];
      const std::string s = e.is_string() ? e.get<std::string>() : e.value("content", std::string());
      const int32_t id = token_id(s);
      if (id < 0) throw Error(cfg.string() + ": eos_token " + s + " is not in the vocabulary");
      add(id);
    }
  }
  // A bare tokenizer.json says nothing about stopping: fall back to the ChatML end markers.
  if (stop_ids_.empty())
    for (const char* t : {"<|im_end|>", "<|endoftext|>"}) add(token_id(t));
}

void BpeTokenizer::encode_segment(std::string_view seg, std::vector<int32_t>& out) const {
  if (seg.empty()) return;
  std::string normalized;
  if (nfc_ && nfc_normalize(seg, normalized)) seg = normalized;
  if (!splitter_) {
    bpe_->encode_word(seg, out);
    return;
  }
  splitter_->split(seg, [&](size_t off, size_t len) { bpe_->encode_word(seg.substr(off, len), out); });
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text, bool parse_special) const {
  std::string repaired;
  if (!utf8_valid(text)) {
    repaired = utf8_lossy(text);
    text = repaired;
  }
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 8);
  size_t seg_start = 0, i = 0;
  if (!added_.empty()) {
    while (i < text.size()) {
      if (!added_.may_start(text[i])) {
        ++i;
        continue;
      }
      int32_t id = -1;
      const size_t len = added_.match_at(text, i, id);
      if (len == 0) {
        ++i;
        continue;
      }
      // HF (encode_special_tokens) finds the match first and only then lets a special token fall
      // back to text, so its span is not searched again for shorter tokens.
      if (parse_special || !special_[size_t(id)]) {
        encode_segment(text.substr(seg_start, i - seg_start), out);
        out.push_back(id);
        seg_start = i + len;
      }
      i += len;
    }
  }
  encode_segment(text.substr(seg_start), out);
  return out;
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string raw;
  for (int32_t id : ids) {
    if (id < 0 || size_t(id) >= bytes_.size() || (skip_special && special_[size_t(id)])) continue;
    raw += bytes_[size_t(id)];
  }
  return utf8_lossy(raw);
}

}  // namespace

std::shared_ptr<Tokenizer> Tokenizer::load(const std::string& path) {
  fs::path p(path);
  if (fs::is_directory(p)) p /= "tokenizer.json";
  if (!fs::exists(p)) throw Error("tokenizer file not found: " + p.string());
  return std::make_shared<BpeTokenizer>(p);
}

// ---- streaming -------------------------------------------------------------------------------

std::string StreamDecoder::push(int32_t id) {
  if (skip_special_ && tok_.is_special(id)) return {};
  pending_ += tok_.token_bytes(id);
  const size_t n = utf8_stable_prefix(pending_);
  if (n == 0) return {};
  std::string out = utf8_lossy(std::string_view(pending_).substr(0, n));
  pending_.erase(0, n);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = utf8_lossy(pending_);
  pending_.clear();
  return out;
}

}  // namespace lily
