// TMA tensor maps of the sm_90a kernels, built on the host per call (pure host work: no
// sync, no allocation; passed to the kernel as a __grid_constant__ parameter).
#pragma once

#include <cuda.h>

#include "common/params.h"

namespace moelora::cuda {

// The weight tensor map of one fused_moe call: w as [E][halves][rows][K] (gated split:
// gate rows then up rows; gated interleaved: row pairs; ungated: one half of N rows),
// boxes of box_rows x 64 elements with the 128-byte swizzle wgmma reads. Rows and K
// columns out of range arrive as zeros.
struct WeightTensorMap {
  CUtensorMap map;
};

// The activation tensor map of a fused_moe call whose A rows are in sorted order
// (GemmParams::a_rows_sorted): a as [num_rows][K], boxes of box_rows x 64 elements with
// the 128-byte swizzle. Rows and K columns out of range arrive as zeros.
struct ActivationTensorMap {
  CUtensorMap map;
};

// cuTensorMapEncodeTiled (CUDA 12.0 ABI) from the driver, looked up once: the library does
// not link libcuda. Throws when the driver lacks it. (Declared here rather than taken from
// cudaTypedefs.h, which CUTLASS includes inside its own namespace.)
using TensorMapEncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                          const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                                          CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                          CUtensorMapFloatOOBfill);
TensorMapEncodeTiled tensor_map_encode_tiled();

WeightTensorMap make_weight_tensor_map(const detail::GemmParams& p, int box_rows);
// Weight-only experts (GemmParams::weight_only): the packed weights in the same
// coordinates, K in bytes, boxes of box_rows x (64 weights' bytes), no swizzle (the
// consumers convert them into swizzled 16-bit B buffers).
WeightTensorMap make_packed_weight_tensor_map(const detail::GemmParams& p, int box_rows);
ActivationTensorMap make_activation_tensor_map(const detail::GemmParams& p, int box_rows);

}  // namespace moelora::cuda
