// Validation shared by the quantized ops (quantize, fused_experts with a QuantScheme).
#pragma once

#include "common/params.h"
#include "moelora/quant.h"
#include "moelora/tensor.h"

namespace moelora::detail {

// Throws moelora::Error naming `op` unless the scheme is consistent (element type,
// power-of-two blocks, block weights paired with per-token-group activations, static
// scales only per tensor). A disabled scheme passes.
void check_quant_scheme(const char* op, const QuantScheme& scheme);

// On the CPU, where they are readable: every scale finite and > 0. (CUDA scales cannot
// be read without a host synchronisation; the Python layer checks them on load.)
void check_scales_finite(const char* op, const char* name, const TensorView& scales);

// The backend parameters of quantize(args) for views already checked (a rank-2 or rank-3
// input, out and scales of matching shapes); block sizes of 0 become the whole dim.
// The quantize op and fused_experts' per-chunk quantization both build them here.
QuantizeParams quantize_params(const QuantizeArgs& args);

// fused_experts on quantized experts (FusedExpertsArgs::quant): checks the scheme, the
// layer dtype (bf16/fp16), w13/w2's element type, the weight scales' layouts, the static
// activation scales, and on CUDA that the device and the kernels take the scheme. Returns
// GEMM1's and GEMM2's GemmQuantParams with the weight scales set (the activation scales
// are each chunk's, set by the orchestration). E: local experts of w13.
// Weight-only schemes: w13 / w2 (the packed weights, their scales and zero points)
// instead, gemm1 / gemm2 disabled.
struct FusedExpertsQuantParams {
  GemmQuantParams gemm1, gemm2;
  WeightOnlyParams w13, w2;
};
FusedExpertsQuantParams check_fused_experts_quant(const char* op, const FusedExpertsArgs& args, int64_t E, int64_t H,
                                                  int64_t I);

// Weight-only schemes (weight_only.cpp): the bytes of a packed row of K weights, and the
// checks of fused_experts' scales and zero points (w13 / w2 themselves checked by the
// caller against packed_weight_cols).
int64_t packed_weight_cols(const QuantScheme& scheme, int64_t K);
FusedExpertsQuantParams check_weight_only_experts(const char* op, const FusedExpertsArgs& args, int64_t E, int64_t H,
                                                  int64_t I);

}  // namespace moelora::detail
