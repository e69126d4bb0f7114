// The grouped W8A8 GEMM instance: fp8 blockwise operands, bf16 output, 128 x 128 cooperative tiles (grouped_gemm_sm90.cuh).
#include "cuda/grouped_gemm_sm90.cuh"

namespace moelora::cuda {
void grouped_gemm_sm90_fp8_blockwise_bf16_m128(const GroupedGemmRun& r, cudaStream_t stream) {
  grouped_sm90::run_grouped_gemm<cutlass::float_e4m3_t, cutlass::bfloat16_t, grouped_sm90::Scaling::kBlockwise, GroupedGemmTiles::kCooperative128>(
      r, stream, "grouped_gemm_sm90_fp8_blockwise_bf16_m128");
}
}  // namespace moelora::cuda
