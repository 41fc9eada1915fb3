// A decode step's decoder layers in one call (model/decode_stack.py). Per layer the
// engine's Python path makes eight calls into compiled kernels (two norms, four
// products, the attention, the residual handling) with the interpreter's work between
// them; run after each product's weight stream has flushed the caches, that work cost
// more than the attention itself at a few rows. Here one loop makes the same calls:
// the kernels of the other modules, reached through the entry points they export
// (layers/csrc/shared/entry_points.h), with the same tensors in the same order, so the
// result is bit-identical to the layers' path:
//
//   x = norm(hidden)                    (the first layer; later ones add the last MLP
//                                        output first: add_rms_norm)
//   attn = qkv_decode(x Wqkv^T + b)     rotation, K/V write, paged decode
//   hidden, x = add_rms_norm(hidden, attn Wo^T + b)
//   pending = silu_mul(x Wgu^T + b) Wd^T + b
//   ... and at the end the final norm of hidden + pending.
#include <torch/extension.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "entry_points.h"

namespace {

using namespace tokenmill::entry;

struct Weight {
  torch::Tensor packed;
  c10::optional<torch::Tensor> bias;
  int64_t out_features;
};

struct Norm {
  torch::Tensor weight;
  double eps;
};

struct Layer {
  Norm input, post;
  Weight qkv, o, gate_up, down;
  int64_t heads;
  double scale;
  torch::Tensor keys, values;  // this layer's pools, set by set_pools
};

template <typename Fn>
Fn entry(const std::map<std::string, int64_t>& entries, const std::string& name) {
  const auto found = entries.find(name);
  TORCH_CHECK(found != entries.end(), "decode stack: no entry point named ", name);
  return from_address<Fn>(found->second);
}

class Stack {
 public:
  Stack(const std::map<std::string, int64_t>& entries, torch::Tensor final_norm,
        double final_eps)
      : linear_(entry<Product>(entries, "f32_linear")),
        linear_silu_mul_(entry<Product>(entries, "f32_linear_silu_mul")),
        norm_(entry<RmsNorm>(entries, "rms_norm")),
        add_norm_(entry<AddRmsNorm>(entries, "add_rms_norm")),
        final_{std::move(final_norm), final_eps} {}

  void add_layer(torch::Tensor input_norm, double input_eps, torch::Tensor post_norm,
                 double post_eps, int64_t heads, double scale, std::vector<torch::Tensor> packed,
                 std::vector<c10::optional<torch::Tensor>> biases,
                 std::vector<int64_t> out_features) {
    TORCH_CHECK(packed.size() == 4 && biases.size() == 4 && out_features.size() == 4,
                "decode stack: a layer has four products (qkv, o, gate/up, down)");
    Weight w[4];
    for (int i = 0; i < 4; ++i) w[i] = {packed[i], biases[i], out_features[i]};
    layers_.push_back({{std::move(input_norm), input_eps}, {std::move(post_norm), post_eps},
                       w[0], w[1], w[2], w[3], heads, scale, {}, {}});
  }

  void set_pools(std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values) {
    TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(),
                "decode stack: one key and one value pool per layer");
    for (size_t i = 0; i < layers_.size(); ++i) {
      layers_[i].keys = keys[i];
      layers_[i].values = values[i];
    }
  }

  // The final norm's output for hidden [T, width] (the embedded decode tokens), through
  // every layer, with `qkv_decode` (a QkvDecode entry point's address) as attention.
  torch::Tensor run(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin,
                    int64_t qkv_decode, torch::Tensor slots, torch::Tensor tables,
                    torch::Tensor lengths) const {
    TORCH_CHECK(!layers_.empty() && layers_[0].keys.defined(),
                "decode stack: no layers, or their pools were never set");
    const auto attend = from_address<QkvDecode>(qkv_decode);
    hidden = hidden.contiguous();
    torch::Tensor x, pending;
    for (const Layer& l : layers_) {
      if (!pending.defined()) {
        x = norm_(hidden, l.input.weight, l.input.eps);
      } else {
        auto sum = add_norm_(hidden, pending, l.input.weight, l.input.eps);
        hidden = std::move(sum[0]);
        x = std::move(sum[1]);
      }
      const auto qkv = call(linear_, x, l.qkv);
      const auto attended = attend(qkv, cos, sin, slots, l.keys, l.values, tables, lengths,
                                   l.scale, l.heads);
      auto sum = add_norm_(hidden, call(linear_, attended, l.o), l.post.weight, l.post.eps);
      hidden = std::move(sum[0]);
      pending = call(linear_, call(linear_silu_mul_, sum[1], l.gate_up), l.down);
    }
    return add_norm_(hidden, pending, final_.weight, final_.eps)[1];
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  static torch::Tensor call(Product fn, const torch::Tensor& x, const Weight& w) {
    return fn(x, w.packed, w.bias, w.out_features);
  }

  Product linear_, linear_silu_mul_;
  RmsNorm norm_;
  AddRmsNorm add_norm_;
  Norm final_;
  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Stack>(m, "Stack")
      .def(pybind11::init<const std::map<std::string, int64_t>&, torch::Tensor, double>(),
           "entry points by name (products and norms), the final norm's weight and eps")
      .def("add_layer", &Stack::add_layer,
           "a layer's norms, heads, scale and its four packed products")
      .def("set_pools", &Stack::set_pools, "every layer's key and value pools")
      .def("run", &Stack::run, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "the final norm's output after every layer, for a decode-only step")
      .def_property_readonly("num_layers", &Stack::num_layers);
}
