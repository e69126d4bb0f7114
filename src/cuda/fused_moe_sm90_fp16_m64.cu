// fused_moe wgmma instances for fp16, tiles of 64 rows.
#include "cuda/fused_moe_launch.h"
#include "cuda/fused_moe_sm90_launch.cuh"

namespace moelora::cuda {

void fused_moe_sm90_fp16_m64(const detail::GemmParams& p, int block_n, int cluster_m, cudaStream_t stream) {
  dispatch_fused_moe_sm90<cute::half_t, 64>(p, block_n, cluster_m, stream);
}

}  // namespace moelora::cuda
