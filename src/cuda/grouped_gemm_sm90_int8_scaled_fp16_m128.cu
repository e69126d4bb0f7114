// The grouped W8A8 GEMM instance: int8 scaled operands, fp16 output, 128 x 128 cooperative tiles (grouped_gemm_sm90.cuh).
#include "cuda/grouped_gemm_sm90.cuh"

namespace moelora::cuda {
void grouped_gemm_sm90_int8_scaled_fp16_m128(const GroupedGemmRun& r, cudaStream_t stream) {
  grouped_sm90::run_grouped_gemm<int8_t, cutlass::half_t, grouped_sm90::Scaling::kEpilogue, GroupedGemmTiles::kCooperative128>(
      r, stream, "grouped_gemm_sm90_int8_scaled_fp16_m128");
}
}  // namespace moelora::cuda
