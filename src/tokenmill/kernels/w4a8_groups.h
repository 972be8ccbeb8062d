// What the w4a8 kernels (vnni_linear.cpp, w4a8_linear.cpp) keep of a row's group of 32
// activations besides their int8 values, so that both compute the same numbers.
//
// A 4-bit weight scale * q + min (q in 0..15) is taken as scale * (q - kCentre) + (min +
// kCentre * scale): only the centred part multiplies the rounded activations x~ = d * xq,
// the rest the exact float32 sum s of x. With S = sum q * xq over the group (integers):
//
//   sum over the group of w * x~ (centred part) + ... = scale * (d * S + e) + min * s,
//   e = kCentre * (s - d * sum xq)
//
// (the rounding errors of x mostly cancel against q - 8 in -8..7, where q's mean of 7.5
// would add them up).
#pragma once

namespace tokenmill {

constexpr float kCentre = 8.f;

struct GroupActivations {
  float d;  // the scale: NaN for a group holding a NaN or an infinity, 0 for one of zeros
  float e;  // kCentre * (s - d * sum xq)
  float s;  // the float32 sum of x
};

// From the group's float32 sum of x, its scale and the sum of its int8 values.
inline GroupActivations group_activations(float sum, float d, float q_sum) {
  return {d, kCentre * (sum - d * q_sum), sum};
}

}  // namespace tokenmill
