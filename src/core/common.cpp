// Out-of-line helpers of common.h.
#include "core/common.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace lily {

void check_failed(const char* expr, const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "lily: internal check failed: %s (%s:%d): %s\n", expr, file, line, msg.c_str());
  std::abort();
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float v;
  if (exp == 0) v = std::ldexp(float(man), -24);
  else if (exp == 31) v = man ? NAN : INFINITY;
  else v = std::ldexp(float(man | 0x400), int(exp) - 25);
  return sign ? -v : v;
}

}  // namespace lily
