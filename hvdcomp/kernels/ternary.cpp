// Fused CPU kernels for TernGrad (Wen et al., NeurIPS 2017) and 2-bit ternary packing.
//
// The pure-PyTorch path (hvdcomp/methods/terngrad.py) needs a dozen full passes over the gradient and a
// per-element Mersenne-Twister draw; these kernels do one read pass for the statistics, one fused
// clip-ternarize-pack pass, and one unpack-accumulate pass for decoding, so compress+decompress runs close
// to memory speed on a CPU.
//
// Wire format (shared with the PyTorch path): each element takes 2 bits, 4 elements per byte, element j of
// a byte at bits 2j..2j+1 (little end first); code 0b00 = 0, 0b01 = +1, 0b10 = -1. Padding codes are 0.
//
// Randomness is counter-based (splitmix64 of seed and element-pair index), so results do not depend on the
// thread count and a run resumed from a checkpoint draws the same numbers.
#include "common.h"

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace hvdcomp {


// The elements one pass of moments() holds in L1 cache: it sums them, then sums their squared deviations from
// their own mean on a second read from cache.
constexpr int64_t kMomentsBlock = 1024;

// Returns float64 [sum, sum of squared deviations from the mean (M2), max |x|, sum |x|] of a float32 tensor, in one
// pass over memory. M2 is not sum(x^2) - sum(x)^2 / n: in float32 partial sums that difference cancels where the mean
// is far above the spread. Each block of kMomentsBlock elements takes its deviations from its own mean, and blocks
// and chunks merge by Chan et al.'s pairwise update (1979): M2 = M2_a + M2_b + (mean_b - mean_a)^2 n_a n_b / (n_a +
// n_b), in float64.
torch::Tensor moments(const torch::Tensor& x) {
  check_float_contiguous(x, "moments: x");
  const float* data = x.data_ptr<float>();
  const int64_t n = x.numel();
  const int64_t chunks = std::max<int64_t>(1, (n + kGrain - 1) / kGrain);
  std::vector<double> sums(chunks, 0.0), deviations(chunks, 0.0), maxes(chunks, 0.0), absolutes(chunks, 0.0);
  // Merges (count_b, sum_b, m2_b) into (count, sum, m2): Chan's update, with means as sum / count.
  const auto merge = [](double& count, double& sum, double& m2, double count_b, double sum_b, double m2_b) {
    if (count_b == 0.0) return;
    if (count > 0.0) {
      const double delta = sum_b / count_b - sum / count;
      m2 += delta * delta * count * count_b / (count + count_b);
    }
    count += count_b;
    sum += sum_b;
    m2 += m2_b;
  };
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * kGrain, hi = std::min(n, lo + kGrain);
      double count = 0.0, cs = 0.0, cq = 0.0, cm = 0.0, ca = 0.0;
      for (int64_t b = lo; b < hi; b += kMomentsBlock) {
        const int64_t e = std::min(hi, b + kMomentsBlock);
        // 8 independent lanes break the add dependency chain and let the compiler use SIMD.
        float s[8] = {}, m[8] = {}, a[8] = {};
        int64_t i = b;
        for (; i + 8 <= e; i += 8)
          for (int j = 0; j < 8; ++j) {
            const float v = data[i + j];
            s[j] += v;
            m[j] = std::max(m[j], std::fabs(v));
            a[j] += std::fabs(v);
          }
        for (; i < e; ++i) {
          s[0] += data[i];
          m[0] = std::max(m[0], std::fabs(data[i]));
          a[0] += std::fabs(data[i]);
        }
        float block_sum = 0.f, block_max = 0.f;
        double block_abs = 0.0;
        for (int j = 0; j < 8; ++j) {
          block_sum += s[j];
          block_max = std::max(block_max, m[j]);
          block_abs += a[j];
        }
        if (!std::isfinite(block_abs) && std::isfinite(block_max)) {  // a lane's float32 sum overflowed (|x| above
          block_abs = 0.0;                                              // ~2.6e36): summed again in float64
          for (i = b; i < e; ++i) block_abs += std::fabs(data[i]);
        }
        ca += block_abs;
        cm = std::max<double>(cm, block_max);
        // The mean and deviations times 2^-k, with 2^k the block's max |x| rounded up to a power of two: exact (the
        // same bits as unscaled), and the deviations' squares neither overflow (|x| above ~1.8e19) nor underflow
        // (below ~1e-19) float32. A block whose sum overflows (|x| above ~1e34) is summed again, scaled.
        int exponent = 0;
        if (std::isfinite(block_max)) std::frexp(block_max, &exponent);
        exponent = std::clamp(exponent, -125, 126);  // 2^-k a normal float32
        const float scale = std::ldexp(1.f, -exponent);
        float scaled_sum = block_sum * scale;
        if (!std::isfinite(block_sum) && std::isfinite(block_max)) {
          scaled_sum = 0.f;
          for (i = b; i < e; ++i) scaled_sum += data[i] * scale;
        }
        const float mean = scaled_sum / static_cast<float>(e - b);
        float q[8] = {};
        for (i = b; i + 8 <= e; i += 8)
          for (int j = 0; j < 8; ++j) {
            const float d = data[i + j] * scale - mean;
            q[j] += d * d;
          }
        for (; i < e; ++i) {
          const float d = data[i] * scale - mean;
          q[0] += d * d;
        }
        double block_m2 = 0.0;
        for (int j = 0; j < 8; ++j) block_m2 += q[j];
        merge(count, cs, cq, static_cast<double>(e - b), std::ldexp(static_cast<double>(scaled_sum), exponent),
              std::ldexp(block_m2, 2 * exponent));
      }
      sums[c] = cs;
      deviations[c] = cq;
      maxes[c] = cm;
      absolutes[c] = ca;
    }
  });
  double count = 0.0, s = 0.0, q = 0.0, m = 0.0, a = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {  // fixed order: the same result for any thread count
    merge(count, s, q, static_cast<double>(std::min(n, (c + 1) * kGrain) - c * kGrain), sums[c], deviations[c]);
    m = std::max(m, maxes[c]);
    a += absolutes[c];
  }
  return torch::tensor({s, q, m, a}, torch::kFloat64);
}

// Stochastic ternarization (TernGrad eq. 2 with clipping, eq. 5) fused with 2-bit packing:
// a_k = min(|x_k|, clip); code_k = sign(x_k) if u_k * scaler < a_k else 0, u_k ~ U[0, 1).
// E[decoded] = sign(x_k) * a_k: unbiased for the clipped gradient when scaler >= max_k a_k.
torch::Tensor ternarize_pack(const torch::Tensor& x, double scaler, double clip, int64_t seed) {
  check_float_contiguous(x, "ternarize_pack: x");
  TORCH_CHECK(scaler >= 0.0, "ternarize_pack: scaler must be >= 0, got ", scaler);
  const int64_t n = x.numel();
  const int64_t nbytes = (n + 3) / 4;
  auto out = torch::empty({nbytes}, torch::kUInt8);
  if (n == 0) return out;
  const float* src = x.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const float s = static_cast<float>(scaler);
  const float c = static_cast<float>(clip);
  const uint64_t key = static_cast<uint64_t>(seed) * 0xD1B54A32D192ED03ULL;
  if (s == 0.f) {
    std::fill(dst, dst + nbytes, 0);
    return out;
  }
  at::parallel_for(0, nbytes, kGrain / 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint64_t r0 = splitmix64(key + 2 * b), r1 = splitmix64(key + 2 * b + 1);
      const uint32_t bits[4] = {static_cast<uint32_t>(r0), static_cast<uint32_t>(r0 >> 32),
                                static_cast<uint32_t>(r1), static_cast<uint32_t>(r1 >> 32)};
      const int64_t base = 4 * b;
      const int lanes = static_cast<int>(std::min<int64_t>(4, n - base));
      uint8_t byte = 0;
      for (int j = 0; j < lanes; ++j) {
        const float v = src[base + j];
        const float a = std::min(std::fabs(v), c);
        // Branch-free: the draw is random, so a branch here would mispredict half the time.
        const uint32_t keep = uniform24(bits[j]) * s < a;
        const uint32_t code = keep << static_cast<uint32_t>(v < 0.f);  // 0, 1 (+1) or 2 (-1)
        byte |= static_cast<uint8_t>(code << (2 * j));
      }
      dst[b] = byte;
    }
  });
  return out;
}

// Decodes and sums ternary payloads: packed is uint8 [R, ceil(n/4)] (rows at any stride), scales float32 [R] (at any
// stride); returns float32 [n] with out_k = sum_r scales_r * t_{r,k}.
torch::Tensor unpack_sum(const torch::Tensor& packed, const torch::Tensor& scales, int64_t n) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8 && packed.dim() == 2 &&
                  packed.stride(1) == 1,
              "unpack_sum: packed must be a CPU uint8 tensor [R, nbytes] with contiguous rows");
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == torch::kFloat32 && scales.dim() == 1,
              "unpack_sum: scales must be a CPU float32 tensor [R] (any stride), got ", scales.sizes());
  const int64_t ranks = packed.size(0), nbytes = packed.size(1);
  TORCH_CHECK(scales.numel() == ranks, "unpack_sum: ", ranks, " payloads but ", scales.numel(), " scales");
  const int64_t scale_stride = scales.stride(0);  // gathered payloads' scalars lie at a step: no copy
  TORCH_CHECK(nbytes == (n + 3) / 4, "unpack_sum: ", nbytes, " bytes per payload cannot hold ", n,
              " elements (expected ", (n + 3) / 4, ")");
  auto out = torch::empty({n}, torch::kFloat32);
  if (n == 0) return out;
  const int64_t stride = ranks > 1 ? packed.stride(0) : nbytes;  // rows at any stride: gathered payloads, no copy
  // lut[byte][j] = value of element j in that byte.
  static const auto lut = [] {
    std::vector<float> t(256 * 4);
    for (int byte = 0; byte < 256; ++byte)
      for (int j = 0; j < 4; ++j) {
        const int code = (byte >> (2 * j)) & 3;
        t[byte * 4 + j] = code == 1 ? 1.f : (code == 2 ? -1.f : 0.f);
      }
    return t;
  }();
  const uint8_t* src = packed.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t full = n / 4;
  const auto decode = [&](int64_t b, float* acc) {
    for (int j = 0; j < 4; ++j) acc[j] = 0.f;
    for (int64_t r = 0; r < ranks; ++r) {
      const float* e = &lut[src[r * stride + b] * 4];
      const float s = sc[r * scale_stride];
      for (int j = 0; j < 4; ++j) acc[j] += s * e[j];
    }
  };
  at::parallel_for(0, full, kGrain / 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) decode(b, dst + 4 * b);
  });
  if (full < nbytes) {  // the last, partly filled byte
    float acc[4];
    decode(full, acc);
    std::copy(acc, acc + (n - 4 * full), dst + 4 * full);
  }
  return out;
}

}  // namespace hvdcomp
