// The grouped W8A8 GEMM instance: fp8 blockwise operands, bf16 output, 64 x 128 pingpong tiles (grouped_gemm_sm90.cuh).
#include "cuda/grouped_gemm_sm90.cuh"

namespace moelora::cuda {
void grouped_gemm_sm90_fp8_blockwise_bf16_m64(const GroupedGemmRun& r, cudaStream_t stream) {
  grouped_sm90::run_grouped_gemm<cutlass::float_e4m3_t, cutlass::bfloat16_t, grouped_sm90::Scaling::kBlockwise, GroupedGemmTiles::kPingpong64>(
      r, stream, "grouped_gemm_sm90_fp8_blockwise_bf16_m64");
}
}  // namespace moelora::cuda
