// Decode attention read in place from the paged KV cache: no gathered copy of any
// request's context, no padding to the longest request.
//
// Each (request, KV head) is one work item on torch's thread pool: the G query heads
// that share the KV head walk the request's blocks in its block table, scoring a
// block's keys, then folding the block into a running softmax (the running maximum,
// the sum of exponentials and the weighted sum of values, rescaled when the maximum
// grows), so each key and value is read once, where it lies. float32 throughout;
// built with -ffast-math for vector exponentials and reassociated dot products.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void scale_add(float* acc, const float* v, float p, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += p * v[i];
}

}  // namespace

// q [D, H, Dh]; keys, values [blocks, block_size, KVH, Dh]; tables [D, W] int64;
// lengths [D] int64: keys row d attends to (its context and its own token).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                           torch::Tensor tables, torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && keys.dtype() == torch::kFloat32 &&
                  values.dtype() == torch::kFloat32,
              "paged_decode takes float32 queries and a float32 cache");
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous() &&
                  tables.is_contiguous() && lengths.is_contiguous(),
              "paged_decode takes contiguous tensors");
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = keys.size(1), kv_heads = keys.size(2);
  const int64_t group = heads / kv_heads, width = tables.size(1);
  auto out = torch::empty_like(q);
  const float* q_data = q.data_ptr<float>();
  const float* k_data = keys.data_ptr<float>();
  const float* v_data = values.data_ptr<float>();
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t* length_data = lengths.data_ptr<int64_t>();
  float* out_data = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const int64_t token_stride = kv_heads * head_dim;  // between a block's tokens

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * head_dim), running_max(group), total(group);
    std::vector<float> scores(group * block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, kv_head = item % kv_heads;
      const int64_t length = length_data[row];
      const float* query = q_data + (row * heads + kv_head * group) * head_dim;
      std::fill(acc.begin(), acc.end(), 0.0f);
      // Finite, not -inf: built with -ffast-math, which assumes no infinities.
      std::fill(running_max.begin(), running_max.end(), -1e30f);
      std::fill(total.begin(), total.end(), 0.0f);
      for (int64_t start = 0, b = 0; start < length && b < width; start += block_size, ++b) {
        const int64_t block = table_data[row * width + b];
        const int64_t count = std::min(block_size, length - start);
        const int64_t base = (block * block_size * kv_heads + kv_head) * head_dim;
        const float* block_keys = k_data + base;
        const float* block_values = v_data + base;
        // Each key once, against the G query heads.
        for (int64_t t = 0; t < count; ++t) {
          const float* key = block_keys + t * token_stride;
          for (int64_t g = 0; g < group; ++g)
            scores[g * block_size + t] = s * dot(query + g * head_dim, key, head_dim);
        }
        for (int64_t g = 0; g < group; ++g) {
          float* score = scores.data() + g * block_size;
          float block_max = -1e30f;
          for (int64_t t = 0; t < count; ++t) block_max = std::max(block_max, score[t]);
          const float new_max = std::max(running_max[g], block_max);
          const float rescale = std::exp(running_max[g] - new_max);
          float block_total = 0.0f;
#pragma omp simd reduction(+ : block_total)
          for (int64_t t = 0; t < count; ++t) {  // vector exp (libmvec)
            score[t] = std::exp(score[t] - new_max);
            block_total += score[t];
          }
          float* sum = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) sum[i] *= rescale;
          total[g] = total[g] * rescale + block_total;
          running_max[g] = new_max;
        }
        // Each value once, into the G heads' sums.
        for (int64_t t = 0; t < count; ++t) {
          const float* value = block_values + t * token_stride;
          for (int64_t g = 0; g < group; ++g)
            scale_add(acc.data() + g * head_dim, value, scores[g * block_size + t], head_dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* target = out_data + (row * heads + kv_head * group + g) * head_dim;
        const float inverse = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
        for (int64_t i = 0; i < head_dim; ++i) target[i] = acc[g * head_dim + i] * inverse;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention in place over a paged KV cache");
}
