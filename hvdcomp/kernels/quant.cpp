// Fused CPU kernels for the bucketed quantizers (hvdcomp/quantization.py and the methods built on it):
// BinGrad and ORQ (Xu, Huo, Huang, arXiv 2002.11082), QSGD (Alistarh et al., NeurIPS 2017), 1-bit SGD
// (Seide et al., 2014) and the sign family, with b-bit packing for b = 1 to 8.
//
// Wire format (shared with hvdcomp/packing.py): codes of b bits form a little-endian bit stream, element i at
// bits [i b, (i + 1) b), so every group of 8 elements takes exactly b bytes. Buckets are multiples of 8
// elements, so no group straddles two buckets. A bucket's levels form a table indexed by the code: sent as they
// are (BinGrad, ORQ, 1-bit SGD: ``tables`` [buckets, 2^b]) or one scale per bucket times a fixed grid (QSGD,
// sign: ``tables`` [buckets, 1] and ``grid`` [2^b]).
//
// Each kernel works one bucket at a time while it is in L1 (statistics, level search, then one draw-and-pack
// pass); decoding sums every rank's payload in one pass. Draws are counter-based (splitmix64 of the
// seed and the group index), so results do not depend on the thread count, and the keep/round-up choice is
// branch-free.
#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace hvdcomp {

namespace {

constexpr int kOrq = 0, kQsgdL2 = 1, kQsgdMax = 2;  // quantize_levels' kinds
constexpr int kBinGrad = 0, kOneBit = 1;            // quantize_binary's kinds

int64_t packed_bytes(int64_t n, int64_t bits) { return (n * bits + 7) / 8; }

// Writes the low 8 b bits of ``word`` (8 codes of b bits) as b little-endian bytes, cut at the buffer's end.
inline void store_group(uint8_t* dst, uint64_t word, int64_t group, int64_t bits, int64_t nbytes) {
  const int64_t offset = group * bits, count = std::min<int64_t>(bits, nbytes - offset);
  for (int64_t i = 0; i < count; ++i) dst[offset + i] = static_cast<uint8_t>(word >> (8 * i));
}

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the packed format is read as little-endian words");

// The group's b bytes in the low bits of a word (bits above 8 b are the next group's: callers mask).
inline uint64_t load_group(const uint8_t* src, int64_t group, int64_t bits, int64_t nbytes) {
  const int64_t offset = group * bits;
  uint64_t word = 0;
  if (offset + 8 <= nbytes) {
    std::memcpy(&word, src + offset, 8);
    return word;
  }
  for (int64_t i = 0; i < nbytes - offset; ++i) word |= static_cast<uint64_t>(src[offset + i]) << (8 * i);
  return word;
}

// Sum of squares, max |v| and minimum and maximum of m values, in 8 independent lanes (SIMD, no long
// dependency chain).
struct Stats {
  double squares;
  float absmax, low, high;
};

inline Stats stats(const float* v, int64_t m) {
  float q[8] = {}, a[8] = {}, lo[8], hi[8];
  for (int j = 0; j < 8; ++j) lo[j] = hi[j] = v[0];
  int64_t i = 0;
  for (; i + 8 <= m; i += 8)
    for (int j = 0; j < 8; ++j) {
      const float x = v[i + j];
      q[j] += x * x;
      a[j] = std::max(a[j], std::fabs(x));
      lo[j] = std::min(lo[j], x);
      hi[j] = std::max(hi[j], x);
    }
  for (; i < m; ++i) {
    q[0] += v[i] * v[i];
    a[0] = std::max(a[0], std::fabs(v[i]));
    lo[0] = std::min(lo[0], v[i]);
    hi[0] = std::max(hi[0], v[i]);
  }
  Stats out{0.0, 0.f, lo[0], hi[0]};
  for (int j = 0; j < 8; ++j) {
    out.squares += q[j];
    out.absmax = std::max(out.absmax, a[j]);
    out.low = std::min(out.low, lo[j]);
    out.high = std::max(out.high, hi[j]);
  }
  return out;
}

// QSGD's L2 norm from stats()' squares. Where those overflow float32's lanes (|v| above about 1.8e19) or lose
// precision below its normal range (every |v| under 2^-60, not all 0), the bucket is summed again in float64; a norm
// beyond float32's range is its largest value, still >= every |v|, so the rounding stays unbiased and the bucket is
// not sent as zeros.
inline float l2_norm(const float* v, int64_t m, double squares, float absmax) {
  if (!std::isfinite(squares) || (absmax > 0.f && absmax < 0x1p-60f)) {
    squares = 0.0;
    for (int64_t i = 0; i < m; ++i) squares += static_cast<double>(v[i]) * v[i];
  }
  return std::min(static_cast<float>(std::sqrt(squares)), std::numeric_limits<float>::max());
}

// Sum and count of the values below t, and the sum of all, in 8 lanes of float32; in float64 where a lane's sum
// overflows (|x| above ~1e36: the means, at most max |x|, are still float32's).
inline void below(const float* v, int64_t m, float t, double& sum_below, int64_t& count_below, double& sum_all) {
  float s[8] = {}, all[8] = {};
  int32_t c[8] = {};
  int64_t i = 0;
  for (; i + 8 <= m; i += 8)
    for (int j = 0; j < 8; ++j) {
      const float x = v[i + j];
      const bool under = x < t;
      s[j] += under ? x : 0.f;
      all[j] += x;
      c[j] += under;
    }
  for (; i < m; ++i) {
    s[0] += v[i] < t ? v[i] : 0.f;
    all[0] += v[i];
    c[0] += v[i] < t;
  }
  sum_below = sum_all = 0.0;
  count_below = 0;
  for (int j = 0; j < 8; ++j) {
    sum_below += s[j];
    sum_all += all[j];
    count_below += c[j];
  }
  if (std::isfinite(sum_below) && std::isfinite(sum_all)) return;
  sum_below = sum_all = 0.0;
  for (i = 0; i < m; ++i) {
    sum_below += v[i] < t ? v[i] : 0.0;
    sum_all += v[i];
  }
}

// (a + b) / 2, halved first where the sum overflows (both above ~1.7e38): as the Triton kernel's scaled units give it.
inline float midpoint(float a, float b) {
  const float sum = a + b;
  return std::isfinite(sum) || !std::isfinite(a) || !std::isfinite(b) ? 0.5f * sum : 0.5f * a + 0.5f * b;
}

// Eight 24-bit uniforms in [0, 1) for group ``group``: four splitmix64 draws, two per call.
inline void uniforms8(uint64_t key, int64_t group, float* u) {
  for (int i = 0; i < 4; ++i) {
    const uint64_t r = splitmix64(key + 4 * static_cast<uint64_t>(group) + i);
    u[2 * i] = uniform24(static_cast<uint32_t>(r));
    u[2 * i + 1] = uniform24(static_cast<uint32_t>(r >> 32));
  }
}

inline uint64_t seed_key(int64_t seed) { return static_cast<uint64_t>(seed) * 0xD1B54A32D192ED03ULL; }

// Calls f(std::integral_constant<int, bits>): shifts by a constant let the compiler unroll and vectorize.
template <typename F>
inline void with_bits(int64_t bits, const F& f) {
  switch (bits) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// Draws and packs one bucket [lo, lo + m): code(value, u) with u uniform in [0, 1), 8 codes per b bytes.
template <int B, typename Code>
inline void encode_bucket(const float* src, int64_t lo, int64_t m, uint64_t key, uint8_t* dst, int64_t nbytes,
                          const Code& code) {
  for (int64_t g = lo / 8; g * 8 < lo + m; ++g) {
    float u[8];
    uniforms8(key, g, u);
    const float* v = src + 8 * g;
    const int64_t count = std::min<int64_t>(8, lo + m - 8 * g);
    uint64_t word = 0;
    if (count == 8) {
      for (int j = 0; j < 8; ++j) word |= code(v[j], u[j]) << (B * j);
    } else {
      for (int64_t j = 0; j < count; ++j) word |= code(v[j], u[j]) << (B * j);
    }
    store_group(dst, word, g, B, nbytes);
  }
}

void check_bucket(int64_t bucket, const char* what) {
  TORCH_CHECK(bucket >= 8 && bucket % 8 == 0, what, ": bucket must be a positive multiple of 8, got ", bucket);
}

// The bin of a position in [0, bins): clamped, and 0 for NaN (a NaN or Inf gradient must not index out of the
// histogram; the optimizer rejects it afterwards).
inline int64_t bin_of(float position, int64_t bins) {
  return position >= 0.f ? (position < static_cast<float>(bins) ? static_cast<int64_t>(position) : bins - 1) : 0;
}

// ORQ's levels for one bucket (see hvdcomp/methods/orq.py): l_0 = min and l_{L-1} = max; the interior levels
// start uniform and move by coordinate descent on the variance of stochastic rounding. The values are binned
// into ``bins`` super-points (count and sum per bin, placed at the bin's mean); for level j with neighbours a <
// b, the optimality condition sum_{[a, l)} (g - a) = sum_{[l, b)} (b - g) reduces to #{g in [l, b)} = K with
// K = sum_{[a, b)} (g - a) / (b - a): the variance falls while the count above l exceeds K, so the optimal l is
// the largest super-point with more than K weight at or above it, found by binary search on prefix sums.
void orq_levels(const float* v, int64_t m, int64_t levels, int64_t iterations, int64_t bins, float* out,
                std::vector<int32_t>& counts, std::vector<float>& sums, std::vector<double>& weight,
                std::vector<double>& mass, std::vector<int64_t>& index) {
  const Stats range = stats(v, m);
  const float lo = range.low, hi = range.high;
  const int64_t top = levels - 1;
  for (int64_t j = 0; j <= top; ++j) out[j] = lo + (hi - lo) * static_cast<float>(j) / static_cast<float>(top);
  out[0] = lo;
  out[top] = hi;
  if (iterations == 0 || levels <= 2 || !(hi > lo)) return;
  // Count and sum per bin, then prefix sums: weight[i] = #values in bins < i, mass[i] = their sum.
  std::fill(counts.begin(), counts.end(), 0);
  std::fill(sums.begin(), sums.end(), 0.f);
  const float scale = static_cast<float>(bins) / (hi - lo);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t b = bin_of((v[i] - lo) * scale, bins);
    counts[b] += 1;
    sums[b] += v[i];
  }
  for (int64_t b = 0; b < bins; ++b) {
    weight[b + 1] = weight[b] + counts[b];
    mass[b + 1] = mass[b] + sums[b];
  }
  const auto mean_of = [&](int64_t b) {
    return static_cast<float>((mass[b + 1] - mass[b]) / (weight[b + 1] - weight[b]));
  };
  // Interior level j sits on super-point index[j] (the first non-empty bin at or above its uniform value).
  index[0] = 0;
  index[top] = bins;
  for (int64_t j = 1; j < top; ++j) {
    int64_t b = bin_of((out[j] - lo) * scale, bins);
    while (b < bins - 1 && weight[b + 1] == weight[b]) ++b;  // the last bin holds the max (finite values)
    index[j] = b;
    out[j] = mean_of(b);
  }
  for (int64_t it = 0; it < iterations; ++it) {
    bool moved = false;
    for (int64_t j = 1; j < top; ++j) {
      const int64_t first = index[j - 1], end = index[j + 1];
      const double a = out[j - 1], b = out[j + 1];
      const double count = weight[end] - weight[first];
      if (count == 0.0 || !(b > a)) continue;
      const double k = (mass[end] - mass[first] - a * count) / (b - a);
      // The largest bin i in [first, end) with weight[end] - weight[i] > k, i.e. weight[i] < weight[end] - k.
      const double* w = weight.data();
      int64_t i = std::lower_bound(w + first, w + end, w[end] - k) - w - 1;
      i = std::max(i, first);
      while (i > first && weight[i + 1] == weight[i]) --i;  // an empty bin: the non-empty one below
      if (i != index[j]) {
        index[j] = i;
        out[j] = mean_of(i);
        moved = true;
      }
    }
    if (!moved) break;  // a fixed point: further sweeps change nothing
  }
}

}  // namespace

// Quantizes ``x`` per bucket onto 2^bits levels with stochastic rounding (unbiased) and packs the codes.
// kind 0 (ORQ): levels from orq_levels, sent as tables [buckets, 2^bits] (iterations 0: uniform from min to
// max). kinds 1 and 2 (QSGD): s = 2^(bits-1) - 1, levels norm * l / s for l in [-s, s] (code s + l), the norm
// L2 (1) or max (2), sent as tables [buckets, 1]. Returns {tables, packed}.
std::vector<torch::Tensor> quantize_levels(const torch::Tensor& x, int64_t bucket, int64_t bits, int64_t kind,
                                           int64_t iterations, int64_t bins, int64_t seed) {
  check_float_contiguous(x, "quantize_levels: x");
  check_bucket(bucket, "quantize_levels");
  TORCH_CHECK(bits >= 1 && bits <= 8, "quantize_levels: bits must be in [1, 8], got ", bits);
  TORCH_CHECK(kind == kOrq || kind == kQsgdL2 || kind == kQsgdMax, "quantize_levels: kind must be 0 (ORQ), ",
              "1 (QSGD, L2 norm) or 2 (QSGD, max norm), got ", kind);
  TORCH_CHECK(kind == kOrq || bits >= 2, "quantize_levels: QSGD needs bits >= 2, got ", bits);
  TORCH_CHECK(kind != kOrq || bins >= 1, "quantize_levels: bins must be >= 1, got ", bins);
  const int64_t n = x.numel(), buckets = (n + bucket - 1) / bucket, levels = int64_t{1} << bits;
  const int64_t width = kind == kOrq ? levels : 1, nbytes = packed_bytes(n, bits);
  auto tables = torch::empty({buckets, width}, torch::kFloat32);
  auto packed = torch::empty({nbytes}, torch::kUInt8);
  const float* src = x.data_ptr<float>();
  float* table = tables.data_ptr<float>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const uint64_t key = seed_key(seed);
  const int64_t s = (levels >> 1) - 1;
  at::parallel_for(0, buckets, std::max<int64_t>(1, kGrain / bucket), [&](int64_t begin, int64_t end) {
    std::vector<int32_t> counts(bins);
    std::vector<float> sums(bins);
    std::vector<double> weight(bins + 1, 0.0), mass(bins + 1, 0.0);  // entry 0 stays 0
    std::vector<int64_t> index(levels);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t lo = b * bucket, m = std::min(bucket, n - lo);
      const float* v = src + lo;
      float* lv = table + b * width;
      if (kind == kOrq) {
        orq_levels(v, m, levels, iterations, bins, lv, counts, sums, weight, mass, index);
      } else {
        const Stats moments = stats(v, m);
        lv[0] = kind == kQsgdL2 ? l2_norm(v, m, moments.squares, moments.absmax) : moments.absmax;
      }
      // 0 for a zero bucket, and for one whose norm is so small (subnormal) that s / norm overflows: it sends zeros
      float inverse = kind == kOrq || lv[0] == 0.f ? 0.f : static_cast<float>(s) / lv[0];
      if (!std::isfinite(inverse)) inverse = 0.f;
      with_bits(bits, [&](auto b_) {
        constexpr int B = decltype(b_)::value;
        constexpr int L = 1 << B;
        if (kind == kOrq) {
          encode_bucket<B>(src, lo, m, key, dst, nbytes, [&](float value, float u) {
            int i = 0;  // the largest i with lv[i] <= value: branch-free binary search
            for (int step = L >> 1; step >= 1; step >>= 1) i += step * static_cast<int>(lv[i + step] <= value);
            i = std::min(i, L - 2);
            return static_cast<uint64_t>(i) + static_cast<uint64_t>(u * (lv[i + 1] - lv[i]) < value - lv[i]);
          });
        } else {
          constexpr int S = (L >> 1) - 1;
          encode_bucket<B>(src, lo, m, key, dst, nbytes, [&](float value, float u) {
            // in [0, s]; a NaN or infinite input to s too (the comparison fails), as the cast below is defined on
            // [0, s] only (one minss, where std::fmin is a libm call)
            const float scaled = std::fabs(value) * inverse;
            const float r = scaled < static_cast<float>(S) ? scaled : static_cast<float>(S);
            const int floor_r = std::min(S - 1, static_cast<int>(r));
            const int level = floor_r + static_cast<int>(u < r - static_cast<float>(floor_r));
            // S + level or S - level, branch-free: the sign is random, a branch would mispredict half the time
            return static_cast<uint64_t>(S + level - 2 * level * static_cast<int>(value < 0.f));
          });
        }
      });
    }
  });
  return {tables, packed};
}

// Binary quantization per bucket, 1 bit per element (code 1: the upper level), levels sent as [buckets, 2].
// kind 0 (BinGrad): the 2-level Lloyd-Max quantizer, from threshold t = mean: b1 = mean{g < t},
// b2 = mean{g >= t}, t <- (b1 + b2) / 2, up to ``iterations`` partitions, stopping at a fixed point; the codes
// use the last partition, so each level is the exact mean of the values it replaces. kind 1 (1-bit SGD):
// threshold 0, levels the means of the negative and the non-negative values (0 where there are none).
std::vector<torch::Tensor> quantize_binary(const torch::Tensor& x, int64_t bucket, int64_t kind,
                                           int64_t iterations) {
  check_float_contiguous(x, "quantize_binary: x");
  check_bucket(bucket, "quantize_binary");
  TORCH_CHECK(kind == kBinGrad || kind == kOneBit, "quantize_binary: kind must be 0 (BinGrad) or 1 (1-bit SGD), ",
              "got ", kind);
  TORCH_CHECK(kind == kOneBit || iterations >= 1, "quantize_binary: iterations must be >= 1, got ", iterations);
  const int64_t n = x.numel(), buckets = (n + bucket - 1) / bucket, nbytes = packed_bytes(n, 1);
  auto tables = torch::empty({buckets, 2}, torch::kFloat32);
  auto packed = torch::empty({nbytes}, torch::kUInt8);
  const float* src = x.data_ptr<float>();
  float* table = tables.data_ptr<float>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, buckets, std::max<int64_t>(1, kGrain / bucket), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t lo = b * bucket, m = std::min(bucket, n - lo);
      const float* v = src + lo;
      float threshold = 0.f, low = 0.f, high = 0.f;
      int64_t count_below = -1;
      const auto cells = [&](float t) {  // the means of the values below t and at or above t; false: unchanged
        double sum_below, sum_all;
        const int64_t before = count_below;
        below(v, m, t, sum_below, count_below, sum_all);
        const int64_t count_above = m - count_below;
        low = count_below ? static_cast<float>(sum_below / count_below) : (kind == kOneBit ? 0.f : t);
        high = count_above ? static_cast<float>((sum_all - sum_below) / count_above) : (kind == kOneBit ? 0.f : t);
        return count_below != before;
      };
      if (kind == kOneBit) {
        cells(0.f);
      } else {
        double sum_below, sum_all;
        int64_t count;
        below(v, m, 0.f, sum_below, count, sum_all);
        threshold = static_cast<float>(sum_all / m);
        // Up to ``iterations`` partitions; the sets {g < t} are nested, so an unchanged count is an unchanged
        // partition: a fixed point, where further iterations would change nothing.
        for (int64_t it = 0; cells(threshold) && it + 1 < iterations; ++it) threshold = midpoint(low, high);
      }
      table[2 * b] = low;
      table[2 * b + 1] = high;
      for (int64_t g = lo / 8; g * 8 < lo + m; ++g) {
        const int64_t count = std::min<int64_t>(8, lo + m - 8 * g);
        uint64_t word = 0;
        for (int64_t j = 0; j < count; ++j) word |= static_cast<uint64_t>(src[8 * g + j] >= threshold) << j;
        store_group(dst, word, g, 1, nbytes);
      }
    }
  });
  return {tables, packed};
}

// Signs, 1 bit per element (1: positive). An exact zero takes a fair coin from ``seed`` (so zeros, such as a
// dead unit's gradient, vote without bias), or counts as positive when seed < 0.
torch::Tensor pack_signs(const torch::Tensor& x, int64_t seed) {
  check_float_contiguous(x, "pack_signs: x");
  const int64_t n = x.numel(), nbytes = packed_bytes(n, 1), groups = (n + 7) / 8;
  auto packed = torch::empty({nbytes}, torch::kUInt8);
  const float* src = x.data_ptr<float>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const uint64_t key = seed_key(seed);
  const bool coin = seed >= 0;
  at::parallel_for(0, groups, kGrain / 8, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint64_t coins = coin ? splitmix64(key + static_cast<uint64_t>(g)) : 0xFFULL;
      const int64_t count = std::min<int64_t>(8, n - 8 * g);
      uint64_t word = 0;
      for (int64_t j = 0; j < count; ++j) {
        const float value = src[8 * g + j];
        word |= static_cast<uint64_t>((value > 0.f) | ((value == 0.f) & ((coins >> j) & 1))) << j;
      }
      dst[g] = static_cast<uint8_t>(word);
    }
  });
  return packed;
}

namespace {

// decode_sum's and decode_subtract's work: the R payloads' decoded sum written to ``dst`` (float32 [n]), or, with
// ``subtract`` (one payload), taken from it in place.
void decode_into(const torch::Tensor& packed, const torch::Tensor& tables, const torch::Tensor& grid, int64_t bits,
                 int64_t bucket, int64_t n, float* dst, bool subtract, const char* what) {
  TORCH_CHECK(bits >= 1 && bits <= 8, what, ": bits must be in [1, 8], got ", bits);
  TORCH_CHECK(bucket >= 1 && (bucket % 8 == 0 || bucket >= n), what, ": bucket must be a multiple of 8 or ",
              "hold the whole tensor, got ", bucket, " for ", n, " elements");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8 && packed.dim() == 2 &&
                  packed.stride(1) == 1,
              what, ": packed must be a CPU uint8 tensor [R, nbytes] with contiguous rows");
  if (n == 0) return;  // whatever tables a whole-tensor bucket came with
  TORCH_CHECK(tables.device().is_cpu() && tables.scalar_type() == torch::kFloat32, what,
              ": tables must be a CPU float32 tensor");
  check_float_contiguous(grid, (std::string(what) + ": grid").c_str());
  const int64_t ranks = packed.size(0), nbytes = packed.size(1), levels = int64_t{1} << bits;
  const int64_t buckets = (n + bucket - 1) / bucket;
  TORCH_CHECK(nbytes == packed_bytes(n, bits), what, ": ", nbytes, " bytes per payload cannot hold ", n,
              " elements of ", bits, " bits (expected ", packed_bytes(n, bits), ")");
  TORCH_CHECK(!subtract || ranks == 1, what, ": subtracts one payload, got ", ranks);
  const int64_t width = grid.numel() == 0 ? levels : 1;
  TORCH_CHECK(grid.numel() == 0 || grid.numel() == levels, what, ": grid must hold 2^bits = ", levels,
              " values, got ", grid.numel());
  TORCH_CHECK(tables.dim() == 3 && tables.size(0) == ranks && tables.size(1) == buckets && tables.size(2) == width,
              what, ": tables must be [", ranks, ", ", buckets, ", ", width, "], got ", tables.sizes());
  TORCH_CHECK(tables.stride(2) == 1 && (buckets == 1 || tables.stride(1) == width), what,
              ": each rank's tables must be contiguous");
  const int64_t packed_stride = packed.size(0) > 1 ? packed.stride(0) : nbytes;
  const int64_t table_stride = tables.size(0) > 1 ? tables.stride(0) : buckets * width;
  const uint8_t* src = packed.data_ptr<uint8_t>();
  const float* table = tables.data_ptr<float>();
  const float* steps = grid.numel() ? grid.data_ptr<float>() : nullptr;
  const int64_t groups = (n + 7) / 8;
  at::parallel_for(0, groups, kGrain / 8, [&](int64_t begin, int64_t end) {
    float lut[256];
    // Segments of this range of groups that lie in one bucket (buckets are whole groups, or the whole tensor).
    for (int64_t first = begin; first < end;) {
      const int64_t b = 8 * first / bucket;
      const int64_t last = std::min(end, ((b + 1) * bucket + 7) / 8);
      for (int64_t r = 0; r < ranks; ++r) {
        const float* entry = table + r * table_stride + b * width;
        for (int64_t c = 0; c < levels; ++c) lut[c] = steps ? entry[0] * steps[c] : entry[c];
        const uint8_t* codes = src + r * packed_stride;
        with_bits(bits, [&](auto b_) {
          constexpr int B = decltype(b_)::value;
          constexpr uint64_t mask = (uint64_t{1} << B) - 1;
          // Full groups whose 8-byte load stays inside the payload: constant shifts, no bounds checks (none where
          // the payload is shorter than 8 bytes: (nbytes - 8) / B rounds toward zero there).
          const int64_t safe = nbytes >= 8 ? (nbytes - 8) / B + 1 : 0;
          const int64_t fast = std::max(first, std::min(last, std::min(n / 8, safe)));
          for (int64_t g = first; g < fast; ++g) {
            uint64_t word;
            std::memcpy(&word, codes + g * B, 8);
            float* o = dst + 8 * g;
            if (subtract) {
              for (int j = 0; j < 8; ++j) o[j] -= lut[(word >> (B * j)) & mask];
            } else if (r == 0) {
              for (int j = 0; j < 8; ++j) o[j] = lut[(word >> (B * j)) & mask];
            } else {
              for (int j = 0; j < 8; ++j) o[j] += lut[(word >> (B * j)) & mask];
            }
          }
          for (int64_t g = fast; g < last; ++g) {
            const uint64_t word = load_group(codes, g, B, nbytes);
            float* o = dst + 8 * g;
            for (int64_t j = 0; j < std::min<int64_t>(8, n - 8 * g); ++j) {
              const float value = lut[(word >> (B * j)) & mask];
              o[j] = subtract ? o[j] - value : (r == 0 ? 0.f : o[j]) + value;
            }
          }
        });
      }
      first = last;
    }
  });
}

}  // namespace

// Decodes and sums the payloads of R ranks: packed uint8 [R, nbytes], tables float32 [R, buckets, T], each rank's
// row contiguous and the rows at any stride (gathered payloads lie at equal steps in one buffer: no copy);
// value = tables[r, bucket, code] where grid is empty (T = 2^bits), else tables[r, bucket, 0] * grid[code].
// Returns float32 [n], added in rank order (the same bits on every rank).
torch::Tensor decode_sum(const torch::Tensor& packed, const torch::Tensor& tables, const torch::Tensor& grid,
                         int64_t bits, int64_t bucket, int64_t n) {
  auto out = torch::empty({n}, torch::kFloat32);
  decode_into(packed, tables, grid, bits, bucket, n, out.data_ptr<float>(), false, "decode_sum");
  return out;
}

// Error feedback's update, residual -= decode(payload), in place and in one pass: one payload (packed uint8
// [1, nbytes], tables [1, buckets, T]) as decode_sum decodes it, from the float32 contiguous ``residual``.
void decode_subtract(const torch::Tensor& residual, const torch::Tensor& packed, const torch::Tensor& tables,
                     const torch::Tensor& grid, int64_t bits, int64_t bucket) {
  check_float_contiguous(residual, "decode_subtract: residual");
  decode_into(packed, tables, grid, bits, bucket, residual.numel(), residual.data_ptr<float>(), true,
              "decode_subtract");
}

// signSGD's majority vote over R ranks' 1-bit sign payloads (packed uint8 [R, ceil(n / 8)], rows contiguous at any
// stride; bit 1: positive): sign(sum_r (2 b_r - 1)) times the ranks' scales (float32 [R], any stride) summed in
// rank order; a tie gives 0. Returns float32 [n].
torch::Tensor sign_vote(const torch::Tensor& packed, const torch::Tensor& scales, int64_t n) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8 && packed.dim() == 2 &&
                  packed.stride(1) == 1,
              "sign_vote: packed must be a CPU uint8 tensor [R, nbytes] with contiguous rows");
  const int64_t ranks = packed.size(0), nbytes = packed.size(1);
  TORCH_CHECK(nbytes == packed_bytes(n, 1), "sign_vote: ", nbytes, " bytes per payload cannot hold ", n,
              " signs (expected ", packed_bytes(n, 1), ")");
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == torch::kFloat32 && scales.dim() == 1 &&
                  scales.numel() == ranks,
              "sign_vote: scales must be a CPU float32 tensor [", ranks, "], got ", scales.sizes());
  const float* sc = scales.data_ptr<float>();
  float scale = 0.f;
  for (int64_t r = 0; r < ranks; ++r) scale += sc[r * scales.stride(0)];
  auto out = torch::empty({n}, torch::kFloat32);
  const int64_t stride = ranks > 1 ? packed.stride(0) : nbytes;
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  constexpr int64_t kChunk = 512;  // bytes of signs whose votes one pass over the ranks counts
  static const auto lut = [] {  // lut[byte][j]: the vote (+1 or -1) of bit j
    std::vector<int8_t> t(256 * 8);
    for (int byte = 0; byte < 256; ++byte)
      for (int j = 0; j < 8; ++j) t[byte * 8 + j] = ((byte >> j) & 1) ? 1 : -1;
    return t;
  }();
  at::parallel_for(0, nbytes, kGrain / 8, [&](int64_t begin, int64_t end) {
    int32_t votes[8 * kChunk];
    for (int64_t first = begin; first < end; first += kChunk) {
      const int64_t last = std::min(end, first + kChunk);
      std::fill(votes, votes + 8 * (last - first), 0);
      for (int64_t r = 0; r < ranks; ++r) {
        const uint8_t* codes = src + r * stride;
        for (int64_t b = first; b < last; ++b) {
          const int8_t* vote = &lut[codes[b] * 8];
          int32_t* v = votes + 8 * (b - first);
          for (int j = 0; j < 8; ++j) v[j] += vote[j];
        }
      }
      const int64_t count = std::min(n, 8 * last) - 8 * first;
      float* o = dst + 8 * first;
      for (int64_t i = 0; i < count; ++i) o[i] = static_cast<float>((votes[i] > 0) - (votes[i] < 0)) * scale;
    }
  });
  return out;
}

}  // namespace hvdcomp
