// bfloat16 linear layers on AVX512-BF16.
//
//   bf16_pack_weight(w [N, K])                              -> packed (the layout below)
//   bf16_linear(x [M, K], packed, N, bias?, residual?)      -> x @ w.T (+ bias) (+ residual)
//
// At a decode step's batch sizes (M up to a few dozen rows) a linear layer is bound by
// reading its weight; this kernel reads each weight element from memory once per call
// and multiplies it into every row while it sits in a register. At a prefill's sizes it
// is bound by arithmetic, which runs near the VDPBF16PS peak.
//
// Packed layout: outputs in panels of 32 (two 16-lane registers), each panel contiguous
// over K in pairs, the operand layout of VDPBF16PS:
//
//   packed[p][kp][half][lane][j] = w[32 p + 16 half + lane][2 kp + j]    (j in {0, 1})
//
// K is padded to even and N to a multiple of 32 with zeros. Arithmetic: the products of
// bfloat16 pairs are exact in float32 and summed in float32 (VDPBF16PS); bias and residual
// are added in float32 and the sum is rounded once to bfloat16 (round to nearest even).
//
// Threads split the panels; each streams its panels in order, and while it multiplies
// one it requests the next into cache, so memory keeps streaming during the arithmetic.
// Rows go through in chunks of at most kMaxRows (a register tile of kMaxRows x 32
// float32 accumulators); the second and later chunks find the panel in cache.
//
// Built only for CPUs with AVX512-BF16 (the compiler targets the host): elsewhere these ops
// do not exist and bfloat16 weights take oneDNN's kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <utility>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

constexpr int64_t kPanel = 32;   // outputs per panel
constexpr int64_t kMaxRows = 12;  // rows per micro-kernel call: 2 * 12 accumulators
constexpr int64_t kMaxSharingChunks = 6;

int64_t even(int64_t k) { return (k + 1) / 2 * 2; }
int64_t panels_for(int64_t n) { return (n + kPanel - 1) / kPanel; }

at::Tensor bf16_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight must be [N, K] bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1), kp = even(k) / 2;
  const int64_t panels = panels_for(n);
  at::Tensor w = weight.contiguous();
  at::Tensor packed = at::zeros({panels, kp, 2, 16, 2}, weight.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t o = 0; o < kPanel && p * kPanel + o < n; ++o) {
        const uint16_t* row = src + (p * kPanel + o) * k;
        uint16_t* col = dst + p * kp * 64 + (o / 16) * 32 + (o % 16) * 2;
        for (int64_t i = 0; i < k; ++i) col[(i / 2) * 64 + (i % 2)] = row[i];
      }
    }
  });
  return packed;
}

// The next panel to request into cache meanwhile: ``Ahead{next, pass, passes}`` requests
// every ``passes``-th pair record of it, from the ``pass``-th on, so that the passes over
// one panel together request the whole next one and memory streams all along.
struct Ahead {
  const uint16_t* panel;  // null: none
  int64_t pass, passes;
};

// acc[r][h] += (x[r][i], x[r][i + 1]) . the panel's pair record ``record``, for every row r;
// ``read_pair`` reads the two inputs (bfloat16 bits) of a row at x[r] + i as one int32.
template <int ROWS, typename ReadPair>
inline void multiply_pair(const uint16_t* x, int64_t x_stride, int64_t i, const uint16_t* record,
                          __m512 (&acc)[kMaxRows][2], ReadPair read_pair) {
  const __m512bh w0 = (__m512bh)_mm512_loadu_si512(record);
  const __m512bh w1 = (__m512bh)_mm512_loadu_si512(record + 32);
#pragma GCC unroll 12
  for (int r = 0; r < ROWS; ++r) {
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(read_pair(x + r * x_stride + i));
    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
  }
}

// Rows x[0 .. ROWS) (k inputs each) times one panel: acc[r][h] lanes are the outputs
// 32 p + 16 h + lane of row r.
template <int ROWS>
inline void panel_kernel(const uint16_t* x, int64_t x_stride, int64_t k, const uint16_t* panel,
                         Ahead ahead, __m512 (&acc)[kMaxRows][2]) {
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;  // full pairs; an odd K's last input pairs with a zero
  for (int64_t kp = 0, turn = ahead.pass; kp < pairs; ++kp, ++turn) {
    if (turn == ahead.passes) turn = 0;
    if (ahead.panel && turn == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead.panel + kp * 64), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(ahead.panel + kp * 64 + 32), _MM_HINT_T1);
    }
    multiply_pair<ROWS>(x, x_stride, 2 * kp, panel + kp * 64, acc, [](const uint16_t* src) {
      int32_t pair;
      std::memcpy(&pair, src, sizeof(pair));
      return pair;
    });
  }
  if (k % 2) {
    multiply_pair<ROWS>(x, x_stride, k - 1, panel + pairs * 64, acc,
                        [](const uint16_t* src) { return static_cast<int32_t>(*src); });
  }
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

inline __m512 load_bf16(const uint16_t* src, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <int ROWS>
void rows_times_panel(const uint16_t* x, int64_t x_stride, int64_t k, const uint16_t* panel,
                      Ahead ahead, int64_t p, int64_t n, const uint16_t* bias,
                      const uint16_t* residual, int64_t res_stride, uint16_t* out,
                      int64_t out_stride) {
  __m512 acc[kMaxRows][2];
  panel_kernel<ROWS>(x, x_stride, k, panel, ahead, acc);
  for (int h = 0; h < 2; ++h) {
    const int64_t col = p * kPanel + 16 * h;
    if (col >= n) break;
    const int64_t width = std::min<int64_t>(16, n - col);
    const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1u);
    const __m512 b = bias ? load_bf16(bias + col, mask) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) {
      __m512 v = _mm512_add_ps(acc[r][h], b);
      if (residual) v = _mm512_add_ps(v, load_bf16(residual + r * res_stride + col, mask));
      _mm256_mask_storeu_epi16(out + r * out_stride + col, mask, round_to_bf16(v));
    }
  }
}

using RowsFn = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, Ahead, int64_t,
                       int64_t, const uint16_t*, const uint16_t*, int64_t, uint16_t*, int64_t);

template <int... R>
constexpr auto make_table(std::integer_sequence<int, R...>) {
  return std::array<RowsFn, sizeof...(R)>{&rows_times_panel<R + 1>...};
}
constexpr auto kRowsFns = make_table(std::make_integer_sequence<int, kMaxRows>{});

const uint16_t* bits_of(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be [M, K] bfloat16 with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  TORCH_CHECK(packed.dim() == 5 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16 && packed.size(0) == panels_for(n) &&
                  packed.size(1) == even(k) / 2,
              "packed must be bf16_pack_weight's packing of an [out_features, K] weight");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                        bias->scalar_type() == at::kBFloat16),
              "bias must be [out_features] bfloat16");
  TORCH_CHECK(!residual || (residual->dim() == 2 && residual->size(0) == m &&
                            residual->size(1) == n && residual->stride(1) == 1 &&
                            residual->scalar_type() == at::kBFloat16),
              "residual must be [M, out_features] bfloat16 with contiguous rows");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const uint16_t* xp = bits_of(x);
  const uint16_t* wp = bits_of(packed);
  const uint16_t* bp = bias ? bits_of(*bias) : nullptr;
  const uint16_t* rp = residual ? bits_of(*residual) : nullptr;
  const int64_t x_stride = x.stride(0), res_stride = residual ? residual->stride(0) : 0;
  const int64_t panel_size = packed.size(1) * 64;  // elements
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t chunks = (m + kMaxRows - 1) / kMaxRows;  // nearly equal sizes
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* panel = wp + p * panel_size;
      const uint16_t* next = p + 1 < end ? panel + panel_size : nullptr;
      for (int64_t c = 0, row = 0; c < chunks; ++c) {
        const int64_t rows = (m - row) / (chunks - c);
        // A few chunks share the requests for the next panel; with many (a prefill), the
        // second alone makes them: spreading them thinner measured slower.
        const Ahead ahead = chunks <= kMaxSharingChunks ? Ahead{next, c, chunks}
                                                        : Ahead{c == 1 ? next : nullptr, 0, 1};
        kRowsFns[rows - 1](xp + row * x_stride, x_stride, k, panel, ahead, p, n, bp,
                           rp ? rp + row * res_stride : nullptr, res_stride, op + row * n, n);
        row += rows;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("bf16_pack_weight(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int out_features, Tensor? bias, "
        "Tensor? residual) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("bf16_pack_weight", &bf16_pack_weight);
  m.impl("bf16_linear", &bf16_linear);
}

#endif  // AVX512-BF16
