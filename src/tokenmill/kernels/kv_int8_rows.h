// The rows of an 8-bit KV cache (models/attention/kv_int8.py): a (token, KV head) row is head_dim
// int8 values and then their float32 scale; value d stands for row[d] * scale.
#pragma once

#include "dtype_conversion.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tokenmill {

// The scale of the 8-bit row starting at row (head_dim values).
inline float int8_row_scale(const int8_t* row, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, row + head_dim, sizeof(scale));
  return scale;
}

// The head_dim values x as an 8-bit row: x * (127 / max |x|) rounded to the nearest
// integer (ties to even), then the scale max |x| * (1 / 127) as float32 (0 for a row of
// zeros), as kv_int8.quantize_rows computes them (a product, not a quotient: the kernels
// are compiled with reciprocal math).
template <typename T>
inline void store_int8_row(const T* x, int64_t head_dim, int8_t* row) {
  float peak = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) peak = std::max(peak, std::fabs(to_float(x[d])));
  const float inv = peak > 0.f ? 127.f / peak : 0.f;
  for (int64_t d = 0; d < head_dim; ++d) {
    row[d] = static_cast<int8_t>(std::nearbyint(to_float(x[d]) * inv));
  }
  const float scale = peak * (1.f / 127.f);
  std::memcpy(row + head_dim, &scale, sizeof(scale));
}

}  // namespace tokenmill
