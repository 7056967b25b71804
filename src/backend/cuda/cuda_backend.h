// The CUDA backend (NVIDIA Hopper, sm_90a): factory plus the few device-specific hooks that the
// benchmark and the cuda-check tool use (per-op timing, memory, copy bandwidth). Plain C++: no CUDA
// header is needed to include this file.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace lily {

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& opt);

namespace cuda_tools {

struct OpTime {
  std::string name;   // op and shape, e.g. "gemv 8192x2048+4096x2048"
  double ms = 0;      // summed over calls
  int calls = 0;
  double bytes = 0;   // bytes the op must move at least (weights, state, cache), summed
};

// Each op is bracketed by CUDA events while profiling is on (eager steps only, not in a graph);
// turning it on also queues the next step behind a short device spin so that the events time the
// device work, not the host's launch gaps.
void set_profiling(Backend& be, bool on);
// Synchronises, returns the accumulated times (sorted by time, largest first) and clears them.
std::vector<OpTime> take_profile(Backend& be);
// Bytes of device memory this backend allocated (weights, states, workspaces).
int64_t device_bytes(Backend& be);
// Device-to-device copy bandwidth (GB/s counting bytes read + written) over `bytes` per copy.
double copy_bandwidth_gbs(Backend& be, int64_t bytes);
// Fills n floats of backend memory with uniform values in [-scale, scale).
void fill_uniform(Backend& be, float* p, int64_t n, float scale, uint64_t seed);
std::string device_name();
// Device time per node of a graph of dependent no-op kernels (the per-kernel floor of a step),
// with or without programmatic dependent launch.
double launch_floor_us(Backend& be, bool pdl);
// How the last sample op picked: 0 greedy, 1 index-order draw, 2 sorted candidates, 3 radix
// fallback (synchronises; for tests).
int last_sample_path(Backend& be);
// Switches optimizations off or on at run time (same ids as BackendOptions::ablations); a captured
// step must be captured again afterwards.
void set_ablations(Backend& be, const Ablations& a);
// Counts, per layer and expert, the tokens routed to it by MoE calls made from now on (also inside
// steps captured from now on); the counts restart at zero.
void set_expert_histogram(Backend& be, bool on);
std::vector<std::vector<int64_t>> expert_histogram(Backend& be);
// Device times (ms) of `reps` calls of `op` (ops on `be`, each flushed and bracketed by CUDA events)
// after `warmup` untimed calls.
std::vector<double> time_ops(Backend& be, const std::function<void()>& op, int warmup, int reps);
// Expert ids [T, top-k] chosen by the last prefill-path MoE call (empty if none).
std::vector<int32_t> last_moe_ids(Backend& be);
// Whether the last prefill-path MoE call kept its (token, slot) rows in fp16 (P16 taken).
bool last_moe_slot16(Backend& be);
// Test aid: from now on (and not inside a captured step) every MoE call appends its expert ids
// [T, top-k] (an empty entry for the decode-path kernels, T < the GEMM threshold); each recorded call
// synchronises. take_moe_ids returns and clears the list (for cpu_tools::set_routing_override).
void record_moe_ids(Backend& be, bool on);
std::vector<std::vector<int32_t>> take_moe_ids(Backend& be);
// Investigation aid: from now on (and in steps captured from now on) the persistent MoE decode
// kernel (D19) and the 4-bit decode GEMV write a %globaltimer stamp per CTA at each phase
// boundary; the summary gives, per launch name and phase, the time since the launch's first CTA
// entered (median over the launches of the last step traced).
void set_kernel_trace(Backend& be, bool on);
// Test aid: the decode MoE top-k selection on the device (lanes: D27's one-warp form, else the
// two-round form) for `rows` rows of E logits; returns the ids [rows, K].
std::vector<int> moe_topk_ids(const std::vector<float>& logits, int rows, int E, int K, bool lanes);
std::vector<std::string> kernel_trace_summary(Backend& be);
// Test aids for P62 (the chunked GDN's qkv and z as fp16): f16_round rounds n device floats to fp16 precision
// in place (still f32); f16_pack stores them as n fp16 values at the start of the same buffer; mark_f16 tells
// the backend that p holds such fp16 values for the next gdn() call, as P62's projection GEMM does.
void f16_round(Backend& be, float* p, int64_t n);
void f16_pack(Backend& be, float* p, int64_t n);
void mark_f16(Backend& be, const float* p);

}  // namespace cuda_tools
}  // namespace lily
