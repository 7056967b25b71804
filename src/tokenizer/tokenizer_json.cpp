// tokenizer.json reader (see tokenizer_json.h). A DOM of the 150K-250K entry vocabulary and merge
// list costs seconds and hundreds of MB; streaming those two sections keeps loading well under that.
#include "tokenizer/tokenizer_json.h"

#include <fstream>
#include <sstream>

#include "core/common.h"

namespace lily {

namespace {

using json = nlohmann::json;

// SAX handler that collects model.vocab and model.merges and ignores everything else.
class VocabSax {
 public:
  explicit VocabSax(TokenizerJson& out) : out_(out) {}

  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(json::number_integer_t v) { return number(int64_t(v)); }
  bool number_unsigned(json::number_unsigned_t v) { return number(int64_t(v)); }
  bool number_float(json::number_float_t, const std::string&) { return true; }
  bool binary(json::binary_t&) { return true; }
  bool string(std::string& s) {
    if (top() == Role::kMerges) {
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        throw Error("malformed merge \"" + s + "\"");
      out_.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
    } else if (top() == Role::kPair) {
      pair_.push_back(std::move(s));
    }
    return true;
  }
  bool key(std::string& k) {
    if (top() == Role::kVocab) token_ = std::move(k);
    else key_ = std::move(k);
    return true;
  }
  bool start_object(std::size_t) {
    Role r = Role::kOther;
    if (stack_.empty()) r = Role::kRoot;
    else if (top() == Role::kRoot && key_ == "model") r = Role::kModel;
    else if (top() == Role::kModel && key_ == "vocab") r = Role::kVocab;
    if (r == Role::kVocab) out_.has_vocab = true;
    stack_.push_back(r);
    return true;
  }
  bool end_object() {
    stack_.pop_back();
    return true;
  }
  bool start_array(std::size_t) {
    Role r = Role::kOther;
    if (!stack_.empty() && top() == Role::kModel && key_ == "merges") r = Role::kMerges;
    else if (!stack_.empty() && top() == Role::kMerges) r = Role::kPair;
    if (r == Role::kPair) pair_.clear();
    stack_.push_back(r);
    return true;
  }
  bool end_array() {
    if (top() == Role::kPair) {
      if (pair_.size() != 2) throw Error("malformed merge: expected a pair of strings");
      out_.merges.emplace_back(std::move(pair_[0]), std::move(pair_[1]));
    }
    stack_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    throw Error(std::string("invalid JSON: ") + e.what());
  }

 private:
  enum class Role { kOther, kRoot, kModel, kVocab, kMerges, kPair };
  Role top() const { return stack_.empty() ? Role::kOther : stack_.back(); }
  bool number(int64_t v) {
    if (top() == Role::kVocab) {
      if (v < 0 || v > INT32_MAX) throw Error("vocab entry " + token_ + " has an invalid id");
      out_.vocab.emplace_back(std::move(token_), int32_t(v));
    }
    return true;
  }

  TokenizerJson& out_;
  std::vector<Role> stack_;
  std::string key_, token_;
  std::vector<std::string> pair_;
};

}  // namespace

TokenizerJson read_tokenizer_json(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error("cannot open " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  TokenizerJson out;
  try {
    VocabSax sax(out);
    json::sax_parse(text, &sax);
    // Second pass: the document minus the two big sections (dropped at their keys, never built).
    std::string root_key;
    out.doc = json::parse(text, [&](int depth, json::parse_event_t ev, json& parsed) {
      if (ev != json::parse_event_t::key) return true;
      if (depth == 1) root_key = parsed.get<std::string>();
      return !(depth == 2 && root_key == "model" && (parsed == "vocab" || parsed == "merges"));
    });
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  } catch (const json::exception& e) {
    throw Error(path + ": invalid JSON: " + e.what());
  }
  return out;
}

}  // namespace lily
