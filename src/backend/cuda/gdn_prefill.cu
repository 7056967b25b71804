// Gated DeltaNet prefill (P4) for T > 1 tokens per call, in three launches:
//  1. prep: every (token, 128-channel head) at once: causal conv with the carried conv state, SiLU,
//     l2norm of q and k (q also × dk^-1/2), gates β = σ(b) and g = −exp(A_log)·softplus(a+dt_bias),
//     written to a workspace sized by T.
//  2. scan: the delta rule, sequential over the tokens but split over the state's columns: given
//     q̂, k̂, β, g, each value column of S evolves independently, so 32 heads × (128 / CB) column
//     blocks run as separate CTAs with their slice of S in fp32 registers for the whole call (S is
//     read and written once). Inside a warp, lane (rg, cg) holds rows 16rg..16rg+15 of NC columns;
//     the two per-token reductions over rows (Sᵀk̂, Sᵀq̂) are 3 shuffles, no block barrier per token.
//     Tokens are staged 32 at a time into shared memory with cp.async, one block ahead.
//     The same kernel shifts the carried conv state (it runs after prep has read it).
//  3. norm: gated RMSNorm over each head's 128 outputs (needs all column blocks) with silu(z).
#include "backend/cuda/prefill_attn.h"

namespace lily::cuda {

namespace {

constexpr int kHD = 128;       // dk == dv of the shapes these kernels take
constexpr int kTB = 32;        // tokens per shared-memory stage of the scan
constexpr int kScanWarps = 4;  // warps per scan CTA
constexpr int kPrepTok = 8;    // tokens per prep CTA (amortises the CTA start over several tokens)

struct PrepArgs {
  GdnDims d;
  const float *conv_w, *A_log, *dt_bias, *conv_state, *qkv, *a, *b;
  int T;
  float *u, *beta, *g;
  const __half* qkv16;   // P62: the raw inputs as fp16 (qkv unused), P41's kernel only
};

// Gates of token t, value head j: g = −exp(A_log)·softplus(a + dt_bias), β = σ(b).
__device__ __forceinline__ void prep_gates(const PrepArgs& p, int t, int j) {
  const int64_t tj = int64_t(t) * p.d.nv + j;
  const float av = p.a[tj] + p.dt_bias[j];
  const float sp = av > 20.f ? av : log1pf(expf(av));
  p.g[tj] = -expf(p.A_log[j]) * sp;
  p.beta[tj] = 1.f / (1.f + expf(-p.b[tj]));
}

// grid (ceil(T / 8), conv_dim / 128), block 128: one thread per channel, 8 consecutive tokens. The
// q and k channel blocks are exactly one head each, so their l2norm is one block reduction.
__global__ void __launch_bounds__(kHD) gdn_prep_kernel(const __grid_constant__ PrepArgs p) {
  __shared__ float red[32];
  pdl_trigger();
  pdl_wait();
  const GdnDims& d = p.d;
  const int K = d.kconv;
  const int64_t CD = d.conv_dim;
  const int blk0 = blockIdx.y * kHD, ch = blk0 + threadIdx.x;
  const int key_dim = d.nk * d.dk;
  const int t_end = min(p.T, int(blockIdx.x + 1) * kPrepTok);
  for (int t = blockIdx.x * kPrepTok; t < t_end; ++t) {   // uniform over the block
    float acc = 0.f;
    for (int tap = 0; tap < K; ++tap) {
      const int tt = t - (K - 1) + tap;   // raw input of token tt (< 0: the carried conv state)
      const float x = tt >= 0 ? p.qkv[int64_t(tt) * CD + ch] : p.conv_state[int64_t(tt + K - 1) * CD + ch];
      acc = fmaf(p.conv_w[int64_t(ch) * K + tap], x, acc);
    }
    float u = siluf_(acc);
    if (blk0 < 2 * key_dim) {   // q or k head (uniform over the block)
      const float ss = block_sum(u * u, red);
      u *= rsqrtf(ss + 1e-6f) * (blk0 < key_dim ? rsqrtf(float(d.dk)) : 1.f);
    } else if (threadIdx.x == 0) {
      prep_gates(p, t, (blk0 - 2 * key_dim) / d.dv);
    }
    p.u[int64_t(t) * CD + ch] = u;
  }
}

// P9: the same pass with a CTA's work in flight at once: the conv weights before the PDL wait, the
// kPrepTok + K - 1 raw inputs of its 8 tokens loaded together (one memory round trip instead of one
// per token), the 8 tokens' q/k sums of squares reduced with one barrier instead of two per token,
// and the gates of the 8 tokens computed by 8 threads. Same arithmetic per value. (32 tokens per CTA
// measured no faster in session 12: 0.127 ms per 4K call either way, so the halo re-reads, 1.375× the
// raw input at 8, are not what bounds it.)
constexpr int kPrepMaxK = 9;   // gdn_prefill_ok: conv kernel <= 9
__global__ void __launch_bounds__(kHD) gdn_prep_batched_kernel(const __grid_constant__ PrepArgs p) {
  __shared__ float red[kPrepTok][kHD / 32];
  pdl_trigger();
  const GdnDims& d = p.d;
  const int K = d.kconv;
  const int64_t CD = d.conv_dim;
  const int blk0 = blockIdx.y * kHD, ch = blk0 + threadIdx.x;
  const int key_dim = d.nk * d.dk;
  const int t0 = blockIdx.x * kPrepTok;
  float w[kPrepMaxK];
#pragma unroll
  for (int tap = 0; tap < kPrepMaxK; ++tap) w[tap] = tap < K ? p.conv_w[int64_t(ch) * K + tap] : 0.f;
  pdl_wait();
  constexpr int W = kPrepTok + kPrepMaxK - 1;   // window: raw inputs of tokens t0 - (K-1) ...
  float x[W];
#pragma unroll
  for (int i = 0; i < W; ++i) {
    const int tt = t0 - (K - 1) + i;
    x[i] = 0.f;
    if (tt < p.T && tt - t0 < kPrepTok)   // i < kPrepTok + K - 1, and within the call
      x[i] = tt >= 0 ? p.qkv[int64_t(tt) * CD + ch] : p.conv_state[int64_t(tt + K - 1) * CD + ch];
  }
  float u[kPrepTok];
#pragma unroll
  for (int j = 0; j < kPrepTok; ++j) {
    float acc = 0.f;
#pragma unroll
    for (int tap = 0; tap < kPrepMaxK; ++tap)
      if (tap < K) acc = fmaf(w[tap], x[j + tap], acc);
    u[j] = siluf_(acc);
  }
  if (blk0 < 2 * key_dim) {   // q or k head (uniform over the block)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int j = 0; j < kPrepTok; ++j) {
      const float ss = warp_sum(u[j] * u[j]);
      if (lane == 0) red[j][warp] = ss;
    }
    __syncthreads();
    const float qs = blk0 < key_dim ? rsqrtf(float(d.dk)) : 1.f;
#pragma unroll
    for (int j = 0; j < kPrepTok; ++j) {
      float ss = 0.f;
#pragma unroll
      for (int q = 0; q < kHD / 32; ++q) ss += red[j][q];
      u[j] *= rsqrtf(ss + 1e-6f) * qs;
    }
  } else if (threadIdx.x < kPrepTok && t0 + int(threadIdx.x) < p.T) {   // gates of token t0 + thread
    prep_gates(p, t0 + int(threadIdx.x), (blk0 - 2 * key_dim) / d.dv);
  }
#pragma unroll
  for (int j = 0; j < kPrepTok; ++j)
    if (t0 + j < p.T) p.u[int64_t(t0 + j) * CD + ch] = u[j];
}

// P41: the same pass (conv kernel 4 only) with each warp on one 128-channel head and each lane on 4 consecutive
// channels: float4 loads and stores, 512 contiguous bytes per warp and row (2 KB per CTA of 4 heads), and a q / k
// head's sum of squares per token in one warp butterfly (no shared memory, no block barrier). The conv, SiLU, the
// norm's expression and the gates are P9's; only the order of the sum of squares differs (each lane's 4 values,
// then the butterfly, instead of a butterfly per 32 channels and the 4 warps' sums in order).
// H16 (P62): the raw inputs read as fp16 (p.qkv16), each value widened to f32 on load; the rest unchanged.
constexpr int kPrepWideWarps = 4;
// LEAN (P74, H16 only): the raw window held as fp16 (2 registers per row instead of 4; fp16 -> f32 is exact, so every
// value is the same) and launch bounds for 8 CTAs per SM. ncu (session 29, 4K prefill): without it 78 registers, 6 CTAs
// (37.5 % occupancy), long-scoreboard stalls 49 %, 1.80 TB/s. The carried conv state's rows (f32; only the first CTA
// row of the call, t0 < 3) are read from memory where they are used instead of being held.
template <bool H16, bool LEAN = false>
__global__ void __launch_bounds__(32 * kPrepWideWarps, LEAN ? 8 : 1)
    gdn_prep_wide_kernel(const __grid_constant__ PrepArgs p) {
  static_assert(!LEAN || H16, "P74: fp16 inputs only");
  constexpr int K = 4, W = kPrepTok + K - 1;
  pdl_trigger();
  const GdnDims& d = p.d;
  const int64_t CD = d.conv_dim;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int head = blockIdx.y * kPrepWideWarps + warp, ch = head * kHD + 4 * lane;
  const int nqk = 2 * d.nk, t0 = blockIdx.x * kPrepTok;
  float4 w[4];   // w[c]: the K = 4 taps of channel ch + c
#pragma unroll
  for (int c = 0; c < 4; ++c) w[c] = reinterpret_cast<const float4*>(p.conv_w + int64_t(ch) * K)[c];
  pdl_wait();
  auto h4 = [](const uint2& v) {   // 4 fp16 -> f32 (exact)
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&v.x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&v.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  };
  float4 x[LEAN ? 1 : W];    // raw inputs of tokens t0 - 3 .. t0 + 7 (the carried conv state before the call's first token)
  uint2 xr[LEAN ? W : 1];    // LEAN: the same as fp16 (zero for the conv state's rows)
#pragma unroll
  for (int i = 0; i < W; ++i) {
    const int tt = t0 - (K - 1) + i;
    if constexpr (LEAN) {
      xr[i] = make_uint2(0u, 0u);
      if (tt >= 0 && tt < p.T) xr[i] = *reinterpret_cast<const uint2*>(p.qkv16 + int64_t(tt) * CD + ch);
    } else {
      x[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (tt < p.T) {
        if (tt < 0) {
          x[i] = *reinterpret_cast<const float4*>(p.conv_state + int64_t(tt + K - 1) * CD + ch);
        } else if constexpr (H16) {
          x[i] = h4(*reinterpret_cast<const uint2*>(p.qkv16 + int64_t(tt) * CD + ch));
        } else {
          x[i] = *reinterpret_cast<const float4*>(p.qkv + int64_t(tt) * CD + ch);
        }
      }
    }
  }
  auto xrow = [&](int i) -> float4 {   // window row i as f32
    if constexpr (LEAN) {
      const int tt = t0 - (K - 1) + i;
      if (tt < 0) return *reinterpret_cast<const float4*>(p.conv_state + int64_t(tt + K - 1) * CD + ch);
      return h4(xr[i]);
    } else {
      return x[i];
    }
  };
  const bool qk = head < nqk;   // uniform per warp
  const float qs = head < d.nk ? rsqrtf(float(d.dk)) : 1.f;
  // Component c (a constant once unrolled) of a float4, so that the rows stay in registers.
  auto cmp = [](const float4& v, int c) { return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w; };
  // Rows j .. j + 3 of the window as f32, each converted once (LEAN: the conversions would otherwise be repeated per
  // token that reads the row: 16 % more instructions in session 29's ncu of the first P74 form).
  float4 r0 = xrow(0), r1 = xrow(1), r2 = xrow(2), r3;
#pragma unroll
  for (int j = 0; j < kPrepTok; ++j) {
    r3 = xrow(j + 3);
    auto conv = [&](const float4& wc, int c) {   // P9's order: taps 0..3, fmaf from 0
      float acc = 0.f;
      acc = fmaf(wc.x, cmp(r0, c), acc);
      acc = fmaf(wc.y, cmp(r1, c), acc);
      acc = fmaf(wc.z, cmp(r2, c), acc);
      acc = fmaf(wc.w, cmp(r3, c), acc);
      return siluf_(acc);
    };
    float4 u = make_float4(conv(w[0], 0), conv(w[1], 1), conv(w[2], 2), conv(w[3], 3));
    if (qk) {
      const float sc = rsqrtf(warp_sum(u.x * u.x + u.y * u.y + u.z * u.z + u.w * u.w) + 1e-6f) * qs;
      u.x *= sc;
      u.y *= sc;
      u.z *= sc;
      u.w *= sc;
    }
    if (t0 + j < p.T) *reinterpret_cast<float4*>(p.u + int64_t(t0 + j) * CD + ch) = u;
    r0 = r1;
    r1 = r2;
    r2 = r3;
  }
  if (!qk && lane < kPrepTok && t0 + lane < p.T) prep_gates(p, t0 + lane, head - nqk);
}

// New conv state = the last K-1 raw inputs of the call; run after prep has read the old one. A
// thread owns whole channels, so reading the old rows (T < K-1) before writing needs no barrier.
// qkv null (P62): left to gdn_conv_shift16_kernel. Q: the raw input type (float, or __half with P62).
template <typename Q>
__device__ void conv_shift(const GdnDims& d, float* conv_state, const Q* qkv, int T) {
  if (!qkv) return;
  const int K1 = d.kconv - 1;
  const int64_t CD = d.conv_dim;
  for (int64_t ch = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; ch < CD; ch += int64_t(gridDim.x) * blockDim.x) {
    float nw[8];
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if (s >= K1) break;
      const int tt = T - K1 + s;
      nw[s] = tt >= 0 ? float(qkv[int64_t(tt) * CD + ch]) : conv_state[int64_t(tt + K1) * CD + ch];
    }
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if (s >= K1) break;
      conv_state[int64_t(s) * CD + ch] = nw[s];
    }
  }
}

// P62: the conv-state shift from fp16 raw inputs, on its own (the chunk scan then gets qkv null).
__global__ void gdn_conv_shift16_kernel(GdnDims d, float* conv_state, const __half* qkv, int T) {
  pdl_trigger();
  pdl_wait();
  conv_shift(d, conv_state, qkv, T);
}

struct ScanArgs {
  GdnDims d;
  float *conv_state, *S;
  const float *qkv, *u, *beta, *g;
  int T;
  float* y;
};

// grid nv * (128 / CB), block 4 warps; CTA (j, column block) owns columns c0..c0+CB-1 of head j.
// Writes the raw outputs o = Sᵀq̂ to y (normalised later by gdn_norm_kernel).
template <int NC>
__global__ void __launch_bounds__(kScanWarps * 32) gdn_scan_kernel(const __grid_constant__ ScanArgs p) {
  constexpr int W = 4 * NC;             // columns per warp (4 column groups of NC)
  constexpr int CB = kScanWarps * W;    // columns per CTA
  extern __shared__ __align__(16) float sm[];
  float* qs = sm;                       // [2][kTB][kHD]
  float* ks = qs + 2 * kTB * kHD;       // [2][kTB][kHD]
  float* vs = ks + 2 * kTB * kHD;       // [2][kTB][CB]
  float* bs = vs + 2 * kTB * CB;        // [2][kTB] β
  float* gs = bs + 2 * kTB;             // [2][kTB] g (log decay)
  const GdnDims& d = p.d;
  const int nblk = kHD / CB;
  const int j = blockIdx.x / nblk, c0 = (blockIdx.x % nblk) * CB;
  const int kh = j / (d.nv / d.nk);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, rg = lane >> 2, cg = lane & 3;
  const int col = warp * W + cg * NC;   // this lane's first column inside the CTA's block
  const int r0 = rg * 16;               // this lane's first row
  const int key_dim = d.nk * kHD, value_dim = d.nv * kHD;
  const int64_t CD = d.conv_dim;
  float* S = p.S + int64_t(j) * kHD * kHD;
  pdl_trigger();
  pdl_wait();

  auto stage = [&](int t0, int buf) {
    const int nt = min(kTB, p.T - t0);
    for (int idx = threadIdx.x; idx < nt * (kHD / 4); idx += blockDim.x) {
      const int tt = idx / (kHD / 4), c4 = idx % (kHD / 4);
      const float* row = p.u + int64_t(t0 + tt) * CD;
      cp_async16(qs + (buf * kTB + tt) * kHD + 4 * c4, row + kh * kHD + 4 * c4);
      cp_async16(ks + (buf * kTB + tt) * kHD + 4 * c4, row + key_dim + kh * kHD + 4 * c4);
    }
    for (int idx = threadIdx.x; idx < nt * (CB / 4); idx += blockDim.x) {
      const int tt = idx / (CB / 4), c4 = idx % (CB / 4);
      cp_async16(vs + (buf * kTB + tt) * CB + 4 * c4, p.u + int64_t(t0 + tt) * CD + 2 * key_dim + j * kHD + c0 + 4 * c4);
    }
    for (int idx = threadIdx.x; idx < nt; idx += blockDim.x) {
      cp_async4(bs + buf * kTB + idx, p.beta + int64_t(t0 + idx) * d.nv + j);
      cp_async4(gs + buf * kTB + idx, p.g + int64_t(t0 + idx) * d.nv + j);
    }
    cp_async_commit();
  };

  float st[16][NC];
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int c = 0; c < NC; ++c) st[i][c] = S[(r0 + i) * kHD + c0 + col + c];

  stage(0, 0);
  int buf = 0;
  for (int t0 = 0; t0 < p.T; t0 += kTB, buf ^= 1) {
    if (t0 + kTB < p.T) {
      stage(t0 + kTB, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int nt = min(kTB, p.T - t0);
    for (int tt = 0; tt < nt; ++tt) {
      const int slot = buf * kTB + tt;
      float kv[16], qv[16];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 a = reinterpret_cast<const float4*>(ks + slot * kHD + r0)[i];
        const float4 b = reinterpret_cast<const float4*>(qs + slot * kHD + r0)[i];
        kv[4 * i] = a.x; kv[4 * i + 1] = a.y; kv[4 * i + 2] = a.z; kv[4 * i + 3] = a.w;
        qv[4 * i] = b.x; qv[4 * i + 1] = b.y; qv[4 * i + 2] = b.z; qv[4 * i + 3] = b.w;
      }
      // m = Sᵀk̂ over the lane's 16 rows, then over the 8 row groups (lane bits 2..4).
      float m[NC];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        float e0 = 0.f, e1 = 0.f;
#pragma unroll
        for (int i = 0; i < 16; i += 2) {
          e0 = fmaf(st[i][c], kv[i], e0);
          e1 = fmaf(st[i + 1][c], kv[i + 1], e1);
        }
        m[c] = e0 + e1;
      }
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        m[c] += __shfl_xor_sync(0xffffffffu, m[c], 4);
        m[c] += __shfl_xor_sync(0xffffffffu, m[c], 8);
        m[c] += __shfl_xor_sync(0xffffffffu, m[c], 16);
      }
      const float beta = bs[slot], alpha = expf(gs[slot]);
      // Decay first (α S), so Sᵀk̂ of the decayed state is α m; δ = β (v − α m); S ← α S + k̂ δᵀ.
      float o[NC];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const float dl = beta * (vs[slot * CB + col + c] - alpha * m[c]);
        float e0 = 0.f, e1 = 0.f;
#pragma unroll
        for (int i = 0; i < 16; i += 2) {
          st[i][c] = fmaf(alpha, st[i][c], kv[i] * dl);
          st[i + 1][c] = fmaf(alpha, st[i + 1][c], kv[i + 1] * dl);
          e0 = fmaf(st[i][c], qv[i], e0);
          e1 = fmaf(st[i + 1][c], qv[i + 1], e1);
        }
        o[c] = e0 + e1;
      }
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        o[c] += __shfl_xor_sync(0xffffffffu, o[c], 4);
        o[c] += __shfl_xor_sync(0xffffffffu, o[c], 8);
        o[c] += __shfl_xor_sync(0xffffffffu, o[c], 16);
      }
      if (rg == 0) {
        float* yp = p.y + int64_t(t0 + tt) * value_dim + j * kHD + c0 + col;
#pragma unroll
        for (int c = 0; c < NC; ++c) yp[c] = o[c];
      }
    }
    __syncthreads();   // every warp is done with `buf` before the next iteration restages it
  }

#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int c = 0; c < NC; ++c) S[(r0 + i) * kHD + c0 + col + c] = st[i][c];

  conv_shift(d, p.conv_state, p.qkv, p.T);
}

// grid (T, nv), block 128: y = o · rsqrt(mean(o²) + eps) · w · silu(z) over each head's outputs.
template <typename Z>   // float, or __half (P62)
__global__ void __launch_bounds__(kHD) gdn_norm_kernel(GdnDims d, const float* norm_w, const Z* z, int T,
                                                      float* y) {
  __shared__ float red[32];
  pdl_trigger();
  pdl_wait();
  const int t = blockIdx.x, j = blockIdx.y, c = threadIdx.x;
  const int64_t off = int64_t(t) * d.nv * kHD + j * kHD + c;
  const float o = y[off];
  const float ss = block_sum(o * o, red);
  y[off] = o * rsqrtf(ss / float(kHD) + d.eps) * norm_w[c] * siluf_(float(z[off]));
}

// ---- chunked form (P4c) ----------------------------------------------------------------------
// Within a chunk of C = 64 tokens (local index i, G_i = Σ_{s≤i} g_s, γ_i = e^{G_i}, S₀ = state at
// the chunk start, rows of K, Q, V = k̂, q̂, v of the tokens), the delta rule unrolls to
//   (I + A) Δ = diag(β) V − diag(βγ) K S₀,   A_is = β_i e^{G_i−G_s} k̂_i·k̂_s  (s < i)
// so Δ = U − W S₀ with U = (I+A)⁻¹ diag(β) V and W = (I+A)⁻¹ diag(βγ) K, and
//   O = diag(γ) Q S₀ + P Δ,          P_is = e^{G_i−G_s} q̂_i·k̂_s  (s ≤ i)
//   S_C = γ_C S₀ + K'ᵀ Δ,            K'_s = e^{G_C−G_s} k̂_s.
// gdn_chunk_intra_kernel computes U, W, P, diag(γ)Q, K', γ_C for every (head, chunk) in parallel
// (the triangular system by forward substitution in fp32); gdn_chunk_scan_kernel carries S over the
// chunks, split over value columns like the scan. Matrix products run on tensor cores in split
// precision (each operand = bf16 hi + bf16 lo, three MMAs, fp32 accumulation: ~16-bit mantissas),
// so the results stay within the fp32 test bounds; S itself stays in fp32 registers.
constexpr int kC = 64;          // tokens per chunk
constexpr int kRS = kHD + 8;    // bf16 row stride of 128-wide tiles (272 B: ldmatrix rows on distinct banks)
constexpr int kPS = kC + 8;     // bf16 row stride of 64-wide tiles (144 B)
constexpr int kAS = kC + 8;     // f32 row stride of A
constexpr int kNB = 32;         // state columns per chunk-scan CTA
constexpr int kNS = kNB + 8;    // row stride (bf16 or f32) of 32-wide tiles

using bf16 = __nv_bfloat16;

// Per (value head, token) rows, chunks padded to kC rows with zeros (Tp = nch · kC).
struct ChunkBufs {
  float* U;                 // [nv][Tp][128] f32
  bf16 *Wh, *Wl;            // [nv][Tp][128] W = (I+A)⁻¹ diag(βγ) K
  bf16 *Qh, *Ql;            // [nv][Tp][128] diag(γ) Q
  bf16 *Kh, *Kl;            // [nv][Tp][128] K'
  bf16 *Ph, *Pl;            // [nv][Tp][64]  P (row i of chunk c at row c·kC + i)
  float* gC;                // [nv][nch] γ of the chunk's last token
  // P11 shared layout (LILY_GDN_P11 bit 2): Q, K planes hold q̂, k̂ unscaled per key head (rows
  // [nk][Tp], written by the first value head of each key head) and the scan applies the per-row
  // factors below itself, so the two value heads of a key head share one copy.
  float *rg, *rk;           // [nv][Tp] γ_i and e^{G_C − G_i}
  // P11 scan3 (LILY_GDN_P11 bit 4): the Q planes hold Q~ = diag(γ)Q − P W instead of diag(γ)Q, and
  // O0 = P U; the P planes are not written.
  float* O0;                // [nv][Tp][128] f32
  int Tp, nch;
};

// Four floats split into hi / lo bf16, stored as 8 bytes each.
__device__ __forceinline__ void store_split4(bf16* hi, bf16* lo, float4 v) {
  bf16 h[4], l[4];
  split_bf16(v.x, h[0], l[0]);
  split_bf16(v.y, h[1], l[1]);
  split_bf16(v.z, h[2], l[2]);
  split_bf16(v.w, h[3], l[3]);
  *reinterpret_cast<uint2*>(hi) = *reinterpret_cast<const uint2*>(h);
  *reinterpret_cast<uint2*>(lo) = *reinterpret_cast<const uint2*>(l);
}
// Two floats split, stored as one bf16 pair each.
__device__ __forceinline__ void store_split2(bf16* hi, bf16* lo, float a, float b) {
  bf16 h[2], l[2];
  split_bf16(a, h[0], l[0]);
  split_bf16(b, h[1], l[1]);
  *reinterpret_cast<uint32_t*>(hi) = *reinterpret_cast<const uint32_t*>(h);
  *reinterpret_cast<uint32_t*>(lo) = *reinterpret_cast<const uint32_t*>(l);
}
// kOne (P24): only the hi part (x rounded to bf16) is stored; else store_split4 / store_split2.
template <bool kOne>
__device__ __forceinline__ void store_split4x(bf16* hi, bf16* lo, float4 v) {
  if constexpr (kOne) {
    const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
    *reinterpret_cast<uint2*>(hi) = make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
  } else {
    store_split4(hi, lo, v);
  }
}
template <bool kOne>
__device__ __forceinline__ void store_split2x(bf16* hi, bf16* lo, float a, float b) {
  if constexpr (kOne) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    *reinterpret_cast<uint32_t*>(hi) = *reinterpret_cast<const uint32_t*>(&h);
  } else {
    store_split2(hi, lo, a, b);
  }
}

// K K̂ᵀ and Q K̂ᵀ (64×64, k = 128) from the chunk's split-bf16 tiles in shared memory, for the per-chunk passes:
// warp = 16 rows (mt) × 32 columns (nh); blocks entirely above the diagonal skip the MMAs (their accumulators
// stay zero, and the callers still write them).
__device__ __forceinline__ void chunk_kq_products(const bf16* qh, const bf16* ql, const bf16* kh, const bf16* kl, int mt,
                                                  int nh, int lane, float (&aK)[4][4], float (&aQ)[4][4]) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) aK[nt][e] = aQ[nt][e] = 0.f;
  if (32 * nh > 16 * mt + 15) return;
  const int lr = lane & 7, q = lane >> 3;
  const int aoff = (16 * mt + lr + 8 * (q & 1)) * kRS + 8 * (q >> 1);   // A: rows × dims
  const int boff = (32 * nh + lr + 8 * (q >> 1)) * kRS + 8 * (q & 1);   // B: keys (n) × dims (k)
#pragma unroll
  for (int kk = 0; kk < kHD / 16; ++kk) {
    uint32_t akh[4], akl[4], aqh[4], aql[4];
    ldsm_x4(akh[0], akh[1], akh[2], akh[3], kh + aoff + 16 * kk);
    ldsm_x4(akl[0], akl[1], akl[2], akl[3], kl + aoff + 16 * kk);
    ldsm_x4(aqh[0], aqh[1], aqh[2], aqh[3], qh + aoff + 16 * kk);
    ldsm_x4(aql[0], aql[1], aql[2], aql[3], ql + aoff + 16 * kk);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      uint32_t bh[4], bl[4];
      ldsm_x4(bh[0], bh[1], bh[2], bh[3], kh + boff + np * 16 * kRS + 16 * kk);
      ldsm_x4(bl[0], bl[1], bl[2], bl[3], kl + boff + np * 16 * kRS + 16 * kk);
      mma_bf16x3(aK[2 * np], akh, akl, bh[0], bh[1], bl[0], bl[1]);
      mma_bf16x3(aK[2 * np + 1], akh, akl, bh[2], bh[3], bl[2], bl[3]);
      mma_bf16x3(aQ[2 * np], aqh, aql, bh[0], bh[1], bl[0], bl[1]);
      mma_bf16x3(aQ[2 * np + 1], aqh, aql, bh[2], bh[3], bl[2], bl[3]);
    }
  }
}

struct IntraArgs {
  GdnDims d;
  const float *u, *beta, *g;
  int T;
  ChunkBufs b;
  int shared;   // P11 shared layout (gdn_chunk_intra2_kernel only)
  int one;      // P24: only the hi planes are read (gdn_chunk_intra2_kernel<0> skips the lo stores)
};
constexpr size_t kIntraSmem = sizeof(bf16) * 4 * kC * kRS + sizeof(float) * kC * kAS + sizeof(double) * kC +
                              sizeof(float) * 4 * kC;

// grid (nch, nv), block 256 (8 warps), 2 CTAs per SM.
__global__ void __launch_bounds__(256, 2) gdn_chunk_intra_kernel(const __grid_constant__ IntraArgs p) {
  extern __shared__ __align__(16) unsigned char smraw[];
  bf16* qh = reinterpret_cast<bf16*>(smraw);   // [kC][kRS] q̂ hi / lo, k̂ hi / lo
  bf16* ql = qh + kC * kRS;
  bf16* kh = ql + kC * kRS;
  bf16* kl = kh + kC * kRS;
  float* Am = reinterpret_cast<float*>(kl + kC * kRS);   // [kC][kAS] A (zero on and above the diagonal)
  double* Gd = reinterpret_cast<double*>(Am + kC * kAS);  // [kC] G_i in double (differences of large sums)
  float* bs = reinterpret_cast<float*>(Gd + kC);         // [kC] β
  float* gs = bs + kC;                                    // [kC] g
  float* gam = gs + kC;                                   // [kC] γ_i
  float* kdec = gam + kC;                                 // [kC] e^{G_C − G_i}
  pdl_trigger();
  pdl_wait();
  const GdnDims& d = p.d;
  const int c = blockIdx.x, j = blockIdx.y, khd = j / (d.nv / d.nk);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int key_dim = d.nk * kHD;
  const int64_t CD = d.conv_dim;
  const int t0 = c * kC, n = min(kC, p.T - t0);
  const int64_t rb = int64_t(j) * p.b.Tp + t0;   // first buffer row of this chunk

  // Rows past T are zero (g = 0, β = 0): they add nothing and keep γ_C = γ_{n−1}.
  if (tid < kC) {
    const bool ok = tid < n;
    gs[tid] = ok ? p.g[int64_t(t0 + tid) * d.nv + j] : 0.f;
    bs[tid] = ok ? p.beta[int64_t(t0 + tid) * d.nv + j] : 0.f;
  }
  for (int idx = tid; idx < kC * (kHD / 4); idx += blockDim.x) {
    const int r = idx / (kHD / 4), c4 = idx % (kHD / 4);
    float4 qv = make_float4(0.f, 0.f, 0.f, 0.f), kv = qv;
    if (r < n) {
      const float* row = p.u + int64_t(t0 + r) * CD + khd * kHD + 4 * c4;
      qv = *reinterpret_cast<const float4*>(row);
      kv = *reinterpret_cast<const float4*>(row + key_dim);
    }
    store_split4(qh + r * kRS + 4 * c4, ql + r * kRS + 4 * c4, qv);
    store_split4(kh + r * kRS + 4 * c4, kl + r * kRS + 4 * c4, kv);
  }
  __syncthreads();
  if (tid < kC) {
    double acc = 0.0;
    for (int i = 0; i <= tid; ++i) acc += gs[i];
    Gd[tid] = acc;
  }
  __syncthreads();
  if (tid < kC) {
    gam[tid] = expf(float(Gd[tid]));
    kdec[tid] = expf(float(Gd[kC - 1] - Gd[tid]));
  }

  // K K̂ᵀ and Q K̂ᵀ (64×64, k = 128): warp = 16 rows (mt) × 32 columns (nh); blocks entirely above
  // the diagonal skip the MMAs but still write their zeros.
  {
    const int mt = warp & 3, nh = warp >> 2;
    float aK[4][4], aQ[4][4];
    chunk_kq_products(qh, ql, kh, kl, mt, nh, lane, aK, aQ);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = 16 * mt + gq + 8 * r, s = 32 * nh + 8 * nt + 2 * tq;
        float av[2], pv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float dec = s + e <= i ? expf(float(Gd[i] - Gd[s + e])) : 0.f;
          av[e] = s + e < i ? bs[i] * dec * aK[nt][2 * r + e] : 0.f;
          pv[e] = dec * aQ[nt][2 * r + e];
        }
        *reinterpret_cast<float2*>(Am + i * kAS + s) = make_float2(av[0], av[1]);
        store_split2(p.b.Ph + (rb + i) * kC + s, p.b.Pl + (rb + i) * kC + s, pv[0], pv[1]);
      }
  }
  __syncthreads();

  // (I + A) X = R by forward substitution, one column per thread, X in registers: columns 0..127 of
  // R are β v (→ U), 128..255 are βγ k̂ (→ W). Row i only needs rows s < i (A is zero from s = i on,
  // so whole float4s of A can be used).
  {
    const int col = tid;
    const bool is_u = col < kHD;   // warp-uniform
    const float* src = p.u + int64_t(t0) * CD + (is_u ? 2 * key_dim + j * kHD + col : key_dim + khd * kHD + col - kHD);
    float X[kC];
#pragma unroll
    for (int i = 0; i < kC; ++i) X[i] = i < n ? src[int64_t(i) * CD] * bs[i] * (is_u ? 1.f : gam[i]) : 0.f;
#pragma unroll
    for (int i = 1; i < kC; ++i) {
      const float4* Ar = reinterpret_cast<const float4*>(Am + i * kAS);
      float a0 = 0.f, a1 = 0.f;
#pragma unroll
      for (int q4 = 0; q4 < (i + 3) / 4; ++q4) {
        const float4 av = Ar[q4];
        a0 = fmaf(av.x, X[4 * q4], a0);
        a1 = fmaf(av.y, X[4 * q4 + 1], a1);
        a0 = fmaf(av.z, X[4 * q4 + 2], a0);
        a1 = fmaf(av.w, X[4 * q4 + 3], a1);
      }
      X[i] -= a0 + a1;
    }
    if (is_u) {
#pragma unroll
      for (int i = 0; i < kC; ++i) p.b.U[(rb + i) * kHD + col] = X[i];
    } else {
#pragma unroll
      for (int i = 0; i < kC; ++i) {
        bf16 h, l;
        split_bf16(X[i], h, l);
        p.b.Wh[(rb + i) * kHD + col - kHD] = h;
        p.b.Wl[(rb + i) * kHD + col - kHD] = l;
      }
    }
  }

  // diag(γ) Q and K' from the fp32 inputs (zero rows past T).
  for (int idx = tid; idx < kC * (kHD / 4); idx += blockDim.x) {
    const int r = idx / (kHD / 4), c4 = idx % (kHD / 4);
    float4 qv = make_float4(0.f, 0.f, 0.f, 0.f), kv = qv;
    if (r < n) {
      const float* row = p.u + int64_t(t0 + r) * CD + khd * kHD + 4 * c4;
      qv = *reinterpret_cast<const float4*>(row);
      kv = *reinterpret_cast<const float4*>(row + key_dim);
    }
    const float fq = gam[r], fk = kdec[r];
    qv = make_float4(qv.x * fq, qv.y * fq, qv.z * fq, qv.w * fq);
    kv = make_float4(kv.x * fk, kv.y * fk, kv.z * fk, kv.w * fk);
    const int64_t o = (rb + r) * kHD + 4 * c4;
    store_split4(p.b.Qh + o, p.b.Ql + o, qv);
    store_split4(p.b.Kh + o, p.b.Kl + o, kv);
  }
  if (tid == 0) p.b.gC[int64_t(j) * p.b.nch + c] = gam[kC - 1];
}

// ---- P11: the per-chunk pass without the serial substitution ----------------------------------
// Same outputs as gdn_chunk_intra_kernel (the chunk scan reads the same buffers), computed as:
//  - T = (I + A)⁻¹ explicitly, in fp32 by 16×16 blocks: the four diagonal blocks by forward
//    substitution (64 threads, 16 steps each), then the off-diagonal blocks level by level,
//    T_ij = −T_ii Σ_{k=j}^{i−1} A_ik T_kj (i − j = 1, 2, 3; every element one thread, 16–48 FMAs);
//  - U = (T diag β) V and W = (T diag βγ) K as split-bf16 MMAs (T is lower triangular: row block
//    mt needs k-blocks 0..mt), instead of 256 threads each running a 64-step chain of 2,016 FMAs;
//  - the gates' prefix sum by one warp (shuffle scan in double) instead of a 64-step serial loop,
//    and diag(γ)Q, K' written from the registers of the first q/k load instead of a second pass.
constexpr size_t kIntra2Smem = sizeof(bf16) * 4 * kC * kRS + sizeof(float) * 2 * kC * kAS + sizeof(double) * kC +
                               sizeof(float) * 4 * kC;

// a, b split into hi / lo bf16 pairs (a in the low half, as an MMA fragment register wants it).
__device__ __forceinline__ void split_pack(float a, float b, uint32_t& h, uint32_t& l) {
  bf16 ha, la, hb, lb;
  split_bf16(a, ha, la);
  split_bf16(b, hb, lb);
  const __nv_bfloat162 H = __halves2bfloat162(ha, hb), L = __halves2bfloat162(la, lb);
  h = *reinterpret_cast<const uint32_t*>(&H);
  l = *reinterpret_cast<const uint32_t*>(&L);
}

// kScan3 (P11 bit 4, for gdn_chunk_scan3_kernel): everything of the output that does not depend on
// the carried state moves here. With M = P T (64×64, lower triangular; split-bf16 MMAs over its ten
// nonzero 16×16 blocks, 5 k-steps per warp),
//   O = diag(γ)Q S₀ + P (U − W S₀) = Q~ S₀ + O0,  Q~ = diag(γ)Q − M diag(βγ) K,  O0 = M diag(β) V,
// and the two products are the U / W products with T replaced by M (same tiles, same code). P
// lives transposed in the upper triangle of A's buffer (A is strictly lower, P_is has s ≤ i), then M
// overwrites it; Q~ is formed in fp32 (the K part's accumulator starts at γ_i q̂_i from the fp32
// input and takes −M diag(βγ) K) and only then split, so its cancellation (q̂'s components along
// keys written with β ≈ 1) loses nothing beyond fp32 rounding of the larger terms.
// grid (nch, nv), block 256 (8 warps), 2 CTAs per SM.
// kMode: 0 = U / W / P / diag(γ)Q (scan2), 1 = kScan3 with M on tensor cores, 2 = kScan3 with M in
// fp32 FMAs (the session-6 form, LILY_GDN_P11 bit 3: a test row that localises an M failure).
// kOne (P24): products in one bf16 MMA (no lo planes in shared memory, the lo loads skipped).
template <int kMode, bool kOne = false>
__global__ void __launch_bounds__(256, 2) gdn_chunk_intra2_kernel(const __grid_constant__ IntraArgs p) {
  constexpr bool kScan3 = kMode != 0;
  extern __shared__ __align__(16) unsigned char smraw[];
  bf16* qh = reinterpret_cast<bf16*>(smraw);   // [kC][kRS] q̂ hi / lo (v hi / lo after the products), k̂ hi / lo
  bf16* ql = qh + kC * kRS;
  bf16* kh = ql + kC * kRS;
  bf16* kl = kh + kC * kRS;
  float* Am = reinterpret_cast<float*>(kl + kC * kRS);    // [kC][kAS] A (zero on and above the diagonal)
  float* Tm = Am + kC * kAS;                              // [kC][kAS] T = (I + A)⁻¹ (lower triangle)
  double* Gd = reinterpret_cast<double*>(Tm + kC * kAS);  // [kC] G_i in double (differences of large sums)
  float* bs = reinterpret_cast<float*>(Gd + kC);          // [kC] β
  float* bgam = bs + kC;                                  // [kC] β γ_i
  float* gam = bgam + kC;                                 // [kC] γ_i
  float* kdec = gam + kC;                                 // [kC] e^{G_C − G_i}
  pdl_trigger();
  pdl_wait();
  const GdnDims& d = p.d;
  const int c = blockIdx.x, j = blockIdx.y, khd = j / (d.nv / d.nk);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int key_dim = d.nk * kHD;
  const int64_t CD = d.conv_dim;
  const int t0 = c * kC, n = min(kC, p.T - t0);
  const int64_t rb = int64_t(j) * p.b.Tp + t0;   // first buffer row of this chunk
  constexpr int kIt = kC * (kHD / 4) / 256;      // float4 per thread of a 64 × 128 tile

  // q̂, k̂ rows (zero past T) into registers, all loads in flight at once; row r = tid / 32 + 8 it.
  float4 qv[kIt], kv[kIt];
#pragma unroll
  for (int it = 0; it < kIt; ++it) {
    const int r = (tid >> 5) + 8 * it, c4 = tid & 31;
    qv[it] = kv[it] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < n) {
      const float* row = p.u + int64_t(t0 + r) * CD + khd * kHD + 4 * c4;
      qv[it] = *reinterpret_cast<const float4*>(row);
      kv[it] = *reinterpret_cast<const float4*>(row + key_dim);
    }
  }
  // Warp 0: gates and decays. Lane l owns tokens 2l, 2l+1 (rows past T: g = 0, β = 0, so γ_C = γ_{n−1}).
  if (warp == 0) {
    float g2[2], b2[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int i = 2 * lane + e;
      g2[e] = i < n ? p.g[int64_t(t0 + i) * d.nv + j] : 0.f;
      b2[e] = i < n ? p.beta[int64_t(t0 + i) * d.nv + j] : 0.f;
    }
    const double s0 = double(g2[0]), s1 = s0 + double(g2[1]);
    double incl = s1;   // inclusive scan of the lane pairs' sums
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const double v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    const double excl = incl - s1, total = __shfl_sync(0xffffffffu, incl, 31);
    const double G[2] = {excl + s0, incl};
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int i = 2 * lane + e;
      const float ga = expf(float(G[e]));
      Gd[i] = G[e];
      bs[i] = b2[e];
      gam[i] = ga;
      bgam[i] = b2[e] * ga;
      kdec[i] = expf(float(total - G[e]));
    }
  }
#pragma unroll
  for (int it = 0; it < kIt; ++it) {
    const int r = (tid >> 5) + 8 * it, c4 = tid & 31;
    store_split4(qh + r * kRS + 4 * c4, ql + r * kRS + 4 * c4, qv[it]);
    store_split4(kh + r * kRS + 4 * c4, kl + r * kRS + 4 * c4, kv[it]);
  }
  __syncthreads();
  if (!kScan3 && p.shared) {
    // q̂, k̂ once per key head (unscaled), the row factors per value head.
    if (j % (d.nv / d.nk) == 0) {
      const int64_t kb = int64_t(khd) * p.b.Tp + t0;
#pragma unroll
      for (int it = 0; it < kIt; ++it) {
        const int r = (tid >> 5) + 8 * it, c4 = tid & 31;
        const int64_t o = (kb + r) * kHD + 4 * c4;
        store_split4x<kOne>(p.b.Qh + o, p.b.Ql + o, qv[it]);
        store_split4x<kOne>(p.b.Kh + o, p.b.Kl + o, kv[it]);
      }
    }
    if (tid < kC) {
      p.b.rg[rb + tid] = gam[tid];
      p.b.rk[rb + tid] = kdec[tid];
    }
  } else {
    // diag(γ) Q (kScan3: Q~, written at the end) and K' from the fp32 registers.
#pragma unroll
    for (int it = 0; it < kIt; ++it) {
      const int r = (tid >> 5) + 8 * it, c4 = tid & 31;
      const float fq = gam[r], fk = kdec[r];
      const float4 a = qv[it], b = kv[it];
      const int64_t o = (rb + r) * kHD + 4 * c4;
      if (!kScan3) store_split4x<kOne>(p.b.Qh + o, p.b.Ql + o, make_float4(a.x * fq, a.y * fq, a.z * fq, a.w * fq));
      store_split4x<kOne>(p.b.Kh + o, p.b.Kl + o, make_float4(b.x * fk, b.y * fk, b.z * fk, b.w * fk));
    }
  }
  if (tid == 0) p.b.gC[int64_t(j) * p.b.nch + c] = gam[kC - 1];

  // K K̂ᵀ and Q K̂ᵀ (64×64, k = 128): warp = 16 rows (mt) × 32 columns (nh); blocks entirely above
  // the diagonal skip the MMAs but still write their zeros (as gdn_chunk_intra_kernel).
  {
    const int mt = warp & 3, nh = warp >> 2;
    float aK[4][4], aQ[4][4];
    chunk_kq_products(qh, ql, kh, kl, mt, nh, lane, aK, aQ);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = 16 * mt + gq + 8 * r, s = 32 * nh + 8 * nt + 2 * tq;
        float av[2], pv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float dec = s + e <= i ? expf(float(Gd[i] - Gd[s + e])) : 0.f;
          av[e] = s + e < i ? bs[i] * dec * aK[nt][2 * r + e] : 0.f;
          pv[e] = dec * aQ[nt][2 * r + e];
        }
        if (kScan3) {   // A strictly below the diagonal, Pᵀ on and above it (disjoint elements)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (s + e < i) Am[i * kAS + s + e] = av[e];        // A_{i,s} at [i][s]
            if (s + e <= i) Am[(s + e) * kAS + i] = pv[e];     // P_{i,s} at [s][i]
          }
        } else {
          *reinterpret_cast<float2*>(Am + i * kAS + s) = make_float2(av[0], av[1]);
          store_split2x<kOne>(p.b.Ph + (rb + i) * kC + s, p.b.Pl + (rb + i) * kC + s, pv[0], pv[1]);
        }
      }
  }
  __syncthreads();   // A complete; q̂ hi / lo free

  // v rows (zero past T) into the q̂ tiles; the loads stay in flight over the diagonal solves.
  {
    float4 vv[kIt];
#pragma unroll
    for (int it = 0; it < kIt; ++it) {
      const int r = (tid >> 5) + 8 * it, c4 = tid & 31;
      vv[it] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (r < n) vv[it] = *reinterpret_cast<const float4*>(p.u + int64_t(t0 + r) * CD + 2 * key_dim + j * kHD + 4 * c4);
    }
    // Diagonal blocks: thread (block b, column cc) solves (I + A_bb) x = e_cc (x = 0 above the
    // diagonal, so the whole 16×16 block of T is written).
    if (tid < kC) {
      const int o = 16 * (tid >> 4), cc = tid & 15;
      float x[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const float* Ar = Am + (o + r) * kAS + o;
        float acc = r == cc ? 1.f : 0.f;
#pragma unroll
        for (int s = 0; s < r; ++s) acc = fmaf(-Ar[s], x[s], acc);
        x[r] = acc;
      }
#pragma unroll
      for (int r = 0; r < 16; ++r) Tm[(o + r) * kAS + o + cc] = x[r];
    }
#pragma unroll
    for (int it = 0; it < kIt; ++it) {
      const int r = (tid >> 5) + 8 * it, c4 = tid & 31;
      store_split4(qh + r * kRS + 4 * c4, ql + r * kRS + 4 * c4, vv[it]);
    }
  }
  __syncthreads();
  // Off-diagonal blocks, level dl = i − j: block e of the level is (i, j) = (e + dl, e), thread =
  // element (r, cc). Y = Σ_k A_ik T_kj is parked in the block, then T_ij = −T_ii Y. A level reads
  // only blocks of lower levels, so the blocks of one level are independent.
  {
    const int r = tid >> 4, cc = tid & 15;
#pragma unroll
    for (int dl = 1; dl < 4; ++dl) {
#pragma unroll
      for (int e = 0; e < 4 - dl; ++e) {
        const int ib = e + dl, jb = e;
        const float* Ar = Am + (16 * ib + r) * kAS;
        float acc = 0.f;
        for (int kb = jb; kb < ib; ++kb)
#pragma unroll
          for (int m = 0; m < 16; ++m) acc = fmaf(Ar[16 * kb + m], Tm[(16 * kb + m) * kAS + 16 * jb + cc], acc);
        Tm[(16 * ib + r) * kAS + 16 * jb + cc] = acc;
      }
      __syncthreads();
      float val[3];
#pragma unroll
      for (int e = 0; e < 4 - dl; ++e) {
        const int ib = e + dl, jb = e;
        const float* Tr = Tm + (16 * ib + r) * kAS + 16 * ib;   // row r of T_ii (zero past r)
        float acc = 0.f;
#pragma unroll
        for (int m = 0; m < 16; ++m) acc = fmaf(Tr[m], Tm[(16 * ib + m) * kAS + 16 * jb + cc], acc);
        val[e] = -acc;
      }
      __syncthreads();
#pragma unroll
      for (int e = 0; e < 4 - dl; ++e) Tm[(16 * (e + dl) + r) * kAS + 16 * e + cc] = val[e];
      __syncthreads();
    }
  }

  if (kMode == 2) {
    // M = P T (lower triangular) in fp32 FMAs: thread = 4×4 tile, rows 4a.., columns 4bq..; k runs
    // over 4bq..4a+3 (T_kj = 0 for k < j there: those places are inside diagonal blocks, which the
    // solve wrote in full); P_ik for k > i is masked (those places of Am hold A).
    const int a = tid >> 4, bq = tid & 15;
    float m[4][4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
      for (int f = 0; f < 4; ++f) m[e][f] = 0.f;
    if (a >= bq) {
#pragma unroll 4
      for (int k = 4 * bq; k <= 4 * a + 3; ++k) {
        const float4 pk = *reinterpret_cast<const float4*>(Am + k * kAS + 4 * a);   // P_{4a+e, k}
        const float4 tk = *reinterpret_cast<const float4*>(Tm + k * kAS + 4 * bq);  // T_{k, 4bq+f}
        const float pe[4] = {k <= 4 * a ? pk.x : 0.f, k <= 4 * a + 1 ? pk.y : 0.f, k <= 4 * a + 2 ? pk.z : 0.f, pk.w};
        const float te[4] = {tk.x, tk.y, tk.z, tk.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
          for (int f = 0; f < 4; ++f) m[e][f] = fmaf(pe[e], te[f], m[e][f]);
      }
    }
    __syncthreads();   // Pᵀ read by everyone: M replaces it, whole 16×16 blocks on and below the diagonal
    if ((a >> 2) >= (bq >> 2)) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        *reinterpret_cast<float4*>(Am + (4 * a + e) * kAS + 4 * bq) = make_float4(m[e][0], m[e][1], m[e][2], m[e][3]);
    }
  } else if (kScan3) {
    // M = P T on tensor cores, split bf16 (P and T are split in registers from the fp32 tiles, three
    // MMAs per k-step, fp32 accumulation: the same precision class as the other products). M is
    // lower triangular; its ten 16×16 blocks (I, J), I ≥ J, cost I − J + 1 k-steps each (K = J..I:
    // T_KJ = 0 for K < J, P_IK = 0 for K > I), 20 in all per 8-column half. Warp (g, h8) takes the
    // 8-column half h8 of the blocks of list g, 5 k-steps for every warp:
    //   g0: (3,0) (0,0)   g1: (2,0) (1,0)   g2: (3,1) (2,1)   g3: (3,2) (1,1) (2,2) (3,3)
    // P_ik is read from its transposed place [k][i]; on a diagonal block the places k > i hold A,
    // masked to zero. The diagonal blocks of M come out zero above the diagonal (P masked, T zero
    // there), so whole blocks are written.
    const int g = warp >> 1, h8 = warp & 1;
    const int Ipk = g == 0 ? 0x03 : g == 1 ? 0x12 : g == 2 ? 0x23 : 0x3213;   // I of entry bi: nibble bi
    const int Jpk = g == 0 ? 0x00 : g == 1 ? 0x00 : g == 2 ? 0x11 : 0x3212;
    const int nb = g == 3 ? 4 : 2;
    float mc[4][4];
#pragma unroll
    for (int bi = 0; bi < 4; ++bi) {
#pragma unroll
      for (int e = 0; e < 4; ++e) mc[bi][e] = 0.f;
      if (bi < nb) {
        const int I = (Ipk >> (4 * bi)) & 15, J = (Jpk >> (4 * bi)) & 15;
        const int nn = 16 * J + 8 * h8 + gq;   // B column (this lane's n)
#pragma unroll 1
        for (int K = J; K <= I; ++K) {
          uint32_t ah[4], al[4], bh[2], bl[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {   // k = 16K + 2tq + 8h (+1)
            const int k = 16 * K + 2 * tq + 8 * h;
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {   // rows i = 16I + gq + 8rr
              const int i = 16 * I + gq + 8 * rr;
              const float p0 = k <= i ? Am[k * kAS + i] : 0.f;
              const float p1 = k + 1 <= i ? Am[(k + 1) * kAS + i] : 0.f;
              split_pack(p0, p1, ah[2 * h + rr], al[2 * h + rr]);
            }
            split_pack(Tm[k * kAS + nn], Tm[(k + 1) * kAS + nn], bh[h], bl[h]);
          }
          mma_bf16x3(mc[bi], ah, al, bh[0], bh[1], bl[0], bl[1]);
        }
      }
    }
    __syncthreads();   // Pᵀ read by everyone: M replaces it
#pragma unroll
    for (int bi = 0; bi < 4; ++bi) {
      if (bi < nb) {
        const int I = (Ipk >> (4 * bi)) & 15, J = (Jpk >> (4 * bi)) & 15;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)
          *reinterpret_cast<float2*>(Am + (16 * I + gq + 8 * rr) * kAS + 16 * J + 8 * h8 + 2 * tq) =
              make_float2(mc[bi][2 * rr], mc[bi][2 * rr + 1]);
      }
    }
  }

  // L (T, or M for kScan3's second pass) times [diag(β) V | diag(βγ) K]: warps 0-3 the V part,
  // warps 4-7 the K part. L is lower triangular, so row block mt costs mt + 1 k-steps: warp (isw,
  // pr, ch) takes row blocks pr and 3 − pr (5 k-steps together, the same for every warp) × columns
  // 64·ch..64·ch+63. A fragments straight from L in fp32, scaled per column and split in registers.
  // epi(isw, row, column, x0, x1) gets the results two columns at a time. qt (kScan3's second pass):
  // the K part's accumulators start at diag(γ) q̂ (fp32, from the input) and its L is negated, so it
  // comes out as Q~ = diag(γ)Q − M diag(βγ) K, the difference taken in the fp32 accumulator; the 16
  // loads of q̂ per row block are issued together in front of the MMAs.
  auto tri_product = [&](const float* L, bool qt, auto&& epi) {
    const int isw = warp >> 2, pr = warp & 1, ch = (warp >> 1) & 1, lr = lane & 7, q = lane >> 3;
    const bf16* Bh = isw ? kh : qh;
    const bf16* Bl = isw ? kl : ql;
    const float* sc = isw ? bgam : bs;
    const bool neg = qt && isw;   // warp-uniform
    const int boff = (lr + 8 * (q & 1)) * kRS + 64 * ch + 8 * (q >> 1);   // B [token][column] (ldmatrix.trans)
#pragma unroll 1
    for (int rbk = 0; rbk < 2; ++rbk) {
      const int mt = rbk ? 3 - pr : pr;
      float acc[8][4];
      if (neg) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int i = 16 * mt + gq + 8 * rr;
          const float gi = gam[i];
          const float* qrow = p.u + int64_t(t0 + i) * CD + khd * kHD + 64 * ch + 2 * tq;
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
            float2 qq = make_float2(0.f, 0.f);
            if (i < n) qq = __ldg(reinterpret_cast<const float2*>(qrow + 8 * nt));
            acc[nt][2 * rr] = gi * qq.x;
            acc[nt][2 * rr + 1] = gi * qq.y;
          }
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
      }
#pragma unroll
      for (int ks = 0; ks < kC / 16; ++ks) {
        if (ks > mt) break;
        uint32_t ah[4], al[4];
#pragma unroll
        for (int h = 0; h < 2; ++h)      // columns 2tq (+8)
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {   // rows gq (+8)
            const int s = 16 * ks + 2 * tq + 8 * h;
            const float2 t = *reinterpret_cast<const float2*>(L + (16 * mt + gq + 8 * rr) * kAS + s);
            const float s0 = neg ? -sc[s] : sc[s], s1 = neg ? -sc[s + 1] : sc[s + 1];
            split_pack(t.x * s0, t.y * s1, ah[2 * h + rr], al[2 * h + rr]);
          }
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t bh[4], bl[4];
          const int o = boff + 16 * ks * kRS + 16 * np;
          ldsm_x4_t(bh[0], bh[1], bh[2], bh[3], Bh + o);
          ldsm_x4_t(bl[0], bl[1], bl[2], bl[3], Bl + o);
          mma_bf16x3(acc[2 * np], ah, al, bh[0], bh[1], bl[0], bl[1]);
          mma_bf16x3(acc[2 * np + 1], ah, al, bh[2], bh[3], bl[2], bl[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)
          epi(isw, 16 * mt + gq + 8 * rr, 64 * ch + 8 * nt + 2 * tq, acc[nt][2 * rr], acc[nt][2 * rr + 1]);
    }
  };

  // U = (T diag β) V and W = (T diag βγ) K. Rows past T come out zero: their rows of A are zero, so
  // their rows of T are unit rows, times β = 0.
  tri_product(Tm, false, [&](int isw, int i, int col, float x0, float x1) {
    const int64_t o = (rb + i) * kHD + col;
    if (isw) store_split2x<kOne>(p.b.Wh + o, p.b.Wl + o, x0, x1);
    else *reinterpret_cast<float2*>(p.b.U + o) = make_float2(x0, x1);
  });
  if (kScan3) {
    __syncthreads();   // M complete
    // O0 = M diag(β) V and Q~ = diag(γ) Q − M diag(βγ) K (difference in the fp32 accumulator, then
    // split). Rows past T: P, hence M, is zero there and so is q̂.
    tri_product(Am, true, [&](int isw, int i, int col, float x0, float x1) {
      const int64_t o = (rb + i) * kHD + col;
      if (isw) store_split2(p.b.Qh + o, p.b.Ql + o, x0, x1);
      else *reinterpret_cast<float2*>(p.b.O0 + o) = make_float2(x0, x1);
    });
  }
}

struct CScanArgs {
  GdnDims d;
  float *conv_state, *S;
  const float* qkv;
  int T;
  ChunkBufs b;
  float* y;
};
constexpr size_t kCScanSmem = sizeof(bf16) * (4 * kC * kRS          // W, diag(γ)Q hi / lo
                                              + 4 * kC * kRS        // K' hi / lo, two chunks
                                              + 4 * kC * kPS        // P hi / lo, two chunks
                                              + 2 * kHD * kNS       // S hi / lo
                                              + 2 * kC * kNS)       // Δ hi / lo
                              + sizeof(float) * kC * kNS;           // U
static_assert(kCScanSmem <= 227 * 1024, "chunk scan: shared memory");

// grid nv · (128 / kNB), block 256 (8 warps); CTA (j, cb) carries columns c0..c0+31 of head j's
// state over all chunks. Per chunk: Δ = U − W S and O = diag(γ)Q S (warp = 16 tokens × 16 columns),
// then O += P Δ, then S = γ_C S + K'ᵀ Δ (warp = 16 state rows × 32 columns, S held as its
// accumulator). S and Δ go to shared memory (split) as B operands. W, diag(γ)Q, U of chunk c+1 load
// during the second half of chunk c; K' and P (double-buffered) one chunk ahead.
// The chunk scans' state as MMA accumulators (warp: 16 state rows × 32 columns from column c0, row
// 16·warp + gq (+8), columns 8·nt + 2·tq (+1)): loaded from the f32 state, and split into the hi / lo bf16
// tiles (row stride kNS) that the next products read.
__device__ __forceinline__ void scan_state_load(const float* Sg, int c0, int warp, int gq, int tq, float (&acc_s)[4][4]) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      acc_s[nt][e] = Sg[(16 * warp + gq + 8 * (e >> 1)) * kHD + c0 + 8 * nt + 2 * tq + (e & 1)];
}
__device__ __forceinline__ void scan_state_split(const float (&acc_s)[4][4], int warp, int gq, int tq, bf16* Sh,
                                                 bf16* Sl) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int o = (16 * warp + gq + 8 * r) * kNS + 8 * nt + 2 * tq;
      store_split2(Sh + o, Sl + o, acc_s[nt][2 * r], acc_s[nt][2 * r + 1]);
    }
}

__global__ void __launch_bounds__(256, 1) gdn_chunk_scan_kernel(const __grid_constant__ CScanArgs p) {
  extern __shared__ __align__(16) unsigned char smraw[];
  bf16* Wh = reinterpret_cast<bf16*>(smraw);   // [kC][kRS]
  bf16* Wl = Wh + kC * kRS;
  bf16* Qh = Wl + kC * kRS;
  bf16* Ql = Qh + kC * kRS;
  bf16* Kh0 = Ql + kC * kRS;                   // [2][kC][kRS]
  bf16* Kl0 = Kh0 + 2 * kC * kRS;
  bf16* Ph0 = Kl0 + 2 * kC * kRS;              // [2][kC][kPS]
  bf16* Pl0 = Ph0 + 2 * kC * kPS;
  bf16* Sh = Pl0 + 2 * kC * kPS;               // [kHD][kNS] (state row = dk, column = value)
  bf16* Sl = Sh + kHD * kNS;
  bf16* Dh = Sl + kHD * kNS;                   // [kC][kNS] Δ (token × value column)
  bf16* Dl = Dh + kC * kNS;
  float* Us = reinterpret_cast<float*>(Dl + kC * kNS);   // [kC][kNS]
  pdl_trigger();
  pdl_wait();
  const GdnDims& d = p.d;
  const int nblk = kHD / kNB;
  const int j = blockIdx.x / nblk, c0 = (blockIdx.x % nblk) * kNB;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int lr = lane & 7, q = lane >> 3;
  const int nch = p.b.nch;
  const int64_t hb = int64_t(j) * p.b.Tp;
  const int64_t value_dim = int64_t(d.nv) * kHD;

  auto issue_a = [&](int c) {   // W, diag(γ)Q, U slice of chunk c
    const int64_t rb = hb + int64_t(c) * kC;
    for (int idx = tid; idx < kC * (kHD / 8); idx += blockDim.x) {
      const int r = idx / (kHD / 8), ch = idx % (kHD / 8);
      const int64_t go = (rb + r) * kHD + 8 * ch;
      const int so = r * kRS + 8 * ch;
      cp_async16(Wh + so, p.b.Wh + go);
      cp_async16(Wl + so, p.b.Wl + go);
      cp_async16(Qh + so, p.b.Qh + go);
      cp_async16(Ql + so, p.b.Ql + go);
    }
    for (int idx = tid; idx < kC * (kNB / 4); idx += blockDim.x) {
      const int r = idx / (kNB / 4), ch = idx % (kNB / 4);
      cp_async16(Us + r * kNS + 4 * ch, p.b.U + (rb + r) * kHD + c0 + 4 * ch);
    }
  };
  auto issue_b = [&](int c) {   // K', P of chunk c into buffer c & 1
    const int64_t rb = hb + int64_t(c) * kC;
    bf16* kh = Kh0 + (c & 1) * kC * kRS;
    bf16* kl = Kl0 + (c & 1) * kC * kRS;
    bf16* ph = Ph0 + (c & 1) * kC * kPS;
    bf16* pl = Pl0 + (c & 1) * kC * kPS;
    for (int idx = tid; idx < kC * (kHD / 8); idx += blockDim.x) {
      const int r = idx / (kHD / 8), ch = idx % (kHD / 8);
      const int64_t go = (rb + r) * kHD + 8 * ch;
      cp_async16(kh + r * kRS + 8 * ch, p.b.Kh + go);
      cp_async16(kl + r * kRS + 8 * ch, p.b.Kl + go);
    }
    for (int idx = tid; idx < kC * (kC / 8); idx += blockDim.x) {
      const int r = idx / (kC / 8), ch = idx % (kC / 8);
      const int64_t go = (rb + r) * kC + 8 * ch;
      cp_async16(ph + r * kPS + 8 * ch, p.b.Ph + go);
      cp_async16(pl + r * kPS + 8 * ch, p.b.Pl + go);
    }
  };

  issue_b(0);
  cp_async_commit();
  issue_a(0);
  cp_async_commit();

  // This warp's 16 state rows (dk) × 32 columns as an MMA accumulator: row 16·warp + gq (+8),
  // columns 8·nt + 2·tq (+1).
  float* Sg = p.S + int64_t(j) * kHD * kHD;
  float acc_s[4][4];
  scan_state_load(Sg, c0, warp, gq, tq, acc_s);
  auto write_s = [&] { scan_state_split(acc_s, warp, gq, tq, Sh, Sl); };
  write_s();

  const int mt = warp & 3, nh = warp >> 2;   // steps 1-2: 16 tokens × 16 columns
  const int aoff = (16 * mt + lr + 8 * (q & 1)) * kRS + 8 * (q >> 1);   // A rows × k (ldmatrix)
  const int poff = (16 * mt + lr + 8 * (q & 1)) * kPS + 8 * (q >> 1);
  const int boff = (lr + 8 * (q & 1)) * kNS + 16 * nh + 8 * (q >> 1);   // B [k][n] (ldmatrix.trans)
  const int koff = (lr + 8 * (q >> 1)) * kRS + 16 * warp + 8 * (q & 1);  // A = K'ᵀ from [token][dk] (.trans)
  const int doff = (lr + 8 * (q & 1)) * kNS + 8 * (q >> 1);             // B = Δ, all 32 columns

  for (int c = 0; c < nch; ++c) {
    const int t0 = c * kC, n = min(kC, p.T - t0);
    __syncthreads();   // S written; the previous chunk is done with Δ and with buffer (c+1)&1
    if (c + 1 < nch) issue_b(c + 1);
    cp_async_commit();
    cp_async_wait<1>();   // everything but K', P of chunk c+1
    __syncthreads();

    float aD[2][4], aO[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) aD[nt][e] = aO[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kHD / 16; ++kk) {
      uint32_t sh[4], sl[4], wh[4], wl[4], qh[4], ql[4];
      ldsm_x4_t(sh[0], sh[1], sh[2], sh[3], Sh + boff + 16 * kk * kNS);
      ldsm_x4_t(sl[0], sl[1], sl[2], sl[3], Sl + boff + 16 * kk * kNS);
      ldsm_x4(wh[0], wh[1], wh[2], wh[3], Wh + aoff + 16 * kk);
      ldsm_x4(wl[0], wl[1], wl[2], wl[3], Wl + aoff + 16 * kk);
      ldsm_x4(qh[0], qh[1], qh[2], qh[3], Qh + aoff + 16 * kk);
      ldsm_x4(ql[0], ql[1], ql[2], ql[3], Ql + aoff + 16 * kk);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_bf16x3(aD[nt], wh, wl, sh[2 * nt], sh[2 * nt + 1], sl[2 * nt], sl[2 * nt + 1]);
        mma_bf16x3(aO[nt], qh, ql, sh[2 * nt], sh[2 * nt + 1], sl[2 * nt], sl[2 * nt + 1]);
      }
    }
    // Δ = U − W S (zero on rows past T: U and W are).
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = 16 * mt + gq + 8 * r, col = 16 * nh + 8 * nt + 2 * tq;
        const float2 uv = *reinterpret_cast<const float2*>(Us + i * kNS + col);
        store_split2(Dh + i * kNS + col, Dl + i * kNS + col, uv.x - aD[nt][2 * r], uv.y - aD[nt][2 * r + 1]);
      }
    __syncthreads();   // Δ complete; W, Q, U free
    if (c + 1 < nch) issue_a(c + 1);
    cp_async_commit();

    // O += P Δ over the tokens s ≤ i (P is zero above the diagonal: k-steps past mt are skipped).
    const bf16* ph = Ph0 + (c & 1) * kC * kPS;
    const bf16* pl = Pl0 + (c & 1) * kC * kPS;
#pragma unroll
    for (int ks = 0; ks < kC / 16; ++ks) {
      if (ks > mt) break;
      uint32_t pah[4], pal[4], dh[4], dl[4];
      ldsm_x4(pah[0], pah[1], pah[2], pah[3], ph + poff + 16 * ks);
      ldsm_x4(pal[0], pal[1], pal[2], pal[3], pl + poff + 16 * ks);
      ldsm_x4_t(dh[0], dh[1], dh[2], dh[3], Dh + boff + 16 * ks * kNS);
      ldsm_x4_t(dl[0], dl[1], dl[2], dl[3], Dl + boff + 16 * ks * kNS);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) mma_bf16x3(aO[nt], pah, pal, dh[2 * nt], dh[2 * nt + 1], dl[2 * nt], dl[2 * nt + 1]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = 16 * mt + gq + 8 * r, col = 16 * nh + 8 * nt + 2 * tq;
        if (i < n)
          *reinterpret_cast<float2*>(p.y + int64_t(t0 + i) * value_dim + j * kHD + c0 + col) =
              make_float2(aO[nt][2 * r], aO[nt][2 * r + 1]);
      }

    // S = γ_C S + K'ᵀ Δ.
    const float gc = p.b.gC[int64_t(j) * nch + c];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_s[nt][e] *= gc;
    const bf16* kh = Kh0 + (c & 1) * kC * kRS;
    const bf16* kl = Kl0 + (c & 1) * kC * kRS;
#pragma unroll
    for (int ks = 0; ks < kC / 16; ++ks) {
      uint32_t ah[4], al[4];
      ldsm_x4_t(ah[0], ah[1], ah[2], ah[3], kh + koff + 16 * ks * kRS);
      ldsm_x4_t(al[0], al[1], al[2], al[3], kl + koff + 16 * ks * kRS);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t dh[4], dl[4];
        ldsm_x4_t(dh[0], dh[1], dh[2], dh[3], Dh + doff + 16 * ks * kNS + 16 * np);
        ldsm_x4_t(dl[0], dl[1], dl[2], dl[3], Dl + doff + 16 * ks * kNS + 16 * np);
        mma_bf16x3(acc_s[2 * np], ah, al, dh[0], dh[1], dl[0], dl[1]);
        mma_bf16x3(acc_s[2 * np + 1], ah, al, dh[2], dh[3], dl[2], dl[3]);
      }
    }
    write_s();   // S hi / lo were last read before the mid-chunk barrier
  }
  cp_async_wait<0>();

#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      Sg[(16 * warp + gq + 8 * (e >> 1)) * kHD + c0 + 8 * nt + 2 * tq + (e & 1)] = acc_s[nt][e];

  conv_shift(d, p.conv_state, p.qkv, p.T);
}

constexpr size_t kCScan2SharedSmem = kCScanSmem + sizeof(bf16) * 2 * kC * kNS + sizeof(float) * 2 * kC;
static_assert(kCScan2SharedSmem <= 227 * 1024, "chunk scan (shared q/k): shared memory");

// Shared memory of gdn_chunk_scan2_kernel<kShared, kOne, NB>: with kOne the lo planes take no space.
// NH (P36): state-column halves per CTA, each with its own S / Δ / U tiles after the shared W / Q / K' / P.
template <bool kShared, bool kOne, int NB, int NH = 1>
constexpr size_t cscan2_smem() {
  constexpr size_t NS = NB + 8, LO = kOne ? 1 : 2;
  return sizeof(bf16) * (LO * 2 * kC * kRS + LO * 2 * kC * kRS + LO * 2 * kC * kPS) +
         NH * (sizeof(bf16) * (LO * kHD * NS + LO * kC * NS) + sizeof(float) * kC * NS) +
         (kShared ? sizeof(bf16) * LO * kC * NS + sizeof(float) * 2 * kC : 0);
}
static_assert(cscan2_smem<false, false, kNB>() == kCScanSmem && cscan2_smem<true, false, kNB>() == kCScan2SharedSmem,
              "chunk scan: shared memory layout");
// P27: 16 state columns per CTA (256 CTAs), kOne only; two CTAs per SM.
constexpr int kNB27 = 16;
constexpr size_t kCScan27Smem = cscan2_smem<false, true, kNB27>();
static_assert(2 * (kCScan27Smem + 1024) <= 228 * 1024, "chunk scan P27: two CTAs per SM");
// P36: P27's 16-column tiles, two halves per CTA (16 warps, 128 CTAs): the head's W / Q / K' / P tiles are
// copied once per 32 columns instead of once per 16 (half the chunk scan's L2 reads, the scan's limit: P27 notes).
constexpr size_t kCScan36Smem = cscan2_smem<false, true, kNB27, 2>();
static_assert(kCScan36Smem <= 227 * 1024, "chunk scan P36: shared memory");

// Bulk (TMA engine) prefetch of `bytes` (multiple of 16, 16-byte aligned) into L2: one instruction
// per contiguous range, nothing to wait for.
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// P11 chunk scan: gdn_chunk_scan_kernel (same grid, shared memory layout and arithmetic) with the
// work and the loads rescheduled around the chain S → Δ → S:
//  - phase 1 computes only Δ = U − W S (48 MMAs per warp instead of 96); diag(γ)Q S moves into
//    phase 2 next to O += PΔ and the state update, interleaved with the latter (two independent
//    accumulator chains per warp). S_c stays readable in shared memory through phase 2: the new S
//    is written after the next chunk's first barrier.
//  - loads: W/U of chunk c+1 are issued after phase 1 of chunk c (all of phase 2 to arrive),
//    diag(γ)Q of chunk c at the start of chunk c (phase 1 to arrive), K'/P one chunk ahead as
//    before; the nine input planes of chunk c+2 are prefetched into L2 (one bulk prefetch per
//    plane, spread over the head's CTAs) so that these copies hit L2, not HBM.
//  - γ_C is loaded at the start of the chunk, not in front of the state update.
// kShared (P11 bit 2): diag(γ)Q and K' are not in the buffers; q̂, k̂ come unscaled from the key
// head's rows (shared by its value heads) and the scan applies the row factors: O = diag(γ)(Q̂S) +
// PΔ, and S ← γ_C S + K̂ᵀ(diag(e^{G_C−G}) Δ) with the scaled Δ as a second tile (10 KB more smem).
// kOne (P24): every product in one bf16 MMA; the lo planes are neither loaded nor stored (no space).
// NB: state columns per CTA (grid nv · 128 / NB). NB = 16 (P27, kOne only): Δ, O per warp are 16 tokens
// × 8 columns, so a warp's S (and Δ) B fragments for two k-steps come from one ldmatrix.x4.trans.
// NH = 2 (P36, NB = 16 only): 16 warps, warps 8h .. 8h + 7 own columns 16h .. 16h + 15 of the CTA's 32, each half
// with its own S / Δ / U tiles; W / Q / K' / P are shared (loaded once for both).
template <bool kShared, bool kOne = false, int NB = kNB, int NH = 1>
__global__ void __launch_bounds__(256 * NH, NB == 16 && NH == 1 ? 2 : 1)
    gdn_chunk_scan2_kernel(const __grid_constant__ CScanArgs p) {
  static_assert(NB == 32 || (NB == 16 && kOne && !kShared), "chunk scan: NB 32, or 16 with kOne");
  static_assert(NH == 1 || (NH == 2 && NB == 16), "chunk scan: two halves only at NB 16");
  constexpr int NS = NB + 8;         // row stride of the NB-wide tiles
  constexpr int NT = NB / 8;         // n8 tiles of the state update per warp
  constexpr int NW = NB / 16;        // n8 tiles of Δ / O per warp (columns 8·NW·nh ..)
  constexpr int LO = kOne ? 0 : 1;   // lo planes present
  extern __shared__ __align__(16) unsigned char smraw[];
  bf16* Wh = reinterpret_cast<bf16*>(smraw);   // [kC][kRS]
  bf16* Wl = Wh + kC * kRS;
  bf16* Qh = Wl + LO * kC * kRS;
  bf16* Ql = Qh + kC * kRS;
  bf16* Kh0 = Ql + LO * kC * kRS;              // [2][kC][kRS]
  bf16* Kl0 = Kh0 + 2 * kC * kRS;
  bf16* Ph0 = Kl0 + LO * 2 * kC * kRS;         // [2][kC][kPS]
  bf16* Pl0 = Ph0 + 2 * kC * kPS;
  // This thread's half (NH = 2): its private tiles follow the shared ones.
  const int half = NH == 2 ? int(threadIdx.x >> 8) : 0;
  bf16* Sh = reinterpret_cast<bf16*>(reinterpret_cast<unsigned char*>(Pl0 + LO * 2 * kC * kPS) +
                                     half * ((1 + LO) * (kHD * NS + kC * NS) * sizeof(bf16) +
                                             kC * NS * sizeof(float)));   // [kHD][NS] (state row = dk, column = value)
  bf16* Sl = Sh + kHD * NS;
  bf16* Dh = Sl + LO * kHD * NS;               // [kC][NS] Δ (token × value column)
  bf16* Dl = Dh + kC * NS;
  float* Us = reinterpret_cast<float*>(Dl + LO * kC * NS);   // [kC][NS]
  bf16* D2h = reinterpret_cast<bf16*>(Us + kC * NS);    // kShared: [kC][NS] diag(e^{G_C−G}) Δ
  bf16* D2l = D2h + kC * NS;
  float* rgs = reinterpret_cast<float*>(D2l + LO * kC * NS); // kShared: [kC] γ_i, then [kC] e^{G_C−G_i}
  float* rks = rgs + kC;
  pdl_trigger();
  pdl_wait();
  const GdnDims& d = p.d;
  const int nblk = kHD / (NB * NH);   // CTAs per head
  const int j = blockIdx.x / nblk, cb = blockIdx.x % nblk, c0 = (cb * NH + half) * NB;
  const int tid = threadIdx.x, warp = NH == 2 ? (tid >> 5) & 7 : tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int htid = NH == 2 ? tid & 255 : tid;   // thread index within the half
  const int lr = lane & 7, q = lane >> 3;
  const int nch = p.b.nch;
  const int64_t hb = int64_t(j) * p.b.Tp;
  // Rows of the Q / K planes: the value head's, or with kShared its key head's.
  const int64_t qb = kShared ? int64_t(j / (d.nv / d.nk)) * p.b.Tp : hb;
  const int64_t value_dim = int64_t(d.nv) * kHD;

  auto issue_w = [&](int c) {   // W hi / lo and the U slice of chunk c
    const int64_t rb = hb + int64_t(c) * kC;
    for (int idx = tid; idx < kC * (kHD / 8); idx += blockDim.x) {
      const int r = idx / (kHD / 8), ch = idx % (kHD / 8);
      const int64_t go = (rb + r) * kHD + 8 * ch;
      const int so = r * kRS + 8 * ch;
      cp_async16(Wh + so, p.b.Wh + go);
      if (!kOne) cp_async16(Wl + so, p.b.Wl + go);
    }
    for (int idx = htid; idx < kC * (NB / 4); idx += NH == 2 ? 256 : int(blockDim.x)) {   // each half its own U slice
      const int r = idx / (NB / 4), ch = idx % (NB / 4);
      cp_async16(Us + r * NS + 4 * ch, p.b.U + (rb + r) * kHD + c0 + 4 * ch);
    }
    if (kShared && tid < kC / 2) {   // row factors: 16 × 16 bytes each
      const int h = tid / (kC / 4), ch = tid % (kC / 4);   // array (γ, decay), 4 floats
      cp_async16((h ? rks : rgs) + 4 * ch, (h ? p.b.rk : p.b.rg) + rb + 4 * ch);
    }
  };
  auto issue_q = [&](int c) {   // diag(γ)Q (kShared: q̂) hi / lo of chunk c
    const int64_t rb = qb + int64_t(c) * kC;
    for (int idx = tid; idx < kC * (kHD / 8); idx += blockDim.x) {
      const int r = idx / (kHD / 8), ch = idx % (kHD / 8);
      const int64_t go = (rb + r) * kHD + 8 * ch;
      const int so = r * kRS + 8 * ch;
      cp_async16(Qh + so, p.b.Qh + go);
      if (!kOne) cp_async16(Ql + so, p.b.Ql + go);
    }
  };
  auto issue_b = [&](int c) {   // K' (kShared: k̂), P of chunk c into buffer c & 1
    const int64_t rb = hb + int64_t(c) * kC, kb = qb + int64_t(c) * kC;
    bf16* kh = Kh0 + (c & 1) * kC * kRS;
    bf16* kl = Kl0 + (c & 1) * kC * kRS;
    bf16* ph = Ph0 + (c & 1) * kC * kPS;
    bf16* pl = Pl0 + (c & 1) * kC * kPS;
    for (int idx = tid; idx < kC * (kHD / 8); idx += blockDim.x) {
      const int r = idx / (kHD / 8), ch = idx % (kHD / 8);
      const int64_t go = (kb + r) * kHD + 8 * ch;
      cp_async16(kh + r * kRS + 8 * ch, p.b.Kh + go);
      if (!kOne) cp_async16(kl + r * kRS + 8 * ch, p.b.Kl + go);
    }
    for (int idx = tid; idx < kC * (kC / 8); idx += blockDim.x) {
      const int r = idx / (kC / 8), ch = idx % (kC / 8);
      const int64_t go = (rb + r) * kC + 8 * ch;
      cp_async16(ph + r * kPS + 8 * ch, p.b.Ph + go);
      if (!kOne) cp_async16(pl + r * kPS + 8 * ch, p.b.Pl + go);
    }
  };
  // Chunk cc's nine planes of head j (64 contiguous rows each) into L2: thread `plane` of the CTA
  // whose column block is plane % nblk.
  auto prefetch = [&](int cc) {
    if (tid >= 9 || tid % nblk != cb || (kOne && tid < 8 && (tid & 1))) return;   // kOne: no lo planes
    const int64_t r0 = hb + int64_t(cc) * kC;
    if (tid < 6) {
      const bf16* pl = tid == 0 ? p.b.Wh : tid == 1 ? p.b.Wl : tid == 2 ? p.b.Qh : tid == 3 ? p.b.Ql : tid == 4 ? p.b.Kh : p.b.Kl;
      prefetch_l2_bulk(pl + (tid < 2 ? r0 : qb + int64_t(cc) * kC) * kHD, kC * kHD * sizeof(bf16));
    } else if (tid < 8) {
      prefetch_l2_bulk((tid == 6 ? p.b.Ph : p.b.Pl) + r0 * kC, kC * kC * sizeof(bf16));
    } else {
      prefetch_l2_bulk(p.b.U + r0 * kHD, kC * kHD * sizeof(float));
    }
  };

  if (nch > 1) prefetch(1);
  // cp.async groups, oldest first: b(0), w(0); per chunk c: q(c), b(c+1) at its start, w(c+1) in its middle.
  issue_b(0);
  cp_async_commit();
  issue_w(0);
  cp_async_commit();

  // This warp's 16 state rows (dk) × NB columns as an MMA accumulator: row 16·warp + gq (+8),
  // columns 8·nt + 2·tq (+1).
  float* Sg = p.S + int64_t(j) * kHD * kHD;
  float acc_s[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      acc_s[nt][e] = Sg[(16 * warp + gq + 8 * (e >> 1)) * kHD + c0 + 8 * nt + 2 * tq + (e & 1)];

  const int mt = warp & 3, nh = warp >> 2;   // Δ and O: 16 tokens × 8·NW columns from column 8·NW·nh
  const int aoff = (16 * mt + lr + 8 * (q & 1)) * kRS + 8 * (q >> 1);   // A rows × k (ldmatrix)
  const int poff = (16 * mt + lr + 8 * (q & 1)) * kPS + 8 * (q >> 1);
  // B [k][n] (ldmatrix.trans): NW = 2, a 16 × 16 block (two n8 tiles of one k-step); NW = 1, the
  // warp's 8 columns over 32 k rows (one n8 tile of two k-steps).
  const int boff = NW == 2 ? (lr + 8 * (q & 1)) * NS + 16 * nh + 8 * (q >> 1) : (lr + 8 * q) * NS + 8 * nh;
  const int koff = (lr + 8 * (q >> 1)) * kRS + 16 * warp + 8 * (q & 1);  // A = K'ᵀ from [token][dk] (.trans)
  const int doff = (lr + 8 * (q & 1)) * NS + 8 * (q >> 1);              // B = Δ, all NB columns
  // B fragments (hi, lo) of the [k][n] tile bh / bl for k-step kk (NW = 2), or hi only for k-steps kk
  // and kk + 1 (NW = 1, kOne).
  auto ldb = [&](const bf16* bh, const bf16* bl, int kk, uint32_t* fh, uint32_t* fl) {
    ldsm_x4_t(fh[0], fh[1], fh[2], fh[3], bh + boff + 16 * kk * NS);
    if constexpr (NW == 2 && !kOne) ldsm_x4_t(fl[0], fl[1], fl[2], fl[3], bl + boff + 16 * kk * NS);
  };

  for (int c = 0; c < nch; ++c) {
    const int t0 = c * kC, n = min(kC, p.T - t0);
    if (c + 2 < nch) prefetch(c + 2);
    const float gc = p.b.gC[int64_t(j) * nch + c];
    __syncthreads();   // chunk c-1 is done with S, Δ, diag(γ)Q and K'/P buffer (c+1)&1
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)   // S_c (hi / lo) as the B operand of this chunk
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int o = (16 * warp + gq + 8 * r) * NS + 8 * nt + 2 * tq;
        store_split2x<kOne>(Sh + o, Sl + o, acc_s[nt][2 * r], acc_s[nt][2 * r + 1]);
      }
    issue_q(c);
    cp_async_commit();
    if (c + 1 < nch) issue_b(c + 1);
    cp_async_commit();
    cp_async_wait<2>();   // everything but q(c) and b(c+1): W/U of chunk c, K'/P of chunk c
    __syncthreads();

    // Phase 1: Δ = U − W S (zero on rows past T: U and W are). The warp's S fragments (NW n8 tiles:
    // hi in sf[kk][2·nt], sf[kk][2·nt + 1], lo 4 further) stay in registers for diag(γ)Q S in phase 2.
    uint32_t sf[kHD / 16][8] = {};
    {
      float aD[NW][4];
#pragma unroll
      for (int nt = 0; nt < NW; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) aD[nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kHD / 16; ++kk) {
        if constexpr (NW == 2) {
          ldb(Sh, Sl, kk, sf[kk], sf[kk] + 4);
        } else if (kk % 2 == 0) {
          uint32_t f[4];
          ldb(Sh, Sl, kk, f, nullptr);
          sf[kk][0] = f[0];
          sf[kk][1] = f[1];
          sf[kk + 1][0] = f[2];
          sf[kk + 1][1] = f[3];
        }
        const uint32_t* sh = sf[kk];
        const uint32_t* sl = sf[kk] + 4;
        uint32_t wh[4], wl[4] = {};
        ldsm_x4(wh[0], wh[1], wh[2], wh[3], Wh + aoff + 16 * kk);
        if constexpr (!kOne) ldsm_x4(wl[0], wl[1], wl[2], wl[3], Wl + aoff + 16 * kk);
#pragma unroll
        for (int nt = 0; nt < NW; ++nt) mma_bf16x<kOne>(aD[nt], wh, wl, sh[2 * nt], sh[2 * nt + 1], sl[2 * nt], sl[2 * nt + 1]);
      }
#pragma unroll
      for (int nt = 0; nt < NW; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = 16 * mt + gq + 8 * r, col = 8 * NW * nh + 8 * nt + 2 * tq;
          const float2 uv = *reinterpret_cast<const float2*>(Us + i * NS + col);
          const float d0 = uv.x - aD[nt][2 * r], d1 = uv.y - aD[nt][2 * r + 1];
          store_split2x<kOne>(Dh + i * NS + col, Dl + i * NS + col, d0, d1);
          if (kShared) {
            const float f = rks[i];
            store_split2x<kOne>(D2h + i * NS + col, D2l + i * NS + col, d0 * f, d1 * f);
          }
        }
    }
    // kShared: this lane's two rows' γ, read before the factors' buffer is reloaded (issue_w below).
    const float rg0 = kShared ? rgs[16 * mt + gq] : 1.f, rg1 = kShared ? rgs[16 * mt + gq + 8] : 1.f;
    cp_async_wait<1>();   // diag(γ)Q of chunk c too (only b(c+1) may still be in flight)
    __syncthreads();      // Δ complete; W, U free
    if (c + 1 < nch) issue_w(c + 1);
    cp_async_commit();

    // Phase 2: O = diag(γ)Q S interleaved with S ← γ_C S + K'ᵀ Δ (two k-steps of the first per
    // k-step of the second), then O += P Δ.
    const bf16* kh = Kh0 + (c & 1) * kC * kRS;
    const bf16* kl = Kl0 + (c & 1) * kC * kRS;
    float aO[NW][4];
#pragma unroll
    for (int nt = 0; nt < NW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) aO[nt][e] = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_s[nt][e] *= gc;
#pragma unroll
    for (int ks = 0; ks < kC / 16; ++ks) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int kk = 2 * ks + h;
        const uint32_t* sh = sf[kk];
        const uint32_t* sl = sf[kk] + 4;
        uint32_t qh[4], ql[4] = {};
        ldsm_x4(qh[0], qh[1], qh[2], qh[3], Qh + aoff + 16 * kk);
        if constexpr (!kOne) ldsm_x4(ql[0], ql[1], ql[2], ql[3], Ql + aoff + 16 * kk);
#pragma unroll
        for (int nt = 0; nt < NW; ++nt) mma_bf16x<kOne>(aO[nt], qh, ql, sh[2 * nt], sh[2 * nt + 1], sl[2 * nt], sl[2 * nt + 1]);
      }
      uint32_t ah[4], al[4] = {};
      ldsm_x4_t(ah[0], ah[1], ah[2], ah[3], kh + koff + 16 * ks * kRS);
      if constexpr (!kOne) ldsm_x4_t(al[0], al[1], al[2], al[3], kl + koff + 16 * ks * kRS);
#pragma unroll
      for (int np = 0; np < NB / 16; ++np) {
        uint32_t dh[4], dl[4] = {};
        ldsm_x4_t(dh[0], dh[1], dh[2], dh[3], (kShared ? D2h : Dh) + doff + 16 * ks * NS + 16 * np);
        if constexpr (!kOne) ldsm_x4_t(dl[0], dl[1], dl[2], dl[3], (kShared ? D2l : Dl) + doff + 16 * ks * NS + 16 * np);
        mma_bf16x<kOne>(acc_s[2 * np], ah, al, dh[0], dh[1], dl[0], dl[1]);
        mma_bf16x<kOne>(acc_s[2 * np + 1], ah, al, dh[2], dh[3], dl[2], dl[3]);
      }
    }
    if (kShared) {   // O = diag(γ) (Q̂ S) so far
#pragma unroll
      for (int nt = 0; nt < NW; ++nt) {
        aO[nt][0] *= rg0;
        aO[nt][1] *= rg0;
        aO[nt][2] *= rg1;
        aO[nt][3] *= rg1;
      }
    }
    // O += P Δ over the tokens s ≤ i (P is zero above the diagonal: k-steps past mt are skipped).
    const bf16* ph = Ph0 + (c & 1) * kC * kPS;
    const bf16* pl = Pl0 + (c & 1) * kC * kPS;
    (void)pl;
    if constexpr (NW == 2) {
#pragma unroll
      for (int ks = 0; ks < kC / 16; ++ks) {
        if (ks > mt) break;
        uint32_t pah[4], pal[4] = {}, dh[4], dl[4] = {};
        ldsm_x4(pah[0], pah[1], pah[2], pah[3], ph + poff + 16 * ks);
        if constexpr (!kOne) ldsm_x4(pal[0], pal[1], pal[2], pal[3], pl + poff + 16 * ks);
        ldb(Dh, Dl, ks, dh, dl);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) mma_bf16x<kOne>(aO[nt], pah, pal, dh[2 * nt], dh[2 * nt + 1], dl[2 * nt], dl[2 * nt + 1]);
      }
    } else {   // Δ fragments of k-steps 2·kp and 2·kp + 1 from one load
#pragma unroll
      for (int kp = 0; kp < kC / 32; ++kp) {
        if (2 * kp > mt) break;
        uint32_t pah[4], dh[4];
        ldb(Dh, Dl, 2 * kp, dh, nullptr);
        ldsm_x4(pah[0], pah[1], pah[2], pah[3], ph + poff + 32 * kp);
        mma_bf16(aO[0], pah[0], pah[1], pah[2], pah[3], dh[0], dh[1]);
        if (2 * kp + 1 > mt) break;
        ldsm_x4(pah[0], pah[1], pah[2], pah[3], ph + poff + 32 * kp + 16);
        mma_bf16(aO[0], pah[0], pah[1], pah[2], pah[3], dh[2], dh[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NW; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = 16 * mt + gq + 8 * r, col = 8 * NW * nh + 8 * nt + 2 * tq;
        if (i < n)
          *reinterpret_cast<float2*>(p.y + int64_t(t0 + i) * value_dim + j * kHD + c0 + col) =
              make_float2(aO[nt][2 * r], aO[nt][2 * r + 1]);
      }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      Sg[(16 * warp + gq + 8 * (e >> 1)) * kHD + c0 + 8 * nt + 2 * tq + (e & 1)] = acc_s[nt][e];

  conv_shift(d, p.conv_state, p.qkv, p.T);
}

// ---- P11 scan3 (LILY_GDN_P11 bit 4): the chunk scan with only the state-dependent work ----------
// With Q~ and O0 from gdn_chunk_intra2_kernel<1>, a chunk needs
//   Δ = U − W S,   O = Q~ S + O0,   S ← γ_C S + K'ᵀ Δ,
// so P, P Δ and its operands leave the scan. Per chunk: one barrier, phase 1 = W S and Q~ S in one
// pass over S's fragments (four accumulators, each split over even / odd k-steps: 12-deep MMA chains,
// the split terms interleaved over the accumulators since the asm MMAs keep their order), Δ and y
// stored; a barrier; phase 2 = the state update (two accumulator sets, 6-deep chains), the new S
// stored to shared memory at once (nobody reads S in phase 2). W, Q~, K' (hi / lo) are
// double-buffered and arrive during the whole previous chunk; U and O0 (this CTA's 32 columns) go to
// registers one chunk ahead; chunk c + 2 is prefetched into L2 as in the scan2 kernel.
// Shared memory: the 64×128 bf16 tiles are unpadded with the 16-byte chunks XOR-swizzled by row
// (chunk ch of row r at ch ^ (r & 7): the 8 rows of an ldmatrix matrix hit 8 distinct bank groups),
// which is what makes 12 of them + S + Δ fit: 227,328 bytes.
constexpr size_t kCScan3Smem = sizeof(bf16) * (12 * kC * kHD + 2 * kHD * kNS + 2 * kC * kNS);
static_assert(kCScan3Smem <= 227 * 1024, "chunk scan3: shared memory");

// Element offset of 16-byte chunk ch (0..15) of row r in a swizzled 64×128 bf16 tile.
__device__ __forceinline__ int swz(int r, int ch) { return r * kHD + ((ch ^ (r & 7)) << 3); }

// grid nv · (128 / kNB), block 256 (8 warps); CTA (j, cb) carries columns c0..c0+31 of head j's state.
__global__ void __launch_bounds__(256, 1) gdn_chunk_scan3_kernel(const __grid_constant__ CScanArgs p) {
  extern __shared__ __align__(16) unsigned char smraw[];
  bf16* tiles = reinterpret_cast<bf16*>(smraw);   // [buffer 2][Wh, Wl, Qh, Ql, Kh, Kl][kC × kHD] swizzled
  bf16* Sh = tiles + 12 * kC * kHD;                // [kHD][kNS] (state row = dk, column = value)
  bf16* Sl = Sh + kHD * kNS;
  bf16* Dh = Sl + kHD * kNS;                       // [kC][kNS] Δ (token × value column)
  bf16* Dl = Dh + kC * kNS;
  constexpr int kTile = kC * kHD;
  pdl_trigger();
  pdl_wait();
  const GdnDims& d = p.d;
  const int nblk = kHD / kNB;
  const int j = blockIdx.x / nblk, cb = blockIdx.x % nblk, c0 = cb * kNB;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int lr = lane & 7, q = lane >> 3;
  const int nch = p.b.nch;
  const int64_t hb = int64_t(j) * p.b.Tp;
  const int64_t value_dim = int64_t(d.nv) * kHD;

  auto issue = [&](int c) {   // W, Q~, K' hi / lo of chunk c into buffer c & 1 (4 rows × 6 planes per thread)
    const int64_t rb = hb + int64_t(c) * kC;
    bf16* dst = tiles + (c & 1) * 6 * kTile;
#pragma unroll
    for (int it = 0; it < kC * (kHD / 8) / 256; ++it) {
      const int idx = tid + 256 * it, r = idx >> 4, ch = idx & 15;
      const int64_t go = (rb + r) * kHD + 8 * ch;
      const int so = swz(r, ch);
      cp_async16(dst + so, p.b.Wh + go);
      cp_async16(dst + kTile + so, p.b.Wl + go);
      cp_async16(dst + 2 * kTile + so, p.b.Qh + go);
      cp_async16(dst + 3 * kTile + so, p.b.Ql + go);
      cp_async16(dst + 4 * kTile + so, p.b.Kh + go);
      cp_async16(dst + 5 * kTile + so, p.b.Kl + go);
    }
  };
  const int mt = warp & 3, nh = warp >> 2;   // phase 1: 16 tokens × 16 columns
  // U and O0 of chunk c at this thread's phase-1 places: index 2·nt + r = row 16mt + gq + 8r,
  // columns 16nh + 8nt + 2tq (+1).
  auto load_uo = [&](int c, float2 (&u)[4], float2 (&o)[4]) {
    const int64_t rb = hb + int64_t(c) * kC;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t go = (rb + 16 * mt + gq + 8 * r) * kHD + c0 + 16 * nh + 8 * nt + 2 * tq;
        u[2 * nt + r] = __ldg(reinterpret_cast<const float2*>(p.b.U + go));
        o[2 * nt + r] = __ldg(reinterpret_cast<const float2*>(p.b.O0 + go));
      }
  };
  // Chunk cc's eight planes of head j into L2 (64 contiguous rows each): thread `plane` of the CTA
  // whose column block is plane % nblk.
  auto prefetch = [&](int cc) {
    if (tid >= 8 || tid % nblk != cb) return;
    const int64_t r0 = hb + int64_t(cc) * kC;
    if (tid < 6) {
      const bf16* pl = tid == 0 ? p.b.Wh : tid == 1 ? p.b.Wl : tid == 2 ? p.b.Qh : tid == 3 ? p.b.Ql : tid == 4 ? p.b.Kh : p.b.Kl;
      prefetch_l2_bulk(pl + r0 * kHD, kC * kHD * sizeof(bf16));
    } else {
      prefetch_l2_bulk((tid == 6 ? p.b.U : p.b.O0) + r0 * kHD, kC * kHD * sizeof(float));
    }
  };

  if (nch > 1) prefetch(1);
  issue(0);
  cp_async_commit();
  float2 uN[4], oN[4];
  load_uo(0, uN, oN);

  // This warp's 16 state rows (dk) × 32 columns as an MMA accumulator: row 16·warp + gq (+8),
  // columns 8·nt + 2·tq (+1).
  float* Sg = p.S + int64_t(j) * kHD * kHD;
  float acc_s[4][4];
  scan_state_load(Sg, c0, warp, gq, tq, acc_s);
  auto write_s = [&] { scan_state_split(acc_s, warp, gq, tq, Sh, Sl); };
  write_s();

  const int boff = (lr + 8 * (q & 1)) * kNS + 16 * nh + 8 * (q >> 1);   // B = S [k][n] (ldmatrix.trans)
  const int doff = (lr + 8 * (q & 1)) * kNS + 8 * (q >> 1);             // B = Δ, all 32 columns
  const int arow = 16 * mt + lr + 8 * (q & 1);                           // A = W / Q~ rows (ldmatrix)

  for (int c = 0; c < nch; ++c) {
    const int t0 = c * kC, n = min(kC, p.T - t0);
    if (c + 2 < nch) prefetch(c + 2);
    const float gc = p.b.gC[int64_t(j) * nch + c];
    float2 u[4], o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      u[e] = uN[e];
      o[e] = oN[e];
    }
    cp_async_wait<0>();   // W, Q~, K' of chunk c (the only group in flight)
    __syncthreads();      // ... visible to all; S_c written; chunk c−1 done with Δ and buffer (c+1)&1
    if (c + 1 < nch) {
      issue(c + 1);
      load_uo(c + 1, uN, oN);
    }
    cp_async_commit();
    const bf16* Wt = tiles + (c & 1) * 6 * kTile;

    // Phase 1: Δ = U − W S and O = Q~ S + O0 (16 tokens × 16 columns per warp; accumulator h
    // takes the k-steps of parity h).
    {
      float aD[2][2][4], aO[2][2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) aD[h][nt][e] = aO[h][nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kHD / 16; ++kk) {
        const int h = kk & 1;
        uint32_t sh[4], sl[4], wh[4], wl[4], qh[4], ql[4];
        const int ao = swz(arow, 2 * kk + (q >> 1));
        ldsm_x4_t(sh[0], sh[1], sh[2], sh[3], Sh + boff + 16 * kk * kNS);
        ldsm_x4_t(sl[0], sl[1], sl[2], sl[3], Sl + boff + 16 * kk * kNS);
        ldsm_x4(wh[0], wh[1], wh[2], wh[3], Wt + ao);
        ldsm_x4(wl[0], wl[1], wl[2], wl[3], Wt + kTile + ao);
        ldsm_x4(qh[0], qh[1], qh[2], qh[3], Wt + 2 * kTile + ao);
        ldsm_x4(ql[0], ql[1], ql[2], ql[3], Wt + 3 * kTile + ao);
        // lo·hi, hi·lo, hi·hi (small terms first), each over the four accumulators.
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          mma_bf16(aD[h][nt], wl[0], wl[1], wl[2], wl[3], sh[2 * nt], sh[2 * nt + 1]);
          mma_bf16(aO[h][nt], ql[0], ql[1], ql[2], ql[3], sh[2 * nt], sh[2 * nt + 1]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          mma_bf16(aD[h][nt], wh[0], wh[1], wh[2], wh[3], sl[2 * nt], sl[2 * nt + 1]);
          mma_bf16(aO[h][nt], qh[0], qh[1], qh[2], qh[3], sl[2 * nt], sl[2 * nt + 1]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          mma_bf16(aD[h][nt], wh[0], wh[1], wh[2], wh[3], sh[2 * nt], sh[2 * nt + 1]);
          mma_bf16(aO[h][nt], qh[0], qh[1], qh[2], qh[3], sh[2 * nt], sh[2 * nt + 1]);
        }
      }
      // Δ (zero on rows past T: U and W are) to shared memory, O to y.
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = 16 * mt + gq + 8 * r, col = 16 * nh + 8 * nt + 2 * tq, x = 2 * nt + r;
          const float d0 = u[x].x - (aD[0][nt][2 * r] + aD[1][nt][2 * r]);
          const float d1 = u[x].y - (aD[0][nt][2 * r + 1] + aD[1][nt][2 * r + 1]);
          store_split2(Dh + i * kNS + col, Dl + i * kNS + col, d0, d1);
          if (i < n)
            *reinterpret_cast<float2*>(p.y + int64_t(t0 + i) * value_dim + j * kHD + c0 + col) =
                make_float2(o[x].x + (aO[0][nt][2 * r] + aO[1][nt][2 * r]),
                            o[x].y + (aO[0][nt][2 * r + 1] + aO[1][nt][2 * r + 1]));
        }
    }
    __syncthreads();   // Δ complete (and every warp done reading S_c)

    // Phase 2: S ← γ_C S + K'ᵀ Δ (warp = 16 state rows × 32 columns); the odd k-steps go to a
    // second accumulator set, added at the end.
    {
      const bf16* Kt = Wt + 4 * kTile;
      float acc2[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc_s[nt][e] *= gc;
          acc2[nt][e] = 0.f;
        }
#pragma unroll
      for (int ks = 0; ks < kC / 16; ++ks) {
        float(*ac)[4] = (ks & 1) ? acc2 : acc_s;
        uint32_t ah[4], al[4], dh[2][4], dl[2][4];
        // A = K'ᵀ from [token][dk] (.trans): tokens 16ks + lr + 8(q>>1), dk 16·warp + 8(q&1).
        const int ko = swz(16 * ks + lr + 8 * (q >> 1), 2 * warp + (q & 1));
        ldsm_x4_t(ah[0], ah[1], ah[2], ah[3], Kt + ko);
        ldsm_x4_t(al[0], al[1], al[2], al[3], Kt + kTile + ko);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          ldsm_x4_t(dh[np][0], dh[np][1], dh[np][2], dh[np][3], Dh + doff + 16 * ks * kNS + 16 * np);
          ldsm_x4_t(dl[np][0], dl[np][1], dl[np][2], dl[np][3], Dl + doff + 16 * ks * kNS + 16 * np);
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          mma_bf16(ac[nt], al[0], al[1], al[2], al[3], dh[nt >> 1][2 * (nt & 1)], dh[nt >> 1][2 * (nt & 1) + 1]);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          mma_bf16(ac[nt], ah[0], ah[1], ah[2], ah[3], dl[nt >> 1][2 * (nt & 1)], dl[nt >> 1][2 * (nt & 1) + 1]);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          mma_bf16(ac[nt], ah[0], ah[1], ah[2], ah[3], dh[nt >> 1][2 * (nt & 1)], dh[nt >> 1][2 * (nt & 1) + 1]);
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[nt][e] += acc2[nt][e];
    }
    write_s();   // S_{c+1}: phase 1 of this chunk (its only reader) ended before the barrier above
  }
  cp_async_wait<0>();

#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      Sg[(16 * warp + gq + 8 * (e >> 1)) * kHD + c0 + 8 * nt + 2 * tq + (e & 1)] = acc_s[nt][e];

  conv_shift(d, p.conv_state, p.qkv, p.T);
}

ChunkBufs chunk_bufs(const GdnDims& d, int T, float* work) {
  ChunkBufs b;
  b.nch = (T + kC - 1) / kC;
  b.Tp = b.nch * kC;
  const int64_t rows = int64_t(d.nv) * b.Tp;
  float* f = work + ((gdn_prefill_workspace_floats(d, T) + 63) / 64) * 64;
  b.U = f;
  f += rows * kHD;
  bf16* h = reinterpret_cast<bf16*>(f);
  b.Wh = h; h += rows * kHD;
  b.Wl = h; h += rows * kHD;
  b.Qh = h; h += rows * kHD;
  b.Ql = h; h += rows * kHD;
  b.Kh = h; h += rows * kHD;
  b.Kl = h; h += rows * kHD;
  b.Ph = h; h += rows * kC;
  b.Pl = h; h += rows * kC;
  b.gC = reinterpret_cast<float*>(h);
  b.rg = b.gC + ((int64_t(d.nv) * b.nch + 63) / 64) * 64;
  b.rk = b.rg + rows;
  b.O0 = b.rk + ((rows + 63) / 64) * 64;   // 256-byte aligned (rows are whole chunks: already)
  return b;
}

template <int NC>
void launch_scan(const ScanArgs& a, cudaStream_t s) {
  constexpr int CB = kScanWarps * 4 * NC;
  const size_t smem = sizeof(float) * (2 * kTB * (2 * kHD + CB) + 4 * kTB);
  static bool attr_set = false;
  if (!attr_set) {
    CUDA_CHECK(cudaFuncSetAttribute(gdn_scan_kernel<NC>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    attr_set = true;
  }
  launch(gdn_scan_kernel<NC>, dim3(a.d.nv * (kHD / CB)), dim3(kScanWarps * 32), smem, s, a);
  CUDA_LAUNCH_CHECK();
}

}  // namespace

bool& gdn_prep_batched_enabled() {
  static bool on = true;
  return on;
}

bool& gdn_prep_wide_enabled() {
  static bool on = true;
  return on;
}
bool& gdn_prep_lean_enabled() {
  static bool on = true;
  return on;
}

bool& gdn_chunk_one() {
  static bool on = true;
  return on;
}
bool& gdn_scan_nb16() {
  static bool on = true;
  return on;
}
bool& gdn_scan_halves() {
  static bool on = true;
  return on;
}
// P24 applies to P11's default pair (gdn_chunk_intra2_kernel<0> + gdn_chunk_scan2_kernel<false>) only.
static bool gdn_p24_active() {
  const int p11 = gdn_chunk_p11();
  return gdn_chunk_one() && (p11 & 3) == 3 && p11 != 7 && !(p11 & 16);
}
int& gdn_chunk_p11() {
  static int parts = 3;
  return parts;
}

bool gdn_prefill_ok(const GdnDims& d) {
  return d.dk == kHD && d.dv == kHD && d.kconv >= 1 && d.kconv <= 9 && d.nk > 0 && d.nv % d.nk == 0 &&
         d.conv_dim == 2 * d.nk * d.dk + d.nv * d.dv;
}

int64_t gdn_prefill_workspace_floats(const GdnDims& d, int T) {
  return int64_t(T) * d.conv_dim + 2LL * T * d.nv + 64;
}

bool gdn_prep_wide_ok(const GdnDims& d, const float* conv_w, const float* conv_state, const void* qkv,
                      const float* work) {
  auto a16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const int heads = d.conv_dim / kHD;
  return gdn_prep_wide_enabled() && gdn_prep_batched_enabled() && d.kconv == 4 && heads % kPrepWideWarps == 0 &&
         a16(conv_w) && a16(conv_state) && a16(qkv) && a16(work);
}

void gdn_prefill_prep(const GdnDims& d, const float* conv_w, const float* A_log, const float* dt_bias,
                      const float* conv_state, const float* qkv, const float* a, const float* b, int T,
                      float* work, cudaStream_t s, const __half* qkv16) {
  LILY_CHECK(gdn_prefill_ok(d), "gdn prefill: unsupported shapes");
  float* u = work;
  float* beta = u + int64_t(T) * d.conv_dim;
  float* g = beta + int64_t(T) * d.nv;
  PrepArgs p{d, conv_w, A_log, dt_bias, conv_state, qkv, a, b, T, u, beta, g, qkv16};
  const dim3 grid((T + kPrepTok - 1) / kPrepTok, d.conv_dim / kHD);
  const int heads = d.conv_dim / kHD;
  if (qkv16) {   // P62
    LILY_CHECK(gdn_prep_wide_ok(d, conv_w, conv_state, qkv16, u), "gdn prefill: fp16 inputs need P41's prep");
    if (gdn_prep_lean_enabled())   // P74
      launch(gdn_prep_wide_kernel<true, true>, dim3(grid.x, heads / kPrepWideWarps), dim3(32 * kPrepWideWarps), 0, s, p);
    else
      launch(gdn_prep_wide_kernel<true>, dim3(grid.x, heads / kPrepWideWarps), dim3(32 * kPrepWideWarps), 0, s, p);
  } else if (gdn_prep_wide_ok(d, conv_w, conv_state, qkv, u))   // P41
    launch(gdn_prep_wide_kernel<false>, dim3(grid.x, heads / kPrepWideWarps), dim3(32 * kPrepWideWarps), 0, s, p);
  else if (gdn_prep_batched_enabled()) launch(gdn_prep_batched_kernel, grid, dim3(kHD), 0, s, p);   // P9
  else launch(gdn_prep_kernel, grid, dim3(kHD), 0, s, p);
  CUDA_LAUNCH_CHECK();
}

void gdn_prefill_scan(const GdnDims& d, const float* norm_w, float* conv_state, float* S, const float* qkv,
                      const float* z, int T, const float* work, float* y, int nc, cudaStream_t s) {
  LILY_CHECK(gdn_prefill_ok(d), "gdn prefill: unsupported shapes");
  const float* u = work;
  const float* beta = u + int64_t(T) * d.conv_dim;
  const float* g = beta + int64_t(T) * d.nv;
  ScanArgs a{d, conv_state, S, qkv, u, beta, g, T, y};
  switch (nc) {
    case 2: launch_scan<2>(a, s); break;
    case 4: launch_scan<4>(a, s); break;
    default: launch_scan<1>(a, s); break;   // measured fastest at T = 512..8192 (256 CTAs)
  }
  launch(gdn_norm_kernel<float>, dim3(T, d.nv), dim3(kHD), 0, s, d, norm_w, z, T, y);
  CUDA_LAUNCH_CHECK();
}

int64_t gdn_chunked_workspace_floats(const GdnDims& d, int T) {
  const int64_t nch = (T + kC - 1) / kC, rows = int64_t(d.nv) * nch * kC;
  // U (f32) + six bf16 planes of 128 + two bf16 planes of 64 per row, γ_C per (head, chunk), then
  // the P11 row factors (two floats per row), then O0 (P11 scan3, 128 floats per row).
  return ((gdn_prefill_workspace_floats(d, T) + 63) / 64) * 64 + rows * (kHD + 3 * kHD + kC) +
         ((d.nv * nch + 63) / 64) * 64 + 2 * rows + 64 + rows * kHD + 64;
}

void gdn_chunked_intra(const GdnDims& d, int T, float* work, cudaStream_t s) {
  LILY_CHECK(gdn_prefill_ok(d), "gdn prefill: unsupported shapes");
  const ChunkBufs b = chunk_bufs(d, T, work);
  const float* u = work;
  const float* beta = u + int64_t(T) * d.conv_dim;
  const float* g = beta + int64_t(T) * d.nv;
  static bool attr_set = false;
  if (!attr_set) {
    CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_intra_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kIntraSmem)));
    CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_intra2_kernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kIntra2Smem)));
    CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_intra2_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kIntra2Smem)));
    CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_intra2_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kIntra2Smem)));
    CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_intra2_kernel<0, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kIntra2Smem)));
    attr_set = true;
  }
  const int p11 = gdn_chunk_p11();
  IntraArgs a{d, u, beta, g, T, b, p11 == 7 ? 1 : 0, gdn_p24_active() ? 1 : 0};
  if ((p11 & 24) == 24) launch(gdn_chunk_intra2_kernel<2>, dim3(b.nch, d.nv), dim3(256), kIntra2Smem, s, a);   // scan3, FMA M
  else if (p11 & 16) launch(gdn_chunk_intra2_kernel<1>, dim3(b.nch, d.nv), dim3(256), kIntra2Smem, s, a);   // P11 scan3
  else if (a.one) launch(gdn_chunk_intra2_kernel<0, true>, dim3(b.nch, d.nv), dim3(256), kIntra2Smem, s, a);   // P24
  else if (p11 & 1) launch(gdn_chunk_intra2_kernel<0>, dim3(b.nch, d.nv), dim3(256), kIntra2Smem, s, a);   // P11
  else launch(gdn_chunk_intra_kernel, dim3(b.nch, d.nv), dim3(256), kIntraSmem, s, a);
  CUDA_LAUNCH_CHECK();
}

void gdn_prefill_norm(const GdnDims& d, const float* norm_w, const float* z, int T, float* y, cudaStream_t s,
                      bool z16) {
  if (z16)   // P62: z as fp16 [T, nv·128] in z's buffer
    launch(gdn_norm_kernel<__half>, dim3(T, d.nv), dim3(kHD), 0, s, d, norm_w, reinterpret_cast<const __half*>(z), T, y);
  else
    launch(gdn_norm_kernel<float>, dim3(T, d.nv), dim3(kHD), 0, s, d, norm_w, z, T, y);
  CUDA_LAUNCH_CHECK();
}

void gdn_chunked_scan(const GdnDims& d, const float* norm_w, float* conv_state, float* S, const float* qkv,
                      const float* z, int T, float* work, float* y, cudaStream_t s, bool norm) {
  LILY_CHECK(gdn_prefill_ok(d), "gdn prefill: unsupported shapes");
  const ChunkBufs b = chunk_bufs(d, T, work);
  static bool attr_set = false;
  if (!attr_set) {
    CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kCScanSmem)));
    CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_scan2_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kCScanSmem)));
    CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_scan2_kernel<false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(cscan2_smem<false, true, kNB>())));
    CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_scan2_kernel<false, true, kNB27>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(kCScan27Smem)));
    CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_scan2_kernel<false, true, kNB27, 2>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(kCScan36Smem)));
    CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_scan2_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kCScan2SharedSmem)));
    CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_scan3_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kCScan3Smem)));
    attr_set = true;
  }
  CScanArgs a{d, conv_state, S, qkv, T, b, y};
  const int p11 = gdn_chunk_p11();
  if (gdn_p24_active() && gdn_scan_nb16() && gdn_scan_halves())   // P36
    launch(gdn_chunk_scan2_kernel<false, true, kNB27, 2>, dim3(d.nv * (kHD / (2 * kNB27))), dim3(512), kCScan36Smem, s,
           a);
  else if (gdn_p24_active() && gdn_scan_nb16())   // P27
    launch(gdn_chunk_scan2_kernel<false, true, kNB27>, dim3(d.nv * (kHD / kNB27)), dim3(256), kCScan27Smem, s, a);
  else if (gdn_p24_active())   // P24
    launch(gdn_chunk_scan2_kernel<false, true>, dim3(d.nv * (kHD / kNB)), dim3(256), cscan2_smem<false, true, kNB>(), s, a);
  else if (p11 & 16) launch(gdn_chunk_scan3_kernel, dim3(d.nv * (kHD / kNB)), dim3(256), kCScan3Smem, s, a);   // P11 scan3
  else if (p11 == 7) launch(gdn_chunk_scan2_kernel<true>, dim3(d.nv * (kHD / kNB)), dim3(256), kCScan2SharedSmem, s, a);
  else if (p11 & 2) launch(gdn_chunk_scan2_kernel<false>, dim3(d.nv * (kHD / kNB)), dim3(256), kCScanSmem, s, a);   // P11
  else launch(gdn_chunk_scan_kernel, dim3(d.nv * (kHD / kNB)), dim3(256), kCScanSmem, s, a);
  CUDA_LAUNCH_CHECK();
  if (norm) gdn_prefill_norm(d, norm_w, z, T, y, s);
}

void gdn_conv_shift16(const GdnDims& d, float* conv_state, const __half* qkv16, int T, cudaStream_t s) {
  launch(gdn_conv_shift16_kernel, dim3(unsigned((d.conv_dim + 255) / 256)), dim3(256), 0, s, d, conv_state, qkv16, T);
  CUDA_LAUNCH_CHECK();
}

}  // namespace lily::cuda
