// Causal attention for a step's prefill chunks (attention/prefill_native.py, taken by
// the paged-native backend), all chunks in one call, reading keys and values where they
// lie in the paged cache (the step's own K/V already written there): a chunk of n
// queries at positions context .. context + n - 1 sees the keys up to its own.
//
// torch's fused CPU kernel runs short causal sequences at a fraction of the machine's
// rate (30-60 GFLOP/s for 128-512 tokens on the 0.5B shape's heads, 2 cores:
// docs/BENCHMARKS.md). Here each chunk's keys are transposed once per KV head out of
// the cache's blocks into [head_dim][keys]. A work item is one chunk's block of query
// positions for one KV head: its G query heads' rows (position-major) take their scores
// as one small matrix product (a tile of rows x a few vectors of keys in registers), a
// softmax per row over the keys its position sees, then the weighted sum of values as a
// second product (a tile of rows x a group of head_dim vectors; each value row read in
// place through the block table). The keys go in passes of key_block, each row's softmax
// kept running across them, so a pass's scores stay in cache (one pass over a 2K
// chunk's keys ran 1.4x slower under AVX2). Work items go to threads round-robin, so the
// triangle's long and short blocks spread evenly. Buffers are padded to whole tiles
// (zero rows and keys), so no tile has a tail. Sums run in another order than SDPA's:
// outputs agree to float32 rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int kVec = 16;
constexpr int kScoreRows = 8;  // 8 x 3 accumulators + 3 key vectors
constexpr int kScoreVecs = 3;
constexpr int kOutRows = 6;    // 6 x 4 accumulators + 4 value vectors
constexpr int kOutVecs = 4;    // value vectors per tile, at most
#else
constexpr int kVec = 8;
constexpr int kScoreRows = 6;  // 6 x 2 accumulators + 2 key vectors + a broadcast
constexpr int kScoreVecs = 2;
constexpr int kOutRows = 6;    // 6 x 2 accumulators + 2 value vectors + a broadcast
constexpr int kOutVecs = 2;    // (6 x 4 would not fit 16 registers)
#endif
constexpr int kKeyTile = kScoreVecs * kVec;
constexpr int kRowPad = std::lcm(kScoreRows, kOutRows);  // rows: whole tiles of both kinds
typedef float vf __attribute__((vector_size(kVec * sizeof(float))));

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, const vf& v) { std::memcpy(p, &v, sizeof v); }
inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

struct Chunk {
  const float* q;                 // the chunk's first query row, at this KV head's heads
  float* out;                     // its first output row, likewise
  int64_t q_row, out_row;         // row strides (floats)
  const float* kt;                // its keys transposed, [head_dim][ld] (zero past them)
  int64_t ld;
  const float* values;            // its values at this KV head, [keys][head_dim]
  int64_t context;                // keys cached before the chunk's first query
};

// scores[rows][keys] = queries[rows][D] . kt[D][ld] (its columns from j0) for a tile of
// MR rows x 3 vectors.
template <int MR>
void score_tile(const float* queries, const float* kt, int64_t ld, float* scores,
                int64_t head_dim, int64_t keys, int64_t r0, int64_t j0) {
  vf acc[MR][kScoreVecs] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    vf w[kScoreVecs];
    for (int t = 0; t < kScoreVecs; ++t) w[t] = load(kt + d * ld + j0 + t * kVec);
    for (int m = 0; m < MR; ++m) {
      const float x = queries[(r0 + m) * head_dim + d];
      for (int t = 0; t < kScoreVecs; ++t) acc[m][t] += x * w[t];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < kScoreVecs; ++t) store(scores + (r0 + m) * keys + j0 + t * kVec, acc[m][t]);
}

// sums rows [r0, r0 + MR), dims [c0, c0 + CV vectors) += the sum over keys j < used of
// weights[row][j] * values[j] (each value row where it lies).
template <int MR, int CV>
void value_tile(const float* weights, int64_t keys, const float* values,
                float* sums, int64_t head_dim, int64_t r0, int64_t c0, int64_t used) {
  if (used == 0) return;
  vf acc[MR][CV];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < CV; ++t) acc[m][t] = load(sums + (r0 + m) * head_dim + c0 + t * kVec);
  for (int64_t j = 0; j < used; ++j) {
    vf w[CV];
    for (int t = 0; t < CV; ++t) w[t] = load(values + j * head_dim + c0 + t * kVec);
    for (int m = 0; m < MR; ++m) {
      const float p = weights[(r0 + m) * keys + j];
      for (int t = 0; t < CV; ++t) acc[m][t] += p * w[t];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < CV; ++t) store(sums + (r0 + m) * head_dim + c0 + t * kVec, acc[m][t]);
}

template <int CV>
void values_pass(const float* weights, int64_t keys, const float* values, float* sums,
                 int64_t head_dim, int64_t rows, const int64_t* used) {
  for (int64_t r0 = 0; r0 < rows; r0 += kOutRows)
    for (int64_t c0 = 0; c0 < head_dim; c0 += CV * kVec)
      value_tile<kOutRows, CV>(weights, keys, values, sums, head_dim, r0, c0,
                               used[r0 / kOutRows]);
}

inline int64_t slot(const int64_t* table, int64_t block_size, int64_t j) {
  return table[j / block_size] * block_size + j % block_size;
}

struct Buffers {
  std::vector<float> queries, scores, sums, top, total;
  std::vector<int64_t> used;
};

// Query positions [p0, p1) of one chunk (the sequence's context + p0 ..), one KV head
// and its `group` query heads, over the keys [0, context + p1) in passes of `key_block`
// (a multiple of kKeyTile; a running softmax per row, as flash attention keeps, so a
// pass's scores stay in cache whatever the sequence's length).
void block(const Chunk& c, int64_t group, int64_t head_dim, int64_t p0, int64_t p1,
           float scale, int64_t key_block, Buffers& b) {
  const int64_t positions = p1 - p0, real_rows = positions * group;
  const int64_t rows = round_up(real_rows, kRowPad);
  const int64_t last_key = c.context + p1;  // keys [0, last_key) are seen by some row
  const int64_t width = round_up(std::min(key_block, last_key), kKeyTile);  // a pass's keys
  b.queries.assign(rows * head_dim, 0.0f);
  b.scores.resize(rows * width);
  b.sums.assign(rows * head_dim, 0.0f);
  b.top.assign(rows, -1e30f);
  b.total.assign(rows, 0.0f);
  b.used.resize(rows / kOutRows);
  // Row (position i, head h) = i * group + h, its query scaled.
  for (int64_t i = 0; i < positions; ++i)
    for (int64_t h = 0; h < group; ++h) {
      const float* src = c.q + (p0 + i) * c.q_row + h * head_dim;
      float* dst = b.queries.data() + (i * group + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = src[d] * scale;
    }
  const int64_t vectors = head_dim / kVec;
  for (int64_t k0 = 0; k0 < last_key; k0 += key_block) {
    const int64_t k1 = std::min(last_key, k0 + key_block);
    const int64_t keys = round_up(k1 - k0, kKeyTile);  // within ld: k0 is a whole tile
    for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows)
      for (int64_t j0 = 0; j0 < keys; j0 += kKeyTile)
        score_tile<kScoreRows>(b.queries.data(), c.kt + k0, c.ld, b.scores.data(), head_dim,
                               keys, r0, j0);
    // Each row's scores of the keys its position sees in this block become weights
    // against its running maximum (its sums rescaled when the maximum grows); the
    // rest (later keys, padding rows) weigh zero.
    for (int64_t r = 0; r < rows; ++r) {
      float* s = b.scores.data() + r * keys;
      const int64_t seen = r < real_rows
          ? std::clamp<int64_t>(c.context + p0 + r / group + 1 - k0, 0, k1 - k0) : 0;
      float block_top = -1e30f;
      for (int64_t j = 0; j < seen; ++j) block_top = std::max(block_top, s[j]);
      const float top = std::max(b.top[r], block_top);
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < seen; ++j) {  // vector exp (libmvec)
        s[j] = std::exp(s[j] - top);
        total += s[j];
      }
      std::fill(s + seen, s + keys, 0.0f);
      if (seen && top > b.top[r]) {
        const float rescale = std::exp(b.top[r] - top);
        float* sum = b.sums.data() + r * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) sum[d] *= rescale;
        b.total[r] *= rescale;
        b.top[r] = top;
      }
      b.total[r] += total;
    }
    for (int64_t t = 0; t < rows / kOutRows; ++t) {
      const int64_t last = std::min(real_rows, (t + 1) * kOutRows) - 1;
      b.used[t] = last >= t * kOutRows
          ? std::clamp<int64_t>(c.context + p0 + last / group + 1 - k0, 0, k1 - k0) : 0;
    }
    const float* values = c.values + k0 * head_dim;
    if (kOutVecs >= 4 && vectors % 4 == 0)
      values_pass<kOutVecs>(b.scores.data(), keys, values, b.sums.data(), head_dim, rows,
                            b.used.data());
    else if (vectors % 2 == 0)
      values_pass<2>(b.scores.data(), keys, values, b.sums.data(), head_dim, rows,
                     b.used.data());
    else
      values_pass<1>(b.scores.data(), keys, values, b.sums.data(), head_dim, rows,
                     b.used.data());
  }
  for (int64_t i = 0; i < positions; ++i)
    for (int64_t h = 0; h < group; ++h) {
      const int64_t r = i * group + h;
      const float* src = b.sums.data() + r * head_dim;
      float* dst = c.out + (p0 + i) * c.out_row + h * head_dim;
      const float inverse = 1.0f / b.total[r];
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = src[d] * inverse;
    }
}

// Rows of [T, heads, D] with each row's heads contiguous (the row stride is free).
void check_rows(const torch::Tensor& x, const char* name, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 3 && x.size(1) == heads &&
              x.size(2) == head_dim && x.stride(2) == 1 && x.stride(1) == head_dim,
              name, " must be float32 [T, ", heads, ", ", head_dim,
              "] with each row's heads contiguous");
}

// q [T, H, D] (each row's heads contiguous); key_cache / value_cache [blocks,
// block_size, KVH, D] holding every chunk's keys and values, its own included; chunk i
// holds query rows [starts[i], starts[i] + lengths[i]) at sequence positions contexts[i]
// onwards, its keys found through tables[i]. Writes those rows of out [T, H, D]
// (contiguous); other rows are left as they are.
void causal_prefill(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                    torch::Tensor out, torch::Tensor tables, torch::Tensor contexts,
                    torch::Tensor starts, torch::Tensor lengths, double scale,
                    int64_t block_positions, int64_t key_block) {
  const int64_t heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(key_cache.dtype() == torch::kFloat32 && key_cache.dim() == 4 &&
              key_cache.is_contiguous() && value_cache.sizes() == key_cache.sizes() &&
              value_cache.dtype() == torch::kFloat32 && value_cache.is_contiguous(),
              "key_cache / value_cache must be contiguous float32 [blocks, block_size, KVH, D]");
  const int64_t blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, "the cache's head_dim is not q's");
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(head_dim % kVec == 0, "head_dim must be a multiple of ", kVec);
  check_rows(q, "q", heads, head_dim);
  check_rows(out, "out", heads, head_dim);
  TORCH_CHECK(out.is_contiguous() && out.size(0) == q.size(0), "out must be contiguous [T, H, D]");
  const int64_t chunks = starts.numel();
  TORCH_CHECK(starts.dtype() == torch::kInt64 && lengths.dtype() == torch::kInt64 &&
              contexts.dtype() == torch::kInt64 && lengths.numel() == chunks &&
              contexts.numel() == chunks, "starts / lengths / contexts: int64, one per chunk");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && tables.dim() == 2 && tables.is_contiguous() &&
              tables.size(0) == chunks, "tables must be contiguous int64 [chunks, width]");
  TORCH_CHECK(block_positions > 0 && key_block > 0,
              "block_positions and key_block must be positive");
  const int64_t group = heads / kv_heads;
  const int64_t pass = std::max<int64_t>(kKeyTile, key_block / kKeyTile * kKeyTile);
  const auto* start = starts.data_ptr<int64_t>();
  const auto* length = lengths.data_ptr<int64_t>();
  const auto* context = contexts.data_ptr<int64_t>();
  const auto* table = tables.data_ptr<int64_t>();
  const int64_t width = tables.size(1), slot_row = kv_heads * head_dim;
  // Each (chunk, KV head)'s keys transposed once, [head_dim][ld] at kt_at[c]: every
  // block of its positions reads them.
  std::vector<int64_t> kt_at(chunks + 1, 0), ld(chunks);
  struct Item { int64_t chunk, kv_head, p0, p1; };
  std::vector<Item> items;
  for (int64_t c = 0; c < chunks; ++c) {
    TORCH_CHECK(start[c] >= 0 && length[c] >= 0 && start[c] + length[c] <= q.size(0),
                "chunk ", c, " lies outside the batch");
    const int64_t keys = context[c] + length[c];
    TORCH_CHECK(context[c] >= 0 && (keys + block_size - 1) / block_size <= width,
                "chunk ", c, "'s block table is shorter than its sequence");
    for (int64_t i = 0; i < (keys + block_size - 1) / block_size; ++i)
      TORCH_CHECK(table[c * width + i] >= 0 && table[c * width + i] < blocks,
                  "chunk ", c, ": block ", table[c * width + i], " out of range");
    ld[c] = round_up(keys, kKeyTile);
    kt_at[c + 1] = kt_at[c] + kv_heads * head_dim * ld[c];
    for (int64_t p0 = 0; p0 < length[c]; p0 += block_positions)
      for (int64_t h = 0; h < kv_heads; ++h)
        items.push_back({c, h, p0, std::min(length[c], p0 + block_positions)});
  }
  const float* qd = q.data_ptr<float>();
  const float* kd = key_cache.data_ptr<float>();
  const float* vd = value_cache.data_ptr<float>();
  float* od = out.data_ptr<float>();
  std::vector<float> kt(kt_at[chunks], 0.0f);
  // And its values, [keys][head_dim] at v_at[c] + h * keys * head_dim: the value
  // products then read one dense stream.
  std::vector<int64_t> v_at(chunks + 1, 0);
  for (int64_t c = 0; c < chunks; ++c)
    v_at[c + 1] = v_at[c] + kv_heads * (context[c] + length[c]) * head_dim;
  std::vector<float> vbuf(v_at[chunks]);
  at::parallel_for(0, chunks * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = i / kv_heads, h = i % kv_heads;
      const int64_t keys = context[c] + length[c];
      float* target = kt.data() + kt_at[c] + h * head_dim * ld[c];
      float* value_target = vbuf.data() + v_at[c] + h * keys * head_dim;
      for (int64_t j = 0; j < keys; ++j) {
        const int64_t at = slot(table + c * width, block_size, j) * slot_row + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) target[d * ld[c] + j] = kd[at + d];
        std::memcpy(value_target + j * head_dim, vd + at, head_dim * sizeof(float));
      }
    }
  });
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                                   items.size()));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Buffers buffers;
    for (int64_t t = begin; t < end; ++t)
      for (size_t i = t; i < items.size(); i += threads) {
        const Item& it = items[i];
        const int64_t row = start[it.chunk];
        const Chunk c{qd + row * q.stride(0) + it.kv_head * group * head_dim,
                      od + row * out.stride(0) + it.kv_head * group * head_dim,
                      q.stride(0), out.stride(0),
                      kt.data() + kt_at[it.chunk] + it.kv_head * head_dim * ld[it.chunk],
                      ld[it.chunk],
                      vbuf.data() + v_at[it.chunk] +
                          it.kv_head * (context[it.chunk] + length[it.chunk]) * head_dim,
                      context[it.chunk]};
        block(c, group, head_dim, it.p0, it.p1, static_cast<float>(scale), pass, buffers);
      }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("causal_prefill", &causal_prefill,
        "causal attention of prefill chunks over the paged cache (see prefill_causal.cpp)");
  m.def("lanes", [] { return kVec; }, "floats per vector: head_dim must be a multiple");
}
