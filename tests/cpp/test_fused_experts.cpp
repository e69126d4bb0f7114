// fused_experts, the whole MoE layer, against reference_fused_experts: for each token m
// and each of its slots j, e = topk_ids[m][j] (skipped when dropped or not on this rank),
// h1 = x·w13[e]ᵀ in double from the dtype-rounded inputs, act, h2 = act·w2[e]ᵀ, weighted
// by topk_weights, summed, times routed_scaling_factor.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "api/fused_experts_plan.h"
#include "api/moe_align_block_size.h"
#include "common/params.h"
#include "fused_experts_testing.h"
#include "test_util.h"

namespace moelora::test {
namespace {

using ::testing::HasSubstr;

class FusedExpertsTest : public ::testing::TestWithParam<LayerCase> {};

TEST_P(FusedExpertsTest, MatchesReference) {
  const LayerCase& c = GetParam();
  MOELORA_SKIP_UNLESS_AVAILABLE(c.backend);
#ifdef MOELORA_WITH_CUDA
  const MoeKernelConfig* config = c.options.config;
  if (c.backend == Backend::kCUDA && config != nullptr &&
      (config->gemm1.kernel == GemmKernel::kSm90 || config->gemm2.kernel == GemmKernel::kSm90) &&
      !cuda::current_device_facts().sm90_kernels) {
    GTEST_SKIP() << "wgmma tiles need an sm_90 device";
  }
#endif
  std::mt19937 rng(std::hash<std::string>{}(c.name));
  LayerProblem problem(c, rng);
  TestStream stream(c.backend);
  fused_experts(problem.args, c.options, stream.handle());
  stream.sync();
  Buffer& out = problem.out_buffer(c);
  out.download();
  const double error = ref::rel_error(out.read(problem.out_view), problem.reference(c));
  EXPECT_LE(error, ref::tolerance(c.dtype));
  EXPECT_EQ(out.count_unwritten(problem.out_view), 0);
  EXPECT_EQ(out.count_written_outside(problem.out_view), 0);
  if (c.backend == Backend::kCUDA && c.M > 0 && c.expect_small_batch.has_value()) {
    problem.workspace.download();
    EXPECT_EQ(problem.workspace.is_poison(0), *c.expect_small_batch)
        << (*c.expect_small_batch ? "the aligned path ran instead of the small-batch kernels"
                                  : "the small-batch kernels ran instead of the aligned path");
  }
#ifdef MOELORA_WITH_CUDA
  if (c.backend == Backend::kCUDA && c.M > 0 && c.expect_grouped.has_value() &&
      cuda::current_device_facts().sm90_kernels) {
    const bool grouped = grouped_path_ran(
        detail::workspace_layout({c.M, c.top_k, c.num_global, c.H, c.I, c.dtype, c.num_local}, c.options),
        problem.workspace);
    EXPECT_EQ(grouped, *c.expect_grouped) << (*c.expect_grouped ? "the tile kernels ran instead of the grouped GEMMs"
                                                                 : "the grouped GEMMs ran");
  }
#endif
  RecordProperty("rel_error", std::to_string(error));
}

// The workspace of the grouped path (no device needed): 16-bit experts reserve it from
// grouped_16bit_min_slots, or from kGroupedMinSlots when the caller's config asks for it, with
// LoRA too (by (expert, adapter) group); and its alignment in blocks of 16 fits whatever block size the config fixes (a
// config of 64-row blocks held too few blocks for the path's 16-row ones).
TEST(FusedExpertsLayout, ReservesTheGroupedPathFor16BitExperts) {
  const int64_t E = 64, H = 2048;
  auto layout = [&](int64_t tokens, const MoeKernelConfig* config, int64_t max_loras = 0) {
    FusedExpertsShape shape{tokens, /*top_k=*/8, E, H, /*intermediate_size=*/1024, DType::kBFloat16};
    shape.max_loras = max_loras;
    shape.lora_rank = max_loras > 0 ? 16 : 0;
    FusedExpertsOptions options;
    options.config = config;
    return detail::workspace_layout(shape, options);
  };
  const int64_t min_tokens = kGrouped16BitMinSlots / 8;
  EXPECT_EQ(layout(min_tokens - 1, nullptr).grouped_rows, 0);
  const detail::WorkspaceLayout at_min = layout(min_tokens, nullptr);
  EXPECT_EQ(at_min.grouped_rows, detail::align_capacity(kGrouped16BitMinSlots, 16, E).max_num_tokens_padded);
  EXPECT_GT(at_min.total, layout(min_tokens - 1, nullptr).total);
  // With adapters: the segmented alignment's groups (expert, adapter or none), padded to 16.
  const detail::WorkspaceLayout with_lora = layout(min_tokens, nullptr, /*max_loras=*/4);
  EXPECT_EQ(with_lora.grouped_rows, detail::align_capacity(kGrouped16BitMinSlots, 16, E * 5).max_num_tokens_padded);
  EXPECT_GE(with_lora.grouped_sizes - with_lora.grouped_entry_offsets, E * 5 * 4) << "a group offset per (expert, adapter)";
  MoeKernelConfig grouped_64;
  grouped_64.block_size = 64;
  grouped_64.grouped_gemm = true;
  const int64_t tokens = kGroupedMinSlots / 8;  // below kGrouped16BitMinSlots: the config asks
  const detail::WorkspaceLayout asked = layout(tokens, &grouped_64);
  EXPECT_GT(asked.grouped_rows, 0);
  const AlignCapacity blocks_of_16 = detail::align_capacity(tokens * 8, 16, E);
  EXPECT_GE(asked.capacity.max_num_blocks, blocks_of_16.max_num_blocks);
  EXPECT_GE(asked.capacity.max_num_tokens_padded, blocks_of_16.max_num_tokens_padded);
  // GEMM1's 16-bit input rows [entries, H] lie inside the workspace.
  EXPECT_GE(asked.total - asked.grouped_a, asked.grouped_rows * H * 2);
  // Few experts: from 64 slots an expert (Mixtral's 8: 512 slots), below kGrouped16BitMinSlots.
  FusedExpertsShape few{/*num_tokens=*/256, /*top_k=*/2, /*num_experts=*/8, H, /*intermediate_size=*/1024, DType::kBFloat16};
  EXPECT_EQ(grouped_16bit_min_slots(8), 512);
  EXPECT_EQ(grouped_16bit_min_slots(E), kGrouped16BitMinSlots);
  EXPECT_GT(detail::workspace_layout(few, FusedExpertsOptions{}).grouped_rows, 0);
  few.num_tokens = 255;
  EXPECT_EQ(detail::workspace_layout(few, FusedExpertsOptions{}).grouped_rows, 0);
}

// The activation's part of a case name.
const char* activation_tag(Activation activation) {
  return activation == Activation::kSilu ? "silu" : activation == Activation::kGelu ? "gelu" : "swiglu";
}

std::vector<LayerCase> layer_cases() {
  std::vector<LayerCase> cases;
  auto add = [&](const std::string& name, LayerCase c, std::vector<Backend> backends = all_backends()) {
    for (Backend backend : backends) {
      c.backend = backend;
      c.name = sanitized(std::string(backend_name(backend)) + "_" + dtype_short_name(c.dtype) + "_" + name);
      cases.push_back(c);
    }
  };
  const DType bf16 = DType::kBFloat16, fp16 = DType::kFloat16, fp32 = DType::kFloat32;

  // The brief's models as one expert-parallel rank: the real E, top_k, H, I, but only
  // num_local experts' weights (the full weights of the big models do not fit a quick
  // test), with routing that favours the local experts so most slots compute.
  struct Model {
    const char* name;
    int64_t E, top_k, H, I, num_local;
    Activation activation;
  };
  const Model models[] = {
      {"mixtral_8x7b", 8, 2, 4096, 14336, 2, Activation::kSilu},
      {"qwen3_30b_a3b", 128, 8, 2048, 768, 16, Activation::kSilu},
      {"qwen3_235b_a22b", 128, 8, 4096, 1536, 4, Activation::kSilu},
      {"deepseek_v3_tp8", 256, 8, 7168, 256, 16, Activation::kSilu},
      {"olmoe_1b_7b", 64, 8, 2048, 1024, 8, Activation::kSilu},
      {"gpt_oss_120b", 128, 4, 2880, 2880, 2, Activation::kSwigluOai},
  };
  // A model's shapes on one rank of num_local experts, on top of `c`.
  auto model_rank = [](const Model& m, LayerCase c) {
    c.top_k = m.top_k;
    c.H = m.H;
    c.I = m.I;
    c.num_global = m.E;
    c.num_local = m.num_local;
    c.expert_map = true;
    c.local_share = 0.75;
    c.weight_scale = 0.02;
    c.options.activation = m.activation;
    return c;
  };
  for (const Model& m : models) {
    LayerCase c = model_rank(m, LayerCase{});
    const bool mixtral = m.I > 8192;  // 176M multiply-adds a slot: one token on the CPU
    for (int64_t M : {1, 16, 64}) {
      if (mixtral && M > 1) continue;
      c.M = M;
      c.local_share = mixtral ? 1.0 : 0.75;
      add(std::string(m.name) + "_ep_M" + std::to_string(M), c);
    }
    {
      // Decode on the aligned path (an explicit block size turns the small-batch default off).
      LayerCase aligned = c;
      aligned.M = 1;
      aligned.options.block_size = 16;
      aligned.expect_small_batch = false;
      add(std::string(m.name) + "_ep_M1_aligned", aligned);
    }
    // M = 256 where a GPU does the work; the reference still runs on the host, so
    // mixtral's routing is left uniform (a quarter of its slots local).
    c.M = 256;
    c.local_share = mixtral ? 0.0 : 0.75;
    add(std::string(m.name) + "_ep_M256", c, {Backend::kCUDA});
    // and without expert_map: every expert local (enough of them for top_k distinct ones)
    if (!mixtral) {
      LayerCase local = c;
      local.M = 16;
      local.expert_map = false;
      local.num_local = local.num_global = std::max(m.num_local, m.top_k);
      add(std::string(m.name) + "_local_M16", local);
    }
  }

  // activations x dtypes on a small shape (K = 136 and 40: multiples of 8, not of 16)
  for (DType dtype : {bf16, fp16, fp32}) {
    for (Activation activation : {Activation::kSilu, Activation::kGelu, Activation::kSwigluOai}) {
      LayerCase c;
      c.dtype = dtype;
      c.options.activation = activation;
      const char* act_name = activation == Activation::kSilu   ? "silu"
                             : activation == Activation::kGelu ? "gelu"
                                                               : "swiglu_oai";
      add(std::string("small_") + act_name, c);
    }
    // odd sizes: K = 19 and 13 (no tensor-core tile fits), N = 26 and 19
    LayerCase odd;
    odd.dtype = dtype;
    odd.M = 17;
    odd.top_k = 3;
    odd.H = 19;
    odd.I = 13;
    odd.num_global = odd.num_local = 5;
    add("odd_H19_I13", odd);
    odd.options.activation = Activation::kSwigluOai;
    add("odd_H19_I13_swiglu", odd);
  }

  LayerCase c;  // the small shape, bf16, silu
  // Decode-sized chunks (no more slots than experts) take the small-batch kernels by default on
  // CUDA; these cases pin the aligned path with an explicit block size (the heuristic's).
  auto aligned = [](LayerCase x) {
    x.options.block_size = 16;
    x.expect_small_batch = false;
    return x;
  };
  {
    LayerCase x = c;
    x.options.chunk_size = 7;
    add("chunk7_M20", aligned(x));
    x.dtype = fp16;
    x.id_dtype = DType::kInt64;
    x.expert_map = true;
    x.num_global = 16;
    x.dropped_share = 0.2;
    add("chunk7_M20_expert_map_dropped_i64", aligned(x));
    x = c;
    x.M = 5;
    x.options.chunk_size = 1;
    add("chunk1_M5", aligned(x));
  }
  {
    LayerCase x = c;
    x.inplace = true;
    add("inplace", x);
    x.dtype = fp32;
    x.padded = true;
    x.options.chunk_size = 7;
    add("inplace_padded_chunk7", x);
    x = c;
    x.inplace = true;
    x.top_k = 1;
    add("inplace_topk1", aligned(x));
  }
  {
    LayerCase x = c;
    x.options.no_combine = true;
    add("no_combine", x);
    x.padded = true;
    x.dropped_share = 0.2;
    x.expert_map = true;
    x.num_global = 16;
    x.dtype = fp16;
    add("no_combine_padded_dropped_expert_map", x);
    x = c;
    x.options.no_combine = true;
    x.top_k = 1;
    add("no_combine_topk1", aligned(x));
  }
  {
    LayerCase x = c;
    x.options.apply_router_weight_on_input = true;
    x.top_k = 1;
    add("weight_on_input_topk1", aligned(x));
    x.top_k = 2;
    x.dtype = fp32;
    add("weight_on_input_topk2", x);
  }
  {
    LayerCase x = c;
    x.options.routed_scaling_factor = 2.5f;
    add("scale2_5", x);
    x.top_k = 1;
    add("scale2_5_topk1", aligned(x));
    x.options.routed_scaling_factor = 1.0f;
    add("topk1", aligned(x));
  }
  {
    LayerCase x = c;
    x.expert_map = true;
    x.num_global = 16;
    x.dropped_share = 0.2;
    add("expert_map_dropped", x);
    x = c;
    x.dropped_share = 0.3;
    add("dropped", x);
    x.dropped_share = 1.0;
    add("all_dropped", x);
    x = c;
    x.M = 0;
    add("M0", x);
    x.M = 1;
    add("M1", aligned(x));
    x = c;
    x.M = 50;
    x.top_k = 1;
    x.one_expert = true;
    add("all_tokens_on_one_expert", x);
    x = c;
    x.num_global = x.num_local = 1;
    x.top_k = 1;
    add("E1", aligned(x));
    x = c;
    x.padded = true;
    x.id_dtype = DType::kInt64;
    add("padded_i64", x);
  }
  {
    LayerCase x = c;
    x.options.activation = Activation::kSwigluOai;
    x.options.swiglu_alpha = 1.1f;
    x.options.swiglu_limit = 0.75f;  // below the spread of h1: both clamps engage
    add("swiglu_alpha1_1_limit0_75", x);
  }
  for (int64_t bs : {16, 32, 48, 64, 128, 256}) {
    LayerCase x = c;
    x.M = 37;
    x.top_k = 4;
    x.num_global = x.num_local = 16;
    x.options.block_size = bs;
    add("block_size" + std::to_string(bs), x);
  }
  // Explicit kernel configs (the override API); the CPU ignores the tiles. Each GEMM
  // gets a different kernel, so a mix-up of gemm1/gemm2 tiles would still be exercised.
  static const MoeKernelConfig kMmaSync{64, {GemmKernel::kSm80, 64, 64}, {GemmKernel::kSm80, 16, 128}};
  static const MoeKernelConfig kWgmma{128, {GemmKernel::kSm90, 128, 256}, {GemmKernel::kSm90, 64, 128}};
  static const MoeKernelConfig kMixed{128, {GemmKernel::kSm90, 64, 256}, {GemmKernel::kSm80, 32, 64}};
  static const MoeKernelConfig kClusters{64, {GemmKernel::kSm90, 64, 256, 2}, {GemmKernel::kSm90, 64, 256, 2}};
  static const MoeKernelConfig kAutoTiles{32, {}, {}};
  // GEMM1 on ordered tiles, GEMM2 on the static schedule (GemmTile::ordered), and the
  // reverse in clusters.
  static const MoeKernelConfig kSchedules{128, {GemmKernel::kSm90, 128, 128, 1, true},
                                          {GemmKernel::kSm90, 64, 256, 1, false}};
  static const MoeKernelConfig kClusterSchedules{128, {GemmKernel::kSm90, 64, 128, 2, false},
                                                 {GemmKernel::kSm90, 128, 256, 2, true}};
  for (const auto& [name, config] : {std::pair{"config_sm80", &kMmaSync}, std::pair{"config_sm90", &kWgmma},
                                     std::pair{"config_mixed", &kMixed}, std::pair{"config_sm90_clusters", &kClusters},
                                     std::pair{"config_sm90_schedules", &kSchedules},
                                     std::pair{"config_sm90_cluster_schedules", &kClusterSchedules},
                                     std::pair{"config_auto_tiles", &kAutoTiles}}) {
    LayerCase x = c;
    x.M = 300;
    x.top_k = 4;
    x.dropped_share = 0.05;
    x.options.config = config;
    add(name, x);
    x.options.activation = Activation::kSwigluOai;
    x.dtype = fp16;
    x.M = 33;
    add(std::string(name) + "_swiglu_fp16", x);
  }
  // sm90 tiles with I % 8 != 0: GEMM1 (K = H) runs on the tensor cores, GEMM2 (K = I)
  // on the CUDA-core kernel, so the activation must stay in slot order (not sorted).
  {
    LayerCase x = c;
    x.M = 300;
    x.top_k = 4;
    x.I = 100;
    x.options.config = &kWgmma;
    add("config_sm90_intermediate_not_multiple_of_8", x);
  }
  // MoeKernelConfig::sorted_input: chunks of >= 512 slots on sm90 tiles copy x into
  // sorted order for GEMM1 (one TMA box per tile): strided x rows, an expert map, dropped
  // slots, and chunks on both sides of the threshold (chunk 150, top_k 4: 600 slots, then
  // 480, which gathers).
  {
    auto with_sorted_input = [](MoeKernelConfig config) {
      config.sorted_input = true;
      return config;
    };
    static const MoeKernelConfig kWgmmaSortedInput = with_sorted_input(kWgmma);
    static const MoeKernelConfig kClustersSortedInput = with_sorted_input(kClusters);
    LayerCase x = c;
    x.M = 300;
    x.top_k = 4;
    x.padded = true;
    x.x_row_pad = 8;  // rows stay 16-byte aligned
    x.expert_map = true;
    x.num_global = 32;
    x.local_share = 0.5;
    x.dropped_share = 0.05;
    x.options.config = &kWgmmaSortedInput;
    add("config_sm90_sorted_input_strided_expert_map", x, {Backend::kCUDA});
    x = c;
    x.M = 270;
    x.top_k = 4;
    x.options.chunk_size = 150;
    x.options.config = &kClustersSortedInput;
    add("config_sm90_sorted_input_chunks", x, {Backend::kCUDA});
    x.options.activation = Activation::kSwigluOai;
    x.options.apply_router_weight_on_input = true;
    x.dtype = fp16;
    add("config_sm90_sorted_input_swiglu_fp16_weight_on_input", x, {Backend::kCUDA});
  }
  // Every tensor-core tile as GEMM1 with the activation fused into its epilogue (CUDA):
  // each activation's gate/up layout, partial output tiles (I = 200), a K tail (H = 136),
  // dropped slots, and the routed weight before the activation.
  static const std::vector<MoeKernelConfig> kGemm1Tiles = [] {
    std::vector<MoeKernelConfig> tiles;
    for (int32_t m : {16, 32, 64}) {
      for (int32_t n : {64, 128}) tiles.push_back({128, {GemmKernel::kSm80, m, n}, {}});
    }
    for (int32_t m : {64, 128}) {
      for (int32_t n : {128, 256}) {
        for (int32_t cluster : {1, 2}) tiles.push_back({128, {GemmKernel::kSm90, m, n, cluster}, {}});
      }
    }
    return tiles;
  }();
  const Activation activations[] = {Activation::kSilu, Activation::kGelu, Activation::kSwigluOai};
  for (size_t i = 0; i < kGemm1Tiles.size(); ++i) {
    const MoeKernelConfig& config = kGemm1Tiles[i];
    LayerCase x = c;
    x.M = 150;
    x.top_k = 4;
    x.I = 200;
    x.dropped_share = 0.05;
    x.options.config = &config;
    x.options.activation = activations[i % 3];
    x.options.swiglu_limit = 0.75f;
    x.options.apply_router_weight_on_input = i % 4 == 3;
    const std::string act = activation_tag(x.options.activation);
    add("fused_act_" + std::string(config.gemm1.kernel == GemmKernel::kSm90 ? "sm90_" : "sm80_") +
            std::to_string(config.gemm1.block_m) + "x" + std::to_string(config.gemm1.block_n) +
            (config.gemm1.cluster_m > 1 ? "_cluster2_" : "_") + act +
            (x.options.apply_router_weight_on_input ? "_weight_on_input" : ""),
        x, {Backend::kCUDA});
  }
  // The grouped GEMMs with 16-bit experts (CUDA, sm_90a: CUTLASS ptr-array GEMMs over rows
  // gathered by expert; the CPU ignores the flag): both 16-bit types and tiles, each
  // activation's gate/up layout, K tails of the 64-element K steps (H = 272, I = 80),
  // expert_map with dropped slots, strided x, chunks, the routed scaling factor, the
  // heuristic's own choice at prefill, and the calls the path does not take.
  {
    LayerCase g = c;
    g.M = 160;
    g.top_k = 4;
    g.H = 272;
    g.I = 80;
    g.options.config = grouped_config();
    g.expect_grouped = true;
    for (const auto& [name, tiles] : {std::pair{"m64", GroupedGemmTiles::kPingpong64},
                                        std::pair{"m128", GroupedGemmTiles::kCooperative128},
                                        std::pair{"m128n256", GroupedGemmTiles::kCooperative128x256}}) {
      for (Activation activation : {Activation::kSilu, Activation::kGelu, Activation::kSwigluOai}) {
        LayerCase x = g;
        x.options.config = grouped_config(tiles, tiles);
        x.options.activation = activation;
        x.options.swiglu_limit = 0.75f;
        const char* act = activation_tag(activation);
        add(std::string("grouped16_") + name + "_" + act, x, {Backend::kCUDA});
        x.dtype = fp16;
        add(std::string("grouped16_") + name + "_" + act, x, {Backend::kCUDA});
      }
    }
    LayerCase x = g;
    x.padded = true;
    x.x_row_pad = 8;  // rows stay 16-byte aligned
    x.expert_map = true;
    x.num_global = 32;
    x.local_share = 0.5;
    x.dropped_share = 0.05;
    x.options.routed_scaling_factor = 2.5f;
    add("grouped16_strided_expert_map_dropped_scale2_5", x, {Backend::kCUDA});
    x = g;
    x.M = 300;
    x.options.chunk_size = 128;  // 512, 512 and 176 slots
    add("grouped16_chunks", x, {Backend::kCUDA});
    x = g;
    x.M = 1024;
    x.top_k = 2;
    x.H = 256;
    x.I = 144;
    x.options.config = nullptr;  // the heuristic: 2048 slots, 256 an expert
    add("grouped16_heuristic_M1024", x, {Backend::kCUDA});
    x = g;
    x.H = 264;  // rows of 264 elements: TMA takes them, the path asks 16 (grouped_experts_supported)
    x.expect_grouped = false;
    add("grouped16_H264_takes_the_tiles", x, {Backend::kCUDA});
    x = g;
    x.options.no_combine = true;
    x.expect_grouped = false;
    add("grouped16_no_combine_takes_the_tiles", x, {Backend::kCUDA});
    x = g;
    x.options.apply_router_weight_on_input = true;
    x.top_k = 1;
    x.expect_grouped = false;
    add("grouped16_weight_on_input_takes_the_tiles", x, {Backend::kCUDA});
  }
  // The small-batch kernels (CUDA; the CPU ignores the flag): every option of the layer,
  // both 16-bit types, the slot limit, and chunks that fall back to the aligned path.
  static const MoeKernelConfig kSmallBatch{16, {}, {}, /*small_batch=*/true};
  {
    LayerCase sb = c;
    sb.M = 6;
    sb.top_k = 4;
    sb.num_global = sb.num_local = 16;
    sb.options.config = &kSmallBatch;
    sb.expect_small_batch = true;
    auto add_small = [&](const std::string& name, LayerCase x, bool qualifies = true) {
      x.expect_small_batch = qualifies;
      add("small_batch_" + name, x);
    };
    for (Activation activation : {Activation::kSilu, Activation::kGelu, Activation::kSwigluOai}) {
      LayerCase x = sb;
      x.options.activation = activation;
      x.options.swiglu_limit = 0.75f;
      const char* act = activation_tag(activation);
      add_small(act, x);
      x.dtype = fp16;
      add_small(std::string(act) + "_fp16", x);
    }
    LayerCase x = sb;
    x.options.no_combine = true;
    add_small("no_combine", x);
    x.padded = true;
    x.x_row_pad = 8;  // hidden rows stay 16-byte aligned
    x.dropped_share = 0.2;
    x.expert_map = true;
    x.num_global = 40;
    x.local_share = 0.5;
    x.id_dtype = DType::kInt64;
    add_small("no_combine_padded_dropped_expert_map_i64", x);
    x.x_row_pad = 9;  // hidden rows not 16-byte aligned: the aligned path
    add_small("no_combine_unaligned_rows_falls_back", x, false);
    x = sb;
    x.inplace = true;
    add_small("inplace", x);
    x.options.chunk_size = 1;
    add_small("inplace_chunk1", x);
    x = sb;
    x.M = 40;
    x.options.chunk_size = 7;  // 28 slots a chunk, the last chunk 5 tokens
    add_small("chunk7_M40", x);
    x = sb;
    x.options.apply_router_weight_on_input = true;
    add_small("weight_on_input", x);
    x.top_k = 1;
    add_small("weight_on_input_topk1", x);
    x = sb;
    x.options.routed_scaling_factor = 2.5f;
    add_small("scale2_5", x);
    x.top_k = 1;
    add_small("scale2_5_topk1", x);
    x = sb;
    x.dropped_share = 0.3;
    add_small("dropped", x);
    x.dropped_share = 1.0;
    add_small("all_dropped", x);
    x = sb;
    x.expert_map = true;
    x.num_global = 64;
    x.local_share = 0.3;
    add_small("expert_map", x);
    x = sb;
    x.M = 1;
    add_small("M1", x);
    x = sb;
    x.M = 60;
    x.top_k = 1;
    x.one_expert = true;  // one expert, 60 slots: 15 passes of 4 over its rows
    add_small("one_expert_60_slots", x);
    x = sb;
    x.M = 16;  // 64 slots: the limit
    add_small("M16_topk4", x);
    x.M = 17;  // 68 slots: the aligned path
    add_small("M17_topk4_falls_back", x, false);
    x = sb;
    x.dtype = fp32;
    add_small("fp32_falls_back", x, false);
    x = sb;
    x.H = 19;  // K % 8 != 0: the aligned path (CUDA-core kernel)
    x.I = 13;
    add_small("odd_H19_I13_falls_back", x, false);
    x = sb;
    x.H = 1000;
    x.I = 136;
    add_small("H1000_I136", x);
    // the brief's models at decode sizes, as one expert-parallel rank
    for (const Model& m : models) {
      LayerCase y = model_rank(m, sb);
      for (int64_t M : {1, 4, 8}) {
        if (m.I > 8192 && M > 1) continue;  // mixtral: one token on the CPU
        y.M = M;
        add_small(std::string(m.name) + "_ep_M" + std::to_string(M), y);
      }
    }
  }
  // Ordered sm90 tiles (the default) against the static schedule, and counters reused
  // by the chunks of one call (each chunk's alignment zeroes them).
  {
    static const MoeKernelConfig kWgmma64{64, {GemmKernel::kSm90, 64, 128}, {GemmKernel::kSm90, 64, 256}};
    LayerCase x = c;
    x.M = 300;
    x.top_k = 4;
    x.num_global = x.num_local = 16;
    x.dropped_share = 0.05;
    x.options.config = &kWgmma64;
    add("sm90_ordered_tiles", x, {Backend::kCUDA});
    x.options.chunk_size = 70;
    add("sm90_ordered_tiles_chunk70", x, {Backend::kCUDA});
    x.options.ordered_tiles = false;
    add("sm90_static_tiles_chunk70", x, {Backend::kCUDA});
    x.options.chunk_size = 64 * 1024;
    x.options.config = &kWgmma;
    add("sm90_static_tiles_128x256", x, {Backend::kCUDA});
  }
  {
    LayerCase x = c;
    x.options.fuse_activation = false;  // the separate activation kernel
    add("unfused_activation", x, {Backend::kCUDA});
    x.options.activation = Activation::kSwigluOai;
    add("unfused_activation_swiglu", x, {Backend::kCUDA});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Layers, FusedExpertsTest, ::testing::ValuesIn(layer_cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace moelora::test
