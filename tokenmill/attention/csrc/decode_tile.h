// The decode kernels' tile fold (paged_decode.cpp, block_sparse_decode.cpp): the
// scores of up to kTile tokens against one KV head's query heads folded into their
// running softmax, and the prefetcher that requests the next tile's lines meanwhile.
//
// With AVX-512 and a head size that is a multiple of 16 (up to 128), a tile's 16
// scores of a query head come out in one register: each token's dot product is summed
// into 16 lanes and the 16 partial vectors are folded together by a transposing
// reduction (45 shuffles and adds instead of 16 horizontal sums), and each query
// head's weighted sum of values stays in registers through the tile. With AVX2 (no
// AVX-512) the same in 8-lane registers: a head size that is a multiple of 8 (up to
// 128), the tile's scores in two registers of 8, each folded from 8 tokens' partial
// vectors. Elsewhere the plain loops of decode_common.h (dot products and scaled adds)
// serve.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "decode_common.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace decode {

constexpr int64_t kTile = 16;

struct Geometry {
  int64_t heads, kv_heads, group, head_dim, block_size, width;
};

// Which cache the prefetcher fills: 1, L1 (prefetcht0); 2, L2 only (prefetcht1). The
// best differs by host, build and shape: on a Zen 4 host the AVX-512 fold read a cold
// cache 1.17-1.42x faster with L2, the AVX2 one 0.92x as fast at 32 x 160 tokens and
// 1.09-1.13x at longer contexts (docs/BENCHMARKS.md), so the engine measures both at
// start-up and sets the faster (attention/kv_fetch.py).
#ifndef TM_KV_FETCH_LEVEL
#define TM_KV_FETCH_LEVEL 1
#endif
// The level the prefetchers of this module take (set through the kernel's
// set_fetch_level). Static: each compiled module keeps its own (an inline function's
// static is one object across every module the process loads, GCC's unique symbols).
static inline int& fetch_level() {
  static int level = TM_KV_FETCH_LEVEL;
  return level;
}

// Requests `lines` 64-byte lines from p on into the cache `Locality` names.
template <int Locality>
inline void fetch_lines(const float* p, int64_t lines) {
  for (int64_t line = 0; line < lines; ++line) __builtin_prefetch(p + 16 * line, 0, Locality);
}

// The next tile's cache lines (keys and values of each of its tokens), requested a
// few tokens at a time while the current tile is folded: a burst of all of them at once
// (256 lines for a tile of 16 tokens of 2 x 64-dim heads) exceeds the lines a core
// can have in flight. TM_PREFETCH_BURST restores the burst (for comparison). A token's
// lines go in one loop (working each line's token and offset out from a running count
// took two integer divisions a line, more than the tile's own arithmetic:
// docs/BENCHMARKS.md).
struct Prefetch {
  const float* keys = nullptr;
  const float* values = nullptr;
  const int64_t* offsets = nullptr;
  int64_t row_lines = 0, total = 0, next = 0;  // total, next: tokens
  bool to_l2 = false;

  // n tokens at offsets o of k and v, row_floats floats of each (all KV heads, or one).
  void start(const float* k, const float* v, const int64_t* o, int64_t n, int64_t row_floats) {
    keys = k, values = v, offsets = o, next = 0;
    row_lines = (row_floats + 15) / 16;
    total = n;
    to_l2 = fetch_level() == 2;
  }
  // Request the lines of up to `count` more tokens, each token's keys then values.
  inline void step(int64_t count) {
    if (to_l2) return fetch<2>(count);
    fetch<3>(count);
  }

  template <int Locality>
  inline void fetch(int64_t count) {
    for (const int64_t stop = std::min(total, next + count); next < stop; ++next) {
      fetch_lines<Locality>(keys + offsets[next], row_lines);
      fetch_lines<Locality>(values + offsets[next], row_lines);
    }
  }
};

// The plain form: any head size, any CPU. state: [group][head_dim + 2] for the item's
// query heads (weighted sum, running maximum, sum of exponentials).
inline void fold_tile_plain(const Geometry& g, const float* query, const float* keys,
                            const float* values, const int64_t* offsets, int64_t n,
                            float scale, float* state, Prefetch& ahead, int64_t per_head) {
  const int64_t stride = g.head_dim + 2;
  float scores[kTile];
  for (int64_t q = 0; q < g.group; ++q) {
    ahead.step(per_head);
    const float* qh = query + q * g.head_dim;
    float* s = state + q * stride;
    for (int64_t t = 0; t < n; ++t) scores[t] = scale * dot(qh, keys + offsets[t], g.head_dim);
    decode::fold_block(scores, n, s, g.head_dim, s[g.head_dim], s[g.head_dim + 1]);
    for (int64_t t = 0; t < n; ++t) scale_add(s, values + offsets[t], scores[t], g.head_dim);
  }
}

// The weighted sums of values of P query heads (rows of `weights`, each head's state
// `stride` floats after the last's) over a tile's n tokens, each head's sum starting
// from its state rescaled by exp(its old maximum - its new one), `rescale`: each
// token's value vectors loaded once for all P heads. Defined per instruction set below.
template <int VECTORS, int P>
inline void accumulate(float* state, int64_t stride, const float (*weights)[kTile],
                       const float* rescale, const float* values, const int64_t* offsets,
                       int64_t n);

// accumulate() for `heads` (1 .. P) heads.
template <int VECTORS, int P>
inline void accumulate_up_to(int heads, float* state, int64_t stride,
                             const float (*weights)[kTile], const float* rescale,
                             const float* values, const int64_t* offsets, int64_t n) {
  if constexpr (P > 0) {
    if (heads == P)
      return accumulate<VECTORS, P>(state, stride, weights, rescale, values, offsets, n);
    accumulate_up_to<VECTORS, P - 1>(heads, state, stride, weights, rescale, values, offsets, n);
  }
}

#if defined(__AVX512F__)
// Lane t of the result is the sum of the 16 lanes of v[t].
inline __m512 sum_each(__m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88),
                       _mm512_shuffle_f32x4(low, high, 0xDD));
}

// AVX-512's accumulate: P x VECTORS independent sums (16 registers).
template <int VECTORS, int P>
inline void accumulate(float* state, int64_t stride, const float (*weights)[kTile],
                       const float* rescale, const float* values, const int64_t* offsets,
                       int64_t n) {
  __m512 acc[P][VECTORS];
  for (int h = 0; h < P; ++h) {
    const __m512 r = _mm512_set1_ps(rescale[h]);
    for (int i = 0; i < VECTORS; ++i)
      acc[h][i] = _mm512_mul_ps(_mm512_loadu_ps(state + h * stride + 16 * i), r);
  }
  for (int64_t t = 0; t < n; ++t) {
    const float* value = values + offsets[t];
    __m512 v[VECTORS];
    for (int i = 0; i < VECTORS; ++i) v[i] = _mm512_loadu_ps(value + 16 * i);
    for (int h = 0; h < P; ++h) {
      const __m512 p = _mm512_set1_ps(weights[h][t]);
      for (int i = 0; i < VECTORS; ++i) acc[h][i] = _mm512_fmadd_ps(p, v[i], acc[h][i]);
    }
  }
  for (int h = 0; h < P; ++h)
    for (int i = 0; i < VECTORS; ++i) _mm512_storeu_ps(state + h * stride + 16 * i, acc[h][i]);
}

// The register form, for head_dim = 16 * VECTORS. Query heads go kHeads at a time:
// each head's scores, then the exponentials of them all in one vector loop, then the
// heads' weighted sums of values in passes of 16 / VECTORS heads (one head at a time
// from start to end left each step waiting on the one before: the sums' chains of
// dependent multiply-adds, the exponentials and the reductions; 1.08-1.11x per layer at
// batch 8-32, docs/BENCHMARKS.md).
template <int VECTORS>
void fold_tile_avx512(const Geometry& g, const float* query, const float* keys,
                      const float* values, const int64_t* offsets, int64_t n, float scale,
                      float* state, Prefetch& ahead, int64_t per_head) {
  constexpr int kHeads = 8, kPass = std::max(1, std::min(kHeads, 16 / VECTORS));
  const int64_t stride = g.head_dim + 2;
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
  alignas(64) float weights[kHeads][kTile];
  alignas(64) float rescale[kHeads] = {};
  for (int64_t q0 = 0; q0 < g.group; q0 += kHeads) {
    const int heads = static_cast<int>(std::min<int64_t>(kHeads, g.group - q0));
    for (int h = 0; h < heads; ++h) {
      ahead.step(per_head);
      const float* qh = query + (q0 + h) * g.head_dim;
      __m512 qv[VECTORS];
      for (int i = 0; i < VECTORS; ++i) qv[i] = _mm512_loadu_ps(qh + 16 * i);
      __m512 partial[kTile];
      for (int64_t t = 0; t < kTile; ++t) {
        if (t >= n) {
          partial[t] = _mm512_setzero_ps();
          continue;
        }
        const float* key = keys + offsets[t];
        __m512 sum = _mm512_mul_ps(qv[0], _mm512_loadu_ps(key));
        for (int i = 1; i < VECTORS; ++i) sum = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(key + 16 * i), sum);
        partial[t] = sum;
      }
      const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(kNoScore), live,
                                               _mm512_mul_ps(sum_each(partial), _mm512_set1_ps(scale)));
      float* s = state + (q0 + h) * stride;
      const float top = std::max(s[g.head_dim], _mm512_reduce_max_ps(scores));
      rescale[h] = s[g.head_dim] - top;
      s[g.head_dim] = top;
      _mm512_store_ps(weights[h], _mm512_sub_ps(scores, _mm512_set1_ps(top)));
    }
    float* flat = &weights[0][0];
#pragma omp simd
    for (int i = 0; i < heads * kTile; ++i) flat[i] = std::exp(flat[i]);  // vector exp (libmvec)
#pragma omp simd
    for (int h = 0; h < kHeads; ++h) rescale[h] = std::exp(rescale[h]);
    for (int h = 0; h < heads; ++h) {
      const __m512 w = _mm512_maskz_mov_ps(live, _mm512_load_ps(weights[h]));
      float* s = state + (q0 + h) * stride;
      s[g.head_dim + 1] = s[g.head_dim + 1] * rescale[h] + _mm512_reduce_add_ps(w);
      _mm512_store_ps(weights[h], w);
    }
    for (int h0 = 0; h0 < heads; h0 += kPass)
      accumulate_up_to<VECTORS, kPass>(std::min(kPass, heads - h0), state + (q0 + h0) * stride,
                                       stride, weights + h0, rescale + h0, values, offsets, n);
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Lane t of the result is the sum of the 8 lanes of v[t].
inline __m256 sum_each8(const __m256* v) {
  const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 low = _mm256_hadd_ps(h01, h23), high = _mm256_hadd_ps(h45, h67);
  // low: lanes 0-3 the lower halves' sums of v[0..3], lanes 4-7 their upper halves'.
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                       _mm256_permute2f128_ps(low, high, 0x31));
}

inline float max_of(__m256 v) {
  v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
  v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
  return _mm256_cvtss_f32(v);
}

inline float sum_of(__m256 v) {
  v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
  return _mm256_cvtss_f32(v);
}

// AVX2's accumulate: a token's value vector loaded once for the P heads' sums.
template <int VECTORS, int P>
inline void accumulate(float* state, int64_t stride, const float (*weights)[kTile],
                        const float* rescale, const float* values, const int64_t* offsets,
                        int64_t n) {
  __m256 acc[P][VECTORS];
  for (int h = 0; h < P; ++h) {
    const __m256 r = _mm256_set1_ps(rescale[h]);
    for (int v = 0; v < VECTORS; ++v)
      acc[h][v] = _mm256_mul_ps(_mm256_loadu_ps(state + h * stride + 8 * v), r);
  }
  for (int64_t t = 0; t < n; ++t) {
    const float* value = values + offsets[t];
    __m256 p[P];
    for (int h = 0; h < P; ++h) p[h] = _mm256_set1_ps(weights[h][t]);
    for (int v = 0; v < VECTORS; ++v) {
      const __m256 x = _mm256_loadu_ps(value + 8 * v);
      for (int h = 0; h < P; ++h) acc[h][v] = _mm256_fmadd_ps(p[h], x, acc[h][v]);
    }
  }
  for (int h = 0; h < P; ++h)
    for (int v = 0; v < VECTORS; ++v) _mm256_storeu_ps(state + h * stride + 8 * v, acc[h][v]);
}

// The register form, for head_dim = 8 * VECTORS: query heads kHeads at a time, as
// fold_tile_avx512 takes them (sums in passes of 8 / VECTORS heads).
template <int VECTORS>
void fold_tile_avx2(const Geometry& g, const float* query, const float* keys,
                    const float* values, const int64_t* offsets, int64_t n, float scale,
                    float* state, Prefetch& ahead, int64_t per_head) {
  constexpr int kHalf = 8;  // tokens per register of scores
  constexpr int kHeads = 8, kPass = std::max(1, 8 / VECTORS);
  const int64_t stride = g.head_dim + 2;
  alignas(32) float weights[kHeads][kTile];
  alignas(32) float rescale[kHeads] = {};
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t q0 = 0; q0 < g.group; q0 += kHeads) {
    const int heads = static_cast<int>(std::min<int64_t>(kHeads, g.group - q0));
    for (int q = 0; q < heads; ++q) {
      ahead.step(per_head);
      const float* qh = query + (q0 + q) * g.head_dim;
      __m256 scores[2];
      for (int h = 0; h < 2; ++h) {
        __m256 partial[kHalf];
        for (int64_t i = 0; i < kHalf; ++i) {
          const int64_t t = h * kHalf + i;
          if (t >= n) {
            partial[i] = _mm256_setzero_ps();
            continue;
          }
          const float* key = keys + offsets[t];
          __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_loadu_ps(key));
          for (int v = 1; v < VECTORS; ++v)
            sum = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * v), _mm256_loadu_ps(key + 8 * v), sum);
          partial[i] = sum;
        }
        // Tokens past n score kNoScore (weight 0 after the exponential).
        const __m256 live = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - h * kHalf)), lane));
        scores[h] = _mm256_blendv_ps(_mm256_set1_ps(kNoScore),
                                     _mm256_mul_ps(sum_each8(partial), _mm256_set1_ps(scale)),
                                     live);
      }
      float* s = state + (q0 + q) * stride;
      const float top = std::max(s[g.head_dim], max_of(_mm256_max_ps(scores[0], scores[1])));
      rescale[q] = s[g.head_dim] - top;
      s[g.head_dim] = top;
      _mm256_store_ps(weights[q], _mm256_sub_ps(scores[0], _mm256_set1_ps(top)));
      _mm256_store_ps(weights[q] + kHalf, _mm256_sub_ps(scores[1], _mm256_set1_ps(top)));
    }
    float* flat = &weights[0][0];
#pragma omp simd
    for (int i = 0; i < heads * kTile; ++i) flat[i] = std::exp(flat[i]);  // vector exp (libmvec)
#pragma omp simd
    for (int q = 0; q < kHeads; ++q) rescale[q] = std::exp(rescale[q]);
    for (int q = 0; q < heads; ++q) {
      for (int64_t t = n; t < kTile; ++t) weights[q][t] = 0.0f;
      float* s = state + (q0 + q) * stride;
      s[g.head_dim + 1] = s[g.head_dim + 1] * rescale[q] +
          sum_of(_mm256_add_ps(_mm256_load_ps(weights[q]), _mm256_load_ps(weights[q] + kHalf)));
    }
    for (int h0 = 0; h0 < heads; h0 += kPass)
      accumulate_up_to<VECTORS, kPass>(std::min(kPass, heads - h0), state + (q0 + h0) * stride,
                                       stride, weights + h0, rescale + h0, values, offsets, n);
  }
}
#endif

using FoldTile = void (*)(const Geometry&, const float*, const float*, const float*,
                          const int64_t*, int64_t, float, float*, Prefetch&, int64_t);

inline FoldTile choose_fold(int64_t head_dim) {
#if defined(__AVX512F__)
  switch (head_dim) {
    case 16: return fold_tile_avx512<1>;
    case 32: return fold_tile_avx512<2>;
    case 64: return fold_tile_avx512<4>;
    case 128: return fold_tile_avx512<8>;
    default: break;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  switch (head_dim) {
    case 32: return fold_tile_avx2<4>;
    case 64: return fold_tile_avx2<8>;
    case 128: return fold_tile_avx2<16>;
    default: break;
  }
#endif
  return fold_tile_plain;
}

}  // namespace decode
