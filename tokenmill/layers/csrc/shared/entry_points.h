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

// Each writes into `out` (contiguous, its shape checked), which the caller keeps from
// call to call: a tensor made after a weight's stream has flushed the caches costs ~10
// us of misses, more than a decode step's norm or short product.
//
// x [M, K] (contiguous) times a weight packed [blocks, K, 16], bias [blocks * 16] or
// none, into out [M, blocks * 16]; or silu(gate) * up of a [gate | up] weight into out
// [M, blocks * 8] (layers/csrc/f32_linear.cpp: f32_linear_into, f32_linear_silu_mul_into).
using Product = void (*)(const torch::Tensor& x, const torch::Tensor& packed,
                         const c10::optional<torch::Tensor>& bias, const torch::Tensor& out);
// RMSNorm of each row of x into out (layers/csrc/row_ops.cpp: rms_norm_into).
using RmsNorm = void (*)(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                         const torch::Tensor& out);
// residual + delta into total (which may be residual itself), its RMSNorm into out
// (row_ops.cpp: add_rms_norm_into).
using AddRmsNorm = void (*)(const torch::Tensor& residual, const torch::Tensor& delta,
                            const torch::Tensor& weight, double eps, const torch::Tensor& total,
                            const torch::Tensor& out);
// A decode step's attention from a layer's qkv projection (rotated in place): rotation,
// K/V write and paged decode into out [T, H Dh] (attention/csrc/paged_decode.cpp:
// rope_write_and_decode_into).
using QkvDecode = void (*)(const torch::Tensor& qkv, const torch::Tensor& cos,
                           const torch::Tensor& sin, const torch::Tensor& slots,
                           const torch::Tensor& keys, const torch::Tensor& values,
                           const torch::Tensor& tables, const torch::Tensor& lengths,
                           double scale, int64_t heads, const torch::Tensor& out);

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
