// Shared device helpers of the CUDA backend: error checks, plain-old-data weight views, bf16
// conversion, warp reductions and the 4-bit dequantisation trick used by every decode kernel.
#pragma once
#include <cuda.h>   // CUtensorMap (TMA; encoded through the runtime's driver entry point, no libcuda link)
#include <cuda_fp16.h>
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

// The SM count of device 0 (the one the backend uses), read once.
inline int sm_count() {
  static const int n = [] {
    int v = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 0));
    return v;
  }();
  return n;
}

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

// ---- D13: L2 prefetch of weights one launch ahead (decode) ---------------------------------
// Up to kMax byte ranges (16-byte aligned, sizes multiples of 16) that a kernel asks L2 to fetch
// with bulk prefetches while it runs, cut into 32 KB pieces spread over the grid's CTAs (lanes of
// warp 0). A hint only: it changes no data (L2 is the point of coherence), so it may be issued
// before pdl_wait() and for any memory that stays allocated.
struct L2Prefetch {
  static constexpr int kMax = 6;
  const void* p[kMax] = {};
  uint32_t bytes[kMax] = {};
  int n = 0;
};

__device__ __forceinline__ void l2_prefetch(const L2Prefetch& pf) {
  if (pf.n == 0 || threadIdx.x >= 32) return;
  constexpr uint32_t kPiece = 32768;
  const uint32_t cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const uint32_t ncta = gridDim.x * gridDim.y * gridDim.z;
  for (int i = 0; i < pf.n && i < L2Prefetch::kMax; ++i) {
    const uint32_t pieces = (pf.bytes[i] + kPiece - 1) / kPiece;
    for (uint32_t k = cta + ncta * threadIdx.x; k < pieces; k += ncta * 32) {
      const char* a = static_cast<const char*>(pf.p[i]) + size_t(k) * kPiece;
      const uint32_t n = min(kPiece, pf.bytes[i] - k * kPiece);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(n) : "memory");
    }
  }
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

// D52: the decode kernels' preloaded affine scales / biases stay raw bf16 bits (the 16-bit load zero-extends
// them into a register) and become floats at their use. Converted at the load instead, the conversion waits for
// the load, and where the load sits in a branch (a row group past the end, the next group of a software
// pipeline, the MoE's routed rows) the warp waits there for DRAM before it goes on. Measured +2.4 % decode at 4K
// (session 18 call 4). Compile-time: -DLILY_SB_EAGER builds the form before D52 (for a two-binary A/B,
// scripts/device/two_binary_ab.sh FLAGS_B=-DLILY_SB_EAGER).
#ifndef LILY_SB_EAGER
using SbReg = uint32_t;
__device__ __forceinline__ SbReg sb_load(const uint16_t* p) { return *p; }
__device__ __forceinline__ float sb_val(SbReg v) { return __uint_as_float(v << 16); }
#else
using SbReg = float;
__device__ __forceinline__ SbReg sb_load(const uint16_t* p) { return bf16f(*p); }
__device__ __forceinline__ float sb_val(SbReg v) { return v; }
#endif

// Scale or bias `g` of row `r` (bf16 or f32 storage).
__device__ __forceinline__ float qm_sb(const QMat& m, const void* p, int64_t r, int g) {
  int64_t ng = m.cols / m.gs;
  return m.sb_f32 ? static_cast<const float*>(p)[r * ng + g]
                  : bf16f(static_cast<const uint16_t*>(p)[r * ng + g]);
}

// P70: element (r, k) of an 8-bit matrix with group size 64 and bf16 scales / biases: qm_at's value (the same fma of
// the same operands) without its generic path (the type switch, three divisions by the runtime group size).
__device__ __forceinline__ float qm_at_q8g64(const QMat& m, int64_t r, int k) {
  const uint32_t w = static_cast<const uint32_t*>(m.data)[r * (m.cols / 4) + k / 4];
  const float q = float((w >> (8 * (k & 3))) & 255u);
  const int64_t g = r * (m.cols >> 6) + (k >> 6);
  return bf16f(static_cast<const uint16_t*>(m.scales)[g]) * q + bf16f(static_cast<const uint16_t*>(m.biases)[g]);
}
// Whether qm_at_q8g64 reads m.
inline bool qm_q8g64(const QMat& m) { return m.type == kQ8 && m.gs == 64 && !m.sb_f32 && m.cols % 64 == 0; }

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

// D9: finishes a folded RMSNorm after the staging barrier: `red` holds one Σx² partial per warp
// (written before that barrier); returns rsqrt(mean x² + eps). When `out` is set the caller's CTA
// also writes out = x · scale · gain (the rmsnorm output, identical to rmsnorm4_kernel's).
__device__ __forceinline__ float fold_norm_scale(const float* red, int nwarps, int n, float eps, const float* x,
                                                 const float* gain, float* out) {
  float t = 0.f;
  for (int i = 0; i < nwarps; ++i) t += red[i];
  const float scale = rsqrtf(t / float(n) + eps);
  if (out)
    for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
      const float4 v = reinterpret_cast<const float4*>(x)[i], g = reinterpret_cast<const float4*>(gain)[i];
      reinterpret_cast<float4*>(out)[i] =
          make_float4(v.x * scale * g.x, v.y * scale * g.y, v.z * scale * g.z, v.w * scale * g.w);
    }
  return scale;
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

// D24: the 8 nibbles of w against 16-bit x, acc + Σ q_j·x_j in int32: the even nibbles as bytes
// (w & 0x0F0F0F0F = n0 n2 n4 n6) and the odd ones ((w >> 4) & 0x0F0F0F0F = n1 n3 n5 n7) meet int16
// pairs in dp2a (lo takes bytes 0-1, hi bytes 2-3); xq = (x0 x2, x1 x3, x4 x6, x5 x7) as int16 pairs.
__device__ __forceinline__ int dot8_q4_i16(uint32_t w, uint4 xq, int acc) {
  constexpr uint32_t M = 0x0F0F0F0Fu;
  const uint32_t lo = w & M, hi = (w >> 4) & M;
  acc = __dp2a_lo(int(xq.x), int(lo), acc);
  acc = __dp2a_lo(int(xq.y), int(hi), acc);
  acc = __dp2a_hi(int(xq.z), int(lo), acc);
  return __dp2a_hi(int(xq.w), int(hi), acc);
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int f) {
  return f == 0 ? v.x : f == 1 ? v.y : f == 2 ? v.z : v.w;
}

// mbarriers in shared memory, one phase per launch (parity 0): D60's pushes complete their bytes on them.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait_parity(uint64_t* bar, int parity) {
  const uint32_t b = smem_addr(bar);
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(b), "r"(parity)
        : "memory");
}

// TMA (sm_90): the box at (column c0, row c1) of a tensor map into shared memory at dst (a shared-window
// address); the copy completes its bytes on the mbarrier at bar (expect_tx first).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
// Host: the tensor map of an fp16 array of `rank` dimensions (dims[0] contiguous; strides[i] = bytes between
// consecutive indices of dimension i + 1, multiples of 16, in any order) read in boxes `box` with the 128-byte
// swizzle (box[0] = 64: 128 bytes); elements out of range read as zeros. Returns the driver's result.
CUresult tma_map_f16_nd(CUtensorMap* m, const void* p, int rank, const uint64_t* dims, const uint64_t* strides,
                        const uint32_t* box);
// The 2-D case, a row-major [rows][inner] array (row stride row_bytes) in boxes of box_inner x box_rows; throws with
// `what` in the message when the driver refuses.
void tma_map_f16(CUtensorMap* m, const void* p, uint64_t inner, uint64_t rows, uint64_t row_bytes, uint32_t box_inner,
                 uint32_t box_rows, const char* what);

constexpr int kTracePhases = 16;   // trace stamps per CTA
constexpr int kTraceCtas = 1024;   // CTAs per traced launch slot
// Investigation aid (cuda_tools::set_kernel_trace): thread 0 of each CTA writes %globaltimer to
// tr[CTA][phase] (kTracePhases per CTA); tr null = off.
__device__ __forceinline__ void trace_stamp(unsigned long long* tr, int phase) {
  if (tr && threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    tr[blockIdx.x * kTracePhases + phase] = t;
  }
}
// The same, taken only once `bits` (a loaded value) has arrived: the timer read is predicated on a compare
// with it, so the warp waits for the load there (an empty asm with the value as input emits no instruction
// and so does not wait).
__device__ __forceinline__ unsigned long long globaltimer_after(uint32_t bits) {
  unsigned long long t;
  asm volatile(
      "{\n.reg .pred p;\nsetp.eq.u32 p, %1, 0x7fc00001;\n@p mov.u64 %0, 0;\n@!p mov.u64 %0, %%globaltimer;\n}"
      : "=l"(t)
      : "r"(bits));
  return t;
}
__device__ __forceinline__ void trace_stamp_after(unsigned long long* tr, int phase, uint32_t bits) {
  if (tr && threadIdx.x == 0) tr[blockIdx.x * kTracePhases + phase] = globaltimer_after(bits);
}
// The same for 2D / 3D grids (CTAs by linear index, the first kTraceCtas).
__device__ __forceinline__ void trace_stamp_nd(unsigned long long* tr, int phase) {
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (tr && threadIdx.x == 0 && cta < unsigned(kTraceCtas)) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    tr[size_t(cta) * kTracePhases + phase] = t;
  }
}
// trace_stamp_after for 2D / 3D grids.
__device__ __forceinline__ void trace_stamp_after_nd(unsigned long long* tr, int phase, uint32_t bits) {
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (tr && threadIdx.x == 0 && cta < unsigned(kTraceCtas))
    tr[size_t(cta) * kTracePhases + phase] = globaltimer_after(bits);
}

// One float4 (4 of the 32 values of a chunk, f = its index 0..7 within the chunk; the chunk's 8
// float4s are held by 8 consecutive lanes) staged for dot8_q4: the chunk's plain sum, reduced over
// those 8 lanes, is written to *sum by the lane with f == 0; the values come back pre-scaled by 16^-k.
__device__ __forceinline__ float4 q4_stage(float4 v, int f, float* sum) {
  const int h = (f & 1) * 4;
  float s = (v.x + v.y) + (v.z + v.w);
  s += __shfl_xor_sync(0xffffffffu, s, 1);
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  s += __shfl_xor_sync(0xffffffffu, s, 4);
  if (f == 0) *sum = s;
  v.x *= nib_prescale(h);
  v.y *= nib_prescale(h + 1);
  v.z *= nib_prescale(h + 2);
  v.w *= nib_prescale(h + 3);
  return v;
}

// A vector of floats held in registers across a block of NT threads: thread t owns float4s
// t, t + NT, ..., t + (NIT-1)·NT. load() issues every load
// before any is used, so staging a vector costs one memory round trip instead of one per loop iteration (the loop
// form waits for each load before the next: 2.6 µs for x in the D19 trace, 2–4 L2 round trips).
template <int NIT, int NT = 256>
struct XRegs {
  float4 v[NIT];
  __device__ __forceinline__ static int index(int k) { return int(threadIdx.x) + NT * k; }
  __device__ __forceinline__ void load(const float* p, int n4) {
#pragma unroll
    for (int k = 0; k < NIT; ++k) {
      const int idx = index(k);
      v[k] = idx < n4 ? reinterpret_cast<const float4*>(p)[idx] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  // D9: v ← g ⊙ v, returning this thread's share of Σv² (taken before the product).
  __device__ __forceinline__ float apply_gain(const XRegs& g) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NIT; ++k) {
      float4& x = v[k];
      ss += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
      x.x *= g.v[k].x;
      x.y *= g.v[k].y;
      x.z *= g.v[k].z;
      x.w *= g.v[k].w;
    }
    return ss;
  }
  // out = scale · v (the folded RMSNorm's output when v holds gain ⊙ x).
  __device__ __forceinline__ void store_scaled(float* out, int n4, float scale) const {
#pragma unroll
    for (int k = 0; k < NIT; ++k) {
      const int idx = index(k);
      if (idx < n4)
        reinterpret_cast<float4*>(out)[idx] = make_float4(v[k].x * scale, v[k].y * scale, v[k].z * scale, v[k].w * scale);
    }
  }
};

// stage_x_q4 (below) from registers: the same layout, cols = 4·NT·NIT at most.
template <int NIT, int NT>
__device__ __forceinline__ void stage_x_q4_regs(const XRegs<NIT, NT>& x, int cols, float4* sm4, float* xsum) {
#pragma unroll
  for (int k = 0; k < NIT; ++k) {
    const int idx = int(threadIdx.x) + NT * k;
    if (idx >= cols / 4) break;   // uniform per warp (cols/4 is a multiple of 32)
    const int ci = idx >> 3, f = idx & 7;
    sm4[(ci >> 5) * 256 + f * 32 + (ci & 31)] = q4_stage(x.v[k], f, xsum + ci);
  }
}

// Stages x (cols floats, cols % 1024 == 0) into shared memory pre-scaled for dot8_q4 and permuted
// so that lane l's f-th float4 of chunk ci sits at [(ci/32)*256 + f*32 + ci%32] (conflict-free
// 16-byte reads), plus the plain sum of each 32-element chunk (bias term of the group-sum trick),
// reduced over the 8 consecutive threads that load one chunk. With `gain` (D9, folded RMSNorm) x
// is staged as gain ⊙ x and the thread's share of Σx² is added to *ss.
__device__ __forceinline__ void stage_x_q4(const float* x, int cols, float4* sm4, float* xsum,
                                           const float* gain = nullptr, float* ss = nullptr) {
  for (int idx = threadIdx.x; idx < cols / 4; idx += blockDim.x) {
    float4 v = reinterpret_cast<const float4*>(x)[idx];
    if (gain) {
      *ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      const float4 g = reinterpret_cast<const float4*>(gain)[idx];
      v.x *= g.x;
      v.y *= g.y;
      v.z *= g.z;
      v.w *= g.w;
    }
    const int ci = idx >> 3, f = idx & 7;
    sm4[(ci >> 5) * 256 + f * 32 + (ci & 31)] = q4_stage(v, f, xsum + ci);
  }
}

// R rows of 4-bit codes (cols = 1024*CPL, bf16 scales/biases, groups of 64) held in registers:
// load() issues every 16-byte load first, dot() then works on x staged by stage_x_q4; lane l owns
// chunks l, l+32, ... of each row. Results are warp-reduced (every lane holds them).
template <int CPL, int R>
struct Q4Rows {
  uint4 w[R][CPL];
  SbReg s[R][CPL], b[R][CPL];   // D52

  __device__ __forceinline__ void load(const uint4* const* rp, const uint16_t* const* sp, const uint16_t* const* bp) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        w[r][i] = __ldcs(rp[r] + lane + 32 * i);
        s[r][i] = sb_load(sp[r] + ((lane + 32 * i) >> 1));
        b[r][i] = sb_load(bp[r] + ((lane + 32 * i) >> 1));
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
      for (int r = 0; r < R; ++r) out[r] = fmaf(sb_val(s[r][i]), d[r], fmaf(sb_val(b[r][i]), xs, out[r]));
    }
#pragma unroll
    for (int r = 0; r < R; ++r) out[r] = warp_sum(out[r]);
  }
  // D24: the same dot products against x as int16 per 32 values (stage_x_i16_regs, dot8_q4_i16): the
  // chunk's integer sum times its step dx is Σ q·x; the bias term uses the exact float sum.
  __device__ __forceinline__ void dot_i16(const uint4* qx, const float* xd, const float* xsum, float* out) const {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; ++r) out[r] = 0.f;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const float xs = xsum[lane + 32 * i], dx = xd[lane + 32 * i];
      uint4 xq[4];
#pragma unroll
      for (int f = 0; f < 4; ++f) xq[f] = qx[(4 * i + f) * 32 + lane];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        int acc = 0;
#pragma unroll
        for (int f = 0; f < 4; ++f) acc = dot8_q4_i16(word_of(w[r][i], f), xq[f], acc);
        out[r] = fmaf(sb_val(s[r][i]), float(acc) * dx, fmaf(sb_val(b[r][i]), xs, out[r]));
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) out[r] = warp_sum(out[r]);
  }
};

// One float4 as int16 at the chunk's scale inv, packed as the two words (q0 q2, q1 q3) of dot8_q4_i16's layout.
__device__ __forceinline__ uint2 q16_pack(float4 v, float inv) {
  const uint32_t q0 = uint32_t(__float2int_rn(v.x * inv)) & 0xFFFFu, q1 = uint32_t(__float2int_rn(v.y * inv)) & 0xFFFFu;
  const uint32_t q2 = uint32_t(__float2int_rn(v.z * inv)) & 0xFFFFu, q3 = uint32_t(__float2int_rn(v.w * inv)) & 0xFFFFu;
  return make_uint2(q0 | (q2 << 16), q1 | (q3 << 16));
}

// D24, one float4 of a 32-value chunk held by 8 consecutive lanes (fi = 0..7: values 4fi..4fi+3):
// dx = max|x| / 32767 over the chunk, q = round(x / dx) as int16. Values 4fi..4fi+3 are 8f + 4·(fi & 1)
// + 0..3 of word f = fi / 2; the lane writes (q0 q2, q1 q3) as one uint2 to words[f] half fi & 1 (words:
// the chunk's 4 uint4s, `stride` uint4s apart). The lane with fi == 0 writes the plain sum and dx.
__device__ __forceinline__ void q16_stage(float4 v, int fi, uint4* words, int stride, float* sum, float* step) {
  float s = (v.x + v.y) + (v.z + v.w);
  float m = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  }
  const float inv = m > 0.f ? 32767.f / m : 0.f;
  reinterpret_cast<uint2*>(words + (fi >> 1) * stride)[fi & 1] = q16_pack(v, inv);
  if (fi == 0) {
    *sum = s;
    *step = m * (1.f / 32767.f);
  }
}

// D63: q16_stage's reductions and scale for one float4 of a chunk held by 8 consecutive lanes; every lane
// ends with the chunk's sum and max (the butterfly adds the same pairs in every lane; a float add is commutative),
// and the division has no branch around it (max(m, smallest denormal) equals m whenever m > 0). Same bits.
__device__ __forceinline__ uint2 q16_lean(float4 v, float& sum, float& m) {
  sum = (v.x + v.y) + (v.z + v.w);
  m = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  }
  const float q = 32767.f / fmaxf(m, __uint_as_float(1u));
  return q16_pack(v, m > 0.f ? q : 0.f);
}

// 16-bit staging (256 threads, x in registers) for Q4Rows::dot_i16: chunk ci's word f at
// qx[((ci / 32)·4 + f)·32 + ci % 32], its step dx at xd[ci], its plain sum at xsum[ci].
template <int NIT>
__device__ __forceinline__ void stage_x_i16_regs(const XRegs<NIT>& x, int cols, uint4* qx, float* xd, float* xsum) {
#pragma unroll
  for (int k = 0; k < NIT; ++k) {
    const int idx = int(threadIdx.x) + 256 * k;
    if (idx >= cols / 4) break;   // uniform per warp
    const int ci = idx >> 3;
    q16_stage(x.v[k], idx & 7, qx + (ci >> 5) * 128 + (ci & 31), 32, xsum + ci, xd + ci);
  }
}

// D89 (default on; session 37: +0.3 % at 4K alone, +1.6 % with D90): stage_x_i16_regs with the float4s'
// reductions interleaved. q16_stage per float4 is a chain of 3 shuffle levels, then an IEEE division whose
// slow-path branch keeps the compiler from overlapping the next float4's chain with it (the SASS ran the chains
// one after the other). Here every float4's sum and max go through the same butterflies level by level, all
// chains at once; each value is computed exactly as in q16_stage (same bits). DF (D90, default on: +1.2 % at 4K):
// the scale as __fdividef (approximate reciprocal, no slow path; bits may differ by one int16 step in rare
// roundings). Thread t of nt holds float4s t + nt·k (k < NIT) of n4; a float4 past n4 must be uniform per warp
// (its lanes still shuffle, nothing is written).
template <int NIT, bool DF>
__device__ __forceinline__ void q16_stage_il(const float4 (&v)[NIT], int t, int nt, int n4, uint4* qx, float* xd,
                                             float* xsum) {
  float s[NIT], m[NIT];
#pragma unroll
  for (int k = 0; k < NIT; ++k) {
    s[k] = (v[k].x + v[k].y) + (v[k].z + v[k].w);
    m[k] = fmaxf(fmaxf(fabsf(v[k].x), fabsf(v[k].y)), fmaxf(fabsf(v[k].z), fabsf(v[k].w)));
  }
#pragma unroll
  for (int o = 1; o < 8; o <<= 1)
#pragma unroll
    for (int k = 0; k < NIT; ++k) {
      s[k] += __shfl_xor_sync(0xffffffffu, s[k], o);
      m[k] = fmaxf(m[k], __shfl_xor_sync(0xffffffffu, m[k], o));
    }
  float inv[NIT];
#pragma unroll
  for (int k = 0; k < NIT; ++k) inv[k] = m[k] > 0.f ? (DF ? __fdividef(32767.f, m[k]) : 32767.f / m[k]) : 0.f;
#pragma unroll
  for (int k = 0; k < NIT; ++k) {
    const int idx = t + nt * k;
    if (idx >= n4) break;   // uniform per warp
    const int ci = idx >> 3, fi = idx & 7;
    uint4* words = qx + (ci >> 5) * 128 + (ci & 31);
    reinterpret_cast<uint2*>(words + (fi >> 1) * 32)[fi & 1] = q16_pack(v[k], inv[k]);
    if (fi == 0) {
      xsum[ci] = s[k];
      xd[ci] = m[k] * (1.f / 32767.f);
    }
  }
}
template <int NIT, bool DF>
__device__ __forceinline__ void stage_x_i16_regs_il(const XRegs<NIT>& x, int cols, uint4* qx, float* xd, float* xsum) {
  q16_stage_il<NIT, DF>(x.v, int(threadIdx.x), 256, cols / 4, qx, xd, xsum);
}

template <int CPL, int R>
__device__ __forceinline__ void q4_dot_rows(const uint4* const* rp, const uint16_t* const* sp,
                                            const uint16_t* const* bp, const float4* sm4,
                                            const float* xsum, float* out) {
  Q4Rows<CPL, R> q;
  q.load(rp, sp, bp);
  q.dot(sm4, xsum, out);
}

// ---- 4-bit tensor-core path (D1m) ----------------------------------------------------------
// Process-wide switch: the mma.sync kernels below or the f44444c FFMA kernels (ablation D1m).
// Measured on the H200 (docs/CUDA.md): mma wins only for the large lm_head GEMV, so by default it
// is used there alone; LILY_MMA_Q4=all in the environment routes every 4-bit decode GEMV and both
// MoE expert kernels through it (validated by cuda-check, 5% slower per step as tuned today).
bool& mma_q4_enabled();
bool mma_q4_all();
constexpr int kMmaMinRows = 32768;   // default scope: GEMVs with at least this many rows

// A warp computes a 16-row tile with mma.sync m16n8k16 (f16 in, f32 accumulate): lane 4g+t holds
// words 2t, 2t+1 of each 64-column group of rows g and g+8 (one 8-byte load per row and group, one
// 32-byte sector per row per quarter-warp). A word's 8 nibbles become 4 exact f16 pairs with two
// LOP3s to 0x6400|q (1024 + q or 1024 + 16q) and one HSUB2 each, so a word costs 9 instructions +
// half an mma instead of ~25 FFMA-path instructions. The k order inside an mma is a permutation of
// the columns; x is staged in exactly that order as the B operand. B column 0 carries fp16(x·f)
// and column 1 the rounding remainder, so c0 + c1 keeps ~22 bits of x; f = 2^k per group keeps
// the group's largest |x| in [2^14, 2^15) (no f16 overflow, no flush of small values), undone in
// fp32. Scales/biases are applied per group in fp32 with the group-sum identity
// Σ(s·q + b)·x = s·Σq·x + b·Σx.
__device__ __forceinline__ uint32_t pack_f16_split(float a, float b, bool remainder) {
  __half ha = __float2half_rn(a), hb = __float2half_rn(b);
  if (remainder) {
    ha = __float2half_rn(a - __half2float(ha));
    hb = __float2half_rn(b - __half2float(hb));
  }
  return uint32_t(__half_as_ushort(ha)) | (uint32_t(__half_as_ushort(hb)) << 16);
}

// Stages one 64-column group of x (called by a whole warp) as B fragments: 64 words at
// smB[p*32 + l*4 + q] for B-holding lane l < 8 (column l>>2: 0 value, 1 remainder; t = l&3), word
// pair j = p and q = (h << 1 | odd) with h the nibble shift (0 or 8 bits), odd the 16-scaled nibble
// of the pair. *gsum = Σx of the group, *ginv = 1/f.
__device__ __forceinline__ void stage_group_mma(const float* xg, uint32_t* smB, float* gsum, float* ginv) {
  const int lane = threadIdx.x & 31;
  const float2 v = reinterpret_cast<const float2*>(xg)[lane];
  float s = v.x + v.y, m = fmaxf(fabsf(v.x), fabsf(v.y));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  }
  const int e = int((__float_as_uint(m) >> 23) & 255u) - 127;   // floor(log2 m) for normal m
  const int k = m > 0.f ? min(max(14 - e, -126), 126) : 0;
  const float f = __uint_as_float(uint32_t(k + 127) << 23);
  if (lane == 0) {
    *gsum = s;
    *ginv = __uint_as_float(uint32_t(127 - k) << 23);
  }
#pragma unroll
  for (int u = 2 * lane; u < 2 * lane + 2; ++u) {
    const int p = u >> 5, l = (u >> 2) & 7, q = u & 3;
    const int h = q >> 1, odd = q & 1, t = l & 3;
    const int c = (2 * t + p) * 8 + 2 * h + odd;
    const float sc = odd ? f * (1.f / 16) : f;
    smB[u] = pack_f16_split(xg[c] * sc, xg[c + 4] * sc, (l >> 2) != 0);
  }
}

// All of x (cols % 64 == 0), every warp taking whole groups.
__device__ __forceinline__ void stage_x_mma(const float* x, int cols, uint32_t* smB, float* gsum, float* ginv) {
  const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int G = warp; G < cols / 64; G += nw) stage_group_mma(x + int64_t(G) * 64, smB + G * 64, gsum + G, ginv + G);
}

__device__ __forceinline__ uint32_t f16x2_minus_1024(uint32_t v) {
  uint32_t r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(0x64006400u));
  return r;
}

__device__ __forceinline__ void mma_16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two rows (g and g+8 of the tile) over groups [G0, G0 + ng) in batches of 4 groups (ng % 4 == 0),
// the next batch's loads in flight while one is computed. w: the row's codes as uint2 (4 per
// group), s/b: the row's bf16 scales/biases (8-byte aligned at every 4th group). On return lanes
// with t == 0 hold the partial dot products of rows g (acc0) and g+8 (acc1).
struct MmaQ4Batch {
  uint2 w[2][4];
  uint2 s[2], b[2];
};

__device__ __forceinline__ void mma_q4_load(MmaQ4Batch& q, const uint2* w0, const uint2* w1, const uint16_t* s0,
                                            const uint16_t* s1, const uint16_t* b0, const uint16_t* b1, int G) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    q.w[0][i] = __ldcs(w0 + (G + i) * 4 + t);
    q.w[1][i] = __ldcs(w1 + (G + i) * 4 + t);
  }
  q.s[0] = *reinterpret_cast<const uint2*>(s0 + G);
  q.s[1] = *reinterpret_cast<const uint2*>(s1 + G);
  q.b[0] = *reinterpret_cast<const uint2*>(b0 + G);
  q.b[1] = *reinterpret_cast<const uint2*>(b1 + G);
}

__device__ __forceinline__ float bf16_of(uint2 v, int i) {
  const uint32_t u = i < 2 ? v.x : v.y;
  return __uint_as_float(i & 1 ? (u & 0xFFFF0000u) : (u << 16));
}

__device__ __forceinline__ void mma_q4_compute(const MmaQ4Batch& q, int G, const uint4* smB4, const float* gsum,
                                               const float* ginv, float& acc0, float& acc1) {
  const int l8 = threadIdx.x & 7;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 B[2] = {smB4[(G + i) * 16 + l8], smB4[(G + i) * 16 + 8 + l8]};
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint32_t wa = j ? q.w[0][i].y : q.w[0][i].x, wb = j ? q.w[1][i].y : q.w[1][i].x;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t xa = h ? wa >> 8 : wa, xb = h ? wb >> 8 : wb;
        mma_16816(c, f16x2_minus_1024((xa & 0x000F000Fu) | 0x64006400u),
                  f16x2_minus_1024((xb & 0x000F000Fu) | 0x64006400u),
                  f16x2_minus_1024((xa & 0x00F000F0u) | 0x64006400u),
                  f16x2_minus_1024((xb & 0x00F000F0u) | 0x64006400u), h ? B[j].z : B[j].x, h ? B[j].w : B[j].y);
      }
    }
    const float gi = ginv[G + i], gs = gsum[G + i];
    acc0 = fmaf(bf16_of(q.s[0], i), (c[0] + c[1]) * gi, fmaf(bf16_of(q.b[0], i), gs, acc0));
    acc1 = fmaf(bf16_of(q.s[1], i), (c[2] + c[3]) * gi, fmaf(bf16_of(q.b[1], i), gs, acc1));
  }
}

__device__ __forceinline__ void mma_q4_rows(const uint2* w0, const uint2* w1, const uint16_t* s0, const uint16_t* s1,
                                            const uint16_t* b0, const uint16_t* b1, int G0, int ng,
                                            const uint32_t* smB, const float* gsum, const float* ginv,
                                            float& acc0, float& acc1) {
  const uint4* smB4 = reinterpret_cast<const uint4*>(smB);
  MmaQ4Batch cur;
  mma_q4_load(cur, w0, w1, s0, s1, b0, b1, G0);
  for (int G = G0; G < G0 + ng; G += 4) {
    MmaQ4Batch nxt;
    if (G + 4 < G0 + ng) mma_q4_load(nxt, w0, w1, s0, s1, b0, b1, G + 4);
    mma_q4_compute(cur, G, smB4, gsum, ginv, acc0, acc1);
    cur = nxt;
  }
}

// Smallest power-of-two K split (warps of a CTA sharing one tile, <= 8) that gives `want` CTAs
// for `tiles` 16-row tiles, with every warp getting whole 4-group batches of every job.
inline int mma_k_split(int64_t tiles, int ng_gcd4, int want) {
  int ks = 1;
  while (ks < 8 && ng_gcd4 % (2 * ks) == 0 && (tiles * ks + 7) / 8 < want) ks *= 2;
  return ks;
}

// fp16 with saturation at ±65504 (a finite value never becomes inf; NaN stays NaN), as the fp16 KV cache.
__device__ __forceinline__ __half sat_half(float x) {
  return __float2half_rn(fabsf(x) > 65504.f ? copysignf(65504.f, x) : x);
}

// The prefill MoE's (token, slot) rows [T·K routed rows, then T shared-expert rows] of H values, f32 or (P16)
// fp16, and their sum for token t at float4 index h4 (H4 = H / 4): the shared row, then the routed rows
// k = 0..K-1 in order. One definition for moe_combine_kernel and P59's fused norm, so both add in the same order.
__device__ __forceinline__ float4 slot4(const float4* s, int64_t i) { return s[i]; }
__device__ __forceinline__ float4 slot4(const uint2* s, int64_t i) {
  const uint2 u = s[i];
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
template <typename S>
__device__ __forceinline__ float4 slot_sum4(const S* __restrict__ slot, int T, int K, int H4, int64_t t, int64_t h4) {
  float4 v = slot4(slot, (int64_t(T) * K + t) * H4 + h4);
  for (int k = 0; k < K; ++k) {
    const float4 r = slot4(slot, (t * K + k) * H4 + h4);
    v.x += r.x;
    v.y += r.y;
    v.z += r.z;
    v.w += r.w;
  }
  return v;
}

}  // namespace lily::cuda
