// The built-in demo model: a tiny random-weight checkpoint in the MLX 4-bit layout with real
// per-head dims, plus a byte-level BPE tokenizer, so every command can run without a download.
#pragma once
#include <cstdint>
#include <string>

namespace lily {

struct DemoModelInfo {
  int vocab_size = 0;      // tokenizer size = embedding rows
  int num_merges = 0;      // BPE merges learned from the built-in text
  uint64_t weight_bytes = 0;
};

// Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
// generation_config.json into `dir` (created if needed). Deterministic for a given seed.
DemoModelInfo write_demo_model(const std::string& dir, uint64_t seed);

}  // namespace lily
