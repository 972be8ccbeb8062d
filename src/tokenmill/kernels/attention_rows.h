// Pieces the attention kernels share: requesting a cache row ahead of use, the exact
// softmax numerators, and on AVX2 + FMA (8 float32 lanes) scoring 8 keys against one
// query and the weighted sums of value rows, for rows stored in float32 or bfloat16. Key
// and value rows lie anywhere in the paged cache; each is named by its offset.
#pragma once

#include <ATen/ATen.h>

#include "dtype_conversion.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace tokenmill {

// Requests the n elements from row into cache.
template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) {
    __builtin_prefetch(bytes + i);
  }
}

// s[t] = exp(s[t] - max(s)) for t < len (len >= 1); returns their sum.
inline float exp_shifted(float* s, int64_t len) {
  const float peak = *std::max_element(s, s + len);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < len; ++t) {
    s[t] = std::exp(s[t] - peak);
    total += s[t];
  }
  return total;
}

#if defined(__AVX2__) && defined(__FMA__)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline void store8(at::BFloat16* p, __m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (int i = 0; i < 8; ++i) p[i] = from_float<at::BFloat16>(lanes[i]);
}

// Lane j = the sum of the 8 lanes of v[j].
inline __m256 fold8(const __m256 (&v)[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

constexpr int64_t kKeys = 8;          // keys scored at once (one register of scores)
constexpr int64_t kValueChunks = 4;   // registers of a value row added per pass
constexpr int64_t kHeadsAtOnce = 3;   // query heads sharing each value row read
// Tokens ahead whose value rows accumulate_values requests while it adds the current one.
constexpr int64_t kRowsAhead = 16;

// Lane j = q . keys[j] over HEAD_DIM dimensions (q in float32), without a horizontal
// sum per key: each key's 8 partial sums are folded together at the end.
template <typename T, int64_t HEAD_DIM>
inline __m256 score_keys(const float* q, const T* const (&keys)[kKeys]) {
  __m256 acc[kKeys];
  for (int64_t j = 0; j < kKeys; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < HEAD_DIM / 8; ++c) {
    const __m256 qv = _mm256_loadu_ps(q + 8 * c);
    for (int64_t j = 0; j < kKeys; ++j) {
      acc[j] = _mm256_fmadd_ps(qv, load8(keys[j] + 8 * c), acc[j]);
    }
  }
  return fold8(acc);
}

// For NH query heads g, over the 32 dimensions d of one pass: sums[g * sums_stride + d] +=
// sum over t in [begin, end) of scores[g * score_stride + t] * V[t, d], V row t at
// values + offsets[t]; with prefetch, rows of width elements are requested ahead. Each
// value row is read once for all NH heads.
template <typename T, int NH>
inline void accumulate_values(const T* values, const int64_t* offsets, int64_t begin,
                              int64_t end, const float* scores, int64_t score_stride,
                              float* sums, int64_t sums_stride, bool prefetch, int64_t width) {
  __m256 acc[NH][kValueChunks];
  for (int g = 0; g < NH; ++g) {
    for (int c = 0; c < kValueChunks; ++c) {
      acc[g][c] = _mm256_loadu_ps(sums + g * sums_stride + 8 * c);
    }
  }
  if (prefetch) {
    for (int64_t t = begin; t < std::min(begin + kRowsAhead, end); ++t) {
      prefetch_row(values + offsets[t], width);
    }
  }
  for (int64_t t = begin; t < end; ++t) {
    if (prefetch && t + kRowsAhead < end) prefetch_row(values + offsets[t + kRowsAhead], width);
    const T* row = values + offsets[t];
    __m256 w[NH];
    for (int g = 0; g < NH; ++g) w[g] = _mm256_broadcast_ss(scores + g * score_stride + t);
    for (int c = 0; c < kValueChunks; ++c) {
      const __m256 v = load8(row + 8 * c);
      for (int g = 0; g < NH; ++g) acc[g][c] = _mm256_fmadd_ps(w[g], v, acc[g][c]);
    }
  }
  for (int g = 0; g < NH; ++g) {
    for (int c = 0; c < kValueChunks; ++c) {
      _mm256_storeu_ps(sums + g * sums_stride + 8 * c, acc[g][c]);
    }
  }
}

// accumulate_values for `heads` (any number) query heads, kHeadsAtOnce at a time, over
// every pass of HEAD_DIM: sums [heads, HEAD_DIM], score rows score_stride apart. Only the
// first pass's first call requests rows ahead (when prefetch); the later ones find them
// in cache.
template <typename T, int64_t HEAD_DIM>
inline void accumulate_values_all(const T* values, const int64_t* offsets, int64_t begin,
                                  int64_t end, const float* scores, int64_t score_stride,
                                  int64_t heads, float* sums, bool prefetch, int64_t width) {
  static_assert(HEAD_DIM % (8 * kValueChunks) == 0, "head size a multiple of 32");
  for (int64_t dim0 = 0; dim0 < HEAD_DIM; dim0 += 8 * kValueChunks) {
    for (int64_t g0 = 0; g0 < heads; g0 += kHeadsAtOnce) {
      const int64_t n = std::min(kHeadsAtOnce, heads - g0);
      const bool first = prefetch && dim0 == 0 && g0 == 0;
      const float* s = scores + g0 * score_stride;
      float* o = sums + g0 * HEAD_DIM + dim0;
      if (n == 3) {
        accumulate_values<T, 3>(values + dim0, offsets, begin, end, s, score_stride, o,
                                HEAD_DIM, first, width);
      } else if (n == 2) {
        accumulate_values<T, 2>(values + dim0, offsets, begin, end, s, score_stride, o,
                                HEAD_DIM, first, width);
      } else {
        accumulate_values<T, 1>(values + dim0, offsets, begin, end, s, score_stride, o,
                                HEAD_DIM, first, width);
      }
    }
  }
}

// out[g * HEAD_DIM + d] = sums[g * HEAD_DIM + d] * inv_totals[g] for `heads` heads, in
// out's dtype.
template <typename T, int64_t HEAD_DIM>
inline void store_scaled(const float* sums, const float* inv_totals, int64_t heads, T* out) {
  for (int64_t g = 0; g < heads; ++g) {
    const __m256 inv = _mm256_set1_ps(inv_totals[g]);
    for (int64_t d = 0; d < HEAD_DIM; d += 8) {
      const __m256 sum = _mm256_loadu_ps(sums + g * HEAD_DIM + d);
      store8(out + g * HEAD_DIM + d, _mm256_mul_ps(sum, inv));
    }
  }
}

#endif  // AVX2 and FMA

}  // namespace tokenmill
