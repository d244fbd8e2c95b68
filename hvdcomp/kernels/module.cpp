// The Python module of hvdcomp's fused CPU kernels: one extension built from every .cpp in this folder.
#include "common.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moments", &hvdcomp::moments,
        "float64 [sum, sum of squared deviations from the mean, max |x|, sum |x|] of a float32 CPU tensor");
  m.def("ternarize_pack", &hvdcomp::ternarize_pack, "TernGrad stochastic ternarization fused with 2-bit packing");
  m.def("unpack_sum", &hvdcomp::unpack_sum, "Decode and sum 2-bit ternary payloads with per-payload scales");
  m.def("randomk_select", &hvdcomp::randomk_select,
        "Random-k: one seeded position per stratum, values gathered (and scaled by the stratum's length)");
  m.def("quantize_levels", &hvdcomp::quantize_levels,
        "ORQ / QSGD: per-bucket levels and stochastic rounding fused with b-bit packing");
  m.def("quantize_binary", &hvdcomp::quantize_binary, "BinGrad / 1-bit SGD: per-bucket two levels, 1-bit codes");
  m.def("pack_signs", &hvdcomp::pack_signs, "Signs as 1-bit codes (exact zeros on a seeded fair coin)");
  m.def("sketch_candidates", &hvdcomp::sketch_candidates, "Items that pass a packed Bloom filter, ascending");
  m.def("sketch_peel", &hvdcomp::sketch_peel, "Peel a summed count sketch over its candidates (float64 values)");
  m.def("excess_moments", &hvdcomp::excess_moments,
        "Threshold's fit: float64 [sum of max(|x| - t, 0), count of |x| > t] in one pass");
  m.def("decode_sum", &hvdcomp::decode_sum, "Decode and sum R ranks' b-bit payloads through per-bucket tables");
  m.def("decode_subtract", &hvdcomp::decode_subtract, "residual -= one decoded b-bit payload, in place");
  m.def("momentum_step", &hvdcomp::momentum_step,
        "Momentum correction and error feedback's accumulation in one pass: u <- m u + g (or g m), residual += u");
  m.def("sign_vote", &hvdcomp::sign_vote, "signSGD's majority vote over R ranks' signs, times their summed scales");
}
