// A plain f32 dot product for the CPU backend's portable paths.
#pragma once

#include <cstdint>

namespace lily {

// Σ_k a[k]·b[k] over n elements with 8 independent partial sums, so the loop is not bound by the
// latency of one add chain and compilers can map the lanes onto whatever vector unit exists.
inline float dot8(const float* a, const float* b, int64_t n) {
  float p[8] = {};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int i = 0; i < 8; ++i) p[i] += a[k + i] * b[k + i];
  for (; k < n; ++k) p[0] += a[k] * b[k];
  return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

}  // namespace lily
