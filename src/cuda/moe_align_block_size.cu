// moe_align_block_size on CUDA: one launch of a cluster of up to 8 CTAs (one CTA below
// kAlignSlotsPerCta slots, and on devices without clusters). Each CTA histograms its
// share of the slots in shared memory; after a cluster barrier every CTA reads all the
// histograms through distributed shared memory, scans the padded group sizes (the same
// scan in every CTA) and scatters its own slots behind the slots of the CTAs before it.
//
// NOTE: one launch, no host sync; the used length stays on the device. Slot order
// inside an expert group follows shared-memory atomics, so it may differ between runs;
// results do not depend on it (each slot's row is computed independently).
// NOTE: one CTA of 1024 threads took 44 us at 32768 slots (H100): the time went to ~65K
// contended shared-memory atomics in one SM. Eight CTAs share that work.
#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <string>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/launch.cuh"

namespace moelora::cuda {
namespace {

constexpr int kAlignThreads = 1024;
constexpr int kAlignItemsPerThread = 4;
// Experts (+1 dropped-slot group) one block can scan.
constexpr int kAlignMaxGroups = kAlignThreads * kAlignItemsPerThread;
// CTAs of the cluster (the portable maximum), and the slots that earn one more CTA.
constexpr int kAlignMaxCtas = 8;
constexpr int kAlignSlotsPerCta = 2048;
// The scatter pass reuses each slot's group from shared memory (2 bytes a slot) up to
// this many slots per CTA (with the ~37 KB of tables and scan storage it stays under
// the 227 KB a block may have), and reads topk_ids again beyond.
constexpr int kAlignCachedSlots = 80 * 1024;
constexpr int kAlignBatch = 8;  // slots a thread loads before using them

// Group of a slot: its expert, or num_experts (the trailing group) when dropped or invalid.
// NOTE: 32-bit index math, and none for contiguous ids: per-slot instructions are the
// kernel's time at large M (a 64-bit division per slot and pass made it 56 us at 32768
// slots on one CTA; see docs/PERF_NOTES.md).
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

// The CTAs of the launch: a cluster on sm_90, else one CTA.
struct AlignCtas {
  int count, rank;
  __device__ AlignCtas() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    count = int(cluster.num_blocks());
    rank = int(cluster.block_rank());
#else
    count = 1;
    rank = 0;
#endif
  }
  // Barrier over every thread of every CTA (release/acquire: shared and global writes
  // before it are visible after it).
  __device__ void sync() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (count > 1) {
      cooperative_groups::this_cluster().sync();
      return;
    }
#endif
    __syncthreads();
  }
  // CTA r's copy of a shared-memory array.
  __device__ const int* shared_of(int* local, int r) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (count > 1) return cooperative_groups::this_cluster().map_shared_rank(local, r);
#endif
    (void)r;
    return local;
  }
};

__global__ void __launch_bounds__(kAlignThreads) moe_align_block_size_kernel(const detail::AlignParams p) {
  using BlockScan = cub::BlockScan<int, kAlignThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  // This CTA's slots per group (read by every CTA of the cluster), then its scatter cursor.
  __shared__ int group_count[kAlignMaxGroups];
  __shared__ int group_offset[kAlignMaxGroups + 1];  // padded start of each group
  extern __shared__ uint16_t slot_group[];           // [min(slots of this CTA, kAlignCachedSlots)]

  const AlignCtas ctas;
  const int num_groups = int(p.num_experts) + 1;
  const int num_slots = int(p.num_tokens * p.top_k);  // < 2^31: checked by the launcher
  const int share = (num_slots + ctas.count - 1) / ctas.count;
  const int slot_begin = min(num_slots, ctas.rank * share), slot_end = min(num_slots, slot_begin + share);
  const bool cached = slot_end - slot_begin <= kAlignCachedSlots;
  const bool contiguous = p.topk_ids_stride_k == 1 && p.topk_ids_stride_token == p.top_k;
  const int block_size = int(p.block_size);
  const int sentinel = num_slots;
  for (int g = threadIdx.x; g < num_groups; g += kAlignThreads) group_count[g] = 0;
  wait_for_previous_kernel();
  // One wave, no later CTAs to protect: let the GEMM's CTAs launch and park now.
  allow_next_kernel_launch();
  // The kernels before this one are done with the counters; the GEMMs after it wait for it.
  if (ctas.rank == 0 && int(threadIdx.x) < p.num_tile_counters) p.tile_counters[threadIdx.x] = 0;
  // Every entry starts as the sentinel; the scatter (after two cluster barriers) overwrites
  // the real slots.
  for (int i = ctas.rank * kAlignThreads + threadIdx.x; i < int(p.max_num_tokens_padded); i += ctas.count * kAlignThreads) {
    p.sorted_token_ids[i] = sentinel;
  }
  __syncthreads();
  // NOTE: kAlignBatch independent loads in flight per thread before their atomics: a
  // thread reading one load at a time waits out the memory latency per slot.
  for (int s0 = slot_begin; s0 < slot_end; s0 += kAlignThreads * kAlignBatch) {
    int g[kAlignBatch];
#pragma unroll
    for (int i = 0; i < kAlignBatch; ++i) {
      const int s = s0 + i * kAlignThreads + int(threadIdx.x);
      g[i] = s < slot_end ? group_of(p, s, contiguous) : -1;
    }
#pragma unroll
    for (int i = 0; i < kAlignBatch; ++i) {
      const int s = s0 + i * kAlignThreads + int(threadIdx.x);
      if (g[i] < 0) continue;
      if (cached) slot_group[s - slot_begin] = uint16_t(g[i]);
      atomicAdd(&group_count[g[i]], 1);
    }
  }
  ctas.sync();

  // Each group's size over all CTAs and the slots of the CTAs before this one; then an
  // exclusive scan of the padded sizes. Thread t owns groups [t*4, t*4+4).
  int padded[kAlignItemsPerThread], before[kAlignItemsPerThread];
#pragma unroll
  for (int i = 0; i < kAlignItemsPerThread; ++i) {
    const int g = threadIdx.x * kAlignItemsPerThread + i;
    int total = 0;
    before[i] = 0;
    if (g < num_groups) {
      for (int r = 0; r < ctas.count; ++r) {
        const int count = ctas.shared_of(group_count, r)[g];
        total += count;
        if (r < ctas.rank) before[i] += count;
      }
    }
    padded[i] = (total + block_size - 1) / block_size * block_size;
  }
  int total_padded = 0;
  BlockScan(scan_storage).ExclusiveSum(padded, padded, total_padded);
#pragma unroll
  for (int i = 0; i < kAlignItemsPerThread; ++i) {
    const int g = threadIdx.x * kAlignItemsPerThread + i;
    if (g < num_groups) group_offset[g] = padded[i];
  }
  if (threadIdx.x == 0) {
    group_offset[num_groups] = total_padded;
    if (ctas.rank == 0) *p.num_tokens_post_padded = total_padded;
  }
  // Every CTA has read every histogram (so each may reuse its own below) and written its
  // sentinels; group_offset is complete.
  ctas.sync();
#pragma unroll
  for (int i = 0; i < kAlignItemsPerThread; ++i) {
    const int g = threadIdx.x * kAlignItemsPerThread + i;
    if (g < num_groups) group_count[g] = group_offset[g] + before[i];
  }

  // Block -> expert table: the group whose padded range holds the block's first entry.
  for (int b = ctas.rank * kAlignThreads + threadIdx.x; b < int(p.max_num_blocks); b += ctas.count * kAlignThreads) {
    int expert = -1;
    const int first = b * block_size;
    if (first < total_padded) {
      int lo = 0, hi = num_groups - 1;  // last g with group_offset[g] <= first
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (group_offset[mid] <= first) lo = mid; else hi = mid - 1;
      }
      if (lo < p.num_experts) expert = p.expert_map ? p.expert_map[lo] : lo;
    }
    p.expert_ids[b] = expert;
  }
  __syncthreads();
  for (int s0 = slot_begin; s0 < slot_end; s0 += kAlignThreads * kAlignBatch) {
    int g[kAlignBatch];
#pragma unroll
    for (int i = 0; i < kAlignBatch; ++i) {
      const int s = s0 + i * kAlignThreads + int(threadIdx.x);
      g[i] = s >= slot_end ? -1 : cached ? int(slot_group[s - slot_begin]) : group_of(p, s, contiguous);
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
  // Clusters need sm_90; one CTA elsewhere.
  const int ctas = current_device_info().cc_major >= 9
                       ? int(std::clamp<int64_t>((num_slots + kAlignSlotsPerCta - 1) / kAlignSlotsPerCta, 1, kAlignMaxCtas))
                       : 1;
  const int64_t share = (num_slots + ctas - 1) / ctas;
  const size_t cache_bytes = size_t(std::min<int64_t>(share, kAlignCachedSlots)) * sizeof(uint16_t);
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(moe_align_block_size_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(kAlignCachedSlots * sizeof(uint16_t))));
  launch_kernel_in_clusters(moe_align_block_size_kernel, dim3(unsigned(ctas)), dim3(kAlignThreads), cache_bytes,
                            static_cast<cudaStream_t>(stream), ctas, p);
}

}  // namespace moelora::cuda
