// Linear layers with bfloat16 activations on AVX512-BF16, over weights in bfloat16, in
// int8 with one float32 scale per output row or per 16 or 32 inputs of a row, or in 4 bits
// with a float32 scale and minimum per 32 inputs of a row:
//
//   bf16_pack_weight(w [N, K] bfloat16)                   -> packed (the layout below)
//   bf16_linear(x [M, K], packed, N, bias?, residual?, gated=False)
//                                                         -> x @ w.T (+ bias) (+ residual)
//   int8_pack_weight(q [N, K] int8)                       -> packed (the same layout)
//   int8_linear(x [M, K], packed, scales [N], N, bias?, residual?)
//                                                         -> (x @ q.T) * scales (+ ...)
//   int8_group_linear(x [M, K], packed, scales, N, bias?, residual?)
//                                   -> x @ (q * scale).T (+ ...)   (see Int8GroupWeights)
//   int4_linear(x [M, K], packed, scales, mins, N, bias?, residual?)
//                                   -> x @ (q * scale + min).T (+ ...)   (see Int4Weights)
//
// At a decode step's batch sizes (M up to a few dozen rows) a linear layer is bound by
// reading its weight; this kernel reads each weight element from memory once per call
// and multiplies it into every row while it sits in a register (int8 and int4 weights:
// a half and a quarter of the bytes, widened to bfloat16 in registers, exactly). At a
// prefill's sizes it is bound by arithmetic, which runs near the VDPBF16PS peak.
//
// Packed layout: outputs in panels of 32 (two 16-lane registers), each panel contiguous
// over K in pairs, the operand layout of VDPBF16PS:
//
//   packed[p][kp][half][lane][j] = w[32 p + 16 half + lane][2 kp + j]    (j in {0, 1})
//
// K is padded to even and N to a multiple of 32 with zeros. Arithmetic: the products of
// bfloat16 pairs are exact in float32 and summed in float32 (VDPBF16PS); the scale, bias
// and residual are applied in float32 and the result is rounded once to bfloat16 (round to
// nearest even).
//
// Threads split the panels; each streams its panels in order, and while it multiplies
// one it requests the next into cache, so memory keeps streaming during the arithmetic.
// Rows go through in chunks of at most W::kMaxRows (a register tile of that many rows x 32
// float32 accumulators); the second and later chunks find the panel in cache. A grouped
// kind's panel (int8 in groups, int4) is widened to bfloat16 once per call into a thread's
// scratch when there is more than one chunk, and the chunks read that (see Widened).
//
// Gated (bf16_linear's gated=True, no bias or residual, N a multiple of 32): each panel's
// two halves are 16 gate outputs and the same 16 up outputs of a gated MLP (the rows of its
// gate/up weight interleaved in blocks of 16, linear.interleave_gate_up), and the call
// returns silu(gate) * up [M, N / 2] from the float32 sums, rounded once: the SiLU gate in
// the epilogue, no [M, N] product in memory. Gated calls multiply without AMX tiles.
//
// Built only for CPUs with AVX512-BF16 (the compiler targets the host): elsewhere these ops
// do not exist and the weights take PyTorch's kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx_tiles.h"
#include "avx512_lanes.h"
#include "dtype_conversion.h"
#include "linear_epilogue.h"
#include "thread_batches.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <type_traits>
#include <utility>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

using tokenmill::first_lanes;
using tokenmill::load_bf16;
using tokenmill::round_to_bf16;

constexpr int64_t kPanel = 32;   // outputs per panel
constexpr int64_t kMaxRows = 12;  // the largest of the weight kinds' kMaxRows (tile arrays)
constexpr int64_t kMaxSharingChunks = 6;

int64_t even(int64_t k) { return (k + 1) / 2 * 2; }
int64_t panels_for(int64_t n) { return (n + kPanel - 1) / kPanel; }

// Weight elements of one kind: how a pair record (32 outputs x 2 inputs) is stored, and
// read into two VDPBF16PS operands (outputs 0-15 and 16-31 of the panel). A grouped kind
// (kGroup > 0) has float32 numbers per kGroup inputs of each output, which the panels
// apply to each group's sums (group_panel_kernel); the others have kGroup 0.
struct BF16Weights {
  using Elem = uint16_t;
  // Rows per micro-kernel call: 2 x 8 accumulators. With 12, each row's input pointer
  // leaves GCC too few general registers, and its moves of pointers between vector and
  // general registers in the inner loop take product slots: 5-8% slower on Zen 4.
  static constexpr int kMaxRows = 8;
  static constexpr int64_t kRecord = 64;  // elements per pair record
  static constexpr int kLines = 2;  // cache lines per record
  static constexpr int64_t kPackedDims = 5;  // [panels, K / 2, 2, 16, 2]
  static constexpr int64_t kGroup = 0;
  static inline void load(const Elem* record, __m512bh& w0, __m512bh& w1) {
    w0 = (__m512bh)_mm512_loadu_si512(record);
    w1 = (__m512bh)_mm512_loadu_si512(record + 32);
  }
};

struct Int8Weights {
  using Elem = int8_t;
  static constexpr int kMaxRows = 12;
  static constexpr int64_t kRecord = 64;
  static constexpr int kLines = 1;
  static constexpr int64_t kPackedDims = 5;
  static constexpr int64_t kGroup = 0;
  // 16 int8 (8 lanes' pairs) -> float32, exact
  static inline __m512 widen(const Elem* src) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
  }
  // |q| <= 127 is exact in bfloat16
  static inline void load(const Elem* record, __m512bh& w0, __m512bh& w1) {
    w0 = _mm512_cvtne2ps_pbh(widen(record + 16), widen(record));
    w1 = _mm512_cvtne2ps_pbh(widen(record + 48), widen(record + 32));
  }
};

// int8 weights in groups of GROUP (16 or 32) inputs, each (output, group) with a float32
// scale: w = q * scale (a GGUF Q8_0 block of 32: its float16 d widened; a Q6_K sub-block
// of 16: d times its int8 sub-scale). Stored as Int8Weights (int8_pack_weight). The
// products run on q (exact in bfloat16) and each group's float32 sum is scaled:
// sum_k x_k w_k = scale * sum_k x_k q_k.
template <int64_t GROUP>
struct Int8GroupWeights : Int8Weights {
  static_assert(GROUP % 2 == 0, "a group is whole pair records");
  static constexpr int kMaxRows = 6;  // 2 x 6 group sums + 2 x 6 totals in registers
  static constexpr int64_t kGroup = GROUP;
  static constexpr bool kMins = false;
};

// 4-bit weights in groups of kGroup inputs, each (output, group) with a float32 scale and
// minimum: w = q * scale + min, q in 0..15. A record holds its 64 values in 32 bytes,
// byte (half, lane) = q[2 kp] | q[2 kp + 1] << 4; packed by the caller (int4_linear).
// The products run on q (exact in bfloat16) and each group's sum is scaled and shifted:
// sum_k x_k w_k = scale * sum_k x_k q_k + min * sum_k x_k.
struct Int4Weights {
  using Elem = uint8_t;
  static constexpr int kMaxRows = 6;  // 2 x 6 group sums + 2 x 6 totals in registers
  static constexpr int64_t kRecord = 32;
  static constexpr int kLines = 1;
  static constexpr int64_t kPackedDims = 4;  // [panels, K / 2, 2, 16]
  static constexpr int64_t kGroup = 32;
  static constexpr bool kMins = true;
  static inline void load(const Elem* record, __m512bh& w0, __m512bh& w1) {
    // bfloat16 bits of 0.0 .. 15.0, looked up by each 16-bit index
    const __m512i table = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150, 0x4140,
        0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000,
        0x3f80, 0x0000);
    __m512bh* out[2] = {&w0, &w1};
    for (int h = 0; h < 2; ++h) {
      const __m512i bytes = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 16 * h)));
      // 16-bit indexes: low half the low nibble (input 2 kp), high half the high one
      const __m512i index = _mm512_or_si512(
          _mm512_and_si512(bytes, _mm512_set1_epi32(0xf)),
          _mm512_slli_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(0xf0)), 12));
      *out[h] = (__m512bh)_mm512_permutexvar_epi16(index, table);
    }
  }
};

// A grouped kind W's panel widened to bfloat16 (int8 and 4-bit q are exact in bfloat16),
// in BF16Weights' record layout: when a call has more rows than one chunk, each panel is
// widened once into a thread's scratch and the chunks read that, rather than widening
// it again in registers for each chunk. The same q in the same VDPBF16PS operands, and
// the same groups, scales and minimums: every row's arithmetic is unchanged.
template <typename W>
struct Widened : BF16Weights {
  static constexpr int kMaxRows = W::kMaxRows;
  static constexpr int64_t kGroup = W::kGroup;
  static constexpr bool kMins = W::kMins;
};

// The weights a pass over a panel of kind W requests ahead (see Ahead): W's own, except
// that a widened panel's passes request the next panel of the packed weight.
template <typename W>
struct Source {
  using type = W;
};
template <typename W>
struct Source<Widened<W>> {
  using type = W;
};

template <typename W>
at::Tensor pack_weight(const at::Tensor& weight) {
  const int64_t n = weight.size(0), k = weight.size(1), kp = even(k) / 2;
  const int64_t panels = panels_for(n);
  at::Tensor w = weight.contiguous();
  at::Tensor packed = at::zeros({panels, kp, 2, 16, 2}, weight.options());
  const auto* src = reinterpret_cast<const typename W::Elem*>(w.data_ptr());
  auto* dst = reinterpret_cast<typename W::Elem*>(packed.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t o = 0; o < kPanel && p * kPanel + o < n; ++o) {
        const auto* row = src + (p * kPanel + o) * k;
        auto* col = dst + p * kp * 64 + (o / 16) * 32 + (o % 16) * 2;
        for (int64_t i = 0; i < k; ++i) col[(i / 2) * 64 + (i % 2)] = row[i];
      }
    }
  });
  return packed;
}

at::Tensor bf16_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight must be [N, K] bfloat16");
  return pack_weight<BF16Weights>(weight);
}

at::Tensor int8_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar,
              "weight must be [N, K] int8");
  return pack_weight<Int8Weights>(weight);
}

// The next panel to request into cache meanwhile: ``Ahead{next, pass, passes}`` requests
// every ``passes``-th pair record of it, from the ``pass``-th on, so that the passes over
// one panel together request the whole next one and memory streams all along.
template <typename W>
struct Ahead {
  const typename Source<W>::type::Elem* panel;  // null: none
  int64_t pass, passes;
};

// The two bfloat16 inputs at src as one int32 (a full pair), or an odd K's last input
// with a zero. (Types, not functions, so that the calls inline.)
struct ReadPair {
  int32_t operator()(const uint16_t* src) const {
    int32_t pair;
    std::memcpy(&pair, src, sizeof(pair));
    return pair;
  }
};
struct ReadLast {
  int32_t operator()(const uint16_t* src) const { return static_cast<int32_t>(*src); }
};

// acc[r][h] += (x[r][i], x[r][i + 1]) . the panel's pair record ``record``, for every row r;
// ``read`` (ReadPair or ReadLast) reads a row's inputs at x[r] + i.
template <typename W, int ROWS, typename Read>
inline void multiply_pair(const uint16_t* x, int64_t x_stride, int64_t i,
                          const typename W::Elem* record, __m512 (&acc)[kMaxRows][2],
                          Read read) {
  __m512bh w0, w1;
  W::load(record, w0, w1);
#pragma GCC unroll 12
  for (int r = 0; r < ROWS; ++r) {
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(read(x + r * x_stride + i));
    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
  }
}

// acc[r][h] += rows x[0 .. ROWS) times the panel's pair records [begin, end) (full pairs).
// ``turn``: where the requests for the next panel stand (see Ahead), carried from one call
// to the next over the same panel.
template <typename W, int ROWS>
inline void multiply_pairs(const uint16_t* x, int64_t x_stride, int64_t begin, int64_t end,
                           const typename W::Elem* panel, Ahead<W> ahead, int64_t& turn,
                           __m512 (&acc)[kMaxRows][2]) {
  for (int64_t kp = begin; kp < end; ++kp, ++turn) {
    if (turn == ahead.passes) turn = 0;
    if (ahead.panel && turn == 0) {
      using S = typename Source<W>::type;
      const char* record = reinterpret_cast<const char*>(ahead.panel + kp * S::kRecord);
      for (int line = 0; line < S::kLines; ++line) {
        _mm_prefetch(record + 64 * line, _MM_HINT_T1);
      }
    }
    multiply_pair<W, ROWS>(x, x_stride, 2 * kp, panel + kp * W::kRecord, acc, ReadPair{});
  }
}

// Rows x[0 .. ROWS) (k inputs each) times one panel of an ungrouped kind: acc[r][h] lanes
// are the outputs 32 p + 16 h + lane of row r.
template <typename W, int ROWS>
inline void panel_kernel(const uint16_t* x, int64_t x_stride, int64_t k,
                         const typename W::Elem* panel, Ahead<W> ahead,
                         __m512 (&acc)[kMaxRows][2]) {
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;  // full pairs; an odd K's last input pairs with a zero
  int64_t turn = ahead.pass;
  multiply_pairs<W, ROWS>(x, x_stride, 0, pairs, panel, ahead, turn, acc);
  if (k % 2) {
    multiply_pair<W, ROWS>(x, x_stride, k - 1, panel + pairs * W::kRecord, acc, ReadLast{});
  }
}

// What one call computes besides the panels: the rows, the output's extras, where it goes.
struct Operands {
  const uint16_t* x;
  int64_t x_stride, k, n;
  const float* scales;  // per output, or null (1)
  // grouped kinds only: [panels, groups, 32] scales, and for int4 also minimums and
  // [M, groups] sums of x per group
  const float* group_scales;
  const float* group_mins;
  const float* x_sums;
  const uint16_t* bias;  // per output, or null
  const uint16_t* residual;  // [M, n], or null
  int64_t res_stride;
  uint16_t* out;
  int64_t out_stride;
  bool gated;  // panel halves are gate and up outputs: out[:, 16 p ..] = silu(gate) * up
};

// A grouped kind's pass over a panel, group by group: each group's sums of x q go into
// part, then into acc scaled by the group's scale (and for int4 plus its minimum times the
// group's sum of x). Rows [row, row + ROWS) of the call; acc as panel_kernel's.
template <typename W, int ROWS>
inline void group_panel_kernel(const Operands& op, int64_t row, const typename W::Elem* panel,
                               Ahead<W> ahead, int64_t p, __m512 (&acc)[kMaxRows][2]) {
  constexpr int64_t kGroupPairs = W::kGroup / 2;
  const int64_t groups = op.k / W::kGroup;
  const float* scales = op.group_scales + p * groups * kPanel;
  const uint16_t* x = op.x + row * op.x_stride;
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  int64_t turn = ahead.pass;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[kMaxRows][2];
    for (int r = 0; r < ROWS; ++r) part[r][0] = part[r][1] = _mm512_setzero_ps();
    multiply_pairs<W, ROWS>(x, op.x_stride, g * kGroupPairs, (g + 1) * kGroupPairs, panel,
                            ahead, turn, part);
    for (int h = 0; h < 2; ++h) {
      const __m512 scale = _mm512_loadu_ps(scales + g * kPanel + 16 * h);
      for (int r = 0; r < ROWS; ++r) {
        acc[r][h] = _mm512_fmadd_ps(part[r][h], scale, acc[r][h]);
      }
      if constexpr (W::kMins) {
        const __m512 min = _mm512_loadu_ps(op.group_mins + (p * groups + g) * kPanel + 16 * h);
        for (int r = 0; r < ROWS; ++r) {
          acc[r][h] = _mm512_fmadd_ps(_mm512_set1_ps(op.x_sums[(row + r) * groups + g]), min,
                                      acc[r][h]);
        }
      }
    }
  }
}

// Where the results for outputs 32 p + 16 h .. + 16 go: a row's float32 sums of products
// times the per-output scale, plus bias and residual, rounded once to bfloat16.
class HalfPanelOutput {
 public:
  HalfPanelOutput(const Operands& op, int64_t p, int h) : op_(op), col_(p * kPanel + 16 * h) {
    if (empty()) return;
    const int64_t width = std::min<int64_t>(16, op.n - col_);
    mask_ = first_lanes(width);
    scale_ = op.scales ? _mm512_maskz_loadu_ps(mask_, op.scales + col_) : _mm512_set1_ps(1.f);
    bias_ = op.bias ? load_bf16(op.bias + col_, mask_) : _mm512_setzero_ps();
  }
  // the panel has no outputs here (the last panel's second half, N not filling it)
  bool empty() const { return col_ >= op_.n; }
  void store(int64_t row, __m512 sums) const {
    __m512 v = _mm512_fmadd_ps(sums, scale_, bias_);
    if (op_.residual) {
      v = _mm512_add_ps(v, load_bf16(op_.residual + row * op_.res_stride + col_, mask_));
    }
    _mm256_mask_storeu_epi16(op_.out + row * op_.out_stride + col_, mask_, round_to_bf16(v));
  }

 private:
  const Operands& op_;
  int64_t col_;
  __mmask16 mask_ = 0;
  __m512 scale_, bias_;
};

// A gated call's outputs 16 p .. 16 p + 15 of row ``row``: silu(gate) * up of the panel's
// float32 sums (each times its per-output scale, for int8), rounded once to bfloat16.
inline void store_gated(const Operands& op, int64_t row, int64_t p, __m512 gate, __m512 up) {
  if (op.scales) {
    gate = _mm512_mul_ps(gate, _mm512_loadu_ps(op.scales + p * kPanel));
    up = _mm512_mul_ps(up, _mm512_loadu_ps(op.scales + p * kPanel + 16));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(op.out + row * op.out_stride + 16 * p),
                      round_to_bf16(tokenmill::silu_times(gate, up)));
}

// Rows [row, row + ROWS) of the call times panel p.
template <typename W, int ROWS>
void rows_times_panel(const Operands& op, int64_t row, const typename W::Elem* panel,
                      Ahead<W> ahead, int64_t p) {
  __m512 acc[kMaxRows][2];
  if constexpr (W::kGroup > 0) {
    group_panel_kernel<W, ROWS>(op, row, panel, ahead, p, acc);
  } else {
    panel_kernel<W, ROWS>(op.x + row * op.x_stride, op.x_stride, op.k, panel, ahead, acc);
  }
  if (op.gated) {
    for (int r = 0; r < ROWS; ++r) store_gated(op, row + r, p, acc[r][0], acc[r][1]);
    return;
  }
  for (int h = 0; h < 2; ++h) {
    const HalfPanelOutput out(op, p, h);
    if (out.empty()) break;
    for (int r = 0; r < ROWS; ++r) out.store(row + r, acc[r][h]);
  }
}

template <typename W>
using RowsFn = void (*)(const Operands&, int64_t, const typename W::Elem*, Ahead<W>, int64_t);

template <typename W, int... R>
constexpr auto make_table(std::integer_sequence<int, R...>) {
  return std::array<RowsFn<W>, sizeof...(R)>{&rows_times_panel<W, R + 1>...};
}
template <typename W>
constexpr auto kRowsFns = make_table<W>(std::make_integer_sequence<int, W::kMaxRows>{});

// A grouped kind's panel (``pairs`` pair records) widened into ``scratch`` (Widened<W>).
template <typename W>
void widen_panel(const typename W::Elem* panel, int64_t pairs, uint16_t* scratch) {
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512bh w0, w1;
    W::load(panel + kp * W::kRecord, w0, w1);
    _mm512_store_si512(scratch + kp * BF16Weights::kRecord, (__m512i)w0);
    _mm512_store_si512(scratch + kp * BF16Weights::kRecord + 32, (__m512i)w1);
  }
}

// The chunks of rows [0, m) times one panel (``panel``, of kind W), requesting ``next``.
template <typename W>
void chunks_times_panel(const Operands& op, int64_t m, int64_t chunks,
                        const typename W::Elem* panel,
                        const typename Source<W>::type::Elem* next, int64_t p) {
  for (int64_t c = 0, row = 0; c < chunks; ++c) {
    const int64_t rows = (m - row) / (chunks - c);
    // A few chunks share the requests for the next panel; with many (a prefill), the
    // second alone makes them: spreading them thinner measured slower.
    const Ahead<W> ahead = chunks <= kMaxSharingChunks
                               ? Ahead<W>{next, c, chunks}
                               : Ahead<W>{c == 1 ? next : nullptr, 0, 1};
    kRowsFns<W>[rows - 1](op, row, panel, ahead, p);
    row += rows;
  }
}

#ifdef TOKENMILL_AMX
// On a CPU with AMX-BF16 (and the process granted its tiles) the panels are multiplied on
// tiles, at every row count, so each row's result still does not depend on the call's
// other rows. A row tile is up to 16 rows; a panel half (16 outputs) is one tile's width.
// Weights are a bfloat16 panel in BF16Weights' record layout (a grouped kind's or int8's
// panel widened first, as Widened): the half h of pair records [kp, kp + n) is a B tile of
// n rows at a stride of one record (128 bytes). Tiles: 0, 1, 5 and 6 float32 products
// (several, so that one product runs while another is read out), 2 and 7 rows' inputs, 3
// and 4 the two halves' weights.
//
// TDPBF16PS sums the exact products of bfloat16 pairs in float32 (in its own order, not
// VDPBF16PS's: the results are not bit-identical to the AVX-512 path's, and within the
// same bound). A grouped kind multiplies one group per tile product and scales its sums in
// float32 as group_panel_kernel does; the ungrouped kinds accumulate 32 inputs per product.
constexpr int kTileRows = 16;
constexpr int64_t kUngroupedDepth = 32;  // inputs per tile product of an ungrouped kind

template <typename W>
constexpr int64_t tile_depth() {
  return W::kGroup > 0 ? W::kGroup : kUngroupedDepth;
}

// Requests [start, start + bytes) into the cache level HINT.
template <_mm_hint HINT>
inline void request_lines(const void* start, int64_t bytes) {
  const char* line = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(line + offset, HINT);
}

// How far ahead the few-rows tile paths request weights, in groups or tile products: the
// tiles keep fewer of the weights' loads in flight than the AVX-512 path does, and without
// the requests a stream of weights from memory reads at about 60% of that path's speed.
constexpr int64_t kAheadGroups = 4;

// Whether the tiles take this call: AMX granted, and K whole tile products.
template <typename W>
bool tiles_take(int64_t k) {
  return tokenmill::amx_permitted() && k % tile_depth<W>() == 0;
}

void configure_tiles(int rows, int64_t depth) {
  tokenmill::TileConfig config;
  for (int product : {0, 1, 5, 6}) config.set(product, rows, 64);
  config.set(2, rows, static_cast<int>(2 * depth));
  config.set(3, static_cast<int>(depth / 2), 64);
  config.set(4, static_cast<int>(depth / 2), 64);
  config.set(7, rows, static_cast<int>(2 * depth));
  config.load();
}

// Tile 0 (``second``: tile 1) = the row tile's inputs [2 kp, 2 kp + depth) times half h
// of the panel's records. (The tile intrinsics take tile numbers as literals.)
inline void tile_product(bool second, const uint16_t* x, int64_t x_stride,
                         const uint16_t* panel, int64_t kp, int h) {
  _tile_loadd(2, x + 2 * kp, x_stride * 2);
  _tile_loadd(3, panel + kp * BF16Weights::kRecord + 32 * h, 2 * BF16Weights::kRecord);
  if (second) {
    _tile_zero(1);
    _tile_dpbf16ps(1, 2, 3);
  } else {
    _tile_zero(0);
    _tile_dpbf16ps(0, 2, 3);
  }
}

// A grouped kind: rows [row, row + rows) times half h of panel p, group by group, each
// group's products read out of its tile, scaled (and for int4 shifted by its minimum times
// the group's sum of x) into float32 sums in registers.
template <typename W>
void group_tiles_times_half(const Operands& op, int64_t row, int rows, const uint16_t* panel,
                            int64_t p, int h, const HalfPanelOutput& out) {
  constexpr int64_t kGroupPairs = W::kGroup / 2;
  const int64_t groups = op.k / W::kGroup;
  const float* scales = op.group_scales + p * groups * kPanel + 16 * h;
  const uint16_t* x = op.x + row * op.x_stride;
  alignas(64) float part[kTileRows][16];
  __m512 acc[kTileRows];
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
  // acc += group g's products (read out of ``part``)
  const auto add_group = [&](int64_t g) {
    const __m512 scale = _mm512_loadu_ps(scales + g * kPanel);
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
      if (r < rows) acc[r] = _mm512_fmadd_ps(_mm512_load_ps(part[r]), scale, acc[r]);
    }
    if constexpr (W::kMins) {
      const __m512 min = _mm512_loadu_ps(op.group_mins + (p * groups + g) * kPanel + 16 * h);
#pragma GCC unroll 16
      for (int r = 0; r < kTileRows; ++r) {
        if (r < rows) {
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(op.x_sums[(row + r) * groups + g]), min,
                                   acc[r]);
        }
      }
    }
  };
  for (int64_t g = 0; g < groups; ++g) {
    if (g % 2 == 0) {
      tile_product(false, x, op.x_stride, panel, g * kGroupPairs, h);
      if (g > 0) {
        _tile_stored(1, part, 64);
        add_group(g - 1);
      }
    } else {
      tile_product(true, x, op.x_stride, panel, g * kGroupPairs, h);
      _tile_stored(0, part, 64);
      add_group(g - 1);
    }
  }
  if (groups % 2) {
    _tile_stored(0, part, 64);
  } else {
    _tile_stored(1, part, 64);
  }
  add_group(groups - 1);
  for (int r = 0; r < rows; ++r) out.store(row + r, acc[r]);
}

// Rows in a call that takes group_tiles_times_panel (two halves' sums in registers).
constexpr int kFewRows = 8;

// A grouped kind, a call of at most kFewRows rows: rows [row, row + rows) times both halves
// of the packed panel p, each group widened just before its products into one of the two
// slots of ``ring`` (in the first-level cache, where a whole widened panel would not be).
// Per output, the same tile products and float32 steps as group_tiles_times_half. Tiles:
// group g's products in 0 and 1 (halves 0 and 1) for even g, in 5 and 6 for odd g. A
// group's stored products are read two groups later: a load right after a tile store waits
// for the store to retire, which would hold back the loads of the weights behind it.
// ``followed``: the thread's next panel follows this one (requests ahead run into it).
template <typename W>
void group_tiles_times_panel(const Operands& op, int64_t row, int rows,
                             const typename W::Elem* packed, bool followed, int64_t p,
                             uint16_t* ring) {
  constexpr int64_t kGroupPairs = W::kGroup / 2;
  constexpr int64_t kStride = 2 * BF16Weights::kRecord;
  const int64_t groups = op.k / W::kGroup;
  const float* scales = op.group_scales + p * groups * kPanel;
  const uint16_t* x = op.x + row * op.x_stride;
  alignas(64) float part[2][2][kTileRows][16];  // [group % 2][half]
  __m512 acc[2][kFewRows];
#pragma GCC unroll 8
  for (int r = 0; r < kFewRows; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
  const auto add_group = [&](int64_t g) {
    for (int h = 0; h < 2; ++h) {
      const __m512 scale = _mm512_loadu_ps(scales + g * kPanel + 16 * h);
#pragma GCC unroll 8
      for (int r = 0; r < kFewRows; ++r) {
        if (r < rows) {
          acc[h][r] = _mm512_fmadd_ps(_mm512_load_ps(part[g % 2][h][r]), scale, acc[h][r]);
        }
      }
      if constexpr (W::kMins) {
        const __m512 min = _mm512_loadu_ps(op.group_mins + (p * groups + g) * kPanel + 16 * h);
#pragma GCC unroll 8
        for (int r = 0; r < kFewRows; ++r) {
          if (r < rows) {
            acc[h][r] = _mm512_fmadd_ps(_mm512_set1_ps(op.x_sums[(row + r) * groups + g]), min,
                                        acc[h][r]);
          }
        }
      }
    }
  };
  // group g's products out of their tiles into part[g % 2]
  const auto store_group = [&](int64_t g) {
    if (g % 2 == 0) {
      _tile_stored(0, part[0][0], 64);
      _tile_stored(1, part[0][1], 64);
    } else {
      _tile_stored(5, part[1][0], 64);
      _tile_stored(6, part[1][1], 64);
    }
  };
  for (int64_t g = 0; g < groups; ++g) {
    if (g >= 2) add_group(g - 2);
    uint16_t* slot = ring + (g % 2) * kGroupPairs * BF16Weights::kRecord;
    constexpr int64_t kGroupBytes = kGroupPairs * W::kRecord * sizeof(typename W::Elem);
    // the weights kAheadGroups groups on (the next panel's, past this one's end)
    if (g + kAheadGroups < groups || followed) {
      request_lines<_MM_HINT_T0>(packed + (g + kAheadGroups) * kGroupPairs * W::kRecord,
                                 kGroupBytes);
    }
    widen_panel<W>(packed + g * kGroupPairs * W::kRecord, kGroupPairs, slot);
    _tile_loadd(2, x + g * W::kGroup, op.x_stride * 2);
    _tile_loadd(3, slot, kStride);
    _tile_loadd(4, slot + 32, kStride);
    if (g % 2 == 0) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    } else {
      _tile_zero(5);
      _tile_zero(6);
      _tile_dpbf16ps(5, 2, 3);
      _tile_dpbf16ps(6, 2, 4);
    }
    if (g >= 1) store_group(g - 1);
  }
  store_group(groups - 1);
  if (groups >= 2) add_group(groups - 2);
  add_group(groups - 1);
  for (int h = 0; h < 2; ++h) {
    const HalfPanelOutput out(op, p, h);
    if (out.empty()) break;
    for (int r = 0; r < rows; ++r) out.store(row + r, acc[h][r]);
  }
}

// An ungrouped kind: rows [row, row + rows) times both halves of a panel, 32 inputs per
// tile product, each half's float32 sums accumulating in its own tile. W: BF16Weights
// reads ``panel`` as bfloat16 records (a bfloat16 weight's, or a widened panel); int8
// widens each product's records just before it into one of the two slots of ``ring``.
// ``followed`` as group_tiles_times_panel's.
template <typename W>
void tiles_times_panel(const Operands& op, int64_t row, int rows,
                       const typename W::Elem* panel, bool followed, int64_t p,
                       uint16_t* ring) {
  const uint16_t* x = op.x + row * op.x_stride;
  constexpr int64_t kDepthPairs = kUngroupedDepth / 2;
  constexpr int64_t kStride = 2 * BF16Weights::kRecord;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t kp = 0; kp < op.k / 2; kp += kDepthPairs) {
    constexpr int64_t kChunkBytes = kDepthPairs * W::kRecord * sizeof(typename W::Elem);
    if (followed || kp + kAheadGroups * kDepthPairs < op.k / 2) {
      request_lines<_MM_HINT_T0>(panel + (kp + kAheadGroups * kDepthPairs) * W::kRecord,
                                 kChunkBytes);
    }
    const uint16_t* records;
    if constexpr (std::is_same_v<W, BF16Weights>) {
      records = panel + kp * BF16Weights::kRecord;
    } else {
      uint16_t* slot = ring + (kp / kDepthPairs % 2) * kDepthPairs * BF16Weights::kRecord;
      widen_panel<W>(panel + kp * W::kRecord, kDepthPairs, slot);
      records = slot;
    }
    _tile_loadd(2, x + 2 * kp, op.x_stride * 2);
    _tile_loadd(3, records, kStride);
    _tile_loadd(4, records + 32, kStride);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  alignas(64) float sums[2][kTileRows][16];
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  for (int h = 0; h < 2; ++h) {
    const HalfPanelOutput out(op, p, h);
    if (out.empty()) break;
    for (int r = 0; r < rows; ++r) out.store(row + r, _mm512_load_ps(sums[h][r]));
  }
}

// An ungrouped kind, two full row tiles at once: rows [row, row + 32) times both halves of
// a bfloat16 panel, each weight tile loaded once for both (tiles 0, 1 the first row tile's
// halves, 5, 6 the second's; 2 and 7 their inputs). Each row's products and sums are
// tiles_times_panel's.
void two_tiles_times_panel(const Operands& op, int64_t row, const uint16_t* panel, int64_t p) {
  const uint16_t* x = op.x + row * op.x_stride;
  const uint16_t* x2 = x + kTileRows * op.x_stride;
  constexpr int64_t kDepthPairs = kUngroupedDepth / 2;
  constexpr int64_t kStride = 2 * BF16Weights::kRecord;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(5);
  _tile_zero(6);
  for (int64_t kp = 0; kp < op.k / 2; kp += kDepthPairs) {
    const uint16_t* records = panel + kp * BF16Weights::kRecord;
    _tile_loadd(2, x + 2 * kp, op.x_stride * 2);
    _tile_loadd(7, x2 + 2 * kp, op.x_stride * 2);
    _tile_loadd(3, records, kStride);
    _tile_loadd(4, records + 32, kStride);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
    _tile_dpbf16ps(5, 7, 3);
    _tile_dpbf16ps(6, 7, 4);
  }
  alignas(64) float sums[2][2][kTileRows][16];  // [row tile][half]
  _tile_stored(0, sums[0][0], 64);
  _tile_stored(1, sums[0][1], 64);
  _tile_stored(5, sums[1][0], 64);
  _tile_stored(6, sums[1][1], 64);
  for (int h = 0; h < 2; ++h) {
    const HalfPanelOutput out(op, p, h);
    if (out.empty()) break;
    for (int r = 0; r < 2 * kTileRows; ++r) {
      out.store(row + r, _mm512_load_ps(sums[r / kTileRows][h][r % kTileRows]));
    }
  }
}

// The whole call on tiles (tiles_take): threads split the panels; each widens a panel of a
// kind other than bfloat16 into its scratch, then multiplies every row tile by it.
template <typename W>
void tiles_linear(const Operands& op, int64_t m, const typename W::Elem* weights,
                  int64_t panels, int64_t pairs) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    constexpr bool kWidens = !std::is_same_v<W, BF16Weights>;
    at::Tensor scratch_tensor;
    uint16_t* scratch = nullptr;
    if constexpr (kWidens) {
      scratch_tensor = at::empty({(pairs + 1) * BF16Weights::kRecord},
                                 at::TensorOptions().dtype(at::kShort));
      auto address = reinterpret_cast<uintptr_t>(scratch_tensor.data_ptr());
      scratch = reinterpret_cast<uint16_t*>((address + 63) / 64 * 64);
    }
    int configured_rows = 0;
    if constexpr (kWidens) {
      if (m <= kFewRows) {  // each group or 32 inputs widened just before its products
        configure_tiles(static_cast<int>(m), tile_depth<W>());
        for (int64_t p = begin; p < end; ++p) {
          const typename W::Elem* packed = weights + p * pairs * W::kRecord;
          const bool followed = p + 1 < end;  // the next panel, right after this one
          if constexpr (W::kGroup > 0) {
            group_tiles_times_panel<W>(op, 0, static_cast<int>(m), packed, followed, p,
                                       scratch);
          } else {
            tiles_times_panel<W>(op, 0, static_cast<int>(m), packed, followed, p, scratch);
          }
        }
        _tile_release();
        return;
      }
    }
    for (int64_t p = begin; p < end; ++p) {
      const typename W::Elem* packed = weights + p * pairs * W::kRecord;
      const uint16_t* panel;
      if constexpr (kWidens) {
        widen_panel<W>(packed, pairs, scratch);
        panel = scratch;
      } else {
        panel = packed;
      }
      int64_t row = 0;
      if constexpr (W::kGroup == 0) {
        for (; row + 2 * kTileRows <= m; row += 2 * kTileRows) {
          if (configured_rows != kTileRows) {
            configure_tiles(kTileRows, tile_depth<W>());
            configured_rows = kTileRows;
          }
          two_tiles_times_panel(op, row, panel, p);
        }
      }
      for (; row < m; row += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - row));
        if (rows != configured_rows) {
          configure_tiles(rows, tile_depth<W>());
          configured_rows = rows;
        }
        if constexpr (W::kGroup > 0) {
          for (int h = 0; h < 2; ++h) {
            const HalfPanelOutput out(op, p, h);
            if (out.empty()) break;
            group_tiles_times_half<W>(op, row, rows, panel, p, h, out);
          }
        } else {
          tiles_times_panel<BF16Weights>(op, row, rows, panel, false, p, nullptr);
        }
      }
    }
    if (configured_rows) _tile_release();
  });
}
#endif  // TOKENMILL_AMX

const uint16_t* bits_of(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
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
                  const char* packer, bool gated = false) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be [M, K] bfloat16 with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  TORCH_CHECK(packed.dim() == W::kPackedDims && packed.is_contiguous() &&
                  packed.scalar_type() == weight_type && packed.size(0) == panels_for(n) &&
                  packed.size(1) == even(k) / 2,
              "packed must be ", packer, "'s packing of an [out_features, K] weight");
  tokenmill::check_bias_and_residual(bias, residual, m, n, at::kBFloat16, "bfloat16");
  TORCH_CHECK(!gated || (n % kPanel == 0 && !bias && !residual),
              "a gated call takes out_features a multiple of ", kPanel,
              ", no bias and no residual");
  const int64_t out_n = gated ? n / 2 : n;
  at::Tensor out = at::empty({m, out_n}, x.options());
  if (m == 0) return out;
  const Operands op{bits_of(x), x.stride(0), k, n, scales, groups.scales, groups.mins,
                    groups.x_sums, bias ? bits_of(*bias) : nullptr,
                    residual ? bits_of(*residual) : nullptr,
                    residual ? residual->stride(0) : 0,
                    reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), out_n, gated};
  const auto* weights = reinterpret_cast<const typename W::Elem*>(packed.data_ptr());
#ifdef TOKENMILL_AMX
  if (!gated && tiles_take<W>(k)) {
    tiles_linear<W>(op, m, weights, packed.size(0), packed.size(1));
    return out;
  }
#endif
  const int64_t panel_size = packed.size(1) * W::kRecord;  // elements
  const int64_t chunks = (m + W::kMaxRows - 1) / W::kMaxRows;  // nearly equal sizes
  // grouped kinds with several chunks: each panel widened once (Widened)
  constexpr bool kWidens = W::kGroup > 0;
  const bool widen = kWidens && chunks > 1;
  tokenmill::parallel_batches(packed.size(0), [&](int64_t begin, int64_t end,
                                                  int64_t following) {
    at::Tensor scratch_tensor;
    uint16_t* scratch = nullptr;
    if constexpr (kWidens) {
      if (widen) {
        // 64-byte aligned records: one more record's room to align the start
        scratch_tensor = at::empty({(packed.size(1) + 1) * BF16Weights::kRecord},
                                   at::TensorOptions().dtype(at::kShort));
        auto address = reinterpret_cast<uintptr_t>(scratch_tensor.data_ptr());
        scratch = reinterpret_cast<uint16_t*>((address + 63) / 64 * 64);
      }
    }
    for (int64_t p = begin; p < end; ++p) {
      const auto* panel = weights + p * panel_size;
      const auto* next = p + 1 < end       ? panel + panel_size
                         : following >= 0 ? weights + following * panel_size
                                          : nullptr;
      if constexpr (kWidens) {
        if (widen) {
          widen_panel<W>(panel, packed.size(1), scratch);
          chunks_times_panel<Widened<W>>(op, m, chunks, scratch, next, p);
          continue;
        }
      }
      chunks_times_panel<W>(op, m, chunks, panel, next, p);
    }
  });
  return out;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual, bool gated) {
  return linear<BF16Weights>(x, packed, nullptr, {}, out_features, bias, residual,
                             at::kBFloat16, "bf16_pack_weight", gated);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       int64_t out_features, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == out_features && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat,
              "scales must be [out_features] float32");
  return linear<Int8Weights>(x, packed, scales.data_ptr<float>(), {}, out_features, bias,
                             residual, at::kChar, "int8_pack_weight");
}

// The checks of a grouped kind's x (K a multiple of W::kGroup) and of its per-group
// tensors ``params``, each [panels, K / kGroup, kPanel] float32 (``names`` says which).
template <typename W>
void check_groups(const at::Tensor& x, std::initializer_list<const at::Tensor*> params,
                  int64_t out_features, const char* names) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be [M, K] bfloat16 with contiguous rows");
  tokenmill::check_group_params(x, params, W::kGroup, panels_for(out_features), kPanel, names);
}

// int8_group_linear in groups of GROUP inputs.
template <int64_t GROUP>
at::Tensor int8_groups_linear(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scales, int64_t out_features,
                              const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& residual) {
  using W = Int8GroupWeights<GROUP>;
  check_groups<W>(x, {&scales}, out_features, "scales");
  return linear<W>(x, packed, nullptr, {scales.data_ptr<float>()}, out_features, bias,
                   residual, at::kChar, "int8_pack_weight");
}

// packed: int8_pack_weight's; scales [panels, K / group, 32] float32 (output 32 p + o of
// panel p at [p, group, o]), a group of 16 or 32 inputs (tokenmill::int8_group_size).
at::Tensor int8_group_linear(const at::Tensor& x, const at::Tensor& packed,
                             const at::Tensor& scales, int64_t out_features,
                             const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& residual) {
  if (tokenmill::int8_group_size(x, scales) == 16) {
    return int8_groups_linear<16>(x, packed, scales, out_features, bias, residual);
  }
  return int8_groups_linear<32>(x, packed, scales, out_features, bias, residual);
}

// packed [panels, K / 2, 2, 16] uint8 as Int4Weights describes; scales and mins
// [panels, K / 32, 32] float32 (output 32 p + o of panel p at [p, group, o]).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t out_features,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  constexpr int64_t kGroup = Int4Weights::kGroup;
  check_groups<Int4Weights>(x, {&scales, &mins}, out_features, "scales and mins");
  const int64_t m = x.size(0), groups = x.size(1) / kGroup;
  // each row's sum of x over each group, for the minimums
  at::Tensor x_sums = at::empty({m, groups}, x.options().dtype(at::kFloat));
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  float* sums = x_sums.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const at::BFloat16* src = xp + r * x.stride(0) + g * kGroup;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < kGroup; ++i) sum += tokenmill::to_float(src[i]);
        sums[r * groups + g] = sum;
      }
    }
  });
  return linear<Int4Weights>(x, packed, nullptr,
                             {scales.data_ptr<float>(), mins.data_ptr<float>(), sums},
                             out_features, bias, residual, at::kByte,
                             "tokenmill's int4 packing (native_weights.NativeInt4Weight)");
}

// Whether these kernels multiply on AMX tiles in this process (see tiles_take).
bool bf16_linear_uses_tiles() {
#ifdef TOKENMILL_AMX
  return tokenmill::amx_permitted();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("bf16_linear_uses_tiles() -> bool", &bf16_linear_uses_tiles);
  m.def("bf16_pack_weight(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int out_features, Tensor? bias, "
        "Tensor? residual, bool gated=False) -> Tensor");
  m.def("int8_pack_weight(Tensor weight) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scales, int out_features, Tensor? bias, "
        "Tensor? residual) -> Tensor");
  m.def("int8_group_linear(Tensor x, Tensor packed, Tensor scales, int out_features, "
        "Tensor? bias, Tensor? residual) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, int out_features, "
        "Tensor? bias, Tensor? residual) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("bf16_pack_weight", &bf16_pack_weight);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("int8_pack_weight", &int8_pack_weight);
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_group_linear", &int8_group_linear);
  m.impl("int4_linear", &int4_linear);
}

#endif  // AVX512-BF16
