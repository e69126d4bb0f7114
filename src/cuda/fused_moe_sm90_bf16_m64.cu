// fused_moe wgmma instances for bf16, tiles of 64 rows.
#include <string>

#include "cuda/fused_moe_launch.h"
#include "cuda/fused_moe_sm90.cuh"

namespace moelora::cuda {

void fused_moe_sm90_bf16_m64(const detail::GemmParams& p, int block_n, cudaStream_t stream) {
  using T = cute::bfloat16_t;
  switch (block_n) {
    case 128: launch_fused_moe_sm90<T, 64, 128>(p, stream); break;
    case 256: launch_fused_moe_sm90<T, 64, 256>(p, stream); break;
    default: throw Error("moelora.fused_moe: no sm90 instance for tile 64x" + std::to_string(block_n));
  }
}

}  // namespace moelora::cuda
