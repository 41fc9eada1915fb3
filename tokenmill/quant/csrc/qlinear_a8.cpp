// Quantized products with int8 activations (W8A8 / W4A8), on AVX-512 VNNI integer dot
// products: y = x W^T + b, where each row of x is first quantized per 32 columns
// (scale = max |x| / 127, codes round(x / scale)) and W is packed as for qlinear.cpp
// (blocks of 16 output lanes, column k's 16 codes side by side; int4 two columns per
// byte). Integer sums are exact, so the result equals x' W'^T + b in float32 up to the
// order of the float sums, where x' is the dequantized activation and W' the
// dequantized weight (quant/kernels.py, quantize_activations, is that reference).
//
// Why: widening codes to float costs ~3 instructions per 16 weights (qlinear.cpp), so
// one-row decode is bound by instructions, not bytes. vpdpbusd multiplies 64 byte
// pairs and sums them in fours into 16 int32 lanes in one instruction; the block
// layout's 4 columns x 16 lanes become 16 lanes x 4 columns with one vpermb.
//   int8: vpdpbusd takes one unsigned operand: the codes w + 128 (w XOR 0x80), and
//         128 * (the chunk's sum of activation codes) is taken off afterwards.
//   int4: codes 0..15 are already unsigned; the low nibbles hold even columns and
//         the high nibbles odd ones, so the activation codes are laid out per 8
//         columns as [x0 x2 x4 x6][x1 x3 x5 x7]; the offset term uses the sum of the
//         dequantized activations over each weight group.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

namespace {

constexpr int kLanes = 16;
constexpr int kChunk = 32;  // activation columns per scale

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
constexpr bool kSupported = true;
constexpr int kRowTile = 6;  // int32 sum, group sum and total per row in 32 registers

// One row's activations, quantized.
struct Row {
  const int8_t* codes;    // [K] (int4: reordered per 8 columns, see above)
  const float* scales;    // [K / 32]
  const int32_t* sums;    // [K / 32] sum of the codes
  const float* group_x;   // [K / group] sum of the dequantized activations (int4)
};

struct Problem {
  const uint8_t* codes;
  const float* scales;
  const float* offsets;  // int4 only
  const float* bias;     // [N] or null
  float* out;            // [M][N]
  int64_t M, N, K, group;
  std::vector<Row> rows;
};

// vpermb index: byte 4j + i of the result is byte 16i + j of the block's 64 bytes
// (column i of lane j), so each int32 lane holds its output channel's 4 columns.
inline __m512i transpose_index() {
  alignas(64) int8_t index[64];
  for (int j = 0; j < kLanes; ++j)
    for (int i = 0; i < 4; ++i) index[4 * j + i] = static_cast<int8_t>(16 * i + j);
  return _mm512_load_si512(index);
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline int64_t lanes_of(const Problem& p, int64_t b) {
  return std::min<int64_t>(kLanes, p.N - b * kLanes);
}

// Rows [m0, m0 + MR) of output block b.
template <int MR, bool INT4>
void tile(const Problem& p, int64_t b, int64_t m0) {
  const __m512i index = transpose_index();
  const __m512i nibble = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(-128);
  const int64_t groups = p.K / p.group, chunks = p.group / kChunk;
  __m512 total[MR];
  for (int m = 0; m < MR; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 group_sum[MR];
    for (int m = 0; m < MR; ++m) group_sum[m] = _mm512_setzero_ps();
    for (int64_t c = g * chunks; c < (g + 1) * chunks; ++c) {
      const int64_t k0 = c * kChunk;
      // Few rows: two sums per row, so consecutive dot products do not wait on
      // each other's latency; more rows interleave their own chains.
      constexpr bool kSplit = MR < 4;
      __m512i sum[MR], alt[MR];
      for (int m = 0; m < MR; ++m) sum[m] = alt[m] = _mm512_setzero_si512();
      if constexpr (INT4) {
        const uint8_t* codes = p.codes + (b * (p.K / 2) + k0 / 2) * kLanes;
        for (int step = 0; step < kChunk / 8; ++step, codes += 64) {
          const __m512i bytes = _mm512_permutexvar_epi8(index, _mm512_loadu_si512(codes));
          const __m512i low = _mm512_and_si512(bytes, nibble);
          const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
          for (int m = 0; m < MR; ++m) {
            const int8_t* x = p.rows[m0 + m].codes + k0 + 8 * step;
            sum[m] = _mm512_dpbusd_epi32(sum[m], low, broadcast4(x));
            __m512i& second = kSplit ? alt[m] : sum[m];
            second = _mm512_dpbusd_epi32(second, high, broadcast4(x + 4));
          }
        }
      } else {
        const uint8_t* codes = p.codes + (b * p.K + k0) * kLanes;
        for (int step = 0; step < kChunk / 4; ++step, codes += 64) {
          const __m512i w = _mm512_xor_si512(
              _mm512_permutexvar_epi8(index, _mm512_loadu_si512(codes)), flip);
          for (int m = 0; m < MR; ++m) {
            __m512i& target = (kSplit && (step & 1)) ? alt[m] : sum[m];
            target = _mm512_dpbusd_epi32(target, w,
                                         broadcast4(p.rows[m0 + m].codes + k0 + 4 * step));
          }
        }
      }
      for (int m = 0; m < MR; ++m) {
        const Row& row = p.rows[m0 + m];
        __m512i exact = kSplit ? _mm512_add_epi32(sum[m], alt[m]) : sum[m];
        if constexpr (!INT4) exact = _mm512_sub_epi32(exact, _mm512_set1_epi32(128 * row.sums[c]));
        group_sum[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact),
                                       _mm512_set1_ps(row.scales[c]), group_sum[m]);
      }
    }
    const __m512 scale = _mm512_loadu_ps(p.scales + (b * groups + g) * kLanes);
    for (int m = 0; m < MR; ++m) total[m] = _mm512_fmadd_ps(group_sum[m], scale, total[m]);
    if constexpr (INT4) {
      const __m512 offset = _mm512_loadu_ps(p.offsets + (b * groups + g) * kLanes);
      for (int m = 0; m < MR; ++m)
        total[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(p.rows[m0 + m].group_x[g]), total[m]);
    }
  }
  const int64_t lanes = lanes_of(p, b);
  const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
  const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + b * kLanes)
                             : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m)
    _mm512_mask_storeu_ps(p.out + (m0 + m) * p.N + b * kLanes, mask,
                          _mm512_add_ps(total[m], bias));
}

template <bool INT4, int MR>
void rows_tail(const Problem& p, int64_t b, int64_t m0, int64_t rows) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile<MR, INT4>(p, b, m0);
    rows_tail<INT4, MR - 1>(p, b, m0, rows);
  }
}

// Quantizes row x [K] into codes (int4: reordered), scales, code sums and, for int4,
// each weight group's sum of the dequantized activations.
void quantize_row(const float* x, int64_t K, int64_t group, bool int4, int8_t* codes,
                  float* scales, int32_t* sums, float* group_x) {
  int8_t natural[kChunk];
  for (int64_t c = 0; c < K / kChunk; ++c) {
    const float* xc = x + c * kChunk;
    const __m512 a = _mm512_loadu_ps(xc), b = _mm512_loadu_ps(xc + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 inv = _mm512_set1_ps(inverse);
    // Round to nearest even (the default rounding mode), as torch.round does.
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(natural), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(natural + 16), _mm512_cvtsepi32_epi8(qb));
    scales[c] = amax / 127.0f;
    sums[c] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    int8_t* out = codes + c * kChunk;
    if (int4) {
      for (int e = 0; e < kChunk; e += 8)
        for (int i = 0; i < 4; ++i) {
          out[e + i] = natural[e + 2 * i];
          out[e + 4 + i] = natural[e + 2 * i + 1];
        }
    } else {
      std::memcpy(out, natural, kChunk);
    }
  }
  if (int4) {
    const int64_t chunks = group / kChunk;
    for (int64_t g = 0; g < K / group; ++g) {
      float s = 0.0f;
      for (int64_t c = g * chunks; c < (g + 1) * chunks; ++c) s += scales[c] * sums[c];
      group_x[g] = s;
    }
  }
}
#else
constexpr bool kSupported = false;
#endif

torch::Tensor quantized_linear_a8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                  c10::optional<torch::Tensor> offsets,
                                  c10::optional<torch::Tensor> bias, int64_t out_features,
                                  int64_t group_size, bool int4) {
  TORCH_CHECK(kSupported, "this CPU has no AVX-512 VNNI + VBMI: int8 activations unavailable");
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kChunk == 0 && group_size % kChunk == 0 && K % group_size == 0,
              "int8 activations need input columns and group size in multiples of 32");
  auto out = torch::empty({M, out_features}, x.options());
  const int64_t chunks = K / kChunk, groups = K / group_size;
  std::vector<int8_t> row_codes(M * K);
  std::vector<float> row_scales(M * chunks), group_x(M * groups);
  std::vector<int32_t> row_sums(M * chunks);
  const float* xd = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(xd + m * K, K, group_size, int4, row_codes.data() + m * K,
                   row_scales.data() + m * chunks, row_sums.data() + m * chunks,
                   group_x.data() + m * groups);
  });
  Problem p{static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(),
            int4 ? offsets->data_ptr<float>() : nullptr,
            bias && bias->defined() ? bias->data_ptr<float>() : nullptr,
            out.data_ptr<float>(), M, out_features, K, group_size, {}};
  p.rows.reserve(M);
  for (int64_t m = 0; m < M; ++m)
    p.rows.push_back({row_codes.data() + m * K, row_scales.data() + m * chunks,
                      row_sums.data() + m * chunks, group_x.data() + m * groups});
  const int64_t blocks = (out_features + kLanes - 1) / kLanes;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      int64_t m0 = 0;
      for (; m0 + kRowTile <= M; m0 += kRowTile) {
        if (int4) tile<kRowTile, true>(p, b, m0); else tile<kRowTile, false>(p, b, m0);
      }
      if (m0 < M) {
        if (int4) rows_tail<true, kRowTile - 1>(p, b, m0, M - m0);
        else rows_tail<false, kRowTile - 1>(p, b, m0, M - m0);
      }
    }
  });
  return out;
#else
  return x;
#endif
}

bool supported() { return kSupported; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantized_linear_a8", &quantized_linear_a8,
        "x [M, K] float32, quantized per 32 columns to int8, times a packed int8 / int4 "
        "weight (see qlinear_a8.cpp)");
  m.def("supported", &supported, "whether this build has the VNNI kernels");
}
