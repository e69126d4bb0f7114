// fused_experts' small-batch instances on int8 (dp4a) operands (W8A8).
#include "cuda/fused_experts_small_batch.cuh"

namespace moelora::cuda::small_batch {

void launch_int8(const SmallBatchMoeParams& p, cudaStream_t stream, int stages) {
  if (p.dtype == DType::kBFloat16) {
    dispatch_activation<__nv_bfloat16, int8_t>(p, stream, stages);
  } else {
    dispatch_activation<__half, int8_t>(p, stream, stages);
  }
}

}  // namespace moelora::cuda::small_batch
