// The grouped W8A8 GEMM instance: int8 scaled operands, bf16 output, 128 x 128 cooperative tiles (grouped_gemm_sm90.cuh).
#include "cuda/grouped_gemm_sm90.cuh"

namespace moelora::cuda {
void grouped_gemm_sm90_int8_scaled_bf16_m128(const GroupedGemmRun& r, cudaStream_t stream) {
  grouped_sm90::run_grouped_gemm<int8_t, cutlass::bfloat16_t, grouped_sm90::Scaling::kEpilogue, GroupedGemmTiles::kCooperative128>(
      r, stream, "grouped_gemm_sm90_int8_scaled_bf16_m128");
}
}  // namespace moelora::cuda
