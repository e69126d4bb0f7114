// The small-batch kernels' shared pieces (fused_experts_small_batch.cuh): the CTA shape,
// the slot tables both kernels build from topk_ids, and the weights' streaming load.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/params.h"

namespace moelora::cuda::small_batch {

using detail::SmallBatchMoeParams;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// The tables' capacity: the larger of the two limits (16-bit and 8-bit experts).
constexpr int kMaxSlots = int(std::max(kSmallBatchMaxSlots, kSmallBatchMaxSlots8Bit));
static_assert(kMaxSlots <= kThreads, "one thread per slot builds the slot tables");

struct SlotTables {
  int32_t expert[kMaxSlots];           // local expert of slot s, -1: no contribution
  int32_t first[kMaxSlots];            // first slot with the same expert; kMaxSlots when expert is -1
  int32_t distinct_expert[kMaxSlots];  // d -> local expert, d in order of first occurrence
  int32_t group_begin[kMaxSlots + 1];  // slots of d: sorted_slot[group_begin[d] .. group_begin[d + 1])
  int32_t sorted_slot[kMaxSlots];
  int32_t num_distinct;
};

// Every thread of the CTA calls this; it ends with a barrier. O(slots^2) shared reads,
// 64 slots at most.
__device__ inline void build_slot_tables(const SmallBatchMoeParams& p, SlotTables& t) {
  const int num_slots = int(p.num_tokens * p.top_k);
  const int s = int(threadIdx.x);
  if (s < num_slots) {
    const int token = s / int(p.top_k), j = s - token * int(p.top_k);
    const int64_t offset = token * p.topk_ids_stride_token + j * p.topk_ids_stride_k;
    const int64_t id = p.topk_ids_int64 ? static_cast<const int64_t*>(p.topk_ids)[offset]
                                        : int64_t(static_cast<const int32_t*>(p.topk_ids)[offset]);
    int64_t e = -1;
    if (id >= 0 && id < p.num_experts) {
      e = p.expert_map ? int64_t(p.expert_map[id]) : id;
    } else if (p.routing_status && id != -1) {
      atomicOr(p.routing_status, kRoutingBadExpertId);  // -1 is a dropped slot, the rest a routing bug
    }
    t.expert[s] = e >= 0 && e < p.num_local_experts ? int32_t(e) : -1;
  }
  // The whole expert_map, as the alignment and the CPU backend check it (only when asked).
  for (int g = s; p.routing_status && p.expert_map && g < p.num_experts; g += int(blockDim.x)) {
    const int32_t local = p.expert_map[g];
    if (local < -1 || local >= p.num_local_experts) atomicOr(p.routing_status, kRoutingBadExpertMap);
  }
  __syncthreads();
  int first = kMaxSlots, earlier = 0;  // earlier: slots before s on the same expert
  if (s < num_slots && t.expert[s] >= 0) {
    first = s;
    for (int q = s - 1; q >= 0; --q) {
      if (t.expert[q] == t.expert[s]) {
        first = q;
        ++earlier;
      }
    }
  }
  if (s < kMaxSlots) t.first[s] = first;
  __syncthreads();
  if (s < num_slots && first < kMaxSlots) {
    // Experts are ranked by first occurrence; a group starts after every slot of the
    // experts ranked before it.
    int rank = 0, begin = 0;
    for (int q = 0; q < num_slots; ++q) {
      const int first_q = t.first[q];
      rank += first_q == q && q < first;
      begin += first_q < first;
    }
    t.sorted_slot[begin + earlier] = s;
    if (earlier == 0) {
      t.distinct_expert[rank] = t.expert[s];
      t.group_begin[rank] = begin;
    }
  }
  if (s == 0) {
    int distinct = 0, valid = 0;
    for (int q = 0; q < num_slots; ++q) {
      distinct += t.first[q] == q;
      valid += t.first[q] < kMaxSlots;
    }
    t.num_distinct = distinct;
    t.group_begin[distinct] = valid;
  }
  __syncthreads();
}

__device__ __forceinline__ uint4 load_streaming(const void* ptr) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr));
  return v;
}

}  // namespace moelora::cuda::small_batch
