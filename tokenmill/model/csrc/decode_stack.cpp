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
//
// Each kernel writes into a buffer the stack keeps from step to step (one per
// activation, all layers sharing them; made again when the row count changes): a
// tensor made after a weight's stream has flushed the caches costs ~10 us of misses
// (the allocator's and the dispatcher's lines), and the kernels that return their
// outputs made ~250 a step, 1-3% of a one-row step on the 0.5B shape
// (benchmarks/bench_whole_decode.py's "fresh tensors").
#include <torch/extension.h>

#include <array>
#include <chrono>
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
      : linear_(entry<Product>(entries, "f32_linear_into")),
        linear_silu_mul_(entry<Product>(entries, "f32_linear_silu_mul_into")),
        norm_(entry<RmsNorm>(entries, "rms_norm_into")),
        add_norm_(entry<AddRmsNorm>(entries, "add_rms_norm_into")),
        final_{std::move(final_norm), final_eps} {}

  void add_layer(torch::Tensor input_norm, double input_eps, torch::Tensor post_norm,
                 double post_eps, int64_t heads, double scale, std::vector<torch::Tensor> packed,
                 std::vector<c10::optional<torch::Tensor>> biases,
                 std::vector<int64_t> out_features) {
    TORCH_CHECK(packed.size() == 4 && biases.size() == 4 && out_features.size() == 4,
                "decode stack: a layer has four products (qkv, o, gate/up, down)");
    Weight w[4];
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(packed[i].dim() == 3 && out_features[i] == packed[i].size(0) * packed[i].size(2),
                  "decode stack: a product's outputs must fill its packed blocks");
      w[i] = {packed[i], biases[i], out_features[i]};
    }
    if (!layers_.empty()) {  // one set of buffers serves every layer
      const Layer& first = layers_[0];
      const Weight* same[4] = {&first.qkv, &first.o, &first.gate_up, &first.down};
      for (int i = 0; i < 4; ++i)
        TORCH_CHECK(packed[i].sizes() == same[i]->packed.sizes(),
                    "decode stack: every layer must have the first one's shapes");
    }
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
                    torch::Tensor lengths) {
    TORCH_CHECK(!layers_.empty() && layers_[0].keys.defined(),
                "decode stack: no layers, or their pools were never set");
    TORCH_CHECK(hidden.dtype() == torch::kFloat32 && hidden.dim() == 2 &&
                    hidden.size(1) == layers_[0].input.weight.numel(),
                "decode stack: hidden must be float32 [T, ", layers_[0].input.weight.numel(), "]");
    const auto attend = from_address<QkvDecode>(qkv_decode);
    const int64_t rows = hidden.size(0);
    Buffers b = buffers(rows);
    b.residual.copy_(hidden);
    // `fresh`: every output a new tensor, as kernels that return theirs make them (A/Bs).
    const auto fresh = [&](std::initializer_list<torch::Tensor*> outputs) {
      if (fresh_)
        for (torch::Tensor* t : outputs) *t = torch::empty_like(*t);
    };
    cos = cos.contiguous();
    sin = sin.contiguous();
    // `timed`: each operation's seconds added to spent_ (bench_step_overhead.py --ops).
    using Clock = std::chrono::steady_clock;
    auto mark = timed_ ? Clock::now() : Clock::time_point{};
    const auto lap = [&](Op op) {
      if (!timed_) return;
      const auto now = Clock::now();
      spent_[op] += std::chrono::duration<double>(now - mark).count();
      mark = now;
    };
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      if (i == 0) {
        fresh({&b.x});
        norm_(b.residual, l.input.weight, l.input.eps, b.x);
      } else {
        const torch::Tensor residual = b.residual;
        fresh({&b.residual, &b.x});
        add_norm_(residual, b.down, l.input.weight, l.input.eps, b.residual, b.x);
      }
      lap(kNorms);
      fresh({&b.qkv});
      linear_(b.x, l.qkv.packed, l.qkv.bias, b.qkv);
      lap(kQkv);
      fresh({&b.attended});
      attend(b.qkv, cos, sin, slots, l.keys, l.values, tables, lengths, l.scale, l.heads,
             b.attended);
      lap(kAttention);
      fresh({&b.o});
      linear_(b.attended, l.o.packed, l.o.bias, b.o);
      lap(kO);
      const torch::Tensor residual = b.residual;
      fresh({&b.residual, &b.x});
      add_norm_(residual, b.o, l.post.weight, l.post.eps, b.residual, b.x);
      lap(kNorms);
      fresh({&b.act});
      linear_silu_mul_(b.x, l.gate_up.packed, l.gate_up.bias, b.act);
      lap(kGateUp);
      fresh({&b.down});
      linear_(b.act, l.down.packed, l.down.bias, b.down);
      lap(kDown);
    }
    auto out = torch::empty_like(b.residual);
    add_norm_(b.residual, b.down, final_.weight, final_.eps, b.residual, out);
    lap(kNorms);
    return out;
  }

  void set_timed(bool on) { timed_ = on; }
  bool timed() const { return timed_; }

  // Seconds spent per operation while `timed` (since the last reset), by name.
  std::map<std::string, double> spent(bool reset) {
    std::map<std::string, double> by_name;
    for (int op = 0; op < kOps; ++op) by_name[kOpNames[op]] = spent_[op];
    if (reset) spent_.fill(0.0);
    return by_name;
  }

  void set_fresh(bool on) { fresh_ = on; }
  bool fresh() const { return fresh_; }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  // The activations of a step of `rows` rows, kept from step to step while the row
  // count holds: a tensor made after a weight's stream costs ~10 us of cache misses
  // (entry_points.h), and a step made ~250 of them.
  struct Buffers {
    int64_t rows = -1;
    torch::Tensor residual, x, qkv, attended, o, act, down;
  };

  const Buffers& buffers(int64_t rows) {
    if (buffers_.rows != rows) {
      const Layer& l = layers_[0];
      const auto make = [&](int64_t columns) {
        return torch::empty({rows, columns}, l.input.weight.options());
      };
      buffers_ = {rows, make(l.input.weight.numel()), make(l.input.weight.numel()),
                  make(l.qkv.out_features), make(l.o.packed.size(1)),
                  make(l.o.out_features), make(l.gate_up.out_features / 2),
                  make(l.down.out_features)};
    }
    return buffers_;
  }

  enum Op { kNorms, kQkv, kAttention, kO, kGateUp, kDown, kOps };
  static constexpr const char* kOpNames[kOps] = {"norms", "qkv", "attention", "o", "gate_up",
                                                 "down"};
  bool timed_ = false;
  std::array<double, kOps> spent_{};

  Product linear_, linear_silu_mul_;
  RmsNorm norm_;
  AddRmsNorm add_norm_;
  bool fresh_ = false;
  Buffers buffers_;
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
      .def_property("fresh", &Stack::fresh, &Stack::set_fresh,
                    "whether every output is a new tensor (as before the kept buffers: A/Bs)")
      .def_property("timed", &Stack::timed, &Stack::set_timed,
                    "whether each operation's seconds are summed (spent)")
      .def("spent", &Stack::spent, pybind11::arg("reset") = true,
           "seconds per operation (norms, qkv, attention, o, gate_up, down) while timed")
      .def_property_readonly("num_layers", &Stack::num_layers);
}
