// The float32 kernel's register tiles and the loops around them (f32_linear.cpp's entry
// points call group_tail): a tile of MR rows x V vectors keeps its sums in registers
// over a chunk of columns, `group` runs a group of blocks' chunks over a panel of rows
// in tiles of even sizes. Included by f32_linear.cpp only.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int kLanes = 16;  // a block's channels: the packed layout on every CPU

// The vector the arithmetic runs on: a whole block's 16 lanes with AVX-512, half a block
// (8 lanes, one AVX2 register) without. A 64-byte GCC vector without AVX-512 is not
// kept in registers: GCC splits each operation through memory, which measured the
// product 3-10x slower than OpenBLAS under `--isa avx2` (docs/BENCHMARKS.md), so a
// block is handled as kParts vectors instead.
//
// Tiles (other shapes: benchmarks/bench_native_rows.py --builds). Up to kDecodeRows
// rows (a decode step's) AVX-512 takes 4 rows x 6 blocks: twice the weight streams per
// thread, and from 5 rows a second tile multiplies from L2 while the next chunk is
// fetched (a decode step's products 1.05-1.12x at 8 rows, ~1.1x at 10-12; no gain from
// 16 on: docs/BENCHMARKS.md; on an Intel host 1.2x slower than the wide tile, so
// the engine measures which it takes: f32_linear.cpp's decode_rows). A chunk's lone
// row tile fetches its own streams TM_STREAM_AHEAD columns ahead into L2; more row
// tiles share out the next chunk's (TM_SPREAD). The fused activation's tiles take gate
// channels a vector at a time ("units": a block with AVX-512, half a block without),
// each with the up channels that pair with it: AVX-512, 6 rows x 2 units (6 x 4
// accumulators), and 4 x 3 up to 8 rows (at 10-12 rows neither won) where the decode
// tiles are taken;
// where the wide tile is, 12 rows x 1 unit up to TM_WIDE_FUSED_ROWS rows (one tile of
// up to 12 rows, two streams: a decode step's products 1.07x at 8 and 12 rows, 1.04x at
// 16 and 32, level at 64, on an Intel host).
// AVX2, 6 rows x 1 unit (the plain tile's 6 x 2 halves) from 20 rows on (from 8 where
// the host measured the wide tile faster than its decode tiles); below, where
// the weights stream from memory, 2 rows x 2 units (a whole block's lines per stream:
// half-block units read each line twice; one row ran 1.4x slower so, and under an AVX2
// cap on an Intel host the gate/up product at 8, 12 and 16 rows 1.19x, 1.11x and 1.10x
// slower, level at 24, 0.95x at 32). AVX2's decode tiles, up to 16 rows, are 2 rows x 2
// blocks (two streams a thread, 8 accumulators): under that cap a decode step's
// products 1.02-1.04x at 4-16 rows against the wide tile (docs/BENCHMARKS.md).
#ifndef TM_DECODE_ROWS  // 0: no decode tiles
#if defined(__AVX512F__)
#define TM_DECODE_ROWS 12
#else
#define TM_DECODE_ROWS 16
#endif
#endif
constexpr int64_t kDecodeRows = TM_DECODE_ROWS;
#if defined(__AVX512F__)
constexpr int kVec = 16;
#ifndef TM_ROW_TILE  // 8 x 3 accumulators + 3 weight vectors of 32 registers
#define TM_ROW_TILE 8
#define TM_BLOCK_TILE 3
#endif
constexpr int kRowTile = TM_ROW_TILE, kBlockTile = TM_BLOCK_TILE;
constexpr int kDecodeRowTile = 4, kDecodeBlockTile = 6;
#ifndef TM_UNIT_TILE  // the fused activation's; 12 or 14 rows x 1 unit: level at 512+ rows
#define TM_UNIT_TILE 2
#define TM_FUSED_ROW_TILE 6
#endif
constexpr int kUnitTile = TM_UNIT_TILE, kFusedRowTile = TM_FUSED_ROW_TILE;
constexpr int kFewUnitTile = 3, kFewRowTile = 4, kWideUnitTile = 1, kWideFusedRowTile = 12;
#ifndef TM_WIDE_FUSED_ROWS  // 0: none
#define TM_WIDE_FUSED_ROWS 32
#endif
constexpr int64_t kWideFusedRows = TM_WIDE_FUSED_ROWS;
#else
constexpr int kVec = 8;
constexpr int kRowTile = 6, kBlockTile = 1;  // 6 x 1 x 2 halves + 2 + a broadcast of 16
#ifndef TM_DECODE_ROW_TILE  // 2 x 2 blocks x 2 halves + 4 weight halves + a broadcast
#define TM_DECODE_ROW_TILE 2
#define TM_DECODE_BLOCK_TILE 2
#endif
constexpr int kDecodeRowTile = TM_DECODE_ROW_TILE, kDecodeBlockTile = TM_DECODE_BLOCK_TILE;
constexpr int kUnitTile = 1, kFusedRowTile = 6, kFewUnitTile = 2, kFewRowTile = 2;
constexpr int kWideUnitTile = 1, kWideFusedRowTile = 6;  // AVX2 has no wide fused tile
constexpr int64_t kWideFusedRows = 0;
#endif
// Rows below which the fused activation takes its few-row tile, for products that take
// the decode tiles up to `decode_rows` (AVX-512: 4 x 3 up to 8 rows; AVX2: 2 x 2 units
// below 20 rows where the host keeps its decode tiles, the same whole-block streams,
// else below 8 rows as before they were measured).
#ifndef TM_FEW_FUSED_ROWS_AVX2
#define TM_FEW_FUSED_ROWS_AVX2 20
#endif
inline int64_t fused_few_rows(int64_t decode_rows) {
  if (kVec == kLanes) return std::min<int64_t>(9, decode_rows + 1);
  return decode_rows > 0 ? TM_FEW_FUSED_ROWS_AVX2 : 8;
}
constexpr int kParts = kLanes / kVec;
constexpr int kMaxVectors = std::max({kBlockTile * kParts, kDecodeBlockTile * kParts,
                                      2 * kUnitTile, 2 * kFewUnitTile});
typedef float vf __attribute__((vector_size(kVec * sizeof(float))));
// Columns per pass: 3 blocks x 256 x 64 B = 48 KB of weights shared by the row tiles
// (benchmarks/bench_native_rows.py --builds compares other sizes).
#ifndef TM_CHUNK
#define TM_CHUNK 256
#endif
constexpr int64_t kChunk = TM_CHUNK;
// Columns per pass for a panel of TM_WIDE_CHUNK_ROWS rows or more: 3 blocks x 512 x 64 B
// = 96 KB from L2, fewer passes over the rows' partial sums; with the even fetch below,
// a 32 x 128 prefill ran ~1.05x faster and 32-row steps 1.01-1.06x on an Intel host,
// where 8-row steps on the decode tiles ran 0.91x and 16-row ones on the wide tile
// 0.92x (docs/BENCHMARKS.md). 0: kChunk at every row count.
#ifndef TM_WIDE_CHUNK
#define TM_WIDE_CHUNK 512
#endif
#ifndef TM_WIDE_CHUNK_ROWS
#define TM_WIDE_CHUNK_ROWS 32
#endif
// The column chunk of a panel of `rows` rows.
inline int64_t chunk_for(int64_t rows) {
  return TM_WIDE_CHUNK > 0 && rows >= TM_WIDE_CHUNK_ROWS ? TM_WIDE_CHUNK : kChunk;
}
// Rows per panel: a thread takes its blocks over one panel of rows at a time, so the
// rows it re-reads for every block group stay in L2 (not the whole x of a 2048-row
// prefill step from L3; benchmarks/bench_native_rows.py compares panel sizes). 256:
// an MLP slice (layers/row_slices.py) is one panel.
#ifndef TM_PANEL
#define TM_PANEL 256
#endif
constexpr int64_t kPanel = TM_PANEL;
// Fetch the next column chunk's weights into L2 while a chunk's row tiles run, spread
// evenly over them: of T row tiles, tile t takes the next chunk's t-th 1/T of the
// columns, a column of every stream (a line each) every T columns of its own loop, so
// the memory streams at an even rate beside the multiply-adds. 0 builds the old plan
// (tiles 1 .. streams a whole stream each, a line every column, in bursts the fill
// buffers could not keep up with; the first tile its own streams ahead). A decode
// step's products 1.11-1.15x at 16-64 rows on an Intel host, 1.16-1.23x at 8-12 rows
// with the decode tiles (docs/BENCHMARKS.md). TM_PREFETCH_NEXT=0: no next-chunk fetch.
#ifndef TM_SPREAD
#define TM_SPREAD 1
#endif
#ifndef TM_PREFETCH_NEXT
#define TM_PREFETCH_NEXT 1
#endif
// How far ahead (in columns: one 64-byte line of each block's stream) a chunk's lone
// row tile (a decode step's few rows) fetches its own weights: a decode step's products
// 1.05-1.1x at 4-32 rows on a Zen 4 host, and the wide tile's 8 rows 1.14x on an Intel
// one, against no fetch (docs/BENCHMARKS.md); 0: none. The build's distance until the
// engine sets the one `tokenmill tune` measured fastest on this host (stream_ahead):
// on an Intel host 32-48 read a one-row step's products 1.03x faster than 64. A lone
// tile of more than kOneAheadRows rows takes a distance of its own (stream_ahead_many,
// tuned at 8 rows): on a Zen 4 host one row read fastest at 16 (1.14x against 48) and 8
// rows at 48 (1.20x against 16), level at 4 (docs/BENCHMARKS.md).
#ifndef TM_STREAM_AHEAD
#define TM_STREAM_AHEAD 64
#endif
int64_t stream_ahead = TM_STREAM_AHEAD, stream_ahead_many = TM_STREAM_AHEAD;
constexpr int64_t kOneAheadRows = 4;
// The distance a lone tile of `rows` rows takes (set and read through it as well).
inline int64_t& stream_ahead_for(int64_t rows) {
  return rows > kOneAheadRows ? stream_ahead_many : stream_ahead;
}
constexpr int64_t kMaxStreamAhead = 1024;
// Products of this many rows or more first repack x tile by tile (pack_rows), so that
// a tile reads its rows' column k from one line; fewer rows (a decode step's, bound by
// the weights' memory) read x in place. An Intel host's 32-512-row steps 1.5-4%.
#ifndef TM_PACK_ROWS
#define TM_PACK_ROWS 16
#endif
// Products of more rows run a slice of this many at a time (a multiple of kPanel; 0:
// all at once), each slice's rows packed into one buffer that the slices reuse: the
// rows a thread reads again for every block group then come from a 10 MB buffer, not
// from a 40 MB one that leaves the last-level cache (a 2048-row down projection, K =
// 4864, 1.2x on an Intel host with TM_SPLIT_PANELS; docs/BENCHMARKS.md).
#ifndef TM_SLICE_ROWS
#define TM_SLICE_ROWS 512
#endif
// From two row panels on, the threads split panels x block groups as one list (whole
// panels each where they can) rather than the groups alone, so each thread re-reads its
// own panel of x. 0 builds the split by groups alone (f32_linear.cpp's
// panels_and_groups).
#ifndef TM_SPLIT_PANELS
#define TM_SPLIT_PANELS 1
#endif
// Block groups laid out per thread, each thread's run of blocks even to a block
// (f32_linear.cpp's Groups); 0 builds one run for all threads.
#ifndef TM_EVEN_SHARES
#define TM_EVEN_SHARES 1
#endif
// A thread done with its own run of work items takes the items another has not begun,
// from the back of its run (f32_linear.cpp's share_out): a thread the OS has taken the
// core from (a served engine shares two cores with its event loop and clients) no
// longer holds up the product. 0 builds the fixed split.
#ifndef TM_STEAL
#define TM_STEAL 1
#endif
// Row tiles of even sizes: a product's rows split into as few tiles as kRowTile allows,
// each within one row of the others (32 rows under AVX2: 6 6 5 5 5 5, not 6 6 6 6 6 2).
// A small tail tile has too few accumulators to hide the multiply-add latency and runs
// at a fraction of the rate per row. 0 builds the old split (full tiles, then the rest).
#ifndef TM_EVEN_TILES
#define TM_EVEN_TILES 1
#endif

// Columns the tile loop takes per pass (GCC's unrolling; the fetch's countdown stays per
// column): at 4 a prefill 1.03-1.05x on an Intel host with AVX-512, level to 1.03x
// under an AVX2 cap (docs/BENCHMARKS.md). Loops restructured around the fetch instead
// (an inner loop per fetch, or a remainder loop after an unrolled one) had GCC keep the
// accumulators in memory, a fraction of the speed.
#ifndef TM_UNROLL
#define TM_UNROLL 4
#endif
#define TM_PRAGMA(text) _Pragma(#text)
#define TM_UNROLL_BY(n) TM_PRAGMA(GCC unroll n)
#define TM_UNROLLED TM_UNROLL_BY(TM_UNROLL)

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
  const float* x;       // [M][K], or packed by row tiles (pack_rows)
  const float* w;       // [blocks][K][16]
  const float* bias;    // [blocks * 16], or null
  int64_t M, K;
  bool packed = false;
  int64_t row0 = 0;  // the product's row that x's first row is (in_slices)
};

// The rows of row tile t of `tiles` over `rows` rows (`done` rows before it): tiles of
// even sizes (or full tiles, then the rest).
template <int RowTile>
inline int64_t tile_rows(int64_t rows, int64_t tiles, int64_t t, int64_t done) {
  return TM_EVEN_TILES ? rows / tiles + (t < rows % tiles)
                       : std::min<int64_t>(RowTile, rows - done);
}

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

// A chunk's weight streams: one per block of a group's vectors (vectors in the second
// half of a block share its lines), w[j] at the chunk's first column, `cols` columns.
struct Streams {
  const float* w[kMaxVectors] = {};
  int lines = 0;
  int64_t cols = 0;
};

Streams streams(const float* w, const Slots& s, int vectors, int64_t k, int64_t cols) {
  Streams ahead;
  for (int j = 0; j < vectors; ++j)
    if (s.w[j] % kLanes == 0) ahead.w[ahead.lines++] = w + s.w[j] + k * kLanes;
  ahead.cols = cols;
  return ahead;
}

// What a row tile fetches into L2 while it runs: `cols` columns of `lines` streams from
// w[j] on, a column (a line of each stream) every `every` columns of its loop; or, with
// `ahead`, its own streams that many columns ahead of each column it reads.
struct Fetch {
  const float* w[kMaxVectors] = {};
  int lines = 0;
  int every = 1;
  int64_t cols = 0;
  int64_t ahead = 0;
};

// Tile t of `tiles` over a chunk of `own` columns: its share of `next` (the columns
// [t * span, (t + 1) * span) of every stream, span = 1 / tiles of them), a column every
// `own / span` columns, so that its share is fetched by the end of its loop.
Fetch share(const Streams& next, int64_t tiles, int64_t t, int64_t own) {
  Fetch f;
  const int64_t span = (next.cols + tiles - 1) / tiles;
  const int64_t first = std::min(next.cols, t * span);
  f.lines = next.lines;
  for (int j = 0; j < f.lines; ++j) f.w[j] = next.w[j] + first * kLanes;
  f.cols = std::min(span, next.cols - first);
  f.every = static_cast<int>(std::max<int64_t>(1, own / std::max<int64_t>(1, span)));
  return f;
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

// Column k of a tile: its V weight vectors (w[j] at column k0) times each row's x.
template <int MR, int V, bool Packed>
__attribute__((always_inline)) inline void step(vf (&acc)[MR][V], const float* const (&w)[V],
                                                const float* x, int64_t k, int64_t k0,
                                                int64_t K) {
  vf wk[V];
  for (int j = 0; j < V; ++j) {
    wk[j] = load(w[j] + (k - k0) * kLanes);
    pin(wk[j]);
  }
  for (int m = 0; m < MR; ++m) {
    const float xm = Packed ? x[k * MR + m] : x[m * K + k];
    for (int j = 0; j < V; ++j) acc[m][j] += xm * wk[j];
  }
}

// Rows [0, MR) of the sink x the slots' first V vectors, columns [k0, k1): accumulators
// start from the bias (first chunk) or the partial sums, and go back to the sink; the
// tile fetches `fetch` as it goes. Out of line: inlined into the product's loops, GCC
// kept the AVX2 tile's accumulators in memory (2.5x slower); with AVX-512 the two
// measured alike.
template <int MR, int V, bool Packed>
__attribute__((noinline)) void tile(const Problem& p, const Slots& s, const float* x,
                                    const Sink& sink, int64_t k0, int64_t k1,
                                    const Fetch& fetch) {
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
  if (fetch.ahead > 0) {
    // A lone tile: its own streams `ahead` columns on (the fetch at the load's index).
    bool line[V];
    for (int j = 0; j < V; ++j) line[j] = s.w[j] % kLanes == 0;
    for (int64_t k = k0; k < k1; ++k) {
      for (int j = 0; j < V; ++j)
        if (line[j]) __builtin_prefetch(w[j] + (k - k0 + fetch.ahead) * kLanes, 0, 2);
      step<MR, V, Packed>(acc, w, x, k, k0, p.K);
    }
  } else {
    // The streams to fetch (up to one per vector: fewer where two vectors share a
    // block's lines), a column every `every` columns until `cols` are fetched.
    const float* ahead[V];
    for (int j = 0; j < V; ++j) ahead[j] = fetch.w[j];
    const int lines = fetch.lines;
    const float* const end = ahead[0] + (lines ? fetch.cols : 0) * kLanes;
    int countdown = 1;
    TM_UNROLLED
    for (int64_t k = k0; k < k1; ++k) {
      if (--countdown == 0) {
        countdown = fetch.every;
        if (ahead[0] < end) {
          for (int j = 0; j < V; ++j) {
            if (j < lines) __builtin_prefetch(ahead[j], 0, 2);
            ahead[j] += kLanes;
          }
        }
      }
      step<MR, V, Packed>(acc, w, x, k, k0, p.K);
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
               int64_t rows, int64_t k0, int64_t k1, const Fetch& fetch) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      if (p.packed) return tile<MR, V, true>(p, s, x, sink, k0, k1, fetch);
      return tile<MR, V, false>(p, s, x, sink, k0, k1, fetch);
    }
    rows_tail<V, MR - 1>(p, s, x, sink, rows, k0, k1, fetch);
  }
}

// What row tile t of `tiles` over a chunk of `columns` for `rows` rows fetches: a lone
// tile its own streams stream_ahead_for(rows) columns ahead; more tiles their shares of
// the next chunk.
Fetch plan(const Streams& next, int64_t tiles, int64_t t, int64_t columns, int64_t rows) {
  if (tiles == 1) {
    Fetch lone;
    lone.ahead = stream_ahead_for(rows);
    return lone;
  }
  if (!TM_PREFETCH_NEXT || next.lines == 0) return Fetch{};
  if (TM_SPREAD) return share(next, tiles, t, columns);
  // The old plan: the first tile its own streams ahead, tiles 1 .. streams a stream each.
  if (t == 0) return plan(next, 1, 0, columns, rows);
  if (t - 1 >= next.lines) return Fetch{};
  Streams one;
  one.w[0] = next.w[t - 1];
  one.lines = 1;
  one.cols = next.cols;
  return share(one, 1, 0, columns);
}

// The slots' first V vectors for rows [m_begin, m_end) (the sink's row 0 is m_begin),
// in row tiles of up to RowTile rows; `next` is what this thread multiplies after them
// (its first chunk is fetched ahead).
template <int V, int RowTile>
void group(const Problem& p, const Slots& s, int64_t m_begin, int64_t m_end, const Sink& sink,
           const Streams& next) {
  const int64_t rows = m_end - m_begin;
  const int64_t tiles = (rows + RowTile - 1) / RowTile;
  const int64_t chunk = chunk_for(rows);
  for (int64_t k0 = 0; k0 < p.K; k0 += chunk) {
    const int64_t k1 = std::min(p.K, k0 + chunk);
    // The chunk after this one: this group's next columns, or the next group's first.
    const Streams after = k1 < p.K ? streams(p.w, s, V, k1, std::min(chunk, p.K - k1)) : next;
    int64_t done = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t size = tile_rows<RowTile>(rows, tiles, t, done);
      rows_tail<V, RowTile>(p, s, p.x + (m_begin + done) * p.K, sink.rows_on(done), size, k0,
                            k1, plan(after, tiles, t, k1 - k0, rows));
      done += size;
    }
  }
}

template <int V, int RowTile>
void group_tail(const Problem& p, const Slots& s, int vectors, int64_t m_begin, int64_t m_end,
                const Sink& sink, const Streams& next) {
  if constexpr (V > 0) {
    if (vectors == V) return group<V, RowTile>(p, s, m_begin, m_end, sink, next);
    group_tail<V - 1, RowTile>(p, s, vectors, m_begin, m_end, sink, next);
  }
}

}  // namespace
