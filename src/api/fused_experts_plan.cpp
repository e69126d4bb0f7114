// fused_experts' planning: the block size and kernel config of a call, its workspace
// layout and size, and the plan of each chunk (FusedExpertsChunkPlan).
#include "api/fused_experts_plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "api/api_util.h"
#include "api/fused_moe.h"
#include "api/kernel_config.h"
#include "api/moe_align_block_size.h"

namespace moelora {

using namespace detail;

// ---------------------------------------------------------------------------------
int64_t fused_experts_block_size(int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                 const FusedExpertsOptions& options) {
  const char* op = "fused_experts_block_size";
  check_range(op, "num_tokens", num_tokens, 0, kMaxSlots);
  check_range(op, "top_k", top_k, 1, kMaxNumExperts);
  check_range(op, "num_experts", num_experts, 1, kMaxNumExperts);
  if (options.block_size != 0) check_block_size(op, options.block_size, /*multiple_of_16=*/true);
  if (options.block_size > 0) return options.block_size;
  // NOTE: monotone in num_tokens, so the first (largest) chunk's block size bounds the
  // workspace of every later chunk. Tiles of 16 rows waste least padding when each
  // expert sees few slots (decode); 64 once experts see dozens of slots.
  const int64_t slots_per_expert = ceil_div(std::max<int64_t>(num_tokens, 1) * top_k, std::max<int64_t>(num_experts, 1));
  if (slots_per_expert <= 16) return 16;
  if (slots_per_expert <= 48) return 32;
  return 64;
}

// The heuristic's 8-bit small-batch limit in slots an expert (below, the NOTE).
constexpr int64_t kSmallBatch8BitSlotsPerExpert = 4;

// Unquantized bf16/fp16 experts: the grouped path's 16-bit operands (the heuristic, the
// workspace and the chunk plan ask the same question).
namespace {
bool experts_16bit(const QuantScheme& quant, DType dtype) {
  return !quant.enabled() && (dtype == DType::kBFloat16 || dtype == DType::kFloat16);
}
}  // namespace

MoeKernelConfig fused_experts_config(const FusedExpertsShape& shape, int64_t num_local_experts, Device device,
                                     const FusedExpertsOptions& options) {
  check_fused_experts_shape("fused_experts_config", shape);
  check_fused_experts_options("fused_experts_config", options);
  check_range("fused_experts_config", "num_local_experts", num_local_experts, 0, kMaxNumExperts);
  // Weight-only experts past the decode kernels: the 16-bit layer's block size. Its GEMMs
  // read the packed experts on sm90 tiles (FusedExpertsChunkPlan::weight_only_tiles) where
  // the block allows them (a multiple of 64 rows), whatever 16-bit tiles a table names:
  // those were tuned for bf16 weights, and any other tile means dequantized copies or the
  // aligned kernels. 128 rows where the block allows (the launcher's rule). A caller's own
  // config stands. NOTE: measured on the H200 (docs/PERF_NOTES.md, issue 30 step 7), whose
  // table (abfed05) names sm80 tiles for GEMM2 in some 64-row cells: DeepSeek-V3-TP8 w4a16
  // at M = 4096 4321 -> 2004 us (copies -> tiles), M = 1024 1358 -> 951, gpt-oss-120b
  // M = 1024 2668 -> 1855, OLMoE M = 256 329 -> 243 (aligned kernels -> tiles).
  if (shape.quant.weight_only()) {
    FusedExpertsShape dense = shape;
    dense.quant = QuantScheme{};
    MoeKernelConfig config = fused_experts_config(dense, num_local_experts, device, options);
#ifdef MOELORA_WITH_CUDA
    const bool caller_tiles = options.config != nullptr;  // tiles the caller named stand
    if (device.type == DeviceType::kCUDA && cuda::current_device_facts().sm90_kernels && config.block_size % 64 == 0) {
      for (GemmTile* tile : {&config.gemm1, &config.gemm2}) {
        if (tile->kernel == GemmKernel::kAuto || (!caller_tiles && tile->kernel != GemmKernel::kSm90)) {
          *tile = GemmTile{GemmKernel::kSm90, config.block_size % 128 == 0 ? 128 : 64, 256};
        }
      }
    }
#endif
    return config;
  }
  const int64_t heuristic_block_size = fused_experts_block_size(shape.num_tokens, shape.top_k, shape.num_experts, options);
  if (options.config != nullptr) {
    MoeKernelConfig config = *options.config;
    if (options.block_size > 0 || config.block_size == 0) config.block_size = heuristic_block_size;
    return config;
  }
  MoeKernelConfig config;
  config.block_size = heuristic_block_size;
  if (options.block_size > 0 || device.type != DeviceType::kCUDA) return config;
#ifdef MOELORA_WITH_CUDA
  const detail::CudaDeviceFacts facts = cuda::current_device_facts();
  // Quantized experts: the grouped GEMMs once the chunk has kGroupedMinSlots slots and 16
  // slots an expert on average. NOTE: measured on H100, fp8_block (docs/PERF_NOTES.md, issue
  // 28 step 2): 1.6-6.1x faster than the W8A8 tile kernels from 1024 slots on every model;
  // at 2048 slots level with 16 slots an expert (Qwen3-30B), 11% slower with 8 (DeepSeek-V3).
  const int64_t slots = std::max<int64_t>(shape.num_tokens, 1) * shape.top_k;
  config.grouped_gemm =
      shape.quant.enabled() && facts.sm90_kernels && slots >= kGroupedMinSlots && slots >= 16 * shape.num_experts;
  // 16-bit experts: the grouped GEMMs at prefill, from grouped_16bit_min_slots (2048 slots,
  // or 64 slots an expert on average when that is fewer). NOTE: measured on H200 (docs/
  // PERF_NOTES.md, issue 31, thirty-ninth session), forced on against the registry's sm90
  // tiles: 0.68-0.91x the layer's time at M = 1024-8192 on every model; at M = 256 0.80x
  // (Mixtral, 64 slots an expert) to 0.98x with 2048 slots; 1.01x at 1024 slots over 128
  // experts (gpt-oss-120b), which the rule leaves to the tiles.
  if (experts_16bit(shape.quant, shape.dtype)) {
    config.grouped_gemm = facts.sm90_kernels && slots >= grouped_16bit_min_slots(shape.num_experts);
  }
  // 8-bit experts: the small-batch kernels up to kSmallBatchMaxSlots8Bit slots while an
  // expert averages at most kSmallBatch8BitSlotsPerExpert slots (most routed experts then
  // see one pass of at most 8 slots). NOTE: measured on H100 (docs/PERF_NOTES.md, issue 28
  // steps 4 and 7): at 128 slots the MMA small-batch kernels beat the W8A8 tile kernels the
  // bf16 tables pick there; at 2-4 slots an expert too (fp8_block OLMoE M = 16 174 -> 152
  // us, Mixtral M = 8 483 -> 427, M = 16 525 -> 475), not at 8 (Mixtral M = 32 552 -> 638).
  const bool small_batch_8bit =
      shape.quant.enabled() && slots <= std::min(kSmallBatchMaxSlots8Bit, kSmallBatch8BitSlotsPerExpert * shape.num_experts);
  const std::string file_name = detail::kernel_config_file_name(num_local_experts, shape.intermediate_size, shape.dtype, facts.name);
  if (const detail::KernelConfigTable* table = detail::find_kernel_config_table(file_name)) {
    const MoeKernelConfig tuned = detail::nearest_kernel_config(*table, std::max<int64_t>(shape.num_tokens, 1));
    const bool runs_here = facts.sm90_kernels ||
                           (tuned.gemm1.kernel != GemmKernel::kSm90 && tuned.gemm2.kernel != GemmKernel::kSm90);
    // NOTE: the tables are the bf16 kernels'. Block-scaled W8A8 tiles have at most 32 rows,
    // so the table's 64-row blocks ran as two tiles that each streamed the expert's
    // weights: Mixtral fp8_block at M = 64 took 1186 us on the table's config and 711 us on
    // the rule below (H100, docs/PERF_NOTES.md issue 28 step 3). Such cells take the rule,
    // tiles included (a block size alone fails the table's tiles, which must divide it).
    const bool blocks_too_large = shape.quant.enabled() && shape.quant.weight_scales == ScaleGranularity::kBlock &&
                                  tuned.block_size > 32;
    if (runs_here && !blocks_too_large) {
      MoeKernelConfig with_grouped = tuned;
      with_grouped.grouped_gemm = config.grouped_gemm;
      with_grouped.small_batch = tuned.small_batch || small_batch_8bit;
      return with_grouped;
    }
  }
  // No table: wgmma tiles of 128 rows once experts see enough slots to fill them; the
  // small-batch kernels while there are no more slots than experts. NOTE: that rule
  // matches every cell the H100 tuner measured (docs/PERF_NOTES.md, issue 3 step 5):
  // small-batch won up to 64 slots on the 64-256-expert models and up to 8 on Mixtral
  // (8 experts), and lost beyond.
  const int64_t slots_per_expert = ceil_div(slots, std::max<int64_t>(shape.num_experts, 1));
  if (facts.sm90_kernels && slots_per_expert >= 192) config.block_size = 128;
  config.small_batch = slots <= std::min(kSmallBatchMaxSlots, shape.num_experts) || small_batch_8bit;
#else
  (void)num_local_experts;
#endif
  return config;
}

std::string kernel_config_file_name(int64_t num_local_experts, int64_t intermediate_size, DType dtype) {
#ifdef MOELORA_WITH_CUDA
  if (cuda::device_available()) {
    return detail::kernel_config_file_name(num_local_experts, intermediate_size, dtype, cuda::current_device_facts().name);
  }
#endif
  (void)num_local_experts, (void)intermediate_size, (void)dtype;
  throw Error("moelora.kernel_config_file_name: tables are per CUDA device, and no CUDA device is available");
}

namespace {

// The segmented shrink's split-K scratch: up to 32 splits (the CUDA kernel's limit) of
// fp32 partial sums, at most 8 MB (a shrink over more padded entries splits less).
constexpr int64_t kLoraShrinkMaxSplits = 32;
constexpr int64_t kLoraShrinkPartialBytes = int64_t(8) << 20;

// Chunks of at least this many slots get room for the activation in sorted order
// (GemmParams::out_rows_sorted: padded entries, not slots); smaller ones keep it by slot.
constexpr int64_t kSortedActivationMinSlots = 512;

// Whether a chunk of this call may run with MoeKernelConfig::sorted_input: the caller's
// config, else the tuned table of the current CUDA device for the full and the last
// chunk. NOTE: the sorted input needs [padded entries, H] of workspace, up to
// (E + 1) x 255 rows more than the slots (~0.9 GB for DeepSeek-V3 at 8192 tokens), so
// only calls whose config may use it reserve it; a call whose table changed since the
// query runs without it.
bool may_sort_input(const FusedExpertsShape& s, const FusedExpertsOptions& o, int64_t chunk_tokens) {
  if (o.config != nullptr) return o.config->sorted_input;
#ifdef MOELORA_WITH_CUDA
  if (o.block_size > 0 || !cuda::device_available()) return false;
  const int64_t num_local_experts = s.num_local_experts > 0 ? s.num_local_experts : s.num_experts;
  const Device cuda_device{DeviceType::kCUDA, 0};  // the table follows the current device
  for (int64_t tokens : {chunk_tokens, s.num_tokens % chunk_tokens}) {
    FusedExpertsShape chunk = s;
    chunk.num_tokens = tokens;
    if (tokens > 0 && fused_experts_config(chunk, num_local_experts, cuda_device, o).sorted_input) return true;
  }
#else
  (void)s, (void)chunk_tokens;
#endif
  return false;
}

}  // namespace

namespace detail {

namespace {

#ifdef MOELORA_WITH_CUDA
// A grouped GEMM's tiles (MoeKernelConfig::grouped_tiles1/2), the heuristic's where the
// config leaves them to it. NOTE: measured on H100 (docs/PERF_NOTES.md, issue 28 step 5),
// 64-row pingpong tiles for both GEMMs against 128-row cooperative ones: faster at up to
// 32 slots an expert (DeepSeek-V3 fp8_block M = 1024, 32 an expert: 829 -> 745 us;
// Qwen3-30B M = 256, 16 an expert: 287 -> 276), level at 64 (Qwen3-30B M = 1024), slower
// from 64 on the wide models (Mixtral M = 256: 612 -> 695) and at M >= 4096 on every model
// (9-30%: the 128-row tiles read each weight tile half as often).
// 16-bit experts take 128 x 256 tiles where 8-bit ones take 128 x 128: measured on an H200
// (reports/gpu/2026-11-29-h200x2-8dc7e77-issue31.txt), both GEMMs on 128 x 256 against
// 128 x 128, from 64 slots an expert: 0.88-1.00x on every model at M = 1024-4096 (Qwen3-30B
// M = 4096 858 -> 779 us, Mixtral M = 1024 1721 -> 1464); at 32 an expert (DeepSeek-V3,
// gpt-oss M = 1024) they lose to the 64-row tiles (1.02-1.08x), which keep those cells.
// 8-bit experts asking for 128 x 256 tiles (16-bit only) take 128 x 128.
GroupedGemmTiles grouped_gemm_tiles(GroupedGemmTiles chosen, int64_t slots, int64_t num_experts, bool quantized) {
  if (chosen == GroupedGemmTiles::kCooperative128x256 && quantized) return GroupedGemmTiles::kCooperative128;
  if (chosen != GroupedGemmTiles::kAuto) return chosen;
  if (slots <= 32 * num_experts) return GroupedGemmTiles::kPingpong64;
  return quantized ? GroupedGemmTiles::kCooperative128 : GroupedGemmTiles::kCooperative128x256;
}
#endif

// Whether the chunk takes the grouped path (MoeKernelConfig::grouped_gemm), and its
// parameters; then the alignment runs in blocks of 16 (the grouped GEMMs take any row
// count per expert, so the least padding), and no small-batch kernel. Adapters (16-bit
// experts only; max_loras > 0): the segmented alignment, an expert's rows spanning its
// max_loras + 1 groups, each GEMM's delta added into its rows by entry.
void plan_grouped_path(FusedExpertsChunkPlan& plan, const FusedExpertsArgs& args, const FusedExpertsOptions& options,
                       const WorkspaceLayout& layout, const FusedExpertsQuantParams& quant, int64_t E_global,
                       int64_t H, int64_t I, int64_t max_loras) {
#ifdef MOELORA_WITH_CUDA
  const bool operands_16bit = experts_16bit(args.quant ? args.quant->scheme : QuantScheme{}, args.hidden_states.dtype);
  if (!(plan.quantized || operands_16bit) || !plan.config.grouped_gemm || !on_cuda(args.hidden_states) || layout.grouped_rows == 0 ||
      (args.lora && !operands_16bit) || options.no_combine || options.apply_router_weight_on_input ||
      args.w13.strides[2] != 1 || args.w2.strides[2] != 1) {
    return;
  }
  void* ws = args.workspace.data;
  GroupedExpertsParams& g = plan.grouped_params;
  g.dtype = args.hidden_states.dtype;
  g.quant13 = quant.gemm1;
  g.quant2 = quant.gemm2;
  g.num_groups = E_global;
  g.groups_per_expert = args.lora ? max_loras + 1 : 1;
  g.expert_map = args.expert_map ? static_cast<const int32_t*>(args.expert_map->data) : nullptr;
  g.group_entry_offsets = static_cast<int32_t*>(byte_offset(ws, layout.grouped_entry_offsets));
  g.group_sizes = static_cast<int32_t*>(byte_offset(ws, layout.grouped_sizes));
  plan.slot_entries = static_cast<int32_t*>(byte_offset(ws, layout.grouped_slot_entries));
  g.H = H;
  g.I = I;
  g.w13 = args.w13.data;  // strides in elements (8-bit: bytes)
  g.w13_stride_expert = args.w13.strides[0];
  g.w13_stride_n = args.w13.strides[1];
  g.w2 = args.w2.data;
  g.w2_stride_expert = args.w2.strides[0];
  g.w2_stride_n = args.w2.strides[1];
  g.a = byte_offset(ws, layout.grouped_a);
  g.a_scales = plan.quantized ? static_cast<float*>(byte_offset(ws, layout.grouped_a_scales)) : nullptr;
  float* tensor_scales = static_cast<float*>(byte_offset(ws, layout.grouped_tensor_scales));
  const bool static_scales = plan.quantized && args.quant->scheme.static_activation_scales;
  g.act_amax = static_scales || operands_16bit ? nullptr : tensor_scales;  // no absmax to collect
  g.act_tensor_scale = static_scales ? static_cast<const float*>(args.quant->a2_scale->data) : tensor_scales + 1;
  g.d = byte_offset(ws, layout.cache1);
  g.args = byte_offset(ws, layout.grouped_args);
  g.cutlass_workspace = byte_offset(ws, layout.grouped_cutlass_workspace);
  g.cutlass_workspace_bytes = kGroupedExpertsCutlassWorkspaceBytes;
  g.tiles1 = grouped_gemm_tiles(plan.config.grouped_tiles1, plan.slots, E_global, plan.quantized);
  g.tiles2 = grouped_gemm_tiles(plan.config.grouped_tiles2, plan.slots, E_global, plan.quantized);
  plan.grouped = cuda::grouped_experts_supported(g);
  if (plan.grouped) {
    plan.config.block_size = 16;
    plan.config.small_batch = false;
  }
#else
  (void)plan, (void)args, (void)options, (void)layout, (void)quant, (void)E_global, (void)H, (void)I, (void)max_loras;
#endif
}

}  // namespace

// Weight-only experts: the dense path from this many slots an expert on average. NOTE:
// measured on H100 (docs/PERF_NOTES.md, issue 30, w4a16): the aligned kernels won over
// dequantized copies at 32-64 an expert (Qwen3-30B M = 1024: 912 against 1391 us; Mixtral
// M = 256: 1916 against 3409) and lost at 128 (Mixtral M = 1024: 7651 against 3877; OLMoE
// M = 1024: 1139 against 1013), where each expert's rows are re-read for 8 blocks or more.
// Where the sm90 tiles read the packed experts (the chunk's config puts both GEMMs on sm90
// tiles, with or without adapters), from 32 an expert: they beat
// the aligned kernels there (issue 30 step 3, w4a16 / w8a16 at 32 an expert: DeepSeek-V3
// M = 1024 957 against 1374 us / 1043 against 1787; gpt-oss M = 1024 2077 / 2773, 2115 /
// 3613; OLMoE M = 256 252 / 336, 280 / 423), and lose below (16 an expert: Qwen3-30B
// M = 256 1497 against 301; 8: DeepSeek-V3 M = 256 3440 against 572). With rank-16
// adapters the tiles with the fused LoRA expand beat the aligned path (H200, issue 30
// step 8: Mixtral M = 256 1347 against 2436 us); without the fused expand (the unfused
// LoRA kernels) they took Mixtral M = 256 to 7535 us (H100).
constexpr int64_t kWeightOnlyDenseSlotsPerExpert = 128;
// The decode kernels below this many slots an expert on average: they take an expert's
// slots 8 at a time, each pass streaming its weights again, where the aligned kernels
// convert each weight once for a 16-entry block. NOTE: H100 (issue 30 step 3), Mixtral at
// 8 an expert (M = 32) w4a16 545 us decode against 445 aligned, w8a16 782 / 578; at 16
// (M = 64) 923 / 697, 1288 / 874; below 8 an expert decode won every cell (Mixtral M = 16,
// 4 an expert: 339 against 418; OLMoE M = 16, 2: 100 / 132; gpt-oss M = 32, 1: 630 / 747).
constexpr int64_t kWeightOnlyDecodeMaxSlotsPerExpert = 8;
constexpr int64_t kWeightOnlyTileSlotsPerExpert = 32;

// The sm90 weight-only tiles below this many slots an expert on average; from it the
// dequantized copies, converted once, serve every tile of an expert's rows. NOTE: each
// 128-row tile converts its weight tiles again: Mixtral (8 experts) at M = 4096, 1024 an
// expert, took 8779 us on the tiles and 7077 on the copies; OLMoE at M = 4096 (512 an
// expert) 1641 against 1773; Mixtral at M = 1024 (256) 2816 against 4020 (H100, w4a16;
// docs/PERF_NOTES.md issue 30 step 2).
constexpr int64_t kWeightOnlyTileMaxSlotsPerExpert = 1024;

// The most weights of one stack (w13: E x 2I x H) the layout dequantizes into copies:
// dequantize_experts indexes units of 8 weights in 32 bits, and its grid-stride threads
// may step up to 4 x the grid's threads past the last (a 2^31 margin covers any device).
// Past it (32 GB of bf16 copies) the chunks run on the aligned kernels or the tiles,
// planned before anything is written, so the launcher's own check never fires mid-call.
constexpr int64_t kMaxDequantizedWeights = int64_t(1) << 34;

namespace {
// Whether a chunk of this shape would run the weight-only sm90 tiles (the plan's final
// word is FusedExpertsChunkPlan::weight_only_tiles, which also checks the tensors).
bool weight_only_tiles_expected(const FusedExpertsShape& chunk, int64_t experts, const FusedExpertsOptions& o) {
#ifdef MOELORA_WITH_CUDA
  if (!cuda::device_available() || !cuda::current_device_facts().sm90_kernels) return false;
  const MoeKernelConfig config = fused_experts_config(chunk, experts, Device{DeviceType::kCUDA, 0}, o);
  return config.gemm1.kernel == GemmKernel::kSm90 && config.gemm2.kernel == GemmKernel::kSm90;
#else
  (void)chunk, (void)experts, (void)o;
  return false;
#endif
}

// Whether the dense path's largest chunk runs on dequantized copies of the experts: from
// kWeightOnlyTileMaxSlotsPerExpert slots an expert, or where its config
// names no sm90 tiles for both GEMMs (or the device has none). Else the tiles read the
// packed experts and the layout reserves no copies.
bool weight_only_copies_expected(const FusedExpertsShape& s, const FusedExpertsOptions& o) {
  const int64_t chunk_tokens = std::min(s.num_tokens, std::max<int64_t>(o.chunk_size, 1));
  const int64_t experts = s.num_local_experts > 0 ? s.num_local_experts : s.num_experts;
  FusedExpertsShape chunk = s;
  chunk.num_tokens = chunk_tokens;
  return chunk_tokens * s.top_k >= kWeightOnlyTileMaxSlotsPerExpert * experts ||
         !weight_only_tiles_expected(chunk, experts, o);
}
}  // namespace

WeightOnlyPath weight_only_path(const FusedExpertsShape& s, const FusedExpertsOptions& o) {
  const int64_t chunk_tokens = std::min(s.num_tokens, std::max<int64_t>(o.chunk_size, 1));
  const int64_t slots = chunk_tokens * s.top_k;
  const int64_t experts = s.num_local_experts > 0 ? s.num_local_experts : s.num_experts;
  const bool decode = slots <= kSmallBatchMaxSlots8Bit && s.hidden_size % 32 == 0 && s.intermediate_size % 32 == 0;
  switch (o.weight_only_path) {
    case WeightOnlyPath::kDecode: return decode ? WeightOnlyPath::kDecode : WeightOnlyPath::kAligned;
    case WeightOnlyPath::kAligned:
    case WeightOnlyPath::kDense: return o.weight_only_path;
    case WeightOnlyPath::kAuto: break;
  }
  if (decode && slots < kWeightOnlyDecodeMaxSlotsPerExpert * experts) return WeightOnlyPath::kDecode;
  if (slots >= kWeightOnlyDenseSlotsPerExpert * experts) return WeightOnlyPath::kDense;
  if (slots < kWeightOnlyTileSlotsPerExpert * experts) return WeightOnlyPath::kAligned;
  FusedExpertsShape chunk = s;
  chunk.num_tokens = chunk_tokens;
  return weight_only_tiles_expected(chunk, experts, o) ? WeightOnlyPath::kDense : WeightOnlyPath::kAligned;
}

void check_fused_experts_shape(const char* op, const FusedExpertsShape& s) {
  check_range(op, "num_tokens", s.num_tokens, 0, kMaxSlots);
  check_range(op, "top_k", s.top_k, 1, kMaxNumExperts);
  check_range(op, "num_experts", s.num_experts, 1, kMaxNumExperts);
  check_range(op, "num_local_experts", s.num_local_experts, 0, kMaxNumExperts);
  if (s.num_tokens * s.top_k > kMaxSlots) {
    fail(op, "argument 'num_tokens' expected num_tokens * top_k <= " + std::to_string(kMaxSlots) + ", got " +
                 std::to_string(s.num_tokens) + " * " + std::to_string(s.top_k));
  }
  check_range(op, "hidden_size", s.hidden_size, 1, kMaxLayerDim);
  check_range(op, "intermediate_size", s.intermediate_size, 1, kMaxLayerDim);
  if (s.dtype != DType::kFloat32 && s.dtype != DType::kFloat16 && s.dtype != DType::kBFloat16) {
    fail(op, std::string("argument 'dtype' expected float32|float16|bfloat16, got ") + dtype_name(s.dtype));
  }
  check_range(op, "max_loras", s.max_loras, 0, kMaxLoraAdapters);
  if (s.max_loras > 0) check_range(op, "lora_rank", s.lora_rank, 1, kMaxLoraRank);
  if (s.quant.enabled()) check_quant_scheme(op, s.quant);
}

void check_fused_experts_options(const char* op, const FusedExpertsOptions& o) {
  if (o.chunk_size < 1) fail(op, "argument 'chunk_size' expected >= 1, got " + std::to_string(o.chunk_size));
  if (o.block_size != 0) check_block_size(op, o.block_size, /*multiple_of_16=*/true);
  if (o.config != nullptr) {
    MoeKernelConfig resolved = *o.config;
    if (o.block_size > 0) resolved.block_size = o.block_size;
    if (resolved.block_size != 0) {
      check_kernel_config(op, "config", resolved);
    } else if (resolved.gemm1.kernel != GemmKernel::kAuto || resolved.gemm2.kernel != GemmKernel::kAuto) {
      fail(op, "argument 'config' expected a block_size (or options.block_size) when it names GEMM tiles, got 0");
    }
  }
  if (o.activation != Activation::kSilu && o.activation != Activation::kGelu && o.activation != Activation::kSwigluOai) {
    fail(op, "argument 'activation' expected silu, gelu or swiglu_oai, got code " + std::to_string(int(o.activation)));
  }
  if (o.activation == Activation::kSwigluOai && !(o.swiglu_limit > 0.f)) {
    fail(op, "argument 'swiglu_limit' expected > 0, got " + std::to_string(o.swiglu_limit));
  }
  switch (o.weight_only_path) {
    case WeightOnlyPath::kAuto:
    case WeightOnlyPath::kDecode:
    case WeightOnlyPath::kAligned:
    case WeightOnlyPath::kDense: break;
    default:
      fail(op, "argument 'weight_only_path' expected auto, decode, aligned or dense, got code " +
                   std::to_string(int(o.weight_only_path)));
  }
}

WorkspaceLayout workspace_layout(const FusedExpertsShape& s, const FusedExpertsOptions& o, bool with_copies) {
  const int64_t chunk_tokens = std::min(s.num_tokens, std::max<int64_t>(o.chunk_size, 1));
  const int64_t slots = chunk_tokens * s.top_k;
  // NOTE: the block size of a chunk comes from the config registry at call time, and a
  // table may change between this query and the call ($MOELORA_CONFIG_DIR). Unless the
  // caller fixed it, size each alignment buffer for its worst block size: padded
  // entries peak at 256, block counts at 16. Both are small next to the GEMM caches.
  const int64_t fixed_block_size = o.block_size > 0                              ? o.block_size
                                   : o.config != nullptr && o.config->block_size > 0 ? o.config->block_size
                                                                                   : 0;
  const int64_t elem = int64_t(dtype_size(s.dtype));
  WorkspaceLayout l{};
  // With LoRA the alignment groups are virtual experts (expert, adapter or none).
  const int64_t groups = s.max_loras > 0 ? lora_groups(s.num_experts, s.max_loras) : s.num_experts;
  auto widen_capacity = [&](int64_t block_size, int64_t num_groups) {
    const AlignCapacity c = align_capacity(slots, block_size, num_groups);
    l.capacity.max_num_tokens_padded = std::max(l.capacity.max_num_tokens_padded, c.max_num_tokens_padded);
    l.capacity.max_num_blocks = std::max(l.capacity.max_num_blocks, c.max_num_blocks);
  };
  for (int64_t block_size = fixed_block_size > 0 ? fixed_block_size : 16;
       block_size <= (fixed_block_size > 0 ? fixed_block_size : kMaxBlockSize); block_size += 16) {
    widen_capacity(block_size, groups);
  }
  // The grouped path (MoeKernelConfig::grouped_gemm) aligns with blocks of 16, whatever
  // block size the caller fixed: its rows are the padded entries of that alignment (with
  // adapters, of the (expert, adapter) groups').
  // 16-bit experts from grouped_16bit_min_slots (a caller's config asking for the path: from
  // kGroupedMinSlots), with or without adapters; 8-bit ones without.
  const bool grouped_16bit =
      experts_16bit(s.quant, s.dtype) &&
      slots >= (o.config != nullptr && o.config->grouped_gemm ? kGroupedMinSlots : grouped_16bit_min_slots(s.num_experts));
  const bool grouped =
      (s.quant.enabled() && !s.quant.weight_only() && s.max_loras == 0 && slots >= kGroupedMinSlots) || grouped_16bit;
  if (grouped) widen_capacity(16, groups);
  int64_t at = 0;
  auto take = [&at](int64_t bytes) { const int64_t here = at; at += round_up(std::max<int64_t>(bytes, 1), 256); return here; };
  l.sorted_token_ids = take(l.capacity.max_num_tokens_padded * 4);
  l.expert_ids = take(l.capacity.max_num_blocks * 4);
  l.num_tokens_post_padded = take(4);
  l.tile_counters = take(kNumTileCounters * 4);
  l.cache2_rows = slots >= kSortedActivationMinSlots ? std::max(slots, l.capacity.max_num_tokens_padded) : slots;
  // The sorted input ([padded entries, H], read by GEMM1 only) shares the region too: GEMM2
  // writes cache3 after GEMM1 has finished.
  l.sorted_input_rows =
      slots >= kSortedActivationMinSlots && chunk_tokens > 0 && may_sort_input(s, o, chunk_tokens) ? l.cache2_rows : 0;
  l.grouped_rows = grouped ? align_capacity(slots, 16, groups).max_num_tokens_padded : 0;
  // Its GEMM outputs ([entries, 2I], then [entries, H]) share the region of cache1/cache3.
  l.cache1 = l.cache3 = l.sorted_input =
      take(std::max({slots * 2 * s.intermediate_size * elem, slots * s.hidden_size * elem,
                     l.sorted_input_rows * s.hidden_size * elem,
                     l.grouped_rows * std::max(2 * s.intermediate_size, s.hidden_size) * elem}));
  l.cache2 = take(l.cache2_rows * s.intermediate_size * elem);
  if (s.max_loras > 0) {
    l.block_lora_ids = take(l.capacity.max_num_blocks * 4);
    l.entry_lora_ids = take(l.capacity.max_num_tokens_padded * 4);  // the segmented alignment (fused path)
    l.block_lora_masks = take(l.capacity.max_num_blocks * 8);
    // Each GEMM's shrink output (w13: 2 slices at most): [slots, slices, rank], or by
    // entry for the fused expand ([padded entries, slices * rank]). GEMM2's shrink runs
    // after GEMM1 has read GEMM1's, so they share it.
    l.lora_intermediate = take(std::max(slots, l.capacity.max_num_tokens_padded) * 2 * s.lora_rank * elem);
    // The fused path's shrink splits K when few blocks hold the entries (small M): fp32
    // partial sums by split and entry, and arrival counters.
    l.lora_shrink_partial_rows = std::min(kLoraShrinkMaxSplits * l.capacity.max_num_tokens_padded,
                                          kLoraShrinkPartialBytes / (2 * s.lora_rank * 4));
    l.lora_shrink_partials = take(l.lora_shrink_partial_rows * 2 * s.lora_rank * 4);
    // One per 16 entries of the blocks: blocks end at most 255 entries past the padded ones.
    l.lora_shrink_counters = take((l.capacity.max_num_tokens_padded / 16 + 16) * 4);
  }
  l.weight_only_path = s.quant.weight_only() ? weight_only_path(s, o) : WeightOnlyPath::kAuto;
  l.weight_only_dense = l.weight_only_path == WeightOnlyPath::kDense;
  const int64_t E_local = s.num_local_experts > 0 ? s.num_local_experts : s.num_experts;
  const int64_t w13_weights = E_local * 2 * s.intermediate_size * s.hidden_size;  // w2: half of it
  l.weight_only_copies = with_copies && l.weight_only_dense && weight_only_copies_expected(s, o) &&
                         w13_weights <= kMaxDequantizedWeights;
  l.dense_w13 = l.dense_w2 = 0;
  if (l.weight_only_copies) {
    l.dense_w13 = take(w13_weights * elem);
    l.dense_w2 = take(w13_weights / 2 * elem);
  }
  if (s.quant.enabled() && !s.quant.weight_only()) {
    // One fp32 scale per token group (block), per row (channel) or per chunk (tensor).
    auto scales = [&](int64_t rows, int64_t cols) {
      switch (s.quant.activation_scales) {
        case ScaleGranularity::kBlock: return rows * ceil_div(cols, s.quant.block_k) * 4;
        case ScaleGranularity::kChannel: return rows * 4;
        default: return int64_t(4);
      }
    };
    l.quant_x = take(chunk_tokens * s.hidden_size);
    l.quant_x_scales = take(scales(chunk_tokens, s.hidden_size));
    l.quant_act = take(slots * s.intermediate_size);
    l.quant_act_scales = take(scales(slots, s.intermediate_size));
    if (grouped) {
      l.grouped_a_scales = take(std::max(scales(l.grouped_rows, s.hidden_size), scales(l.grouped_rows, s.intermediate_size)));
    }
  }
  if (grouped) {
    const int64_t E = s.num_experts;
    l.grouped_entry_offsets = take(groups * 4);  // by alignment group (expert, or expert and adapter)
    l.grouped_sizes = take(groups * 4);
    l.grouped_slot_entries = take(slots * 4);
    l.grouped_args = take(grouped_experts_args_bytes(E));
    l.grouped_cutlass_workspace = take(kGroupedExpertsCutlassWorkspaceBytes);
    l.grouped_tensor_scales = take(2 * 4);  // the activation's absmax and scale (kTensor)
    // GEMM1's input [entries, H], then GEMM2's [entries, I]: 8-bit, or 16-bit experts'
    // rows in the layer dtype.
    l.grouped_a = take(l.grouped_rows * std::max(s.hidden_size, s.intermediate_size) * (grouped_16bit ? elem : 1));
  }
  l.total = at;
  return l;
}

FusedExpertsChunkPlan plan_fused_experts_chunk(const FusedExpertsArgs& args, const FusedExpertsOptions& options,
                                               const FusedExpertsShape& shape, const WorkspaceLayout& layout,
                                               const LoraStack& lora13, const LoraStack& lora2,
                                               const FusedExpertsQuantParams& quant, int64_t begin, int64_t tokens) {
  const TensorView& x = args.hidden_states;
  const Device device = x.device;
  const DType dtype = x.dtype;
  const int64_t elem = int64_t(dtype_size(dtype));
  const int64_t top_k = shape.top_k, H = shape.hidden_size, I = shape.intermediate_size, E_global = shape.num_experts;
  void* ws = args.workspace.data;
  FusedExpertsChunkPlan plan;
  plan.begin = begin;
  plan.tokens = tokens;
  const int64_t slots = plan.slots = tokens * top_k;
  MoeKernelConfig& config = plan.config;
  FusedExpertsShape chunk_shape{tokens, top_k, E_global, H, I, x.dtype};
  chunk_shape.quant = shape.quant;
  config = fused_experts_config(chunk_shape, shape.num_local_experts, device, options);
  check_kernel_config("fused_experts", "config", config);
  plan.quantized = args.quant != nullptr && !args.quant->scheme.weight_only();
  plan.weight_only = args.quant != nullptr && args.quant->scheme.weight_only();
  // The weight-only aligned kernels take blocks of 16 (two n8 tiles).
  plan.weight_only_aligned = plan.weight_only && on_cuda(x) && layout.weight_only_path == WeightOnlyPath::kAligned;
  if (plan.weight_only_aligned) config.block_size = 16;
  plan_grouped_path(plan, args, options, layout, quant, E_global, H, I, args.lora ? lora13.max_loras : 0);
  const int64_t block_size = plan.block_size = config.block_size;
  const AlignCapacity cap = plan.capacity =
      align_capacity(slots, block_size, args.lora ? lora_groups(E_global, lora13.max_loras) : E_global);
  if (cap.max_num_tokens_padded > layout.capacity.max_num_tokens_padded ||
      cap.max_num_blocks > layout.capacity.max_num_blocks) {
    // The layout bounds every block size; this guards the workspace against a new one.
    throw std::logic_error("moelora.fused_experts: block size " + std::to_string(block_size) +
                           " needs more alignment workspace than fused_experts_workspace_size reserved");
  }

  plan.topk_ids = args.topk_ids;
  plan.topk_ids.shape[0] = tokens;
  plan.topk_ids.data =
      byte_offset(plan.topk_ids.data, begin * plan.topk_ids.strides[0] * int64_t(dtype_size(plan.topk_ids.dtype)));
  plan.topk_weights = args.topk_weights;
  plan.topk_weights.shape[0] = tokens;
  plan.topk_weights.data = byte_offset(plan.topk_weights.data, begin * plan.topk_weights.strides[0] * 4);
  plan.x = view2d(byte_offset(x.data, begin * x.strides[0] * elem), dtype, tokens, H, x.strides[0], 1, device);
  plan.out = byte_offset(args.out.data, begin * args.out.strides[0] * elem);

  auto i32 = [&](int64_t offset, int64_t n) {
    TensorView t = TensorView::contiguous(byte_offset(ws, offset), DType::kInt32, {n}, device);
    return t;
  };
  plan.sorted_token_ids = i32(layout.sorted_token_ids, layout.capacity.max_num_tokens_padded);
  plan.sorted_token_ids.shape[0] = cap.max_num_tokens_padded;
  plan.expert_ids = i32(layout.expert_ids, layout.capacity.max_num_blocks);
  plan.expert_ids.shape[0] = cap.max_num_blocks;
  plan.num_tokens_post_padded = i32(layout.num_tokens_post_padded, 1);

  // Both GEMMs on the tensor-core kernels (16-byte rows; e.g. I % 8 == 0) open two paths:
  // - with adapters, the fused LoRA: each GEMM takes its expand as extra K steps
  //   (GemmParams::lora_t) after a shrink kernel, on the segmented alignment, and the
  //   activation stays fused. Otherwise the aligned path runs on the virtual alignment,
  //   the activation as its own kernel and the delta kernels after each GEMM (the w13
  //   delta before the activation). The small-batch kernels take per-slot deltas.
  // - both on the sm90 kernel, the sorted activation: GEMM1 writes the activation in
  //   sorted order (row = entry), and GEMM2 loads each tile's rows as one TMA box instead
  //   of gathering them by slot. NOTE: gathered 16-byte cp.async rows cost ~35% of
  //   Mixtral's layer at M = 4096 (H100; docs/PERF_NOTES.md, issue 3 step 6).
  auto tensor_core_kernel = [](const GemmTile& t) {
    return t.kernel == GemmKernel::kSm80 || t.kernel == GemmKernel::kSm90;
  };
  // Quantized experts run the W8A8 kernels: none of the 16-bit tensor-core paths below.
  // Weight-only experts reach them only dequantized (the dense path).
  plan.tensor_core_gemms = on_cuda(x) && options.fuse_activation && !plan.quantized &&
                           (!plan.weight_only || layout.weight_only_dense) && tensor_core_kernel(config.gemm1) &&
                           tensor_core_kernel(config.gemm2);
#ifdef MOELORA_WITH_CUDA
  if (plan.tensor_core_gemms) {
    const TensorView by_slot = view2d(byte_offset(ws, layout.cache2), dtype, slots, I, I, 1, device);
    const GemmParams gemm1_probe = gemm_params(plan.x, args.w13, by_slot, plan.sorted_token_ids, plan.expert_ids,
                                               plan.num_tokens_post_padded, nullptr, top_k, block_size, config.gemm1);
    const GemmParams gemm2_probe = gemm_params(by_slot, args.w2, by_slot, plan.sorted_token_ids, plan.expert_ids,
                                               plan.num_tokens_post_padded, nullptr, 1, block_size, config.gemm2);
    const bool loadable =
        cuda::fused_moe_tensor_core_loadable(gemm1_probe) && cuda::fused_moe_tensor_core_loadable(gemm2_probe);
    plan.sm90_rows = loadable && config.gemm1.kernel == GemmKernel::kSm90 && config.gemm2.kernel == GemmKernel::kSm90;
    const bool expand_supported =
        args.lora &&
        cuda::fused_moe_lora_expand_supported(gemm1_probe, lora13.rank, lora13.num_slices, lora13.slices) &&
        cuda::fused_moe_lora_expand_supported(gemm2_probe, lora2.rank, lora2.num_slices, lora2.slices);
    // Weight-only experts on the dense path: the sm90 kernel converts the packed experts
    // itself when both GEMMs run on it, below kWeightOnlyTileMaxSlotsPerExpert, with the
    // fused LoRA expand where the call has adapters (its consumers read lora_b: measured on
    // an H200, Mixtral w4a16 rank 16 M = 256 2436 -> 1347 us against the copies). Else the
    // chunk runs on dequantized copies (with the fused LoRA expand).
    if (plan.weight_only && plan.sm90_rows && (!args.lora || expand_supported) &&
        slots < kWeightOnlyTileMaxSlotsPerExpert * shape.num_local_experts) {
      GemmParams packed1 = gemm1_probe, packed2 = gemm2_probe;
      packed1.weight_only = quant.w13;
      packed1.K = H;
      packed2.weight_only = quant.w2;
      packed2.K = I;
      plan.weight_only_tiles =
          cuda::fused_moe_weight_only_loadable(packed1) && cuda::fused_moe_weight_only_loadable(packed2);
    }
    plan.fused_lora = loadable && expand_supported;
  }
#else
  (void)lora2;
#endif
  // Weight-only on the dense path: the tiles, else the copies where the layout has them,
  // else (a smaller last chunk whose config names no sm90 tiles, tensors they cannot load)
  // the aligned kernels, which take any chunk.
  if (plan.weight_only && on_cuda(x) && layout.weight_only_dense && !plan.weight_only_tiles) {
    if (!layout.weight_only_copies) {
      WorkspaceLayout aligned = layout;
      aligned.weight_only_path = WeightOnlyPath::kAligned;
      aligned.weight_only_dense = false;
      return plan_fused_experts_chunk(args, options, shape, aligned, lora13, lora2, quant, begin, tokens);
    }
    plan.weight_only_copies = true;
  }
  if ((args.lora && !plan.fused_lora) || plan.quantized) config.sorted_input = false;  // x is read by slot
  plan.sorted_activation =
      plan.sm90_rows && (!args.lora || plan.fused_lora) && cap.max_num_tokens_padded <= layout.cache2_rows;
  // GEMM1 reads x in sorted order too (a copy by moe_gather_sorted_rows): one TMA box
  // per tile instead of gathered rows. NOTE: a table choice: on H100 it cut Mixtral's
  // layer 24% at M = 4096 and made DeepSeek's (I = 256) 24% slower (PERF_NOTES step 7).
  plan.sorted_input =
      plan.sorted_activation && config.sorted_input && cap.max_num_tokens_padded <= layout.sorted_input_rows;
  // Weight-only: the decode kernels on the call's kDecode path.
  plan.small_batch =
      on_cuda(x) && (plan.weight_only ? layout.weight_only_path == WeightOnlyPath::kDecode : config.small_batch);
  plan.fused_activation = on_cuda(x) && options.fuse_activation && (!args.lora || plan.fused_lora);
  // GEMM2: one output row per slot, written straight into `out` when no reduction is needed.
  plan.direct = options.no_combine || (top_k == 1 && options.routed_scaling_factor == 1.0f);

  // GEMM1's result before the activation kernel, in the layer dtype: quantized experts
  // round it there on every path (the CUDA epilogues that fuse the activation too).
  plan.cache1 = view2d(byte_offset(ws, layout.cache1), dtype, slots, 2 * I, 2 * I, 1, device);
  plan.cache2 = view2d(byte_offset(ws, layout.cache2), dtype,
                       plan.sorted_activation ? cap.max_num_tokens_padded : slots, I, I, 1, device);
  plan.x_sorted = view2d(byte_offset(ws, layout.sorted_input), dtype, cap.max_num_tokens_padded, H, H, 1, device);
  plan.cache3 = view2d(byte_offset(ws, layout.cache3), dtype, slots, H, H, 1, device);
  if (plan.direct) {
    const int64_t row_stride = options.no_combine ? args.out.strides[1] : args.out.strides[0];
    plan.gemm2_out = view2d(plan.out, dtype, slots, H, top_k == 1 ? args.out.strides[0] : row_stride, 1, device);
  } else {
    plan.gemm2_out = plan.cache3;
  }
  if (plan.quantized) {
    const QuantScheme& q = args.quant->scheme;
    plan.quant_block_rows = q.activation_scales == ScaleGranularity::kTensor ? 0 : 1;
    plan.quant_block_cols = q.activation_scales == ScaleGranularity::kBlock ? q.block_k : 0;
    auto scale_cols = [&](int64_t cols) {
      return q.activation_scales == ScaleGranularity::kBlock ? ceil_div(cols, q.block_k) : int64_t(1);
    };
    auto scales = [&](int64_t offset, const TensorView* given, int64_t rows, int64_t cols) {
      if (given) return view2d(given->data, DType::kFloat32, 1, 1, 1, 1, device);  // static: the caller's [1]
      const int64_t scale_rows = q.activation_scales == ScaleGranularity::kTensor ? 1 : rows;
      return view2d(byte_offset(ws, offset), DType::kFloat32, scale_rows, scale_cols(cols), scale_cols(cols), 1, device);
    };
    plan.x_quantized = view2d(byte_offset(ws, layout.quant_x), q.element, tokens, H, H, 1, device);
    plan.x_scales = scales(layout.quant_x_scales, args.quant->a13_scale, tokens, H);
    plan.act_quantized = view2d(byte_offset(ws, layout.quant_act), q.element, slots, I, I, 1, device);
    plan.act_scales = scales(layout.quant_act_scales, args.quant->a2_scale, slots, I);
    plan.grouped_params.x_tensor_scale = static_cast<const float*>(plan.x_scales.data);
  }
  return plan;
}

}  // namespace detail

int64_t fused_experts_workspace_size(const FusedExpertsShape& shape, const FusedExpertsOptions& options) {
  const char* op = "fused_experts_workspace_size";
  check_fused_experts_shape(op, shape);
  check_fused_experts_options(op, options);
  return detail::workspace_layout(shape, options).total;
}

}  // namespace moelora
