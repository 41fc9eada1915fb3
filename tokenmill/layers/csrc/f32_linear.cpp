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
// product passes over them. At one row that is NB independent streams and sums per
// thread, measured ~2x faster than one block at a time with 4 sums and a prefetch.
// The work is split over torch's threads by groups of blocks (contiguous memory per
// thread). GCC vector types keep it portable: one AVX-512 register per block, or a
// block in two 8-lane halves (AVX2 registers) without AVX-512. Sums run in another
// order than a BLAS does (results differ from torch's by rounding only).
//
// f32_linear_silu_mul: a gated MLP's gate/up product with its activation in the
// epilogue, silu(x Wg^T + bg) * (x Wu^T + bu) for a weight packed from [gate | up]
// (gate blocks first, then the up blocks of the same channels). A tile takes gate
// channels with the up channels that pair with them, keeps its partial sums in a
// per-thread buffer the size of one panel's group (L2, not the [M, 2I] output), and
// writes only the [M, I] activation: the [M, 2I] products are never stored or read
// again. Per element the sums and the activation's rounding are those of f32_linear
// followed by row_ops.cpp's silu_mul (vec_math.h): bit-identical to the two calls.
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
// The fused activation's tiles take gate channels a vector at a time ("units": a block
// with AVX-512, half a block without), each with the up channels that pair with it:
// 6 rows x 2 units with AVX-512 (6 x 4 accumulators). Under AVX2, 6 rows x 1 unit
// (the plain tile's 6 x 2 halves) from kFusedFewRows rows on; below that, where the
// weights stream from memory, 2 rows x 2 units (a whole block's lines per stream:
// half-block units read each line twice, and one row ran 1.4x slower so).
#if defined(__AVX512F__)
constexpr int kUnitTile = 2, kFusedRowTile = 6;
constexpr int kFewUnitTile = 2, kFewRowTile = 6;
#else
constexpr int kUnitTile = 1, kFusedRowTile = 6;
constexpr int kFewUnitTile = 2, kFewRowTile = 2;
#endif
constexpr int64_t kFusedFewRows = 8;
constexpr int kMaxVectors = std::max({kBlockTile * kParts, 2 * kUnitTile, 2 * kFewUnitTile});
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

// The vectors a group of tiles computes: vector j's channels start at float w[j] of
// the packed weight (its block's stream, plus its lane offset in the block's columns)
// and at b[j] of the bias. Adjacent for a plain product; gate units then their up
// units for the fused activation.
struct Slots {
  int64_t w[kMaxVectors];
  int64_t b[kMaxVectors];

  void set(int j, int64_t block, int64_t lane, int64_t K) {
    w[j] = block * K * kLanes + lane;
    b[j] = block * kLanes + lane;
  }
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

// Weights to fetch into L2 while a tile runs: the next chunk of `lines` 64-byte column
// streams (w[j]: the first column of it), one line per stream and column of the tile:
// the columns k with (k - k0) % every == phase, so the fetches of a chunk are spread
// evenly over the row tiles that share them.
struct Prefetch {
  const float* w[kMaxVectors] = {};
  int lines = 0;
  int every = 1, phase = 0;
};

// The column streams of a group's vectors from column k on (one per block: vectors in
// the second half of a block share its lines), for fetching ahead.
Prefetch streams(const float* w, const Slots& s, int vectors, int64_t k) {
  Prefetch ahead;
  for (int j = 0; j < vectors; ++j)
    if (s.w[j] % kLanes == 0) ahead.w[ahead.lines++] = w + s.w[j] + k * kLanes;
  return ahead;
}

// silu(gate) * up of a finished tile's sums into the sink's act (vec_math.h's rounding:
// built without FMA contraction, as row_ops.cpp is, and kept out of line so the tile's
// own loop keeps its multiply-adds). `sums`: the tile's rows of V vectors each.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <int MR, int V>
__attribute__((noinline)) void activate(const float* sums, const Sink& sink) {
  constexpr int kHalf = V / 2 * kVec;
  for (int m = 0; m < MR; ++m, sums += V * kVec) {
    float* target = sink.act + m * sink.ld_act;
#pragma omp simd
    for (int i = 0; i < kHalf; ++i) target[i] = tokenmill::silu(sums[i]) * sums[kHalf + i];
  }
}
#pragma GCC pop_options

// Rows [0, MR) of the sink x the slots' first V vectors, columns [k0, k1): accumulators
// start from the bias (first chunk) or the partial sums, and go back to the sink. Out
// of line: inlined into the product's loops, GCC kept the AVX2 tile's accumulators in
// memory (2.5x slower); with AVX-512 the two measured alike.
template <int MR, int V>
__attribute__((noinline)) void tile(const Problem& p, const Slots& s, const float* x,
                                    const Sink& sink, int64_t k0, int64_t k1,
                                    const Prefetch& ahead) {
  vf acc[MR][V];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < V; ++j) {
      if (k0 > 0) acc[m][j] = load(sink.part + m * sink.ld + j * kVec);
      else if (p.bias) acc[m][j] = load(p.bias + s.b[j]);
      else acc[m][j] = vf{};
    }
  }
  const float* w[V];
  for (int j = 0; j < V; ++j) w[j] = p.w + s.w[j] + k0 * kLanes;
  int countdown = ahead.phase;
  for (int64_t k = k0; k < k1; ++k) {
    if (ahead.lines && countdown-- == 0) {
      countdown = ahead.every - 1;
      for (int j = 0; j < ahead.lines; ++j)
        __builtin_prefetch(ahead.w[j] + (k - k0) * kLanes, 0, 2);
    }
    vf wk[V];
    for (int j = 0; j < V; ++j) {
      wk[j] = load(w[j] + (k - k0) * kLanes);
      pin(wk[j]);
    }
    for (int m = 0; m < MR; ++m) {
      const float xm = x[m * p.K + k];
      for (int j = 0; j < V; ++j) acc[m][j] += xm * wk[j];
    }
  }
  if (sink.act && k1 == p.K) {
    float sums[MR * V * kVec];  // a copy: passing acc's own address kept it in memory
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < V; ++j) store(sums + (m * V + j) * kVec, acc[m][j]);
    return activate<MR, V>(sums, sink);
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < V; ++j) store(sink.part + m * sink.ld + j * kVec, acc[m][j]);
}

template <int V, int MR>
void rows_tail(const Problem& p, const Slots& s, const float* x, const Sink& sink,
               int64_t rows, int64_t k0, int64_t k1, const Prefetch& ahead) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile<MR, V>(p, s, x, sink, k0, k1, ahead);
    rows_tail<V, MR - 1>(p, s, x, sink, rows, k0, k1, ahead);
  }
}

// The slots' first V vectors for rows [m_begin, m_end) (the sink's row 0 is m_begin),
// in row tiles of up to RowTile rows; `next` is what this thread multiplies after them
// (its first chunk is fetched ahead).
template <int V, int RowTile>
void group(const Problem& p, const Slots& s, int64_t m_begin, int64_t m_end, const Sink& sink,
           const Prefetch& next) {
  const int64_t rows = m_end - m_begin;
  const int64_t tiles = (rows + RowTile - 1) / RowTile;
  for (int64_t k0 = 0; k0 < p.K; k0 += kChunk) {
    const int64_t k1 = std::min(p.K, k0 + kChunk);
    // The chunk after this one: this group's next columns, or the next group's first.
    const Prefetch after = k1 < p.K ? streams(p.w, s, V, k1) : next;
    int64_t done = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t size = TM_EVEN_TILES ? rows / tiles + (t < rows % tiles)
                                         : std::min<int64_t>(RowTile, rows - done);
      // Row tiles 1 .. tiles - 1 share out the next chunk's columns (none with one tile:
      // a lone row tile streams from memory anyway, and fetching ahead measured slower).
      Prefetch ahead;
      if (TM_PREFETCH_NEXT && tiles > 1 && t > 0 && after.lines > 0) {
        ahead = after;
        ahead.every = static_cast<int>(tiles - 1);
        ahead.phase = static_cast<int>(t - 1);
      }
      rows_tail<V, RowTile>(p, s, p.x + (m_begin + done) * p.K, sink.rows_on(done), size, k0,
                            k1, ahead);
      done += size;
    }
  }
}

template <int V, int RowTile>
void group_tail(const Problem& p, const Slots& s, int vectors, int64_t m_begin, int64_t m_end,
                const Sink& sink, const Prefetch& next) {
  if constexpr (V > 0) {
    if (vectors == V) return group<V, RowTile>(p, s, m_begin, m_end, sink, next);
    group_tail<V - 1, RowTile>(p, s, vectors, m_begin, m_end, sink, next);
  }
}

// Group g of a plain product: blocks [g * kBlockTile, ...) while they last, a vector
// per kVec lanes. Returns the vectors.
int adjacent_slots(int64_t g, int64_t blocks, int64_t K, Slots& s) {
  const int64_t b0 = g * kBlockTile;
  const int count = static_cast<int>(std::min<int64_t>(kBlockTile, blocks - b0)) * kParts;
  for (int j = 0; j < count; ++j) s.set(j, b0 + j / kParts, (j % kParts) * kVec, K);
  return count;
}

// Group g of the fused activation: gate units [g * unit_tile, ...) of `units` (a unit:
// kVec channels, `units / kParts` blocks of gates), then the up units of the same
// channels (the up blocks follow the gate blocks). Returns the vectors.
int pair_slots(int64_t g, int unit_tile, int64_t units, int64_t K, Slots& s) {
  const int64_t u0 = g * unit_tile, gate_blocks = units / kParts;
  const int count = static_cast<int>(std::min<int64_t>(unit_tile, units - u0));
  for (int j = 0; j < count; ++j) {
    const int64_t u = u0 + j, lane = (u % kParts) * kVec;
    s.set(j, u / kParts, lane, K);
    s.set(count + j, gate_blocks + u / kParts, lane, K);
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
        Slots s, following;
        const int vectors = adjacent_slots(g, blocks, p.K, s);
        const Prefetch next = g + 1 < end
            ? streams(p.w, following, adjacent_slots(g + 1, blocks, p.K, following), 0)
            : Prefetch{};
        const Sink sink{o + m0 * ldo + g * kBlockTile * kLanes, ldo};
        group_tail<kBlockTile * kParts, kRowTile>(p, s, vectors, m0, m1, sink, next);
      }
    }
  });
  if (out_features == ldo) return out;
  return out.narrow(1, 0, out_features).contiguous();
}

// silu(gate) * up into o [M][width] in tiles of UnitTile units x RowTile rows.
template <int UnitTile, int RowTile>
void fused(const Problem& p, float* o, int64_t width) {
  const int64_t units = width / kVec, groups = (units + UnitTile - 1) / UnitTile;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    // The partial sums of one group over one panel of rows.
    std::vector<float> partial(kPanel * 2 * UnitTile * kVec);
    for (int64_t m0 = 0; m0 < p.M; m0 += kPanel) {
      const int64_t m1 = std::min(p.M, m0 + kPanel);
      for (int64_t g = begin; g < end; ++g) {
        Slots s, following;
        const int vectors = pair_slots(g, UnitTile, units, p.K, s);
        const Prefetch next = g + 1 < end
            ? streams(p.w, following, pair_slots(g + 1, UnitTile, units, p.K, following), 0)
            : Prefetch{};
        const Sink sink{partial.data(), vectors * kVec, o + m0 * width + g * UnitTile * kVec,
                        width};
        group_tail<2 * UnitTile, RowTile>(p, s, vectors, m0, m1, sink, next);
      }
    }
  });
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
  if (p.M < kFusedFewRows) fused<kFewUnitTile, kFewRowTile>(p, out.data_ptr<float>(), width);
  else fused<kUnitTile, kFusedRowTile>(p, out.data_ptr<float>(), width);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("f32_linear", &f32_linear,
        "x [M, K] float32 times a weight packed [blocks, K, 16] (see f32_linear.cpp)");
  m.def("f32_linear_silu_mul", &f32_linear_silu_mul,
        "silu(gate) * up of x [M, K] times a [gate | up] weight packed [blocks, K, 16]");
}
