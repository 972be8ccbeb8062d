// Partial AVX2 registers of float32: the first ``width`` lanes (width <= 8), for the
// last, narrower columns of an output; and their rounding to bfloat16. AVX2's masked
// moves are slow on some CPUs (AMD's microcode them), so a partial register goes through
// a small aligned buffer instead.
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

// float32 lanes -> bfloat16, round to nearest even (NaN kept), 8 at a time: the AVX2
// form of avx512_lanes.h's round_to_bf16.
inline __m128i round_to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

}  // namespace tokenmill

#endif  // AVX2
