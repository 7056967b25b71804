// Internal interface between the qmatmul dispatcher (qmatmul.cpp) and its per-ISA kernels
// (qmatmul_scalar.cpp, qmatmul_avx2.cpp, qmatmul_avx512.cpp).
#pragma once
#include <cstdint>

#include "model/weights.h"

namespace lily::qmm {

// One qmatmul call, prepared once by the dispatcher and shared read-only by every thread.
struct Job {
  QMatrix W;
  int64_t rows = 0, cols = 0;
  int64_t groups = 0;           // affine: cols / group_size
  int T = 0;
  const float* x = nullptr;     // [T, cols] natural order
  // 4-bit SIMD paths: x reordered so that nibble j of the lanes' code words meets contiguous x.
  // Inside a block of 8·L elements (L = SIMD lanes) xp[j·L + l] = x[8·l + j] (permute_x4).
  const float* xp = nullptr;    // [T, cols]
  const float* xsum = nullptr;  // affine: [T, xsum_stride] Σx over each group (the b·Σx term)
  int64_t xsum_stride = 0;
  float* y = nullptr;           // [T, rows]
};

// Floats of per-thread scratch a kernel needs for job j: scales and biases in f32 of up to 4 rows,
// each padded by 32 so a full vector load past the last group stays inside.
inline int64_t scratch_floats(const Job& j) { return 4 * 2 * (j.groups + 32); }

// Each kernel computes y[t0 .. t0+tb, r0 .. r1) with tb <= its kMaxTb.
using RowsFn = void (*)(const Job& j, int64_t r0, int64_t r1, int t0, int tb, float* scratch);

// Token blocks: 4 tokens of 2048 f32 (32 KiB) still fit L1 next to the weights being read.
constexpr int kMaxTbScalar = 4, kMaxTbAvx2 = 4, kMaxTbAvx512 = 4;
void rows_scalar(const Job& j, int64_t r0, int64_t r1, int t0, int tb, float* scratch);
void rows_avx2(const Job& j, int64_t r0, int64_t r1, int t0, int tb, float* scratch);
void rows_avx512(const Job& j, int64_t r0, int64_t r1, int t0, int tb, float* scratch);

// Writes the reordered copy of one token's x[cols] described at Job::xp for SIMD width `lanes`
// (16: blocks of 128, then blocks of 64 laid out as for 8 lanes; 8: blocks of 64). cols % 64 == 0.
void permute_x4(const float* x, int64_t cols, int lanes, float* out);

// Scale or bias i of a row (bf16 or f32 storage).
inline float sb_at(const void* p, bool f32, int64_t i) {
  if (f32) return static_cast<const float*>(p)[i];
  uint32_t u = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

}  // namespace lily::qmm
