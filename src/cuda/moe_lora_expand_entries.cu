// moe_lora_expand_entries on CUDA: the LoRA expand on the segmented alignment, added into a
// GEMM's output rows by entry (fused_experts' grouped path, whose CUTLASS GEMMs take no
// expand in their K loops):
//   out[entry, col(c, j)] += t[entry, c * rank :] · lora_b[c][l, e, j]ᵀ
// for each entry whose adapter l the segmented shrink wrote (moe_lora_shrink: t by entry,
// already scaled by the adapter's scale). Other entries (no adapter, a disabled one,
// padding, an expert not local) are not touched.
//
// A CTA takes 16 entries of one block and kExpandColumns output columns of one slice. The
// entries of a block hold runs of a few adapters (the segmented alignment pads only where
// an expert ends): the CTA takes each adapter of its rows in turn, its lora_b tile against
// the rows of that adapter (the others' rows zero), all into one accumulator.
#include <climits>
#include <stdexcept>
#include <string>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/launch.cuh"
#include "cuda/moe_lora_tiles.cuh"
#include "cuda/numeric.cuh"

namespace moelora::cuda {
namespace {

using detail::LoraDeltaParams;
using namespace lora_tiles;

constexpr int kMaxAdapters = 64;  // kMaxLoraAdapters: bits of block_lora_masks

// Grid (entry tiles of kTileRows, slices, column chunks of kExpandColumns).
template <typename T>
__global__ void __launch_bounds__(kExpandThreads) moe_lora_expand_entries_kernel(const LoraDeltaParams p) {
  static_assert(kTensorCores<T>, "the grouped path runs 16-bit types");
  __shared__ int row_lora[kTileRows];  // each row's adapter, -1: nothing to add
  __shared__ unsigned long long tile_adapters;
  __shared__ alignas(32) T t_tile[kTileRows][kMaxRankPadded + kPad];
  __shared__ alignas(32) T lora_tile[kExpandColumns][kMaxRankPadded + kPad];
  __shared__ alignas(32) float result[kTileRows][kExpandColumns + 4];

  wait_for_previous_kernel();
  const int64_t entry0 = int64_t(blockIdx.x) * kTileRows;
  const int64_t used = min(int64_t(*p.num_tokens_post_padded), p.max_num_tokens_padded);
  if (entry0 >= used) return;
  const int64_t block = entry0 / p.block_size;
  const int expert = p.expert_ids[block];
  if (expert < 0 || expert >= p.num_experts) return;
  if (threadIdx.x == 0) tile_adapters = 0;
  __syncthreads();
  if (threadIdx.x < kTileRows) {
    // The rows moe_lora_shrink wrote: a slot, and an adapter in the block's mask.
    const int64_t entry = entry0 + threadIdx.x;
    int l = -1;
    if (entry < used) {
      const int32_t slot = p.sorted_token_ids[entry];
      if (slot >= 0 && slot < p.num_slots) l = p.entry_lora_ids[entry];
      if (l < 0 || l >= kMaxAdapters || !(p.block_lora_masks[block] >> l & 1)) l = -1;
    }
    row_lora[threadIdx.x] = l;
    if (l >= 0) atomicOr(&tile_adapters, 1ull << l);
  }
  __syncthreads();
  const unsigned long long adapters = tile_adapters;  // uniform across the CTA
  if (adapters == 0) return;
  const int c = blockIdx.y;
  const int64_t n0 = int64_t(blockIdx.z) * kExpandColumns;
  const int columns = p.N_slice - n0 < kExpandColumns ? int(p.N_slice - n0) : kExpandColumns;
  const int rank = int(p.rank), rank_padded = round_up16(rank);
  const int64_t t_cols = int64_t(p.num_slices) * p.rank;
  const detail::LoraSliceParams& sl = p.slices[c];
  const T* t = static_cast<const T*>(p.intermediate);
  const T zero = from_float<T>(0.f);
  const int warp = threadIdx.x / 32;
  float acc[8] = {};
  for (unsigned long long left = adapters; left != 0; left &= left - 1) {
    const int l = __ffsll(static_cast<long long>(left)) - 1;
    for (int i = threadIdx.x; i < kTileRows * rank_padded; i += kExpandThreads) {
      const int r = i / rank_padded, k = i % rank_padded;
      t_tile[r][k] = row_lora[r] == l && k < rank ? t[(entry0 + r) * t_cols + c * p.rank + k] : zero;
    }
    const T* lora_b = static_cast<const T*>(sl.lora_b) + l * sl.b_stride_lora + expert * sl.b_stride_expert;
    for (int i = threadIdx.x; i < kExpandColumns * rank_padded; i += kExpandThreads) {
      const int n = i / rank_padded, k = i % rank_padded;
      lora_tile[n][k] = n < columns && k < rank ? lora_b[(n0 + n) * sl.b_stride_n + k] : zero;
    }
    __syncthreads();
    mma_16x16_accumulate<T>(acc, smem_addr(&t_tile[0][0] + mma_lane_a(kMaxRankPadded + kPad)),
                            smem_addr(&lora_tile[warp * 16][0] + mma_lane_b(kMaxRankPadded + kPad)), rank_padded);
    __syncthreads();  // the next adapter's tiles overwrite these
  }
  store_mma_16x16(&result[0][warp * 16], kExpandColumns + 4, acc);
  __syncthreads();
  T* out = static_cast<T*>(p.out);
  for (int i = threadIdx.x; i < kTileRows * columns; i += kExpandThreads) {
    const int r = i / columns, n = i % columns;
    if (row_lora[r] < 0) continue;
    const int64_t at = out_offset(p, entry0 + r, c, n0 + n);
    out[at] = from_float<T>(to_float(out[at]) + result[r][n]);
  }
  allow_next_kernel_launch();
}

}  // namespace

void moe_lora_expand_entries(const LoraDeltaParams& p, Stream stream) {
  if (p.sorted_token_ids == nullptr || p.entry_lora_ids == nullptr || p.block_lora_masks == nullptr ||
      p.block_size % kTileRows != 0 || p.rank > kMaxRankPadded || p.dtype == DType::kFloat32 || !p.add_inputs ||
      p.topk_weights != nullptr || p.adapters.max_loras > kMaxAdapters) {
    throw std::logic_error(
        "moelora.moe_lora_expand_entries: needs the segmented alignment, block_size % 16 == 0, rank <= 128, a 16-bit "
        "type, add_inputs, no routed weights and at most 64 adapters");
  }
  const int64_t tiles = (p.max_num_tokens_padded + kTileRows - 1) / kTileRows;
  const int64_t column_chunks = (p.N_slice + kExpandColumns - 1) / kExpandColumns;
  if (tiles <= 0 || column_chunks <= 0) return;
  if (tiles > INT32_MAX || column_chunks > 65535) {
    throw Error("moelora.fused_experts: too many LoRA rows or columns for the expand (" + std::to_string(tiles) +
                " row tiles, " + std::to_string(column_chunks) + " column chunks)");
  }
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (kTensorCores<T>) {
      launch_kernel(moe_lora_expand_entries_kernel<T>,
                    dim3(unsigned(tiles), unsigned(p.num_slices), unsigned(column_chunks)), dim3(kExpandThreads), 0,
                    static_cast<cudaStream_t>(stream), p);
    }
  });
}

}  // namespace moelora::cuda
