// fused_moe W8A8 instances for int8 operands (mma.sync m16n8k32, s32 accumulation; sm_80+).
#include "cuda/fused_moe_launch.h"
#include "cuda/fused_moe_w8a8.cuh"

namespace moelora::cuda {
void fused_moe_w8a8_int8(const detail::GemmParams& p, int block_m, cudaStream_t stream) {
  dispatch_fused_moe_w8a8<int8_t>(p, block_m, stream);
}
}  // namespace moelora::cuda
