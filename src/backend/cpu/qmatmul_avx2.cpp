// AVX2+FMA qmatmul kernels. Every function carries a target attribute so the file builds without
// -mavx2 and only runs after cpu_best_isa() saw the CPU support it.
#include "backend/cpu/simd_qmatmul.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cstring>

// Token loops must be fully unrolled so the per-token accumulators live in registers.
#define LILY_UNROLL _Pragma("GCC unroll 16")
#define LILY_AVX2 __attribute__((target("avx2,fma")))

namespace lily::qmm {

namespace {

LILY_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Σ a[i]·b[i], i < n.
LILY_AVX2 inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum8(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

LILY_AVX2 inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// Scales (or biases) [i0, i0+n) of a bf16/f32 tensor into f32 out[n].
LILY_AVX2 inline void load_sb(const void* p, bool f32, int64_t i0, int64_t n, float* out) {
  if (f32) {
    std::memcpy(out, static_cast<const float*>(p) + i0, size_t(n) * 4);
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(p) + i0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, bf16x8(s + i));
  for (; i < n; ++i) out[i] = sb_at(s, false, i);
}

// 4-bit rows: a 64-element block is 8 code words, one per lane; nibble n of every lane is masked,
// converted and meets 8 contiguous floats of the reordered x. Lanes map to groups by lane·8/gs.
template <int TB>
LILY_AVX2 void affine4_rows(const Job& j, int64_t r0, int64_t r1, int t0, float* sf, float* bf) {
  const int64_t cols = j.cols, G = j.groups, gs = j.W.group_size, words_per_row = cols / 8;
  const __m256i nib = _mm256_set1_epi32(0xf);
  alignas(32) int32_t gidx[8];
  for (int l = 0; l < 8; ++l) gidx[l] = int32_t(l * 8 / gs);
  const int shift = __builtin_ctz(unsigned(gs));  // gs is a power of two on SIMD paths
  const __m256i gidx8 = _mm256_load_si256(reinterpret_cast<const __m256i*>(gidx));
  const float* xp[TB];
  const float* xs[TB];
  LILY_UNROLL for (int t = 0; t < TB; ++t) {
    xp[t] = j.xp + int64_t(t0 + t) * cols;
    xs[t] = j.xsum + int64_t(t0 + t) * j.xsum_stride;
  }
  for (int64_t r = r0; r < r1; ++r) {
    load_sb(j.W.scales, j.W.sb_f32, r * G, G, sf);
    load_sb(j.W.biases, j.W.sb_f32, r * G, G, bf);
    const uint32_t* codes = static_cast<const uint32_t*>(j.W.data) + r * words_per_row;
    __m256 acc[TB];
    LILY_UNROLL for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t e = 0; e < cols; e += 64) {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + e / 8));
      __m256 ba[TB];
      __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(v, nib));
      LILY_UNROLL for (int t = 0; t < TB; ++t) ba[t] = _mm256_mul_ps(q, _mm256_loadu_ps(xp[t] + e));
#pragma GCC unroll 7
      for (int n = 1; n < 8; ++n) {
        v = _mm256_srli_epi32(v, 4);
        q = _mm256_cvtepi32_ps(_mm256_and_si256(v, nib));
        LILY_UNROLL for (int t = 0; t < TB; ++t) ba[t] = _mm256_fmadd_ps(q, _mm256_loadu_ps(xp[t] + e + 8 * n), ba[t]);
      }
      const __m256 sv = gs >= 64 ? _mm256_set1_ps(sf[e >> shift])
                                 : _mm256_permutevar8x32_ps(_mm256_loadu_ps(sf + (e >> shift)), gidx8);
      LILY_UNROLL for (int t = 0; t < TB; ++t) acc[t] = _mm256_fmadd_ps(sv, ba[t], acc[t]);
    }
    LILY_UNROLL for (int t = 0; t < TB; ++t) j.y[int64_t(t0 + t) * j.rows + r] = hsum8(acc[t]) + dot(bf, xs[t], G);
  }
}

// 8-bit rows: codes widen straight to floats in element order; scales apply once per group.
template <int TB>
LILY_AVX2 void affine8_rows(const Job& j, int64_t r0, int64_t r1, int t0, float* sf, float* bf) {
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
    __m256 acc[TB];
    LILY_UNROLL for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256 ba[TB];
      LILY_UNROLL for (int t = 0; t < TB; ++t) ba[t] = _mm256_setzero_ps();
      for (int64_t e = g * gs; e < (g + 1) * gs; e += 8) {
        const __m256 q = _mm256_cvtepi32_ps(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + e))));
        LILY_UNROLL for (int t = 0; t < TB; ++t) ba[t] = _mm256_fmadd_ps(q, _mm256_loadu_ps(x[t] + e), ba[t]);
      }
      const __m256 sv = _mm256_set1_ps(sf[g]);
      LILY_UNROLL for (int t = 0; t < TB; ++t) acc[t] = _mm256_fmadd_ps(sv, ba[t], acc[t]);
    }
    LILY_UNROLL for (int t = 0; t < TB; ++t) j.y[int64_t(t0 + t) * j.rows + r] = hsum8(acc[t]) + dot(bf, xs[t], G);
  }
}

// bf16 / f32 rows; two accumulators per token so a single token is not bound by FMA latency.
template <int TB, bool kBf16>
LILY_AVX2 void dense_rows(const Job& j, int64_t r0, int64_t r1, int t0) {
  const int64_t cols = j.cols;
  const float* x[TB];
  LILY_UNROLL for (int t = 0; t < TB; ++t) x[t] = j.x + int64_t(t0 + t) * cols;
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* wb = static_cast<const uint16_t*>(j.W.data) + r * cols;
    const float* wf = static_cast<const float*>(j.W.data) + r * cols;
    __m256 a0[TB], a1[TB];
    LILY_UNROLL for (int t = 0; t < TB; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= cols; k += 16) {
      const __m256 w0 = kBf16 ? bf16x8(wb + k) : _mm256_loadu_ps(wf + k);
      const __m256 w1 = kBf16 ? bf16x8(wb + k + 8) : _mm256_loadu_ps(wf + k + 8);
      LILY_UNROLL for (int t = 0; t < TB; ++t) {
        a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[t] + k), a0[t]);
        a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[t] + k + 8), a1[t]);
      }
    }
    LILY_UNROLL for (int t = 0; t < TB; ++t) {
      float s = hsum8(_mm256_add_ps(a0[t], a1[t]));
      for (int64_t i = k; i < cols; ++i) s += (kBf16 ? sb_at(wb, false, i) : wf[i]) * x[t][i];
      j.y[int64_t(t0 + t) * j.rows + r] = s;
    }
  }
}

template <int TB>
LILY_AVX2 void rows_tb(const Job& j, int64_t r0, int64_t r1, int t0, float* scratch) {
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

LILY_AVX2 void rows_avx2(const Job& j, int64_t r0, int64_t r1, int t0, int tb, float* scratch) {
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
void rows_avx2(const Job& j, int64_t r0, int64_t r1, int t0, int tb, float* scratch) {
  rows_scalar(j, r0, r1, t0, tb, scratch);
}
}  // namespace lily::qmm

#endif
