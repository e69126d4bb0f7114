// The moe_sum_reduce op: sums each token's top_k rows into its output row, scaled.
#include "api/api_util.h"
#include "api/validate.h"
#include "moelora/ops.h"

namespace moelora {

using namespace detail;

void moe_sum_reduce(const TensorView& input, const TensorView& out, float routed_scaling_factor, Stream stream) {
  const char* op = "moe_sum_reduce";
  float_dtype(ArgCheck(op, "input", input).rank(3).unit_stride(2));
  ArgCheck(op, "out", out)
      .rank(2).same_dtype(input, "input").on(input.device, "input").unit_stride(1)
      .dim(0, input.shape[0], "tokens of 'input'").dim(1, input.shape[2], "hidden size of 'input'")
      .no_overlap(input, "input");
  if (on_cuda(input)) require_cuda_backend(op);
  const detail::SumReduceParams p{
      .dtype = input.dtype,
      .input = input.data,
      .input_stride_token = input.strides[0],
      .input_stride_k = input.strides[1],
      .out = out.data,
      .out_stride_token = out.strides[0],
      .num_tokens = input.shape[0],
      .top_k = input.shape[1],
      .hidden = input.shape[2],
      .scale = routed_scaling_factor,
  };
  run_sum_reduce(p, input.device, stream);
}

}  // namespace moelora
