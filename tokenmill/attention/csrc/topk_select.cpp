// The block choice of the fixed-budget sparse backends (quest, static-topk) for every
// (decode row, KV head) in one call, instead of the ~15 tensor operations per layer of
// attention/quest.py's PyTorch selection (its reference), which cost more than the
// attention they saved on small models (docs/BENCHMARKS.md, the self-check's table).
//
// A block's score is, for quest, the largest q . k any key between the block's
// elementwise key bounds can give (sum over dimensions of max(q * min, q * max)); for
// static-topk, the largest q . k over the block's actual keys; either maximised over
// the query heads that share the KV head. The row's first and last blocks are always
// kept; of the others, the best-scored (ties: the earlier block) up to `keep` blocks in
// all (at least 2); a row with no more blocks than that keeps every one. The kept
// blocks come out in context order, for paged_decode_lists (block_sparse_decode.cpp).
//
// float32 throughout; built with -ffast-math.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <numeric>
#include <tuple>
#include <vector>

#include "decode_common.h"

namespace {

using decode::dot;
using decode::kNoScore;

struct Shape {
  int64_t group, head_dim, kv_heads, block_size;
};

// Quest's bound of one block for one KV head's query heads.
float bound_score(const Shape& s, const float* query, const float* low, const float* high) {
  float best = kNoScore;
  for (int64_t g = 0; g < s.group; ++g) {
    const float* qg = query + g * s.head_dim;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < s.head_dim; ++d) sum += std::max(qg[d] * low[d], qg[d] * high[d]);
    best = std::max(best, sum);
  }
  return best;
}

// The best exact score of one block's `count` keys (rows of all KV heads, this head's
// part at `keys`).
float exact_score(const Shape& s, const float* query, const float* keys, int64_t count) {
  float best = kNoScore;
  const int64_t token_floats = s.kv_heads * s.head_dim;
  for (int64_t t = 0; t < count; ++t)
    for (int64_t g = 0; g < s.group; ++g)
      best = std::max(best, dot(query + g * s.head_dim, keys + t * token_floats, s.head_dim));
  return best;
}

}  // namespace

// q [D, KVH, G, Dh] contiguous; key_min, key_max [pool blocks, KVH, Dh] (quest's bounds;
// unread when exact); keys [pool blocks, block, KVH, Dh] (the cache's keys; read only
// when exact); tables [D, W]; lengths [D] (context and own token). Returns (lists
// [D, KVH, W] int64: kept logical blocks in context order, the first counts[d, h]
// valid; counts [D, KVH] int64).
std::tuple<torch::Tensor, torch::Tensor> topk_select(
    torch::Tensor q, torch::Tensor key_min, torch::Tensor key_max, torch::Tensor keys,
    torch::Tensor tables, torch::Tensor lengths, int64_t keep, bool exact) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && key_min.dtype() == torch::kFloat32 &&
                  key_max.dtype() == torch::kFloat32 && keys.dtype() == torch::kFloat32,
              "topk_select takes float32 queries, bounds and keys");
  TORCH_CHECK(q.is_contiguous() && key_min.is_contiguous() && key_max.is_contiguous() &&
                  keys.is_contiguous() && tables.is_contiguous() && lengths.is_contiguous(),
              "topk_select takes contiguous tensors");
  const int64_t rows = q.size(0), kv_heads = q.size(1), width = tables.size(1);
  const Shape s{q.size(2), q.size(3), kv_heads, keys.size(1)};
  TORCH_CHECK(keys.size(2) == kv_heads && keys.size(3) == s.head_dim &&
                  key_min.sizes() == key_max.sizes() && key_min.size(0) == keys.size(0),
              "topk_select: bounds [blocks, KVH, Dh] and keys [blocks, block, KVH, Dh] of "
              "one pool");
  const int64_t k = std::min(std::max<int64_t>(keep, 2), width);
  auto lists = torch::zeros({rows, kv_heads, width}, tables.options());
  auto counts = torch::zeros({rows, kv_heads}, tables.options());
  const float* q_data = q.data_ptr<float>();
  const float* min_data = key_min.data_ptr<float>();
  const float* max_data = key_max.data_ptr<float>();
  const float* key_data = keys.data_ptr<float>();
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t* length_data = lengths.data_ptr<int64_t>();
  int64_t* list_data = lists.data_ptr<int64_t>();
  int64_t* count_data = counts.data_ptr<int64_t>();
  const int64_t block_floats = s.block_size * kv_heads * s.head_dim;

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score;
    std::vector<int64_t> order;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, h = item % kv_heads;
      const int64_t length = length_data[row];
      const int64_t blocks = std::min((length + s.block_size - 1) / s.block_size, width);
      int64_t* out = list_data + item * width;
      if (blocks <= k) {  // everything fits the budget: dense
        std::iota(out, out + blocks, 0);
        count_data[item] = blocks;
        continue;
      }
      const float* query = q_data + item * s.group * s.head_dim;
      const int64_t* table = table_data + row * width;
      // The middle blocks 1 .. blocks - 2 compete for k - 2 places.
      score.resize(blocks);
      for (int64_t b = 1; b + 1 < blocks; ++b) {
        const int64_t physical = table[b];
        score[b] = exact
            ? exact_score(s, query, key_data + physical * block_floats + h * s.head_dim,
                          std::min(s.block_size, length - b * s.block_size))
            : bound_score(s, query, min_data + (physical * kv_heads + h) * s.head_dim,
                          max_data + (physical * kv_heads + h) * s.head_dim);
      }
      order.resize(blocks - 2);
      std::iota(order.begin(), order.end(), 1);
      std::partial_sort(order.begin(), order.begin() + (k - 2), order.end(),
                        [&score](int64_t a, int64_t b) {
                          return score[a] > score[b] || (score[a] == score[b] && a < b);
                        });
      std::sort(order.begin(), order.begin() + (k - 2));
      out[0] = 0;
      std::copy(order.begin(), order.begin() + (k - 2), out + 1);
      out[k - 1] = blocks - 1;
      count_data[item] = k;
    }
  });
  return {lists, counts};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("topk_select", &topk_select,
        "quest's (bounds) or static-topk's (exact) block choice for decode rows");
}
