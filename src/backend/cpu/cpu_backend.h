// Factory of the CPU backend (the reference and portable default).
#pragma once
#include <memory>

#include "backend/backend.h"

namespace lily {
std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& opt);
// The sample op on host memory (sample_cpu.cpp); the reference the cuda kernels must match.
void cpu_sample(const float* logits, int n, SampleConfig* cfg, int32_t* counts, int32_t* id);

// TEST AIDS of the cpu backend (`be` must be one).
namespace cpu_tools {
// The next MoE calls, one entry each in call order, use these expert ids [T, top-k] instead of the
// backend's own top-k (an empty entry: its own). Lets a reference follow another backend's routing,
// so that the rest of the arithmetic can be compared where near-tied router logits would otherwise
// pick different experts (`lily cuda-check --follow-routing`).
void set_routing_override(Backend& be, std::vector<std::vector<int32_t>> per_call);
// Since the last set_routing_override: tokens routed by an override, those whose own top-k set
// differed, and the largest gap, in log-probability, between the own k-th and (k+1)-th expert among them.
struct RoutingStats {
  int64_t tokens = 0, differing = 0;
  double max_gap = 0;
};
RoutingStats routing_stats(Backend& be);
size_t routing_override_left(Backend& be);   // entries not consumed yet
}  // namespace cpu_tools
}  // namespace lily
