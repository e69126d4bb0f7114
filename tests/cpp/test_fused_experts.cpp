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

#include "common/params.h"
#include "test_util.h"

namespace moelora::test {
namespace {

using ::testing::HasSubstr;

struct LayerCase {
  std::string name;
  Backend backend;
  DType dtype = DType::kBFloat16;
  int64_t M = 20, top_k = 2, H = 136, I = 40;
  int64_t num_global = 8;        // E_global: the range of topk_ids
  int64_t num_local = 8;         // E_local: experts in w13/w2
  bool expert_map = false;       // false: num_global == num_local, ids are local
  double local_share = 0.0;      // with expert_map: chance a pick favours a local expert (0: uniform)
  double dropped_share = 0.0;    // share of slots set to -1
  bool one_expert = false;       // every slot on one expert
  bool inplace = false;          // out is hidden_states
  bool padded = false;           // hidden_states, out, topk_ids, topk_weights with padded rows
  int64_t x_row_pad = 9;         // padded: hidden_states elements past each row (9: rows not 16-byte aligned)
  DType id_dtype = DType::kInt32;
  double weight_scale = 0.0;     // 0: 1/sqrt(K) per GEMM
  FusedExpertsOptions options{};
  // CUDA, when set: whether the small-batch kernels (true) or the aligned path (false)
  // take every chunk. The small-batch kernels never write the alignment part of the
  // workspace (its first bytes), so its poison shows which path ran.
  std::optional<bool> expect_small_batch;
};

void PrintTo(const LayerCase& c, std::ostream* os) { *os << c.name; }

// Routing for a layer case: distinct experts per token; with expert_map, picks favour the
// local experts by local_share; then a share of slots is dropped.
std::vector<int64_t> make_routing(const LayerCase& c, const std::vector<int64_t>& local_experts, std::mt19937& rng) {
  std::vector<int64_t> ids(static_cast<size_t>(c.M * c.top_k));
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (int64_t m = 0; m < c.M; ++m) {
    std::vector<int64_t> chosen;
    for (int64_t j = 0; j < c.top_k; ++j) {
      std::vector<int64_t> candidates;
      const bool favour_local = uniform(rng) < c.local_share;
      for (int64_t e : favour_local ? local_experts : std::vector<int64_t>{}) {
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) candidates.push_back(e);
      }
      if (candidates.empty()) {
        for (int64_t e = 0; e < c.num_global; ++e) {
          if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) candidates.push_back(e);
        }
      }
      std::uniform_int_distribution<size_t> pick(0, candidates.size() - 1);
      chosen.push_back(candidates[pick(rng)]);
      ids[size_t(m * c.top_k + j)] = chosen.back();
    }
  }
  std::bernoulli_distribution drop(c.dropped_share);
  for (auto& id : ids) {
    if (c.one_expert) id = local_experts.front();
    if (drop(rng)) id = -1;
  }
  return ids;
}

// All buffers of one fused_experts call, filled, uploaded and poisoned.
struct LayerProblem {
  LayerProblem(const LayerCase& c, std::mt19937& rng)
      : x_row_stride(c.padded ? c.H + c.x_row_pad : c.H),
        out_rows(c.options.no_combine ? c.M * c.top_k : c.M),
        out_row_stride(c.padded ? c.H + 3 : c.H),
        ids_row_stride(c.padded ? c.top_k + 2 : c.top_k),
        workspace_bytes(fused_experts_workspace_size({c.M, c.top_k, c.num_global, c.H, c.I, c.dtype, c.num_local},
                                                     c.options)),
        hidden(c.backend, c.dtype, std::max<int64_t>(1, c.M * x_row_stride)),
        w13(c.backend, c.dtype, c.num_local * 2 * c.I * c.H),
        w2(c.backend, c.dtype, c.num_local * c.H * c.I),
        topk_weights(c.backend, DType::kFloat32, std::max<int64_t>(1, c.M * ids_row_stride)),
        topk_ids(c.backend, c.id_dtype, std::max<int64_t>(1, c.M * ids_row_stride)),
        expert_map(c.backend, DType::kInt32, c.num_global),
        out(c.backend, c.dtype, std::max<int64_t>(1, out_rows * out_row_stride)),
        // 256 spare bytes, so a misaligned view of the full size still fits (bad-argument tests)
        workspace(c.backend, DType::kFloat32, (workspace_bytes + 256 + 3) / 4) {
    // which global experts are local: a random subset, mapped to 0..E_local-1
    std::vector<int64_t> global(static_cast<size_t>(c.num_global));
    std::iota(global.begin(), global.end(), 0);
    if (c.expert_map) std::shuffle(global.begin(), global.end(), rng);
    const std::vector<int64_t> local_experts(global.begin(), global.begin() + c.num_local);
    map.assign(size_t(c.num_global), -1);
    for (int64_t i = 0; i < c.num_local; ++i) map[size_t(local_experts[size_t(i)])] = int32_t(i);
    ids = make_routing(c, local_experts, rng);

    hidden.poison();  // the padding of hidden_states must keep it (matters when inplace)
    x_view = hidden.view({c.M, c.H}, {x_row_stride, 1});
    x_values = hidden.fill_normal(x_view, rng);
    hidden.upload();
    const double w13_scale = c.weight_scale > 0 ? c.weight_scale : 1.0 / std::sqrt(double(c.H));
    const double w2_scale = c.weight_scale > 0 ? c.weight_scale : 1.0 / std::sqrt(double(c.I));
    w13_values = w13.fill_normal(w13.view({c.num_local, 2 * c.I, c.H}), rng, w13_scale);
    w2_values = w2.fill_normal(w2.view({c.num_local, c.H, c.I}), rng, w2_scale);
    w13.upload();
    w2.upload();
    weights_view = topk_weights.view({c.M, c.top_k}, {ids_row_stride, 1});
    weight_values = random_router_weights(c.M, c.top_k, rng);
    topk_weights.write(weights_view, weight_values);
    topk_weights.upload();
    // padding of topk_ids holds an id no expert has: reading it is caught
    for (int64_t i = 0; i < topk_ids.size(); ++i) topk_ids.set(i, 100000);
    ids_view = topk_ids.view({c.M, c.top_k}, {ids_row_stride, 1});
    topk_ids.write(ids_view, std::vector<double>(ids.begin(), ids.end()));
    topk_ids.upload();
    expert_map.write(expert_map.view({c.num_global}), std::vector<double>(map.begin(), map.end()));
    expert_map.upload();
    map_view = expert_map.view({c.num_global});
    out.poison();
    workspace.poison();  // the op must not rely on a zeroed workspace

    args.hidden_states = x_view;
    args.w13 = w13.view({c.num_local, 2 * c.I, c.H});
    args.w2 = w2.view({c.num_local, c.H, c.I});
    args.topk_weights = weights_view;
    args.topk_ids = ids_view;
    if (c.inplace) {
      out_view = x_view;
    } else if (c.options.no_combine) {
      out_view = out.view({c.M, c.top_k, c.H}, {c.top_k * out_row_stride, out_row_stride, 1});
    } else {
      out_view = out.view({c.M, c.H}, {out_row_stride, 1});
    }
    args.out = out_view;
    args.workspace = workspace.view({(workspace_bytes + 3) / 4});
    args.expert_map = c.expert_map ? &map_view : nullptr;
  }

  std::vector<double> reference(const LayerCase& c) const {
    return ref::reference_fused_experts(x_values, w13_values, w2_values, weight_values, ids, c.M, c.top_k, c.num_local,
                                        c.H, c.I, c.expert_map ? map.data() : nullptr, c.options.activation,
                                        c.options.swiglu_alpha, c.options.swiglu_limit,
                                        c.options.apply_router_weight_on_input, c.options.no_combine,
                                        c.options.routed_scaling_factor);
  }

  Buffer& out_buffer(const LayerCase& c) { return c.inplace ? hidden : out; }

  int64_t x_row_stride, out_rows, out_row_stride, ids_row_stride, workspace_bytes;
  Buffer hidden, w13, w2, topk_weights, topk_ids, expert_map, out, workspace;
  std::vector<int64_t> ids;
  std::vector<int32_t> map;
  TensorView x_view, weights_view, ids_view, map_view, out_view;
  std::vector<double> x_values, w13_values, w2_values, weight_values;
  FusedExpertsArgs args;
};

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
  RecordProperty("rel_error", std::to_string(error));
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
    const std::string act = x.options.activation == Activation::kSilu   ? "silu"
                            : x.options.activation == Activation::kGelu ? "gelu"
                                                                        : "swiglu";
    add("fused_act_" + std::string(config.gemm1.kernel == GemmKernel::kSm90 ? "sm90_" : "sm80_") +
            std::to_string(config.gemm1.block_m) + "x" + std::to_string(config.gemm1.block_n) +
            (config.gemm1.cluster_m > 1 ? "_cluster2_" : "_") + act +
            (x.options.apply_router_weight_on_input ? "_weight_on_input" : ""),
        x, {Backend::kCUDA});
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
      const char* act = activation == Activation::kSilu ? "silu" : activation == Activation::kGelu ? "gelu" : "swiglu";
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

// ---- per-backend checks --------------------------------------------------------------

class FusedExpertsBackendTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override { MOELORA_SKIP_UNLESS_AVAILABLE(GetParam()); }
  Backend backend() const { return GetParam(); }
};

// Calls after the first reuse the workspace's tile counters and cached tables: the same
// problem run three times (output poisoned before each) gives the same result each time.
TEST(FusedExpertsRepeated, CallsReuseTheTileCounters) {
  MOELORA_SKIP_UNLESS_AVAILABLE(Backend::kCUDA);
  static const MoeKernelConfig kWgmma{128, {GemmKernel::kSm90, 64, 256}, {GemmKernel::kSm90, 128, 128}};
#ifdef MOELORA_WITH_CUDA
  if (!cuda::current_device_facts().sm90_kernels) GTEST_SKIP() << "wgmma tiles need an sm_90 device";
#endif
  LayerCase c;
  c.backend = Backend::kCUDA;
  c.M = 500;
  c.top_k = 4;
  c.num_global = c.num_local = 16;
  c.options.config = &kWgmma;
  c.options.chunk_size = 200;
  std::mt19937 rng(907);
  LayerProblem problem(c, rng);
  const std::vector<double> expected = problem.reference(c);
  TestStream stream(c.backend);
  for (int call = 0; call < 3; ++call) {
    problem.out.poison();
    fused_experts(problem.args, c.options, stream.handle());
    stream.sync();
    problem.out.download();
    EXPECT_LE(ref::rel_error(problem.out.read(problem.out_view), expected), ref::tolerance(c.dtype)) << "call " << call;
    EXPECT_EQ(problem.out.count_unwritten(problem.out_view), 0) << "call " << call;
  }
}

// The block size a chunk uses never needs more workspace than the query reported, for
// any chunk count; and a larger workspace is fine.
TEST_P(FusedExpertsBackendTest, WorkspaceQueryCoversEveryChunk) {
  for (int64_t chunk_size : {int64_t(1), int64_t(7), int64_t(64 * 1024)}) {
    FusedExpertsOptions options;
    options.chunk_size = chunk_size;
    const int64_t bytes = fused_experts_workspace_size({300, 8, 128, 2048, 768, DType::kBFloat16}, options);
    EXPECT_GT(bytes, 0);
    const int64_t block_size = fused_experts_block_size(std::min<int64_t>(300, chunk_size), 8, 128, options);
    EXPECT_GE(block_size, 16);
    EXPECT_LE(block_size, 256);
    EXPECT_EQ(block_size % 16, 0);
  }
}

// The sorted input ([padded entries, H]) is reserved only for configs that may use it: it
// can exceed the [slots, max(2I, H)] region it shares (here H > 2I), by up to 255 rows
// per expert.
TEST(FusedExpertsWorkspace, SortedInputIsReservedOnlyWhenTheConfigAsksForIt) {
  const FusedExpertsShape shape{1024, 8, 128, 2048, 768, DType::kBFloat16};
  MoeKernelConfig config{128, {GemmKernel::kSm90, 128, 256}, {GemmKernel::kSm90, 128, 256}};
  FusedExpertsOptions options;
  options.config = &config;
  const int64_t gathered = fused_experts_workspace_size(shape, options);
  config.sorted_input = true;
  const int64_t sorted = fused_experts_workspace_size(shape, options);
  // 8192 slots + at most 129 x 127 padding rows (block size 128), each of H = 2048 bf16.
  EXPECT_GT(sorted, gathered);
  EXPECT_LE(sorted - gathered, (129 * 127 + 256) * 2048 * 2);
  // Below 512 slots nothing is sorted: no room reserved.
  const FusedExpertsShape small{63, 8, 128, 2048, 768, DType::kBFloat16};
  const int64_t small_sorted = fused_experts_workspace_size(small, options);
  config.sorted_input = false;
  EXPECT_EQ(small_sorted, fused_experts_workspace_size(small, options));
}

// On the CPU an id out of range anywhere, even in the last chunk, is an error before any
// chunk writes the output.
TEST_P(FusedExpertsBackendTest, RejectsOutOfRangeIdBeforeWriting) {
  if (backend() != Backend::kCPU) GTEST_SKIP() << "the CUDA backend cannot read ids on the host";
  LayerCase c;
  c.backend = backend();
  c.options.chunk_size = 7;
  std::mt19937 rng(701);
  LayerProblem problem(c, rng);
  problem.topk_ids.set(problem.ids_view.strides[0] * 19 + 1, 8);  // E = 8: one past the last expert
  const std::string message = error_message([&] { fused_experts(problem.args, c.options); });
  EXPECT_THAT(message, HasSubstr("'topk_ids'"));
  EXPECT_THAT(message, HasSubstr("[19, 1]"));
  EXPECT_EQ(problem.out.count_written(), 0);
}

TEST_P(FusedExpertsBackendTest, RejectsBadArguments) {
  float any_storage[4] = {0, 0, 0, 0};
  struct BadCase {
    std::string what, argument;
    std::function<void(FusedExpertsArgs&, FusedExpertsOptions&, LayerProblem&)> breaks;
    bool cpu_only = false;  // needs ids readable on the host
  };
  Buffer other_dtype(backend(), DType::kFloat16, 8 * 80 * 136);
  const std::vector<BadCase> bad_cases = {
      {"rank 3 hidden_states", "hidden_states",
       [](auto& a, auto&, auto&) {
         a.hidden_states.rank = 3;
         a.hidden_states.shape[2] = 1;
         a.hidden_states.strides[2] = 1;
       }},
      {"rank above kMaxRank", "hidden_states", [](auto& a, auto&, auto&) { a.hidden_states.rank = kMaxRank + 1; }},
      {"int32 hidden_states", "hidden_states", [](auto& a, auto&, auto&) { a.hidden_states.dtype = DType::kInt32; }},
      {"null hidden_states", "hidden_states", [](auto& a, auto&, auto&) { a.hidden_states.data = nullptr; }},
      {"w13 of another dtype", "w13", [&](auto& a, auto&, auto&) { a.w13 = other_dtype.view({8, 80, 136}); }},
      {"w13 odd rows", "w13", [](auto& a, auto&, auto&) { a.w13.shape[1] = 79; }},
      {"w13 of another hidden size", "w13", [](auto& a, auto&, auto&) { a.w13.shape[2] = 135; }},
      {"w13 negative stride", "w13", [](auto& a, auto&, auto&) { a.w13.strides[2] = -1; }},
      {"w2 of another intermediate size", "w2", [](auto& a, auto&, auto&) { a.w2.shape[2] = 39; }},
      {"w2 of other experts", "w2", [](auto& a, auto&, auto&) { a.w2.shape[0] = 7; }},
      {"w2 on another device", "w2",
       [&](auto& a, auto&, auto&) { a.w2.device = other_device(backend()); a.w2.data = any_storage; }},
      {"bf16 topk_weights", "topk_weights", [](auto& a, auto&, auto&) { a.topk_weights.dtype = DType::kBFloat16; }},
      {"topk_weights of another top_k", "topk_weights", [](auto& a, auto&, auto&) { a.topk_weights.shape[1] = 1; }},
      {"topk_ids of other tokens", "topk_ids", [](auto& a, auto&, auto&) { a.topk_ids.shape[0] = 19; }},
      {"float topk_ids", "topk_ids", [](auto& a, auto&, auto&) { a.topk_ids.dtype = DType::kFloat32; }},
      {"topk_ids on another device", "topk_ids",
       [&](auto& a, auto&, auto&) { a.topk_ids.device = other_device(backend()); a.topk_ids.data = any_storage; }},
      {"out of another hidden size", "out", [](auto& a, auto&, auto&) { a.out.shape[1] = 135; }},
      {"out negative stride", "out", [](auto& a, auto&, auto&) { a.out.strides[0] = -136; }},
      {"no_combine with a 2-D out", "out", [](auto&, auto& o, auto&) { o.no_combine = true; }},
      {"out overlapping w2", "out", [](auto& a, auto&, auto&) { a.out.data = a.w2.data; }},
      {"workspace too small", "workspace", [](auto& a, auto&, auto&) { a.workspace.shape[0] -= 1; }},
      {"workspace unaligned", "workspace",
       [](auto& a, auto&, auto&) { a.workspace.data = static_cast<char*>(a.workspace.data) + 4; }},
      {"chunk_size 0", "chunk_size", [](auto&, auto& o, auto&) { o.chunk_size = 0; }},
      {"block_size 40", "block_size", [](auto&, auto& o, auto&) { o.block_size = 40; }},
      {"block_size 512", "block_size", [](auto&, auto& o, auto&) { o.block_size = 512; }},
      {"config tile taller than its block", "config.gemm1",
       [](auto&, auto& o, auto&) {
         static const MoeKernelConfig bad{16, {GemmKernel::kSm80, 32, 64}, {}};
         o.config = &bad;
       }},
      {"config sm90 tile 64 x 64", "config.gemm2",
       [](auto&, auto& o, auto&) {
         static const MoeKernelConfig bad{64, {}, {GemmKernel::kSm90, 64, 64}};
         o.config = &bad;
       }},
      {"config tiles without a block size", "config",
       [](auto&, auto& o, auto&) {
         static const MoeKernelConfig bad{0, {GemmKernel::kSm80, 16, 64}, {}};
         o.config = &bad;
       }},
      {"config block size 24", "config",
       [](auto&, auto& o, auto&) {
         static const MoeKernelConfig bad{24, {}, {}};
         o.config = &bad;
       }},
      {"config grouped tiles out of range", "config.grouped_tiles2",
       [](auto&, auto& o, auto&) {
         static const MoeKernelConfig bad{.block_size = 16, .grouped_tiles2 = static_cast<GroupedGemmTiles>(3)};
         o.config = &bad;
       }},
      {"swiglu limit 0", "swiglu_limit",
       [](auto&, auto& o, auto&) {
         o.activation = Activation::kSwigluOai;
         o.swiglu_limit = 0.0f;
       }},
      {"expert_map of int64", "expert_map",
       [](auto& a, auto&, auto& p) {
         p.map_view.dtype = DType::kInt64;
         p.map_view.shape[0] /= 2;
         a.expert_map = &p.map_view;
       }},
      {"expert_map past the local experts", "expert_map",
       [](auto& a, auto&, auto& p) {
         p.expert_map.set(3, 8);  // w13 has 8 experts
         a.expert_map = &p.map_view;
       },
       true},
  };
  for (const BadCase& bad : bad_cases) {
    if (bad.cpu_only && backend() != Backend::kCPU) continue;
    SCOPED_TRACE(bad.what);
    LayerCase c;
    c.backend = backend();
    std::mt19937 rng(702);
    LayerProblem problem(c, rng);
    FusedExpertsArgs args = problem.args;
    FusedExpertsOptions options = c.options;
    bad.breaks(args, options, problem);
    TestStream stream(backend());
    const std::string message = error_message([&] { fused_experts(args, options, stream.handle()); });
    EXPECT_THAT(message, HasSubstr(quoted(bad.argument)));
    stream.sync();
    problem.out.download();
    EXPECT_EQ(problem.out.count_written(), 0);
  }
}

// An empty batch may arrive with any strides (DLPack exporters report 0 for empty
// arrays; seen with nanobind 3.1): it is accepted and nothing runs.
TEST(FusedExpertsEmpty, EmptyViewsWithZeroStridesAreAccepted) {
  const int64_t E = 2, top_k = 2, H = 16, I = 8;
  std::vector<float> w13(E * 2 * I * H, 0.5f), w2(E * H * I, 0.5f), one(1);
  std::vector<int32_t> ids(1);
  std::vector<uint64_t> workspace(1024);
  auto empty = [](void* data, DType dtype, std::initializer_list<int64_t> shape) {
    TensorView t = TensorView::contiguous(data, dtype, shape);
    for (int d = 0; d < t.rank; ++d) t.strides[d] = 0;
    return t;
  };
  FusedExpertsArgs args{
      .hidden_states = empty(one.data(), DType::kFloat32, {0, H}),
      .w13 = TensorView::contiguous(w13.data(), DType::kFloat32, {E, 2 * I, H}),
      .w2 = TensorView::contiguous(w2.data(), DType::kFloat32, {E, H, I}),
      .topk_weights = empty(one.data(), DType::kFloat32, {0, top_k}),
      .topk_ids = empty(ids.data(), DType::kInt32, {0, top_k}),
      .out = empty(one.data() , DType::kFloat32, {0, H}),
      .workspace = TensorView::contiguous(
          reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(workspace.data()) + 255) / 256 * 256), DType::kInt32,
          {1024}),
  };
  args.out.data = nullptr;  // no elements: no pointer needed
  EXPECT_NO_THROW(fused_experts(args));
  FusedExpertsOptions no_combine;
  no_combine.no_combine = true;
  args.out = empty(nullptr, DType::kFloat32, {0, top_k, H});
  EXPECT_NO_THROW(fused_experts(args, no_combine));
}

INSTANTIATE_TEST_SUITE_P(Backends, FusedExpertsBackendTest, ::testing::ValuesIn(all_backends()),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

}  // namespace
}  // namespace moelora::test
