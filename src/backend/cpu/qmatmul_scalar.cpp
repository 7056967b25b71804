// Portable qmatmul kernel (no intrinsics): same blocking and group-sum identity as the SIMD paths,
// used on CPUs without AVX2 and for shapes the SIMD kernels do not cover.
#include <cstring>

#include "backend/cpu/simd_qmatmul.h"

namespace lily::qmm {

namespace {

// Affine rows: Σ_k (s·q_k + b)·x_k = s·Σ_k q_k·x_k + b·Σ_k x_k per group, so the inner loop is one
// multiply-add per code and the bias costs one multiply-add per group.
template <int TB>
void affine_rows(const Job& j, int64_t r0, int64_t r1, int t0) {
  const int bits = j.W.bits(), per_word = 32 / bits, gs = j.W.group_size;
  const uint32_t mask = (1u << bits) - 1;
  const int64_t words_per_row = j.cols / per_word;
  const float* x[TB];
  const float* xs[TB];
  for (int t = 0; t < TB; ++t) {
    x[t] = j.x + int64_t(t0 + t) * j.cols;
    xs[t] = j.xsum + int64_t(t0 + t) * j.xsum_stride;
  }
  for (int64_t r = r0; r < r1; ++r) {
    const uint32_t* words = static_cast<const uint32_t*>(j.W.data) + r * words_per_row;
    float acc[TB] = {};
    for (int64_t g = 0; g < j.groups; ++g) {
      float ga[TB] = {};
      const int64_t k0 = g * gs;
      for (int64_t k = k0; k < k0 + gs; k += per_word) {
        const uint32_t w = words[k / per_word];
        for (int i = 0; i < per_word; ++i) {
          const float q = float((w >> (bits * i)) & mask);
          for (int t = 0; t < TB; ++t) ga[t] += q * x[t][k + i];
        }
      }
      const float s = sb_at(j.W.scales, j.W.sb_f32, r * j.groups + g);
      const float b = sb_at(j.W.biases, j.W.sb_f32, r * j.groups + g);
      for (int t = 0; t < TB; ++t) acc[t] += s * ga[t] + b * xs[t][g];
    }
    for (int t = 0; t < TB; ++t) j.y[int64_t(t0 + t) * j.rows + r] = acc[t];
  }
}

template <int TB, bool kBf16>
void dense_rows(const Job& j, int64_t r0, int64_t r1, int t0) {
  const float* x[TB];
  for (int t = 0; t < TB; ++t) x[t] = j.x + int64_t(t0 + t) * j.cols;
  for (int64_t r = r0; r < r1; ++r) {
    float acc[TB] = {};
    for (int64_t k = 0; k < j.cols; ++k) {
      float w;
      if constexpr (kBf16) {
        const uint32_t u = uint32_t(static_cast<const uint16_t*>(j.W.data)[r * j.cols + k]) << 16;
        std::memcpy(&w, &u, 4);
      } else {
        w = static_cast<const float*>(j.W.data)[r * j.cols + k];
      }
      for (int t = 0; t < TB; ++t) acc[t] += w * x[t][k];
    }
    for (int t = 0; t < TB; ++t) j.y[int64_t(t0 + t) * j.rows + r] = acc[t];
  }
}

template <int TB>
void rows_tb(const Job& j, int64_t r0, int64_t r1, int t0) {
  switch (j.W.type) {
    case WType::kAffine4:
    case WType::kAffine8: affine_rows<TB>(j, r0, r1, t0); return;
    case WType::kBF16: dense_rows<TB, true>(j, r0, r1, t0); return;
    case WType::kF32: dense_rows<TB, false>(j, r0, r1, t0); return;
  }
}

}  // namespace

void rows_scalar(const Job& j, int64_t r0, int64_t r1, int t0, int tb, float*) {
  switch (tb) {
    case 1: rows_tb<1>(j, r0, r1, t0); return;
    case 2: rows_tb<2>(j, r0, r1, t0); return;
    case 3: rows_tb<3>(j, r0, r1, t0); return;
    default: rows_tb<4>(j, r0, r1, t0); return;
  }
}

}  // namespace lily::qmm
