// Writes in-memory weights (e.g. the synthetic full-size model) as an MLX 4-bit checkpoint directory
// (config.json + sharded model-*.safetensors + model.safetensors.index.json) that `load_weights` reads
// back bit for bit, so the real load path can be exercised at full size without a download.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "model/weights.h"

namespace lily {

// config.json text (nested text_config, MLX quantization block with the 8-bit router and shared-expert
// gate overrides) for a config built in code.
std::string mlx_config_json(const ModelConfig& c);

struct CheckpointWriteOptions {
  int64_t shard_bytes = int64_t(4) << 30;                      // start a new shard past this size
  std::function<void(int64_t done, int64_t total)> progress;   // bytes written so far (optional)
};

// Weights must be affine-quantized with bf16 scales (MLX layout); vectors are written as f32 so that
// the effective gains round-trip exactly. Returns the bytes of tensor data written.
int64_t write_mlx_checkpoint(const ModelWeights& w, const std::string& dir, const CheckpointWriteOptions& opt = {});

}  // namespace lily
