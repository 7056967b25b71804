// Portable qmatmul kernel (no intrinsics): same blocking and group-sum identity as the SIMD paths,
// used on CPUs without AVX2 and for shapes the SIMD kernels do not cover.
#include <cstring>

#include "backend/cpu/dot8.h"
#include "backend/cpu/simd_qmatmul.h"

namespace lily::qmm {

namespace {

// Affine rows: Σ_k (s·q_k + b)·x_k = s·Σ_k q_k·x_k + b·Σ_k x_k per group. Codes are unpacked once
// into floats per chunk of a group and reused for every token of the block; the bias costs one
// multiply-add per group.
template <int TB, int kBits>
void affine_rows(const Job& j, int64_t r0, int64_t r1, int t0) {
  constexpr int per_word = 32 / kBits;
  constexpr uint32_t mask = (1u << kBits) - 1;
  const int gs = j.W.group_size;
  const int64_t words_per_row = j.cols / per_word;
  // Chunk of a group unpacked at a time: divides the group, holds whole words (gs % per_word == 0).
  int chunk = 64;
  while (gs % chunk != 0) chunk /= 2;
  float q[64];
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
      for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += chunk) {
        for (int w = 0; w < chunk / per_word; ++w) {
          const uint32_t word = words[k0 / per_word + w];
          for (int i = 0; i < per_word; ++i) q[w * per_word + i] = float((word >> (kBits * i)) & mask);
        }
        for (int t = 0; t < TB; ++t) ga[t] += dot8(q, x[t] + k0, chunk);
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
  float w[256];
  for (int64_t r = r0; r < r1; ++r) {
    float acc[TB] = {};
    for (int64_t k0 = 0; k0 < j.cols; k0 += 256) {
      const int64_t n = j.cols - k0 < 256 ? j.cols - k0 : 256;
      const float* wr;
      if constexpr (kBf16) {
        const uint16_t* p = static_cast<const uint16_t*>(j.W.data) + r * j.cols + k0;
        for (int64_t i = 0; i < n; ++i) {
          const uint32_t u = uint32_t(p[i]) << 16;
          std::memcpy(&w[i], &u, 4);
        }
        wr = w;
      } else {
        wr = static_cast<const float*>(j.W.data) + r * j.cols + k0;
      }
      for (int t = 0; t < TB; ++t) acc[t] += dot8(wr, j.x + int64_t(t0 + t) * j.cols + k0, n);
    }
    for (int t = 0; t < TB; ++t) j.y[int64_t(t0 + t) * j.rows + r] = acc[t];
  }
}

template <int TB>
void rows_tb(const Job& j, int64_t r0, int64_t r1, int t0) {
  switch (j.W.type) {
    case WType::kAffine4: affine_rows<TB, 4>(j, r0, r1, t0); return;
    case WType::kAffine8: affine_rows<TB, 8>(j, r0, r1, t0); return;
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
