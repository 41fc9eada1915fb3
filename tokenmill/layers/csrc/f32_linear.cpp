// Float32 products on the CPU with tokenmill's own kernel: y = x W^T + b, W packed once
// at load (layers/native_linear.py) into blocks of 16 output channels:
//   packed [blocks][K][16] float32, block b's column k = the 16 channels' weights at k
// (channels past N are zero): a block is one stream, a column one 16-lane vector.
//
// One kernel for every row count: tiles of up to MR rows x NB blocks (8 x 3 with
// AVX-512: 24 accumulators in registers; 4 x 6 up to 12 rows, the decode tiles of
// f32_tiles.h; a product's rows in tiles of even sizes), each
// weight column loaded once per tile into registers and shared by its rows, the columns
// in chunks (chunk_for) so a tile's weights stay in L1/L2 while every row tile of the
// product passes over them (one row: NB streams and sums per thread, ~2x one block at a
// time). The work is split over torch's threads by groups of blocks (contiguous memory
// per thread, each thread's run even to a block; one done early takes another's last
// groups), from two row panels on by panels and groups; products of many rows run a
// slice of rows at a time (in_slices). GCC vector
// types keep it portable: one AVX-512 register per block, or two 8-lane halves (AVX2)
// without. Sums differ from a BLAS's by rounding only.
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
#include <atomic>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "entry_points.h"
#include "f32_tiles.h"

namespace {

// Rows up to which a product takes the decode tiles (0: never): the build's
// TM_DECODE_ROWS until the engine sets what it measured on this host
// (layers/product_table.py): on one AVX-512 host the 4 x 6 tiles read 8 rows 1.05-1.12x
// faster than the wide tile, on another 1.2x slower (docs/BENCHMARKS.md).
int64_t decode_rows = kDecodeRows;

// Groups of up to `tile` blocks (or fused units) of `items`, laid out as `shares` even
// runs, one per thread, each run cut into groups from its start (its last may be
// smaller, and a shorter run's last empty): each thread's share of a one-panel product
// is even to a block. A down projection's 56 blocks in groups of 3 went 30 to one
// thread and 26 to the other; now 28 each, 9 groups of 3 and one of 1.
struct Groups {
  int64_t items, tile, shares, per_share;

  Groups(int64_t items, int64_t tile, int64_t shares)
      : items(items), tile(tile), shares(shares),
        per_share(((items + shares - 1) / shares + tile - 1) / tile) {}
  int64_t count() const { return shares * per_share; }
  int64_t first(int64_t g) const { return items * (g / per_share) / shares + g % per_share * tile; }
  int64_t size(int64_t g) const {
    const int64_t end = items * (g / per_share + 1) / shares;
    return std::clamp<int64_t>(end - first(g), 0, tile);
  }
};

Groups groups_of(int64_t items, int64_t tile) {
  return {items, tile, TM_EVEN_SHARES ? std::max(1, at::get_num_threads()) : 1};
}

// Whether a plain product of `rows` rows over `blocks` blocks takes the decode tiles:
// up to decode_rows rows, where they leave each of `threads` four groups or more.
bool takes_decode_tiles(int64_t rows, int64_t blocks, int64_t threads) {
  return rows <= decode_rows && blocks >= 4 * kDecodeBlockTile * threads;
}

// The fused activation's tile for `rows` rows of `width` gate channels: AVX-512's few-row
// tile where it leaves each thread four groups or more (AVX2's: below 8 rows whatever
// the width); AVX-512's wide fused tile where the host takes the wide tile (no decode
// tiles); else the plain one.
enum class FusedTile { few, wide, plain };
FusedTile fused_tile(int64_t rows, int64_t width, int64_t threads) {
  if (rows < fused_few_rows(decode_rows) &&
      (kVec < kLanes || width / kVec >= 4 * kFewUnitTile * threads))
    return FusedTile::few;
  if (kWideFusedRows > 0 && decode_rows == 0 && rows <= kWideFusedRows &&
      width / kVec >= 4 * kWideUnitTile * threads)
    return FusedTile::wide;
  return FusedTile::plain;
}

// Group g of a plain product: its blocks, a vector per kVec lanes. Returns the vectors.
int adjacent_slots(const Groups& groups, int64_t g, int64_t K, Slots& s) {
  const int64_t b0 = groups.first(g);
  const int count = static_cast<int>(groups.size(g)) * kParts;
  for (int j = 0; j < count; ++j) s.set(j, b0 + j / kParts, (j % kParts) * kVec, K);
  return count;
}

// Group g of the fused activation: its gate units of `units` (a unit: kVec channels,
// `units / kParts` blocks of gates), then the up units of the same channels (the up
// blocks follow the gate blocks). Returns the vectors.
int pair_slots(const Groups& groups, int64_t g, int64_t K, Slots& s) {
  const int64_t u0 = groups.first(g), gate_blocks = groups.items / kParts;
  const int count = static_cast<int>(groups.size(g));
  for (int j = 0; j < count; ++j) {
    const int64_t u = u0 + j, lane = (u % kParts) * kVec;
    s.set(j, u / kParts, lane, K);
    s.set(count + j, gate_blocks + u / kParts, lane, K);
  }
  return 2 * count;
}

// x [M][K] with each row tile's rows interleaved, as `group` splits every panel into
// tiles: a tile of `size` rows from row r on holds [K][size] at out + r * K. A tile's
// loop then reads its rows' column k from one line at a fixed offset instead of from
// `size` rows K floats apart (fewer address operations beside the multiply-adds).
template <int RowTile>
void pack_rows(const float* x, int64_t M, int64_t K, float* out) {
  std::vector<std::pair<int64_t, int64_t>> spans;  // (first row, rows) of every tile
  for (int64_t m0 = 0; m0 < M; m0 += kPanel) {
    const int64_t rows = std::min(M, m0 + kPanel) - m0;
    const int64_t tiles = (rows + RowTile - 1) / RowTile;
    for (int64_t t = 0, done = 0; t < tiles; ++t) {
      const int64_t size = tile_rows<RowTile>(rows, tiles, t, done);
      spans.emplace_back(m0 + done, size);
      done += size;
    }
  }
  at::parallel_for(0, static_cast<int64_t>(spans.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [r, size] = spans[i];
      const float* src = x + r * K;
      float* dst = out + r * K;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t m = 0; m < size; ++m) dst[k * size + m] = src[m * K + k];
    }
  });
}

// body(q) for each slice of p's rows, TM_SLICE_ROWS at a time (0: all at once): q.x its
// rows, q.M their count, q.row0 the first. From TM_PACK_ROWS rows and with `pack`, a
// slice's rows are first packed by RowTile's tiles into one buffer that every slice
// reuses. A slice keeps the packed rows and the output it writes cache-sized.
template <int RowTile, typename Body>
void in_slices(const Problem& p, bool pack, const Body& body) {
  const int64_t slice = TM_SLICE_ROWS > 0 ? TM_SLICE_ROWS : std::max<int64_t>(p.M, 1);
  torch::Tensor buffer;
  for (int64_t r0 = 0; r0 < p.M; r0 += slice) {
    Problem q = p;
    q.x = p.x + r0 * p.K;
    q.M = std::min(slice, p.M - r0);
    q.row0 = r0;
    if (pack && q.M >= TM_PACK_ROWS) {
      if (!buffer.defined()) buffer = torch::empty({q.M * q.K}, torch::kFloat32);
      pack_rows<RowTile>(q.x, q.M, q.K, buffer.data_ptr<float>());
      q.x = buffer.data_ptr<float>();
      q.packed = true;
    }
    body(q);
  }
}

// One thread's run of work items [front, back), both in one word so that taking an
// item from either end is one compare-and-swap: the owner takes from the front, a
// thread done with its own run from the back (each item runs once).
struct alignas(64) Run {
  std::atomic<uint64_t> span{0};

  void set(uint64_t front, uint64_t back) { span.store(front << 32 | back); }
  // The item taken (-1: none left) and, from the front, the owner's next (-1: none).
  std::pair<int64_t, int64_t> take(bool front) {
    uint64_t v = span.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t f = v >> 32, b = v & 0xffffffffu;
      if (f >= b) return {-1, -1};
      const uint64_t next = front ? (f + 1) << 32 | b : f << 32 | (b - 1);
      if (span.compare_exchange_weak(v, next, std::memory_order_acq_rel))
        return front ? std::pair<int64_t, int64_t>(f, f + 1 < b ? f + 1 : -1)
                     : std::pair<int64_t, int64_t>(b - 1, -1);
    }
  }
};

// Items a thread took from another's run, since the library loaded (tests read it).
std::atomic<int64_t> stolen_items{0};

// item(i, next) for every i in [0, n), split over torch's threads as at::parallel_for
// splits it (a contiguous run each); `next` is the item the thread takes after i (-1:
// none known), whose first columns the item fetches ahead. With TM_STEAL a thread done
// with its run takes the others' last items. Items write disjoint outputs, so the
// results are the same bits whoever runs them.
template <typename Item>
void share_out(int64_t n, const Item& item) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  if (!TM_STEAL || threads == 1) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) item(i, i + 1 < end ? i + 1 : -1);
    });
    return;
  }
  const int64_t chunk = (n + threads - 1) / threads;
  std::vector<Run> runs(threads);
  for (int64_t t = 0; t < threads; ++t)
    runs[t].set(std::min(n, t * chunk), std::min(n, (t + 1) * chunk));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (auto [i, next] = runs[t].take(true); i >= 0; std::tie(i, next) = runs[t].take(true))
        item(i, next);
      for (int64_t k = 1; k < threads; ++k) {
        Run& other = runs[(t + k) % threads];
        for (int64_t i = other.take(false).first; i >= 0; i = other.take(false).first) {
          stolen_items.fetch_add(1, std::memory_order_relaxed);
          item(i, -1);
        }
      }
    }
  });
}

// fn(m0, m1, g, after) for every panel of rows [m0, m1) and group g of `groups`, split
// over torch's threads as one list, panel by panel; `after` is the group the thread takes
// next (-1: none), whose first columns fn fetches ahead. A thread's share is contiguous
// (share_out), until it takes another's last items: from two panels on, threads take
// whole panels, each its own panel of x (a 512-row down projection 1.2x on an Intel
// host, docs/BENCHMARKS.md).
template <typename Fn>
void panels_and_groups(int64_t M, int64_t groups, const Fn& fn) {
  const int64_t panels = (M + kPanel - 1) / kPanel;
  if (!TM_SPLIT_PANELS) {
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m0 = 0; m0 < M; m0 += kPanel)
        for (int64_t g = begin; g < end; ++g)
          fn(m0, std::min(M, m0 + kPanel), g, g + 1 < end ? g + 1 : -1);
    });
    return;
  }
  share_out(panels * groups, [&](int64_t i, int64_t next) {
    const int64_t m0 = i / groups * kPanel;
    fn(m0, std::min(M, m0 + kPanel), i % groups, next >= 0 ? next % groups : -1);
  });
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

// out [M, columns] float32, contiguous: what an `_into` entry point writes.
void check_out(const torch::Tensor& out, const torch::Tensor& x, int64_t columns) {
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == columns,
              "out must be float32 [", x.size(0), ", ", columns, "], contiguous");
}

// y = x W^T + b into o [M][blocks * 16] (x contiguous; checked).
void linear_into(const torch::Tensor& x, const torch::Tensor& packed,
                 const c10::optional<torch::Tensor>& bias, float* o) {
  const int64_t blocks = packed.size(0), ldo = blocks * kLanes;
  const Problem p = problem(x, packed, bias);
  const bool decode = takes_decode_tiles(p.M, blocks, at::get_num_threads());
  const Groups groups = groups_of(blocks, decode ? kDecodeBlockTile : kBlockTile);
  in_slices<kRowTile>(p, !decode, [&](const Problem& q) {
    float* const rows = o + q.row0 * ldo;
    panels_and_groups(q.M, groups.count(), [&](int64_t m0, int64_t m1, int64_t g, int64_t after) {
      Slots s, following;
      const int vectors = adjacent_slots(groups, g, q.K, s);
      const Streams next = after >= 0
          ? streams(q.w, following, adjacent_slots(groups, after, q.K, following), 0,
                    std::min(chunk_for(m1 - m0), q.K))
          : Streams{};
      const Sink sink{rows + m0 * ldo + groups.first(g) * kLanes, ldo};
      if (decode)
        group_tail<kDecodeBlockTile * kParts, kDecodeRowTile>(q, s, vectors, m0, m1, sink, next);
      else
        group_tail<kBlockTile * kParts, kRowTile>(q, s, vectors, m0, m1, sink, next);
    });
  });
}

torch::Tensor f32_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                         int64_t out_features) {
  check_product(x, packed, bias, out_features);
  x = x.contiguous();
  const int64_t ldo = packed.size(0) * kLanes;
  auto out = torch::empty({x.size(0), ldo}, x.options());
  linear_into(x, packed, bias, out.data_ptr<float>());
  if (out_features == ldo) return out;
  return out.narrow(1, 0, out_features).contiguous();
}

// f32_linear into out [M, blocks * 16] (x contiguous): the decode stack's entry point,
// which keeps its buffers from step to step (a tensor made after a weight stream costs
// ~10 us of cache misses, more than a short product's arithmetic).
void f32_linear_into(const torch::Tensor& x, const torch::Tensor& packed,
                     const c10::optional<torch::Tensor>& bias, const torch::Tensor& out) {
  check_product(x, packed, bias, packed.size(0) * kLanes);
  check_out(out, x, packed.size(0) * kLanes);
  linear_into(x, packed, bias, out.data_ptr<float>());
}

// silu(gate) * up into o [M][width] in tiles of UnitTile units x RowTile rows.
template <int UnitTile, int RowTile>
void fused(const Problem& p, float* o, int64_t width) {
  const Groups groups = groups_of(width / kVec, UnitTile);
  in_slices<RowTile>(p, true, [&](const Problem& q) {
    float* const rows = o + q.row0 * width;
    panels_and_groups(q.M, groups.count(), [&](int64_t m0, int64_t m1, int64_t g, int64_t after) {
      // The partial sums of one group over one panel of rows, a buffer per thread.
      thread_local std::vector<float> partial;
      partial.resize(kPanel * 2 * UnitTile * kVec);
      Slots s, following;
      const int vectors = pair_slots(groups, g, q.K, s);
      const Streams next = after >= 0
          ? streams(q.w, following, pair_slots(groups, after, q.K, following), 0,
                    std::min(chunk_for(m1 - m0), q.K))
          : Streams{};
      const Sink sink{partial.data(), vectors * kVec, rows + m0 * width + groups.first(g) * kVec,
                      width};
      group_tail<2 * UnitTile, RowTile>(q, s, vectors, m0, m1, sink, next);
    });
  });
}

void check_fused(const torch::Tensor& x, const torch::Tensor& packed,
                 const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  check_product(x, packed, bias, out_features);
  TORCH_CHECK(out_features == packed.size(0) * kLanes && packed.size(0) % 2 == 0,
              "the fused activation takes [gate | up] of 2 x a multiple of 16 channels, got ",
              out_features);
}

// silu(gate) * up into o [M][width] (x contiguous; checked).
void silu_mul_into(const torch::Tensor& x, const torch::Tensor& packed,
                   const c10::optional<torch::Tensor>& bias, float* o) {
  const int64_t width = packed.size(0) / 2 * kLanes;
  const Problem p = problem(x, packed, bias);
  switch (fused_tile(p.M, width, at::get_num_threads())) {
    case FusedTile::few: fused<kFewUnitTile, kFewRowTile>(p, o, width); break;
    case FusedTile::wide: fused<kWideUnitTile, kWideFusedRowTile>(p, o, width); break;
    case FusedTile::plain: fused<kUnitTile, kFusedRowTile>(p, o, width);
  }
}

torch::Tensor f32_linear_silu_mul(torch::Tensor x, torch::Tensor packed,
                                  c10::optional<torch::Tensor> bias, int64_t out_features) {
  check_fused(x, packed, bias, out_features);
  x = x.contiguous();
  auto out = torch::empty({x.size(0), out_features / 2}, x.options());
  silu_mul_into(x, packed, bias, out.data_ptr<float>());
  return out;
}

// f32_linear_silu_mul into out [M, blocks * 8] (x contiguous): the decode stack's.
void f32_linear_silu_mul_into(const torch::Tensor& x, const torch::Tensor& packed,
                              const c10::optional<torch::Tensor>& bias,
                              const torch::Tensor& out) {
  check_fused(x, packed, bias, packed.size(0) * kLanes);
  check_out(out, x, packed.size(0) / 2 * kLanes);
  silu_mul_into(x, packed, bias, out.data_ptr<float>());
}

void set_decode_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= kDecodeRows, "decode rows must be 0 .. ", kDecodeRows,
              " (this build's TM_DECODE_ROWS), got ", rows);
  decode_rows = rows;
}

void set_stream_ahead(int64_t columns, int64_t rows) {
  TORCH_CHECK(columns >= 0 && columns <= kMaxStreamAhead, "stream ahead must be 0 .. ",
              kMaxStreamAhead, " columns, got ", columns);
  TORCH_CHECK(rows >= 1, "stream ahead: rows must be 1 or more, got ", rows);
  stream_ahead_for(rows) = columns;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("f32_linear", &f32_linear,
        "x [M, K] float32 times a weight packed [blocks, K, 16] (see f32_linear.cpp)");
  m.def("f32_linear_silu_mul", &f32_linear_silu_mul,
        "silu(gate) * up of x [M, K] times a [gate | up] weight packed [blocks, K, 16]");
  m.def("set_decode_rows", &set_decode_rows,
        "rows up to which products take the decode tiles (0: never)");
  m.def("decode_rows", [] { return decode_rows; }, "the current decode-tile limit");
  m.def("stolen_items", [] { return stolen_items.load(); },
        "work items a thread took from another's run since the library loaded");
  m.attr("max_decode_rows") = kDecodeRows;
  m.def("set_stream_ahead", &set_stream_ahead,
        "columns ahead a lone row tile of `rows`' class fetches its own weights (0: none)",
        pybind11::arg("columns"), pybind11::arg("rows") = 1);
  m.def("stream_ahead",
        [](int64_t rows) { return stream_ahead_for(rows); },
        "the current fetch distance of `rows`' class", pybind11::arg("rows") = 1);
  m.attr("one_ahead_rows") = kOneAheadRows;
  m.attr("built_stream_ahead") = TM_STREAM_AHEAD;
  m.def("entry_points", [] {
    const tokenmill::entry::Product linear = &f32_linear_into;
    const tokenmill::entry::Product silu_mul = &f32_linear_silu_mul_into;
    return std::map<std::string, int64_t>{
        {"f32_linear_into", tokenmill::entry::address(linear)},
        {"f32_linear_silu_mul_into", tokenmill::entry::address(silu_mul)}};
  }, "the products' C++ entry points by name (csrc/shared/entry_points.h)");
}
