// The grouped W8A8 GEMM instance: int8 scaled operands, fp16 output, 64 x 128 pingpong tiles (grouped_gemm_sm90.cuh).
#include "cuda/grouped_gemm_sm90.cuh"

namespace moelora::cuda {
void grouped_gemm_sm90_int8_scaled_fp16_m64(const GroupedGemmRun& r, cudaStream_t stream) {
  grouped_sm90::run_grouped_gemm<int8_t, cutlass::half_t, grouped_sm90::Scaling::kEpilogue, GroupedGemmTiles::kPingpong64>(
      r, stream, "grouped_gemm_sm90_int8_scaled_fp16_m64");
}
}  // namespace moelora::cuda
