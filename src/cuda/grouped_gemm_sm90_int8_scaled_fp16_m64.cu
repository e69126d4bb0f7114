// The grouped W8A8 GEMM instance: int8 scaled operands, fp16 output, 64 x 128 pingpong tiles (grouped_gemm_sm90.cuh).
#include "cuda/grouped_gemm_sm90.cuh"

namespace moelora::cuda {
template void grouped_gemm_sm90<GroupedGemmOperands::kInt8Scaled, DType::kFloat16, GroupedGemmTiles::kPingpong64>(const GroupedGemmRun&,
                                                                                                cudaStream_t);
}  // namespace moelora::cuda
