// CPU moe_align_block_size (and moe_lora_align_block_size): group the slots of topk_ids
// by expert (by virtual expert = (expert, adapter) with LoRA), pad every group to a
// multiple of block_size. See include/moelora/ops.h for the contract.
//
// Layout written (num_slots = num_tokens * top_k is the padding sentinel):
//   sorted_token_ids: [group e=0 | group e=1 | ... | group e=E-1 | dropped group | sentinel...]
//   each group = its slots in ascending order, then sentinels up to a multiple of block_size;
//   groups with no slots take no blocks. The dropped group holds the slots whose id is -1;
//   its blocks get expert id -1, so fused_moe writes zeros for them.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/params.h"

namespace moelora::cpu {
namespace {

int64_t read_topk_id(const detail::AlignParams& p, int64_t token, int64_t k) {
  const int64_t offset = token * p.topk_ids_stride_token + k * p.topk_ids_stride_k;
  return p.topk_ids_int64 ? static_cast<const int64_t*>(p.topk_ids)[offset]
                          : int64_t(static_cast<const int32_t*>(p.topk_ids)[offset]);
}

int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

}  // namespace

void moe_align_block_size(const detail::AlignParams& p) {
  const int64_t num_slots = p.num_tokens * p.top_k;
  // With LoRA (max_loras > 0) a group is a virtual expert e * (max_loras + 1) +
  // (adapter + 1); without, the expert. The API has checked every adapter id.
  const int64_t groups_per_expert = p.max_loras + 1;
  const int64_t num_experts = p.num_experts;
  const int64_t num_groups = num_experts * groups_per_expert;
  const int64_t dropped_group = num_groups;  // index of the trailing group of id -1

  // Pass 1: histogram, and validation of every id before anything is written.
  std::vector<int32_t> slot_group(num_slots);  // [num_slots] group of each slot
  std::vector<int64_t> group_count(num_groups + 1, 0);
  for (int64_t token = 0; token < p.num_tokens; ++token) {
    int64_t adapter = -1;
    if (p.max_loras > 0) {
      const int32_t id = p.token_lora_ids[token * p.token_lora_ids_stride];
      if (id >= 0 && id < p.max_loras && (p.adapter_enabled == nullptr || p.adapter_enabled[id] != 0)) adapter = id;
    }
    for (int64_t k = 0; k < p.top_k; ++k) {
      const int64_t id = read_topk_id(p, token, k);
      int64_t group;
      if (id >= 0 && id < num_experts) {
        group = id * groups_per_expert + (adapter + 1);
      } else if (id == -1) {
        group = dropped_group;
      } else {
        throw Error("moelora.moe_align_block_size: argument 'topk_ids' holds " + std::to_string(id) +
                    " at [" + std::to_string(token) + ", " + std::to_string(k) +
                    "]; expected an expert id in [0, " + std::to_string(num_experts) +
                    ") or -1 (dropped slot)");
      }
      slot_group[token * p.top_k + k] = int32_t(group);
      ++group_count[group];
    }
  }

  // Group offsets in sorted_token_ids; every group starts on a block boundary.
  std::vector<int64_t> group_begin(num_groups + 2, 0);
  for (int64_t g = 0; g <= num_groups; ++g) {
    group_begin[g + 1] = group_begin[g] + round_up(group_count[g], p.block_size);
  }
  const int64_t used_length = group_begin[num_groups + 1];
  const int64_t used_blocks = used_length / p.block_size;
  // NOTE: the API sizes the outputs from moe_align_block_size_capacity, which bounds the
  // worst case; this check only guards against a capacity formula and the layout
  // drifting apart (it would otherwise be a silent out-of-bounds write).
  if (used_length > p.max_num_tokens_padded || used_blocks > p.max_num_blocks) {
    throw Error("moelora.moe_align_block_size: the aligned layout needs " + std::to_string(used_length) +
                " entries in " + std::to_string(used_blocks) + " blocks, but 'sorted_token_ids' has " +
                std::to_string(p.max_num_tokens_padded) + " and 'expert_ids' " +
                std::to_string(p.max_num_blocks));
  }

  // Pass 2: write. Sentinels and -1 first, then the slots over them in ascending slot
  // order, which keeps each group stable.
  std::fill(p.sorted_token_ids, p.sorted_token_ids + p.max_num_tokens_padded, int32_t(num_slots));
  std::fill(p.expert_ids, p.expert_ids + p.max_num_blocks, int32_t(-1));
  if (p.block_lora_ids) std::fill(p.block_lora_ids, p.block_lora_ids + p.max_num_blocks, int32_t(-1));
  std::vector<int64_t> cursor(group_begin.begin(), group_begin.end() - 1);  // [num_groups + 1]
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    const int32_t group = slot_group[slot];
    p.sorted_token_ids[cursor[group]++] = int32_t(slot);
  }
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t e = g / groups_per_expert;
    const int32_t block_expert = p.expert_map ? p.expert_map[e] : int32_t(e);
    for (int64_t b = group_begin[g] / p.block_size; b < group_begin[g + 1] / p.block_size; ++b) {
      p.expert_ids[b] = block_expert;
      if (p.block_lora_ids) p.block_lora_ids[b] = int32_t(g % groups_per_expert - 1);
    }
  }
  // The dropped group's blocks keep the -1 written above.
  *p.num_tokens_post_padded = int32_t(used_length);
}

}  // namespace moelora::cpu
