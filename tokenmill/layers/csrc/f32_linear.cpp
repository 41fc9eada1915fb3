// Float32 products on the CPU with tokenmill's own kernel: y = x W^T + b, W packed once
// at load (layers/native_linear.py) into blocks of 16 output channels:
//   packed [blocks][K][16] float32, block b's column k = the 16 channels' weights at k
// (channels past N are zero). Every block is one contiguous stream and a column is one
// vector of 16 lanes: no shuffles, no per-call packing.
//
// One kernel for every row count: tiles of up to MR rows x NB blocks (8 x 3 with
// AVX-512: 24 accumulators in registers; a product's rows in tiles of even sizes), each
// weight column loaded once per tile into registers and shared by its rows, the columns
// in chunks of kChunk so a tile's weights stay in L1/L2 while every row tile of the
// product passes over them. At one row that is NB
// independent streams and sums per thread, which measured faster than one block
// streamed at a time with four accumulators and a software prefetch (about 2x).
// The work is split over torch's threads by groups of blocks (contiguous memory per
// thread). GCC vector types keep it portable: one AVX-512 register per block, or a
// block in two 8-lane halves (AVX2 registers) without AVX-512. Sums run in another
// order than a BLAS does (results differ from torch's by rounding only).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int kLanes = 16;  // a block's channels: the packed layout on every CPU

// The vector the arithmetic runs on: a whole block's 16 lanes with AVX-512, half a block
// (8 lanes, one AVX2 register) without. A 64-byte GCC vector without AVX-512 is not
// kept in registers: GCC splits each operation through memory, which measured the
// product 3-10x slower than OpenBLAS under `--isa avx2` (docs/BENCHMARKS.md), so a
// block is handled as kParts vectors instead.
#if defined(__AVX512F__)
constexpr int kVec = 16;
constexpr int kRowTile = 8;    // 8 x 3 accumulators + 3 weight vectors of 32 registers
constexpr int kBlockTile = 3;
#else
constexpr int kVec = 8;
constexpr int kRowTile = 6;    // 6 x 1 x 2 halves + 2 + a broadcast of 16 registers
constexpr int kBlockTile = 1;
#endif
constexpr int kParts = kLanes / kVec;
// The fused activation's tiles: gate/up pairs of blocks (2 pairs with AVX-512: 6 x 4
// accumulators; 1 pair without: 3 x 4 halves of 16 registers).
#if defined(__AVX512F__)
constexpr int kPairTile = 2;
constexpr int kFusedRowTile = 6;
#else
constexpr int kPairTile = 1;
constexpr int kFusedRowTile = 3;
#endif
constexpr int kMaxBlocks = std::max(kBlockTile, 2 * kPairTile);
typedef float vf __attribute__((vector_size(kVec * sizeof(float))));
// Columns per pass: 3 blocks x 256 x 64 B = 48 KB of weights shared by the row tiles
// (benchmarks/bench_native_rows.py --builds compares other sizes).
#ifndef TM_CHUNK
#define TM_CHUNK 256
#endif
constexpr int64_t kChunk = TM_CHUNK;
// Rows per panel: a thread takes its blocks over one panel of rows at a time, so the
// rows it re-reads for every block group stay in L2 (not the whole x of a 2048-row
// prefill step from L3; benchmarks/bench_native_rows.py compares panel sizes). 256:
// an MLP slice (layers/row_slices.py) is one panel.
#ifndef TM_PANEL
#define TM_PANEL 256
#endif
constexpr int64_t kPanel = TM_PANEL;
// Prefetch the next column chunk's weights during a chunk's later row tiles (which read
// the current chunk from L2 and are bound by arithmetic), so the next chunk's first row
// tile does not wait on memory. 0 builds the loop without it (docs/BENCHMARKS.md
// compares the two builds in the engine).
#ifndef TM_PREFETCH_NEXT
#define TM_PREFETCH_NEXT 1
#endif
// Row tiles of even sizes: a product's rows split into as few tiles as kRowTile allows,
// each within one row of the others (32 rows under AVX2: 6 6 5 5 5 5, not 6 6 6 6 6 2).
// A small tail tile has too few accumulators to hide the multiply-add latency and runs
// at a fraction of the rate per row. 0 builds the old split (full tiles, then the rest).
#ifndef TM_EVEN_TILES
#define TM_EVEN_TILES 1
#endif

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
// Keeps v in a register from here on (an empty asm that claims to change it): left
// alone, GCC folds a weight column's load into every row's multiply-add of a small tile
// (4 rows under AVX2: 12 loads per 8 multiply-adds, bound by the load ports at the cost
// of a 6-row tile). The constraint is x86's; elsewhere the compiler decides.
inline void pin(vf& v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}
inline void store(float* p, const vf& v) { std::memcpy(p, &v, sizeof v); }

struct Problem {
  const float* x;       // [M][K]
  const float* w;       // [blocks][K][16]
  const float* bias;    // [blocks * 16], or null
  int64_t M, K;
};

// The packed blocks a group of tiles multiplies (adjacent for a plain product; gate
// blocks then their up blocks for the fused activation).
struct Blocks {
  int64_t at[kMaxBlocks];
};

// Where a tile's sums go. `part` holds them between column chunks: the tile's row r,
// vector j at part[r * ld + j * kVec]. After the last chunk they stay there; or, with
// `act` (the fused activation), the tile's first half of vectors are gates and the
// second half the ups of the same channels, and silu(gate) * up goes to act: row r,
// gate vector j at act[r * ld_act + j * kVec].
struct Sink {
  float* part;
  int64_t ld;
  float* act = nullptr;
  int64_t ld_act = 0;

  Sink rows_on(int64_t rows) const {
    return {part + rows * ld, ld, act ? act + rows * ld_act : nullptr, ld_act};
  }
};

// Weights to fetch into L2 while a tile runs: the next chunk of `blocks` blocks (w[j]:
// block j's first column of it), one 64-byte column per block and column of the tile:
// the columns k with (k - k0) % every == phase, so the fetches of a chunk are spread
// evenly over the row tiles that share them.
struct Prefetch {
  const float* w[kMaxBlocks] = {};
  int blocks = 0;
  int every = 1, phase = 0;
};

// silu(gate) * up of a finished tile's sums into the sink's act (vec_math.h's rounding:
// built without FMA contraction, as row_ops.cpp is, and kept out of line so the tile's
// own loop keeps its multiply-adds).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <int MR, int V>
__attribute__((noinline)) void activate(const vf (&acc)[MR][V], const Sink& sink) {
  constexpr int kHalf = V / 2 * kVec;
  for (int m = 0; m < MR; ++m) {
    float sums[V * kVec];
    std::memcpy(sums, acc[m], sizeof sums);
    float* target = sink.act + m * sink.ld_act;
#pragma omp simd
    for (int i = 0; i < kHalf; ++i) target[i] = tokenmill::silu(sums[i]) * sums[kHalf + i];
  }
}
#pragma GCC pop_options

// Rows [0, MR) of the sink x the blocks' first NB, columns [k0, k1): accumulators start
// from the bias (first chunk) or the partial sums, and go back to the sink.
template <int MR, int NB>
void tile(const Problem& p, const Blocks& b, const float* x, const Sink& sink, int64_t k0,
          int64_t k1, const Prefetch& ahead) {
  constexpr int V = NB * kParts;  // vectors across the tile's blocks
  vf acc[MR][V];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < V; ++j) {
      if (k0 > 0) acc[m][j] = load(sink.part + m * sink.ld + j * kVec);
      else if (p.bias) acc[m][j] = load(p.bias + b.at[j / kParts] * kLanes + (j % kParts) * kVec);
      else acc[m][j] = vf{};
    }
  }
  const float* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = p.w + (b.at[j] * p.K + k0) * kLanes;
  int countdown = ahead.phase;
  for (int64_t k = k0; k < k1; ++k) {
    if (ahead.blocks && countdown-- == 0) {
      countdown = ahead.every - 1;
      for (int j = 0; j < ahead.blocks; ++j)
        __builtin_prefetch(ahead.w[j] + (k - k0) * kLanes, 0, 2);
    }
    vf wk[V];
    for (int j = 0; j < V; ++j) {
      wk[j] = load(w[j / kParts] + (k - k0) * kLanes + (j % kParts) * kVec);
      pin(wk[j]);
    }
    for (int m = 0; m < MR; ++m) {
      const float xm = x[m * p.K + k];
      for (int j = 0; j < V; ++j) acc[m][j] += xm * wk[j];
    }
  }
  if (sink.act && k1 == p.K) return activate<MR, V>(acc, sink);
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < V; ++j) store(sink.part + m * sink.ld + j * kVec, acc[m][j]);
}

template <int NB, int MR>
void rows_tail(const Problem& p, const Blocks& b, const float* x, const Sink& sink,
               int64_t rows, int64_t k0, int64_t k1, const Prefetch& ahead) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile<MR, NB>(p, b, x, sink, k0, k1, ahead);
    rows_tail<NB, MR - 1>(p, b, x, sink, rows, k0, k1, ahead);
  }
}

// The blocks b.at[0, NB) for rows [m_begin, m_end) (the sink's row 0 is m_begin), in
// row tiles of up to RowTile rows; `next` is what this thread multiplies after them
// (their first chunk is fetched ahead).
template <int NB, int RowTile>
void group(const Problem& p, const Blocks& b, int64_t m_begin, int64_t m_end, const Sink& sink,
           const Prefetch& next) {
  const int64_t rows = m_end - m_begin;
  const int64_t tiles = (rows + RowTile - 1) / RowTile;
  for (int64_t k0 = 0; k0 < p.K; k0 += kChunk) {
    const int64_t k1 = std::min(p.K, k0 + kChunk);
    // The chunk after this one: this group's next columns, or the next group's first.
    Prefetch after = next;
    if (k1 < p.K) {
      after.blocks = NB;
      for (int j = 0; j < NB; ++j) after.w[j] = p.w + (b.at[j] * p.K + k1) * kLanes;
    }
    int64_t done = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t size = TM_EVEN_TILES ? rows / tiles + (t < rows % tiles)
                                         : std::min<int64_t>(RowTile, rows - done);
      // Row tiles 1 .. tiles - 1 share out the next chunk's columns (none with one tile:
      // a lone row tile streams from memory anyway, and fetching ahead measured slower).
      Prefetch ahead;
      if (TM_PREFETCH_NEXT && tiles > 1 && t > 0 && after.blocks > 0) {
        ahead = after;
        ahead.every = static_cast<int>(tiles - 1);
        ahead.phase = static_cast<int>(t - 1);
      }
      rows_tail<NB, RowTile>(p, b, p.x + (m_begin + done) * p.K, sink.rows_on(done), size, k0,
                             k1, ahead);
      done += size;
    }
  }
}

template <int NB, int RowTile>
void group_tail(const Problem& p, const Blocks& b, int blocks, int64_t m_begin, int64_t m_end,
                const Sink& sink, const Prefetch& next) {
  if constexpr (NB > 0) {
    if (blocks == NB) return group<NB, RowTile>(p, b, m_begin, m_end, sink, next);
    group_tail<NB - 1, RowTile>(p, b, blocks, m_begin, m_end, sink, next);
  }
}

// The first column of each block of a group (what fetching ahead into it reads).
Prefetch starts(const Problem& p, const Blocks& b, int blocks) {
  Prefetch first;
  first.blocks = blocks;
  for (int j = 0; j < blocks; ++j) first.w[j] = p.w + b.at[j] * p.K * kLanes;
  return first;
}

// Group g of a plain product: blocks [g * kBlockTile, ...) while they last.
int adjacent_blocks(int64_t g, int64_t blocks, Blocks& b) {
  const int64_t b0 = g * kBlockTile;
  const int count = static_cast<int>(std::min<int64_t>(kBlockTile, blocks - b0));
  for (int j = 0; j < count; ++j) b.at[j] = b0 + j;
  return count;
}

// Group g of the fused activation: gate blocks [g * kPairTile, ...) of `pairs`, then
// their up blocks (pairs further on).
int pair_blocks(int64_t g, int64_t pairs, Blocks& b) {
  const int64_t p0 = g * kPairTile;
  const int count = static_cast<int>(std::min<int64_t>(kPairTile, pairs - p0));
  for (int j = 0; j < count; ++j) {
    b.at[j] = p0 + j;
    b.at[count + j] = pairs + p0 + j;
  }
  return 2 * count;
}

void check_product(const torch::Tensor& x, const torch::Tensor& packed,
                   const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  TORCH_CHECK(packed.dtype() == torch::kFloat32 && packed.dim() == 3 &&
              packed.size(2) == kLanes && packed.is_contiguous(),
              "packed must be float32 [blocks, K, 16], contiguous");
  const int64_t blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == x.size(1), "x has ", x.size(1), " columns, the weight ",
              packed.size(1));
  TORCH_CHECK(out_features > (blocks - 1) * kLanes && out_features <= blocks * kLanes,
              "out_features ", out_features, " does not fit ", blocks, " blocks");
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->is_contiguous() &&
                bias->numel() == blocks * kLanes, "bias must be float32 [blocks * 16]");
  }
}

Problem problem(const torch::Tensor& x, const torch::Tensor& packed,
                const c10::optional<torch::Tensor>& bias) {
  const bool has_bias = bias && bias->defined();
  return {x.data_ptr<float>(), packed.data_ptr<float>(),
          has_bias ? bias->data_ptr<float>() : nullptr, x.size(0), x.size(1)};
}

torch::Tensor f32_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                         int64_t out_features) {
  check_product(x, packed, bias, out_features);
  x = x.contiguous();
  const int64_t blocks = packed.size(0), ldo = blocks * kLanes;
  auto out = torch::empty({x.size(0), ldo}, x.options());
  const Problem p = problem(x, packed, bias);
  float* o = out.data_ptr<float>();
  const int64_t groups = (blocks + kBlockTile - 1) / kBlockTile;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < p.M; m0 += kPanel) {
      const int64_t m1 = std::min(p.M, m0 + kPanel);
      for (int64_t g = begin; g < end; ++g) {
        Blocks b, following;
        const int count = adjacent_blocks(g, blocks, b);
        const Prefetch next = g + 1 < end
            ? starts(p, following, adjacent_blocks(g + 1, blocks, following)) : Prefetch{};
        const Sink sink{o + m0 * ldo + b.at[0] * kLanes, ldo};
        group_tail<kBlockTile, kRowTile>(p, b, count, m0, m1, sink, next);
      }
    }
  });
  if (out_features == ldo) return out;
  return out.narrow(1, 0, out_features).contiguous();
}

torch::Tensor f32_linear_silu_mul(torch::Tensor x, torch::Tensor packed,
                                  c10::optional<torch::Tensor> bias, int64_t out_features) {
  check_product(x, packed, bias, out_features);
  const int64_t blocks = packed.size(0);
  TORCH_CHECK(out_features == blocks * kLanes && blocks % 2 == 0,
              "the fused activation takes [gate | up] of 2 x a multiple of 16 channels, got ",
              out_features);
  x = x.contiguous();
  const int64_t pairs = blocks / 2, width = pairs * kLanes;
  auto out = torch::empty({x.size(0), width}, x.options());
  const Problem p = problem(x, packed, bias);
  float* o = out.data_ptr<float>();
  const int64_t groups = (pairs + kPairTile - 1) / kPairTile;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    // The partial sums of one group over one panel of rows.
    std::vector<float> partial(kPanel * 2 * kPairTile * kLanes);
    for (int64_t m0 = 0; m0 < p.M; m0 += kPanel) {
      const int64_t m1 = std::min(p.M, m0 + kPanel);
      for (int64_t g = begin; g < end; ++g) {
        Blocks b, following;
        const int count = pair_blocks(g, pairs, b);
        const Prefetch next = g + 1 < end
            ? starts(p, following, pair_blocks(g + 1, pairs, following)) : Prefetch{};
        const Sink sink{partial.data(), count * kLanes, o + m0 * width + b.at[0] * kLanes,
                        width};
        group_tail<2 * kPairTile, kFusedRowTile>(p, b, count, m0, m1, sink, next);
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("f32_linear", &f32_linear,
        "x [M, K] float32 times a weight packed [blocks, K, 16] (see f32_linear.cpp)");
  m.def("f32_linear_silu_mul", &f32_linear_silu_mul,
        "silu(gate) * up of x [M, K] times a [gate | up] weight packed [blocks, K, 16]");
}
