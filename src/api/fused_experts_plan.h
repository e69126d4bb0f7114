// fused_experts' planning: the workspace layout of a call, and the plan of one chunk
// (which path it runs, with which config, in which workspace regions).
#pragma once

#include <cstdint>

#include "api/moe_lora.h"
#include "api/quant_check.h"
#include "common/params.h"
#include "moelora/ops.h"

namespace moelora::detail {

// GEMM1's and GEMM2's ordered-tile counters (GemmParams::tile_counter).
constexpr int kNumTileCounters = 2;

// Workspace layout, each piece 256-byte aligned. cache1 (GEMM1's [slots, 2I], only when
// the activation runs as its own kernel) is dead once the activation has read it, before
// GEMM2 writes cache3 ([slots, H]): the two share one region, and so does the sorted input.
struct WorkspaceLayout {
  int64_t sorted_token_ids, expert_ids, num_tokens_post_padded, tile_counters, cache1, cache2, cache3, sorted_input,
      block_lora_ids, entry_lora_ids, block_lora_masks, lora_intermediate, lora_shrink_partials, lora_shrink_counters,
      total;
  // Quantized experts: the chunk's 8-bit hidden rows [tokens, H] and activation [slots, I],
  // and their scales (QuantScheme::activation_scales' layout).
  int64_t quant_x, quant_x_scales, quant_act, quant_act_scales;
  // The grouped path (GroupedExpertsParams), when a chunk may take it (grouped_rows > 0):
  // the alignment's per-expert offsets and sizes and per-slot entries, the GEMMs' device
  // arrays and CUTLASS workspace, the 8-bit rows by entry and their scales. GEMM outputs
  // by entry go in the cache1/cache3 region.
  int64_t grouped_rows;  // padded entries of the alignment with blocks of 16
  int64_t grouped_entry_offsets, grouped_sizes, grouped_slot_entries, grouped_args, grouped_cutlass_workspace,
      grouped_tensor_scales, grouped_a, grouped_a_scales;
  // Weight-only experts (w4a16 / w8a16): the call's path (weight_only_path). On kDense
  // (weight_only_dense) the sm90 tiles read the packed experts; where the largest chunk
  // cannot take them (adapters, kWeightOnlyTileMaxSlotsPerExpert slots an expert, a config
  // without sm90 tiles) w13 and w2 are dequantized into the layer dtype once a call,
  // [E_local, 2I, H] and [E_local, H, I] (weight_only_copies: dense_w13, dense_w2).
  // NOTE: the copies are all local experts in 16 bits (gpt-oss-120b 6.4 GB): not reserved
  // where the tiles run; a chunk whose tiles cannot run there takes the aligned kernels.
  WeightOnlyPath weight_only_path;
  bool weight_only_dense;
  bool weight_only_copies;
  int64_t dense_w13, dense_w2;  // 0 (no region) without weight_only_copies
  int64_t lora_shrink_partial_rows;  // rows of [*, 2 * rank] fp32 partial sums
  int64_t cache2_rows;  // slots, or the padded entries of the worst block size (sorted activation)
  int64_t sorted_input_rows;  // 0, or cache2_rows when a chunk's config may ask for the sorted input
  AlignCapacity capacity;
};

// The checks of a layer's shape and options that the op and the size queries share
// (ranges that keep every derived size in int64, the scheme, the option values).
void check_fused_experts_shape(const char* op, const FusedExpertsShape& s);
void check_fused_experts_options(const char* op, const FusedExpertsOptions& o);

// For a checked shape and options. with_copies = false leaves out the weight-only
// dequantized copies (the lean layout a smaller workspace may still take: the chunks that
// would read them run the aligned kernels).
WorkspaceLayout workspace_layout(const FusedExpertsShape& s, const FusedExpertsOptions& o, bool with_copies = true);

// The path of a weight-only call (every chunk takes it): options.weight_only_path, or by
// the largest chunk's slots (kDecode up to kSmallBatchMaxSlots8Bit when H and I are
// multiples of 32, kDense from kWeightOnlyDenseSlotsPerExpert slots an expert, kAligned
// between). kDecode on a larger chunk becomes kAligned.
WeightOnlyPath weight_only_path(const FusedExpertsShape& s, const FusedExpertsOptions& o);

// What one chunk of fused_experts runs: its config, the path, and the views of its rows
// and of the workspace regions it uses. The orchestration (fused_experts.cpp) executes it.
struct FusedExpertsChunkPlan {
  int64_t begin = 0, tokens = 0, slots = 0;  // tokens [begin, begin + tokens); slots = tokens * top_k
  MoeKernelConfig config;  // resolved and checked; sorted_input cleared where the delta kernels read x by slot
  int64_t block_size = 0;  // config.block_size
  AlignCapacity capacity;  // of the chunk's alignment (virtual experts with adapters)

  // The path. small_batch: try the small-batch kernels first (a chunk they refuse runs the
  // aligned path). Else the alignment, then GEMM1 with the activation fused
  // (fused_activation) or GEMM1 into cache1 and the activation kernel, then GEMM2, then
  // moe_sum_reduce unless `direct` (GEMM2 writes `out`).
  bool small_batch = false;
  bool weight_only = false;        // w4a16 / w8a16: small_batch, weight_only_aligned, or dense weights
  bool weight_only_aligned = false;  // WeightOnlyPath::kAligned (blocks of 16)
  bool tensor_core_gemms = false;  // both GEMMs on the tensor-core kernels, activation fused
  bool sm90_rows = false;          // ... both on sm90 and loadable: GEMM rows may go by entry
  bool weight_only_tiles = false;  // weight-only on the dense path: the sm90 GEMMs read the packed experts
  bool weight_only_copies = false;  // ... else they read the dequantized copies (the layout's dense_w13/w2)
  bool fused_lora = false;         // adapters: a shrink kernel, the expand in each GEMM's K loop
  bool fused_activation = false;
  bool sorted_activation = false;  // GEMM1 writes cache2 by entry; GEMM2 reads it so
  bool sorted_input = false;       // GEMM1 reads x gathered by entry (x_sorted)
  bool direct = false;

  // The chunk's rows of the arguments.
  TensorView x, topk_ids, topk_weights;
  void* out = nullptr;  // the chunk's first row of `out`
  // Workspace regions (WorkspaceLayout), sized for this chunk.
  TensorView sorted_token_ids, expert_ids, num_tokens_post_padded;  // by `capacity`
  TensorView cache1;     // [slots, 2I]: GEMM1's output before the activation kernel; the small-batch w13 delta
  TensorView cache2;     // [slots, I], or [padded entries, I] with sorted_activation
  TensorView x_sorted;   // [padded entries, H]: x by entry (sorted_input)
  TensorView cache3;     // [slots, H]: GEMM2's output to reduce; the small-batch w2 delta
  TensorView gemm2_out;  // cache3, or the chunk's rows of `out` when direct

  // Quantized experts (FusedExpertsArgs::quant): the 8-bit GEMM inputs and their scales,
  // and how each is quantized (QuantizeParams' blocks: rows x cols, 0 = the whole dim).
  bool quantized = false;
  TensorView x_quantized;    // [tokens, H]
  TensorView x_scales;       // [tokens, ceil(H / block_k)], [tokens, 1] or [1, 1] (a13_scale when static)
  TensorView act_quantized;  // [slots, I]
  TensorView act_scales;     // [slots, ceil(I / block_k)], [slots, 1] or [1, 1] (a2_scale when static)
  int64_t quant_block_rows = 1, quant_block_cols = 0;

  // The grouped path (MoeKernelConfig::grouped_gemm, quantized experts on sm_90a): the
  // alignment in blocks of 16 with per-expert offsets and sizes and per-slot entries, then
  // both GEMMs as CUTLASS grouped GEMMs (GroupedExpertsParams, its regions in the workspace).
  bool grouped = false;
  GroupedExpertsParams grouped_params{};
  int32_t* slot_entries = nullptr;  // [slots]
};

// The plan of tokens [begin, begin + tokens) of a validated call: `shape` is the call's
// (global experts, local experts, LoRA), `layout` its workspace, lora13 / lora2 its
// stacks (zero without adapters), quant its GEMMs' weight scales (quantized experts).
// Throws on a config that fails check_kernel_config.
FusedExpertsChunkPlan plan_fused_experts_chunk(const FusedExpertsArgs& args, const FusedExpertsOptions& options,
                                               const FusedExpertsShape& shape, const WorkspaceLayout& layout,
                                               const LoraStack& lora13, const LoraStack& lora2,
                                               const FusedExpertsQuantParams& quant, int64_t begin, int64_t tokens);

}  // namespace moelora::detail
