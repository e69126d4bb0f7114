// Launchers of the fused_moe kernel instances, one translation unit per family and
// element type so they compile in parallel. fused_moe.cu picks one per call.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"

namespace moelora::cuda {

// mma.sync (sm_80+): bf16/fp16, K % 8 == 0, unit K stride, 16-byte aligned rows.
// block_m 16|32|64 dividing p.block_size; block_n 64|128.
void fused_moe_sm80_bf16(const detail::GemmParams& p, int block_m, int block_n, cudaStream_t stream);
void fused_moe_sm80_fp16(const detail::GemmParams& p, int block_m, int block_n, cudaStream_t stream);

// wgmma (sm_90a): same operand rules; block_m 64|128 dividing p.block_size; block_n 128|256;
// cluster_m 1|2.
void fused_moe_sm90_bf16_m64(const detail::GemmParams& p, int block_n, int cluster_m, cudaStream_t stream);
void fused_moe_sm90_bf16_m128(const detail::GemmParams& p, int block_n, int cluster_m, cudaStream_t stream);
void fused_moe_sm90_fp16_m64(const detail::GemmParams& p, int block_n, int cluster_m, cudaStream_t stream);
void fused_moe_sm90_fp16_m128(const detail::GemmParams& p, int block_n, int cluster_m, cudaStream_t stream);

// wgmma weight-only (issue 30): GemmParams::weight_only's packed 4-/8-bit experts, converted
// by the consumer warpgroups; K % 32 == 0; block_m 64|128 dividing p.block_size; block_n 128|256;
// 1-CTA clusters.
void fused_moe_sm90_weight_only_bf16_w4(const detail::GemmParams& p, int block_m, int block_n, cudaStream_t stream);
void fused_moe_sm90_weight_only_bf16_w8(const detail::GemmParams& p, int block_m, int block_n, cudaStream_t stream);
void fused_moe_sm90_weight_only_fp16_w4(const detail::GemmParams& p, int block_m, int block_n, cudaStream_t stream);
void fused_moe_sm90_weight_only_fp16_w8(const detail::GemmParams& p, int block_m, int block_n, cudaStream_t stream);

// W8A8 mma.sync (issue 28): 8-bit a and w with GemmParams::quant's scales, out bf16/fp16;
// K % 16 == 0, unit K stride, 16-byte aligned rows, quant.block_k == 128 for block scales.
// block_m 16|32|64 dividing p.block_size (the largest instance of the scale kind at
// most block_m runs); 128 weight rows a tile. fp8 needs sm_89+.
void fused_moe_w8a8_fp8(const detail::GemmParams& p, int block_m, cudaStream_t stream);
void fused_moe_w8a8_int8(const detail::GemmParams& p, int block_m, cudaStream_t stream);

}  // namespace moelora::cuda
