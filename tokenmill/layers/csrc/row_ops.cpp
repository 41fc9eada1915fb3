// Per-row operators a decode step calls dozens of times, each one compiled call instead
// of several torch operators (~5 µs of dispatch each on these CPUs), float32:
//
//   rms_norm  out = weight * (x * 1 / sqrt(mean(x^2) + eps)) per row (layers/norm.py).
//             The torch form's arithmetic (the two products in the same order, 1 / sqrt
//             as torch's rsqrt computes it on the CPU); only the order of the mean's
//             additions differs, which moves a result by an ulp or two.
//   rotate_   rotary embedding in place on [T, heads, D] (rows may be strided: Q and K
//             sit side by side in the fused QKV output): for each half pair,
//             x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, rounded exactly as the
//             torch form rounds them (built without contracting into FMAs), so the
//             result is bit-identical to layers/rotary.py's apply_rotary.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32,
              "rms_norm takes float32");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm takes contiguous tensors");
  const int64_t width = weight.numel();
  TORCH_CHECK(x.size(-1) == width, "rms_norm: the last dimension must match the weight");
  const int64_t rows = x.numel() / width;
  auto out = torch::empty_like(x);
  const float* in = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in + r * width;
      float* target = o + r * width;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < width; ++i) sum += row[i] * row[i];
      const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(width) + e);
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) target[i] = w[i] * (row[i] * inverse);
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
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = data + t * stride + h * 2 * half;
        float* x2 = x1 + half;
        const float* ct = c + t * half;
        const float* st = s + t * half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          const float a_cos = a * ct[i], b_sin = b * st[i];
          const float b_cos = b * ct[i], a_sin = a * st[i];
          x1[i] = a_cos - b_sin;
          x2[i] = b_cos + a_sin;
        }
      }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row of x (float32)");
  m.def("rotate_", &rotate_, "rotary embedding in place on [T, heads, D] (float32)");
}
