// Causal attention for the prompt (or prompt chunk) tokens of a batch, over the paged KV
// cache read in place, bfloat16 on AVX512-BF16. Every prefilled sequence of the batch in
// one call, written into the rows of ``out`` they own:
//
//   for sequence s with query tokens [ranges[s, 0], ranges[s, 1]) and seq_lens[s] keys in
//   all, query i (position ctx + i, ctx = seq_lens[s] - its query count) of head h:
//     out[ranges[s, 0] + i, h] = softmax(scale * q . K[s, 0 .. ctx + i]) @ V[s, 0 .. ctx + i]
//
// with K/V rows of sequence s in the cache blocks block_tables[s, :] (the new tokens' rows
// already stored) and G = heads / kv_heads query heads per KV head. A task is a tile of up
// to kTile query tokens of one sequence and one KV head, all G of its query heads: its
// (query, head) rows lie in the 16 lanes of ceil(rows / 16) registers, so that every step
// is a vertical one, the same for each lane whichever rows share its register:
//   scores: for each key, sum over dimension pairs of (the rows' q pair) . (the key's pair,
//           broadcast) with VDPBF16PS (exact products, float32 sums), 16 keys at a time;
//           a key after a row's own position scores kUnseen in that row's lane;
//   softmax in float32 with each lane's maximum subtracted, over keys in order; each
//           weight rounded to bfloat16 (as the values' multiplier), the sum of the rounded
//           weights dividing the output;
//   values: for each output dimension, sum over key pairs of (the rows' weight pair) .
//           (the keys' value pair, broadcast) with VDPBF16PS, in key order; one rounding to
//           bfloat16 at the end.
// A row's result so depends on its query and keys alone, not on the tile, chunk or batch
// it is computed in: the arithmetic on its lane is the same sequence (keys 0, 1, ... in
// pairs from key 0; keys a tile pads with weigh exactly 0).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "avx512_lanes.h"
#include "thread_batches.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

using tokenmill::round_to_bf16;

constexpr int64_t kLanes = 16;  // (query, head) rows per register
constexpr int64_t kTile = 16;   // query tokens per task
constexpr int64_t kKeys = 16;   // keys scored per pass (one accumulator each)
constexpr int64_t kDims = 16;   // output dimensions per values pass (one accumulator each)
constexpr int64_t kMaxHeadDim = 256;

// A score no row can have: a key after the row's own position (exp of it less any
// score is exactly 0).
constexpr float kUnseen = -1e30f;

// exp(x) lane by lane for x <= 0 (a score less the lane's maximum), within 2 ulp; x below
// -120 gives exactly 0.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-120.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2, high part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);      // and the rest
  // e^r on |r| <= ln(2) / 2: its Taylor series to r^7 (error below 2^-27)
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  return _mm512_scalef_ps(p, n);  // p * 2^n, 0 where that is below float32's range
}

// float32 lanes (>= 0, finite) rounded to the nearest bfloat16, nearest even on a tie,
// kept as float32 (the low 16 bits 0).
inline __m512i round_to_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb),
                          _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}

alignas(64) const uint16_t kZeroRow[kMaxHeadDim] = {};

// One thread's working memory for the tasks it computes, grown as needed.
struct TileBuffers {
  std::vector<const uint16_t*> keys, values;  // each key's row in either cache, padded
  std::vector<__m512i> queries;  // [register][pair]: the rows' q pairs
  std::vector<__m512i> last_key;  // [register]: each lane's last key
  std::vector<__m512> peaks;      // [register]: each lane's largest score
  std::vector<__m512> scores;    // [register][key]; then [register][key pair]: weight pairs
  std::vector<int32_t> pairs;    // [key pair][dimension]: value pairs
  std::vector<float> inv_totals;  // [register * 16 + lane]
};

template <int64_t HEAD_DIM>
void prefill_attention(const at::Tensor& q, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                       const at::Tensor& query_ranges, const at::Tensor& seq_lens, double scale,
                       at::Tensor& out) {
  constexpr int64_t kPairs = HEAD_DIM / 2;  // 32-bit words (bfloat16 pairs) per row
  const int64_t num_seqs = seq_lens.size(0), num_heads = q.size(1);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t block_stride = key_cache.stride(0), token_stride = key_cache.stride(1);
  const int64_t table_stride = block_tables.stride(0);
  const int64_t q_token_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t out_stride = out.stride(0);
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* k_ptr = reinterpret_cast<const uint16_t*>(key_cache.data_ptr<at::BFloat16>());
  const auto* v_ptr = reinterpret_cast<const uint16_t*>(value_cache.data_ptr<at::BFloat16>());
  auto* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* ranges = query_ranges.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const __m512 fscale = _mm512_set1_ps(static_cast<float>(scale));

  // Tasks: (sequence, KV head, tile of its queries), in that order.
  std::vector<int64_t> first_task(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t tiles = (ranges[2 * s + 1] - ranges[2 * s] + kTile - 1) / kTile;
    first_task[s + 1] = first_task[s] + tiles * num_kv_heads;
  }
  tokenmill::parallel_batches(first_task[num_seqs], [&](int64_t begin, int64_t end, int64_t) {
    TileBuffers buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = std::upper_bound(first_task.begin(), first_task.end(), task) -
                        first_task.begin() - 1;
      const int64_t start = ranges[2 * s], q_len = ranges[2 * s + 1] - start;
      const int64_t ctx = lens[s] - q_len;
      const int64_t tiles = (q_len + kTile - 1) / kTile;
      const int64_t kv = (task - first_task[s]) / tiles;
      const int64_t tile = (task - first_task[s]) % tiles;
      const int64_t r0 = tile * kTile, r1 = std::min(q_len, r0 + kTile);
      const int64_t rows = (r1 - r0) * group;  // row r * G + g: query r0 + r, head kv * G + g
      const int64_t regs = (rows + kLanes - 1) / kLanes;
      const int64_t diagonal = ctx + r0;      // query r sees keys 0 .. diagonal + r
      const int64_t keys = ctx + r1;          // the tile's last query sees them all
      const int64_t padded = (keys + kKeys - 1) / kKeys * kKeys;
      const int32_t* table = tables + s * table_stride;

      buf.keys.resize(padded);
      buf.values.resize(padded);
      for (int64_t t = 0; t < keys; ++t) {
        const int64_t offset = table[t / block_size] * block_stride +
                               (t % block_size) * token_stride + kv * HEAD_DIM;
        buf.keys[t] = k_ptr + offset;
        buf.values[t] = v_ptr + offset;
      }
      std::fill(buf.keys.begin() + keys, buf.keys.end(), kZeroRow);
      std::fill(buf.values.begin() + keys, buf.values.end(), kZeroRow);

      // Each register's rows: their query's last key (past a padding lane's: it sees all)
      // and their q pairs, gathered.
      buf.last_key.resize(regs);
      buf.queries.resize(regs * kPairs);
      for (int64_t reg = 0; reg < regs; ++reg) {
        alignas(64) int32_t last[kLanes], word[kLanes];
        for (int64_t lane = 0; lane < kLanes; ++lane) {
          const int64_t row = std::min(reg * kLanes + lane, rows - 1);
          const int64_t r = row / group, g = row % group;
          last[lane] = reg * kLanes + lane < rows ? static_cast<int32_t>(diagonal + r)
                                                  : static_cast<int32_t>(padded);
          word[lane] = static_cast<int32_t>(((start + r0 + r) * q_token_stride +
                                             (kv * group + g) * q_head_stride) / 2);
        }
        buf.last_key[reg] = _mm512_load_si512(last);
        const __m512i index = _mm512_load_si512(word);
        for (int64_t p = 0; p < kPairs; ++p) {
          buf.queries[reg * kPairs + p] = _mm512_i32gather_epi32(
              _mm512_add_epi32(index, _mm512_set1_epi32(static_cast<int>(p))), q_ptr, 4);
        }
      }

      // Scores, 16 keys at a time, their rows copied together first; each lane's maximum.
      buf.scores.resize(regs * padded);
      buf.peaks.assign(regs, _mm512_set1_ps(kUnseen));
      alignas(64) uint16_t key_rows[kKeys][HEAD_DIM];
      for (int64_t t0 = 0; t0 < padded; t0 += kKeys) {
        for (int64_t k = 0; k < kKeys; ++k) {
          std::memcpy(key_rows[k], buf.keys[t0 + k], HEAD_DIM * sizeof(uint16_t));
        }
        const auto* key_words = reinterpret_cast<const int32_t*>(key_rows);
        for (int64_t reg = 0; reg < regs; ++reg) {
          const __m512i* qs = buf.queries.data() + reg * kPairs;
          __m512 acc[kKeys];
          for (int64_t k = 0; k < kKeys; ++k) acc[k] = _mm512_setzero_ps();
          for (int64_t p = 0; p < kPairs; ++p) {
            const __m512bh qp = (__m512bh)qs[p];
            for (int64_t k = 0; k < kKeys; ++k) {
              acc[k] = _mm512_dpbf16_ps(
                  acc[k], qp, (__m512bh)_mm512_set1_epi32(key_words[k * kPairs + p]));
            }
          }
          __m512* dst = buf.scores.data() + reg * padded + t0;
          __m512 peak = buf.peaks[reg];
          for (int64_t k = 0; k < kKeys; ++k) {
            const __mmask16 seen = _mm512_cmpge_epi32_mask(
                buf.last_key[reg], _mm512_set1_epi32(static_cast<int>(t0 + k)));
            dst[k] = _mm512_mask_mul_ps(_mm512_set1_ps(kUnseen), seen, acc[k], fscale);
            peak = _mm512_max_ps(peak, dst[k]);
          }
          buf.peaks[reg] = peak;
        }
      }

      // Softmax: weights as bfloat16 pairs (keys 2j, 2j + 1 in lanes' low and high halves)
      // written over the scores they come from.
      buf.inv_totals.resize(regs * kLanes);
      for (int64_t reg = 0; reg < regs; ++reg) {
        __m512* row_scores = buf.scores.data() + reg * padded;
        const __m512 peak = buf.peaks[reg];
        __m512 total = _mm512_setzero_ps();
        for (int64_t t = 0; t < padded; t += 2) {
          const __m512i even =
              round_to_bf16_bits(exp_nonpositive(_mm512_sub_ps(row_scores[t], peak)));
          const __m512i odd =
              round_to_bf16_bits(exp_nonpositive(_mm512_sub_ps(row_scores[t + 1], peak)));
          total = _mm512_add_ps(total, _mm512_castsi512_ps(even));
          total = _mm512_add_ps(total, _mm512_castsi512_ps(odd));
          row_scores[t / 2] = _mm512_castsi512_ps(_mm512_or_si512(_mm512_srli_epi32(even, 16), odd));
        }
        _mm512_storeu_ps(buf.inv_totals.data() + reg * kLanes,
                         _mm512_div_ps(_mm512_set1_ps(1.f), total));
      }

      // Value pairs: word d of pair j = (V[2j, d], V[2j + 1, d]).
      buf.pairs.resize(padded / 2 * HEAD_DIM);
      const __m512i interleave_lo = _mm512_set_epi16(
          47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
          39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i interleave_hi = _mm512_add_epi16(interleave_lo, _mm512_set1_epi16(16));
      for (int64_t j = 0; j < padded / 2; ++j) {
        const uint16_t* a = buf.values[2 * j];
        const uint16_t* b = buf.values[2 * j + 1];
        int32_t* dst = buf.pairs.data() + j * HEAD_DIM;
        for (int64_t d = 0; d < HEAD_DIM; d += 32) {
          const __m512i va = _mm512_loadu_si512(a + d), vb = _mm512_loadu_si512(b + d);
          _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(va, interleave_lo, vb));
          _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(va, interleave_hi, vb));
        }
      }

      // Values, 16 dimensions at a time over every key pair; then each lane's output row.
      const __m512i across = _mm512_mullo_epi32(  // element i of a lane's output: [i][lane]
          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
          _mm512_set1_epi32(kLanes));
      for (int64_t reg = 0; reg < regs; ++reg) {
        const __m512* weights = buf.scores.data() + reg * padded;
        const __m512 inv = _mm512_loadu_ps(buf.inv_totals.data() + reg * kLanes);
        const int64_t live = std::min(kLanes, rows - reg * kLanes);
        for (int64_t d0 = 0; d0 < HEAD_DIM; d0 += kDims) {
          __m512 acc[kDims];
          for (int64_t i = 0; i < kDims; ++i) acc[i] = _mm512_setzero_ps();
          for (int64_t j = 0; j < padded / 2; ++j) {
            const __m512bh w = (__m512bh)_mm512_castps_si512(weights[j]);
            const int32_t* pair = buf.pairs.data() + j * HEAD_DIM + d0;
            for (int64_t i = 0; i < kDims; ++i) {
              acc[i] = _mm512_dpbf16_ps(acc[i], w, (__m512bh)_mm512_set1_epi32(pair[i]));
            }
          }
          alignas(64) float columns[kDims][kLanes];  // [dimension][lane]
          for (int64_t i = 0; i < kDims; ++i) {
            _mm512_store_ps(columns[i], _mm512_mul_ps(acc[i], inv));
          }
          for (int64_t lane = 0; lane < live; ++lane) {
            const int64_t row = reg * kLanes + lane, r = row / group, g = row % group;
            uint16_t* dst = out_ptr + (start + r0 + r) * out_stride +
                            (kv * group + g) * HEAD_DIM + d0;
            const __m512 v = _mm512_i32gather_ps(
                _mm512_add_epi32(across, _mm512_set1_epi32(static_cast<int>(lane))),
                &columns[0][0], 4);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), round_to_bf16(v));
          }
        }
      }
    }
  });
}

// q [T, H, D] bfloat16 (rows of D contiguous); key_cache/value_cache [N, bs, kvh, D]
// (contiguous); block_tables [S, max_blocks] int32; query_ranges [S, 2] int32 (each
// sequence's flat token range [start, end) in q, disjoint); seq_lens [S] int32 (each at
// least its query count); out [T, H * D] (rows of H * D contiguous): the sequences' rows
// are written, the others kept.
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_ranges, const at::Tensor& seq_lens,
                             double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && out.dim() == 2,
              "q [T, H, D], cache [N, bs, kvh, D], out [T, H * D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && key_cache.scalar_type() == at::kBFloat16 &&
                  value_cache.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "q, the caches and out must be bfloat16");
  TORCH_CHECK(q.stride(0) % 2 == 0 && q.stride(1) % 2 == 0,
              "q's token and head strides must be even (its rows are read in pairs)");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(1) == 1 && key_cache.is_contiguous() &&
                  value_cache.is_contiguous(),
              "q's and out's last dimension and the caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_ranges.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "block_tables, query_ranges and seq_lens must be int32");
  TORCH_CHECK(block_tables.stride(1) == 1 && query_ranges.is_contiguous() &&
                  seq_lens.is_contiguous() && query_ranges.dim() == 2 &&
                  query_ranges.size(1) == 2 && query_ranges.size(0) == seq_lens.size(0) &&
                  block_tables.size(0) == seq_lens.size(0),
              "one block table row, query range and seq_len per sequence");
  TORCH_CHECK(q.size(1) % key_cache.size(2) == 0 && q.size(2) == key_cache.size(3) &&
                  out.size(0) == q.size(0) && out.size(1) == q.size(1) * q.size(2),
              "heads must be a multiple of kv_heads, head dims equal, out [T, H * D]");
  const int32_t* ranges = query_ranges.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    const int32_t start = ranges[2 * s], end = ranges[2 * s + 1];
    TORCH_CHECK(start >= 0 && start < end && end <= q.size(0) && lens[s] >= end - start &&
                    (lens[s] + key_cache.size(1) - 1) / key_cache.size(1) <= block_tables.size(1),
                "sequence ", s, ": its queries must lie in q, its keys in its block table");
  }
  switch (q.size(2)) {
    case 64:
      prefill_attention<64>(q, key_cache, value_cache, block_tables, query_ranges, seq_lens,
                            scale, out);
      break;
    case 128:
      prefill_attention<128>(q, key_cache, value_cache, block_tables, query_ranges, seq_lens,
                             scale, out);
      break;
    case 256:
      prefill_attention<256>(q, key_cache, value_cache, block_tables, query_ranges, seq_lens,
                             scale, out);
      break;
    default:
      TORCH_CHECK(false, "head_dim must be 64, 128 or 256, got ", q.size(2));
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor query_ranges, Tensor seq_lens, float scale, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}

#endif  // AVX512-BF16
