// The grouped W8A8 GEMM instance: fp8 scaled operands, fp16 output, 128 x 128 cooperative tiles (grouped_gemm_sm90.cuh).
#include "cuda/grouped_gemm_sm90.cuh"

namespace moelora::cuda {
template void grouped_gemm_sm90<GroupedGemmOperands::kFp8Scaled, DType::kFloat16, GroupedGemmTiles::kCooperative128>(const GroupedGemmRun&,
                                                                                                cudaStream_t);
}  // namespace moelora::cuda
