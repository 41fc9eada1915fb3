// A read-only pass over a paged KV pool in a block table's order: every float of the
// listed blocks' keys and values summed, on torch's threads (each a share of the rows,
// as paged_decode splits them). The rate this reads at is the ceiling a decode
// attention kernel can stream the same blocks at on this host
// (benchmarks/bench_decode_attention_cold.py prints it beside the kernel's).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

double block_read(torch::Tensor keys, torch::Tensor values, torch::Tensor tables) {
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && tables.is_contiguous() &&
                  keys.dtype() == torch::kFloat32 && tables.dtype() == torch::kInt64,
              "block_read takes a contiguous float32 pool and int64 tables");
  const int64_t block_floats = keys.numel() / keys.size(0);
  const float* k = keys.data_ptr<float>();
  const float* v = values.data_ptr<float>();
  const int64_t* order = tables.data_ptr<int64_t>();
  const int64_t count = tables.numel();
  std::vector<double> sums(at::get_num_threads(), 0.0);
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    // 8 lanes: one AVX2 register (a 64-byte vector would go through memory there).
    typedef float vf __attribute__((vector_size(32)));
    vf a = {}, b = {};
    for (int64_t i = begin; i < end; ++i) {
      const float* kb = k + order[i] * block_floats;
      const float* vb = v + order[i] * block_floats;
      for (int64_t j = 0; j + 8 <= block_floats; j += 8) {
        vf x, y;  // unaligned loads
        std::memcpy(&x, kb + j, sizeof x);
        std::memcpy(&y, vb + j, sizeof y);
        a += x;
        b += y;
      }
    }
    double total = 0.0;
    for (int lane = 0; lane < 8; ++lane) total += a[lane] + b[lane];
    sums[at::get_thread_num()] += total;
  });
  double total = 0.0;
  for (double s : sums) total += s;
  return total;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_read", &block_read, "sum every float of the listed blocks' keys and values");
}
