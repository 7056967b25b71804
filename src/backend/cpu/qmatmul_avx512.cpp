// AVX-512 qmatmul kernels. Every function carries a target attribute so the file builds without
// -mavx512f and only runs after cpu_best_isa() saw the CPU support it.
#include "backend/cpu/simd_qmatmul.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cstring>

// GCC 12's AVX-512 headers self-initialise placeholder vectors (`__m512i __Y = __Y;`), which
// -Wmaybe-uninitialized reports at every inlined use; the warning says nothing about this code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// Token loops must be fully unrolled so the per-token accumulators live in registers.
#define LILY_UNROLL _Pragma("GCC unroll 16")
#define LILY_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

namespace lily::qmm {

namespace {

LILY_AVX512 inline __mmask16 tail_mask(int64_t n) { return __mmask16((1u << n) - 1); }

// Σ a[i]·b[i], i < n.
LILY_AVX512 inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

LILY_AVX512 inline __m512 bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

LILY_AVX512 inline __m512 bf16x16_masked(__mmask16 m, const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// Scales (or biases) [i0, i0+n) of a bf16/f32 tensor into f32 out[n].
LILY_AVX512 inline void load_sb(const void* p, bool f32, int64_t i0, int64_t n, float* out) {
  if (f32) {
    std::memcpy(out, static_cast<const float*>(p) + i0, size_t(n) * 4);
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(p) + i0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, bf16x16(s + i));
  if (i < n) _mm512_mask_storeu_ps(out + i, tail_mask(n - i), bf16x16_masked(tail_mask(n - i), s + i));
}

// ---- 4-bit ---------------------------------------------------------------------------------------
// A 128-element block is 16 code words, one per lane; nibble n of every lane is turned into floats
// by one permute from the table {0..15} (vpermps reads only the low 4 index bits, so no mask is
// needed) and meets 16 contiguous floats of the reordered x. A trailing 64-element block runs the
// same code on 8 lanes with masked loads (the other lanes see zero codes and zero x). Lane l covers
// elements e+8l .. e+8l+7, all in group (e+8l)/gs, so one permute of the row's f32 scales (or a
// broadcast when gs >= 128) gives the scale of every lane.
struct Lanes {
  __m512i gidx;   // lane -> group offset inside a block
  int shift;      // log2(group_size)
  bool uniform;   // gs >= 128: one group per block
};

LILY_AVX512 inline Lanes make_lanes(int gs) {
  alignas(64) int32_t gidx[16];
  for (int l = 0; l < 16; ++l) gidx[l] = int32_t(l * 8 / gs);
  return {_mm512_load_si512(gidx), __builtin_ctz(unsigned(gs)), gs >= 128};
}

// Scale (or bias) of every lane of the block at element e, from a row's f32 values v.
LILY_AVX512 inline __m512 lane_values(const float* v, int64_t e, const Lanes& L) {
  return L.uniform ? _mm512_set1_ps(v[e >> L.shift])
                   : _mm512_permutexvar_ps(L.gidx, _mm512_loadu_ps(v + (e >> L.shift)));
}

// Row r's scales and biases as f32, zero-padded so a full-vector read past the last group sees 0.
LILY_AVX512 inline void row_sb(const Job& j, int64_t r, float* sf, float* bf) {
  const int64_t G = j.groups;
  load_sb(j.W.scales, j.W.sb_f32, r * G, G, sf);
  load_sb(j.W.biases, j.W.sb_f32, r * G, G, bf);
  _mm512_storeu_ps(sf + G, _mm512_setzero_ps());
  _mm512_storeu_ps(bf + G, _mm512_setzero_ps());
}

template <bool kFull>
LILY_AVX512 inline __m512 load_x(const float* p) {
  return kFull ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(__mmask16(0x00ff), p);
}

// One block of the decode kernel: acc[t] += lane scales · Σ_n q_n·x_n. kFull: 16 lanes, else the
// trailing 8-lane block (masked loads; x of that block is laid out with 8 lanes).
template <int TB, bool kFull>
LILY_AVX512 inline void affine4_block(const uint32_t* codes, const float* const* xp, const float* sf,
                                      int64_t e, const Lanes& L, __m512* acc) {
  constexpr __mmask16 m = kFull ? 0xffff : 0x00ff;
  constexpr int step = kFull ? 16 : 8;
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i v = kFull ? _mm512_loadu_si512(codes + e / 8) : _mm512_maskz_loadu_epi32(m, codes + e / 8);
  __m512 ba[TB];
  __m512 q = _mm512_permutexvar_ps(v, table);
  LILY_UNROLL for (int t = 0; t < TB; ++t) ba[t] = _mm512_mul_ps(q, load_x<kFull>(xp[t] + e));
#pragma GCC unroll 7
  for (int n = 1; n < 8; ++n) {
    v = _mm512_srli_epi32(v, 4);
    q = _mm512_permutexvar_ps(v, table);
    LILY_UNROLL for (int t = 0; t < TB; ++t) ba[t] = _mm512_fmadd_ps(q, load_x<kFull>(xp[t] + e + step * n), ba[t]);
  }
  const __m512 sv = lane_values(sf, e, L);
  LILY_UNROLL for (int t = 0; t < TB; ++t) acc[t] = _mm512_fmadd_ps(sv, ba[t], acc[t]);
}

// Few tokens (decode): Σ(s·q+b)·x = s·Σq·x + b·Σx, so per block only one multiply by the lane
// scales, and the bias term is a dot product of the row's biases with the per-group sums of x.
template <int TB>
LILY_AVX512 void affine4_rows(const Job& j, int64_t r0, int64_t r1, int t0, float* sf, float* bf) {
  const int64_t cols = j.cols, G = j.groups, words_per_row = cols / 8;
  const Lanes L = make_lanes(j.W.group_size);
  const float* xp[TB];
  const float* xs[TB];
  LILY_UNROLL for (int t = 0; t < TB; ++t) {
    xp[t] = j.xp + int64_t(t0 + t) * cols;
    xs[t] = j.xsum + int64_t(t0 + t) * j.xsum_stride;
  }
  for (int64_t r = r0; r < r1; ++r) {
    row_sb(j, r, sf, bf);
    const uint32_t* codes = static_cast<const uint32_t*>(j.W.data) + r * words_per_row;
    __m512 acc[TB];
    LILY_UNROLL for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
    int64_t e = 0;
    for (; e + 128 <= cols; e += 128) affine4_block<TB, true>(codes, xp, sf, e, L, acc);
    if (e < cols) affine4_block<TB, false>(codes, xp, sf, e, L, acc);
    LILY_UNROLL for (int t = 0; t < TB; ++t)
      j.y[int64_t(t0 + t) * j.rows + r] = _mm512_reduce_add_ps(acc[t]) + dot(bf, xs[t], G);
  }
}

// Prompt blocks of 4 tokens: an R-row × 4-token register tile. Each block of codes is dequantised
// once per row (w = s·q + b, one FMA) and each x vector is loaded once for R rows, so the x block
// (4 tokens, 32 KiB at 2048 columns) stays in L1 while rows stream past it.
constexpr int kTileTokens = 4;

// One block of the prompt tile: dequantise R rows' codes, multiply with 4 tokens' x.
template <int R, bool kFull>
LILY_AVX512 inline void affine4_tile_block(const uint32_t* const* codes, const float* const* sf,
                                           const float* const* bf, const float* xp, int64_t cols,
                                           int64_t e, const Lanes& L, __m512 (*acc)[kTileTokens]) {
  constexpr int TB = kTileTokens, step = kFull ? 16 : 8;
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i v[R];
  __m512 sv[R], bv[R];
  LILY_UNROLL for (int i = 0; i < R; ++i) {
    v[i] = kFull ? _mm512_loadu_si512(codes[i] + e / 8) : _mm512_maskz_loadu_epi32(0x00ff, codes[i] + e / 8);
    sv[i] = lane_values(sf[i], e, L);
    bv[i] = lane_values(bf[i], e, L);
  }
#pragma GCC unroll 8
  for (int n = 0; n < 8; ++n) {
    __m512 xv[TB];
    LILY_UNROLL for (int t = 0; t < TB; ++t) xv[t] = load_x<kFull>(xp + t * cols + e + step * n);
    LILY_UNROLL for (int i = 0; i < R; ++i) {
      const __m512 w = _mm512_fmadd_ps(_mm512_permutexvar_ps(v[i], table), sv[i], bv[i]);
      v[i] = _mm512_srli_epi32(v[i], 4);
      LILY_UNROLL for (int t = 0; t < TB; ++t) acc[i][t] = _mm512_fmadd_ps(w, xv[t], acc[i][t]);
    }
  }
}

template <int R>
LILY_AVX512 void affine4_tile(const Job& j, int64_t r, int t0, float* scratch, const Lanes& L) {
  constexpr int TB = kTileTokens;
  const int64_t cols = j.cols, stride = 2 * (j.groups + 32), words_per_row = cols / 8;
  const uint32_t* codes[R];
  const float* sf[R];
  const float* bf[R];
  LILY_UNROLL for (int i = 0; i < R; ++i) {
    float* s = scratch + i * stride;
    row_sb(j, r + i, s, s + j.groups + 32);
    sf[i] = s;
    bf[i] = s + j.groups + 32;
    codes[i] = static_cast<const uint32_t*>(j.W.data) + (r + i) * words_per_row;
  }
  const float* xp = j.xp + int64_t(t0) * cols;
  __m512 acc[R][TB];
  LILY_UNROLL for (int i = 0; i < R; ++i) LILY_UNROLL for (int t = 0; t < TB; ++t) acc[i][t] = _mm512_setzero_ps();
  int64_t e = 0;
  for (; e + 128 <= cols; e += 128) affine4_tile_block<R, true>(codes, sf, bf, xp, cols, e, L, acc);
  if (e < cols) affine4_tile_block<R, false>(codes, sf, bf, xp, cols, e, L, acc);
  LILY_UNROLL for (int i = 0; i < R; ++i) LILY_UNROLL for (int t = 0; t < TB; ++t)
    j.y[int64_t(t0 + t) * j.rows + r + i] = _mm512_reduce_add_ps(acc[i][t]);
}

LILY_AVX512 void affine4_tiles(const Job& j, int64_t r0, int64_t r1, int t0, float* scratch) {
  const Lanes L = make_lanes(j.W.group_size);
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) affine4_tile<4>(j, r, t0, scratch, L);
  switch (r1 - r) {
    case 3: affine4_tile<3>(j, r, t0, scratch, L); break;
    case 2: affine4_tile<2>(j, r, t0, scratch, L); break;
    case 1: affine4_tile<1>(j, r, t0, scratch, L); break;
    default: break;
  }
}

// 8-bit rows: a code byte per element in element order, so 16 codes widen straight to floats and
// meet x in its natural order; scales apply once per group.
template <int TB>
LILY_AVX512 void affine8_rows(const Job& j, int64_t r0, int64_t r1, int t0, float* sf, float* bf) {
  const int64_t cols = j.cols, G = j.groups, gs = j.W.group_size;
  const float* x[TB];
  const float* xs[TB];
  LILY_UNROLL for (int t = 0; t < TB; ++t) {
    x[t] = j.x + int64_t(t0 + t) * cols;
    xs[t] = j.xsum + int64_t(t0 + t) * j.xsum_stride;
  }
  for (int64_t r = r0; r < r1; ++r) {
    load_sb(j.W.scales, j.W.sb_f32, r * G, G, sf);
    load_sb(j.W.biases, j.W.sb_f32, r * G, G, bf);
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(static_cast<const uint32_t*>(j.W.data) + r * (cols / 4));
    __m512 acc[TB];
    LILY_UNROLL for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m512 ba[TB];
      LILY_UNROLL for (int t = 0; t < TB; ++t) ba[t] = _mm512_setzero_ps();
      for (int64_t e = g * gs; e < (g + 1) * gs; e += 16) {
        const __m512 q = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + e))));
        LILY_UNROLL for (int t = 0; t < TB; ++t) ba[t] = _mm512_fmadd_ps(q, _mm512_loadu_ps(x[t] + e), ba[t]);
      }
      const __m512 sv = _mm512_set1_ps(sf[g]);
      LILY_UNROLL for (int t = 0; t < TB; ++t) acc[t] = _mm512_fmadd_ps(sv, ba[t], acc[t]);
    }
    LILY_UNROLL for (int t = 0; t < TB; ++t)
      j.y[int64_t(t0 + t) * j.rows + r] = _mm512_reduce_add_ps(acc[t]) + dot(bf, xs[t], G);
  }
}

// bf16 / f32 rows; two accumulators per token so a single token is not bound by FMA latency.
template <int TB, bool kBf16>
LILY_AVX512 void dense_rows(const Job& j, int64_t r0, int64_t r1, int t0) {
  const int64_t cols = j.cols;
  const float* x[TB];
  LILY_UNROLL for (int t = 0; t < TB; ++t) x[t] = j.x + int64_t(t0 + t) * cols;
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* wb = static_cast<const uint16_t*>(j.W.data) + r * cols;
    const float* wf = static_cast<const float*>(j.W.data) + r * cols;
    __m512 a0[TB], a1[TB];
    LILY_UNROLL for (int t = 0; t < TB; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= cols; k += 32) {
      const __m512 w0 = kBf16 ? bf16x16(wb + k) : _mm512_loadu_ps(wf + k);
      const __m512 w1 = kBf16 ? bf16x16(wb + k + 16) : _mm512_loadu_ps(wf + k + 16);
      LILY_UNROLL for (int t = 0; t < TB; ++t) {
        a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[t] + k), a0[t]);
        a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[t] + k + 16), a1[t]);
      }
    }
    for (; k < cols; k += 16) {
      const __mmask16 m = cols - k >= 16 ? __mmask16(0xffff) : tail_mask(cols - k);
      const __m512 w = kBf16 ? bf16x16_masked(m, wb + k) : _mm512_maskz_loadu_ps(m, wf + k);
      LILY_UNROLL for (int t = 0; t < TB; ++t) a0[t] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, x[t] + k), a0[t]);
    }
    LILY_UNROLL for (int t = 0; t < TB; ++t) j.y[int64_t(t0 + t) * j.rows + r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
  }
}

template <int TB>
LILY_AVX512 void rows_tb(const Job& j, int64_t r0, int64_t r1, int t0, float* scratch) {
  float* sf = scratch;
  float* bf = scratch + j.groups + 32;
  switch (j.W.type) {
    case WType::kAffine4:
      if constexpr (TB == kTileTokens) affine4_tiles(j, r0, r1, t0, scratch);
      else affine4_rows<TB>(j, r0, r1, t0, sf, bf);
      return;
    case WType::kAffine8: affine8_rows<TB>(j, r0, r1, t0, sf, bf); return;
    case WType::kBF16: dense_rows<TB, true>(j, r0, r1, t0); return;
    case WType::kF32: dense_rows<TB, false>(j, r0, r1, t0); return;
  }
}

}  // namespace

LILY_AVX512 void rows_avx512(const Job& j, int64_t r0, int64_t r1, int t0, int tb, float* scratch) {
  switch (tb) {
    case 1: rows_tb<1>(j, r0, r1, t0, scratch); return;
    case 2: rows_tb<2>(j, r0, r1, t0, scratch); return;
    case 3: rows_tb<3>(j, r0, r1, t0, scratch); return;
    default: rows_tb<4>(j, r0, r1, t0, scratch); return;
  }
}

}  // namespace lily::qmm

#else  // not x86: cpu_best_isa() never selects this path.

namespace lily::qmm {
void rows_avx512(const Job& j, int64_t r0, int64_t r1, int t0, int tb, float* scratch) {
  rows_scalar(j, r0, r1, t0, tb, scratch);
}
}  // namespace lily::qmm

#endif
