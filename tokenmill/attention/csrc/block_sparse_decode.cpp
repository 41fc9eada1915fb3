// Sparse decode attention in two calls per layer, for the block-sparse backends:
//
// topp_select   retrieval-topp's choice of blocks for every (decode row, KV head):
//               local heads keep their sink and window blocks; a retrieval head
//               scores each token of the context on its index dimensions (the index
//               kept beside the cache), softmaxes per query head, sums per block,
//               keeps per query head the blocks that reach top_p of the mass, takes
//               the union over the group, adds the sink and window blocks and clamps
//               the count to [least, max(most, forced)] (forced first, then chosen,
//               then the rest, by the group's largest mass). The same rule as
//               attention/retrieval.py's PyTorch selection (its reference), without
//               the ~100 small tensor operations per layer that made it cost more
//               than dense attention on small models.
// paged_decode_lists
//               attention of each (row, KV head) over its own list of logical blocks,
//               read in place from the paged cache, a tile of up to 16 of a block's
//               tokens at a time folded into a running softmax per query head with
//               decode_tile.h's fold, as csrc/paged_decode.cpp does for whole
//               contexts, the next tile's lines prefetched meanwhile.
//
// float32 throughout; built with -ffast-math.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>
#include <vector>

#include "decode_common.h"
#include "decode_tile.h"

namespace {

using decode::dot;
using decode::kNoScore;
using decode::scale_add;

struct Selection {
  int64_t block_size, sink_blocks, window, least, most;
  float top_p, scale;
};

// One share of one retrieval head of one row: blocks [first, last) of the context.
// Scores every token of them for each of the group's query heads on the index
// dimensions, and leaves per query head the share's maximum score and, per block,
// the sum of exp(score - that maximum).
void score_share(const Selection& sel, const float* query, int64_t group,
                 int64_t index_dims, const float* index, int64_t index_row,
                 int64_t head_offset, const int64_t* table, int64_t length, int64_t first,
                 int64_t last, float* share_max, float* block_sums, int64_t width,
                 std::vector<float>& scores) {
  const int64_t begin = first * sel.block_size;
  const int64_t end = std::min(last * sel.block_size, length);
  const int64_t n = std::max<int64_t>(end - begin, 0);
  scores.resize(group * n);
  for (int64_t g = 0; g < group; ++g) share_max[g] = kNoScore;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t position = begin + t;
    const int64_t slot = table[position / sel.block_size] * sel.block_size +
                         position % sel.block_size;
    const float* key = index + slot * index_row + head_offset;
    for (int64_t g = 0; g < group; ++g) {
      const float score = sel.scale * dot(query + g * index_dims, key, index_dims);
      scores[g * n + t] = score;
      share_max[g] = std::max(share_max[g], score);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores.data() + g * n;
    const float top = share_max[g];
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) row[t] = std::exp(row[t] - top);
    float* sums = block_sums + g * width;
    for (int64_t b = first; b < last; ++b) {
      const int64_t a = b * sel.block_size - begin;
      const int64_t z = std::min(a + sel.block_size, n);
      float sum = 0.0f;
      for (int64_t t = a; t < z; ++t) sum += row[t];
      sums[b] = sum;
    }
  }
}

// The kept blocks of one retrieval head of one row, from its shares' maxima
// [shares][group] and block sums [group][width] (blocks of share c: c * per_share ..).
void choose_retrieval(const Selection& sel, int64_t group, int64_t blocks, int64_t width,
                      int64_t per_share, const float* share_max, const float* block_sums,
                      const std::vector<char>& forced, std::vector<int64_t>& out) {
  std::vector<float> mass(blocks), priority(blocks, 0.0f);
  std::vector<char> chosen(blocks, 0);
  std::vector<int64_t> order(blocks);
  const int64_t shares = (blocks + per_share - 1) / per_share;
  for (int64_t g = 0; g < group; ++g) {
    float top = kNoScore;
    for (int64_t c = 0; c < shares; ++c) top = std::max(top, share_max[c * group + g]);
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      mass[b] = block_sums[g * width + b] * std::exp(share_max[(b / per_share) * group + g] - top);
      total += mass[b];
    }
    for (int64_t b = 0; b < blocks; ++b) mass[b] /= total;
    // Blocks by mass (ties: the earlier block first), kept while the mass before
    // them is under top_p: sorted a few at a time, as far as the mass takes them.
    std::iota(order.begin(), order.end(), 0);
    const auto heavier = [&mass](int64_t a, int64_t b) {
      return mass[a] > mass[b] || (mass[a] == mass[b] && a < b);
    };
    float before = 0.0f;
    int64_t sorted = 0, next = 0;
    for (int64_t step = 32; next < blocks && before < sel.top_p; step *= 4) {
      const int64_t upto = std::min(blocks, sorted + step);
      std::partial_sort(order.begin() + sorted, order.begin() + upto, order.end(), heavier);
      sorted = upto;
      for (; next < sorted && before < sel.top_p; ++next) {
        chosen[order[next]] = 1;
        before += mass[order[next]];
      }
    }
    for (int64_t b = 0; b < blocks; ++b) priority[b] = std::max(priority[b], mass[b]);
  }
  int64_t wanted = 0, forced_count = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    wanted += (chosen[b] || forced[b]);
    forced_count += forced[b];
  }
  const int64_t ceiling = std::max(forced_count, sel.most);
  const int64_t count = std::min(std::min(std::max(wanted, sel.least), ceiling), blocks);
  out.clear();
  if (count == wanted) {  // no floor or ceiling to apply: the chosen and the forced
    for (int64_t b = 0; b < blocks; ++b)
      if (chosen[b] || forced[b]) out.push_back(b);
    return;
  }
  std::vector<float> key(blocks);
  for (int64_t b = 0; b < blocks; ++b)
    key[b] = forced[b] * 4.0f + chosen[b] * 2.0f + priority[b];
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&key](int64_t a, int64_t b) { return key[a] > key[b]; });
  out.assign(order.begin(), order.begin() + count);
  std::sort(out.begin(), out.end());
}

}  // namespace

// q [D, KVH, G, Dh] contiguous; tables [D, W]; lengths [D] (context and own token);
// index [slots, R, r]; dims [R, r]; heads [R] (the retrieval KV heads, ascending).
// Returns (lists [D, KVH, W] int64: kept logical blocks in context order, the first
// counts[d, h] valid; counts [D, KVH] int64).
std::tuple<torch::Tensor, torch::Tensor> topp_select(
    torch::Tensor q, torch::Tensor tables, torch::Tensor lengths, torch::Tensor index,
    torch::Tensor dims, torch::Tensor heads, int64_t block_size, int64_t sink_blocks,
    int64_t window, double top_p, int64_t least, int64_t most, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && index.dtype() == torch::kFloat32,
              "topp_select takes float32 queries and index");
  TORCH_CHECK(q.is_contiguous() && tables.is_contiguous() && lengths.is_contiguous() &&
                  index.is_contiguous() && dims.is_contiguous() && heads.is_contiguous(),
              "topp_select takes contiguous tensors");
  const int64_t rows = q.size(0), kv_heads = q.size(1), group = q.size(2),
                head_dim = q.size(3), width = tables.size(1);
  const int64_t retrieval = heads.size(0), index_dims = dims.size(1);
  const int64_t index_row = retrieval * index_dims;
  auto lists = torch::zeros({rows, kv_heads, width}, tables.options());
  auto counts = torch::zeros({rows, kv_heads}, tables.options());
  const Selection sel{block_size, sink_blocks, window, least, most,
                      static_cast<float>(top_p), static_cast<float>(scale)};
  const float* q_data = q.data_ptr<float>();
  const float* index_data = index.data_ptr<float>();
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t* length_data = lengths.data_ptr<int64_t>();
  const int64_t* dim_data = dims.data_ptr<int64_t>();
  const int64_t* head_data = heads.data_ptr<int64_t>();
  int64_t* list_data = lists.data_ptr<int64_t>();
  int64_t* count_data = counts.data_ptr<int64_t>();
  std::vector<int64_t> slot_of(kv_heads, -1);  // KV head -> its place among the retrieval
  for (int64_t r = 0; r < retrieval; ++r) slot_of[head_data[r]] = r;

  // Scores, split into shares of whole blocks so that one long row's retrieval head
  // spreads over the threads (the choice itself is per head, after).
  int64_t longest = 0;
  for (int64_t row = 0; row < rows; ++row) longest = std::max(longest, length_data[row]);
  const int64_t longest_blocks = std::min((longest + block_size - 1) / block_size, width);
  const int64_t threads = at::get_num_threads();
  const int64_t work = std::max<int64_t>(rows * retrieval, 1);
  const int64_t shares = std::max<int64_t>(
      1, std::min((2 * threads + work - 1) / work, longest_blocks / 8));
  const int64_t per_share = std::max<int64_t>(1, (longest_blocks + shares - 1) / shares);
  // The index dimensions of each (row, retrieval head)'s query heads.
  std::vector<float> queries(rows * retrieval * group * index_dims);
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t r = 0; r < retrieval; ++r)
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < index_dims; ++j)
          queries[((row * retrieval + r) * group + g) * index_dims + j] =
              q_data[((row * kv_heads + head_data[r]) * group + g) * head_dim +
                     dim_data[r * index_dims + j]];
  std::vector<float> share_max(rows * retrieval * shares * group);
  std::vector<float> block_sums(rows * retrieval * group * width, 0.0f);
  at::parallel_for(0, rows * retrieval * shares, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pair = item / shares, share = item % shares;
      const int64_t row = pair / retrieval, r = pair % retrieval;
      const int64_t length = length_data[row];
      const int64_t blocks = std::min((length + block_size - 1) / block_size, width);
      score_share(sel, queries.data() + pair * group * index_dims, group, index_dims,
                  index_data, index_row, r * index_dims, table_data + row * width, length,
                  std::min(share * per_share, blocks),
                  std::min((share + 1) * per_share, blocks),
                  share_max.data() + (pair * shares + share) * group,
                  block_sums.data() + pair * group * width, width, scores);
    }
  });

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> forced;
    std::vector<int64_t> kept;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, h = item % kv_heads;
      const int64_t length = length_data[row];
      const int64_t blocks = std::min((length + block_size - 1) / block_size, width);
      const int64_t first_window = std::max<int64_t>(length - window, 0) / block_size;
      forced.assign(blocks, 0);
      for (int64_t b = 0; b < blocks; ++b) forced[b] = b < sink_blocks || b >= first_window;
      if (slot_of[h] < 0) {
        kept.clear();
        for (int64_t b = 0; b < blocks; ++b)
          if (forced[b]) kept.push_back(b);
      } else {
        const int64_t pair = row * retrieval + slot_of[h];
        choose_retrieval(sel, group, blocks, width, per_share,
                         share_max.data() + pair * shares * group,
                         block_sums.data() + pair * group * width, forced, kept);
      }
      std::copy(kept.begin(), kept.end(), list_data + item * width);
      count_data[item] = static_cast<int64_t>(kept.size());
    }
  });
  return {lists, counts};
}

// q [D, H, Dh] (contiguous heads in each row); keys, values [blocks, block, KVH, Dh];
// tables [D, W]; lengths [D]; lists [D, KVH, L] logical blocks in context order, the
// first counts[d, h] of them attended (the one holding the row's last token among them).
torch::Tensor paged_decode_lists(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                                 torch::Tensor tables, torch::Tensor lengths,
                                 torch::Tensor lists, torch::Tensor counts, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && keys.dtype() == torch::kFloat32 &&
                  values.dtype() == torch::kFloat32,
              "paged_decode_lists takes float32 queries and a float32 cache");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && keys.is_contiguous() &&
                  values.is_contiguous() && tables.is_contiguous() &&
                  lengths.is_contiguous() && lists.is_contiguous() && counts.is_contiguous(),
              "paged_decode_lists takes contiguous tensors");
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = keys.size(1), kv_heads = keys.size(2), group = heads / kv_heads;
  const int64_t width = tables.size(1), list_width = lists.size(2);
  auto out = torch::empty({rows, heads, head_dim}, q.options());
  const int64_t q_stride = q.stride(0);
  const float* q_data = q.data_ptr<float>();
  const float* k_data = keys.data_ptr<float>();
  const float* v_data = values.data_ptr<float>();
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t* length_data = lengths.data_ptr<int64_t>();
  const int64_t* list_data = lists.data_ptr<int64_t>();
  const int64_t* count_data = counts.data_ptr<int64_t>();
  float* out_data = out.data_ptr<float>();
  const float s = static_cast<float>(scale);

  const decode::Geometry g{heads, kv_heads, group, head_dim, block_size, width};
  const decode::FoldTile fold = decode::choose_fold(head_dim);
  const int64_t token_floats = kv_heads * head_dim, stride = head_dim + 2;

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> state(group * stride);
    int64_t offsets[2][decode::kTile];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, h = item % kv_heads;
      const int64_t length = length_data[row];
      const float* query = q_data + row * q_stride + h * group * head_dim;
      for (int64_t q = 0; q < group; ++q) {
        float* s_q = state.data() + q * stride;
        std::fill(s_q, s_q + head_dim, 0.0f);
        s_q[head_dim] = kNoScore;  // running maximum
        s_q[head_dim + 1] = 0.0f;  // sum of exponentials
      }
      // The kept blocks' tokens in tiles of up to kTile (a tile stays in one block).
      const int64_t* list = list_data + item * list_width;
      const int64_t kept = count_data[item];
      int64_t i = 0, t0 = 0;  // the next tile: list entry, first token in its block
      const auto next_tile = [&](int64_t* offsets_out) -> int64_t {
        for (; i < kept; ++i, t0 = 0) {
          const int64_t b = list[i];
          const int64_t count = std::min(block_size, length - b * block_size);
          if (t0 >= count) continue;
          const int64_t n = std::min(decode::kTile, count - t0);
          const int64_t first = table_data[row * width + b] * block_size + t0;
          for (int64_t t = 0; t < n; ++t) offsets_out[t] = (first + t) * token_floats;
          t0 += n;
          return n;
        }
        return 0;
      };
      decode::Prefetch ahead;
      int64_t n = next_tile(offsets[0]);
      for (int64_t tile = 0; n > 0; tile ^= 1) {
        const int64_t next_n = next_tile(offsets[tile ^ 1]);
        ahead.start(k_data + h * head_dim, v_data + h * head_dim, offsets[tile ^ 1], next_n,
                    head_dim);
        fold(g, query, k_data + h * head_dim, v_data + h * head_dim, offsets[tile], n, s,
             state.data(), ahead, (ahead.total + group - 1) / group);
        ahead.step(ahead.total);
        n = next_n;
      }
      for (int64_t q = 0; q < group; ++q) {
        const float* s_q = state.data() + q * stride;
        float* target = out_data + (row * heads + h * group + q) * head_dim;
        const float inverse = s_q[head_dim + 1] > 0.0f ? 1.0f / s_q[head_dim + 1] : 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) target[d] = s_q[d] * inverse;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("topp_select", &topp_select, "retrieval-topp's block choice for decode rows");
  m.def("paged_decode_lists", &paged_decode_lists,
        "decode attention over per-head lists of blocks of a paged KV cache");
}
