// Fused CPU selection for random-k sparsification (hvdcomp/methods/randomk.py).
//
// k positions out of n, one per stratum: stratum b covers [b n / k, (b + 1) n / k) and its position is
// start_b + floor(u_b * length_b), u_b uniform from splitmix64(seed, b). Every element is chosen with
// probability 1 / length_b of its stratum, so scaling a chosen value by length_b makes the estimate unbiased.
// One pass over k strata: draw, gather, scale; no pass over the n elements.
#include "common.h"

#include <ATen/Parallel.h>

#include <vector>

namespace hvdcomp {

std::vector<torch::Tensor> randomk_select(const torch::Tensor& x, int64_t k, int64_t seed, bool scale) {
  check_float_contiguous(x, "randomk_select: x");
  const int64_t n = x.numel();
  TORCH_CHECK(k >= 1 && k <= n, "randomk_select: k must be in [1, n] = [1, ", n, "], got ", k);
  auto values = torch::empty({k}, x.options());
  auto indices = torch::empty({k}, x.options().dtype(torch::kInt64));
  const float* src = x.data_ptr<float>();
  float* out = values.data_ptr<float>();
  int64_t* idx = indices.data_ptr<int64_t>();
  const auto n128 = static_cast<__int128>(n);
  at::parallel_for(0, k, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const auto start = static_cast<int64_t>(n128 * b / k);
      const auto length = static_cast<int64_t>(n128 * (b + 1) / k) - start;
      const uint64_t bits = splitmix64(static_cast<uint64_t>(seed) ^ (static_cast<uint64_t>(b) * 0xD6E8FEB86659FD93ULL));
      const double u = static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);  // 53 bits, in [0, 1)
      const int64_t i = start + std::min(length - 1, static_cast<int64_t>(u * static_cast<double>(length)));
      idx[b] = i;
      out[b] = scale ? src[i] * static_cast<float>(length) : src[i];
    }
  });
  return {values, indices};
}

}  // namespace hvdcomp
