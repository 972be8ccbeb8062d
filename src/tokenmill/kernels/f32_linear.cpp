// Linear layers with float32 activations on AVX2 + FMA, over weights in float32, in int8
// with one float32 scale per output row or per 16 or 32 inputs of a row, or in 4 bits with
// a float32 scale and minimum per 32 inputs of a row:
//
//   f32_pack_weight(w [N, K] float32)                     -> packed (the layout below)
//   f32_linear(x [M, K], packed, N, bias?, residual?)     -> x @ w.T (+ bias) (+ residual)
//   int8_f32_pack_weight(q [N, K] int8)                   -> packed (the same layout)
//   int8_f32_linear(x [M, K], packed, scales [N], N, bias?, residual?)
//                                                         -> (x @ q.T) * scales (+ ...)
//   int8_group_f32_linear(x [M, K], packed, scales, N, bias?, residual?)
//                                   -> x @ (q * scale).T (+ ...)   (see Int8GroupWeights)
//   int4_f32_linear(x [M, K], packed, scales, mins, N, bias?, residual?)
//                                   -> x @ (q * scale + min).T (+ ...)   (see Int4Weights)
//
// The float32 counterpart of bf16_linear.cpp, in 8-lane float32 FMA (AVX2; the default
// for float32 weights where the CPU has no AVX-512). At a decode step's batch sizes it is
// bound by reading its weight: each weight element is read from memory once per call and
// multiplied into every row while it sits in a register (int8 weights: a quarter of the
// bytes, widened to float32 in registers, exactly). At larger batches it is bound by the
// FMA units.
//
// Packed layout: outputs in panels of 16 (two 8-lane registers), each panel contiguous
// over K:
//
//   packed[p][i][lane] = w[16 p + lane][i]
//
// N is padded to a multiple of 16 with zeros. Arithmetic: products and sums in float32
// (FMA, so each product is rounded once, with its sum); scale, bias and residual applied in
// float32.
//
// Threads split the panels; each streams its panels in order, and while it multiplies one
// it requests the next into cache, so memory keeps streaming during the arithmetic. Rows go
// through in chunks of at most kMaxRows (a register tile of kMaxRows rows x 16 float32
// accumulators); the second and later chunks find the panel in cache. One or two rows (a
// decode step's few sequences) take several panels at once instead, so that enough
// independent FMAs are in flight to keep up with memory. With more than two
// chunks, an int8 panel is widened once into a float32 copy, which the chunks then share.
// An int4 panel is multiplied directly by every chunk of at most kInt4DirectRows rows,
// however many rows the call has, so that a row's result never depends on the row count
// (its per-group sums scaled and shifted: another sum than of widened weights). Grouped
// int8 weights take the int8 paths, scaled as they are read (see Int8GroupWeights).
//
// Built for every CPU with AVX2 and FMA (the compiler targets the host), AVX-512 ones
// too, where they run as they do elsewhere: there oneDNN's 16-lane float32 kernels have
// twice this peak, so the weight formats take these only where the native kernels are
// asked for alone (batch_invariant) or a format has no other (gguf in float32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "avx2_lanes.h"
#include "linear_epilogue.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <initializer_list>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)

namespace {

using tokenmill::load_lanes;
using tokenmill::store_lanes;

constexpr int64_t kPanel = 16;  // outputs per panel
constexpr int kMaxRows = 6;  // rows per micro-kernel call: 2 x 6 accumulators of 16
// rows per int4 micro-kernel call (2 x 4 group sums, 4 weight registers)
constexpr int kInt4DirectRows = 4;
constexpr int64_t kMaxSharingChunks = 6;
// Chains of FMAs (pairs of 8-lane sums) that one or two rows keep going at once: 4 x 2
// chains cover the FMA units' latency (4 cycles, 2 a cycle).
constexpr int kFewRowsSlots = 4;
constexpr int64_t kLine = 64;  // bytes per cache line

int64_t panels_for(int64_t n) { return (n + kPanel - 1) / kPanel; }

// Weight elements of one kind: one input's 16 outputs (a record) read into two registers
// (load_input). A grouped kind (kGroup > 0) has float32 numbers per kGroup inputs of each
// output; the others have kGroup 0.
struct F32Weights {
  using Elem = float;
  static constexpr int64_t kInputsPerRecord = 1;
  static constexpr int64_t kGroup = 0;
  static inline void load(const Elem* record, __m256& w0, __m256& w1) {
    w0 = _mm256_loadu_ps(record);
    w1 = _mm256_loadu_ps(record + 8);
  }
};

struct Int8Weights {
  using Elem = int8_t;
  static constexpr int64_t kInputsPerRecord = 1;
  static constexpr int64_t kGroup = 0;
  // |q| <= 127 is exact in float32
  static inline void load(const Elem* record, __m256& w0, __m256& w1) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(record));
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  }
};

// int8 weights in groups of GROUP (16 or 32) inputs, each (output, group) with a float32
// scale: w = q * scale (a GGUF Q8_0 block of 32: its float16 d widened; a Q6_K sub-block
// of 16: d times its int8 sub-scale), stored as Int8Weights (int8_f32_pack_weight); scales
// are [panels, K / GROUP, 16]. Each record is scaled as it is read, so every path (several
// panels, row chunks, a widened copy) multiplies x by the same float32 weights: q * scale,
// exact where it has at most 24 significant bits, as every GGUF type's does (Q8_0: d's 11
// and q's 7; Q6_K: d's 11, the sub-scale's 7 and q's 5), so the output is x @ w.T summed
// in float32.
template <int64_t GROUP>
struct Int8GroupWeights : Int8Weights {
  static constexpr int64_t kGroup = GROUP;
  // ``scales``: the record's group's 16 scales
  static inline void load(const Elem* record, const float* scales, __m256& w0, __m256& w1) {
    Int8Weights::load(record, w0, w1);
    w0 = _mm256_mul_ps(w0, _mm256_loadu_ps(scales));
    w1 = _mm256_mul_ps(w1, _mm256_loadu_ps(scales + 8));
  }
};

// The int8 kinds, which share their paths (several panels, row chunks, widening).
template <typename W>
constexpr bool kInt8 = std::is_base_of_v<Int8Weights, W>;

// 4-bit weights in groups of kGroup inputs, each (output, group) with a float32 scale and
// minimum: w = q * scale + min, q in 0..15. A record holds two inputs' 16 outputs in 16
// bytes, byte lane = q[2 kp] | q[2 kp + 1] << 4 (packed by native_weights.NativeInt4Weight);
// scales and minimums are [panels, K / kGroup, 16].
struct Int4Weights {
  using Elem = uint8_t;
  static constexpr int64_t kInputsPerRecord = 2;
  static constexpr int64_t kGroup = 32;
};

template <typename W>
at::Tensor pack_weight(const at::Tensor& weight) {
  const int64_t n = weight.size(0), k = weight.size(1), panels = panels_for(n);
  at::Tensor w = weight.contiguous();
  at::Tensor packed = at::zeros({panels, k, kPanel}, weight.options());
  const auto* src = reinterpret_cast<const typename W::Elem*>(w.data_ptr());
  auto* dst = reinterpret_cast<typename W::Elem*>(packed.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t o = 0; o < kPanel && p * kPanel + o < n; ++o) {
        const auto* row = src + (p * kPanel + o) * k;
        auto* col = dst + p * k * kPanel + o;
        for (int64_t i = 0; i < k; ++i) col[i * kPanel] = row[i];
      }
    }
  });
  return packed;
}

at::Tensor f32_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "weight must be [N, K] float32");
  return pack_weight<F32Weights>(weight);
}

at::Tensor int8_f32_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar,
              "weight must be [N, K] int8");
  return pack_weight<Int8Weights>(weight);
}

// A grouped kind's numbers per panel, [K / kGroup, kPanel] float32; 0 for the others.
template <typename W>
constexpr int64_t group_scales_size(int64_t k) {
  if constexpr (W::kGroup > 0) {
    return k / W::kGroup * kPanel;
  } else {
    return 0;
  }
}

// Input i's record of a panel into two registers; ``scales``: the panel's group scales
// (grouped kinds; the others ignore it).
template <typename W>
inline void load_input(const typename W::Elem* panel, const float* scales, int64_t i,
                       __m256& w0, __m256& w1) {
  if constexpr (W::kGroup > 0) {
    W::load(panel + i * kPanel, scales + i / W::kGroup * kPanel, w0, w1);
  } else {
    W::load(panel + i * kPanel, w0, w1);
  }
}

// The next panel to request into cache meanwhile: ``Ahead{next, pass, passes}`` requests
// every ``passes``-th cache line of it, from the ``pass``-th on, so that the passes over
// one panel together request the whole next one and memory streams all along.
struct Ahead {
  const char* panel;  // null: none
  int64_t pass, passes;
};

// Rows x[0 .. ROWS) (k inputs each) times PANELS consecutive panels (panel_size elements
// apart; ``scales``: the first one's group scales, the others' following it, or null for
// an ungrouped kind): acc[ROWS * j + r][h] lanes are the outputs 16 (p + j) + 8 h + lane of
// row r, for the first panel p. Every output is one chain of FMAs over the inputs in
// order, however many rows and panels go together, so a row's result does not depend on
// its batch. With one or two rows, several panels at once give the FMA units enough
// independent chains (an FMA waits for the previous one of its chain). The sums build in
// named registers (s<slot><half>), copied out once: with an array indexed in the loop, GCC
// also stores every sum to the stack at every input, which halves the speed.
template <typename W, int ROWS, int PANELS = 1>
inline void panel_kernel(const float* x, int64_t x_stride, int64_t k,
                         const typename W::Elem* panel, int64_t panel_size,
                         const float* scales, Ahead ahead, __m256 (&acc)[kMaxRows][2]) {
  static_assert(ROWS >= 1 && PANELS >= 1 && ROWS * PANELS <= kMaxRows);
  static_assert(PANELS == 1 || ROWS <= 2, "several panels only for one or two rows");
  constexpr int64_t kRecordsPerLine = kLine / (kPanel * sizeof(typename W::Elem));
  const int64_t panel_bytes = panel_size * static_cast<int64_t>(sizeof(typename W::Elem));
  const int64_t scales_size = group_scales_size<W>(k);
  __m256 s00, s01, s10, s11, s20, s21, s30, s31, s40, s41, s50, s51;
  s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = s40 = s41 = s50 = s51 = _mm256_setzero_ps();
  for (int64_t i = 0, turn = ahead.pass; i < k; ++i) {
    if (i % kRecordsPerLine == 0) {
      if (turn == ahead.passes) turn = 0;
      if (ahead.panel && turn == 0) {
        for (int j = 0; j < PANELS; ++j) {
          _mm_prefetch(ahead.panel + j * panel_bytes +
                           i * kPanel * static_cast<int64_t>(sizeof(typename W::Elem)),
                       _MM_HINT_T1);
        }
      }
      ++turn;
    }
    __m256 w0[PANELS], w1[PANELS];
    for (int j = 0; j < PANELS; ++j) {
      load_input<W>(panel + j * panel_size, scales + j * scales_size, i, w0[j], w1[j]);
    }
    // Each slot broadcasts its row's input itself: with all rows' broadcasts held at once,
    // six rows need more registers than there are.
#define TOKENMILL_SLOT(n)                                                       \
  if constexpr (ROWS * PANELS > n) {                                            \
    const __m256 xb = _mm256_broadcast_ss(x + (n % ROWS) * x_stride + i);       \
    s##n##0 = _mm256_fmadd_ps(xb, w0[n / ROWS], s##n##0);                       \
    s##n##1 = _mm256_fmadd_ps(xb, w1[n / ROWS], s##n##1);                       \
  }
    TOKENMILL_SLOT(0) TOKENMILL_SLOT(1) TOKENMILL_SLOT(2)
    TOKENMILL_SLOT(3) TOKENMILL_SLOT(4) TOKENMILL_SLOT(5)
#undef TOKENMILL_SLOT
  }
  const __m256 sums[kMaxRows][2] = {{s00, s01}, {s10, s11}, {s20, s21},
                                    {s30, s31}, {s40, s41}, {s50, s51}};
  for (int n = 0; n < ROWS * PANELS; ++n) acc[n][0] = sums[n][0], acc[n][1] = sums[n][1];
}

// What one call computes besides the panels: the rows, the output's extras, where it goes.
struct Operands {
  const float* x;
  int64_t x_stride, k, n;
  const float* scales;  // per output, or null (1)
  const float* group_scales;  // grouped kinds only: [panels, K / kGroup, 16] scales,
  const float* group_mins;  // and for int4 minimums
  const float* x_sums;  // and [M, K / 32] sums of each row of x per group

  const float* bias;  // per output, or null
  const float* residual;  // [M, n], or null
  int64_t res_stride;
  float* out;
  int64_t out_stride;
};

// int4's direct pass over a panel for a few rows, group by group: each group's sums of
// x q build in named registers (p<row><half>), then go into acc scaled by the group's
// scale, plus its minimum times the group's sum of x. Two inputs per record: the low
// nibbles are input 2 kp, the high ones 2 kp + 1.
template <int ROWS>
inline void int4_panel_kernel(const Operands& op, int64_t row, const uint8_t* panel,
                              Ahead ahead, int64_t p, __m256 (&acc)[kMaxRows][2]) {
  static_assert(ROWS >= 1 && ROWS <= kInt4DirectRows);
  constexpr int64_t kGroupRecords = Int4Weights::kGroup / 2;
  constexpr int64_t kRecordsPerLine = kLine / kPanel;
  const int64_t groups = op.k / Int4Weights::kGroup;
  const float* scales = op.group_scales + p * groups * kPanel;
  const float* mins = op.group_mins + p * groups * kPanel;
  const float* x = op.x + row * op.x_stride;
  const int64_t xs = op.x_stride;
  const __m256i nibble = _mm256_set1_epi32(0xf);
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0, turn = ahead.pass; g < groups; ++g) {
    __m256 p00, p01, p10, p11, p20, p21, p30, p31;
    p00 = p01 = p10 = p11 = p20 = p21 = p30 = p31 = _mm256_setzero_ps();
    for (int64_t kp = g * kGroupRecords; kp < (g + 1) * kGroupRecords; ++kp) {
      if (kp % kRecordsPerLine == 0) {
        if (turn == ahead.passes) turn = 0;
        if (ahead.panel && turn == 0) _mm_prefetch(ahead.panel + kp * kPanel, _MM_HINT_T1);
        ++turn;
      }
      const __m128i bytes =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + kp * kPanel));
      const __m256i lanes0 = _mm256_cvtepu8_epi32(bytes);
      const __m256i lanes1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
      const __m256 e0 = _mm256_cvtepi32_ps(_mm256_and_si256(lanes0, nibble));
      const __m256 o0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(lanes0, 4));
      const __m256 e1 = _mm256_cvtepi32_ps(_mm256_and_si256(lanes1, nibble));
      const __m256 o1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(lanes1, 4));
#define TOKENMILL_ROW(r)                                                   \
  if constexpr (ROWS > r) {                                                \
    const __m256 xe = _mm256_broadcast_ss(x + r * xs + 2 * kp);           \
    const __m256 xo = _mm256_broadcast_ss(x + r * xs + 2 * kp + 1);       \
    p##r##0 = _mm256_fmadd_ps(xo, o0, _mm256_fmadd_ps(xe, e0, p##r##0));   \
    p##r##1 = _mm256_fmadd_ps(xo, o1, _mm256_fmadd_ps(xe, e1, p##r##1));   \
  }
      TOKENMILL_ROW(0) TOKENMILL_ROW(1) TOKENMILL_ROW(2) TOKENMILL_ROW(3)
#undef TOKENMILL_ROW
    }
    const __m256 part[kInt4DirectRows][2] = {{p00, p01}, {p10, p11}, {p20, p21}, {p30, p31}};
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = _mm256_loadu_ps(scales + g * kPanel + 8 * h);
      const __m256 min = _mm256_loadu_ps(mins + g * kPanel + 8 * h);
      for (int r = 0; r < ROWS; ++r) {
        acc[r][h] = _mm256_fmadd_ps(part[r][h], scale, acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(op.x_sums[(row + r) * groups + g]), min,
                                    acc[r][h]);
      }
    }
  }
}

// Panel p's group scales (grouped kinds: its block of op.group_scales), else null.
template <typename W>
inline const float* group_scales_of(const Operands& op, int64_t p) {
  if constexpr (W::kGroup > 0) {
    return op.group_scales + p * group_scales_size<W>(op.k);
  } else {
    return nullptr;
  }
}

// Panel p's outputs of rows [row, row + rows) from their sums (acc[r] for row row + r):
// scale, bias and residual applied, stored.
inline void store_panel(const Operands& op, int64_t row, int rows, int64_t p,
                        const __m256 (*acc)[2]) {
  for (int h = 0; h < 2; ++h) {
    const int64_t col = p * kPanel + 8 * h;
    if (col >= op.n) break;
    const int64_t width = std::min<int64_t>(8, op.n - col);
    const __m256 scale = op.scales ? load_lanes(op.scales + col, width) : _mm256_set1_ps(1.f);
    const __m256 b = op.bias ? load_lanes(op.bias + col, width) : _mm256_setzero_ps();
    for (int r = 0; r < rows; ++r) {
      __m256 v = _mm256_fmadd_ps(acc[r][h], scale, b);
      if (op.residual) {
        v = _mm256_add_ps(v, load_lanes(op.residual + (row + r) * op.res_stride + col, width));
      }
      store_lanes(op.out + (row + r) * op.out_stride + col, v, width);
    }
  }
}

// Rows [row, row + ROWS) of the call times panel p.
template <typename W, int ROWS>
void rows_times_panel(const Operands& op, int64_t row, const typename W::Elem* panel,
                      Ahead ahead, int64_t p) {
  __m256 acc[kMaxRows][2];
  if constexpr (std::is_same_v<W, Int4Weights>) {
    int4_panel_kernel<ROWS>(op, row, panel, ahead, p, acc);
  } else {
    panel_kernel<W, ROWS>(op.x + row * op.x_stride, op.x_stride, op.k, panel, 0,
                          group_scales_of<W>(op, p), ahead, acc);
  }
  store_panel(op, row, ROWS, p, acc);
}

// All ROWS rows of the call (one or two) times panels [p, p + PANELS), consecutive in
// memory from ``panel``; ``next``: the panels to request into cache meanwhile, or null.
template <typename W, int ROWS, int PANELS>
void rows_times_panels(const Operands& op, const typename W::Elem* panel, int64_t panel_size,
                       const void* next, int64_t p) {
  __m256 acc[kMaxRows][2];
  panel_kernel<W, ROWS, PANELS>(op.x, op.x_stride, op.k, panel, panel_size,
                                group_scales_of<W>(op, p),
                                Ahead{static_cast<const char*>(next), 0, 1}, acc);
  for (int j = 0; j < PANELS; ++j) store_panel(op, 0, ROWS, p + j, acc + ROWS * j);
}

template <typename W>
using RowsFn = void (*)(const Operands&, int64_t, const typename W::Elem*, Ahead, int64_t);

template <typename W, int... R>
constexpr auto make_table(std::integer_sequence<int, R...>) {
  return std::array<RowsFn<W>, sizeof...(R)>{&rows_times_panel<W, R + 1>...};
}
template <typename W>
constexpr auto kRowsFns = make_table<W>(
    std::make_integer_sequence<int, std::is_same_v<W, Int4Weights> ? kInt4DirectRows
                                                                    : kMaxRows>{});

// All the rows of the call times panel p, in chunks of at most kMaxRows; ``next``: the
// panel to request into cache meanwhile, or null.
template <typename W>
void panel_times_rows(const Operands& op, int64_t m, const typename W::Elem* panel,
                      const void* next, int64_t p) {
  constexpr int64_t kChunk = std::is_same_v<W, Int4Weights> ? kInt4DirectRows : kMaxRows;
  const int64_t chunks = (m + kChunk - 1) / kChunk;  // nearly equal sizes
  const char* ahead_panel = static_cast<const char*>(next);
  for (int64_t c = 0, row = 0; c < chunks; ++c) {
    const int64_t rows = (m - row) / (chunks - c);
    // A few chunks share the requests for the next panel; with many (a prefill), the
    // second alone makes them.
    const Ahead ahead = chunks <= kMaxSharingChunks
                            ? Ahead{ahead_panel, c, chunks}
                            : Ahead{c == 1 ? ahead_panel : nullptr, 0, 1};
    kRowsFns<W>[rows - 1](op, row, panel, ahead, p);
    row += rows;
  }
}

// From this many rows on, an int8 panel is widened once into float32 (which stays in
// cache) and multiplied as float32 weights, instead of widening it again for every chunk
// of rows.
constexpr int64_t kWidenFromRows = 2 * kMaxRows + 1;

// Panel p of an int8 kind as float32 into dst (its [K, 16] layout), as load_input reads it
// (q, or q * scale), requesting ``next`` (the next panel, or null) into cache meanwhile.
template <typename W>
void widen_panel(const Operands& op, const typename W::Elem* panel, int64_t p,
                 const typename W::Elem* next, float* dst) {
  const float* scales = group_scales_of<W>(op, p);
  for (int64_t i = 0; i < op.k; ++i) {
    if (next && i % (kLine / kPanel) == 0) _mm_prefetch(next + i * kPanel, _MM_HINT_T1);
    __m256 w0, w1;
    load_input<W>(panel, scales, i, w0, w1);
    _mm256_storeu_ps(dst + i * kPanel, w0);
    _mm256_storeu_ps(dst + i * kPanel + 8, w1);
  }
}

// A grouped kind's per-group operands (see Operands); all null for the other kinds.
struct GroupOperands {
  const float* scales = nullptr;
  const float* mins = nullptr;
  const float* x_sums = nullptr;
};

// The checks and the loop shared by every weight kind (``scales``: int8's, else null).
template <typename W>
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const float* scales,
                  GroupOperands groups, int64_t out_features,
                  const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual, at::ScalarType weight_type,
                  const char* packer) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "x must be [M, K] float32 with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
                  packed.scalar_type() == weight_type && packed.size(0) == panels_for(n) &&
                  packed.size(1) * W::kInputsPerRecord == k && packed.size(2) == kPanel,
              "packed must be ", packer, "'s packing of an [out_features, K] weight");
  tokenmill::check_bias_and_residual(bias, residual, m, n, at::kFloat, "float32");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const Operands op{x.data_ptr<float>(), x.stride(0), k, n, scales, groups.scales,
                    groups.mins, groups.x_sums,
                    bias ? bias->data_ptr<float>() : nullptr,
                    residual ? residual->data_ptr<float>() : nullptr,
                    residual ? residual->stride(0) : 0, out.data_ptr<float>(), n};
  const auto* weights = reinterpret_cast<const typename W::Elem*>(packed.data_ptr());
  const int64_t panel_size = packed.size(1) * kPanel;  // elements
  bool widen = false;
  if constexpr (kInt8<W>) widen = m >= kWidenFromRows;
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(widen ? k * kPanel : 0);
    int64_t p = begin;
    if constexpr (!std::is_same_v<W, Int4Weights>) {
      // One or two rows: kFewRowsSlots / m panels at a time (see panel_kernel).
      if (m <= 2) {
        const int64_t group = kFewRowsSlots / m;
        for (; p + group <= end; p += group) {
          const auto* panel = weights + p * panel_size;
          const auto* next = p + 2 * group <= end ? panel + group * panel_size : nullptr;
          if (m == 1) {
            rows_times_panels<W, 1, kFewRowsSlots>(op, panel, panel_size, next, p);
          } else {
            rows_times_panels<W, 2, kFewRowsSlots / 2>(op, panel, panel_size, next, p);
          }
        }
      }
    }
    for (; p < end; ++p) {
      const auto* panel = weights + p * panel_size;
      const auto* next = p + 1 < end ? panel + panel_size : nullptr;
      if constexpr (kInt8<W>) {
        if (widen) {
          widen_panel<W>(op, panel, p, next, widened.data());
          panel_times_rows<F32Weights>(op, m, widened.data(), nullptr, p);
          continue;
        }
      }
      // float32 and int8 in chunks of rows, int4 too (never widened: see above)
      panel_times_rows<W>(op, m, panel, next, p);
    }
  });
  return out;
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& residual) {
  return linear<F32Weights>(x, packed, nullptr, {}, out_features, bias, residual,
                            at::kFloat, "f32_pack_weight");
}

at::Tensor int8_f32_linear(const at::Tensor& x, const at::Tensor& packed,
                           const at::Tensor& scales, int64_t out_features,
                           const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == out_features && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat,
              "scales must be [out_features] float32");
  return linear<Int8Weights>(x, packed, scales.data_ptr<float>(), {}, out_features, bias,
                             residual, at::kChar, "int8_f32_pack_weight");
}

// The checks of a grouped kind's x's shape (K a multiple of W::kGroup; linear checks the
// rest) and of its per-group tensors ``params``, each [panels, K / kGroup, kPanel]
// float32 (``names`` says which).
template <typename W>
void check_groups(const at::Tensor& x, std::initializer_list<const at::Tensor*> params,
                  int64_t out_features, const char* names) {
  tokenmill::check_group_params(x, params, W::kGroup, panels_for(out_features), kPanel, names);
}

// int8_group_f32_linear in groups of GROUP inputs.
template <int64_t GROUP>
at::Tensor int8_groups_f32_linear(const at::Tensor& x, const at::Tensor& packed,
                                  const at::Tensor& scales, int64_t out_features,
                                  const std::optional<at::Tensor>& bias,
                                  const std::optional<at::Tensor>& residual) {
  using W = Int8GroupWeights<GROUP>;
  check_groups<W>(x, {&scales}, out_features, "scales");
  return linear<W>(x, packed, nullptr, {scales.data_ptr<float>()}, out_features, bias,
                   residual, at::kChar, "int8_f32_pack_weight");
}

// packed: int8_f32_pack_weight's; scales [panels, K / group, 16] float32 (output 16 p + o
// of panel p at [p, group, o]), a group of 16 or 32 inputs (tokenmill::int8_group_size).
at::Tensor int8_group_f32_linear(const at::Tensor& x, const at::Tensor& packed,
                                 const at::Tensor& scales, int64_t out_features,
                                 const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& residual) {
  if (tokenmill::int8_group_size(x, scales) == 16) {
    return int8_groups_f32_linear<16>(x, packed, scales, out_features, bias, residual);
  }
  return int8_groups_f32_linear<32>(x, packed, scales, out_features, bias, residual);
}

// packed [panels, K / 2, 16] uint8 as Int4Weights describes; scales and mins
// [panels, K / 32, 16] float32 (output 16 p + o of panel p at [p, group, o]).
at::Tensor int4_f32_linear(const at::Tensor& x, const at::Tensor& packed,
                           const at::Tensor& scales, const at::Tensor& mins,
                           int64_t out_features, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& residual) {
  constexpr int64_t kGroup = Int4Weights::kGroup;
  check_groups<Int4Weights>(x, {&scales, &mins}, out_features, "scales and mins");
  // each row's sum of x over each group, for the minimums
  const int64_t m = x.size(0), groups = x.size(1) / kGroup;
  at::Tensor x_sums;
  if (x.scalar_type() == at::kFloat) {
    x_sums = x.reshape({m, groups, kGroup}).sum(-1).contiguous();
  }
  return linear<Int4Weights>(
      x, packed, nullptr,
      {scales.data_ptr<float>(), mins.data_ptr<float>(),
       x_sums.defined() ? x_sums.data_ptr<float>() : nullptr},
      out_features, bias, residual, at::kByte,
      "tokenmill's int4 packing (native_weights.NativeInt4Weight)");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("f32_pack_weight(Tensor weight) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor packed, int out_features, Tensor? bias, "
        "Tensor? residual) -> Tensor");
  m.def("int8_f32_pack_weight(Tensor weight) -> Tensor");
  m.def("int8_f32_linear(Tensor x, Tensor packed, Tensor scales, int out_features, "
        "Tensor? bias, Tensor? residual) -> Tensor");
  m.def("int8_group_f32_linear(Tensor x, Tensor packed, Tensor scales, int out_features, "
        "Tensor? bias, Tensor? residual) -> Tensor");
  m.def("int4_f32_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, "
        "int out_features, Tensor? bias, Tensor? residual) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("f32_pack_weight", &f32_pack_weight);
  m.impl("f32_linear", &f32_linear);
  m.impl("int8_f32_pack_weight", &int8_f32_pack_weight);
  m.impl("int8_f32_linear", &int8_f32_linear);
  m.impl("int8_group_f32_linear", &int8_group_f32_linear);
  m.impl("int4_f32_linear", &int4_f32_linear);
}

#endif  // AVX2 + FMA
