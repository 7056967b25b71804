// Sparse MoE block for decode: router GEMV, then (D4a) one kernel that picks the top-k experts on
// the device and computes gate·up·SwiGLU for only the selected experts and the shared expert,
// folding the routing weight (or the shared expert's sigmoid gate) into its output, then (D4b)
// one kernel for all down projections summed into the block output.
#include <algorithm>
#include <cfloat>
#include <cstdlib>

#include <cooperative_groups.h>

#include "backend/cuda/cuda_ops.h"

namespace cg = cooperative_groups;

namespace lily::cuda {

namespace {

struct MoeArgs {
  MoeDev m;
  const float* x;          // [T, H]
  const float* logits;     // [T, E]
  const float* sg;         // [T] shared-expert gate logit
  int32_t* ids;            // [T, K]
  float* act;              // [T, K+1, Imax] weighted SwiGLU outputs
  float* out;              // [T, H]
  int imax;
  float* wts;              // [T, K+1] routing weights and σ(shared gate) (D10)
  int topk_ready;          // D10: ids and wts were written by the router kernel
  float* res;              // D9: the down stage also adds out into res
  L2Prefetch pf;           // D13: the next launch's weights (issued by the router stage)
  int pf_down;             // D13: gate/up prefetches the chosen experts' down projections
  int early_down;          // D17: gate/up triggers after its wait; down loads its rows before its wait
  int stage_regs;          // D21: x and the down activations staged from registers
  int flags;               // MoeDecode::flags (D19 experiments)
  int xq16;                // D24: int16 x / activations for the D19 4-bit rows (needs D21)
  int topk_lanes;          // D27: the decode top-k on one warp (select_topk_lanes)
  unsigned long long* trace;   // investigation aid: D19 phase timestamps [CTA][kTracePhases]
  const float* rlog;       // D39: unscaled router logits [E] + shared gate, from the previous launch
  int lean_act;            // D63 (D31 instances): stage_down_act_lean for the down activations
};

// D19 phase timestamp (thread 0 of each CTA; only with a trace buffer).
__device__ __forceinline__ void trace_mark(const MoeArgs& a, int phase) { trace_stamp(a.trace, phase); }

__device__ __forceinline__ const void* stack_ptr(const void* base, int64_t stride, int e, int64_t off);

// D13: once the experts are known, the gate/up CTAs ask L2 for the K+1 down matrices (codes,
// scales, biases) the next kernel will read, one 32 KB bulk prefetch per CTA and piece, so that the
// down kernel's loads hit L2 instead of starting from HBM after its PDL wait.
__device__ __forceinline__ void prefetch_down(const MoeArgs& a, const int* sid) {
  const MoeDev& m = a.m;
  if (!a.pf_down || threadIdx.x != 0) return;
  constexpr int64_t kPiece = 32768;
  const int64_t cb = int64_t(m.H) * m.I / 2, sb = int64_t(m.H) * (m.I / 64) * 2;   // I == Is (fast path)
  const int pc = int((cb + kPiece - 1) / kPiece), ps = int((sb + kPiece - 1) / kPiece), per = pc + 2 * ps;
  for (int k = blockIdx.x; k < (m.K + 1) * per; k += gridDim.x) {
    const int s = k / per, q = k % per;
    const bool sh = s == m.K;
    const QMat& w = sh ? m.sh_down : m.down0;
    const int e = sh ? 0 : sid[s];
    const char* base;
    int64_t off, len;
    if (q < pc) {
      base = static_cast<const char*>(sh ? w.data : stack_ptr(w.data, m.down_stride, e, 0));
      off = int64_t(q) * kPiece;
      len = cb;
    } else {
      const int qq = (q - pc) % ps;
      const void* p = q < pc + ps ? w.scales : w.biases;
      base = static_cast<const char*>(sh ? p : stack_ptr(p, m.down_sb_stride, e, 0));
      off = int64_t(qq) * kPiece;
      len = sb;
    }
    const uint32_t n = uint32_t(min(kPiece, len - off)) & ~15u;
    if (n) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + off), "r"(n) : "memory");
  }
}

// The gate/up kernels' routing: either the router kernel already chose (D10: copy ids/weights),
// or warp 0 runs the top-k itself. Needs a block barrier before sid/sw are read.
__device__ void topk_warp(const float* lg, int E, int K, float* sel, int* sid, float* sw);
__device__ __forceinline__ void routing(const MoeArgs& a, int t, float* sel, int* sid, float* sw) {
  const MoeDev& m = a.m;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (a.topk_ready) {
    if (int(threadIdx.x) < m.K) sid[threadIdx.x] = a.ids[int64_t(t) * m.K + threadIdx.x];
    if (int(threadIdx.x) <= m.K) sw[threadIdx.x] = a.wts[int64_t(t) * (m.K + 1) + threadIdx.x];
    return;
  }
  if (warp == 0) {
    topk_warp(a.logits + int64_t(t) * m.E, m.E, m.K, sel, sid, sw);
    if (lane == 0) sw[m.K] = sigmoidf_(a.sg[t]);
    if (blockIdx.x == 0 && lane < m.K) {
      a.ids[int64_t(t) * m.K + lane] = sid[lane];
      if (m.hist) atomicAdd(&m.hist[sid[lane]], 1);
    }
  }
}

// Top-k of softmax(logits) on warp 0 of the block: selected ids and renormalised weights into smem.
__device__ void topk_warp(const float* lg, int E, int K, float* sel, int* sid, float* sw) {
  const int lane = threadIdx.x & 31;
  for (int e = lane; e < E; e += 32) sel[e] = lg[e];
  __syncwarp();
  float top = 0.f, sum = 0.f;
  for (int k = 0; k < K; ++k) {
    float bv = -FLT_MAX;
    int bi = 0x7fffffff;
    for (int e = lane; e < E; e += 32)
      if (sel[e] > bv) {
        bv = sel[e];
        bi = e;
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
    if (k == 0) top = bv;
    const float p = __expf(bv - top);   // softmax numerator; the full denominator cancels
    sum += p;
    if (lane == 0) {
      sid[k] = bi;
      sw[k] = p;
      sel[bi] = -FLT_MAX;
    }
    __syncwarp();
  }
  if (lane < K) sw[lane] /= sum;
  __syncwarp();
}

__device__ __forceinline__ const void* stack_ptr(const void* base, int64_t stride, int e, int64_t off) {
  return static_cast<const char*>(base) + int64_t(e) * stride + off;
}

// Expert e of a stacked matrix as a QMat view.
__device__ __forceinline__ QMat stack_mat(const QMat& w0, int64_t stride, int64_t sb_stride, int e) {
  QMat q = w0;
  q.data = stack_ptr(w0.data, stride, e, 0);
  if (w0.scales) q.scales = stack_ptr(w0.scales, sb_stride, e, 0);
  if (w0.biases) q.biases = stack_ptr(w0.biases, sb_stride, e, 0);
  return q;
}

// Gate/up row `i` of slot s (s < K: routed expert sid[s]; s == K: shared expert) as a QMat row view.
__device__ __forceinline__ QMat slot_mat(const MoeDev& m, const QMat& w0, const QMat& sh, int64_t stride,
                                         int64_t sb_stride, int s, const int* sid, int K) {
  if (s == K) return sh;
  QMat q = w0;
  q.data = stack_ptr(w0.data, stride, sid[s], 0);
  if (w0.scales) q.scales = stack_ptr(w0.scales, sb_stride, sid[s], 0);
  if (w0.biases) q.biases = stack_ptr(w0.biases, sb_stride, sid[s], 0);
  return q;
}

// grid (blocks, T), 8 warps. FAST: 4-bit rows of H = 1024*CPL with the staged-x dot product.
template <bool FAST, int CPL>
__global__ void __launch_bounds__(256, 2) moe_gate_up_kernel(const __grid_constant__ MoeArgs a) {
  extern __shared__ float4 sm4[];
  __shared__ float sel[1024];
  __shared__ int sid[32];
  __shared__ float sw[33];
  const MoeDev& m = a.m;
  const int t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* x = a.x + int64_t(t) * m.H;
  float* xsum = reinterpret_cast<float*>(sm4 + m.H / 4);
  if (a.early_down) {   // D17: the down kernel starts only once the router's ids are visible
    pdl_wait();
    pdl_trigger();
  } else {
    pdl_trigger();
    pdl_wait();
  }
  routing(a, t, sel, sid, sw);
  // D10: the chosen experts are in global memory already, so the first weight loads can be issued
  // before x is staged (their latency overlaps the staging); otherwise after the barrier.
  const int* sidp = a.topk_ready ? a.ids + int64_t(t) * m.K : sid;
  const int items = m.K * m.I + m.Is;   // (slot, row) pairs
  float* act = a.act + int64_t(t) * (m.K + 1) * a.imax;
  const int nwarps = gridDim.x * 8;
  auto slot_row = [&](int it, int& sl, int& row) {
    sl = it < m.K * m.I ? it / m.I : m.K;
    row = it < m.K * m.I ? it % m.I : it - m.K * m.I;
  };
  if constexpr (FAST) {
    // One (slot, row) pair per warp step: gate and up rows; the next pair's loads are issued
    // before this pair is computed.
    auto load = [&](Q4Rows<CPL, 2>& q, int it) {
      int sl, row;
      slot_row(it, sl, row);
      const QMat g = slot_mat(m, m.gate0, m.sh_gate, m.gate_stride, m.gate_sb_stride, sl, sidp, m.K);
      const QMat p = slot_mat(m, m.up0, m.sh_up, m.up_stride, m.up_sb_stride, sl, sidp, m.K);
      const uint4* rp[2] = {static_cast<const uint4*>(g.data) + int64_t(row) * (m.H / 32),
                            static_cast<const uint4*>(p.data) + int64_t(row) * (m.H / 32)};
      const uint16_t* sp[2] = {static_cast<const uint16_t*>(g.scales) + int64_t(row) * (m.H / 64),
                               static_cast<const uint16_t*>(p.scales) + int64_t(row) * (m.H / 64)};
      const uint16_t* bp[2] = {static_cast<const uint16_t*>(g.biases) + int64_t(row) * (m.H / 64),
                               static_cast<const uint16_t*>(p.biases) + int64_t(row) * (m.H / 64)};
      q.load(rp, sp, bp);
    };
    int it = blockIdx.x * 8 + warp;
    Q4Rows<CPL, 2> cur;
    if (a.topk_ready && it < items) load(cur, it);
    stage_x_q4(x, m.H, sm4, xsum);
    __syncthreads();
    prefetch_down(a, sid);
    if (it >= items) return;
    if (!a.topk_ready) load(cur, it);
    for (; it < items; it += nwarps) {
      Q4Rows<CPL, 2> nxt;
      if (it + nwarps < items) load(nxt, it + nwarps);
      float res[2];
      cur.dot(sm4, xsum, res);
      cur = nxt;
      int sl, row;
      slot_row(it, sl, row);
      if (lane == 0) act[sl * a.imax + row] = sw[sl] * siluf_(res[0]) * res[1];
    }
  } else {
    __syncthreads();
    for (int it = blockIdx.x * 8 + warp; it < items; it += nwarps) {
      int sl, row;
      slot_row(it, sl, row);
      const QMat g = slot_mat(m, m.gate0, m.sh_gate, m.gate_stride, m.gate_sb_stride, sl, sid, m.K);
      const QMat p = slot_mat(m, m.up0, m.sh_up, m.up_stride, m.up_sb_stride, sl, sid, m.K);
      float dg = 0.f, du = 0.f;
      for (int k = lane; k < m.H; k += 32) {
        dg = fmaf(qm_at(g, row, k), x[k], dg);
        du = fmaf(qm_at(p, row, k), x[k], du);
      }
      dg = warp_sum(dg);
      du = warp_sum(du);
      if (lane == 0) act[sl * a.imax + row] = sw[sl] * siluf_(dg) * du;
    }
  }
}

// D4a on tensor cores (D1m): a 16-row mma tile is 8 gate rows (tile rows g) and the matching 8 up
// rows (rows g+8), so lane 4g holds both halves of output row g. KS warps split the H groups of a
// tile; partial sums meet in shared memory.
__global__ void __launch_bounds__(256, 2) moe_gate_up_mma_kernel(const __grid_constant__ MoeArgs a, int KS) {
  extern __shared__ uint4 smx[];
  __shared__ float sel[1024];
  __shared__ int sid[32];
  __shared__ float sw[33];
  __shared__ float red[8][16];
  const MoeDev& m = a.m;
  const int t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const int ng = m.H / 64;
  uint32_t* smB = reinterpret_cast<uint32_t*>(smx);
  float* gsum = reinterpret_cast<float*>(smB + ng * 64);
  float* ginv = gsum + ng;
  if (a.early_down) {   // D17 (see moe_gate_up_kernel)
    pdl_wait();
    pdl_trigger();
  } else {
    pdl_trigger();
    pdl_wait();
  }
  routing(a, t, sel, sid, sw);
  stage_x_mma(a.x + int64_t(t) * m.H, m.H, smB, gsum, ginv);
  __syncthreads();
  float* act = a.act + int64_t(t) * (m.K + 1) * a.imax;
  const int tiles = (m.K * m.I + m.Is) / 8, TPC = 8 / KS, sets = (tiles + TPC - 1) / TPC, gpw = ng / KS;
  auto slot_row = [&](int it, int& sl, int& row) {
    sl = it < m.K * m.I ? it / m.I : m.K;
    row = it < m.K * m.I ? it % m.I : it - m.K * m.I;
  };
  auto emit = [&](int it, float gate, float up) {
    int sl, row;
    slot_row(it, sl, row);
    act[sl * a.imax + row] = sw[sl] * siluf_(gate) * up;
  };
  for (int set = blockIdx.x; set < sets; set += gridDim.x) {
    const int tile = set * TPC + warp / KS, ks = warp % KS;
    float a0 = 0.f, a1 = 0.f;
    if (tile < tiles) {
      int sl, row;
      slot_row(tile * 8 + g, sl, row);
      const QMat gm = slot_mat(m, m.gate0, m.sh_gate, m.gate_stride, m.gate_sb_stride, sl, sid, m.K);
      const QMat um = slot_mat(m, m.up0, m.sh_up, m.up_stride, m.up_sb_stride, sl, sid, m.K);
      mma_q4_rows(static_cast<const uint2*>(gm.data) + int64_t(row) * (m.H / 16),
                  static_cast<const uint2*>(um.data) + int64_t(row) * (m.H / 16),
                  static_cast<const uint16_t*>(gm.scales) + int64_t(row) * ng,
                  static_cast<const uint16_t*>(um.scales) + int64_t(row) * ng,
                  static_cast<const uint16_t*>(gm.biases) + int64_t(row) * ng,
                  static_cast<const uint16_t*>(um.biases) + int64_t(row) * ng, ks * gpw, gpw, smB, gsum, ginv, a0,
                  a1);
    }
    if (KS == 1) {
      if (tq == 0 && tile < tiles) emit(tile * 8 + g, a0, a1);
      continue;
    }
    if (tq == 0) {
      red[warp][g] = a0;
      red[warp][g + 8] = a1;
    }
    __syncthreads();
    if (int(threadIdx.x) < TPC * 8) {
      const int tis = threadIdx.x >> 3, i = threadIdx.x & 7, tl = set * TPC + tis;
      float gv = 0.f, uv = 0.f;
      for (int k = 0; k < KS; ++k) {
        gv += red[tis * KS + k][i];
        uv += red[tis * KS + k][i + 8];
      }
      if (tl < tiles) emit(tl * 8 + i, gv, uv);
    }
    __syncthreads();
  }
}

// The FAST down path (I = Is = 512, K <= 9): output rows h0, h0+1 of a warp; a half-warp reads one
// 256-byte expert row, so a warp covers two slots per step. load() issues every row load (id_of(s):
// routed slot s's expert id), dot() adds the K+1 slots' products into acc (lane-partial sums).
template <int R = 2>
struct DownRowsT {
  uint4 wv[5][R];
  SbReg sc[5][R], bi[5][R];   // D52
  template <typename IdOf>
  __device__ __forceinline__ void load(const MoeDev& m, int h0, IdOf id_of) {
    const int lane = threadIdx.x & 31, half = lane >> 4, c = lane & 15, S = m.K + 1;
#pragma unroll
    for (int q = 0; q < 5; ++q) {
      const int s = 2 * q + half, ss = s < S ? s : 0;
      const bool shared = ss == m.K;
      const int e = shared ? 0 : id_of(ss);
      const QMat w = shared ? m.sh_down : stack_mat(m.down0, m.down_stride, m.down_sb_stride, e);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t row = min(h0 + r, m.H - 1);
        wv[q][r] = __ldcs(static_cast<const uint4*>(w.data) + row * 16 + c);
        sc[q][r] = sb_load(static_cast<const uint16_t*>(w.scales) + row * 8 + (c >> 1));
        bi[q][r] = sb_load(static_cast<const uint16_t*>(w.biases) + row * 8 + (c >> 1));
      }
    }
  }
  __device__ __forceinline__ void dot(const float4* sm4, const float* xsum, int S, float* acc) const {
    const int lane = threadIdx.x & 31, half = lane >> 4, c = lane & 15;
#pragma unroll
    for (int q = 0; q < 5; ++q) {
      const int s = 2 * q + half;
      if (s >= S) continue;
      const float xs = xsum[s * 16 + c];
      float d[R];
#pragma unroll
      for (int r = 0; r < R; ++r) d[r] = 0.f;
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        const float4 xa = sm4[s * 128 + (2 * f) * 16 + c];
        const float4 xb = sm4[s * 128 + (2 * f + 1) * 16 + c];
#pragma unroll
        for (int r = 0; r < R; ++r) d[r] += dot8_q4(word_of(wv[q][r], f), xa, xb);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] = fmaf(sb_val(sc[q][r]), d[r], fmaf(sb_val(bi[q][r]), xs, acc[r]));
    }
  }
  // D24: against the activations as int16 per 32 values (stage_down_act with x16): slot s, chunk c,
  // word f at qx[(s·4 + f)·16 + c], the chunk's step at xd[s·16 + c].
  __device__ __forceinline__ void dot_i16(const uint4* qx, const float* xd, const float* xsum, int S, float* acc) const {
    const int lane = threadIdx.x & 31, half = lane >> 4, c = lane & 15;
#pragma unroll
    for (int q = 0; q < 5; ++q) {
      const int s = 2 * q + half;
      if (s >= S) continue;
      const float xs = xsum[s * 16 + c], dx = xd[s * 16 + c];
      uint4 xq[4];
#pragma unroll
      for (int f = 0; f < 4; ++f) xq[f] = qx[(s * 4 + f) * 16 + c];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        int d = 0;
#pragma unroll
        for (int f = 0; f < 4; ++f) d = dot8_q4_i16(word_of(wv[q][r], f), xq[f], d);
        acc[r] = fmaf(sb_val(sc[q][r]), float(d) * dx, fmaf(sb_val(bi[q][r]), xs, acc[r]));
      }
    }
  }
};
using DownRows = DownRowsT<2>;

// Stages the S slots' activations (512 each, slot s at act + s*imax, read through L2) for
// DownRows::dot: slot s, chunk c (16 per row), float4 f -> [s*128 + f*16 + c], pre-scaled for
// dot8_q4, plus per-chunk sums. slot_scale (shared memory, optional) multiplies slot s's values.
// D21 (`regs`, 256 threads): every load of a round of 5 float4s per thread is issued first (S <= 10
// is one round) instead of one L2 round trip per loop iteration. D24 (`x16`, with regs): the values
// as int16 per 32 (DownRowsT::dot_i16): words in the first S·64 uint4s of sm4, the steps after them.
__device__ __forceinline__ void stage_down_act(const float* act, int S, int imax, float4* sm4, float* xsum,
                                               const float* slot_scale, bool regs = false, bool x16 = false) {
  if (regs) {
    constexpr int kN = 5;
    for (int base = 0; base < S * 128; base += kN * 256) {
      float4 vr[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const int idx = base + int(threadIdx.x) + 256 * k;
        vr[k] = idx < S * 128 ? __ldcg(reinterpret_cast<const float4*>(act + (idx / 128) * imax) + idx % 128)
                              : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const int idx = base + int(threadIdx.x) + 256 * k;
        if (idx >= S * 128) break;   // uniform per warp (multiples of 128)
        const int s = idx / 128, r = idx % 128, cc = r / 8, f = r % 8;
        float4 v = vr[k];
        if (slot_scale) {
          const float sk = slot_scale[s];
          v.x *= sk;
          v.y *= sk;
          v.z *= sk;
          v.w *= sk;
        }
        if (x16)
          q16_stage(v, f, reinterpret_cast<uint4*>(sm4) + s * 64 + cc, 16, xsum + s * 16 + cc,
                    reinterpret_cast<float*>(sm4 + S * 64) + s * 16 + cc);
        else
          sm4[s * 128 + f * 16 + cc] = q4_stage(v, f, xsum + s * 16 + cc);
      }
    }
    return;
  }
  for (int idx = threadIdx.x; idx < S * 128; idx += blockDim.x) {
    const int s = idx / 128, r = idx % 128, cc = r / 8, f = r % 8;
    float4 v = __ldcg(reinterpret_cast<const float4*>(act + s * imax) + r);
    if (slot_scale) {
      const float k = slot_scale[s];
      v.x *= k;
      v.y *= k;
      v.z *= k;
      v.w *= k;
    }
    sm4[s * 128 + f * 16 + cc] = q4_stage(v, f, xsum + s * 16 + cc);
  }
}

// D63: stage_down_act for the D31 instance (256 threads, S slots of 512 values at act + 512 s, int16, every slot
// scaled by slot_scale[s]) in fewer instructions, same bits. Thread t's float4s are act4[t + 256 k] (slot
// (t >> 7) + 2k, position r = t & 127 in it, so its chunk cc = r >> 3 and float4 f = r & 7 are fixed): the addresses
// are one base plus constants, the slot's index needs no signed division, the step's division runs without a branch
// around it, and the chunk's sum and step are stored by all its 8 lanes (they hold the same values).
template <int S>
__device__ __forceinline__ void stage_down_act_lean(const float* act, float4* sm4, float* xsum, const float* slot_scale) {
  constexpr int kN = (S * 128 + 255) / 256;
  const int t = int(threadIdx.x), r = t & 127, s0 = t >> 7, cc = r >> 3, f = r & 7;
  const float4* a4 = reinterpret_cast<const float4*>(act);
  float4 vr[kN];
#pragma unroll
  for (int k = 0; k < kN; ++k)
    vr[k] = t + 256 * k < S * 128 ? __ldcg(a4 + t + 256 * k) : make_float4(0.f, 0.f, 0.f, 0.f);
  uint2* w = reinterpret_cast<uint2*>(reinterpret_cast<uint4*>(sm4) + s0 * 64 + cc + (f >> 1) * 16) + (f & 1);
  float* xd = reinterpret_cast<float*>(sm4 + S * 64);
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    if (t + 256 * k >= S * 128) break;   // uniform per warp (multiples of 128)
    const int sl = s0 + 2 * k;
    float4 v = vr[k];
    const float sk = slot_scale[sl];
    v.x *= sk;
    v.y *= sk;
    v.z *= sk;
    v.w *= sk;
    float sum, m;
    w[k * 2 * 64 * 2] = q16_lean(v, sum, m);   // slot + 2: 128 uint4 = 256 uint2 further
    xsum[sl * 16 + cc] = sum;
    xd[sl * 16 + cc] = m * (1.f / 32767.f);
  }
}

// grid (blocks, T), 8 warps, 2 output rows per warp. FAST (I = Is = 512, K <= 9): a half-warp reads
// one 256-byte expert row, so a warp covers two experts per step; all K+1 rows are loaded before
// the activations are staged.
template <bool FAST>
__global__ void __launch_bounds__(256) moe_down_kernel(const __grid_constant__ MoeArgs a) {
  extern __shared__ float4 sm4[];
  const MoeDev& m = a.m;
  const int t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int S = m.K + 1;
  pdl_trigger();
  // D17: this kernel starts only after every gate/up CTA passed its wait, i.e. after the router
  // (which wrote the ids) completed, so the FAST path reads the ids and issues its weight loads
  // before waiting for the gate/up activations. Otherwise (ids written by gate/up) wait first.
  if (!(FAST && a.early_down)) pdl_wait();
  const int32_t* sid = a.ids + int64_t(t) * m.K;   // read by every thread (L2 hits), no barrier
  const float* act = a.act + int64_t(t) * S * a.imax;
  float* xsum = reinterpret_cast<float*>(sm4 + S * 128);
  const int h0 = (blockIdx.x * 8 + warp) * 2;
  float acc[2] = {0.f, 0.f};
  if constexpr (FAST) {
    DownRows dr;
    dr.load(m, h0, [&](int ss) { return __ldcg(sid + ss); });   // L2: written by another kernel
    if (a.early_down) pdl_wait();   // D17: act comes from the gate/up kernel
    stage_down_act(act, S, a.imax, sm4, xsum, nullptr, a.stage_regs);
    __syncthreads();
    if (h0 >= m.H) return;
    dr.dot(sm4, xsum, S, acc);
  } else {
    if (h0 >= m.H) return;
    for (int s = 0; s < S; ++s) {
      const QMat w = slot_mat(m, m.down0, m.sh_down, m.down_stride, m.down_sb_stride, s, sid, m.K);
      const int I = s == m.K ? m.Is : m.I;
      for (int r = 0; r < 2; ++r) {
        if (h0 + r >= m.H) continue;
        for (int k = lane; k < I; k += 32) acc[r] = fmaf(qm_at(w, h0 + r, k), act[s * a.imax + k], acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float v = warp_sum(acc[r]);
    if (lane == 0 && h0 + r < m.H) {
      a.out[int64_t(t) * m.H + h0 + r] = v;
      if (a.res) a.res[int64_t(t) * m.H + h0 + r] += v;
    }
  }
}

// D4b on tensor cores (D1m), I = Is = 512: one CTA per 16 output rows, warp s computes slot s's
// 8 groups (staging only its own slot's activations, so warps never wait on each other before the
// final reduction).
__global__ void __launch_bounds__(288) moe_down_mma_kernel(const __grid_constant__ MoeArgs a) {
  __shared__ __align__(16) uint32_t smB[9 * 8 * 64];
  __shared__ float gsum[9 * 8], ginv[9 * 8];
  __shared__ float red[9][16];
  const MoeDev& m = a.m;
  const int t = blockIdx.y, lane = threadIdx.x & 31, s = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const int S = m.K + 1, h0 = blockIdx.x * 16;
  pdl_trigger();
  pdl_wait();
  const float* act = a.act + (int64_t(t) * S + s) * a.imax;
  for (int G = 0; G < 8; ++G) stage_group_mma(act + G * 64, smB + (s * 8 + G) * 64, gsum + s * 8 + G, ginv + s * 8 + G);
  __syncwarp();
  const QMat w = slot_mat(m, m.down0, m.sh_down, m.down_stride, m.down_sb_stride, s, a.ids + int64_t(t) * m.K, m.K);
  const int64_t r0 = min(h0 + g, m.H - 1), r1 = min(h0 + g + 8, m.H - 1);
  float a0 = 0.f, a1 = 0.f;
  mma_q4_rows(static_cast<const uint2*>(w.data) + r0 * 32, static_cast<const uint2*>(w.data) + r1 * 32,
              static_cast<const uint16_t*>(w.scales) + r0 * 8, static_cast<const uint16_t*>(w.scales) + r1 * 8,
              static_cast<const uint16_t*>(w.biases) + r0 * 8, static_cast<const uint16_t*>(w.biases) + r1 * 8, 0, 8,
              smB + s * 8 * 64, gsum + s * 8, ginv + s * 8, a0, a1);
  if (tq == 0) {
    red[s][g] = a0;
    red[s][g + 8] = a1;
  }
  __syncthreads();
  if (threadIdx.x < 16 && h0 + int(threadIdx.x) < m.H) {
    float v = 0.f;
    for (int k = 0; k < S; ++k) v += red[k][threadIdx.x];
    a.out[int64_t(t) * m.H + h0 + threadIdx.x] = v;
    if (a.res) a.res[int64_t(t) * m.H + h0 + threadIdx.x] += v;
  }
}

// ---- D10 (decode, T == 1): router + softmax + top-k in one kernel ----------------------------
// (E+1)/4 CTAs of 4 warps; warp w of CTA b computes router row 4b+w (row E: the shared-expert gate)
// with gemv_q8_kernel's 8-bit dot product (x staged per CTA; with D9 the RMSNorm is folded in the
// same way as in the GEMVs). The last CTA to finish (atomic ticket, threadfence pattern) selects
// the top k of the E logits (E <= 256, k <= 8) with warp reductions, in topk_warp's order (largest
// first, ties to the lower index), writes ids, renormalised softmax weights and σ(shared gate), and
// resets the ticket so that a captured step can be replayed. The gate/up kernel then only copies
// the result.
constexpr int kRouterWarps = 4;

// Unsigned key with the order of the float (finite values and ±inf; -0 counts as +0, so equal
// logits tie and go to the lower index).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = f == 0.f ? 0u : __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
// Top k (k <= 8) of lg[0, E) (E <= 256, shared memory) by warp selection on order-preserving
// integer keys (redux.sync max, then the min index among equal keys: the largest logit, ties to the
// lower index, as in topk_warp). Round 1: warp w < 4 picks the top k of logits [64w, 64w+64) (2 per
// lane); round 2: warp 0 picks the top k of those 4k. A taken or absent element has key 0, below
// every real logit's key. Called by the whole block (>= 4 warps); sid/sv (ids, logits) are valid
// after it (it ends with a block barrier).
__device__ void select_topk_block(const float* lg, int E, int K, uint32_t* ckey, uint32_t* cidx, int* sid,
                                  float* sv) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp < 4) {
    const int e0 = 64 * warp + 2 * lane, e1 = e0 + 1;
    uint32_t k0 = e0 < E ? order_key(lg[e0]) : 0u, k1 = e1 < E ? order_key(lg[e1]) : 0u;
    for (int k = 0; k < K; ++k) {
      const bool second = k1 > k0;
      const uint32_t kb = second ? k1 : k0, ib = second ? e1 : e0;
      const uint32_t best = __reduce_max_sync(0xffffffffu, kb);
      const uint32_t win = __reduce_min_sync(0xffffffffu, kb == best ? ib : 0xffffffffu);
      if (ib == win) {
        if (second) k1 = 0u;
        else k0 = 0u;
      }
      if (lane == 0) {
        ckey[warp * K + k] = best;
        cidx[warp * K + k] = win;
      }
    }
  }
  __syncthreads();
  if (warp == 0) {
    uint32_t kc = lane < 4 * K ? ckey[lane] : 0u;
    const uint32_t ic = lane < 4 * K ? cidx[lane] : 0xffffffffu;
    for (int k = 0; k < K; ++k) {
      const uint32_t best = __reduce_max_sync(0xffffffffu, kc);
      const uint32_t win = __reduce_min_sync(0xffffffffu, kc == best ? ic : 0xffffffffu);
      if (ic == win) kc = 0u;
      if (lane == 0) {
        const int e = int(min(win, uint32_t(E - 1)));   // in range whatever the logits
        sid[k] = e;
        sv[k] = lg[e];
      }
    }
  }
  __syncthreads();
}

// D27: the same selection (largest logit first, ties to the lower index) on warp 0 alone, one round.
// Lane l holds logits [8l, 8l+8) as 35-bit composites (order key << 3 | 7 - j: unique, larger for the
// lower index among equal keys) and sorts them in registers (19-comparator network); then each of the
// k picks is one redux.sync max over the lanes' heads and a ballot: the lowest lane holding the best
// key wins (its indices are below every higher lane's), writes sid/sv and shifts its list. 8 dependent
// (redux, ballot) steps instead of select_topk_block's 2 rounds of 8 (redux, redux) pairs and its two
// block barriers. Called by warp 0 only (E <= 256, K <= 8); sid/sv are valid in warp 0 after it.
__device__ __forceinline__ void cswap_desc(uint64_t& a, uint64_t& b) {
  const uint64_t hi = a > b ? a : b, lo = a > b ? b : a;
  a = hi;
  b = lo;
}
__device__ __forceinline__ void named_bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void named_bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
// The lane's 8 composites sorted in descending order (19-comparator network); tr (investigation aid): thread 0
// stamps phase 15 once they are sorted.
__device__ __forceinline__ void sort8_desc(uint64_t (&c)[8], unsigned long long* tr) {
  cswap_desc(c[0], c[2]); cswap_desc(c[1], c[3]); cswap_desc(c[4], c[6]); cswap_desc(c[5], c[7]);
  cswap_desc(c[0], c[4]); cswap_desc(c[1], c[5]); cswap_desc(c[2], c[6]); cswap_desc(c[3], c[7]);
  cswap_desc(c[0], c[1]); cswap_desc(c[2], c[3]); cswap_desc(c[4], c[5]); cswap_desc(c[6], c[7]);
  cswap_desc(c[2], c[4]); cswap_desc(c[3], c[5]);
  cswap_desc(c[1], c[4]); cswap_desc(c[3], c[6]);
  cswap_desc(c[1], c[2]); cswap_desc(c[3], c[4]); cswap_desc(c[5], c[6]);
  if (tr) {   // the stamp must wait for the sorted lists: make them inputs of the timer read
    asm volatile("" ::"l"(c[0]), "l"(c[7]));
    trace_stamp(tr, 15);
  }
}
// After pick k: the winning lane drops its head; at pick arrive_at the warp arrives on named barrier 1 (D36).
__device__ __forceinline__ void pick_done(uint64_t (&c)[8], bool win, int k, int arrive_at) {
#pragma unroll
  for (int j = 0; j < 7; ++j) c[j] = win ? c[j + 1] : c[j];
  c[7] = win ? 0ull : c[7];
  if (k == arrive_at) {
    __syncwarp();
    named_bar_arrive(1, blockDim.x);
  }
}
// arrive_at >= 0 (D36): after pick arrive_at the warp arrives on named barrier 1 (whole CTA counted), so the
// block's other warps may read sid[arrive_at] while this warp goes on picking.
// tr (investigation aid): thread 0 stamps phase 15 once the lanes' lists are sorted.
__device__ __forceinline__ void select_topk_lanes(const float* lg, int E, int K, int* sid, float* sv,
                                                  int arrive_at = -1, unsigned long long* tr = nullptr) {
  const int lane = threadIdx.x & 31;
  uint64_t c[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int e = 8 * lane + j;
    c[j] = e < E ? (uint64_t(order_key(lg[e])) << 3) | uint64_t(7 - j) : 0ull;
  }
  sort8_desc(c, tr);
  for (int k = 0; k < K; ++k) {
    const uint32_t head = uint32_t(c[0] >> 3);
    const uint32_t best = __reduce_max_sync(0xffffffffu, head);
    const int w = __ffs(__ballot_sync(0xffffffffu, head == best)) - 1;
    const bool win = lane == w;
    if (win) {
      const int e = min(8 * lane + 7 - int(c[0] & 7u), E - 1);   // in range whatever the logits
      sid[k] = e;
      sv[k] = lg[e];
    }
    pick_done(c, win, k, arrive_at);
  }
  __syncwarp();
}

// D50: select_topk_lanes on logits already in the lane's registers (v = logits [8l, 8l+8)), E == 256. No
// shared-memory reads: the winner lane writes sid[k] (no logit load in the pick loop) and lane k keeps pick
// k's logit decoded from its order key (*mine, exact); *top is pick 0's logit on every lane.
__device__ __forceinline__ float key_float(uint32_t k) { return __uint_as_float((k & 0x80000000u) ? k ^ 0x80000000u : ~k); }
__device__ __forceinline__ void select_topk_regs(const float (&v)[8], int K, int* sid, float* mine, float* top,
                                                 int arrive_at, unsigned long long* tr) {
  const int lane = threadIdx.x & 31;
  uint64_t c[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) c[j] = (uint64_t(order_key(v[j])) << 3) | uint64_t(7 - j);
  sort8_desc(c, tr);
  uint32_t my = 0u, first = 0u;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    if (k >= K) break;
    const uint32_t head = uint32_t(c[0] >> 3);
    const uint32_t best = __reduce_max_sync(0xffffffffu, head);
    const int w = __ffs(__ballot_sync(0xffffffffu, head == best)) - 1;
    const bool win = lane == w;
    if (win) sid[k] = 8 * lane + 7 - int(c[0] & 7u);
    if (k == 0) first = best;
    if (lane == k) my = best;
    pick_done(c, win, k, arrive_at);
  }
  __syncwarp();
  *mine = key_float(my);
  *top = key_float(first);
}

constexpr int kRouterCols = 2048;   // H: 128 16-byte chunks of 16 codes per row, 4 per lane

// Stages x (kRouterCols floats; gain ⊙ x with D9, adding the thread's share of Σx² to *ss) as
// gemv_q8_kernel does: chunk ci (16 codes), float4 f -> [(ci/32)*128 + f*32 + ci%32], bytes 1 and
// 3 of a word pre-scaled by 1/256, plus the plain sum of each chunk. Needs blockDim.x % 32 == 0.
// One float4 (f = 0..3 of a 16-value chunk held by 4 consecutive lanes) staged for the 8-bit dot:
// the chunk's plain sum to *sum (lane f == 0), bytes 1 and 3 of a word pre-scaled by 1/256.
__device__ __forceinline__ float4 q8_stage(float4 v, int f, float* sum) {
  float s4 = (v.x + v.y) + (v.z + v.w);
  s4 += __shfl_xor_sync(0xffffffffu, s4, 1);
  s4 += __shfl_xor_sync(0xffffffffu, s4, 2);
  if (f == 0) *sum = s4;
  v.y *= 1.f / 256;
  v.w *= 1.f / 256;
  return v;
}
// stage_x_q8 from registers (256 threads, 2 float4s each: the router's 2048 columns).
__device__ __forceinline__ void stage_x_q8_regs(const XRegs<2>& x, float4* sm4, float* xsum) {
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int idx = int(threadIdx.x) + 256 * k;
    const float4 v = x.v[k];
    const int ci = idx >> 2;
    sm4[(ci >> 5) * 128 + (idx & 3) * 32 + (ci & 31)] = q8_stage(v, idx & 3, xsum + ci);
  }
}

__device__ __forceinline__ void stage_x_q8(const float* xin, const float* gain, float4* sm4, float* xsum,
                                           float* ss) {
  for (int idx = threadIdx.x; idx < kRouterCols / 4; idx += blockDim.x) {
    float4 v = reinterpret_cast<const float4*>(xin)[idx];
    if (gain) {
      if (ss) *ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;   // null: the caller has the sum already
      const float4 g = reinterpret_cast<const float4*>(gain)[idx];
      v.x *= g.x;
      v.y *= g.y;
      v.z *= g.z;
      v.w *= g.w;
    }
    const int ci = idx >> 2;
    sm4[(ci >> 5) * 128 + (idx & 3) * 32 + (ci & 31)] = q8_stage(v, idx & 3, xsum + ci);
  }
}

// One 8-bit router row (kRouterCols columns) in registers: load() may run before pdl_wait (weights),
// dot() works on x staged by stage_x_q8 and returns the warp-reduced dot product.
struct Q8RouterRow {
  static constexpr int CPL = kRouterCols / 512;
  uint4 wv[CPL];
  float sc[CPL], bi[CPL];
  __device__ __forceinline__ void load(const QMat& w, int64_t r) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      wv[i] = __ldcs(static_cast<const uint4*>(w.data) + r * (kRouterCols / 16) + lane + 32 * i);
      sc[i] = bf16f(static_cast<const uint16_t*>(w.scales)[r * (kRouterCols / 64) + ((lane + 32 * i) >> 2)]);
      bi[i] = bf16f(static_cast<const uint16_t*>(w.biases)[r * (kRouterCols / 64) + ((lane + 32 * i) >> 2)]);
    }
  }
  __device__ __forceinline__ float dot(const float4* sm4, const float* xsum) const {
    const int lane = threadIdx.x & 31;
    const float M = 8388608.f;
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      float d = 0.f;
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        const float4 xv = sm4[i * 128 + f * 32 + lane];
        const uint32_t wd = word_of(wv[i], f), h = wd >> 16;
        d = fmaf(__uint_as_float((wd & 0xFFu) | 0x4B000000u) - M, xv.x, d);
        d = fmaf(__uint_as_float((wd & 0xFF00u) | 0x4B000000u) - M, xv.y, d);
        d = fmaf(__uint_as_float((h & 0xFFu) | 0x4B000000u) - M, xv.z, d);
        d = fmaf(__uint_as_float((h & 0xFF00u) | 0x4B000000u) - M, xv.w, d);
      }
      acc = fmaf(sc[i], d, fmaf(bi[i], xsum[lane + 32 * i], acc));
    }
    return warp_sum(acc);
  }
};

__global__ void __launch_bounds__(32 * kRouterWarps) moe_router_topk_kernel(const __grid_constant__ MoeArgs a,
                                                                            const __grid_constant__ GemvNorm nrm,
                                                                            int* counter) {
  __shared__ float4 sm4[kRouterCols / 4];
  __shared__ float xsum[kRouterCols / 16];
  __shared__ float red[kRouterWarps];
  __shared__ float lg[64 * kRouterWarps];
  __shared__ int sid[32];
  __shared__ float sv[32];
  __shared__ uint32_t ckey[32], cidx[32];
  __shared__ int is_last;
  const MoeDev& m = a.m;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nt = 32 * kRouterWarps;
  const int row = blockIdx.x * kRouterWarps + warp;   // row > E: idle warp
  const bool sg_row = row == m.E;
  const QMat& w = sg_row ? m.shared_gate : m.router;
  const int64_t r = row < m.E ? row : 0;
  Q8RouterRow rw;
  pdl_trigger();
  if (row <= m.E) rw.load(w, r);   // weights never change: loads issued before the wait
  // D13: the next launch's weights (next layer's projections, ~13 MB), queued after this kernel's
  // own loads so that they do not wait behind the prefetch.
  l2_prefetch(a.pf);
  pdl_wait();
  const float* xin = nrm.w ? nrm.h : a.x;
  float ss = 0.f;
  stage_x_q8(xin, nrm.w, sm4, xsum, &ss);
  if (nrm.w) {
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
  }
  __syncthreads();
  const float nscale = nrm.w ? fold_norm_scale(red, kRouterWarps, kRouterCols, nrm.eps, nrm.h, nrm.w,
                                               blockIdx.x == 0 ? const_cast<float*>(a.x) : nullptr)
                             : 1.f;
  if (row <= m.E) {
    const float v = rw.dot(sm4, xsum) * nscale;
    if (lane == 0) {
      if (sg_row) const_cast<float*>(a.sg)[0] = v;
      else const_cast<float*>(a.logits)[row] = v;
      __threadfence();   // visible device-wide before the ticket is taken
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == int(gridDim.x) - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int e = threadIdx.x; e < m.E; e += nt) lg[e] = __ldcg(a.logits + e);
  __syncthreads();
  if (!a.topk_lanes) select_topk_block(lg, m.E, m.K, ckey, cidx, sid, sv);
  else if (warp == 0) select_topk_lanes(lg, m.E, m.K, sid, sv);
  if (warp == 0) {
    const float p = lane < m.K ? __expf(sv[lane] - sv[0]) : 0.f;   // the full softmax denominator cancels
    const float sum = warp_sum(p);
    if (lane < m.K) {
      a.ids[lane] = sid[lane];
      a.wts[lane] = p / sum;
      if (m.hist) atomicAdd(&m.hist[sid[lane]], 1);
    }
    if (lane == 0) {
      a.wts[m.K] = sigmoidf_(__ldcg(a.sg));
      *counter = 0;   // ready for the next call (stream order: no other router kernel runs now)
    }
  }
}

// ---- D19 (decode, T == 1): the whole MoE block as one persistent kernel --------------------
// One wave of G CTAs (8 warps each; G from the occupancy API, all co-resident, see moe()) runs:
//   1. router rows (E + 1 of them incl. the shared-expert gate, warp-per-row as in the D10 router)
//      -> the CTAs that own router rows arrive on ctr[0];
//   2. meanwhile the shared expert's gate/up rows (their weights were loaded before pdl_wait):
//      SwiGLU written unweighted (σ(shared gate) is only known after the handoff);
//   3. every CTA waits for ctr[0] == nR, runs the top-k itself on the E logits (select_topk_block,
//      redundant per CTA but no second serial step), then the K routed experts' gate/up rows;
//      CTA 0 publishes ids/weights (last_moe_ids, expert histogram); then arrive on ctr[1];
//   4. the down rows of the CTA's 16 outputs are loaded, every CTA waits for ctr[1] == G, stages
//      the K+1 activations (shared slot scaled by σ(shared gate)) and writes out (+ residual).
// Handoffs: bar.sync, then thread 0 fences (gpu scope) and adds to the counter (release); waiters
// spin with ld.acquire.gpu, fence, bar.sync, and read other CTAs' data through L2 (__ldcg).
// With moep=64 the counters are reset by the last CTA to pass the second handoff (ctr[2] counts
// those), so a captured graph replays; by default the handoffs use tickets and tagged logits instead
// (below, grid_wait64; docs/CUDA.md "Session 4 notes"). Deadlock safety: a CTA spins only on CTAs of its own grid, the grid is
// at most (occupancy per SM) x SMs CTAs and PDL dependents are released (pdl_trigger) only after
// the second handoff, i.e. once every CTA of the grid is resident; earlier kernels in the stream
// finish without waiting on this one, so every CTA eventually becomes resident.
constexpr int kPersistThreads = 256;

__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Call after a block barrier that follows the CTA's writes.
__device__ __forceinline__ void grid_arrive(int* c) {
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(c, 1);
  }
}
__device__ __forceinline__ void grid_wait(const int* c, int target) {
  if (threadIdx.x == 0) {
    while (ld_acquire_gpu(c) < target) __nanosleep(32);
    __threadfence();
  }
  __syncthreads();
}

// Ticket handoffs (default; the reset scheme above is flag 64): 64-bit counters that only grow.
// Thread 0 of every CTA takes a ticket at kernel start, before its PDL wait (off the critical
// path); launch n = ticket / G (all G CTAs of launch n take theirs before any CTA of launch n+1
// can start: launch n releases dependents only after its second handoff). The handoffs wait for
// (n+1)·nR and (n+1)·G arrivals, so nothing is reset and no CTA waits on an atomic's return
// between the handoffs (the reset scheme's ctr[2] add returned its value in thread 0 right before
// the down stage). The waiter's acquire load orders the CTA's later reads (bar.sync after it).
__device__ __forceinline__ unsigned long long ld_acquire_gpu64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long ld_relaxed_gpu64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_gpu64(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void grid_arrive64(unsigned long long* c) {
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(c, 1ull);
  }
}
// D33: the same arrival as one release add (thread 0, after the CTA's barrier; PTX release is cumulative,
// so the CTA's earlier writes are ordered before it) instead of a sequentially consistent fence
// (__threadfence) followed by a relaxed add.
__device__ __forceinline__ void grid_arrive64_release(unsigned long long* c) {
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(c) : "memory");
}
__device__ __forceinline__ void grid_wait64(const unsigned long long* c, unsigned long long target) {
  if (threadIdx.x == 0)
    while (ld_acquire_gpu64(c) < target) __nanosleep(32);
  __syncthreads();
}

// Dynamic shared memory (floats): x staged for the 4-bit rows (H + H/32), then a region used first
// for x staged for the 8-bit router rows (H + H/16) and later for the down activations (S*512 + S*16).
size_t persist_smem(const MoeDev& m) {
  const int S = m.K + 1;
  return size_t(m.H + m.H / 32 + std::max(m.H + m.H / 16, S * 512 + S * 16)) * 4;
}

// Warp 0, after the picks: p (lanes < K) is pick lane's unnormalised softmax term; the routing weights go to
// sw / slot_scale (routed slots carry their weight already; the shared slot's σ(gate) is applied at staging, as
// that slot was written before it was known), and CTA 0 publishes ids / weights (and the expert histogram).
// sg_logit() (read by lane 0 only) is the shared-expert gate's logit, lsc the logits' scale.
template <class SgLogit>
__device__ __forceinline__ void route_weights(const MoeArgs& a, int K, const int* sid, float p, SgLogit sg_logit,
                                              float lsc, float* sw, float* slot_scale) {
  const int lane = threadIdx.x & 31;
  const float sum = warp_sum(p);
  if (lane < K) {
    sw[lane] = p / sum;
    slot_scale[lane] = 1.f;
  }
  if (lane == 0) {
    sw[K] = sigmoidf_(sg_logit() * lsc);
    slot_scale[K] = sw[K];
  }
  if (blockIdx.x == 0 && lane < K) {
    a.ids[lane] = sid[lane];
    a.wts[lane] = p / sum;
    if (a.m.hist) atomicAdd(&a.m.hist[sid[lane]], 1);
  }
  if (blockIdx.x == 0 && lane == 0) a.wts[K] = sw[K];
}

// F (D31): the instance for the default configuration only — x staged from registers at H = 2,048 (D21),
// int16 x and activations (D24), ticket handoffs with tagged logits, the one-warp top-k (D27), one down row
// per warp, no moep experiment bits. Every runtime alternative folds to a constant, so the compiler drops
// the other paths (74.5 KB of SASS instead of ~196 KB). F also makes the model's shapes constants (E 256,
// K 8, H 2,048, I = Is = 512) and folds the norm and the residual (always present on this path). What pays
// (session 9: +7 % per token) is fewer dependent instructions in latency-bound phases (constant trip counts,
// the unrolled K = 8 picks, no dispatch branches), not instruction-cache fit: warming the caches did not help.
// EP (D36, with F only): the block's warps wait only for the pick of their first item's slot (the same for
// the CTA's 8 warps: gw / I) before loading it; warp 0 goes on picking meanwhile (named barriers 1 and 2).
// RL (D39, with EP): the router logits come from the previous launch (a.rlog, unscaled: times the norm scale
// here); no router rows and no logits handoff. The shared expert's rows move to warps 1..7 (warp 0 picks).
// W0 (D50, with RL): warp 0 loads the 257 logits straight into registers after the PDL wait and picks at once
// (select_topk_regs) while warps 1..7 stage x alone (3 float4s per thread; named barrier 3 among them, 4 to tell
// warp 0); warp 0 then waits for the staging only to scale the routing weights by the norm scale.
template <bool F, bool EP, bool RL, bool W0 = false, bool FS = false>
__device__ __forceinline__ void moe_persist_body(const MoeArgs& a, const GemvNorm& nrm, int* ctr) {
  extern __shared__ float4 smp[];
  __shared__ float lg[256];
  __shared__ int sid[32];
  __shared__ float sv[32], sw[33], slot_scale[33];
  __shared__ uint32_t ckey[32], cidx[32];
  __shared__ float red[kPersistThreads / 32];
  __shared__ float s_sg;
  const MoeDev& m = a.m;
  // D31 (F): the model's shapes, the folded norm and the residual as constants.
  constexpr bool SP = F;
  const int E = SP ? 256 : m.E, K = SP ? 8 : m.K, H = SP ? 2048 : m.H, I = SP ? 512 : m.I, Is = SP ? 512 : m.Is;
  const int imax = SP ? 512 : a.imax;
  const bool NW = SP || nrm.w != nullptr, RS = SP || a.res != nullptr;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwc = kPersistThreads / 32;
  const int G = gridDim.x, gw = blockIdx.x * nwc + warp, nw = G * nwc, S = K + 1;
  float4* xq4 = smp;
  float* xs4 = reinterpret_cast<float*>(xq4 + H / 4);
  float4* xq8 = reinterpret_cast<float4*>(xs4 + H / 32);   // H/32 floats: 16-byte multiple
  float* xs8 = reinterpret_cast<float*>(xq8 + H / 4);
  float4* dq = xq8;                                           // down stage (after the router rows)
  float* dsum = reinterpret_cast<float*>(dq + S * 128);
  const int nR = min(G, (E + 1 + nwc - 1) / nwc);           // CTAs that own router rows
  const int pre = E + 1 + Is;                             // router rows, then shared rows
  float* act = a.act;                                         // [K+1, imax]

  auto load_q4 = [&](Q4Rows<2, 2>& q, const QMat& g, const QMat& u, int row) {
    const uint4* rp[2] = {static_cast<const uint4*>(g.data) + int64_t(row) * (H / 32),
                          static_cast<const uint4*>(u.data) + int64_t(row) * (H / 32)};
    const uint16_t* sp[2] = {static_cast<const uint16_t*>(g.scales) + int64_t(row) * (H / 64),
                             static_cast<const uint16_t*>(u.scales) + int64_t(row) * (H / 64)};
    const uint16_t* bp[2] = {static_cast<const uint16_t*>(g.biases) + int64_t(row) * (H / 64),
                             static_cast<const uint16_t*>(u.biases) + int64_t(row) * (H / 64)};
    q.load(rp, sp, bp);
  };
  const int items = K * I;
  auto load_routed = [&](Q4Rows<2, 2>& q, int it) {
    const int sl = it / I, row = it % I;
    load_q4(q, stack_mat(m.gate0, m.gate_stride, m.gate_sb_stride, sid[sl]),
            stack_mat(m.up0, m.up_stride, m.up_sb_stride, sid[sl]), row);
  };
  // Weights never change: this warp's first router or shared-expert row is loaded before the wait.
  Q8RouterRow rr;
  Q4Rows<2, 2> cur;
  trace_mark(a, 0);
  // Ticket handoffs (default): counters at ctr + 8 (tickets, router arrivals, gate/up arrivals).
  unsigned long long* tk = reinterpret_cast<unsigned long long*>(ctr + 8);
  const bool tickets = SP || !(a.flags & 64);
  // Tagged logits (default with tickets; flag 128 off): 8-byte {tag, logit} slots at ctr + 16.
  const bool tags = SP || (tickets && !(a.flags & 128));
  unsigned long long* tg = reinterpret_cast<unsigned long long*>(ctr + 16);
  __shared__ unsigned long long s_gen;
  if (tickets && threadIdx.x == 0) s_gen = atomicAdd(&tk[0], 1ull) / unsigned(G);
  static_assert(!RL || EP, "D39 only in the D36 instance");
  static_assert(!W0 || RL, "D50 only in the D39 instance");
  // RL: shared-expert row sr on warp `warp` (1..7) of CTA blockIdx.x, in its own registers (computed while
  // the warp's first routed rows load, after the picks: warp 0 picks alone).
  const int sr = RL && warp > 0 ? int(blockIdx.x) * (nwc - 1) + warp - 1 : Is;
  Q4Rows<2, 2> shr;
  if (RL) {
    if (sr < Is) load_q4(shr, m.sh_gate, m.sh_up, sr);
  } else if (gw <= E) {
    rr.load(gw == E ? m.shared_gate : m.router, gw < E ? gw : 0);
  } else if (gw < pre) {
    load_q4(cur, m.sh_gate, m.sh_up, gw - E - 1);
  }
  l2_prefetch(a.pf);   // D13: the next launch's weights
  const float* xin = NW ? nrm.h : a.x;
  float ns = 1.f;
  if constexpr (W0) {
    if (warp == 0) {   // D50: the logits into registers, the picks at once
      pdl_wait();
      trace_mark(a, 1);
      const float4* r4 = reinterpret_cast<const float4*>(a.rlog);
      const float4 l0 = __ldcg(r4 + 2 * lane), l1 = __ldcg(r4 + 2 * lane + 1);
      const float sgl = lane == 0 ? __ldcg(a.rlog + E) : 0.f;
      trace_mark(a, 5);
      const float v[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
      float mine, top;
      select_topk_regs(v, K, sid, &mine, &top, (blockIdx.x * nwc) / I, a.trace);
      trace_mark(a, 12);
      named_bar_sync(4, kPersistThreads);   // warps 1..7 have staged x and their shares of Σx²
      trace_mark(a, 2);
      ns = fold_norm_scale(red + 1, nwc - 1, H, nrm.eps, nrm.h, nrm.w, nullptr);
      const float p = lane < K ? __expf((mine - top) * ns) : 0.f;   // the full softmax denominator cancels
      route_weights(a, K, sid, p, [&] { return sgl; }, ns, sw, slot_scale);
      if (blockIdx.x < nR && lane == 0) atomicAdd(&tk[1], 1ull);   // counted as the other instances do
      trace_mark(a, 13);
      named_bar_arrive(2, kPersistThreads);
      if (gw < items) load_routed(cur, gw);
    } else {   // warps 1..7: x (float4 t + 224k of H / 4 = 512) with the norm gain, staged as int16
      const int t = int(threadIdx.x) - 32;
      float4 xg[3], xv[3];
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        const int idx = t + 224 * k;
        if (idx < H / 4) xg[k] = reinterpret_cast<const float4*>(nrm.w)[idx];
      }
      pdl_wait();
      float ss = 0.f;
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        const int idx = t + 224 * k;
        if (idx < H / 4) {
          xv[k] = reinterpret_cast<const float4*>(xin)[idx];
          ss += xv[k].x * xv[k].x + xv[k].y * xv[k].y + xv[k].z * xv[k].z + xv[k].w * xv[k].w;
          xv[k].x *= xg[k].x;
          xv[k].y *= xg[k].y;
          xv[k].z *= xg[k].z;
          xv[k].w *= xg[k].w;
        } else if constexpr (FS) {
          xv[k] = make_float4(0.f, 0.f, 0.f, 0.f);   // shuffled by q16_stage_il, never written
        }
      }
      ss = warp_sum(ss);
      if (lane == 0) red[warp] = ss;
      uint4* qx = reinterpret_cast<uint4*>(xq4);
      float* xd = reinterpret_cast<float*>(xq4) + H / 2;
      if constexpr (FS) {   // D91: the 3 chains interleaved, the scale by __fdividef (as D89 + D90 in the GEMVs)
        q16_stage_il<3, true>(xv, t, 224, H / 4, qx, xd, xs4);
      } else {
#pragma unroll
        for (int k = 0; k < 3; ++k) {
          const int idx = t + 224 * k;
          if (idx >= H / 4) break;   // uniform per warp (224 and 512 are multiples of 32)
          const int ci = idx >> 3;
          q16_stage(xv[k], idx & 7, qx + (ci >> 5) * 128 + (ci & 31), 32, xs4 + ci, xd + ci);
        }
      }
      named_bar_sync(3, kPersistThreads - 32);
      ns = fold_norm_scale(red + 1, nwc - 1, H, nrm.eps, nrm.h, nrm.w, nullptr);
      if (blockIdx.x == 0) {
#pragma unroll
        for (int k = 0; k < 3; ++k) {
          const int idx = t + 224 * k;
          if (idx < H / 4)
            reinterpret_cast<float4*>(const_cast<float*>(a.x))[idx] =
                make_float4(xv[k].x * ns, xv[k].y * ns, xv[k].z * ns, xv[k].w * ns);
        }
      }
      named_bar_arrive(4, kPersistThreads);
      named_bar_sync(1, kPersistThreads);
      if (gw < items) load_routed(cur, gw);
      if (sr < Is) {   // D39: the shared row while the routed rows load and warp 0 finishes its picks
        float r[2];
        shr.dot_i16(reinterpret_cast<const uint4*>(xq4), reinterpret_cast<const float*>(xq4) + H / 2, xs4, r);
        if (lane == 0) act[K * imax + sr] = siluf_(r[0] * ns) * (r[1] * ns);
      }
      named_bar_sync(2, kPersistThreads);
    }
  } else {
    if (SP || (a.stage_regs && H == 2 * 4 * kPersistThreads)) {
      // D21: x once into registers (the norm gain, a weight, before the wait), both layouts from there.
      XRegs<2> xr;
      if (NW) xr.load(nrm.w, H / 4);
      const XRegs<2> g = xr;
      pdl_wait();
      trace_mark(a, 1);
      float lgv = 0.f;
      if (RL) {   // D39: the logits (one per thread: E == 256 threads) in flight with x
        lgv = __ldcg(a.rlog + threadIdx.x);
        if (threadIdx.x == 0) s_sg = __ldcg(a.rlog + E);
      }
      xr.load(xin, H / 4);
      if (RL) lg[threadIdx.x] = lgv;
      if (NW) {
        const float ss = warp_sum(xr.apply_gain(g));
        if (lane == 0) red[warp] = ss;
      }
      // D24: the gate/up rows read x as int16 per 32 values (qx in the xq4 region).
      if (SP || a.xq16) stage_x_i16_regs(xr, H, reinterpret_cast<uint4*>(xq4), reinterpret_cast<float*>(xq4) + H / 2, xs4);
      else stage_x_q4_regs(xr, H, xq4, xs4);
      if (!RL) stage_x_q8_regs(xr, xq8, xs8);
      __syncthreads();
      if (NW) {
        ns = fold_norm_scale(red, nwc, H, nrm.eps, nrm.h, nrm.w, nullptr);
        if (blockIdx.x == 0) xr.store_scaled(const_cast<float*>(a.x), H / 4, ns);
      }
    } else {
      pdl_wait();
      trace_mark(a, 1);
      float ss = 0.f;
      stage_x_q4(xin, H, xq4, xs4, nrm.w, &ss);
      stage_x_q8(xin, nrm.w, xq8, xs8, nullptr);
      if (NW) {
        ss = warp_sum(ss);
        if (lane == 0) red[warp] = ss;
      }
      __syncthreads();
      // D9: the staged x is gain ⊙ h; the rmsnorm scale multiplies the dot products instead.
      if (NW)
        ns = fold_norm_scale(red, nwc, H, nrm.eps, nrm.h, nrm.w, blockIdx.x == 0 ? const_cast<float*>(a.x) : nullptr);
    }
    trace_mark(a, 2);
    // 1. router rows (RL: none, the logits came with the previous launch)
    for (int p = gw; !RL && p <= E; p += nw) {
      if (p != gw) rr.load(p == E ? m.shared_gate : m.router, p < E ? p : 0);
      const float v = rr.dot(xq8, xs8) * ns;
      if (lane == 0) {
        if (tags) st_relaxed_gpu64(tg + p, (uint64_t(uint32_t(s_gen + 1)) << 32) | __float_as_uint(v));
        if (p == E) const_cast<float*>(a.sg)[0] = v;
        else const_cast<float*>(a.logits)[p] = v;
      }
    }
    __syncthreads();
    trace_mark(a, 3);
    if (blockIdx.x < nR) {   // with tags only counted (no fence), so that launches may mix the modes
      if (tags) {
        if (threadIdx.x == 0) atomicAdd(&tk[1], 1ull);
      } else if (tickets) {
        grid_arrive64(&tk[1]);
      } else {
        grid_arrive(&ctr[0]);
      }
    }
    // 2. shared expert gate/up rows (unweighted SwiGLU); RL: below, with the first routed loads in flight
    for (int p = gw; !RL && p < pre; p += nw) {
      if (p <= E) continue;
      if (p != gw) load_q4(cur, m.sh_gate, m.sh_up, p - E - 1);
      float r[2];
      if (SP || a.xq16) cur.dot_i16(reinterpret_cast<const uint4*>(xq4), reinterpret_cast<const float*>(xq4) + H / 2, xs4, r);
      else cur.dot(xq4, xs4, r);
      if (lane == 0) act[K * imax + (p - E - 1)] = siluf_(r[0] * ns) * (r[1] * ns);
    }
    // 3. routing, then the routed experts' gate/up rows
    trace_mark(a, 4);
    if (RL) {
      // D39: lg and s_sg were staged with x (before the staging barrier).
    } else if (tags) {
      // Tagged logits: each thread polls its slots until they carry this launch's tag (value and tag
      // are one 8-byte word), so the logits arrive with the handoff in one round trip.
      const uint32_t want = uint32_t(s_gen + 1);
      for (int e = threadIdx.x; e <= E; e += kPersistThreads) {
        uint64_t w;
        while (uint32_t((w = ld_relaxed_gpu64(tg + e)) >> 32) != want) __nanosleep(32);
        const float v = __uint_as_float(uint32_t(w));
        if (e < E) lg[e] = v;
        else s_sg = v;
      }
      __syncthreads();
    } else {
      if (tickets) grid_wait64(&tk[1], (s_gen + 1) * unsigned(nR));
      else grid_wait(&ctr[0], nR);
      for (int e = threadIdx.x; e < E; e += kPersistThreads) lg[e] = __ldcg(a.logits + e);
      if (threadIdx.x == 0) s_sg = __ldcg(a.sg);
      __syncthreads();
    }
    trace_mark(a, 5);
    static_assert(!EP || F, "D36 only in the D31 instance");
    if (EP) {
      if (warp == 0) select_topk_lanes(lg, E, K, sid, sv, (blockIdx.x * nwc) / I, a.trace);
    } else if (!SP && !a.topk_lanes) {
      select_topk_block(lg, E, K, ckey, cidx, sid, sv);
    } else if (warp == 0) {
      select_topk_lanes(lg, E, K, sid, sv);
    }
    trace_mark(a, 12);
    if (warp == 0) {
      const float lsc = RL ? ns : 1.f;   // D39: the logits are unscaled (the norm scale is positive: same order)
      const float p = lane < K ? __expf((sv[lane] - sv[0]) * lsc) : 0.f;   // the full softmax denominator cancels
      route_weights(a, K, sid, p, [&] { return s_sg; }, lsc, sw, slot_scale);
    }
    trace_mark(a, 13);
    if (EP) {   // D36: barrier 1 = this CTA's first slot picked, 2 = all picks and weights
      if (warp == 0) {
        named_bar_arrive(2, kPersistThreads);
        if (gw < items) load_routed(cur, gw);
      } else {
        named_bar_sync(1, kPersistThreads);
        if (gw < items) load_routed(cur, gw);
        if (RL && sr < Is) {   // D39: the shared row while the routed rows load and warp 0 finishes its picks
          float r[2];
          shr.dot_i16(reinterpret_cast<const uint4*>(xq4), reinterpret_cast<const float*>(xq4) + H / 2, xs4, r);
          if (lane == 0) act[K * imax + sr] = siluf_(r[0] * ns) * (r[1] * ns);
        }
        named_bar_sync(2, kPersistThreads);
      }
    } else {
      __syncthreads();
      if (gw < items) load_routed(cur, gw);
    }
  }
  trace_mark(a, 6);
  for (int it = gw; it < items; it += nw) {
    Q4Rows<2, 2> nxt;
    if (it + nw < items) load_routed(nxt, it + nw);
    float r[2];
    if (SP || a.xq16) cur.dot_i16(reinterpret_cast<const uint4*>(xq4), reinterpret_cast<const float*>(xq4) + H / 2, xs4, r);
    else cur.dot(xq4, xs4, r);
    cur = nxt;
    if (lane == 0) act[(it / I) * imax + it % I] = sw[it / I] * siluf_(r[0] * ns) * (r[1] * ns);
  }
  __syncthreads();
  trace_mark(a, 7);
  if (SP && !(a.flags & 2048)) grid_arrive64_release(&tk[2]);   // D33 (off: moep bit 2048, the fence form)
  else if (tickets) grid_arrive64(&tk[2]);
  else grid_arrive(&ctr[1]);
  // 4. down projections: this CTA's output rows (R per warp: 2 in 128 CTAs with flag 16, else 1 in
  // 256 CTAs) and the residual values they add to are loaded before the wait.
  auto down = [&](auto rtag) {
    constexpr int R = decltype(rtag)::value;
    const int nbd = (H + 8 * R - 1) / (8 * R);
    DownRowsT<R> dr;
    float resv[R];
    auto id_of = [&](int s) { return sid[s]; };
    const int h0 = (blockIdx.x * nwc + warp) * R;
    if (blockIdx.x < nbd) {
      dr.load(m, h0, id_of);
      if (RS && lane == 0)
#pragma unroll
        for (int r = 0; r < R; ++r) resv[r] = h0 + r < H ? a.res[h0 + r] : 0.f;
    }
    if (tickets) grid_wait64(&tk[2], (s_gen + 1) * unsigned(G));
    else grid_wait(&ctr[1], G);
    trace_mark(a, 8);
    if (SP || !(a.flags & 1)) pdl_trigger();   // every CTA of the grid is resident now (see above)
    if (!tickets && threadIdx.x == 0 && atomicAdd(&ctr[2], 1) == G - 1) {   // last CTA past the handoffs
      ctr[0] = 0;
      ctr[1] = 0;
      ctr[2] = 0;
    }
    if (blockIdx.x >= nbd) return;
    const bool x16 = SP || (a.xq16 && !(a.flags & 256));   // D24 (moep bit 256: float down stage)
    if (SP && a.lean_act) stage_down_act_lean<9>(act, dq, dsum, slot_scale);   // D63 (SP: S = 9, imax = 512)
    else stage_down_act(act, S, imax, dq, dsum, slot_scale, SP || a.stage_regs, x16);
    __syncthreads();
    trace_mark(a, 9);
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    if (x16) dr.dot_i16(reinterpret_cast<const uint4*>(dq), reinterpret_cast<const float*>(dq + S * 64), dsum, S, acc);
    else dr.dot(dq, dsum, S, acc);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float v = warp_sum(acc[r]);
      if (lane == 0 && h0 + r < H) {
        a.out[h0 + r] = v;
        if (RS) a.res[h0 + r] = resv[r] + v;
      }
    }
  };
  static_assert(kPersistThreads == 256, "down: 8 warps per CTA");
  if (!SP && (a.flags & 16)) down(std::integral_constant<int, 2>{});
  else down(std::integral_constant<int, 1>{});
  trace_mark(a, 10);
  __syncthreads();
  trace_mark(a, 11);
}

template <bool F, bool EP = false>
__global__ void __launch_bounds__(kPersistThreads, 2) moe_persist_kernel(const __grid_constant__ MoeArgs a,
                                                                         const __grid_constant__ GemvNorm nrm,
                                                                         int* ctr) {
  moe_persist_body<F, EP, false>(a, nrm, ctr);
}
// D39's instance at most 96 registers (kRlRegs): one of its CTAs then fits on an SM beside two CTAs of the
// out-projection launch before it (80 registers), so it starts (tickets, weight loads) before they finish.
// LILY_D39_REGS=0 takes the uncapped build (the compiler's choice, ~100).
constexpr int kRlRegs = 96;
__global__ void __maxnreg__(kRlRegs)
    moe_persist_rl_kernel(const __grid_constant__ MoeArgs a, const __grid_constant__ GemvNorm nrm, int* ctr) {
  moe_persist_body<true, true, true>(a, nrm, ctr);
}
// D50: the same with warp 0 picking from registers while warps 1..7 stage x.
__global__ void __maxnreg__(kRlRegs)
    moe_persist_rlw0_kernel(const __grid_constant__ MoeArgs a, const __grid_constant__ GemvNorm nrm, int* ctr) {
  moe_persist_body<true, true, true, true>(a, nrm, ctr);
}
// D88 (default on, `--ablate D88`; session 37: +0.7 % at 4K): the D50 instance at 88 registers. Registers are
// allocated 8 per thread at a time, so the 90-register build takes 96; at 88 two MoE CTAs (45,056) leave exactly
// one 80-register GEMV CTA of 256 threads (20,480) room on an SM, and the launch after the MoE (in-projection,
// q / k / v, lm_head) can enter during its tail instead of after it (D48 tried 80 registers and slowed the MoE
// itself; D74 shrank the GEMV instead).
constexpr int kRlRegs88 = 88;
__global__ void __maxnreg__(kRlRegs88)
    moe_persist_rlw0_r88_kernel(const __grid_constant__ MoeArgs a, const __grid_constant__ GemvNorm nrm, int* ctr) {
  moe_persist_body<true, true, true, true>(a, nrm, ctr);
}
// D91 (default on, `--ablate D91`; session 38: +0.3 % at 4K, 32K and 128K): the D88 instance with warps 1..7's x
// staging as q16_stage_il (interleaved chains, __fdividef).
__global__ void __maxnreg__(kRlRegs88)
    moe_persist_rlw0_r88_fs_kernel(const __grid_constant__ MoeArgs a, const __grid_constant__ GemvNorm nrm, int* ctr) {
  moe_persist_body<true, true, true, true, true>(a, nrm, ctr);
}
__global__ void __launch_bounds__(kPersistThreads, 2)
    moe_persist_rl_free_kernel(const __grid_constant__ MoeArgs a, const __grid_constant__ GemvNorm nrm, int* ctr) {
  moe_persist_body<true, true, true>(a, nrm, ctr);
}

bool q4ok(const QMat& w) { return w.type == kQ4 && !w.sb_f32 && w.gs == 64; }
bool q8router_ok(const QMat& w, int rows, int H) {
  return w.type == kQ8 && !w.sb_f32 && w.gs == 64 && w.cols == H && w.rows == rows;
}

}  // namespace

bool& moe_lean_act_enabled() {
  static bool on = true;
  return on;
}

bool moe_norm_ok(const MoeDev& m, int T, bool fast) {
  return gemv_norm_ok(m.router, T, fast) && gemv_norm_ok(m.shared_gate, T, fast) && m.router.cols == m.H &&
         m.shared_gate.cols == m.H;
}

bool& moe_w0_pick_enabled() {
  static bool on = true;
  return on;
}

bool& moe_regs88_enabled() {
  static bool on = true;
  return on;
}

bool& moe_stage_il_enabled() {
  static bool on = true;
  return on;
}

bool& moe_early_pick_enabled() {
  static bool on = true;
  return on;
}

bool& moe_persist_special_enabled() {
  static bool on = true;
  return on;
}

bool& topk_lanes_enabled() {
  static bool on = true;
  return on;
}

bool moe_router_topk_ok(const MoeDev& m, int T, bool fast) {
  return T == 1 && fast && m.H == kRouterCols && m.E <= 64 * kRouterWarps && m.K <= 8 && m.K <= m.E &&
         q8router_ok(m.router, m.E, m.H) &&
         q8router_ok(m.shared_gate, 1, m.H);
}

bool moe_persist_ok(const MoeDev& m, int T, bool fast) {
  return moe_router_topk_ok(m, T, fast) && m.I == 512 && m.Is == 512 && m.K <= 8 && q4ok(m.gate0) && q4ok(m.up0) &&
         q4ok(m.down0) && q4ok(m.sh_gate) && q4ok(m.sh_up) && q4ok(m.sh_down) && persist_smem(m) <= 48 * 1024 &&
         !(mma_q4_enabled() && mma_q4_all());   // LILY_MMA_Q4=all keeps testing the mma kernels
}

int64_t moe_workspace_floats(const MoeDev& m, int T) {
  const int imax = std::max(m.I, m.Is);
  return int64_t(T) * (m.E + 1 + m.K + (m.K + 1) * imax + m.K + 1) + 64;   // + padding of the sections
}

// Workspace sections start on 16-byte boundaries (the down kernel stages act with float4 loads):
// router logits [T, E], shared gate [T], ids [T, K], activations [T, K+1, imax], weights.
namespace {
int64_t r4(int64_t n) { return (n + 3) / 4 * 4; }
}  // namespace

const int32_t* moe_ids(const MoeDev& m, int T, const float* work) {
  return reinterpret_cast<const int32_t*>(work + r4(int64_t(T) * m.E) + r4(T));
}

void moe(const MoeDev& m, const float* x, int T, float* out, float* work, bool fast, int stages, cudaStream_t s,
         const MoeDecode* dec) {
  LILY_CHECK(m.E <= 1024 && m.K <= 32 && m.K <= m.E, "moe: at most 1024 experts and top-32 supported");
  const int imax = std::max(m.I, m.Is);
  MoeArgs a{};
  a.m = m;
  a.x = x;
  float* logits = work;
  float* sg = logits + r4(int64_t(T) * m.E);
  a.logits = logits;
  a.sg = sg;
  a.ids = reinterpret_cast<int32_t*>(sg + r4(T));
  a.act = sg + r4(T) + r4(int64_t(T) * m.K);
  a.out = out;
  a.imax = imax;
  a.wts = a.act + r4(int64_t(T) * (m.K + 1) * imax);
  // Decode fusions (T == 1): D9 folded norm and residual, D10 fused router + top-k.
  const GemvNorm* norm = dec && dec->norm.w ? &dec->norm : nullptr;
  LILY_CHECK(!norm || moe_norm_ok(m, T, fast), "moe: folded rmsnorm not supported for these weights");
  a.res = dec ? dec->res : nullptr;
  LILY_CHECK(!a.res || T == 1, "moe: folded residual only for decode");
  const bool fused_router = dec && dec->counter && moe_router_topk_ok(m, T, fast);
  a.topk_ready = fused_router ? 1 : 0;
  if (dec) {
    a.pf = dec->pf;
    a.pf_down = dec->pf_down && m.I == m.Is && m.I % 64 == 0 ? 1 : 0;
  }
  const bool fast_down = fast && m.I == 512 && m.Is == 512 && m.K <= 9 && q4ok(m.down0) && q4ok(m.sh_down);
  // D17 needs the ids from the router kernel (not gate/up) and the FFMA down kernel, and must be
  // set identically for the gate/up and down launches of one call.
  a.trace = dec ? dec->trace : nullptr;
  a.stage_regs = stage_regs_enabled() ? 1 : 0;
  a.flags = dec ? dec->flags : 0;
  a.lean_act = moe_lean_act_enabled() ? 1 : 0;   // D63
  a.xq16 = a.stage_regs && gemv_x16_enabled() && m.H == 2048 ? 1 : 0;   // the D21 staging path of D19
  a.topk_lanes = topk_lanes_enabled() && m.E <= 256 && m.K <= 8 ? 1 : 0;
  a.early_down = dec && dec->early_down && fused_router && fast_down && !(mma_q4_enabled() && mma_q4_all()) ? 1 : 0;
  // D19: the whole block as one persistent kernel (all three stages in one call).
  if (stages == 7 && dec && dec->persist && fused_router && moe_persist_ok(m, T, fast)) {
    static int grid = -1;
    static size_t grid_smem = 0;
    const size_t smem = persist_smem(m);
    if (grid < 0 || grid_smem != smem) {
      // All CTAs must be co-resident (they spin on each other): at most the occupancy per SM
      // (capped at 2, LILY_MOEP_CTAS_PER_SM overrides the cap) times the SM count. Every instance gets
      // the same grid: the ticket handoffs number launches by tickets / grid, and launches may mix them.
      const int sms = sm_count();
      int cap = 2;
      if (const char* v = std::getenv("LILY_MOEP_CTAS_PER_SM"); v && *v) cap = std::max(1, std::atoi(v));
      int per_sm = cap;
      for (const void* k : {reinterpret_cast<const void*>(moe_persist_kernel<false>),
                            reinterpret_cast<const void*>(moe_persist_kernel<true>),
                            reinterpret_cast<const void*>(moe_persist_kernel<true, true>),
                            reinterpret_cast<const void*>(moe_persist_rl_kernel),
                            reinterpret_cast<const void*>(moe_persist_rlw0_kernel),
                            reinterpret_cast<const void*>(moe_persist_rlw0_r88_kernel),
                            reinterpret_cast<const void*>(moe_persist_rl_free_kernel)}) {
        int n = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, kPersistThreads, smem));
        per_sm = std::min(per_sm, n);
      }
      grid = per_sm * sms;
      grid_smem = smem;
    }
    // D31: the default configuration's own instance (moe_persist_kernel<true>).
    const bool special = moe_persist_special_enabled() && a.stage_regs && a.xq16 && m.H == 2048 && m.E == 256 &&
                         m.K == 8 && m.I == 512 && m.Is == 512 && norm && a.res && a.topk_lanes &&
                         (a.flags & (1 | 16 | 64 | 128 | 256)) == 0;
    if (grid > 0) {
      // D36: the first slot's loads before the whole top-k (needs each CTA's first slot below K).
      const bool early = special && moe_early_pick_enabled() && (int64_t(grid - 1) * (kPersistThreads / 32)) / m.I < m.K;
      // D39: the logits from the launches before (the shared rows on warps 1..7 of the first 74 CTAs).
      const bool rl = early && dec->router_logits && int64_t(grid) * (kPersistThreads / 32 - 1) >= m.Is;
      a.rlog = rl ? dec->router_logits : nullptr;
      static const bool rl_free = [] {
        const char* v = std::getenv("LILY_D39_REGS");
        return v && *v && std::atoi(v) == 0;
      }();
      const auto w0_kernel = !moe_regs88_enabled()   ? moe_persist_rlw0_kernel
                             : moe_stage_il_enabled() ? moe_persist_rlw0_r88_fs_kernel
                                                      : moe_persist_rlw0_r88_kernel;
      launch(rl && rl_free ? moe_persist_rl_free_kernel
             : rl && moe_w0_pick_enabled() ? w0_kernel
             : rl        ? moe_persist_rl_kernel
             : early     ? moe_persist_kernel<true, true>
             : special ? moe_persist_kernel<true>
                       : moe_persist_kernel<false>,
             dim3(grid), dim3(kPersistThreads), smem,
             s, a, norm ? *norm : GemvNorm{}, dec->persist);
      CUDA_LAUNCH_CHECK();
      return;
    }
  }
  if (stages & 1) {
    if (fused_router) {
      launch(moe_router_topk_kernel, dim3((m.E + 1 + kRouterWarps - 1) / kRouterWarps), dim3(32 * kRouterWarps), 0,
             s, a, norm ? *norm : GemvNorm{}, dec->counter);
      CUDA_LAUNCH_CHECK();
    } else {
      GemvJob jobs[2] = {{m.router, x, logits}, {m.shared_gate, x, sg}};
      gemv_batch(jobs, 2, T, fast, s, norm, dec ? &dec->pf : nullptr);
    }
  }
  const bool fast_up = fast && m.H % 1024 == 0 && m.H <= 4096 && q4ok(m.gate0) && q4ok(m.up0) &&
                       q4ok(m.sh_gate) && q4ok(m.sh_up);
  const int items = m.K * m.I + m.Is;
  // One wave (2 CTAs per SM): every CTA repeats the top-k, so extra waves would repeat its latency.
  const int sms = sm_count();
  const int nb_up = std::min((items + 7) / 8, 2 * sms);
  const size_t smem_up = fast_up ? m.H * 4 + m.H / 32 * 4 : 16;
  const bool mma_up = fast && mma_q4_enabled() && mma_q4_all() && m.H % 256 == 0 && m.H <= 8192 && m.I % 8 == 0 &&
                      m.Is % 8 == 0 && q4ok(m.gate0) && q4ok(m.up0) && q4ok(m.sh_gate) && q4ok(m.sh_up);
  if (!(stages & 2)) {
  } else if (mma_up) {
    const int ks = mma_k_split(items / 8, m.H / 256, 2 * sms);
    const int sets = (items / 8 * ks + 7) / 8;
    launch(moe_gate_up_mma_kernel, dim3(std::min(sets, 2 * sms), T), dim3(256), size_t(m.H) * 4 + m.H / 64 * 8, s,
           a, ks);
  } else if (fast_up && m.H == 2048) {
    launch(moe_gate_up_kernel<true, 2>, dim3(nb_up, T), dim3(256), smem_up, s, a);
  } else if (fast_up) {
    launch(moe_gate_up_kernel<true, 4>, dim3(nb_up, T), dim3(256), smem_up, s, a);
  } else {
    launch(moe_gate_up_kernel<false, 2>, dim3(nb_up, T), dim3(256), smem_up, s, a);
  }
  if (!(stages & 4)) return;
  const int nb_down = (m.H + 15) / 16;
  const size_t smem_down = fast_down ? (m.K + 1) * 512 * 4 + (m.K + 1) * 16 * 4 : 16;
  if (fast_down && mma_q4_enabled() && mma_q4_all()) {
    launch(moe_down_mma_kernel, dim3(nb_down, T), dim3(32 * (m.K + 1)), 0, s, a);
  } else if (fast_down) {
    static bool attr = false;
    if (!attr) {
      CUDA_CHECK(cudaFuncSetAttribute(moe_down_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      33 * 512 * 4 + 33 * 16 * 4));
      attr = true;
    }
    launch(moe_down_kernel<true>, dim3(nb_down, T), dim3(256), smem_down, s, a);
  } else {
    launch(moe_down_kernel<false>, dim3(nb_down, T), dim3(256), smem_down, s, a);
  }
  CUDA_LAUNCH_CHECK();
}

// Test aid: the decode top-k selections on `rows` rows of E logits (one CTA of 256 threads per row):
// lanes = 0 runs select_topk_block, 1 select_topk_lanes; ids [rows, K] to the host.
__global__ void topk_test_kernel(const float* logits, int E, int K, int lanes, int* ids) {
  __shared__ __align__(16) float lg[256];
  __shared__ int sid[32];
  __shared__ float sv[32];
  __shared__ uint32_t ckey[32], cidx[32];
  const float* row = logits + int64_t(blockIdx.x) * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) lg[e] = row[e];
  __syncthreads();
  if (!lanes) select_topk_block(lg, E, K, ckey, cidx, sid, sv);
  else if (threadIdx.x < 32) select_topk_lanes(lg, E, K, sid, sv);
  __syncthreads();
  if (int(threadIdx.x) < K) ids[int64_t(blockIdx.x) * K + threadIdx.x] = sid[threadIdx.x];
}
void topk_select_test(const float* host_logits, int rows, int E, int K, bool lanes, int* host_ids) {
  LILY_CHECK(E >= 1 && E <= 256 && K >= 1 && K <= 8 && K <= E, "topk test: E <= 256, K <= 8");
  float* d = nullptr;
  int* o = nullptr;
  CUDA_CHECK(cudaMalloc(&d, sizeof(float) * size_t(rows) * E));
  CUDA_CHECK(cudaMalloc(&o, sizeof(int) * size_t(rows) * K));
  CUDA_CHECK(cudaMemcpy(d, host_logits, sizeof(float) * size_t(rows) * E, cudaMemcpyHostToDevice));
  topk_test_kernel<<<rows, 256>>>(d, E, K, lanes ? 1 : 0, o);
  CUDA_LAUNCH_CHECK();
  CUDA_CHECK(cudaMemcpy(host_ids, o, sizeof(int) * size_t(rows) * K, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaFree(d));
  CUDA_CHECK(cudaFree(o));
}

}  // namespace lily::cuda
