// Float32 products on the CPU with tokenmill's own kernel: y = x W^T + b, W packed once
// at load (layers/native_linear.py) into blocks of 16 output channels:
//   packed [blocks][K][16] float32, block b's column k = the 16 channels' weights at k
// (channels past N are zero): a block is one stream, a column one 16-lane vector.
//
// One kernel for every row count: tiles of up to MR rows x NB blocks (8 x 3 with
// AVX-512: 24 accumulators in registers; 4 x 6 up to 12 rows, the decode tiles of
// f32_tiles.h; a product's rows in tiles of even sizes), each
// weight column loaded once per tile into registers and shared by its rows, the columns
// in chunks of kChunk so a tile's weights stay in L1/L2 while every row tile of the
// product passes over them (one row: NB streams and sums per thread, ~2x one block at a
// time). The work is split over torch's threads by groups of blocks (contiguous memory
// per thread). GCC vector types keep it portable: one AVX-512 register per block, or
// two 8-lane halves (AVX2) without. Sums differ from a BLAS's by rounding only.
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
#include <vector>

#include "f32_tiles.h"

namespace {

// Rows up to which a product takes the decode tiles (0: never): the build's
// TM_DECODE_ROWS until the engine sets what it measured on this host
// (layers/product_table.py): on one AVX-512 host the 4 x 6 tiles read 8 rows 1.05-1.12x
// faster than the wide tile, on another 1.2x slower (docs/BENCHMARKS.md).
int64_t decode_rows = kDecodeRows;

// Group g of a plain product: blocks [g * tile, ...) while they last, a vector per kVec
// lanes. Returns the vectors.
int adjacent_slots(int64_t g, int tile, int64_t blocks, int64_t K, Slots& s) {
  const int64_t b0 = g * tile;
  const int count = static_cast<int>(std::min<int64_t>(tile, blocks - b0)) * kParts;
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
  Problem p = problem(x, packed, bias);
  float* o = out.data_ptr<float>();
  // The decode tile where it leaves every thread four groups or more.
  const bool decode = p.M <= decode_rows &&
                      blocks >= 4 * kDecodeBlockTile * at::get_num_threads();
  const torch::Tensor rows = decode ? torch::Tensor() : packed_rows<kRowTile>(p);
  const int tile = decode ? kDecodeBlockTile : kBlockTile;
  const int64_t groups = (blocks + tile - 1) / tile;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < p.M; m0 += kPanel) {
      const int64_t m1 = std::min(p.M, m0 + kPanel);
      for (int64_t g = begin; g < end; ++g) {
        Slots s, following;
        const int vectors = adjacent_slots(g, tile, blocks, p.K, s);
        const Prefetch next = g + 1 < end
            ? streams(p.w, following, adjacent_slots(g + 1, tile, blocks, p.K, following), 0)
            : Prefetch{};
        const Sink sink{o + m0 * ldo + g * tile * kLanes, ldo};
        if (decode)
          group_tail<kDecodeBlockTile * kParts, kDecodeRowTile>(p, s, vectors, m0, m1, sink,
                                                                next);
        else
          group_tail<kBlockTile * kParts, kRowTile>(p, s, vectors, m0, m1, sink, next);
      }
    }
  });
  if (out_features == ldo) return out;
  return out.narrow(1, 0, out_features).contiguous();
}

// silu(gate) * up into o [M][width] in tiles of UnitTile units x RowTile rows.
template <int UnitTile, int RowTile>
void fused(Problem p, float* o, int64_t width) {
  const torch::Tensor rows = packed_rows<RowTile>(p);
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
  // AVX-512's few-row tile where it leaves every thread four groups or more (AVX2's:
  // below 8 rows whatever the width).
  const bool few = p.M < fused_few_rows(decode_rows) &&
                   (kVec < kLanes || width / kVec >= 4 * kFewUnitTile * at::get_num_threads());
  if (few) fused<kFewUnitTile, kFewRowTile>(p, out.data_ptr<float>(), width);
  else fused<kUnitTile, kFusedRowTile>(p, out.data_ptr<float>(), width);
  return out;
}

void set_decode_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= kDecodeRows, "decode rows must be 0 .. ", kDecodeRows,
              " (this build's TM_DECODE_ROWS), got ", rows);
  decode_rows = rows;
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
  m.attr("max_decode_rows") = kDecodeRows;
}
