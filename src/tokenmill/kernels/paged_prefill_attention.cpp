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
// to kTile query tokens of one sequence and one KV head, all G of its query heads:
//   scores: q . k with VDPBF16PS (exact products, float32 sums), 16 keys' partial sums
//           folded into one register (no horizontal sum per key);
//   softmax in float32 with the maximum subtracted, over each query's own keys;
//   values: each V row widened to float32 once per tile, then added into every query's
//           accumulator with its weight; one rounding to bfloat16 at the end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dtype_conversion.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

using tokenmill::from_float;

constexpr int64_t kKeys = 16;  // keys per score register
constexpr int64_t kTile = 16;  // query tokens per task

// Lane t of the result = the sum of the 16 lanes of v[t].
inline __m512 fold16(__m512 (&v)[kKeys]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // quads[i]: its 128-bit lane L holds the lane-L partial sums of keys 4i .. 4i + 3
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], 0xee));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], 0xee));
  return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
}

template <int64_t HEAD_DIM>
void prefill_attention(const at::Tensor& q, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                       const at::Tensor& query_ranges, const at::Tensor& seq_lens, double scale,
                       at::Tensor& out) {
  constexpr int64_t kPairs = HEAD_DIM / 32;  // VDPBF16PS operands per row
  constexpr int64_t kLanes = HEAD_DIM / 16;  // float32 registers per row
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
  const float fscale = static_cast<float>(scale);

  // Tasks: (sequence, KV head, tile of its queries), in that order.
  std::vector<int64_t> first_task(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t tiles = (ranges[2 * s + 1] - ranges[2 * s] + kTile - 1) / kTile;
    first_task[s + 1] = first_task[s] + tiles * num_kv_heads;
  }
  at::parallel_for(0, first_task[num_seqs], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    std::vector<int64_t> offsets;  // each key's row in either cache (this KV head)
    alignas(64) float values[kKeys][HEAD_DIM];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = std::upper_bound(first_task.begin(), first_task.end(), task) -
                        first_task.begin() - 1;
      const int64_t start = ranges[2 * s], q_len = ranges[2 * s + 1] - start;
      const int64_t ctx = lens[s] - q_len;
      const int64_t tiles = (q_len + kTile - 1) / kTile;
      const int64_t kv = (task - first_task[s]) / tiles;
      const int64_t tile = (task - first_task[s]) % tiles;
      const int64_t r0 = tile * kTile, r1 = std::min(q_len, r0 + kTile);
      const int64_t rows = (r1 - r0) * group;   // (query, head) pairs of the tile
      const int64_t keys = ctx + r1;            // the tile's last query sees them all
      const int64_t padded = (keys + kKeys - 1) / kKeys * kKeys;
      const int32_t* table = tables + s * table_stride;
      offsets.resize(padded);
      for (int64_t t = 0; t < keys; ++t) {
        offsets[t] = table[t / block_size] * block_stride + (t % block_size) * token_stride +
                     kv * HEAD_DIM;
      }
      for (int64_t t = keys; t < padded; ++t) offsets[t] = offsets[keys - 1];
      scores.assign(rows * padded, 0.f);
      // Row (r, g) of the tile: query token r0 + r, head kv * G + g; it sees ctx + r0 + r + 1 keys.
      for (int64_t r = 0; r < r1 - r0; ++r) {
        const int64_t seen = ctx + r0 + r + 1;
        for (int64_t g = 0; g < group; ++g) {
          const uint16_t* q_row =
              q_ptr + (start + r0 + r) * q_token_stride + (kv * group + g) * q_head_stride;
          __m512bh qv[kPairs];
          for (int64_t i = 0; i < kPairs; ++i) {
            qv[i] = (__m512bh)_mm512_loadu_si512(q_row + 32 * i);
          }
          float* p = scores.data() + (r * group + g) * padded;
          for (int64_t t0 = 0; t0 < seen; t0 += kKeys) {
            __m512 dots[kKeys];
            for (int64_t t = 0; t < kKeys; ++t) {
              const uint16_t* key = k_ptr + offsets[t0 + t];
              dots[t] = _mm512_setzero_ps();
              for (int64_t i = 0; i < kPairs; ++i) {
                dots[t] = _mm512_dpbf16_ps(dots[t], qv[i],
                                           (__m512bh)_mm512_loadu_si512(key + 32 * i));
              }
            }
            _mm512_storeu_ps(p + t0, _mm512_mul_ps(fold16(dots), _mm512_set1_ps(fscale)));
          }
          const float peak = *std::max_element(p, p + seen);
          float total = 0.f;
          for (int64_t t = 0; t < seen; ++t) {
            p[t] = std::exp(p[t] - peak);
            total += p[t];
          }
          const float inv = 1.f / total;
          for (int64_t t = 0; t < seen; ++t) p[t] *= inv;
          std::fill(p + seen, p + padded, 0.f);  // keys it must not see weigh 0
        }
      }
      acc.assign(rows * HEAD_DIM, 0.f);
      for (int64_t t0 = 0; t0 < keys; t0 += kKeys) {
        const int64_t n = std::min(kKeys, keys - t0);
        for (int64_t t = 0; t < n; ++t) {
          const uint16_t* value = v_ptr + offsets[t0 + t];
          for (int64_t i = 0; i < kLanes; ++i) {
            const __m256i raw =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(value + 16 * i));
            _mm512_store_ps(values[t] + 16 * i, _mm512_castsi512_ps(
                                                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
          }
        }
        // rows whose queries see none of these keys (earlier queries) skip them
        const int64_t first_row = std::max<int64_t>(0, t0 - ctx - r0) * group;
        for (int64_t row = first_row; row < rows; ++row) {
          const float* p = scores.data() + row * padded + t0;
          float* o = acc.data() + row * HEAD_DIM;
          __m512 sum[kLanes];
          for (int64_t i = 0; i < kLanes; ++i) sum[i] = _mm512_loadu_ps(o + 16 * i);
          for (int64_t t = 0; t < n; ++t) {
            const __m512 w = _mm512_set1_ps(p[t]);
            for (int64_t i = 0; i < kLanes; ++i) {
              sum[i] = _mm512_fmadd_ps(w, _mm512_load_ps(values[t] + 16 * i), sum[i]);
            }
          }
          for (int64_t i = 0; i < kLanes; ++i) _mm512_storeu_ps(o + 16 * i, sum[i]);
        }
      }
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t r = row / group, g = row % group;
        uint16_t* dst = out_ptr + (start + r0 + r) * out_stride + (kv * group + g) * HEAD_DIM;
        const float* o = acc.data() + row * HEAD_DIM;
        for (int64_t d = 0; d < HEAD_DIM; ++d) dst[d] = from_float<at::BFloat16>(o[d]).x;
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
    default:
      TORCH_CHECK(false, "head_dim must be 64 or 128, got ", q.size(2));
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
