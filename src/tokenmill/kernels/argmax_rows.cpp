// Greedy sampling's argmax over the logits rows, in the logits' own dtype:
//
//   argmax_rows(x [N, V]) -> int64 [N]: per row, the first index of its largest value, a NaN
//                            counting as larger than any number (torch.argmax's answer)
//
// Values are compared as integers: a float's bits, read as sign and magnitude, order as its
// value does (-0 and +0 equal), with every NaN mapped above +inf. Integer compares vectorize
// and no fast-math assumption about NaN applies. Two passes per row: the largest key (a
// vectorized max), then the first block holding it and the first index in that block.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>

namespace {

// Sign-magnitude bits -> an int32 key ordered as the value; NaN above everything.
template <typename Bits, uint32_t kSign, uint32_t kInf>
inline int32_t order_key(Bits raw) {
  const uint32_t bits = static_cast<uint32_t>(raw);
  const int32_t magnitude = static_cast<int32_t>(bits & (kSign - 1));
  const int32_t key = (bits & kSign) ? -magnitude : magnitude;
  return magnitude > static_cast<int32_t>(kInf) ? INT32_MAX : key;
}

template <typename Bits, uint32_t kSign, uint32_t kInf>
void argmax_kernel(const at::Tensor& x, at::Tensor& out) {
  constexpr int64_t kBlock = 256;
  const int64_t rows = x.size(0), n = x.size(1);
  const auto* data = reinterpret_cast<const Bits*>(x.data_ptr());
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Bits* row = data + r * x.stride(0);
      int32_t best = INT32_MIN;
#pragma omp simd reduction(max : best)
      for (int64_t i = 0; i < n; ++i) best = std::max(best, order_key<Bits, kSign, kInf>(row[i]));
      int64_t index = 0;
      for (int64_t b = 0; b < n; b += kBlock) {
        const int64_t stop = std::min(n, b + kBlock);
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = b; i < stop; ++i) hit |= order_key<Bits, kSign, kInf>(row[i]) == best;
        if (hit) {
          index = b;
          while (order_key<Bits, kSign, kInf>(row[index]) != best) ++index;
          break;
        }
      }
      result[r] = index;
    }
  });
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "x must be [rows, n] with n > 0 and contiguous rows");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  switch (x.scalar_type()) {
    case at::kFloat:
      argmax_kernel<uint32_t, 0x80000000u, 0x7f800000u>(x, out);
      break;
    case at::kBFloat16:
      argmax_kernel<uint16_t, 0x8000u, 0x7f80u>(x, out);
      break;
    case at::kHalf:
      argmax_kernel<uint16_t, 0x8000u, 0x7c00u>(x, out);
      break;
    default:
      TORCH_CHECK(false, "x must be float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
}
