// The grouped W8A8 GEMM instance: fp8 blockwise operands, bf16 output (grouped_gemm_sm90.cuh).
#include "cuda/grouped_gemm_sm90.cuh"

namespace moelora::cuda {
void grouped_gemm_sm90_fp8_blockwise_bf16(const GroupedGemmRun& r, cudaStream_t stream) {
  grouped_sm90::run_grouped_gemm<cutlass::float_e4m3_t, cutlass::bfloat16_t, grouped_sm90::Scaling::kBlockwise>(r, stream,
                                                                                 "grouped_gemm_sm90_fp8_blockwise_bf16");
}
}  // namespace moelora::cuda
