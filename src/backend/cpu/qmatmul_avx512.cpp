// AVX-512 qmatmul kernels. Every function carries a target attribute so the file builds without
// -mavx512f and only runs after cpu_best_isa() saw the CPU support it.
#include "backend/cpu/simd_qmatmul.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cstring>

// GCC 12's AVX-512 headers self-initialise placeholder vectors (`__m512i __Y = __Y;`), which
// -Wmaybe-uninitialized reports at every inlined use; the warning says nothing about this code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define LILY_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

namespace lily::qmm {

namespace {

LILY_AVX512 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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

// 4-bit rows. A 128-element block is 16 code words, one per lane; nibble j of every lane is turned
// into floats by one permute from the table {0..15} (vpermps reads only the low 4 index bits, so
// no mask is needed) and meets 16 contiguous floats of the reordered x. Lanes map to groups by
// lane·8/gs, so one scale vector per block covers any power-of-two group size. A trailing
// 64-element block uses 8 lanes.
template <int TB>
LILY_AVX512 void affine4_rows(const Job& j, int64_t r0, int64_t r1, int t0, float* sf, float* bf) {
  const int64_t cols = j.cols, G = j.groups, gs = j.W.group_size, words_per_row = cols / 8;
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256 table_lo = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 table_hi = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) int32_t gidx[16];
  for (int l = 0; l < 16; ++l) gidx[l] = int32_t(l * 8 / gs);
  const __m512i gidx16 = _mm512_load_si512(gidx);
  const __m256i gidx8 = _mm256_load_si256(reinterpret_cast<const __m256i*>(gidx));
  const float* xp[TB];
  const float* xs[TB];
  for (int t = 0; t < TB; ++t) {
    xp[t] = j.xp + int64_t(t0 + t) * cols;
    xs[t] = j.xsum + int64_t(t0 + t) * j.xsum_stride;
  }
  for (int64_t r = r0; r < r1; ++r) {
    load_sb(j.W.scales, j.W.sb_f32, r * G, G, sf);
    load_sb(j.W.biases, j.W.sb_f32, r * G, G, bf);
    const uint32_t* codes = static_cast<const uint32_t*>(j.W.data) + r * words_per_row;
    __m512 acc[TB];
    for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
    int64_t e = 0;
    for (; e + 128 <= cols; e += 128) {
      __m512i v = _mm512_loadu_si512(codes + e / 8);
      __m512 ba[TB];
      __m512 q = _mm512_permutexvar_ps(v, table);
      for (int t = 0; t < TB; ++t) ba[t] = _mm512_mul_ps(q, _mm512_loadu_ps(xp[t] + e));
#pragma GCC unroll 7
      for (int n = 1; n < 8; ++n) {
        v = _mm512_srli_epi32(v, 4);
        q = _mm512_permutexvar_ps(v, table);
        for (int t = 0; t < TB; ++t) ba[t] = _mm512_fmadd_ps(q, _mm512_loadu_ps(xp[t] + e + 16 * n), ba[t]);
      }
      const __m512 sv = gs >= 128 ? _mm512_set1_ps(sf[e / gs])
                                  : _mm512_permutexvar_ps(gidx16, _mm512_loadu_ps(sf + e / gs));
      for (int t = 0; t < TB; ++t) acc[t] = _mm512_fmadd_ps(sv, ba[t], acc[t]);
    }
    __m256 acc8[TB];
    for (int t = 0; t < TB; ++t) acc8[t] = _mm256_setzero_ps();
    if (e < cols) {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + e / 8));
      __m256 ba[TB];
      for (int t = 0; t < TB; ++t) ba[t] = _mm256_setzero_ps();
      for (int n = 0; n < 8; ++n) {
        const __m256 q = _mm256_permutex2var_ps(table_lo, v, table_hi);
        v = _mm256_srli_epi32(v, 4);
        for (int t = 0; t < TB; ++t) ba[t] = _mm256_fmadd_ps(q, _mm256_loadu_ps(xp[t] + e + 8 * n), ba[t]);
      }
      const __m256 sv = gs >= 64 ? _mm256_set1_ps(sf[e / gs])
                                 : _mm256_permutexvar_ps(gidx8, _mm256_loadu_ps(sf + e / gs));
      for (int t = 0; t < TB; ++t) acc8[t] = _mm256_mul_ps(sv, ba[t]);
    }
    for (int t = 0; t < TB; ++t)
      j.y[int64_t(t0 + t) * j.rows + r] = _mm512_reduce_add_ps(acc[t]) + hsum8(acc8[t]) + dot(bf, xs[t], G);
  }
}

// 8-bit rows: a code byte per element in element order, so 16 codes widen straight to floats and
// meet x in its natural order; scales apply once per group.
template <int TB>
LILY_AVX512 void affine8_rows(const Job& j, int64_t r0, int64_t r1, int t0, float* sf, float* bf) {
  const int64_t cols = j.cols, G = j.groups, gs = j.W.group_size;
  const float* x[TB];
  const float* xs[TB];
  for (int t = 0; t < TB; ++t) {
    x[t] = j.x + int64_t(t0 + t) * cols;
    xs[t] = j.xsum + int64_t(t0 + t) * j.xsum_stride;
  }
  for (int64_t r = r0; r < r1; ++r) {
    load_sb(j.W.scales, j.W.sb_f32, r * G, G, sf);
    load_sb(j.W.biases, j.W.sb_f32, r * G, G, bf);
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(static_cast<const uint32_t*>(j.W.data) + r * (cols / 4));
    __m512 acc[TB];
    for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m512 ba[TB];
      for (int t = 0; t < TB; ++t) ba[t] = _mm512_setzero_ps();
      for (int64_t e = g * gs; e < (g + 1) * gs; e += 16) {
        const __m512 q = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + e))));
        for (int t = 0; t < TB; ++t) ba[t] = _mm512_fmadd_ps(q, _mm512_loadu_ps(x[t] + e), ba[t]);
      }
      const __m512 sv = _mm512_set1_ps(sf[g]);
      for (int t = 0; t < TB; ++t) acc[t] = _mm512_fmadd_ps(sv, ba[t], acc[t]);
    }
    for (int t = 0; t < TB; ++t)
      j.y[int64_t(t0 + t) * j.rows + r] = _mm512_reduce_add_ps(acc[t]) + dot(bf, xs[t], G);
  }
}

// bf16 / f32 rows; two accumulators per token so a single token is not bound by FMA latency.
template <int TB, bool kBf16>
LILY_AVX512 void dense_rows(const Job& j, int64_t r0, int64_t r1, int t0) {
  const int64_t cols = j.cols;
  const float* x[TB];
  for (int t = 0; t < TB; ++t) x[t] = j.x + int64_t(t0 + t) * cols;
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* wb = static_cast<const uint16_t*>(j.W.data) + r * cols;
    const float* wf = static_cast<const float*>(j.W.data) + r * cols;
    __m512 a0[TB], a1[TB];
    for (int t = 0; t < TB; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= cols; k += 32) {
      const __m512 w0 = kBf16 ? bf16x16(wb + k) : _mm512_loadu_ps(wf + k);
      const __m512 w1 = kBf16 ? bf16x16(wb + k + 16) : _mm512_loadu_ps(wf + k + 16);
      for (int t = 0; t < TB; ++t) {
        a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[t] + k), a0[t]);
        a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[t] + k + 16), a1[t]);
      }
    }
    for (; k < cols; k += 16) {
      const __mmask16 m = cols - k >= 16 ? __mmask16(0xffff) : tail_mask(cols - k);
      const __m512 w = kBf16 ? bf16x16_masked(m, wb + k) : _mm512_maskz_loadu_ps(m, wf + k);
      for (int t = 0; t < TB; ++t) a0[t] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, x[t] + k), a0[t]);
    }
    for (int t = 0; t < TB; ++t) j.y[int64_t(t0 + t) * j.rows + r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
  }
}

template <int TB>
LILY_AVX512 void rows_tb(const Job& j, int64_t r0, int64_t r1, int t0, float* scratch) {
  float* sf = scratch;
  float* bf = scratch + j.groups + 32;
  switch (j.W.type) {
    case WType::kAffine4: affine4_rows<TB>(j, r0, r1, t0, sf, bf); return;
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
    case 4: rows_tb<4>(j, r0, r1, t0, scratch); return;
    case 5: rows_tb<5>(j, r0, r1, t0, scratch); return;
    case 6: rows_tb<6>(j, r0, r1, t0, scratch); return;
    case 7: rows_tb<7>(j, r0, r1, t0, scratch); return;
    default: rows_tb<8>(j, r0, r1, t0, scratch); return;
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
