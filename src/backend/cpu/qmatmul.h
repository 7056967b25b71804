// Matrix products against the checkpoint's weight formats (MLX affine 4/8-bit, bf16, f32) on the
// CPU: a scalar reference and the fast multithreaded SIMD kernels dispatched at run time.
#pragma once
#include <cstdint>

#include "core/thread_pool.h"
#include "model/weights.h"

namespace lily {

// Instruction-set paths of the fast kernels, ordered: a path may run only if the CPU supports it.
enum class SimdIsa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// y[T, W.rows] = x[T, W.cols] · Wᵀ for W of any WType. Multithreaded over output rows (inline
// for small matrices), SIMD path chosen by qmatmul_isa(). Matches qmatmul_ref up to f32
// summation order.
void qmatmul(const QMatrix& W, const float* x, int T, float* y, ThreadPool& pool);

// Scalar reference, obviously correct, single-threaded: dequantises each weight and accumulates
// in double.
void qmatmul_ref(const QMatrix& W, const float* x, int T, float* y);

// Dequantises row r of W into out[W.cols] (the embedding lookup).
void dequant_row(const QMatrix& W, int64_t r, float* out);

// Name of the path qmatmul uses on this machine: "avx512", "avx2" or "scalar". The environment
// variable LILY_CPU_SIMD=scalar|avx2|avx512 lowers it (read once; never above what the CPU has).
const char* qmatmul_isa();

// ---- lower-level entry points (tests, benchmarks) ----------------------------------------------
// Best path this CPU supports.
SimdIsa cpu_best_isa();
// The path selected by a LILY_CPU_SIMD value (nullptr or "" = best), clamped to cpu_best_isa().
// Throws lily::Error on an unknown value.
SimdIsa simd_isa_from_env(const char* value);
const char* simd_isa_name(SimdIsa isa);
// The path qmatmul_with actually takes for W when asked for `want`: lower when the CPU lacks
// `want` or when W's shape is outside what the SIMD kernels cover (then the portable path runs).
SimdIsa qmatmul_effective_isa(SimdIsa want, const QMatrix& W);
// qmatmul with an explicit path (clamped as qmatmul_effective_isa says).
void qmatmul_with(SimdIsa isa, const QMatrix& W, const float* x, int T, float* y, ThreadPool& pool);

}  // namespace lily
