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
// With a sliding window W > 0, sequence b's keys are only its last W (len_b - W .. len_b
// - 1): the kernel starts at that key's block and reads nothing before it.
//
// On AVX2 hosts float32 and bfloat16 heads of 64, 128 or 256 take a register-blocked path
// (decode_attention_avx2): a KV head at a time, scores for 8 keys at once folded without a
// horizontal sum per key, and each value row read once for up to 3 query heads. With
// AVX-512 (decode_attention_avx512) the same plan in 16 lanes, and each key row too is
// read and widened once for up to 3 query heads; bfloat16 heads on a CPU with AVX512-BF16
// are scored with VDPBF16PS on the keys' own bfloat16 pairs (exact products, float32
// sums, the scale applied to the sum), without widening them.
//
// An 8-bit cache (kv_int8_rows.h: each row's int8 values, then its float32 scale) is read
// in place: on every path each key's scores and each value's weights are times its row's
// scale. With AVX512-VNNI its keys are scored as integers: each query head is rounded to
// an 8-bit row too, and VPDPBUSD multiplies 64 byte pairs an instruction, 16 keys at once
// with their rows transposed so that no sum is horizontal (score_int8_keys).
//
// Both register-blocked paths take their tasks in batches (thread_batches.h) and, while
// computing a task, request the next task's K and V rows into L2 (NextTaskRows), so that
// memory streams during the arithmetic.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "avx2_lanes.h"
#include "avx512_lanes.h"
#include "dtype_conversion.h"
#include "kv_int8_rows.h"
#include "thread_batches.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
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

// The cache's element type C: T itself, or int8_t for an 8-bit cache, whose (token, KV
// head) rows hold head_dim values and then their float32 scale (row_width = head_dim + 4
// bytes, kv_int8_rows.h).
template <typename C>
constexpr bool kInt8Cache = std::is_same_v<C, int8_t>;

// The scale of the cache row starting at row (head_dim values): 1 but in an 8-bit cache.
template <typename C>
inline float row_scale(const C* row, int64_t head_dim) {
  if constexpr (kInt8Cache<C>) {
    return tokenmill::int8_row_scale(row, head_dim);
  } else {
    return 1.f;
  }
}

inline float to_float(int8_t x) { return static_cast<float>(x); }

// What both kernels read, from paged_decode_attention's checked tensors, and how they
// split the work: a task is a sequence's KV heads [kv_begin, kv_begin + heads_per_task):
// all of them when there are enough sequences to keep every thread busy, else one, so that
// a few long sequences still spread over the threads.
template <typename T, typename C>
struct DecodeOperands {
  int64_t num_seqs, num_heads, num_kv_heads, group, head_dim, row_width;
  int64_t block_size, block_stride, token_stride, table_stride, q_seq_stride, q_head_stride;
  const T* q;
  const C* k;
  const C* v;
  const int32_t* tables;
  const int32_t* lens;
  T* out;
  float scale;
  int64_t window;  // > 0: each query sees its sequence's last `window` keys only
  int64_t heads_per_task, tasks_per_seq;

  DecodeOperands(const at::Tensor& q_, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens, double scale_, int64_t window_, at::Tensor& out_)
      : num_seqs(q_.size(0)), num_heads(q_.size(1)), num_kv_heads(key_cache.size(2)),
        group(num_heads / num_kv_heads), head_dim(q_.size(2)), row_width(key_cache.size(3)),
        block_size(key_cache.size(1)), block_stride(key_cache.stride(0)),
        token_stride(key_cache.stride(1)), table_stride(block_tables.stride(0)),
        q_seq_stride(q_.stride(0)), q_head_stride(q_.stride(1)), q(q_.data_ptr<T>()),
        k(key_cache.data_ptr<C>()), v(value_cache.data_ptr<C>()),
        tables(block_tables.data_ptr<int32_t>()), lens(seq_lens.data_ptr<int32_t>()),
        out(out_.data_ptr<T>()), scale(static_cast<float>(scale_)), window(window_),
        heads_per_task(num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1),
        tasks_per_seq(num_kv_heads / heads_per_task) {}

  // The first key sequence b's query sees: 0, or the window's first.
  int64_t first_key(int64_t b) const {
    return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
  }

  // The keys sequence b's query sees: first_key(b) .. lens[b] - 1.
  int64_t visible_len(int64_t b) const { return lens[b] - first_key(b); }

  // offsets[t] for t < visible_len(b): where visible key t's row of sequence b's KV heads
  // from kv_begin starts in either cache. Only the blocks holding visible keys are read.
  void row_offsets(int64_t b, int64_t kv_begin, int64_t* offsets) const {
    const int32_t* table = tables + b * table_stride;
    const int64_t first = first_key(b);
    for (int64_t t = first, block = first / block_size; t < lens[b]; ++block) {
      const int64_t base = table[block] * block_stride + kv_begin * row_width;
      for (int64_t i = t % block_size; i < block_size && t < lens[b]; ++i, ++t) {
        offsets[t - first] = base + i * token_stride;
      }
    }
  }
};

// HEAD_DIM > 0: the head size known at compile time (its loops unroll and the per-head
// accumulators stay in registers); 0: read from the tensors (any size up to kMaxHeadDim).
template <typename T, typename C, int64_t HEAD_DIM>
void decode_attention_kernel(const DecodeOperands<T, C>& op) {
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
      const int64_t width = heads_per_task * op.row_width;  // a token's K or V row
      const int64_t len = op.visible_len(b);
      scores.resize(op.num_heads * len);
      offsets.resize(len);
      op.row_offsets(b, kv_begin, offsets.data());
      // Head by head: the first head of a KV group reads its rows from memory (prefetched
      // ahead), the others find them in cache.
      for (int64_t h = h_begin; h < h_end; ++h) {
        const bool first = (h - h_begin) % group == 0;
        const int64_t head_offset = (h / group - kv_begin) * op.row_width;
        const T* q_head = op.q + b * op.q_seq_stride + h * op.q_head_stride;
        float qh[kBuffer];
        for (int64_t d = 0; d < head_dim; ++d) qh[d] = to_float(q_head[d]) * op.scale;
        float* s = scores.data() + h * len;
        for (int64_t t = 0; t < len; ++t) {
          if (first && t + kPrefetchAhead < len) {
            prefetch_row(op.k + offsets[t + kPrefetchAhead], width);
          }
          const C* key = op.k + offsets[t] + head_offset;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * to_float(key[d]);
          s[t] = dot * row_scale(key, head_dim);
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
            prefetch_row(op.v + offsets[t + kPrefetchAhead], width);
          }
          const C* value = op.v + offsets[t] + head_offset;
          const float w = s[t] * row_scale(value, head_dim);
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

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline __m256 load8(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// Rounded in registers: a scalar loop over the lanes here made GCC keep the value
// passes' accumulators in memory.
inline void store8(at::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), tokenmill::round_to_bf16(v));
}

// Lane j = the sum of the 8 lanes of v[j].
inline __m256 fold8(const __m256 (&v)[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

constexpr int64_t kKeys = 8;          // keys scored at once (one register of scores)
constexpr int64_t kValueChunks = 4;   // registers of a value row added per pass
constexpr int64_t kHeadsAtOnce = 3;   // query heads sharing each value (AVX-512: key) row read
// Tokens ahead whose whole K or V rows (every KV head of the task) are requested while
// the task's first KV head is computed, for a task whose rows no earlier task requested
// (the first of a batch); the other KV heads find them in L2.
constexpr int64_t kRowsAhead = 16;

// Lane j: the scale of key row keys[j] (1 but in an 8-bit cache).
template <int64_t HEAD_DIM, typename C>
inline __m256 key_scales(const C* const (&keys)[kKeys]) {
  if constexpr (kInt8Cache<C>) {
    alignas(32) float scales[kKeys];
    for (int64_t j = 0; j < kKeys; ++j) scales[j] = row_scale(keys[j], HEAD_DIM);
    return _mm256_load_ps(scales);
  } else {
    return _mm256_set1_ps(1.f);
  }
}

// One task's keys: its sequence b, first KV head, visible keys (len) and those rounded up
// to whole tiles of keys scored at once (padded); offsets[t] = key t's row of the first KV
// head in either cache, the last tile's missing keys repeating the last key (their scores
// are never read).
struct TaskKeys {
  int64_t b, kv_begin, len, padded;
};

template <typename T, typename C>
TaskKeys task_keys(const DecodeOperands<T, C>& op, int64_t task, int64_t tile,
                   std::vector<int64_t>& offsets) {
  const int64_t b = task / op.tasks_per_seq;
  const int64_t kv_begin = (task % op.tasks_per_seq) * op.heads_per_task;
  const int64_t len = op.visible_len(b);
  const int64_t padded = (len + tile - 1) / tile * tile;
  offsets.resize(padded);
  op.row_offsets(b, kv_begin, offsets.data());
  std::fill(offsets.begin() + len, offsets.end(), offsets[len - 1]);
  return {b, kv_begin, len, padded};
}

// The next task's K and V rows (every KV head of it), requested into L2 a few cache lines
// at a time while the current task computes, so that memory streams during its
// arithmetic rather than only while its first KV head waits for its own rows.
// ``reset`` aims the requests at a task (len 0: none) and spreads them over ``calls``
// calls of ``request``.
template <typename C>
class NextTaskRows {
 public:
  template <typename T>
  NextTaskRows(const DecodeOperands<T, C>& op, int64_t width)
      : k_(reinterpret_cast<const char*>(op.k)), v_(reinterpret_cast<const char*>(op.v)),
        lines_per_row_((width * static_cast<int64_t>(sizeof(C)) + 63) / 64) {}

  void reset(const int64_t* offsets, int64_t len, int64_t calls) {
    offsets_ = offsets;
    len_ = len;
    token_ = line_ = 0;
    cache_ = k_;
    per_call_ = (2 * len * lines_per_row_ + calls - 1) / std::max<int64_t>(calls, 1);
  }

  inline void request() {
    for (int64_t i = 0; i < per_call_ && token_ < len_; ++i) {
      _mm_prefetch(cache_ + offsets_[token_] * static_cast<int64_t>(sizeof(C)) + 64 * line_,
                   _MM_HINT_T1);
      if (++line_ < lines_per_row_) continue;
      line_ = 0;
      if (++token_ == len_ && cache_ == k_) {
        cache_ = v_;
        token_ = 0;
      }
    }
  }

 private:
  const char* k_;
  const char* v_;
  int64_t lines_per_row_;
  const int64_t* offsets_ = nullptr;
  int64_t len_ = 0, token_ = 0, line_ = 0, per_call_ = 0;
  const char* cache_ = nullptr;
};

// Runs body(task, offsets, ahead, requested) for the tasks [begin, end) in order (offsets:
// the task's rows, as task_keys, in tiles of `tile` keys), with ahead aimed at the next
// task's rows: the next of the range, then ``following`` (a task this thread computes
// next, or -1); requested: whether a task before it in the range requested its rows. The
// body calls ahead.request() calls_per_tile times per key tile and value_passes times per
// value row, for each of its KV heads: the next task's rows are requested over the whole
// task.
template <typename T, typename C, typename Body>
void tasks_in_order(const DecodeOperands<T, C>& op, int64_t begin, int64_t end, int64_t following,
                    int64_t width, int64_t tile, int64_t calls_per_tile, int64_t value_passes,
                    Body body) {
  std::vector<int64_t> offsets, next_offsets;
  NextTaskRows<C> ahead(op, width);
  TaskKeys task = task_keys(op, begin, tile, offsets);
  for (int64_t index = begin; index < end; ++index) {
    const bool requested = index > begin;
    const int64_t next_index = index + 1 < end ? index + 1 : following;
    const TaskKeys next = next_index >= 0 ? task_keys(op, next_index, tile, next_offsets)
                                          : TaskKeys{0, 0, 0, 0};
    ahead.reset(next_offsets.data(), next.len,
                op.heads_per_task *
                    (calls_per_tile * task.padded / tile + value_passes * task.len));
    body(task, offsets.data(), ahead, requested);
    std::swap(offsets, next_offsets);
    task = next;
  }
}

// queries[g * head_dim + d] = the scaled float32 query of head h0 + g of sequence b.
template <typename T, typename C>
void scaled_queries(const DecodeOperands<T, C>& op, int64_t b, int64_t h0, int64_t head_dim,
                    float* queries) {
  for (int64_t g = 0; g < op.group; ++g) {
    const T* q_head = op.q + b * op.q_seq_stride + (h0 + g) * op.q_head_stride;
    for (int64_t d = 0; d < head_dim; ++d) {
      queries[g * head_dim + d] = to_float(q_head[d]) * op.scale;
    }
  }
}

// queries[g * head_dim + d] = the bfloat16 bits of query head h0 + g of sequence b, unscaled.
template <typename T, typename C>
void raw_queries(const DecodeOperands<T, C>& op, int64_t b, int64_t h0, int64_t head_dim,
                 uint16_t* queries) {
  for (int64_t g = 0; g < op.group; ++g) {
    std::memcpy(queries + g * head_dim, op.q + b * op.q_seq_stride + (h0 + g) * op.q_head_stride,
                head_dim * sizeof(uint16_t));
  }
}

// Each of `rows` score rows (len keys, `stride` apart) becomes exp(score - the row's
// maximum), and inv_totals[row] 1 / the row's sum.
inline void exp_rows(float* scores, int64_t rows, int64_t stride, int64_t len,
                     float* inv_totals) {
  for (int64_t row = 0; row < rows; ++row) {
    float* s = scores + row * stride;
    const float peak = *std::max_element(s, s + len);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = std::exp(s[t] - peak);
      total += s[t];
    }
    inv_totals[row] = 1.f / total;
  }
}

// For NH query heads g: out[g * out_stride + d] = sum_t scores[g * score_stride + t] *
// V[t, d] * inv_totals[g], over the 32 dimensions d of one pass, V row t at
// values + offsets[t] (in an 8-bit cache, times its scale, scale_offset elements further);
// with prefetch, rows of width elements are requested ahead.
struct AddValues8 {
template <typename T, typename C, int NH>
static void run(const C* values, const int64_t* offsets, int64_t scale_offset, int64_t len,
                const float* scores, int64_t score_stride, const float* inv_totals,
                T* out, int64_t out_stride, bool prefetch, int64_t width,
                NextTaskRows<C>& ahead) {
  __m256 acc[NH][kValueChunks];
  for (int g = 0; g < NH; ++g) {
    for (int c = 0; c < kValueChunks; ++c) acc[g][c] = _mm256_setzero_ps();
  }
  if (prefetch) {
    for (int64_t t = 0; t < std::min(kRowsAhead, len); ++t) {
      prefetch_row(values + offsets[t], width);
    }
  }
  for (int64_t t = 0; t < len; ++t) {
    if (prefetch && t + kRowsAhead < len) prefetch_row(values + offsets[t + kRowsAhead], width);
    ahead.request();
    const C* row = values + offsets[t];
    const float row_weight = row_scale(row, scale_offset);
    __m256 w[NH];
    for (int g = 0; g < NH; ++g) w[g] = _mm256_set1_ps(scores[g * score_stride + t] * row_weight);
    for (int c = 0; c < kValueChunks; ++c) {
      const __m256 v = load8(row + 8 * c);
      for (int g = 0; g < NH; ++g) acc[g][c] = _mm256_fmadd_ps(w[g], v, acc[g][c]);
    }
  }
  for (int g = 0; g < NH; ++g) {
    const __m256 inv = _mm256_set1_ps(inv_totals[g]);
    for (int c = 0; c < kValueChunks; ++c) {
      store8(out + g * out_stride + 8 * c, _mm256_mul_ps(acc[g][c], inv));
    }
  }
}
};

// Values: each pass adds DIMS dimensions for up to kHeadsAtOnce query heads
// (Adder::run<T, C, heads>), so that a value row read once serves them all; with first (the
// task's first KV head, its rows not requested by an earlier task) the first pass requests
// the rows of all its KV heads ahead.
template <typename Adder, int64_t DIMS, int64_t HEAD_DIM, typename T, typename C>
void add_value_passes(const DecodeOperands<T, C>& op, const TaskKeys& task, int64_t kv,
                      const float* scores, const float* inv_totals, const int64_t* offsets,
                      bool first, NextTaskRows<C>& ahead) {
  const int64_t group = op.group, h0 = kv * group, width = op.heads_per_task * op.row_width;
  const C* values = op.v + (kv - task.kv_begin) * op.row_width;
  for (int64_t dim0 = 0; dim0 < HEAD_DIM; dim0 += DIMS) {
    for (int64_t g0 = 0; g0 < group; g0 += kHeadsAtOnce) {
      const int64_t heads = std::min(kHeadsAtOnce, group - g0);
      const bool prefetch = first && dim0 == 0 && g0 == 0;
      const float* s = scores + g0 * task.padded;
      T* o = op.out + (task.b * op.num_heads + h0 + g0) * HEAD_DIM + dim0;
      if (heads == 3) {
        Adder::template run<T, C, 3>(values + dim0, offsets, HEAD_DIM - dim0, task.len, s,
                                     task.padded, inv_totals + g0, o, HEAD_DIM, prefetch,
                                     width, ahead);
      } else if (heads == 2) {
        Adder::template run<T, C, 2>(values + dim0, offsets, HEAD_DIM - dim0, task.len, s,
                                     task.padded, inv_totals + g0, o, HEAD_DIM, prefetch,
                                     width, ahead);
      } else {
        Adder::template run<T, C, 1>(values + dim0, offsets, HEAD_DIM - dim0, task.len, s,
                                     task.padded, inv_totals + g0, o, HEAD_DIM, prefetch,
                                     width, ahead);
      }
    }
  }
}

// The task's first KV head requests its first kRowsAhead key rows (of all its KV heads).
template <typename T, typename C>
void prefetch_first_keys(const DecodeOperands<T, C>& op, const TaskKeys& task,
                         const int64_t* offsets, int64_t width) {
  for (int64_t t = 0; t < std::min(kRowsAhead, task.len); ++t) {
    prefetch_row(op.k + offsets[t], width);
  }
}

template <typename T, typename C, int64_t HEAD_DIM>
void decode_attention_avx2(const DecodeOperands<T, C>& op) {
  static_assert(HEAD_DIM % (8 * kValueChunks) == 0, "head size a multiple of 32");
  constexpr int64_t kChunks = HEAD_DIM / 8;
  const int64_t group = op.group, heads_per_task = op.heads_per_task;
  const int64_t width = heads_per_task * op.row_width;  // elements of a token's K or V row

  const int64_t head_groups = (group + kHeadsAtOnce - 1) / kHeadsAtOnce;
  tokenmill::parallel_batches(op.num_seqs * op.tasks_per_seq, [&](int64_t begin, int64_t end,
                                                                  int64_t following) {
    std::vector<float> scores, queries(group * HEAD_DIM), inv_totals(group);
    tasks_in_order(op, begin, end, following, width, kKeys, 1,
                   HEAD_DIM / (8 * kValueChunks) * head_groups,
                   [&](const TaskKeys& task, const int64_t* offsets, NextTaskRows<C>& ahead,
                       bool requested) {
      const int64_t len = task.len, padded = task.padded;
      scores.resize(group * padded);
      for (int64_t kv = task.kv_begin; kv < task.kv_begin + heads_per_task; ++kv) {
        const int64_t head_offset = (kv - task.kv_begin) * op.row_width;
        const bool first = !requested && kv == task.kv_begin;
        scaled_queries(op, task.b, kv * group, HEAD_DIM, queries.data());
        // Scores, 8 keys at a time for every query head of the group: the keys' rows come
        // from L2 (requested by the previous task, or kRowsAhead tokens ahead by the first
        // KV head), and from L1 for every query head after the first.
        if (first) prefetch_first_keys(op, task, offsets, width);
        for (int64_t t0 = 0; t0 < padded; t0 += kKeys) {
          ahead.request();
          const C* keys[kKeys];
          for (int64_t j = 0; j < kKeys; ++j) keys[j] = op.k + offsets[t0 + j] + head_offset;
          if (first) {
            for (int64_t j = t0 + kRowsAhead; j < std::min(t0 + kRowsAhead + kKeys, len); ++j) {
              prefetch_row(op.k + offsets[j], width);
            }
          }
          for (int64_t g = 0; g < group; ++g) {
            const float* qh = queries.data() + g * HEAD_DIM;
            __m256 acc[kKeys];
            for (int64_t j = 0; j < kKeys; ++j) acc[j] = _mm256_setzero_ps();
            for (int64_t c = 0; c < kChunks; ++c) {
              const __m256 qv = _mm256_loadu_ps(qh + 8 * c);
              for (int64_t j = 0; j < kKeys; ++j) {
                acc[j] = _mm256_fmadd_ps(qv, load8(keys[j] + 8 * c), acc[j]);
              }
            }
            _mm256_storeu_ps(scores.data() + g * padded + t0,
                             _mm256_mul_ps(fold8(acc), key_scales<HEAD_DIM>(keys)));
          }
        }
        exp_rows(scores.data(), group, padded, len, inv_totals.data());
        add_value_passes<AddValues8, 8 * kValueChunks, HEAD_DIM>(
            op, task, kv, scores.data(), inv_totals.data(), offsets, first, ahead);
      }
    });
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512 load16(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// (In registers, as store8.)
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), tokenmill::round_to_bf16(v));
}

inline __m256 add_halves(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

constexpr int64_t kDimsPerPass = 64;  // value dimensions added per pass (4 registers)

// scores[g * score_stride + j] = q_g . K[keys[j]] for the NH query heads g at queries +
// g * HEAD_DIM (scaled) and the kKeys keys keys[j]: each key's row is read and converted
// once for all NH heads (NH x kKeys accumulators stay in registers).
template <typename C, int64_t HEAD_DIM, int NH>
inline void score_keys(const C* const (&keys)[kKeys], const float* queries, float* scores,
                       int64_t score_stride) {
  __m512 acc[NH][kKeys];
  for (int g = 0; g < NH; ++g) {
    for (int64_t j = 0; j < kKeys; ++j) acc[g][j] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < HEAD_DIM / 16; ++c) {
    for (int64_t j = 0; j < kKeys; ++j) {
      const __m512 k = load16(keys[j] + 16 * c);
      for (int g = 0; g < NH; ++g) {
        acc[g][j] = _mm512_fmadd_ps(_mm512_loadu_ps(queries + g * HEAD_DIM + 16 * c), k,
                                    acc[g][j]);
      }
    }
  }
  const __m256 scales = key_scales<HEAD_DIM>(keys);
  for (int g = 0; g < NH; ++g) {
    __m256 halves[kKeys];
    for (int64_t j = 0; j < kKeys; ++j) halves[j] = add_halves(acc[g][j]);
    _mm256_storeu_ps(scores + g * score_stride, _mm256_mul_ps(fold8(halves), scales));
  }
}

#if defined(__AVX512BF16__)
constexpr bool kScorePairs = true;

// score_keys for bfloat16 heads with VDPBF16PS: queries holds the NH heads' unscaled
// bfloat16 values (HEAD_DIM apart); each instruction multiplies 16 pairs of query and key
// values exactly and adds them to float32 sums (no widening of the keys, half the
// instructions of the FMA form), and the folded sums are times scale.
template <int64_t HEAD_DIM, int NH>
inline void score_key_pairs(const at::BFloat16* const (&keys)[kKeys], const uint16_t* queries,
                            float scale, float* scores, int64_t score_stride) {
  constexpr int64_t kChunks = HEAD_DIM / 32;
  __m512 acc[NH][kKeys];
  for (int g = 0; g < NH; ++g) {
    for (int64_t j = 0; j < kKeys; ++j) acc[g][j] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < kChunks; ++c) {
    __m512bh q[NH];
    for (int g = 0; g < NH; ++g) {
      q[g] = (__m512bh)_mm512_loadu_si512(queries + g * HEAD_DIM + 32 * c);
    }
    for (int64_t j = 0; j < kKeys; ++j) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(keys[j] + 32 * c);
      for (int g = 0; g < NH; ++g) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], q[g], k);
    }
  }
  const __m256 scales = _mm256_set1_ps(scale);
  for (int g = 0; g < NH; ++g) {
    __m256 halves[kKeys];
    for (int64_t j = 0; j < kKeys; ++j) halves[j] = add_halves(acc[g][j]);
    _mm256_storeu_ps(scores + g * score_stride, _mm256_mul_ps(fold8(halves), scales));
  }
}
#else
constexpr bool kScorePairs = false;
#endif

// (The build condition of vnni_linear.cpp too: KernelCapabilities.int8_kv_integer_scores.)
#if defined(__AVX512VNNI__)
constexpr bool kIntegerScores = true;

// bytes[g * (head_dim + 4) ...]: query head h0 + g of sequence b rounded to an 8-bit row
// (kv_int8_rows.h: its int8 values, then its scale); offsets[g]: 128 * the sum of its
// values (what VPDPBUSD adds to a dot product with keys offset by 128).
template <typename T, typename C>
void int8_queries(const DecodeOperands<T, C>& op, int64_t b, int64_t h0, int64_t head_dim,
                  int8_t* bytes, float* offsets) {
  for (int64_t g = 0; g < op.group; ++g) {
    int8_t* row = bytes + g * (head_dim + 4);
    tokenmill::store_int8_row(op.q + b * op.q_seq_stride + (h0 + g) * op.q_head_stride,
                              head_dim, row);
    int32_t sum = 0;
    for (int64_t d = 0; d < head_dim; ++d) sum += row[d];
    offsets[g] = 128.f * static_cast<float>(sum);
  }
}

constexpr int64_t kIntegerKeys = 16;  // keys scored at once as integers (a register)

// Transposes 16 registers of 16 dwords: afterwards lane j of r[i] is what lane i of r[j]
// was. (Two interleaving stages leave r[4k + m]'s 128-bit lane L holding dword 4L + m of
// rows 4k .. 4k + 3; two 128-bit shuffles per output gather the four lanes of a dword.)
inline void transpose_dwords(__m512i (&r)[16]) {
  __m512i t[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {
    r[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    r[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    r[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    r[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xEE);
    r[m] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + m] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + m] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

inline int32_t load_dword(const void* p) {
  int32_t x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

// scores[g * score_stride + j] for the NH query heads rounded to 8-bit rows (int8_queries:
// queries, offsets) and the kIntegerKeys 8-bit key rows keys[j], with VPDPBUSD: 64 bytes of
// each key a step, transposed so that lane j of register i holds key j's bytes 4i .. 4i + 3
// and each instruction multiplies them with query bytes 4i .. 4i + 3 in every lane (the
// keys' bytes offset by 128, as unsigned, times the queries' signed ones). The sums are
// exact integers (below 2^24 in float32 too); less the offsets, times both rows' scales
// and score_scale, they are the scores, lane j key j's (no horizontal sums).
template <int64_t HEAD_DIM, int NH>
inline void score_int8_keys(const int8_t* const (&keys)[kIntegerKeys], const int8_t* queries,
                            const float* offsets, float score_scale, float* scores,
                            int64_t score_stride) {
  constexpr int64_t kRow = HEAD_DIM + 4;
  __m512i acc[NH];
  for (int g = 0; g < NH; ++g) acc[g] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(-128);
  for (int64_t c = 0; c < HEAD_DIM / 64; ++c) {
    __m512i r[kIntegerKeys];
    for (int64_t j = 0; j < kIntegerKeys; ++j) {
      r[j] = _mm512_xor_si512(_mm512_loadu_si512(keys[j] + 64 * c), flip);
    }
    transpose_dwords(r);
    for (int64_t i = 0; i < 16; ++i) {
      for (int g = 0; g < NH; ++g) {
        const __m512i q = _mm512_set1_epi32(load_dword(queries + g * kRow + 64 * c + 4 * i));
        acc[g] = _mm512_dpbusd_epi32(acc[g], r[i], q);
      }
    }
  }
  alignas(64) float key_scale[kIntegerKeys];
  for (int64_t j = 0; j < kIntegerKeys; ++j) {
    key_scale[j] = tokenmill::int8_row_scale(keys[j], HEAD_DIM);
  }
  const __m512 key_scales16 = _mm512_load_ps(key_scale);
  for (int g = 0; g < NH; ++g) {
    const float scale = tokenmill::int8_row_scale(queries + g * kRow, HEAD_DIM) * score_scale;
    const __m512 dots = _mm512_sub_ps(_mm512_cvtepi32_ps(acc[g]), _mm512_set1_ps(offsets[g]));
    _mm512_storeu_ps(scores + g * score_stride,
                     _mm512_mul_ps(dots, _mm512_mul_ps(key_scales16, _mm512_set1_ps(scale))));
  }
}
#else
constexpr bool kIntegerScores = false;
#endif

// AddValues8 with 16-lane registers: kDimsPerPass dimensions of NH query heads per pass.
struct AddValues16 {
template <typename T, typename C, int NH>
static void run(const C* values, const int64_t* offsets, int64_t scale_offset, int64_t len,
                const float* scores, int64_t score_stride, const float* inv_totals,
                T* out, int64_t out_stride, bool prefetch, int64_t width,
                NextTaskRows<C>& ahead) {
  constexpr int kChunks = kDimsPerPass / 16;
  __m512 acc[NH][kChunks];
  for (int g = 0; g < NH; ++g) {
    for (int c = 0; c < kChunks; ++c) acc[g][c] = _mm512_setzero_ps();
  }
  if (prefetch) {
    for (int64_t t = 0; t < std::min(kRowsAhead, len); ++t) {
      prefetch_row(values + offsets[t], width);
    }
  }
  for (int64_t t = 0; t < len; ++t) {
    if (prefetch && t + kRowsAhead < len) prefetch_row(values + offsets[t + kRowsAhead], width);
    ahead.request();
    const C* row = values + offsets[t];
    const float row_weight = row_scale(row, scale_offset);
    __m512 w[NH];
    for (int g = 0; g < NH; ++g) w[g] = _mm512_set1_ps(scores[g * score_stride + t] * row_weight);
    for (int c = 0; c < kChunks; ++c) {
      const __m512 v = load16(row + 16 * c);
      for (int g = 0; g < NH; ++g) acc[g][c] = _mm512_fmadd_ps(w[g], v, acc[g][c]);
    }
  }
  for (int g = 0; g < NH; ++g) {
    const __m512 inv = _mm512_set1_ps(inv_totals[g]);
    for (int c = 0; c < kChunks; ++c) {
      store16(out + g * out_stride + 16 * c, _mm512_mul_ps(acc[g][c], inv));
    }
  }
}
};

// decode_attention_avx2's plan with AVX-512 registers: a KV head's key rows are read once
// per kHeadsAtOnce query heads (not once per query head), 16 lanes per instruction.
template <typename T, typename C, int64_t HEAD_DIM>
void decode_attention_avx512(const DecodeOperands<T, C>& op) {
  static_assert(HEAD_DIM % kDimsPerPass == 0, "head size a multiple of 64");
  const int64_t group = op.group, heads_per_task = op.heads_per_task;
  const int64_t width = heads_per_task * op.row_width;  // elements of a token's K or V row

  const int64_t head_groups = (group + kHeadsAtOnce - 1) / kHeadsAtOnce;
  tokenmill::parallel_batches(op.num_seqs * op.tasks_per_seq, [&](int64_t begin, int64_t end,
                                                                  int64_t following) {
    constexpr bool kPairs = kScorePairs && std::is_same_v<C, at::BFloat16>;
    constexpr bool kIntegers = kIntegerScores && kInt8Cache<C>;
    constexpr int64_t kTile = kIntegers ? kIntegerKeys : kKeys;  // keys scored at once
    // the group's queries: scaled float32 (FMA scores), their bfloat16 bits (pairs) or
    // 8-bit rows (integers)
    std::vector<float> scores, queries(kPairs || kIntegers ? 0 : group * HEAD_DIM);
    std::vector<float> inv_totals(group), query_offsets(kIntegers ? group : 0);
    std::vector<uint16_t> raw(kPairs ? group * HEAD_DIM : 0);
    std::vector<int8_t> bytes(kIntegers ? group * (HEAD_DIM + 4) : 0);
    tasks_in_order(op, begin, end, following, width, kTile, head_groups,
                   HEAD_DIM / kDimsPerPass * head_groups,
                   [&](const TaskKeys& task, const int64_t* offsets, NextTaskRows<C>& ahead,
                       bool requested) {
      const int64_t len = task.len, padded = task.padded;
      scores.resize(group * padded);
      for (int64_t kv = task.kv_begin; kv < task.kv_begin + heads_per_task; ++kv) {
        const int64_t head_offset = (kv - task.kv_begin) * op.row_width;
        if constexpr (kPairs) {
          raw_queries(op, task.b, kv * group, HEAD_DIM, raw.data());
        } else if constexpr (kIntegers) {
          int8_queries(op, task.b, kv * group, HEAD_DIM, bytes.data(), query_offsets.data());
        } else {
          scaled_queries(op, task.b, kv * group, HEAD_DIM, queries.data());
        }
        const bool first = !requested && kv == task.kv_begin;
        if (first) prefetch_first_keys(op, task, offsets, width);
        for (int64_t g0 = 0; g0 < group; g0 += kHeadsAtOnce) {
          const int64_t heads = std::min(kHeadsAtOnce, group - g0);
          const bool prefetch = first && g0 == 0;
          for (int64_t t0 = 0; t0 < padded; t0 += kTile) {
            ahead.request();
            const C* keys[kTile];
            for (int64_t j = 0; j < kTile; ++j) keys[j] = op.k + offsets[t0 + j] + head_offset;
            if (prefetch) {
              for (int64_t j = t0 + kRowsAhead; j < std::min(t0 + kRowsAhead + kTile, len); ++j) {
                prefetch_row(op.k + offsets[j], width);
              }
            }
            float* s = scores.data() + g0 * padded + t0;
            if constexpr (kPairs) {
              const uint16_t* rq = raw.data() + g0 * HEAD_DIM;
              if (heads == 3) {
                score_key_pairs<HEAD_DIM, 3>(keys, rq, op.scale, s, padded);
              } else if (heads == 2) {
                score_key_pairs<HEAD_DIM, 2>(keys, rq, op.scale, s, padded);
              } else {
                score_key_pairs<HEAD_DIM, 1>(keys, rq, op.scale, s, padded);
              }
            } else if constexpr (kIntegers) {
              const int8_t* bq = bytes.data() + g0 * (HEAD_DIM + 4);
              const float* off = query_offsets.data() + g0;
              if (heads == 3) {
                score_int8_keys<HEAD_DIM, 3>(keys, bq, off, op.scale, s, padded);
              } else if (heads == 2) {
                score_int8_keys<HEAD_DIM, 2>(keys, bq, off, op.scale, s, padded);
              } else {
                score_int8_keys<HEAD_DIM, 1>(keys, bq, off, op.scale, s, padded);
              }
            } else if (const float* q = queries.data() + g0 * HEAD_DIM; heads == 3) {
              score_keys<C, HEAD_DIM, 3>(keys, q, s, padded);
            } else if (heads == 2) {
              score_keys<C, HEAD_DIM, 2>(keys, q, s, padded);
            } else {
              score_keys<C, HEAD_DIM, 1>(keys, q, s, padded);
            }
          }
        }
        exp_rows(scores.data(), group, padded, len, inv_totals.data());
        add_value_passes<AddValues16, kDimsPerPass, HEAD_DIM>(
            op, task, kv, scores.data(), inv_totals.data(), offsets, first, ahead);
      }
    });
  });
}

#endif  // AVX-512 F and BW

#endif  // AVX2 and FMA

// The kernel for the cache element type C (T, or int8_t for an 8-bit cache).
template <typename T, typename C>
void decode_attention(const DecodeOperands<T, C>& op) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (op.head_dim == 64) return decode_attention_avx512<T, C, 64>(op);
    if (op.head_dim == 128) return decode_attention_avx512<T, C, 128>(op);
    if (op.head_dim == 256) return decode_attention_avx512<T, C, 256>(op);
#endif
    if (op.head_dim == 64) return decode_attention_avx2<T, C, 64>(op);
    if (op.head_dim == 128) return decode_attention_avx2<T, C, 128>(op);
    if (op.head_dim == 256) return decode_attention_avx2<T, C, 256>(op);  // Gemma 3
  }
#endif
  switch (op.head_dim) {
    case 64:
      return decode_attention_kernel<T, C, 64>(op);
    case 128:
      return decode_attention_kernel<T, C, 128>(op);
    default:
      return decode_attention_kernel<T, C, 0>(op);
  }
}

// q [B, H, D] (rows of D contiguous); key_cache/value_cache [num_blocks, block_size,
// kv_heads, D] (contiguous) in q's dtype, or int8 [num_blocks, block_size, kv_heads, D + 4]
// (an 8-bit cache: each row's D values, then their float32 scale);
// block_tables [B, max_blocks] int32; seq_lens [B] int32 (each >= 1) -> [B, H, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4, "q [B, H, D], cache [N, bs, kvh, D]");
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  TORCH_CHECK(q.stride(2) == 1 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "q's last dimension and the caches must be contiguous");
  const bool int8_cache = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK((int8_cache || key_cache.scalar_type() == q.scalar_type()) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "the caches must share q's dtype, or both be int8");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous(),
              "block_tables rows and seq_lens must be contiguous");
  TORCH_CHECK(q.size(1) % key_cache.size(2) == 0 &&
                  key_cache.size(3) == q.size(2) + (int8_cache ? 4 : 0),
              "heads must be a multiple of kv_heads, the cache rows D wide (D + 4 if int8)");
  at::Tensor out = at::empty(q.sizes(), q.options());
  TORCH_CHECK(q.size(2) <= kMaxHeadDim, "head_dim above ", kMaxHeadDim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                  "paged_decode_attention", [&] {
    if (int8_cache) {
      decode_attention(DecodeOperands<scalar_t, int8_t>(q, key_cache, value_cache, block_tables,
                                                        seq_lens, scale, window, out));
    } else {
      decode_attention(DecodeOperands<scalar_t, scalar_t>(q, key_cache, value_cache,
                                                          block_tables, seq_lens, scale,
                                                          window, out));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def("paged_decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
