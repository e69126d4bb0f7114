// The gated activation ops: silu_and_mul, gelu_and_mul and swiglu_oai_and_mul, one
// backend kernel with the activation as a parameter.
#include <string>

#include "api/api_util.h"
#include "api/validate.h"
#include "moelora/ops.h"

namespace moelora {

using namespace detail;

namespace {

void run_activation_op(const char* op, detail::ActivationKind kind, const TensorView& input, const TensorView& out,
                       float alpha, float limit, Stream stream) {
  float_dtype(ArgCheck(op, "input", input).rank(2).unit_stride(1));
  if (input.shape[1] % 2 != 0) {
    fail(op, "argument 'input' expected an even last dim (gate and up halves), got shape " + input.shape_string());
  }
  ArgCheck(op, "out", out)
      .rank(2).same_dtype(input, "input").on(input.device, "input").unit_stride(1)
      .dim(0, input.shape[0], "rows of 'input'").dim(1, input.shape[1] / 2, "half the last dim of 'input'")
      .no_overlap(input, "input");
  if (on_cuda(input)) require_cuda_backend(op);
  const detail::ActivationParams p{
      .dtype = input.dtype,
      .out_dtype = input.dtype,
      .kind = kind,
      .input = input.data,
      .input_stride_row = input.strides[0],
      .out = out.data,
      .out_stride_row = out.strides[0],
      .num_rows = input.shape[0],
      .width = out.shape[1],
      .alpha = alpha,
      .limit = limit,
  };
  run_activation(p, input.device, stream);
}

}  // namespace

void silu_and_mul(const TensorView& input, const TensorView& out, Stream stream) {
  run_activation_op("silu_and_mul", detail::ActivationKind::kSiluAndMul, input, out, 0.f, 0.f, stream);
}

void gelu_and_mul(const TensorView& input, const TensorView& out, Stream stream) {
  run_activation_op("gelu_and_mul", detail::ActivationKind::kGeluAndMul, input, out, 0.f, 0.f, stream);
}

void swiglu_oai_and_mul(const TensorView& input, const TensorView& out, float alpha, float limit, Stream stream) {
  if (!(limit > 0.f)) fail("swiglu_oai_and_mul", "argument 'limit' expected > 0, got " + std::to_string(limit));
  run_activation_op("swiglu_oai_and_mul", detail::ActivationKind::kSwigluOai, input, out, alpha, limit, stream);
}

}  // namespace moelora
