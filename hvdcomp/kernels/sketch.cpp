// Fused CPU decoding for lossless homomorphic compression (hvdcomp/methods/sketch.py; Li et al., arXiv 2402.07529).
//
// Hashes (the PyTorch path in sketch.py computes the same bits): mix() is splitmix64's finalizer.
//   Sketch: H = mix(item ^ seed), G = mix(H); item lands in cell j * c3 + ((hash32_j * c3) >> 32) of each of three
//   sub-tables of c3 cells (hash32_0 = low 32 bits of H, hash32_1 = high 32 bits of H, hash32_2 = low 32 bits of G),
//   with sign 1 - 2 * bit (32 + j) of G. Three sub-tables keep an item's three cells distinct.
//   Bloom filter: F = mix(item ^ filter_seed), h1 = low 32 bits, h2 = high 32 bits | 1; bit (h1 + j h2) mod bits.
//
// sketch_candidates: every item of [0, n_items) that passes the (aggregated) filter, ascending.
// sketch_peel: peels the summed sketch over the candidates. A queue holds the cells covered by exactly one
// unresolved candidate (ascending at first, then first-in first-out): the candidate's value is the cell's residual
// times its sign, and its contribution leaves its other cells. Residuals are float64, so the subtractions are exact
// where every partial sum of the m float32 values meeting in a cell fits 53 bits: where they are within
// 2^(29 - ceil(log2 m)) of each other in magnitude. Returns the values and how many
// candidates were resolved: all of them when peeling completes (the hypergraph has an empty 2-core), which does not
// depend on the values, so every rank that decodes the same sums reaches the same verdict.
#include "common.h"

#include <ATen/Parallel.h>

#include <vector>

namespace hvdcomp {

namespace {

inline uint64_t mix(uint64_t z) { return splitmix64(z); }

inline bool passes(const uint8_t* filter, uint64_t item, uint64_t seed, uint64_t bits, int64_t hashes) {
  const uint64_t f = mix(item ^ seed);
  const uint64_t h1 = f & 0xFFFFFFFFULL, h2 = (f >> 32) | 1ULL;
  for (int64_t j = 0; j < hashes; ++j) {
    const uint64_t bit = (h1 + static_cast<uint64_t>(j) * h2) % bits;
    if (!((filter[bit >> 3] >> (bit & 7)) & 1)) return false;
  }
  return true;
}

inline void cells_of(uint64_t item, uint64_t seed, uint64_t c3, int64_t cell[3], double sign[3]) {
  const uint64_t h = mix(item ^ seed), g = mix(h);
  const uint64_t hash32[3] = {h & 0xFFFFFFFFULL, h >> 32, g & 0xFFFFFFFFULL};
  for (int j = 0; j < 3; ++j) {
    cell[j] = static_cast<int64_t>(j * c3 + ((hash32[j] * c3) >> 32));
    sign[j] = ((g >> (32 + j)) & 1) ? -1.0 : 1.0;
  }
}

}  // namespace

torch::Tensor sketch_candidates(const torch::Tensor& filter, int64_t n_items, int64_t seed, int64_t hashes) {
  TORCH_CHECK(filter.device().is_cpu() && filter.scalar_type() == torch::kUInt8 && filter.is_contiguous(),
              "sketch_candidates: filter must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(filter.numel() > 0 && hashes >= 1 && n_items >= 0, "sketch_candidates: bad sizes");
  const uint8_t* bytes = filter.data_ptr<uint8_t>();
  const uint64_t bits = static_cast<uint64_t>(filter.numel()) * 8;
  const auto useed = static_cast<uint64_t>(seed);
  const int64_t chunks = std::max<int64_t>(1, (n_items + kGrain - 1) / kGrain);
  std::vector<std::vector<int64_t>> found(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      for (int64_t i = c * kGrain, hi = std::min(n_items, (c + 1) * kGrain); i < hi; ++i)
        if (passes(bytes, static_cast<uint64_t>(i), useed, bits, hashes)) found[c].push_back(i);
  });
  int64_t total = 0;
  for (const auto& part : found) total += static_cast<int64_t>(part.size());
  auto out = torch::empty({total}, torch::dtype(torch::kInt64));
  int64_t* dst = out.data_ptr<int64_t>();
  for (const auto& part : found) dst = std::copy(part.begin(), part.end(), dst);
  return out;
}

std::vector<torch::Tensor> sketch_peel(const torch::Tensor& candidates, const torch::Tensor& table, int64_t seed) {
  TORCH_CHECK(candidates.device().is_cpu() && candidates.scalar_type() == torch::kInt64 && candidates.is_contiguous(),
              "sketch_peel: candidates must be a contiguous int64 CPU tensor");
  TORCH_CHECK(table.device().is_cpu() && table.dim() == 2 && table.size(0) % 3 == 0 && table.size(0) > 0,
              "sketch_peel: table must be a CPU tensor of [3 c, block] cells");
  const int64_t count = candidates.numel(), cells = table.size(0), block = table.size(1);
  const auto c3 = static_cast<uint64_t>(cells / 3);
  const auto useed = static_cast<uint64_t>(seed);
  auto residual = table.to(torch::kFloat64, /*non_blocking=*/false, /*copy=*/true).contiguous();  // never the input
  double* res = residual.data_ptr<double>();
  const int64_t* items = candidates.data_ptr<int64_t>();
  std::vector<int64_t> where(3 * count);
  std::vector<double> signs(3 * count);
  std::vector<int32_t> covered(cells, 0);
  std::vector<int64_t> members(cells, 0);  // XOR of the unresolved candidates' ordinals in each cell
  at::parallel_for(0, count, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) cells_of(static_cast<uint64_t>(items[c]), useed, c3, &where[3 * c], &signs[3 * c]);
  });
  for (int64_t c = 0; c < count; ++c)
    for (int j = 0; j < 3; ++j) {
      ++covered[where[3 * c + j]];
      members[where[3 * c + j]] ^= c;
    }
  std::vector<int64_t> queue;
  queue.reserve(cells);
  for (int64_t cell = 0; cell < cells; ++cell)
    if (covered[cell] == 1) queue.push_back(cell);
  auto values = torch::zeros({count, block}, torch::dtype(torch::kFloat64));
  double* out = values.data_ptr<double>();
  int64_t resolved = 0;
  for (size_t head = 0; head < queue.size(); ++head) {
    const int64_t cell = queue[head];
    if (covered[cell] != 1) continue;
    const int64_t c = members[cell];
    int j = 0;
    while (where[3 * c + j] != cell) ++j;
    double* value = out + c * block;
    const double* source = res + cell * block;
    for (int64_t b = 0; b < block; ++b) value[b] = signs[3 * c + j] * source[b];
    for (int k = 0; k < 3; ++k) {
      const int64_t other = where[3 * c + k];
      double* target = res + other * block;
      for (int64_t b = 0; b < block; ++b) target[b] -= signs[3 * c + k] * value[b];
      members[other] ^= c;
      if (--covered[other] == 1) queue.push_back(other);
    }
    ++resolved;
  }
  return {values, torch::tensor(resolved, torch::dtype(torch::kInt64))};
}

}  // namespace hvdcomp
