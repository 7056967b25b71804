// Host-side launchers of the CUDA kernels (one .cu per op family). All take the stream they
// enqueue on and never synchronise, so a whole decode step can be captured into a CUDA graph.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/backend.h"
#include "backend/cuda/cuda_common.cuh"

namespace lily::cuda {

// ---- gemv.cu -------------------------------------------------------------------------------
constexpr int kMaxGemvJobs = 8;
struct GemvJob {
  QMat w;
  const float* x = nullptr;   // [T, w.cols]
  float* y = nullptr;         // [T, w.rows]
};
// Runs every job (y = x · Wᵀ for T tokens) in as few launches as possible. `fast` false forces
// the generic kernel (ablation D1).
void gemv_batch(const GemvJob* jobs, int n, int T, bool fast, cudaStream_t s);
// True when the specialised 4-bit decode kernel handles this matrix.
bool gemv_fast_ok(const QMat& w);

void embed(const QMat& E, const int32_t* tokens, int T, float* out, cudaStream_t s);
// If r != nullptr: h += r first (written back), then out = rmsnorm(h) * w.
void rmsnorm(float* h, const float* r, const float* w, int n, int T, float eps, float* out,
             cudaStream_t s);
void add(float* h, const float* r, int64_t n, cudaStream_t s);

// ---- sample.cu -----------------------------------------------------------------------------
// ids[t] = argmax(logits[t, 0:n)), lowest index on ties. `scratch` from argmax_scratch_bytes.
int64_t argmax_scratch_bytes(int T);
void argmax(const float* logits, int T, int n, int32_t* ids, void* scratch, cudaStream_t s);
void increment(int32_t* p, int by, cudaStream_t s);
// Keeps the stream busy for `ns` nanoseconds, so that the host can enqueue a whole eager step
// behind it and per-op events then measure device time rather than launch gaps.
void spin(uint64_t ns, cudaStream_t s);
// Fills n floats with uniform values in [-scale, scale) from a counter-based hash (bench only).
void fill_uniform(float* p, int64_t n, float scale, uint64_t seed, cudaStream_t s);

// ---- sampling.cu ---------------------------------------------------------------------------
// The sample op (backend.h Backend::sample): three kernels, no host synchronisation. `ws` from
// sample_workspace_bytes(n), zeroed once at allocation (the kernels leave it ready for the next call).
int64_t sample_workspace_bytes(int n);
void sample(const float* logits, int n, SampleConfig* cfg, int32_t* counts, int32_t* id, void* ws, cudaStream_t s);
// How the last pick was made: 0 greedy, 1 index-order draw, 2 sorted candidates, 3 radix fallback
// (synchronous; tests only).
int sample_last_path(const void* ws);

// ---- gdn.cu --------------------------------------------------------------------------------
struct GdnDims {
  int nk, nv, dk, dv, conv_dim, kconv;
  float eps;
};
void gdn(const GdnDims& d, const float* conv_w, const float* A_log, const float* dt_bias,
         const float* norm_w, float* conv_state, float* S, const float* qkv, const float* z,
         const float* a, const float* b, int T, float* y, cudaStream_t s);

// ---- attention.cu --------------------------------------------------------------------------
struct AttnDims {
  int heads, kv_heads, head_dim, rot_dim;
  float theta, eps;
  int capacity;
};
// Workspace floats needed for T tokens (prepared queries + split-KV partials).
int64_t attention_workspace_floats(const AttnDims& d, int T);
// `splits`: KV blocks per (token, kv head) for decode (D7); `pack_gqa`: one KV pass per KV head (D6).
void attention(const AttnDims& d, const float* q_norm, const float* k_norm, float* kc, float* vc,
               int pos0, const int32_t* pos_dev, const float* q, const float* k, const float* v,
               int T, float* o, float* work, int splits, bool pack_gqa, cudaStream_t s);

// ---- moe.cu --------------------------------------------------------------------------------
struct MoeDev {
  int E, K, H, I, Is;
  QMat router, shared_gate;           // [E, H], [1, H]
  QMat gate0, up0, down0;             // expert 0 of each stack
  int64_t gate_stride, gate_sb_stride, up_stride, up_sb_stride, down_stride, down_sb_stride;
  QMat sh_gate, sh_up, sh_down;
  int* hist = nullptr;                // optional [E] counts of routed tokens per expert
};
int64_t moe_workspace_floats(const MoeDev& m, int T);
// `fast` false uses the generic kernels (ablation D1). `stages` bits: 1 router, 2 gate/up, 4 down
// (the profiler launches them one at a time).
void moe(const MoeDev& m, const float* x, int T, float* out, float* work, bool fast, int stages, cudaStream_t s);

}  // namespace lily::cuda
