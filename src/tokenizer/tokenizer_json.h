// Fast reader of a Hugging Face tokenizer.json: the large model.vocab / model.merges sections are
// streamed (SAX) into flat vectors, everything else is an ordinary JSON document.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace lily {

struct TokenizerJson {
  nlohmann::json doc;                                          // the file without vocab and merges
  std::vector<std::pair<std::string, int32_t>> vocab;          // model.vocab in file order
  std::vector<std::pair<std::string, std::string>> merges;     // model.merges, either file format
  bool has_vocab = false;
};

// Throws lily::Error naming the file on I/O errors, invalid JSON or a malformed merge.
TokenizerJson read_tokenizer_json(const std::string& path);

}  // namespace lily
