// Shared device helpers of the CUDA backend: error checks, plain-old-data weight views, bf16
// conversion, warp reductions and the 4-bit dequantisation trick used by every decode kernel.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "core/common.h"

namespace lily::cuda {

[[noreturn]] void cuda_fail(cudaError_t e, const char* expr, const char* file, int line);

#define CUDA_CHECK(expr)                                                          \
  do {                                                                            \
    cudaError_t e_ = (expr);                                                      \
    if (e_ != cudaSuccess) ::lily::cuda::cuda_fail(e_, #expr, __FILE__, __LINE__); \
  } while (0)
// After every launch: catches bad configurations at once instead of at the next sync.
#define CUDA_LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

// ---- programmatic dependent launch (D3) ----------------------------------------------------
// Kernels launched through launch() may start while the previous kernel in the stream finishes:
// each kernel first lets its own dependents launch (pdl_trigger), may read immutable data (weights),
// and must pass pdl_wait() before touching anything an earlier kernel wrote and before writing.
// Every kernel calls pdl_wait(), so completion stays ordered along the whole stream.
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

bool& pdl_enabled();   // process-wide switch (ablation D3)

template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// Weight types as in model/weights.h (kept numerically identical).
enum : int { kQ4 = 0, kQ8 = 1, kBF = 2, kF32 = 3 };

// A weight matrix in device memory, passed to kernels by value.
struct QMat {
  int type = kF32;
  int rows = 0, cols = 0;
  int gs = 64;
  int sb_f32 = 0;                 // affine scales/biases stored as f32 instead of bf16
  const void* data = nullptr;
  const void* scales = nullptr;
  const void* biases = nullptr;
};

__device__ __forceinline__ float bf16f(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

// Scale or bias `g` of row `r` (bf16 or f32 storage).
__device__ __forceinline__ float qm_sb(const QMat& m, const void* p, int64_t r, int g) {
  int64_t ng = m.cols / m.gs;
  return m.sb_f32 ? static_cast<const float*>(p)[r * ng + g]
                  : bf16f(static_cast<const uint16_t*>(p)[r * ng + g]);
}

// Element (r, k) of any matrix type, dequantised (slow path, used by generic kernels).
__device__ __forceinline__ float qm_at(const QMat& m, int64_t r, int k) {
  switch (m.type) {
    case kQ4: {
      uint32_t w = static_cast<const uint32_t*>(m.data)[r * (m.cols / 8) + k / 8];
      float q = float((w >> (4 * (k & 7))) & 15u);
      return qm_sb(m, m.scales, r, k / m.gs) * q + qm_sb(m, m.biases, r, k / m.gs);
    }
    case kQ8: {
      uint32_t w = static_cast<const uint32_t*>(m.data)[r * (m.cols / 4) + k / 4];
      float q = float((w >> (8 * (k & 3))) & 255u);
      return qm_sb(m, m.scales, r, k / m.gs) * q + qm_sb(m, m.biases, r, k / m.gs);
    }
    case kBF: return bf16f(static_cast<const uint16_t*>(m.data)[r * m.cols + k]);
    default: return static_cast<const float*>(m.data)[r * m.cols + k];
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum; `red` is shared scratch of >= 32 floats. All threads get the result.
__device__ __forceinline__ float block_sum(float v, float* red) {
  int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[wid] = v;
  __syncthreads();
  float s = lane < nw ? red[lane] : 0.f;
  return warp_sum(s);
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + __expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.f + __expf(-x)); }

// ---- 4-bit fast path -----------------------------------------------------------------------
// Nibble k of a word is turned into a float without an int->float conversion: OR-ing the masked
// bits into the mantissa of 2^23 gives exactly 2^23 + q·16^k (k <= 4), so one LOP3 + one FADD per
// element. The matching activation is pre-scaled by 16^-k (exact, a power of two) when x is staged
// in shared memory; nibbles 5..7 reuse the trick on w >> 20.
__host__ __device__ constexpr float nib_prescale(int e) {
  return e == 0 || e == 5 ? 1.f : e == 1 || e == 6 ? 1.f / 16 : e == 2 || e == 7 ? 1.f / 256
         : e == 3 ? 1.f / 4096 : 1.f / 65536;
}

// Σ_e q_e x_e over the 8 nibbles of w, with x pre-scaled (xa = elements 0..3, xb = 4..7).
__device__ __forceinline__ float dot8_q4(uint32_t w, float4 xa, float4 xb) {
  const float M = 8388608.f;
  uint32_t h = w >> 20;
  float acc;
  acc = (__uint_as_float((w & 0x0000000Fu) | 0x4B000000u) - M) * xa.x;
  acc = fmaf(__uint_as_float((w & 0x000000F0u) | 0x4B000000u) - M, xa.y, acc);
  acc = fmaf(__uint_as_float((w & 0x00000F00u) | 0x4B000000u) - M, xa.z, acc);
  acc = fmaf(__uint_as_float((w & 0x0000F000u) | 0x4B000000u) - M, xa.w, acc);
  acc = fmaf(__uint_as_float((w & 0x000F0000u) | 0x4B000000u) - M, xb.x, acc);
  acc = fmaf(__uint_as_float((h & 0x0000000Fu) | 0x4B000000u) - M, xb.y, acc);
  acc = fmaf(__uint_as_float((h & 0x000000F0u) | 0x4B000000u) - M, xb.z, acc);
  acc = fmaf(__uint_as_float((h & 0x00000F00u) | 0x4B000000u) - M, xb.w, acc);
  return acc;
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int f) {
  return f == 0 ? v.x : f == 1 ? v.y : f == 2 ? v.z : v.w;
}

// Stages x (cols floats, cols % 1024 == 0) into shared memory pre-scaled for dot8_q4 and permuted
// so that lane l's f-th float4 of chunk ci sits at [(ci/32)*256 + f*32 + ci%32] (conflict-free
// 16-byte reads), plus the plain sum of each 32-element chunk (bias term of the group-sum trick),
// reduced over the 8 consecutive threads that load one chunk.
__device__ __forceinline__ void stage_x_q4(const float* x, int cols, float4* sm4, float* xsum) {
  for (int idx = threadIdx.x; idx < cols / 4; idx += blockDim.x) {
    float4 v = reinterpret_cast<const float4*>(x)[idx];
    const int ci = idx >> 3, f = idx & 7, h = (f & 1) * 4;
    float s = (v.x + v.y) + (v.z + v.w);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    s += __shfl_xor_sync(0xffffffffu, s, 4);
    if (f == 0) xsum[ci] = s;
    v.x *= nib_prescale(h);
    v.y *= nib_prescale(h + 1);
    v.z *= nib_prescale(h + 2);
    v.w *= nib_prescale(h + 3);
    sm4[(ci >> 5) * 256 + f * 32 + (ci & 31)] = v;
  }
}

// R rows of 4-bit codes (cols = 1024*CPL, bf16 scales/biases, groups of 64) held in registers:
// load() issues every 16-byte load first, dot() then works on x staged by stage_x_q4; lane l owns
// chunks l, l+32, ... of each row. Results are warp-reduced (every lane holds them).
template <int CPL, int R>
struct Q4Rows {
  uint4 w[R][CPL];
  float s[R][CPL], b[R][CPL];

  __device__ __forceinline__ void load(const uint4* const* rp, const uint16_t* const* sp, const uint16_t* const* bp) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        w[r][i] = __ldcs(rp[r] + lane + 32 * i);
        s[r][i] = bf16f(sp[r][(lane + 32 * i) >> 1]);
        b[r][i] = bf16f(bp[r][(lane + 32 * i) >> 1]);
      }
  }
  __device__ __forceinline__ void dot(const float4* sm4, const float* xsum, float* out) const {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; ++r) out[r] = 0.f;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const float xs = xsum[lane + 32 * i];
      float d[R];
#pragma unroll
      for (int r = 0; r < R; ++r) d[r] = 0.f;
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        const float4 xa = sm4[i * 256 + (2 * f) * 32 + lane];
        const float4 xb = sm4[i * 256 + (2 * f + 1) * 32 + lane];
#pragma unroll
        for (int r = 0; r < R; ++r) d[r] += dot8_q4(word_of(w[r][i], f), xa, xb);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) out[r] = fmaf(s[r][i], d[r], fmaf(b[r][i], xs, out[r]));
    }
#pragma unroll
    for (int r = 0; r < R; ++r) out[r] = warp_sum(out[r]);
  }
};

template <int CPL, int R>
__device__ __forceinline__ void q4_dot_rows(const uint4* const* rp, const uint16_t* const* sp,
                                            const uint16_t* const* bp, const float4* sm4,
                                            const float* xsum, float* out) {
  Q4Rows<CPL, R> q;
  q.load(rp, sp, bp);
  q.dot(sm4, xsum, out);
}

}  // namespace lily::cuda
