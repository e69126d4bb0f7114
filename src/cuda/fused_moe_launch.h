// Launchers of the fused_moe kernel instances, one translation unit each so they
// compile in parallel. fused_moe.cu picks one per call.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"

namespace moelora::cuda {

// Tensor-core path: bf16/fp16, K % 8 == 0, unit K stride, 16-byte aligned rows.
// block_m is the tile height: 16, 32 or 64, dividing p.block_size.
void fused_moe_sm80_bf16(const detail::GemmParams& p, int block_m, cudaStream_t stream);
void fused_moe_sm80_fp16(const detail::GemmParams& p, int block_m, cudaStream_t stream);

}  // namespace moelora::cuda
