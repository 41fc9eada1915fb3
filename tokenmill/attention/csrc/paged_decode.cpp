// Decode attention read in place from the paged KV cache: no gathered copy of any
// request's context, no padding to the longest request.
//
// A work item on torch's thread pool is one request's run of consecutive blocks (its
// whole context, or a share of it when there are fewer requests than threads): for
// each block in its block table it scores every token's keys against all query heads
// (the G query heads of a KV head against that head's key), then folds the block into
// a running softmax per query head (the running maximum, the sum of exponentials and
// the weighted sum of values, rescaled when the maximum grows). A block is one
// contiguous run of memory ([block_size][KV heads][head_dim]), read once, front to
// back, while the next block of the table is prefetched: blocks lie anywhere in the
// pool, where the hardware prefetcher cannot follow. A request split into several
// shares has them merged at the end (the shares' maxima rescale their sums), as
// flash-decoding does on GPUs. float32 throughout; built with -ffast-math for vector
// exponentials and reassociated dot products.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "decode_common.h"

namespace {

using decode::dot;
using decode::kNoScore;
using decode::scale_add;

constexpr int64_t kMinBlocksPerShare = 4;
inline void prefetch_block(const float* keys, const float* values, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) {
    __builtin_prefetch(keys + i);
    __builtin_prefetch(values + i);
  }
}

struct Geometry {
  int64_t heads, kv_heads, group, head_dim, block_size, width;
};

// One share of one request: blocks [first, last) of its table, `length` keys in all.
// Leaves per query head the running maximum, the sum of exponentials and the
// unnormalised weighted sum of values in `state` ([heads][head_dim + 2]).
void attend_share(const Geometry& g, const float* query, const float* k_data,
                  const float* v_data, const int64_t* table, int64_t length, int64_t first,
                  int64_t last, float scale, float* state, std::vector<float>& scores) {
  const int64_t stride = g.head_dim + 2, block_floats = g.block_size * g.kv_heads * g.head_dim;
  for (int64_t h = 0; h < g.heads; ++h) {
    float* s = state + h * stride;
    std::fill(s, s + g.head_dim, 0.0f);
    s[g.head_dim] = kNoScore;  // running maximum
    s[g.head_dim + 1] = 0.0f;  // sum of exponentials
  }
  for (int64_t b = first; b < last; ++b) {
    const int64_t start = b * g.block_size;
    const int64_t count = std::min(g.block_size, length - start);
    if (count <= 0) break;
    const float* keys = k_data + table[b] * block_floats;
    const float* values = v_data + table[b] * block_floats;
    if (b + 1 < last && start + g.block_size < length)
      prefetch_block(k_data + table[b + 1] * block_floats, v_data + table[b + 1] * block_floats,
                     block_floats);
    // scores[h][t] for the block's tokens, keys read in memory order.
    for (int64_t t = 0; t < count; ++t)
      for (int64_t kv = 0; kv < g.kv_heads; ++kv) {
        const float* key = keys + (t * g.kv_heads + kv) * g.head_dim;
        for (int64_t q = kv * g.group; q < (kv + 1) * g.group; ++q)
          scores[q * g.block_size + t] = scale * dot(query + q * g.head_dim, key, g.head_dim);
      }
    for (int64_t h = 0; h < g.heads; ++h) {
      float* score = scores.data() + h * g.block_size;
      float* s = state + h * stride;
      decode::fold_block(score, count, s, g.head_dim, s[g.head_dim], s[g.head_dim + 1]);
    }
    for (int64_t t = 0; t < count; ++t)
      for (int64_t kv = 0; kv < g.kv_heads; ++kv) {
        const float* value = values + (t * g.kv_heads + kv) * g.head_dim;
        for (int64_t q = kv * g.group; q < (kv + 1) * g.group; ++q)
          scale_add(state + q * stride, value, scores[q * g.block_size + t], g.head_dim);
      }
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
  const Geometry g{q.size(1), keys.size(2), q.size(1) / keys.size(2), q.size(2), keys.size(1),
                   tables.size(1)};
  auto out = torch::empty({rows, q.size(1), q.size(2)}, q.options());
  const int64_t q_stride = q.stride(0);
  const float* q_data = q.data_ptr<float>();
  const float* k_data = keys.data_ptr<float>();
  const float* v_data = values.data_ptr<float>();
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t* length_data = lengths.data_ptr<int64_t>();
  float* out_data = out.data_ptr<float>();
  const float s = static_cast<float>(scale);

  // Shares per request: enough items for two per thread, none under a few blocks.
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, length_data[r]);
  const int64_t longest_blocks = (longest + g.block_size - 1) / g.block_size;
  const int64_t threads = at::get_num_threads();
  const int64_t shares = std::max<int64_t>(
      1, std::min((2 * threads + rows - 1) / rows, longest_blocks / kMinBlocksPerShare));
  const int64_t stride = g.head_dim + 2;
  std::vector<float> states(rows * shares * g.heads * stride);

  at::parallel_for(0, rows * shares, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(g.heads * g.block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / shares, share = item % shares;
      const int64_t length = length_data[row];
      const int64_t blocks = std::min((length + g.block_size - 1) / g.block_size, g.width);
      const int64_t per_share = (blocks + shares - 1) / shares;
      attend_share(g, q_data + row * q_stride, k_data, v_data,
                   table_data + row * g.width, length, share * per_share,
                   std::min(blocks, (share + 1) * per_share), s,
                   states.data() + item * g.heads * stride, scores);
    }
  });

  // Merge each request's shares: rescale to the largest maximum, then normalise.
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t h = 0; h < g.heads; ++h) {
      float top = kNoScore;
      for (int64_t share = 0; share < shares; ++share)
        top = std::max(top, states[((row * shares + share) * g.heads + h) * stride + g.head_dim]);
      float* target = out_data + (row * g.heads + h) * g.head_dim;
      std::fill(target, target + g.head_dim, 0.0f);
      float total = 0.0f;
      for (int64_t share = 0; share < shares; ++share) {
        const float* state = states.data() + ((row * shares + share) * g.heads + h) * stride;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention in place over a paged KV cache");
}
