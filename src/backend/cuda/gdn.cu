// Fused Gated DeltaNet core (D4d): causal conv update + SiLU, l2norm of q and k, gates, the f32
// delta-rule recurrence and the gated RMSNorm, one CTA per value head for all T tokens. The value
// heads that share a key head form one thread-block cluster, so the shared q/k conv state is
// rewritten only after every CTA of the cluster has read it.
#include <cooperative_groups.h>

#include <utility>

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
  L2Prefetch pf;   // D13: the next launch's weights
  unsigned long long* tr;   // investigation aid (decode kernel): trace stamps, null = off
  int late;                 // pdl_late_mask() & kLateGdn (decode kernel): trigger after the state update
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
  l2_prefetch(g.pf);
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

// ---- D12: decode step (T == 1) over dv/32 CTAs per value head ---------------------------------
// One CTA of 8 warps owns 32 value columns (one per lane) of one head: its 128×32 slice of S sits in
// registers (warp w holds rows w, w+8, ..., 16 per thread), so S is read by 4× more SMs than with
// one CTA per head. Every CTA recomputes the conv + SiLU + l2norm of the head's full q and k (288
// channels, cheap) and its own 32 v channels. The gated RMSNorm needs Σo² over the whole head: the
// CTAs of a head exchange their partial sums through distributed shared memory. A cluster is the
// ratio·(dv/32) = 8 CTAs sharing one key head, so the shared q/k conv state is rewritten (spread
// over the cluster's CTAs) only after every CTA has read it. Mutable state is only prefetched into
// L2 before the PDL wait (L2 is coherent, so that is safe); registers are filled after it.
constexpr int kGdnDecDk = 128;                 // key head dim: 8 warps × 16 rows
constexpr int kGdnDecRows = kGdnDecDk / 8;     // state rows per thread
constexpr int kGdnDecCh = 2 * kGdnDecDk + 32;  // conv channels per CTA: q | k | v slice

// PUSH (D42): warp 0 writes its partial Σo² into each of the head's CTAs (distributed shared memory)
// before the cluster barrier, so after it every CTA reads its head's partial sums locally and can leave
// without the second cluster barrier (off: each CTA reads its siblings' sums after the barrier, and a
// final barrier keeps every CTA alive until they have). Same sums in the same order either way.
// SLATE (D45): S is written back after the cluster barrier (see there).
// ES (D55): the thread's 16 state values and its conv state rows are loaded into registers before the PDL
// wait (instead of prefetched into L2 there and loaded after it). Both were last written by this layer's
// kernel in an earlier step, which has completed by then: a replayed graph starts after the previous
// replay, and in a stream a kernel launches only once all of its predecessor's CTAs have triggered, a
// chain that the persistent MoE (it triggers after its own wait) cuts within every layer.
// MB (D60, with PUSH and SLATE): the partial Σo² go to all the cluster's CTAs by st.async, each completing 4 bytes
// on the receiver's mbarrier, and each CTA waits for its own 8 arrivals instead of passing a cluster barrier.
// Receiving all of them also tells a CTA that every CTA of the cluster has read the old conv state (each push
// is computed from it), which is what the barrier ordered before the conv state is rewritten. The mbarriers are
// initialised before the PDL wait and published by a split cluster barrier: its arrive there, its wait right
// before the pushes (long satisfied by then; a whole cluster.sync before the wait cost 0.75 µs, session 19).
template <bool PUSH, bool SLATE, bool ES = false, bool MB = false>
__global__ void __launch_bounds__(256) gdn_decode_kernel(const __grid_constant__ GdnArgs g) {
  static_assert(!MB || (PUSH && SLATE), "D60: on D42 and D45");
  __shared__ float raw[4][kGdnDecCh];   // conv taps: state rows 0..2, current input
  __shared__ float act[kGdnDecCh];      // conv + SiLU output
  __shared__ float red[8];
  __shared__ float part[8][32], part2[8][32];
  __shared__ float ssq;
  __shared__ float ssq_all[8];   // PUSH: the head's partial Σo², slot q from its CTA q (MB: slot = cluster rank)
  __shared__ alignas(8) uint64_t sbar;   // MB: the pushes' mbarrier
  const GdnDims& d = g.d;
  constexpr int dk = kGdnDecDk;
  const int P = d.dv / 32, ratio = d.nv / d.nk;
  const int j = blockIdx.x / P, p = blockIdx.x % P, kh = j / ratio;
  const int key_dim = d.nk * dk;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, col = p * 32 + lane;
  auto chan = [&](int i) {
    return i < dk ? kh * dk + i : i < 2 * dk ? key_dim + kh * dk + (i - dk) : 2 * key_dim + j * d.dv + p * 32 + (i - 2 * dk);
  };
  float* S = g.S + int64_t(j) * dk * d.dv;
  trace_stamp(g.tr, 0);
  if (!g.late) pdl_trigger();
  l2_prefetch(g.pf);
  float sv[kGdnDecRows];
  float cst[2][3];   // ES: the conv state rows of channels tid and tid + 256
  if constexpr (ES) {
#pragma unroll
    for (int i = 0; i < kGdnDecRows; ++i) sv[i] = S[(warp + 8 * i) * d.dv + col];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int i = tid + 256 * u;
#pragma unroll
      for (int st = 0; st < 3; ++st) cst[u][st] = i < kGdnDecCh ? g.conv_state[int64_t(st) * d.conv_dim + chan(i)] : 0.f;
    }
  } else {
    if (lane < kGdnDecRows) {
      const float* line = S + (warp + 8 * lane) * d.dv + p * 32;   // one 128-byte line per row
      asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
    }
    if (tid < kGdnDecCh / 32)
      for (int st = 0; st < 3; ++st) {
        const float* line = g.conv_state + int64_t(st) * d.conv_dim + chan(tid * 32);
        asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
      }
  }
  float cw[2][4];   // conv weights of channels tid and tid + 256 (immutable: loaded before the wait)
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int i = tid + 256 * u;
#pragma unroll
    for (int tap = 0; tap < 4; ++tap) cw[u][tap] = i < kGdnDecCh ? g.conv_w[int64_t(chan(i)) * 4 + tap] : 0.f;
  }
  const float A = -__expf(g.A_log[j]), dtb = g.dt_bias[j], nw = g.norm_w[col];
  if constexpr (MB) {
    if (tid == 0) {
      mbar_init(&sbar, 1);
      mbar_expect_tx(&sbar, uint32_t(cg::this_cluster().num_blocks()) * 4);   // the one arrival, 4 bytes per CTA
    }
    // Relaxed: a release here would wait for the state loads above (D55); fence.mbarrier_init orders the init.
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");   // waited for before the pushes
  }
  pdl_wait();
  trace_stamp(g.tr, 1);
  if constexpr (!ES)
#pragma unroll
    for (int i = 0; i < kGdnDecRows; ++i) sv[i] = S[(warp + 8 * i) * d.dv + col];
  const float zv = g.z[j * d.dv + col];
  const float av = g.a[j] + dtb, bv = g.b[j];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int i = tid + 256 * u;
    if (i < kGdnDecCh) {
      const int ch = chan(i);
      float r[4];
#pragma unroll
      for (int st = 0; st < 3; ++st) r[st] = ES ? cst[u][st] : g.conv_state[int64_t(st) * d.conv_dim + ch];
      r[3] = g.qkv[ch];
      float acc = 0.f;
#pragma unroll
      for (int tap = 0; tap < 4; ++tap) {
        acc = fmaf(cw[u][tap], r[tap], acc);
        raw[tap][i] = r[tap];
      }
      act[i] = siluf_(acc);
    }
  }
  __syncthreads();
  trace_stamp(g.tr, 2);
  {  // l2 norms: warps 0-3 sum q², warps 4-7 sum k²
    const float v = act[(warp < 4 ? 0 : dk) + 32 * (warp & 3) + lane];
    const float s2 = warp_sum(v * v);
    if (lane == 0) red[warp] = s2;
  }
  __syncthreads();
  trace_stamp(g.tr, 4);
  const float nq = rsqrtf(red[0] + red[1] + red[2] + red[3] + 1e-6f) * rsqrtf(float(dk));
  const float nkk = rsqrtf(red[4] + red[5] + red[6] + red[7] + 1e-6f);
  const float sp = av > 20.f ? av : log1pf(__expf(av));
  const float alpha = __expf(A * sp);
  const float beta = sigmoidf_(bv);
  const float* qs = act;
  const float* ks = act + dk;
  // m = Sᵀk̂ (decay applied after, it is a scalar), δ = β (v − α m).
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < kGdnDecRows; ++i) m = fmaf(sv[i], ks[warp + 8 * i], m);
  part[warp][lane] = m * nkk;
  __syncthreads();
  trace_stamp(g.tr, 5);
  m = 0.f;
#pragma unroll
  for (int w = 0; w < 8; ++w) m += part[w][lane];
  const float delta = beta * (act[2 * dk + lane] - alpha * m);
  // S ← α S + k̂ δᵀ, o = Sᵀ q̂.
  const float kd = nkk * delta;
  float o = 0.f;
#pragma unroll
  for (int i = 0; i < kGdnDecRows; ++i) {
    sv[i] = fmaf(alpha, sv[i], ks[warp + 8 * i] * kd);
    o = fmaf(sv[i], qs[warp + 8 * i], o);
  }
  part2[warp][lane] = o * nq;
  if constexpr (!SLATE)
#pragma unroll
    for (int i = 0; i < kGdnDecRows; ++i) S[(warp + 8 * i) * d.dv + col] = sv[i];
  __syncthreads();
  trace_stamp(g.tr, 6);
  if (g.late) pdl_trigger();
  o = 0.f;
#pragma unroll
  for (int w = 0; w < 8; ++w) o += part2[w][lane];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank()), nrank = ratio * P, head0 = (rank / P) * P;
  if constexpr (MB) asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");   // every mbarrier initialised
  if (warp == 0) {
    const float s2 = warp_sum(o * o);
    if constexpr (MB) {
      if (lane < nrank) {
        uint32_t ra, rb;
        asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(smem_addr(ssq_all + rank)), "r"(lane));
        asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rb) : "r"(smem_addr(&sbar)), "r"(lane));
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(ra),
                     "r"(__float_as_uint(s2)), "r"(rb)
                     : "memory");
      }
    } else if constexpr (PUSH) {
      if (lane < P) cluster.map_shared_rank(ssq_all, head0 + lane)[rank - head0] = s2;
    } else {
      if (lane == 0) ssq = s2;
    }
  }
  // Without D60: the barrier's release waits for this thread's earlier stores to be performed; with D45 the 16 KB
  // of S per CTA are written after it, so that it waits for no global store (only the Σo² pushes and the conv reads).
  if constexpr (MB) mbar_wait_parity(&sbar, 0);   // D60: the cluster's pushes have all landed here
  else cluster.sync();   // partial Σo² visible cluster-wide; every CTA has read the old conv state
  trace_stamp(g.tr, 7);
  if constexpr (SLATE)
#pragma unroll
    for (int i = 0; i < kGdnDecRows; ++i) S[(warp + 8 * i) * d.dv + col] = sv[i];
  if (warp == 0) {
    float tot = 0.f;
    for (int q = 0; q < P; ++q) tot += MB ? ssq_all[head0 + q] : PUSH ? ssq_all[q] : *cluster.map_shared_rank(&ssq, head0 + q);
    g.y[j * d.dv + col] = o * rsqrtf(tot / float(d.dv) + d.eps) * nw * siluf_(zv);
  }
  trace_stamp(g.tr, 8);
  // New conv state = the last 3 raw inputs: shared q/k channels spread over the cluster's CTAs in
  // 32-channel pieces, this CTA's own v channels by itself.
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int i = tid + 256 * u;
    if (i < kGdnDecCh && (i >= 2 * dk || (i / 32) % nrank == rank))
      for (int st = 0; st < 3; ++st) g.conv_state[int64_t(st) * d.conv_dim + chan(i)] = raw[st + 1][i];
  }
  trace_stamp(g.tr, 9);
  if constexpr (!PUSH) cluster.sync();   // no CTA leaves while a sibling may still read its ssq
  trace_stamp(g.tr, 3);
}

}  // namespace

unsigned long long*& gdn_trace_next() {
  static unsigned long long* p = nullptr;
  return p;
}

bool& gdn_split_enabled() {
  static bool on = true;
  return on;
}

bool& gdn_s_late_enabled() {
  static bool on = true;
  return on;
}

bool& gdn_early_state_enabled() {
  static bool on = true;
  return on;
}

bool& gdn_mbar_enabled() {
  static bool on = true;
  return on;
}

bool& gdn_push_enabled() {
  static bool on = true;
  return on;
}

void gdn(const GdnDims& d, const float* conv_w, const float* A_log, const float* dt_bias,
         const float* norm_w, float* conv_state, float* S, const float* qkv, const float* z,
         const float* a, const float* b, int T, float* y, cudaStream_t s, const L2Prefetch* pf) {
  const int ratio = d.nv / d.nk;
  LILY_CHECK(d.nv % d.nk == 0 && ratio <= 8, "gdn: value heads must be a multiple (<= 8x) of key heads");
  LILY_CHECK(d.kconv >= 1 && d.dv <= 512, "gdn: unsupported conv kernel or value head size");
  int rq = 1;
  while (rq * 2 * d.dv <= 512 && d.dk % (rq * 2) == 0) rq *= 2;
  GdnArgs g{d, conv_w, A_log, dt_bias, norm_w, conv_state, S, qkv, z, a, b, T, rq, y, pf ? *pf : L2Prefetch{},
            std::exchange(gdn_trace_next(), nullptr), (pdl_late_mask() & kLateGdn) ? 1 : 0};
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
  if (gdn_split_enabled() && T == 1 && d.dk == kGdnDecDk && d.dv % 32 == 0 && ratio * (d.dv / 32) <= 8 &&
      d.kconv == 4) {   // D12
    cfg.gridDim = dim3(d.nv * (d.dv / 32));
    cfg.blockDim = dim3(256);
    cfg.dynamicSmemBytes = 0;
    attr[0].val.clusterDim.x = ratio * (d.dv / 32);
    // D42 (PUSH), D45 (SLATE), D55 (ES), D60 (MB): the instances that the switches' combinations select.
    const bool push = gdn_push_enabled(), late = gdn_s_late_enabled();
    auto kern = push ? (late ? gdn_decode_kernel<true, true> : gdn_decode_kernel<true, false>)
                     : (late ? gdn_decode_kernel<false, true> : gdn_decode_kernel<false, false>);
    if (push && late && gdn_early_state_enabled())
      kern = gdn_mbar_enabled() ? gdn_decode_kernel<true, true, true, true> : gdn_decode_kernel<true, true, true>;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, g));
    return;
  }
  if (d.dk / rq == 32) CUDA_CHECK(cudaLaunchKernelEx(&cfg, gdn_kernel<32>, g));
  else CUDA_CHECK(cudaLaunchKernelEx(&cfg, gdn_kernel<0>, g));
}

}  // namespace lily::cuda
