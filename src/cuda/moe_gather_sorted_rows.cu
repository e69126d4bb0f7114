// moe_gather_sorted_rows on CUDA: fused_experts' input rows in sorted order, so that
// GEMM1 loads each tile's rows as one TMA box (GatherRowsParams). Memory-bound: one warp
// per entry, 16-byte accesses.
#include <algorithm>
#include <stdexcept>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/launch.cuh"
#include "cuda/numeric.cuh"

namespace moelora::cuda {
namespace {

using detail::GatherRowsParams;

constexpr int kWarps = 8;
// 16-byte chunks each lane has in flight: four loads before their four stores.
constexpr int kUnroll = 4;

// Grid-stride over the entries; the grid is sized from max_num_tokens_padded, and
// entries past the device-side count exit. Chunk: uint4 or uint32_t.
template <class Chunk>
__global__ void __launch_bounds__(kWarps * 32)
    moe_gather_sorted_rows_kernel(const GatherRowsParams p, int64_t row_chunks, int64_t input_stride_chunks,
                                  int64_t out_stride_chunks) {
  wait_for_previous_kernel();
  const int64_t num_entries = std::min<int64_t>(*p.num_tokens_post_padded, p.max_num_tokens_padded);
  const int lane = int(threadIdx.x % 32);
  for (int64_t entry = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; entry < num_entries;
       entry += int64_t(gridDim.x) * kWarps) {
    const int32_t slot = p.sorted_token_ids[entry];
    if (slot < 0 || slot >= p.num_slots) continue;  // padding
    if (p.slot_entries && lane == 0) p.slot_entries[slot] = p.expert_ids[entry / p.block_size] >= 0 ? int32_t(entry) : -1;
    const Chunk* src = static_cast<const Chunk*>(p.input) + (slot / p.top_k) * input_stride_chunks;
    Chunk* dst = static_cast<Chunk*>(p.out) + entry * out_stride_chunks;
    for (int64_t c0 = lane; c0 < row_chunks; c0 += 32 * kUnroll) {
      Chunk v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = c0 + 32 * u;
        if (c < row_chunks) v[u] = src[c];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = c0 + 32 * u;
        if (c < row_chunks) dst[c] = v[u];
      }
    }
  }
  allow_next_kernel_launch();
}

}  // namespace

void moe_gather_sorted_rows(const GatherRowsParams& p, Stream stream) {
  if (p.max_num_tokens_padded == 0 || p.width == 0) return;
  const int64_t elem = int64_t(dtype_size(p.dtype)), row_bytes = p.width * elem;
  auto aligned_to = [&](int64_t bytes) {
    return row_bytes % bytes == 0 && (p.input_stride_row * elem) % bytes == 0 && (p.out_stride_row * elem) % bytes == 0 &&
           reinterpret_cast<uintptr_t>(p.input) % bytes == 0 && reinterpret_cast<uintptr_t>(p.out) % bytes == 0;
  };
  const int64_t chunk = aligned_to(16) ? 16 : aligned_to(4) ? 4 : 0;
  if (chunk == 0) throw std::logic_error("moelora.moe_gather_sorted_rows: rows must be 4-byte aligned");
  // Enough warps for the copy rate (several per SM), no more CTAs than entries need.
  const int64_t ctas = std::min<int64_t>((p.max_num_tokens_padded + kWarps - 1) / kWarps,
                                         int64_t(current_device_info().num_sms) * 8);
  launch_kernel(chunk == 16 ? moe_gather_sorted_rows_kernel<uint4> : moe_gather_sorted_rows_kernel<uint32_t>,
                dim3(unsigned(ctas)), dim3(kWarps * 32), 0, static_cast<cudaStream_t>(stream), p, row_bytes / chunk,
                p.input_stride_row * elem / chunk, p.out_stride_row * elem / chunk);
}

}  // namespace moelora::cuda
