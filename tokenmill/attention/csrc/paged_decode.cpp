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
// and a tile may span blocks; the next tile's rows are prefetched a few tokens per query
// head while the current one is folded (blocks lie anywhere in the pool, where the
// hardware prefetcher cannot follow). A request split into shares has them merged
// at the end (the shares' maxima rescale their sums), as flash-decoding does on GPUs.
// The tile fold and the prefetcher are decode_tile.h's (shared with the sparse
// backends' list kernel). float32 throughout; built with -ffast-math for vector
// exponentials and reassociated dot products.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "decode_common.h"
#include "entry_points.h"
#include "rotary.h"
#include "decode_tile.h"

namespace {

using decode::choose_fold;
using decode::FoldTile;
using decode::Geometry;
using decode::kNoScore;
using decode::kTile;
using decode::Prefetch;
using decode::scale_add;

constexpr int64_t kMinTokensPerShare = 64;

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
    ahead.start(k_data, v_data, offsets[tile ^ 1], next_n, g.kv_heads * g.head_dim);
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

// The checks every entry makes of a step's pool, block tables and key counts, for
// `rows` query rows of `heads` heads of `head_dim`.
void check_pool(int64_t rows, int64_t heads, int64_t head_dim, const torch::Tensor& keys,
                const torch::Tensor& values, const torch::Tensor& tables,
                const torch::Tensor& lengths) {
  TORCH_CHECK(keys.dtype() == torch::kFloat32 && values.dtype() == torch::kFloat32,
              "paged_decode takes float32 queries and a float32 cache");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && tables.is_contiguous() &&
                  lengths.is_contiguous(),
              "paged_decode takes a contiguous pool, block tables and key counts");
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && keys.size(3) == head_dim &&
                  heads % keys.size(2) == 0,
              "paged_decode: the pool is [blocks, block size, KVH, Dh] with KVH dividing H");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == rows && lengths.numel() == rows,
              "paged_decode: one block table and one key count per query row");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lengths.dtype() == torch::kInt64,
              "paged_decode takes int64 block tables and key counts");
}

// The attention of `rows` query rows (row r's heads contiguous from q_data + r *
// q_stride) into out_data [rows][heads][head_dim]; check_pool has passed.
void decode_rows(const float* q_data, int64_t q_stride, int64_t rows, int64_t heads,
                 int64_t head_dim, const torch::Tensor& keys, const torch::Tensor& values,
                 const torch::Tensor& tables, const torch::Tensor& lengths, double scale,
                 float* out_data) {
  const Geometry g{heads, keys.size(2), heads / keys.size(2), head_dim, keys.size(1),
                   tables.size(1)};
  const FoldTile fold = choose_fold(g.head_dim);
  const float* k_data = keys.data_ptr<float>();
  const float* v_data = values.data_ptr<float>();
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t* length_data = lengths.data_ptr<int64_t>();
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
}

// q [D, H, Dh] (rows may be strided: Q and K come from one rotated tensor); keys, values
// [blocks, block_size, KVH, Dh]; tables [D, W] int64;
// lengths [D] int64: keys row d attends to (its context and its own token).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                           torch::Tensor tables, torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 3 && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "paged_decode takes float32 queries q [D, H, Dh] with contiguous heads");
  const int64_t rows = q.size(0);
  check_pool(rows, q.size(1), q.size(2), keys, values, tables, lengths);
  auto out = torch::empty({rows, q.size(1), q.size(2)}, q.options());
  decode_rows(q.data_ptr<float>(), q.stride(0), rows, q.size(1), q.size(2), keys, values,
              tables, lengths, scale, out.data_ptr<float>());
  return out;
}

// Rows of `token_floats` values (row t at rows + t * row_stride) stored at their slots
// (block * block_size + offset) of the pool (checked_slots has checked them).
void store_rows(const float* rows, int64_t row_stride, int64_t tokens, const int64_t* slot,
                float* pool, int64_t token_floats) {
  for (int64_t t = 0; t < tokens; ++t)
    std::copy(rows + t * row_stride, rows + t * row_stride + token_floats,
              pool + slot[t] * token_floats);
}

const int64_t* checked_slots(const torch::Tensor& slots, int64_t tokens,
                             const torch::Tensor& keys) {
  TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.is_contiguous() &&
                  slots.numel() == tokens,
              "write_and_decode takes int64 slots, one per row");
  const int64_t pool_slots = keys.size(0) * keys.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)  // all checked before any is written
    TORCH_CHECK(slot[t] >= 0 && slot[t] < pool_slots, "write_and_decode: slot out of range");
  return slot;
}

// The step's new keys and values k, v [T, KVH, Dh] (rows may be strided) stored at
// their slots (block * block_size + offset) of the pool, then paged_decode: one call
// instead of a write and a read per layer.
torch::Tensor write_and_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor slots, torch::Tensor keys, torch::Tensor values,
                               torch::Tensor tables, torch::Tensor lengths, double scale) {
  TORCH_CHECK(k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32 &&
                  keys.dtype() == torch::kFloat32 && values.dtype() == torch::kFloat32,
              "write_and_decode takes float32 keys and values and int64 slots");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "the pool must be contiguous");
  const int64_t token_floats = keys.size(2) * keys.size(3);
  const int64_t* slot = checked_slots(slots, k.size(0), keys);
  for (const auto& [fresh, pool] : {std::pair{k, keys}, std::pair{v, values}}) {
    TORCH_CHECK(fresh.dim() == 3 && fresh.size(0) == slots.numel() &&
                    fresh.size(1) * fresh.size(2) == token_floats && fresh.stride(2) == 1 &&
                    fresh.stride(1) == fresh.size(2),
                "write_and_decode: k and v are [T, KVH, Dh] with contiguous heads");
    store_rows(fresh.data_ptr<float>(), fresh.stride(0), fresh.size(0), slot,
               pool.data_ptr<float>(), token_floats);
  }
  return paged_decode(q, keys, values, tables, lengths, scale);
}

// A decode step's whole attention from the layer's fused projection qkv [T, (H + 2 KVH)
// Dh] (contiguous): rotate its query and key heads in place by cos and sin ([T, Dh / 2]
// each, in any shape with that many values), store the keys and values at their slots,
// attend (paged_decode); returns [T, H Dh]. One call where the Python layer took a
// split, views, a rotation and the write-and-attend call (each a dispatch that runs
// cold after the weights' stream).
void rope_write_and_decode_into(const torch::Tensor& qkv, const torch::Tensor& cos,
                                const torch::Tensor& sin, const torch::Tensor& slots,
                                const torch::Tensor& keys, const torch::Tensor& values,
                                const torch::Tensor& tables, const torch::Tensor& lengths,
                                double scale, int64_t heads, const torch::Tensor& out) {
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && qkv.dim() == 2 && qkv.is_contiguous(),
              "rope_write_and_decode takes a contiguous float32 qkv [T, (H + 2 KVH) Dh]");
  TORCH_CHECK(keys.dim() == 4, "the key pool is [blocks, block size, KVH, Dh]");
  const int64_t tokens = qkv.size(0), kv_heads = keys.size(2), head_dim = keys.size(3);
  const int64_t half = head_dim / 2, width = qkv.size(1);
  TORCH_CHECK(heads > 0 && head_dim % 2 == 0 && width == (heads + 2 * kv_heads) * head_dim,
              "rope_write_and_decode: qkv has ", width, " columns, not (", heads,
              " + 2 x ", kv_heads, ") x ", head_dim);
  TORCH_CHECK(cos.dtype() == torch::kFloat32 && sin.dtype() == torch::kFloat32 &&
                  cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == tokens * half && sin.numel() == tokens * half,
              "rope_write_and_decode: cos and sin hold [T, Dh / 2] contiguous float32 values");
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous() &&
                  out.numel() == tokens * heads * head_dim,
              "rope_write_and_decode: out must be contiguous float32 [T, H Dh]");
  check_pool(tokens, heads, head_dim, keys, values, tables, lengths);
  const int64_t* slot = checked_slots(slots, tokens, keys);
  // Raw pointers from here on: no tensor views (each a dispatch, run cold).
  float* data = qkv.data_ptr<float>();
  tokenmill::rotate_rows(data, 0, tokens, width, heads + kv_heads, half,
                         cos.data_ptr<float>(), sin.data_ptr<float>());
  const int64_t token_floats = kv_heads * head_dim;
  store_rows(data + heads * head_dim, width, tokens, slot, keys.data_ptr<float>(),
             token_floats);
  store_rows(data + heads * head_dim + token_floats, width, tokens, slot,
             values.data_ptr<float>(), token_floats);
  decode_rows(data, width, tokens, heads, head_dim, keys, values, tables, lengths, scale,
              out.data_ptr<float>());
}

// A decode step's whole attention from the layer's fused projection qkv [T, (H + 2 KVH)
// Dh] (contiguous): rotate its query and key heads in place by cos and sin ([T, Dh / 2]
// each, in any shape with that many values), store the keys and values at their slots,
// attend (paged_decode); returns [T, H Dh]. One call where the Python layer took a
// split, views, a rotation and the write-and-attend call (each a dispatch that runs
// cold after the weights' stream).
torch::Tensor rope_write_and_decode(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                    torch::Tensor slots, torch::Tensor keys,
                                    torch::Tensor values, torch::Tensor tables,
                                    torch::Tensor lengths, double scale, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 2 && heads > 0, "rope_write_and_decode takes qkv [T, (H + 2 KVH) Dh]");
  TORCH_CHECK(keys.dim() == 4, "the key pool is [blocks, block size, KVH, Dh]");
  auto out = torch::empty({qkv.size(0), heads * keys.size(3)}, qkv.options());
  rope_write_and_decode_into(qkv, cos.contiguous(), sin.contiguous(), slots, keys, values,
                             tables, lengths, scale, heads, out);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention in place over a paged KV cache");
  m.def("write_and_decode", &write_and_decode,
        "store the step's keys and values at their slots, then paged_decode");
  m.def("rope_write_and_decode", &rope_write_and_decode,
        "rotate a decode step's qkv projection's query and key heads, then write_and_decode");
  m.def("set_fetch_level", [](int64_t level) {
    TORCH_CHECK(level == 1 || level == 2, "fetch level must be 1 (L1) or 2 (L2), got ", level);
    decode::fetch_level() = static_cast<int>(level);
  }, "the cache the next tile's keys and values are prefetched into: 1 (L1) or 2 (L2)");
  m.def("fetch_level", [] { return decode::fetch_level(); }, "the prefetch level in use");
  m.def("built_fetch_level", [] { return TM_KV_FETCH_LEVEL; }, "this build's own level");
  m.def("entry_points", [] {
    const tokenmill::entry::QkvDecode qkv_decode = &rope_write_and_decode_into;
    return std::map<std::string, int64_t>{
        {"rope_write_and_decode_into", tokenmill::entry::address(qkv_decode)}};
  }, "the whole-step decode's C++ entry point by name (csrc/shared/entry_points.h)");
}
