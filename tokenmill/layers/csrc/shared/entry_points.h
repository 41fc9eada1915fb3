// The C++ entry points kernels hand to one another (model/csrc/decode_stack.cpp calls
// the product, norm and attention kernels of other modules in one loop, without
// Python between them). Each kernel module exports its functions' addresses by name
// (`entry_points()`), each assigned to one of these types in the exporting file, so a
// signature that drifts from its type fails to compile there, not at a call.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace tokenmill::entry {

// x [M, K] times a weight packed [blocks, K, 16], bias [blocks * 16] or none, N outputs
// (layers/csrc/f32_linear.cpp: f32_linear and f32_linear_silu_mul).
using Product = torch::Tensor (*)(torch::Tensor x, torch::Tensor packed,
                                  c10::optional<torch::Tensor> bias, int64_t out_features);
// RMSNorm of each row (layers/csrc/row_ops.cpp: rms_norm).
using RmsNorm = torch::Tensor (*)(torch::Tensor x, torch::Tensor weight, double eps);
// {residual + delta, its RMSNorm} (row_ops.cpp: add_rms_norm).
using AddRmsNorm = std::vector<torch::Tensor> (*)(torch::Tensor residual, torch::Tensor delta,
                                                  torch::Tensor weight, double eps);
// A decode step's attention from a layer's qkv projection: rotation, K/V write and paged
// decode (attention/csrc/paged_decode.cpp: rope_write_and_decode).
using QkvDecode = torch::Tensor (*)(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                    torch::Tensor slots, torch::Tensor keys,
                                    torch::Tensor values, torch::Tensor tables,
                                    torch::Tensor lengths, double scale, int64_t heads);

template <typename Fn>
int64_t address(Fn fn) {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(fn));
}

template <typename Fn>
Fn from_address(int64_t address) {
  TORCH_CHECK(address != 0, "a null kernel entry point");
  return reinterpret_cast<Fn>(static_cast<intptr_t>(address));
}

}  // namespace tokenmill::entry
