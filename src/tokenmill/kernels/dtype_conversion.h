// Widening to float32 and rounding back, written so that loops over them vectorize.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace tokenmill {

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <>
inline float to_float<at::BFloat16>(at::BFloat16 x) {
  // bfloat16 is the top half of a float32: widening is a shift.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

template <>
inline at::BFloat16 from_float<at::BFloat16>(float x) {
  // Round to nearest even, as c10's conversion does, but branch-free; NaN stays NaN.
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return at::BFloat16(static_cast<uint16_t>(nan ? 0x7fc0u : rounded),
                      at::BFloat16::from_bits());
}

}  // namespace tokenmill
