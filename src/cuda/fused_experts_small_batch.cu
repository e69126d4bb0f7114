// fused_experts' small-batch path: the entry points, and the instances whose operands are
// the layer's own bf16/fp16 (the 8-bit ones: fused_experts_small_batch_{fp8,int8}.cu; the
// weight-only ones: fused_experts_small_batch_weight_only.cu).
#include "cuda/fused_experts_small_batch.cuh"

namespace moelora::cuda {

using namespace small_batch;

namespace {

// Weight-only experts: 16-byte aligned packed rows of a K % 32 == 0 (whole 16-byte lane
// chunks, each in one scale group), 16-byte aligned 16-bit rows of x and act.
bool weight_only_supported(const SmallBatchMoeParams& p) {
  const int64_t slots = p.num_tokens * p.top_k;
  auto packed_rows = [](const detail::WeightOnlyParams& q) {
    return aligned16(q.w) && q.w_stride_expert % 16 == 0 && q.w_stride_n % 16 == 0 &&
           (q.group_size == 0 || q.group_size % 32 == 0);
  };
  return (p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16) && slots >= 1 &&
         slots <= kSmallBatchMaxSlots8Bit && p.H % 32 == 0 && p.I % 32 == 0 && p.H < (int64_t(1) << 30) &&
         p.I < (int64_t(1) << 27) && p.w2q.enabled && p.w13q.bits == p.w2q.bits && packed_rows(p.w13q) &&
         packed_rows(p.w2q) && p.x_stride_token % 8 == 0 && aligned16(p.x) && aligned16(p.act);
}

}  // namespace

bool fused_experts_small_batch_supported(const SmallBatchMoeParams& p) {
  if (p.w13q.enabled) return weight_only_supported(p);
  const int64_t slots = p.num_tokens * p.top_k;
  // Elements of a 16-byte chunk: 8 of a 16-bit type, 16 of an 8-bit one (W8A8).
  const int64_t chunk = p.quant13.enabled ? kChunkBytes : kChunkBytes / 2;
  const bool rows_aligned = p.w13_stride_k == 1 && p.w2_stride_k == 1 && p.x_stride_token % chunk == 0 &&
                            p.w13_stride_expert % chunk == 0 &&
                            p.w13_stride_n % chunk == 0 && p.w2_stride_expert % chunk == 0 &&
                            p.w2_stride_n % chunk == 0 && aligned16(p.x) && aligned16(p.w13) && aligned16(p.w2) &&
                            aligned16(p.act) && (!p.quant13.enabled || aligned16(p.act_quantized));
  // A 16-bit chunk, or an 8-bit MMA step, must not straddle two K blocks of the block scales.
  const bool blocks = !p.quant13.enabled || p.quant13.w_scales != ScaleGranularity::kBlock ||
                      (p.quant13.block_k % kMmaStep == 0 && p.quant2.block_k % kMmaStep == 0);
  // int8 MMAs sum a slice of K in int32 between folds: 127 x 127 x K stays below 2^31 for
  // K <= 2^17.
  const bool int32_sums = p.quant13.element != DType::kInt8 || (p.H <= (int64_t(1) << 17) && p.I <= (int64_t(1) << 17));
  const int64_t max_slots = p.quant13.enabled ? kSmallBatchMaxSlots8Bit : kSmallBatchMaxSlots;
  // I < 2^27: GEMM1's units (distinct experts x I / 8, 128 x 2^24 at most) stay in 32 bits.
  return (p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16) && slots >= 1 && slots <= max_slots &&
         p.H % chunk == 0 && p.I % chunk == 0 && p.H < (int64_t(1) << 30) && p.I < (int64_t(1) << 27) &&
         rows_aligned && blocks && (!p.quant13.enabled || int32_sums);
}

void fused_experts_small_batch(const SmallBatchMoeParams& p, Stream stream, int stages) {
  if (!fused_experts_small_batch_supported(p)) {
    throw Error("moelora.fused_experts: the small-batch kernels do not take this call (at most " +
                std::to_string(kSmallBatchMaxSlots) + " slots, " + std::to_string(kSmallBatchMaxSlots8Bit) +
                " with 8-bit experts; bf16/fp16, 16-byte aligned rows)");
  }
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.w13q.enabled) {
    launch_weight_only(p, s, stages);
  } else if (p.quant13.enabled) {
    p.quant13.element == DType::kInt8 ? launch_int8(p, s, stages) : launch_fp8(p, s, stages);
  } else if (p.dtype == DType::kBFloat16) {
    dispatch_activation<__nv_bfloat16, __nv_bfloat16>(p, s, stages);
  } else {
    dispatch_activation<__half, __half>(p, s, stages);
  }
}

}  // namespace moelora::cuda
