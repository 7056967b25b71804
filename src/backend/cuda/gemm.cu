// Prefill GEMM (P1): y = x · Wᵀ on bf16 tensor cores with the MLX 4/8-bit dequantisation fused into
// the mainloop. A CTA computes a BM×128 output tile with 8 warps; per 64-column K step (one
// quantisation group) a cp.async stage brings BM rows of bf16 activations and 128 rows of packed
// codes into shared memory (4 stages in flight), plus every 8th step the scales/biases of the next
// 8 groups. Warps read A with ldmatrix and turn their codes into B fragments in registers: a nibble
// OR-ed into the mantissa of bf16 128.0 is 128 + q exactly, one bf16x2 subtract and one bf16x2 FMA
// with the group's scale/bias give the weight pair. The activations are staged in a permuted
// k-order (gemm.h) so that the 16 codes a thread owns per group are exactly its fragment elements.
// No dequantised matrix is ever written to global memory except by the P1-off ablation.
// 8-bit matrices (the router and the shared-expert gate) run in split precision: x = x_hi + x_lo
// and w = w_hi + w_lo as bf16 pairs, three MMAs per fragment (hi·hi + lo·hi + hi·lo), ~16-bit
// mantissas, so that top-k routing agrees with the f32 reference except at exact near-ties.
#include <cuda_bf16.h>

#include <cstdlib>

#include "backend/cuda/gemm.h"

namespace lily::cuda {

namespace {

constexpr bool kperm_is_bijection() {
  for (int L = 0; L < 64; ++L)
    if (gemm_kperm_inv(gemm_kperm(L)) != L || gemm_kperm(L) < 0 || gemm_kperm(L) > 63) return false;
  return true;
}
static_assert(kperm_is_bijection(), "gemm k-order must be a permutation of each 64-column group");

constexpr int kBK = 64;        // K per pipeline stage = one quantisation group
constexpr int kBN = 128;       // weight rows (output columns) per CTA
constexpr int kStages = 4;
constexpr int kThreads = 256;

enum : int { kStore = 0, kAccum = 1, kSwiGLU = 2, kScatter = 3 };

struct GemmArgs {
  const uint16_t* a;            // bf16 [rows, K] in mma k-order
  const uint16_t* a_lo;         // 8-bit B only: the bf16 remainders x - x_hi, same layout
  const int* a_rows;            // optional gather: position p reads A row a_rows[p]
  int K;
  int M;                        // plain mode: rows of A / y
  int N;                        // output columns (weight rows of one matrix)
  int swiglu;                   // B tile = 64 gate rows + 64 up rows, interleaved per 8
  GroupedB b;
  const int4* tiles;            // nullptr: plain mode, tile = blockIdx.x
  const int* n_tiles;
  int mode;
  float* y;
  int64_t ldy;
  uint16_t* act;
  int ld_act;
  const int* dst;
  const float* scale;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t bf2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 bits_bf2(uint32_t u) { return *reinterpret_cast<__nv_bfloat162*>(&u); }
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) { return bf2_bits(__floats2bfloat162_rn(lo, hi)); }

// Weight pair (nibble p, nibble p+4) of word w as bf16x2: (128 + q) - 128 is exact, then q·s + b
// with one rounding.
__device__ __forceinline__ uint32_t dq4_pair(uint32_t w, int p, __nv_bfloat162 s2, __nv_bfloat162 b2) {
  const uint32_t v = ((w >> (4 * p)) & 0x000F000Fu) | 0x43004300u;
  const __nv_bfloat162 q = __hsub2(bits_bf2(v), bits_bf2(0x43004300u));
  return bf2_bits(__hfma2(q, s2, b2));
}

// Byte `bt` of words wl/wh dequantised in f32, returned as bf16 pair `hi` and remainder pair `lo`.
__device__ __forceinline__ void dq8_pair(uint32_t wl, uint32_t wh, int bt, float s, float b, uint32_t& hi,
                                         uint32_t& lo) {
  const float v0 = fmaf(float((wl >> (8 * bt)) & 255u), s, b), v1 = fmaf(float((wh >> (8 * bt)) & 255u), s, b);
  const __nv_bfloat162 h = __floats2bfloat162_rn(v0, v1);
  hi = bf2_bits(h);
  lo = pack_bf16(v0 - __low2float(h), v1 - __high2float(h));
}

template <int BM>
struct Cfg {
  static constexpr int WM = BM == 32 ? 1 : 2;           // warps along M
  static constexpr int WN = 8 / WM;                     // warps along N
  static constexpr int WTM = BM / WM, WTN = kBN / WN;   // warp tile
  static constexpr int MT = WTM / 16, NT = WTN / 8;
  static_assert(NT % 2 == 0 && MT >= 1, "warp tile");
};

// Bytes of one weight row per stage in shared memory.
template <int BT>
constexpr int brow_bytes() {
  return BT == kQ4 ? 32 : BT == kQ8 ? 64 : 128;
}
template <int BT>
constexpr int a_tiles() {
  return BT == kQ8 ? 2 : 1;   // split precision: hi and lo activations
}
template <int BM, int BT>
constexpr int stage_bytes() {
  return a_tiles<BT>() * BM * 128 + kBN * brow_bytes<BT>();
}
template <int BM, int BT>
constexpr int smem_bytes() {
  return kStages * stage_bytes<BM, BT>() + (BT == kBF ? 0 : 2 * 2 * kBN * 16);
}

// Swizzled offset of 16-byte chunk c of a 128-byte row r (conflict-free ldmatrix and cp.async).
__device__ __forceinline__ int swz(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

template <int BM, int BT>
__global__ void __launch_bounds__(kThreads, 1) gemm_kernel(const __grid_constant__ GemmArgs a) {
  using C = Cfg<BM>;
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int RB = brow_bytes<BT>();
  constexpr int SB = stage_bytes<BM, BT>();
  constexpr int BCH = kBN * RB / 16 / kThreads;         // B chunks per thread per stage
  constexpr int ACH = BM * 8 / kThreads;                // A chunks per thread per stage (BM >= 32)
  static_assert(BCH >= 1 && ACH >= 1, "chunking");
  uint16_t* sbs = reinterpret_cast<uint16_t*>(smem + kStages * SB);   // [2][kBN][8] scales
  uint16_t* sbb = sbs + 2 * kBN * 8;                                  // [2][kBN][8] biases

  pdl_trigger();
  pdl_wait();
  int group = 0, pos0, rows;
  if (a.tiles) {
    if (int(blockIdx.x) >= *a.n_tiles) return;
    const int4 tl = a.tiles[blockIdx.x];
    group = tl.x;
    pos0 = tl.y;
    rows = tl.z;
  } else {
    pos0 = blockIdx.x * BM;
    rows = min(BM, a.M - pos0);
  }
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int K = a.K, nk = K / kBK;

  // ---- per-thread load plan ----
  // B rows: CTA row r -> (matrix, output column). SwiGLU interleaves gate/up per 8 rows.
  auto b_row = [&](int r, int& mat, int& col) {
    if (a.swiglu) {
      mat = (r >> 3) & 1;
      col = blockIdx.y * (kBN / 2) + (r >> 4) * 8 + (r & 7);
    } else {
      mat = 0;
      col = blockIdx.y * kBN + r;
    }
  };
  auto mat_of = [&](int mat) -> const QMat& { return group < a.b.n_groups ? a.b.w[mat] : a.b.extra[mat]; };
  const int64_t goff = group < a.b.n_groups ? int64_t(group) * a.b.stride : 0;
  const int64_t gsoff = group < a.b.n_groups ? int64_t(group) * a.b.sb_stride : 0;
  const int64_t row_bytes = BT == kQ4 ? K / 2 : BT == kQ8 ? K : 2 * K;

  const uint8_t* bsrc[BCH];
  bool bval[BCH];
  int bdst[BCH];
#pragma unroll
  for (int j = 0; j < BCH; ++j) {
    const int idx = tid + j * kThreads, r = idx / (RB / 16), c = idx % (RB / 16);
    int mat, col;
    b_row(r, mat, col);
    bval[j] = col < a.N;
    const QMat& w = mat_of(mat);
    bsrc[j] = static_cast<const uint8_t*>(w.data) + goff + int64_t(bval[j] ? col : 0) * row_bytes + c * 16;
    bdst[j] = BT == kBF ? swz(r, c) : r * RB + c * 16;
  }
  // Scales/biases: thread t < 2*kBN loads 16 bytes (8 groups) of one row's scales (t even) or biases.
  const uint8_t* sbsrc = nullptr;
  bool sbval = false;
  uint32_t sbdst = 0;
  if (BT != kBF && tid < 2 * kBN) {
    const int r = tid >> 1;
    int mat, col;
    b_row(r, mat, col);
    sbval = col < a.N;
    const QMat& w = mat_of(mat);
    const void* base = (tid & 1) ? w.biases : w.scales;
    sbsrc = static_cast<const uint8_t*>(base) + gsoff + int64_t(sbval ? col : 0) * (K / 64) * 2;
    sbdst = smem_addr(((tid & 1) ? sbb : sbs) + r * 8);
  }
  constexpr int AT = a_tiles<BT>();
  const uint16_t* asrc[ACH];
  bool aval[ACH];
  int adst[ACH];
#pragma unroll
  for (int j = 0; j < ACH; ++j) {
    const int idx = tid + j * kThreads, m = idx >> 3, c = idx & 7;
    aval[j] = m < rows;
    int src = 0;
    if (aval[j]) src = a.a_rows ? a.a_rows[pos0 + m] : pos0 + m;
    asrc[j] = a.a + int64_t(src) * K + c * 8;
    adst[j] = swz(m, c);
  }
  const uint32_t sm0 = smem_addr(smem);
  auto load_stage = [&](int kg) {
    const uint32_t st = sm0 + (kg % kStages) * SB;
#pragma unroll
    for (int j = 0; j < ACH; ++j) {
      cp_async16(st + adst[j], asrc[j] + kg * kBK, aval[j]);
      if (AT == 2) cp_async16(st + BM * 128 + adst[j], asrc[j] + (a.a_lo - a.a) + kg * kBK, aval[j]);
    }
#pragma unroll
    for (int j = 0; j < BCH; ++j) cp_async16(st + AT * BM * 128 + bdst[j], bsrc[j] + int64_t(kg) * RB, bval[j]);
    if (BT != kBF && (kg & 7) == 0 && sbsrc)
      cp_async16(sbdst + ((kg >> 3) & 1) * kBN * 16, sbsrc + (kg >> 3) * 16, sbval);
  };

  // ---- warp tile ----
  const int wm0 = (warp / C::WN) * C::WTM, wn0 = (warp % C::WN) * C::WTN;
  const int g = lane >> 2, t = lane & 3;
  float acc[C::MT][C::NT][4];
#pragma unroll
  for (int i = 0; i < C::MT; ++i)
#pragma unroll
    for (int j = 0; j < C::NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) load_stage(s);
    cp_commit();
  }

  for (int kg = 0; kg < nk; ++kg) {
    cp_wait<kStages - 2>();
    __syncthreads();
    if (kg + kStages - 1 < nk) load_stage(kg + kStages - 1);
    cp_commit();

    const uint8_t* st = smem + (kg % kStages) * SB;
    const uint32_t a_base = smem_addr(st);
    const uint8_t* bst = st + AT * BM * 128;
    // This group's codes and scales for the warp's NT n8-tiles (row wn0 + 8j + g).
    uint32_t cw[C::NT][BT == kQ8 ? 4 : 2];
    __nv_bfloat162 s2[C::NT], b2[C::NT];
    float sf[C::NT], bf[C::NT];
    if constexpr (BT != kBF) {
      const int sbi = ((kg >> 3) & 1) * kBN * 8 + (kg & 7);
#pragma unroll
      for (int j = 0; j < C::NT; ++j) {
        const int r = wn0 + 8 * j + g;
        if constexpr (BT == kQ4) {
          const uint2 v = *reinterpret_cast<const uint2*>(bst + r * 32 + 8 * t);
          cw[j][0] = v.x;
          cw[j][1] = v.y;
        } else {
          const uint4 v = *reinterpret_cast<const uint4*>(bst + r * 64 + 16 * t);
          cw[j][0] = v.x;
          cw[j][1] = v.y;
          cw[j][2] = v.z;
          cw[j][3] = v.w;
        }
        const uint16_t sv = sbs[sbi + r * 8], bv = sbb[sbi + r * 8];
        s2[j] = bits_bf2(uint32_t(sv) * 0x10001u);
        b2[j] = bits_bf2(uint32_t(bv) * 0x10001u);
        sf[j] = __uint_as_float(uint32_t(sv) << 16);
        bf[j] = __uint_as_float(uint32_t(bv) << 16);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {   // k16 steps of the group
      uint32_t af[C::MT][4], afl[AT == 2 ? C::MT : 1][4];
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt) {
        const int r = wm0 + mt * 16 + (lane & 15), c = 2 * i + (lane >> 4);
        ldsm_x4(a_base + swz(r, c), af[mt]);
        if constexpr (AT == 2) ldsm_x4(a_base + BM * 128 + swz(r, c), afl[mt]);
      }
      uint32_t bfr[C::NT][2], bfl[AT == 2 ? C::NT : 1][2];
      if constexpr (BT == kBF) {
#pragma unroll
        for (int p = 0; p < C::NT / 2; ++p) {
          const int q = lane >> 3;
          const int r = wn0 + (2 * p + (q >> 1)) * 8 + (lane & 7), c = 2 * i + (q & 1);
          uint32_t v[4];
          ldsm_x4(smem_addr(bst) + swz(r, c), v);
          bfr[2 * p][0] = v[0];
          bfr[2 * p][1] = v[1];
          bfr[2 * p + 1][0] = v[2];
          bfr[2 * p + 1][1] = v[3];
        }
      } else if constexpr (BT == kQ4) {
#pragma unroll
        for (int j = 0; j < C::NT; ++j) {
          const uint32_t w = cw[j][i >> 1];
          bfr[j][0] = dq4_pair(w, 2 * (i & 1), s2[j], b2[j]);
          bfr[j][1] = dq4_pair(w, 2 * (i & 1) + 1, s2[j], b2[j]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < C::NT; ++j) {
          const uint32_t wl = cw[j][2 * (i >> 1)], wh = cw[j][2 * (i >> 1) + 1];
          dq8_pair(wl, wh, 2 * (i & 1), sf[j], bf[j], bfr[j][0], bfl[j][0]);
          dq8_pair(wl, wh, 2 * (i & 1) + 1, sf[j], bf[j], bfr[j][1], bfl[j][1]);
        }
      }
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
        for (int j = 0; j < C::NT; ++j) {
          mma_bf16(acc[mt][j], af[mt], bfr[j][0], bfr[j][1]);
          if constexpr (AT == 2) {
            mma_bf16(acc[mt][j], afl[mt], bfr[j][0], bfr[j][1]);
            mma_bf16(acc[mt][j], af[mt], bfl[j][0], bfl[j][1]);
          }
        }
    }
  }
  cp_wait<0>();

  // ---- epilogue ----
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int m = wm0 + mt * 16 + g + 8 * hh;
      if (m >= rows) continue;
      const int64_t pos = pos0 + m;
      if (a.mode == kSwiGLU) {
        uint16_t* arow = a.act + pos * a.ld_act;
#pragma unroll
        for (int p = 0; p < C::NT / 2; ++p) {
          const int o = blockIdx.y * (kBN / 2) + wn0 / 2 + p * 8 + 2 * t;
          if (o >= a.N) continue;
          const float g0 = acc[mt][2 * p][2 * hh], g1 = acc[mt][2 * p][2 * hh + 1];
          const float u0 = acc[mt][2 * p + 1][2 * hh], u1 = acc[mt][2 * p + 1][2 * hh + 1];
          const float v0 = g0 / (1.f + __expf(-g0)) * u0, v1 = g1 / (1.f + __expf(-g1)) * u1;
          const int base = o & ~63, L0 = gemm_kperm_inv(o & 63), L1 = gemm_kperm_inv((o + 1) & 63);
          arow[base + L0] = __bfloat16_as_ushort(__float2bfloat16_rn(v0));
          if (o + 1 < a.N) arow[base + L1] = __bfloat16_as_ushort(__float2bfloat16_rn(v1));
        }
        continue;
      }
      float sc = 1.f;
      int64_t orow = pos;
      if (a.mode == kScatter) {
        orow = a.dst[pos];
        sc = a.scale[pos];
      }
      float* yrow = a.y + orow * a.ldy;
#pragma unroll
      for (int j = 0; j < C::NT; ++j) {
        const int n = blockIdx.y * kBN + wn0 + 8 * j + 2 * t;
        const float v0 = sc * acc[mt][j][2 * hh], v1 = sc * acc[mt][j][2 * hh + 1];
        if (n + 1 < a.N && (a.ldy & 1) == 0) {
          float2* p = reinterpret_cast<float2*>(yrow + n);
          if (a.mode == kAccum) {
            const float2 o = *p;
            *p = make_float2(o.x + v0, o.y + v1);
          } else {
            *p = make_float2(v0, v1);
          }
        } else {
          if (n < a.N) yrow[n] = a.mode == kAccum ? yrow[n] + v0 : v0;
          if (n + 1 < a.N) yrow[n + 1] = a.mode == kAccum ? yrow[n + 1] + v1 : v1;
        }
      }
    }
}

// x f32 -> bf16 in mma k-order; one thread writes 8 consecutive staged columns (16 bytes), and
// with xl the bf16 remainders x - bf16(x) in the same order.
__global__ void convert_a_kernel(const float* __restrict__ x, int T, int K, uint16_t* __restrict__ xb,
                                 uint16_t* __restrict__ xl) {
  pdl_trigger();
  pdl_wait();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;   // chunk of 8
  if (i >= int64_t(T) * (K / 8)) return;
  const int64_t row = i / (K / 8);
  const int c8 = int(i % (K / 8)), G = c8 >> 3, L0 = (c8 & 7) * 8;
  const float* src = x + row * K + G * 64;
  uint32_t o[4], r[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const float v0 = src[gemm_kperm(L0 + 2 * u)], v1 = src[gemm_kperm(L0 + 2 * u + 1)];
    const __nv_bfloat162 h = __floats2bfloat162_rn(v0, v1);
    o[u] = bf2_bits(h);
    r[u] = pack_bf16(v0 - __low2float(h), v1 - __high2float(h));
  }
  reinterpret_cast<uint4*>(xb)[i] = make_uint4(o[0], o[1], o[2], o[3]);
  if (xl) reinterpret_cast<uint4*>(xl)[i] = make_uint4(r[0], r[1], r[2], r[3]);
}

// P1 off: W -> bf16 [rows, cols] in mma k-order (same rounding as the fused path: s·q + b once).
__global__ void dequant_kernel(const QMat w, uint16_t* __restrict__ wb) {
  pdl_trigger();
  pdl_wait();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;   // chunk of 8
  if (i >= int64_t(w.rows) * (w.cols / 8)) return;
  const int64_t row = i / (w.cols / 8);
  const int c8 = int(i % (w.cols / 8)), G = c8 >> 3, L0 = (c8 & 7) * 8;
  uint32_t o[4];
#pragma unroll
  for (int u = 0; u < 4; ++u)
    o[u] = pack_bf16(qm_at(w, row, G * 64 + gemm_kperm(L0 + 2 * u)), qm_at(w, row, G * 64 + gemm_kperm(L0 + 2 * u + 1)));
  reinterpret_cast<uint4*>(wb)[i] = make_uint4(o[0], o[1], o[2], o[3]);
}

int sm_count() {
  static int sms = 0;
  if (!sms) CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  return sms;
}

template <int BM, int BT>
void launch_gemm(const GemmArgs& a, int grid_m, int grid_n, cudaStream_t s) {
  static bool attr = false;
  if (!attr) {
    CUDA_CHECK(cudaFuncSetAttribute(gemm_kernel<BM, BT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    smem_bytes<BM, BT>()));
    attr = true;
  }
  launch(gemm_kernel<BM, BT>, dim3(grid_m, grid_n), dim3(kThreads), size_t(smem_bytes<BM, BT>()), s, a);
}

template <int BT>
void launch_bm(int bm, const GemmArgs& a, int grid_m, int grid_n, cudaStream_t s) {
  if (bm == 128) launch_gemm<128, BT>(a, grid_m, grid_n, s);
  else if (bm == 64) launch_gemm<64, BT>(a, grid_m, grid_n, s);
  else launch_gemm<32, BT>(a, grid_m, grid_n, s);
}

void launch_any(int bt, int bm, const GemmArgs& a, int grid_m, int grid_n, cudaStream_t s) {
  if (bt == kQ4) launch_bm<kQ4>(bm, a, grid_m, grid_n, s);
  else if (bt == kQ8) launch_bm<kQ8>(bm, a, grid_m, grid_n, s);
  else launch_bm<kBF>(bm, a, grid_m, grid_n, s);
  CUDA_LAUNCH_CHECK();
}

int env_int(const char* name, int def) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : def;
}

}  // namespace

bool gemm_ok(const QMat& w) {
  return (w.type == kQ4 || w.type == kQ8) && w.gs == 64 && !w.sb_f32 && w.cols % 512 == 0 && w.rows > 0;
}

void gemm_convert_a(const float* x, int T, int K, uint16_t* xb, uint16_t* xl, cudaStream_t s) {
  const int64_t n = int64_t(T) * (K / 8);
  launch(convert_a_kernel, dim3(unsigned((n + 255) / 256)), dim3(256), 0, s, x, T, K, xb, xl);
  CUDA_LAUNCH_CHECK();
}

int64_t gemm_dequant_bytes(const QMat& w) { return int64_t(w.rows) * w.cols * 2; }

void gemm_dequant(const QMat& w, uint16_t* wb, cudaStream_t s) {
  const int64_t n = int64_t(w.rows) * (w.cols / 8);
  launch(dequant_kernel, dim3(unsigned((n + 255) / 256)), dim3(256), 0, s, w, wb);
  CUDA_LAUNCH_CHECK();
}

void gemm(const QMat& w, const uint16_t* xb, const uint16_t* xl, int T, float* y, int64_t ldy, bool accumulate,
          const uint16_t* wb, int bm, cudaStream_t s) {
  LILY_CHECK(gemm_ok(w), "gemm: unsupported weight matrix");
  LILY_CHECK(w.type != kQ8 || (xl && !wb), "gemm: 8-bit weights need the split activations, no P1-off copy");
  const int gn = (w.rows + kBN - 1) / kBN;
  if (!bm) bm = env_int("LILY_GEMM_BM", 0);
  if (bm != 32 && bm != 64 && bm != 128) {
    // Largest M-tile that still fills the GPU (B re-reads fall with BM, idle SMs cost more).
    auto ctas = [&](int m) { return int64_t((T + m - 1) / m) * gn; };
    bm = 128;
    if (ctas(128) < sm_count()) bm = 64;
    if (bm == 64 && (T <= 32 || ctas(64) < sm_count())) bm = 32;
  }
  GemmArgs a{};
  a.a = xb;
  a.a_lo = xl;
  a.K = w.cols;
  a.M = T;
  a.N = w.rows;
  a.b.w[0] = w;
  a.b.n_groups = 1;
  a.mode = accumulate ? kAccum : kStore;
  a.y = y;
  a.ldy = ldy;
  int bt = w.type;
  if (wb) {
    a.b.w[0].type = kBF;
    a.b.w[0].data = wb;
    bt = kBF;
  }
  launch_any(bt, bm, a, (T + bm - 1) / bm, gn, s);
}

void gemm_grouped_swiglu(const GroupedB& b, const uint16_t* xb, const int* a_rows, const int4* tiles,
                         const int* n_tiles, int max_tiles, int bm, uint16_t* act, int ld_act, cudaStream_t s) {
  GemmArgs a{};
  a.a = xb;
  a.a_rows = a_rows;
  a.K = b.w[0].cols;
  a.N = b.w[0].rows;
  a.swiglu = 1;
  a.b = b;
  a.tiles = tiles;
  a.n_tiles = n_tiles;
  a.mode = kSwiGLU;
  a.act = act;
  a.ld_act = ld_act;
  launch_any(kQ4, bm, a, max_tiles, (a.N + kBN / 2 - 1) / (kBN / 2), s);
}

void gemm_grouped_scatter(const GroupedB& b, const uint16_t* act, const int4* tiles, const int* n_tiles,
                          int max_tiles, int bm, const int* dst, const float* scale, float* y, int64_t ldy,
                          cudaStream_t s) {
  GemmArgs a{};
  a.a = act;
  a.K = b.w[0].cols;
  a.N = b.w[0].rows;
  a.b = b;
  a.tiles = tiles;
  a.n_tiles = n_tiles;
  a.mode = kScatter;
  a.dst = dst;
  a.scale = scale;
  a.y = y;
  a.ldy = ldy;
  launch_any(kQ4, bm, a, max_tiles, (a.N + kBN - 1) / kBN, s);
}

}  // namespace lily::cuda
