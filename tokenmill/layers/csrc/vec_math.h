// Float32 math shared by the compiled kernels, written so a compiler vectorizes the
// loops around it. Built without contracting products and sums into FMAs (a pragma,
// so kernels whose own loops want FMAs can include it): every kernel rounds these the
// same way, and the gated MLP's activation fused into the gate/up product
// (f32_linear.cpp) is bit-identical to row_ops.cpp's silu_mul.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace tokenmill {

// e^x: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by the polynomial, 2^n through the
// exponent bits; 0 below -87.3 and infinity above 88.7, as the float32 exponential
// gives. Written so the compiler vectorizes the loop around it (no floor, no memcpy:
// neither vectorizes without -ffast-math, which rms_norm's rounding must not have).
inline float exp_vectorizable(float x) {
  const float clamped = std::min(88.0f, std::max(-87.0f, x));
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (clamped * 1.44269504088896341f + kRound) - kRound;
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * r * r + r + 1.0f) *
                  __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return x > 88.7f ? HUGE_VALF : (x < -87.3f ? 0.0f : y);
}

// silu(x) = x / (1 + e^-x), the torch form, rounded to float32.
inline float silu(float x) { return x / (1.0f + exp_vectorizable(-x)); }

}  // namespace tokenmill

#pragma GCC pop_options
