// MoE block for a prefill chunk of T tokens (MODEL.md §2.4) on the grouped tensor-core GEMM:
// x -> GEMM operands once (fp16 with a row scale for the experts, bf16 hi/lo for the 8-bit router);
// router logits and the shared-expert gate logit by the GEMM (8-bit weights);
// per token softmax over all experts in f32, top-k, renormalised (warp per token, ties to the lower
// id as on the CPU); then, without any host synchronisation (P2): per-expert counts, one block that
// scans them into row offsets and a list of fixed-size M-tiles (the shared expert is group E,
// visited by every token), a scatter of the T·K (token, slot) rows into expert order; grouped
// gate+up GEMM with SwiGLU in the epilogue writing fp16 activations (an exponent per row and 64
// columns) or bf16 ones in the next GEMM's k-order,
// grouped down GEMM writing w_k·down_k (shared: σ(gate)·down) to one f32 row per (token, slot), and
// a gather-reduce per token in a fixed order, so results do not depend on scheduling.
// The grouped GEMMs are launched for the worst-case tile count; surplus CTAs exit at once.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <vector>

#include <cuda_fp16.h>

#include "backend/cuda/gemm.h"

namespace lily::cuda {

namespace {

// Workspace sections (byte offsets, 256-aligned); tile list sized for the smallest M-tile.
struct Layout {
  int64_t xb, rs, xh, xl, logits, sg, ids, wts, rank, ctl, tiles, tiles2, row_tok, row_dst, row_w, act, aexp, slot, total;
  int max_tiles32;
};

int max_tiles(const MoeDev& m, int T, int bm) {
  const int64_t routed = int64_t(T) * m.K, busy = std::min<int64_t>(m.E, routed);
  return int((routed + busy * (bm - 1)) / bm + (T + bm - 1) / bm);
}

Layout layout(const MoeDev& m, int T) {
  Layout l{};
  int64_t o = 0;
  auto take = [&](int64_t bytes) {
    const int64_t at = o;
    o += (bytes + 255) / 256 * 256;
    return at;
  };
  const int64_t R = int64_t(T) * m.K + T;   // routed rows + shared-expert rows
  l.max_tiles32 = max_tiles(m, T, 32);
  l.xb = take(int64_t(T) * m.H * 2);
  l.rs = take(int64_t(T) * 4);
  l.xh = take(int64_t(T) * m.H * 2);
  l.xl = take(int64_t(T) * m.H * 2);
  l.logits = take(int64_t(T) * m.E * 4 * kRouterMaxSplit);   // P37: one slice per K split
  l.sg = take(int64_t(T) * 4);
  l.ids = take(int64_t(T) * m.K * 4);
  l.wts = take(int64_t(T) * m.K * 4);
  l.rank = take(int64_t(T) * m.K * 4);   // P71
  l.ctl = take(4 * (3 * int64_t(m.E + 1) + 2));   // counts, offsets, fill [E+1], n_tiles, n_tiles2
  l.tiles = take(int64_t(l.max_tiles32) * 16);
  l.tiles2 = take(int64_t(l.max_tiles32) * 16);   // the down GEMM's own tile list (its M-tile differs)
  l.row_tok = take(R * 4);
  l.row_dst = take(R * 4);
  l.row_w = take(R * 4);
  l.act = take(R * m.I * 2);
  l.aexp = take(R * (m.I / 64));
  l.slot = take(R * m.H * 4);
  l.total = o;
  return l;
}

// Warp per token: softmax over E logits (f32), top-K by probability (lowest id on ties),
// renormalised weights; per-expert counts for the grouping. nz > 1 (P37): the logits are the sum of nz
// partial slices zstride apart, added in slice order. RANK (P71): each (token, k)'s arrival at its expert's count
// (the atomic's old value) goes to rank, so that the scatter places the row without an atomic of its own.
// BATCH (P72, NJ == 8): every slice's loads issued before the first add (the runtime slice count otherwise keeps each
// slice's loads behind the previous add); the same adds in the same order.
template <int NJ, bool RANK, bool BATCH = false>
__global__ void moe_topk_kernel(const float* __restrict__ logits, int T, int E, int K, int32_t* __restrict__ ids,
                                float* __restrict__ wts, int* counts, int* hist, int nz, int64_t zstride,
                                int* __restrict__ rank) {
  pdl_trigger();
  pdl_wait();
  const int lane = threadIdx.x & 31, t = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (t >= T) return;
  const float* l = logits + int64_t(t) * E;
  float p[NJ];
  float mx = -FLT_MAX;
  if constexpr (BATCH) {
    static_assert(NJ == 8, "P72: the slices of 256 experts at most in registers");
    float part[kRouterMaxSplit][NJ];
#pragma unroll
    for (int z = 0; z < kRouterMaxSplit; ++z)
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int e = j * 32 + lane;
        part[z][j] = z < nz && e < E ? l[z * zstride + e] : 0.f;
      }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      float v = -FLT_MAX;
      if (j * 32 + lane < E) {
        v = part[0][j];
#pragma unroll
        for (int z = 1; z < kRouterMaxSplit; ++z)
          if (z < nz) v += part[z][j];
      }
      p[j] = v;
      mx = fmaxf(mx, p[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int e = j * 32 + lane;
      float v = -FLT_MAX;
      if (e < E) {
        v = l[e];
        for (int z = 1; z < nz; ++z) v += l[z * zstride + e];
      }
      p[j] = v;
      mx = fmaxf(mx, p[j]);
    }
  }
  mx = warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    p[j] = j * 32 + lane < E ? expf(p[j] - mx) : 0.f;
    sum += p[j];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int j = 0; j < NJ; ++j) p[j] = j * 32 + lane < E ? p[j] / sum : -1.f;
  float top = 0.f, myv = 0.f;
  int myi = 0;
  for (int k = 0; k < K; ++k) {
    float bv = -2.f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      if (p[j] > bv) {
        bv = p[j];
        bi = j * 32 + lane;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
      }
    }
    top += bv;
    if (lane == k) {
      myv = bv;
      myi = bi;
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      if (j * 32 + lane == bi) p[j] = -1.f;
  }
  if (lane < K) {
    ids[int64_t(t) * K + lane] = myi;
    wts[int64_t(t) * K + lane] = myv / top;
    if constexpr (RANK) rank[int64_t(t) * K + lane] = atomicAdd(&counts[myi], 1);
    else atomicAdd(&counts[myi], 1);
    if (hist) atomicAdd(&hist[myi], 1);
  }
}

// One block of 512 threads: exclusive scans of the group sizes (E experts + the shared expert
// with T rows) and of their tile counts; writes row offsets, resets the fill counters, writes the
// tile list and its length.
// P56 (full_first): the full tiles first (in group order), then each group's partial tile by rows, largest first
// (ties by group): the grouped GEMMs' grids run tile-major, so the last wave holds the shortest CTAs instead of the
// shared expert's full tiles (group E, last in group order). Same tiles, same rows per tile: the same bits.
__global__ void __launch_bounds__(512) moe_plan_kernel(const int* counts, int E, int T, int bm, int* offsets,
                                                       int* fill, int4* tiles, int* n_tiles, int full_first) {
  __shared__ int sc[512], st[512], sp[512];
  pdl_trigger();
  pdl_wait();
  const int tid = threadIdx.x;
  const int c = tid < E ? counts[tid] : tid == E ? T : 0;
  const int nt = full_first ? c / bm : (c + bm - 1) / bm;   // P56: full tiles only in this scan
  const int part = c % bm;                                   // P56: the partial tile's rows (0: none)
  sc[tid] = c;
  st[tid] = nt;
  sp[tid] = full_first ? part : 0;
  for (int off = 1; off < 512; off <<= 1) {
    __syncthreads();
    const int x = tid >= off ? sc[tid - off] : 0, y = tid >= off ? st[tid - off] : 0;
    __syncthreads();
    sc[tid] += x;
    st[tid] += y;
  }
  __syncthreads();
  if (tid <= E) {
    const int off = sc[tid] - c, toff = st[tid] - nt;
    offsets[tid] = off;
    fill[tid] = 0;
    for (int i = 0; i < nt; ++i) tiles[toff + i] = make_int4(tid, off + i * bm, min(bm, c - i * bm), 0);
    if (full_first && part > 0) {
      int rank = 0;   // partial tiles before this one: more rows, or as many rows and a lower group
      for (int e = 0; e <= E; ++e) {
        const int p = sp[e];
        rank += p > part || (p == part && e < tid);
      }
      tiles[st[511] + rank] = make_int4(tid, off + nt * bm, part, 0);
    }
  }
  int np = 0;   // partial tiles (P56)
  if (full_first) np = __syncthreads_count(tid <= E && part > 0);
  if (tid == 0) *n_tiles = st[511] + np;
}

// Rows in group order: routed (t, k) at offsets[e] + arrival, shared-expert rows at T·K + t. RANK (P71): the arrival
// is the top-k kernel's (rank), not an atomic on fill here.
template <bool RANK>
__global__ void moe_scatter_kernel(const int32_t* __restrict__ ids, const float* __restrict__ wts,
                                   const float* __restrict__ sg, int T, int K, const int* offsets, int* fill,
                                   const int* __restrict__ rank, int* __restrict__ row_tok, int* __restrict__ row_dst,
                                   float* __restrict__ row_w) {
  pdl_trigger();
  pdl_wait();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t routed = int64_t(T) * K;
  if (i < routed) {
    const int e = ids[i];
    const int pos = offsets[e] + (RANK ? rank[i] : atomicAdd(&fill[e], 1));
    row_tok[pos] = int(i / K);
    row_dst[pos] = int(i);
    row_w[pos] = wts[i];
  } else if (i < routed + T) {
    const int t = int(i - routed);
    row_tok[i] = t;
    row_dst[i] = int(i);
    row_w[i] = sigmoidf_(sg[t]);
  }
}

// out[t] = shared row + Σ_k routed rows, in this fixed order (slot_sum4). The slot rows are f32 or (P16) fp16.
template <typename S>
__global__ void moe_combine_kernel(const S* __restrict__ slot, int T, int K, int H4, float4* __restrict__ out) {
  pdl_trigger();
  pdl_wait();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(T) * H4) return;
  out[i] = slot_sum4(slot, T, K, H4, i / H4, i % H4);
}
bool g_last_slot16 = false;

// Ablation P2 off: the same plan built on the host from the device's top-k.
void host_plan(const MoeDev& m, int T, int bm, char* w, const Layout& l, cudaStream_t s) {
  const int64_t routed = int64_t(T) * m.K, R = routed + T;
  std::vector<int32_t> ids(routed);
  std::vector<float> wts(routed), sg(T);
  CUDA_CHECK(cudaMemcpyAsync(ids.data(), w + l.ids, routed * 4, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaMemcpyAsync(wts.data(), w + l.wts, routed * 4, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaMemcpyAsync(sg.data(), w + l.sg, T * 4, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<int> start(m.E + 2, 0);
  for (int64_t i = 0; i < routed; ++i) ++start[ids[i] + 1];
  for (int e = 0; e < m.E; ++e) start[e + 1] += start[e];
  std::vector<int4> tiles;
  for (int e = 0; e <= m.E; ++e) {
    const int c = e < m.E ? start[e + 1] - start[e] : T, off = e < m.E ? start[e] : int(routed);
    for (int i = 0; i * bm < c; ++i) tiles.push_back(make_int4(e, off + i * bm, std::min(bm, c - i * bm), 0));
  }
  std::vector<int> row_tok(R), row_dst(R);
  std::vector<float> row_w(R);
  std::vector<int> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < routed; ++i) {
    const int pos = fill[ids[i]]++;
    row_tok[pos] = int(i / m.K);
    row_dst[pos] = int(i);
    row_w[pos] = wts[i];
  }
  for (int t = 0; t < T; ++t) {
    row_tok[routed + t] = t;
    row_dst[routed + t] = int(routed + t);
    row_w[routed + t] = 1.f / (1.f + std::exp(-sg[t]));
  }
  const int n = int(tiles.size());
  int* ctl = reinterpret_cast<int*>(w + l.ctl);
  CUDA_CHECK(cudaMemcpyAsync(w + l.tiles, tiles.data(), int64_t(n) * 16, cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaMemcpyAsync(ctl + 3 * (m.E + 1), &n, 4, cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaMemcpyAsync(w + l.row_tok, row_tok.data(), R * 4, cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaMemcpyAsync(w + l.row_dst, row_dst.data(), R * 4, cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaMemcpyAsync(w + l.row_w, row_w.data(), R * 4, cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaStreamSynchronize(s));   // host vectors die here
}

bool q4g(const QMat& w) { return w.type == kQ4 && gemm_ok(w); }

}  // namespace

bool moe_prefill_ok(const MoeDev& m) {
  return gemm_ok(m.router) && gemm_ok(m.shared_gate) && q4g(m.gate0) && q4g(m.up0) && q4g(m.down0) &&
         q4g(m.sh_gate) && q4g(m.sh_up) && q4g(m.sh_down) && m.I == m.Is && m.E % 32 == 0 && m.E + 1 <= 512 && m.I <= 1024 &&
         m.K <= 32 && m.K <= m.E && m.gate_stride == m.up_stride && m.gate_sb_stride == m.up_sb_stride &&
         m.gate0.rows == m.I && m.down0.cols == m.I && m.down0.rows == m.H && m.gate0.cols == m.H;
}

// P3 (default on; --ablate P3): the expert M-tile chosen per chunk from the rows per expert (the rule below, then
// P17 / P40 / P53 / P55's choices in moe_prefill); off: M-tile 64 for both expert GEMMs at every prompt length (what
// LILY_MOE_TILE=64 forces). The workspace's tile lists are sized for M-tile 32, so any tile fits.
bool g_p3 = true;
void moe_prefill_set_p3(bool on) { g_p3 = on; }

int moe_prefill_tile(const MoeDev& m, int T) {
  const char* v = std::getenv("LILY_MOE_TILE");
  const int forced = v && *v ? std::atoi(v) : 0;
  if (forced == 32 || forced == 64 || forced == 128) return forced;
  if (!g_p3) return 64;
  // Expected rows per expert; a tile much larger than that is mostly padding, a much smaller one
  // re-reads the expert's weights once per tile.
  const double rows = double(T) * m.K / m.E;
  return rows >= 160 ? 128 : rows >= 24 ? 64 : 32;
}

bool g_p40 = true;
void moe_prefill_set_p40(bool on) { g_p40 = on; }
// The expected rows per expert from which the gate/up GEMM takes M-tile 128: 8 with P40 (T >= 256; tuning aid:
// LILY_P40_ROWS, read per call; session 21 call 2: 8 gave +9.6 % at 256 over 16; from 512 tokens 4, 8 and 16
// all choose M-tile 128), 128 without.
// A positive number from the environment variable `name` (read per call), else `def`.
static double env_rows(const char* name, double def) {
  const char* v = std::getenv(name);
  const double r = v && *v ? std::atof(v) : 0;
  return r > 0 ? r : def;
}
static double p40_rows() { return g_p40 ? env_rows("LILY_P40_ROWS", 8) : 128; }

// P55: the expected rows per expert from which the down GEMM takes M-tile 128 on its resident-activation kernel
// (LILY_P55_ROWS, read per call). Session 25: at 512 tokens (16 rows) -2.8 % with 2 weight blocks per CTA (call 2),
// +3.0 % with 4 (call 5); at 768 +3.0 % (call 5); at 1K (32 rows) +0.8 % with 2, +2.2 % with 4 (call 2). Below 16
// rows the gate/up GEMM keeps M-tile 32 (P53), and P55 needs the M-tile 128 list.
static double p55_rows() { return env_rows("LILY_P55_ROWS", 16); }

// P56: from LILY_P56_MIN_ROWS (default 16) to below LILY_P56_ROWS (default 96) expected rows per expert the tile
// lists put their full tiles first (both read per call). Session 25 call 3: +3.6 % at 1K (32 rows), +1.5 % at 2K (64),
// -1.0 % at 4K (128: the gate/up GEMM 15.82 vs 15.19 ms, an expert's partial tile no longer next to its full one, so
// its weights are read again from DRAM); call 4: +2.2 % at 1K, +0.1 % at 2K, -0.4 % at 512 (16 rows) without P55;
// call 5, with P55 taken at 512: +4.1 % at 512, +1.6 % at 768.
static bool p56_takes(double rows) {
  const char* vm = std::getenv("LILY_P56_MIN_ROWS");   // may be 0
  const double lo = vm && *vm ? std::atof(vm) : 16;
  return rows >= lo && rows < env_rows("LILY_P56_ROWS", 96);
}

// P53: the expected rows per expert below which the gate/up GEMM keeps M-tile 32 (LILY_P53_ROWS, read per call).
static double p53_rows() { return env_rows("LILY_P53_ROWS", 16); }

bool moe_prefill_p17(const MoeDev& m, bool f16) {
  const int wg = gemm_moe_wg();
  return f16 && gemm_moe_p17() && (wg == 2 || wg == 3) && m.H % 128 == 0 && m.I % 128 == 0;
}

int64_t moe_prefill_workspace_bytes(const MoeDev& m, int T) { return layout(m, T).total; }

// P37 (default on since session 25: +2.1 to +5.8 % at 128-768 tokens): the router GEMM (E = 256 rows: 2 N tiles) with
// K in 4 slices, the top-k kernel adding them. From T >= 2,048 at M-tile 128 (256 CTAs at T = 4,096 instead of 256 at
// M-tile 32; session 18: 2.12 vs 2.34 ms per 4K prefill, end to end +-0.0 %); below, at M-tile 32, where unsplit it runs T / 32 x 2 CTAs (16 at 256 tokens: 1.28 of
// a 256-token prefill's 20 ms in session 24). LILY_ROUTER_SPLIT / LILY_ROUTER_BM override (tuning aids).
RouterSplit router_split(const MoeDev& m, int T, bool on) {
  RouterSplit r;
  if (!on) return r;
  static const int fk = [] { const char* v = std::getenv("LILY_ROUTER_SPLIT"); return v && *v ? std::atoi(v) : 0; }();
  static const int fb = [] { const char* v = std::getenv("LILY_ROUTER_BM"); return v && *v ? std::atoi(v) : 0; }();
  int k = fk > 0 ? fk : 4;
  k = std::min(k, kRouterMaxSplit);
  while (k > 1 && m.H % (512 * k) != 0) --k;
  if (k <= 1) return r;
  r.k = k;
  r.bm = fb == 32 || fb == 64 || fb == 128 ? fb : T >= 2048 ? 128 : 32;
  return r;
}

// P68: the fewest K slices (1, 2, 4, 8) that give the P13 kernel's 128-token tiles at least 3/4 of the SMs as work
// units (T = 4,096: 32 tiles x 4), else 8; each slice whole 64-column steps.
int router16_split(const MoeDev& m, int T) {
  const int nk = m.H / 64, tiles = ((T + 127) / 128) * ((m.E + 255) / 256);
  const int sms = sm_count();
  const int f = int(env_rows("LILY_ROUTER16_SPLIT", 0));
  int k = 1;
  if (f > 0) {
    k = f;
  } else {
    while (k < kRouterMaxSplit && tiles * k < sms * 3 / 4) k *= 2;
  }
  k = std::min(k, kRouterMaxSplit);
  while (k > 1 && nk % k != 0) --k;
  return k;
}

const int32_t* moe_prefill_ids(const MoeDev& m, int T, const void* work) {
  return reinterpret_cast<const int32_t*>(static_cast<const char*>(work) + layout(m, T).ids);
}

bool moe_prefill_last_slot16() { return g_last_slot16; }

MoeSlots moe_prefill_slots(const MoeDev& m, int T, const void* work) {
  MoeSlots sl;
  sl.p = static_cast<const char*>(work) + layout(m, T).slot;
  sl.f16 = g_last_slot16;
  sl.T = T;
  sl.K = m.K;
  return sl;
}

void moe_prefill_combine(const MoeSlots& sl, int H, float* out, cudaStream_t s) {
  const int64_t n = int64_t(sl.T) * (H / 4);
  const dim3 g(unsigned((n + 255) / 256)), b(256);
  if (sl.f16)
    launch(moe_combine_kernel<uint2>, g, b, 0, s, static_cast<const uint2*>(sl.p), sl.T, sl.K, H / 4,
           reinterpret_cast<float4*>(out));
  else
    launch(moe_combine_kernel<float4>, g, b, 0, s, static_cast<const float4*>(sl.p), sl.T, sl.K, H / 4,
           reinterpret_cast<float4*>(out));
  CUDA_LAUNCH_CHECK();
}

void moe_prefill(const MoeDev& m, const float* x, int T, float* out, void* work, const MoePrefillOpts& o,
                 cudaStream_t s) {
  LILY_CHECK(moe_prefill_ok(m), "moe_prefill: unsupported weights");
  const Layout l = layout(m, T);
  char* w = static_cast<char*>(work);
  const bool f16 = gemm_f16();
  // P19: the one-row shared-expert gate rides on the conversion's read of x (same f32 dot as the GEMV).
  const bool sg_fused = o.sg_in_convert && m.shared_gate.rows == 1 && m.shared_gate.cols == m.H;
  // P68: the router GEMM on the experts' fp16 operand and the router's fp16 copy; then no 8-bit GEMM here reads the
  // split operands (the shared gate is in the conversion, or a GEMV on x), and they are not written.
  const bool r16 = m.router16 && f16;
  GemmA xa;   // experts: xa.a (+ rs); router and shared gate (8-bit): bf16 hi/lo
  xa.f16 = f16;
  xa.a = reinterpret_cast<uint16_t*>(w + l.xb);
  xa.rs = f16 ? reinterpret_cast<float*>(w + l.rs) : nullptr;
  xa.hi = f16 && !r16 ? reinterpret_cast<uint16_t*>(w + l.xh) : nullptr;
  xa.lo = r16 ? nullptr : reinterpret_cast<uint16_t*>(w + l.xl);
  int8_t* aexp = reinterpret_cast<int8_t*>(w + l.aexp);
  float* logits = reinterpret_cast<float*>(w + l.logits);
  float* sg = reinterpret_cast<float*>(w + l.sg);
  int32_t* ids = reinterpret_cast<int32_t*>(w + l.ids);
  float* wts = reinterpret_cast<float*>(w + l.wts);
  int* rank = reinterpret_cast<int*>(w + l.rank);
  const bool rk = o.rank_in_topk && !o.host_routing;   // P71
  int* counts = reinterpret_cast<int*>(w + l.ctl);
  int* offsets = counts + (m.E + 1);
  int* fill = offsets + (m.E + 1);
  int* n_tiles = fill + (m.E + 1);
  int4* tiles = reinterpret_cast<int4*>(w + l.tiles);
  int* row_tok = reinterpret_cast<int*>(w + l.row_tok);
  int* row_dst = reinterpret_cast<int*>(w + l.row_dst);
  float* row_w = reinterpret_cast<float*>(w + l.row_w);
  uint16_t* act = reinterpret_cast<uint16_t*>(w + l.act);
  float* slot = reinterpret_cast<float*>(w + l.slot);
  int bm = o.bm ? o.bm : moe_prefill_tile(m, T);
  // The down GEMM may run its own M-tile (device routing only): a second tile list over the same rows,
  // planned after the scatter. P17 (default): from 128 expected rows per expert the gate/up GEMM runs M-tile
  // 128 on the P15 kernel (0.587 vs 0.634 ms at T = 4,096) while the down GEMM keeps the tile of the rule
  // above (its mma.sync kernel at 128: 0.589 vs 0.413 ms). P40 (default): from 16 expected rows, since P38 sizes
  // the wgmmas of a short tile by its rows. LILY_MOE_TILE forces both (unless LILY_MOE_TILE_DOWN forces the down tile).
  int bm_dn = bm;
  if (!o.bm && !o.host_routing) {
    const char* v = std::getenv("LILY_MOE_TILE_DOWN");
    const char* vg = std::getenv("LILY_MOE_TILE");
    if (v && *v) {
      const int f = std::atoi(v);
      if (f == 32 || f == 64 || f == 128) bm_dn = f;
    } else if (!(vg && *vg) && g_p3 && bm < 128 && moe_prefill_p17(m, f16) && double(T) * m.K / m.E >= p40_rows() &&
               !(bm == 32 && gemm_moe_p53() && double(T) * m.K / m.E < p53_rows())) {
      bm = 128;
    }
    if (!(v && *v) && bm == 128 && f16 && gemm_moe_p55() && gemm_moe_wg() == 2 && double(T) * m.K / m.E >= p55_rows())
      bm_dn = 128;   // P55: the same tile list for both GEMMs
  }
  const int mt = max_tiles(m, T, bm);
  const bool split = bm_dn != bm;
  int* n_tiles2 = n_tiles + 1;
  int4* tiles2 = reinterpret_cast<int4*>(w + l.tiles2);
  const int64_t routed = int64_t(T) * m.K;

  // P42: with the shared gate fused, every reader of x here takes the converted operands (the router xh / xl, the
  // experts xa), and the model reads x (its normalised rows) again only after writing it anew.
  float* x_out = o.skip_x && sg_fused ? nullptr : const_cast<float*>(x);
  RouterSplit rsplit = router_split(m, T, o.router_split);
  if (r16) rsplit = {router16_split(m, T), 0};
  if ((o.stages & (1 | 32)) && o.pre_norm.h)   // P25: x = rmsnorm(h) written and converted in one pass
    gemm_rmsnorm_convert(o.pre_norm.h, o.pre_norm.r, o.pre_norm.w, m.H, T, o.pre_norm.eps, x_out, xa, s,
                         sg_fused ? &m.shared_gate : nullptr, sg_fused ? sg : nullptr);
  else if (o.stages & (1 | 32))
    gemm_convert_a(x, T, m.H, xa, s, sg_fused ? &m.shared_gate : nullptr, sg_fused ? sg : nullptr);
  if ((o.stages & (1 | 64)) && r16) gemm_f16_ksplit(xa, T, m.router16, m.E, m.H, logits, rsplit.k, s);
  else if (o.stages & (1 | 64)) gemm(m.router, xa, T, logits, m.E, false, nullptr, rsplit.bm, s, rsplit.k);
  if ((o.stages & (1 | 128)) && !sg_fused) {
    if (gemm_takes(m.shared_gate, T) && xa.lo) {
      gemm(m.shared_gate, xa, T, sg, 1, false, nullptr, 0, s);
    } else {   // one row: the f32 GEMV kernel (gemm_small_n)
      const GemvJob j{m.shared_gate, x, sg};
      gemv_batch(&j, 1, T, true, s);
    }
  }
  if (o.stages & (2 | 256)) {
    CUDA_CHECK(cudaMemsetAsync(counts, 0, 4 * (m.E + 1), s));
    const dim3 gt((T + 7) / 8), bt(256);
    const int64_t zs = int64_t(T) * m.E;
    using TopK = void (*)(const float*, int, int, int, int32_t*, float*, int*, int*, int, int64_t, int*);
    const bool batch = o.topk_batch && m.E <= 256;   // P72
    const TopK k = m.E > 256 ? (rk ? moe_topk_kernel<16, true> : moe_topk_kernel<16, false>)
                   : batch   ? (rk ? moe_topk_kernel<8, true, true> : moe_topk_kernel<8, false, true>)
                             : (rk ? moe_topk_kernel<8, true> : moe_topk_kernel<8, false>);
    launch(k, gt, bt, 0, s, logits, T, m.E, m.K, ids, wts, counts, m.hist, rsplit.k, zs, rank);
    CUDA_LAUNCH_CHECK();
  }
  if (o.stages & (2 | 512)) {
    const bool full_first = o.tiles_full_first && p56_takes(double(T) * m.K / m.E);   // P56
    if (o.host_routing) {
      host_plan(m, T, bm, w, l, s);
    } else {
      launch(moe_plan_kernel, dim3(1), dim3(512), 0, s, counts, m.E, T, bm, offsets, fill, tiles, n_tiles,
             full_first ? 1 : 0);
      CUDA_LAUNCH_CHECK();
      const int64_t R = routed + T;
      launch(rk ? moe_scatter_kernel<true> : moe_scatter_kernel<false>, dim3(unsigned((R + 255) / 256)), dim3(256), 0, s,
             ids, wts, sg, T, m.K, offsets, fill, static_cast<const int*>(rank), row_tok, row_dst, row_w);
      CUDA_LAUNCH_CHECK();
      if (split) {   // same offsets; resets fill, which the scatter is done with
        launch(moe_plan_kernel, dim3(1), dim3(512), 0, s, counts, m.E, T, bm_dn, offsets, fill, tiles2, n_tiles2,
               full_first ? 1 : 0);
        CUDA_LAUNCH_CHECK();
      }
    }
  }
  if (o.stages & 4) {
    GroupedB b;
    b.w[0] = m.gate0;
    b.w[1] = m.up0;
    b.extra[0] = m.sh_gate;
    b.extra[1] = m.sh_up;
    b.stride = m.gate_stride;
    b.sb_stride = m.gate_sb_stride;
    b.n_groups = m.E;
    gemm_grouped_swiglu(b, xa, row_tok, tiles, n_tiles, mt, bm, act, aexp, m.I, s);
  }
  if (o.stages & 8) {
    GroupedB b;
    b.w[0] = m.down0;
    b.extra[0] = m.sh_down;
    b.stride = m.down_stride;
    b.sb_stride = m.down_sb_stride;
    b.n_groups = m.E;
    g_last_slot16 = gemm_grouped_scatter(b, act, aexp, f16, split ? tiles2 : tiles, split ? n_tiles2 : n_tiles,
                                         split ? max_tiles(m, T, bm_dn) : mt, bm_dn, row_dst, row_w, slot, m.H, s,
                                         o.slot16);
  }
  if (o.stages & 16) moe_prefill_combine(moe_prefill_slots(m, T, w), m.H, out, s);
}

}  // namespace lily::cuda
