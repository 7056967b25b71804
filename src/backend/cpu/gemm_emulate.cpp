// TEST AID (see gemm_emulate.h): operand rounding of the CUDA prefill GEMM reproduced on the CPU.
// Weights are dequantised with the GPU's rounding into an f32 copy (row chunks of at most 64 MB),
// activations rounded into an f32 copy, and the existing f32 qmatmul forms the products: every
// rounded value is exactly representable in f32, so only the summation order differs from the GPU.
#include "backend/cpu/gemm_emulate.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cpu/qmatmul.h"
#include "backend/cpu/simd_qmatmul.h"
#include "core/common.h"

namespace lily {

GemmEmu gemm_emu_from_env() {
  const char* v = std::getenv("LILY_CPU_EMULATE");
  if (!v || !*v || std::strcmp(v, "off") == 0) return GemmEmu::kOff;
  if (std::strcmp(v, "bf16") == 0) return GemmEmu::kBf16;
  if (std::strcmp(v, "fp16") == 0) return GemmEmu::kFp16;
  throw Error(std::string("LILY_CPU_EMULATE: unknown value '") + v + "' (expected bf16, fp16 or off)");
}

bool gemm_emu_slot16_from_env() {
  const char* v = std::getenv("LILY_CPU_EMULATE_SLOT16");
  return !(v && *v && std::strcmp(v, "0") == 0);
}

float round_fp16_sat(float v) {
  return std::fabs(v) > 65504.f ? std::copysign(65504.f, v) : round_fp16(double(v));
}

int gemm_emu_min_t() {
  const char* v = std::getenv("LILY_GEMM_MIN_T");
  return v && *v ? std::atoi(v) : 16;
}

bool gemm_emu_applies(const QMatrix& W, int T, bool skinny) {
  auto env = [](const char* n, int def) { const char* v = std::getenv(n); return v && *v ? std::atoi(v) : def; };
  int small_n = env("LILY_GEMM_SMALL_N", 64);   // gemm_small_n(T) of the CUDA backend
  if (skinny && T >= env("LILY_GEMM_SKINNY_T", 256)) small_n = std::min(small_n, env("LILY_GEMM_SKINNY_N", 32));
  return (W.type == WType::kAffine4 || W.type == WType::kAffine8) && W.group_size == 64 && !W.sb_f32 &&
         W.cols % 512 == 0 && W.rows > 0 && W.rows >= small_n;
}

namespace {
// Round to `frac` fraction bits, exponent floor `emin` (below it the quantum stays 2^(emin-frac)).
double round_to(double v, int frac, int emin) {
  if (v == 0 || !std::isfinite(v)) return v;
  int e;
  std::frexp(v, &e);   // |v| in [2^(e-1), 2^e)
  const int q = std::max(e - 1, emin) - frac;
  return std::ldexp(std::nearbyint(std::ldexp(v, -q)), q);
}
// Nearest-even rounding of a finite float's bits to its top 32 - drop bits (same exponent range).
float round_f32_bits(float f, int drop) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t half = (1u << (drop - 1)) - 1u, mask = ~((1u << drop) - 1u);
  u = (u + half + ((u >> drop) & 1u)) & mask;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}
}  // namespace

// Fast paths: when v is exactly a float (always, for the products formed here), nearest-even
// rounding of its f32 bits; the general path only for inexact, subnormal-fp16 or huge values.
float round_bf16(double v) {
  const float f = float(v);
  if (double(f) == v && std::isfinite(f)) return round_f32_bits(f, 16);
  return float(round_to(v, 7, -126));
}

float round_fp16(double v) {
  const float f = float(v);
  if (double(f) == v && std::fabs(f) >= 0x1p-14f && std::fabs(f) <= 65504.f) return round_f32_bits(f, 13);
  if (v == 0) return float(v);
  const double r = round_to(v, 10, -14);
  return std::fabs(r) > 65504.0 ? float(std::copysign(INFINITY, r)) : float(r);
}

int fp16_row_exp(float amax) {
  if (!(amax > 0) || !std::isfinite(amax)) return 0;
  int e;
  std::frexp(amax, &e);   // amax = m·2^e, m in [0.5, 1): amax·2^(15-e) in [2^14, 2^15)
  return std::clamp(15 - e, -100, 100);
}

void qmatmul_emulated(GemmEmu mode, const QMatrix& W, const float* x, int T, float* y, ThreadPool& pool,
                      bool q8_fp16) {
  LILY_CHECK(mode != GemmEmu::kOff && gemm_emu_applies(W, 1 << 30), "qmatmul_emulated: unsupported matrix");
  if (T <= 0) return;
  const int64_t K = W.cols, N = W.rows, G = K / 64;
  const bool bits8 = W.type == WType::kAffine8;
  const bool q8_16 = bits8 && q8_fp16 && mode == GemmEmu::kFp16;   // P68: one fp16 product
  const bool q8 = bits8 && !q8_16;                                   // split precision
  const bool f16 = mode == GemmEmu::kFp16 && !q8;

  // Activations: 4-bit -> one rounded copy; 8-bit -> (x_hi + x_lo) and x_hi.
  std::vector<float> xa(size_t(T * K)), xh(q8 ? size_t(T * K) : 0);
  for (int t = 0; t < T; ++t) {
    const float* xt = x + t * K;
    float* at = xa.data() + t * K;
    if (q8) {
      float* ht = xh.data() + t * K;
      for (int64_t k = 0; k < K; ++k) {
        const float hi = round_bf16(xt[k]), lo = round_bf16(double(xt[k]) - hi);
        ht[k] = hi;
        at[k] = hi + lo;
      }
    } else if (f16) {
      float amax = 0;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xt[k]));
      const int s = fp16_row_exp(amax);
      const double up = std::ldexp(1.0, s), down = std::ldexp(1.0, -s);   // exact scalings
      for (int64_t k = 0; k < K; ++k) at[k] = float(double(round_fp16(double(xt[k]) * up)) * down);
    } else {
      for (int64_t k = 0; k < K; ++k) at[k] = round_bf16(xt[k]);
    }
  }

  const int64_t chunk = std::max<int64_t>(1, (int64_t(16) << 20) / K);
  std::vector<float> wa(size_t(std::min(chunk, N) * K)), wl(q8 ? wa.size() : 0);
  std::vector<float> ya(size_t(T * std::min(chunk, N))), yl(q8 ? ya.size() : 0);
  const uint32_t* words = static_cast<const uint32_t*>(W.data);
  const int64_t wpr = bits8 ? K / 4 : K / 8;   // u32 words per row
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    pool.parallel_for(n, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = r0 + i;
        const uint32_t* wr = words + r * wpr;
        float* out = wa.data() + i * K;
        for (int64_t g = 0; g < G; ++g) {
          const float s = qmm::sb_at(W.scales, false, r * G + g), b = qmm::sb_at(W.biases, false, r * G + g);
          const float s16 = round_fp16(double(s) * (1 << kFp16WExp)), b16 = round_fp16(double(b) * (1 << kFp16WExp));
          for (int j = 0; j < 64; ++j) {
            const int64_t k = g * 64 + j;
            if (q8) {
              const float q = float((wr[k / 4] >> (8 * (k % 4))) & 255u);
              const float v = std::fmaf(q, s, b);
              const float hi = round_bf16(v);
              out[k] = hi;
              wl[size_t(i * K + k)] = round_bf16(double(v) - hi);
            } else if (q8_16) {
              const float q = float((wr[k / 4] >> (8 * (k % 4))) & 255u);
              const double v = double(std::fmaf(q, s, b)) * (1 << kFp16WExp);
              out[k] = float(double(round_fp16(v)) * (1.0 / (1 << kFp16WExp)));
            } else {
              const double q = double((wr[k / 8] >> (4 * (k % 8))) & 15u);
              out[k] = f16 ? float(double(round_fp16(q * s16 + b16)) * (1.0 / (1 << kFp16WExp)))
                           : round_bf16(q * s + b);
            }
          }
        }
      }
    });
    QMatrix F;
    F.type = WType::kF32;
    F.rows = n;
    F.cols = K;
    F.data = wa.data();
    float* yo = n == N ? y : ya.data();
    qmatmul(F, xa.data(), T, yo, pool);
    if (q8) {
      F.data = wl.data();
      qmatmul(F, xh.data(), T, yl.data(), pool);
      for (int64_t i = 0; i < T * n; ++i) yo[i] += yl[size_t(i)];
    }
    if (yo != y)
      for (int t = 0; t < T; ++t) std::memcpy(y + t * N + r0, yo + t * n, size_t(n) * 4);
  }
}

}  // namespace lily
