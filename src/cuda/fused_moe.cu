// fused_moe launcher: picks the kernel and tile for a call. No sync, no allocation.
#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/fused_moe_launch.h"
#include "cuda/fused_moe_simt.cuh"
#include "cuda/numeric.cuh"

namespace moelora::cuda {
namespace {

// The tensor-core kernel copies 16-byte chunks of K-contiguous rows.
bool tensor_core_loadable(const detail::GemmParams& p) {
  constexpr int64_t kElems = 8;  // 16 bytes of a 16-bit type
  return p.dtype != DType::kFloat32 && p.K % kElems == 0 && p.a_stride_k == 1 && p.w_stride_k == 1 &&
         p.a_stride_row % kElems == 0 && p.w_stride_n % kElems == 0 && p.w_stride_expert % kElems == 0 &&
         aligned16(p.a) && aligned16(p.w);
}

// Tallest tile that stays inside one alignment block (so one expert per tile).
int tile_rows(int64_t block_size) {
  for (int rows : {64, 32, 16}) {
    if (block_size % rows == 0) return rows;
  }
  return 0;
}

}  // namespace

void fused_moe(const detail::GemmParams& p, Stream stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.max_num_blocks == 0 || p.N == 0 || p.num_slots == 0) return;
  if (tensor_core_loadable(p) && tile_rows(p.block_size) > 0) {
    if (p.dtype == DType::kBFloat16) {
      fused_moe_sm80_bf16(p, tile_rows(p.block_size), s);
    } else {
      fused_moe_sm80_fp16(p, tile_rows(p.block_size), s);
    }
    return;
  }
  dispatch_float(p.dtype, [&](auto t) { launch_fused_moe_simt<decltype(t)>(p, s); });
}

}  // namespace moelora::cuda
