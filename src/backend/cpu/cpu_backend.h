// Factory of the CPU backend (the reference and portable default).
#pragma once
#include <memory>

#include "backend/backend.h"

namespace lily {
std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& opt);
// The sample op on host memory (sample_cpu.cpp); the reference the cuda kernels must match.
void cpu_sample(const float* logits, int n, SampleConfig* cfg, int32_t* counts, int32_t* id);
}  // namespace lily
