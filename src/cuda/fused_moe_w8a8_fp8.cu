// fused_moe W8A8 instances for fp8 e4m3 operands (mma.sync m16n8k32; the sm_89+ code
// paths run on the sm_90a build, the sm_80 build traps and is never launched).
#include "cuda/fused_moe_launch.h"
#include "cuda/fused_moe_w8a8.cuh"

namespace moelora::cuda {
void fused_moe_w8a8_fp8(const detail::GemmParams& p, int block_m, cudaStream_t stream) {
  dispatch_fused_moe_w8a8<cute::float_e4m3_t>(p, block_m, stream);
}
}  // namespace moelora::cuda
