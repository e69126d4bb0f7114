// moelora public API: one function per op.
//
// Conventions shared by every op:
// - Inputs and outputs are TensorViews on one device; the op runs on that device's
//   backend (CPU, or CUDA on `stream`). CPU ops are synchronous.
// - Floating-point activations and weights are bf16, fp16 or fp32 (all of one op's
//   float tensors share a dtype unless said); accumulation is always fp32.
// - Nothing allocates: the caller passes every output and workspace. Sizes are
//   queryable (moe_align_block_size_capacity, fused_experts_workspace_size).
// - No op synchronises the host with the device, so every CUDA op can be captured
//   in a CUDA graph. Counts that depend on data (num_tokens_post_padded) stay on
//   the device.
// - A bad argument throws moelora::Error naming the op, the argument, what was
//   expected and what was given; nothing is written then.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "moelora/quant.h"
#include "moelora/tensor.h"

namespace moelora {

// Largest expert count (global, with expert parallelism) any op accepts.
constexpr int64_t kMaxNumExperts = 4095;

// ---------------------------------------------------------------------------------
// moe_align_block_size
//
// topk_ids [M, top_k] int32|int64: the experts each token is routed to. Slot s = m*top_k+j.
// Output, for num_slots = M*top_k:
//   sorted_token_ids [capacity.max_num_tokens_padded] int32: slot ids grouped by expert
//       (ascending expert id), each group padded with the sentinel num_slots up to a
//       multiple of block_size. Every entry past the groups is the sentinel too.
//   expert_ids [capacity.max_num_blocks] int32: the expert of each block of block_size
//       entries; the local id expert_map[e] when expert_map is given, -1 for a block
//       whose expert is not on this rank (the GEMM writes zeros there). Entries past
//       the last block are -1.
//   num_tokens_post_padded [1] int32: the used length of sorted_token_ids (a multiple
//       of block_size), on the device.
// topk_ids == -1 marks a dropped slot: it is grouped in a trailing block with expert -1,
// so the layer gives it zero weight. On CPU any other id outside [0, num_experts)
// throws; the CUDA backend cannot read ids on the host and treats them as -1.
// expert_map [num_experts] int32 (optional): global expert -> local expert or -1.
// block_size: 16 to 256.
struct AlignCapacity {
  int64_t max_num_tokens_padded;
  int64_t max_num_blocks;
};
AlignCapacity moe_align_block_size_capacity(int64_t num_slots, int64_t block_size,
                                            int64_t num_experts);

void moe_align_block_size(const TensorView& topk_ids, int64_t block_size, int64_t num_experts,
                          const TensorView* expert_map, const TensorView& sorted_token_ids,
                          const TensorView& expert_ids, const TensorView& num_tokens_post_padded,
                          Stream stream = nullptr);

// ---------------------------------------------------------------------------------
// Multi-LoRA (seed 003). Every token carries an adapter id in [0, max_loras) or -1
// (none); every (adapter, expert) pair has its own low-rank pair per output slice.
constexpr int64_t kMaxLoraRank = 128;     // ranks 1..128; kernels pad internally
constexpr int64_t kMaxLoraAdapters = 64;  // adapter slots L

// The per-batch adapter state, shared by every LoRA op of a layer.
//   token_lora_ids [M] int32: the adapter of each token, -1 = none.
//   adapter_enabled [L] int32 (optional): 0 disables a slot (its tokens run base-only).
//   adapter_scale [L] fp32 (optional; 1 when absent): multiplies the adapter's delta
//       (PEFT's lora_alpha / r, unless the caller folded it into lora_b as vLLM does).
// On the CPU an id outside [-1, L) throws; the CUDA backend cannot read ids on the
// host and treats such a token as having no adapter (as topk_ids treats bad experts).
struct MoeLoraAdapters {
  TensorView token_lora_ids;
  const TensorView* adapter_enabled = nullptr;
  const TensorView* adapter_scale = nullptr;
};

// The adapter stacks of one expert GEMM (out [slots, N] = a · w[e]ᵀ) in num_slices
// output slices of N / num_slices columns each (w13: gate and up; w2: one slice):
//   lora_a[c] [L, E, r, K], lora_b[c] [L, E, N / num_slices, r], the GEMM's dtype; any
//   strides with unit stride on the last dim. Every slice of a GEMM has the same r.
// The delta of slot s (token m = s / top_k, adapter l, expert e) at column n of slice c,
// slice column j:
//   delta[s, n] = scale[l] · Σ_i lora_b[c][l, e, j, i] · Σ_k lora_a[c][l, e, i, k] · a[s, k]
// Slice c holds columns [c·N/S, (c+1)·N/S) (j = n - c·N/S), or with interleaved_slices
// the columns n ≡ c (mod S) (j = n / S: gpt-oss stores gate and up interleaved).
struct MoeLoraWeights {
  int num_slices = 1;  // 1 or 2
  TensorView lora_a[2];
  TensorView lora_b[2];
  bool interleaved_slices = false;
};

// ---------------------------------------------------------------------------------
// moe_lora_align_block_size: moe_align_block_size over virtual experts, so every block
// has one expert AND one adapter (seed 003; vLLM PR 32317 keys them lora * E + expert).
// A slot's group is (expert, adapter) with adapter -1 for tokens without one (or with a
// disabled one): those form base-only blocks. Groups are ordered expert-major (all of an
// expert's adapters together), so the m-tiles of one expert stay adjacent and share the
// base weight tiles in L2.
//   block_lora_ids [capacity.max_num_blocks] int32: the adapter of each block, -1 for
//       base-only blocks and blocks past the used length.
// Everything else as moe_align_block_size; capacity from moe_lora_align_block_size_capacity.
// max_loras: 1 to kMaxLoraAdapters. One launch; counts stay on the device.
AlignCapacity moe_lora_align_block_size_capacity(int64_t num_slots, int64_t block_size, int64_t num_experts,
                                                 int64_t max_loras);
void moe_lora_align_block_size(const TensorView& topk_ids, const MoeLoraAdapters& adapters, int64_t max_loras,
                               int64_t block_size, int64_t num_experts, const TensorView* expert_map,
                               const TensorView& sorted_token_ids, const TensorView& expert_ids,
                               const TensorView& block_lora_ids, const TensorView& num_tokens_post_padded,
                               Stream stream = nullptr);

// ---------------------------------------------------------------------------------
// Kernel configs of the grouped GEMM (CUDA backend; the CPU backend ignores them).
//   kSm80: mma.sync, runs on sm_80 and later; block_m 16|32|64, block_n 64|128.
//   kSm90: wgmma, sm_90 (H100/H200) only;     block_m 64|128,   block_n 128|256,
//          cluster_m 1|2 (2: CTA pairs on m-tiles 2p, 2p + 1 share each weight tile
//          by TMA multicast when both belong to one expert).
// block_m must divide the alignment block size. kAuto leaves the choice to the
// launcher's heuristic. A tile applies to the tensor-core path: fp32 operands and
// unaligned rows always take the CUDA-core kernel.
enum class GemmKernel : int8_t { kAuto = 0, kSm80 = 1, kSm90 = 2 };
struct GemmTile {
  GemmKernel kernel = GemmKernel::kAuto;
  int32_t block_m = 0;
  int32_t block_n = 0;
  int32_t cluster_m = 1;  // kSm90 only
  // kSm90 in fused_experts with FusedExpertsOptions::ordered_tiles: take the tiles in
  // raster order from a device counter; false: the static persistent schedule. A tuned
  // choice per GEMM: ordered keeps the m-tiles sharing a weight tile together (long K
  // gains), and hands each tile through a queue (short K may pay for it).
  bool ordered = true;
};
// Tiles of a grouped GEMM (MoeKernelConfig::grouped_gemm): 128 x 128 with both consumer warp
// groups on one tile (cooperative), or 64 x 128 with one tile per consumer warp group
// (pingpong: one's epilogue runs under the other's mainloop, which pays where K is short;
// and half the padding of a group with few rows), or 128 x 256 cooperative: each A tile read
// once for twice the columns, the shape of CUTLASS's fastest dense bf16 GEMMs on Hopper
// (16-bit experts; 8-bit ones asking for it take 128 x 128).
enum class GroupedGemmTiles : int8_t { kAuto = 0, kCooperative128 = 1, kPingpong64 = 2, kCooperative128x256 = 3 };
// One layer's config: the alignment block size and each GEMM's tile.
struct MoeKernelConfig {
  int64_t block_size = 0;  // 0: heuristic
  GemmTile gemm1, gemm2;
  // fused_experts on CUDA, for chunks of at most kSmallBatchMaxSlots slots (8-bit experts:
  // kSmallBatchMaxSlots8Bit): two kernels read topk_ids directly (no alignment, no padding
  // rows), stream each routed expert's weight rows once (CUDA-core dot products; MMAs for
  // 8-bit experts), and sum the top-k in GEMM2. A chunk that does not qualify (more slots,
  // fp32, rows not 16-byte aligned) takes the aligned path with block_size and the tiles
  // above.
  bool small_batch = false;
  // fused_experts on CUDA, for chunks whose activation goes in sorted order (both GEMMs
  // on kSm90 tensor-core tiles, at least 512 slots): first copy the chunk's hidden rows
  // into sorted order, so GEMM1 loads each tile's rows as one TMA box instead of
  // gathering them. Costs a write and a read of [slots, H]: it pays where GEMM1 reads
  // each row many times (wide intermediate sizes, many slots per expert).
  bool sorted_input = false;
  // fused_experts on CUDA with quantized (W8A8) or 16-bit experts (sm_90a; no no_combine,
  // routed weight on the output; LoRA with 16-bit experts only, each GEMM's delta then added
  // into its rows by entry): both GEMMs as CUTLASS grouped GEMMs over rows gathered into
  // expert order, one group per expert (docs/CUTLASS_GROUPED_FP8.md), for
  // chunks of at least kGroupedMinSlots slots (16-bit: grouped_16bit_min_slots unless the
  // caller's config asks). The heuristic turns it on for those chunks; a chunk or scheme
  // the path does not take runs the tile kernels.
  bool grouped_gemm = false;
  // The grouped path's CUTLASS tiles for GEMM1 and GEMM2 (GroupedGemmTiles); kAuto: the
  // heuristic's: 64 x 128 pingpong up to 32 slots an expert, above that 128 x 256 for 16-bit
  // experts and 128 x 128 for 8-bit ones.
  GroupedGemmTiles grouped_tiles1 = GroupedGemmTiles::kAuto, grouped_tiles2 = GroupedGemmTiles::kAuto;
};
// Fewest slots of a chunk for MoeKernelConfig::grouped_gemm: the workspace holds its
// buffers only for calls whose chunks reach it. (The heuristic also asks for 16 slots an
// expert: 128 slots reach it only with 8 experts, Mixtral's.)
constexpr int64_t kGroupedMinSlots = 128;
// 16-bit experts: the fewest slots of a chunk for which the heuristic (and the workspace,
// unless the caller's config asks for the grouped path) takes the grouped GEMMs, or fewer
// where the experts average kGrouped16BitSlotsPerExpert slots (Mixtral's 8 experts: 512).
constexpr int64_t kGrouped16BitMinSlots = 2048;
constexpr int64_t kGrouped16BitSlotsPerExpert = 64;
constexpr int64_t grouped_16bit_min_slots(int64_t num_experts) {
  return std::min(kGrouped16BitMinSlots, std::max(kGroupedMinSlots, kGrouped16BitSlotsPerExpert * num_experts));
}
// Most slots (tokens x top_k) a chunk may have for MoeKernelConfig::small_batch: with
// 16-bit experts, and with 8-bit ones (W8A8, whose kernels multiply on MMAs and take up to
// 128 slots: a chunk of 128 slots over as many experts streams each routed expert once).
constexpr int64_t kSmallBatchMaxSlots = 64;
constexpr int64_t kSmallBatchMaxSlots8Bit = 128;

// ---------------------------------------------------------------------------------
// fused_moe: the grouped expert GEMM over aligned blocks.
//
// For every entry i < num_tokens_post_padded of sorted_token_ids with slot s < num_slots:
//   out[s, :] = a[s / top_k, :] · w[expert_ids[i / block_size], :, :]ᵀ  (× topk_weights.flat[s]
//   when mul_routed_weight), accumulated in fp32, rounded to out's dtype.
// Rows of blocks whose expert is -1 are written with zeros; rows of slots that no
// block holds are not written.
//   a [num_rows, K]          bf16|fp16|fp32, any strides (rows gathered by slot / top_k;
//                            top_k = 1 when a already holds one row per slot)
//   w [E, N, K]              a's dtype, any strides
//   out [num_slots, N]       a's dtype, any strides; num_slots = num_rows * top_k
//   topk_weights [M, top_k'] fp32 with M * top_k' == num_slots (read only when
//                            mul_routed_weight), indexed by slot: [s / top_k', s % top_k']
//   sorted_token_ids, expert_ids, num_tokens_post_padded: from moe_align_block_size
//                            with the same block_size; block_size a multiple of 16.
struct FusedMoeArgs {
  TensorView a;
  TensorView w;
  TensorView out;
  TensorView sorted_token_ids;
  TensorView expert_ids;
  TensorView num_tokens_post_padded;
  const TensorView* topk_weights = nullptr;
  bool mul_routed_weight = false;
  int64_t top_k = 1;
  int64_t block_size = 64;
  GemmTile tile{};  // kAuto: chosen per call
};
void fused_moe(const FusedMoeArgs& args, Stream stream = nullptr);

// ---------------------------------------------------------------------------------
// fused_moe_lora: the LoRA delta alone, for engines that run their own base GEMM
// (vLLM's fused_moe_lora semantics; no count is read on the host, so one captured CUDA
// graph serves every mix of adapters).
//   out [num_slots, N]       the GEMM's output, num_slots = M * top_k; any strides
//   a [num_rows, K]          the GEMM's input: num_rows = M (row = slot / top_k) or
//                            M * top_k (one row per slot); unit stride on K
//   topk_ids [M, top_k]      int32|int64 expert of each slot (local ids), -1 = dropped
//   topk_weights [M, top_k]  fp32, read when mul_routed_weight (the delta is weighted)
// For every slot whose token has an enabled adapter and whose expert is not -1:
//   out[s, :] = (add_inputs ? out[s, :] : 0) + delta[s, :] (× topk_weights[s])
// Every other slot's row: kept with add_inputs, zeros without.
// The delta's intermediate [num_slots, S, r] goes in `workspace`
// (fused_moe_lora_workspace_size bytes, 256-byte aligned).
// Large batches pass the alignment of moe_lora_align_block_size (sorted_token_ids,
// expert_ids, block_lora_ids, num_tokens_post_padded with block_size): the kernels then
// run per block of one (expert, adapter); without it, per slot (small batch).
struct FusedMoeLoraArgs {
  TensorView out;
  TensorView a;
  TensorView topk_ids;
  MoeLoraAdapters adapters;
  MoeLoraWeights weights;
  TensorView workspace;
  const TensorView* topk_weights = nullptr;
  bool mul_routed_weight = false;
  bool add_inputs = true;
  const TensorView* sorted_token_ids = nullptr;
  const TensorView* expert_ids = nullptr;
  const TensorView* block_lora_ids = nullptr;
  const TensorView* num_tokens_post_padded = nullptr;
  int64_t block_size = 0;
};
int64_t fused_moe_lora_workspace_size(int64_t num_slots, int num_slices, int64_t rank, DType dtype);
void fused_moe_lora(const FusedMoeLoraArgs& args, Stream stream = nullptr);

// ---------------------------------------------------------------------------------
// Activations: input [T, 2I] -> out [T, I], rank 2, any row strides, unit column stride.
//   silu_and_mul:  out = silu(gate) * up, gate = input[:, :I], up = input[:, I:]
//   gelu_and_mul:  out = gelu(gate) * up, exact (erf) GELU
//   swiglu_oai_and_mul (gpt-oss): gate = input[:, 0::2], up = input[:, 1::2] (interleaved);
//       gate = min(gate, limit); up = clamp(up, -limit, limit);
//       out = (up + 1) * gate * sigmoid(alpha * gate)
void silu_and_mul(const TensorView& input, const TensorView& out, Stream stream = nullptr);
void gelu_and_mul(const TensorView& input, const TensorView& out, Stream stream = nullptr);
void swiglu_oai_and_mul(const TensorView& input, const TensorView& out, float alpha = 1.702f,
                        float limit = 7.0f, Stream stream = nullptr);

// ---------------------------------------------------------------------------------
// moe_sum_reduce: input [M, top_k, H] -> out [M, H] = routed_scaling_factor * Σ_j input[:, j, :]
// fp32 accumulation in slot order (deterministic). Any strides, unit stride on H.
void moe_sum_reduce(const TensorView& input, const TensorView& out, float routed_scaling_factor = 1.0f,
                    Stream stream = nullptr);

// ---------------------------------------------------------------------------------
// fused_experts: the whole MoE layer.
//   hidden_states [M, H]; w13 [E_local, 2I, H] (gate rows first, then up; interleaved for
//   swiglu_oai); w2 [E_local, H, I]; topk_weights [M, top_k] fp32; topk_ids [M, top_k]
//   int32|int64 (global ids); expert_map [E_global] int32 optional (else E_global = E_local).
//   out [M, H], or [M, top_k, H] with no_combine. out may be hidden_states itself (inplace).
//   workspace: fused_experts_workspace_size(...) bytes on the same device, 256-byte aligned.
//   Sized for the call's own shape: one sized with max_loras > 0 lacks the grouped path's
//   room that the same tokens without adapters may take (size for both to serve both).
// Per chunk of at most chunk_size tokens: align -> GEMM1 -> activation -> GEMM2 -> reduce.
enum class Activation : int8_t { kSilu, kGelu, kSwigluOai };

// Weight-only experts on CUDA (FusedExpertsQuant, w4a16 / w8a16): the path a call takes.
//   kDecode:  the small-batch kernels from topk_ids (chunks of at most
//             kSmallBatchMaxSlots8Bit slots; larger ones take kAligned)
//   kAligned: the same register dequantization and MMAs over moe_align_block_size's blocks
//   kDense:   on sm_90a without adapters, where the config names wgmma tiles for both
//             GEMMs, the tile kernel reading the packed experts; else w13 and w2
//             dequantized once into the workspace, then the 16-bit GEMMs
//   kAuto:    by the chunk's slots an expert (fused_experts_plan.cpp)
enum class WeightOnlyPath : int8_t { kAuto, kDecode, kAligned, kDense };

struct FusedExpertsOptions {
  Activation activation = Activation::kSilu;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  // Weight each slot's GEMM1 row (before the activation) instead of its GEMM2 row.
  // vLLM/SGLang allow it only with top_k == 1, where it equals scaling the input; for
  // top_k > 1 it is applied per slot.
  bool apply_router_weight_on_input = false;
  bool no_combine = false;                    // out is [M, top_k, H]: no reduction
  float routed_scaling_factor = 1.0f;         // applied by the reduction (not with no_combine)
  int64_t chunk_size = 64 * 1024;             // tokens per chunk
  int64_t block_size = 0;                     // 0: chosen from the chunk's token count
  // Override of the config registry for every chunk (block_size above, when set, wins
  // over config->block_size). Null: tuned table for the device and shape, else heuristic.
  const MoeKernelConfig* config = nullptr;
  // CUDA: apply the activation in GEMM1's epilogue (the [slots, 2I] intermediate never
  // reaches memory). false runs the separate activation kernel, as the CPU backend
  // always does; for A/B measurements.
  bool fuse_activation = true;
  // CUDA, sm90 tiles: take output tiles (cluster tiles) in raster order from a device
  // counter (kept in the workspace) instead of a static persistent schedule, so the
  // m-tiles that share an expert's weight tile run together and read it from DRAM once.
  // false: the static schedule; for A/B measurements.
  bool ordered_tiles = true;
  // Weight-only experts: the path (kAuto: the heuristic); for A/B measurements.
  WeightOnlyPath weight_only_path = WeightOnlyPath::kAuto;
};

struct FusedExpertsShape {
  int64_t num_tokens;      // M
  int64_t top_k;
  int64_t num_experts;     // E_global
  int64_t hidden_size;     // H
  int64_t intermediate_size;  // I
  DType dtype;
  // Experts in w13 / w2 (expert parallelism); 0: num_experts. Names the tuned table,
  // whose choices (MoeKernelConfig::sorted_input) size part of the workspace.
  int64_t num_local_experts = 0;
  // With LoRA (FusedExpertsArgs::lora): the adapter slots L and the largest rank of
  // w13's and w2's stacks. 0: no LoRA.
  int64_t max_loras = 0;
  int64_t lora_rank = 0;
  // Quantized experts (FusedExpertsArgs::quant): room for the 8-bit activations and
  // their scales; weight-only, for dequantized copies of the experts where the largest
  // chunk runs on them (1024+ slots an expert, or no sm90 tiles for its config; at most
  // 2^34 weights in w13).
  // The copies are a speed-up: a workspace without room for them still serves (those
  // chunks then run the aligned kernels). Disabled: bf16/fp16 experts.
  QuantScheme quant{};
};
int64_t fused_experts_workspace_size(const FusedExpertsShape& shape,
                                     const FusedExpertsOptions& options = {});
// The block size fused_experts uses for a chunk of num_tokens tokens when no config
// says otherwise (the heuristic of the registry).
int64_t fused_experts_block_size(int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                 const FusedExpertsOptions& options = {});

// The config fused_experts uses for a chunk of shape.num_tokens tokens on `device`:
// options.config / options.block_size, else the tuned table of the device for
// (E = num_local_experts, N = intermediate size, dtype) at the nearest token count,
// else the heuristic. Tables: shipped ones (configs/*.json, built in), overridden by
// files of the same name in the folder named by $MOELORA_CONFIG_DIR. File names follow
// vLLM: "E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3,dtype=bf16.json".
MoeKernelConfig fused_experts_config(const FusedExpertsShape& shape, int64_t num_local_experts, Device device,
                                     const FusedExpertsOptions& options = {});
// The table file name for a shape on the current CUDA device (for the tuner).
std::string kernel_config_file_name(int64_t num_local_experts, int64_t intermediate_size, DType dtype);

// The layer's adapters: w13's stacks in two slices (gate, up: lora_b [L, E, I, r] each)
// or one (lora_b [L, E, 2I, r] with w13's row order); w2's in one slice (lora_a
// [L, E, r, I], lora_b [L, E, H, r]). E = experts of w13. The w13 delta is added before
// the activation, the w2 delta before the routed weight: the layer computes
//   h1 = x · (w13[e] + scale·B13·A13)ᵀ,  h2 = act(h1) · (w2[e] + scale·B2·A2)ᵀ.
// With swiglu_oai the two w13 slices are gate and up of gpt-oss's interleaved rows:
// w13.interleaved_slices must say so (true exactly then; w2's false).
struct FusedExpertsLora {
  MoeLoraAdapters adapters;
  MoeLoraWeights w13;
  MoeLoraWeights w2;
};

// Quantized experts (issue 28; DESIGN.md "Quantized experts"): w13 and w2 hold
// scheme.element values (fp8 e4m3 or int8) with fp32 scales, as QuantScheme describes:
//   w13_scale: kBlock [E, ceil(2I / block_n), ceil(H / block_k)], kChannel [E, 2I], kTensor [E]
//   w2_scale:  kBlock [E, ceil(H / block_n), ceil(I / block_k)],  kChannel [E, H],  kTensor [E]
//   a13_scale, a2_scale [1]: the static activation scales of GEMM1's and GEMM2's inputs
//       (kTensor with static_activation_scales; vLLM's w13_input_scale / w2_input_scale).
// Per chunk the layer quantizes hidden_states (per token group of block_k, per token, or
// per tensor), runs GEMM1 on the 8-bit operands (fp32 accumulation, scales per K block),
// applies the activation, rounds it to the layer dtype and quantizes it the same way
// along I, runs GEMM2, and reduces in the layer dtype. hidden_states and out stay
// bf16/fp16. LoRA adapters stay in the layer dtype and see the unquantized activations.
//
// Weight-only experts (issue 30; scheme.weight_only(): w4a16, w8a16). K: H for w13, I for
// w2; N: 2I for w13, H for w2; G = scheme.group_size (0: per channel).
//   w13 / w2: uint8 [E, N, K / 2] (4-bit: byte k / 2 holds k, the even k in the low nibble)
//       or [E, N, K] (8-bit), unit stride on the last dim, 16-byte aligned rows on CUDA.
//   w13_scale / w2_scale: the layer dtype, [E, N, K / G], or [E, N] per channel; any strides.
//   w13_zero / w2_zero (scheme.zero_points): uint8 [E, N, K / G] (or [E, N]), one value a
//       byte; or, 4-bit, packed two a byte along N ([E, N / 2, K / G], the even n in the low
//       nibble: vLLM's w13_qzeros). Without zero points: 8 (4-bit) or 128 (8-bit).
// A weight is (q - zero) * scale; the GEMMs run on bf16/fp16 activations. On CUDA
// (WeightOnlyPath): chunks of at most kSmallBatchMaxSlots8Bit slots, fewer than 8 an
// expert, run the decode kernels, which stream the packed weights and dequantize in
// registers; larger ones the same dot products over the alignment's blocks; from 32 slots
// an expert the sm_90a tiles read the packed experts where the config names them, and
// from 128 the experts are dequantized once into the workspace otherwise
// (fused_experts_workspace_size counts it) for the 16-bit GEMMs.
struct FusedExpertsQuant {
  QuantScheme scheme;
  TensorView w13_scale;
  TensorView w2_scale;
  const TensorView* a13_scale = nullptr;
  const TensorView* a2_scale = nullptr;
  const TensorView* w13_zero = nullptr;  // weight-only with zero points
  const TensorView* w2_zero = nullptr;
};

// Routing status (issue 33): bits fused_experts' CUDA kernels OR into an optional int32
// word when they meet ids they cannot use, instead of dropping those slots silently (the
// CPU backend raises moelora::Error for the same ids; the word is never read back by the
// op, so passing it costs no synchronisation and works inside a CUDA graph).
constexpr int32_t kRoutingBadExpertId = 1;   // a topk_ids value outside [-1, num_experts)
constexpr int32_t kRoutingBadAdapterId = 2;  // a token_lora_ids value outside [-1, max_loras)
constexpr int32_t kRoutingBadExpertMap = 4;  // an expert_map value outside [-1, num_local_experts)

struct FusedExpertsArgs {
  TensorView hidden_states;
  TensorView w13;
  TensorView w2;
  TensorView topk_weights;
  TensorView topk_ids;
  TensorView out;
  TensorView workspace;  // 1-D, any dtype; only its bytes count
  const TensorView* expert_map = nullptr;
  const FusedExpertsLora* lora = nullptr;  // null: no adapters
  const FusedExpertsQuant* quant = nullptr;  // null: w13/w2 in hidden_states' dtype
  // int32 [1] on hidden_states' device, or null: the kRouting* bits are OR'ed into it
  // (the caller zeroes it; nothing else of it is read or written).
  const TensorView* routing_status = nullptr;
};
void fused_experts(const FusedExpertsArgs& args, const FusedExpertsOptions& options = {},
                   Stream stream = nullptr);

// ---------------------------------------------------------------------------------
// sparse_mla_decode: the sparse MLA attention of DeepSeek-V3.2-class models (seed 001;
// FlashMLA's flash_mla_sparse_fwd semantics, with split-KV for small batches). One
// latent KV head shared by every query head; each token attends to its own topk rows.
//   q [T, Hq, 576] bf16: 512 latent lanes then 64 rope lanes; any token/head strides
//   kv [S, 1, 576] bf16: the latent cache; the first 512 lanes of a row are also V
//   indices [T, 1, topk] int32: the kv rows each token attends to; an entry < 0 or >= S
//       is masked (so are the entries at positions >= topk_length[t])
//   out [T, Hq, 512] bf16: Σ_i softmax(scale · q·kv[idx_i])_i · kv[idx_i, :512]
//   lse [T, Hq] fp32 (optional): natural-log log-sum-exp of the scaled logits over the
//       unmasked entries (without the sink); -inf for a row with none
//   topk_length [T] int32 (optional): the valid prefix of each token's indices (values
//       above topk count as topk, below 0 as 0)
//   attn_sink [Hq] fp32 (optional): a per-head logit with no value row, added to the
//       softmax's denominator: out = Σ_i e^{s_i} v_i / (Σ_i e^{s_i} + e^{sink})
// A row with no unmasked entry gets zeros (never NaN). Duplicate indices count as many
// times as they appear. Hq 1..128; topk >= 1 (any value; the kernels mask the tail).
// q and kv rows must be 16-byte aligned (strides multiples of 8 elements), out's
// strides even (4-byte aligned pairs).
// CUDA splits each token's indices over num_splits CTAs when T and Hq alone do not fill
// the device, and merges the parts in a second kernel; their bf16 partial outputs and
// fp32 log-sum-exps go in `workspace` (sparse_mla_decode_workspace_size bytes, 256-byte
// aligned; 0 bytes, so any or an empty view, when the op runs in one pass). The split
// count comes from T, Hq, topk and the device's SM count (never from data), so one
// captured graph serves every call of a shape.
constexpr int64_t kMlaHeadDim = 576;   // latent 512 + rope 64
constexpr int64_t kMlaValueDim = 512;  // the latent lanes: V
constexpr int64_t kMlaMaxHeads = 128;
constexpr int64_t kMlaMaxSplits = 64;

struct SparseMlaDecodeArgs {
  TensorView q;
  TensorView kv;
  TensorView indices;
  TensorView out;
  TensorView workspace;  // 1-D, any dtype; only its bytes count
  float softmax_scale = 0.0f;
  const TensorView* lse = nullptr;
  const TensorView* topk_length = nullptr;
  const TensorView* attn_sink = nullptr;
  // 0: chosen for the device; 1: one pass; n > 1: n splits (at most kMlaMaxSplits, and
  // fewer when topk has fewer 64-key blocks, or block pairs where the sm_90a kernel takes
  // 64-head groups; every split gets whole blocks, or pairs, and none is empty).
  // The CPU backend always runs one pass.
  int num_splits = 0;
};
// The split count sparse_mla_decode runs with on `device` (1 on the CPU), and the
// workspace bytes it needs for it.
int sparse_mla_decode_num_splits(int64_t num_tokens, int64_t num_heads, int64_t topk, Device device,
                                 int num_splits = 0);
int64_t sparse_mla_decode_workspace_size(int64_t num_tokens, int64_t num_heads, int64_t topk, Device device,
                                         int num_splits = 0);
void sparse_mla_decode(const SparseMlaDecodeArgs& args, Stream stream = nullptr);

// ---------------------------------------------------------------------------------
// Build facts.
bool cuda_available();  // built with the CUDA backend and a CUDA device is visible
const char* version();

}  // namespace moelora
