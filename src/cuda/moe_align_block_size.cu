// moe_align_block_size on CUDA: one block of 1024 threads does histogram, scan,
// block->expert table and scatter, all in shared memory.
//
// NOTE: one launch, no host sync; the used length stays on the device. Slot order
// inside an expert group follows shared-memory atomics, so it may differ between runs;
// results do not depend on it (each slot's row is computed independently).
#include <cub/block/block_scan.cuh>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/launch.cuh"

namespace moelora::cuda {
namespace {

constexpr int kAlignThreads = 1024;
constexpr int kAlignItemsPerThread = 4;
// Experts (+1 dropped-slot group) one block can scan.
constexpr int kAlignMaxGroups = kAlignThreads * kAlignItemsPerThread;

__device__ __forceinline__ int64_t load_expert_id(const detail::AlignParams& p, int64_t slot) {
  const int64_t token = slot / p.top_k, j = slot % p.top_k;
  const int64_t offset = token * p.topk_ids_stride_token + j * p.topk_ids_stride_k;
  return p.topk_ids_int64 ? static_cast<const int64_t*>(p.topk_ids)[offset]
                          : static_cast<const int32_t*>(p.topk_ids)[offset];
}

// Group of a slot: its expert, or num_experts (the trailing group) when dropped or invalid.
__device__ __forceinline__ int group_of(const detail::AlignParams& p, int64_t slot) {
  const int64_t e = load_expert_id(p, slot);
  return (e >= 0 && e < p.num_experts) ? int(e) : int(p.num_experts);
}

__global__ void __launch_bounds__(kAlignThreads) moe_align_block_size_kernel(const detail::AlignParams p) {
  using BlockScan = cub::BlockScan<int, kAlignThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int group_count[kAlignMaxGroups];   // slots per group, then the scatter cursor
  __shared__ int group_offset[kAlignMaxGroups + 1];  // padded start of each group

  const int num_groups = int(p.num_experts) + 1;
  const int64_t num_slots = p.num_tokens * p.top_k;
  const int block_size = int(p.block_size);
  for (int g = threadIdx.x; g < num_groups; g += kAlignThreads) group_count[g] = 0;
  wait_for_previous_kernel();
  // One CTA, no later waves to protect: let the GEMM's CTAs launch and park now.
  allow_next_kernel_launch();
  __syncthreads();
  for (int64_t s = threadIdx.x; s < num_slots; s += kAlignThreads) atomicAdd(&group_count[group_of(p, s)], 1);
  __syncthreads();

  // Exclusive scan of the padded group sizes; thread t owns groups [t*4, t*4+4).
  int padded[kAlignItemsPerThread];
#pragma unroll
  for (int i = 0; i < kAlignItemsPerThread; ++i) {
    const int g = threadIdx.x * kAlignItemsPerThread + i;
    padded[i] = g < num_groups ? (group_count[g] + block_size - 1) / block_size * block_size : 0;
  }
  int total = 0;
  BlockScan(scan_storage).ExclusiveSum(padded, padded, total);
#pragma unroll
  for (int i = 0; i < kAlignItemsPerThread; ++i) {
    const int g = threadIdx.x * kAlignItemsPerThread + i;
    if (g < num_groups) group_offset[g] = padded[i];
  }
  if (threadIdx.x == 0) {
    group_offset[num_groups] = total;
    *p.num_tokens_post_padded = total;
  }
  __syncthreads();

  // Block -> expert table: the group whose padded range holds the block's first entry.
  for (int64_t b = threadIdx.x; b < p.max_num_blocks; b += kAlignThreads) {
    int expert = -1;
    const int64_t first = b * block_size;
    if (first < total) {
      int lo = 0, hi = num_groups - 1;  // last g with group_offset[g] <= first
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (group_offset[mid] <= first) lo = mid; else hi = mid - 1;
      }
      if (lo < p.num_experts) expert = p.expert_map ? p.expert_map[lo] : lo;
    }
    p.expert_ids[b] = expert;
  }
  // Every entry starts as the sentinel; the scatter below overwrites the real slots.
  for (int64_t i = threadIdx.x; i < p.max_num_tokens_padded; i += kAlignThreads) {
    p.sorted_token_ids[i] = int32_t(num_slots);
  }
  for (int g = threadIdx.x; g < num_groups; g += kAlignThreads) group_count[g] = group_offset[g];
  __syncthreads();
  for (int64_t s = threadIdx.x; s < num_slots; s += kAlignThreads) {
    const int pos = atomicAdd(&group_count[group_of(p, s)], 1);
    p.sorted_token_ids[pos] = int32_t(s);
  }
}

}  // namespace

void moe_align_block_size(const detail::AlignParams& p, Stream stream) {
  if (p.num_experts + 1 > kAlignMaxGroups) {
    throw Error("moelora.moe_align_block_size: argument 'num_experts' expected at most " +
                std::to_string(kAlignMaxGroups - 1) + " on CUDA, got " + std::to_string(p.num_experts));
  }
  launch_kernel(moe_align_block_size_kernel, dim3(1), dim3(kAlignThreads), 0, static_cast<cudaStream_t>(stream), p);
}

}  // namespace moelora::cuda
