// The grouped 16-bit GEMM instance: bf16 operands and output, 64 x 128 pingpong tiles (grouped_gemm_sm90.cuh).
#include "cuda/grouped_gemm_sm90.cuh"

namespace moelora::cuda {
template void grouped_gemm_sm90<GroupedGemmOperands::k16Bit, DType::kBFloat16, GroupedGemmTiles::kPingpong64>(const GroupedGemmRun&,
                                                                                    cudaStream_t);
}  // namespace moelora::cuda
