// Per-row operators a decode step calls dozens of times, each one compiled call instead
// of several torch operators (~5 µs of dispatch each on these CPUs), float32:
//
//   rms_norm  out = weight * (x * 1 / sqrt(mean(x^2) + eps)) per row (layers/norm.py).
//             The torch form's arithmetic (the two products in the same order, 1 / sqrt
//             as torch's rsqrt computes it on the CPU); only the order of the mean's
//             additions differs, which moves a result by an ulp or two.
//   add_rms_norm  residual + delta, and rms_norm of that sum, in one pass: the sum
//             rounds as torch's add does, the norm as rms_norm above.
//   silu_mul  silu(gate) * up for x = [gate | up] per row ([T, 2I] -> [T, I]): silu
//             rounded to float32 (x / (1 + exp(-x)), the torch form), then the product.
//             The exponential is computed in vec_math.h (Cody-Waite range reduction and the
//             Cephes polynomial, within a few ulp of torch's), in a loop the compiler
//             vectorizes: the C library's would be called once per element.
//   rotate_   rotary embedding in place on [T, heads, D] (rows may be strided: Q and K
//             sit side by side in the fused QKV output): shared/rotary.h's rotate_rows,
//             bit-identical to layers/rotary.py's apply_rotary.
//   argmax    the index of each row's largest value, the first one where it repeats, and
//             the first NaN where a row has one (torch.argmax's answers): a vectorized
//             maximum, then a scan for its first index, chunk by chunk. torch's argmax
//             tracks indices through its reduction and took 160-250 µs for one row of
//             a 151936-token vocabulary here, its amax 10-17 µs (layers/sampler.py).
//             Fewer long rows than threads are read in a piece per thread, merged.
//   packed_rows  rows of a weight kept in the native kernel's packed form [blocks, in,
//             lanes] (row r is lane r % lanes of block r / lanes): a tied LM head read
//             as the token embedding. One call where the indexing took three operators
//             (~0.15-0.3 ms of a one-row decode step, with the caches cold after the
//             weights' stream: layers/native_linear.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "entry_points.h"
#include "rotary.h"
#include "vec_math.h"

namespace {

using tokenmill::silu;

inline void normalize_row(const float* row, const float* w, float* target, int64_t width,
                          float e) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < width; ++i) sum += row[i] * row[i];
  const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(width) + e);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) target[i] = w[i] * (row[i] * inverse);
}

void check_rows_out(const torch::Tensor& x, const torch::Tensor& out, const char* name) {
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous() && out.sizes() == x.sizes(),
              name, ": out must be contiguous float32 of x's shape");
}

}  // namespace

void rms_norm_into(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                   const torch::Tensor& out) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32,
              "rms_norm takes float32");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm takes contiguous tensors");
  const int64_t width = weight.numel();
  TORCH_CHECK(x.size(-1) == width, "rms_norm: the last dimension must match the weight");
  check_rows_out(x, out, "rms_norm");
  const int64_t rows = x.numel() / width;
  const float* in = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      normalize_row(in + r * width, w, o + r * width, width, e);
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  rms_norm_into(x, weight, eps, out);
  return out;
}

// total may be residual itself (each element is read before it is written).
void add_rms_norm_into(const torch::Tensor& residual, const torch::Tensor& delta,
                       const torch::Tensor& weight, double eps, const torch::Tensor& total,
                       const torch::Tensor& out) {
  TORCH_CHECK(residual.dtype() == torch::kFloat32 && delta.dtype() == torch::kFloat32 &&
                  weight.dtype() == torch::kFloat32, "add_rms_norm takes float32");
  TORCH_CHECK(residual.is_contiguous() && delta.is_contiguous() && weight.is_contiguous() &&
                  residual.sizes() == delta.sizes(),
              "add_rms_norm takes contiguous tensors of one shape");
  const int64_t width = weight.numel();
  TORCH_CHECK(residual.size(-1) == width, "add_rms_norm: the last dimension must match the weight");
  check_rows_out(residual, total, "add_rms_norm");
  check_rows_out(residual, out, "add_rms_norm");
  const int64_t rows = residual.numel() / width;
  const float* a = residual.data_ptr<float>();
  const float* b = delta.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* t = total.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t at = r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) t[at + i] = a[at + i] + b[at + i];
      normalize_row(t + at, w, o + at, width, e);
    }
  });
}

std::vector<torch::Tensor> add_rms_norm(torch::Tensor residual, torch::Tensor delta,
                                        torch::Tensor weight, double eps) {
  auto total = torch::empty_like(residual, at::MemoryFormat::Contiguous);
  auto out = torch::empty_like(residual, at::MemoryFormat::Contiguous);
  add_rms_norm_into(residual, delta, weight, eps, total, out);
  return {total, out};
}

torch::Tensor silu_mul(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.size(-1) % 2 == 0,
              "silu_mul takes contiguous float32 [..., 2 * I]");
  const int64_t width = x.size(-1) / 2, rows = x.numel() / (2 * width);
  auto sizes = x.sizes().vec();
  sizes.back() = width;
  auto out = torch::empty(sizes, x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * 2 * width;
      const float* up = gate + width;
      float* target = o + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        target[i] = silu(gate[i]) * up[i];
      }
    }
  });
  return out;
}

void rotate_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && cos.dtype() == torch::kFloat32 &&
                  sin.dtype() == torch::kFloat32, "rotate_ takes float32");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotate_ takes [T, heads, D] with contiguous heads in each row");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * half &&
                  sin.numel() == tokens * half, "rotate_: cos and sin are [T, D / 2]");
  float* data = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    tokenmill::rotate_rows(data, begin, end, stride, heads, half, c, s);
  });
}

// The first index in [0, n) where row[i] == value, 64 values at a time (a row's first
// NaN instead where it has one: rare, a plain scan).
int64_t first_equal(const float* row, int64_t n, float value, bool nan) {
  if (nan) {
    for (int64_t i = 0; i < n; ++i)
      if (row[i] != row[i]) return i;
  }
  constexpr int64_t kChunk = 64;
  int64_t start = 0;
  for (; start + kChunk <= n; start += kChunk) {
    int hits[kChunk];
#pragma omp simd
    for (int64_t l = 0; l < kChunk; ++l) hits[l] = row[start + l] == value;
    int hit = 0;
    for (int64_t l = 0; l < kChunk; ++l) hit |= hits[l];
    if (hit) break;
  }
  for (int64_t i = start; i < n; ++i)
    if (row[i] == value) return i;
  return n;
}

// A run of a row's values: its maximum, whether it holds a NaN, and the first index of
// its first NaN (if any) or else of its maximum.
struct Found {
  float top;
  int nan;
  int64_t first;
};

Found scan(const float* row, int64_t n) {
  // kLanes running maxima (independent chains the compiler keeps in vectors), folded at
  // the end; NaNs noted on the way.
  constexpr int64_t kLanes = 32;
  float tops[kLanes];
  int nans[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) tops[l] = -INFINITY, nans[l] = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = row[i + l];
      tops[l] = v > tops[l] ? v : tops[l];
      nans[l] |= v != v;
    }
  }
  float top = -INFINITY;
  int nan = 0;
  for (; i < n; ++i) top = row[i] > top ? row[i] : top, nan |= row[i] != row[i];
  for (int64_t l = 0; l < kLanes; ++l) top = tops[l] > top ? tops[l] : top, nan |= nans[l];
  return {top, nan, first_equal(row, n, top, nan)};
}

// Rows this long, fewer than the threads, are scanned in one piece per thread: a
// one-row step's 151936 logits, just written by the LM head's two threads and pushed
// out of the caches by its weight stream, took a median 131-165 us to scan on one core,
// 107-136 in two pieces (18-19 and 12-15 us in cache; bench_argmax.py --after-head).
constexpr int64_t kSplitLength = 1 << 15;

torch::Tensor argmax(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() &&
              x.size(1) > 0, "argmax takes contiguous float32 [rows, n > 0]");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  const float* data = x.data_ptr<float>();
  int64_t* index = out.data_ptr<int64_t>();
  const int64_t threads = at::get_num_threads();
  const int64_t pieces = rows < threads && n >= kSplitLength ? (threads + rows - 1) / rows : 1;
  if (pieces == 1) {
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) index[r] = scan(data + r * n, n).first;
    });
    return out;
  }
  // Pieces of whole 32-value runs; a row's answer is its first piece with a NaN (when
  // any has one), else its first piece holding the row's maximum.
  const int64_t length = ((n + pieces - 1) / pieces + 31) & ~int64_t{31};
  std::vector<Found> found(rows * pieces);
  at::parallel_for(0, rows * pieces, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / pieces, start = std::min(n, item % pieces * length);
      const int64_t size = std::min(n, start + length) - start;
      Found f = size > 0 ? scan(data + r * n + start, size) : Found{-INFINITY, 0, 0};
      f.first += start;
      found[item] = f;
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    const Found* f = found.data() + r * pieces;
    float top = -INFINITY;
    int nan = 0;
    for (int64_t p = 0; p < pieces; ++p) top = std::max(top, f[p].top), nan |= f[p].nan;
    int64_t p = 0;
    while (p + 1 < pieces && (nan ? !f[p].nan : f[p].top != top)) ++p;
    index[r] = f[p].first;
  }
  return out;
}

torch::Tensor packed_rows(torch::Tensor packed, torch::Tensor ids) {
  TORCH_CHECK(packed.dtype() == torch::kFloat32 && packed.dim() == 3 && packed.is_contiguous(),
              "packed_rows takes a contiguous float32 packed weight [blocks, in, lanes]");
  TORCH_CHECK(ids.dtype() == torch::kInt64 && ids.dim() == 1 && ids.is_contiguous(),
              "packed_rows takes contiguous int64 row ids [T]");
  const int64_t lanes = packed.size(2), width = packed.size(1);
  const int64_t rows = packed.size(0) * lanes, count = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < rows, "packed_rows: row ", id[t], " is not in [0, ",
                rows, ")");
  auto out = torch::empty({count, width}, packed.options());
  const float* w = packed.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* source = w + id[t] / lanes * width * lanes + id[t] % lanes;
      float* target = o + t * width;
      for (int64_t k = 0; k < width; ++k) target[k] = source[k * lanes];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_rows", &packed_rows,
        "rows ids of a packed float32 weight [blocks, in, lanes] (row r: lane r % lanes)");
  m.def("argmax", &argmax, "each row's first index of its maximum (float32 [rows, n])");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row of x (float32)");
  m.def("add_rms_norm", &add_rms_norm, "residual + delta and its RMSNorm (float32)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [gate | up] rows (float32)");
  m.def("rotate_", &rotate_, "rotary embedding in place on [T, heads, D] (float32)");
  m.def("entry_points", [] {
    const tokenmill::entry::RmsNorm norm = &rms_norm_into;
    const tokenmill::entry::AddRmsNorm add_norm = &add_rms_norm_into;
    return std::map<std::string, int64_t>{
        {"rms_norm_into", tokenmill::entry::address(norm)},
        {"add_rms_norm_into", tokenmill::entry::address(add_norm)}};
  }, "the norms' C++ entry points by name (csrc/shared/entry_points.h)");
}
