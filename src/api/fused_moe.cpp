// The fused_moe op (one grouped GEMM over aligned blocks) and its backend parameters,
// which fused_experts fills for both of its GEMMs.
#include "api/fused_moe.h"

#include <algorithm>
#include <string>

#include "api/api_util.h"
#include "api/kernel_config.h"
#include "api/validate.h"

namespace moelora {

using namespace detail;

namespace detail {

GemmParams gemm_params(const TensorView& a, const TensorView& w, const TensorView& out,
                       const TensorView& sorted_token_ids, const TensorView& expert_ids,
                       const TensorView& num_tokens_post_padded, const TensorView* topk_weights,
                       int64_t top_k, int64_t block_size, GemmTile tile) {
  return GemmParams{
      .dtype = out.dtype,  // a's and w's too, unless they are 8-bit (quant)
      .a = a.data,
      .a_stride_row = a.strides[0],
      .a_stride_k = a.strides[1],
      .w = w.data,
      .w_stride_expert = w.strides[0],
      .w_stride_n = w.strides[1],
      .w_stride_k = w.strides[2],
      .out = out.data,
      .out_stride_row = out.strides[0],
      .out_stride_n = out.strides[1],
      .topk_weights = topk_weights ? static_cast<const float*>(topk_weights->data) : nullptr,
      .topk_weights_cols = topk_weights ? topk_weights->shape[1] : 1,
      .topk_weights_stride_row = topk_weights ? topk_weights->strides[0] : 0,
      .topk_weights_stride_col = topk_weights ? topk_weights->strides[1] : 0,
      .sorted_token_ids = static_cast<const int32_t*>(sorted_token_ids.data),
      .sorted_token_ids_size = sorted_token_ids.shape[0],
      .expert_ids = static_cast<const int32_t*>(expert_ids.data),
      .num_tokens_post_padded = static_cast<const int32_t*>(num_tokens_post_padded.data),
      .max_num_blocks = std::min<int64_t>(expert_ids.shape[0], ceil_div(sorted_token_ids.shape[0], block_size)),
      .num_rows = a.shape[0],
      .num_slots = out.shape[0],
      .num_experts = w.shape[0],
      .N = w.shape[1],
      .K = w.shape[2],
      .top_k = top_k,
      .block_size = block_size,
      .tile = tile,
  };
}

}  // namespace detail

void fused_moe(const FusedMoeArgs& args, Stream stream) {
  const char* op = "fused_moe";
  const TensorView& a = args.a;
  float_dtype(ArgCheck(op, "a", a).rank(2));
  const Device device = a.device;
  ArgCheck(op, "w", args.w).rank(3).same_dtype(a, "a").on(device, "a").dim(2, a.shape[1], "K, from 'a'");
  if (args.top_k < 1) fail(op, "argument 'top_k' expected >= 1, got " + std::to_string(args.top_k));
  ArgCheck(op, "out", args.out)
      .rank(2).same_dtype(a, "a").on(device, "a")
      .dim(0, a.shape[0] * args.top_k, "num_slots = a rows * top_k")
      .dim(1, args.w.shape[1], "N, from 'w'");
  check_block_size(op, args.block_size, /*multiple_of_16=*/true);
  detail::check_gemm_tile(op, "tile", args.tile, args.block_size);
  ArgCheck(op, "sorted_token_ids", args.sorted_token_ids).rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "a");
  ArgCheck(op, "expert_ids", args.expert_ids).rank(1).dtype(DType::kInt32).unit_stride(0).on(device, "a")
      .dim_at_least(0, ceil_div(args.sorted_token_ids.shape[0], args.block_size),
                    "one expert per block of 'sorted_token_ids'");
  ArgCheck(op, "num_tokens_post_padded", args.num_tokens_post_padded)
      .rank(1).dtype(DType::kInt32).dim(0, 1, "a single count").on(device, "a");
  const TensorView* topk_weights = nullptr;
  if (args.mul_routed_weight) {
    if (!args.topk_weights) fail(op, "argument 'topk_weights' expected a tensor when mul_routed_weight, got none");
    ArgCheck(op, "topk_weights", *args.topk_weights).rank(2).dtype(DType::kFloat32).on(device, "a");
    if (args.topk_weights->numel() != args.out.shape[0]) {
      fail(op, "argument 'topk_weights' expected " + std::to_string(args.out.shape[0]) +
                   " elements (one per slot), got shape " + args.topk_weights->shape_string());
    }
    topk_weights = args.topk_weights;
  }
  check_disjoint_writes(op, {{&args.out, "out"}},
                        {{&a, "a"}, {&args.w, "w"}, {&args.sorted_token_ids, "sorted_token_ids"},
                         {&args.expert_ids, "expert_ids"},
                         {&args.num_tokens_post_padded, "num_tokens_post_padded"}, {topk_weights, "topk_weights"}});
  if (on_cuda(a)) require_cuda_backend(op);
  if (!on_cuda(a)) {
    // On the CPU the block experts are readable: an id outside [-1, E) would index past w.
    const int64_t used_blocks =
        std::min<int64_t>(args.expert_ids.shape[0],
                          ceil_div(*static_cast<const int32_t*>(args.num_tokens_post_padded.data), args.block_size));
    TensorView used = args.expert_ids;
    used.shape[0] = std::max<int64_t>(used_blocks, 0);
    check_cpu_ids(op, "expert_ids", used, -1, args.w.shape[0]);
  }
  run_gemm(gemm_params(a, args.w, args.out, args.sorted_token_ids, args.expert_ids, args.num_tokens_post_padded,
                       topk_weights, args.top_k, args.block_size, args.tile),
           device, stream);
}

}  // namespace moelora
