// The grouped 16-bit GEMM instance: fp16 operands and output, 128 x 256 cooperative tiles (grouped_gemm_sm90.cuh).
#include "cuda/grouped_gemm_sm90.cuh"

namespace moelora::cuda {
template void grouped_gemm_sm90<GroupedGemmOperands::k16Bit, DType::kFloat16, GroupedGemmTiles::kCooperative128x256>(
    const GroupedGemmRun&, cudaStream_t);
}  // namespace moelora::cuda
