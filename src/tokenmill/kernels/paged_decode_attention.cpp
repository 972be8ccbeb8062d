// Decode attention over the paged KV cache, read in place (no gather, no padding).
//
// out[b, h, :] = softmax(scale * q[b, h] . K[b, :len_b, h / G]) @ V[b, :len_b, h / G]
//
// where K/V rows of sequence b live in the cache blocks block_tables[b, :] (token t in
// block block_tables[b, t / block_size] at offset t % block_size), and G = heads / kv_heads
// query heads share one KV head. A task is a sequence (or one KV head of it), computed
// head by head: the first query head of a KV group reads the group's rows from memory,
// the others find them in cache. Arithmetic is float32 whatever the storage dtype;
// softmax is exact (max subtracted), never over padding.
//
// On AVX2 hosts float32 and bfloat16 heads of 64 or 128 take a register-blocked path
// (decode_attention_avx2): a KV head at a time, scores for 8 keys at once folded without a
// horizontal sum per key, and each value row read once for up to 3 query heads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention_rows.h"
#include "dtype_conversion.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

using tokenmill::exp_shifted;
using tokenmill::from_float;
using tokenmill::prefetch_row;
using tokenmill::to_float;

// Tokens ahead whose rows are requested before use: blocks lie anywhere in the cache, so
// the hardware prefetcher cannot guess the next block.
constexpr int64_t kPrefetchAhead = 4;

constexpr int64_t kMaxHeadDim = 256;

// What both kernels read, from paged_decode_attention's checked tensors, and how they
// split the work: a task is a sequence's KV heads [kv_begin, kv_begin + heads_per_task):
// all of them when there are enough sequences to keep every thread busy, else one, so that
// a few long sequences still spread over the threads.
template <typename T>
struct DecodeOperands {
  int64_t num_seqs, num_heads, num_kv_heads, group, head_dim;
  int64_t block_size, block_stride, token_stride, table_stride, q_seq_stride, q_head_stride;
  const T* q;
  const T* k;
  const T* v;
  const int32_t* tables;
  const int32_t* lens;
  T* out;
  float scale;
  int64_t heads_per_task, tasks_per_seq;

  DecodeOperands(const at::Tensor& q_, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens, double scale_, at::Tensor& out_)
      : num_seqs(q_.size(0)), num_heads(q_.size(1)), num_kv_heads(key_cache.size(2)),
        group(num_heads / num_kv_heads), head_dim(q_.size(2)),
        block_size(key_cache.size(1)), block_stride(key_cache.stride(0)),
        token_stride(key_cache.stride(1)), table_stride(block_tables.stride(0)),
        q_seq_stride(q_.stride(0)), q_head_stride(q_.stride(1)), q(q_.data_ptr<T>()),
        k(key_cache.data_ptr<T>()), v(value_cache.data_ptr<T>()),
        tables(block_tables.data_ptr<int32_t>()), lens(seq_lens.data_ptr<int32_t>()),
        out(out_.data_ptr<T>()), scale(static_cast<float>(scale_)),
        heads_per_task(num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1),
        tasks_per_seq(num_kv_heads / heads_per_task) {}

  // offsets[t] for t < lens[b]: where token t's row of sequence b's KV heads from kv_begin
  // starts in either cache.
  void row_offsets(int64_t b, int64_t kv_begin, int64_t* offsets) const {
    const int32_t* table = tables + b * table_stride;
    for (int64_t t = 0, block = 0; t < lens[b]; ++block) {
      const int64_t base = table[block] * block_stride + kv_begin * head_dim;
      for (int64_t i = 0; i < block_size && t < lens[b]; ++i, ++t) {
        offsets[t] = base + i * token_stride;
      }
    }
  }
};

// HEAD_DIM > 0: the head size known at compile time (its loops unroll and the per-head
// accumulators stay in registers); 0: read from the tensors (any size up to kMaxHeadDim).
template <typename T, int64_t HEAD_DIM>
void decode_attention_kernel(const DecodeOperands<T>& op) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : op.head_dim;
  constexpr int64_t kBuffer = HEAD_DIM > 0 ? HEAD_DIM : kMaxHeadDim;
  const int64_t group = op.group, heads_per_task = op.heads_per_task;

  at::parallel_for(0, op.num_seqs * op.tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> offsets;  // each token's row in either cache
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / op.tasks_per_seq;
      const int64_t kv_begin = (task % op.tasks_per_seq) * heads_per_task;
      const int64_t h_begin = kv_begin * group, h_end = (kv_begin + heads_per_task) * group;
      const int64_t width = heads_per_task * head_dim;  // elements of a token's K or V row
      const int64_t len = op.lens[b];
      scores.resize(op.num_heads * len);
      offsets.resize(len);
      op.row_offsets(b, kv_begin, offsets.data());
      // Head by head: the first head of a KV group reads its rows from memory (prefetched
      // ahead), the others find them in cache.
      for (int64_t h = h_begin; h < h_end; ++h) {
        const bool first = (h - h_begin) % group == 0;
        const int64_t head_offset = (h / group - kv_begin) * head_dim;
        const T* q_head = op.q + b * op.q_seq_stride + h * op.q_head_stride;
        float qh[kBuffer];
        for (int64_t d = 0; d < head_dim; ++d) qh[d] = to_float(q_head[d]) * op.scale;
        float* s = scores.data() + h * len;
        for (int64_t t = 0; t < len; ++t) {
          if (first && t + kPrefetchAhead < len) {
            prefetch_row(op.k + offsets[t + kPrefetchAhead], width);
          }
          const T* key = op.k + offsets[t] + head_offset;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * to_float(key[d]);
          s[t] = dot;
        }
        const float total = exp_shifted(s, len);
        float acc[kBuffer] = {};
        for (int64_t t = 0; t < len; ++t) {
          if (first && t + kPrefetchAhead < len) {
            prefetch_row(op.v + offsets[t + kPrefetchAhead], width);
          }
          const T* value = op.v + offsets[t] + head_offset;
          const float w = s[t];
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) acc[d] += w * to_float(value[d]);
        }
        const float inv = 1.f / total;
        T* out_head = op.out + (b * op.num_heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) out_head[d] = from_float<T>(acc[d] * inv);
      }
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__)

using tokenmill::accumulate_values_all;
using tokenmill::kKeys;
using tokenmill::kRowsAhead;
using tokenmill::score_keys;
using tokenmill::store_scaled;

template <typename T, int64_t HEAD_DIM>
void decode_attention_avx2(const DecodeOperands<T>& op) {
  const int64_t group = op.group, heads_per_task = op.heads_per_task;

  at::parallel_for(0, op.num_seqs * op.tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, queries(group * HEAD_DIM), inv_totals(group);
    std::vector<float> sums(group * HEAD_DIM);  // the group's weighted sums of value rows
    std::vector<int64_t> offsets;  // each token's row of this task's first KV head
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / op.tasks_per_seq;
      const int64_t kv_begin = (task % op.tasks_per_seq) * heads_per_task;
      const int64_t len = op.lens[b];
      const int64_t padded = (len + kKeys - 1) / kKeys * kKeys;
      const int64_t width = heads_per_task * HEAD_DIM;  // elements of a token's K or V row
      scores.resize(group * padded);
      offsets.resize(padded);
      op.row_offsets(b, kv_begin, offsets.data());
      // The last tile's missing keys repeat the last one; their scores are never read.
      std::fill(offsets.begin() + len, offsets.end(), offsets[len - 1]);
      for (int64_t kv = kv_begin; kv < kv_begin + heads_per_task; ++kv) {
        const int64_t head_offset = (kv - kv_begin) * HEAD_DIM;
        const int64_t h0 = kv * group;
        for (int64_t g = 0; g < group; ++g) {
          const T* q_head = op.q + b * op.q_seq_stride + (h0 + g) * op.q_head_stride;
          for (int64_t d = 0; d < HEAD_DIM; ++d) {
            queries[g * HEAD_DIM + d] = to_float(q_head[d]) * op.scale;
          }
        }
        // Scores, 8 keys at a time for every query head of the group: the keys' rows come
        // from memory for the task's first KV head (kRowsAhead tokens requested ahead),
        // from L2 for the others, and from L1 for every query head after the first.
        if (kv == kv_begin) {
          for (int64_t t = 0; t < std::min(kRowsAhead, len); ++t) {
            prefetch_row(op.k + offsets[t], width);
          }
        }
        for (int64_t t0 = 0; t0 < padded; t0 += kKeys) {
          const T* keys[kKeys];
          for (int64_t j = 0; j < kKeys; ++j) keys[j] = op.k + offsets[t0 + j] + head_offset;
          if (kv == kv_begin) {
            for (int64_t j = t0 + kRowsAhead; j < std::min(t0 + kRowsAhead + kKeys, len); ++j) {
              prefetch_row(op.k + offsets[j], width);
            }
          }
          for (int64_t g = 0; g < group; ++g) {
            _mm256_storeu_ps(scores.data() + g * padded + t0,
                             score_keys<T, HEAD_DIM>(queries.data() + g * HEAD_DIM, keys));
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          inv_totals[g] = 1.f / exp_shifted(scores.data() + g * padded, len);
        }
        // Values: each pass adds 32 dimensions for up to kHeadsAtOnce query heads, so that
        // a value row read once serves them all.
        std::fill(sums.begin(), sums.end(), 0.f);
        accumulate_values_all<T, HEAD_DIM>(op.v + head_offset, offsets.data(), 0, len,
                                           scores.data(), padded, group, sums.data(),
                                           kv == kv_begin, width);
        store_scaled<T, HEAD_DIM>(sums.data(), inv_totals.data(), group,
                                  op.out + (b * op.num_heads + h0) * HEAD_DIM);
      }
    }
  });
}

#endif  // AVX2 and FMA

// q [B, H, D] (rows of D contiguous); key_cache/value_cache [num_blocks, block_size,
// kv_heads, D] (contiguous);
// block_tables [B, max_blocks] int32; seq_lens [B] int32 (each >= 1) -> [B, H, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4, "q [B, H, D], cache [N, bs, kvh, D]");
  TORCH_CHECK(q.stride(2) == 1 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "q's last dimension and the caches must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == q.scalar_type() &&
                  value_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous(),
              "block_tables rows and seq_lens must be contiguous");
  TORCH_CHECK(q.size(1) % key_cache.size(2) == 0 && q.size(2) == key_cache.size(3),
              "heads must be a multiple of kv_heads, head dims equal");
  at::Tensor out = at::empty(q.sizes(), q.options());
  TORCH_CHECK(q.size(2) <= kMaxHeadDim, "head_dim above ", kMaxHeadDim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                  "paged_decode_attention", [&] {
    const DecodeOperands<scalar_t> op(q, key_cache, value_cache, block_tables, seq_lens,
                                      scale, out);
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>) {
      if (op.head_dim == 64) return decode_attention_avx2<scalar_t, 64>(op);
      if (op.head_dim == 128) return decode_attention_avx2<scalar_t, 128>(op);
    }
#endif
    switch (op.head_dim) {
      case 64:
        return decode_attention_kernel<scalar_t, 64>(op);
      case 128:
        return decode_attention_kernel<scalar_t, 128>(op);
      default:
        return decode_attention_kernel<scalar_t, 0>(op);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def("paged_decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
