// The contract between the C++ API (src/api) and the backends (src/cpu, src/cuda).
//
// The API validates every argument and fills these structs with raw pointers, sizes
// and element strides; a backend trusts them and only computes. Backends never see a
// TensorView and never allocate.
#pragma once

#include <cstdint>

#include "moelora/ops.h"
#include "moelora/quant.h"
#include "moelora/tensor.h"

namespace moelora::detail {

// moe_align_block_size. See include/moelora/ops.h for the contract.
struct AlignParams {
  const void* topk_ids;          // [num_tokens, top_k] int32 or int64
  bool topk_ids_int64;
  int64_t topk_ids_stride_token;  // elements
  int64_t topk_ids_stride_k;
  int64_t num_tokens;
  int64_t top_k;
  int64_t block_size;             // 16..256
  int64_t num_experts;            // global expert count (the range of valid ids)
  const int32_t* expert_map;      // [num_experts] global -> local or -1; null = identity
  int32_t* sorted_token_ids;      // [max_num_tokens_padded]
  int64_t max_num_tokens_padded;
  int32_t* expert_ids;            // [max_num_blocks]
  int64_t max_num_blocks;
  int32_t* num_tokens_post_padded;  // [1]
  // fused_experts: the GEMMs' ordered-tile counters (GemmParams::tile_counter), set to
  // zero by this kernel after it waits for the kernels before it.
  int32_t* tile_counters = nullptr;
  int num_tile_counters = 0;
  // moe_lora_align_block_size (max_loras > 0): groups are virtual experts
  // e * (max_loras + 1) + (adapter + 1), adapter -1 for tokens without an enabled one;
  // block_lora_ids gets each block's adapter. max_loras == 0: groups are experts.
  int64_t max_loras = 0;
  const int32_t* token_lora_ids = nullptr;  // [num_tokens]
  int64_t token_lora_ids_stride = 1;
  const int32_t* adapter_enabled = nullptr;  // [max_loras]; null = all enabled
  // fused_experts' routing status (kRouting* bits, ops.h), or null; num_local_experts:
  // expert_map's value range (the experts the GEMMs hold).
  int32_t* routing_status = nullptr;
  int64_t num_local_experts = 0;
  int32_t* block_lora_ids = nullptr;         // [max_num_blocks]
  // Segmented (CUDA, fused_experts' fused LoRA path; max_loras > 0, block_lora_ids null):
  // the same (expert, adapter) groups in the same order, padded only where an expert ends,
  // so the blocks are those of the plain expert alignment and each block holds runs of a
  // few adapters. entry_lora_ids gets each entry's adapter (-1: none or padding),
  // block_lora_masks each block's set of adapters (bit l).
  int32_t* entry_lora_ids = nullptr;     // [max_num_tokens_padded]
  uint64_t* block_lora_masks = nullptr;  // [max_num_blocks]
  // Segmented: the LoRA shrink's arrival counters, one per 16 entries of the blocks
  // [max_num_blocks * block_size / 16], zeroed here (LoraDeltaParams::shrink_counters).
  int32_t* lora_shrink_counters = nullptr;
  // fused_experts' grouped path (CUDA; with max_loras > 0 on the segmented alignment): each
  // group's first entry and its slot count [num_experts * (max_loras + 1)].
  int32_t* group_entry_offsets = nullptr;
  int32_t* group_sizes = nullptr;
};

// The adapter of token m: token_lora_ids[m] when in [0, max_loras) and enabled, else -1.
struct LoraAdapterParams {
  const int32_t* token_lora_ids;  // [num_tokens]
  int64_t token_lora_ids_stride;
  const int32_t* adapter_enabled;  // [max_loras]; null = all enabled
  const float* adapter_scale;      // [max_loras]; null = 1
  int64_t max_loras;
  int32_t* routing_status = nullptr;  // fused_experts' status word (kRouting* bits), or null
};

// One output slice of a LoRA stack: lora_a [L, E, rank, K], lora_b [L, E, N_slice, rank],
// unit stride on the last dim.
struct LoraSliceParams {
  const void* lora_a;
  int64_t a_stride_lora, a_stride_expert, a_stride_rank;
  const void* lora_b;
  int64_t b_stride_lora, b_stride_expert, b_stride_n;
};

// The LoRA delta of an expert GEMM (fused_moe_lora, and fused_experts with adapters):
//   shrink: intermediate[s, c, :] = a[s / a_top_k] · lora_a[c][l, e]ᵀ           [rank]
//   expand: out[s, col(c, j)] = (add_inputs ? out : 0) + scale[l] · Σ_i
//           intermediate[s, c, i] · lora_b[c][l, e, j, i]  (× routed weight of s)
// for every slot s with an adapter l and an expert e >= 0; every other slot's row is kept
// (add_inputs) or zeroed. col(c, j) = c * N_slice + j, or j * num_slices + c when
// interleaved_slices. Slots come per block of the virtual alignment (sorted_token_ids
// non-null: each block one (expert, adapter)), or one by one from topk_ids.
struct LoraDeltaParams {
  DType dtype;  // of a, the stacks, the intermediate and out
  const void* a;
  int64_t a_stride_row;  // unit stride on K
  int64_t a_top_k;       // a row = slot / a_top_k
  int64_t K, N_slice, rank;
  int num_slices;
  LoraSliceParams slices[2];
  bool interleaved_slices;
  int64_t num_experts;  // E of the stacks (local experts)
  void* out;
  int64_t out_stride_row, out_stride_n;
  bool add_inputs;
  const float* topk_weights;  // indexed by slot like GemmParams; null = no multiply
  int64_t topk_weights_cols, topk_weights_stride_row, topk_weights_stride_col;
  LoraAdapterParams adapters;  // token of slot s = s / top_k
  int64_t top_k;
  int64_t num_slots;
  // [num_slots, num_slices, rank] of dtype. On the segmented alignment (entry_lora_ids;
  // the shrink alone, for GemmParams::lora_t): [max_num_tokens_padded, num_slices * rank]
  // by entry, scaled by the adapter's scale; only entries with an enabled adapter written.
  void* intermediate;
  // a row = entry (GEMM2's activation in sorted order) instead of slot / a_top_k.
  bool a_rows_by_entry = false;
  // Per-slot mode (sorted_token_ids == null): expert of slot s = topk_ids (-1 or out of
  // range: none), through expert_map when given.
  const void* topk_ids;
  bool topk_ids_int64;
  int64_t topk_ids_stride_token, topk_ids_stride_k;
  const int32_t* expert_map;
  int64_t num_global_experts;  // the range of topk_ids
  // Block mode: moe_lora_align_block_size's outputs.
  const int32_t* sorted_token_ids;
  const int32_t* expert_ids;
  const int32_t* block_lora_ids;
  const int32_t* entry_lora_ids = nullptr;  // segmented alignment (with block_lora_ids null): per entry
  const uint64_t* block_lora_masks = nullptr;  // segmented: each block's adapters (bit l)
  // The segmented shrink's split-K scratch: fp32 partial sums [shrink_partial_rows,
  // num_slices * rank] and arrival counters (one per 16 entries), zero on entry (the
  // alignment zeroes them; the last split of a row group resets its own). Null: no split.
  float* shrink_partials = nullptr;
  int64_t shrink_partial_rows = 0;
  // Entries the segmented alignment can fill (padded per expert, not per adapter group as
  // max_num_tokens_padded allows): each split's share of the partial sums.
  int64_t segmented_entries = 0;
  int32_t* shrink_counters = nullptr;
  const int32_t* num_tokens_post_padded;
  int64_t max_num_tokens_padded;
  int64_t max_num_blocks;
  int64_t block_size;
};

enum class ActivationKind : int8_t { kSiluAndMul, kGeluAndMul, kSwigluOai };

// quantize. See include/moelora/quant.h. input/out [batch, rows, cols] with unit column
// stride; scales [batch, ceil(rows / block_rows), ceil(cols / block_cols)], any strides.
// Block sizes are resolved (a whole dim, not 0).
struct QuantizeParams {
  DType input_dtype;  // bf16, fp16 or fp32
  const void* input;
  int64_t input_stride_batch, input_stride_row;
  DType out_dtype;  // kFloat8E4M3 or kInt8
  void* out;
  int64_t out_stride_batch, out_stride_row;
  float* scales;
  int64_t scales_stride_batch, scales_stride_row, scales_stride_col;
  int64_t batch, rows, cols;
  int64_t block_rows, block_cols;
  bool static_scales;
};

// The W8A8 operands of a quantized expert GEMM (GemmParams::quant, SmallBatchMoeParams::quant):
// a and w hold `element`s; the product over K is
//   Σ_kb a_scale(row, kb) · w_scale(e, n, kb) · Σ_{k in block kb} a[row, k] · w[e, n, k]
// with kb = k / block_k for kBlock scales, a single block otherwise:
//   a_scale: kBlock [rows of a, ceil(K / block_k)], kChannel [rows of a], kTensor [1]
//   w_scale: kBlock [E, ceil(N_w / block_n), ceil(K / block_k)], kChannel [E, N_w], kTensor [E]
// (N_w: w's rows, 2N for a gated GEMM). Strides in elements.
struct GemmQuantParams {
  bool enabled = false;
  DType element = DType::kFloat8E4M3;
  ScaleGranularity a_scales = ScaleGranularity::kBlock;
  ScaleGranularity w_scales = ScaleGranularity::kBlock;
  int64_t block_n = 128, block_k = 128;
  const float* a_scale = nullptr;
  int64_t a_scale_stride_row = 0, a_scale_stride_k = 0;
  const float* w_scale = nullptr;
  int64_t w_scale_stride_expert = 0, w_scale_stride_n = 0, w_scale_stride_k = 0;
};

// Weight-only experts (issue 30; FusedExpertsQuant with a w4a16 / w8a16 scheme): one
// GEMM's packed weights, scales and zero points. w[e, n, k] = (q - zero) * scale with
//   q: bits 4: (w[e][n][k / 2] >> 4 (k % 2)) & 15; bits 8: w[e][n][k]   (bytes)
//   scale: scale[e][n][k / group_size] (group_size 0: one group, stride_k unused), `dtype`
//   zero: null: 8 / 128; else zero[e][n][g], or zero_packed (4-bit): nibble n % 2 of
//         zero[e][n / 2][g]
// Strides in elements (bytes for w and zero).
struct WeightOnlyParams {
  bool enabled = false;
  int bits = 4;
  int64_t group_size = 0;
  const uint8_t* w = nullptr;
  int64_t w_stride_expert = 0, w_stride_n = 0;
  DType scale_dtype = DType::kBFloat16;
  const void* scale = nullptr;
  int64_t scale_stride_expert = 0, scale_stride_n = 0, scale_stride_k = 0;
  const uint8_t* zero = nullptr;
  bool zero_packed = false;
  int64_t zero_stride_expert = 0, zero_stride_n = 0, zero_stride_k = 0;
};

// Weight-only experts dequantized into the layer dtype (CUDA, fused_experts' larger
// chunks): out[e][n][k] = (q - zero) * scale for e < num_experts, n < N, k < K.
struct DequantizeExpertsParams {
  WeightOnlyParams w;
  DType dtype;  // of out
  void* out;    // [num_experts, N, K] contiguous
  int64_t num_experts, N, K;
};

// fused_moe: out[s] = a[s / top_k] · w[e]ᵀ (× routed weight) over aligned blocks.
//
// With `gated` (CUDA only; fused_experts' GEMM1), w holds 2N rows, a gate row and an up
// row per output column j (rows j and N + j, or 2j and 2j + 1 for swiglu_oai), and
// out[s][j] = act(gate_j × routed weight, up_j × routed weight): the activation runs in
// the epilogue and the [slots, 2N] intermediate never reaches memory.
struct GemmParams {
  DType dtype;                    // of a, w and out (of out alone with quant)
  const void* a;                  // [num_rows, K]
  int64_t a_stride_row, a_stride_k;
  const void* w;                  // [num_experts, N, K]
  int64_t w_stride_expert, w_stride_n, w_stride_k;
  void* out;                      // [num_slots, N]
  int64_t out_stride_row, out_stride_n;
  const float* topk_weights;      // [*, topk_weights_cols], indexed by slot; null = no multiply
  int64_t topk_weights_cols;
  int64_t topk_weights_stride_row, topk_weights_stride_col;
  const int32_t* sorted_token_ids;  // [sorted_token_ids_size]
  int64_t sorted_token_ids_size;
  const int32_t* expert_ids;        // [max_num_blocks]
  const int32_t* num_tokens_post_padded;  // [1], device-side count
  int64_t max_num_blocks;           // grid bound; blocks past *num_tokens_post_padded exit
  int64_t num_rows;                 // rows of a
  int64_t num_slots;                // rows of out; also the padding sentinel
  int64_t num_experts;              // E of w
  int64_t N, K;
  int64_t top_k;                    // a row = slot / top_k
  int64_t block_size;               // entries per expert block of sorted_token_ids
  GemmTile tile;                    // CUDA kernel and tile; kAuto = the launcher's heuristic
  // sm90 kernel: take (cluster) tiles in raster order from this device counter,
  // zero at launch (fused_experts has the alignment kernel zero it). Null: a static
  // persistent schedule.
  int32_t* tile_counter = nullptr;
  bool gated = false;               // N outputs from 2N weight rows through `activation`
  ActivationKind activation = ActivationKind::kSiluAndMul;
  float alpha = 0.f, limit = 0.f;   // swiglu_oai only
  // sm90 kernel only (fused_experts with both GEMMs on it): GEMM1 stores row r of a tile
  // at its entry (m_tile * block_m + r) instead of its slot; GEMM2 reads its A rows
  // there, so a tile's rows are consecutive and arrive in one TMA box. GEMM1 reads A by
  // entry too when x was copied into sorted order (MoeKernelConfig::sorted_input).
  bool out_rows_sorted = false;
  bool a_rows_sorted = false;
  // Fused LoRA expand (sm90 kernel in 1-CTA clusters; fused_experts with adapters, on
  // the segmented alignment, AlignParams::block_lora_masks): a tile whose block holds n
  // adapters runs ceil(n * lora_t_cols / 64) more K steps after its base ones. Adapter j
  // of the block (j-th set bit) owns K columns [j * lora_t_cols, +lora_t_cols): there A =
  // the rows of lora_t (by entry: the shrink's output, already scaled by the adapter's
  // scale) whose entry has that adapter, zero for the other rows, and B = the adapter's
  // lora_b rows for the tile's columns, slice s at [s * lora_rank, +lora_rank), zero off
  // the slice. So acc = x · wᵀ + Σ_rows' adapter t · [B_0 | B_1]ᵀ before the epilogue
  // (routed weight, activation). lora_t == null: no LoRA.
  const void* lora_t = nullptr;               // [sorted_token_ids_size, lora_t_cols], dtype
  const uint64_t* block_lora_masks = nullptr;  // [max_num_blocks]
  const int32_t* entry_lora_ids = nullptr;     // [sorted_token_ids_size], -1 = none
  int64_t lora_t_cols = 0;                  // lora_slices * lora_rank, a multiple of 8
  int64_t lora_rank = 0;                    // a multiple of 8
  int lora_slices = 0;                      // 1 or 2
  LoraSliceParams lora[2] = {};             // lora_b of each slice (lora_a is the shrink's)
  // Set when the kernel right before this GEMM is lora_t's shrink (moe_lora_shrink), which
  // lets it launch once past its own wait: then a kernel that honours it (the sm80 tiles)
  // waits only before its first LoRA K step, so the base K steps stream beside the shrink.
  // What it reads before that wait (a, w, the alignment, the routing) and what it writes
  // (out) the shrink neither writes nor reads. Kernels that ignore it wait at entry.
  bool lora_late_wait = false;
  // W8A8 (issue 28): a and w are 8-bit with scales; out keeps `dtype`. No LoRA expand,
  // no sorted rows.
  GemmQuantParams quant{};
  // Weight-only experts (the CPU backend, and the CUDA sm90 kernel: fused_moe_weight_only_loadable;
  // CUDA runs dequantized experts otherwise): w's rows come from these packed weights
  // (w, w_stride_* unused); K counts weights.
  WeightOnlyParams weight_only{};
};

// fused_experts' small-batch path (MoeKernelConfig::small_batch, CUDA only), straight
// from topk_ids: GEMM1 + activation into `act`, then GEMM2 + the top-k sum into `out`.
// fused_experts_small_batch_supported() says whether the kernels take these (unit K
// strides, 16-byte aligned rows, 16-bit float types, at most kSmallBatchMaxSlots slots;
// kSmallBatchMaxSlots8Bit with quant13 enabled).
struct SmallBatchMoeParams {
  DType dtype;                    // bf16 or fp16: x, w13, w2, act, out
  const void* x;                  // [num_tokens, H], unit stride on H
  int64_t x_stride_token;
  const void* w13;                // [num_local_experts, 2I, H]
  int64_t w13_stride_expert, w13_stride_n, w13_stride_k;
  const void* w2;                 // [num_local_experts, H, I]
  int64_t w2_stride_expert, w2_stride_n, w2_stride_k;
  const void* topk_ids;           // [num_tokens, top_k], global ids
  bool topk_ids_int64;
  int64_t topk_ids_stride_token, topk_ids_stride_k;
  const float* topk_weights;      // [num_tokens, top_k]
  int64_t topk_weights_stride_token, topk_weights_stride_k;
  const int32_t* expert_map;      // [num_experts] global -> local or -1; null = identity
  int64_t num_tokens, top_k;
  int64_t num_experts;            // global: the range of valid ids
  int64_t num_local_experts;      // experts in w13 / w2
  int64_t H, I;
  void* act;                      // [num_tokens * top_k, I] workspace: GEMM1's output
  void* out;                      // [num_tokens, H], or [num_tokens, top_k, H] with no_combine
  int64_t out_stride_token, out_stride_k;
  bool no_combine;
  bool router_weight_on_input;    // the routed weight scales GEMM1 (before the activation)
  float routed_scaling_factor;    // applied to the top-k sum (not with no_combine)
  ActivationKind activation;
  float alpha, limit;             // swiglu_oai only
  // LoRA (fused_experts with adapters): per-slot deltas added to GEMM1's gate and up
  // values before the activation ([num_tokens * top_k, 2I] in w13's row order) and to
  // GEMM2's rows before the routed weight ([num_tokens * top_k, H]); null: none.
  const void* gate_up_delta = nullptr;
  const void* down_delta = nullptr;
  // Set only when the kernels right before each GEMM are its LoRA delta kernels, which let
  // it launch once past their own waits: the GEMMs then wait for them only where they first
  // read a delta, so the delta kernels run beside the weight streaming. What the GEMMs read
  // before that wait (x, the routing, the weights; GEMM2's act) was written by kernels that
  // completed before the delta kernels passed their waits. CTA 0 waits on every path (a
  // chunk with no local expert reads no delta), so the grid completes after them.
  bool late_delta_wait = false;
  // W8A8 (issue 28), quant13.enabled: x (already quantized, strides in its elements) and
  // w13 hold quant13.element values with quant13's scales; GEMM1 still writes `act` in
  // `dtype`, which the caller quantizes into act_quantized [num_tokens * top_k, I] (rows by
  // slot, quant2's a scales) for GEMM2 against w2 and quant2's w scales.
  GemmQuantParams quant13{};
  GemmQuantParams quant2{};
  const void* act_quantized = nullptr;
  // Weight-only experts (issue 30), w13q.enabled: w13 and w2 are these packed weights
  // (w13, w2 and their strides unused); x and act stay in `dtype`.
  WeightOnlyParams w13q{};
  WeightOnlyParams w2q{};
  int32_t* routing_status = nullptr;  // fused_experts' status word (kRouting* bits), or null
};

// fused_experts' weight-only experts on chunks past the small-batch kernels (issue 30,
// the aligned path): the small-batch kernels' per-slot work (`moe`: x, the packed
// weights, routing, activation, LoRA deltas) over the blocks of moe_align_block_size
// (block_size 16: the MMA's two n8 tiles) instead of slot tables. GEMM1 writes moe.act by
// slot; GEMM2 writes each slot's row times its routed weight (unless
// router_weight_on_input) into down_out [slots, H] (down_out_stride_slot apart; the
// caller's `out` with no_combine or top_k == 1 and no scaling), zeros for the slots of
// blocks without a local expert; moe_sum_reduce follows unless down_out is `out`.
// moe.down_delta may be down_out itself (each element is read, then written, by one lane).
struct WeightOnlyAlignedParams {
  SmallBatchMoeParams moe;
  const int32_t* sorted_token_ids;
  const int32_t* expert_ids;
  const int32_t* num_tokens_post_padded;
  int64_t max_num_blocks;
  void* down_out;
  int64_t down_out_stride_slot;
};

// input [num_rows, 2 * width] -> out [num_rows, width]; unit column stride on both.
struct ActivationParams {
  DType dtype;      // of input
  DType out_dtype;  // of out: dtype, or (CPU, quantized experts) the layer's from fp32
  ActivationKind kind;
  const void* input;
  int64_t input_stride_row;
  void* out;
  int64_t out_stride_row;
  int64_t num_rows;
  int64_t width;  // I
  float alpha;    // swiglu_oai only
  float limit;    // swiglu_oai only
};

// input [num_tokens, top_k, hidden] -> out [num_tokens, hidden]; unit stride on hidden.
struct SumReduceParams {
  DType dtype;
  const void* input;
  int64_t input_stride_token, input_stride_k;
  void* out;
  int64_t out_stride_token;
  int64_t num_tokens, top_k, hidden;
  float scale;
  // CUDA, fused_experts' grouped path: the input holds one row per entry; slot
  // (t, j)'s row is slot_entries[t * top_k + j] (-1: none, adds nothing), weighted by
  // topk_weights[t, j] before the sum. input_stride_k is then the entry row stride.
  const int32_t* slot_entries = nullptr;
  const float* topk_weights = nullptr;
  int64_t topk_weights_stride_token = 0, topk_weights_stride_k = 0;
};

// fused_experts' input in sorted order (CUDA only; GEMM1 then loads each tile's rows as
// one TMA box, GemmParams::a_rows_sorted): out[e] = input[sorted_token_ids[e] / top_k]
// for every entry e < *num_tokens_post_padded whose slot is real. Padding rows are left
// as they are: a GEMM's output rows depend only on their own A rows, and padding rows are
// never stored.
struct GatherRowsParams {
  DType dtype;                            // any; rows 4-byte aligned (16-byte: faster)
  const void* input;                      // [num_slots / top_k, width]
  int64_t input_stride_row;
  void* out;                              // [max_num_tokens_padded, width]
  int64_t out_stride_row;
  const int32_t* sorted_token_ids;        // [max_num_tokens_padded]
  const int32_t* num_tokens_post_padded;  // [1], device-side count
  int64_t max_num_tokens_padded;
  int64_t num_slots;                      // the padding sentinel
  int64_t top_k;
  int64_t width;
  // fused_experts' grouped path: also each slot's entry [num_slots] (every slot has one
  // entry), -1 where the entry's block has no local expert (expert_ids, block_size).
  int32_t* slot_entries = nullptr;
  const int32_t* expert_ids = nullptr;
  int64_t block_size = 0;
};

// fused_experts' grouped path (CUDA, sm_90a; quantized experts, many slots per expert):
// both expert GEMMs as CUTLASS grouped GEMMs, one group per (global) expert, over rows in
// entry order of the alignment (each expert's slots contiguous from its first entry):
//   x quantized by token -> rows and scales gathered by entry into `a` -> GEMM1 -> d [entries, 2I]
//   -> activation + quantization by entry into `a` (moe_activation_quantize) -> GEMM2 -> d [entries, H]
//   -> moe_sum_reduce through slot_entries, with the routed weights.
// `a`/`a_scales` and `d` hold GEMM1's operands, then GEMM2's (each GEMM's input is dead once
// it has run). The arrays CUTLASS reads (problem sizes, pointers, strides) are written on the
// device by moe_grouped_gemm_args, so nothing waits for the host.
struct GroupedExpertsParams {
  DType dtype;                       // of d (the layer's)
  GemmQuantParams quant13, quant2;   // scheme and weight scales of each GEMM (a_scale unused);
                                     // not enabled: 16-bit experts, operands in dtype
  int64_t num_groups;                // global experts
  const int32_t* expert_map;         // [num_groups] -> local expert or -1; null = identity
  // [num_groups * groups_per_expert]: written by the alignment (AlignParams'), read by the
  // args. With adapters the alignment's groups are (expert, adapter or none), an expert's
  // groups_per_expert (max_loras + 1) of them packed in a row (the segmented alignment):
  // the expert's rows span them all.
  int32_t* group_entry_offsets;
  int32_t* group_sizes;
  int64_t groups_per_expert = 1;
  int64_t H, I;
  const void* w13;                   // [E_local, 2I, H]
  int64_t w13_stride_expert, w13_stride_n;
  const void* w2;                    // [E_local, H, I]
  int64_t w2_stride_expert, w2_stride_n;
  void* a;                           // [entries, max(H, I)] 8-bit, or dtype (16-bit experts)
  float* a_scales;                   // kBlock [entries, ceil(K / 128)], kChannel [entries]
  const float* x_tensor_scale;       // kTensor activations: x's scale (GEMM1)
  const float* act_tensor_scale;     // kTensor activations: the activation's (GEMM2)
  float* act_amax;                   // kTensor dynamic: moe_activation_quantize's absmax, zeroed by the args
  void* d;                           // [entries, max(2I, H)] in dtype
  void* args;                        // grouped_experts_args_bytes(num_groups)
  void* cutlass_workspace;
  int64_t cutlass_workspace_bytes;
  GroupedGemmTiles tiles1, tiles2;   // each GEMM's CUTLASS tiles (not kAuto)
};
// The device arrays of both GEMMs: per GEMM, problem sizes (3 int32 a group, 16-byte
// rounded), then eight 8-byte arrays (a, b, d pointers; their row strides; a and w scale
// pointers).
#ifdef __CUDACC__
__host__ __device__
#endif
inline int64_t grouped_gemm_args_bytes(int64_t num_groups) {
  return (num_groups * 12 + 15) / 16 * 16 + 8 * 8 * num_groups;
}
inline int64_t grouped_experts_args_bytes(int64_t num_groups) { return 2 * grouped_gemm_args_bytes(num_groups); }
// CUTLASS's own workspace for the grouped GEMMs: TMA descriptors, 4 of 128 bytes per SM,
// reserved for up to 256 SMs (checked against Gemm::get_workspace_size at each run).
constexpr int64_t kGroupedExpertsCutlassWorkspaceBytes = 256 * 4 * 128;

// fused_experts' grouped path: GEMM2's input, the activation of GEMM1's rows by entry,
// quantized (or, with element = dtype, rounded to the layer dtype: 16-bit experts). Row e is real when e < *num_tokens_post_padded, its slot is real and its
// block's expert is local; others are not read nor written. Scales as GemmQuantParams'
// activation scales; kTensor dynamic: *amax collects the absmax (one launch), then the
// second writes *scales and the elements.
struct ActivationQuantizeParams {
  DType dtype;                       // of input
  ActivationKind kind;
  float alpha, limit;                // swiglu_oai only
  const void* input;                 // [entries, 2I]
  DType element;                     // kFloat8E4M3, kInt8, or dtype (no scales)
  void* out;                         // [entries, I]
  ScaleGranularity granularity;      // kBlock (block_k 128), kChannel or kTensor
  float* scales;                     // kBlock [entries, ceil(I / 128)], kChannel [entries], kTensor [1]
  bool static_scale;                 // kTensor: *scales is the caller's
  float* amax;                       // kTensor dynamic: [1] scratch
  const int32_t* sorted_token_ids;
  const int32_t* expert_ids;
  const int32_t* num_tokens_post_padded;
  int64_t max_num_tokens_padded, num_slots, block_size, width;  // width = I
};

// sparse_mla_decode. See include/moelora/ops.h for the contract. Strides in elements.
struct SparseMlaDecodeParams {
  const void* q;  // [num_tokens, num_heads, kMlaHeadDim] bf16
  int64_t q_stride_token, q_stride_head;
  const void* kv;  // [num_kv_rows, kMlaHeadDim] bf16
  int64_t kv_stride_row;
  const int32_t* indices;  // [num_tokens, topk]
  int64_t indices_stride_token;
  void* out;  // [num_tokens, num_heads, kMlaValueDim] bf16
  int64_t out_stride_token, out_stride_head;
  float* lse;  // [num_tokens, num_heads] or null
  int64_t lse_stride_token, lse_stride_head;
  const int32_t* topk_length;  // [num_tokens] or null
  int64_t topk_length_stride;
  const float* attn_sink;  // [num_heads] or null
  int64_t attn_sink_stride;
  int64_t num_tokens, num_heads, num_kv_rows, topk;
  float softmax_scale;
  int num_splits;   // CUDA: resolved, >= 1 (the CPU runs one pass)
  void* workspace;  // CUDA with num_splits > 1: the partial outputs and their LSEs
};

}  // namespace moelora::detail

// Backend entry points. Each has the same signature in both backends; CPU ignores the
// stream.
namespace moelora::cpu {
void moe_align_block_size(const detail::AlignParams& p);
void fused_moe(const detail::GemmParams& p);
void activation(const detail::ActivationParams& p);
void moe_sum_reduce(const detail::SumReduceParams& p);
void moe_lora_delta(const detail::LoraDeltaParams& p);
void sparse_mla_decode(const detail::SparseMlaDecodeParams& p);
void quantize(const detail::QuantizeParams& p);
}  // namespace moelora::cpu

namespace moelora::detail {
// What the config registry needs to know about the current CUDA device.
struct CudaDeviceFacts {
  const char* name;  // e.g. "NVIDIA H100 80GB HBM3"; valid for the process lifetime
  int cc_major, cc_minor;
  int num_sms;
  bool sm90_kernels;  // the build has sm_90a kernels and the device runs them
};
}  // namespace moelora::detail

namespace moelora::cuda {
bool device_available();
detail::CudaDeviceFacts current_device_facts();
// Programmatic dependent launch on/off for this process (default on where the device
// has it, unless $MOELORA_PDL=0). For A/B timing against launches without it.
void set_pdl_allowed(bool allowed);
// The GEMMs' late waits (SmallBatchMoeParams::late_delta_wait, GemmParams::lora_late_wait)
// on/off for this process (default on, unless $MOELORA_LATE_WAITS=0): off, every GEMM of
// the layer waits for the kernel before it at entry. For A/B timing, and to rule the late
// waits out when a result looks wrong.
void set_late_waits_allowed(bool allowed);
bool late_waits_enabled();
// The alignment's small CTA (256 or 512 threads where one CTA aligns at most 2048 slots) on/off
// for this process (default on, unless $MOELORA_ALIGN_SMALL_CTA=0: 1024 threads always). For
// A/B timing; tests run the small slot counts both ways.
void set_align_small_cta_enabled(bool enabled);
bool align_small_cta_enabled();
// The sm80 expert GEMMs' 16 x 128 tile with its prologue's kStages - 1 loads in a loop, not
// unrolled (6,464 -> 4,584 SASS instructions; default on, unless $MOELORA_SM80_COMPACT=0: the
// unrolled prologue). For A/B timing; tests run the sm80 cases both ways.
void set_sm80_compact_prologue_enabled(bool enabled);
bool sm80_compact_prologue_enabled();
// Kernel plans treat a CTA as able to have at most `bytes` of shared memory (0: the
// device's own opt-in limit) and an SM `bytes` + 1 KB: an H100 then runs the plan an A100
// (166,912) gets. For tests and benchmarks: a workspace query and its op's launch must
// see the same limit.
void set_cta_smem_limit(int bytes);
void moe_align_block_size(const detail::AlignParams& p, Stream stream);
void fused_moe(const detail::GemmParams& p, Stream stream);
// The tensor-core kernels load these operands (16-bit types, K-contiguous 16-byte rows);
// otherwise fused_moe runs the CUDA-core kernel, which takes neither sorted mode.
bool fused_moe_tensor_core_loadable(const detail::GemmParams& p);
// The sm90 kernel reads p.weight_only's packed experts itself (an sm_90 device and an
// sm_90a build, K % 32 == 0, unit K strides, 16-byte aligned rows); else fused_experts
// runs the 16-bit GEMMs on dequantized copies.
bool fused_moe_weight_only_loadable(const detail::GemmParams& p);
void activation(const detail::ActivationParams& p, Stream stream);
void moe_sum_reduce(const detail::SumReduceParams& p, Stream stream);
void moe_gather_sorted_rows(const detail::GatherRowsParams& p, Stream stream);
// fused_experts' grouped path (GroupedExpertsParams): whether this build and device run it
// for these shapes and scales, and its steps. grouped_experts_args writes both GEMMs' arrays
// (after the alignment); grouped_experts_gemm runs GEMM 1 or 2.
bool grouped_experts_supported(const detail::GroupedExpertsParams& p);
void grouped_experts_args(const detail::GroupedExpertsParams& p, Stream stream);
void grouped_experts_gemm(const detail::GroupedExpertsParams& p, int gemm, Stream stream);
void moe_activation_quantize(const detail::ActivationQuantizeParams& p, Stream stream);
void quantize(const detail::QuantizeParams& p, Stream stream);
// Whether the device runs p.quant's element type on its tensor cores (fp8: sm_89+,
// int8: sm_80+); fused_moe throws for a quantized call otherwise.
bool quant_element_supported(DType element);
// The W8A8 kernels load these operands (K % 16 == 0, unit K strides, 16-byte aligned
// rows; block scales with block_k 128).
bool fused_moe_w8a8_loadable(const detail::GemmParams& p);
// Two launches (shrink, expand); base-only blocks and slots skip the LoRA work.
void moe_lora_delta(const detail::LoraDeltaParams& p, Stream stream);
// The shrink alone, by entry (on the segmented alignment, LoraDeltaParams::entry_lora_ids), for a GEMM with
// the fused expand (GemmParams::lora_t).
void moe_lora_shrink(const detail::LoraDeltaParams& p, Stream stream);
// The expand on the segmented alignment, added into out's rows by entry (t from
// moe_lora_shrink, scaled): fused_experts' grouped path, whose GEMMs take no expand.
void moe_lora_expand_entries(const detail::LoraDeltaParams& p, Stream stream);
// moe_lora_expand_entries and moe_lora_expand_activation by 16-entry groups, a warp a group's
// 32 columns (16-bit types, 16-byte rows, slices x padded rank <= 64: the callers check and
// choose them by lora_expand_groups_use()).
void moe_lora_expand_groups(const detail::LoraDeltaParams& p, Stream stream);
void moe_lora_expand_activation_groups(const detail::LoraDeltaParams& p, const detail::ActivationQuantizeParams& act,
                                       Stream stream);
// Where the expands run by 16-entry groups ($MOELORA_LORA_EXPAND_GROUPS): 0 never (the
// column tiles everywhere), 1 (the default) where the tiles would not stream by their rule
// (short runs), 2 wherever they fit. For A/B timing; set_lora_expand_groups_use for tests.
enum class ExpandGroupsUse : int { kNever = 0, kByRule = 1, kAlways = 2 };
ExpandGroupsUse lora_expand_groups_use();
void set_lora_expand_groups_use(ExpandGroupsUse use);
// Where moe_sum_reduce loads kSlotBatch slots' rows at a time ($MOELORA_SUM_BATCHED): 0 never,
// 1 (the default) where its grid holds at most 4 CTAs an SM (small M), 2 always. For A/B
// timing; set_sum_batched_use for tests.
enum class SumBatchedUse : int { kNever = 0, kByRule = 1, kAlways = 2 };
SumBatchedUse sum_batched_use();
void set_sum_batched_use(SumBatchedUse use);
// GEMM1's expand and the gated activation in one pass (16-bit experts): act.input is p's
// `out` (GEMM1's rows by entry); each row plus its delta goes through the activation into
// act.out, GEMM1's rows are not written back. Replaces moe_activation_quantize there.
void moe_lora_expand_activation(const detail::LoraDeltaParams& p, const detail::ActivationQuantizeParams& act,
                                Stream stream);
// moe_lora_expand_activation on/off for this process (default on, unless
// $MOELORA_LORA_EXPAND_ACTIVATION=0): off, moe_lora_expand_entries writes GEMM1's rows back
// and moe_activation_quantize reads them. For A/B timing.
bool lora_expand_activation_enabled();
// How the expand kernels' CTAs take column tiles ($MOELORA_LORA_EXPAND_STREAM): 0 one a CTA,
// its pairs in rounds; 1 (the default) a stride of them streamed where the mean (expert,
// adapter) run is long or a CTA would walk many; 2 streamed at every run length. For A/B
// timing; set_lora_expand_stream_use for tests.
enum class ExpandStreamUse : int { kNever = 0, kByRule = 1, kAlways = 2 };
ExpandStreamUse lora_expand_stream_use();
void set_lora_expand_stream_use(ExpandStreamUse use);
// Where moe_lora_shrink takes its warp-tile kernel ($MOELORA_LORA_SHRINK_WARP_TILES): 0 never
// (the segmented shrink), 1 (the default) at up to 1024 slots, and past them where the mean
// (expert, adapter) run is under 32 and K at most 8192, or under 64 and K at most 4096; 2 at
// every slot count, run length and K. For A/B timing.
enum class WarpTilesUse : int { kNever = 0, kByRule = 1, kAlways = 2 };
WarpTilesUse lora_shrink_warp_tiles_use();
// For this process, over the environment's (tests take the fallback with kNever).
void set_lora_shrink_warp_tiles_use(WarpTilesUse use);
// Whether p's tile (kSm80, or kSm90 where available) can run with the fused expand of
// this stack: 16-bit types, rank % 8 == 0, lora_b rows 16-byte aligned.
bool fused_moe_lora_expand_supported(const detail::GemmParams& p, int64_t rank, int num_slices,
                                     const detail::LoraSliceParams* slices);
// The small-batch kernels run these parameters (slot count, dtype, alignment).
bool fused_experts_small_batch_supported(const detail::SmallBatchMoeParams& p);
// Both kernels, or one: GEMM1 + activation (stage 1), GEMM2 + the top-k sum (stage 2).
// With LoRA the down delta is computed from GEMM1's output between the two.
void fused_experts_small_batch(const detail::SmallBatchMoeParams& p, Stream stream, int stages = 3);
// Weight-only experts into the layer dtype (fused_experts' chunks past the decode kernels).
void dequantize_experts(const detail::DequantizeExpertsParams& p, Stream stream);
// Weight-only experts over the alignment (WeightOnlyAlignedParams): GEMM1 + activation
// (stage 1), GEMM2 (stage 2).
void fused_experts_weight_only_aligned(const detail::WeightOnlyAlignedParams& p, Stream stream, int stage);
// The split count for a shape on the current device (requested > 0: that, capped by the
// key blocks of topk, or block pairs for the wgmma kernel, and kMlaMaxSplits), and the
// workspace bytes of a split count.
int sparse_mla_decode_num_splits(int64_t num_tokens, int64_t num_heads, int64_t topk, int requested);
int64_t sparse_mla_decode_workspace_bytes(int64_t num_tokens, int64_t num_heads, int num_splits);
// One launch (one pass), or two (the splits, then their merge).
void sparse_mla_decode(const detail::SparseMlaDecodeParams& p, Stream stream);
}  // namespace moelora::cuda
