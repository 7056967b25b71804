// Fused Gated DeltaNet core (D4d): causal conv update + SiLU, l2norm of q and k, gates, the f32
// delta-rule recurrence and the gated RMSNorm, one CTA per value head for all T tokens. The value
// heads that share a key head form one thread-block cluster, so the shared q/k conv state is
// rewritten only after every CTA of the cluster has read it.
#include <cooperative_groups.h>

#include "backend/cuda/cuda_ops.h"

namespace cg = cooperative_groups;

namespace lily::cuda {

namespace {

struct GdnArgs {
  GdnDims d;
  const float *conv_w, *A_log, *dt_bias, *norm_w;
  float *conv_state, *S;
  const float *qkv, *z, *a, *b;
  int T, rq;
  float* y;
};

// NR > 0: each thread keeps its NR = dk/rq state values in registers for all T tokens (one read
// and one write of S per call); NR == 0: generic sizes, S is read and written in global memory.
template <int NR>
__global__ void __launch_bounds__(512) gdn_kernel(const __grid_constant__ GdnArgs g) {
  extern __shared__ float sm[];
  const GdnDims& d = g.d;
  const int j = blockIdx.x, kh = j / (d.nv / d.nk);
  const int key_dim = d.nk * d.dk, value_dim = d.nv * d.dv, K = d.kconv;
  const int nch = 2 * d.dk + d.dv;
  float* qs = sm;                       // [dk]
  float* ks = qs + d.dk;                // [dk]
  float* vs = ks + d.dk;                // [dv]
  float* part = vs + d.dv;              // [rq][dv]
  float* newst = part + g.rq * d.dv;    // [K-1][nch]
  float* red = newst + (K - 1) * nch;   // [32]
  const int tid = threadIdx.x, c = tid % d.dv, rq = tid / d.dv;
  float* S = g.S + int64_t(j) * d.dk * d.dv;
  pdl_trigger();
  pdl_wait();
  // Channel of the conv input for the block's i-th local channel (q | k | v of this head).
  auto chan = [&](int i) {
    return i < d.dk ? kh * d.dk + i : i < 2 * d.dk ? key_dim + kh * d.dk + (i - d.dk)
                                                   : 2 * key_dim + j * d.dv + (i - 2 * d.dk);
  };
  // Raw (pre-conv) projection of token t (t < 0 reads the carried conv state).
  auto raw = [&](int t, int ch) {
    return t >= 0 ? g.qkv[int64_t(t) * d.conv_dim + ch] : g.conv_state[int64_t(t + K - 1) * d.conv_dim + ch];
  };
  float sv[NR > 0 ? NR : 1];
  if constexpr (NR > 0) {
#pragma unroll
    for (int i = 0; i < NR; ++i) sv[i] = S[(rq + i * g.rq) * d.dv + c];
  }
  const float A = -__expf(g.A_log[j]), dtb = g.dt_bias[j];
  const float qscale = rsqrtf(float(d.dk));
  for (int t = 0; t < g.T; ++t) {
    for (int i = tid; i < nch; i += blockDim.x) {
      const int ch = chan(i);
      float acc = 0.f;
      for (int tap = 0; tap < K; ++tap) acc = fmaf(g.conv_w[int64_t(ch) * K + tap], raw(t - (K - 1) + tap, ch), acc);
      sm[i] = siluf_(acc);
    }
    __syncthreads();
    float sq = 0.f, sk = 0.f;
    for (int i = tid; i < d.dk; i += blockDim.x) {
      sq += qs[i] * qs[i];
      sk += ks[i] * ks[i];
    }
    const float nq = rsqrtf(block_sum(sq, red) + 1e-6f) * qscale;
    const float nkk = rsqrtf(block_sum(sk, red) + 1e-6f);
    const float av = g.a[int64_t(t) * d.nv + j] + dtb;
    const float sp = av > 20.f ? av : log1pf(__expf(av));
    const float alpha = __expf(A * sp);
    const float beta = sigmoidf_(g.b[int64_t(t) * d.nv + j]);
    // m = Sᵀk̂ (decay applied after, it is a scalar), δ = β (v − α m).
    float m = 0.f;
    if constexpr (NR > 0) {
#pragma unroll
      for (int i = 0; i < NR; ++i) m = fmaf(sv[i], ks[rq + i * g.rq], m);
    } else {
      for (int r = rq; r < d.dk; r += g.rq) m = fmaf(S[r * d.dv + c], ks[r], m);
    }
    part[rq * d.dv + c] = m * nkk;
    __syncthreads();
    m = 0.f;
    for (int i = 0; i < g.rq; ++i) m += part[i * d.dv + c];
    const float delta = beta * (vs[c] - alpha * m);
    __syncthreads();
    // S ← α S + k̂ δᵀ, o = Sᵀ q̂.
    float o = 0.f;
    const float kd = nkk * delta;
    if constexpr (NR > 0) {
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        sv[i] = fmaf(alpha, sv[i], ks[rq + i * g.rq] * kd);
        o = fmaf(sv[i], qs[rq + i * g.rq], o);
      }
    } else {
      for (int r = rq; r < d.dk; r += g.rq) {
        const float s = fmaf(alpha, S[r * d.dv + c], ks[r] * kd);
        S[r * d.dv + c] = s;
        o = fmaf(s, qs[r], o);
      }
    }
    part[rq * d.dv + c] = o * nq;
    __syncthreads();
    o = 0.f;
    for (int i = 0; i < g.rq; ++i) o += part[i * d.dv + c];
    const float ss = block_sum(rq == 0 ? o * o : 0.f, red);
    if (rq == 0) {
      const float zv = g.z[int64_t(t) * value_dim + j * d.dv + c];
      g.y[int64_t(t) * value_dim + j * d.dv + c] =
          o * rsqrtf(ss / float(d.dv) + d.eps) * g.norm_w[c] * siluf_(zv);
    }
    __syncthreads();
  }
  if constexpr (NR > 0) {
#pragma unroll
    for (int i = 0; i < NR; ++i) S[(rq + i * g.rq) * d.dv + c] = sv[i];
  }
  // New conv state = the last K-1 raw inputs; q/k channels are shared with the sibling CTAs, so
  // everyone reads first, then the cluster's rank 0 writes them.
  for (int i = tid; i < nch; i += blockDim.x)
    for (int s = 0; s < K - 1; ++s) newst[s * nch + i] = raw(g.T - (K - 1) + s, chan(i));
  cg::this_cluster().sync();
  const bool owner = cg::this_cluster().block_rank() == 0;
  for (int i = tid; i < nch; i += blockDim.x) {
    if (i < 2 * d.dk && !owner) continue;
    for (int s = 0; s < K - 1; ++s) g.conv_state[int64_t(s) * d.conv_dim + chan(i)] = newst[s * nch + i];
  }
}

}  // namespace

void gdn(const GdnDims& d, const float* conv_w, const float* A_log, const float* dt_bias,
         const float* norm_w, float* conv_state, float* S, const float* qkv, const float* z,
         const float* a, const float* b, int T, float* y, cudaStream_t s) {
  const int ratio = d.nv / d.nk;
  LILY_CHECK(d.nv % d.nk == 0 && ratio <= 8, "gdn: value heads must be a multiple (<= 8x) of key heads");
  LILY_CHECK(d.kconv >= 1 && d.dv <= 512, "gdn: unsupported conv kernel or value head size");
  int rq = 1;
  while (rq * 2 * d.dv <= 512 && d.dk % (rq * 2) == 0) rq *= 2;
  GdnArgs g{d, conv_w, A_log, dt_bias, norm_w, conv_state, S, qkv, z, a, b, T, rq, y};
  const int nch = 2 * d.dk + d.dv;
  const size_t smem = sizeof(float) * (2 * d.dk + d.dv + rq * d.dv + (d.kconv - 1) * nch + 32);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(d.nv);
  cfg.blockDim = dim3(rq * d.dv);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = ratio;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 2;
  if (d.dk / rq == 32) CUDA_CHECK(cudaLaunchKernelEx(&cfg, gdn_kernel<32>, g));
  else CUDA_CHECK(cudaLaunchKernelEx(&cfg, gdn_kernel<0>, g));
}

}  // namespace lily::cuda
