// Full-width synthetic Qwen3.6-35B-A3B weights (real config, every real tensor shape and dtype of the
// MLX 4-bit checkpoint, random values) built in host memory, for benchmarks and CPU/CUDA parity
// checks without a download (BENCHMARK.md "Synthetic full-size model").
#pragma once
#include <cstdint>

#include "model/weights.h"

namespace lily {

struct SyntheticOptions {
  int layers = 40;        // first `layers` layers of the real pattern (every 4th is attention)
  int vocab = 0;          // 0 = the real 248,320
  uint64_t seed = 1;
  int threads = 0;        // 0 = all cores
};

// The real text config of Qwen3.6-35B-A3B with its MLX quantization block, cut to `layers` layers
// and `vocab` rows (0 = real).
ModelConfig synthetic_config(int layers, int vocab);

// Random 4-bit codes with group scales of random sign (zero-mean weights, std ≈ 1/sqrt(fan_in)),
// 8-bit router and shared-expert gate, f32 small vectors; memory owned by the returned weights.
ModelWeights make_synthetic_weights(const SyntheticOptions& opt);

}  // namespace lily
