// Prefill GEMM (P1): y = x · Wᵀ on fp16 (default) or bf16 (LILY_GEMM_BF16=1) tensor cores with the
// MLX 4/8-bit dequantisation fused into the mainloop. A CTA computes a BM×BN output tile with 8 warps
// (BN = 128, or 256 with P10 for 4-bit and 16-bit B: see Cfg); per 64-column K step (one
// quantisation group) a cp.async stage brings BM rows of bf16 activations and BN rows of packed
// codes into shared memory (4 stages in flight), plus every 8th step the scales/biases of the next
// 8 groups. Warps read A with ldmatrix and turn their codes into B fragments in registers: a nibble
// OR-ed into the mantissa of bf16 128.0 (fp16 1024.0) is 128 + q (1024 + q) exactly, one x2 subtract
// and one x2 FMA with the group's scale/bias give the weight pair, rounded once.
// fp16 has 3 more mantissa bits than bf16 (8x smaller rounding error) but a range of ±65504, so:
// activations are converted with a per-row power-of-two scale 2^s (max|x|·2^s in [2^14, 2^15)),
// weights use s·2^8 and b·2^8 (small scales stay out of fp16 subnormals), and the f32 epilogue
// multiplies by 2^-(s+8). The SwiGLU activations of the MoE (written by the gate/up epilogue, whose
// row maximum no single CTA sees) get one exponent per (row, 64-column group); the down GEMM
// (AM = 2) rescales each group's A fragments to the row's largest-group exponent with one HMUL2
// (exact: powers of two ≤ 1) and undoes the row exponent in its epilogue. The activations are staged in a permuted
// k-order (gemm.h) so that the 16 codes a thread owns per group are exactly its fragment elements.
// No dequantised matrix is ever written to global memory except by the P1-off ablation.
// 8-bit matrices (the router and the shared-expert gate) run in split precision: x = x_hi + x_lo
// and w = w_hi + w_lo as bf16 pairs, three MMAs per fragment (hi·hi + lo·hi + hi·lo), ~16-bit
// mantissas, so that top-k routing agrees with the f32 reference except at exact near-ties.
#include <cuda.h>   // CUtensorMap (P13's TMA variant; encoded by tma_map_f16, cuda_backend.cu)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend/cuda/gemm.h"
#include "backend/cuda/cuda_ops.h"   // rmsnorm (the P25 probe's reference path)

namespace lily::cuda {

namespace {

constexpr bool kperm_is_bijection() {
  for (int L = 0; L < 64; ++L)
    if (gemm_kperm_inv(gemm_kperm(L)) != L || gemm_kperm(L) < 0 || gemm_kperm(L) > 63) return false;
  return true;
}
static_assert(kperm_is_bijection(), "gemm k-order must be a permutation of each 64-column group");

constexpr int kBK = 64;        // K per pipeline stage = one quantisation group
constexpr int kBN = 128;       // weight rows (output columns) per CTA: the wgmma kernel, P10 off
constexpr int kBNWide = 256;   // P10: the mma.sync kernel's wide tile
constexpr int kBNMoe = 512;    // P10 at 512: the MoE's grouped GEMMs, 4-bit B, fp16, BM <= 64
#ifndef LILY_P10_MINB   // min_ctas below: -DLILY_P10_MINB=1 lets those kernels take ~190 registers
#define LILY_P10_MINB 2
#endif
constexpr int kStages = 4;
constexpr int kThreads = 256;

enum : int { kStore = 0, kAccum = 1, kSwiGLU = 2, kScatter = 3 };

// A operand modes: bf16; fp16 with a per-row scale (a_scale[row] = 2^-s); fp16 with per-(row, group)
// exponents act_exp (the down GEMM of the MoE).
enum : int { kAmBf16 = 0, kAmF16 = 1, kAmF16Grp = 2 };
constexpr float kInvW = 1.f / float(1 << kGemmF16WExp);   // undoes the 2^8 weight scale
constexpr int kMaxGrpK = 1024;                             // AM = 2: K / 64 <= 16 groups

struct GemmArgs {
  const uint16_t* a;            // bf16/fp16 [rows, K] in mma k-order
  const uint16_t* a_lo;         // 8-bit B only: the bf16 remainders x - x_hi, same layout
  const float* a_scale;         // fp16: 2^-s per A row
  int8_t* act_exp;              // SwiGLU (fp16): out, exponent per (row, 64-column group); AM 2: in
  int ld_exp;                   // groups per row of act_exp
  const int* a_rows;            // optional gather: position p reads A row a_rows[p]
  int K;
  int M;                        // plain mode: rows of A / y
  int N;                        // output columns (weight rows of one matrix)
  int swiglu;                   // B tile = 64 gate rows + 64 up rows, interleaved per 8
  GroupedB b;
  const int4* tiles;            // nullptr: plain mode, tile = blockIdx.x
  const int* n_tiles;
  int raster;                   // plain mode, mma.sync: M tiles per band of the tile order (0: none)
  int mode;
  float* y;
  int64_t ldy;
  uint16_t* act;
  int ld_act;
  const int* dst;
  bool pre_scatter;   // P35 (gemm_kernel, AM 2, kScatter): dst / scale read before the mainloop
  const float* scale;
  int y16;                      // P16, scatter mode on the mma.sync kernel: y holds fp16 (saturated), ldy in halves
  int var_n;                    // P38 (P34 MoE kernel): wgmma N = the tile's rows rounded up to 32, not 128
  int skip_pad;                 // P39 (gemm_kernel, AM 2): no MMAs for m16 tiles past the tile's rows
  int n_fast;                   // P43 (gemm_kernel, grouped): the grid walked N tile fastest
  // P30 (plain store mode, P13 kernel only): nseg > 0 splits the output columns into segments; column
  // n of segment q (seg_n0[q] <= n < seg_n0[q + 1]) is written to seg_y[q] + row · seg_ld[q] + n - seg_n0[q].
  int nseg;
  int seg_n0[kGemmMaxSegs];
  float* seg_y[kGemmMaxSegs];
  int64_t seg_ld[kGemmMaxSegs];
  int seg_h16;   // P62: bit q set = segment q written as saturated fp16 (seg_y[q] read as __half*)
  // P37 (plain store mode, 8-bit B): ksplit > 1 cuts K into ksplit equal slices (multiples of 512), one
  // per blockIdx.z; slice z writes its partial product to y + z · zstride (the caller sums the slices).
  // Last, so that the other fields keep their offsets (and every other kernel its SASS).
  int ksplit;
  int64_t zstride;
  int p81;   // P81 (P13 kernel, P62's fp16 segments): a warp's 16 x 64 output blocks stored through shared memory
};

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
__device__ __forceinline__ void mma_f16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t h2_bits(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __half2 bits_h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }
__device__ __forceinline__ uint32_t bf2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 bits_bf2(uint32_t u) { return *reinterpret_cast<__nv_bfloat162*>(&u); }
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) { return bf2_bits(__floats2bfloat162_rn(lo, hi)); }

// fp16 weight pair (nibble p, nibble p+4) of word w: (1024 + q) - 1024 is exact, then q·s + b with one
// rounding. `magic` is 0x64006400; P32 passes it in a register ptxas cannot fold (0x64006400 ^ (K &
// 0x80000000), K >= 0), so that mask and magic are one LOP3 (a SASS LOP3 takes one immediate). s, b: the
// pair's scale and bias (P32: one row of a packed pair, through the HFMA2's operand selectors).
__device__ __forceinline__ uint32_t dq4_pair_m(uint32_t w, int p, __half2 s, __half2 b, uint32_t magic) {
  const uint32_t v = ((w >> (4 * p)) & 0x000F000Fu) | magic;
  const __half2 q = __hsub2(bits_h2(v), bits_h2(0x64006400u));
  return h2_bits(__hfma2(q, s, b));
}
// Weight pair (nibble p, nibble p+4) of word w as bf16x2 / fp16x2: (128 + q) - 128 (fp16:
// (1024 + q) - 1024) is exact, then q·s + b with one rounding. s2, b2: the pair's scale and bias.
template <bool F16>
__device__ __forceinline__ uint32_t dq4_pair(uint32_t w, int p, uint32_t s2, uint32_t b2) {
  if constexpr (F16) {
    return dq4_pair_m(w, p, bits_h2(s2), bits_h2(b2), 0x64006400u);
  } else {
    const uint32_t v = ((w >> (4 * p)) & 0x000F000Fu) | 0x43004300u;
    const __nv_bfloat162 q = __hsub2(bits_bf2(v), bits_bf2(0x43004300u));
    return bf2_bits(__hfma2(q, bits_bf2(s2), bits_bf2(b2)));
  }
}

// fp16 unpacking of pair p (nibbles p, p + 4) of word w with scale s and bias b, w8 = w >> 8. With magic opaque to
// the compiler (the caller makes it so; P46 for the down GEMM) the mask and the exponent OR are one LOP3 (a LOP3
// takes one immediate). kOdd (P47 for the down GEMM, P50 for the gate/up kernel): an odd pair is read in place,
// (w & 0x00F000F0) | magic = 1024 + 16q, and brought to q by one HFMA2 (x / 16 - 64, exact), so a word needs one
// shift (w >> 8, pairs 2 and 3) instead of three (4, 8, 12). Both give q exactly, then the same q·s + b: the same
// bits as dq4_pair_m.
template <bool kOdd>
__device__ __forceinline__ uint32_t dq4_pair_odd(uint32_t w, uint32_t w8, int p, __half2 s, __half2 b, uint32_t magic) {
  __half2 q;
  if (kOdd && (p & 1)) {
    const uint32_t v = ((p >= 2 ? w8 : w) & 0x00F000F0u) | magic;
    q = __hfma2(bits_h2(v), bits_h2(0x2C002C00u), bits_h2(0xD400D400u));   // x · 2^-4 - 64
  } else {
    const uint32_t v = kOdd ? ((p >= 2 ? w8 : w) & 0x000F000Fu) | magic : ((w >> (4 * p)) & 0x000F000Fu) | magic;
    q = __hsub2(bits_h2(v), bits_h2(0x64006400u));
  }
  return h2_bits(__hfma2(q, s, b));
}
// The MoE down GEMM's form: scale and bias packed in sb (low, high half).
template <bool kOdd>
__device__ __forceinline__ uint32_t dq4_pair_down(uint32_t w, uint32_t w8, int p, uint32_t sb, uint32_t magic) {
  return dq4_pair_odd<kOdd>(w, w8, p, __low2half2(bits_h2(sb)), __high2half2(bits_h2(sb)), magic);
}

// The same with the scale and bias packed in one word (low half: scale, high half: bias), each
// broadcast to both lanes by the HFMA2's operand selectors: one register per n8 tile instead of two
// (the 512-wide tiles' register budget), the same values, so the same bits.
template <bool F16>
__device__ __forceinline__ uint32_t dq4_pair_sb(uint32_t w, int p, uint32_t sb) {
  if constexpr (F16) {
    return dq4_pair_m(w, p, __low2half2(bits_h2(sb)), __high2half2(bits_h2(sb)), 0x64006400u);
  } else {
    const uint32_t v = ((w >> (4 * p)) & 0x000F000Fu) | 0x43004300u;
    const __nv_bfloat162 q = __hsub2(bits_bf2(v), bits_bf2(0x43004300u));
    return bf2_bits(__hfma2(q, __low2bfloat162(bits_bf2(sb)), __high2bfloat162(bits_bf2(sb))));
  }
}

// fp16 path: the exponent s of a row with maximum |x| = amax (max|x|·2^s in [2^14, 2^15); the
// cpu emulation, fp16_row_exp in gemm_emulate.cpp, is the same function).
// The exponent comes from the bits (frexpf and ldexpf are multi-instruction library calls, and
// these run per element in the conversion and the SwiGLU epilogue): for a normal amax,
// frexp's e = biased exponent - 126; a subnormal amax gives e <= -126 either way, clamped to 100.
__device__ __forceinline__ int f16_row_exp(float amax) {
  if (!(amax > 0.f) || !isfinite(amax)) return 0;
  const int e = int((__float_as_uint(amax) >> 23) & 0xffu) - 126;
  return min(max(15 - e, -100), 100);
}

// 2^e for |e| <= 126 (a normal float, exact): v * pow2f(e) is ldexpf(v, e) in one multiply (one
// correctly rounded result either way).
__device__ __forceinline__ float pow2f(int e) { return __uint_as_float(uint32_t(127 + e) << 23); }

// Byte `bt` of words wl/wh dequantised in f32, returned as bf16 pair `hi` and remainder pair `lo`.
__device__ __forceinline__ void dq8_pair(uint32_t wl, uint32_t wh, int bt, float s, float b, uint32_t& hi,
                                         uint32_t& lo) {
  const float v0 = fmaf(float((wl >> (8 * bt)) & 255u), s, b), v1 = fmaf(float((wh >> (8 * bt)) & 255u), s, b);
  const __nv_bfloat162 h = __floats2bfloat162_rn(v0, v1);
  hi = bf2_bits(h);
  lo = pack_bf16(v0 - __low2float(h), v1 - __high2float(h));
}

// Warp layout of a BM x BN CTA tile. BN = 128: 2x4 warps (64x32 at BM = 128, 32x32 at 64), 1x8 at
// BM = 32 (32x16). BN = 256 (P10): 16-bit B at BM = 128 in 2x4 warps of 64x64 (twice the MMAs per ldmatrix
// of 64x32); 4-bit B, and BM = 64, 32, in 1x8 warps (128x32, 64x32, 32x32), so that every 4-bit
// weight of the CTA is unpacked by exactly one warp (MT MMAs per unpacked fragment). BN = 512 (4-bit
// B, BM = 64 / 32 only: the MoE's grouped GEMMs): 1x8 warps of 64x64 / 32x64.
template <int BM, int BN, int BT>
struct Cfg {
  static constexpr int WM = BM == 32 || (BN >= 256 && (BM == 64 || BT == kQ4)) ? 1 : 2;   // warps along M
  static constexpr int WN = 8 / WM;                                      // warps along N
  static constexpr int WTM = BM / WM, WTN = BN / WN;                     // warp tile
  static constexpr int MT = WTM / 16, NT = WTN / 8;
  static_assert(NT % 2 == 0 && MT >= 1 && WTN % 16 == 0, "warp tile");
  static_assert(BN != kBNMoe || (BT == kQ4 && BM <= 64), "512-wide tiles: 4-bit B, BM <= 64");
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
template <int BM, int BT, int BN>
constexpr int stage_bytes() {
  return a_tiles<BT>() * BM * 128 + BN * brow_bytes<BT>();
}
// Extra shared memory of the AM = 2 mode: per row 16 group factors (fp16) and the epilogue factor.
template <int BM, int AM>
constexpr int grp_bytes() {
  return AM == kAmF16Grp ? BM * (kMaxGrpK / 64) * 2 + BM * 4 + BM * 4 : 0;   // + P35's [BM] destination rows
}
// AM = 2, thread tid < BM of a CTA over tile rows pos0 .. pos0 + rows - 1: row tid's group factors
// 2^(s_row - s_group) as fp16 bits in sgf[tid][*] (0 below fp16's smallest subnormal 2^-24) and its
// epilogue factor 2^-(s_row + 8) in srf[tid], s_row the smallest of the row's group exponents. Rows past
// `rows` get zeros (exponents 0). Shared by gemm_kernel, P1w (gemm_wgmma.cuh) and P14/P15 (gemm_moe_wg.cuh).
__device__ __forceinline__ void grp_row_factors(const GemmArgs& a, int tid, int pos0, int rows, int K, uint16_t* sgf,
                                                float* srf) {
  const int G = K / 64;
  const int8_t* e = a.act_exp + int64_t(pos0 + (tid < rows ? tid : 0)) * a.ld_exp;
  int smin = 127;
  for (int gi = 0; gi < G; ++gi) smin = min(smin, tid < rows ? int(e[gi]) : 0);
  for (int gi = 0; gi < G; ++gi) {
    const int d = smin - (tid < rows ? int(e[gi]) : 0);
    sgf[tid * (kMaxGrpK / 64) + gi] = __half_as_ushort(__float2half_rn(d < -24 ? 0.f : ldexpf(1.f, d)));
  }
  srf[tid] = ldexpf(kInvW, -smin);
}
// The wgmma kernels' AM 2 step (P1w, P14, P15, P18): the 16-byte fp16 activation chunk at p, of tile row m,
// times that row's factor for step (64-column group) kg, from grp_row_factors' table.
__device__ __forceinline__ void grp_scale_chunk(uint8_t* p, const uint16_t* sgf, int m, int kg) {
  const __half2 f = bits_h2(uint32_t(sgf[m * (kMaxGrpK / 64) + kg]) * 0x10001u);
  uint4* q = reinterpret_cast<uint4*>(p);
  uint4 v = *q;
  v.x = h2_bits(__hmul2(bits_h2(v.x), f));
  v.y = h2_bits(__hmul2(bits_h2(v.y), f));
  v.z = h2_bits(__hmul2(bits_h2(v.z), f));
  v.w = h2_bits(__hmul2(bits_h2(v.w), f));
  *q = v;
}
template <int BM, int BT, int AM, int BN>
constexpr int smem_bytes() {
  return kStages * stage_bytes<BM, BT, BN>() + (BT == kBF ? 0 : 2 * 2 * BN * 16) + grp_bytes<BM, AM>();
}
constexpr int kSvLd = 68;   // SwiGLU staging tile row stride in floats (64 + 4: fewer bank conflicts)
// The same for a CTA of BN weight rows (BN / 2 activation columns).
template <int BN>
constexpr int sv_ld() {
  return BN / 2 + 4;
}

// Swizzled offset of 16-byte chunk c of a 128-byte row r (conflict-free ldmatrix and cp.async).
__device__ __forceinline__ int swz(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// CTAs per SM the register allocation must allow. P10 with 4-bit B, fp16 operands and BM <= 64: 2
// (the 64x32 warp tiles would take ~190 registers and so one CTA per SM, where BN = 128 runs two of
// ~120; shared memory allows two: 82 KB each at BM = 64). Not in bf16 (LILY_GEMM_BF16), whose
// BM = 64 kernel spills at 128 registers. BN = 512: 1 (64x64 warp tiles: 128 accumulators per thread).
template <int BM, int BT, int AM, int BN>
constexpr int min_ctas() {
  return BN == 256 && BT == kQ4 && AM != kAmBf16 && BM <= 64 ? LILY_P10_MINB : 1;
}

// V (the MoE down GEMM at BM 64 / BN 256; 0 elsewhere): bit 2 = P46, bit 4 = P47 (dq4_pair_down: the unpacking in
// fewer instructions), bit 8 = P48 (CTAs whose warps have all 64 rows live run a copy of the main loop without P39's
// per-m16-tile checks). With V != 0 the fp16 scale and bias of an n8 tile share one register (as dq4_pair_sb). Same
// MMAs on the same values in the same order per accumulator: the same bits.
template <int BM, int BT, int AM, int BN, int V = 0>
__global__ void __launch_bounds__(kThreads, (min_ctas<BM, BT, AM, BN>()))
    gemm_kernel(const __grid_constant__ GemmArgs a) {
  using C = Cfg<BM, BN, BT>;
  constexpr bool F16 = AM != kAmBf16;
  static_assert(!(F16 && BT == kQ8), "8-bit matrices run in bf16 split precision");
  static_assert(AM != kAmF16Grp || BT == kQ4, "per-group A exponents: 4-bit B only");
  static_assert(BN == 128 || BN == 256 || BN == 512, "CTA width");
  static_assert(V == 0 || ((V & ~14) == 0 && F16 && BT == kQ4 && BN == 256), "P46-P48: the 4-bit fp16 256-wide kernel");
  constexpr int SVLD = sv_ld<BN>();
  static_assert(BM * SVLD * 4 <= kStages * stage_bytes<BM, BT, BN>(), "SwiGLU staging tile");
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int RB = brow_bytes<BT>();
  constexpr int SB = stage_bytes<BM, BT, BN>();
  constexpr int BCH = BN * RB / 16 / kThreads;          // B chunks per thread per stage
  constexpr int ACH = BM * 8 / kThreads;                // A chunks per thread per stage (BM >= 32)
  constexpr int SBCH = 2 * BN / kThreads;               // scale/bias chunks per thread (every 8th stage)
  static_assert(BCH >= 1 && ACH >= 1 && SBCH >= 1, "chunking");
  uint16_t* sbs = reinterpret_cast<uint16_t*>(smem + kStages * SB);   // [2][BN][8] scales
  uint16_t* sbb = sbs + 2 * BN * 8;                                   // [2][BN][8] biases
  // AM 2: [BM][16] fp16 factors 2^(s_row - s_group) and [BM] epilogue factors 2^-(s_row + 8).
  uint16_t* sgf = sbb + 2 * BN * 8;
  float* srf = reinterpret_cast<float*>(sgf + BM * (kMaxGrpK / 64));
  int* sdst = reinterpret_cast<int*>(srf + BM);   // P35: the scatter's destination rows

  pdl_trigger();
  // Plain mode: the tile is known without the previous kernel's results, so the first stages' weights
  // (immutable) are requested before the PDL wait; grouped mode needs the tile list first. Not with
  // BT == kBF: that B is the P1-off buffer, which the kernel just before this one (dequant_kernel)
  // is still writing, and which one workspace slot shares between the jobs of a batch.
  const bool plain = a.tiles == nullptr;
  constexpr bool kEarlyB = BT != kBF;
  if (!plain || !kEarlyB) pdl_wait();
  // (bx, by): this CTA's M tile (or tile-list entry) and N tile. Plain mode with a.raster = R > 0
  // walks the grid in bands of R M tiles, N tile by N tile inside a band, so that the CTAs running
  // at once share fewer distinct A and B rows (L2 reuse); R = 0: blockIdx as launched (M fastest).
  int bx = blockIdx.x, by = blockIdx.y;
  if (plain && a.raster > 0) {
    const int lin = blockIdx.x + gridDim.x * blockIdx.y, band = a.raster * gridDim.y;
    const int m0 = (lin / band) * a.raster, h = min(int(gridDim.x) - m0, a.raster), in = lin % band;
    bx = m0 + in % h;
    by = in / h;
  } else if (!plain && a.n_fast) {
    // P43 (grouped): the N tiles of one tile-list entry launch next to each other, so its activation rows are read
    // from DRAM once (M-tile fastest, a tile's 8 N-tile CTAs are a whole pass over the list apart).
    const int lin = blockIdx.x + gridDim.x * blockIdx.y;
    bx = lin / gridDim.y;
    by = lin % gridDim.y;
  }
  int group = 0, pos0, rows;
  if (!plain) {
    if (bx >= *a.n_tiles) return;
    const int4 tl = a.tiles[bx];
    group = tl.x;
    pos0 = tl.y;
    rows = tl.z;
  } else {
    pos0 = bx * BM;
    rows = min(BM, a.M - pos0);
  }
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int K = a.K;
  // P37: this CTA's K slice [k0, k0 + nk·kBK) (K stays the row stride of A and B).
  // 8-bit B only (the router): every other instance folds k0 to 0 and keeps its code.
  constexpr bool kSplitK = BT == kQ8;
  const bool zs = kSplitK && plain && a.ksplit > 1;
  const int kz = zs ? int(blockIdx.z) : 0;
  const int nk = K / kBK / (zs ? a.ksplit : 1), k0 = kz * nk * kBK;

  // ---- per-thread load plan ----
  // B rows: CTA row r -> (matrix, output column). SwiGLU interleaves gate/up per 8 rows.
  auto b_row = [&](int r, int& mat, int& col) {
    if (a.swiglu) {
      mat = (r >> 3) & 1;
      col = by * (BN / 2) + (r >> 4) * 8 + (r & 7);
    } else {
      mat = 0;
      col = by * BN + r;
    }
  };
  auto mat_of = [&](int mat) -> const QMat& { return group < a.b.n_groups ? a.b.w[mat] : a.b.extra[mat]; };
  const int64_t goff = group < a.b.n_groups ? int64_t(group) * a.b.stride : 0;
  const int64_t gsoff = group < a.b.n_groups ? int64_t(group) * a.b.sb_stride : 0;
  const int64_t row_bytes = BT == kQ4 ? K / 2 : BT == kQ8 ? K : 2 * K;

  // A thread's B chunk j is 16 bytes of CTA row r0 + j·RPJ (RPJ = a multiple of 16 rows): same
  // matrix and 16-byte column as chunk 0, output column col0 + j·DCOL (SwiGLU: half as many, the
  // other half being the other matrix). Up to 4 chunks keep a pointer each; more (8 for BN = 256
  // with 16-bit B) are recomputed per stage from one pointer (registers for the accumulators).
  // Swizzled kBF destinations: r & 7 is the same for all chunks.
  constexpr int RPJ = kThreads * 16 / RB;
  static_assert(RPJ % 16 == 0, "B chunk rows");
  const int b_r0 = tid / (RB / 16), b_c = tid % (RB / 16);
  int b_mat, b_col0;
  b_row(b_r0, b_mat, b_col0);
  const int b_dcol = a.swiglu ? RPJ / 2 : RPJ;
  // Rows past N read nothing (src-size 0) from a valid address: the chunk-0 row clamped to column 0.
  const uint8_t* b_src0 = static_cast<const uint8_t*>(mat_of(b_mat).data) + goff +
                          int64_t(b_col0 < a.N ? b_col0 : 0) * row_bytes + b_c * 16 +
                          (BT == kQ4 ? k0 / 2 : BT == kQ8 ? k0 : 2 * k0);
  // 512 wide: bytes between chunks j and j + 1 (< 2^31 / 3 for the MoE's K: 32-bit offsets).
  [[maybe_unused]] const int b_jstride = int(b_dcol * row_bytes);
  const int b_dst0 = BT == kBF ? swz(b_r0, b_c) : b_r0 * RB + b_c * 16;
  constexpr bool kBPtrs = BCH <= 4 && BN == kBN;
  // 512 wide: N is a multiple of the tile (the launcher checks), so no B row is past N (registers).
  constexpr bool kBFull = BN == kBNMoe;
  const uint8_t* bsrc[kBPtrs ? BCH : 1];
  bool bval[kBPtrs ? BCH : 1];
  if constexpr (kBPtrs) {
#pragma unroll
    for (int j = 0; j < BCH; ++j) {
      bval[j] = b_col0 + j * b_dcol < a.N;
      bsrc[j] = b_src0 + (bval[j] ? int64_t(j * b_dcol) * row_bytes : 0);
    }
  }
  // Scales/biases: chunk idx = tid + j·kThreads < 2·BN loads 16 bytes (8 groups) of row idx >> 1's
  // scales (idx even) or biases: row r0 + j·128 (same matrix), output column col0 + j·SB_DCOL.
  const int sb_r0 = tid >> 1;
  int sb_mat = 0, sb_col0 = 0;
  b_row(sb_r0, sb_mat, sb_col0);
  const int sb_dcol = a.swiglu ? kThreads / 4 : kThreads / 2;
  const uint8_t* sb_src0 = nullptr;
  if (BT != kBF) {
    const QMat& w = mat_of(sb_mat);
    sb_src0 = static_cast<const uint8_t*>((tid & 1) ? w.biases : w.scales) + gsoff +
              int64_t(sb_col0 < a.N ? sb_col0 : 0) * (K / 64) * 2 + (k0 / 64) * 2;
  }
  const uint32_t sb_dst0 = smem_addr(((tid & 1) ? sbb : sbs) + sb_r0 * 8);
  const uint32_t sm0 = smem_addr(smem);
  auto load_b = [&](int kg) {
    const uint32_t st = sm0 + (kg % kStages) * SB + a_tiles<BT>() * BM * 128 + b_dst0;
#pragma unroll
    for (int j = 0; j < BCH; ++j) {
      if constexpr (kBPtrs) {
        cp_async16(st + j * RPJ * RB, bsrc[j] + int64_t(kg) * RB, bval[j]);
      } else {
        if constexpr (kBFull) {
          cp_async16(st + j * RPJ * RB, b_src0 + j * b_jstride + kg * RB, true);
        } else {
          const bool v = b_col0 + j * b_dcol < a.N;
          cp_async16(st + j * RPJ * RB, b_src0 + (v ? int64_t(j * b_dcol) * row_bytes : 0) + int64_t(kg) * RB, v);
        }
      }
    }
    if (BT != kBF && (kg & 7) == 0) {
#pragma unroll
      for (int j = 0; j < SBCH; ++j) {
        const bool v = kBFull || sb_col0 + j * sb_dcol < a.N;
        cp_async16(sb_dst0 + j * (kThreads / 2) * 16 + ((kg >> 3) & 1) * BN * 16,
                   sb_src0 + (v ? int64_t(j * sb_dcol) * (K / 64) * 2 : 0) + (kg >> 3) * 16, v);
      }
    }
  };
  if (plain) {   // uncommitted: they join the first stage's commit group below
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s)
      if (s < nk) load_b(s);
    if (kEarlyB) pdl_wait();
  }
  constexpr int AT = a_tiles<BT>();
  // A chunk j: 16 bytes of CTA row m0 + 32j. P10's down GEMM (AM 2: never gathered, rows pos0 + m
  // contiguous) derives them from one pointer, which keeps BM = 64 at 2 CTAs per SM without spills.
  constexpr bool kAOne = BN >= kBNWide && AM == kAmF16Grp;
  const uint16_t* asrc[kAOne ? 1 : ACH];
  bool aval[kAOne ? 1 : ACH];
  int adst[kAOne ? 1 : ACH];
#pragma unroll
  for (int j = 0; j < (kAOne ? 1 : ACH); ++j) {
    const int idx = tid + j * kThreads, m = idx >> 3, c = idx & 7;
    aval[j] = m < rows;
    int src = 0;
    if (aval[j]) src = a.a_rows ? a.a_rows[pos0 + m] : pos0 + m;
    asrc[j] = a.a + int64_t(src) * K + c * 8 + k0;
    adst[j] = swz(m, c);
  }
  auto load_a = [&](int kg) {
    const uint32_t st = sm0 + (kg % kStages) * SB;
#pragma unroll
    for (int j = 0; j < ACH; ++j) {
      if constexpr (kAOne) {   // row m0 + 32j: swizzle phase unchanged, source 32j rows further
        const bool v = (tid >> 3) + j * (kThreads / 8) < rows;
        cp_async16(st + adst[0] + j * (kThreads / 8) * 128, asrc[0] + (v ? int64_t(j) * (kThreads / 8) * K : 0) + kg * kBK,
                   v);
      } else {
        cp_async16(st + adst[j], asrc[j] + kg * kBK, aval[j]);
        if (AT == 2) cp_async16(st + BM * 128 + adst[j], asrc[j] + (a.a_lo - a.a) + kg * kBK, aval[j]);
      }
    }
  };
  auto load_stage = [&](int kg) {
    load_a(kg);
    load_b(kg);
  };

  // AM 2: the row's exponents per group -> factors 2^(s_row - s_g) <= 1 (s_row = min over groups,
  // from the group with the largest values), 0 below fp16's smallest subnormal 2^-24. Visible to
  // all warps after the first barrier of the mainloop (P10: a barrier of its own, below, since
  // every thread reads them before that one). kGfRegs: applied to the A fragments in registers
  // (128 wide); else to the staged A tile in shared memory (P10).
  constexpr bool kGfRegs = AM == kAmF16Grp && BN == kBN;
  static_assert(AM != kAmF16Grp || kGfRegs || kAOne, "P10 AM 2: the shared-memory scaling uses the one-pointer A plan");
  // P35 (a.pre_scatter): the scatter epilogue's per-row destination and routing weight are read here,
  // before the mainloop hides their latency, into shared memory (the weight folded into srf: the same
  // single product row factor × weight); the epilogue then issues no global load between its stores
  // (each row's a.dst / a.scale load waited for the previous row's stores: y may alias them for the
  // compiler; ~8 % of the down GEMM's stall samples in session 13's ncu run).
  const bool pre_scatter = AM == kAmF16Grp && a.mode == kScatter && a.pre_scatter;
  if constexpr (AM == kAmF16Grp) {
    if (tid < BM) {
      grp_row_factors(a, tid, pos0, rows, K, sgf, srf);
      if (pre_scatter) {
        sdst[tid] = tid < rows ? a.dst[pos0 + tid] : 0;
        if (tid < rows) srf[tid] *= a.scale[pos0 + tid];
      }
    }
    if constexpr (!kGfRegs) __syncthreads();
  }

  // ---- warp tile ----
  const int wm0 = (warp / C::WN) * C::WTM, wn0 = (warp % C::WN) * C::WTN;
  const int live_rows = a.skip_pad ? rows : BM;   // P39
  // P46: fp16 exponent bits of 1024 for the unpacking, opaque to the compiler (K > 0, so the OR adds nothing).
  [[maybe_unused]] const uint32_t magic = (V & 2) != 0 ? 0x64006400u | (uint32_t(a.K) >> 31) : 0x64006400u;
  const int g = lane >> 2, t = lane & 3;
  float acc[C::MT][C::NT][4];
#pragma unroll
  for (int i = 0; i < C::MT; ++i)
#pragma unroll
    for (int j = 0; j < C::NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  // Commit group s holds stage s (plain mode: group 0 also holds the early weights of stages 1, 2,
  // which only completes them sooner than the wait for their own stage requires).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) {
      if (plain) load_a(s);
      else load_stage(s);
    }
    cp_commit();
  }

  auto main_loop = [&](auto full_t) {
  [[maybe_unused]] constexpr bool kFull = decltype(full_t)::value;   // P48: every m16 tile of the warp is live (no P39 checks)
  for (int kg = 0; kg < nk; ++kg) {
    cp_wait<kStages - 2>();
    if constexpr (!kGfRegs && AM == kAmF16Grp) {
      // P10, AM 2: each thread scales the A chunks it copied itself (complete for this thread after
      // the wait) by their row's factor for this group, in shared memory, before the barrier that
      // publishes the stage: 4 HMUL2 per 16 bytes once per CTA instead of per fragment in every warp
      // (the same fp16 products, so the same bits).
      uint8_t* sa = smem + (kg % kStages) * SB + adst[0];
#pragma unroll
      for (int j = 0; j < ACH; ++j) {
        const int m = (tid >> 3) + j * (kThreads / 8);
        const uint32_t f = uint32_t(sgf[m * (kMaxGrpK / 64) + kg]) * 0x10001u;
        uint4* p = reinterpret_cast<uint4*>(sa + j * (kThreads / 8) * 128);
        uint4 v = *p;
        v.x = h2_bits(__hmul2(bits_h2(v.x), bits_h2(f)));
        v.y = h2_bits(__hmul2(bits_h2(v.y), bits_h2(f)));
        v.z = h2_bits(__hmul2(bits_h2(v.z), bits_h2(f)));
        v.w = h2_bits(__hmul2(bits_h2(v.w), bits_h2(f)));
        *p = v;
      }
    }
    __syncthreads();
    if (kg + kStages - 1 < nk) load_stage(kg + kStages - 1);
    cp_commit();

    const uint8_t* st = smem + (kg % kStages) * SB;
    const uint32_t a_base = smem_addr(st);
    const uint8_t* bst = st + AT * BM * 128;
    // This group's codes and scales for the warp's NT n8-tiles (row wn0 + 8j + g).
    // 512 wide: scale and bias packed in s2 (dq4_pair_sb), b2 unused; the codes are read from shared
    // memory by k16 step (word i / 2, at its first use), not all 16 words per thread at once.
    constexpr bool kSBPack = BT == kQ4 && BN == kBNMoe;
    constexpr bool kSB2 = kSBPack || V != 0;   // P46-P48 (4-bit fp16 only): s and b in one register
    uint32_t cw[kSBPack ? 1 : C::NT][BT == kQ8 ? 4 : 2];
    uint32_t s2[C::NT], b2[kSB2 ? 1 : C::NT];
    float sf[C::NT], bf[C::NT];
    if constexpr (BT != kBF) {
      const int sbi = ((kg >> 3) & 1) * BN * 8 + (kg & 7);
#pragma unroll
      for (int j = 0; j < C::NT; ++j) {
        const int r = wn0 + 8 * j + g;
        if constexpr (kSBPack) {
        } else if constexpr (BT == kQ4) {
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
        sf[j] = __uint_as_float(uint32_t(sv) << 16);
        bf[j] = __uint_as_float(uint32_t(bv) << 16);
        if constexpr (kSB2) {
          if constexpr (F16)
            s2[j] = h2_bits(__floats2half2_rn(sf[j] * float(1 << kGemmF16WExp), bf[j] * float(1 << kGemmF16WExp)));
          else
            s2[j] = uint32_t(sv) | (uint32_t(bv) << 16);
        } else if constexpr (F16) {
          s2[j] = h2_bits(__float2half2_rn(sf[j] * float(1 << kGemmF16WExp)));
          b2[j] = h2_bits(__float2half2_rn(bf[j] * float(1 << kGemmF16WExp)));
        } else {
          s2[j] = uint32_t(sv) * 0x10001u;
          b2[j] = uint32_t(bv) * 0x10001u;
        }
      }
    }
    // AM 2 (128 wide): this group's A factors for the rows g and g + 8 of each m16 tile.
    uint32_t gf[kGfRegs ? C::MT : 1][2];
    if constexpr (kGfRegs) {
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          gf[mt][hh] = uint32_t(sgf[(wm0 + mt * 16 + g + 8 * hh) * (kMaxGrpK / 64) + kg]) * 0x10001u;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {   // k16 steps of the group
      // A fragment of m16 tile mt (ldmatrix), AM 2: scaled by the group factors of its rows.
      auto load_af = [&](int mt, uint32_t* f4) {
        const int r = wm0 + mt * 16 + (lane & 15), c = 2 * i + (lane >> 4);
        ldsm_x4(a_base + swz(r, c), f4);
        if constexpr (kGfRegs) {   // a0, a2: row g; a1, a3: row g + 8
#pragma unroll
          for (int e = 0; e < 4; ++e) f4[e] = h2_bits(__hmul2(bits_h2(f4[e]), bits_h2(gf[mt][e & 1])));
        }
      };
      if constexpr (BT == kQ4 && BN >= kBNWide) {
        // Weight pair p of n8 tile j's word w; word: this k16 step's code word of n8 tile j.
        auto dq = [&](uint32_t w, int p, int j) -> uint32_t {
          if constexpr (V != 0) return dq4_pair_down<(V & 4) != 0>(w, w >> 8, p, s2[j], magic);
          else if constexpr (kSB2) return dq4_pair_sb<F16>(w, p, s2[j]);
          else return dq4_pair<F16>(w, p, s2[j], b2[j]);
        };
        auto word = [&](int j) -> uint32_t {
          if constexpr (kSBPack) return *reinterpret_cast<const uint32_t*>(bst + (wn0 + 8 * j + g) * 32 + 8 * t + 4 * (i >> 1));
          else return cw[j][i >> 1];
        };
        // P10, 4-bit: the order of the MMAs (volatile asm, so it fixes the live ranges) keeps the
        // smaller operand set live: NT <= MT (64x32 warp tiles): all NT unpacked fragments, then
        // m16 tile by m16 tile with its A fragment loaded just before; else (64x64) all MT A
        // fragments, then n8 tile by n8 tile unpacked just before. Each accumulator's k-order is
        // unchanged.
        if constexpr (C::NT <= C::MT) {
          uint32_t bq[C::NT][2];
#pragma unroll
          for (int j = 0; j < C::NT; ++j) {
            const uint32_t w = word(j);
            bq[j][0] = dq(w, 2 * (i & 1), j);
            bq[j][1] = dq(w, 2 * (i & 1) + 1, j);
          }
#pragma unroll
          for (int mt = 0; mt < C::MT; ++mt) {
            // P39 (the down GEMM, AM 2): m16 tiles wholly past the tile's rows are skipped (their
            // accumulators stay 0 and the epilogue writes no row >= rows): same bits, fewer MMAs.
            // P48: not checked in the copy of the loop for warps with all their rows live.
            if constexpr (AM == kAmF16Grp && !kFull)
              if (wm0 + mt * 16 >= live_rows) break;
            uint32_t f4[4];
            load_af(mt, f4);
#pragma unroll
            for (int j = 0; j < C::NT; ++j) {
              if constexpr (F16) mma_f16(acc[mt][j], f4, bq[j][0], bq[j][1]);
              else mma_bf16(acc[mt][j], f4, bq[j][0], bq[j][1]);
            }
          }
        } else {
          uint32_t af[C::MT][4];
#pragma unroll
          for (int mt = 0; mt < C::MT; ++mt) load_af(mt, af[mt]);
#pragma unroll
          for (int j = 0; j < C::NT; ++j) {
            const uint32_t w = word(j);
            const uint32_t b0 = dq(w, 2 * (i & 1), j);
            const uint32_t b1 = dq(w, 2 * (i & 1) + 1, j);
#pragma unroll
            for (int mt = 0; mt < C::MT; ++mt) {
              if constexpr (F16) mma_f16(acc[mt][j], af[mt], b0, b1);
              else mma_bf16(acc[mt][j], af[mt], b0, b1);
            }
          }
        }
      } else {
        uint32_t af[C::MT][4], afl[AT == 2 ? C::MT : 1][4];
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) {
          load_af(mt, af[mt]);
          if constexpr (AT == 2) {
            const int r = wm0 + mt * 16 + (lane & 15), c = 2 * i + (lane >> 4);
            ldsm_x4(a_base + BM * 128 + swz(r, c), afl[mt]);
          }
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
            bfr[j][0] = dq4_pair<F16>(w, 2 * (i & 1), s2[j], b2[j]);
            bfr[j][1] = dq4_pair<F16>(w, 2 * (i & 1) + 1, s2[j], b2[j]);
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
            if constexpr (F16) {
              mma_f16(acc[mt][j], af[mt], bfr[j][0], bfr[j][1]);
            } else {
              mma_bf16(acc[mt][j], af[mt], bfr[j][0], bfr[j][1]);
              if constexpr (AT == 2) {
                mma_bf16(acc[mt][j], afl[mt], bfr[j][0], bfr[j][1]);
                mma_bf16(acc[mt][j], af[mt], bfl[j][0], bfl[j][1]);
              }
            }
          }
      }
    }
  }
  };
  if constexpr ((V & 8) != 0) {
    if (live_rows >= wm0 + C::WTM) main_loop(std::true_type{});
    else main_loop(std::false_type{});
  } else {
    main_loop(std::false_type{});
  }
  cp_wait<0>();

  // ---- epilogue ----
  // Row factor undoing the operand scales: fp16 2^-(s + 8) (s of the gathered A row), AM 2 from
  // shared memory, bf16 1.
  auto row_factor = [&](int m) -> float {
    if constexpr (AM == kAmF16Grp) return srf[m];
    if constexpr (AM == kAmF16) return a.a_scale[a.a_rows ? a.a_rows[pos0 + m] : pos0 + m] * kInvW;
    return 1.f;
  };
  if (BT == kQ4 && a.mode == kSwiGLU) {
    // 1. silu(gate)·up of the warp's fragments into an f32 [BM][BN / 2] tile (pipeline smem reused).
    __syncthreads();
    float* sv = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int m = wm0 + mt * 16 + g + 8 * hh;
        const float rf = m < rows ? row_factor(m) : 0.f;
#pragma unroll
        for (int p = 0; p < C::NT / 2; ++p) {
          const float g0 = rf * acc[mt][2 * p][2 * hh], g1 = rf * acc[mt][2 * p][2 * hh + 1];
          const float u0 = rf * acc[mt][2 * p + 1][2 * hh], u1 = rf * acc[mt][2 * p + 1][2 * hh + 1];
          const float v0 = g0 / (1.f + __expf(-g0)) * u0, v1 = g1 / (1.f + __expf(-g1)) * u1;
          *reinterpret_cast<float2*>(sv + m * SVLD + wn0 / 2 + p * 8 + 2 * t) = make_float2(v0, v1);
        }
      }
    __syncthreads();
    // 2. Eight threads per (row, 64-column group): 16 bytes each in the down GEMM's k-order
    //    (coalesced 128-byte rows); fp16: the row's exponent for this group from the max over the 8
    //    threads. BN = 256: two groups per CTA, each with its own exponent as with BN = 128.
    //    (BM · NG is a multiple of 32, so the loop is uniform across a warp for the shuffles.)
    constexpr int NG = BN / 128;
    const int L0 = 8 * (tid & 7);
    for (int mg = tid >> 3; mg < BM * NG; mg += kThreads / 8) {
      const int m = mg / NG, gi = mg % NG, G = by * NG + gi;   // G: the group's index in the row
      float v[8], amax = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        v[i] = sv[m * SVLD + gi * 64 + gemm_kperm(L0 + i)];
        amax = fmaxf(amax, fabsf(v[i]));
      }
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      if (m >= rows || G * 64 >= a.N) continue;
      const int64_t pos = pos0 + m;
      uint32_t o[4];
      if constexpr (F16) {
        const int se = f16_row_exp(amax);
        const float up = pow2f(se);
#pragma unroll
        for (int u = 0; u < 4; ++u) o[u] = h2_bits(__floats2half2_rn(v[2 * u] * up, v[2 * u + 1] * up));
        if ((tid & 7) == 0) a.act_exp[pos * a.ld_exp + G] = int8_t(se);
      } else {
#pragma unroll
        for (int u = 0; u < 4; ++u) o[u] = pack_bf16(v[2 * u], v[2 * u + 1]);
      }
      *reinterpret_cast<uint4*>(a.act + pos * a.ld_act + G * 64 + L0) = make_uint4(o[0], o[1], o[2], o[3]);
    }
    return;
  }
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int m = wm0 + mt * 16 + g + 8 * hh;
      if (m >= rows) continue;
      const int64_t pos = pos0 + m;
      float sc = row_factor(m);
      int64_t orow = pos;
      if (pre_scatter) {
        orow = sdst[m];
      } else if (a.mode == kScatter) {
        orow = a.dst[pos];
        sc *= a.scale[pos];
      }
      float* yrow = a.y + kz * a.zstride + orow * a.ldy;
      if (a.mode == kScatter && a.y16) {   // P16: the slot rows as fp16 (ldy even, n even: 4-byte stores)
        __half* hrow = reinterpret_cast<__half*>(a.y) + orow * a.ldy;
#pragma unroll
        for (int j = 0; j < C::NT; ++j) {
          const int n = by * BN + wn0 + 8 * j + 2 * t;
          const float v0 = sc * acc[mt][j][2 * hh], v1 = sc * acc[mt][j][2 * hh + 1];
          if (n + 1 < a.N) *reinterpret_cast<__half2*>(hrow + n) = __halves2half2(sat_half(v0), sat_half(v1));
          else if (n < a.N) hrow[n] = sat_half(v0);
        }
        continue;
      }
#pragma unroll
      for (int j = 0; j < C::NT; ++j) {
        const int n = by * BN + wn0 + 8 * j + 2 * t;
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

#include "backend/cuda/gemm_wgmma.cuh"

// One 16-byte chunk of each conversion output: staged columns 8·c8 .. 8·c8 + 7 of row `row` in mma
// k-order, read from xr (the row's K f32 values, global or shared memory). xa: fp16 scaled by `up`
// (f16) or bf16; xh / xl (optional): bf16 x_hi and the remainders x - x_hi. need_h false (P70; only when f16 and
// neither xh nor xl is written): the bf16 halves are not computed.
__device__ __forceinline__ void convert_a_chunk(const float* xr, int64_t row, int K, int c8, int f16, float up,
                                                uint16_t* __restrict__ xa, uint16_t* __restrict__ xh,
                                                uint16_t* __restrict__ xl, bool need_h = true) {
  const int G = c8 >> 3, L0 = (c8 & 7) * 8;
  const float* src = xr + G * 64;
  uint32_t o[4], h[4] = {}, l[4] = {};
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const float v0 = src[gemm_kperm(L0 + 2 * u)], v1 = src[gemm_kperm(L0 + 2 * u + 1)];
    if (need_h) {
      const __nv_bfloat162 hb = __floats2bfloat162_rn(v0, v1);
      h[u] = bf2_bits(hb);
      l[u] = pack_bf16(v0 - __low2float(hb), v1 - __high2float(hb));
    }
    o[u] = f16 ? h2_bits(__floats2half2_rn(v0 * up, v1 * up)) : h[u];
  }
  const int64_t i = row * (K / 8) + c8;
  if (xa) reinterpret_cast<uint4*>(xa)[i] = make_uint4(o[0], o[1], o[2], o[3]);
  if (xh) reinterpret_cast<uint4*>(xh)[i] = make_uint4(h[0], h[1], h[2], h[3]);
  if (xl) reinterpret_cast<uint4*>(xl)[i] = make_uint4(l[0], l[1], l[2], l[3]);
}

// x f32 [T, K] -> the GEMM's A operands in mma k-order, one block per row. xa: fp16 scaled by the
// row's 2^s (rs[row] = 2^-s) or bf16 (f16 == 0); xh/xl (optional): bf16 x_hi and remainders
// x - x_hi for 8-bit matrices. One thread writes 8 consecutive staged columns (16 bytes) per output.
// dy (P19, optional): dy[row] = x[row] · dw[0] in f32 (the MoE's one-row shared-expert gate, which this
// kernel's read of x serves instead of a separate GEMV launch over the same rows).
__global__ void __launch_bounds__(256) convert_a_kernel(const float* __restrict__ x, int K, int f16,
                                                        uint16_t* __restrict__ xa, float* __restrict__ rs,
                                                        uint16_t* __restrict__ xh, uint16_t* __restrict__ xl,
                                                        const QMat dw, float* __restrict__ dy) {
  __shared__ float red[32];
  pdl_trigger();
  pdl_wait();
  const int64_t row = blockIdx.x;
  const float* xr = x + row * K;
  if (dy) {
    float d = 0.f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) d += xr[i] * qm_at(dw, 0, i);
    d = block_sum(d, red);
    if (threadIdx.x == 0) dy[row] = d;
    __syncthreads();   // red is reused below
  }
  int se = 0;
  float up = 1.f;
  if (f16) {
    float amax = 0.f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) amax = fmaxf(amax, fabsf(xr[i]));
    amax = warp_max(amax);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = red[0];
    for (int w = 1; w < int(blockDim.x >> 5); ++w) amax = fmaxf(amax, red[w]);
    se = f16_row_exp(amax);
    up = pow2f(se);
    if (threadIdx.x == 0) rs[row] = pow2f(-se);
  }
  for (int c8 = threadIdx.x; c8 < K / 8; c8 += blockDim.x) convert_a_chunk(xr, row, K, c8, f16, up, xa, xh, xl);
}

// P25: rmsnorm (with the residual add, as rmsnorm4_kernel: n = 4 · blockDim.x, one float4 per thread)
// and convert_a_kernel in one pass: the normalised row stays in shared memory for the conversion
// instead of going through global memory to a second kernel. Same arithmetic in the same order as
// the two kernels (the P19 dot on threads 0-255 with convert_a_kernel's stride; the extra warps'
// zero partials leave block_sum's result unchanged), so the outputs are bit-identical. `out` (the
// f32 normalised rows) is still written for any other reader.
// P59 (S = uint2 / float4, the fp16 / f32 slot rows): r is not read; the residual is the prefill MoE's
// combine of `slot` (slot_sum4, moe_combine_kernel's order) for this row, so the MoE's [T, H] output is never
// written. S = void: r (optional) as before.
template <typename S>
__global__ void __launch_bounds__(1024) rmsnorm_convert_kernel(float* h, const float* r, const S* slot, int sl_T,
                                                               int sl_K, const float* w, int n,
                                                               float eps, float* out, int f16,
                                                               uint16_t* __restrict__ xa, float* __restrict__ rs,
                                                               uint16_t* __restrict__ xh, uint16_t* __restrict__ xl,
                                                               const QMat dw, float* __restrict__ dy, int p70) {
  __shared__ float red[32];
  __shared__ __align__(16) float ys[4096];
  pdl_trigger();
  pdl_wait();
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x, base = row * n;
  float4 v = reinterpret_cast<const float4*>(h + base)[tid];
  if (std::is_void_v<S> ? r != nullptr : true) {
    float4 a;
    if constexpr (std::is_void_v<S>) a = reinterpret_cast<const float4*>(r + base)[tid];
    else a = slot_sum4(slot, sl_T, sl_K, n / 4, row, tid);
    v.x += a.x;
    v.y += a.y;
    v.z += a.z;
    v.w += a.w;
    reinterpret_cast<float4*>(h + base)[tid] = v;
  }
  const float scale = rsqrtf(block_sum(v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w, red) / float(n) + eps);
  const float4 g = reinterpret_cast<const float4*>(w)[tid];
  const float4 y = make_float4(v.x * scale * g.x, v.y * scale * g.y, v.z * scale * g.z, v.w * scale * g.w);
  if (out) reinterpret_cast<float4*>(out + base)[tid] = y;
  reinterpret_cast<float4*>(ys)[tid] = y;
  float amax = fmaxf(fmaxf(fabsf(y.x), fabsf(y.y)), fmaxf(fabsf(y.z), fabsf(y.w)));
  __syncthreads();   // ys complete; block_sum's reads of red done
  auto gate_dot = [&] {   // this thread's part of the P19 dot
    float d = 0.f;
    if (tid < 256) {
      if (p70 & 2)   // P70: the 8-bit gate's weights without qm_at's generic path (the same values)
        for (int i = tid; i < n; i += 256) d += ys[i] * qm_at_q8g64(dw, 0, i);
      else
        for (int i = tid; i < n; i += 256) d += ys[i] * qm_at(dw, 0, i);
    }
    return d;
  };
  if (dy) {
    const float d = block_sum(gate_dot(), red);
    if (tid == 0) dy[row] = d;
    __syncthreads();   // red is reused below
  }
  float up = 1.f;
  if (f16) {   // fp16: the row's power-of-two scale from its maximum |y|
    amax = warp_max(amax);
    if ((tid & 31) == 0) red[tid >> 5] = amax;
    __syncthreads();
    amax = red[0];
    for (int k = 1; k < int(blockDim.x >> 5); ++k) amax = fmaxf(amax, red[k]);
    const int se = f16_row_exp(amax);
    up = pow2f(se);
    if (tid == 0) rs[row] = pow2f(-se);
  }
  const bool need_h = !(p70 & 1) || !f16 || xh || xl;
  for (int c8 = tid; c8 < n / 8; c8 += blockDim.x) convert_a_chunk(ys, row, n, c8, f16, up, xa, xh, xl, need_h);
}

// P28: the GDN output's gated RMSNorm (gdn_norm_kernel: per token and 128-wide value head,
// y · rsqrt(mean y² + eps) · w · silu(z)) and convert_a_kernel in one pass, one block of min(nv, 8)
// warps per row; warp w takes heads w, w + W, ... (nv / W of them, all their loads issued at once:
// 8 rows in flight per SM). Lane l holds a head's columns l, l + 32, l + 64, l + 96, so each of its
// four warp sums is one of gdn_norm_kernel's per-warp sums, combined in block_sum's order ((r0 + r2) +
// (r1 + r3): its final butterfly over lanes 0-3): the outputs are bit-identical. The normalised row
// stays in shared memory for the conversion; out (f32) is written only when given.
// MINB (P75): launch bounds for MINB CTAs per SM (ncu, session 29: 60 registers without, 4 CTAs, 50 % occupancy,
// long-scoreboard stalls on z 32.5 %, 2.05 TB/s); with it the bf16 hi / lo arithmetic is also skipped when nothing
// writes it (as P70). Same bits.
constexpr int kGnMaxHeadsPerWarp = 4;
constexpr int kGnP75MinBlocks = 5;
template <typename Z, int MINB = 1>   // z: float, or __half (P62)
__global__ void __launch_bounds__(256, MINB) gdn_norm_convert_kernel(const float* __restrict__ y, const Z* __restrict__ z,
                                                               const float* __restrict__ w, int nv, float eps,
                                                               float* __restrict__ out, int f16,
                                                               uint16_t* __restrict__ xa, float* __restrict__ rs,
                                                               uint16_t* __restrict__ xh, uint16_t* __restrict__ xl) {
  __shared__ float red[8];
  __shared__ __align__(16) float ys[4096];
  pdl_trigger();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nw = blockDim.x >> 5, hp = nv / nw, n = nv * 128;
  float wl[4];   // the norm weights of this lane's columns (the same for every head), loaded once
#pragma unroll
  for (int u = 0; u < 4; ++u) wl[u] = w[lane + 32 * u];
  pdl_wait();
  const int64_t row = blockIdx.x;
  float o[kGnMaxHeadsPerWarp][4], zz[kGnMaxHeadsPerWarp][4];
#pragma unroll
  for (int i = 0; i < kGnMaxHeadsPerWarp; ++i)
    if (i < hp) {
      const int64_t base = row * n + (warp + i * nw) * 128;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        o[i][u] = y[base + lane + 32 * u];
        zz[i][u] = float(z[base + lane + 32 * u]);
      }
    }
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kGnMaxHeadsPerWarp; ++i)
    if (i < hp) {
      float r[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) r[u] = warp_sum(o[i][u] * o[i][u]);
      const float sc = rsqrtf(((r[0] + r[2]) + (r[1] + r[3])) / float(128) + eps);
      const int h0 = (warp + i * nw) * 128;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int c = lane + 32 * u;
        const float v = o[i][u] * sc * wl[u] * siluf_(zz[i][u]);
        ys[h0 + c] = v;
        if (out) out[row * n + h0 + c] = v;
        amax = fmaxf(amax, fabsf(v));
      }
    }
  amax = warp_max(amax);
  if (lane == 0) red[warp] = amax;
  __syncthreads();   // ys and red complete
  float up = 1.f;
  if (f16) {
    amax = red[0];
    for (int k = 1; k < nw; ++k) amax = fmaxf(amax, red[k]);
    const int se = f16_row_exp(amax);
    up = pow2f(se);
    if (tid == 0) rs[row] = pow2f(-se);
  }
  const bool need_h = MINB == 1 || !f16 || xh || xl;
  for (int c8 = tid; c8 < n / 8; c8 += blockDim.x) convert_a_chunk(ys, row, n, c8, f16, up, xa, xh, xl, need_h);
}

// P1 off: W -> bf16 or fp16 [rows, cols] in mma k-order with the fused path's rounding (bf16: the
// f32 s·q + b rounded; fp16: one fp16 FMA of q with s·2^8 and b·2^8, as dq4_pair).
__global__ void dequant_kernel(const QMat w, int f16, uint16_t* __restrict__ wb) {
  pdl_trigger();
  pdl_wait();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;   // chunk of 8
  if (i >= int64_t(w.rows) * (w.cols / 8)) return;
  const int64_t row = i / (w.cols / 8);
  const int c8 = int(i % (w.cols / 8)), G = c8 >> 3, L0 = (c8 & 7) * 8;
  uint32_t o[4];
  if (f16) {
    const uint32_t* codes = static_cast<const uint32_t*>(w.data) + row * (w.cols / 8) + G * 8;
    const __half s = __float2half_rn(qm_sb(w, w.scales, row, G) * float(1 << kGemmF16WExp));
    const __half b = __float2half_rn(qm_sb(w, w.biases, row, G) * float(1 << kGemmF16WExp));
    uint16_t e[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int L = gemm_kperm(L0 + u);
      const int q = int((codes[L >> 3] >> (4 * (L & 7))) & 15u);
      e[u] = __half_as_ushort(__hfma(__int2half_rn(q), s, b));
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) o[u] = uint32_t(e[2 * u]) | (uint32_t(e[2 * u + 1]) << 16);
  } else {
#pragma unroll
    for (int u = 0; u < 4; ++u)
      o[u] = pack_bf16(qm_at(w, row, G * 64 + gemm_kperm(L0 + 2 * u)), qm_at(w, row, G * 64 + gemm_kperm(L0 + 2 * u + 1)));
  }
  reinterpret_cast<uint4*>(wb)[i] = make_uint4(o[0], o[1], o[2], o[3]);
}

// P68: an 8-bit matrix as the P13 kernel's fp16 operand (x 2^8, mma k-order, as dequant_kernel's f16 copies):
// each weight s·q + b in f32, rounded once. One thread per 8 outputs (16 bytes).
__global__ void dequant8_f16_kernel(const QMat w, uint16_t* __restrict__ wb) {
  pdl_trigger();
  pdl_wait();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(w.rows) * (w.cols / 8)) return;
  const int64_t row = i / (w.cols / 8);
  const int c8 = int(i % (w.cols / 8)), G = c8 >> 3, L0 = (c8 & 7) * 8;
  uint32_t o[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const float v0 = qm_at(w, row, G * 64 + gemm_kperm(L0 + 2 * u)) * float(1 << kGemmF16WExp);
    const float v1 = qm_at(w, row, G * 64 + gemm_kperm(L0 + 2 * u + 1)) * float(1 << kGemmF16WExp);
    o[u] = h2_bits(__floats2half2_rn(v0, v1));
  }
  reinterpret_cast<uint4*>(wb)[i] = make_uint4(o[0], o[1], o[2], o[3]);
}

int env_int(const char* name, int def);
#include "backend/cuda/gemm_wg16.cuh"
#include "backend/cuda/gemm_moe_wg.cuh"

template <int BM, int BT, int AM, int BN, int V = 0>
void launch_gemm(const GemmArgs& a, int grid_m, int grid_n, cudaStream_t s) {
  static bool attr = false;
  if (!attr) {
    CUDA_CHECK(cudaFuncSetAttribute(gemm_kernel<BM, BT, AM, BN, V>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    smem_bytes<BM, BT, AM, BN>()));
    attr = true;
  }
  launch(gemm_kernel<BM, BT, AM, BN, V>, dim3(grid_m, grid_n, a.ksplit > 1 ? a.ksplit : 1), dim3(kThreads),
         size_t(smem_bytes<BM, BT, AM, BN>()), s, a);
}

template <int BT, int AM, int BN>
void launch_bm(int bm, const GemmArgs& a, int grid_m, int grid_n, cudaStream_t s) {
  if (bm == 128) launch_gemm<128, BT, AM, BN>(a, grid_m, grid_n, s);
  else if (bm == 64) launch_gemm<64, BT, AM, BN>(a, grid_m, grid_n, s);
  else launch_gemm<32, BT, AM, BN>(a, grid_m, grid_n, s);
}
template <int BT, int AM>
void launch_bn(int bm, int bn, const GemmArgs& a, int grid_m, int grid_n, cudaStream_t s) {
  if constexpr (BT == kQ4 && AM != kAmBf16) {   // 512 wide: BM = 64 / 32 only (moe_bn ensures it)
    if (bn == kBNMoe) {
      LILY_CHECK(bm <= 64 && a.N % (a.swiglu ? kBNMoe / 2 : kBNMoe) == 0 && a.K <= (1 << 20),
                 "gemm: 512-wide tiles need BM <= 64, whole N tiles and K <= 2^20");
      if (bm == 64) launch_gemm<64, BT, AM, kBNMoe>(a, grid_m, grid_n, s);
      else launch_gemm<32, BT, AM, kBNMoe>(a, grid_m, grid_n, s);
      return;
    }
  }
  LILY_CHECK(bn != kBNMoe, "gemm: 512-wide tiles are for 4-bit B with fp16 operands");
  if (bn == kBNWide) launch_bm<BT, AM, kBNWide>(bm, a, grid_m, grid_n, s);
  else launch_bm<BT, AM, kBN>(bm, a, grid_m, grid_n, s);
}

int env_int(const char* name, int def);

// The (B type, A mode) pairs that run on the wgmma kernel (128-wide tiles only).
bool on_wgmma(int bt, int am) {
  return bt == kQ4 && (am == kAmF16 || (am == kAmF16Grp && env_int("LILY_GEMM_WGMMA_GRP", 0))) && gemm_wgmma();
}

// bn: the CTA width the caller sized grid_n for (kBNWide only where gemm_bn allows it, kBNMoe only
// where moe_bn does).
void launch_any(int bt, int am, int bm, int bn, const GemmArgs& a, int grid_m, int grid_n, cudaStream_t s) {
  if (on_wgmma(bt, am)) {
    LILY_CHECK(bn == kBN, "gemm: the wgmma kernel has 128-wide tiles");
    if (am == kAmF16Grp) launch_wgmma_bm<kAmF16Grp>(bm, a, grid_m, grid_n, s);
    else launch_wgmma_bm<kAmF16>(bm, a, grid_m, grid_n, s);
  } else if (bt == kQ4) {
    if (am == kAmF16Grp) launch_bn<kQ4, kAmF16Grp>(bm, bn, a, grid_m, grid_n, s);
    else if (am == kAmF16) launch_bn<kQ4, kAmF16>(bm, bn, a, grid_m, grid_n, s);
    else launch_bn<kQ4, kAmBf16>(bm, bn, a, grid_m, grid_n, s);
  } else if (bt == kQ8) {
    LILY_CHECK(bn == kBN, "gemm: 8-bit matrices have 128-wide tiles");
    launch_bm<kQ8, kAmBf16, kBN>(bm, a, grid_m, grid_n, s);
  } else {
    if (am == kAmF16) launch_bn<kBF, kAmF16>(bm, bn, a, grid_m, grid_n, s);
    else launch_bn<kBF, kAmBf16>(bm, bn, a, grid_m, grid_n, s);
  }
  CUDA_LAUNCH_CHECK();
}

// P10: the CTA width of a call on the mma.sync kernel with 4-bit or 16-bit B. LILY_GEMM_BN=128|256
// (read per call) forces it; otherwise 256 with P10 on. `wide_ok`: the caller's own condition for
// the unforced choice (dense GEMMs: enough CTAs). 8-bit B and the wgmma kernel: always 128.
// LILY_GEMM_BN=512 counts as 256 here (dense GEMMs have no 512-wide form).
int gemm_bn(int bt, int am, bool wide_ok);
// The width of the MoE's grouped GEMMs (4-bit B) at M-tile bm: LILY_GEMM_BN=128|256|512 forces it,
// else LILY_MOE_BN=128|256|512 (default 256; 512 measured slower) with P10 on, 128 with P10 off. 512 wide needs fp16
// operands and BM <= 64; elsewhere it becomes 256 (BM = 128: 1x8 warps of 128x32).
int moe_bn(int am, int bm);

int env_int(const char* name, int def) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : def;
}

}  // namespace

namespace {
bool g_wgmma = false;
bool g_wg16 = true;
int g_wg16_min_tiles = 0;   // P52 (cuda_backend sets 72); 0 = three quarters of the SMs
// P13: whether a 16-bit-B fp16 GEMM of T x N x K runs on gemm_wg16_kernel. LILY_GEMM_WG16=0/1/2 (read
// per call) forces it off / on / on with TMA loads; otherwise P13 on, no LILY_GEMM_BN forcing (an
// mma.sync knob) and at least LILY_GEMM_WG16_MIN_TILES (default 3/4 of the SMs) 128x256 tiles: below
// that the mma.sync kernel's 64-token tiles fill the GPU better.
bool wg16_takes(int T, int N, int K) {
  if (K % kBK != 0 || T <= 0 || N <= 0) return false;
  const int forced = env_int("LILY_GEMM_WG16", -1);
  if (forced >= 0 && forced <= 2) return forced >= 1;
  if (!g_wg16 || env_int("LILY_GEMM_BN", 0) != 0) return false;
  const int64_t tiles = int64_t((T + kW16BM - 1) / kW16BM) * ((N + kW16BN - 1) / kW16BN);
  return tiles >= env_int("LILY_GEMM_WG16_MIN_TILES", g_wg16_min_tiles > 0 ? g_wg16_min_tiles : sm_count() * 3 / 4);
}
// The TMA form of the P13 kernel (default: 648 vs 461 TFLOP/s for the cp.async form on 8192x2048 at
// T = 4096, session 6): LILY_GEMM_WG16=1 forces the cp.async form, =2 the TMA form; otherwise
// LILY_GEMM_WG16_TMA=0 selects cp.async (read per call).
bool wg16_tma() {
  const int forced = env_int("LILY_GEMM_WG16", -1);
  if (forced == 1) return false;
  if (forced == 2) return true;
  return env_int("LILY_GEMM_WG16_TMA", 1) != 0;
}
}  // namespace
// P15 for the gate/up GEMM by default (session 7: MoE block 1.298 vs 1.330 ms at T = 4,096, +1.2 to
// +1.6 % end to end); LILY_MOE_WG, when set, chooses (0 = mma.sync for both GEMMs).
bool g_moe_p15 = true;
void gemm_set_moe_p15(bool on) { g_moe_p15 = on; }
// P17: P15 at M-tile 128 (one m64n128 block per consumer warpgroup); off: gemm_kernel runs the 128 tiles.
bool g_moe_p17 = true;
void gemm_set_moe_p17(bool on) { g_moe_p17 = on; }
bool gemm_moe_p17() { return g_moe_p17; }
// P18: the P17 kernel with 4 consumer warpgroups (256 weight rows per CTA); off: 2 (128 rows).
bool g_moe_p18 = true;
void gemm_set_moe_p18(bool on) { g_moe_p18 = on; }
bool gemm_moe_p18() { return g_moe_p18; }
// P32: the P18 kernel's step loop with running counters / pointers, one-LOP3 unpacking (same bits).
bool g_moe_p32 = true;
void gemm_set_moe_p32(bool on) { g_moe_p32 = on; }
bool gemm_moe_p32() { return g_moe_p32; }
// P34 (with P32): two 64-k steps per ring stage (4 stages): per-stage bookkeeping once per two steps.
// P35: gemm_kernel's scatter epilogue (the MoE down GEMM) with its rows' destinations and weights staged in
// shared memory before the mainloop.
bool g_moe_p35 = true;
void gemm_set_moe_p35(bool on) { g_moe_p35 = on; }
bool g_moe_p34 = true;
void gemm_set_moe_p34(bool on) { g_moe_p34 = on; }
bool gemm_moe_p34() { return g_moe_p34; }
// P50 (the P34 gate/up kernel): odd nibble pairs unpacked in place (dq4_pair_odd), one shift per code word.
bool g_moe_p50 = true;
void gemm_set_moe_p50(bool on) { g_moe_p50 = on; }
bool gemm_moe_p50() { return g_moe_p50; }
// P53: the gate/up GEMM of short prompts at M-tile 32 on the P34 kernel with an 8-stage ring.
bool g_moe_p53 = true;
void gemm_set_moe_p53(bool on) { g_moe_p53 = on; }
bool gemm_moe_p53() { return g_moe_p53; }
// P55: the down GEMM at M-tile 128 with the tile's activations resident (gemm_moe_down_res_kernel), NB weight blocks of
// 256 rows per CTA: 4, or 8 with P55n8 (LILY_TRY; LILY_P55_NB = 2 / 4 / 8 overrides, read per call).
bool g_moe_p55 = true;
int g_moe_p55_nb = 4;
void gemm_set_moe_p55(bool on, int nb) {
  g_moe_p55 = on;
  g_moe_p55_nb = nb;
}
bool gemm_moe_p55() { return g_moe_p55; }
// P78 (default on since session 30; --ablate P78): P55's fp16 slot rows stored 16 bytes per lane through shared memory
// (the same values). Session 30 call 2: +1.1 % prefill at 4K, +0.6 % at 1K, +0.8 % at 32K (without P79); the down GEMM
// 10.71 -> 9.77 ms per 4K prefill.
bool g_moe_p78 = true;
void gemm_set_moe_p78(bool on) { g_moe_p78 = on; }
static int p55_nb() {
  const int v = env_int("LILY_P55_NB", g_moe_p55_nb);
  return v == 2 || v == 8 ? v : 4;
}
// P38 (P34 kernel): each tile's wgmmas span its rows rounded up to 32 tokens instead of 128 (same bits).
bool g_moe_p38 = true;
void gemm_set_moe_p38(bool on) { g_moe_p38 = on; }
// P39 (gemm_kernel, the MoE down GEMM): m16 tiles wholly past the tile's rows skip their A loads and MMAs (same bits).
bool g_moe_p39 = true;
void gemm_set_moe_p39(bool on) { g_moe_p39 = on; }
// P70: gemm_rmsnorm_convert without the split operands' arithmetic when they are not written, and the P19 dot's 8-bit
// weights without qm_at's generic path (the same bits).
bool g_p70 = true;
void gemm_set_p70(bool on) { g_p70 = on; }
// P81 (default on since session 30; --ablate P81): the P13 kernel's fp16 output segments (P62) stored as whole 128-byte
// rows through shared memory instead of 4-byte pairs (8 rows x 16 bytes per store instruction); the same values.
// Session 30 call 3: +3.4 % prefill at 4K, +1.5 % at 1K, +1.7 % at 32K; the GDN projections 10.60 -> 9.58 ms per 4K.
bool g_p81 = true;
bool gemm_set_p81(bool on) {
  const bool was = g_p81;
  g_p81 = on;
  return was;
}
bool g_p75 = false;   // opt-in (LILY_TRY=P75): its kernel is faster, the 4K prefill was not (session 29)
bool gemm_set_p75(bool on) {
  const bool was = g_p75;
  g_p75 = on;
  return was;
}
// P43 (gemm_kernel, the MoE down GEMM): CTAs in N-tile-fastest order (a tile's activation rows read once from DRAM).
bool g_moe_p43 = true;
void gemm_set_moe_p43(bool on) { g_moe_p43 = on; }
// P46-P48 (gemm_kernel<64, kQ4, kAmF16Grp, 256, V>, the MoE down GEMM): its unpacking's mask and exponent OR in one
// LOP3; its odd pairs unpacked in place (one shift per word); a copy of its main loop without P39's checks.
bool g_moe_p46 = true, g_moe_p47 = true, g_moe_p48 = true;
void gemm_set_moe_p46(bool on) { g_moe_p46 = on; }
void gemm_set_moe_p47(bool on) { g_moe_p47 = on; }
void gemm_set_moe_p48(bool on) { g_moe_p48 = on; }
// Every combination of the three (V = 2, 4, ..., 14; V = 0 is launch_any's instance).
template <int... I>
void launch_down_v(int v, const GemmArgs& a, int grid_m, int grid_n, cudaStream_t s, std::integer_sequence<int, I...>) {
  using Fn = void (*)(const GemmArgs&, int, int, cudaStream_t);
  static constexpr Fn fns[] = {&launch_gemm<64, kQ4, kAmF16Grp, kBNWide, 2 * I>...};
  fns[v / 2](a, grid_m, grid_n, s);
}
int gemm_moe_wg() {
  const int forced = env_int("LILY_MOE_WG", -1);
  return forced >= 0 ? forced : (g_moe_p15 ? 2 : 0);
}
void gemm_set_wg16(bool on) { g_wg16 = on; }
void gemm_set_wg16_min_tiles(int n) { g_wg16_min_tiles = n; }
bool gemm_wg16() { return g_wg16; }
void gemm_set_wgmma(bool on) { g_wgmma = on; }
bool gemm_wgmma() { return g_wgmma; }

bool gemm_f16() {
  const char* v = std::getenv("LILY_GEMM_BF16");
  return !(v && *v && std::strcmp(v, "0") != 0);
}

bool gemm_ok(const QMat& w) {
  return (w.type == kQ4 || w.type == kQ8) && w.gs == 64 && !w.sb_f32 && w.cols % 512 == 0 && w.rows > 0;
}

namespace {
bool g_skinny = true;
bool g_wide = true;
}
void gemm_set_wide(bool on) { g_wide = on; }
bool gemm_wide() { return g_wide; }

namespace {
int gemm_bn(int bt, int am, bool wide_ok) {
  if (bt == kQ8 || on_wgmma(bt, am)) return kBN;
  const int forced = env_int("LILY_GEMM_BN", 0);
  if (forced == kBN || forced == kBNWide) return forced;
  if (forced == kBNMoe) return kBNWide;
  return g_wide && wide_ok ? kBNWide : kBN;
}
int moe_bn(int am, int bm) {
  if (on_wgmma(kQ4, am)) return kBN;
  int bn = env_int("LILY_GEMM_BN", 0);
  if (bn != kBN && bn != kBNWide && bn != kBNMoe) {
    // 256 by default: 512 measured slower (MoE block 1.523 vs 1.327 ms at T = 4096; 33,625 vs 35,942
    // tok/s end to end at 4K, session 6), so it stays an opt-in experiment (LILY_MOE_BN=512).
    bn = g_wide ? env_int("LILY_MOE_BN", kBNWide) : kBN;
    if (bn != kBN && bn != kBNWide && bn != kBNMoe) bn = kBNWide;
  }
  if (bn == kBNMoe && (am == kAmBf16 || bm > 64)) bn = kBNWide;
  return bn;
}
}  // namespace
void gemm_set_skinny(bool on) { g_skinny = on; }
int gemm_small_n(int T) {
  const int n = env_int("LILY_GEMM_SMALL_N", 64);
  if (!g_skinny || T < env_int("LILY_GEMM_SKINNY_T", 256)) return n;
  return std::min(n, env_int("LILY_GEMM_SKINNY_N", 32));
}

bool gemm_takes(const QMat& w, int T) { return gemm_ok(w) && w.rows >= gemm_small_n(T); }

void gemm_convert_a(const float* x, int T, int K, const GemmA& o, cudaStream_t s, const QMat* dot_w, float* dot_y) {
  LILY_CHECK(!o.f16 || (o.a && o.rs), "gemm_convert_a: fp16 needs the row scales");
  LILY_CHECK(!dot_y || (dot_w && dot_w->rows == 1 && dot_w->cols == K), "gemm_convert_a: the dot needs one row of K");
  uint16_t* hi = o.f16 || !o.a ? const_cast<uint16_t*>(o.hi) : nullptr;   // bf16: a is x_hi
  launch(convert_a_kernel, dim3(unsigned(T)), dim3(256), 0, s, x, K, int(o.f16), const_cast<uint16_t*>(o.a),
         const_cast<float*>(o.rs), hi, const_cast<uint16_t*>(o.lo), dot_y ? *dot_w : QMat{}, dot_y);
  CUDA_LAUNCH_CHECK();
}

// n / 4 threads per row: at least 256 (the P19 dot runs on threads 0-255 with convert_a_kernel's stride;
// with fewer it would miss columns — n = 128 failed the probe, session 11 call 7), at most 1024.
bool gemm_rmsnorm_convert_ok(int n) { return n % 128 == 0 && n >= 1024 && n <= 4096; }

void gemm_rmsnorm_convert(float* h, const float* r, const float* w, int n, int T, float eps, float* out,
                          const GemmA& o, cudaStream_t s, const QMat* dot_w, float* dot_y, const MoeSlots* slots) {
  LILY_CHECK(gemm_rmsnorm_convert_ok(n), "gemm_rmsnorm_convert: n must be a multiple of 128 in 1024..4096");
  LILY_CHECK(!o.f16 || (o.a && o.rs), "gemm_rmsnorm_convert: fp16 needs the row scales");
  LILY_CHECK(!dot_y || (dot_w && dot_w->rows == 1 && dot_w->cols == n), "gemm_rmsnorm_convert: the dot needs one row of n");
  LILY_CHECK(!slots || (!r && slots->p && slots->T == T && slots->K > 0),
             "gemm_rmsnorm_convert: the MoE slot rows replace r, for the same T rows");
  uint16_t* hi = o.f16 || !o.a ? const_cast<uint16_t*>(o.hi) : nullptr;   // as gemm_convert_a
  // P70: bit 1 = the bf16 halves only when written, bit 2 = the dot's 8-bit fast path (same bits either way).
  const int p70 = g_p70 ? 1 | (dot_y && qm_q8g64(*dot_w) ? 2 : 0) : 0;
  auto go = [&](auto kernel, const auto* sl) {
    launch(kernel, dim3(unsigned(T)), dim3(unsigned(n / 4)), 0, s, h, r, sl, T, slots ? slots->K : 0, w, n, eps, out,
           int(o.f16), const_cast<uint16_t*>(o.a), const_cast<float*>(o.rs), hi, const_cast<uint16_t*>(o.lo),
           dot_y ? *dot_w : QMat{}, dot_y, p70);
  };
  if (!slots) go(rmsnorm_convert_kernel<void>, static_cast<const void*>(nullptr));
  else if (slots->f16) go(rmsnorm_convert_kernel<uint2>, static_cast<const uint2*>(slots->p));
  else go(rmsnorm_convert_kernel<float4>, static_cast<const float4*>(slots->p));
  CUDA_LAUNCH_CHECK();
}

namespace {
// Host side of the conversion test entries (P25, P28): device buffers freed with the object, random
// inputs, one side's conversion outputs, byte comparison.
struct ProbeBufs {
  std::mt19937 g;
  std::normal_distribution<float> nd{0.f, 1.f};
  std::vector<void*> owned;
  explicit ProbeBufs(unsigned seed) : g(seed) {}
  ~ProbeBufs() {
    for (void* p : owned) CUDA_CHECK(cudaFree(p));
  }
  void* zeros(int64_t bytes) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, size_t(bytes)));
    CUDA_CHECK(cudaMemset(p, 0, size_t(bytes)));
    CUDA_CHECK(cudaDeviceSynchronize());   // the probes' kernels run on non-blocking streams
    owned.push_back(p);
    return p;
  }
  float* zeros_f(int64_t n) { return static_cast<float*>(zeros(n * 4)); }
  float* copy(const std::vector<float>& v) {
    float* p = zeros_f(int64_t(v.size()));
    CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());   // a pageable copy may return before its DMA has landed
    return p;
  }
  std::vector<float> randn(int64_t n, float sc) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = sc * nd(g);
    return v;
  }
};
// One side's conversion outputs for T rows of tn / T values.
struct ConvOut {
  float* rs;
  uint16_t *xa, *xh, *xl;
  ConvOut(ProbeBufs& b, int64_t tn, int T)
      : rs(b.zeros_f(T)),
        xa(static_cast<uint16_t*>(b.zeros(tn * 2))),
        xh(static_cast<uint16_t*>(b.zeros(tn * 2))),
        xl(static_cast<uint16_t*>(b.zeros(tn * 2))) {}
  GemmA operand(bool f16, bool split) const {
    GemmA a;
    a.f16 = f16;
    a.a = xa;
    a.rs = f16 ? rs : nullptr;
    a.hi = split ? xh : nullptr;
    a.lo = split ? xl : nullptr;
    return a;
  }
};
int64_t bytes_differ(const void* a, const void* b, int64_t bytes) {
  std::vector<uint8_t> x(static_cast<size_t>(bytes)), y(static_cast<size_t>(bytes));
  CUDA_CHECK(cudaMemcpy(x.data(), a, size_t(bytes), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(y.data(), b, size_t(bytes), cudaMemcpyDeviceToHost));
  int64_t d = 0;
  for (size_t i = 0; i < x.size(); ++i) d += x[i] != y[i];
  return d;
}
int64_t conv_differ(const ConvOut& a, const ConvOut& b, int64_t tn, int T) {
  return bytes_differ(a.rs, b.rs, int64_t(T) * 4) + bytes_differ(a.xa, b.xa, tn * 2) +
         bytes_differ(a.xh, b.xh, tn * 2) + bytes_differ(a.xl, b.xl, tn * 2);
}
}  // namespace

static QMat probe_q8(ProbeBufs& b, int N, int K);

int64_t gemm_rmsnorm_convert_probe(int n, int T, bool add, bool f16, bool split, int dot, unsigned seed, int slots) {
  ProbeBufs b(seed);
  const int64_t tn = int64_t(T) * n;
  const std::vector<float> h0 = b.randn(tn, 3.f);
  float* r = b.copy(b.randn(tn, 1.f));
  // P59: the residual as the MoE combine of 8 + 1 slot rows per token (fp16 or f32); the reference runs the
  // combine stage into r first, the fused kernel reads the slots.
  MoeSlots sl;
  if (slots) {
    sl.f16 = slots == 1;
    sl.T = T;
    sl.K = 8;
    const std::vector<float> v = b.randn(int64_t(T) * (sl.K + 1) * n, 0.4f);
    if (sl.f16) {
      std::vector<__half> hv(v.size());
      for (size_t i = 0; i < v.size(); ++i) hv[i] = __float2half_rn(v[i]);
      void* d = b.zeros(int64_t(hv.size()) * 2);
      CUDA_CHECK(cudaMemcpy(d, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice));
      sl.p = d;
    } else {
      sl.p = b.copy(v);
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    add = true;
  }
  float* w = b.copy(b.randn(n, 0.5f));
  QMat q;
  q.type = kF32;
  q.rows = 1;
  q.cols = n;
  q.data = b.copy(b.randn(n, 0.05f));
  if (dot == 2) q = probe_q8(b, 1, n);
  float* h[2] = {b.copy(h0), b.copy(h0)};
  float* out[2] = {b.zeros_f(tn), b.zeros_f(tn)};
  float* dy[2] = {b.zeros_f(T), b.zeros_f(T)};
  const ConvOut c0(b, tn, T), c1(b, tn, T);
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  if (slots) moe_prefill_combine(sl, n, r, s);
  rmsnorm(h[0], add ? r : nullptr, w, n, T, 1e-6f, out[0], s);
  gemm_convert_a(out[0], T, n, c0.operand(f16, split), s, dot ? &q : nullptr, dot ? dy[0] : nullptr);
  gemm_rmsnorm_convert(h[1], add && !slots ? r : nullptr, w, n, T, 1e-6f, out[1], c1.operand(f16, split), s,
                       dot ? &q : nullptr, dot ? dy[1] : nullptr, slots ? &sl : nullptr);
  CUDA_CHECK(cudaStreamSynchronize(s));
  CUDA_CHECK(cudaStreamDestroy(s));
  return bytes_differ(h[0], h[1], tn * 4) + bytes_differ(out[0], out[1], tn * 4) +
         bytes_differ(dy[0], dy[1], int64_t(T) * 4) + conv_differ(c0, c1, tn, T);
}

// A random router-like 8-bit matrix N x K on the device (probe aid).
static QMat probe_q8(ProbeBufs& b, int N, int K) {
  std::vector<uint8_t> codes(size_t(N) * K);
  std::vector<uint16_t> sc(size_t(N) * (K / 64)), bi(sc.size());
  std::uniform_int_distribution<int> ud(0, 255);
  for (uint8_t& c : codes) c = uint8_t(ud(b.g));
  auto bf = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  };
  for (size_t i = 0; i < sc.size(); ++i) {
    sc[i] = bf(0.002f * (1.f + 0.1f * b.nd(b.g)));
    bi[i] = bf(-0.25f + 0.01f * b.nd(b.g));
  }
  QMat w;
  w.type = kQ8;
  w.rows = N;
  w.cols = K;
  w.gs = 64;
  void* d = b.zeros(int64_t(codes.size()));
  void* ds = b.zeros(int64_t(sc.size()) * 2);
  void* db = b.zeros(int64_t(bi.size()) * 2);
  CUDA_CHECK(cudaMemcpy(d, codes.data(), codes.size(), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(ds, sc.data(), sc.size() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(db, bi.data(), bi.size() * 2, cudaMemcpyHostToDevice));
  w.data = d;
  w.scales = ds;
  w.biases = db;
  return w;
}

// The P37 / P68 probes: a router-shaped 8-bit GEMM of T rows with K in ksplit slices (every slice element must be
// written: the buffer starts as NaN), the slices summed on the host, against the split-precision GEMM unsplit: the
// largest |difference| over the largest |y|, 1e30 if any value is not finite. r16 (P68): the slices from the fp16
// operands on the router's fp16 copy (gemm_dequant8 + gemm_f16_ksplit); else (P37) the split-precision GEMM at bm.
static double router_probe(int T, int N, int K, int ksplit, int bm, unsigned seed, bool r16) {
  ProbeBufs b(seed);
  const QMat w = probe_q8(b, N, K);
  const int64_t tk = int64_t(T) * K, tn = int64_t(T) * N;
  float* x = b.copy(b.randn(tk, 1.f));
  const ConvOut c(b, tk, T);
  float* y1 = b.zeros_f(tn);
  float* yz = b.copy(std::vector<float>(size_t(tn * ksplit), std::numeric_limits<float>::quiet_NaN()));
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const GemmA xa = c.operand(r16, true);
  gemm_convert_a(x, T, K, xa, s);
  gemm(w, xa, T, y1, N, false, nullptr, bm, s);
  if (r16) {
    uint16_t* wb = static_cast<uint16_t*>(b.zeros(gemm_dequant_bytes(w)));
    gemm_dequant8(w, wb, s);
    gemm_f16_ksplit(c.operand(true, false), T, wb, N, K, yz, ksplit, s);
  } else {
    gemm(w, xa, T, yz, N, false, nullptr, bm, s, ksplit);
  }
  CUDA_CHECK(cudaStreamSynchronize(s));
  CUDA_CHECK(cudaStreamDestroy(s));
  std::vector<float> h1(static_cast<size_t>(tn)), hz(static_cast<size_t>(tn * ksplit));
  CUDA_CHECK(cudaMemcpy(h1.data(), y1, h1.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(hz.data(), yz, hz.size() * 4, cudaMemcpyDeviceToHost));
  double md = 0, my = 0;
  for (int64_t i = 0; i < tn; ++i) {
    double v = 0;
    for (int z = 0; z < ksplit; ++z) v += hz[size_t(z * tn + i)];
    if (!std::isfinite(v) || !std::isfinite(h1[size_t(i)])) return 1e30;
    md = std::max(md, std::fabs(v - h1[size_t(i)]));
    my = std::max(my, double(std::fabs(h1[size_t(i)])));
  }
  return my > 0 ? md / my : 1e30;
}

double gemm_splitk_probe(int T, int N, int K, int ksplit, int bm, unsigned seed) {
  return router_probe(T, N, K, ksplit, bm, seed, false);
}

double gemm_router16_probe(int T, int N, int K, int ksplit, unsigned seed) {
  return router_probe(T, N, K, ksplit, 0, seed, true);
}

bool gemm_gdn_norm_convert_ok(int nv, int dv) {
  return dv == 128 && nv >= 1 && nv <= 8 * kGnMaxHeadsPerWarp && (nv <= 8 || nv % 8 == 0);
}

void gemm_gdn_norm_convert(const float* y, const float* z, const float* w, int nv, int dv, int T, float eps,
                           float* out, const GemmA& o, cudaStream_t s, bool z16) {
  LILY_CHECK(gemm_gdn_norm_convert_ok(nv, dv), "gemm_gdn_norm_convert: value heads of 128, at most 8 or a multiple of 8 up to 32");
  LILY_CHECK(!o.f16 || (o.a && o.rs), "gemm_gdn_norm_convert: fp16 needs the row scales");
  uint16_t* hi = o.f16 || !o.a ? const_cast<uint16_t*>(o.hi) : nullptr;   // as gemm_convert_a
  const dim3 g{unsigned(T)}, b{unsigned(32 * std::min(nv, 8))};
  if (z16 && g_p75 && b.x == 256)   // P75 (6 CTAs per SM measured no better in session 29: 1.83 vs 1.80 ms per 4K)
    launch(gdn_norm_convert_kernel<__half, kGnP75MinBlocks>, g, b, 0, s, y, reinterpret_cast<const __half*>(z), w, nv,
           eps, out, int(o.f16), const_cast<uint16_t*>(o.a), const_cast<float*>(o.rs), hi, const_cast<uint16_t*>(o.lo));
  else if (z16)
    launch(gdn_norm_convert_kernel<__half>, g, b, 0, s, y, reinterpret_cast<const __half*>(z), w, nv, eps, out,
           int(o.f16), const_cast<uint16_t*>(o.a), const_cast<float*>(o.rs), hi, const_cast<uint16_t*>(o.lo));
  else
    launch(gdn_norm_convert_kernel<float>, g, b, 0, s, y, z, w, nv, eps, out, int(o.f16), const_cast<uint16_t*>(o.a),
           const_cast<float*>(o.rs), hi, const_cast<uint16_t*>(o.lo));
  CUDA_LAUNCH_CHECK();
}

int64_t gemm_gdn_norm_convert_probe(int nv, int T, bool f16, bool split, unsigned seed, bool z16) {
  ProbeBufs b(seed);
  const int n = nv * 128;
  const int64_t tn = int64_t(T) * n;
  const std::vector<float> y0 = b.randn(tn, 2.f);
  float* z = b.copy(b.randn(tn, 1.5f));
  if (z16) {   // P62: z as fp16 in z's buffer (both sides read it so; P75's kernel on the fused side)
    std::vector<float> zf(static_cast<size_t>(tn));
    CUDA_CHECK(cudaMemcpy(zf.data(), z, size_t(tn) * 4, cudaMemcpyDeviceToHost));
    std::vector<__half> zh(zf.size());
    for (size_t i = 0; i < zf.size(); ++i) zh[i] = __float2half_rn(zf[i]);
    CUDA_CHECK(cudaMemcpy(z, zh.data(), zh.size() * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  float* w = b.copy(b.randn(128, 0.5f));
  float* y[2] = {b.copy(y0), b.copy(y0)};
  float* y_raw = b.copy(y0);   // the fused kernel must leave its input raw
  float* out = b.zeros_f(tn);
  const ConvOut c0(b, tn, T), c1(b, tn, T);
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  GdnDims d{};
  d.nk = nv;
  d.nv = nv;
  d.dk = d.dv = 128;
  d.eps = 1e-6f;
  gdn_prefill_norm(d, w, z, T, y[0], s, z16);   // reference: in place, then the conversion
  gemm_convert_a(y[0], T, n, c0.operand(f16, split), s);
  gemm_gdn_norm_convert(y[1], z, w, nv, 128, T, 1e-6f, out, c1.operand(f16, split), s, z16);
  CUDA_CHECK(cudaStreamSynchronize(s));
  CUDA_CHECK(cudaStreamDestroy(s));
  return bytes_differ(y[0], out, tn * 4) + bytes_differ(y[1], y_raw, tn * 4) + conv_differ(c0, c1, tn, T);
}

int64_t gemm_dequant_bytes(const QMat& w) { return int64_t(w.rows) * w.cols * 2; }

void gemm_dequant(const QMat& w, bool f16, uint16_t* wb, cudaStream_t s) {
  const int64_t n = int64_t(w.rows) * (w.cols / 8);
  launch(dequant_kernel, dim3(unsigned((n + 255) / 256)), dim3(256), 0, s, w, int(f16), wb);
  CUDA_LAUNCH_CHECK();
}

void gemm(const QMat& w, const GemmA& x, int T, float* y, int64_t ldy, bool accumulate, const uint16_t* wb, int bm,
          cudaStream_t s, int ksplit) {
  LILY_CHECK(gemm_ok(w), "gemm: unsupported weight matrix");
  LILY_CHECK(w.type != kQ8 || (x.lo && !wb && (x.f16 ? x.hi : x.a)), "gemm: 8-bit weights need the split activations");
  LILY_CHECK(w.type == kQ8 || (x.a && (!x.f16 || x.rs)), "gemm: missing activations");
  int bt = w.type, am = kAmBf16;
  if (w.type != kQ8) am = x.f16 ? kAmF16 : kAmBf16;
  if (wb) bt = kBF;
  if (!bm) bm = env_int("LILY_GEMM_BM", 0);
  const bool bm_forced = bm == 32 || bm == 64 || bm == 128;
  // Largest M-tile that still fills the GPU (B re-reads fall with BM, idle SMs cost more).
  auto pick_bm = [&](int gn) {
    if (bm_forced) return bm;
    auto ctas = [&](int m) { return int64_t((T + m - 1) / m) * gn; };
    int b = 128;
    if (ctas(128) < sm_count()) b = 64;
    if (b == 64 && (T <= 32 || ctas(64) < sm_count())) b = 32;
    return b;
  };
  // P10: 256-wide tiles from T >= LILY_GEMM_BN_MIN_T (default 512) when they still fill the GPU with
  // BM >= 64 (halving the N tiles must not leave SMs idle: shorter chunks keep 128).
  int bn = kBN;
  if (gemm_bn(bt, am, true) == kBNWide) {
    const int fbn = env_int("LILY_GEMM_BN", 0);
    const bool forced = fbn == kBNWide || fbn == kBNMoe;
    const int b = pick_bm((w.rows + kBNWide - 1) / kBNWide);
    if (forced || (T >= env_int("LILY_GEMM_BN_MIN_T", 512) && (bm_forced || b >= 64))) bn = kBNWide;
  }
  const int gn = (w.rows + bn - 1) / bn;
  bm = pick_bm(gn);
  GemmArgs a{};
  a.raster = bn == kBNWide ? env_int("LILY_GEMM_RASTER", 0) : 0;
  a.K = w.cols;
  a.M = T;
  a.N = w.rows;
  a.b.w[0] = w;
  a.b.n_groups = 1;
  a.mode = accumulate ? kAccum : kStore;
  a.y = y;
  a.ldy = ldy;
  if (w.type == kQ8) {
    a.a = x.f16 ? x.hi : x.a;
    a.a_lo = x.lo;
  } else {
    a.a = x.a;
    a.a_scale = x.rs;
  }
  if (wb) {
    a.b.w[0].type = kBF;
    a.b.w[0].data = wb;
  }
  if (ksplit > 1) {   // P37
    LILY_CHECK(!accumulate && w.type == kQ8 && w.cols % (512 * ksplit) == 0,
               "gemm: split K is for 8-bit weights in store mode, K a multiple of 512 per slice");
    a.ksplit = ksplit;
    a.zstride = int64_t(T) * ldy;
  } else if (wb && am == kAmF16 && wg16_takes(T, w.rows, w.cols)) {   // P13
    launch_wg16(a, wg16_tma(), s);
    return;
  }
  launch_any(bt, am, bm, bn, a, (T + bm - 1) / bm, gn, s);
}

bool gemm_segmented_ok(int T, int N, int K, bool f16) { return f16 && wg16_takes(T, N, K); }

void gemm_dequant8(const QMat& w, uint16_t* wb, cudaStream_t s) {
  LILY_CHECK(w.type == kQ8 && w.cols % 64 == 0, "gemm_dequant8: 8-bit matrices, K a multiple of 64");
  const int64_t n = int64_t(w.rows) * (w.cols / 8);
  launch(dequant8_f16_kernel, dim3(unsigned((n + 255) / 256)), dim3(256), 0, s, w, wb);
  CUDA_LAUNCH_CHECK();
}

namespace {
// The arguments of y [T, N] (row stride ldy) = x · Wᵀ (store mode) from fp16 activations a16 with their row scales rs
// and a 16-bit weight copy wb [N, K] (the P13 kernel's and the P8 path's operands).
GemmArgs f16_args(const uint16_t* a16, const float* rs, int T, int K, const uint16_t* wb, int N, float* y, int64_t ldy) {
  GemmArgs a{};
  a.a = a16;
  a.a_scale = rs;
  a.K = K;
  a.M = T;
  a.N = N;
  a.b.n_groups = 1;
  a.b.w[0].type = kBF;
  a.b.w[0].rows = N;
  a.b.w[0].cols = K;
  a.b.w[0].data = wb;
  a.mode = kStore;
  a.y = y;
  a.ldy = ldy;
  return a;
}
}  // namespace

void gemm_f16_ksplit(const GemmA& x, int T, const uint16_t* wb, int N, int K, float* y, int ksplit, cudaStream_t s) {
  LILY_CHECK(x.f16 && x.a && x.rs && wb, "gemm_f16_ksplit: fp16 activations and a 16-bit weight copy");
  LILY_CHECK(T > 0 && N > 0 && K % kBK == 0 && ksplit >= 1 && (K / kBK) % ksplit == 0,
             "gemm_f16_ksplit: whole 64-column steps per K slice");
  GemmArgs a = f16_args(x.a, x.rs, T, K, wb, N, y, N);
  a.ksplit = ksplit;
  a.zstride = int64_t(T) * N;
  launch_wg16(a, true, s);
}

void gemm_segmented(const GemmA& x, int T, int K, const uint16_t* wb, int nseg, const int* rows, float* const* ys,
                    cudaStream_t s, int h16) {
  LILY_CHECK(nseg >= 1 && nseg <= kGemmMaxSegs, "gemm_segmented: 1..4 segments");
  LILY_CHECK(x.f16 && x.a && x.rs && wb, "gemm_segmented: fp16 activations and a 16-bit weight copy");
  int n = 0;
  for (int q = 0; q < nseg; ++q) {
    LILY_CHECK(rows[q] > 0 && rows[q] % 2 == 0, "gemm_segmented: segments of an even number of rows");
    n += rows[q];
  }
  GemmArgs a = f16_args(x.a, x.rs, T, K, wb, n, ys[0], rows[0]);
  a.nseg = nseg;
  a.seg_h16 = h16;
  a.p81 = g_p81 ? 1 : 0;
  for (int q = 0, n0 = 0; q < nseg; n0 += rows[q], ++q) {
    a.seg_n0[q] = n0;
    a.seg_y[q] = ys[q];
    a.seg_ld[q] = rows[q];
  }
  LILY_CHECK(wg16_takes(T, n, K), "gemm_segmented: shape not on the P13 kernel");
  launch_wg16(a, wg16_tma(), s);
}

int64_t gemm_segmented_probe(int T, int K, int nseg, const int* rows, unsigned seed, int h16) {
  ProbeBufs b(seed);
  std::uniform_real_distribution<float> ud(-1.f, 1.f);
  int N = 0;
  for (int q = 0; q < nseg; ++q) N += rows[q];
  auto fp16_rand = [&](int64_t n) {   // n random fp16 values on the device
    std::vector<uint16_t> h(static_cast<size_t>(n));
    for (uint16_t& v : h) v = __half_as_ushort(__float2half(ud(b.g)));
    void* d = b.zeros(n * 2);
    CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());   // as ProbeBufs::copy
    return static_cast<const uint16_t*>(d);
  };
  const uint16_t* a = fp16_rand(int64_t(T) * K);
  const uint16_t* w = fp16_rand(int64_t(N) * K);
  std::vector<float> hrs(static_cast<size_t>(T));
  for (float& v : hrs) v = std::ldexp(1.f, int(b.g() % 5) - 2);
  GemmA x;
  x.f16 = true;
  x.a = a;
  x.rs = b.copy(hrs);
  std::vector<float*> ys(static_cast<size_t>(nseg));
  for (int q = 0; q < nseg; ++q)   // NaN: every element must be written
    ys[size_t(q)] = b.copy(std::vector<float>(size_t(T) * rows[q], std::numeric_limits<float>::quiet_NaN()));
  float* whole = b.zeros_f(int64_t(T) * N);
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  gemm_segmented(x, T, K, w, nseg, rows, ys.data(), s, h16);
  gemm_segmented(x, T, K, w, 1, &N, &whole, s);   // the same GEMM, one output
  CUDA_CHECK(cudaStreamSynchronize(s));
  CUDA_CHECK(cudaStreamDestroy(s));
  std::vector<float> hw(static_cast<size_t>(T) * N);
  CUDA_CHECK(cudaMemcpy(hw.data(), whole, hw.size() * 4, cudaMemcpyDeviceToHost));
  int64_t diff = 0;
  int n0 = 0;
  for (int q = 0; q < nseg; ++q) {
    std::vector<float> hy(static_cast<size_t>(T) * rows[q]);
    if ((h16 >> q) & 1) {   // P62: the f32 product rounded to fp16 (saturated), bit for bit; the rest untouched (NaN)
      std::vector<__half> hh(hy.size());
      CUDA_CHECK(cudaMemcpy(hh.data(), ys[size_t(q)], hh.size() * 2, cudaMemcpyDeviceToHost));
      std::vector<float> tail(hy.size() / 2);
      CUDA_CHECK(cudaMemcpy(tail.data(), ys[size_t(q)] + hy.size() / 2, tail.size() * 4, cudaMemcpyDeviceToHost));
      for (int t = 0; t < T; ++t) {
        bool bad = false;
        for (int c = 0; c < rows[q]; ++c) {
          const float v = std::fmin(std::fmax(hw[size_t(t) * N + n0 + c], -65504.f), 65504.f);
          bad = bad || __half_as_ushort(__float2half_rn(v)) != __half_as_ushort(hh[size_t(t) * rows[q] + c]);
        }
        diff += bad;
      }
      for (float v : tail) diff += !std::isnan(v);   // nothing written past the fp16 rows
    } else {
      CUDA_CHECK(cudaMemcpy(hy.data(), ys[size_t(q)], hy.size() * 4, cudaMemcpyDeviceToHost));
      for (int t = 0; t < T; ++t)
        diff += std::memcmp(&hy[size_t(t) * rows[q]], &hw[size_t(t) * N + n0], size_t(rows[q]) * 4) != 0;
    }
    n0 += rows[q];
  }
  return diff;
}

void gemm_f16_raw(int kernel, const uint16_t* a16, const float* rs, int T, int K, const uint16_t* b16, int N,
                  float* y, int64_t ldy, bool accumulate) {
  static cudaStream_t s = nullptr;
  if (!s) CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_CHECK(cudaDeviceSynchronize());
  LILY_CHECK(K % kBK == 0 && T > 0 && N > 0, "gemm_f16_raw: K must be a multiple of 64");
  GemmArgs a = f16_args(a16, rs, T, K, b16, N, y, ldy);
  if (accumulate) a.mode = kAccum;
  if (kernel >= 1) launch_wg16(a, kernel == 2, s);
  else launch_any(kBF, kAmF16, 128, kBNWide, a, (T + 127) / 128, (N + kBNWide - 1) / kBNWide, s);
  CUDA_CHECK(cudaStreamSynchronize(s));
}

void gemm_grouped_swiglu(const GroupedB& b, const GemmA& x, const int* a_rows, const int4* tiles, const int* n_tiles,
                         int max_tiles, int bm, uint16_t* act, int8_t* act_exp, int ld_act, cudaStream_t s) {
  GemmArgs a{};
  a.a = x.a;
  a.a_scale = x.rs;
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
  a.act_exp = act_exp;
  a.ld_exp = ld_act / 64;
  a.var_n = g_moe_p38 ? 1 : 0;
  LILY_CHECK(a.N % 64 == 0 && ld_act >= a.N && (!x.f16 || (x.rs && act_exp)), "gemm_grouped_swiglu: arguments");
  // P10: 256-wide tiles = 128 gate + 128 up rows, 128 activation columns (two exponent groups) per CTA;
  // 512 wide: 256 + 256 rows, 256 columns (four groups).
  const int am = x.f16 ? kAmF16 : kAmBf16;
  const int wg = gemm_moe_wg();   // 1: P14, 2 and 3: P15
  if (am == kAmF16 && a.N % (kMwBN / 2) == 0 && wg > 0 &&
      launch_moe_wg(wg >= 2 ? 2 : 1, am, bm, a, max_tiles, a.N / (kMwBN / 2), s))
    return;
  int bn = moe_bn(am, bm);
  if (bn == kBNMoe && a.N % (kBNMoe / 2) != 0) bn = kBNWide;   // 512 wide: whole N tiles only
  launch_any(kQ4, am, bm, bn, a, max_tiles, (a.N + bn / 2 - 1) / (bn / 2), s);
}

bool gemm_grouped_scatter(const GroupedB& b, const uint16_t* act, const int8_t* act_exp, bool f16, const int4* tiles,
                          const int* n_tiles, int max_tiles, int bm, const int* dst, const float* scale, float* y,
                          int64_t ldy, cudaStream_t s, bool y16) {
  GemmArgs a{};
  a.a = act;
  a.act_exp = const_cast<int8_t*>(act_exp);
  a.K = b.w[0].cols;
  a.ld_exp = a.K / 64;
  a.N = b.w[0].rows;
  a.b = b;
  a.tiles = tiles;
  a.n_tiles = n_tiles;
  a.mode = kScatter;
  a.dst = dst;
  a.pre_scatter = g_moe_p35;
  a.var_n = g_moe_p38 ? 1 : 0;
  a.skip_pad = g_moe_p39 ? 1 : 0;
  a.n_fast = g_moe_p43 ? 1 : 0;
  a.scale = scale;
  a.y = y;
  a.ldy = ldy;
  LILY_CHECK(!f16 || (act_exp && a.K <= kMaxGrpK), "gemm_grouped_scatter: fp16 needs the exponents, K <= 1024");
  const int am = f16 ? kAmF16Grp : kAmBf16;
  const int wg = gemm_moe_wg();   // 1: P14, 3: P15 (2: P15 for gate/up only, the down GEMM on gemm_kernel)
  if (am == kAmF16Grp && wg == 2 && bm == 128 && g_moe_p55) {   // P55: fp16 slot rows as P16 (f32 without it)
    const bool y16s = y16 && ldy % 2 == 0;
    if (launch_moe_down_res(a, max_tiles, p55_nb(), y16s, g_moe_p78, s)) return y16s;
  }
  if (am == kAmF16Grp && (wg == 1 || wg == 3) &&
      launch_moe_wg(wg == 1 ? 1 : 2, am, bm, a, max_tiles, (a.N + kMwBN - 1) / kMwBN, s))
    return false;   // P14 / P15 epilogues write f32
  int bn = moe_bn(am, bm);
  if (bn == kBNMoe && a.N % kBNMoe != 0) bn = kBNWide;   // 512 wide: whole N tiles only
  a.y16 = y16 && !on_wgmma(kQ4, am) && ldy % 2 == 0 ? 1 : 0;   // P16 on the mma.sync kernel only
  const int v = (g_moe_p46 ? 2 : 0) | (g_moe_p47 ? 4 : 0) | (g_moe_p48 ? 8 : 0);   // P46-P48 (the same bits)
  if (v && am == kAmF16Grp && bm == 64 && bn == kBNWide && !on_wgmma(kQ4, am)) {
    launch_down_v(v, a, max_tiles, (a.N + kBNWide - 1) / kBNWide, s, std::make_integer_sequence<int, 8>{});
    CUDA_LAUNCH_CHECK();
    return a.y16 != 0;
  }
  launch_any(kQ4, am, bm, bn, a, max_tiles, (a.N + bn - 1) / bn, s);
  return a.y16 != 0;
}

void gemm_moe_raw(int kernel, int bm, bool swiglu, const uint16_t* a16, const float* rs, const int8_t* aexp,
                  const int* a_rows, int K, int N, int E, const void* codes, const void* scales, const void* biases,
                  const void* codes2, const void* scales2, const void* biases2, const int* tiles, int n_tiles,
                  const int* dst, const float* scale, float* y, uint16_t* act, int8_t* act_exp) {
  static cudaStream_t s = nullptr;
  if (!s) CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_CHECK(cudaDeviceSynchronize());
  LILY_CHECK(K % 512 == 0 && N % 128 == 0 && n_tiles > 0 && (bm == 32 || bm == 64 || bm == 128),
             "gemm_moe_raw: arguments");
  int4* dt = nullptr;
  int* dn = nullptr;
  CUDA_CHECK(cudaMalloc(&dt, size_t(n_tiles) * sizeof(int4)));
  CUDA_CHECK(cudaMalloc(&dn, sizeof(int)));
  CUDA_CHECK(cudaMemcpy(dt, tiles, size_t(n_tiles) * sizeof(int4), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dn, &n_tiles, sizeof(int), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaDeviceSynchronize());   // the GEMM runs on the non-blocking stream s
  auto mat = [&](const void* c, const void* sc, const void* bi) {
    QMat w;
    w.type = kQ4;
    w.rows = N;
    w.cols = K;
    w.gs = 64;
    w.data = c;
    w.scales = sc;
    w.biases = bi;
    return w;
  };
  GroupedB b;
  b.w[0] = b.extra[0] = mat(codes, scales, biases);
  if (swiglu) b.w[1] = b.extra[1] = mat(codes2, scales2, biases2);
  b.stride = int64_t(N) * K / 2;
  b.sb_stride = int64_t(N) * (K / 64) * 2;
  b.n_groups = E;
  const char* old = std::getenv("LILY_MOE_WG");
  const std::string keep = old ? old : "";
  setenv("LILY_MOE_WG", kernel == 2 ? "3" : std::to_string(kernel).c_str(), 1);   // 3: P15 for both GEMMs
  if (swiglu) {
    GemmA x;
    x.a = a16;
    x.rs = rs;
    x.f16 = true;
    gemm_grouped_swiglu(b, x, a_rows, dt, dn, n_tiles, bm, act, act_exp, N, s);
  } else {
    gemm_grouped_scatter(b, a16, aexp, true, dt, dn, n_tiles, bm, dst, scale, y, N, s);
  }
  if (old) setenv("LILY_MOE_WG", keep.c_str(), 1);
  else unsetenv("LILY_MOE_WG");
  const cudaError_t e = cudaStreamSynchronize(s);
  cudaFree(dt);
  cudaFree(dn);
  CUDA_CHECK(e);
}

}  // namespace lily::cuda
