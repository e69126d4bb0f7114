// fused_experts' per-backend checks: repeated calls on one workspace, the workspace
// query, the sorted-input reservation, ids out of range, bad arguments with the argument
// named, empty views (the layer against its reference: test_fused_experts.cpp).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#ifdef MOELORA_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "common/params.h"
#include "fused_experts_testing.h"
#include "test_util.h"

namespace moelora::test {
namespace {

using ::testing::HasSubstr;

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
  // Caller configs check_kernel_config refuses, and a case setting one.
  static const MoeKernelConfig kTileTallerThanBlock{16, {GemmKernel::kSm80, 32, 64}, {}};
  static const MoeKernelConfig kSm90Tile64x64{64, {}, {GemmKernel::kSm90, 64, 64}};
  static const MoeKernelConfig kTilesWithoutBlockSize{0, {GemmKernel::kSm80, 16, 64}, {}};
  static const MoeKernelConfig kBlockSize24{24, {}, {}};
  static const MoeKernelConfig kGroupedTilesOutOfRange{.block_size = 16,
                                                       .grouped_tiles2 = static_cast<GroupedGemmTiles>(4)};
  auto with_config = [](const MoeKernelConfig& config) {
    return [&config](FusedExpertsArgs&, FusedExpertsOptions& o, LayerProblem&) { o.config = &config; };
  };
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
      // Found by the fuzzer (issue 33): an in-place out over expert_map sent the CPU
      // backend's second chunk to a garbage expert; every read tensor is checked now.
      {"out over topk_weights", "out", [](auto& a, auto&, auto&) { a.topk_weights.data = a.out.data; }},
      {"workspace over topk_weights", "workspace",
       [](auto& a, auto&, auto&) { a.topk_weights.data = a.workspace.data; }},
      {"workspace too small", "workspace", [](auto& a, auto&, auto&) { a.workspace.shape[0] -= 1; }},
      {"workspace unaligned", "workspace",
       [](auto& a, auto&, auto&) { a.workspace.data = static_cast<char*>(a.workspace.data) + 4; }},
      {"chunk_size 0", "chunk_size", [](auto&, auto& o, auto&) { o.chunk_size = 0; }},
      {"block_size 40", "block_size", [](auto&, auto& o, auto&) { o.block_size = 40; }},
      {"block_size 512", "block_size", [](auto&, auto& o, auto&) { o.block_size = 512; }},
      {"config tile taller than its block", "config.gemm1", with_config(kTileTallerThanBlock)},
      {"config sm90 tile 64 x 64", "config.gemm2", with_config(kSm90Tile64x64)},
      {"config tiles without a block size", "config", with_config(kTilesWithoutBlockSize)},
      {"config block size 24", "config", with_config(kBlockSize24)},
      {"config grouped tiles out of range", "config.grouped_tiles2", with_config(kGroupedTilesOutOfRange)},
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

// The size queries check the shape and options they are given (found by the fuzzer,
// issue 33: top_k 0 divided by zero, huge sizes overflowed the byte counts).
TEST(FusedExpertsWorkspace, QueriesRejectOutOfRangeShapesAndOptions) {
  const FusedExpertsShape good{16, 2, 8, 64, 32, DType::kBFloat16};
  ASSERT_GT(fused_experts_workspace_size(good), 0);
  struct Bad {
    const char* argument;
    std::function<void(FusedExpertsShape&, FusedExpertsOptions&)> edit;
  };
  const std::vector<Bad> bad = {
      {"'num_tokens'", [](FusedExpertsShape& s, FusedExpertsOptions&) { s.num_tokens = -1; }},
      {"'num_tokens'", [](FusedExpertsShape& s, FusedExpertsOptions&) { s.num_tokens = int64_t(1) << 30; s.top_k = 8; }},
      {"'top_k'", [](FusedExpertsShape& s, FusedExpertsOptions&) { s.top_k = 0; }},
      {"'num_experts'", [](FusedExpertsShape& s, FusedExpertsOptions&) { s.num_experts = 0; }},
      {"'num_local_experts'", [](FusedExpertsShape& s, FusedExpertsOptions&) { s.num_local_experts = -2; }},
      {"'hidden_size'", [](FusedExpertsShape& s, FusedExpertsOptions&) { s.hidden_size = int64_t(1) << 40; }},
      {"'intermediate_size'", [](FusedExpertsShape& s, FusedExpertsOptions&) { s.intermediate_size = 0; }},
      {"'dtype'", [](FusedExpertsShape& s, FusedExpertsOptions&) { s.dtype = DType::kInt32; }},
      {"'max_loras'", [](FusedExpertsShape& s, FusedExpertsOptions&) { s.max_loras = kMaxLoraAdapters + 1; }},
      {"'lora_rank'", [](FusedExpertsShape& s, FusedExpertsOptions&) { s.max_loras = 2; s.lora_rank = 0; }},
      {"'chunk_size'", [](FusedExpertsShape&, FusedExpertsOptions& o) { o.chunk_size = 0; }},
      {"'block_size'", [](FusedExpertsShape&, FusedExpertsOptions& o) { o.block_size = 24; }},
      {"'activation'", [](FusedExpertsShape&, FusedExpertsOptions& o) { o.activation = static_cast<Activation>(7); }},
      {"'weight_only_path'",
       [](FusedExpertsShape&, FusedExpertsOptions& o) { o.weight_only_path = static_cast<WeightOnlyPath>(9); }},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.argument);
    FusedExpertsShape s = good;
    FusedExpertsOptions o;
    b.edit(s, o);
    EXPECT_THAT(error_message([&] { fused_experts_workspace_size(s, o); }), HasSubstr(b.argument));
  }
  EXPECT_THAT(error_message([] { fused_experts_block_size(-1, 2, 8); }), HasSubstr("'num_tokens'"));
  EXPECT_THAT(error_message([] { fused_experts_block_size(4, 0, 8); }), HasSubstr("'top_k'"));
  EXPECT_THAT(error_message([] { fused_experts_block_size(4, 2, 0); }), HasSubstr("'num_experts'"));
  EXPECT_THAT(error_message([] { fused_moe_lora_workspace_size(16, 3, 8, DType::kBFloat16); }),
              HasSubstr("'num_slices'"));
  EXPECT_THAT(error_message([] { fused_moe_lora_workspace_size(16, 2, 0, DType::kBFloat16); }), HasSubstr("'rank'"));
  EXPECT_THAT(error_message([] { fused_moe_lora_workspace_size(int64_t(1) << 40, 2, 8, DType::kBFloat16); }),
              HasSubstr("'num_slots'"));
  EXPECT_THAT(error_message([] { fused_moe_lora_workspace_size(16, 2, 8, DType::kInt32); }), HasSubstr("'dtype'"));
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

// ---- the routing status word (issue 33) ---------------------------------------------

// A status word of the wrong dtype, size or rank, or one over an output, is refused by name
// before anything is written.
TEST_P(FusedExpertsBackendTest, RoutingStatusArgumentIsChecked) {
  LayerCase c;
  c.backend = backend();
  std::mt19937 rng(811);
  LayerProblem problem(c, rng);
  Buffer words_f32(backend(), DType::kFloat32, 2), words(backend(), DType::kInt32, 2);
  TensorView over_out = problem.out_view;
  over_out.dtype = DType::kInt32;
  over_out.rank = 1;
  over_out.shape[0] = 1;
  over_out.strides[0] = 1;
  const std::vector<std::pair<std::string, TensorView>> bad = {
      {"float32", words_f32.view({1})}, {"two words", words.view({2})}, {"rank 2", words.view({1, 1})},
      {"over out", over_out}};
  for (const auto& [what, view] : bad) {
    FusedExpertsArgs args = problem.args;
    args.routing_status = &view;
    problem.out.poison();
    problem.out.upload();
    EXPECT_THAT(error_message([&] { fused_experts(args, c.options); }), HasSubstr("'routing_status'")) << what;
    problem.out.download();
    EXPECT_EQ(problem.out.count_written(), 0) << what;
  }
}

#ifdef MOELORA_WITH_CUDA
// On CUDA an id the kernels cannot use drops its slot, as -1 does, and sets a bit of the
// status word when one is passed: on the small-batch kernels (M = 4) and the aligned path
// (M = 300); bits are OR'ed into what the word held; valid routing (with -1) sets none.
class FusedExpertsRoutingStatus : public ::testing::TestWithParam<int64_t> {};

// A CUDA layer problem whose call passes a routing status word (not copyable: args points
// at word_view, and problem.args at problem's buffers).
struct WordedProblem {
  WordedProblem(const LayerCase& c, std::mt19937& rng) : problem(c, rng), args(problem.args) {
    args.routing_status = &word_view;
  }
  WordedProblem(const WordedProblem&) = delete;
  WordedProblem& operator=(const WordedProblem&) = delete;
  LayerProblem problem;
  Buffer word{Backend::kCUDA, DType::kInt32, 1};
  const TensorView word_view = word.view({1});
  FusedExpertsArgs args;
};

TEST_P(FusedExpertsRoutingStatus, BadIdsSetBitsAndDropTheirSlots) {
  MOELORA_SKIP_UNLESS_AVAILABLE(Backend::kCUDA);
  LayerCase c;
  c.backend = Backend::kCUDA;
  c.M = GetParam();
  c.num_global = 12;
  c.num_local = 8;
  c.expert_map = true;
  c.dropped_share = 0.1;
  std::mt19937 rng(823);
  WordedProblem worded(c, rng);
  LayerProblem& problem = worded.problem;
  Buffer& word = worded.word;
  const FusedExpertsArgs& args = worded.args;
  TestStream stream(Backend::kCUDA);
  auto run = [&](int32_t held) {
    word.set(0, held);
    word.upload();
    problem.out.poison();
    problem.out.upload();
    fused_experts(args, c.options, stream.handle());
    stream.sync();
    word.download();
    problem.out.download();
    return int32_t(word.get(0));
  };
  const std::vector<double> expected_valid = problem.reference(c);
  EXPECT_EQ(run(0), 0) << "valid routing";
  EXPECT_LE(ref::rel_error(problem.out.read(problem.out_view), expected_valid), ref::tolerance(c.dtype));

  // Two slots with ids past every expert and below -1: dropped, as the reference's -1.
  const int64_t bad_past = 3 * problem.ids_row_stride + 1, bad_below = 1 * problem.ids_row_stride;
  problem.ids[size_t(3 * c.top_k + 1)] = -1;
  problem.ids[size_t(1 * c.top_k)] = -1;
  const std::vector<double> expected_dropped = problem.reference(c);
  problem.topk_ids.set(bad_past, double(c.num_global + 3));
  problem.topk_ids.set(bad_below, -7);
  problem.topk_ids.upload();
  EXPECT_EQ(run(0), kRoutingBadExpertId);
  EXPECT_LE(ref::rel_error(problem.out.read(problem.out_view), expected_dropped), ref::tolerance(c.dtype));
  EXPECT_EQ(run(64), 64 | kRoutingBadExpertId) << "bits are OR'ed";
  problem.topk_ids.set(bad_past, -1);
  problem.topk_ids.set(bad_below, -1);
  problem.topk_ids.upload();
  EXPECT_EQ(run(0), 0) << "the same slots dropped with -1";

  // An expert_map value past the local experts, on a global expert that is not local.
  int64_t remote = 0;
  while (problem.map[size_t(remote)] >= 0) ++remote;
  problem.expert_map.set(remote, double(c.num_local + 5));
  problem.expert_map.upload();
  EXPECT_EQ(run(0) & kRoutingBadExpertMap, kRoutingBadExpertMap);
}
INSTANTIATE_TEST_SUITE_P(Tokens, FusedExpertsRoutingStatus, ::testing::Values(4, 300));

// The word set from a captured CUDA graph: replays with bad and then valid ids.
TEST(FusedExpertsRoutingStatusGraph, ReplaysReportEachRouting) {
  MOELORA_SKIP_UNLESS_AVAILABLE(Backend::kCUDA);
  for (int64_t M : {4, 300}) {
    LayerCase c;
    c.backend = Backend::kCUDA;
    c.M = M;
    std::mt19937 rng(829);
    WordedProblem worded(c, rng);
    LayerProblem& problem = worded.problem;
    Buffer& word = worded.word;
    const FusedExpertsArgs& args = worded.args;
    TestStream stream(Backend::kCUDA);
    cudaStream_t s = static_cast<cudaStream_t>(stream.handle());
    fused_experts(args, c.options, stream.handle());  // warm-up outside the capture
    stream.sync();
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOELORA_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    MOELORA_CUDA_CHECK(cudaMemsetAsync(worded.word_view.data, 0, sizeof(int32_t), s));
    fused_experts(args, c.options, stream.handle());
    MOELORA_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (bool bad : {true, false, true}) {
      problem.topk_ids.set(2 * problem.ids_row_stride, bad ? double(c.num_global) : 0.0);
      problem.topk_ids.upload();
      MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, s));
      stream.sync();
      word.download();
      EXPECT_EQ(int32_t(word.get(0)), bad ? kRoutingBadExpertId : 0) << "M " << M << (bad ? " bad" : " valid");
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}
#endif

INSTANTIATE_TEST_SUITE_P(Backends, FusedExpertsBackendTest, ::testing::ValuesIn(all_backends()),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

}  // namespace
}  // namespace moelora::test
