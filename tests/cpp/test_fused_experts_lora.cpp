// fused_experts with adapters (multi-LoRA) on CPU and CUDA against float64 references:
// delta = scale[l] · B · (A · a) per slice, added before the activation (w13) and before the
// routed weight (w2); one CUDA graph for every adapter mix; the LoRA kernels' fallbacks; bad
// arguments. Fresh random data per case, outputs poisoned (NaN) first. The align and the
// delta alone: test_moe_lora.cpp.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#ifdef MOELORA_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "api/fused_experts_plan.h"
#include "fused_experts_testing.h"
#include "lora_testing.h"
#include "test_util.h"

namespace moelora::test {
namespace {

using ::testing::HasSubstr;

struct LayerLoraCase {
  std::string name;
  Backend backend;
  DType dtype = DType::kBFloat16;
  int64_t M = 24, top_k = 2, E = 8, H = 136, I = 48;
  int64_t L = 4, rank = 16;
  double share = 1.0;
  bool disable_some = false;
  int w13_slices = 2;
  Activation activation = Activation::kSilu;
  FusedExpertsOptions options{};
  // CUDA with sm_90a kernels: whether the grouped GEMMs must have run (their slot-to-entry
  // table in the workspace written) or must not.
  std::optional<bool> expect_grouped;
};

void PrintTo(const LayerLoraCase& c, std::ostream* os) { *os << c.name << "_" << backend_name(c.backend); }

class FusedExpertsLoraTest : public ::testing::TestWithParam<LayerLoraCase> {};

// The buffers of one fused_experts call with adapters, filled and uploaded.
struct LoraLayer {
  LoraLayer(const LayerLoraCase& c, std::mt19937& rng)
      : c(c),
        x(c.backend, c.dtype, c.M * c.H),
        w13(c.backend, c.dtype, c.E * 2 * c.I * c.H),
        w2(c.backend, c.dtype, c.E * c.H * c.I),
        topk_weights(c.backend, DType::kFloat32, c.M * c.top_k),
        topk_ids(c.backend, DType::kInt32, c.M * c.top_k),
        out(c.backend, c.dtype, c.M * (c.options.no_combine ? c.top_k : 1) * c.H),
        lora_ids(c.backend, DType::kInt32, c.M),
        enabled(c.backend, DType::kInt32, c.L),
        scale(c.backend, DType::kFloat32, c.L),
        stack13(c.backend, c.dtype, c.w13_slices, c.L, c.E, c.rank, c.H, 2 * c.I,
                c.activation == Activation::kSwigluOai && c.w13_slices == 2, rng),
        stack2(c.backend, c.dtype, 1, c.L, c.E, c.rank, c.I, c.H, false, rng),
        workspace(c.backend, DType::kFloat32,
                  (fused_experts_workspace_size(shape(), c.options) + 3) / 4) {
    x_values = x.fill_normal(x.view({c.M, c.H}), rng);
    w13_values = w13.fill_normal(w13.view({c.E, 2 * c.I, c.H}), rng, 1.0 / std::sqrt(double(c.H)));
    w2_values = w2.fill_normal(w2.view({c.E, c.H, c.I}), rng, 1.0 / std::sqrt(double(c.I)));
    weight_values = random_router_weights(c.M, c.top_k, rng);
    topk_weights.write(topk_weights.view({c.M, c.top_k}), weight_values);
    ids = random_routing(c.M, c.top_k, c.E, rng);
    topk_ids.write(topk_ids.view({c.M, c.top_k}), std::vector<double>(ids.begin(), ids.end()));
    set_adapters(random_token_loras(c.M, c.L, c.share, rng), rng);
    for (Buffer* b : {&x, &w13, &w2, &topk_weights, &topk_ids}) b->upload();
    out.poison();
    workspace.poison();
  }

  FusedExpertsShape shape() const {
    FusedExpertsShape s{c.M, c.top_k, c.E, c.H, c.I, c.dtype, c.E};
    s.max_loras = c.L;
    s.lora_rank = c.rank;
    return s;
  }

  // New adapter ids, enabled mask and scales (host and device).
  void set_adapters(const std::vector<int64_t>& token_loras, std::mt19937& rng) {
    token_lora_values = token_loras;
    enabled_values.assign(size_t(c.L), 1);
    if (c.disable_some) {
      std::bernoulli_distribution off(0.5);
      for (auto& e : enabled_values) e = off(rng) ? 0 : 1;
    }
    scale_values.assign(size_t(c.L), 0.0);
    std::uniform_real_distribution<double> uniform(0.5, 2.0);
    for (auto& s : scale_values) s = uniform(rng);
    lora_ids.write(lora_ids.view({c.M}), std::vector<double>(token_loras.begin(), token_loras.end()));
    enabled.write(enabled.view({c.L}), std::vector<double>(enabled_values.begin(), enabled_values.end()));
    scale.write(scale.view({c.L}), scale_values);
    scale_values = ref::round_to(DType::kFloat32, scale_values);
    for (Buffer* b : {&lora_ids, &enabled, &scale}) b->upload();
  }

  FusedExpertsArgs args() {
    enabled_view = enabled.view({c.L});
    scale_view = scale.view({c.L});
    lora.adapters = MoeLoraAdapters{lora_ids.view({c.M}), &enabled_view, &scale_view};
    lora.w13 = stack13.weights;
    lora.w2 = stack2.weights;
    FusedExpertsArgs a;
    a.hidden_states = x.view({c.M, c.H});
    a.w13 = w13.view({c.E, 2 * c.I, c.H});
    a.w2 = w2.view({c.E, c.H, c.I});
    a.topk_weights = topk_weights.view({c.M, c.top_k});
    a.topk_ids = topk_ids.view({c.M, c.top_k});
    a.out = c.options.no_combine ? out.view({c.M, c.top_k, c.H}) : out.view({c.M, c.H});
    a.workspace = workspace.view({workspace.size()});
    a.lora = &lora;
    return a;
  }

  std::vector<double> reference() const {
    ref::RefLora r;
    r.token_lora = resolve_loras(token_lora_values, enabled_values);
    r.scale = scale_values;
    r.w13 = stack13.ref;
    r.w2 = stack2.ref;
    return ref::reference_fused_experts(x_values, w13_values, w2_values, weight_values, ids, c.M, c.top_k, c.E, c.H,
                                        c.I, nullptr, c.activation, c.options.swiglu_alpha, c.options.swiglu_limit,
                                        c.options.apply_router_weight_on_input, c.options.no_combine,
                                        c.options.routed_scaling_factor, &r);
  }

  const LayerLoraCase& c;
  Buffer x, w13, w2, topk_weights, topk_ids, out, lora_ids, enabled, scale;
  LoraStackData stack13, stack2;
  Buffer workspace;
  std::vector<double> x_values, w13_values, w2_values, weight_values, scale_values;
  std::vector<int64_t> ids, token_lora_values;
  std::vector<int32_t> enabled_values;
  TensorView enabled_view, scale_view;
  FusedExpertsLora lora;
};

// One case's layer against the float64 reference (and, with adapters, far from the layer
// without them); on CUDA, whether the grouped GEMMs ran where the case says.
void expect_layer_matches_reference(LayerLoraCase c) {
  c.options.activation = c.activation;
  std::mt19937 rng(777 + uint32_t(c.rank * 31 + c.L * 7 + c.M));
  LoraLayer layer(c, rng);
  TestStream stream(c.backend);
  fused_experts(layer.args(), c.options, stream.handle());
  stream.sync();
  layer.out.download();
  const TensorView ov = c.options.no_combine ? layer.out.view({c.M, c.top_k, c.H}) : layer.out.view({c.M, c.H});
  const std::vector<double> expected = layer.reference();
  EXPECT_LE(ref::rel_error(layer.out.read(ov), expected), ref::tolerance(c.dtype));
  EXPECT_EQ(layer.out.count_unwritten(ov), 0);
  // The adapters must move the result: the same layer without them is far from it.
  if (c.share > 0 && !c.disable_some) {
    LayerLoraCase base_case = c;
    std::vector<double> no_lora = ref::reference_fused_experts(
        layer.x_values, layer.w13_values, layer.w2_values, layer.weight_values, layer.ids, c.M, c.top_k, c.E, c.H, c.I,
        nullptr, c.activation, c.options.swiglu_alpha, c.options.swiglu_limit, c.options.apply_router_weight_on_input,
        c.options.no_combine, c.options.routed_scaling_factor, nullptr);
    EXPECT_GT(ref::rel_error(no_lora, expected), 10 * ref::tolerance(c.dtype));
  }
#ifdef MOELORA_WITH_CUDA
  if (c.backend == Backend::kCUDA && c.expect_grouped.has_value() && cuda::current_device_facts().sm90_kernels) {
    const bool grouped = grouped_path_ran(detail::workspace_layout(layer.shape(), c.options), layer.workspace);
    EXPECT_EQ(grouped, *c.expect_grouped) << (*c.expect_grouped ? "the tile kernels ran instead of the grouped GEMMs"
                                                                 : "the grouped GEMMs ran");
  }
#endif
}

TEST_P(FusedExpertsLoraTest, MatchesReference) {
  MOELORA_SKIP_UNLESS_AVAILABLE(GetParam().backend);
  expect_layer_matches_reference(GetParam());
}

std::vector<LayerLoraCase> layer_cases() {
  std::vector<LayerLoraCase> cases;
  for (Backend backend : all_backends()) {
    for (int64_t rank : {1, 8, 16, 64, 128}) {
      LayerLoraCase c{.name = "rank" + std::to_string(rank), .backend = backend, .rank = rank};
      cases.push_back(c);
    }
    for (int64_t L : {1, 4, 16, 64}) {
      for (double share : {0.0, 0.5, 1.0}) {
        LayerLoraCase c{.name = "adapters" + std::to_string(L) + "_share" + std::to_string(int(share * 100)),
                        .backend = backend, .M = 40, .top_k = 4, .E = 16, .L = L, .share = share};
        cases.push_back(c);
      }
    }
    cases.push_back({.name = "disabled", .backend = backend, .L = 8, .disable_some = true});
    cases.push_back({.name = "w13_one_slice", .backend = backend, .w13_slices = 1});
    cases.push_back({.name = "swiglu_oai", .backend = backend, .activation = Activation::kSwigluOai});
    cases.push_back({.name = "gelu_fp16", .backend = backend, .dtype = DType::kFloat16, .activation = Activation::kGelu});
    cases.push_back({.name = "fp32", .backend = backend, .dtype = DType::kFloat32, .M = 9, .rank = 12});
    LayerLoraCase weight_on_input{.name = "weight_on_input_top1", .backend = backend, .top_k = 1};
    weight_on_input.options.apply_router_weight_on_input = true;
    cases.push_back(weight_on_input);
    LayerLoraCase no_combine{.name = "no_combine", .backend = backend};
    no_combine.options.no_combine = true;
    cases.push_back(no_combine);
    LayerLoraCase chunked{.name = "chunked_scaled", .backend = backend, .M = 50};
    chunked.options.chunk_size = 16;
    chunked.options.routed_scaling_factor = 2.5f;
    cases.push_back(chunked);
    LayerLoraCase big{.name = "block64", .backend = backend, .M = 200, .top_k = 4, .E = 8, .L = 4, .rank = 64};
    cases.push_back(big);
    // CUDA: the small-batch kernels with per-slot deltas (at most 64 slots a chunk).
    static const MoeKernelConfig small_batch{.block_size = 16, .small_batch = true};
    for (auto [name, activation, slices, rank] :
         {std::tuple{"small_batch", Activation::kSilu, 2, int64_t(16)},
          std::tuple{"small_batch_swiglu_oai", Activation::kSwigluOai, 2, int64_t(8)},
          std::tuple{"small_batch_one_slice_rank128", Activation::kGelu, 1, int64_t(128)}}) {
      LayerLoraCase c{.name = name, .backend = backend, .rank = rank, .disable_some = true, .w13_slices = slices,
                      .activation = activation};
      c.options.config = &small_batch;
      cases.push_back(c);
    }
    LayerLoraCase small_no_combine{.name = "small_batch_no_combine_chunked", .backend = backend, .M = 30, .share = 0.5};
    small_no_combine.options.config = &small_batch;
    small_no_combine.options.no_combine = true;
    small_no_combine.options.chunk_size = 13;
    cases.push_back(small_no_combine);
    LayerLoraCase small_on_input{.name = "small_batch_weight_on_input", .backend = backend, .top_k = 1};
    small_on_input.options.config = &small_batch;
    small_on_input.options.apply_router_weight_on_input = true;
    cases.push_back(small_on_input);
    if (backend != Backend::kCUDA) continue;
    // CUDA sm_90a: the grouped GEMMs (16-bit experts) with each GEMM's delta on the segmented
    // alignment, added into its rows by entry (moe_lora_expand_entries). H and I multiples
    // of 16 (TMA rows); ranks 1-128 (rank 128 with 2 slices: two column passes of the shrink),
    // both tile shapes, interleaved and one-slice w13 stacks, fp16, disabled adapters and
    // tokens without one, 16 and 64 adapters, chunks, the warp-tile shrink (at up to 1024
    // slots, and past them at short runs), and long runs of one (expert, adapter) with the
    // segmented shrink and the streamed expands.
    {
      std::vector<LayerLoraCase> g;
      for (int64_t rank : {1, 16, 64, 128}) {
        g.push_back({.name = "grouped16_rank" + std::to_string(rank), .backend = backend, .M = 160, .top_k = 4,
                     .E = 8, .H = 272, .I = 80, .rank = rank});
      }
      g.push_back({.name = "grouped16_m64_share50_disabled", .backend = backend, .M = 160, .top_k = 4, .E = 16,
                   .H = 272, .I = 80, .L = 16, .share = 0.5, .disable_some = true});
      g.back().options.config = grouped_config(GroupedGemmTiles::kPingpong64, GroupedGemmTiles::kPingpong64);
      g.push_back({.name = "grouped16_m128_adapters64", .backend = backend, .M = 160, .top_k = 4, .E = 8, .H = 272,
                   .I = 80, .L = 64, .share = 1.0});
      g.back().options.config =
          grouped_config(GroupedGemmTiles::kCooperative128, GroupedGemmTiles::kCooperative128);
      g.push_back({.name = "grouped16_swiglu_oai", .backend = backend, .M = 160, .top_k = 4, .H = 272, .I = 80,
                   .activation = Activation::kSwigluOai});
      g.push_back({.name = "grouped16_swiglu_oai_one_slice", .backend = backend, .M = 160, .top_k = 4, .H = 272,
                   .I = 80, .rank = 24, .w13_slices = 1, .activation = Activation::kSwigluOai});
      g.push_back({.name = "grouped16_gelu_one_slice_fp16", .backend = backend, .dtype = DType::kFloat16, .M = 160,
                   .top_k = 4, .H = 272, .I = 80, .rank = 32, .w13_slices = 1, .activation = Activation::kGelu});
      // Past 1024 slots with runs of one (expert, adapter) shorter than 32 entries on average
      // (slots / (E * L)): the warp-tile shrink; ranks 64, 128 (two slices: 8 column chunks), 8
      // (one column tile of two, rank 16's variant) and 24 (a partial column tile) in fp16.
      g.push_back({.name = "grouped16_warp_tile_shrink", .backend = backend, .M = 300, .top_k = 4, .E = 16,
                   .H = 1040, .I = 528, .L = 16, .rank = 64, .share = 0.5, .disable_some = true});
      g.push_back({.name = "grouped16_warp_tile_shrink_rank128", .backend = backend, .M = 300, .top_k = 4, .E = 16,
                   .H = 272, .I = 80, .rank = 128});
      // Rank 16's variant (4 steps a batch, 128 K) past one batch a K quarter: GEMM1's K = 1040
      // (quarters of 288: two batches and a step), GEMM2's 528 (160: one batch and a step).
      g.push_back({.name = "grouped16_warp_tile_shrink_rank16_long_k", .backend = backend, .M = 300, .top_k = 4,
                   .E = 16, .H = 1040, .I = 528, .L = 8, .rank = 16, .share = 0.5});
      g.push_back({.name = "grouped16_warp_tile_shrink_rank8", .backend = backend, .M = 300, .top_k = 4, .E = 16,
                   .H = 272, .I = 80, .rank = 8});
      g.push_back({.name = "grouped16_warp_tile_shrink_rank24_one_slice_fp16", .backend = backend,
                   .dtype = DType::kFloat16, .M = 300, .top_k = 4, .E = 16, .H = 272, .I = 80, .rank = 24,
                   .w13_slices = 1, .activation = Activation::kGelu});
      // Runs of 75 entries on average (>= 32): the segmented shrink split over K, and the
      // expands' CTAs stream column tiles (kStreamMinMeanRun), a tile of more pairs than a stage
      // holds taking its pairs in rounds in the same launch; rank 64 holds one pair a stage.
      g.push_back({.name = "grouped16_long_runs_streamed", .backend = backend, .M = 300, .top_k = 4, .E = 8,
                   .H = 1040, .I = 528, .L = 2});
      g.push_back({.name = "grouped16_long_runs_streamed_swiglu_oai_rank64_share50", .backend = backend, .M = 300,
                   .top_k = 4, .E = 8, .H = 272, .I = 80, .L = 2, .rank = 64, .share = 0.5,
                   .activation = Activation::kSwigluOai});
      LayerLoraCase chunked{.name = "grouped16_chunks_scaled", .backend = backend, .M = 300, .top_k = 4, .H = 272,
                            .I = 80};
      chunked.options.chunk_size = 128;  // 512, 512 and 176 slots
      chunked.options.routed_scaling_factor = 2.5f;
      g.push_back(chunked);
      for (LayerLoraCase& c : g) {
        if (c.options.config == nullptr) c.options.config = grouped_config();
        c.expect_grouped = true;
        cases.push_back(c);
      }
      // The calls the path does not take: no_combine and the routed weight on the input.
      LayerLoraCase no_combine{.name = "grouped16_no_combine_takes_the_tiles", .backend = backend, .M = 160,
                               .top_k = 4, .H = 272, .I = 80};
      no_combine.options.config = grouped_config();
      no_combine.options.no_combine = true;
      no_combine.expect_grouped = false;
      cases.push_back(no_combine);
    }
    // CUDA: both GEMMs on the tensor-core kernels, the LoRA expand fused into their K
    // loops (rank % 8 == 0; rank 1 falls back to the delta kernels). Tails in N (I = 48,
    // H = 136), up to 4 extra K steps (2 slices x rank 128), 2-CTA cluster tiles run as
    // 1-CTA; sm90 on both, sm80 on both (16-row blocks), and one of each.
    static const MoeKernelConfig fused_m128{.block_size = 128,
                                            .gemm1 = {GemmKernel::kSm90, 128, 256, 2, true},
                                            .gemm2 = {GemmKernel::kSm90, 128, 128, 1, false}};
    static const MoeKernelConfig fused_m64{.block_size = 64,
                                           .gemm1 = {GemmKernel::kSm90, 64, 128, 1, false},
                                           .gemm2 = {GemmKernel::kSm90, 64, 256, 2, true},
                                           .sorted_input = true};
    static const MoeKernelConfig fused_sm80{.block_size = 16,
                                            .gemm1 = {GemmKernel::kSm80, 16, 64},
                                            .gemm2 = {GemmKernel::kSm80, 16, 128}};
    static const MoeKernelConfig fused_mixed{.block_size = 64,
                                             .gemm1 = {GemmKernel::kSm90, 64, 128, 1, false},
                                             .gemm2 = {GemmKernel::kSm80, 32, 64}};
    for (const MoeKernelConfig* config : {&fused_m128, &fused_m64, &fused_sm80, &fused_mixed}) {
      const std::string tag = config == &fused_m128  ? "sm90_m128_"
                              : config == &fused_m64 ? "sm90_m64_"
                              : config == &fused_sm80 ? "sm80_m16_"
                                                      : "mixed_m64_";
      std::vector<LayerLoraCase> fused;
      for (int64_t rank : {1, 8, 16, 64, 128}) {
        fused.push_back({.name = tag + "rank" + std::to_string(rank), .backend = backend, .M = 60, .top_k = 4,
                         .rank = rank});
      }
      fused.push_back({.name = tag + "sorted_activation_share50", .backend = backend, .M = 200, .top_k = 4,
                       .L = 16, .share = 0.5, .disable_some = true});
      fused.push_back({.name = tag + "swiglu_oai", .backend = backend, .M = 60, .activation = Activation::kSwigluOai});
      fused.push_back({.name = tag + "swiglu_oai_one_slice", .backend = backend, .M = 60, .rank = 24,
                       .w13_slices = 1, .activation = Activation::kSwigluOai});
      fused.push_back({.name = tag + "gelu_one_slice_fp16", .backend = backend, .dtype = DType::kFloat16, .M = 60,
                       .rank = 32, .w13_slices = 1, .activation = Activation::kGelu});
      LayerLoraCase on_input{.name = tag + "weight_on_input_top1", .backend = backend, .M = 60, .top_k = 1};
      on_input.options.apply_router_weight_on_input = true;
      fused.push_back(on_input);
      // K of 1032 and 528 (tails in K): the shrink splits K over 3-5 CTAs a block; rank 128
      // with 2 slices takes two column passes; the last one with the sorted activation.
      for (int64_t rank : {16, 128}) {
        fused.push_back({.name = tag + "split_k_rank" + std::to_string(rank), .backend = backend, .M = 24,
                         .H = 1032, .I = 528, .rank = rank});
      }
      fused.push_back({.name = tag + "split_k_sorted_activation_share50", .backend = backend, .M = 200, .top_k = 4,
                       .H = 1032, .I = 528, .L = 16, .share = 0.5, .disable_some = true});
      // Up to 1024 slots (kWarpTilesAnyRunMaxSlots, src/cuda/moe_lora_shrink_segmented.cu) the shrink
      // takes the warp tiles at every K: the cases above, and one past kWarpTilesMaxK.
      fused.push_back({.name = tag + "warp_tile_shrink_small_chunk_long_k", .backend = backend, .M = 40, .H = 8200,
                       .I = 80, .rank = 16});
      // Past it, below a mean (expert, adapter) run of 32 entries (slots / (E * L)), or of 64 at
      // K <= 4096, it is the warp-tile kernel: 1200 / 16 and 1088 / 16 take the segmented one,
      // 1200 / 32 (K 136 and 48), 1088 / 128 and 1200 / 128 the warp tiles (tails in K: 1032 and 528
      // are not multiples of its 128-element steps).
      fused.push_back({.name = tag + "segmented_shrink", .backend = backend, .M = 300, .top_k = 4, .E = 4, .rank = 16});
      fused.push_back({.name = tag + "segmented_shrink_split_k_share50", .backend = backend, .M = 272, .top_k = 4,
                       .E = 4, .H = 1032, .I = 528, .rank = 64, .share = 0.5, .disable_some = true});
      fused.push_back({.name = tag + "warp_tile_shrink_mean_run_37", .backend = backend, .M = 300, .top_k = 4,
                       .rank = 16});
      fused.push_back({.name = tag + "warp_tile_shrink_share50", .backend = backend, .M = 272, .top_k = 4,
                       .H = 1032, .I = 528, .L = 16, .rank = 64, .share = 0.5, .disable_some = true});
      fused.push_back({.name = tag + "warp_tile_shrink_rank16", .backend = backend, .M = 300, .top_k = 4,
                       .H = 1032, .I = 528, .L = 16, .rank = 16});
      LayerLoraCase no_combine{.name = tag + "no_combine_chunked", .backend = backend, .M = 70, .share = 0.5};
      no_combine.options.no_combine = true;
      no_combine.options.chunk_size = 32;
      fused.push_back(no_combine);
      for (LayerLoraCase& c : fused) {
        c.options.config = config;
        cases.push_back(c);
      }
    }
  }
  return cases;
}

// Named (CUDA_grouped16_rank16, ...) so that a sanitizer run can pick the cases of one path.
INSTANTIATE_TEST_SUITE_P(All, FusedExpertsLoraTest, ::testing::ValuesIn(layer_cases()),
                         [](const auto& info) { return std::string(backend_name(info.param.backend)) + "_" + info.param.name; });

// ---- one captured CUDA graph serves every adapter mix -------------------------------------

#ifdef MOELORA_WITH_CUDA
// The default config; both GEMMs on the sm90 kernel with the fused expand; both on the
// sm80 kernel with the fused expand, the shrink as warp tiles (2, 4) or the segmented kernel
// split over K with arrival counters (3).
class FusedExpertsLoraCudaGraph : public ::testing::TestWithParam<int> {};

TEST_P(FusedExpertsLoraCudaGraph, OneGraphServesEveryAdapterMix) {
  MOELORA_SKIP_UNLESS_AVAILABLE(Backend::kCUDA);
  LayerLoraCase c{.name = "graph", .backend = Backend::kCUDA, .M = 48, .top_k = 4, .E = 16, .L = 8, .rank = 16,
                  .disable_some = true};
  static const MoeKernelConfig fused{.block_size = 64,
                                     .gemm1 = {GemmKernel::kSm90, 64, 256, 1, true},
                                     .gemm2 = {GemmKernel::kSm90, 64, 128, 1, true}};
  static const MoeKernelConfig fused_sm80{.block_size = 16,
                                          .gemm1 = {GemmKernel::kSm80, 16, 64},
                                          .gemm2 = {GemmKernel::kSm80, 16, 64}};
  if (GetParam() == 1) c.options.config = &fused;
  if (GetParam() >= 2) {
    c.options.config = &fused_sm80;
    c.H = 1032;
    c.I = 528;
  }
  // Past 1024 slots: with long runs (1200 slots / (4 x 4) pairs >= 64) the segmented MMA
  // shrink and its arrival counters, which the alignment zeroes in every replay; with short
  // ones (1200 / (16 x 8)) the warp-tile shrink, as below 1024 slots.
  if (GetParam() == 3) c.M = 300, c.E = 4, c.L = 4;
  if (GetParam() == 4) c.M = 300;
  std::mt19937 rng(4242);
  LoraLayer layer(c, rng);
  TestStream stream(Backend::kCUDA);
  cudaStream_t s = static_cast<cudaStream_t>(stream.handle());
  const FusedExpertsArgs args = layer.args();
  fused_experts(args, c.options, stream.handle());  // warm-up outside the capture
  stream.sync();
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOELORA_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  fused_experts(args, c.options, stream.handle());
  MOELORA_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (double share : {1.0, 0.0, 0.5, 0.25, 1.0}) {
    layer.set_adapters(random_token_loras(c.M, c.L, share, rng), rng);
    layer.out.poison();
    MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, s));
    stream.sync();
    layer.out.download();
    const TensorView ov = layer.out.view({c.M, c.H});
    EXPECT_LE(ref::rel_error(layer.out.read(ov), layer.reference()), ref::tolerance(c.dtype)) << "share " << share;
    EXPECT_EQ(layer.out.count_unwritten(ov), 0);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}
INSTANTIATE_TEST_SUITE_P(Configs, FusedExpertsLoraCudaGraph, ::testing::Values(0, 1, 2, 3, 4));

// Each case through the grouped GEMMs (and so the grouped path's LoRA kernels) against the
// float64 reference.
void expect_grouped_layers_match(const std::vector<LayerLoraCase>& cases, const std::string& variant) {
  for (LayerLoraCase c : cases) {
    c.options.config = grouped_config();
    c.expect_grouped = true;
    SCOPED_TRACE(c.name + ", " + variant);
    expect_layer_matches_reference(c);
  }
}

// c at ranks 16 and 64 (one and four column tiles of the warp-tile shrink) through the grouped GEMMs.
void expect_grouped_ranks_match(LayerLoraCase c, const std::string& variant) {
  std::vector<LayerLoraCase> cases;
  for (int64_t rank : {16, 64}) {
    c.rank = rank;
    cases.push_back(c);
    cases.back().name += "_rank" + std::to_string(rank);
  }
  expect_grouped_layers_match(cases, variant);
}

// The sm80 16 x 128 tile on both GEMMs with the fused expand (Qwen3-30B's and OLMoE's tiles at
// M = 16-64), its prologue both ways: compact (the default) and unrolled ($MOELORA_SM80_COMPACT=0);
// ranks 8-128 (up to 4 extra K steps through the prologue), one slice, tails in K (1032, 528).
TEST(FusedExpertsLoraSm80Prologue, MatchesReference) {
  MOELORA_SKIP_UNLESS_AVAILABLE(Backend::kCUDA);
  static const MoeKernelConfig sm80_m16_n128{.block_size = 16,
                                             .gemm1 = {GemmKernel::kSm80, 16, 128},
                                             .gemm2 = {GemmKernel::kSm80, 16, 128}};
  for (const bool compact : {true, false}) {
    const ScopedKnob prologue(cuda::sm80_compact_prologue_enabled, cuda::set_sm80_compact_prologue_enabled, compact);
    const std::string tag = compact ? "compact_" : "unrolled_";
    std::vector<LayerLoraCase> cases;
    for (int64_t rank : {8, 16, 64, 128}) {
      cases.push_back({.name = tag + "rank" + std::to_string(rank), .backend = Backend::kCUDA, .M = 60, .top_k = 4,
                       .rank = rank});
    }
    cases.push_back({.name = tag + "swiglu_oai_one_slice", .backend = Backend::kCUDA, .M = 60, .rank = 24,
                     .w13_slices = 1, .activation = Activation::kSwigluOai});
    cases.push_back({.name = tag + "k_tails_share50", .backend = Backend::kCUDA, .M = 24, .H = 1032, .I = 528,
                     .rank = 16, .share = 0.5, .disable_some = true});
    for (LayerLoraCase& c : cases) {
      c.options.config = &sm80_m16_n128;
      expect_layer_matches_reference(c);
    }
  }
}

// Short runs through the segmented shrink, as with MOELORA_LORA_SHRINK_WARP_TILES=0 (and as
// at K > 8192 past 1024 slots): the fallback the default rule no longer takes there (grouped
// path, 1200 slots / (16 x 4) pairs; a fused-path chunk of 24 slots).
TEST(FusedExpertsLoraWarpTilesOff, ShortRunsMatchReference) {
  MOELORA_SKIP_UNLESS_AVAILABLE(Backend::kCUDA);
  const ScopedKnob warp_tiles(cuda::lora_shrink_warp_tiles_use, cuda::set_lora_shrink_warp_tiles_use,
                              cuda::WarpTilesUse::kNever);
  expect_grouped_ranks_match({.name = "short_runs", .backend = Backend::kCUDA, .M = 300, .top_k = 4, .E = 16,
                              .H = 272, .I = 80, .share = 0.5},
                             "warp tiles off");
  LayerLoraCase small{.name = "warp_tiles_off_small_chunk", .backend = Backend::kCUDA, .M = 6, .top_k = 4, .E = 16,
                      .H = 1040, .I = 528, .rank = 16};
  expect_layer_matches_reference(small);
}

// Long runs through the warp tiles, as with MOELORA_LORA_SHRINK_WARP_TILES=2 (a candidate rule
// the proof's A/B times: 1200 slots / (4 x 2) pairs).
TEST(FusedExpertsLoraWarpTilesAlways, LongRunsMatchReference) {
  MOELORA_SKIP_UNLESS_AVAILABLE(Backend::kCUDA);
  const ScopedKnob warp_tiles(cuda::lora_shrink_warp_tiles_use, cuda::set_lora_shrink_warp_tiles_use,
                              cuda::WarpTilesUse::kAlways);
  expect_grouped_ranks_match({.name = "long_runs", .backend = Backend::kCUDA, .M = 300, .top_k = 4, .E = 4,
                              .H = 1040, .I = 528, .L = 2, .share = 0.5},
                             "warp tiles always");
}

// The expand variants' cases: short runs (tiles of many pairs), long runs, and swiglu_oai
// (interleaved gate/up) at rank 64; widths not a multiple of 64 (I = 80, 528; H = 272, 1040).
std::vector<LayerLoraCase> expand_cases() {
  return {
      {.name = "short_runs", .backend = Backend::kCUDA, .M = 300, .top_k = 4, .E = 16, .H = 272, .I = 80, .rank = 16,
       .share = 0.5},
      {.name = "long_runs", .backend = Backend::kCUDA, .M = 300, .top_k = 4, .E = 8, .H = 1040, .I = 528, .L = 2},
      {.name = "swiglu_oai_rank64", .backend = Backend::kCUDA, .M = 300, .top_k = 4, .E = 8, .H = 272, .I = 80, .L = 2,
       .rank = 64, .activation = Activation::kSwigluOai},
  };
}

// The LoRA expands' column-tile schedules whatever the rule picks ($MOELORA_LORA_EXPAND_STREAM
// 0 and 2): a column tile a CTA at long runs, and a streamed stride of them at short runs,
// where most tiles hold more pairs than a stage (their rounds walk the stride) and some fit
// one (double-buffered).
TEST(FusedExpertsLoraExpandSchedules, NeverAndAlwaysStreamedMatchReference) {
  MOELORA_SKIP_UNLESS_AVAILABLE(Backend::kCUDA);
  const ScopedKnob groups(cuda::lora_expand_groups_use, cuda::set_lora_expand_groups_use,
                          cuda::ExpandGroupsUse::kNever);
  const ScopedKnob stream(cuda::lora_expand_stream_use, cuda::set_lora_expand_stream_use,
                          cuda::ExpandStreamUse::kNever);
  expect_grouped_layers_match(expand_cases(), "a column tile a CTA");
  cuda::set_lora_expand_stream_use(cuda::ExpandStreamUse::kAlways);
  expect_grouped_layers_match(expand_cases(), "streamed");
}

// moe_lora_expand_groups and moe_lora_expand_activation_groups wherever they fit
// ($MOELORA_LORA_EXPAND_GROUPS=2; the rule takes them at short runs): the expands by 16-entry
// groups, a warp a group's 32 columns: expand_cases (at rank 64 the join falls back to the
// tiles), and groups of several adapters (E = 64 and 8 adapters: ~7 a group, so more than one
// round of lora_b tiles at rank 16 and one a round at rank 64), disabled adapters, swiglu_oai
// at rank 16 (the join by groups, interleaved), share 0.5 (groups with live rows and no
// adapter, which the join activates), fp16 at rank 32 and rank 48, w13 as one slice at rank 16
// and 48; the warps' last 8 outputs past I = 80.
TEST(FusedExpertsLoraExpandGroups, MatchesReference) {
  MOELORA_SKIP_UNLESS_AVAILABLE(Backend::kCUDA);
  const ScopedKnob groups(cuda::lora_expand_groups_use, cuda::set_lora_expand_groups_use,
                          cuda::ExpandGroupsUse::kAlways);
  std::vector<LayerLoraCase> cases = expand_cases();
  cases.push_back({.name = "many_adapters_a_group", .backend = Backend::kCUDA, .M = 300, .top_k = 4, .E = 64, .H = 272,
                   .I = 80, .L = 8, .rank = 16, .disable_some = true});
  cases.push_back({.name = "many_adapters_a_group_rank64", .backend = Backend::kCUDA, .M = 300, .top_k = 4, .E = 64,
                   .H = 272, .I = 80, .L = 8, .rank = 64});
  cases.push_back({.name = "swiglu_oai", .backend = Backend::kCUDA, .M = 300, .top_k = 4, .E = 16, .H = 272, .I = 80,
                   .L = 2, .share = 0.5, .activation = Activation::kSwigluOai});
  cases.push_back({.name = "fp16", .backend = Backend::kCUDA, .dtype = DType::kFloat16, .M = 200, .top_k = 4, .E = 16,
                   .H = 272, .I = 80, .rank = 32, .share = 0.5});
  // GEMM2's expand at slices x padded rank 48 (the kernel's k_extent instances: 16, 32, 48, 64).
  cases.push_back({.name = "rank48", .backend = Backend::kCUDA, .M = 300, .top_k = 4, .E = 16, .H = 272, .I = 80,
                   .rank = 48, .share = 0.5});
  // The join with w13 as one slice: slices x padded rank 16 and 48 (rank 48 past the groups at
  // two slices), so every k_extent instance of the join runs.
  cases.push_back({.name = "one_slice_rank16", .backend = Backend::kCUDA, .M = 300, .top_k = 4, .E = 16, .H = 272,
                   .I = 80, .rank = 16, .share = 0.5, .w13_slices = 1});
  cases.push_back({.name = "one_slice_rank48_swiglu_oai", .backend = Backend::kCUDA, .M = 300, .top_k = 4, .E = 16,
                   .H = 272, .I = 80, .rank = 48, .w13_slices = 1, .activation = Activation::kSwigluOai});
  expect_grouped_layers_match(cases, "the expands and the join by groups");
}

// An adapter id past the slots (or below -1) sets kRoutingBadAdapterId in the routing
// status word (issue 33), on the small-batch path (M = 6) and the aligned one (M = 200);
// valid ids (-1 included) set nothing.
TEST(FusedExpertsLoraRoutingStatus, BadAdapterIdSetsItsBit) {
  MOELORA_SKIP_UNLESS_AVAILABLE(Backend::kCUDA);
  for (int64_t M : {6, 200}) {
    LayerLoraCase c{.name = "status", .backend = Backend::kCUDA, .M = M, .E = 8, .L = 4, .rank = 16, .share = 0.5};
    std::mt19937 rng(4243);
    LoraLayer layer(c, rng);
    Buffer word(Backend::kCUDA, DType::kInt32, 1);
    const TensorView word_view = word.view({1});
    FusedExpertsArgs args = layer.args();
    args.routing_status = &word_view;
    TestStream stream(Backend::kCUDA);
    auto run = [&] {
      word.set(0, 0);
      word.upload();
      fused_experts(args, c.options, stream.handle());
      stream.sync();
      word.download();
      return int32_t(word.get(0));
    };
    EXPECT_EQ(run(), 0) << "M " << M << ": valid adapter ids";
    for (int64_t bad : {c.L, c.L + 7, int64_t(-2)}) {
      layer.lora_ids.set(3, double(bad));
      layer.lora_ids.upload();
      EXPECT_EQ(run(), kRoutingBadAdapterId) << "M " << M << ", adapter id " << bad;
    }
  }
}
#endif

// ---- bad arguments --------------------------------------------------------------------

TEST(FusedExpertsLoraErrors, NameTheArgument) {
  LayerLoraCase c{.name = "errors", .backend = Backend::kCPU, .M = 6, .E = 4, .H = 32, .I = 16, .L = 4, .rank = 8};
  std::mt19937 rng(5);
  LoraLayer layer(c, rng);
  FusedExpertsArgs args = layer.args();

  // An adapter id out of range (CPU reads it).
  layer.lora_ids.set(3, 4);
  EXPECT_THAT(error_message([&] { fused_experts(args); }), HasSubstr("'token_lora_ids' expected values in [-1, 4)"));
  layer.lora_ids.set(3, -2);
  EXPECT_THAT(error_message([&] { fused_experts(args); }), HasSubstr("'token_lora_ids'"));
  layer.lora_ids.set(3, 0);

  // Rank above the limit.
  Buffer big_a(Backend::kCPU, c.dtype, c.L * c.E * 129 * c.H);
  FusedExpertsLora bad = layer.lora;
  bad.w13.lora_a[0] = big_a.view({c.L, c.E, 129, c.H});
  args.lora = &bad;
  EXPECT_THAT(error_message([&] { fused_experts(args); }), HasSubstr("'w13_lora_a[0]' expected a rank (dim 2) in [1, 128]"));

  // Slices disagreeing on the rank, lora_b with the wrong slice width, a wrong expert count.
  bad = layer.lora;
  Buffer other_a(Backend::kCPU, c.dtype, c.L * c.E * 4 * c.H);
  bad.w13.lora_a[1] = other_a.view({c.L, c.E, 4, c.H});
  EXPECT_THAT(error_message([&] { fused_experts(args); }), HasSubstr("'w13_lora_a[1]'"));
  bad = layer.lora;
  Buffer wide_b(Backend::kCPU, c.dtype, c.L * c.E * 2 * c.I * c.rank);
  bad.w13.lora_b[0] = wide_b.view({c.L, c.E, 2 * c.I, c.rank});
  EXPECT_THAT(error_message([&] { fused_experts(args); }), HasSubstr("'w13_lora_b[0]' expected size 16 on dim 2"));
  bad = layer.lora;
  bad.w2.lora_a[0] = layer.stack2.a[0].view({c.L, c.E / 2, c.rank, c.I});
  EXPECT_THAT(error_message([&] { fused_experts(args); }), HasSubstr("'w2_lora_a[0]'"));
  bad = layer.lora;
  bad.w13.interleaved_slices = true;  // silu: gate and up are halves
  EXPECT_THAT(error_message([&] { fused_experts(args); }), HasSubstr("'w13_interleaved_slices' expected false"));
  bad = layer.lora;
  bad.w2.num_slices = 2;
  EXPECT_THAT(error_message([&] { fused_experts(args); }), HasSubstr("w2_"));

  // Adapter state of the wrong size or type.
  bad = layer.lora;
  const TensorView short_enabled = layer.enabled.view({c.L - 1});
  bad.adapters.adapter_enabled = &short_enabled;
  EXPECT_THAT(error_message([&] { fused_experts(args); }), HasSubstr("'adapter_enabled'"));
  bad = layer.lora;
  const TensorView int_scale = layer.enabled.view({c.L});
  bad.adapters.adapter_scale = &int_scale;
  EXPECT_THAT(error_message([&] { fused_experts(args); }), HasSubstr("'adapter_scale'"));
  bad = layer.lora;
  bad.adapters.token_lora_ids = layer.lora_ids.view({c.M - 1});
  EXPECT_THAT(error_message([&] { fused_experts(args); }), HasSubstr("'token_lora_ids'"));

  // A workspace sized without the adapters.
  args.lora = &layer.lora;
  FusedExpertsShape no_lora = layer.shape();
  no_lora.max_loras = no_lora.lora_rank = 0;
  args.workspace = layer.workspace.view({fused_experts_workspace_size(no_lora) / 4});
  EXPECT_THAT(error_message([&] { fused_experts(args); }), HasSubstr("'workspace' expected at least"));
}

}  // namespace
}  // namespace moelora::test
