// Partial AVX-512 registers of float32 and their bfloat16 form in memory: the first
// ``count`` of 16 lanes, for the last, narrower columns of an output.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)

namespace tokenmill {

// The mask of lanes [0, count), 1 <= count <= 16.
inline __mmask16 first_lanes(int64_t count) {
  return static_cast<__mmask16>((1u << count) - 1u);
}

// The bfloat16 values at src in the lanes of mask, widened (exactly) to float32; 0 elsewhere.
inline __m512 load_bf16(const uint16_t* src, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// float32 lanes -> bfloat16, round to nearest even (NaN kept), 16 at a time.
inline __m256i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// silu(gate) * up lane by lane, gate / (1 + exp(-gate)) * up in float32 as the separate
// silu_and_mul op computes it (fused_layers.cpp): the gated epilogue of the linear kernels.
inline __m512 silu_times(__m512 gate, __m512 up) {
  alignas(64) float g[16], u[16];
  _mm512_store_ps(g, gate);
  _mm512_store_ps(u, up);
#pragma omp simd
  for (int i = 0; i < 16; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  return _mm512_load_ps(g);
}

}  // namespace tokenmill

#endif  // AVX-512 F and BW
