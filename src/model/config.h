// Model configuration with Hugging Face field names (text_config of qwen3_5_moe), plus the MLX
// quantization block. Parsed from config.json in either published form (nested text_config or flat).
#pragma once
#include <map>
#include <string>
#include <vector>

namespace lily {

struct QuantOverride {
  int group_size = 64;
  int bits = 4;
};

struct QuantConfig {
  bool present = false;          // false: unquantized checkpoint (HF bf16)
  int group_size = 64;           // only 64 is supported
  int bits = 4;                  // default bits; per-module overrides below
  std::string mode = "affine";   // only affine is supported
  // Keyed by module path as written in the file (e.g. "language_model.model.layers.0.mlp.gate").
  std::map<std::string, QuantOverride> overrides;
};

struct ModelConfig {
  std::string model_type;              // "qwen3_5_moe" (top) / "qwen3_5_moe_text" (text_config)
  int hidden_size = 0;                 // 2048
  int num_hidden_layers = 0;           // 40
  std::vector<bool> is_full_attention; // from layer_types: true = full_attention
  int num_attention_heads = 0;         // 16
  int num_key_value_heads = 0;         // 2
  int head_dim = 0;                    // 256
  bool attn_output_gate = true;
  int linear_num_key_heads = 0;        // 16
  int linear_num_value_heads = 0;      // 32
  int linear_key_head_dim = 0;         // 128
  int linear_value_head_dim = 0;       // 128
  int linear_conv_kernel_dim = 0;      // 4
  int num_experts = 0;                 // 256
  int num_experts_per_tok = 0;         // 8
  int moe_intermediate_size = 0;       // 512
  int shared_expert_intermediate_size = 0;  // 512
  int vocab_size = 0;                  // 248320
  float rms_norm_eps = 1e-6f;
  int max_position_embeddings = 0;     // 262144
  float rope_theta = 1e7f;
  float partial_rotary_factor = 0.25f;
  bool tie_word_embeddings = false;
  std::vector<int> eos_token_ids;      // from config (text_config.eos_token_id), may be empty
  QuantConfig quant;

  // Derived sizes.
  int rotary_dim() const { return int(head_dim * partial_rotary_factor); }
  int linear_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int linear_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  int conv_dim() const { return 2 * linear_key_dim() + linear_value_dim(); }
  int num_full_attention_layers() const;
};

// Parses config.json text. Throws lily::Error naming the field on a missing or unsupported value.
ModelConfig parse_config(const std::string& json_text);
// Reads DIR/config.json. Throws lily::Error naming the file.
ModelConfig load_config(const std::string& dir);

}  // namespace lily
