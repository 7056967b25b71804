// Causal flash attention for prefill (P6, P12): T query tokens at positions pos0..pos0+T-1 over the
// KV cache [0, pos0 + T), head_dim 256, 8 query heads per KV head.
//
// A CTA takes 16 consecutive tokens × the 8 query heads of one KV head (a 128-row query tile, warp w
// = head w of the group, 16 token rows), so each K/V tile it loads serves all 8 heads (GQA). Keys go
// by in tiles of 32: cp.async copies the f32 rows into a staging buffer one tile ahead, the CTA
// converts them to 16-bit tiles, and each warp computes S = Q·Kᵀ (16×32) and O += P·V (16×256) with
// mma.sync m16n8k16 (fp16 in by default, bf16 with LILY_ATTN_BF16=1; fp32 accumulate; fragments
// through ldmatrix, V transposed on the fly). fp16 has the same MMA rate and 8× less rounding error
// than bf16; its range suffices: q̂, k̂ are RMS-normalised (× gain), P ∈ [0, 1], and values are
// assumed |v| < 65504 (the conversion saturates there instead of producing inf/NaN).
// The softmax is online in fp32 in the log2 domain (log2 e folded into Q); the causal mask only
// touches tiles that reach past the block's first token. When the query tiles alone cannot fill the
// GPU (short chunks after a long prefix), the KV range is split over CTAs and a merge kernel
// combines their partial softmaxes; otherwise the kernel writes o × σ(gate) directly.
// With the fp16 KV cache (D18) the K/V tiles are cp.async'd straight from the cache (rows past the
// valid range zero-filled by the copy itself); with an f32 cache either every CTA converts its tiles
// or (LILY_ATTN_BF16KV, default) one pass converts the cache rows into a 16-bit copy first.
// P12 (default): the 16-bit-KV path takes keys in tiles of 64 (2-slot ring) instead of 32 (3 slots):
// per MMA half the barriers, softmax passes, rescale checks and Q fragment reloads. Opt-in
// experiments on top (docs/CUDA.md "P12"): LILY_ATTN_QREG=1 (Q fragments in registers) and
// LILY_ATTN_WG=1|2 (S, or S and P·V, on wgmma from 128-byte-swizzled tiles).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstring>

#include "backend/cuda/prefill_attn.h"

namespace lily::cuda {

namespace {

constexpr int kHD = 256;              // head dim
constexpr int kGQ = 8;                // query heads per KV head = warps per CTA
constexpr int kBQ = 16;               // tokens per CTA
constexpr int kBK = 32;               // keys per tile (P12 off, and the f32-staging path)
constexpr int kBK2 = 64;              // P12: keys per tile of the 16-bit-KV path
constexpr int kRS = kHD + 8;          // bf16 row stride in shared memory (528 B: ldmatrix rows hit distinct banks)
constexpr int kMaxSplits = 32;
constexpr int kPart = kHD + 2;        // partial row: Σ p·v [256], m, l
constexpr int kStages = 3;            // bf16-KV path: K/V tiles in flight (cp.async ring)
constexpr int kStages2 = 2;           // P12: ring of 2 tiles of 64 keys (3 would not fit: 270 KB)
constexpr size_t kSmemF32 = sizeof(float) * 2 * kBK * kHD                 // f32 staging K, V
                            + sizeof(__nv_bfloat16) * (2 * kBK + kGQ * kBQ) * kRS;   // bf16 K, V, Q
// K, V ring + Q of the 16-bit-KV path: 169 KB (32-key tiles × 3), 198 KB (P12: 64-key tiles × 2).
constexpr size_t smem_bf(int bk, int nst) { return sizeof(__nv_bfloat16) * (2 * nst * bk + kGQ * kBQ) * kRS; }
constexpr size_t kSmemBf = smem_bf(kBK, kStages);
constexpr size_t kSmemBf2 = smem_bf(kBK2, kStages2);
constexpr int kStagesQ = 3;           // QREG: 3 slots of 64 keys (Q staged in one of them)
constexpr size_t kSmemQreg = sizeof(__nv_bfloat16) * kStagesQ * 2 * kBK2 * kRS;
static_assert(kSmemBf2 <= 227 * 1024 && kSmemQreg <= 227 * 1024, "P12 tiles exceed the shared memory of an SM");

// 16-bit operands: fp16 (F16) or bf16, stored in __nv_bfloat16 arrays as raw 2-byte values.
// SAT: clamp to the fp16 range first (cache and query values; NaN stays NaN) — P ∈ [0, 1] needs none.
__device__ __forceinline__ float sat_f16(float x) { return fabsf(x) > 65504.f ? copysignf(65504.f, x) : x; }
template <bool F16, bool SAT = true>
__device__ __forceinline__ uint32_t pack16(float lo, float hi) {
  if constexpr (F16) {
    const __half2 v = SAT ? __floats2half2_rn(sat_f16(lo), sat_f16(hi)) : __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    return pack_bf16(lo, hi);
  }
}
template <bool F16>
__device__ __forceinline__ void mma16(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                      uint32_t b1) {
  if constexpr (F16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    mma_bf16(c, a0, a1, a2, a3, b0, b1);
  }
}

// 16 bytes global -> shared, or 16 zero bytes when !valid (src-size 0: nothing is read).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t n = valid ? 16u : 0u;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sa), "l"(gmem), "r"(n) : "memory");
}

struct FlashArgs {
  const float *kc, *vc, *qbuf, *q;
  // 16-bit K/V (BF_KV): the fp16 cache itself, or a 16-bit copy of its rows; rows >= pos0 + T are
  // never read (zero-filled in shared memory).
  const __nv_bfloat16 *kb, *vb;
  float *o, *part;
  int pos0, T, kv_heads, splits;
};

// grid (ceil(T/16), kv_heads, splits), 256 threads. Fragment naming as in the PTX ISA: lane =
// 4·gq + tq; accumulator c0,c1 = row gq, columns 2tq, 2tq+1; c2,c3 = row gq+8.
// BF_KV: K/V tiles come from a 16-bit copy of the cache by cp.async straight into a ring of NST tiles
// (one barrier per tile, no conversion); otherwise f32 rows are staged and converted by every CTA.
// F16: operands fp16 (else bf16). BK: keys per tile — 32 with NST = 3 (P6), 64 with NST = 2 (P12:
// half the barriers, softmax reductions, rescale checks and Q fragment loads per MMA; S is 32
// accumulators per thread instead of 16).
// QREG (opt-in experiment, LILY_ATTN_QREG=1): each warp keeps its 16×256 Q fragments in registers (64
// per thread) instead of reloading them from shared memory every tile; the Q tile is staged in the
// ring slot that the third tile will use, so the ring gets NST = 3 slots of 64 keys in the same 198 KB
// (slot = [K rows][V rows]).
template <bool BF_KV, bool F16, int BK = kBK, int NST = kStages, bool QREG = false>
__global__ void __launch_bounds__(kGQ * 32, 1) attn_flash_kernel(const __grid_constant__ FlashArgs a) {
  static_assert(BF_KV || BK == kBK, "the f32-staging path has 32-key tiles");
  static_assert(BK % 16 == 0 && NST >= 2, "tile shape");
  static_assert(!QREG || (BF_KV && 2 * BK >= kGQ * kBQ), "QREG stages Q in a ring slot");
  extern __shared__ __align__(16) unsigned char smraw[];
  float* stK = reinterpret_cast<float*>(smraw);                   // [BK][kHD] f32 (f32 path)
  float* stV = stK + BK * kHD;                                   // [BK][kHD] f32
  // bf16 K, V tiles: [BK][kRS] each (f32 path), or rings of NST tiles (BF_KV): slot s holds K at
  // Kb + s·kSlot and V kVOff further (all K slots then all V slots; QREG: slot = K rows then V rows).
  __nv_bfloat16* Kb = BF_KV ? reinterpret_cast<__nv_bfloat16*>(smraw) : reinterpret_cast<__nv_bfloat16*>(stV + BK * kHD);
  constexpr int kSlot = QREG ? 2 * BK * kRS : BK * kRS;
  constexpr int kVOff = QREG ? BK * kRS : (BF_KV ? NST : 1) * BK * kRS;
  pdl_trigger();
  pdl_wait();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int nqb = gridDim.x;
  const int t0 = (nqb - 1 - int(blockIdx.x)) * kBQ;               // longest rows first
  const int kvh = blockIdx.y, split = blockIdx.z, heads = a.kv_heads * kGQ;
  const int h = kvh * kGQ + warp;
  const int kv_len = a.pos0 + a.T;                                // valid cache rows
  const int kv_end = a.pos0 + min(t0 + kBQ, a.T);                 // keys this block can see
  const int ntiles = (kv_end + BK - 1) / BK;
  const int tps = (ntiles + a.splits - 1) / a.splits;
  const int tile_lo = split * tps, tile_hi = min(ntiles, tile_lo + tps);
  const int64_t rs = int64_t(a.kv_heads) * kHD;                   // cache row stride (floats)
  // Q tile [kGQ*kBQ][kRS], row = warp*16 + token: after the K/V tiles, or (QREG) in the slot of tile
  // tile_lo + NST - 1, which is first written after the loop's first barrier.
  __nv_bfloat16* Qb = QREG ? Kb + ((tile_lo + NST - 1) % NST) * kSlot : Kb + kVOff + (BF_KV ? NST : 1) * BK * kRS;

  if (tile_lo >= tile_hi) {   // empty slice of a split range: l = 0 marks it for the merge
    if (tid < kGQ * kBQ) {
      const int t = t0 + (tid & (kBQ - 1)), hh = kvh * kGQ + tid / kBQ;
      if (t < a.T) {
        float* pb = a.part + ((int64_t(t) * heads + hh) * a.splits + split) * kPart;
        pb[kHD] = -FLT_MAX;
        pb[kHD + 1] = 0.f;
      }
    }
    return;
  }

  auto issue_tile = [&](int it) {
    for (int idx = tid; idx < BK * (kHD / 4); idx += blockDim.x) {
      const int r = idx / (kHD / 4), c4 = idx % (kHD / 4), key = it * BK + r;
      if (key < kv_len) {
        cp_async16(stK + r * kHD + 4 * c4, a.kc + key * rs + kvh * kHD + 4 * c4);
        cp_async16(stV + r * kHD + 4 * c4, a.vc + key * rs + kvh * kHD + 4 * c4);
      }
    }
    cp_async_commit();
  };
  // BF_KV: tile it → ring slot it % NST; the copy holds whole tiles (zero rows past the cache).
  auto issue_bf = [&](int it) {
    __nv_bfloat16* kd = Kb + (it % NST) * kSlot;
    __nv_bfloat16* vd = kd + kVOff;
    for (int idx = tid; idx < BK * (kHD / 8); idx += blockDim.x) {
      const int r = idx / (kHD / 8), c8 = idx % (kHD / 8), key = it * BK + r;
      const bool ok = key < kv_len;   // the cache may end inside this tile (capacity not a tile multiple)
      const int64_t go = ok ? int64_t(key) * rs + kvh * kHD + 8 * c8 : 0;
      cp_async16_zfill(kd + r * kRS + 8 * c8, a.kb + go, ok);
      cp_async16_zfill(vd + r * kRS + 8 * c8, a.vb + go, ok);
    }
  };
  if constexpr (BF_KV) {
    for (int st = 0; st < NST - 1; ++st) {
      if (tile_lo + st < tile_hi) issue_bf(tile_lo + st);
      cp_async_commit();
    }
  } else {
    issue_tile(tile_lo);
  }

  // Q tile to bf16, scaled by log2 e (qbuf already carries hd^-1/2); rows past T are zero.
  const float kLog2e = 1.4426950408889634f;
  for (int idx = tid; idx < kGQ * kBQ * (kHD / 4); idx += blockDim.x) {
    const int row = idx / (kHD / 4), c4 = idx % (kHD / 4);
    const int t = t0 + (row & (kBQ - 1)), hh = kvh * kGQ + row / kBQ;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (t < a.T) v = reinterpret_cast<const float4*>(a.qbuf + (int64_t(t) * heads + hh) * kHD)[c4];
    uint2 pk;
    pk.x = pack16<F16>(v.x * kLog2e, v.y * kLog2e);
    pk.y = pack16<F16>(v.z * kLog2e, v.w * kLog2e);
    *reinterpret_cast<uint2*>(Qb + row * kRS + 4 * c4) = pk;
  }

  float oacc[kHD / 8][4];
#pragma unroll
  for (int n = 0; n < kHD / 8; ++n) oacc[n][0] = oacc[n][1] = oacc[n][2] = oacc[n][3] = 0.f;
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};
  // Last key each of the lane's two rows may see (rows past T act as row T-1 and are not stored).
  const int lim[2] = {a.pos0 + min(t0 + gq, a.T - 1), a.pos0 + min(t0 + gq + 8, a.T - 1)};
  const __nv_bfloat16* qw = Qb + warp * kBQ * kRS;
  // ldmatrix row addresses: A (Q) matrices {rows 0-7 | 8-15} × {cols 0-7 | 8-15}; B (K) matrices
  // {keys n..n+7 | n+8..n+15} × {dims k..k+7 | k+8..k+15}; V (trans) {keys | keys+8} × {dims | dims+8}.
  const int lr = lane & 7, lh = (lane >> 3) & 1, lq = lane >> 4;
  const __nv_bfloat16* qa = qw + (lr + 8 * lh) * kRS + 8 * lq;
  const int kao = (lr + 8 * lq) * kRS + 8 * lh, vao = (lr + 8 * lh) * kRS + 8 * lq;
  // QREG: the warp's Q fragments once (the barrier makes every thread's Q stores visible; the loop's
  // first barrier then orders these loads before the copy that reuses the slot).
  uint32_t qf[QREG ? kHD / 16 : 1][4];
  if constexpr (QREG) {
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kHD / 16; ++kk) ldsm_x4(qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], qa + kk * 16);
  }

  for (int it = tile_lo; it < tile_hi; ++it) {
    const __nv_bfloat16 *ka, *va;
    if constexpr (BF_KV) {
      cp_async_wait<NST - 2>();   // tile it has landed (this thread's copies)
      __syncthreads();                // everyone's copies; every warp is done with tile it-1's slot
      if (it + NST - 1 < tile_hi) issue_bf(it + NST - 1);   // into tile it-1's slot
      cp_async_commit();
      ka = Kb + (it % NST) * kSlot + kao;
      va = Kb + (it % NST) * kSlot + kVOff + vao;
    } else {
      cp_async_wait<0>();
      __syncthreads();   // staging holds tile it; every warp is done with the previous bf16 tiles
      for (int idx = tid; idx < BK * (kHD / 4); idx += blockDim.x) {
        const int r = idx / (kHD / 4), c4 = idx % (kHD / 4);
        const bool ok = it * BK + r < kv_len;   // rows past the cache are zero (never NaN garbage)
        const float4 kx = ok ? reinterpret_cast<const float4*>(stK + r * kHD)[c4] : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 vx = ok ? reinterpret_cast<const float4*>(stV + r * kHD)[c4] : make_float4(0.f, 0.f, 0.f, 0.f);
        *reinterpret_cast<uint2*>(Kb + r * kRS + 4 * c4) =
            make_uint2(pack16<F16>(kx.x, kx.y), pack16<F16>(kx.z, kx.w));
        *reinterpret_cast<uint2*>(Kb + kVOff + r * kRS + 4 * c4) =
            make_uint2(pack16<F16>(vx.x, vx.y), pack16<F16>(vx.z, vx.w));
      }
      __syncthreads();   // bf16 tiles ready, staging free
      if (it + 1 < tile_hi) issue_tile(it + 1);
      ka = Kb + kao;
      va = Kb + kVOff + vao;
    }

    // S = Q Kᵀ: 16 rows × BK keys (BK/8 n-tiles of 8), 16 k-steps over the head dim.
    float s[BK / 8][4];
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kHD / 16; ++kk) {
      uint32_t a0, a1, a2, a3;
      if constexpr (QREG) {
        a0 = qf[kk][0];
        a1 = qf[kk][1];
        a2 = qf[kk][2];
        a3 = qf[kk][3];
      } else {
        ldsm_x4(a0, a1, a2, a3, qa + kk * 16);
      }
#pragma unroll
      for (int np = 0; np < BK / 16; ++np) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(b0, b1, b2, b3, ka + np * 16 * kRS + kk * 16);
        mma16<F16>(s[2 * np], a0, a1, a2, a3, b0, b1);
        mma16<F16>(s[2 * np + 1], a0, a1, a2, a3, b2, b3);
      }
    }
    // Causal mask where the tile reaches past the block's first token.
    const int kbase = it * BK;
    if (kbase + BK - 1 > a.pos0 + t0) {
#pragma unroll
      for (int n = 0; n < BK / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (kbase + 8 * n + 2 * tq + (e & 1) > lim[e >> 1]) s[n][e] = -INFINITY;
    }
    // Online softmax (rows gq and gq+8; a row's 32 scores live in the 4 lanes of a quad).
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
      mx[0] = fmaxf(mx[0], fmaxf(s[n][0], s[n][1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[n][2], s[n][3]));
    }
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float mn = fmaxf(mrow[r], mx[r]);
      const float ref = mn == -INFINITY ? 0.f : mn;   // a row with nothing visible yet stays empty
      corr[r] = exp2f(mrow[r] - ref);
      mrow[r] = mn;
      mx[r] = ref;
    }
    float ls[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
      s[n][0] = exp2f(s[n][0] - mx[0]);
      s[n][1] = exp2f(s[n][1] - mx[0]);
      s[n][2] = exp2f(s[n][2] - mx[1]);
      s[n][3] = exp2f(s[n][3] - mx[1]);
      ls[0] += s[n][0] + s[n][1];
      ls[1] += s[n][2] + s[n][3];
    }
    lrow[0] = lrow[0] * corr[0] + ls[0];
    lrow[1] = lrow[1] * corr[1] + ls[1];
    if (!__all_sync(0xffffffffu, corr[0] == 1.f && corr[1] == 1.f)) {   // maxima mostly settle early
#pragma unroll
      for (int n = 0; n < kHD / 8; ++n) {
        oacc[n][0] *= corr[0];
        oacc[n][1] *= corr[0];
        oacc[n][2] *= corr[1];
        oacc[n][3] *= corr[1];
      }
    }
    // O += P V: P's accumulator layout is the A fragment layout of the next MMA (keys 16kk..16kk+15).
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const uint32_t p0 = pack16<F16, false>(s[2 * kk][0], s[2 * kk][1]);
      const uint32_t p1 = pack16<F16, false>(s[2 * kk][2], s[2 * kk][3]);
      const uint32_t p2 = pack16<F16, false>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      const uint32_t p3 = pack16<F16, false>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int np = 0; np < kHD / 16; ++np) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(b0, b1, b2, b3, va + kk * 16 * kRS + np * 16);
        mma16<F16>(oacc[2 * np], p0, p1, p2, p3, b0, b1);
        mma16<F16>(oacc[2 * np + 1], p0, p1, p2, p3, b2, b3);
      }
    }
  }

  // Row sums over the quad, then either the final output or this slice's partial.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 1);
    lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = t0 + gq + 8 * r;
    if (t >= a.T) continue;
    if (a.splits == 1) {
      const float inv = 1.f / lrow[r];
      const float* gate = a.q + (int64_t(t) * heads + h) * 2 * kHD + kHD;
      float* out = a.o + (int64_t(t) * heads + h) * kHD;
#pragma unroll
      for (int n = 0; n < kHD / 8; ++n) {
        const int e = 8 * n + 2 * tq;
        const float2 gv = *reinterpret_cast<const float2*>(gate + e);
        *reinterpret_cast<float2*>(out + e) =
            make_float2(oacc[n][2 * r] * inv * sigmoidf_(gv.x), oacc[n][2 * r + 1] * inv * sigmoidf_(gv.y));
      }
    } else {
      float* pb = a.part + ((int64_t(t) * heads + h) * a.splits + split) * kPart;
#pragma unroll
      for (int n = 0; n < kHD / 8; ++n)
        *reinterpret_cast<float2*>(pb + 8 * n + 2 * tq) = make_float2(oacc[n][2 * r], oacc[n][2 * r + 1]);
      if (tq == 0) {
        pb[kHD] = lrow[r] > 0.f ? mrow[r] : -FLT_MAX;
        pb[kHD + 1] = lrow[r];
      }
    }
  }
}


// ---- P12 experiment (LILY_ATTN_WG=1|2): S = Q·Kᵀ, and with 2 also O += P·V, on wgmma -------------
// The same CTA (8 warps = 2 warpgroups, warp w = head w, 16 tokens; warpgroup g = query rows 64g..
// 64g+63 of the Q tile) and the same 64-key tiles in a 2-slot cp.async ring, but the tiles are stored
// in the 128-byte-swizzled layout wgmma reads: a [rows][256] fp16 tile is 4 chunks of 64 columns, chunk
// c = [rows][128 B] with the 16-byte unit u of row r at ((u ^ (r & 7)) << 4). Q and K are K-major
// operands of S (descriptor: SBO 1024 = 8 rows); V is the N-major B operand of P·V (LBO 8 KB = the
// next 64 dims, SBO 1024 = the next 8 keys; imm-trans-b 1). wgmma's accumulator layout per warp is the
// m16n8k16 one (row 16w + gq (+8), column 8j + 2tq (+1)) and its register-A layout is the m16n8k16 A
// layout, so the softmax, the P packing and the epilogue are the mma.sync kernel's. Each warpgroup
// reads a K/V tile once per wgmma instead of each warp once per ldmatrix: shared-memory reads per
// tile drop from ~590 KB (P12) to ~384 KB (S only) or ~192 KB (S and P·V).
constexpr int kWgQ = kGQ * kBQ * kHD * 2;       // Q tile, 64 KB
constexpr int kWgKV = kBK2 * kHD * 2;           // one K or V tile of 64 keys, 32 KB
constexpr int kWgSlot = 2 * kWgKV;              // ring slot: K then V
constexpr size_t kSmemWg = size_t(kWgQ) + 2 * kWgSlot + 1024;   // + slack to align the base to 1024
static_assert(kSmemWg <= 227 * 1024, "wgmma flash tiles exceed the shared memory of an SM");
// P63: + the ring's mbarriers (full[2], empty[2]) and P67's Q barrier behind the two slots.
constexpr size_t kSmemWgTma = kSmemWg + 5 * 8;
static_assert(kSmemWgTma <= 227 * 1024, "wgmma flash tiles exceed the shared memory of an SM");
// P63: the K and V tensor maps ([kv rows][kv_heads * 256] fp16, rows past pos0 + T read as zeros).
struct FlashMaps {
  CUtensorMap k, v;
  CUtensorMap q;   // P67: the fp16 queries [T][heads][256] as dims (256, T, heads), box (64, 16 tokens, 8 heads)
};

__device__ __forceinline__ uint32_t wgf_swz(int r, int u) { return uint32_t(r * 128 + ((u ^ (r & 7)) << 4)); }
// Matrix descriptor, 128-byte swizzle (PTX ISA "matrix descriptor"): start, LBO, SBO (bytes).
__device__ __forceinline__ uint64_t wgf_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((saddr & 0x3FFFFu) >> 4) | (uint64_t((lbo & 0x3FFFFu) >> 4) << 16) |
         (uint64_t((sbo & 0x3FFFFu) >> 4) << 32) | (uint64_t(1) << 62);
}
__device__ __forceinline__ void wgf_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgf_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgf_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator reads/writes across the asynchronous wgmma.
template <int R>
__device__ __forceinline__ void wgf_regs(float* d) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// cp.async / st.shared writes made visible to the async proxy (wgmma operand reads).
__device__ __forceinline__ void wgf_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// D[64 x 64] += A[64 x 16] · B[16 x 64], A and B K-major in shared memory (descriptors), fp16 in, f32 out.
__device__ __forceinline__ void wgf_ss_n64(float* d, uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(1));
}
// D[64 x 256] += A[64 x 16] · B[16 x 256], A from registers (the m16n8k16 A layout per warp), B
// N-major (transposed) in shared memory, fp16 in, f32 out.
__device__ __forceinline__ void wgf_rs_n256_t(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(1));
}

// grid and arguments as attn_flash_kernel (fp16 operands, 16-bit K/V). PVW: P·V on wgmma too (else
// mma.sync with V fragments by ldmatrix.trans from the swizzled tile); PVW_SWAP (diagnostic,
// LILY_ATTN_WG=3): V's descriptor with LBO and SBO exchanged, to tell in one device run which reading
// of the N-major stride fields holds if WG=2 fails.
// TMA (P63, with PVW): a third warpgroup is the producer (registers moved to the consumers by setmaxnreg, 40 vs
// 232, as FA3 does: a ninth warp alone would cap every thread at 168): lane 0 of its first warp loads each 64-key
// K / V tile with 8 TMA copies (one per 64-dim chunk of K and of V, box 64 x 64, the same swizzled layout; keys past
// pos0 + T zero-filled by the map's bounds) into the 2-slot ring, completing on the slot's "full" mbarrier by transaction count, and
// reuses a slot once all 8 consumer warps have arrived on its "empty" mbarrier after the P·V that read it. The
// consumers no longer copy (16 cp.async and their address arithmetic per thread and tile: ~15 % of the
// kernel's stall samples at 4K, session 27 call 1) and no longer meet at a CTA barrier per tile, so each
// warpgroup runs on as soon as its next tile has landed: one warpgroup's softmax can overlap the other's
// products. Same operations on the same operands in the same order per row: the same bits.
// QT (P67, with TMA): a.qbuf holds the queries already as this kernel's fp16 operand (× log2 e, saturated:
// attention_prep's q16), loaded by the producer's first TMA copies (4 boxes of 64 dims x 16 tokens x 8 heads, rows
// past T zero) straight into the swizzled Q tile (row = head · 16 + token), completing on its own mbarrier; the
// consumers skip the conversion.
template <bool PVW, bool PVW_SWAP = false, bool P33 = true, bool TMA = false, bool QT = false>
__global__ void __launch_bounds__(kGQ * 32 + (TMA ? 128 : 0), 1)
    attn_flash_wg_kernel(const __grid_constant__ FlashArgs a, const __grid_constant__ FlashMaps maps) {
  static_assert(!TMA || PVW, "P63: the TMA ring serves the kernel with both products on wgmma");
  static_assert(TMA || !QT, "P67 needs P63's producer warpgroup");
  constexpr int BK = kBK2;
  extern __shared__ __align__(1024) unsigned char smwg[];
  const uint32_t raw0 = static_cast<uint32_t>(__cvta_generic_to_shared(smwg));
  const uint32_t pad = ((raw0 + 1023u) & ~1023u) - raw0;   // swizzle atoms need 1024-byte alignment
  unsigned char* sm = smwg + pad;                          // Q [4 chunks][128 rows][128 B], then 2 slots
  const uint32_t sQ = raw0 + pad;
  uint64_t* full = reinterpret_cast<uint64_t*>(sm + kWgQ + 2 * kWgSlot);   // P63: full[2], empty[2]
  uint64_t* empty = full + 2;
  uint64_t* qbar = full + 4;   // P67
  pdl_trigger();
  pdl_wait();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int wg = warp >> 2;
  const int nqb = gridDim.x;
  const int t0 = (nqb - 1 - int(blockIdx.x)) * kBQ;               // longest rows first
  const int kvh = blockIdx.y, split = blockIdx.z, heads = a.kv_heads * kGQ;
  const int h = kvh * kGQ + warp;
  const int kv_len = a.pos0 + a.T;
  const int kv_end = a.pos0 + min(t0 + kBQ, a.T);
  const int ntiles = (kv_end + BK - 1) / BK;
  const int tps = (ntiles + a.splits - 1) / a.splits;
  const int tile_lo = split * tps, tile_hi = min(ntiles, tile_lo + tps);
  const int64_t rs = int64_t(a.kv_heads) * kHD;

  if (tile_lo >= tile_hi) {   // empty slice of a split range: l = 0 marks it for the merge
    if (tid < kGQ * kBQ) {
      const int t = t0 + (tid & (kBQ - 1)), hh = kvh * kGQ + tid / kBQ;
      if (t < a.T) {
        float* pb = a.part + ((int64_t(t) * heads + hh) * a.splits + split) * kPart;
        pb[kHD] = -FLT_MAX;
        pb[kHD + 1] = 0.f;
      }
    }
    return;
  }

  // Tile it → slot it & 1: key row r, 16-byte unit U (dims 8U..8U+7) → chunk U / 8, unit U % 8.
  auto issue = [&](int it) {
    unsigned char* kd = sm + kWgQ + (it & 1) * kWgSlot;
    unsigned char* vd = kd + kWgKV;
    for (int idx = tid; idx < BK * (kHD / 8); idx += blockDim.x) {
      const int r = idx / (kHD / 8), U = idx % (kHD / 8), key = it * BK + r;
      const bool ok = key < kv_len;
      const int64_t go = ok ? int64_t(key) * rs + kvh * kHD + 8 * U : 0;
      const uint32_t off = (U >> 3) * (BK * 128) + wgf_swz(r, U & 7);
      cp_async16_zfill(kd + off, a.kb + go, ok);
      cp_async16_zfill(vd + off, a.vb + go, ok);
    }
  };
  if constexpr (TMA) {
    if (tid == 0) {
      mbar_init(&full[0], 1);
      mbar_init(&full[1], 1);
      mbar_init(&empty[0], kGQ);
      mbar_init(&empty[1], kGQ);
      if (QT) mbar_init(qbar, 1);
    }
    __syncthreads();   // the last CTA-wide barrier: the producer warpgroup leaves after its loop
    if (warp >= kGQ) {
      // The producer warpgroup gives registers back for the consumers (168 each at 384 threads per SM; FA3's split).
      asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
      if (warp == kGQ && lane == 0) {
        if constexpr (QT) {
          mbar_expect_tx(qbar, kWgQ);
#pragma unroll
          for (int c = 0; c < kHD / 64; ++c)
            tma_load_3d(sQ + c * (kGQ * kBQ * 128), &maps.q, 64 * c, t0, kvh * kGQ, smem_addr(qbar));
        }
        for (int i = 0; i < tile_hi - tile_lo; ++i) {
          const int sl = i & 1;
          if (i >= 2) mbar_wait_parity(&empty[sl], ((i >> 1) + 1) & 1);   // tile i - 2 fully consumed
          mbar_expect_tx(&full[sl], 2 * kWgKV);
          const uint32_t kd = sQ + kWgQ + sl * kWgSlot, fb = smem_addr(&full[sl]);
          const int key0 = (tile_lo + i) * BK;
#pragma unroll
          for (int c = 0; c < kHD / 64; ++c) {
            tma_load_2d(kd + c * (BK * 128), &maps.k, kvh * kHD + 64 * c, key0, fb);
            tma_load_2d(kd + kWgKV + c * (BK * 128), &maps.v, kvh * kHD + 64 * c, key0, fb);
          }
        }
      }
      return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  } else {
    issue(tile_lo);
    cp_async_commit();
  }

  // Q tile to fp16 × log2 e in the swizzled layout (row = warp*16 + token); rows past T are zero.
  // P33: eight float4 loads in flight per thread (off: one at a time, each waited for — ~8 % of the
  // kernel's stall samples at T = 4,096 in session 13's ncu run).
  const float kLog2e = 1.4426950408889634f;
  constexpr int kQUnits = kGQ * kBQ * (kHD / 4), kQBatch = P33 ? 8 : 1;
  static_assert(kQUnits % (kQBatch * kGQ * 32) == 0, "Q tile: whole batches per thread");
  for (int i0 = tid; i0 < kQUnits && !QT; i0 += kQBatch * kGQ * 32) {
    float4 v[kQBatch];
#pragma unroll
    for (int u = 0; u < kQBatch; ++u) {
      const int idx = i0 + u * kGQ * 32, row = idx / (kHD / 4), c4 = idx % (kHD / 4);
      const int t = t0 + (row & (kBQ - 1)), hh = kvh * kGQ + row / kBQ;
      v[u] = t < a.T ? reinterpret_cast<const float4*>(a.qbuf + (int64_t(t) * heads + hh) * kHD)[c4]
                     : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kQBatch; ++u) {
      const int idx = i0 + u * kGQ * 32, row = idx / (kHD / 4), c4 = idx % (kHD / 4);
      uint2 pk;
      pk.x = pack16<true>(v[u].x * kLog2e, v[u].y * kLog2e);
      pk.y = pack16<true>(v[u].z * kLog2e, v[u].w * kLog2e);
      const int U = c4 >> 1;
      *reinterpret_cast<uint2*>(sm + (U >> 3) * (kGQ * kBQ * 128) + wgf_swz(row, U & 7) + (c4 & 1) * 8) = pk;
    }
  }

  if constexpr (QT) {   // P67: the Q tile has landed (async proxy: no fence)
    mbar_wait_parity(qbar, 0);
  } else if constexpr (TMA) {   // the Q stores visible to wgmma, then every consumer's (named barrier: 8 warps)
    wgf_proxy_fence();
    asm volatile("bar.sync 1, %0;" ::"n"(kGQ * 32) : "memory");
  }

  float oacc[kHD / 8][4];
#pragma unroll
  for (int n = 0; n < kHD / 8; ++n) oacc[n][0] = oacc[n][1] = oacc[n][2] = oacc[n][3] = 0.f;
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};
  const int lim[2] = {a.pos0 + min(t0 + gq, a.T - 1), a.pos0 + min(t0 + gq + 8, a.T - 1)};
  // mma.sync P·V: ldmatrix.trans rows {keys 0-7 | 8-15} × {dims | dims+8}; key row & 7 = lr.
  const int lr = lane & 7, lh = (lane >> 3) & 1, lq = lane >> 4;
  const int vrow = (lr + 8 * lh) * 128;

  for (int it = tile_lo; it < tile_hi; ++it) {
    const int sl = TMA ? (it - tile_lo) & 1 : it & 1;
    if constexpr (TMA) {
      mbar_wait_parity(&full[sl], ((it - tile_lo) >> 1) & 1);   // tile it has landed (async proxy: no fence)
    } else {
      cp_async_wait<0>();   // tile it (this thread's copies; Q's stores are older)
      wgf_proxy_fence();    // ... visible to wgmma's reads
      __syncthreads();      // everyone's; every warpgroup is done with tile it-1's slot
      if (it + 1 < tile_hi) issue(it + 1);
      cp_async_commit();
    }
    const uint32_t kaddr = sQ + kWgQ + sl * kWgSlot, vaddr = kaddr + kWgKV;

    // S = Q Kᵀ for the warpgroup's 64 rows × 64 keys: 16 k-steps, 32 bytes apart inside a chunk.
    float s[BK / 8][4];
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    wgf_regs<BK / 2>(&s[0][0]);
    wgf_fence();
#pragma unroll
    for (int c = 0; c < kHD / 64; ++c)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        wgf_ss_n64(&s[0][0], wgf_desc(sQ + c * (kGQ * kBQ * 128) + wg * (64 * 128) + 32 * j, 16, 1024),
                   wgf_desc(kaddr + c * (BK * 128) + 32 * j, 16, 1024));
    wgf_commit();
    wgf_wait0();
    wgf_regs<BK / 2>(&s[0][0]);

    const int kbase = it * BK;
    if (kbase + BK - 1 > a.pos0 + t0) {
#pragma unroll
      for (int n = 0; n < BK / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (kbase + 8 * n + 2 * tq + (e & 1) > lim[e >> 1]) s[n][e] = -INFINITY;
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
      mx[0] = fmaxf(mx[0], fmaxf(s[n][0], s[n][1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[n][2], s[n][3]));
    }
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float mn = fmaxf(mrow[r], mx[r]);
      const float ref = mn == -INFINITY ? 0.f : mn;
      corr[r] = exp2f(mrow[r] - ref);
      mrow[r] = mn;
      mx[r] = ref;
    }
    float ls[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
      s[n][0] = exp2f(s[n][0] - mx[0]);
      s[n][1] = exp2f(s[n][1] - mx[0]);
      s[n][2] = exp2f(s[n][2] - mx[1]);
      s[n][3] = exp2f(s[n][3] - mx[1]);
      ls[0] += s[n][0] + s[n][1];
      ls[1] += s[n][2] + s[n][3];
    }
    lrow[0] = lrow[0] * corr[0] + ls[0];
    lrow[1] = lrow[1] * corr[1] + ls[1];
    if (!__all_sync(0xffffffffu, corr[0] == 1.f && corr[1] == 1.f)) {
#pragma unroll
      for (int n = 0; n < kHD / 8; ++n) {
        oacc[n][0] *= corr[0];
        oacc[n][1] *= corr[0];
        oacc[n][2] *= corr[1];
        oacc[n][3] *= corr[1];
      }
    }
    if constexpr (PVW) {
      // O += P V: one m64n256k16 per 16 keys, P from registers (all packed before the fence: the
      // A registers must not change while the wgmmas are in flight), V N-major from the slot.
      uint32_t pa[BK / 16][4];
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        pa[kk][0] = pack16<true, false>(s[2 * kk][0], s[2 * kk][1]);
        pa[kk][1] = pack16<true, false>(s[2 * kk][2], s[2 * kk][3]);
        pa[kk][2] = pack16<true, false>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[kk][3] = pack16<true, false>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      }
      wgf_regs<kHD / 2>(&oacc[0][0]);
      wgf_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
        wgf_rs_n256_t(&oacc[0][0], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3],
                      PVW_SWAP ? wgf_desc(vaddr + kk * (16 * 128), 1024, BK * 128)
                               : wgf_desc(vaddr + kk * (16 * 128), BK * 128, 1024));
      wgf_commit();
      wgf_wait0();
      wgf_regs<kHD / 2>(&oacc[0][0]);
      if constexpr (TMA) {
        if (lane == 0) mbar_arrive(&empty[sl]);   // this warp is done with the slot (its S and P·V have retired)
      }
    } else {
      const unsigned char* vs = sm + kWgQ + (it & 1) * kWgSlot + kWgKV + vrow;
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        const uint32_t p0 = pack16<true, false>(s[2 * kk][0], s[2 * kk][1]);
        const uint32_t p1 = pack16<true, false>(s[2 * kk][2], s[2 * kk][3]);
        const uint32_t p2 = pack16<true, false>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        const uint32_t p3 = pack16<true, false>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int np = 0; np < kHD / 16; ++np) {
          // dims 16np + 8lq.. → 16-byte unit U = 2np + lq: chunk U / 8, unit U % 8 (swizzled by lr).
          const int U = 2 * np + lq;
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(b0, b1, b2, b3, vs + kk * (16 * 128) + (U >> 3) * (BK * 128) + (((U & 7) ^ lr) << 4));
          mma16<true>(oacc[2 * np], p0, p1, p2, p3, b0, b1);
          mma16<true>(oacc[2 * np + 1], p0, p1, p2, p3, b2, b3);
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 1);
    lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = t0 + gq + 8 * r;
    if (t >= a.T) continue;
    if (a.splits == 1) {
      const float inv = 1.f / lrow[r];
      const float* gate = a.q + (int64_t(t) * heads + h) * 2 * kHD + kHD;
      float* out = a.o + (int64_t(t) * heads + h) * kHD;
      // P33: the gate in batches of 8 loads issued before the batch's stores (off: interleaved, each
      // load waits for its predecessor's store — out may alias the gate for the compiler).
      constexpr int GB = P33 ? 8 : 1;
#pragma unroll
      for (int n0 = 0; n0 < kHD / 8; n0 += GB) {
        float2 gv[GB];
#pragma unroll
        for (int u = 0; u < GB; ++u) gv[u] = *reinterpret_cast<const float2*>(gate + 8 * (n0 + u) + 2 * tq);
#pragma unroll
        for (int u = 0; u < GB; ++u) {
          const int n = n0 + u;
          *reinterpret_cast<float2*>(out + 8 * n + 2 * tq) = make_float2(
              oacc[n][2 * r] * inv * sigmoidf_(gv[u].x), oacc[n][2 * r + 1] * inv * sigmoidf_(gv[u].y));
        }
      }
    } else {
      float* pb = a.part + ((int64_t(t) * heads + h) * a.splits + split) * kPart;
#pragma unroll
      for (int n = 0; n < kHD / 8; ++n)
        *reinterpret_cast<float2*>(pb + 8 * n + 2 * tq) = make_float2(oacc[n][2 * r], oacc[n][2 * r + 1]);
      if (tq == 0) {
        pb[kHD] = lrow[r] > 0.f ? mrow[r] : -FLT_MAX;
        pb[kHD + 1] = lrow[r];
      }
    }
  }
}

// grid (heads, T), block 256: o = Σ_s acc_s 2^(m_s−M) / Σ_s l_s 2^(m_s−M) × σ(gate).
__global__ void __launch_bounds__(kHD) attn_flash_merge_kernel(const float* part, const float* q, int heads, int splits,
                                                               float* o) {
  pdl_trigger();
  pdl_wait();
  const int h = blockIdx.x, t = blockIdx.y, e = threadIdx.x;
  const float* pb = part + (int64_t(t) * heads + h) * splits * kPart;
  float M = -FLT_MAX;
  for (int s = 0; s < splits; ++s)
    if (pb[s * kPart + kHD + 1] > 0.f) M = fmaxf(M, pb[s * kPart + kHD]);
  float L = 0.f, A = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float l = pb[s * kPart + kHD + 1];
    if (l > 0.f) {
      const float f = exp2f(pb[s * kPart + kHD] - M);
      L = fmaf(l, f, L);
      A = fmaf(pb[s * kPart + e], f, A);
    }
  }
  const float gate = q[(int64_t(t) * heads + h) * 2 * kHD + kHD + e];
  o[(int64_t(t) * heads + h) * kHD + e] = A / L * sigmoidf_(gate);
}

// grid-stride, float4 → 4 fp16 / bf16: cache rows [0, rows) of K and V, zeros up to rows_pad (whole tiles).
template <bool F16>
__global__ void kv_to_16_kernel(const float* kc, const float* vc, int64_t n4, int64_t n4_pad, __nv_bfloat16* kb,
                                  __nv_bfloat16* vb) {
  pdl_trigger();
  pdl_wait();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4_pad; i += int64_t(gridDim.x) * blockDim.x) {
    float4 k = make_float4(0.f, 0.f, 0.f, 0.f), v = k;
    if (i < n4) {
      k = reinterpret_cast<const float4*>(kc)[i];
      v = reinterpret_cast<const float4*>(vc)[i];
    }
    reinterpret_cast<uint2*>(kb)[i] = make_uint2(pack16<F16>(k.x, k.y), pack16<F16>(k.z, k.w));
    reinterpret_cast<uint2*>(vb)[i] = make_uint2(pack16<F16>(v.x, v.y), pack16<F16>(v.z, v.w));
  }
}

// KV splits per query tile: enough CTAs for about two waves' worth of SMs (one CTA fits an SM),
// at most kMaxSplits. Depends on T only (the workspace is sized by T); the kernel clamps the
// slices to the tiles a block really has.
int flash_splits(const AttnDims& d, int T) {
  const int base = ((T + kBQ - 1) / kBQ) * d.kv_heads;
  const int want = 2 * sm_count();
  if (base >= want / 2) return 1;
  return std::min(kMaxSplits, (want + base - 1) / base);
}

}  // namespace

bool& attn_prefill_bk64_enabled() {
  static bool on = true;
  return on;
}
bool& attn_prefill_qreg_enabled() {
  static bool on = false;
  return on;
}
bool& attn_prefill_p33_enabled() {
  static bool on = true;
  return on;
}
bool& attn_prefill_p63_enabled() {
  static bool on = true;
  return on;
}
bool& attn_prefill_p67_enabled() {
  static bool on = true;
  return on;
}
int& attn_prefill_wg_mode() {
  static int mode = 2;
  return mode;
}

bool attention_prefill_ok(const AttnDims& d) {
  return d.head_dim == kHD && d.kv_heads > 0 && d.heads == d.kv_heads * kGQ && d.rot_dim <= kHD;
}

namespace {
int64_t part_floats(const AttnDims& d, int T) {
  const int splits = flash_splits(d, T);
  return ((int64_t(T) * d.heads * kHD + (splits > 1 ? int64_t(T) * d.heads * splits * kPart : 0) + 63) / 64) * 64;
}
int64_t kv_rows_pad(int pos0, int T) { return int64_t(pos0 + T + kBK - 1) / kBK * kBK; }
}  // namespace

int64_t attention_prefill_workspace_floats(const AttnDims& d, int T, int pos0, bool bf16_kv) {
  // bf16 K and V copies: 2 × rows × kv_heads × hd bf16 = rows × kv_heads × hd floats.
  return part_floats(d, T) + (bf16_kv ? kv_rows_pad(pos0, T) * d.kv_heads * kHD : 0) + 64;
}

void attention_prefill(const AttnDims& d, const float* q_norm, const float* k_norm, void* kc, void* vc, bool kv16,
                       int pos0, const float* q, const float* k, const float* v, int T, float* o, float* work,
                       bool bf16_kv, bool f16, cudaStream_t s) {
  LILY_CHECK(attention_prefill_ok(d), "attention prefill: unsupported shapes");
  LILY_CHECK(pos0 >= 0 && pos0 + T <= d.capacity, "attention prefill: KV cache overflow");
  if (kv16) {   // the cache is the 16-bit operand: fp16 MMA, no copy
    bf16_kv = true;
    f16 = true;
  }
  float* qbuf = work;
  float* part = work + int64_t(T) * d.heads * kHD;
  // P12: 64-key tiles in a 2-slot ring for the 16-bit-KV path (the f32-staging path keeps 32).
  const bool bk64 = bf16_kv && attn_prefill_bk64_enabled();
  const int wgm = bk64 && f16 ? attn_prefill_wg_mode() : 0;   // wgmma experiment: fp16 operands only
  const bool qreg = bk64 && !wgm && attn_prefill_qreg_enabled();
  const bool p63 = wgm == 2 && attn_prefill_p33_enabled() && attn_prefill_p63_enabled();
  FlashMaps maps;
  std::memset(&maps, 0, sizeof maps);
  bool q16 = false;   // P67: the prep writes the fp16 Q operand, the producer loads it by TMA
  if (p63 && attn_prefill_p67_enabled() && attention_prep_q16_ok(d, T, kv16)) {
    const uint64_t dims[3] = {uint64_t(kHD), uint64_t(T), uint64_t(d.heads)};
    const uint64_t strides[2] = {uint64_t(d.heads) * kHD * 2, uint64_t(kHD) * 2};   // token, head (bytes)
    const uint32_t box[3] = {64, uint32_t(kBQ), uint32_t(kGQ)};
    q16 = tma_map_f16_nd(&maps.q, qbuf, 3, dims, strides, box) == CUDA_SUCCESS;   // else the f32 queries
  }
  attention_prep(d, q_norm, k_norm, kc, vc, kv16, pos0, nullptr, q, k, v, T, qbuf, s, q16);
  const int bk = bk64 ? kBK2 : kBK;
  // Fewer splits when the longest block has few tiles (each slice keeps >= 4 tiles).
  const int max_tiles = (pos0 + T + bk - 1) / bk;
  const int splits = std::max(1, std::min(flash_splits(d, T), max_tiles / 4));
  static bool attr_set = false;
  if (!attr_set) {
    CUDA_CHECK(cudaFuncSetAttribute(attn_flash_kernel<true, false, kBK2, kStages2>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBf2)));
    CUDA_CHECK(cudaFuncSetAttribute(attn_flash_kernel<true, true, kBK2, kStages2>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBf2)));
    CUDA_CHECK(cudaFuncSetAttribute(attn_flash_wg_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kSmemWg)));
    CUDA_CHECK(cudaFuncSetAttribute(attn_flash_wg_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kSmemWg)));
    CUDA_CHECK(cudaFuncSetAttribute(attn_flash_wg_kernel<true, false, false>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemWg)));
    CUDA_CHECK(cudaFuncSetAttribute(attn_flash_wg_kernel<true, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kSmemWg)));
    CUDA_CHECK(cudaFuncSetAttribute(attn_flash_wg_kernel<true, false, true, true>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemWgTma)));
    CUDA_CHECK(cudaFuncSetAttribute(attn_flash_wg_kernel<true, false, true, true, true>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemWgTma)));
    CUDA_CHECK(cudaFuncSetAttribute(attn_flash_kernel<true, false, kBK2, kStagesQ, true>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemQreg)));
    CUDA_CHECK(cudaFuncSetAttribute(attn_flash_kernel<true, true, kBK2, kStagesQ, true>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemQreg)));
    CUDA_CHECK(cudaFuncSetAttribute(attn_flash_kernel<false, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kSmemF32)));
    CUDA_CHECK(cudaFuncSetAttribute(attn_flash_kernel<true, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kSmemBf)));
    CUDA_CHECK(cudaFuncSetAttribute(attn_flash_kernel<false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kSmemF32)));
    CUDA_CHECK(cudaFuncSetAttribute(attn_flash_kernel<true, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kSmemBf)));
    attr_set = true;
  }
  __nv_bfloat16 *kb = nullptr, *vb = nullptr;
  if (kv16) {
    kb = static_cast<__nv_bfloat16*>(kc);   // fp16 bits; the kernel only moves them (F16 = true)
    vb = static_cast<__nv_bfloat16*>(vc);
  } else if (bf16_kv) {
    const int64_t row = int64_t(d.kv_heads) * kHD;
    kb = reinterpret_cast<__nv_bfloat16*>(work + part_floats(d, T));
    vb = kb + kv_rows_pad(pos0, T) * row;
    const int64_t n4 = int64_t(pos0 + T) * row / 4, n4_pad = kv_rows_pad(pos0, T) * row / 4;
    const int blocks = int(std::min<int64_t>((n4_pad + 255) / 256, 8LL * sm_count()));
    if (f16)
      launch(kv_to_16_kernel<true>, dim3(blocks), dim3(256), 0, s, static_cast<const float*>(kc),
             static_cast<const float*>(vc), n4, n4_pad, kb, vb);
    else
      launch(kv_to_16_kernel<false>, dim3(blocks), dim3(256), 0, s, static_cast<const float*>(kc),
             static_cast<const float*>(vc), n4, n4_pad, kb, vb);
    CUDA_LAUNCH_CHECK();
  }
  const float* kf = kv16 ? nullptr : static_cast<const float*>(kc);
  const float* vf = kv16 ? nullptr : static_cast<const float*>(vc);
  FlashArgs fa{kf, vf, qbuf, q, kb, vb, o, part, pos0, T, d.kv_heads, splits};
  const dim3 grid((T + kBQ - 1) / kBQ, d.kv_heads, splits);
  if (p63) {
    // P63: rows = the keys this call reads (pos0 + T), so the last tile's keys past them arrive as zeros.
    const uint64_t inner = uint64_t(d.kv_heads) * kHD, rows = uint64_t(pos0 + T);
    tma_map_f16(&maps.k, kb, inner, rows, inner * 2, 64, kBK2, "attention prefill");
    tma_map_f16(&maps.v, vb, inner, rows, inner * 2, 64, kBK2, "attention prefill");
    const dim3 blk(kGQ * 32 + 128);
    if (q16) launch(attn_flash_wg_kernel<true, false, true, true, true>, grid, blk, kSmemWgTma, s, fa, maps);
    else launch(attn_flash_wg_kernel<true, false, true, true>, grid, blk, kSmemWgTma, s, fa, maps);
  } else if (wgm == 1)
    launch(attn_flash_wg_kernel<false>, grid, dim3(kGQ * 32), kSmemWg, s, fa, maps);
  else if (wgm == 2 && attn_prefill_p33_enabled())
    launch(attn_flash_wg_kernel<true>, grid, dim3(kGQ * 32), kSmemWg, s, fa, maps);
  else if (wgm == 2)
    launch(attn_flash_wg_kernel<true, false, false>, grid, dim3(kGQ * 32), kSmemWg, s, fa, maps);
  else if (wgm >= 3)
    launch(attn_flash_wg_kernel<true, true>, grid, dim3(kGQ * 32), kSmemWg, s, fa, maps);
  else if (qreg && f16)
    launch(attn_flash_kernel<true, true, kBK2, kStagesQ, true>, grid, dim3(kGQ * 32), kSmemQreg, s, fa);
  else if (qreg)
    launch(attn_flash_kernel<true, false, kBK2, kStagesQ, true>, grid, dim3(kGQ * 32), kSmemQreg, s, fa);
  else if (bk64 && f16)
    launch(attn_flash_kernel<true, true, kBK2, kStages2>, grid, dim3(kGQ * 32), kSmemBf2, s, fa);
  else if (bk64)
    launch(attn_flash_kernel<true, false, kBK2, kStages2>, grid, dim3(kGQ * 32), kSmemBf2, s, fa);
  else if (bf16_kv && f16)
    launch(attn_flash_kernel<true, true>, grid, dim3(kGQ * 32), kSmemBf, s, fa);
  else if (bf16_kv)
    launch(attn_flash_kernel<true, false>, grid, dim3(kGQ * 32), kSmemBf, s, fa);
  else if (f16)
    launch(attn_flash_kernel<false, true>, grid, dim3(kGQ * 32), kSmemF32, s, fa);
  else
    launch(attn_flash_kernel<false, false>, grid, dim3(kGQ * 32), kSmemF32, s, fa);
  CUDA_LAUNCH_CHECK();
  if (splits > 1) {
    launch(attn_flash_merge_kernel, dim3(d.heads, T), dim3(kHD), 0, s, (const float*)part, q, d.heads, splits, o);
    CUDA_LAUNCH_CHECK();
  }
}

}  // namespace lily::cuda
