// One decode step's products timed call by call from C++ (no Python between them): the
// native kernel's entry points (layers/csrc/shared/entry_points.h) over a list of
// packed weights, each product's seconds recorded
// (benchmarks/bench_product_kinds.py sums them by kind).
#include <torch/extension.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "entry_points.h"

// Seconds [passes, weights]: weight i multiplied by xs[i] into outs[i], the fused
// activation's entry point where fused[i].
torch::Tensor product_pass(int64_t linear_into, int64_t silu_mul_into,
                           std::vector<torch::Tensor> weights, std::vector<bool> fused,
                           std::vector<torch::Tensor> xs, std::vector<torch::Tensor> outs,
                           int64_t passes) {
  using tokenmill::entry::Product;
  const auto linear = tokenmill::entry::from_address<Product>(linear_into);
  const auto silu_mul = tokenmill::entry::from_address<Product>(silu_mul_into);
  const int64_t n = static_cast<int64_t>(weights.size());
  TORCH_CHECK(static_cast<int64_t>(fused.size()) == n && static_cast<int64_t>(xs.size()) == n &&
                  static_cast<int64_t>(outs.size()) == n,
              "one x, output and kind per weight");
  auto seconds = torch::zeros({passes, n}, torch::kFloat64);
  double* s = seconds.data_ptr<double>();
  const c10::optional<torch::Tensor> none;
  for (int64_t p = 0; p < passes; ++p) {
    for (int64_t i = 0; i < n; ++i) {
      const auto started = std::chrono::steady_clock::now();
      (fused[i] ? silu_mul : linear)(xs[i], weights[i], none, outs[i]);
      s[p * n + i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - started)
                         .count();
    }
  }
  return seconds;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("product_pass", &product_pass, "seconds per product per pass [passes, weights]");
}
