// Sampling by temperature alone, in the logits' own dtype, one pass over each row's
// probabilities plus a short walk:
//
//   sample_rows(logits [N, V], temperature [N] float32, u [N] float32) -> int64 [N]
//
// Row r with temperature t > 0 picks token i with probability softmax(logits[r] / t)[i]:
// it inverts the cumulative distribution at u[r] * (total), u in [0, 1) drawn by the
// caller; the first token whose cumulative weight exceeds that point wins, so a token of
// probability 0 never does. (Greedy rows are the caller's: argmax_rows.)
//
// Weights e_i = exp((x_i - max) / t) are summed in blocks of kBlock, and the total is the
// sum of the block sums in order; the walk adds the same block sums in the same order, so
// it always finds the point it was given (below the total).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dtype_conversion.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using tokenmill::to_float;

constexpr int64_t kBlock = 256;

template <typename T>
void sample_kernel(const at::Tensor& logits, const float* temperature, const float* u,
                   int64_t* out) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(n), block_sums(blocks);
    for (int64_t r = begin; r < end; ++r) {
      const T* row = logits.data_ptr<T>() + r * logits.stride(0);
      float peak = -INFINITY;
#pragma omp simd reduction(max : peak)
      for (int64_t i = 0; i < n; ++i) peak = std::max(peak, to_float(row[i]));
      const float inv_t = 1.f / temperature[r];
      float* e = weights.data();
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) e[i] = std::exp((to_float(row[i]) - peak) * inv_t);
      float total = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        float sum = 0.f;
        const int64_t stop = std::min(n, (b + 1) * kBlock);
#pragma omp simd reduction(+ : sum)
        for (int64_t i = b * kBlock; i < stop; ++i) sum += e[i];
        block_sums[b] = sum;
        total += sum;
      }
      const float point = std::min(u[r] * total, std::nextafter(total, 0.f));
      float cum = 0.f;
      int64_t b = 0;
      while (b + 1 < blocks && cum + block_sums[b] <= point) cum += block_sums[b++];
      // The answer lies in block b: the first index whose running sum passes the point;
      // summed one by one the block may round a hair short of its block sum, and then its
      // last token of nonzero weight is the answer.
      int64_t pick = -1;
      for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) {
        if (e[i] > 0.f) pick = i;
        cum += e[i];
        if (cum > point) break;
      }
      // (a block of weights all 0 cannot be chosen: the row's maximum weighs 1; logits
      // with NaN or +inf give NaN weights, and then the last token)
      for (int64_t i = n - 1; pick < 0 && i >= 0; --i) {
        if (e[i] > 0.f) pick = i;
      }
      out[r] = pick < 0 ? n - 1 : pick;
    }
  });
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                       const at::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be [rows, vocab] with contiguous rows");
  for (const at::Tensor* t : {&temperature, &u}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == logits.size(0),
                "temperature and u must be float32, one per row");
  }
  const float* t = temperature.data_ptr<float>();
  for (int64_t r = 0; r < logits.size(0); ++r) {
    TORCH_CHECK(t[r] > 0.f, "temperature must be positive (row ", r, ")");
  }
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "sample_rows",
                                  [&] {
                                    sample_kernel<scalar_t>(logits, temperature.data_ptr<float>(),
                                                            u.data_ptr<float>(),
                                                            out.data_ptr<int64_t>());
                                  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor u) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("sample_rows", &sample_rows);
}
