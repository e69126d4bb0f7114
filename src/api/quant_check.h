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

// Runs quantize on `device`'s backend.
void run_quantize(const QuantizeParams& p, Device device, Stream stream);

}  // namespace moelora::detail
