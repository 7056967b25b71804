// Matrix-vector kernels (D1): the specialised 4-bit decode GEMV (16-byte weight loads, several rows
// per warp, group-sum trick), a generic kernel for every weight type and any T, plus the small
// row ops (embedding lookup, RMSNorm with optional fused residual add, add).
#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_ops.h"

namespace lily::cuda {

int& pdl_late_mask() {
  static int m = 0;
  return m;
}

namespace {

struct GemvLaunch {
  GemvJob job[kMaxGemvJobs];
  int block_begin[kMaxGemvJobs + 1];
  int n;
  int T;
  GemvNorm norm;        // D9 (norm.w set): stage rmsnorm(norm.h) instead of job.x
  float* norm_out;      // D9: CTA 0 writes rmsnorm(norm.h) here (the jobs' x), else null
  L2Prefetch pf;        // D13: the next launch's weights
  int stage_regs;       // D21: x staged from registers (all loads in flight at once)
  unsigned long long* trace;   // investigation aid: phase stamps (trace_stamp)
  GemvRouterRows rt;    // D39: router rows (gemv_q4_kernel<.., RT> only)
  int late;             // pdl_late_mask(): trigger the dependents after x staging instead of at entry
};

// Epilogue of one output: y, plus the folded residual add (D9).
__device__ __forceinline__ void gemv_store(const GemvJob& jb, int64_t i, float v) {
  jb.y[i] = v;
  if (jb.res) jb.res[i] += v;
}

__device__ __forceinline__ int find_job(const GemvLaunch& L) {
  int j = 0;
  while (j + 1 < L.n && int(blockIdx.x) >= L.block_begin[j + 1]) ++j;
  return j;
}

// cols = 1024*CPL (each lane owns CPL 16-byte chunks of a row), R rows per warp per iteration,
// 8 warps per block; blocks of a job stride over its row groups. The first group's weight loads
// are issued before x is staged so that their latency overlaps the staging.
// RT (D39, with X16): CTA b < L.rt.n also computes the dot of row b of L.rt.q (cols floats at b · qstride + qoff)
// with this launch's x as loaded (the raw residual h when a norm is folded: before its gain), plus L.rt.add[b]
// if set, into L.rt.out[b]. The row goes to shared memory before the PDL wait (cp.async; each thread reads back
// only what it copied: no barrier), after the x staging area (cols floats more of dynamic shared memory).
// FS (D89, default on; X16 only): the router-row and norm reductions as one interleaved butterfly and the int16
// staging with its float4 chains interleaved (stage_x_i16_regs_il; same bits); FS == 2 (D90) also takes the scale
// by __fdividef.
template <int CPL, int R, bool X16 = false, bool RT = false, int FS = 0>   // X16 (D24): x as int16 per 32 values, dp2a
__global__ void __launch_bounds__(256, 3) gemv_q4_kernel(const __grid_constant__ GemvLaunch L) {
  static_assert(!RT || X16, "D39: the int16 register-staged kernel");
  static_assert(!FS || X16, "D89: the int16 register-staged kernel");
  using XR = XRegs<CPL, 256>;
  extern __shared__ float4 sm4[];
  constexpr int cols = CPL * 1024;
  float* xsum = reinterpret_cast<float*>(sm4 + cols / 4);
  const int j = find_job(L);
  const GemvJob& jb = L.job[j];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nb = L.block_begin[j + 1] - L.block_begin[j], bj = blockIdx.x - L.block_begin[j];
  const int rows = jb.w.rows;
  const uint4* data = static_cast<const uint4*>(jb.w.data);
  const uint16_t* sc = static_cast<const uint16_t*>(jb.w.scales);
  const uint16_t* bi = static_cast<const uint16_t*>(jb.w.biases);
  auto load = [&](Q4Rows<CPL, R>& q, int g) {
    const uint4* rp[R];
    const uint16_t *sp[R], *bp[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t row = min(g * 8 * R + warp * R + r, rows - 1);
      rp[r] = data + row * (cols / 32);
      sp[r] = sc + row * (cols / 64);
      bp[r] = bi + row * (cols / 64);
    }
    q.load(rp, sp, bp);
  };
  Q4Rows<CPL, R> cur;
  __shared__ float red[8];
  // D39: this CTA's row of L.rt.q (CPL float4 per thread, x's layout).
  __shared__ float rred[8];
  float4* qs = sm4 + cols / 4 + CPL * 8;
  const int rrow = RT ? int(blockIdx.x) : 0;
  const bool has_r = RT && rrow < L.rt.n;
  trace_stamp(L.trace, 0);
  if (!L.late) pdl_trigger();
  l2_prefetch(L.pf);
  load(cur, bj);   // weights never change: safe before the wait
  if constexpr (RT) {
    if (has_r && L.rt.qi) {   // D76: the row as int16 codes (8 bytes per float4 of x) and its group's scale
      const int64_t ro = int64_t(rrow) * L.rt.qstride + L.rt.qoff;
      const uint2* qr = reinterpret_cast<const uint2*>(L.rt.qi + ro);
      const float* sr = L.rt.qscale + ro / 64;
      uint2* qh = reinterpret_cast<uint2*>(qs);
      float* sh = reinterpret_cast<float*>(qh + cols / 4);
#pragma unroll
      for (int k = 0; k < CPL; ++k) {
        const int c = XR::index(k);
        const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(qh + c));
        const uint32_t ss = static_cast<uint32_t>(__cvta_generic_to_shared(sh + c));
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(sa), "l"(qr + c) : "memory");
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(ss), "l"(sr + c / 16) : "memory");
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
    } else if (has_r) {
      const float4* qr = reinterpret_cast<const float4*>(L.rt.q + int64_t(rrow) * L.rt.qstride + L.rt.qoff);
#pragma unroll
      for (int k = 0; k < CPL; ++k) {
        const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(qs + XR::index(k)));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(qr + XR::index(k)) : "memory");
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
  }
  // x staged from registers, every load in flight at once; the norm gain (a weight) before the wait.
  XR xr;
  float resv[R];
  float radd = 0.f;   // D53
  // X16 is launched only with L.stage_regs (launch_fast): the other staging compiled out of it.
  const bool regs = X16 || L.stage_regs;
  if (regs) {
    if (L.norm.w) xr.load(L.norm.w, cols / 4);
    XR g = xr;
    pdl_wait();
    trace_stamp(L.trace, 1);
    xr.load(L.norm.w ? L.norm.h : jb.x, cols / 4);
    // The residual values of the first group, read with x (not after the dot: one round trip less).
    const int rq = bj * 8 * R + warp * R;
#pragma unroll
    for (int r = 0; r < R; ++r) resv[r] = jb.res && lane == 0 && rq + r < rows ? __ldcg(jb.res + rq + r) : 0.f;
    // D53: the in-projection's Q_h·h for this CTA's router row, in flight with x (after the barrier it cost thread 0
    // a dependent L2 round trip before its own rows).
    if constexpr (RT)
      if (has_r && threadIdx.x == 0 && L.rt.add && L.rt.early_add) radd = __ldcg(L.rt.add + rrow);
    if (L.trace) {   // investigation aid: when this thread's x has arrived (its first float4, then all of it)
      trace_stamp_after(L.trace, 4, __float_as_uint(xr.v[0].x));
      uint32_t all = 0;
#pragma unroll
      for (int k = 0; k < CPL; ++k)
        all ^= __float_as_uint(xr.v[k].x) ^ __float_as_uint(xr.v[k].y) ^ __float_as_uint(xr.v[k].z) ^
               __float_as_uint(xr.v[k].w);
      trace_stamp_after(L.trace, 6, all);
    }
    float part = 0.f;   // D39's share (RT), reduced below
    if constexpr (RT) {   // D39: the row · x as loaded (before a folded norm's gain), reduced after the barrier
      if (has_r) {
        asm volatile("cp.async.wait_group 0;" ::: "memory");   // this thread's own copies of the row
        if (L.trace) trace_stamp(L.trace, 7);
        if (L.rt.qi) {   // D76
          const uint2* qh = reinterpret_cast<const uint2*>(qs);
          const float* sh = reinterpret_cast<const float*>(qh + cols / 4);
#pragma unroll
          for (int k = 0; k < CPL; ++k) {
            const int c = XR::index(k);
            const uint2 u = qh[c];
            const float d = float(int16_t(u.x & 0xffffu)) * xr.v[k].x + float(int(u.x) >> 16) * xr.v[k].y +
                            float(int16_t(u.y & 0xffffu)) * xr.v[k].z + float(int(u.y) >> 16) * xr.v[k].w;
            part += sh[c] * d;
          }
        } else {
#pragma unroll
          for (int k = 0; k < CPL; ++k) {
            const float4 q = qs[XR::index(k)];
            part += q.x * xr.v[k].x + q.y * xr.v[k].y + q.z * xr.v[k].z + q.w * xr.v[k].w;
          }
        }
      }
      if constexpr (!FS) {
        part = warp_sum(part);
        if (lane == 0) rred[warp] = part;
      }
    }
    if constexpr (FS) {   // D89: both warp sums through one butterfly (each summed as warp_sum sums it)
      float ss = L.norm.w ? xr.apply_gain(g) : 0.f;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        if constexpr (RT) part += __shfl_xor_sync(0xffffffffu, part, o);
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
      }
      if (lane == 0) {
        if constexpr (RT) rred[warp] = part;
        if (L.norm.w) red[warp] = ss;
      }
    } else if (L.norm.w) {
      const float ss = warp_sum(xr.apply_gain(g));
      if (lane == 0) red[warp] = ss;
    }
    // D24: x as int16 per 32 values in the first 2·cols bytes, the x steps after that.
    if constexpr (FS)
      stage_x_i16_regs_il<CPL, FS == 2>(xr, cols, reinterpret_cast<uint4*>(sm4), reinterpret_cast<float*>(sm4) + cols / 2,
                                        xsum);
    else if constexpr (X16)
      stage_x_i16_regs(xr, cols, reinterpret_cast<uint4*>(sm4), reinterpret_cast<float*>(sm4) + cols / 2, xsum);
    else
      stage_x_q4_regs(xr, cols, sm4, xsum);
    trace_stamp(L.trace, 5);
  } else {
    pdl_wait();
    trace_stamp(L.trace, 1);
    float ss = 0.f;
    stage_x_q4(L.norm.w ? L.norm.h : jb.x, cols, sm4, xsum, L.norm.w, &ss);
    if (L.norm.w) {
      ss = warp_sum(ss);
      if (lane == 0) red[warp] = ss;
    }
  }
  __syncthreads();
  if constexpr (RT) {
    if (has_r && threadIdx.x == 0) {
      float v = !L.rt.add ? 0.f : L.rt.early_add ? radd : __ldcg(L.rt.add + rrow);
#pragma unroll
      for (int w = 0; w < 8; ++w) v += rred[w];
      L.rt.out[rrow] = v;
    }
  }
  float nscale = 1.f;
  if (L.norm.w) {
    nscale = fold_norm_scale(red, 8, cols, L.norm.eps, L.norm.h, L.norm.w,
                             blockIdx.x == 0 && !regs ? L.norm_out : nullptr);
    if (blockIdx.x == 0 && regs && L.norm_out) xr.store_scaled(L.norm_out, cols / 4, nscale);
  }
  trace_stamp(L.trace, 2);
  if (L.late) pdl_trigger();
  // Software pipeline: the next row group's loads are in flight while this one is computed.
  for (int g = bj; g * 8 * R < rows; g += nb) {
    const int r0 = g * 8 * R + warp * R;
    if (r0 >= rows) break;
    Q4Rows<CPL, R> nxt;
    if ((g + nb) * 8 * R < rows) load(nxt, g + nb);
    float acc[R];
    if constexpr (X16)
      cur.dot_i16(reinterpret_cast<const uint4*>(sm4), reinterpret_cast<const float*>(sm4) + cols / 2, xsum, acc);
    else
      cur.dot(sm4, xsum, acc);
    cur = nxt;
    if (lane == 0)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (r0 + r < rows) {
          if (regs && g == bj) {
            const float v = acc[r] * nscale;
            jb.y[r0 + r] = v;
            if (jb.res) jb.res[r0 + r] = resv[r] + v;
          } else {
            gemv_store(jb, r0 + r, acc[r] * nscale);
          }
        }
  }
  trace_stamp(L.trace, 3);
}

// 4-bit rows of any cols % 256 == 0 on tensor cores (D1m): a CTA of 8 warps takes 8/KS 16-row
// tiles per step, the KS warps of a tile splitting its groups (more CTAs for the small per-layer
// GEMVs), partial sums reduced in shared memory. x is staged once per CTA.
__global__ void __launch_bounds__(256, 2) gemv_q4_mma_kernel(const __grid_constant__ GemvLaunch L, int KS) {
  extern __shared__ uint4 smx[];
  __shared__ float red[8][16];
  const int j = find_job(L);
  const GemvJob& jb = L.job[j];
  const int cols = jb.w.cols, ng = cols / 64, rows = jb.w.rows;
  uint32_t* smB = reinterpret_cast<uint32_t*>(smx);
  float* gsum = reinterpret_cast<float*>(smB + ng * 64);
  float* ginv = gsum + ng;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int nb = L.block_begin[j + 1] - L.block_begin[j], bj = blockIdx.x - L.block_begin[j];
  const int tiles = (rows + 15) / 16, TPC = 8 / KS, sets = (tiles + TPC - 1) / TPC, gpw = ng / KS;
  const uint2* data = static_cast<const uint2*>(jb.w.data);
  const uint16_t* sc = static_cast<const uint16_t*>(jb.w.scales);
  const uint16_t* bi = static_cast<const uint16_t*>(jb.w.biases);
  pdl_trigger();
  l2_prefetch(L.pf);
  {  // weights never change: warm L2 with this warp's first batch before waiting on x
    const int tile = bj * TPC + warp / KS, G = (warp % KS) * gpw;
    if (tile < tiles) {
      const int64_t r = min(tile * 16 + g + (t & 1) * 8, rows - 1);
      const uint2* p = data + r * (cols / 16) + G * 4 + (t >> 1) * 8;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
    }
  }
  pdl_wait();
  stage_x_mma(jb.x, cols, smB, gsum, ginv);
  __syncthreads();
  for (int set = bj; set < sets; set += nb) {
    const int tile = set * TPC + warp / KS, ks = warp % KS;
    float a0 = 0.f, a1 = 0.f;
    if (tile < tiles) {
      const int64_t r0 = min(tile * 16 + g, rows - 1), r1 = min(tile * 16 + g + 8, rows - 1);
      mma_q4_rows(data + r0 * (cols / 16), data + r1 * (cols / 16), sc + r0 * ng, sc + r1 * ng, bi + r0 * ng,
                  bi + r1 * ng, ks * gpw, gpw, smB, gsum, ginv, a0, a1);
    }
    if (KS == 1) {
      if (t == 0 && tile < tiles) {
        if (tile * 16 + g < rows) gemv_store(jb, tile * 16 + g, a0);
        if (tile * 16 + g + 8 < rows) gemv_store(jb, tile * 16 + g + 8, a1);
      }
      continue;
    }
    if (t == 0) {
      red[warp][g] = a0;
      red[warp][g + 8] = a1;
    }
    __syncthreads();
    if (int(threadIdx.x) < TPC * 16) {
      const int tis = threadIdx.x >> 4, i = threadIdx.x & 15, row = (set * TPC + tis) * 16 + i;
      float v = 0.f;
      for (int k = 0; k < KS; ++k) v += red[tis * KS + k][i];
      if (row < rows) gemv_store(jb, row, v);
    }
    __syncthreads();
  }
}

// 8-bit rows of cols = 512*CPL (router, shared-expert gate): lane l owns 16-byte chunks
// l, l+32, ... (16 codes each). Bytes 0/1 of a word use the 2^23 trick directly and bytes 2/3 on
// w >> 16, so x is pre-scaled by (1, 1/256, 1, 1/256); chunk sums give the bias term.
template <int CPL, int R>
__global__ void __launch_bounds__(256) gemv_q8_kernel(const __grid_constant__ GemvLaunch L) {
  extern __shared__ float4 sm4[];
  constexpr int cols = CPL * 512;
  float* xsum = reinterpret_cast<float*>(sm4 + cols / 4);
  const int j = find_job(L);
  const GemvJob& jb = L.job[j];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ float red[8];
  pdl_trigger();
  l2_prefetch(L.pf);
  pdl_wait();
  const float* xin = L.norm.w ? L.norm.h : jb.x;
  float ss = 0.f;
  for (int idx = threadIdx.x; idx < cols / 4; idx += blockDim.x) {
    float4 v = reinterpret_cast<const float4*>(xin)[idx];
    if (L.norm.w) {   // D9: stage gain ⊙ h, accumulate Σh²
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      const float4 g = reinterpret_cast<const float4*>(L.norm.w)[idx];
      v.x *= g.x;
      v.y *= g.y;
      v.z *= g.z;
      v.w *= g.w;
    }
    const int ci = idx >> 2, f = idx & 3;
    float s = (v.x + v.y) + (v.z + v.w);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (f == 0) xsum[ci] = s;
    v.y *= 1.f / 256;
    v.w *= 1.f / 256;
    sm4[(ci >> 5) * 128 + f * 32 + (ci & 31)] = v;
  }
  if (L.norm.w) {
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
  }
  __syncthreads();
  const float nscale = L.norm.w ? fold_norm_scale(red, 8, cols, L.norm.eps, L.norm.h, L.norm.w,
                                                  blockIdx.x == 0 ? L.norm_out : nullptr)
                                : 1.f;
  const int nb = L.block_begin[j + 1] - L.block_begin[j], bj = blockIdx.x - L.block_begin[j];
  const int rows = jb.w.rows;
  const uint4* data = static_cast<const uint4*>(jb.w.data);
  const uint16_t* sc = static_cast<const uint16_t*>(jb.w.scales);
  const uint16_t* bi = static_cast<const uint16_t*>(jb.w.biases);
  const float M = 8388608.f;
  for (int g = bj; g * 8 * R < rows; g += nb) {
    const int r0 = g * 8 * R + warp * R;
    if (r0 >= rows) break;
    uint4 w[R][CPL];
    float s[R][CPL], b[R][CPL];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t row = min(r0 + r, rows - 1);
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        w[r][i] = __ldcs(data + row * (cols / 16) + lane + 32 * i);
        s[r][i] = bf16f(sc[row * (cols / 64) + ((lane + 32 * i) >> 2)]);
        b[r][i] = bf16f(bi[row * (cols / 64) + ((lane + 32 * i) >> 2)]);
      }
    }
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const float xs = xsum[lane + 32 * i];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float d = 0.f;
#pragma unroll
        for (int f = 0; f < 4; ++f) {
          const float4 xv = sm4[i * 128 + f * 32 + lane];
          const uint32_t wd = word_of(w[r][i], f), h = wd >> 16;
          d = fmaf(__uint_as_float((wd & 0xFFu) | 0x4B000000u) - M, xv.x, d);
          d = fmaf(__uint_as_float((wd & 0xFF00u) | 0x4B000000u) - M, xv.y, d);
          d = fmaf(__uint_as_float((h & 0xFFu) | 0x4B000000u) - M, xv.z, d);
          d = fmaf(__uint_as_float((h & 0xFF00u) | 0x4B000000u) - M, xv.w, d);
        }
        acc[r] = fmaf(s[r][i], d, fmaf(b[r][i], xs, acc[r]));
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float v = warp_sum(acc[r]);
      if (lane == 0 && r0 + r < rows) gemv_store(jb, r0 + r, v * nscale);
    }
  }
}

constexpr int kGenTok = 8;   // tokens per pass of the generic kernel

// One warp per row; the row's weights are dequantised once per pass of up to kGenTok tokens.
__global__ void __launch_bounds__(256) gemv_generic_kernel(const __grid_constant__ GemvLaunch L) {
  const int j = find_job(L);
  const GemvJob& jb = L.job[j];
  const QMat& m = jb.w;
  const int lane = threadIdx.x & 31;
  pdl_trigger();
  l2_prefetch(L.pf);
  pdl_wait();
  const int row = (blockIdx.x - L.block_begin[j]) * 8 + (threadIdx.x >> 5);
  if (row >= m.rows) return;
  const int t0 = blockIdx.y * kGenTok, nt = min(kGenTok, L.T - t0);
  const int cols = m.cols;
  const float* x = jb.x + int64_t(t0) * cols;
  float acc[kGenTok];
#pragma unroll
  for (int t = 0; t < kGenTok; ++t) acc[t] = 0.f;
  auto fma_tok = [&](float wv, int k) {
#pragma unroll
    for (int t = 0; t < kGenTok; ++t)
      if (t < nt) acc[t] = fmaf(wv, x[int64_t(t) * cols + k], acc[t]);
  };
  if (m.type == kQ4 || m.type == kQ8) {
    const int per = m.type == kQ4 ? 8 : 4, bits = 32 / per;
    const uint32_t mask = (1u << bits) - 1u;
    const uint32_t* d = static_cast<const uint32_t*>(m.data) + int64_t(row) * (cols / per);
    for (int u = lane; u < cols / per; u += 32) {
      const uint32_t w = d[u];
      const int g = u * per / m.gs;
      const float s = qm_sb(m, m.scales, row, g), b = qm_sb(m, m.biases, row, g);
      for (int e = 0; e < per; ++e) fma_tok(fmaf(s, float((w >> (bits * e)) & mask), b), u * per + e);
    }
  } else if (m.type == kBF) {
    const uint16_t* d = static_cast<const uint16_t*>(m.data) + int64_t(row) * cols;
    for (int k = lane; k < cols; k += 32) fma_tok(bf16f(d[k]), k);
  } else {
    const float* d = static_cast<const float*>(m.data) + int64_t(row) * cols;
    for (int k = lane; k < cols; k += 32) fma_tok(d[k], k);
  }
#pragma unroll
  for (int t = 0; t < kGenTok; ++t) {
    float v = warp_sum(acc[t]);
    if (lane == 0 && t < nt) gemv_store(jb, int64_t(t0 + t) * m.rows + row, v);
  }
}

template <int CPL, int R, bool Q8 = false>
void launch_fast(const std::vector<GemvJob>& jobs, cudaStream_t s, const GemvNorm* norm, bool& norm_written,
                 const L2Prefetch*& pf, bool x16 = false) {
  GemvLaunch L{};
  if (pf) L.pf = *pf;
  pf = nullptr;   // D13: once per batch
  L.n = int(jobs.size());
  L.T = 1;
  L.stage_regs = stage_regs_enabled() ? 1 : 0;
  L.trace = std::exchange(gemv_trace_next(), nullptr);
  // D39: router-row dots on the int16 register-staged kernel (x16 needs D21's staging).
  GemvRouterRows& rt = gemv_router_next();
  const bool use_rt = !Q8 && (rt.q || rt.qi) && x16 && L.stage_regs && rt.cols == CPL * 1024;
  if (use_rt) {
    L.rt = rt;
    rt.used = true;
  }
  rt.q = nullptr;
  rt.qi = nullptr;
  if (norm) {   // D9: the first launch of the batch writes the normalised x
    L.norm = *norm;
    L.norm_out = norm_written ? nullptr : const_cast<float*>(jobs[0].x);
    norm_written = true;
  }
  // At most one wave per job (3 CTAs per SM); larger jobs loop with a software pipeline. D14: one
  // wave for the whole batch (the GDN projections had 656 CTAs, attention's q/k/v 460, for 396
  // resident: a tail wave that repeats the prologue and delays the next launch); each job gets a
  // share of the wave in proportion to its row groups.
  const int wave = 3 * sm_count();
  int64_t groups = 0;
  for (const GemvJob& j : jobs) groups += (j.w.rows + 8 * R - 1) / (8 * R);
  int nb = 0;
  for (int j = 0; j < L.n; ++j) {
    L.job[j] = jobs[j];
    L.block_begin[j] = nb;
    const int gj = (jobs[j].w.rows + 8 * R - 1) / (8 * R);
    nb += gemv_one_wave_enabled() && groups > wave ? std::max(1, int(int64_t(gj) * wave / groups))
                                                   : std::min(gj, wave);
  }
  L.block_begin[L.n] = nb;
  if constexpr (!Q8) {
    const int late = pdl_late_mask();
    L.late = ((late & kLateGemvRes) && L.n == 1 && jobs[0].res) || ((late & kLateGemvNorm) && norm) ? 1 : 0;
  }
  if constexpr (Q8) {
    const int smem = CPL * 512 * 4 + CPL * 32 * 4;
    launch(gemv_q8_kernel<CPL, R>, dim3(nb), dim3(256), smem, s, L);
  } else {
    const int smem = CPL * 1024 * 4 + CPL * 32 * 4;
    // D39: one CTA per router row at least (the CTAs past the jobs' rows only compute theirs).
    const int fs = gemv_fused_stage_mode();   // D89 / D90
    if (use_rt) {
      launch(fs == 2   ? gemv_q4_kernel<CPL, R, true, true, 2>
             : fs == 1 ? gemv_q4_kernel<CPL, R, true, true, 1>
                       : gemv_q4_kernel<CPL, R, true, true>,
             dim3(std::max(nb, L.rt.n)), dim3(256), smem + CPL * 1024 * 4, s, L);
      CUDA_LAUNCH_CHECK();
      return;
    }
    // D24: int16 x and dp2a (needs D21's register staging).
    if (x16 && L.stage_regs)
      launch(fs == 2   ? gemv_q4_kernel<CPL, R, true, false, 2>
             : fs == 1 ? gemv_q4_kernel<CPL, R, true, false, 1>
                       : gemv_q4_kernel<CPL, R, true>,
             dim3(nb), dim3(256), smem, s, L);
    else launch(gemv_q4_kernel<CPL, R>, dim3(nb), dim3(256), smem, s, L);
  }
  CUDA_LAUNCH_CHECK();
}

bool mma_ok(const QMat& w) {
  return w.type == kQ4 && !w.sb_f32 && w.gs == 64 && w.cols % 256 == 0 && w.cols <= 8192;
}

void launch_mma(const std::vector<GemvJob>& jobs, cudaStream_t s, const L2Prefetch*& pf) {
  GemvLaunch L{};
  if (pf) L.pf = *pf;
  pf = nullptr;
  L.n = int(jobs.size());
  L.T = 1;
  int64_t tiles = 0;
  int gcd4 = 0, cmax = 0;
  for (const GemvJob& j : jobs) {
    tiles += (j.w.rows + 15) / 16;
    gcd4 = std::gcd(gcd4, j.w.cols / 256);
    cmax = std::max(cmax, j.w.cols);
  }
  const int ks = mma_k_split(tiles, gcd4, 2 * sm_count());
  int nb = 0;
  for (int j = 0; j < L.n; ++j) {
    L.job[j] = jobs[j];
    L.block_begin[j] = nb;
    const int sets = ((jobs[j].w.rows + 15) / 16 * ks + 7) / 8;
    nb += std::min(sets, 2 * sm_count());
  }
  L.block_begin[L.n] = nb;
  const int smem = cmax * 4 + cmax / 64 * 8;
  launch(gemv_q4_mma_kernel, dim3(nb), dim3(256), smem, s, L, ks);
  CUDA_LAUNCH_CHECK();
}

void launch_generic(const std::vector<GemvJob>& jobs, int T, cudaStream_t s, const L2Prefetch*& pf) {
  GemvLaunch L{};
  if (pf) L.pf = *pf;
  pf = nullptr;
  L.n = int(jobs.size());
  L.T = T;
  int nb = 0;
  for (int j = 0; j < L.n; ++j) {
    L.job[j] = jobs[j];
    L.block_begin[j] = nb;
    nb += (jobs[j].w.rows + 7) / 8;
  }
  L.block_begin[L.n] = nb;
  dim3 grid(nb, (T + kGenTok - 1) / kGenTok);
  launch(gemv_generic_kernel, grid, dim3(256), 0, s, L);
  CUDA_LAUNCH_CHECK();
}

__global__ void embed_kernel(QMat E, const int32_t* tokens, int T, float* out) {
  pdl_trigger();
  pdl_wait();
  const int t = blockIdx.y, k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= E.cols) return;
  const int id = tokens[t];
  out[int64_t(t) * E.cols + k] = id >= 0 && id < E.rows ? qm_at(E, id, k) : 0.f;
}

__global__ void __launch_bounds__(256) rmsnorm_kernel(float* h, const float* r, const float* w,
                                                      int n, float eps, float* out) {
  __shared__ float red[32];
  pdl_trigger();
  pdl_wait();
  const int64_t base = int64_t(blockIdx.x) * n;
  float ss = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float v = h[base + i];
    if (r) {
      v += r[base + i];
      h[base + i] = v;
    }
    ss += v * v;
  }
  const float scale = rsqrtf(block_sum(ss, red) / float(n) + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[base + i] = h[base + i] * scale * w[i];
}

// n = 4 * blockDim.x: one float4 per thread, everything in registers.
__global__ void rmsnorm4_kernel(float* h, const float* r, const float* w, int n, float eps, float* out) {
  __shared__ float red[32];
  pdl_trigger();
  pdl_wait();
  const int64_t base = int64_t(blockIdx.x) * n;
  float4 v = reinterpret_cast<const float4*>(h + base)[threadIdx.x];
  if (r) {
    const float4 a = reinterpret_cast<const float4*>(r + base)[threadIdx.x];
    v.x += a.x;
    v.y += a.y;
    v.z += a.z;
    v.w += a.w;
    reinterpret_cast<float4*>(h + base)[threadIdx.x] = v;
  }
  const float scale = rsqrtf(block_sum(v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w, red) / float(n) + eps);
  const float4 g = reinterpret_cast<const float4*>(w)[threadIdx.x];
  reinterpret_cast<float4*>(out + base)[threadIdx.x] =
      make_float4(v.x * scale * g.x, v.y * scale * g.y, v.z * scale * g.z, v.w * scale * g.w);
}

__global__ void add_kernel(float* h, const float* r, int64_t n) {
  pdl_trigger();
  pdl_wait();
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) h[i] += r[i];
}

}  // namespace

bool& stage_regs_enabled() {
  static bool on = true;
  return on;
}
int& gemv_fused_stage_mode() {
  static int mode = 2;
  return mode;
}

bool& gemv_x16_enabled() {
  static bool on = true;
  return on;
}
GemvRouterRows& gemv_router_next() {
  static GemvRouterRows r;
  return r;
}

unsigned long long*& gemv_trace_next() {
  static unsigned long long* p = nullptr;
  return p;
}

bool& gemv_one_wave_enabled() {
  static bool on = true;
  return on;
}

bool& mma_q4_enabled() {
  static bool on = true;
  return on;
}

bool& lmhead_i16_enabled() {
  static bool on = true;
  return on;
}

bool mma_q4_all() {
  static const bool all = [] {
    const char* e = std::getenv("LILY_MMA_Q4");
    return e && std::string(e) == "all";
  }();
  return all;
}

bool gemv_fast_ok(const QMat& w) {
  if (w.sb_f32 || w.gs != 64) return false;
  if (w.type == kQ8) return w.cols == 2048;
  return w.type == kQ4 && (w.cols == 2048 || w.cols == 4096);
}

namespace {
// D26: with int16 x (D24, staged from registers: D21) the FFMA/dp2a GEMV streams the lm_head faster than
// the mma.sync one (+2.7 % per step at 4K, +1.9 % at 128K, session 6), so the large-row scope of D1m
// applies only when D26 or D24 is off.
bool routes_to_mma(const QMat& w, int T, bool fast) {
  const bool big_mma = w.rows >= kMmaMinRows && !(lmhead_i16_enabled() && gemv_x16_enabled() && stage_regs_enabled());
  return fast && T == 1 && mma_q4_enabled() && mma_ok(w) && (mma_q4_all() || big_mma);
}
}  // namespace

bool gemv_norm_ok(const QMat& w, int T, bool fast) {
  return T == 1 && fast && !routes_to_mma(w, T, fast) && gemv_fast_ok(w);
}

// D39: Q for one layer (cuda_ops.h). CTA (x, y): columns 256x .. 256x + 255 of Q_a for rows 16y .. 16y + 15,
// the rows' A = W_r·diag(w2) staged 256 columns at a time; CTAs x = 0 also write those A values as Q_h.
// Every product and sum in fp32 (the dequantised weights are exact in fp32).
__global__ void __launch_bounds__(256) router_fold_kernel(QMat wr, QMat wsg, const float* w2, QMat wo, float* q) {
  constexpr int RB = 16;
  __shared__ float A[RB][256];
  const int E = wr.rows, H = wr.cols, C = wo.cols, n = E + 1;
  const int c = blockIdx.x * 256 + threadIdx.x, e0 = blockIdx.y * RB;
  float acc[RB] = {};
  for (int k0 = 0; k0 < H; k0 += 256) {
    __syncthreads();
    for (int r = 0; r < RB; ++r) {
      const int e = e0 + r, k = k0 + threadIdx.x;
      float v = 0.f;
      if (e < n && k < H) v = (e < E ? qm_at(wr, e, k) : qm_at(wsg, 0, k)) * w2[k];
      A[r][threadIdx.x] = v;
      if (blockIdx.x == 0 && e < n && k < H) q[int64_t(e) * (H + C) + k] = v;
    }
    __syncthreads();
    if (c < C)
      for (int kk = 0; kk < 256 && k0 + kk < H; ++kk) {
        const float w = qm_at(wo, k0 + kk, c);
#pragma unroll
        for (int r = 0; r < RB; ++r) acc[r] = fmaf(A[r][kk], w, acc[r]);
      }
  }
  if (c < C)
    for (int r = 0; r < RB; ++r)
      if (e0 + r < n) q[int64_t(e0 + r) * (H + C) + H + c] = acc[r];
}

// D76: each group of 64 values of q as int16 codes times one fp32 scale (max |q| / 32767; round to nearest).
__global__ void router_fold_i16_kernel(const float* q, int16_t* qi, float* qscale, int64_t groups) {
  const int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (g >= groups) return;
  const float* v = q + g * 64;
  float m = 0.f;
  for (int i = 0; i < 64; ++i) m = fmaxf(m, fabsf(v[i]));
  const float sc = m / 32767.f, inv = m > 0.f ? 32767.f / m : 0.f;
  for (int i = 0; i < 64; ++i) qi[g * 64 + i] = int16_t(max(-32767, min(32767, __float2int_rn(v[i] * inv))));
  qscale[g] = sc;
}

void router_fold_to_i16(const float* q, int16_t* qi, float* qscale, int64_t n, cudaStream_t s) {
  LILY_CHECK(n % 64 == 0, "router fold int16: a whole number of 64-value groups");
  const int64_t groups = n / 64;
  router_fold_i16_kernel<<<int((groups + 255) / 256), 256, 0, s>>>(q, qi, qscale, groups);
  CUDA_LAUNCH_CHECK();
}

void build_router_fold(const QMat& router, const QMat& shared_gate, const float* w2, const QMat& wo, float* q,
                       cudaStream_t s) {
  LILY_CHECK(router.cols == wo.rows && shared_gate.cols == router.cols && shared_gate.rows == 1,
             "router fold: shapes (router E x H, shared gate 1 x H, out-projection H x C)");
  router_fold_kernel<<<dim3((wo.cols + 255) / 256, (router.rows + 1 + 15) / 16), 256, 0, s>>>(router, shared_gate, w2,
                                                                                             wo, q);
  CUDA_LAUNCH_CHECK();
}

void gemv_batch(const GemvJob* jobs, int n, int T, bool fast, cudaStream_t s, const GemvNorm* norm,
                const L2Prefetch* pf) {
  std::vector<GemvJob> f2, f4, q8, mm, gen;
  for (int i = 0; i < n; ++i) {
    const GemvJob& j = jobs[i];
    if (routes_to_mma(j.w, T, fast))
      mm.push_back(j);
    else if (fast && T == 1 && gemv_fast_ok(j.w))
      (j.w.type == kQ8 ? q8 : j.w.cols == 2048 ? f2 : f4).push_back(j);
    else
      gen.push_back(j);
  }
  LILY_CHECK(!norm || (mm.empty() && gen.empty()), "gemv_batch: folded rmsnorm on a kernel without it");
  bool written = false;
  // D24: x as int16 per 32 values (dp2a) in the 2,048/4,096-column kernels.
  const bool x16 = stage_regs_enabled() && gemv_x16_enabled();
  if (!f2.empty()) launch_fast<2, 2>(f2, s, norm, written, pf, x16);
  if (!f4.empty()) launch_fast<4, 1>(f4, s, norm, written, pf, x16);
  if (!q8.empty()) launch_fast<4, 2, true>(q8, s, norm, written, pf);
  if (!mm.empty()) launch_mma(mm, s, pf);
  if (!gen.empty()) launch_generic(gen, T, s, pf);
}

void embed(const QMat& E, const int32_t* tokens, int T, float* out, cudaStream_t s) {
  dim3 grid((E.cols + 255) / 256, T);
  launch(embed_kernel, grid, dim3(256), 0, s, E, tokens, T, out);
  CUDA_LAUNCH_CHECK();
}

void rmsnorm(float* h, const float* r, const float* w, int n, int T, float eps, float* out,
             cudaStream_t s) {
  if (n % 128 == 0 && n / 4 <= 1024)
    launch(rmsnorm4_kernel, dim3(T), dim3(n / 4), 0, s, h, r, w, n, eps, out);
  else
    launch(rmsnorm_kernel, dim3(T), dim3(256), 0, s, h, r, w, n, eps, out);
  CUDA_LAUNCH_CHECK();
}

__global__ void f16_convert_kernel(float* p, int64_t n, __half* out16) {
  pdl_trigger();
  pdl_wait();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const __half h = sat_half(p[i]);   // as the projection GEMM's fp16 segments
    if (out16) out16[i] = h;
    else p[i] = __half2float(h);
  }
}
void f16_convert(float* p, int64_t n, __half* out16, cudaStream_t s) {
  launch(f16_convert_kernel, dim3(unsigned(std::min<int64_t>((n + 255) / 256, 4096))), dim3(256), 0, s, p, n, out16);
  CUDA_LAUNCH_CHECK();
}

void add(float* h, const float* r, int64_t n, cudaStream_t s) {
  launch(add_kernel, dim3(unsigned((n + 255) / 256)), dim3(256), 0, s, h, r, n);
  CUDA_LAUNCH_CHECK();
}

}  // namespace lily::cuda
