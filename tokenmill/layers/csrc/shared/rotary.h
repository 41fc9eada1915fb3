// Rotary embedding in place, shared by row_ops.cpp (rotate_) and the paged decode
// kernel's whole-step entry (attention/csrc/paged_decode.cpp): for each half pair of a
// head, x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, rounded exactly as the torch form
// (layers/rotary.py's apply_rotary) rounds them. Built here without fast-math or
// contracted multiply-adds whatever the including file's flags (paged_decode.cpp's are
// -ffast-math), and kept out of line so those options hold.
#pragma once

#include <cstdint>

namespace tokenmill {

#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")
// Rows [t0, t1) of data (row t's heads from data + t * row_stride, each 2 * half
// values), `heads` heads each, by row t's cos and sin (half values each at c, s + t *
// half).
inline __attribute__((noinline)) void rotate_rows(float* data, int64_t t0, int64_t t1,
                                                  int64_t row_stride, int64_t heads,
                                                  int64_t half, const float* c,
                                                  const float* s) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      float* x1 = data + t * row_stride + h * 2 * half;
      float* x2 = x1 + half;
      const float* ct = c + t * half;
      const float* st = s + t * half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        const float a_cos = a * ct[i], b_sin = b * st[i];
        const float b_cos = b * ct[i], a_sin = a * st[i];
        x1[i] = a_cos - b_sin;
        x2[i] = b_cos + a_sin;
      }
    }
}
#pragma GCC pop_options

}  // namespace tokenmill
