// Arithmetic of the sampling op (backend.h Backend::sample) shared by the cpu and cuda backends, so
// that both pick the same token from the same logits. Every float operation is a single IEEE
// round-to-nearest op (the cuda side uses the __f*_rn intrinsics, which nvcc never contracts into
// FMAs; the cpu file is compiled with -ffp-contract=off), exp is our own polynomial built from
// those ops, and probabilities are fixed-point integers, so sums are exact in any order.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LILY_HD __host__ __device__ __forceinline__
#else
#define LILY_HD inline
#endif

namespace lily::smath {

// Tokens whose tempered logit lies more than 30 below the best one get weight 0 (never picked):
// at most 248,320 · e^-30 ≈ 2e-8 of the mass of the best token is lost.
constexpr float kXMin = -30.0f;
constexpr int kWeightBits = 44;   // weight of the best token = 2^44; a vocabulary sums below 2^62

LILY_HD float f_add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
LILY_HD float f_sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
LILY_HD float f_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
LILY_HD float f_div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
LILY_HD float f_fma(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
LILY_HD uint32_t f_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
LILY_HD float f_from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
LILY_HD uint64_t mulhi64(uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH__
  return __umul64hi(a, b);
#else
  return uint64_t((unsigned __int128)a * b >> 64);
#endif
}

// Order-preserving map of a (penalised) logit to 32 bits; 0 marks "never sampled" (NaN, -inf, ids
// past n_valid). -0 is folded into +0 and +inf into FLT_MAX so that equal values get equal keys.
LILY_HD uint32_t logit_key(float l) {
  if (!(l > -INFINITY)) return 0u;   // NaN, -inf
  if (l == 0.0f) l = 0.0f;
  if (l == INFINITY) l = 3.40282347e38f;
  const uint32_t u = f_bits(l);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
LILY_HD float key_logit(uint32_t k) { return f_from_bits((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k); }
// Total order of candidates: key, then lower id first. Distinct for distinct ids.
LILY_HD uint64_t full_key(uint32_t k, uint32_t id) { return (uint64_t(k) << 32) | (0xFFFFFFFFu - id); }
LILY_HD uint32_t full_key_id(uint64_t fk) { return 0xFFFFFFFFu - uint32_t(fk); }

// Tempered logit relative to the best: x = (l - max) / T <= 0, monotone in the key.
LILY_HD float rel_x(uint32_t k, uint32_t max_key, float inv_t) {
  return f_mul(f_sub(key_logit(k), key_logit(max_key)), inv_t);
}

// round-down(2^44 · e^x) for x in [kXMin, 0] (0 below): e^x = 2^(x·log2 e) split into 2^k · 2^f,
// 2^f by a degree-7 polynomial (error ~1e-7, plenty: only determinism matters here).
LILY_HD uint64_t weight(float x) {
  if (!(x >= kXMin)) return 0;
  if (x >= 0.0f) return uint64_t(1) << kWeightBits;
  const float t = f_mul(x, 1.44269504f);
  const float kf = floorf(t);
  const float f = f_sub(t, kf);   // [0, 1)
  float p = 1.5252734e-5f;
  p = f_fma(p, f, 1.5403530e-4f);
  p = f_fma(p, f, 1.3333558e-3f);
  p = f_fma(p, f, 9.6181291e-3f);
  p = f_fma(p, f, 5.5504109e-2f);
  p = f_fma(p, f, 2.4022651e-1f);
  p = f_fma(p, f, 6.9314718e-1f);
  p = f_fma(p, f, 1.0f);          // [1, 2]
  const uint64_t m = uint64_t(f_mul(p, 8388608.0f));   // p · 2^23, an exact integer
  const int sh = 21 + int(kf);                         // 2^44 · 2^kf · p = m · 2^(21 + kf)
  uint64_t w = sh >= 0 ? (m << sh) : (m >> (-sh));
  return w > 0 ? w : 1;   // x >= kXMin keeps a non-zero weight
}

// Penalised logit of token i (Sampler::apply_penalties order: logit_bias, repetition, then
// presence + frequency). `c`: bit 0 = seen (prompt or generated), bits 1.. = times generated.
LILY_HD float penalise(float l, int32_t c, float rep, float presence, float frequency) {
  if (rep != 1.0f && (c & 1)) l = l > 0.0f ? f_div(l, rep) : f_mul(l, rep);
  const int32_t n = c >> 1;
  if (n > 0) l = f_sub(l, f_add(presence, f_mul(frequency, float(n))));
  return l;
}

// The random number of one draw: a counter-based hash of (seed, step) (splitmix64 finaliser).
LILY_HD uint64_t draw_bits(uint64_t seed, uint64_t step) {
  uint64_t z = seed ^ (step * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull);
  for (int r = 0; r < 2; ++r) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
  }
  return z;
}

// Nucleus target: the kept prefix is the shortest whose weight sum reaches ceil(top_p · Z).
LILY_HD uint64_t top_p_target(float top_p, uint64_t z) {
#ifdef __CUDA_ARCH__
  const double t = ceil(__dmul_rn(double(top_p), __ull2double_rn(z)));
#else
  const double t = std::ceil(double(top_p) * double(z));
#endif
  uint64_t r = t <= 0.0 ? 1 : uint64_t(t);
  if (r > z) r = z;
  return r < 1 ? 1 : r;
}

// Smallest key k in (0, max_key] with x(k) >= xmin (x is monotone in k); max_key itself has x = 0.
LILY_HD uint32_t min_key_with_x(uint32_t max_key, float inv_t, float xmin) {
  uint32_t lo = 0x00800000u, hi = max_key;   // keys below 0x00800000 are -inf / NaN
  if (lo > hi) return hi;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (rel_x(mid, max_key, inv_t) >= xmin) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

}  // namespace lily::smath
