// fused_moe mma.sync instances for bf16.
#include "cuda/fused_moe_launch.h"
#include "cuda/fused_moe_sm80.cuh"

namespace moelora::cuda {

void fused_moe_sm80_bf16(const detail::GemmParams& p, int block_m, int block_n, cudaStream_t stream) {
  dispatch_fused_moe_sm80<cute::bfloat16_t>(p, block_m, block_n, stream);
}

}  // namespace moelora::cuda
