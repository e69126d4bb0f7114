// fused_moe wgmma instances for 8-bit weight-only experts and fp16 activations.
#include "cuda/fused_moe_launch.h"
#include "cuda/fused_moe_sm90_launch.cuh"

namespace moelora::cuda {

void fused_moe_sm90_weight_only_fp16_w8(const detail::GemmParams& p, int block_m, int block_n, cudaStream_t stream) {
  dispatch_fused_moe_sm90_weight_only<cute::half_t, 8>(p, block_m, block_n, stream);
}

}  // namespace moelora::cuda
