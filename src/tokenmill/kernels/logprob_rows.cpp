// The raw logprobs OpenAI's ``logprobs`` option reports, in the logits' own dtype, with one
// pass over each row and nothing of the vocabulary's size allocated:
//
//   logprob_rows(logits [R, V], token_ids [R] int64, k) ->
//       (logprobs [R, 1 + k] float32, top_ids [R, k] int64, ranks [R] int64)
//
// Row r, with m its largest logit: lp(x) = (x - m) - log(sum_i exp(x_i - m)), log_softmax in
// float32. logprobs[r, 0] = lp(x_s), x_s the logit of token_ids[r]; top_ids[r] are the ids
// of the k largest logits, largest first, equal logits to the lower id, and logprobs[r, 1 + j]
// is lp of top_ids[r, j]; ranks[r] = 1 + the number of logits larger than x_s.
//
// Ranked on the logits. lp is one monotone float32 formula of x, so this is the count of
// logprobs larger than lp(x_s), and top_ids is in the logprobs' order, except where rounding
// gives two distinct logits the same float32 logprob: the logits' order (the exact
// logprobs') is kept there, where ranking the rounded logprobs would count them equal. That
// takes logits closer than about a float32 step at the logprob's magnitude (2^-19, 2e-6,
// for a logprob in [-32, -16)). Distinct bfloat16 logits are at least 2^-8 of their
// magnitude apart, so with bfloat16 logits it happens only to logits within about
// 2^-14 |lp| of zero (2e-3 for a logprob of -32). It does happen: 262144 logits drawn from
// N(0, 3) in bfloat16 hold such a pair in about one row of three, within 2e-4 of zero. A
// sampled token there may get a larger rank than a count of the rounded logprobs gives (by
// the logits above its own whose logprob rounds to its own); the top-k differ from the
// rounded logprobs' only in a row where some of its k + 1 largest logits lie that close
// to zero.
//
// Per block of kBlock logits (in L1 while it is read twice): its maximum, its count of
// logits above x_s and its sum of exp(x - block maximum); the row's total is then the block
// sums scaled by exp(block maximum - m), added in block order (a fixed order, however the
// rows are split among threads). The top-k lie in the k blocks of largest maxima (equal
// maxima to the lower block): each block left out has k blocks whose maxima beat its own,
// and so k logits that beat each of its logits; only those blocks are read again, in id
// order, entry by entry, and only while their maximum could still enter the top k.
//
// A row's logits may be -inf (a grammar's mask), all but one; a row without a finite
// logit gives NaN logprobs, as log_softmax does. NaN or +inf logits are not ordered.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dtype_conversion.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <tuple>
#include <vector>

namespace {

using tokenmill::to_float;

constexpr int64_t kBlock = 256;

// Whether x is -inf, on the bits: fast math lets the compiler assume there are no
// infinities, and fold std::isinf away.
inline bool is_minus_infinity(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits == 0xff800000u;
}

// The k largest values pushed, largest first. Pushed in increasing id order, so equal values
// stay in id order: a later equal value does not enter a full list.
class TopK {
 public:
  explicit TopK(int64_t k) : k_(k), values_(k), ids_(k) {}

  void clear() { size_ = 0; }

  // Whether a value could enter: the list is not full, or it beats the k-th value.
  bool admits(float value) const {
    return size_ < k_ || (k_ > 0 && value > values_[k_ - 1]);
  }

  // Inserts (value, id), dropping the k-th value when full; requires admits(value).
  void push(float value, int64_t id) {
    int64_t at = size_ < k_ ? size_++ : k_ - 1;
    for (; at > 0 && values_[at - 1] < value; --at) {
      values_[at] = values_[at - 1];
      ids_[at] = ids_[at - 1];
    }
    values_[at] = value;
    ids_[at] = id;
  }

  float value(int64_t j) const { return values_[j]; }
  int64_t id(int64_t j) const { return ids_[j]; }

 private:
  int64_t k_, size_ = 0;
  std::vector<float> values_;
  std::vector<int64_t> ids_;
};

template <typename T>
void logprob_kernel(const at::Tensor& logits, const int64_t* token_ids, int64_t k,
                    float* logprobs, int64_t* top_ids, int64_t* ranks) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int64_t top_blocks = std::min(k, blocks);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> block_max(blocks), block_sum(blocks);
    std::vector<int64_t> order(blocks);
    TopK top(k);
    for (int64_t r = begin; r < end; ++r) {
      const T* row = logits.data_ptr<T>() + r * logits.stride(0);
      const float sampled = to_float(row[token_ids[r]]);
      int64_t greater = 0;
      float peak = -INFINITY;
      for (int64_t b = 0; b < blocks; ++b) {
        const T* x = row + b * kBlock;
        const int64_t size = std::min(kBlock, n - b * kBlock);
        float local_max = -INFINITY;
        int32_t above = 0;
#pragma omp simd reduction(max : local_max) reduction(+ : above)
        for (int64_t i = 0; i < size; ++i) {
          const float v = to_float(x[i]);
          local_max = std::max(local_max, v);
          above += v > sampled;
        }
        // A block of -inf alone weighs 0 (exp(-inf - -inf) would be NaN).
        const float shift = is_minus_infinity(local_max) ? 0.f : local_max;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < size; ++i) sum += std::exp(to_float(x[i]) - shift);
        block_max[b] = local_max;
        block_sum[b] = sum;
        greater += above;
        peak = std::max(peak, local_max);
      }
      float total = 0.f;
      for (int64_t b = 0; b < blocks; ++b) total += block_sum[b] * std::exp(block_max[b] - peak);
      const float log_total = std::log(total);

      top.clear();
      if (top_blocks > 0) {
        std::iota(order.begin(), order.end(), int64_t{0});
        std::partial_sort(order.begin(), order.begin() + top_blocks, order.end(),
                          [&](int64_t a, int64_t b) {
                            return block_max[a] > block_max[b] ||
                                   (block_max[a] == block_max[b] && a < b);
                          });
        std::sort(order.begin(), order.begin() + top_blocks);
        for (int64_t j = 0; j < top_blocks; ++j) {
          const int64_t b = order[j];
          if (!top.admits(block_max[b])) continue;
          const T* x = row + b * kBlock;
          const int64_t size = std::min(kBlock, n - b * kBlock);
          for (int64_t i = 0; i < size; ++i) {
            const float v = to_float(x[i]);
            if (top.admits(v)) top.push(v, b * kBlock + i);
          }
        }
      }

      float* out = logprobs + r * (1 + k);
      out[0] = (sampled - peak) - log_total;
      for (int64_t j = 0; j < k; ++j) {
        out[1 + j] = (top.value(j) - peak) - log_total;
        top_ids[r * k + j] = top.id(j);
      }
      ranks[r] = 1 + greater;
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> logprob_rows(const at::Tensor& logits,
                                                            const at::Tensor& token_ids,
                                                            int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be [rows, vocab] with contiguous rows");
  TORCH_CHECK(token_ids.scalar_type() == at::kLong && token_ids.is_contiguous() &&
                  token_ids.numel() == logits.size(0),
              "token_ids must be int64, one per row");
  TORCH_CHECK(k >= 0 && k <= logits.size(1), "k must be in [0, vocab], not ", k);
  const int64_t rows = logits.size(0), n = logits.size(1);
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(ids[r] >= 0 && ids[r] < n, "token_ids[", r, "] = ", ids[r], " is not in [0, ",
                n, ")");
  }
  const at::TensorOptions options = logits.options();
  at::Tensor logprobs = at::empty({rows, 1 + k}, options.dtype(at::kFloat));
  at::Tensor top_ids = at::empty({rows, k}, options.dtype(at::kLong));
  at::Tensor ranks = at::empty({rows}, options.dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(),
                                  "logprob_rows", [&] {
                                    logprob_kernel<scalar_t>(logits, ids, k,
                                                             logprobs.data_ptr<float>(),
                                                             top_ids.data_ptr<int64_t>(),
                                                             ranks.data_ptr<int64_t>());
                                  });
  return {logprobs, top_ids, ranks};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("logprob_rows(Tensor logits, Tensor token_ids, int k) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("logprob_rows", &logprob_rows);
}
