// Blocks of an 8-bit KV cache (kv_int8_rows.h) as values, for a kernel that reads a
// model-dtype cache (the prefill attention):
//
//   dequantize_kv_blocks(cache, blocks, dtype)[i, n, t, h, d] =
//       cache[i, blocks[n], t, h, d] * scale of that row, rounded to dtype
//
// cache [2, num_blocks, block_size, kv_heads, D + 4] int8, contiguous; blocks [n] int64
// -> [2, n, block_size, kv_heads, D] in dtype (float32, bfloat16 or float16): the same
// values as kv_int8.dequantize_rows (a float32 product, rounded once). The 2n blocks
// spread over the compute threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dtype_conversion.h"
#include "kv_int8_rows.h"

namespace {

template <typename T>
void dequantize_blocks(const at::Tensor& cache, const at::Tensor& blocks, at::Tensor& out) {
  const int64_t count = blocks.size(0), num_blocks = cache.size(1);
  const int64_t rows_per_block = cache.size(2) * cache.size(3);
  const int64_t width = cache.size(4), head_dim = width - 4;
  const int8_t* source = cache.data_ptr<int8_t>();
  const int64_t* ids = blocks.data_ptr<int64_t>();
  T* target = out.data_ptr<T>();
  at::parallel_for(0, 2 * count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t half = index / count, block = ids[index % count];
      const int8_t* rows = source + (half * num_blocks + block) * rows_per_block * width;
      T* values = target + index * rows_per_block * head_dim;
      for (int64_t r = 0; r < rows_per_block; ++r) {
        const int8_t* row = rows + r * width;
        const float scale = tokenmill::int8_row_scale(row, head_dim);
        T* value = values + r * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) {
          value[d] = tokenmill::from_float<T>(static_cast<float>(row[d]) * scale);
        }
      }
    }
  });
}

at::Tensor dequantize_kv_blocks(const at::Tensor& cache, const at::Tensor& blocks,
                                at::ScalarType dtype) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.scalar_type() == at::kChar &&
                  cache.is_contiguous() && cache.size(4) > 4,
              "cache must be an 8-bit KV cache [2, blocks, block_size, kv_heads, D + 4]");
  TORCH_CHECK(blocks.dim() == 1 && blocks.scalar_type() == at::kLong && blocks.is_contiguous(),
              "blocks must be [n] int64");
  if (blocks.numel() > 0) {
    const auto [low, high] = at::aminmax(blocks);
    TORCH_CHECK(low.item<int64_t>() >= 0 && high.item<int64_t>() < cache.size(1),
                "block ids out of range");
  }
  at::Tensor out = at::empty({2, blocks.size(0), cache.size(2), cache.size(3), cache.size(4) - 4},
                             cache.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequantize_kv_blocks", [&] {
    dequantize_blocks<scalar_t>(cache, blocks, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("dequantize_kv_blocks(Tensor cache, Tensor blocks, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("dequantize_kv_blocks", &dequantize_kv_blocks);
}
