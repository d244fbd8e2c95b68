// The Python module of hvdcomp's fused CPU kernels: one extension built from every .cpp in this folder.
#include "common.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moments", &hvdcomp::moments, "float64 [sum, sum of squares, max |x|] of a float32 CPU tensor");
  m.def("ternarize_pack", &hvdcomp::ternarize_pack, "TernGrad stochastic ternarization fused with 2-bit packing");
  m.def("unpack_sum", &hvdcomp::unpack_sum, "Decode and sum 2-bit ternary payloads with per-payload scales");
  m.def("randomk_select", &hvdcomp::randomk_select,
        "Random-k: one seeded position per stratum, values gathered (and scaled by the stratum's length)");
}
