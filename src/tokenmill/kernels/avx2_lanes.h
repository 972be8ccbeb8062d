// Partial AVX2 registers of float32: the first ``width`` lanes (width <= 8), for the
// last, narrower columns of an output. AVX2's masked moves are slow on some CPUs (AMD's
// microcode them), so a partial register goes through a small aligned buffer instead.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__)

namespace tokenmill {

// The lanes [0, width) of a register's worth at src; the rest read as 0.
inline __m256 load_lanes(const float* src, int64_t width) {
  if (width == 8) return _mm256_loadu_ps(src);
  alignas(32) float lanes[8] = {};
  std::copy(src, src + width, lanes);
  return _mm256_load_ps(lanes);
}

// v's lanes [0, width) to dst.
inline void store_lanes(float* dst, __m256 v, int64_t width) {
  if (width == 8) {
    _mm256_storeu_ps(dst, v);
    return;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  std::copy(lanes, lanes + width, dst);
}

}  // namespace tokenmill

#endif  // AVX2
