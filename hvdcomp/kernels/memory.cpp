// Momentum correction and error feedback's accumulation in one pass (hvdcomp/error_feedback.py, DGC's memory):
// u <- m u + g (``average``) or u = g m (m the momentum's gain 1 / (1 - momentum)), then residual <- residual + u,
// each operation rounded as PyTorch's separate ones round them (the build turns FMA contraction off).
#include "common.h"

namespace hvdcomp {

void momentum_step(const torch::Tensor& g, const std::optional<torch::Tensor>& u,
                   const std::optional<torch::Tensor>& residual, double momentum, bool average) {
  check_float_contiguous(g, "momentum_step: gradient");
  const int64_t n = g.numel();
  TORCH_CHECK(!average || u.has_value(), "momentum_step: the running average needs its buffer u");
  for (const auto* buffer : {&u, &residual}) {
    if (!buffer->has_value()) continue;
    check_float_contiguous(**buffer, "momentum_step: u and residual");
    TORCH_CHECK((*buffer)->numel() == n, "momentum_step: buffers of ", (*buffer)->numel(),
                " elements for a gradient of ", n);
  }
  const float m = static_cast<float>(momentum);
  const float* src = g.data_ptr<float>();
  float* up = u ? u->data_ptr<float>() : nullptr;
  float* rp = residual ? residual->data_ptr<float>() : nullptr;
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float value = average ? up[i] * m + src[i] : src[i] * m;
      if (up) up[i] = value;
      if (rp) rp[i] += value;
    }
  });
}

}  // namespace hvdcomp
