// Typed views of the checkpoint's tensors, grouped per layer with Hugging Face names. The loader
// fills them from mmap'd safetensors (MLX 4-bit affine or HF bf16); a backend may re-point every
// view at its own memory (see Backend::upload). Views never own memory.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"

namespace lily {

enum class WType : uint8_t {
  kAffine4,  // U32 codes, 8 per word, first element in the lowest nibble; scales/biases per group
  kAffine8,  // U32 codes, 4 per word, first element in the lowest byte
  kBF16,     // plain bf16 [rows, cols]
  kF32,      // plain f32 [rows, cols]
};

// A weight matrix W[rows, cols] used as y = W x (rows = out, cols = in).
struct QMatrix {
  WType type = WType::kF32;
  int64_t rows = 0, cols = 0;
  int group_size = 64;                // affine only
  bool sb_f32 = false;                // affine only: scales/biases stored as f32 instead of bf16
  const void* data = nullptr;         // codes [rows, cols*bits/32] u32, or [rows, cols] bf16/f32
  const void* scales = nullptr;       // affine: [rows, cols/group_size] bf16 (or f32)
  const void* biases = nullptr;       // affine: [rows, cols/group_size] bf16 (or f32)

  int bits() const { return type == WType::kAffine4 ? 4 : type == WType::kAffine8 ? 8 : 0; }
  bool quantized() const { return type == WType::kAffine4 || type == WType::kAffine8; }
  int64_t data_bytes_per_row() const;   // bytes of `data` per row
  int64_t sb_bytes_per_row() const;     // bytes of `scales` (and of `biases`) per row
  // View of rows [r0, r0+n).
  QMatrix row_slice(int64_t r0, int64_t n) const;
};

// A stack of same-shaped expert matrices; expert e lives at a fixed byte stride from expert 0.
// Covers both the MLX layout (one tensor per projection, [E, out, in']) and the HF fused
// gate_up_proj [E, 2*I, in] (gate = rows [0, I), up = rows [I, 2I) of each slab).
struct QStack {
  QMatrix first;                      // expert 0
  int64_t n = 0;                      // number of experts
  int64_t data_stride = 0;            // bytes between experts in `data`
  int64_t sb_stride = 0;              // bytes between experts in `scales` / `biases`
  QMatrix expert(int64_t e) const;
};

// A small float vector converted to f32 at load (norm gains with the +1 already applied where
// the checkpoint stores zero-centred values, conv taps, A_log, dt_bias).
struct FVec {
  const float* data = nullptr;
  int64_t n = 0;
};

struct GdnWeights {                   // linear_attn.*
  QMatrix in_proj_qkv;                // [conv_dim=8192, H]
  QMatrix in_proj_z;                  // [value_dim=4096, H]
  QMatrix in_proj_a, in_proj_b;       // [nv=32, H]
  FVec conv1d;                        // [conv_dim, K=4], tap K-1 multiplies the current token
  FVec A_log, dt_bias;                // [nv]
  FVec norm;                          // [dv=128] plain gain (never shifted)
  QMatrix out_proj;                   // [H, value_dim]
};

struct AttnWeights {                  // self_attn.*
  QMatrix q_proj;                     // [heads*2*head_dim, H]; per head [256 query | 256 gate]
  QMatrix k_proj, v_proj;             // [kv_heads*head_dim, H]
  QMatrix o_proj;                     // [H, heads*head_dim]
  FVec q_norm, k_norm;                // [head_dim], effective gain (1+w applied)
};

struct MoeWeights {                   // mlp.*
  QMatrix gate;                       // router [E, H] (8-bit in MLX files)
  QStack experts_gate, experts_up;    // [E][I, H]
  QStack experts_down;                // [E][H, I]
  QMatrix shared_gate_proj, shared_up_proj;  // [Is, H]
  QMatrix shared_down_proj;           // [H, Is]
  QMatrix shared_expert_gate;         // [1, H] (8-bit in MLX files)
};

struct LayerWeights {
  bool full_attention = false;
  FVec input_layernorm, post_attention_layernorm;  // [H], effective gain
  GdnWeights linear_attn;             // valid when !full_attention
  AttnWeights self_attn;              // valid when full_attention
  MoeWeights mlp;
};

class MappedFile;

struct ModelWeights {
  ModelConfig config;
  bool hf_layout = false;             // true: raw HF checkpoint (norms were zero-centred)
  QMatrix embed_tokens;               // [vocab, H]
  QMatrix lm_head;                    // [vocab, H]
  FVec norm;                          // [H] final norm, effective gain
  std::vector<LayerWeights> layers;
  // Owners of the memory the views point at.
  std::vector<std::shared_ptr<MappedFile>> files;
  std::vector<std::shared_ptr<std::vector<float>>> f32_arena;
};

struct LoadOptions {
  bool progress = true;               // progress bar on stderr when it is a terminal
};

// Loads a checkpoint directory (config.json + model.safetensors or sharded index). Validates every
// text tensor's name, shape and dtype against the config; skips mtp.* and vision tensors. Throws
// lily::Error naming the tensor and the file on any problem.
ModelWeights load_weights(const std::string& dir, const LoadOptions& opt = {});

}  // namespace lily
