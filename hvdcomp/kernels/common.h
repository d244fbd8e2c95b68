// Helpers shared by hvdcomp's fused CPU kernels (ternary.cpp, randomk.cpp, quant.cpp, threshold.cpp, sketch.cpp,
// memory.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>

namespace hvdcomp {

constexpr int64_t kGrain = 1 << 15;

// Counter-based random bits: splitmix64 of a seed and a counter, so results do not depend on the thread count.
inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Uniform in [0, 1) with 24 random bits: exactly representable in float.
inline float uniform24(uint32_t bits) { return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f); }

inline void check_float_contiguous(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, what, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
}

// ternary.cpp
torch::Tensor moments(const torch::Tensor& x);
torch::Tensor ternarize_pack(const torch::Tensor& x, double scaler, double clip, int64_t seed);
torch::Tensor unpack_sum(const torch::Tensor& packed, const torch::Tensor& scales, int64_t n);
// randomk.cpp
std::vector<torch::Tensor> randomk_select(const torch::Tensor& x, int64_t k, int64_t seed, bool scale);
// quant.cpp
std::vector<torch::Tensor> quantize_levels(const torch::Tensor& x, int64_t bucket, int64_t bits, int64_t kind,
                                           int64_t iterations, int64_t bins, int64_t seed);
std::vector<torch::Tensor> quantize_binary(const torch::Tensor& x, int64_t bucket, int64_t kind,
                                           int64_t iterations);
torch::Tensor pack_signs(const torch::Tensor& x, int64_t seed);
torch::Tensor decode_sum(const torch::Tensor& packed, const torch::Tensor& tables, const torch::Tensor& grid,
                         int64_t bits, int64_t bucket, int64_t n);
void decode_subtract(const torch::Tensor& residual, const torch::Tensor& packed, const torch::Tensor& tables,
                     const torch::Tensor& grid, int64_t bits, int64_t bucket);
torch::Tensor sign_vote(const torch::Tensor& packed, const torch::Tensor& scales, int64_t n);
// threshold.cpp
torch::Tensor excess_moments(const torch::Tensor& x, const torch::Tensor& threshold);
// memory.cpp
void momentum_step(const torch::Tensor& g, const std::optional<torch::Tensor>& u,
                   const std::optional<torch::Tensor>& residual, double momentum, bool average);
// sketch.cpp
torch::Tensor sketch_candidates(const torch::Tensor& filter, int64_t n_items, int64_t seed, int64_t hashes);
std::vector<torch::Tensor> sketch_peel(const torch::Tensor& candidates, const torch::Tensor& table, int64_t seed);

}  // namespace hvdcomp
