// Decode attention read in place from the paged KV cache: no gathered copy of any
// request's context, no padding to the longest request.
//
// A work item on torch's thread pool is one request's run of tokens (its whole
// context, or a share of it when requests are fewer than two per thread), read a tile
// of up to 16 tokens at a time with all KV heads (a token's keys for every head are
// one contiguous row: reading each head's part in a separate item halves the rows
// the memory streams and measured far slower in the engine, docs/BENCHMARKS.md): per
// KV head, the G query heads that share it are scored against its keys and the tile
// is folded into a running softmax per query head (the running maximum, the sum of
// exponentials and the weighted sum of values, rescaled when the maximum grows). A
// tile's tokens are found through the block table one by one, so any block size works
// and a tile may span blocks; the next tile's rows are prefetched a few lines per query
// head while the current one is folded (blocks lie anywhere in the pool, where the
// hardware prefetcher cannot follow). A request split into shares has them merged
// at the end (the shares' maxima rescale their sums), as flash-decoding does on GPUs.
//
// With AVX-512 and a head size that is a multiple of 16 (up to 128), a tile's 16
// scores of a query head come out in one register: each token's dot product is summed
// into 16 lanes and the 16 partial vectors are folded together by a transposing
// reduction (45 shuffles and adds instead of 16 horizontal sums), and each query
// head's weighted sum of values stays in registers through the tile. Elsewhere the
// plain loops below (dot products and scaled adds) serve. float32 throughout; built
// with -ffast-math for vector exponentials and reassociated dot products.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "decode_common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using decode::dot;
using decode::kNoScore;
using decode::scale_add;

constexpr int64_t kTile = 16;
constexpr int64_t kMinTokensPerShare = 64;

struct Geometry {
  int64_t heads, kv_heads, group, head_dim, block_size, width;
};

// Where the keys (and, at the same offset, the values) of tokens [start, start + n)
// of a request lie (their rows of all KV heads); n <= kTile.
inline void tile_offsets(const Geometry& g, const int64_t* table, int64_t start, int64_t n,
                         int64_t* offsets) {
  const int64_t token_floats = g.kv_heads * g.head_dim;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t position = start + t;
    offsets[t] = (table[position / g.block_size] * g.block_size + position % g.block_size) *
                 token_floats;
  }
}

// The next tile's cache lines (keys and values of each of its tokens), requested a
// few at a time while the current tile is folded: a burst of all of them at once
// (256 lines for a tile of 16 tokens of 2 x 64-dim heads) exceeds the lines a core
// can have in flight. TM_PREFETCH_BURST restores the burst (for comparison).
struct Prefetch {
  const float* keys = nullptr;
  const float* values = nullptr;
  const int64_t* offsets = nullptr;
  int64_t row_lines = 0, total = 0, next = 0;

  void start(const Geometry& g, const float* k, const float* v, const int64_t* o, int64_t n) {
    keys = k, values = v, offsets = o, next = 0;
    row_lines = (g.kv_heads * g.head_dim + 15) / 16;
    total = 2 * n * row_lines;
  }
  // Request up to `count` more lines, token by token, each token's keys then values.
  inline void step(int64_t count) {
    for (const int64_t stop = std::min(total, next + count); next < stop; ++next) {
      const int64_t t = next / (2 * row_lines), within = next % (2 * row_lines);
      const float* base = within < row_lines ? keys : values;
      __builtin_prefetch(base + offsets[t] + (within % row_lines) * 16);
    }
  }
};

// The plain form: any head size, any CPU. state: [group][head_dim + 2] for the item's
// query heads (weighted sum, running maximum, sum of exponentials).
void fold_tile_plain(const Geometry& g, const float* query, const float* keys,
                     const float* values, const int64_t* offsets, int64_t n, float scale,
                     float* state, Prefetch& ahead, int64_t per_head) {
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

// The register form, for head_dim = 16 * VECTORS.
template <int VECTORS>
void fold_tile_avx512(const Geometry& g, const float* query, const float* keys,
                      const float* values, const int64_t* offsets, int64_t n, float scale,
                      float* state, Prefetch& ahead, int64_t per_head) {
  const int64_t stride = g.head_dim + 2;
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
  alignas(64) float weights[kTile];
  for (int64_t q = 0; q < g.group; ++q) {
    ahead.step(per_head);
    __m512 qv[VECTORS];
    for (int i = 0; i < VECTORS; ++i) qv[i] = _mm512_loadu_ps(query + q * g.head_dim + 16 * i);
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
    float* s = state + q * stride;
    const float top = std::max(s[g.head_dim], _mm512_reduce_max_ps(scores));
    const float rescale = std::exp(s[g.head_dim] - top);
    _mm512_store_ps(weights, _mm512_sub_ps(scores, _mm512_set1_ps(top)));
#pragma omp simd
    for (int t = 0; t < kTile; ++t) weights[t] = std::exp(weights[t]);  // vector exp (libmvec)
    const __m512 w = _mm512_maskz_mov_ps(live, _mm512_load_ps(weights));
    s[g.head_dim] = top;
    s[g.head_dim + 1] = s[g.head_dim + 1] * rescale + _mm512_reduce_add_ps(w);
    _mm512_store_ps(weights, w);
    __m512 acc[VECTORS];
    const __m512 r = _mm512_set1_ps(rescale);
    for (int i = 0; i < VECTORS; ++i) acc[i] = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * i), r);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 p = _mm512_set1_ps(weights[t]);
      const float* value = values + offsets[t];
      for (int i = 0; i < VECTORS; ++i)
        acc[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(value + 16 * i), acc[i]);
    }
    for (int i = 0; i < VECTORS; ++i) _mm512_storeu_ps(s + 16 * i, acc[i]);
  }
}
#endif

using FoldTile = void (*)(const Geometry&, const float*, const float*, const float*,
                          const int64_t*, int64_t, float, float*, Prefetch&, int64_t);

FoldTile choose_fold(int64_t head_dim) {
#if defined(__AVX512F__)
  switch (head_dim) {
    case 16: return fold_tile_avx512<1>;
    case 32: return fold_tile_avx512<2>;
    case 64: return fold_tile_avx512<4>;
    case 128: return fold_tile_avx512<8>;
    default: break;
  }
#endif
  return fold_tile_plain;
}

// One share of one request: tokens [first, last). Leaves per query head the running
// maximum, the sum of exponentials and the unnormalised weighted sum of values in
// `state` ([heads][head_dim + 2]).
void attend_share(const Geometry& g, FoldTile fold, const float* query, const float* k_data,
                  const float* v_data, const int64_t* table, int64_t first, int64_t last,
                  float scale, float* state) {
  const int64_t stride = g.head_dim + 2;
  for (int64_t h = 0; h < g.heads; ++h) {
    float* s = state + h * stride;
    std::fill(s, s + g.head_dim, 0.0f);
    s[g.head_dim] = kNoScore;  // running maximum
    s[g.head_dim + 1] = 0.0f;  // sum of exponentials
  }
  int64_t offsets[2][kTile];
  int64_t n = std::min(kTile, last - first);
  if (n > 0) tile_offsets(g, table, first, n, offsets[0]);
  Prefetch ahead;
  for (int64_t start = first, tile = 0; start < last; start += kTile, tile ^= 1) {
    const int64_t next_start = start + kTile;
    const int64_t next_n = std::max<int64_t>(0, std::min(kTile, last - next_start));
    if (next_n > 0) tile_offsets(g, table, next_start, next_n, offsets[tile ^ 1]);
    ahead.start(g, k_data, v_data, offsets[tile ^ 1], next_n);
#ifdef TM_PREFETCH_BURST
    ahead.step(ahead.total);
#endif
    // The lines spread evenly over the tile's query heads.
    const int64_t per_head = (ahead.total + g.heads - 1) / g.heads;
    for (int64_t kv = 0; kv < g.kv_heads; ++kv)
      fold(g, query + kv * g.group * g.head_dim, k_data + kv * g.head_dim,
           v_data + kv * g.head_dim, offsets[tile], n, scale,
           state + kv * g.group * stride, ahead, per_head);
    ahead.step(ahead.total);  // any left over
    n = next_n;
  }
}

}  // namespace

// q [D, H, Dh] (rows may be strided: Q and K come from one rotated tensor); keys, values
// [blocks, block_size, KVH, Dh]; tables [D, W] int64;
// lengths [D] int64: keys row d attends to (its context and its own token).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                           torch::Tensor tables, torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && keys.dtype() == torch::kFloat32 &&
                  values.dtype() == torch::kFloat32,
              "paged_decode takes float32 queries and a float32 cache");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && keys.is_contiguous() &&
                  values.is_contiguous() && tables.is_contiguous() && lengths.is_contiguous(),
              "paged_decode takes contiguous tensors (q: contiguous heads in each row)");
  const int64_t rows = q.size(0);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == rows && lengths.numel() == rows,
              "paged_decode: one block table and one key count per query row");
  const Geometry g{q.size(1), keys.size(2), q.size(1) / keys.size(2), q.size(2), keys.size(1),
                   tables.size(1)};
  const FoldTile fold = choose_fold(g.head_dim);
  auto out = torch::empty({rows, q.size(1), q.size(2)}, q.options());
  const int64_t q_stride = q.stride(0);
  const float* q_data = q.data_ptr<float>();
  const float* k_data = keys.data_ptr<float>();
  const float* v_data = values.data_ptr<float>();
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t* length_data = lengths.data_ptr<int64_t>();
  float* out_data = out.data_ptr<float>();
  const float s = static_cast<float>(scale);

  // Shares per request: enough items for two per thread, none under a few tiles.
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r)
    longest = std::max(longest, std::min(length_data[r], g.width * g.block_size));
  const int64_t threads = at::get_num_threads();
  const int64_t shares = std::max<int64_t>(
      1, std::min((2 * threads + rows - 1) / rows, longest / kMinTokensPerShare));
  const int64_t stride = g.head_dim + 2, item_floats = g.heads * stride;
  std::vector<float> states(rows * shares * item_floats);

  at::parallel_for(0, rows * shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / shares, share = item % shares;
      const int64_t length = std::min(length_data[row], g.width * g.block_size);
      const int64_t per_share = (length + shares - 1) / shares;
      attend_share(g, fold, q_data + row * q_stride, k_data, v_data,
                   table_data + row * g.width, share * per_share,
                   std::min(length, (share + 1) * per_share), s,
                   states.data() + item * item_floats);
    }
  });

  // Merge each request's shares: rescale to the largest maximum, then normalise.
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t h = 0; h < g.heads; ++h) {
      const float* first = states.data() + row * shares * item_floats + h * stride;
      float top = kNoScore;
      for (int64_t share = 0; share < shares; ++share)
        top = std::max(top, first[share * item_floats + g.head_dim]);
      float* target = out_data + (row * g.heads + h) * g.head_dim;
      std::fill(target, target + g.head_dim, 0.0f);
      float total = 0.0f;
      for (int64_t share = 0; share < shares; ++share) {
        const float* state = first + share * item_floats;
        if (state[g.head_dim + 1] == 0.0f) continue;  // an empty share
        const float weight = std::exp(state[g.head_dim] - top);
        total += state[g.head_dim + 1] * weight;
        scale_add(target, state, weight, g.head_dim);
      }
      const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
      for (int64_t i = 0; i < g.head_dim; ++i) target[i] *= inverse;
    }
  return out;
}

// The step's new keys and values k, v [T, KVH, Dh] (rows may be strided) stored at
// their slots (block * block_size + offset) of the pool, then paged_decode: one call
// instead of a write and a read per layer.
torch::Tensor write_and_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor slots, torch::Tensor keys, torch::Tensor values,
                               torch::Tensor tables, torch::Tensor lengths, double scale) {
  TORCH_CHECK(k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32 &&
                  keys.dtype() == torch::kFloat32 && values.dtype() == torch::kFloat32 &&
                  slots.dtype() == torch::kInt64 && slots.is_contiguous(),
              "write_and_decode takes float32 keys and values and int64 slots");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "the pool must be contiguous");
  const int64_t token_floats = keys.size(2) * keys.size(3);
  const int64_t pool_slots = keys.size(0) * keys.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* key_pool = keys.data_ptr<float>();
  float* value_pool = values.data_ptr<float>();
  for (int64_t t = 0; t < slots.numel(); ++t)  // all checked before any is written
    TORCH_CHECK(slot[t] >= 0 && slot[t] < pool_slots, "write_and_decode: slot out of range");
  for (const auto& [fresh, pool] : {std::pair{k, key_pool}, std::pair{v, value_pool}}) {
    TORCH_CHECK(fresh.dim() == 3 && fresh.size(0) == slots.numel() &&
                    fresh.size(1) * fresh.size(2) == token_floats && fresh.stride(2) == 1 &&
                    fresh.stride(1) == fresh.size(2),
                "write_and_decode: k and v are [T, KVH, Dh] with contiguous heads");
    const float* rows = fresh.data_ptr<float>();
    for (int64_t t = 0; t < fresh.size(0); ++t)
      std::copy(rows + t * fresh.stride(0), rows + t * fresh.stride(0) + token_floats,
                pool + slot[t] * token_floats);
  }
  return paged_decode(q, keys, values, tables, lengths, scale);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention in place over a paged KV cache");
  m.def("write_and_decode", &write_and_decode,
        "store the step's keys and values at their slots, then paged_decode");
}
