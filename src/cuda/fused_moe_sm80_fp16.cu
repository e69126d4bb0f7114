// fused_moe mma.sync instances for fp16.
#include <string>

#include "cuda/fused_moe_launch.h"
#include "cuda/fused_moe_sm80.cuh"

namespace moelora::cuda {

void fused_moe_sm80_fp16(const detail::GemmParams& p, int block_m, int block_n, cudaStream_t stream) {
  using T = cute::half_t;
  switch (block_m * 1000 + block_n) {
    case 16064: launch_fused_moe_sm80<T, 16, 64>(p, stream); break;
    case 16128: launch_fused_moe_sm80<T, 16, 128>(p, stream); break;
    case 32064: launch_fused_moe_sm80<T, 32, 64>(p, stream); break;
    case 32128: launch_fused_moe_sm80<T, 32, 128>(p, stream); break;
    case 64064: launch_fused_moe_sm80<T, 64, 64>(p, stream); break;
    case 64128: launch_fused_moe_sm80<T, 64, 128>(p, stream); break;
    default:
      throw Error("moelora.fused_moe: no sm80 instance for tile " + std::to_string(block_m) + "x" + std::to_string(block_n));
  }
}

}  // namespace moelora::cuda
