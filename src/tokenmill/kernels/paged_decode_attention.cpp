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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dtype_conversion.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using tokenmill::from_float;
using tokenmill::to_float;

// Tokens ahead whose rows are requested before use: blocks lie anywhere in the cache, so
// the hardware prefetcher cannot guess the next block.
constexpr int64_t kPrefetchAhead = 4;

template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) {
    __builtin_prefetch(bytes + i);
  }
}

constexpr int64_t kMaxHeadDim = 256;

// HEAD_DIM > 0: the head size known at compile time (its loops unroll and the per-head
// accumulators stay in registers); 0: read from the tensors (any size up to kMaxHeadDim).
template <typename T, int64_t HEAD_DIM>
void decode_attention_kernel(const at::Tensor& q, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1);
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : q.size(2);
  constexpr int64_t kBuffer = HEAD_DIM > 0 ? HEAD_DIM : kMaxHeadDim;
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t block_stride = key_cache.stride(0), token_stride = key_cache.stride(1);
  const int64_t table_stride = block_tables.stride(0);
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = key_cache.data_ptr<T>();
  const T* v_ptr = value_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  // A task is a sequence's KV heads [kv_begin, kv_end): all of them when there are enough
  // sequences to keep every thread busy, else one, so that a few long sequences still
  // spread over the threads.
  const int64_t heads_per_task =
      num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / heads_per_task;

  at::parallel_for(0, num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> offsets;  // each token's row in either cache
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_seq;
      const int64_t kv_begin = (task % tasks_per_seq) * heads_per_task;
      const int64_t h_begin = kv_begin * group, h_end = (kv_begin + heads_per_task) * group;
      const int64_t width = heads_per_task * head_dim;  // elements of a token's K or V row
      const int64_t len = lens[b];
      const int32_t* table = tables + b * table_stride;
      scores.resize(num_heads * len);
      offsets.resize(len);
      for (int64_t t = 0, block = 0; t < len; ++block) {
        const int64_t base = table[block] * block_stride + kv_begin * head_dim;
        for (int64_t i = 0; i < block_size && t < len; ++i, ++t) {
          offsets[t] = base + i * token_stride;
        }
      }
      // Head by head: the first head of a KV group reads its rows from memory (prefetched
      // ahead), the others find them in cache.
      for (int64_t h = h_begin; h < h_end; ++h) {
        const bool first = (h - h_begin) % group == 0;
        const int64_t head_offset = (h / group - kv_begin) * head_dim;
        const T* q_head = q_ptr + b * q_seq_stride + h * q_head_stride;
        float qh[kBuffer];
        for (int64_t d = 0; d < head_dim; ++d) qh[d] = to_float(q_head[d]) * fscale;
        float* s = scores.data() + h * len;
        for (int64_t t = 0; t < len; ++t) {
          if (first && t + kPrefetchAhead < len) {
            prefetch_row(k_ptr + offsets[t + kPrefetchAhead], width);
          }
          const T* key = k_ptr + offsets[t] + head_offset;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * to_float(key[d]);
          s[t] = dot;
        }
        const float peak = *std::max_element(s, s + len);
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - peak);
          total += s[t];
        }
        float acc[kBuffer] = {};
        for (int64_t t = 0; t < len; ++t) {
          if (first && t + kPrefetchAhead < len) {
            prefetch_row(v_ptr + offsets[t + kPrefetchAhead], width);
          }
          const T* value = v_ptr + offsets[t] + head_offset;
          const float w = s[t];
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) acc[d] += w * to_float(value[d]);
        }
        const float inv = 1.f / total;
        T* out_head = out_ptr + (b * num_heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) out_head[d] = from_float<T>(acc[d] * inv);
      }
    }
  });
}

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
    switch (q.size(2)) {
      case 64:
        decode_attention_kernel<scalar_t, 64>(q, key_cache, value_cache, block_tables,
                                              seq_lens, scale, out);
        break;
      case 128:
        decode_attention_kernel<scalar_t, 128>(q, key_cache, value_cache, block_tables,
                                               seq_lens, scale, out);
        break;
      default:
        decode_attention_kernel<scalar_t, 0>(q, key_cache, value_cache, block_tables,
                                             seq_lens, scale, out);
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
