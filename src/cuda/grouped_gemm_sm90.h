// The sm_90a grouped GEMMs of fused_experts' grouped path, W8A8 or 16-bit (CUTLASS 4.2
// ptr-array collectives; docs/CUTLASS_GROUPED_FP8.md): plain declarations, so that no file
// outside the instance TUs sees a CUTLASS type.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moelora/ops.h"
#include "moelora/tensor.h"

namespace moelora::cuda {

// One grouped GEMM, all arrays on the device and indexed by group (one group per expert):
//   D_g[M_g, N_g] = scale(A_g[M_g, K_g] · B_g[N_g, K_g]ᵀ)
// problem_shapes holds (M, N, K) as three int32 per group; groups with M = 0 are skipped and
// their pointers never read. Strides are each operand's row stride in elements (K-major A
// and B, N-major D). Scales:
//   blockwise: a_scales[g] -> [M_g, ceil(K/128)] row-major, w_scales[g] -> [ceil(N/128), ceil(K/128)]
//   row-major (both strides exactly as written);
//   epilogue: a_scales[g] -> [M_g] (a_scale_per_row) or one scalar, w_scales[g] -> [N_g]
//   (w_scale_per_col) or one scalar.
//   16-bit operands: no scales (a_scales and w_scales are not read).
struct GroupedGemmRun {
  int num_groups;
  const int32_t* problem_shapes;  // [num_groups][3]
  const void* const* a;
  const int64_t* stride_a;
  const void* const* b;
  const int64_t* stride_b;
  void* const* d;
  const int64_t* stride_d;
  const float* const* a_scales;
  const float* const* w_scales;
  bool a_scale_per_row = false, w_scale_per_col = false;
  // CUTLASS's workspace (detail::kGroupedExpertsCutlassWorkspaceBytes: four 128-byte TMA
  // descriptors per SM), 128-byte aligned; checked against Gemm::get_workspace_size at each
  // run. One GEMM at a time per region: each launch rewrites the descriptors.
  void* workspace;
  int64_t workspace_bytes;
};

// The operands of an instance and where their scales apply (grouped_gemm_sm90.cuh):
// 8-bit with scales, or k16Bit: the output's own type (bf16 or fp16), unscaled.
enum class GroupedGemmOperands { kFp8Blockwise, kFp8Scaled, kInt8Scaled, k16Bit };

// The instances (sm_90a builds only; 1x2 clusters), defined in grouped_gemm_sm90.cuh and
// instantiated one per TU, grouped_gemm_sm90_<operands>_<out>_<tiles>.cu: kOut bf16 or
// fp16, tiles m128 (GroupedGemmTiles::kCooperative128), m64 (kPingpong64) or, 16-bit
// operands only, m128n256 (kCooperative128x256).
template <GroupedGemmOperands kOperands, DType kOut, GroupedGemmTiles kTiles>
void grouped_gemm_sm90(const GroupedGemmRun& r, cudaStream_t stream);

}  // namespace moelora::cuda
