// Element-wise parts of a Llama layer, each one pass over its rows in float32 (one
// rounding to the storage dtype at the end), rows spread over the compute threads:
//
//   rms_norm(x, w, eps)      x / sqrt(mean(x^2) + eps) * w
//   silu_and_mul(x)          silu(x[:, :I]) * x[:, I:]              x = [gate | up]
//   rotary_store_kv(...)     rotate the q and k heads of qkv in place ("rotate half"
//                            layout), then copy each token's k and v into its cache slot
//                            (into an 8-bit cache: each head's row quantized,
//                            kv_int8_rows.h)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dtype_conversion.h"
#include "kv_int8_rows.h"

#include <cmath>
#include <cstring>
#include <type_traits>

namespace {

using tokenmill::from_float;
using tokenmill::store_int8_row;
using tokenmill::to_float;

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, n] with contiguous rows");
}

// Rows per parallel task: enough work per task that small batches stay on one thread.
int64_t grain_for(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_len)); }

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, float eps, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x.data_ptr<T>() + r * x.stride(0);
      T* dst = out.data_ptr<T>() + r * n;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) sum += to_float(src[i]) * to_float(src[i]);
      const float inv = 1.f / std::sqrt(sum / n + eps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(to_float(src[i]) * inv * to_float(w[i]));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [n], contiguous, in x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x, weight, static_cast<float>(eps), out);
  });
  return out;
}

template <typename T>
void silu_and_mul_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x.data_ptr<T>() + r * x.stride(0);
      const T* up = gate + n;
      T* dst = out.data_ptr<T>() + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float g = to_float(gate[i]);
        dst[i] = from_float<T>(g / (1.f + std::exp(-g)) * to_float(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must be [rows, 2 * I]");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(x, out);
  });
  return out;
}

// C: the cache's element type, T or int8_t (rows of head_dim + 4 bytes).
template <typename T, typename C>
void rotary_store_rows(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                       at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  const int64_t tokens = qkv.size(0), head_dim = cos.size(-1), half = head_dim / 2;
  const int64_t kv_width = num_kv_heads * head_dim;  // a token's k (or v) in qkv
  const int64_t row_width = head_dim + (kInt8 ? 4 : 0);  // a head's row in the cache
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  C* k_cache = key_cache.data_ptr<C>();
  C* v_cache = value_cache.data_ptr<C>();
  at::parallel_for(0, tokens, grain_for(qkv.size(1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv.data_ptr<T>() + t * qkv.stride(0);
      const T* c = cos.data_ptr<T>() + t * cos.stride(0);
      const T* s = sin.data_ptr<T>() + t * sin.stride(0);
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        T* x = row + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
          const float r1 = x1 * to_float(c[i]) + x2 * to_float(s[i]);
          const float r2 = x2 * to_float(c[half + i]) + x1 * to_float(s[half + i]);
          x[i] = from_float<T>(r1);
          x[i + half] = from_float<T>(r2);
        }
      }
      const T* k = row + num_heads * head_dim;
      C* k_slot = k_cache + slots[t] * num_kv_heads * row_width;
      C* v_slot = v_cache + slots[t] * num_kv_heads * row_width;
      if constexpr (kInt8) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          store_int8_row(k + h * head_dim, head_dim, k_slot + h * row_width);
          store_int8_row(k + kv_width + h * head_dim, head_dim, v_slot + h * row_width);
        }
      } else {
        std::memcpy(k_slot, k, kv_width * sizeof(T));
        std::memcpy(v_slot, k + kv_width, kv_width * sizeof(T));
      }
    }
  });
}

// qkv [T, (H + 2 KVH) D], rows contiguous: | q heads | k heads | v heads |.
// cos [T, D] = [cos, cos] and sin [T, D] = [-sin, sin] (each D/2 wide) at each token's
// position, rows contiguous (or [T, 1, D], as RotaryEmbedding.cos_sin gives them): the
// rotation is x * cos + swap_halves(x) * sin.
// key_cache/value_cache [num_blocks, block_size, KVH, D] contiguous: flat slot s is row s
// of the [num_blocks * block_size, KVH * D] view; or int8 [num_blocks, block_size, KVH,
// D + 4], an 8-bit cache (store_int8_row).
void rotary_store_kv(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor key_cache, at::Tensor value_cache,
                     const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  const int64_t tokens = qkv.size(0), head_dim = cos.size(-1);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "qkv width");
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->scalar_type() == qkv.scalar_type() && table->size(0) == tokens &&
                    table->size(-1) == head_dim && table->numel() == tokens * head_dim &&
                    table->stride(-1) == 1,
                "cos and sin must be [T, D] (or [T, 1, D]) with contiguous rows, in qkv's dtype");
  }
  const bool int8_cache = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  (int8_cache || key_cache.scalar_type() == qkv.scalar_type()) &&
                  value_cache.scalar_type() == key_cache.scalar_type() &&
                  key_cache.size(-2) == num_kv_heads &&
                  key_cache.size(-1) == head_dim + (int8_cache ? 4 : 0),
              "caches must be contiguous, in qkv's dtype (KVH * D wide) or int8 (KVH * (D + 4))");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == tokens,
              "slot_mapping must be [T] int64");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_store_kv", [&] {
    if (int8_cache) {
      rotary_store_rows<scalar_t, int8_t>(qkv, cos, sin, key_cache, value_cache, slot_mapping,
                                          num_heads, num_kv_heads);
    } else {
      rotary_store_rows<scalar_t, scalar_t>(qkv, cos, sin, key_cache, value_cache,
                                            slot_mapping, num_heads, num_kv_heads);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_store_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) key_cache, "
        "Tensor(c!) value_cache, Tensor slot_mapping, int num_heads, int num_kv_heads) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_store_kv", &rotary_store_kv);
}
