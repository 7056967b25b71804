// Shared basics: the error type thrown at edges, an always-on check macro, bf16 conversion.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace lily {

// Thrown for bad input at the edges (files, config, HTTP, CLI). The message is shown to the user
// as is, so it must name the offending thing (file, tensor, field).
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void check_failed(const char* expr, const char* file, int line, const std::string& msg);

// Invariant check that stays on in release builds.
#define LILY_CHECK(cond, msg)                                                 \
  do {                                                                        \
    if (!(cond)) ::lily::check_failed(#cond, __FILE__, __LINE__, (msg));      \
  } while (0)

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round-to-nearest-even, NaN kept quiet (same rule as PyTorch / MLX).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t h);

}  // namespace lily
