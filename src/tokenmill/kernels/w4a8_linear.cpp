// Linear layers over 4-bit weights with 8-bit activations, on AVX2:
//
//   w4a8_linear(x [M, K] float32, packed, group_params, N, bias?, residual?)
//       -> x~ @ (q * scale + min).T (+ bias) (+ residual)
//
// Weights: 4-bit values q in 0..15 with a float16 scale and minimum per group of kGroup
// (32) inputs of an output row, w = q * scale + min (GGUF Q4_1's form, in its dtypes).
// Activations: each row of x is quantized per group of kGroup (32) inputs to int8 at
// every call, x~ = d * round(x / d) with d = max|x| / 127 over the group (round to
// nearest even). The weights are centred on 8, and only their centred part sees x rounded
// (w4a8_groups.h, which vnni_linear.cpp's w4a8 shares):
//
//   y[m, n] = sum over groups g of scale[n, g] * (d[m, g] * sum q[n, k] * xq[m, k] + e[m, g])
//                                  + min[n, g] * s[m, g]
//
// The integer products are exact (VPMADDUBSW: unsigned 4-bit values times signed bytes,
// summed in 16 bits: at most 16 products of 15 x 127 per lane, 30480, no saturation); the
// rest is float32. This is what a CPU without fast bfloat16 arithmetic does fastest: one
// VPMADDUBSW multiplies 32 pairs, four times what one float32 FMA does. The cost is the
// rounding of the activations, which ``benchmarks/accuracy.py`` measures.
//
// Packed layout (native_weights.NativeW4A8Weight packs it): outputs in panels of 16,
// inputs in records of 4; a record is 32 bytes, byte 4 o + j holding input 4 r + j of
// output o of the panel in its low nibble and of output 8 + o in its high nibble:
//
//   packed[p][r][4 o + j] = q[16 p + o][4 r + j] | q[16 p + 8 + o][4 r + j] << 4
//
// One 256-bit load and two masks give a record's two registers: 8 outputs x 4 inputs
// each, the operand layout of VPMADDUBSW against a row's 4 int8 inputs broadcast to every
// 32-bit lane. group_params is [panels, K / kGroup, 2, 16] float16: per group, the
// scales of the panel's 16 outputs, then their minimums (one cache line).
//
// Threads split the panels; each streams its panels in order and requests the next one
// into cache while it multiplies. Rows go through in chunks of at most kMaxRows (16-bit
// accumulators for kMaxRows rows x 16 outputs in registers); later chunks find the panel
// in cache.
//
// Built for CPUs with AVX2, FMA and F16C; elsewhere this op does not exist.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "avx2_lanes.h"
#include "linear_epilogue.h"
#include "w4a8_groups.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

namespace {

using tokenmill::GroupActivations;
using tokenmill::load_lanes;
using tokenmill::store_lanes;

constexpr int64_t kPanel = 16;   // outputs per panel
constexpr int64_t kGroup = 32;   // inputs per weight scale and minimum and per activation scale
constexpr int64_t kRecord = 32;  // bytes per record: 4 inputs x 16 outputs x 4 bits
constexpr int64_t kRecordsPerGroup = kGroup / 4;
constexpr int kMaxRows = 4;

int64_t panels_for(int64_t n) { return (n + kPanel - 1) / kPanel; }

// 8 float16 values at src, widened (exactly) to float32.
inline __m256 half_lanes(const uint16_t* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}

// The activations of one call, quantized: xq [M, K] int8, groups [M, K / kGroup].
struct QuantizedRows {
  const int8_t* xq;
  const GroupActivations* groups;
  int64_t k;
};

// Whether v is neither NaN nor an infinity, read off its bits (fast math would fold
// std::isfinite to true).
inline bool finite(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x7f800000u) != 0x7f800000u;
}

// The largest lane of v.
inline float max_lane(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// The sum of v's lanes.
inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The sum of v's 32-bit integer lanes.
inline int32_t sum_int_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

// One group of kGroup (32) inputs at src: its int8 values into dst, the rest into `group`.
inline void quantize_group(const float* src, int8_t* dst, GroupActivations& group) {
  static_assert(kGroup == 32, "four registers a group");
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(src + 8 * i);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const auto abs = [&](__m256 a) { return _mm256_and_ps(a, abs_mask); };
  const float amax = max_lane(_mm256_max_ps(_mm256_max_ps(abs(v[0]), abs(v[1])),
                                            _mm256_max_ps(abs(v[2]), abs(v[3]))));
  const float sum = sum_lanes(_mm256_add_ps(_mm256_add_ps(v[0], v[1]),
                                            _mm256_add_ps(v[2], v[3])));
  const bool ok = finite(sum);  // a NaN or an infinity in the group makes its sum one
  const __m256 inv = _mm256_set1_ps(ok && amax > 0.f ? 127.f / amax : 0.f);
  // round to nearest even (the default rounding mode), |value| <= 127: no saturation
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  for (int half = 0; half < 2; ++half) {
    const __m256i words =
        _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * half], q[2 * half + 1]), 0xd8);
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words),
                                          _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * half), bytes);
  }
  const auto q_sum = static_cast<float>(sum_int_lanes(
      _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]))));
  const float d = ok ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
  group = tokenmill::group_activations(sum, d, q_sum);
}

void quantize_rows(const float* x, int64_t x_stride, int64_t m, int64_t k, int8_t* xq,
                   GroupActivations* groups) {
  const int64_t count = k / kGroup;
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < count; ++g) {
        quantize_group(x + r * x_stride + g * kGroup, xq + r * k + g * kGroup,
                       groups[r * count + g]);
      }
    }
  });
}

// Rows [row, row + ROWS) of the call times panel p: acc[r][o] = the panel's output o of
// row r, before bias and residual. The 16-bit sums of a group build in named registers
// (a<row><half>); the float32 sums stay in acc, in memory (L1), updated once per group:
// with more in registers, GCC spills the 16-bit sums instead.
template <int ROWS>
inline void panel_kernel(const QuantizedRows& xr, int64_t row, const uint8_t* panel,
                         const uint16_t* params, const char* ahead,
                         float (&acc)[kMaxRows][kPanel]) {
  static_assert(ROWS >= 1 && ROWS <= kMaxRows);
  const int64_t k = xr.k, groups = k / kGroup;
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < ROWS; ++r) std::fill(acc[r], acc[r] + kPanel, 0.f);
  const int8_t* x = xr.xq + row * k;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = panel + g * kRecordsPerGroup * kRecord;
    if (ahead) {  // a group's records are 4 cache lines
      for (int line = 0; line < 4; ++line) {
        _mm_prefetch(ahead + g * kRecordsPerGroup * kRecord + 64 * line, _MM_HINT_T1);
      }
    }
    __m256i a00, a01, a10, a11, a20, a21, a30, a31;
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = _mm256_setzero_si256();
    for (int64_t i = 0; i < kRecordsPerGroup; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + i * kRecord));
      const __m256i low = _mm256_and_si256(v, nibble);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      const int8_t* xi = x + g * kGroup + 4 * i;
#define TOKENMILL_ROW(r)                                                            \
  if constexpr (ROWS > r) {                                                         \
    int32_t four;                                                                   \
    std::memcpy(&four, xi + r * k, sizeof(four));                                   \
    const __m256i xb = _mm256_set1_epi32(four);                                     \
    a##r##0 = _mm256_add_epi16(a##r##0, _mm256_maddubs_epi16(low, xb));             \
    a##r##1 = _mm256_add_epi16(a##r##1, _mm256_maddubs_epi16(high, xb));            \
    __asm__("" : "+x"(a##r##0), "+x"(a##r##1));                                     \
  }
      // The empty asm statements keep each 16-bit sum in its register, taking its
      // products one record at a time: without them GCC reassociates the integer sums
      // into trees and keeps every product of a group on the stack (2x slower).
      TOKENMILL_ROW(0) TOKENMILL_ROW(1) TOKENMILL_ROW(2) TOKENMILL_ROW(3)
#undef TOKENMILL_ROW
    }
    const __m256i sums[kMaxRows][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
    for (int h = 0; h < 2; ++h) {
      const uint16_t* group_params = params + g * 2 * kPanel + 8 * h;
      const __m256 scale = half_lanes(group_params);
      const __m256 min = half_lanes(group_params + kPanel);
      for (int r = 0; r < ROWS; ++r) {
        const GroupActivations& xg = xr.groups[(row + r) * groups + g];
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r][h], ones));
        const __m256 centred = _mm256_fmadd_ps(dot, _mm256_set1_ps(xg.d), _mm256_set1_ps(xg.e));
        __m256 v = _mm256_fmadd_ps(centred, scale, _mm256_loadu_ps(acc[r] + 8 * h));
        v = _mm256_fmadd_ps(min, _mm256_set1_ps(xg.s), v);
        _mm256_storeu_ps(acc[r] + 8 * h, v);
      }
    }
  }
}

struct Output {
  const float* bias;      // per output, or null
  const float* residual;  // [M, n], or null
  int64_t res_stride;
  float* out;  // [M, n]
  int64_t n;
};

template <int ROWS>
void rows_times_panel(const QuantizedRows& xr, int64_t row, const uint8_t* panel,
                      const uint16_t* params, const char* ahead, int64_t p, const Output& o) {
  float acc[kMaxRows][kPanel];
  panel_kernel<ROWS>(xr, row, panel, params, ahead, acc);
  for (int h = 0; h < 2; ++h) {
    const int64_t col = p * kPanel + 8 * h;
    if (col >= o.n) break;
    const int64_t width = std::min<int64_t>(8, o.n - col);
    const __m256 b = o.bias ? load_lanes(o.bias + col, width) : _mm256_setzero_ps();
    for (int r = 0; r < ROWS; ++r) {
      __m256 v = _mm256_add_ps(_mm256_loadu_ps(acc[r] + 8 * h), b);
      if (o.residual) {
        v = _mm256_add_ps(v, load_lanes(o.residual + (row + r) * o.res_stride + col, width));
      }
      store_lanes(o.out + (row + r) * o.n + col, v, width);
    }
  }
}

using RowsFn = void (*)(const QuantizedRows&, int64_t, const uint8_t*, const uint16_t*,
                        const char*, int64_t, const Output&);
template <int... R>
constexpr auto make_table(std::integer_sequence<int, R...>) {
  return std::array<RowsFn, sizeof...(R)>{&rows_times_panel<R + 1>...};
}
constexpr auto kRowsFns = make_table(std::make_integer_sequence<int, kMaxRows>{});

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& group_params, int64_t out_features,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "x must be [M, K] float32 with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), n = out_features, panels = panels_for(n);
  TORCH_CHECK(k % kGroup == 0, "x must be [M, K] with K a multiple of ", kGroup);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte && packed.size(0) == panels &&
                  packed.size(1) * 4 == k && packed.size(2) == kRecord,
              "packed must be native_weights.NativeW4A8Weight's packing of an "
              "[out_features, K] weight");
  TORCH_CHECK(group_params.dim() == 4 && group_params.size(0) == panels &&
                  group_params.size(1) == k / kGroup && group_params.size(2) == 2 &&
                  group_params.size(3) == kPanel && group_params.is_contiguous() &&
                  group_params.scalar_type() == at::kHalf,
              "group_params must be [panels, K / ", kGroup, ", 2, ", kPanel, "] float16");
  tokenmill::check_bias_and_residual(bias, residual, m, n, at::kFloat, "float32");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  // One scratch allocation for the quantized rows: their groups' GroupActivations, then
  // the int8 values.
  const int64_t group_count = m * (k / kGroup);
  at::Tensor scratch = at::empty({group_count * int64_t{sizeof(GroupActivations)} + m * k},
                                 x.options().dtype(at::kByte));
  auto* groups = reinterpret_cast<GroupActivations*>(scratch.data_ptr<uint8_t>());
  auto* xq = reinterpret_cast<int8_t*>(groups + group_count);
  quantize_rows(x.data_ptr<float>(), x.stride(0), m, k, xq, groups);
  const QuantizedRows xr{xq, groups, k};
  const Output o{bias ? bias->data_ptr<float>() : nullptr,
                 residual ? residual->data_ptr<float>() : nullptr,
                 residual ? residual->stride(0) : 0, out.data_ptr<float>(), n};
  const auto* weights = packed.data_ptr<uint8_t>();
  const auto* params = reinterpret_cast<const uint16_t*>(group_params.data_ptr());
  const int64_t panel_bytes = k / 4 * kRecord, panel_params = k / kGroup * 2 * kPanel;
  const int64_t chunks = (m + kMaxRows - 1) / kMaxRows;  // of nearly equal sizes
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = weights + p * panel_bytes;
      const char* next =
          p + 1 < end ? reinterpret_cast<const char*>(panel + panel_bytes) : nullptr;
      for (int64_t c = 0, row = 0; c < chunks; ++c) {
        const int64_t rows = (m - row) / (chunks - c);
        kRowsFns[rows - 1](xr, row, panel, params + p * panel_params, c == 0 ? next : nullptr,
                           p, o);
        row += rows;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("w4a8_linear(Tensor x, Tensor packed, Tensor group_params, int out_features, "
        "Tensor? bias, Tensor? residual) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("w4a8_linear", &w4a8_linear); }

#endif  // AVX2 + FMA + F16C
