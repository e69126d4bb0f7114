// moe_align_block_size on CUDA: one block of 1024 threads does histogram, scan,
// block->expert table and scatter, all in shared memory; each slot's group is read from
// topk_ids once and kept in shared memory for the scatter.
//
// NOTE: one launch, no host sync; the used length stays on the device. Slot order
// inside an expert group follows shared-memory atomics, so it may differ between runs;
// results do not depend on it (each slot's row is computed independently).
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <string>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/launch.cuh"

namespace moelora::cuda {
namespace {

constexpr int kAlignThreads = 1024;
constexpr int kAlignItemsPerThread = 4;
// Experts (+1 dropped-slot group) one block can scan.
constexpr int kAlignMaxGroups = kAlignThreads * kAlignItemsPerThread;
// The scatter pass reuses each slot's group from shared memory (2 bytes a slot) up to
// this many slots (M = 10240 at top-8; with the ~37 KB of tables and scan storage it
// stays under the 227 KB a block may have), and reads topk_ids again beyond.
constexpr int kAlignCachedSlots = 80 * 1024;
constexpr int kAlignBatch = 8;  // slots a thread loads before using them

// Group of a slot: its expert, or num_experts (the trailing group) when dropped or invalid.
// NOTE: 32-bit index math, and none for contiguous ids: one CTA handles every slot, so
// per-slot instructions are the kernel's time at large M (a 64-bit division per slot and
// pass made it 56 us at 32768 slots; see docs/PERF_NOTES.md).
__device__ __forceinline__ int group_of(const detail::AlignParams& p, int slot, bool contiguous) {
  int64_t offset = slot;
  if (!contiguous) {
    const int token = slot / int(p.top_k), j = slot - token * int(p.top_k);
    offset = token * p.topk_ids_stride_token + j * p.topk_ids_stride_k;
  }
  const int64_t e = p.topk_ids_int64 ? static_cast<const int64_t*>(p.topk_ids)[offset]
                                     : int64_t(static_cast<const int32_t*>(p.topk_ids)[offset]);
  return (e >= 0 && e < p.num_experts) ? int(e) : int(p.num_experts);
}

__global__ void __launch_bounds__(kAlignThreads) moe_align_block_size_kernel(const detail::AlignParams p) {
  using BlockScan = cub::BlockScan<int, kAlignThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int group_count[kAlignMaxGroups];   // slots per group, then the scatter cursor
  __shared__ int group_offset[kAlignMaxGroups + 1];  // padded start of each group
  extern __shared__ uint16_t slot_group[];        // [min(num_slots, kAlignCachedSlots)]

  const int num_groups = int(p.num_experts) + 1;
  const int num_slots = int(p.num_tokens * p.top_k);  // < 2^31: checked by the launcher
  const bool cached = num_slots <= kAlignCachedSlots;
  const bool contiguous = p.topk_ids_stride_k == 1 && p.topk_ids_stride_token == p.top_k;
  const int block_size = int(p.block_size);
  for (int g = threadIdx.x; g < num_groups; g += kAlignThreads) group_count[g] = 0;
  wait_for_previous_kernel();
  // One CTA, no later waves to protect: let the GEMM's CTAs launch and park now.
  allow_next_kernel_launch();
  __syncthreads();
  // NOTE: kAlignBatch independent loads in flight per thread before their atomics: one
  // CTA reading a load at a time waits out the memory latency per slot (42 us at 32768
  // slots, measured).
  for (int s0 = 0; s0 < num_slots; s0 += kAlignThreads * kAlignBatch) {
    int g[kAlignBatch];
#pragma unroll
    for (int i = 0; i < kAlignBatch; ++i) {
      const int s = s0 + i * kAlignThreads + int(threadIdx.x);
      g[i] = s < num_slots ? group_of(p, s, contiguous) : -1;
    }
#pragma unroll
    for (int i = 0; i < kAlignBatch; ++i) {
      const int s = s0 + i * kAlignThreads + int(threadIdx.x);
      if (g[i] < 0) continue;
      if (cached) slot_group[s] = uint16_t(g[i]);
      atomicAdd(&group_count[g[i]], 1);
    }
  }
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
  for (int b = threadIdx.x; b < int(p.max_num_blocks); b += kAlignThreads) {
    int expert = -1;
    const int first = b * block_size;
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
  for (int i = threadIdx.x; i < int(p.max_num_tokens_padded); i += kAlignThreads) p.sorted_token_ids[i] = num_slots;
  for (int g = threadIdx.x; g < num_groups; g += kAlignThreads) group_count[g] = group_offset[g];
  __syncthreads();
  for (int s0 = 0; s0 < num_slots; s0 += kAlignThreads * kAlignBatch) {
    int g[kAlignBatch];
#pragma unroll
    for (int i = 0; i < kAlignBatch; ++i) {
      const int s = s0 + i * kAlignThreads + int(threadIdx.x);
      g[i] = s >= num_slots ? -1 : cached ? int(slot_group[s]) : group_of(p, s, contiguous);
    }
#pragma unroll
    for (int i = 0; i < kAlignBatch; ++i) {
      if (g[i] >= 0) p.sorted_token_ids[atomicAdd(&group_count[g[i]], 1)] = s0 + i * kAlignThreads + int(threadIdx.x);
    }
  }
}

}  // namespace

void moe_align_block_size(const detail::AlignParams& p, Stream stream) {
  if (p.num_experts + 1 > kAlignMaxGroups) {
    throw Error("moelora.moe_align_block_size: argument 'num_experts' expected at most " +
                std::to_string(kAlignMaxGroups - 1) + " on CUDA, got " + std::to_string(p.num_experts));
  }
  const int64_t num_slots = p.num_tokens * p.top_k;
  if (num_slots > INT32_MAX || p.max_num_tokens_padded > INT32_MAX) {
    throw Error("moelora.moe_align_block_size: argument 'topk_ids' expected fewer than 2^31 slots on CUDA, got " +
                std::to_string(num_slots));
  }
  const size_t cache_bytes = size_t(std::min<int64_t>(num_slots, kAlignCachedSlots)) * sizeof(uint16_t);
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(moe_align_block_size_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(kAlignCachedSlots * sizeof(uint16_t))));
  launch_kernel(moe_align_block_size_kernel, dim3(1), dim3(kAlignThreads), cache_bytes, static_cast<cudaStream_t>(stream), p);
}

}  // namespace moelora::cuda
