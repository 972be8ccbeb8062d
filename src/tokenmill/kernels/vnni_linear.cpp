// Linear layers over int8 or 4-bit weights times activations quantized to int8, multiplied
// as integers with AVX512-VNNI's VPDPBUSD (64 byte products summed into 16 int32 lanes per
// instruction, twice the products of one bfloat16 VDPBF16PS):
//
//   vnni_w8a8_linear(x [M, K], packed, scales, N, bias?, residual?, gated=False)
//       -> x~ @ (q * scale).T (+ bias) (+ residual), q int8, a float32 scale per output
//   vnni_w4a8_linear(x [M, K], packed, group_params, N, bias?, residual?, gated=False)
//       -> x~ @ (q * scale + min).T (+ bias) (+ residual), q in 0..15, a float16 scale
//          and minimum per kBlock (32) inputs of an output (GGUF Q4_1's form, in its dtypes)
//   vnni_q4_k_linear(x, packed, params, N, bias?, residual?, gated=False)
//       -> w4a8's product with GGUF Q4_K's parameters: per 32 inputs of an output a 6-bit
//          sc and mn, per super-block of 256 a float16 d and dmin, scale = d * sc and
//          min = -(dmin * mn), both exact in float32 (11 by 6 significant bits)
//   vnni_q8_0_linear(x, packed, params, N, bias?, residual?, gated=False)
//       -> x~ @ (q * d).T (+ bias) (+ residual), q int8, a float16 d per 32 inputs of an
//          output (GGUF Q8_0)
//   vnni_q6_k_linear(x, packed, params, N, bias?, residual?, gated=False)
//       -> x~ @ ((q - 32) * d * sc).T (+ bias) (+ residual), q in 0..63, an int8 sc per 16
//          inputs of an output and a float16 d per super-block of 256 (GGUF Q6_K; d * sc
//          exact in float32)
//
//   vnni_dequantize(kind, packed, params, N, K) -> [N, K] bfloat16
//       -> the dense weight a packed one of kind "q4_k", "q6_k", "q8_0" or "w4a8" holds:
//          each value the kind's own float32 value (q4_k: d * sc * q - dmin * mn; q6_k:
//          d * sc * (q - 32); q8_0: d * q; w4a8: scale * q + min), the GGUF file's
//          dequantization bit for bit, rounded once to bfloat16 (what a prefill's rows
//          multiply on bfloat16 matmuls)
//
// x is bfloat16 or float32, and so are bias, residual and the output. With gated=True (no
// bias or residual, N a multiple of 32) each panel's two halves are 16 gate outputs and the
// same 16 up outputs of a gated MLP (its gate/up rows interleaved in blocks of 16,
// linear.interleave_gate_up) and the call returns silu(gate) * up [M, N / 2] from the
// float32 outputs, rounded once. Activations: each
// row of x is quantized per block of inputs at every call, x~ = d * round(x / d) with d =
// max|x| / 127 over the block (round to nearest even); a block is 32 inputs for w4a8 and
// q4_k (their weights' groups), for q8_0 32 and q6_k 16 (theirs), and for w8a8 64 where K
// is a multiple of 64 (else 32). Then
//
//   w8a8: y[m, n] = scale[n] * (sum over blocks b: d[m, b] * sum (q[n, k] + 128) xq[m, k]
//                               - c[m]),   c[m] = 128 * sum over b: d[m, b] * sum xq[m, k]
//   w4a8: y[m, n] = sum over blocks b: scale[n, b] * (d[m, b] * sum q[n, k] xq[m, k]
//                                                   + e[m, b])
//                                      + min[n, b] * s[m, b]
//         with s and e as w4a8_groups.h defines them: the weights centred on 8, only their
//         centred part sees x rounded (the embedded model's mean KL divergence from
//         float32 0.005, against 0.029 for the same blocks uncentred).
//   q8_0, q6_k: y[m, n] = sum over blocks b: scale[n, b] * (d[m, b] * (sum u[n, k] xq[m, k]
//                                                                 - o * sum xq[m, k]))
//         with u = q + o the stored byte (q8_0: o = 128; q6_k: o = 32, u its q), the
//         difference taken in int32 (exact).
//
// VPDPBUSD multiplies unsigned bytes by signed ones: 4-bit and Q6_K's 6-bit weights are
// unsigned already, int8 weights are stored plus 128 (1..255) and c (w8a8) or the block's
// sum of xq (q8_0) takes the 128s out again. The integer
// sums are exact; the rest is float32 in an order that does not depend on M or on a row's
// neighbours, so a row's output is the same in any batch.
//
// Packed layouts, in panels of kPanel (32) outputs and records of 4 inputs (the 4 bytes of
// a VPDPBUSD lane); native_weights.NativeW8A8Weight, NativeVnniW4A8Weight,
// NativeVnniQ4KWeight, NativeVnniQ8_0Weight and NativeVnniQ6KWeight pack them:
//   w8a8: packed [panels, K / 4, 2, 16, 4] uint8: [p][r][h][o][j] = q[32 p + 16 h + o][4 r + j]
//         + 128 (a record is two 64-byte registers, outputs 0..15 and 16..31);
//         scales [panels * 32] float32.
//   q8_0, q6_k: packed as w8a8's, the bytes u; params [panels, bytes] uint8, per panel
//         q8_0: per block the 32 outputs' d (float16, 64 bytes); q6_k: per super-block
//         the 16 blocks' sc of the 32 outputs (int8, 16 x 32 bytes), then the outputs' d
//         (float16, 64 bytes).
//   w4a8: packed [panels, K / 4, 16, 4] uint8: [p][r][o][j] = q[32 p + o][4 r + j]
//         | q[32 p + 16 + o][4 r + j] << 4 (one register; the nibbles are its two halves);
//         group_params [panels, K / kBlock, 2, 32] float16: per block, the 32 outputs'
//         scales, then their minimums.
//   q4_k: packed as w4a8's; params [panels, bytes] uint8, per panel and super-block the 8
//         blocks' sc of the 32 outputs, then their mn (uint8, 8 x 2 x 32 bytes), then the
//         outputs' d and dmin (float16, 2 x 64 bytes).
//
// Threads split the panels; each streams its panels in order and requests the next one
// (its weights and its parameters) into cache while it multiplies. Rows go
// through in chunks of at most kMaxRows (their int32 and float32 sums in registers); later
// chunks find the panel in cache. With more than one chunk, a 4-bit panel is widened once
// to w8a8's record layout (bytes 0..15, one register per half) in a buffer of its thread,
// and every chunk multiplies that (q4_k's too).
//
// Built for CPUs with AVX512-VNNI (and AVX512-BW); elsewhere these ops do not exist.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "avx512_lanes.h"
#include "linear_epilogue.h"
#include "thread_batches.h"
#include "w4a8_groups.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)

namespace {

using tokenmill::first_lanes;
using tokenmill::load_bf16;
using tokenmill::round_to_bf16;

constexpr int64_t kPanel = 32;  // outputs per panel
// inputs per w4a8 weight scale and minimum and per activation scale (w8a8's where 64 do
// not divide K); every K's multiple
constexpr int64_t kBlock = 32;
constexpr int kMaxRows = 6;  // the largest of the weight kinds' kMaxRows

int64_t panels_for(int64_t n) { return (n + kPanel - 1) / kPanel; }

// The first `count` of 16 float32 values at src (bfloat16 or float32); 0 past them.
inline __m512 load_floats(const uint16_t* src, int64_t count) {
  return load_bf16(src, first_lanes(count));
}
inline __m512 load_floats(const float* src, int64_t count) {
  return _mm512_maskz_loadu_ps(first_lanes(count), src);
}

// v's first `count` lanes to dst, rounded to bfloat16 or as float32.
inline void store_floats(uint16_t* dst, __m512 v, int64_t count) {
  _mm256_mask_storeu_epi16(dst, first_lanes(count), round_to_bf16(v));
}
inline void store_floats(float* dst, __m512 v, int64_t count) {
  _mm512_mask_storeu_ps(dst, first_lanes(count), v);
}

// 16 float16 values at src, or 16 bytes (unsigned, signed), as float32.
inline __m512 halfs(const uint8_t* src) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}
inline __m512 bytes_u8(const uint8_t* src) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
}
inline __m512 bytes_i8(const uint8_t* src) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
}

// Whether v is neither NaN nor an infinity, read off its bits (fast math would fold
// std::isfinite to true).
inline bool finite(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x7f800000u) != 0x7f800000u;
}

// The activations of one call, quantized: xq [M, K] int8; per row and block what the
// weight kind keeps of it, ``Acts`` [M, K / kBlock]; and per row w8a8's c ([M]; w4a8:
// unused).
template <typename Acts>
struct QuantizedRows {
  const int8_t* xq;
  const Acts* acts;
  const float* c;
  int64_t k;
};

// The weight kinds: what a row's block of activations carries (Acts), how a record becomes
// the two registers of 16 outputs x 4 inputs that VPDPBUSD takes, and what a block's int32
// sums add to the float32 ones.
struct W8Acts {
  float d;  // the block's scale: NaN for a NaN or an infinity in it, 0 for zeros
};

// int8 weights, activations rounded per block of BLOCK inputs: w8a8 takes 64 where K is a
// multiple of it (half the blocks' float32 epilogues of 32, which share VPDPBUSD's
// ports), else 32.
template <int64_t BLOCK>
struct W8Blocks {
  static constexpr int64_t kBlock = BLOCK;
  using Acts = W8Acts;
  static constexpr int64_t kRecordBytes = 128;
  static constexpr int kMaxRows = 6;  // 2 int32 and 2 float32 sums a row in registers
  static constexpr bool kPinSums = false;  // GCC keeps them in registers unasked
  static inline void load(const uint8_t* record, __m512i& lo, __m512i& hi) {
    lo = _mm512_loadu_si512(record);
    hi = _mm512_loadu_si512(record + 64);
  }
  static constexpr bool kNibbles = false;
  static constexpr int64_t kParamBytes = 0;  // per block of a panel (the scales: Output)
  struct BlockParams {};
  static inline BlockParams params_of(const uint8_t*, int64_t) { return {}; }
  // acc += sums * d (the weight scale comes last, per output)
  static inline __m512 add_block(__m512 acc, __m512i sums, const Acts& a, const BlockParams&,
                                 int) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(a.d), acc);
  }
};

constexpr int64_t kWideBlock = 64;
using W8 = W8Blocks<kWideBlock>;
using W8Narrow = W8Blocks<kBlock>;

struct W4 {
  static constexpr int64_t kBlock = ::kBlock;
  using Acts = tokenmill::GroupActivations;
  static inline Acts block_acts(float sum, float d, int32_t q_sum) {
    return tokenmill::group_activations(sum, d, static_cast<float>(q_sum));
  }
  static constexpr int64_t kRecordBytes = 64;
  static constexpr int kMaxRows = 4;  // and a block's scales and minimums
  // An empty asm statement after each row's products keeps its sums in registers, taking
  // products one record at a time: without it GCC interleaves a block's records and
  // spills (2x slower). (With the int8 kind it makes GCC spill instead.)
  static constexpr bool kPinSums = true;
  static constexpr bool kNibbles = true;  // widened where more than one chunk of rows
  static constexpr int64_t kParamBytes = 2 * kPanel * 2;
  static inline void load(const uint8_t* record, __m512i& lo, __m512i& hi) {
    const __m512i v = _mm512_loadu_si512(record), nibble = _mm512_set1_epi8(0x0f);
    lo = _mm512_and_si512(v, nibble);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  }
  // Block b's weight scales and minimums, per half of the panel, from its [2, 32] float16.
  struct BlockParams {
    __m512 scale[2], min[2];
  };
  static inline BlockParams params_of(const uint8_t* panel_params, int64_t b) {
    const uint8_t* params = panel_params + b * kParamBytes;
    return {{halfs(params), halfs(params + 32)}, {halfs(params + 64), halfs(params + 96)}};
  }
  // acc += scale * (sums * d + e) + min * s
  static inline __m512 add_block(__m512 acc, __m512i sums, const Acts& a,
                                 const BlockParams& params, int h) {
    const __m512 centred = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(a.d),
                                           _mm512_set1_ps(a.e));
    acc = _mm512_fmadd_ps(centred, params.scale[h], acc);
    return _mm512_fmadd_ps(params.min[h], _mm512_set1_ps(a.s), acc);
  }
};

// W4's sums with Q4_K's parameters: block b's scale d * sc and minimum -(dmin * mn) from
// its super-block's [8, 2, 32] uint8 sc and mn and [2, 32] float16 d and dmin (exact
// products: the float32 values the file's dequantization gives).
struct W4K : W4 {
  static constexpr int64_t kSuper = 8;  // blocks per super-block
  static constexpr int64_t kSuperBytes = kSuper * 2 * kPanel + 2 * kPanel * 2;
  static constexpr int64_t kParamBytes = kSuperBytes / kSuper;
  static inline BlockParams params_of(const uint8_t* panel_params, int64_t b) {
    const uint8_t* super = panel_params + b / kSuper * kSuperBytes;
    const uint8_t* sc = super + b % kSuper * 2 * kPanel;
    const uint8_t* d = super + kSuper * 2 * kPanel;
    const __m512 sign = _mm512_set1_ps(-0.f);
    const auto min = [&](int h) {
      return _mm512_xor_ps(_mm512_mul_ps(halfs(d + 64 + 32 * h), bytes_u8(sc + 32 + 16 * h)),
                           sign);
    };
    const auto scale = [&](int h) {
      return _mm512_mul_ps(halfs(d + 32 * h), bytes_u8(sc + 16 * h));
    };
    return {{scale(0), scale(1)}, {min(0), min(1)}};
  }
};

// A 4-bit panel widened once to W8's record layout (unpack_panel): the same sums and
// epilogue as W, two plain loads a record, more rows at a time.
template <typename W>
struct Widened : W {
  static constexpr int64_t kRecordBytes = W8::kRecordBytes;
  static constexpr int kMaxRows = 6;
  static inline void load(const uint8_t* record, __m512i& lo, __m512i& hi) {
    W8::load(record, lo, hi);
  }
};

// What int8 groups keep of a row's block of activations: its scale and the offset's part
// of the integer sums, o * sum xq.
struct GroupActs {
  float d;  // NaN for a NaN or an infinity in the block, 0 for zeros
  int32_t offset_sum;
};

// Unsigned bytes u = q + OFFSET with a scale per BLOCK inputs of an output, the block of
// activations too: SUPER == 1, the block's float16 d (Q8_0); else a super-block of SUPER
// blocks, per block an int8 sc and per super-block a float16 d, scale d * sc (Q6_K).
template <int64_t BLOCK, int OFFSET, int64_t SUPER>
struct W8Groups {
  static constexpr int64_t kBlock = BLOCK;
  using Acts = GroupActs;
  static constexpr int64_t kRecordBytes = W8::kRecordBytes;
  static constexpr int kMaxRows = 6;
  static constexpr bool kPinSums = false;
  static constexpr bool kNibbles = false;
  static constexpr int64_t kSuperBytes = (SUPER > 1 ? SUPER * kPanel : 0) + kPanel * 2;
  static constexpr int64_t kParamBytes = kSuperBytes / SUPER;
  static_assert(kParamBytes * SUPER == kSuperBytes);
  static inline void load(const uint8_t* record, __m512i& lo, __m512i& hi) {
    W8::load(record, lo, hi);
  }
  static inline Acts block_acts(float, float d, int32_t q_sum) { return {d, OFFSET * q_sum}; }
  struct BlockParams {
    __m512 scale[2];
  };
  static inline BlockParams params_of(const uint8_t* panel_params, int64_t b) {
    const uint8_t* super = panel_params + b / SUPER * kSuperBytes;
    const uint8_t* d = super + (SUPER > 1 ? SUPER * kPanel : 0);
    if constexpr (SUPER == 1) {
      return {{halfs(d), halfs(d + 32)}};
    } else {
      const uint8_t* sc = super + b % SUPER * kPanel;
      return {{_mm512_mul_ps(halfs(d), bytes_i8(sc)),
               _mm512_mul_ps(halfs(d + 32), bytes_i8(sc + 16))}};
    }
  }
  // acc += scale * ((sums - o * sum xq) * d)
  static inline __m512 add_block(__m512 acc, __m512i sums, const Acts& a,
                                 const BlockParams& params, int h) {
    const __m512i centred = _mm512_sub_epi32(sums, _mm512_set1_epi32(a.offset_sum));
    const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(centred), _mm512_set1_ps(a.d));
    return _mm512_fmadd_ps(v, params.scale[h], acc);
  }
};

using Q8_0 = W8Groups<32, 128, 1>;
using Q6K = W8Groups<16, 32, 16>;

// This thread's buffer for a widened panel, at least `bytes` long (grown, never shrunk).
inline uint8_t* widening_buffer(int64_t bytes) {
  thread_local std::vector<uint8_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < bytes) buffer.resize(bytes);
  return buffer.data();
}

// The 4-bit panel at src ([K / 4, 64] bytes) as Widened's records ([K / 4, 128]) at dst.
inline void unpack_panel(const uint8_t* src, int64_t k, uint8_t* dst) {
  for (int64_t r = 0; r < k / 4; ++r) {
    __m512i lo, hi;
    W4::load(src + r * W4::kRecordBytes, lo, hi);
    _mm512_storeu_si512(dst + r * W8::kRecordBytes, lo);
    _mm512_storeu_si512(dst + r * W8::kRecordBytes + 64, hi);
  }
}

// Whether W is the int8 kind (weights stored plus 128, c taking the 128s out).
template <typename W>
constexpr bool kInt8 = std::is_same_v<typename W::Acts, W8Acts>;

// Row r of x, block by block: int8 values into xq, W's Acts per block into `acts` and (W8)
// c into *c (QuantizedRows).
template <typename W, typename T>
void quantize_row(const T* x, int64_t k, int8_t* xq, typename W::Acts* acts, float* c) {
  constexpr int kParts = W::kBlock / 16;
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  float c_sum = 0.f;
  for (int64_t b = 0; b < k / W::kBlock; ++b) {
    __m512 v[kParts];
    __m512 amax16 = _mm512_setzero_ps(), sum16 = _mm512_setzero_ps();
    for (int i = 0; i < kParts; ++i) {
      v[i] = load_floats(x + b * W::kBlock + 16 * i, 16);
      amax16 = _mm512_max_ps(amax16, _mm512_and_ps(v[i], abs_mask));
      sum16 = _mm512_add_ps(sum16, v[i]);
    }
    const float amax = _mm512_reduce_max_ps(amax16);
    const float sum = _mm512_reduce_add_ps(sum16);
    const bool ok = finite(sum);  // a NaN or an infinity in the block makes its sum one
    const __m512 inv = _mm512_set1_ps(ok && amax > 0.f ? 127.f / amax : 0.f);
    // round to nearest even (the default rounding mode), |value| <= 127: no saturation
    __m512i q_sum16 = _mm512_setzero_si512();
    for (int i = 0; i < kParts; ++i) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * W::kBlock + 16 * i),
                       _mm512_cvtepi32_epi8(q));
      q_sum16 = _mm512_add_epi32(q_sum16, q);
    }
    const float d = ok ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
    const int32_t q_sum = _mm512_reduce_add_epi32(q_sum16);
    if constexpr (kInt8<W>) {
      acts[b] = {d};
      c_sum += d * static_cast<float>(q_sum);
    } else {
      acts[b] = W::block_acts(sum, d, q_sum);
    }
  }
  if constexpr (kInt8<W>) *c = 128.f * c_sum;
}

// The panel to request into cache while one is multiplied: bytes [begin, end) of its
// weights and its parameters (w8a8: none), or nulls for none. Each chunk of rows times the
// panel requests its share of the next one's weights, spread over its blocks, so that
// memory streams during all of the panel's arithmetic (not only its first chunk's, which
// asked more of memory than a core gets at 32 rows and more). At a decode's few rows the
// arithmetic is short and a panel's parameters are read from memory as late as its
// weights unless requested too: the first chunk requests them.
struct NextPanel {
  const char* weights;
  const char* params;
  int64_t begin, end;
};

// Rows [row, row + ROWS) of the call times one panel: acc[r][h] = outputs 16 h .. 16 h + 15
// of row r, before the epilogue. params: the panel's parameters (w8a8: null).
template <typename W, int ROWS>
inline void panel_kernel(const QuantizedRows<typename W::Acts>& xr, int64_t row,
                         const uint8_t* panel, const uint8_t* params, NextPanel ahead,
                         __m512 (&acc)[kMaxRows][2]) {
  constexpr int64_t kRecords = W::kBlock / 4;
  constexpr int64_t kBlockBytes = kRecords * W::kRecordBytes;
  const int64_t k = xr.k, blocks = k / W::kBlock;
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int8_t* x = xr.xq + row * k;
  // whole cache lines of the next panel's weights a block requests
  const int64_t span = ((ahead.end - ahead.begin + blocks - 1) / blocks + 63) / 64 * 64;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * kBlockBytes;
    if (ahead.weights) {
      const int64_t end = std::min(ahead.begin + (b + 1) * span, ahead.end);
      for (int64_t line = ahead.begin + b * span; line < end; line += 64) {
        _mm_prefetch(ahead.weights + line, _MM_HINT_T1);
      }
      if (ahead.params) {  // and the lines that hold its parameters of the block
        for (int64_t line = b * W::kParamBytes / 64 * 64; line < (b + 1) * W::kParamBytes;
             line += 64) {
          _mm_prefetch(ahead.params + line, _MM_HINT_T1);
        }
      }
    }
    __m512i sums[kMaxRows][2];
    for (int r = 0; r < ROWS; ++r) sums[r][0] = sums[r][1] = _mm512_setzero_si512();
    // Written out whole: as a loop, GCC copied every sum to another register and back
    // around each record (24 register copies beside w8a8's 12 products a record).
#pragma GCC unroll 16
    for (int64_t i = 0; i < kRecords; ++i) {
      __m512i lo, hi;
      W::load(block + i * W::kRecordBytes, lo, hi);
      const int8_t* xi = x + b * W::kBlock + 4 * i;
      for (int r = 0; r < ROWS; ++r) {
        int32_t four;
        std::memcpy(&four, xi + r * k, sizeof(four));
        const __m512i xb = _mm512_set1_epi32(four);
        sums[r][0] = _mm512_dpbusd_epi32(sums[r][0], lo, xb);
        sums[r][1] = _mm512_dpbusd_epi32(sums[r][1], hi, xb);
        if constexpr (W::kPinSums) __asm__("" : "+v"(sums[r][0]), "+v"(sums[r][1]));
      }
    }
    const typename W::BlockParams block_params = W::params_of(params, b);
    for (int r = 0; r < ROWS; ++r) {
      const typename W::Acts& a = xr.acts[(row + r) * blocks + b];
      for (int h = 0; h < 2; ++h) {
        acc[r][h] = W::add_block(acc[r][h], sums[r][h], a, block_params, h);
      }
    }
  }
}

template <typename T>
struct Output {
  const float* scales;  // w8a8: per output (padded to the panels); w4a8: null
  const T* bias;        // per output, or null
  const T* residual;    // [M, n], or null
  int64_t res_stride;
  T* out;  // [M, n], or gated [M, n / 2]
  int64_t n;
  bool gated;  // panel halves are gate and up outputs: out[:, 16 p ..] = silu(gate) * up
};

// Row ``row``'s sums for outputs col .. col + 15, w8a8's with the 128s taken out and times
// the weight scale (w4a8's panel sums are scaled already).
template <typename Acts, typename T>
inline __m512 weight_scaled(__m512 sums, const QuantizedRows<Acts>& xr, int64_t row,
                            const Output<T>& o, int64_t col) {
  if (!o.scales) return sums;
  return _mm512_mul_ps(_mm512_sub_ps(sums, _mm512_set1_ps(xr.c[row])),
                       _mm512_loadu_ps(o.scales + col));
}

template <typename W, int ROWS, typename T>
void rows_times_panel(const QuantizedRows<typename W::Acts>& xr, int64_t row,
                      const uint8_t* panel, const uint8_t* params, NextPanel ahead, int64_t p,
                      const Output<T>& o) {
  __m512 acc[kMaxRows][2];
  panel_kernel<W, ROWS>(xr, row, panel, params, ahead, acc);
  if (o.gated) {
    for (int r = 0; r < ROWS; ++r) {
      const __m512 gate = weight_scaled(acc[r][0], xr, row + r, o, p * kPanel);
      const __m512 up = weight_scaled(acc[r][1], xr, row + r, o, p * kPanel + 16);
      store_floats(o.out + (row + r) * (o.n / 2) + 16 * p, tokenmill::silu_times(gate, up),
                   16);
    }
    return;
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t col = p * kPanel + 16 * h;
    if (col >= o.n) break;
    const int64_t width = std::min<int64_t>(16, o.n - col);
    const __m512 bias = o.bias ? load_floats(o.bias + col, width) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) {
      __m512 v = weight_scaled(acc[r][h], xr, row + r, o, col);
      v = _mm512_add_ps(v, bias);
      if (o.residual) {
        v = _mm512_add_ps(v, load_floats(o.residual + (row + r) * o.res_stride + col, width));
      }
      store_floats(o.out + (row + r) * o.n + col, v, width);
    }
  }
}

template <typename W, typename T>
using RowsFn = void (*)(const QuantizedRows<typename W::Acts>&, int64_t, const uint8_t*,
                        const uint8_t*, NextPanel, int64_t, const Output<T>&);
template <typename W, typename T, int... R>
constexpr auto make_table(std::integer_sequence<int, R...>) {
  return std::array<RowsFn<W, T>, sizeof...(R)>{&rows_times_panel<W, R + 1, T>...};
}
template <typename W, typename T>
constexpr auto kRowsFns = make_table<W, T>(std::make_integer_sequence<int, W::kMaxRows>{});

// The storage type of x's dtype: bfloat16 as its bits.
template <typename T>
const T* data_of(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return reinterpret_cast<const uint16_t*>(t.data_ptr());
  } else {
    return t.data_ptr<float>();
  }
}

// Rows 0 .. m of the call times panel p, in chunks of nearly equal sizes, at most
// W::kMaxRows each; each chunk requests its share of `next` into cache (whole cache lines),
// the first one its parameters too.
template <typename W, typename T>
void rows_times_panel_in_chunks(const QuantizedRows<typename W::Acts>& xr, int64_t m,
                                const uint8_t* panel, const uint8_t* params, NextPanel next,
                                int64_t p, const Output<T>& o) {
  const int64_t chunks = (m + W::kMaxRows - 1) / W::kMaxRows;
  for (int64_t c = 0, row = 0; c < chunks; ++c) {
    const int64_t rows = (m - row) / (chunks - c);
    const auto line_at = [&](int64_t share) {
      return share == chunks ? next.end : next.end * share / chunks / 64 * 64;
    };
    const NextPanel share = next.weights ? NextPanel{next.weights, c == 0 ? next.params : nullptr,
                                                     line_at(c), line_at(c + 1)}
                                         : NextPanel{};
    kRowsFns<W, T>[rows - 1](xr, row, panel, params, share, p, o);
    row += rows;
  }
}

template <typename W, typename T>
void linear(const at::Tensor& x, const at::Tensor& packed, const float* scales,
            const uint8_t* params, const std::optional<at::Tensor>& bias,
            const std::optional<at::Tensor>& residual, bool gated, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), blocks = k / W::kBlock;
  const int64_t n = gated ? 2 * out.size(1) : out.size(1);
  // One scratch allocation for the quantized rows: their blocks' Acts, c (float32), then
  // the int8 values.
  using Acts = typename W::Acts;
  const int64_t act_count = m * blocks;
  at::Tensor scratch = at::empty({act_count * int64_t{sizeof(Acts)} + m * 4 + m * k},
                                 x.options().dtype(at::kByte));
  auto* acts = reinterpret_cast<Acts*>(scratch.data_ptr<uint8_t>());
  auto* c = reinterpret_cast<float*>(acts + act_count);
  auto* xq = reinterpret_cast<int8_t*>(c + m);
  const T* xs = data_of<T>(x);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      quantize_row<W>(xs + r * x.stride(0), k, xq + r * k, acts + r * blocks, c + r);
    }
  });
  const QuantizedRows<Acts> xr{xq, acts, c, k};
  const Output<T> o{scales, bias ? data_of<T>(*bias) : nullptr,
                    residual ? data_of<T>(*residual) : nullptr,
                    residual ? residual->stride(0) : 0,
                    reinterpret_cast<T*>(out.data_ptr()), n, gated};
  const auto* weights = packed.data_ptr<uint8_t>();
  const int64_t panel_bytes = k / 4 * W::kRecordBytes, panel_params = blocks * W::kParamBytes;
  // 4-bit panels are widened once when more than one chunk of rows multiplies them
  const bool widen = W::kNibbles && m > W::kMaxRows;
  tokenmill::parallel_batches(panels_for(n), [&](int64_t begin, int64_t end,
                                                 int64_t following) {
    uint8_t* widened = widen ? widening_buffer(k / 4 * W8::kRecordBytes) : nullptr;
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = weights + p * panel_bytes;
      const uint8_t* panel_params_at = params ? params + p * panel_params : nullptr;
      const int64_t next_p = p + 1 < end ? p + 1 : following;
      const NextPanel next =
          next_p < 0 ? NextPanel{}
                     : NextPanel{reinterpret_cast<const char*>(weights + next_p * panel_bytes),
                                 params ? reinterpret_cast<const char*>(
                                              params + next_p * panel_params)
                                        : nullptr,
                                 0, panel_bytes};
      if constexpr (W::kNibbles) {
        if (widen) {
          unpack_panel(panel, k, widened);
          rows_times_panel_in_chunks<Widened<W>, T>(xr, m, widened, panel_params_at, next, p,
                                                    o);
          continue;
        }
      }
      rows_times_panel_in_chunks<W, T>(xr, m, panel, panel_params_at, next, p, o);
    }
  });
}

// The checks both ops share, and the dispatch on x's dtype.
template <typename W>
at::Tensor checked_linear(const at::Tensor& x, const at::Tensor& packed, const float* scales,
                          const uint8_t* params, int64_t out_features,
                          const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& residual, bool gated,
                          const char* layout, int64_t multiple) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be [M, K] bfloat16 or float32 with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), panels = panels_for(out_features);
  TORCH_CHECK(k % multiple == 0, "x must be [M, K] with K a multiple of ", multiple);
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.size(0) == panels && packed.size(1) == k / 4 * W::kRecordBytes,
              "packed must be ", layout, "'s packing of an [out_features, K] weight");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  tokenmill::check_bias_and_residual(bias, residual, m, out_features, x.scalar_type(),
                                     bf16 ? "bfloat16" : "float32");
  TORCH_CHECK(!gated || (out_features % kPanel == 0 && !bias && !residual),
              "a gated call takes out_features a multiple of ", kPanel,
              ", no bias and no residual");
  at::Tensor out = at::empty({m, gated ? out_features / 2 : out_features}, x.options());
  if (m == 0) return out;
  if (bf16) {
    linear<W, uint16_t>(x, packed, scales, params, bias, residual, gated, out);
  } else {
    linear<W, float>(x, packed, scales, params, bias, residual, gated, out);
  }
  return out;
}

at::Tensor vnni_w8a8_linear(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales, int64_t out_features,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual, bool gated) {
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == panels_for(out_features) * kPanel &&
                  scales.is_contiguous() && scales.scalar_type() == at::kFloat,
              "scales must be [out_features padded to a multiple of ", kPanel, "] float32");
  const auto linear = x.dim() == 2 && x.size(1) % kWideBlock == 0 ? checked_linear<W8>
                                                                  : checked_linear<W8Narrow>;
  return linear(x, packed, scales.data_ptr<float>(), nullptr, out_features, bias, residual,
                gated, "linear.NativeW8A8Weight", kBlock);
}

at::Tensor vnni_w4a8_linear(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& group_params, int64_t out_features,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual, bool gated) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(group_params.dim() == 4 && group_params.size(0) == panels_for(out_features) &&
                  group_params.size(1) * kBlock == x.size(1) && group_params.size(2) == 2 &&
                  group_params.size(3) == kPanel && group_params.is_contiguous() &&
                  group_params.scalar_type() == at::kHalf,
              "group_params must be [panels, K / ", kBlock, ", 2, ", kPanel, "] float16");
  return checked_linear<W4>(x, packed, nullptr,
                            static_cast<const uint8_t*>(group_params.data_ptr()),
                            out_features, bias, residual, gated,
                            "linear.NativeVnniW4A8Weight", kBlock);
}

// The ops over a GGUF file's own blocks: W's parameters in params, [panels, bytes]
// uint8, for K a multiple of `multiple` (a super-block's inputs).
template <typename W>
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& params,
                       int64_t out_features, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual, bool gated, int64_t multiple,
                       const char* layout) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(params.dim() == 2 && params.size(0) == panels_for(out_features) &&
                  params.size(1) == x.size(1) / W::kBlock * W::kParamBytes &&
                  params.is_contiguous() && params.scalar_type() == at::kByte,
              "params must be ", layout, "'s [panels, ", W::kParamBytes,
              " bytes per block] uint8");
  return checked_linear<W>(x, packed, nullptr, params.data_ptr<uint8_t>(), out_features, bias,
                           residual, gated, layout, multiple);
}

at::Tensor vnni_q4_k_linear(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& params, int64_t out_features,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual, bool gated) {
  return gguf_linear<W4K>(x, packed, params, out_features, bias, residual, gated,
                          W4K::kSuper * W4K::kBlock, "native_weights.NativeVnniQ4KWeight");
}

at::Tensor vnni_q8_0_linear(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& params, int64_t out_features,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual, bool gated) {
  return gguf_linear<Q8_0>(x, packed, params, out_features, bias, residual, gated,
                           Q8_0::kBlock, "native_weights.NativeVnniQ8_0Weight");
}

at::Tensor vnni_q6_k_linear(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& params, int64_t out_features,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual, bool gated) {
  return gguf_linear<Q6K>(x, packed, params, out_features, bias, residual, gated,
                          16 * Q6K::kBlock, "native_weights.NativeVnniQ6KWeight");
}

// vnni_dequantize: each kind's map of a block's stored values u (the bytes the packed
// records hold) to the file's float32 values, in the arithmetic the file's dequantization
// does: products exact in float32, then at most one rounded addition.
inline float half_at(const uint8_t* src) {
  uint16_t bits;
  std::memcpy(&bits, src, sizeof(bits));
  return _cvtsh_ss(bits);
}

inline __m512 as_floats(__m512i u, int offset) {
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(offset)));
}

struct DenseQ8_0 {
  static constexpr int64_t kBlock = Q8_0::kBlock, kRecordBytes = Q8_0::kRecordBytes;
  static constexpr int64_t kMultiple = kBlock, kParamBytes = Q8_0::kParamBytes;
  static constexpr bool kNibbles = false;
  // d * q
  static inline __m512 values(__m512i u, const uint8_t* params, int64_t o, int64_t b) {
    return _mm512_mul_ps(_mm512_set1_ps(half_at(params + b * kParamBytes + 2 * o)),
                         as_floats(u, 128));
  }
};

struct DenseQ6K {
  static constexpr int64_t kBlock = Q6K::kBlock, kRecordBytes = Q6K::kRecordBytes;
  static constexpr int64_t kSuper = 16, kMultiple = kSuper * kBlock;
  static constexpr int64_t kParamBytes = Q6K::kParamBytes;
  static constexpr bool kNibbles = false;
  // (d * sc) * (q - 32)
  static inline __m512 values(__m512i u, const uint8_t* params, int64_t o, int64_t b) {
    const uint8_t* super = params + b / kSuper * Q6K::kSuperBytes;
    const float d = half_at(super + kSuper * kPanel + 2 * o);
    const float sc = static_cast<float>(static_cast<int8_t>(super[b % kSuper * kPanel + o]));
    return _mm512_mul_ps(_mm512_set1_ps(d * sc), as_floats(u, 32));
  }
};

struct DenseQ4K {
  static constexpr int64_t kBlock = W4K::kBlock, kRecordBytes = W4K::kRecordBytes;
  static constexpr int64_t kMultiple = W4K::kSuper * kBlock, kParamBytes = W4K::kParamBytes;
  static constexpr bool kNibbles = true;
  // (d * sc) * q - (dmin * mn)
  static inline __m512 values(__m512i u, const uint8_t* params, int64_t o, int64_t b) {
    const uint8_t* super = params + b / W4K::kSuper * W4K::kSuperBytes;
    const uint8_t* sc = super + b % W4K::kSuper * 2 * kPanel;
    const uint8_t* d = super + W4K::kSuper * 2 * kPanel;
    const float scale = half_at(d + 2 * o) * static_cast<float>(sc[o]);
    const float min = half_at(d + 2 * kPanel + 2 * o) * static_cast<float>(sc[kPanel + o]);
    return _mm512_fmsub_ps(_mm512_set1_ps(scale), as_floats(u, 0), _mm512_set1_ps(min));
  }
};

struct DenseW4A8 {
  static constexpr int64_t kBlock = W4::kBlock, kRecordBytes = W4::kRecordBytes;
  static constexpr int64_t kMultiple = kBlock, kParamBytes = W4::kParamBytes;
  static constexpr bool kNibbles = true;
  // scale * q + min
  static inline __m512 values(__m512i u, const uint8_t* params, int64_t o, int64_t b) {
    const uint8_t* block = params + b * kParamBytes;
    return _mm512_fmadd_ps(_mm512_set1_ps(half_at(block + 2 * o)), as_floats(u, 0),
                           _mm512_set1_ps(half_at(block + 2 * kPanel + 2 * o)));
  }
};

// The values of output o of a panel (its row at `row`, K inputs) for inputs c ..
// c + width, width 32 or 64, from their stored values u (byte i of `u`: input c + i).
template <typename D>
inline void dense_chunk(__m512i u, const uint8_t* params, int64_t o, int64_t c, int64_t width,
                        uint16_t* row) {
  alignas(64) uint8_t bytes[64];
  _mm512_store_si512(bytes, u);
  for (int64_t t = 0; t < width / 16; ++t) {
    const __m512i part =
        _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(bytes + 16 * t)));
    const __m512 w = D::values(part, params, o, (c + 16 * t) / D::kBlock);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + c + 16 * t), round_to_bf16(w));
  }
}

// Panel p's `outputs` (at most 32) rows of the dense weight at out ([outputs, K]): output
// o's 64 inputs at a time, one gather of their 16 records' lanes (a nibble panel's lane
// holds outputs o and 16 + o).
template <typename D>
void dense_panel(const uint8_t* panel, const uint8_t* params, int64_t k, int64_t outputs,
                 uint16_t* out) {
  const __m512i records = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int32_t>(D::kRecordBytes)));
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const int64_t lanes = D::kNibbles ? 16 : kPanel;
  for (int64_t o = 0; o < std::min(lanes, outputs); ++o) {
    const int64_t lane = D::kNibbles ? 4 * o : o / 16 * 64 + o % 16 * 4;
    for (int64_t c = 0; c < k; c += 64) {
      const int64_t width = std::min<int64_t>(64, k - c);
      const __m512i u = _mm512_mask_i32gather_epi32(
          _mm512_setzero_si512(), static_cast<__mmask16>(first_lanes(width / 4)), records,
          panel + c / 4 * D::kRecordBytes + lane, 1);
      if constexpr (D::kNibbles) {
        dense_chunk<D>(_mm512_and_si512(u, nibble), params, o, c, width, out + o * k);
        if (16 + o < outputs) {
          dense_chunk<D>(_mm512_and_si512(_mm512_srli_epi16(u, 4), nibble), params, 16 + o, c,
                         width, out + (16 + o) * k);
        }
      } else {
        dense_chunk<D>(u, params, o, c, width, out + o * k);
      }
    }
  }
}

template <typename D>
at::Tensor dequantize(const at::Tensor& packed, const at::Tensor& params, int64_t n, int64_t k,
                      const char* layout) {
  const int64_t panels = panels_for(n);
  TORCH_CHECK(n > 0 && k > 0 && k % D::kMultiple == 0, "in_features must be a positive "
              "multiple of ", D::kMultiple, " and out_features positive");
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.size(0) == panels && packed.size(1) == k / 4 * D::kRecordBytes,
              "packed must be ", layout, "'s packing of an [out_features, in_features] weight");
  TORCH_CHECK(params.is_contiguous() && params.dim() >= 1 && params.size(0) == panels &&
                  params.nbytes() == static_cast<size_t>(panels * k / D::kBlock *
                                                         D::kParamBytes),
              "params must be ", layout, "'s parameters of an [out_features, in_features] "
              "weight");
  at::Tensor out = at::empty({n, k}, packed.options().dtype(at::kBFloat16));
  const auto* weights = packed.data_ptr<uint8_t>();
  const auto* param_bytes = static_cast<const uint8_t*>(params.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      dense_panel<D>(weights + p * packed.size(1), param_bytes + p * (k / D::kBlock) *
                     D::kParamBytes, k, std::min(kPanel, n - p * kPanel),
                     dst + p * kPanel * k);
    }
  });
  return out;
}

at::Tensor vnni_dequantize(c10::string_view kind, const at::Tensor& packed,
                           const at::Tensor& params, int64_t out_features,
                           int64_t in_features) {
  if (kind == "q4_k") {
    return dequantize<DenseQ4K>(packed, params, out_features, in_features,
                                "native_weights.NativeVnniQ4KWeight");
  }
  if (kind == "q6_k") {
    return dequantize<DenseQ6K>(packed, params, out_features, in_features,
                                "native_weights.NativeVnniQ6KWeight");
  }
  if (kind == "q8_0") {
    return dequantize<DenseQ8_0>(packed, params, out_features, in_features,
                                 "native_weights.NativeVnniQ8_0Weight");
  }
  TORCH_CHECK(kind == "w4a8", "kind must be q4_k, q6_k, q8_0 or w4a8, not ", kind);
  return dequantize<DenseW4A8>(packed, params, out_features, in_features,
                               "native_weights.NativeVnniW4A8Weight");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("vnni_w8a8_linear(Tensor x, Tensor packed, Tensor scales, int out_features, "
        "Tensor? bias, Tensor? residual, bool gated=False) -> Tensor");
  m.def("vnni_w4a8_linear(Tensor x, Tensor packed, Tensor group_params, int out_features, "
        "Tensor? bias, Tensor? residual, bool gated=False) -> Tensor");
  m.def("vnni_q4_k_linear(Tensor x, Tensor packed, Tensor params, int out_features, "
        "Tensor? bias, Tensor? residual, bool gated=False) -> Tensor");
  m.def("vnni_q8_0_linear(Tensor x, Tensor packed, Tensor params, int out_features, "
        "Tensor? bias, Tensor? residual, bool gated=False) -> Tensor");
  m.def("vnni_q6_k_linear(Tensor x, Tensor packed, Tensor params, int out_features, "
        "Tensor? bias, Tensor? residual, bool gated=False) -> Tensor");
  m.def("vnni_dequantize(str kind, Tensor packed, Tensor params, int out_features, "
        "int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("vnni_w8a8_linear", &vnni_w8a8_linear);
  m.impl("vnni_w4a8_linear", &vnni_w4a8_linear);
  m.impl("vnni_q4_k_linear", &vnni_q4_k_linear);
  m.impl("vnni_q8_0_linear", &vnni_q8_0_linear);
  m.impl("vnni_q6_k_linear", &vnni_q6_k_linear);
  m.impl("vnni_dequantize", &vnni_dequantize);
}

#endif  // AVX512-VNNI
