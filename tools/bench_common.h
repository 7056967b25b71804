// Pieces shared by `lily bench decode` (cmd_bench.cpp) and `lily bench prefill` (bench_prefill.cpp).
#pragma once
#include <memory>
#include <string>

#include "model/weights.h"

namespace lily {

struct BenchWeights {
  std::shared_ptr<ModelWeights> host;
  std::string name;   // recorded as the results' "model"
};

// The checkpoint in `model_dir` when use_model, else the full-size synthetic model with `layers`
// layers (random weights).
BenchWeights load_bench_weights(bool use_model, const std::string& model_dir, int layers);

int bench_prefill_main(int argc, char** argv);

}  // namespace lily
