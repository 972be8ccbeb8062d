// What every linear kernel checks of its optional epilogue operands: bias [out_features]
// and residual [M, out_features], both in the activations' dtype, the bias contiguous and
// the residual's rows contiguous; and the group size both int8 group kernels infer from
// their scales.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>
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

// The inputs per scale of int8 weights in groups (int8_group_linear,
// int8_group_f32_linear): K / groups for x [M, K] and scales [panels, groups, outputs per
// panel], which must be 16 or 32. The kernel checks the rest of both shapes.
inline int64_t int8_group_size(const at::Tensor& x, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && scales.dim() == 3,
              "x must be [M, K] and scales [panels, K / group, outputs per panel]");
  const int64_t k = x.size(1), groups = scales.size(1);
  TORCH_CHECK(groups > 0 && (k == 16 * groups || k == 32 * groups),
              "scales must have one group per 16 or per 32 inputs: ", groups,
              " groups for K = ", k);
  return k / groups;
}

// The checks of a grouped weight kind's per-group tensors ``params`` (scales, and int4's
// minimums; ``names`` says which): each [panels, K / group, panel] float32, contiguous, for
// x [M, K] with K a multiple of ``group``.
inline void check_group_params(const at::Tensor& x,
                               std::initializer_list<const at::Tensor*> params, int64_t group,
                               int64_t panels, int64_t panel, const char* names) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % group == 0,
              "x must be [M, K] with K a multiple of ", group);
  for (const at::Tensor* t : params) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == panels && t->size(1) == x.size(1) / group &&
                    t->size(2) == panel && t->is_contiguous() && t->scalar_type() == at::kFloat,
                names, " must be [panels, K / ", group, ", ", panel, "] float32");
  }
}

}  // namespace tokenmill
