// Gated attention core: fused q/k preparation (D4c: per-head query/gate split, zero-centred norms,
// partial RoPE, KV append), a split-KV decode kernel (D7) in which one CTA serves all query heads
// of a KV head from a single coalesced pass over the cache (D5, D6), and the merge of the partial
// softmaxes that also applies the sigmoid output gate. The cache is f32 or fp16 (D18, KvType): the
// prep kernel writes either, the split kernel reads either with the same warp-contiguous rows.
#include <cuda_fp16.h>

#include <cfloat>
#include <utility>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/prefill_attn.h"

namespace lily::cuda {

namespace {

__device__ __forceinline__ int cur_pos(int pos0, const int32_t* pos_dev) { return pos_dev ? *pos_dev : pos0; }

// Positions per split: the grid is fixed (a captured step replays at any length), so the cache
// [0, len) is cut into at most `splits` slices of at least d.min_chunk positions (D41: 64, one
// 16-position step for each of the D20 kernel's 4 warps; off: 32); CTAs past the end exit at once.
__device__ __forceinline__ int split_chunk(int len, int splits, int min_chunk) {
  return max(min_chunk, (len + splits - 1) / splits);
}

// ---- cache elements: f32 or fp16 ------------------------------------------------------------
// fp16 stores saturate at ±65504 (a value past the fp16 range becomes the largest finite one
// instead of inf, which would turn a softmax into NaN); NaN stays NaN so that a bug stays visible.
__device__ __forceinline__ void kv_store(float* p, float x) { *p = x; }
__device__ __forceinline__ void kv_store(__half* p, float x) {
  *p = __float2half_rn(fabsf(x) > 65504.f ? copysignf(65504.f, x) : x);
}
__device__ __forceinline__ float2 h2f(uint32_t u) {
  __half2 h;
  *reinterpret_cast<uint32_t*>(&h) = u;
  return __half22float2(h);
}
// N consecutive cache elements (p aligned to N elements) into out[0..N), streaming loads: one
// vector load per lane, so a warp reads 32·N contiguous elements (f32 N=8: 1 KiB; fp16: 512 B).
template <int N>
__device__ __forceinline__ void kv_load(const float* p, float* out) {
  if constexpr (N == 2) {
    const float2 a = __ldcs(reinterpret_cast<const float2*>(p));
    out[0] = a.x; out[1] = a.y;
  } else {
#pragma unroll
    for (int e = 0; e < N; e += 4) {
      const float4 a = __ldcs(reinterpret_cast<const float4*>(p + e));
      out[e] = a.x; out[e + 1] = a.y; out[e + 2] = a.z; out[e + 3] = a.w;
    }
  }
}
template <int N>
__device__ __forceinline__ void kv_load(const __half* p, float* out) {
  static_assert(N == 2 || N == 4 || N == 8, "kv_load: 2, 4 or 8 fp16 per lane");
  uint32_t w[N / 2];
  if constexpr (N == 8) {
    const uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
    w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w;
  } else if constexpr (N == 4) {
    const uint2 u = __ldcs(reinterpret_cast<const uint2*>(p));
    w[0] = u.x; w[1] = u.y;
  } else {
    w[0] = __ldcs(reinterpret_cast<const unsigned int*>(p));
  }
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float2 f = h2f(w[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// N consecutive fp16 cache elements as N/2 raw half2 words (converted where used, U4 below).
template <int N>
__device__ __forceinline__ void kv_load_raw(const __half* p, uint32_t* w) {
  static_assert(N == 4 || N == 8, "kv_load_raw: 4 or 8 fp16 per lane");
  if constexpr (N == 8) {
    const uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
    w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w;
  } else {
    const uint2 u = __ldcs(reinterpret_cast<const uint2*>(p));
    w[0] = u.x; w[1] = u.y;
  }
}

// grid (heads + kv_heads, T), block head_dim threads. Queries go to qbuf [T, heads, hd]
// (normalised, rotated, pre-multiplied by 1/sqrt(hd)); keys and values to the cache rows.
template <typename KV>
__global__ void attn_prep_kernel(AttnDims d, const float* qn, const float* kn, KV* kc, KV* vc,
                                 int pos0, const int32_t* pos_dev, const float* q, const float* k,
                                 const float* v, float* qbuf, const __grid_constant__ L2Prefetch pf) {
  extern __shared__ float sm[];   // [hd] + red[32]
  float* red = sm + d.head_dim;
  pdl_trigger();
  l2_prefetch(pf);   // D13: the next launch's weights (o_proj)
  pdl_wait();
  const int h = blockIdx.x, t = blockIdx.y, i = threadIdx.x, hd = d.head_dim;
  const int pos = cur_pos(pos0, pos_dev) + t;
  const bool is_q = h < d.heads;
  const int kvh = h - d.heads;
  const float* src = is_q ? q + (int64_t(t) * d.heads + h) * 2 * hd
                          : k + (int64_t(t) * d.kv_heads + kvh) * hd;
  const float x = src[i];
  const float ss = block_sum(x * x, red);
  sm[i] = x * rsqrtf(ss / float(hd) + d.eps) * (is_q ? qn[i] : kn[i]);
  __syncthreads();
  float outv = sm[i];
  const int half = d.rot_dim / 2;
  if (i < d.rot_dim) {
    const int p = i < half ? i : i - half;
    const float inv = powf(d.theta, -float(2 * p) / float(d.rot_dim));
    float sn, cs;
    sincosf(float(pos) * inv, &sn, &cs);
    outv = i < half ? sm[i] * cs - sm[i + half] * sn : sm[i] * cs + sm[i - half] * sn;
  }
  if (is_q) {
    qbuf[(int64_t(t) * d.heads + h) * hd + i] = outv * rsqrtf(float(hd));
  } else if (pos < d.capacity) {
    const int64_t row = (int64_t(pos) * d.kv_heads + kvh) * hd;
    kv_store(kc + row + i, outv);
    kv_store(vc + row + i, v[(int64_t(t) * d.kv_heads + kvh) * hd + i]);
  }
}

// The slice [lo, hi) of the cache that split `blockIdx.x` of token t covers, and where its partials
// go ([T, heads, splits, hd + 2] from head h0). An empty slice writes l = 0 for its HPB heads.
struct SplitSlice {
  int lo, hi;
  float* pbase;
  int64_t hstride;
};
// The positions [lo, hi) of split `blockIdx.x` of token t (no side effects).
__device__ __forceinline__ int2 split_bounds(const AttnDims& d, int pos0, const int32_t* pos_dev, int t) {
  const int len = min(cur_pos(pos0, pos_dev) + t + 1, d.capacity);
  const int chunk = split_chunk(len, int(gridDim.x), d.min_chunk);
  const int lo = int(blockIdx.x) * chunk;
  return make_int2(lo, min(len, lo + chunk));
}
template <int HPB>
__device__ __forceinline__ SplitSlice split_slice(const AttnDims& d, int pos0, const int32_t* pos_dev, int t, int h0,
                                                  int hd, float* part) {
  const int splits = gridDim.x, split = blockIdx.x;
  const int2 b = split_bounds(d, pos0, pos_dev, t);
  SplitSlice sl;
  sl.lo = b.x;
  sl.hi = b.y;
  sl.pbase = part + ((int64_t(t) * d.heads + h0) * splits + split) * (hd + 2);
  sl.hstride = int64_t(splits) * (hd + 2);
  if (sl.lo >= sl.hi && threadIdx.x < HPB) sl.pbase[threadIdx.x * sl.hstride + hd + 1] = 0.f;   // l = 0
  return sl;
}
// After a block barrier: combines the NW warps' (acc [NW][HPB][hd], (m, l) [NW][HPB][2]) of the
// block into the slice's partials (Σ p·v, m, l per head).
template <int NW, int HPB>
__device__ __forceinline__ void combine_warps(const float* sacc, const float* sml, int hd, const SplitSlice& sl) {
  for (int idx = threadIdx.x; idx < HPB * hd; idx += blockDim.x) {
    const int h = idx / hd, e = idx % hd;
    float M = -FLT_MAX;
    for (int w = 0; w < NW; ++w) M = fmaxf(M, sml[(w * HPB + h) * 2]);
    float L = 0.f, A = 0.f;
    for (int w = 0; w < NW; ++w) {
      const float f = exp2f(sml[(w * HPB + h) * 2] - M);
      L = fmaf(sml[(w * HPB + h) * 2 + 1], f, L);
      A = fmaf(sacc[(w * HPB + h) * hd + e], f, A);
    }
    float* pb = sl.pbase + h * sl.hstride;
    pb[e] = A;
    if (e == 0) {
      pb[hd] = M;
      pb[hd + 1] = L;
    }
  }
}
// D66: combine_warps with 4 consecutive dims per thread (float4 reads of the warps' sums, two float2 stores:
// hd + 2 is even) so that a head's max, weights and l are computed once per 4 dims instead of once per dim.
// The same operations in the same order per dim as combine_warps: the same bits.
template <int NW, int HPB, int HD>
__device__ __forceinline__ void combine_warps_v4(const float* sacc, const float* sml, const SplitSlice& sl) {
  static_assert(HD % 4 == 0, "4 dims per thread");
  for (int i4 = threadIdx.x; i4 < HPB * HD / 4; i4 += blockDim.x) {
    const int h = 4 * i4 / HD, e = 4 * i4 % HD;
    float M = -FLT_MAX;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, sml[(w * HPB + h) * 2]);
    float L = 0.f, A0 = 0.f, A1 = 0.f, A2 = 0.f, A3 = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float f = exp2f(sml[(w * HPB + h) * 2] - M);
      L = fmaf(sml[(w * HPB + h) * 2 + 1], f, L);
      const float4 a = *reinterpret_cast<const float4*>(sacc + (w * HPB + h) * HD + e);
      A0 = fmaf(a.x, f, A0);
      A1 = fmaf(a.y, f, A1);
      A2 = fmaf(a.z, f, A2);
      A3 = fmaf(a.w, f, A3);
    }
    float* pb = sl.pbase + h * sl.hstride;
    *reinterpret_cast<float2*>(pb + e) = make_float2(A0, A1);
    *reinterpret_cast<float2*>(pb + e + 2) = make_float2(A2, A3);
    if (e == 0) {
      pb[HD] = M;
      pb[HD + 1] = L;
    }
  }
}

// Partial softmax of HPB query heads over one slice of the cache. grid (splits, kv_heads*G/HPB, T),
// 8 warps; a warp takes every 8th position of the slice, lanes hold DPL consecutive dims.
// Partials: [T, heads, splits, hd + 2] = (Σ p·v, m, l) with m the running max (log2 domain).
// U4 (opt-in, LILY_ATTN_KV16_U4=1, fp16 cache only): a warp takes 4 positions per iteration (p, p+8,
// p+16, p+24, stride 32) instead of 2, kept as raw half2 words (the same 32 registers as 2 f32 rows)
// and converted where used: twice the bytes in flight per warp, at the cost of converting K and V
// once per head. ptxas (sm_90a, hd 256, 8 heads per CTA): 332 B of spill stores vs 60 B for the
// 2-position fp16 loop (76 B for f32), so it is off by default until measured.
template <int DPL, int HPB, typename KV, bool U4 = false>
__global__ void __launch_bounds__(256, 2) attn_split_kernel(AttnDims d, const KV* kc, const KV* vc,
                                                         int pos0, const int32_t* pos_dev,
                                                         const float* qbuf, float* part) {
  extern __shared__ float sm[];   // [8 warps][HPB][hd] acc, then [8][HPB] m and l, then q [HPB][hd]
  constexpr int hd = DPL * 32;
  pdl_trigger();
  pdl_wait();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.z;
  const int G = d.heads / d.kv_heads;
  const int h0 = blockIdx.y * HPB, kvh = h0 / G;
  const SplitSlice sl = split_slice<HPB>(d, pos0, pos_dev, t, h0, hd, part);
  const int lo = sl.lo, hi = sl.hi;
  if (lo >= hi) return;
  // Queries live in shared memory (registers go to the cache rows in flight): [h][e/4][lane] float4.
  const float kLog2e = 1.4426950408889634f;
  float4* q4 = reinterpret_cast<float4*>(sm + 8 * HPB * hd + 16 * HPB);
  for (int i = threadIdx.x; i < HPB * hd / 4; i += blockDim.x) {
    const int h = i / (hd / 4), r = i % (hd / 4), ln = r / (DPL / 4), e4 = r % (DPL / 4);
    float4 v = reinterpret_cast<const float4*>(qbuf + (int64_t(t) * d.heads + h0 + h) * hd)[r];
    v.x *= kLog2e;
    v.y *= kLog2e;
    v.z *= kLog2e;
    v.w *= kLog2e;
    q4[(h * (DPL / 4) + e4) * 32 + ln] = v;
  }
  __syncthreads();
  float m[HPB], l[HPB], acc[HPB][DPL];
#pragma unroll
  for (int h = 0; h < HPB; ++h) {
    m[h] = -FLT_MAX;
    l[h] = 0.f;
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[h][e] = 0.f;
  }
  const int64_t rs = int64_t(d.kv_heads) * hd;
  const KV* kb = kc + int64_t(kvh) * hd + lane * DPL;
  const KV* vb = vc + int64_t(kvh) * hd + lane * DPL;
  if constexpr (U4) {
    static_assert(sizeof(KV) == 2 && DPL >= 4, "U4: fp16 cache, 4 or 8 dims per lane");
    constexpr int U = 4, W = DPL / 2;   // W: half2 words per lane and row
    for (int p = lo + warp; p < hi; p += 8 * U) {
      uint32_t kw[U][W], vw[U][W];
      bool ok[U];   // warp-uniform (p is): shuffles below run on full warps
#pragma unroll
      for (int u = 0; u < U; ++u) {
        ok[u] = p + 8 * u < hi;
        const int pp = ok[u] ? p + 8 * u : p;   // a valid row; its weight is 0 below
        kv_load_raw<DPL>(kb + pp * rs, kw[u]);
        kv_load_raw<DPL>(vb + pp * rs, vw[u]);
      }
#pragma unroll
      for (int h = 0; h < HPB; ++h) {
        float sc[U];
#pragma unroll
        for (int u = 0; u < U; ++u) sc[u] = 0.f;
#pragma unroll
        for (int e4 = 0; e4 < DPL / 4; ++e4) {
          const float4 qv = q4[(h * (DPL / 4) + e4) * 32 + lane];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const float2 a = h2f(kw[u][2 * e4]), b = h2f(kw[u][2 * e4 + 1]);
            sc[u] = fmaf(qv.x, a.x, fmaf(qv.y, a.y, fmaf(qv.z, b.x, fmaf(qv.w, b.y, sc[u]))));
          }
        }
        float mn = m[h];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          sc[u] = ok[u] ? warp_sum(sc[u]) : -FLT_MAX;
          mn = fmaxf(mn, sc[u]);
        }
        const float corr = exp2f(m[h] - mn);
        float pu[U], psum = 0.f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          pu[u] = ok[u] ? exp2f(sc[u] - mn) : 0.f;
          psum += pu[u];
        }
        m[h] = mn;
        l[h] = fmaf(l[h], corr, psum);
#pragma unroll
        for (int w = 0; w < W; ++w) {
          float a0 = 0.f, a1 = 0.f;
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const float2 f = h2f(vw[u][w]);
            a0 = fmaf(pu[u], f.x, a0);
            a1 = fmaf(pu[u], f.y, a1);
          }
          acc[h][2 * w] = fmaf(acc[h][2 * w], corr, a0);
          acc[h][2 * w + 1] = fmaf(acc[h][2 * w + 1], corr, a1);
        }
      }
    }
  } else
  for (int p = lo + warp; p < hi; p += 16) {
    const bool two = p + 8 < hi;
    float kr[2][DPL], vr[2][DPL];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int pp = u == 0 || two ? p + 8 * u : p;
      kv_load<DPL>(kb + pp * rs, kr[u]);
      kv_load<DPL>(vb + pp * rs, vr[u]);
    }
#pragma unroll
    for (int h = 0; h < HPB; ++h) {
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int e4 = 0; e4 < DPL / 4; ++e4) {
        const float4 qv = q4[(h * (DPL / 4) + e4) * 32 + lane];
        s0 = fmaf(qv.x, kr[0][4 * e4], fmaf(qv.y, kr[0][4 * e4 + 1], fmaf(qv.z, kr[0][4 * e4 + 2], fmaf(qv.w, kr[0][4 * e4 + 3], s0))));
        s1 = fmaf(qv.x, kr[1][4 * e4], fmaf(qv.y, kr[1][4 * e4 + 1], fmaf(qv.z, kr[1][4 * e4 + 2], fmaf(qv.w, kr[1][4 * e4 + 3], s1))));
      }
      s0 = warp_sum(s0);
      s1 = two ? warp_sum(s1) : -FLT_MAX;
      const float mn = fmaxf(m[h], fmaxf(s0, s1));
      const float corr = exp2f(m[h] - mn), p0 = exp2f(s0 - mn), p1 = two ? exp2f(s1 - mn) : 0.f;
      m[h] = mn;
      l[h] = fmaf(l[h], corr, p0 + p1);
#pragma unroll
      for (int e = 0; e < DPL; ++e) acc[h][e] = fmaf(acc[h][e], corr, fmaf(p0, vr[0][e], p1 * vr[1][e]));
    }
  }
  // Combine the 8 warps of the block.
  float* sacc = sm;
  float* sml = sm + 8 * HPB * hd;
#pragma unroll
  for (int h = 0; h < HPB; ++h) {
#pragma unroll
    for (int e = 0; e < DPL; ++e) sacc[(warp * HPB + h) * hd + lane * DPL + e] = acc[h][e];
    if (lane == 0) {
      sml[(warp * HPB + h) * 2] = m[h];
      sml[(warp * HPB + h) * 2 + 1] = l[h];
    }
  }
  __syncthreads();
  combine_warps<8, HPB>(sacc, sml, hd, sl);
}

// ---- D20: tensor-core split-KV decode (fp16 cache, head_dim 256, 8 query heads per KV head) ----
// The same slices and partials as attn_split_kernel<8, 8, __half> (so the merge kernels are shared),
// but the per-position dot products and the P·V sums run on mma.sync m16n8k16 (fp16 in, f32
// accumulate) instead of FMAs plus a 5-shuffle reduction per position and head. A warp takes 16
// positions per step:
//   S^T[16 pos][8 heads] = K[16 pos][256] · Q^T     (16 k-steps; A = K rows straight from the cache)
//   O^T[256][8 heads]  += V^T[256][16 pos] · P^T     (16 m-tiles; A = V^T built from 4 cache rows)
// The 256 dims may be visited in any order as long as the two operands agree, so each lane's
// fragment elements are chosen to be contiguous in memory (16-byte loads, whole sectors per warp):
//   S: logical dim (ks, 2t+j) -> 32(ks/2) + 8t + 4(ks%2) + j, (ks, 2t+8+j) -> the same + 2;
//   O: output row (mt, g) -> 64(mt/4) + 8g + 2(mt%4), row (mt, g+8) -> that + 1,
// with g = lane/4, t = lane%4 (the PTX fragment coordinates). P leaves the S^T accumulators as fp16
// pairs and becomes the B operand of the second product through movmatrix.trans (one per 8 positions).
// Softmax in the log2 domain as in attn_split_kernel (q pre-scaled by log2 e here). 4 warps per CTA
// (~190 registers per lane: 2 CTAs per SM, the grid of the FMA kernel stays one wave).
constexpr int kMmaDecWarps = 4;

__device__ __forceinline__ void mma_f16_16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t u4w(const uint4& u, int i) { return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w; }

// PM, the load schedule (D25): 0 (D25 off) = K rows, S, then the V rows; 1 = the V rows issued with the
// K rows (one DRAM round trip per step instead of two); 2 (default) = as 1, and the next step's K rows
// issued as soon as the S product has consumed this step's (K one step ahead; 255 registers, no spills).
// Measured (session 6): mode 1 +0.1 / +0.1 / +0.4 %, mode 2 +0.4 / +0.8 / +1.1 % at 4K / 32K / 128K.
// D28 (T == 1, rot_dim 64): the prep kernel's work done by the split CTAs themselves. Each CTA
// normalises and rotates the queries of its 8 heads (RMSNorm with q_norm, partial RoPE, 1/sqrt(hd))
// into shared memory (warp w: heads 2w, 2w+1, lane l: dims l + 32j, so each RoPE pair (l, l + 32)
// sits in one lane), and the CTA whose slice holds the new position appends its k (normalised,
// rotated) and v to the cache before any warp reads it. One kernel boundary fewer per attention
// layer; every CTA repeats the 8 heads' query preparation (8 KB read, a few hundred instructions).
struct AttnPrepArgs {
  const float *q, *k, *v, *qn, *kn;   // projections [heads][2hd] (query | gate), [kv][hd], [kv][hd]; norm weights
  __half *kc, *vc;                    // the cache (written at the new position)
  L2Prefetch pf;                      // D13: the next launch's weights (o_proj), as the prep kernel did
  int kv_prefetch;                    // D43: prefetch this CTA's K / V rows into L2 before the PDL wait (2: D73)
  int late;                           // pdl_late_mask() & kLateSplit: trigger after the KV loop
  unsigned long long* tr;             // investigation aid: trace stamps (0 entry, 1 past wait, 2 q ready, 4 KV
                                      // loop done, 3 end; warp 0: 5 K rows arrived, 6 scores, 7 V rows and P,
                                      // 8 P·V done), null = off
  int cw4;                            // D66: combine_warps_v4 instead of combine_warps (same bits)
  int qfirst;                         // D67 (FP): the q / k / v loads issued first after the wait
};
// RMSNorm (weight nw) and partial RoPE (64 dims, pairs (l, l + 32)) of one 256-wide head, lane l
// holding dims l + 32j in y[j].
// D67 calls the three parts apart (all loads first); prep_head_lanes is the three in a row.
__device__ __forceinline__ void prep_head_load(const float* src, float (&x)[8]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = src[lane + 32 * j];
}
__device__ __forceinline__ float prep_head_ss(const float (&x)[8]) {
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) ss = fmaf(x[j], x[j], ss);
  return warp_sum(ss);
}
__device__ __forceinline__ void prep_head_done(const float (&x)[8], float ss, const float* nw, float eps, float cs,
                                               float sn, float (&y)[8]) {
  const int lane = threadIdx.x & 31;
  const float r = rsqrtf(ss / 256.f + eps);
#pragma unroll
  for (int j = 0; j < 8; ++j) y[j] = x[j] * r * nw[lane + 32 * j];
  const float a = y[0], b = y[1];
  y[0] = a * cs - b * sn;
  y[1] = b * cs + a * sn;
}
__device__ __forceinline__ void prep_head_lanes(const float* src, const float* nw, float eps, float cs, float sn,
                                                float (&y)[8]) {
  float x[8];
  prep_head_load(src, x);
  prep_head_done(x, prep_head_ss(x), nw, eps, cs, sn, y);
}

// P66 (prefill, head_dim 256 and rot_dim 64): attn_prep_kernel's work with D28's warp-per-head layout. A CTA of 8
// warps takes one token; warp w prepares the rows w, w + 8, w + 16 of its heads + kv_heads rows (query heads, then
// key heads with their value rows copied), all its rows' loads issued first; lane l computes the RoPE angle of
// pair l once per token (attn_prep_kernel: one powf and one sincosf per element, one CTA of 256 threads per row and
// a block-wide reduction). Same formulas; Σx² summed in a different order (the last bits of the norm may differ).
// Q16 (P67): the queries go out as the fp16 operand of P63's flash kernel, × log2 e and saturated as that kernel's
// conversion did ([T, heads, hd] fp16 in qbuf's space: the same values, half the bytes, loaded there by TMA).
constexpr int kPrepRowsPerWarp = 3;   // 18 rows (16 query + 2 key heads) over 8 warps
template <typename KV, bool Q16>
__global__ void __launch_bounds__(256) attn_prep_rows_kernel(AttnDims d, const float* qn, const float* kn, KV* kc,
                                                             KV* vc, int pos0, const int32_t* pos_dev, const float* q,
                                                             const float* k, const float* v, float* qbuf,
                                                             const __grid_constant__ L2Prefetch pf) {
  constexpr int hd = 256;
  pdl_trigger();
  l2_prefetch(pf);
  pdl_wait();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = blockIdx.x;
  const int rows = d.heads + d.kv_heads;
  float x[kPrepRowsPerWarp][8];
#pragma unroll
  for (int u = 0; u < kPrepRowsPerWarp; ++u) {
    const int r = warp + 8 * u;
    if (r < d.heads) prep_head_load(q + (int64_t(t) * d.heads + r) * 2 * hd, x[u]);
    else if (r < rows) prep_head_load(k + (int64_t(t) * d.kv_heads + (r - d.heads)) * hd, x[u]);
  }
  const int pos = cur_pos(pos0, pos_dev) + t;
  const float inv = powf(d.theta, -float(2 * lane) / float(d.rot_dim));
  float sn, cs;
  sincosf(float(pos) * inv, &sn, &cs);
#pragma unroll
  for (int u = 0; u < kPrepRowsPerWarp; ++u) {
    const int r = warp + 8 * u;
    if (r >= rows) continue;
    const bool is_q = r < d.heads;
    float y[8];
    prep_head_done(x[u], prep_head_ss(x[u]), is_q ? qn : kn, d.eps, cs, sn, y);
    if (is_q && Q16) {
      __half* out = reinterpret_cast<__half*>(qbuf) + (int64_t(t) * d.heads + r) * hd;
      const float kLog2e = 1.4426950408889634f;
#pragma unroll
      for (int j = 0; j < 8; ++j) out[lane + 32 * j] = sat_half(y[j] * rsqrtf(float(hd)) * kLog2e);
    } else if (is_q) {
      float* out = qbuf + (int64_t(t) * d.heads + r) * hd;
#pragma unroll
      for (int j = 0; j < 8; ++j) out[lane + 32 * j] = y[j] * rsqrtf(float(hd));
    } else if (pos < d.capacity) {
      const int kvh = r - d.heads;
      const int64_t row = (int64_t(pos) * d.kv_heads + kvh) * hd;
      const float* vs = v + (int64_t(t) * d.kv_heads + kvh) * hd;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        kv_store(kc + row + lane + 32 * j, y[j]);
        kv_store(vc + row + lane + 32 * j, vs[lane + 32 * j]);
      }
    }
  }
}

constexpr int kKvPrefetchRows = 16 * kMmaDecWarps;   // D43: positions of a slice prefetched before the wait
template <int PM, bool FP>
__global__ void __launch_bounds__(32 * kMmaDecWarps, 2) attn_split_mma_kernel(AttnDims d, const __half* kc,
                                                                             const __half* vc, int pos0,
                                                                             const int32_t* pos_dev,
                                                                             const float* qbuf, float* part,
                                                                             const __grid_constant__ AttnPrepArgs pa) {
  constexpr int hd = 256, HPB = 8, NW = kMmaDecWarps;
  extern __shared__ float sm[];   // [NW][HPB][hd] acc, then [NW][HPB] (m, l); with FP first the queries [HPB][hd]
  trace_stamp_nd(pa.tr, 0);
  if (!pa.late) pdl_trigger();
  if constexpr (FP) l2_prefetch(pa.pf);
  if (pa.kv_prefetch) {
    // D43: the rows of earlier positions were written by earlier steps; the position read here may be a
    // step stale before the wait, which only changes what is prefetched (L2 is the point of coherence).
    // At most the first kKvPrefetchRows positions (the loop's first step): a long slice prefetched whole
    // is evicted from L2 before it is read (128K: the whole cache, 268 MB per layer; measured −7.6 %).
    const int2 b = split_bounds(d, pos0, pos_dev, blockIdx.z);
    const int64_t rs = int64_t(d.kv_heads) * hd;
    const int n = min(b.y - b.x, kKvPrefetchRows);
    if (pa.kv_prefetch == 2) {
      // D73: two bulk prefetches per CTA instead of 2n of one row each: the CTA of KV head y takes the y-th share of
      // the positions with every KV head's rows (contiguous: [pos][kv head][hd]); the slice's other CTAs take the
      // rest. The same bytes in all.
      const int p0 = b.x + n * int(blockIdx.y) / d.kv_heads, p1 = b.x + n * (int(blockIdx.y) + 1) / d.kv_heads;
      if (threadIdx.x < 2 && p1 > p0) {
        const __half* base = (threadIdx.x ? vc : kc) + int64_t(p0) * rs;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base), "r"(uint32_t((p1 - p0) * rs * 2))
                     : "memory");
      }
    } else {
      for (int i = int(threadIdx.x); i < 2 * n; i += int(blockDim.x)) {
        const __half* row = (i & 1 ? vc : kc) + (int64_t(b.x + (i >> 1)) * rs + int64_t(blockIdx.y) * hd);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(row), "r"(hd * 2) : "memory");
      }
    }
  }
  pdl_wait();
  trace_stamp_nd(pa.tr, 1);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tt = blockIdx.z;
  const int h0 = blockIdx.y * HPB, kvh = blockIdx.y;
  // D67: the two query rows of this warp (and on warp 0 the new k / v rows) are loaded and their Σx² summed
  // before the slice bounds (the position load) and the early exit, so that the three wait on one round trip.
  float xq[2][8], ssq[2] = {0.f, 0.f}, xk[8], ssk = 0.f, xv[8];
  int pos_a = pos0;               // D67: the position loaded once, first; then passed on as a value
  const int32_t* pos_p = pos_dev;
  if (FP && pa.qfirst) {
    pos_a = cur_pos(pos0, pos_dev);
    pos_p = nullptr;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) prep_head_load(pa.q + int64_t(h0 + 2 * warp + hh) * 2 * hd, xq[hh]);
    if (warp == 0) {
      prep_head_load(pa.k + int64_t(kvh) * hd, xk);
      prep_head_load(pa.v + int64_t(kvh) * hd, xv);
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) ssq[hh] = prep_head_ss(xq[hh]);
    if (warp == 0) ssk = prep_head_ss(xk);
  }
  const SplitSlice sl = split_slice<HPB>(d, pos_a, pos_p, tt, h0, hd, part);
  const int lo = sl.lo, hi = sl.hi;
  if (lo >= hi) return;
  if constexpr (FP) {
    const int pos = cur_pos(pos_a, pos_p);
    const float inv = powf(d.theta, -float(2 * lane) / float(d.rot_dim));
    float sn, cs;
    sincosf(float(pos) * inv, &sn, &cs);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int hl = 2 * warp + hh;
      float y[8];
      if (pa.qfirst) prep_head_done(xq[hh], ssq[hh], pa.qn, d.eps, cs, sn, y);
      else prep_head_lanes(pa.q + int64_t(h0 + hl) * 2 * hd, pa.qn, d.eps, cs, sn, y);
#pragma unroll
      for (int j = 0; j < 8; ++j) sm[hl * hd + lane + 32 * j] = y[j] * rsqrtf(float(hd));
    }
    if (warp == 0 && lo <= pos && pos < hi && pa.qfirst) {
      float y[8];
      prep_head_done(xk, ssk, pa.kn, d.eps, cs, sn, y);
      const int64_t row = (int64_t(pos) * d.kv_heads + kvh) * hd;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        kv_store(pa.kc + row + lane + 32 * j, y[j]);
        kv_store(pa.vc + row + lane + 32 * j, xv[j]);
      }
    } else if (warp == 0 && lo <= pos && pos < hi) {
      float y[8];
      prep_head_lanes(pa.k + int64_t(kvh) * hd, pa.kn, d.eps, cs, sn, y);
      const int64_t row = (int64_t(pos) * d.kv_heads + kvh) * hd;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        kv_store(pa.kc + row + lane + 32 * j, y[j]);
        kv_store(pa.vc + row + lane + 32 * j, pa.v[int64_t(kvh) * hd + lane + 32 * j]);
      }
    }
    __syncthreads();
  }
  // Q^T fragments: head g, dims 32i + 8t + [0, 8) for i < 8, times log2 e, as fp16 pairs.
  const float kLog2e = 1.4426950408889634f;
  uint32_t qw[8][4];
  {
    const float* qh = FP ? sm + g * hd + 8 * t : qbuf + (int64_t(tt) * d.heads + h0 + g) * hd + 8 * t;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float4 a = *reinterpret_cast<const float4*>(qh + 32 * i);
      const float4 b = *reinterpret_cast<const float4*>(qh + 32 * i + 4);
      qw[i][0] = pack_h2(a.x * kLog2e, a.y * kLog2e);
      qw[i][1] = pack_h2(a.z * kLog2e, a.w * kLog2e);
      qw[i][2] = pack_h2(b.x * kLog2e, b.y * kLog2e);
      qw[i][3] = pack_h2(b.z * kLog2e, b.w * kLog2e);
    }
  }
  if constexpr (FP) __syncthreads();   // every warp holds its fragments before sm is reused
  trace_stamp_nd(pa.tr, 2);
  float acc[16][4];
#pragma unroll
  for (int mt = 0; mt < 16; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
  float m0 = -FLT_MAX, m1 = -FLT_MAX, l0 = 0.f, l1 = 0.f;   // heads 2t, 2t+1
  const int64_t rs = int64_t(d.kv_heads) * hd;            // halves per cache row
  const __half* kb = kc + int64_t(kvh) * hd;
  const __half* vb = vc + int64_t(kvh) * hd;
  // K rows p0+g and p0+g+8 (a row past the slice loads row lo; its score is masked).
  auto load_k = [&](int p0, uint4 (&kr)[2][8]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int p = p0 + g + 8 * r;
      const uint4* src = reinterpret_cast<const uint4*>(kb + int64_t(p < hi ? p : lo) * rs) + t;
#pragma unroll
      for (int i = 0; i < 8; ++i) kr[r][i] = __ldcs(src + 4 * i);
    }
  };
  // V rows p0 + {2t, 2t+1, 2t+8, 2t+9}, dims 64q + 8g + [0, 8).
  auto load_v = [&](int p0, uint4 (&vr)[4][4]) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int p = p0 + 2 * t + (r & 1) + 8 * (r >> 1);
      const uint4* src = reinterpret_cast<const uint4*>(vb + int64_t(p < hi ? p : lo) * rs) + g;
#pragma unroll
      for (int q = 0; q < 4; ++q) vr[r][q] = __ldcs(src + 8 * q);
    }
  };
  uint4 kr[2][8];
  if (PM == 2 && lo + 16 * warp < hi) load_k(lo + 16 * warp, kr);
  for (int p0 = lo + 16 * warp; p0 < hi; p0 += 16 * NW) {
    if (PM != 2) load_k(p0, kr);
    uint4 vr[4][4];
    if (PM >= 1) load_v(p0, vr);
    trace_stamp_after_nd(pa.tr, 5, kr[0][0].x);
    float sc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < 16; ++ks) {
      const int i = ks >> 1, w = 2 * (ks & 1);
      mma_f16_16816(sc, u4w(kr[0][i], w), u4w(kr[1][i], w), u4w(kr[0][i], w + 1), u4w(kr[1][i], w + 1),
                    qw[i][w], qw[i][w + 1]);
    }
    trace_stamp_after_nd(pa.tr, 6, __float_as_uint(sc[0]));
    if (PM == 2 && p0 + 16 * NW < hi) load_k(p0 + 16 * NW, kr);
    if (PM == 0) load_v(p0, vr);   // issued before the softmax math
    // sc: (pos g, head 2t), (pos g, head 2t+1), (pos g+8, head 2t), (pos g+8, head 2t+1).
    if (p0 + g >= hi) sc[0] = sc[1] = -FLT_MAX;
    if (p0 + g + 8 >= hi) sc[2] = sc[3] = -FLT_MAX;
    float x0 = fmaxf(sc[0], sc[2]), x1 = fmaxf(sc[1], sc[3]);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, o));
      x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, o));
    }
    const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
    const float c0 = exp2f(m0 - n0), c1 = exp2f(m1 - n1);
    m0 = n0;
    m1 = n1;
    const float e0 = exp2f(sc[0] - n0), e1 = exp2f(sc[1] - n1), e2 = exp2f(sc[2] - n0), e3 = exp2f(sc[3] - n1);
    l0 = fmaf(l0, c0, e0 + e2);
    l1 = fmaf(l1, c1, e1 + e3);
    // P^T fragments: rows (pos) g / g+8, cols (heads) 2t, 2t+1 -> transposed: head g, pos 2t, 2t+1 (+8).
    const uint32_t pb0 = movmatrix_trans(pack_h2(e0, e1)), pb1 = movmatrix_trans(pack_h2(e2, e3));
    trace_stamp_after_nd(pa.tr, 7, vr[3][3].w ^ pb1);
#pragma unroll
    for (int mt = 0; mt < 16; ++mt) {
      const int q = mt >> 2, w = mt & 3;
      acc[mt][0] *= c0;
      acc[mt][1] *= c1;
      acc[mt][2] *= c0;
      acc[mt][3] *= c1;
      const uint32_t v0 = u4w(vr[0][q], w), v1 = u4w(vr[1][q], w), v2 = u4w(vr[2][q], w), v3 = u4w(vr[3][q], w);
      mma_f16_16816(acc[mt], __byte_perm(v0, v1, 0x5410), __byte_perm(v0, v1, 0x7632), __byte_perm(v2, v3, 0x5410),
                    __byte_perm(v2, v3, 0x7632), pb0, pb1);
    }
  }
  trace_stamp_after_nd(pa.tr, 8, __float_as_uint(acc[15][3]));
  // Row sums over the 8 lane groups; then the warps of the CTA combine as in attn_split_kernel.
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
  }
  float* sacc = sm;
  float* sml = sm + NW * HPB * hd;
#pragma unroll
  for (int mt = 0; mt < 16; ++mt) {
    const int dim = 64 * (mt >> 2) + 8 * g + 2 * (mt & 3);
    float* a0 = sacc + (warp * HPB + 2 * t) * hd;
    float* a1 = a0 + hd;
    a0[dim] = acc[mt][0];
    a1[dim] = acc[mt][1];
    a0[dim + 1] = acc[mt][2];
    a1[dim + 1] = acc[mt][3];
  }
  if (g == 0) {
    sml[(warp * HPB + 2 * t) * 2] = m0;
    sml[(warp * HPB + 2 * t) * 2 + 1] = l0;
    sml[(warp * HPB + 2 * t + 1) * 2] = m1;
    sml[(warp * HPB + 2 * t + 1) * 2 + 1] = l1;
  }
  trace_stamp_nd(pa.tr, 4);
  if (pa.late) pdl_trigger();
  __syncthreads();
  if (pa.cw4) combine_warps_v4<NW, HPB, hd>(sacc, sml, sl);
  else combine_warps<NW, HPB>(sacc, sml, hd, sl);
  trace_stamp_nd(pa.tr, 3);
}

// grid (heads, T), block hd: o = Σ_s acc_s 2^(m_s−M) / Σ_s l_s 2^(m_s−M), times σ(gate). The
// split weights are computed once into shared memory; each thread then sums its dim over splits.
__global__ void attn_merge_kernel(AttnDims d, int splits, int pos0, const int32_t* pos_dev, const float* part,
                                  const float* q, float* o) {
  extern __shared__ float wsm[];   // [splits] weights, red[32]
  float* red = wsm + splits;
  pdl_trigger();
  pdl_wait();
  const int h = blockIdx.x, t = blockIdx.y, e = threadIdx.x, hd = d.head_dim;
  const int len = min(cur_pos(pos0, pos_dev) + t + 1, d.capacity);
  const int chunk = split_chunk(len, splits, d.min_chunk);
  const int ns = min(splits, (len + chunk - 1) / chunk);
  const float* pb = part + (int64_t(t) * d.heads + h) * splits * (hd + 2);
  float mloc = -FLT_MAX;
  for (int s = e; s < ns; s += blockDim.x)
    if (pb[s * (hd + 2) + hd + 1] > 0.f) mloc = fmaxf(mloc, pb[s * (hd + 2) + hd]);
  mloc = warp_max(mloc);
  if ((e & 31) == 0) red[e >> 5] = mloc;
  __syncthreads();
  float M = -FLT_MAX;
  for (int i = 0; i < int(blockDim.x >> 5); ++i) M = fmaxf(M, red[i]);
  float lloc = 0.f;
  for (int s = e; s < ns; s += blockDim.x) {
    const float l = pb[s * (hd + 2) + hd + 1];
    const float f = l > 0.f ? exp2f(pb[s * (hd + 2) + hd] - M) : 0.f;
    wsm[s] = f;
    lloc = fmaf(l, f, lloc);
  }
  const float L = block_sum(lloc, red);
  float A = 0.f;
#pragma unroll 8
  for (int s = 0; s < ns; ++s) {
    const float f = wsm[s];
    if (f > 0.f) A = fmaf(pb[s * (hd + 2) + e], f, A);
  }
  const float gate = q[(int64_t(t) * d.heads + h) * 2 * hd + hd + e];
  o[(int64_t(t) * d.heads + h) * hd + e] = A / L * sigmoidf_(gate);
}

// D11 (decode merge, warps across splits): grid (heads, hd/64, T), 16 warps. A CTA owns 64 dims of
// one head; warp w folds splits w, w+16, ... into a running (max, Σl, Σacc) with lanes on 2 dims
// each (independent 8-byte loads, several splits in flight), so there is no serial loop over all
// splits and no separate max pass; the 16 warp states are combined in shared memory.
constexpr int kMergeWarps = 16;
constexpr int kMergeBatch = 8;   // D68: slices per warp loaded together (64 slices per KV head at <= 12,288 positions: 4)
__global__ void __launch_bounds__(32 * kMergeWarps) attn_merge_warps_kernel(AttnDims d, int splits, int pos0,
                                                                            const int32_t* pos_dev,
                                                                            const float* part, const float* q,
                                                                            float* o, unsigned long long* tr, int eg) {
  __shared__ float sacc[kMergeWarps][64];
  __shared__ float sml[kMergeWarps][2];
  trace_stamp_nd(tr, 0);
  pdl_trigger();
  pdl_wait();
  trace_stamp_nd(tr, 1);
  const int h = blockIdx.x, e0 = blockIdx.y * 64, t = blockIdx.z, hd = d.head_dim;
  // D56 (eg bit 0): the output gate is loaded with the partials, not after the block barrier (one L2 round trip less).
  float gate = 0.f;
  if ((eg & 1) && threadIdx.x < 64) gate = q[(int64_t(t) * d.heads + h) * 2 * hd + hd + e0 + threadIdx.x];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int pos = cur_pos(pos0, pos_dev);
  const float* pb = part + (int64_t(t) * d.heads + h) * splits * (hd + 2);
  float2 bml[kMergeBatch], bv[kMergeBatch];   // D68: a batch of this warp's slices (m, l) and values
  auto load_batch = [&](int base) {
#pragma unroll
    for (int i = 0; i < kMergeBatch; ++i) {
      const int sp = base + i * kMergeWarps;
      const float* ps = pb + int64_t(sp < splits ? sp : 0) * (hd + 2);
      bml[i] = *reinterpret_cast<const float2*>(ps + hd);   // (m, l); hd + 2 is even: 8-byte aligned
      bv[i] = *reinterpret_cast<const float2*>(ps + e0 + 2 * lane);
    }
  };
  if (eg & 2) load_batch(warp);
  const int len = min(pos + t + 1, d.capacity);
  const int chunk = split_chunk(len, splits, d.min_chunk);
  const int ns = min(splits, (len + chunk - 1) / chunk);
  float m = -FLT_MAX, l = 0.f, a0 = 0.f, a1 = 0.f;
  auto fold = [&](float2 ml, float2 v) {   // one slice's partials into the warp's running (m, l, a)
    const float mn = fmaxf(m, ml.x);
    const float corr = exp2f(m - mn), f = exp2f(ml.x - mn);
    m = mn;
    l = fmaf(l, corr, ml.y * f);
    a0 = fmaf(a0, corr, v.x * f);
    a1 = fmaf(a1, corr, v.y * f);
  };
  if (eg & 2) trace_stamp_after_nd(tr, 9, __float_as_uint(bml[0].y));
  if (eg & 2) {
    // D68: the warp's slices of the whole grid (not just the ns filled at this length) loaded kMergeBatch at a time,
    // the first batch issued with the position load that gives ns (before any instruction uses it); rows past ns
    // (stale partials of an earlier step) are loaded and skipped. The same slices folded in the same order: the
    // same bits.
    for (int base = warp; base < splits; base += kMergeBatch * kMergeWarps) {
#pragma unroll
      for (int i = 0; i < kMergeBatch; ++i)
        if (base + i * kMergeWarps < ns && bml[i].y > 0.f) fold(bml[i], bv[i]);
      if (base + kMergeBatch * kMergeWarps < splits) load_batch(base + kMergeBatch * kMergeWarps);
    }
  } else {
#pragma unroll 4
    for (int sp = warp; sp < ns; sp += kMergeWarps) {
      const float* ps = pb + int64_t(sp) * (hd + 2);
      const float2 ml = *reinterpret_cast<const float2*>(ps + hd);   // (m, l); hd + 2 is even: 8-byte aligned
      const float2 v = *reinterpret_cast<const float2*>(ps + e0 + 2 * lane);
      if (!(ml.y > 0.f)) continue;                                     // empty slice
      fold(ml, v);
    }
  }
  sacc[warp][2 * lane] = a0;
  sacc[warp][2 * lane + 1] = a1;
  if (lane == 0) {
    sml[warp][0] = m;
    sml[warp][1] = l;
  }
  trace_stamp_after_nd(tr, 10, __float_as_uint(a1));
  __syncthreads();
  if (threadIdx.x < 64) {
    float M = -FLT_MAX;
    for (int w = 0; w < kMergeWarps; ++w) M = fmaxf(M, sml[w][0]);
    float L = 0.f, A = 0.f;
    for (int w = 0; w < kMergeWarps; ++w) {
      const float f = sml[w][1] > 0.f ? exp2f(sml[w][0] - M) : 0.f;
      L = fmaf(sml[w][1], f, L);
      A = fmaf(sacc[w][threadIdx.x], f, A);
    }
    const int e = e0 + threadIdx.x;
    if (!(eg & 1)) gate = q[(int64_t(t) * d.heads + h) * 2 * hd + hd + e];
    o[(int64_t(t) * d.heads + h) * hd + e] = A / L * sigmoidf_(gate);
  }
  trace_stamp_nd(tr, 3);
}

int eff_splits(int T, int splits) { return T == 1 ? splits : std::max(1, std::min(splits, 64 / T)); }

template <int DPL, int HPB, typename KV, bool U4>
void launch_split_u(const AttnDims& d, const KV* kc, const KV* vc, int pos0, const int32_t* pos_dev,
                    const float* qbuf, float* part, int splits, int T, cudaStream_t s) {
  const size_t smem = sizeof(float) * (8 * HPB * (DPL * 32) + 16 * HPB + HPB * DPL * 32);
  static bool attr_set = false;
  if (!attr_set) {
    CUDA_CHECK(cudaFuncSetAttribute(attn_split_kernel<DPL, HPB, KV, U4>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    attr_set = true;
  }
  dim3 grid(splits, d.heads / HPB, T);
  launch(attn_split_kernel<DPL, HPB, KV, U4>, grid, dim3(256), smem, s, d, kc, vc, pos0, pos_dev, qbuf, part);
  CUDA_LAUNCH_CHECK();
}

template <int DPL, int HPB, typename KV>
void launch_split(const AttnDims& d, const KV* kc, const KV* vc, int pos0, const int32_t* pos_dev,
                  const float* qbuf, float* part, int splits, int T, cudaStream_t s) {
  if constexpr (sizeof(KV) == 2 && DPL >= 4) {
    if (kv16_u4_enabled()) {
      launch_split_u<DPL, HPB, KV, true>(d, kc, vc, pos0, pos_dev, qbuf, part, splits, T, s);
      return;
    }
  }
  launch_split_u<DPL, HPB, KV, false>(d, kc, vc, pos0, pos_dev, qbuf, part, splits, T, s);
}

template <int DPL, typename KV>
void launch_split_h(const AttnDims& d, int hpb, const KV* kc, const KV* vc, int pos0,
                    const int32_t* pos_dev, const float* qbuf, float* part, int splits, int T,
                    cudaStream_t s) {
  switch (hpb) {
    case 8: launch_split<DPL, 8>(d, kc, vc, pos0, pos_dev, qbuf, part, splits, T, s); break;
    case 4: launch_split<DPL, 4>(d, kc, vc, pos0, pos_dev, qbuf, part, splits, T, s); break;
    case 2: launch_split<DPL, 2>(d, kc, vc, pos0, pos_dev, qbuf, part, splits, T, s); break;
    default: launch_split<DPL, 1>(d, kc, vc, pos0, pos_dev, qbuf, part, splits, T, s); break;
  }
}

template <typename KV>
void launch_split_all(const AttnDims& d, int hpb, const KV* kc, const KV* vc, int pos0, const int32_t* pos_dev,
                      const float* qbuf, float* part, int splits, int T, cudaStream_t s) {
  if (d.head_dim == 256) launch_split_h<8>(d, hpb, kc, vc, pos0, pos_dev, qbuf, part, splits, T, s);
  else if (d.head_dim == 128) launch_split_h<4>(d, hpb, kc, vc, pos0, pos_dev, qbuf, part, splits, T, s);
  else launch_split_h<2>(d, hpb, kc, vc, pos0, pos_dev, qbuf, part, splits, T, s);
}

bool prep_rows_ok(const AttnDims& d, int T) {
  return T > 1 && d.head_dim == 256 && d.rot_dim == 64 && d.heads + d.kv_heads <= 8 * kPrepRowsPerWarp;
}
void launch_prep(const AttnDims& d, const float* q_norm, const float* k_norm, void* kc, void* vc, bool kv16,
                 int pos0, const int32_t* pos_dev, const float* q, const float* k, const float* v, int T,
                 float* qbuf, const L2Prefetch& pf, cudaStream_t s, bool q16 = false) {
  LILY_CHECK(!q16 || (prep_rows_ok(d, T) && kv16), "attention prep: fp16 queries need P66's kernel and the fp16 cache");
  if (q16 || (attn_prep_rows_enabled() && prep_rows_ok(d, T))) {   // P66
    auto kern = q16 ? attn_prep_rows_kernel<__half, true> : attn_prep_rows_kernel<__half, false>;
    if (kv16)
      launch(kern, dim3(T), dim3(256), 0, s, d, q_norm, k_norm, static_cast<__half*>(kc), static_cast<__half*>(vc),
             pos0, pos_dev, q, k, v, qbuf, pf);
    else
      launch(attn_prep_rows_kernel<float, false>, dim3(T), dim3(256), 0, s, d, q_norm, k_norm, static_cast<float*>(kc),
             static_cast<float*>(vc), pos0, pos_dev, q, k, v, qbuf, pf);
    CUDA_LAUNCH_CHECK();
    return;
  }
  const dim3 grid(d.heads + d.kv_heads, T), block(d.head_dim);
  const size_t smem = (d.head_dim + 32) * sizeof(float);
  if (kv16)
    launch(attn_prep_kernel<__half>, grid, block, smem, s, d, q_norm, k_norm, static_cast<__half*>(kc),
           static_cast<__half*>(vc), pos0, pos_dev, q, k, v, qbuf, pf);
  else
    launch(attn_prep_kernel<float>, grid, block, smem, s, d, q_norm, k_norm, static_cast<float*>(kc),
           static_cast<float*>(vc), pos0, pos_dev, q, k, v, qbuf, pf);
  CUDA_LAUNCH_CHECK();
}

// grid-stride conversions between f32 and fp16 cache buffers (tests, benchmarks).
__global__ void f32_to_f16_kernel(const float* src, __half* dst, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    kv_store(dst + i, src[i]);
}
__global__ void f16_to_f32_kernel(const __half* src, float* dst, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __half2float(src[i]);
}

}  // namespace

int64_t attention_workspace_floats(const AttnDims& d, int T) {
  return int64_t(T) * d.heads * d.head_dim +
         int64_t(T) * d.heads * eff_splits(T, 256) * (d.head_dim + 2) + 64;
}

bool& attn_kv_prefetch_enabled() {
  static bool on = true;
  return on;
}

bool& attn_combine_v4_enabled() {
  static bool on = true;
  return on;
}

bool& attn_kv_prefetch_bulk_enabled() {
  static bool on = false;
  return on;
}

bool& attn_q_first_enabled() {
  static bool on = true;
  return on;
}

std::array<unsigned long long*, 2>& attn_trace_next() {
  static std::array<unsigned long long*, 2> p{};
  return p;
}

bool& attn_prep_rows_enabled() {
  static bool on = true;
  return on;
}
bool& merge_warps_enabled() {
  static bool on = true;
  return on;
}

bool& kv16_u4_enabled() {
  static bool on = false;
  return on;
}

bool& attn_mma_decode_enabled() {
  static bool on = true;
  return on;
}

bool& attn_merge_early_parts_enabled() {
  static bool on = true;
  return on;
}

bool& attn_merge_early_gate_enabled() {
  static bool on = true;
  return on;
}

bool& attn_prep_fused_enabled() {
  static bool on = true;
  return on;
}

int& attn_mma_pipe_mode() {
  static int mode = 2;
  return mode;
}

void attention(const AttnDims& d, const float* q_norm, const float* k_norm, void* kc, void* vc, bool kv16,
               int pos0, const int32_t* pos_dev, const float* q, const float* k, const float* v,
               int T, float* o, float* work, int splits, bool pack_gqa, cudaStream_t s, const L2Prefetch* pf) {
  const int hd = d.head_dim, G = d.heads / d.kv_heads;
  LILY_CHECK(hd == 64 || hd == 128 || hd == 256, "attention: head_dim must be 64, 128 or 256");
  unsigned long long* tr[2] = {std::exchange(attn_trace_next()[0], nullptr), std::exchange(attn_trace_next()[1], nullptr)};
  LILY_CHECK(d.heads % d.kv_heads == 0 && d.rot_dim <= hd && d.rot_dim % 2 == 0,
             "attention: unsupported head configuration");
  const int sms = sm_count();
  int hpb = 1;
  if (pack_gqa)
    for (int c : {8, 4, 2})
      if (G % c == 0) {
        hpb = c;
        break;
      }
  // splits <= 0: one CTA per SM and per (kv head or head) group, two CTAs fit on an SM.
  if (splits <= 0) splits = std::max(1, 2 * sms / (d.heads / hpb));
  splits = eff_splits(T, std::min(splits, 256));
  float* qbuf = work;
  float* part = work + int64_t(T) * d.heads * hd;
  const bool d20 = kv16 && attn_mma_decode_enabled() && hd == 256 && hpb == 8 && G == 8;
  const bool fused_prep = d20 && T == 1 && d.rot_dim == 64 && attn_prep_fused_enabled();   // D28
  if (!fused_prep) launch_prep(d, q_norm, k_norm, kc, vc, kv16, pos0, pos_dev, q, k, v, T, qbuf, pf ? *pf : L2Prefetch{}, s);
  if (d20) {   // D20
    const size_t smem = sizeof(float) * (kMmaDecWarps * 8 * 256 + kMmaDecWarps * 16);
    static bool attr_set = false;
    if (!attr_set) {
      for (auto kern : {attn_split_mma_kernel<0, false>, attn_split_mma_kernel<1, false>, attn_split_mma_kernel<2, false>,
                        attn_split_mma_kernel<0, true>, attn_split_mma_kernel<1, true>, attn_split_mma_kernel<2, true>})
        CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      attr_set = true;
    }
    const int pm = attn_mma_pipe_mode();
    auto kern = fused_prep ? (pm == 2 ? attn_split_mma_kernel<2, true> : pm == 1 ? attn_split_mma_kernel<1, true>
                                                                                : attn_split_mma_kernel<0, true>)
                           : (pm == 2 ? attn_split_mma_kernel<2, false> : pm == 1 ? attn_split_mma_kernel<1, false>
                                                                                  : attn_split_mma_kernel<0, false>);
    AttnPrepArgs pa{};
    if (fused_prep) pa = AttnPrepArgs{q, k, v, q_norm, k_norm, static_cast<__half*>(kc), static_cast<__half*>(vc),
                                      pf ? *pf : L2Prefetch{}, 0, 0, nullptr};
    pa.kv_prefetch = T == 1 && attn_kv_prefetch_enabled() ? (attn_kv_prefetch_bulk_enabled() ? 2 : 1) : 0;
    pa.late = T == 1 && (pdl_late_mask() & kLateSplit) ? 1 : 0;
    pa.tr = T == 1 ? tr[0] : nullptr;
    pa.cw4 = attn_combine_v4_enabled() ? 1 : 0;
    pa.qfirst = fused_prep && attn_q_first_enabled() ? 1 : 0;
    launch(kern, dim3(splits, d.kv_heads, T), dim3(32 * kMmaDecWarps), smem, s, d,
           static_cast<const __half*>(kc), static_cast<const __half*>(vc), pos0, pos_dev, (const float*)qbuf, part, pa);
    CUDA_LAUNCH_CHECK();
  } else if (kv16)
    launch_split_all(d, hpb, static_cast<const __half*>(kc), static_cast<const __half*>(vc), pos0, pos_dev, qbuf,
                     part, splits, T, s);
  else
    launch_split_all(d, hpb, static_cast<const float*>(kc), static_cast<const float*>(vc), pos0, pos_dev, qbuf,
                     part, splits, T, s);
  if (merge_warps_enabled() && T == 1)
    launch(attn_merge_warps_kernel, dim3(d.heads, hd / 64, T), dim3(32 * kMergeWarps), 0, s, d, splits, pos0,
           pos_dev, (const float*)part, q, o, tr[1], (attn_merge_early_gate_enabled() ? 1 : 0) | (attn_merge_early_parts_enabled() ? 2 : 0));
  else
    launch(attn_merge_kernel, dim3(d.heads, T), dim3(hd), (splits + 32) * sizeof(float), s, d, splits, pos0,
           pos_dev, (const float*)part, q, o);
  CUDA_LAUNCH_CHECK();
}

void attention_prep(const AttnDims& d, const float* q_norm, const float* k_norm, void* kc, void* vc, bool kv16,
                    int pos0, const int32_t* pos_dev, const float* q, const float* k, const float* v, int T,
                    float* qbuf, cudaStream_t s, bool q16) {
  launch_prep(d, q_norm, k_norm, kc, vc, kv16, pos0, pos_dev, q, k, v, T, qbuf, L2Prefetch{}, s, q16);
}
bool attention_prep_q16_ok(const AttnDims& d, int T, bool kv16) { return kv16 && prep_rows_ok(d, T); }

void kv_convert(void* dst, bool dst16, const void* src, bool src16, int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  const int blocks = int(std::min<int64_t>((n + 255) / 256, 4096));
  if (dst16 == src16) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, n * (dst16 ? 2 : 4), cudaMemcpyDeviceToDevice, s));
  } else if (dst16) {
    f32_to_f16_kernel<<<blocks, 256, 0, s>>>(static_cast<const float*>(src), static_cast<__half*>(dst), n);
    CUDA_LAUNCH_CHECK();
  } else {
    f16_to_f32_kernel<<<blocks, 256, 0, s>>>(static_cast<const __half*>(src), static_cast<float*>(dst), n);
    CUDA_LAUNCH_CHECK();
  }
}

}  // namespace lily::cuda
