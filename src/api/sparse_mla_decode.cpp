// The C++ API of sparse_mla_decode: validate, fill SparseMlaDecodeParams, dispatch.
#include <cmath>
#include <string>

#include "api/validate.h"
#include "common/params.h"
#include "moelora/ops.h"

namespace moelora {

using detail::ArgCheck;
using detail::fail;

namespace {

constexpr const char* kOp = "sparse_mla_decode";

void check_shape_numbers(int64_t num_tokens, int64_t num_heads, int64_t topk, int num_splits) {
  if (num_tokens < 0) fail(kOp, "argument 'num_tokens' expected >= 0, got " + std::to_string(num_tokens));
  if (num_heads < 1 || num_heads > kMlaMaxHeads) {
    fail(kOp, "argument 'num_heads' expected a value in [1, " + std::to_string(kMlaMaxHeads) + "], got " +
                  std::to_string(num_heads));
  }
  if (topk < 1) fail(kOp, "argument 'topk' expected >= 1, got " + std::to_string(topk));
  if (num_splits < 0 || num_splits > kMlaMaxSplits) {
    fail(kOp, "argument 'num_splits' expected 0 (auto) or a value in [1, " + std::to_string(kMlaMaxSplits) +
                  "], got " + std::to_string(num_splits));
  }
}

// The workspace bytes of a resolved split count: the splits' fp32 parts on CUDA.
int64_t workspace_bytes_for(int64_t num_tokens, int64_t num_heads, Device device, int num_splits) {
  if (device.type == DeviceType::kCPU || num_splits == 1) return 0;
#ifdef MOELORA_WITH_CUDA
  return cuda::sparse_mla_decode_workspace_bytes(num_tokens, num_heads, num_splits);
#else
  return 0;
#endif
}

}  // namespace

int sparse_mla_decode_num_splits(int64_t num_tokens, int64_t num_heads, int64_t topk, Device device,
                                 int num_splits) {
  check_shape_numbers(num_tokens, num_heads, topk, num_splits);
  if (device.type == DeviceType::kCPU) return 1;
  detail::require_cuda_backend(kOp);
#ifdef MOELORA_WITH_CUDA
  return cuda::sparse_mla_decode_num_splits(num_tokens, num_heads, topk, num_splits);
#else
  return 1;
#endif
}

int64_t sparse_mla_decode_workspace_size(int64_t num_tokens, int64_t num_heads, int64_t topk, Device device,
                                         int num_splits) {
  return workspace_bytes_for(num_tokens, num_heads, device,
                             sparse_mla_decode_num_splits(num_tokens, num_heads, topk, device, num_splits));
}

void sparse_mla_decode(const SparseMlaDecodeArgs& args, Stream stream) {
  const TensorView& q = args.q;
  ArgCheck(kOp, "q", q).rank(3).dtype(DType::kBFloat16).dim(2, kMlaHeadDim, "the MLA head dim 512 + 64").unit_stride(2)
      .rows_aligned(16);
  const int64_t num_tokens = q.shape[0], num_heads = q.shape[1];
  if (num_heads < 1 || num_heads > kMlaMaxHeads) {
    fail(kOp, "argument 'q' expected 1 to " + std::to_string(kMlaMaxHeads) + " heads on dim 1, got shape " +
                  q.shape_string());
  }
  const Device device = q.device;
  ArgCheck(kOp, "kv", args.kv).rank(3).dtype(DType::kBFloat16).on(device, "q")
      .dim(1, 1, "one latent KV head").dim(2, kMlaHeadDim, "the MLA head dim 512 + 64").unit_stride(2)
      .rows_aligned(16);
  ArgCheck(kOp, "indices", args.indices).rank(3).dtype(DType::kInt32).on(device, "q")
      .dim(0, num_tokens, "tokens of 'q'").dim(1, 1, "one latent KV head").unit_stride(2);
  const int64_t topk = args.indices.shape[2];
  if (topk < 1) fail(kOp, "argument 'indices' expected at least 1 index per token on dim 2, got shape " +
                              args.indices.shape_string());
  ArgCheck(kOp, "out", args.out).rank(3).dtype(DType::kBFloat16).on(device, "q")
      .dim(0, num_tokens, "tokens of 'q'").dim(1, num_heads, "heads of 'q'").dim(2, kMlaValueDim, "the value dim 512")
      .unit_stride(2).rows_aligned(4)
      .no_overlap(q, "q").no_overlap(args.kv, "kv").no_overlap(args.indices, "indices");
  if (args.lse) {
    ArgCheck(kOp, "lse", *args.lse).rank(2).dtype(DType::kFloat32).on(device, "q")
        .dim(0, num_tokens, "tokens of 'q'").dim(1, num_heads, "heads of 'q'")
        .no_overlap(q, "q").no_overlap(args.kv, "kv").no_overlap(args.out, "out");
  }
  if (args.topk_length) {
    ArgCheck(kOp, "topk_length", *args.topk_length).rank(1).dtype(DType::kInt32).on(device, "q")
        .dim(0, num_tokens, "tokens of 'q'");
  }
  if (args.attn_sink) {
    ArgCheck(kOp, "attn_sink", *args.attn_sink).rank(1).dtype(DType::kFloat32).on(device, "q")
        .dim(0, num_heads, "heads of 'q'");
  }
  detail::check_disjoint_writes(kOp, {{&args.out, "out"}, {args.lse, "lse"}},
                                {{&q, "q"}, {&args.kv, "kv"}, {&args.indices, "indices"},
                                 {args.topk_length, "topk_length"}, {args.attn_sink, "attn_sink"}});
  if (!std::isfinite(args.softmax_scale) || args.softmax_scale <= 0.0f) {
    fail(kOp, "argument 'softmax_scale' expected a finite value > 0, got " + std::to_string(args.softmax_scale));
  }
  if (device.type == DeviceType::kCUDA) detail::require_cuda_backend(kOp);
  const int num_splits = sparse_mla_decode_num_splits(num_tokens, num_heads, topk, device, args.num_splits);
  const int64_t workspace_bytes = workspace_bytes_for(num_tokens, num_heads, device, num_splits);
  if (workspace_bytes > 0) {
    ArgCheck(kOp, "workspace", args.workspace).rank(1).on(device, "q").contiguous().rows_aligned(256);
    const int64_t given = args.workspace.numel() * int64_t(dtype_size(args.workspace.dtype));
    if (given < workspace_bytes) {
      fail(kOp, "argument 'workspace' expected at least " + std::to_string(workspace_bytes) +
                    " bytes (sparse_mla_decode_workspace_size for " + std::to_string(num_splits) + " splits), got " +
                    std::to_string(given));
    }
    detail::check_disjoint_writes(kOp, {{&args.workspace, "workspace"}},
                                  {{&q, "q"}, {&args.kv, "kv"}, {&args.indices, "indices"}, {&args.out, "out"},
                                   {args.lse, "lse"}, {args.topk_length, "topk_length"},
                                   {args.attn_sink, "attn_sink"}});
  }
  if (num_tokens == 0) return;

  const detail::SparseMlaDecodeParams p{
      .q = q.data,
      .q_stride_token = q.strides[0],
      .q_stride_head = q.strides[1],
      .kv = args.kv.data,
      .kv_stride_row = args.kv.strides[0],
      .indices = static_cast<const int32_t*>(args.indices.data),
      .indices_stride_token = args.indices.strides[0],
      .out = args.out.data,
      .out_stride_token = args.out.strides[0],
      .out_stride_head = args.out.strides[1],
      .lse = args.lse ? static_cast<float*>(args.lse->data) : nullptr,
      .lse_stride_token = args.lse ? args.lse->strides[0] : 0,
      .lse_stride_head = args.lse ? args.lse->strides[1] : 0,
      .topk_length = args.topk_length ? static_cast<const int32_t*>(args.topk_length->data) : nullptr,
      .topk_length_stride = args.topk_length ? args.topk_length->strides[0] : 0,
      .attn_sink = args.attn_sink ? static_cast<const float*>(args.attn_sink->data) : nullptr,
      .attn_sink_stride = args.attn_sink ? args.attn_sink->strides[0] : 0,
      .num_tokens = num_tokens,
      .num_heads = num_heads,
      .num_kv_rows = args.kv.shape[0],
      .topk = topk,
      .softmax_scale = args.softmax_scale,
      .num_splits = num_splits,
      .workspace = workspace_bytes > 0 ? args.workspace.data : nullptr,
  };
#ifdef MOELORA_WITH_CUDA
  if (device.type == DeviceType::kCUDA) {
    cuda::sparse_mla_decode(p, stream);
    return;
  }
#endif
  (void)stream;
  cpu::sparse_mla_decode(p);
}

}  // namespace moelora
