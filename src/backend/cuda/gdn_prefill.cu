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
};

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
      const int j = (blk0 - 2 * key_dim) / d.dv;
      const int64_t tj = int64_t(t) * d.nv + j;
      const float av = p.a[tj] + p.dt_bias[j];
      const float sp = av > 20.f ? av : log1pf(expf(av));
      p.g[tj] = -expf(p.A_log[j]) * sp;
      p.beta[tj] = 1.f / (1.f + expf(-p.b[tj]));
    }
    p.u[int64_t(t) * CD + ch] = u;
  }
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

  // New conv state = the last K-1 raw inputs; a thread owns whole channels, so reading the old
  // rows (T < K-1) before writing needs no barrier.
  const int K1 = d.kconv - 1;
  for (int64_t ch = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; ch < CD; ch += int64_t(gridDim.x) * blockDim.x) {
    float nw[8];
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if (s >= K1) break;
      const int tt = p.T - K1 + s;
      nw[s] = tt >= 0 ? p.qkv[int64_t(tt) * CD + ch] : p.conv_state[int64_t(tt + K1) * CD + ch];
    }
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if (s >= K1) break;
      p.conv_state[int64_t(s) * CD + ch] = nw[s];
    }
  }
}

// grid (T, nv), block 128: y = o · rsqrt(mean(o²) + eps) · w · silu(z) over each head's outputs.
__global__ void __launch_bounds__(kHD) gdn_norm_kernel(GdnDims d, const float* norm_w, const float* z, int T,
                                                      float* y) {
  __shared__ float red[32];
  pdl_trigger();
  pdl_wait();
  const int t = blockIdx.x, j = blockIdx.y, c = threadIdx.x;
  const int64_t off = int64_t(t) * d.nv * kHD + j * kHD + c;
  const float o = y[off];
  const float ss = block_sum(o * o, red);
  y[off] = o * rsqrtf(ss / float(kHD) + d.eps) * norm_w[c] * siluf_(z[off]);
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

bool gdn_prefill_ok(const GdnDims& d) {
  return d.dk == kHD && d.dv == kHD && d.kconv >= 1 && d.kconv <= 9 && d.nk > 0 && d.nv % d.nk == 0 &&
         d.conv_dim == 2 * d.nk * d.dk + d.nv * d.dv;
}

int64_t gdn_prefill_workspace_floats(const GdnDims& d, int T) {
  return int64_t(T) * d.conv_dim + 2LL * T * d.nv + 64;
}

void gdn_prefill_prep(const GdnDims& d, const float* conv_w, const float* A_log, const float* dt_bias,
                      const float* conv_state, const float* qkv, const float* a, const float* b, int T,
                      float* work, cudaStream_t s) {
  LILY_CHECK(gdn_prefill_ok(d), "gdn prefill: unsupported shapes");
  float* u = work;
  float* beta = u + int64_t(T) * d.conv_dim;
  float* g = beta + int64_t(T) * d.nv;
  PrepArgs p{d, conv_w, A_log, dt_bias, conv_state, qkv, a, b, T, u, beta, g};
  launch(gdn_prep_kernel, dim3((T + kPrepTok - 1) / kPrepTok, d.conv_dim / kHD), dim3(kHD), 0, s, p);
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
    case 1: launch_scan<1>(a, s); break;
    case 4: launch_scan<4>(a, s); break;
    default: launch_scan<2>(a, s); break;
  }
  launch(gdn_norm_kernel, dim3(T, d.nv), dim3(kHD), 0, s, d, norm_w, z, T, y);
  CUDA_LAUNCH_CHECK();
}

}  // namespace lily::cuda
