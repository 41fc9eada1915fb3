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
  const float* bias;    // [N] padded to blocks * 16, or null
  float* out;           // [M][blocks * 16]
  int64_t M, K, ldo;    // ldo = blocks * 16
};

// Weights to fetch into L2 while a tile runs: `blocks` blocks from `w` on (a block's
// next chunk, consecutive blocks K x 16 floats apart), one 64-byte column per block and
// column of the tile: the columns k with (k - k0) % every == phase, so the fetches of a
// chunk are spread evenly over the row tiles that share them.
struct Prefetch {
  const float* w = nullptr;
  int blocks = 0;
  int every = 1, phase = 0;
};

// Rows [m0, m0 + MR) x blocks [b0, b0 + NB), columns [k0, k1): accumulators start from
// the bias (first chunk) or the partial sums in out, and go back to out.
template <int MR, int NB>
void tile(const Problem& p, int64_t b0, int64_t m0, int64_t k0, int64_t k1,
          Prefetch ahead = {}) {
  constexpr int V = NB * kParts;  // vectors across the tile's blocks
  vf acc[MR][V];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < V; ++j) {
      const int64_t col = (b0 + j / kParts) * kLanes + (j % kParts) * kVec;
      if (k0 > 0) acc[m][j] = load(p.out + (m0 + m) * p.ldo + col);
      else if (p.bias) acc[m][j] = load(p.bias + col);
      else acc[m][j] = vf{};
    }
  }
  const float* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = p.w + ((b0 + j) * p.K + k0) * kLanes;
  const float* x = p.x + m0 * p.K;
  int countdown = ahead.phase;
  for (int64_t k = k0; k < k1; ++k) {
    if (ahead.blocks && countdown-- == 0) {
      countdown = ahead.every - 1;
      for (int j = 0; j < ahead.blocks; ++j)
        __builtin_prefetch(ahead.w + j * p.K * kLanes + (k - k0) * kLanes, 0, 2);
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
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < V; ++j)
      store(p.out + (m0 + m) * p.ldo + (b0 + j / kParts) * kLanes + (j % kParts) * kVec,
            acc[m][j]);
}

template <int NB, int MR>
void rows_tail(const Problem& p, int64_t b0, int64_t m0, int64_t rows, int64_t k0, int64_t k1,
               Prefetch ahead) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile<MR, NB>(p, b0, m0, k0, k1, ahead);
    rows_tail<NB, MR - 1>(p, b0, m0, rows, k0, k1, ahead);
  }
}

// Blocks [b0, b0 + NB) for rows [m_begin, m_end); `next` blocks from `next_b0` on are
// what this thread multiplies after them (their first chunk is fetched ahead).
template <int NB>
void group(const Problem& p, int64_t b0, int64_t m_begin, int64_t m_end, int64_t next_b0,
           int next) {
  const int64_t rows = m_end - m_begin;
  const int64_t tiles = (rows + kRowTile - 1) / kRowTile;
  for (int64_t k0 = 0; k0 < p.K; k0 += kChunk) {
    const int64_t k1 = std::min(p.K, k0 + kChunk);
    // The chunk after this one: this group's next columns, or the next group's first.
    const float* after = k1 < p.K ? p.w + (b0 * p.K + k1) * kLanes
                                   : p.w + next_b0 * p.K * kLanes;
    const int after_blocks = k1 < p.K ? NB : next;
    int64_t m0 = m_begin;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t size = TM_EVEN_TILES ? rows / tiles + (t < rows % tiles)
                                         : std::min<int64_t>(kRowTile, m_end - m0);
      // Row tiles 1 .. tiles - 1 share out the next chunk's columns (none with one tile:
      // a lone row tile streams from memory anyway, and fetching ahead measured slower).
      Prefetch ahead;
      if (TM_PREFETCH_NEXT && tiles > 1 && t > 0 && after_blocks > 0) {
        ahead.w = after;
        ahead.blocks = after_blocks;
        ahead.every = static_cast<int>(tiles - 1);
        ahead.phase = static_cast<int>(t - 1);
      }
      rows_tail<NB, kRowTile>(p, b0, m0, size, k0, k1, ahead);
      m0 += size;
    }
  }
}

template <int NB>
void group_tail(const Problem& p, int64_t b0, int64_t blocks, int64_t m_begin, int64_t m_end,
                int64_t next_b0, int next) {
  if constexpr (NB > 0) {
    if (blocks == NB) return group<NB>(p, b0, m_begin, m_end, next_b0, next);
    group_tail<NB - 1>(p, b0, blocks, m_begin, m_end, next_b0, next);
  }
}

torch::Tensor f32_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                         int64_t out_features) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  TORCH_CHECK(packed.dtype() == torch::kFloat32 && packed.dim() == 3 &&
              packed.size(2) == kLanes && packed.is_contiguous(),
              "packed must be float32 [blocks, K, 16], contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " columns, the weight ", packed.size(1));
  TORCH_CHECK(out_features > (blocks - 1) * kLanes && out_features <= blocks * kLanes,
              "out_features ", out_features, " does not fit ", blocks, " blocks");
  const bool has_bias = bias && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->is_contiguous() &&
                bias->numel() == blocks * kLanes, "bias must be float32 [blocks * 16]");
  }
  auto out = torch::empty({M, blocks * kLanes}, x.options());
  const Problem p{x.data_ptr<float>(), packed.data_ptr<float>(),
                  has_bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), M, K,
                  blocks * kLanes};
  const int64_t groups = (blocks + kBlockTile - 1) / kBlockTile;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kPanel) {
      const int64_t m1 = std::min(M, m0 + kPanel);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t b0 = g * kBlockTile;
        const int64_t next_b0 = b0 + kBlockTile;  // the thread's next group, if any
        const int next = g + 1 < end
            ? static_cast<int>(std::min<int64_t>(kBlockTile, blocks - next_b0)) : 0;
        group_tail<kBlockTile>(p, b0, std::min<int64_t>(kBlockTile, blocks - b0), m0, m1,
                               next_b0, next);
      }
    }
  });
  if (out_features == blocks * kLanes) return out;
  return out.narrow(1, 0, out_features).contiguous();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("f32_linear", &f32_linear,
        "x [M, K] float32 times a weight packed [blocks, K, 16] (see f32_linear.cpp)");
}
