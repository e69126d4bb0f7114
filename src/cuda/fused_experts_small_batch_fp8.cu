// fused_experts' small-batch instances on fp8 e4m3 (sm_89+; the sm_80 build traps) operands (W8A8).
#include "cuda/fused_experts_small_batch.cuh"

namespace moelora::cuda::small_batch {

void launch_fp8(const SmallBatchMoeParams& p, cudaStream_t stream, int stages) {
  if (p.dtype == DType::kBFloat16) {
    dispatch_activation<__nv_bfloat16, __nv_fp8_e4m3>(p, stream, stages);
  } else {
    dispatch_activation<__half, __nv_fp8_e4m3>(p, stream, stages);
  }
}

}  // namespace moelora::cuda::small_batch
