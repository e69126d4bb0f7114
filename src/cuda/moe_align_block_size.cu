// moe_align_block_size (and moe_lora_align_block_size: groups are (expert, adapter)) on
// CUDA: one launch of a cluster of up to 8 CTAs (one CTA below kAlignSlotsPerCta slots,
// and on devices without clusters). Each CTA histograms its share of the slots in shared
// memory; after a cluster barrier every CTA reads all the histograms through distributed
// shared memory, scans the padded group sizes (the same scan in every CTA) and scatters
// its own slots behind the slots of the CTAs before it.
//
// NOTE: one launch, no host sync; the used length stays on the device. Slot order
// inside an expert group follows shared-memory atomics, so it may differ between runs;
// results do not depend on it (each slot's row is computed independently).
// NOTE: one CTA of 1024 threads took 44 us at 32768 slots (H100): the time went to ~65K
// contended shared-memory atomics in one SM. Eight CTAs share that work.
#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>
#include <cutlass/fast_math.h>

#include <algorithm>
#include <climits>
#include <string>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/launch.cuh"

namespace moelora::cuda {
namespace {

// Threads of a CTA: 1024, or 256 / 512 where those cover one CTA's slots and groups
// (align_threads).
// NOTE: at small M the kernel's time is its 32 warps' instructions and barriers, most of
// them replicated per thread (index setup, the scan's 4 items a thread over 4096 group
// places for a few hundred groups), not its slots: in the layer's graph (H200, 5e60aaa,
// docs/wip/issue31-exposed.sh) one more alignment launch cost 4.8-6.1 us of the base layer
// and 8.5-11.8 us of the LoRA layer at M = 16-64 (128-512 slots) on every model measured.
constexpr int kAlignThreads = 1024;
constexpr int kAlignItemsPerThread = 4;
// Most groups (experts, or (expert, adapter) pairs with LoRA, + 1 dropped-slot group):
// two int tables of this size in shared memory (132 KB), e.g. 256 experts x 65 adapter
// groups + 1.
constexpr int kAlignMaxGroups = 16896;
// Dynamic shared memory: the two group tables, then each slot's group (2 bytes a slot)
// for the scatter pass, as many slots as fit (80K without LoRA, 32K at the most groups);
// beyond that the scatter reads topk_ids again.
// Segmented LoRA alignment: a third table (200 KB at the most groups, no slot cache).
constexpr int kAlignSmemBytes = 200 * 1024;
// CTAs of the cluster (the portable maximum), and the slots that earn one more CTA.
constexpr int kAlignMaxCtas = 8;
constexpr int kAlignSlotsPerCta = 2048;
// NOTE: 4, not 8: the unrolled loops are most of the kernel's code, and its one CTA at
// decode waits on instruction fetch (in a graph, H100: 5.7 -> 5.0 us at 512 slots; 19.1 ->
// 18.7 us at 65536 slots over 8 CTAs).
constexpr int kAlignBatch = 4;  // slots a thread loads before using them

// Group of a slot: its expert (times max_loras + 1, plus the token's adapter + 1 with
// adapters: kAdapters, max_loras > 0), or the trailing group num_groups - 1 when dropped
// or invalid. top_k: a division by p.top_k as a multiply and a shift.
// NOTE: 32-bit index math, and none for contiguous ids: per-slot instructions are the
// kernel's time at large M (a 64-bit division per slot and pass made it 56 us at 32768
// slots on one CTA; see docs/PERF_NOTES.md). The divisions by top_k as IEEE-exact integer
// divisions (~25 instructions each, inlined in both unrolled slot loops) made the kernel
// ~5K SASS instructions: its one CTA at decode waited mostly on instruction fetch.
// With adapters, the token's adapter is loaded beside its expert id (one memory round trip,
// not two) and looked up in adapter_enabled's copy in shared memory (not a third).
template <bool kAdapters, bool kInt64Ids>
__device__ __forceinline__ int group_of(const detail::AlignParams& p, int slot, bool contiguous, int num_groups,
                                        const cutlass::FastDivmod& top_k, const uint8_t* adapter_enabled) {
  int64_t offset = slot;
  int token = 0, j = 0;
  if (!contiguous || kAdapters) top_k(token, j, slot);
  if (!contiguous) offset = token * p.topk_ids_stride_token + j * p.topk_ids_stride_k;
  const int64_t e = kInt64Ids ? static_cast<const int64_t*>(p.topk_ids)[offset]
                              : int64_t(static_cast<const int32_t*>(p.topk_ids)[offset]);
  const int lora = kAdapters ? p.token_lora_ids[token * p.token_lora_ids_stride] : -1;
  if (e < 0 || e >= p.num_experts) {
    // -1: a slot the router dropped; anything else is a routing bug the caller may ask to
    // hear of (the CPU backend raises).
    if (p.routing_status && e != -1) atomicOr(p.routing_status, kRoutingBadExpertId);
    return num_groups - 1;
  }
  if constexpr (kAdapters) {
    if (p.routing_status && (lora < -1 || lora >= p.max_loras)) atomicOr(p.routing_status, kRoutingBadAdapterId);
    const bool active = lora >= 0 && lora < p.max_loras && adapter_enabled[lora] != 0;
    return int(e) * int(p.max_loras + 1) + (active ? lora + 1 : 0);
  } else {
    return int(e);
  }
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

// cache_slots: how many slots' groups the dynamic shared memory holds after the tables.
// Segmented (AlignParams::entry_lora_ids): a third table holds each group's total, so the
// last group of an expert can pad the expert's sum to the block size.
// kAdapters: max_loras > 0 (virtual experts, the LoRA tables); kInt64Ids: topk_ids'
// dtype. An instance carries only its own case's code: at decode the kernel's time is
// instruction fetch (ncu, H100, 512 slots: 720 instructions a warp, one issued every 34
// cycles, half of them waiting for an instruction).
// kThreads: the CTA's threads (align_threads).
template <int kThreads, bool kAdapters, bool kInt64Ids>
__global__ void __launch_bounds__(kThreads)
    moe_align_block_size_kernel(const detail::AlignParams p, int num_groups, int cache_slots,
                                const cutlass::FastDivmod top_k) {
  // Groups one scan pass covers; more groups (virtual experts with LoRA) take more passes.
  constexpr int kAlignGroupsPerPass = kThreads * kAlignItemsPerThread;
  using BlockScan = cub::BlockScan<int, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ uint8_t adapter_enabled[kAdapters ? kMaxLoraAdapters : 1];  // p.adapter_enabled, 1 where null
  extern __shared__ int4 align_smem[];
  // This CTA's slots per group (read by every CTA of the cluster; never overwritten), and
  // this CTA's scatter cursor per group.
  int* group_count = reinterpret_cast<int*>(align_smem);
  int* group_cursor = group_count + num_groups;
  const bool segmented = kAdapters && p.entry_lora_ids != nullptr;
  // Each group's total over the cluster, when segmented: one CTA's counts are the totals.
  int* const group_total_table = group_cursor + num_groups;  // [num_groups] when segmented
  uint16_t* slot_group = reinterpret_cast<uint16_t*>(group_total_table + (segmented ? num_groups : 0));  // [cache_slots]

  const AlignCtas ctas;
  const int num_slots = int(p.num_tokens * p.top_k);  // < 2^31: checked by the launcher
  const int share = (num_slots + ctas.count - 1) / ctas.count;
  const int slot_begin = min(num_slots, ctas.rank * share), slot_end = min(num_slots, slot_begin + share);
  const bool cached = slot_end - slot_begin <= cache_slots;
  const bool contiguous = p.topk_ids_stride_k == 1 && p.topk_ids_stride_token == p.top_k;
  const int block_size = int(p.block_size);
  const int groups_per_expert = kAdapters ? int(p.max_loras) + 1 : 1;
  const int sentinel = num_slots;
  for (int g = threadIdx.x; g < num_groups; g += kThreads) group_count[g] = 0;
  wait_for_previous_kernel();
  // One wave, no later CTAs to protect: let the GEMM's CTAs launch and park now.
  allow_next_kernel_launch();
  // The kernels before this one are done with the counters; the GEMMs after it wait for it.
  if (ctas.rank == 0 && int(threadIdx.x) < p.num_tile_counters) p.tile_counters[threadIdx.x] = 0;
  // Every entry starts as the sentinel; the scatter (after two cluster barriers) overwrites
  // the real slots.
  for (int i = ctas.rank * kThreads + threadIdx.x; i < int(p.max_num_tokens_padded); i += ctas.count * kThreads) {
    p.sorted_token_ids[i] = sentinel;
    if (segmented) p.entry_lora_ids[i] = -1;
  }
  // The adapter masks are OR-ed in by every CTA after the cluster barrier below. The
  // shrink's counters start at zero (the kernels before this one are done with them).
  for (int b = ctas.rank * kThreads + threadIdx.x; segmented && b < int(p.max_num_blocks);
       b += ctas.count * kThreads) {
    p.block_lora_masks[b] = 0;
  }
  for (int i = ctas.rank * kThreads + threadIdx.x;
       segmented && p.lora_shrink_counters && i < int(p.max_num_blocks * p.block_size / 16); i += ctas.count * kThreads) {
    p.lora_shrink_counters[i] = 0;
  }
  if (kAdapters && int(threadIdx.x) < p.max_loras) {
    adapter_enabled[threadIdx.x] = p.adapter_enabled == nullptr || p.adapter_enabled[threadIdx.x] != 0;
  }
  __syncthreads();
  // NOTE: kAlignBatch independent loads in flight per thread before their atomics: a
  // thread reading one load at a time waits out the memory latency per slot.
  for (int s0 = slot_begin; s0 < slot_end; s0 += kThreads * kAlignBatch) {
    int g[kAlignBatch];
#pragma unroll
    for (int i = 0; i < kAlignBatch; ++i) {
      const int s = s0 + i * kThreads + int(threadIdx.x);
      g[i] = s < slot_end ? group_of<kAdapters, kInt64Ids>(p, s, contiguous, num_groups, top_k, adapter_enabled) : -1;
    }
#pragma unroll
    for (int i = 0; i < kAlignBatch; ++i) {
      const int s = s0 + i * kThreads + int(threadIdx.x);
      if (g[i] < 0) continue;
      if (cached) slot_group[s - slot_begin] = uint16_t(g[i]);
      atomicAdd(&group_count[g[i]], 1);
    }
  }
  ctas.sync();
  const int* group_total = ctas.count == 1 ? group_count : group_total_table;
  if (segmented && ctas.count > 1) {
    for (int g = threadIdx.x; g < num_groups; g += kThreads) {
      int total = 0;
      for (int r = 0; r < ctas.count; ++r) total += ctas.shared_of(group_count, r)[g];
      group_total_table[g] = total;
    }
    __syncthreads();
  }

  // Each group's size over all CTAs and the slots of the CTAs before this one; an
  // exclusive scan of the padded sizes, kAlignGroupsPerPass groups a pass (thread t owns
  // groups [t*4, t*4+4) of a pass). Every CTA runs the same scan; each writes its own
  // cursors, and the block table entries of the groups g with g % count == rank.
  int total_padded = 0;
  for (int pass = 0; pass < num_groups; pass += kAlignGroupsPerPass) {
    int padded[kAlignItemsPerThread], offset[kAlignItemsPerThread], before[kAlignItemsPerThread];
#pragma unroll
    for (int i = 0; i < kAlignItemsPerThread; ++i) {
      const int g = pass + threadIdx.x * kAlignItemsPerThread + i;
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
      if (segmented && g < num_groups - 1) {
        // Unpadded inside an expert; its last group pads the expert's sum (every expert
        // starts on a block, so its blocks are those of the plain alignment).
        padded[i] = total;
        if (g % groups_per_expert == groups_per_expert - 1) {
          int expert_total = 0;
          for (int k = g - groups_per_expert + 1; k <= g; ++k) expert_total += group_total[k];
          padded[i] += (expert_total + block_size - 1) / block_size * block_size - expert_total;
        }
      }
    }
    int pass_total = 0;
    BlockScan(scan_storage).ExclusiveSum(padded, offset, pass_total);
#pragma unroll
    for (int i = 0; i < kAlignItemsPerThread; ++i) {
      const int g = pass + threadIdx.x * kAlignItemsPerThread + i;
      if (g >= num_groups) continue;
      const int start = total_padded + offset[i];
      group_cursor[g] = start + before[i];
      if (g % ctas.count != ctas.rank) continue;
      // Block -> expert (and adapter) table for this group's blocks.
      int expert = -1, lora = -1;
      if (g < num_groups - 1) {
        const int e = g / groups_per_expert;
        expert = p.expert_map ? p.expert_map[e] : e;
        lora = g - e * groups_per_expert - 1;
        if (p.routing_status && lora == -1 && (expert < -1 || expert >= p.num_local_experts)) {
          atomicOr(p.routing_status, kRoutingBadExpertMap);  // once an expert (its adapter-less group)
        }
      }
      // Segmented, groups of one expert share blocks: the same expert id, and each
      // group's adapter bit in the blocks its slots reach.
      for (int b = start / block_size; b * block_size < start + padded[i]; ++b) {
        p.expert_ids[b] = expert;
        if (kAdapters && p.block_lora_ids) p.block_lora_ids[b] = lora;
      }
      if (segmented && lora >= 0) {
        const int total = group_total[g];
        for (int b = start / block_size; b * block_size < start + total; ++b) {
          atomicOr(reinterpret_cast<unsigned long long*>(&p.block_lora_masks[b]), 1ull << lora);
        }
      }
    }
    total_padded += pass_total;
    __syncthreads();  // scan_storage is reused by the next pass
  }
  // The grouped path: each expert's first entry and slot count, from this CTA's cursors
  // (its first entry plus the slots of the CTAs before it) and the histograms.
  // NOTE: a loop of its own: kept in the scan's registers it spilled on sm_80.
  for (int g = ctas.rank * kThreads + threadIdx.x; p.group_sizes && g < num_groups - 1;
       g += ctas.count * kThreads) {
    int total = 0, before = 0;
    for (int r = 0; r < ctas.count; ++r) {
      const int count = ctas.shared_of(group_count, r)[g];
      total += count;
      if (r < ctas.rank) before += count;
    }
    p.group_entry_offsets[g] = group_cursor[g] - before;
    p.group_sizes[g] = total;
  }
  if (ctas.rank == 0 && threadIdx.x == 0) *p.num_tokens_post_padded = total_padded;
  for (int b = total_padded / block_size + ctas.rank * kThreads + threadIdx.x; b < int(p.max_num_blocks);
       b += ctas.count * kThreads) {
    p.expert_ids[b] = -1;
    if (kAdapters && p.block_lora_ids) p.block_lora_ids[b] = -1;
  }
  // Every CTA has read every histogram (no CTA exits while another reads its shared
  // memory) and written its sentinels before any slot is scattered over them.
  ctas.sync();
  for (int s0 = slot_begin; s0 < slot_end; s0 += kThreads * kAlignBatch) {
    int g[kAlignBatch];
#pragma unroll
    for (int i = 0; i < kAlignBatch; ++i) {
      const int s = s0 + i * kThreads + int(threadIdx.x);
      g[i] = s >= slot_end   ? -1
             : cached        ? int(slot_group[s - slot_begin])
                             : group_of<kAdapters, kInt64Ids>(p, s, contiguous, num_groups, top_k, adapter_enabled);
    }
#pragma unroll
    for (int i = 0; i < kAlignBatch; ++i) {
      if (g[i] < 0) continue;
      const int entry = atomicAdd(&group_cursor[g[i]], 1);
      p.sorted_token_ids[entry] = s0 + i * kThreads + int(threadIdx.x);
      if (segmented && g[i] < num_groups - 1) p.entry_lora_ids[entry] = g[i] % groups_per_expert - 1;
    }
  }
}

// The CTA's threads: at one CTA, the fewest of 256 and 512 whose threads take its slots in one
// batch of kAlignBatch a thread and its groups in one scan pass (at most 2048 slots and 2048
// groups), else kAlignThreads ($MOELORA_ALIGN_SMALL_CTA=0: always kAlignThreads).
int align_threads(int64_t num_slots, int ctas, int64_t num_groups) {
  if (ctas > 1 || !align_small_cta_enabled()) return kAlignThreads;
  for (int threads : {256, 512}) {
    if (num_slots <= int64_t(threads) * kAlignBatch && num_groups <= int64_t(threads) * kAlignItemsPerThread) {
      return threads;
    }
  }
  return kAlignThreads;
}

template <int kThreads>
auto align_kernel(const detail::AlignParams& p) {
  return p.max_loras > 0 ? (p.topk_ids_int64 ? moe_align_block_size_kernel<kThreads, true, true>
                                             : moe_align_block_size_kernel<kThreads, true, false>)
                         : (p.topk_ids_int64 ? moe_align_block_size_kernel<kThreads, false, true>
                                             : moe_align_block_size_kernel<kThreads, false, false>);
}

}  // namespace

void moe_align_block_size(const detail::AlignParams& p, Stream stream) {
  const int64_t num_groups = p.num_experts * (p.max_loras + 1) + 1;
  if (num_groups > kAlignMaxGroups) {
    throw Error(p.max_loras > 0
                    ? "moelora.moe_lora_align_block_size: argument 'num_experts' x ('max_loras' + 1) expected at most " +
                          std::to_string(kAlignMaxGroups - 1) + " on CUDA, got " + std::to_string(p.num_experts) +
                          " x " + std::to_string(p.max_loras + 1)
                    : "moelora.moe_align_block_size: argument 'num_experts' expected at most " +
                          std::to_string(kAlignMaxGroups - 1) + " on CUDA, got " + std::to_string(p.num_experts));
  }
  if (p.max_loras > kMaxLoraAdapters) {  // the kernel's copy of adapter_enabled
    throw Error("moelora.moe_lora_align_block_size: argument 'max_loras' expected at most " +
                std::to_string(kMaxLoraAdapters) + ", got " + std::to_string(p.max_loras));
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
  const int64_t table_bytes = (p.entry_lora_ids ? 3 : 2) * num_groups * int64_t(sizeof(int));
  const int cache_slots = int(std::min<int64_t>(share, (kAlignSmemBytes - table_bytes) / int64_t(sizeof(uint16_t))));
  const size_t smem_bytes = size_t(table_bytes + int64_t(cache_slots) * int64_t(sizeof(uint16_t)));
  const int threads = align_threads(num_slots, ctas, num_groups);
  const auto kernel = threads == 256   ? align_kernel<256>(p)
                      : threads == 512 ? align_kernel<512>(p)
                                       : align_kernel<kAlignThreads>(p);
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kAlignSmemBytes));
  launch_kernel_in_clusters(kernel, dim3(unsigned(ctas)), dim3(unsigned(threads)), smem_bytes,
                            static_cast<cudaStream_t>(stream), ctas, p, int(num_groups), cache_slots,
                            cutlass::FastDivmod(int(std::max<int64_t>(p.top_k, 1))));
}

}  // namespace moelora::cuda
