// What every linear kernel checks of its optional epilogue operands: bias [out_features]
// and residual [M, out_features], both in the activations' dtype, the bias contiguous and
// the residual's rows contiguous.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace tokenmill {

// dtype_name: how the messages name dtype ("float32", "bfloat16").
inline void check_bias_and_residual(const std::optional<at::Tensor>& bias,
                                    const std::optional<at::Tensor>& residual, int64_t m,
                                    int64_t out_features, at::ScalarType dtype,
                                    const char* dtype_name) {
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == out_features &&
                        bias->is_contiguous() && bias->scalar_type() == dtype),
              "bias must be [out_features] ", dtype_name);
  TORCH_CHECK(!residual || (residual->dim() == 2 && residual->size(0) == m &&
                            residual->size(1) == out_features && residual->stride(1) == 1 &&
                            residual->scalar_type() == dtype),
              "residual must be [M, out_features] ", dtype_name, " with contiguous rows");
}

}  // namespace tokenmill
