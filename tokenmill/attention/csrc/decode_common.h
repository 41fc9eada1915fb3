// What the decode attention kernels share (paged_decode.cpp, block_sparse_decode.cpp):
// float32 dot products and scaled adds, and folding one block of scores into a query
// head's running softmax. Compiled with -ffast-math by both (vector exponentials,
// reassociated sums).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace decode {

constexpr float kNoScore = -1e30f;  // finite: -ffast-math assumes no infinities

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void scale_add(float* acc, const float* v, float p, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += p * v[i];
}

// One query head's running softmax: acc[head_dim] (the unnormalised weighted sum of
// values), its maximum score and its sum of exponentials. Folding a block of `count`
// scores raises the maximum if needed, rescales acc and the sum to it, and turns the
// scores into their weights exp(score - maximum); the caller then adds each token's
// value times its weight to acc.
inline void fold_block(float* score, int64_t count, float* acc, int64_t head_dim,
                       float& top, float& total) {
  float block_max = kNoScore;
  for (int64_t t = 0; t < count; ++t) block_max = std::max(block_max, score[t]);
  const float new_max = std::max(top, block_max);
  const float rescale = std::exp(top - new_max);
  float block_total = 0.0f;
#pragma omp simd reduction(+ : block_total)
  for (int64_t t = 0; t < count; ++t) {  // vector exp (libmvec)
    score[t] = std::exp(score[t] - new_max);
    block_total += score[t];
  }
#pragma omp simd
  for (int64_t i = 0; i < head_dim; ++i) acc[i] *= rescale;
  total = total * rescale + block_total;
  top = new_max;
}

}  // namespace decode
