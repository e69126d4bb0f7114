// fused_moe tensor-core instances for bf16.
#include "cuda/fused_moe_launch.h"
#include "cuda/fused_moe_sm80.cuh"

namespace moelora::cuda {

void fused_moe_sm80_bf16(const detail::GemmParams& p, int block_m, cudaStream_t stream) {
  switch (block_m) {
    case 64: launch_fused_moe_sm80<cute::bfloat16_t, 64>(p, stream); break;
    case 32: launch_fused_moe_sm80<cute::bfloat16_t, 32>(p, stream); break;
    case 16: launch_fused_moe_sm80<cute::bfloat16_t, 16>(p, stream); break;
    default: throw Error("moelora.fused_moe: no tensor-core instance for tile height " + std::to_string(block_m));
  }
}

}  // namespace moelora::cuda
