// Weight-only quantized products on the CPU: y = x W^T + b with W stored as int8 or
// 4-bit codes and float32 scales (and offsets) per group of input columns.
//
// Layout (tokenmill/quant/packing.py writes it): output channels in blocks of 16 lanes;
// for block b, column k holds the 16 lanes' codes side by side, so a product reads
// each block as one contiguous stream and a vector of 16 lanes needs no shuffles:
//   int8  codes [blocks][K][16]      int8, w = code * scale
//   int4  codes [blocks][K / 2][16]  uint8, low nibble column 2c, high nibble 2c + 1,
//                                    w = code * scale + offset
//   scales, offsets [blocks][K / group][16] float32
// Activations stay float32 (W8A32 / W4A32): codes are widened and scaled in
// registers, so the result equals a product with the dequantized float32 weight up to
// the order of the sums. GCC vector types keep it portable: a block's 16 lanes are one
// AVX-512 register, or two 8-lane halves (AVX2 registers) without AVX-512 -- a 64-byte
// GCC vector there is split through memory, which measured these products 6-10x
// slower under `--isa avx2` (docs/BENCHMARKS.md), as it did the float32 kernel.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;  // a block's output channels: the packed layout on every CPU
#if defined(__AVX512F__)
constexpr int kVec = 16;
constexpr int kRowTile = 8;  // 32 vector registers: 8 accumulators and the rest
#else
constexpr int kVec = 8;
constexpr int kRowTile = 6;  // 16 registers: 6 x 2 accumulator halves, 2 weight halves, x
#endif
constexpr int kParts = kLanes / kVec;
typedef float vf __attribute__((vector_size(kVec * sizeof(float))));

// A block's 16 lanes as kParts register-sized vectors; the arithmetic runs per part.
struct Lanes {
  vf part[kParts];
  Lanes& operator+=(const Lanes& o) {
    for (int i = 0; i < kParts; ++i) part[i] += o.part[i];
    return *this;
  }
};
inline Lanes operator+(Lanes a, const Lanes& b) { return a += b; }
inline Lanes operator*(const Lanes& a, const Lanes& b) {
  Lanes r;
  for (int i = 0; i < kParts; ++i) r.part[i] = a.part[i] * b.part[i];
  return r;
}
inline Lanes operator*(float s, const Lanes& a) {
  Lanes r;
  for (int i = 0; i < kParts; ++i) r.part[i] = s * a.part[i];
  return r;
}
inline Lanes operator*(const Lanes& a, float s) { return s * a; }

inline Lanes load(const float* p) { Lanes v; std::memcpy(&v, p, sizeof v); return v; }

// Widening 16 codes to 16 floats. GCC turns __builtin_convertvector from bytes into
// scalar code on AVX2 (and from int8 even on AVX-512), so the widening is spelled
// out per instruction set; only the float arithmetic is left to the vector types.
#if defined(__AVX512F__)
inline Lanes bytes_to_float(__m128i b, bool is_signed) {
  const __m512i wide = is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  return Lanes{{(vf)_mm512_cvtepi32_ps(wide)}};
}
#endif

inline Lanes widen_int8(const int8_t* p) {
#if defined(__AVX512F__)
  return bytes_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), true);
#elif defined(__AVX2__)
  // Each half sign-extended straight from memory (no load and byte shift first).
  const auto half = [](const int8_t* q) {
    return (vf)_mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  };
  return Lanes{{half(p), half(p + 8)}};
#else
  float v[kLanes];
  for (int i = 0; i < kLanes; ++i) v[i] = p[i];
  return load(v);
#endif
}

inline void widen_int4(const uint8_t* p, Lanes& low, Lanes& high) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  // Eight bytes at a time zero-extended straight from memory to 32 bits, then split
  // into nibbles there (fewer shuffles than splitting the bytes first).
  const __m256i mask = _mm256_set1_epi32(15);
  for (int i = 0; i < kParts; ++i) {
    const __m256i wide = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i * kVec)));
    low.part[i] = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(wide, mask));
    high.part[i] = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4));
  }
#elif defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  low = bytes_to_float(_mm_and_si128(b, mask), false);
  high = bytes_to_float(_mm_and_si128(_mm_srli_epi16(b, 4), mask), false);
#else
  float l[kLanes], h[kLanes];
  for (int i = 0; i < kLanes; ++i) {
    l[i] = p[i] & 15;
    h[i] = p[i] >> 4;
  }
  low = load(l);
  high = load(h);
#endif
}

struct Problem {
  const float* x;  // [M][K]
  const uint8_t* codes;
  const float* scales;
  const float* offsets;  // int4 only
  const float* bias;     // [N] or null
  float* out;            // [M][N]
  int64_t M, N, K, group;
  const float* group_sums;  // [M][K / group]: x summed over each group (int4 only)
};

inline int64_t lanes_of(const Problem& p, int64_t b) {
  return std::min<int64_t>(kLanes, p.N - b * kLanes);
}

inline Lanes bias_of(const Problem& p, int64_t b) {
  float tmp[kLanes] = {};
  if (p.bias) std::memcpy(tmp, p.bias + b * kLanes, lanes_of(p, b) * sizeof(float));
  return load(tmp);
}

inline void store_row(const Problem& p, int64_t b, int64_t m, const Lanes& v) {
  float tmp[kLanes];
  std::memcpy(tmp, &v, sizeof tmp);
  std::memcpy(p.out + m * p.N + b * kLanes, tmp, lanes_of(p, b) * sizeof(float));
}

// One row (decode at batch 1): the product streams the weight once and is bound by
// how fast codes are widened, so each group's codes are summed unscaled into four
// independent accumulators (an FMA's latency spans four issues) and scaled once at
// the group's end: int4 adds offset * (the group's sum of x) there. In 8-lane halves
// four accumulators are eight registers already, so the third and fourth column add
// into the first two: eight would not fit 16 registers beside the widened codes, and
// GCC kept two of them on the stack (int4 at half the speed).
template <bool INT4>
void one_row(const Problem& p, int64_t b) {
  Lanes acc = bias_of(p, b);
  const int64_t groups = p.K / p.group;
  const float* x = p.x;
  for (int64_t g = 0; g < groups; ++g) {
    const Lanes scale = load(p.scales + (b * groups + g) * kLanes);
    const int64_t k0 = g * p.group, k1 = k0 + p.group;
    Lanes a{}, c{}, d_own{}, e_own{};
    Lanes& d = kParts == 1 ? d_own : a;
    Lanes& e = kParts == 1 ? e_own : c;
    int64_t k = k0;
    if constexpr (INT4) {
      const uint8_t* codes = p.codes + (b * (p.K / 2) + k0 / 2) * kLanes;
      for (; k + 4 <= k1; k += 4, codes += 2 * kLanes) {
        Lanes l0, h0, l1, h1;
        widen_int4(codes, l0, h0);
        widen_int4(codes + kLanes, l1, h1);
        a += x[k] * l0;
        c += x[k + 1] * h0;
        d += x[k + 2] * l1;
        e += x[k + 3] * h1;
      }
      for (; k < k1; k += 2, codes += kLanes) {
        Lanes l0, h0;
        widen_int4(codes, l0, h0);
        a += x[k] * l0;
        c += x[k + 1] * h0;
      }
      const Lanes offset = load(p.offsets + (b * groups + g) * kLanes);
      acc += ((a + c) + (d_own + e_own)) * scale + offset * p.group_sums[g];
    } else {
      const int8_t* codes = reinterpret_cast<const int8_t*>(p.codes) + (b * p.K + k0) * kLanes;
      for (; k + 4 <= k1; k += 4, codes += 4 * kLanes) {
        a += x[k] * widen_int8(codes);
        c += x[k + 1] * widen_int8(codes + kLanes);
        d += x[k + 2] * widen_int8(codes + 2 * kLanes);
        e += x[k + 3] * widen_int8(codes + 3 * kLanes);
      }
      for (; k < k1; ++k, codes += kLanes) a += x[k] * widen_int8(codes);
      acc += ((a + c) + (d_own + e_own)) * scale;
    }
  }
  store_row(p, b, 0, acc);
}

// Rows [m0, m0 + MR) of output block b: each column's codes are dequantized once in
// registers and used by all MR rows. The accumulators are a plain array of vectors
// (an array of Lanes made GCC store every one of them back to the stack each column).
template <int MR, bool INT4>
void tile(const Problem& p, int64_t b, int64_t m0) {
  vf acc[MR][kParts];
  const Lanes init = bias_of(p, b);
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < kParts; ++i) acc[m][i] = init.part[i];
  const int64_t groups = p.K / p.group;
  const float* x = p.x + m0 * p.K;
  for (int64_t g = 0; g < groups; ++g) {
    const Lanes scale = load(p.scales + (b * groups + g) * kLanes);
    const int64_t k0 = g * p.group, k1 = k0 + p.group;
    if constexpr (INT4) {
      const Lanes offset = load(p.offsets + (b * groups + g) * kLanes);
      const uint8_t* codes = p.codes + (b * (p.K / 2) + k0 / 2) * kLanes;
      // Codes times x summed unscaled, then scale * that + offset * (x's sum over
      // the group) at the group's end, as one_row does: no multiply per column. The
      // sums live in an array local to the group: summed into acc directly, across
      // the group loop, GCC kept acc in memory and stored every accumulator each
      // column (under AVX2 a 6-row int8 tile issued 12 stores per 12 multiply-adds).
      vf sum[MR][kParts] = {};
      for (int64_t k = k0; k < k1; k += 2, codes += kLanes) {
        Lanes low, high;
        widen_int4(codes, low, high);
        for (int m = 0; m < MR; ++m) {
          const float x0 = x[m * p.K + k], x1 = x[m * p.K + k + 1];
          for (int i = 0; i < kParts; ++i) {
            sum[m][i] += x0 * low.part[i];
            sum[m][i] += x1 * high.part[i];
          }
        }
      }
      for (int m = 0; m < MR; ++m)
        for (int i = 0; i < kParts; ++i)
          acc[m][i] += sum[m][i] * scale.part[i] +
                       p.group_sums[(m0 + m) * groups + g] * offset.part[i];
    } else {
      const int8_t* codes = reinterpret_cast<const int8_t*>(p.codes) + (b * p.K + k0) * kLanes;
      // As for int4: summed unscaled in a local array, scaled at the group's end.
      vf sum[MR][kParts] = {};
      for (int64_t k = k0; k < k1; ++k, codes += kLanes) {
        const Lanes w = widen_int8(codes);
        for (int m = 0; m < MR; ++m) {
          const float xm = x[m * p.K + k];
          for (int i = 0; i < kParts; ++i) sum[m][i] += xm * w.part[i];
        }
      }
      for (int m = 0; m < MR; ++m)
        for (int i = 0; i < kParts; ++i) acc[m][i] += sum[m][i] * scale.part[i];
    }
  }
  for (int m = 0; m < MR; ++m) {
    Lanes row;
    for (int i = 0; i < kParts; ++i) row.part[i] = acc[m][i];
    store_row(p, b, m0 + m, row);
  }
}

template <bool INT4, int MR>
void rows_tail(const Problem& p, int64_t b, int64_t m0, int64_t rows) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile<MR, INT4>(p, b, m0);
    rows_tail<INT4, MR - 1>(p, b, m0, rows);
  }
}

template <bool INT4>
void run(const Problem& p) {
  const int64_t blocks = (p.N + kLanes - 1) / kLanes;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (p.M == 1) {
        one_row<INT4>(p, b);
        continue;
      }
      // Row tiles of even sizes (8 rows under AVX2: 4 + 4, not 6 + 2): a small tail
      // tile has too few accumulators to cover the multiply-add latency.
      const int64_t tiles = (p.M + kRowTile - 1) / kRowTile;
      for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
        const int64_t size = p.M / tiles + (t < p.M % tiles);
        rows_tail<INT4, kRowTile>(p, b, m0, size);
        m0 += size;
      }
    }
  });
}

torch::Tensor quantized_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                               c10::optional<torch::Tensor> offsets,
                               c10::optional<torch::Tensor> bias, int64_t out_features,
                               int64_t group_size, bool int4) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % group_size == 0 && (!int4 || group_size % 2 == 0), "bad group size");
  auto out = torch::empty({M, out_features}, x.options());
  Problem p{x.data_ptr<float>(), static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(),
            int4 ? offsets->data_ptr<float>() : nullptr,
            bias && bias->defined() ? bias->data_ptr<float>() : nullptr,
            out.data_ptr<float>(), M, out_features, K, group_size, nullptr};
  torch::Tensor group_sums;
  if (int4) {
    group_sums = x.view({M, K / group_size, group_size}).sum(2).contiguous();
    p.group_sums = group_sums.data_ptr<float>();
  }
  if (int4) run<true>(p); else run<false>(p);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantized_linear", &quantized_linear,
        "x [M, K] float32 times a packed int8 / int4 weight (see qlinear.cpp)");
}
