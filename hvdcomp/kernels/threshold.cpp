// Fused CPU kernel for threshold sparsification's fit (hvdcomp/methods/threshold.py, SIDCo's multi-stage
// exponential model): each stage needs the mean excess of |x| over t among the entries above t, which is one pass
// here, where the PyTorch ops take three and two tensors of x's size.
#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace hvdcomp {

// Returns float64 [sum of max(|x| - t, 0), count of |x| > t] of a float32 tensor, t a float32 tensor of one
// element; partial sums per chunk in 8 lanes, added in chunk order (the same result for any thread count).
torch::Tensor excess_moments(const torch::Tensor& x, const torch::Tensor& threshold) {
  check_float_contiguous(x, "excess_moments: x");
  check_float_contiguous(threshold, "excess_moments: threshold");
  TORCH_CHECK(threshold.numel() == 1, "excess_moments: threshold must hold one value, got ", threshold.numel());
  const float t = threshold.data_ptr<float>()[0];
  const float* data = x.data_ptr<float>();
  const int64_t n = x.numel();
  const int64_t chunks = std::max<int64_t>(1, (n + kGrain - 1) / kGrain);
  std::vector<double> excess(chunks, 0.0), counts(chunks, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * kGrain, hi = std::min(n, lo + kGrain);
      float e[8] = {};
      int32_t k[8] = {};
      int64_t i = lo;
      for (; i + 8 <= hi; i += 8)
        for (int j = 0; j < 8; ++j) {
          const float over = std::fabs(data[i + j]) - t;
          e[j] += over > 0.f ? over : 0.f;
          k[j] += over > 0.f;
        }
      for (; i < hi; ++i) {
        const float over = std::fabs(data[i]) - t;
        e[0] += over > 0.f ? over : 0.f;
        k[0] += over > 0.f;
      }
      for (int j = 0; j < 8; ++j) {
        excess[c] += e[j];
        counts[c] += k[j];
      }
    }
  });
  double total = 0.0, count = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    total += excess[c];
    count += counts[c];
  }
  return torch::tensor({total, count}, torch::kFloat64);
}

}  // namespace hvdcomp
