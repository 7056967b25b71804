// Pieces shared by `lily bench decode` (cmd_bench.cpp) and `lily bench prefill` (bench_prefill.cpp).
#pragma once
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

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

// Median of a sample (mean of the two middle values for an even count; 0 when empty).
inline double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// printf-style formatting of one number.
inline std::string fmtd(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

}  // namespace lily
