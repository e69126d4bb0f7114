// fused_moe mma.sync instances for fp16.
#include "cuda/fused_moe_launch.h"
#include "cuda/fused_moe_sm80.cuh"

namespace moelora::cuda {

void fused_moe_sm80_fp16(const detail::GemmParams& p, int block_m, int block_n, cudaStream_t stream) {
  dispatch_fused_moe_sm80<cute::half_t>(p, block_m, block_n, stream);
}

}  // namespace moelora::cuda
