// fused_moe: the grouped expert GEMM, against the float64 reference_moe_gemm.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/params.h"
#include "test_util.h"

namespace moelora::test {
namespace {

using ::testing::HasSubstr;

// How the tensors are laid out in memory.
enum class Layout {
  kContiguous,
  kPadded,       // a: every other row (+ pad), w: padded rows and experts, out: padding columns
                 // that must keep their poison, topk_weights: padded rows
  kTransposedW,  // w stored [E, K, N] and viewed as [E, N, K]; a with column stride 2
  kOddOutRows,   // a and w contiguous (tensor-core loadable); out rows N + 5 apart, so the
                 // wgmma epilogue cannot store column pairs as one word
};

struct GemmCase {
  std::string name;
  Backend backend;
  DType dtype;
  int64_t M, top_k, E, N, K, block_size;
  bool per_slot_a;         // a holds one row per slot and the call's top_k is 1 (GEMM2 of the layer)
  bool mul_routed_weight;
  Layout layout;
  double dropped_share;    // share of slots routed to -1
  bool expert_map;         // ids are global over 2E experts, every other one on this rank
  double weight_scale;     // 0: 1/sqrt(K)
  GemmTile tile{};         // kAuto: the launcher's heuristic
};

const char* kernel_name(GemmKernel k) {
  return k == GemmKernel::kSm80 ? "sm80" : k == GemmKernel::kSm90 ? "sm90" : "auto";
}

void PrintTo(const GemmCase& c, std::ostream* os) { *os << c.name; }

std::string case_name(const GemmCase& c) {
  const std::string tile = c.tile.kernel == GemmKernel::kAuto
                               ? std::string()
                               : std::string("_") + kernel_name(c.tile.kernel) + "_" + std::to_string(c.tile.block_m) +
                                     "x" + std::to_string(c.tile.block_n) +
                                     (c.tile.cluster_m > 1 ? "_cluster" + std::to_string(c.tile.cluster_m) : "");
  return std::string(backend_name(c.backend)) + "_" + dtype_short_name(c.dtype) + "_" + c.name + "_M" +
         std::to_string(c.M) + "_bs" + std::to_string(c.block_size) + tile;
}

// The storage and views of one fused_moe call; ids, alignment and inputs are filled and
// uploaded, out is poisoned.
struct GemmProblem {
  GemmProblem(const GemmCase& c, std::mt19937& rng)
      : num_slots(c.M * c.top_k),
        num_rows(c.per_slot_a ? num_slots : c.M),
        a(c.backend, c.dtype, std::max<int64_t>(1, num_rows * (c.layout == Layout::kContiguous ? c.K : 2 * c.K + 3))),
        w(c.backend, c.dtype, c.E * (c.layout == Layout::kPadded ? c.N * (c.K + 8) + 16 : c.N * c.K)),
        out(c.backend, c.dtype,
            std::max<int64_t>(1, num_slots * (c.layout == Layout::kPadded || c.layout == Layout::kOddOutRows ? c.N + 5
                                                                                                              : c.N))),
        topk_weights(c.backend, DType::kFloat32, std::max<int64_t>(1, c.M * (c.top_k + 1))) {
    // routing: global ids, a share of them dropped; with expert_map, odd experts are remote
    const int64_t num_global = c.expert_map ? 2 * c.E : c.E;
    topk_ids = random_routing(c.M, c.top_k, num_global, rng);
    std::bernoulli_distribution drop(c.dropped_share);
    for (auto& id : topk_ids) id = drop(rng) ? -1 : id;
    if (c.expert_map) {
      for (int64_t e = 0; e < num_global; ++e) map.push_back(e % 2 == 0 ? int32_t(e / 2) : -1);
    }
    slot_expert.resize(size_t(num_slots));
    for (int64_t s = 0; s < num_slots; ++s) {
      const int64_t id = topk_ids[size_t(s)];
      slot_expert[size_t(s)] = id == -1 ? -1 : c.expert_map ? map[size_t(id)] : id;
    }

    // alignment through the public op (tested on its own in test_moe_align_block_size.cpp)
    const AlignCapacity cap = moe_align_block_size_capacity(num_slots, c.block_size, num_global);
    ids_buffer = std::make_unique<Buffer>(buffer_with(c.backend, DType::kInt32, {topk_ids.begin(), topk_ids.end()}));
    map_buffer = std::make_unique<Buffer>(buffer_with(c.backend, DType::kInt32, {map.begin(), map.end()}));
    sorted_token_ids = std::make_unique<Buffer>(c.backend, DType::kInt32, cap.max_num_tokens_padded);
    expert_ids = std::make_unique<Buffer>(c.backend, DType::kInt32, cap.max_num_blocks);
    num_tokens_post_padded = std::make_unique<Buffer>(c.backend, DType::kInt32, 1);
    const TensorView map_view = map_buffer->view({int64_t(map.size())});
    TestStream stream(c.backend);
    moe_align_block_size(ids_buffer->view({c.M, c.top_k}), c.block_size, num_global,
                         c.expert_map ? &map_view : nullptr, sorted_token_ids->view({cap.max_num_tokens_padded}),
                         expert_ids->view({cap.max_num_blocks}), num_tokens_post_padded->view({1}), stream.handle());
    stream.sync();

    // inputs
    const double scale = c.weight_scale > 0 ? c.weight_scale : 1.0 / std::sqrt(double(c.K));
    switch (c.layout) {
      case Layout::kContiguous:
        a_view = a.view({num_rows, c.K});
        w_view = w.view({c.E, c.N, c.K});
        out_view = out.view({num_slots, c.N});
        break;
      case Layout::kPadded:
        a_view = a.view({num_rows, c.K}, {2 * c.K + 3, 1}, c.K + 1);
        w_view = w.view({c.E, c.N, c.K}, {c.N * (c.K + 8) + 16, c.K + 8, 1}, 5);
        out_view = out.view({num_slots, c.N}, {c.N + 5, 1}, 2);
        break;
      case Layout::kOddOutRows:
        a_view = a.view({num_rows, c.K});
        w_view = w.view({c.E, c.N, c.K});
        out_view = out.view({num_slots, c.N}, {c.N + 5, 1}, 2);
        break;
      case Layout::kTransposedW:
        a_view = a.view({num_rows, c.K}, {2 * c.K + 3, 2});
        w_view = w.view({c.E, c.N, c.K}, {c.N * c.K, 1, c.N});
        out_view = out.view({num_slots, c.N});
        break;
    }
    a_values = a.fill_normal(a_view, rng);
    w_values = w.fill_normal(w_view, rng, scale);
    a.upload();
    w.upload();
    weights_view = c.layout == Layout::kPadded ? topk_weights.view({c.M, c.top_k}, {c.top_k + 1, 1})
                                               : topk_weights.view({c.M, c.top_k});
    weight_values = random_router_weights(c.M, c.top_k, rng);
    topk_weights.write(weights_view, weight_values);
    topk_weights.upload();
    out.poison();

    args.a = a_view;
    args.w = w_view;
    args.out = out_view;
    args.sorted_token_ids = sorted_token_ids->view({cap.max_num_tokens_padded});
    args.expert_ids = expert_ids->view({cap.max_num_blocks});
    args.num_tokens_post_padded = num_tokens_post_padded->view({1});
    args.topk_weights = c.mul_routed_weight ? &weights_view : nullptr;
    args.mul_routed_weight = c.mul_routed_weight;
    args.top_k = c.per_slot_a ? 1 : c.top_k;
    args.block_size = c.block_size;
    args.tile = c.tile;
  }

  std::vector<double> reference(const GemmCase& c) const {
    const double* slot_weight = c.mul_routed_weight ? weight_values.data() : nullptr;
    return ref::reference_moe_gemm(a_values, w_values, slot_expert, slot_weight, num_rows, c.per_slot_a ? 1 : c.top_k,
                                   c.N, c.K);
  }

  int64_t num_slots, num_rows;
  std::vector<int64_t> topk_ids, slot_expert;
  std::vector<int32_t> map;
  Buffer a, w, out, topk_weights;
  std::unique_ptr<Buffer> ids_buffer, map_buffer, sorted_token_ids, expert_ids, num_tokens_post_padded;
  TensorView a_view, w_view, out_view, weights_view;
  std::vector<double> a_values, w_values, weight_values;
  FusedMoeArgs args;
};

// One fused_moe call on fresh data (seeded), against the float64 reference.
void expect_call_matches_reference(const GemmCase& c, size_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  GemmProblem problem(c, rng);
  TestStream stream(c.backend);
  fused_moe(problem.args, stream.handle());
  stream.sync();
  problem.out.download();
  const std::vector<double> got = problem.out.read(problem.out_view);
  EXPECT_LE(ref::rel_error(got, problem.reference(c)), ref::tolerance(c.dtype));
  // every slot sits in some block (dropped and remote ones in -1 blocks, written as zeros)
  EXPECT_EQ(problem.out.count_unwritten(problem.out_view), 0);
  EXPECT_EQ(problem.out.count_written_outside(problem.out_view), 0);
}

class FusedMoeTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(FusedMoeTest, MatchesReference) {
  const GemmCase& c = GetParam();
  MOELORA_SKIP_UNLESS_AVAILABLE(c.backend);
#ifdef MOELORA_WITH_CUDA
  if (c.tile.kernel == GemmKernel::kSm90 && !cuda::current_device_facts().sm90_kernels) {
    GTEST_SKIP() << "wgmma tiles need an sm_90 device";
  }
#endif
  expect_call_matches_reference(c, std::hash<std::string>{}(c.name));
}

std::vector<GemmCase> gemm_cases() {
  std::vector<GemmCase> cases;
  auto add = [&](GemmCase c, const std::vector<Backend>& backends = all_backends()) {
    for (Backend backend : backends) {
      c.backend = backend;
      cases.push_back(c);
    }
  };
  const DType bf16 = DType::kBFloat16, fp16 = DType::kFloat16, fp32 = DType::kFloat32;
  const Layout contiguous = Layout::kContiguous, padded = Layout::kPadded, transposed = Layout::kTransposedW;

  // The brief's models, both GEMMs of the layer, with fewer experts (the weights of every
  // expert of the big models do not fit a quick CPU test). GEMM1: K = H, N = 2I, rows
  // gathered per token; GEMM2: K = I, N = H, one row per slot, routed weights applied.
  struct Model { const char* name; int64_t E, top_k, H, I; };
  const Model models[] = {{"mixtral", 8, 2, 4096, 14336},    {"qwen3_30b", 128, 8, 2048, 768},
                          {"qwen3_235b", 128, 8, 4096, 1536}, {"deepseek_v3_tp8", 256, 8, 7168, 256},
                          {"olmoe", 64, 8, 2048, 1024},       {"gpt_oss", 128, 4, 2880, 2880}};
  for (const Model& m : models) {
    const int64_t E = m.top_k;  // the experts every token routes to: each one sees every token
    const bool big = m.H * m.I > 8'000'000;
    for (int64_t M : {1, 16}) {
      if (big && M > 1) continue;
      // NOTE: mixtral's GEMMs run on the CPU in test_fused_experts.cpp (one token); here
      // its 235M-element weights would double the CPU suite's time.
      const std::vector<Backend> backends =
          m.I > 8192 ? std::vector<Backend>{Backend::kCUDA} : all_backends();
      add({std::string(m.name) + "_gemm1", {}, bf16, M, m.top_k, E, 2 * m.I, m.H, 16, false, false, contiguous, 0.0,
           false, 0.02},
          backends);
      add({std::string(m.name) + "_gemm2", {}, bf16, M, m.top_k, E, m.H, m.I, 16, true, true, contiguous, 0.0, false,
           0.02},
          backends);
    }
  }
  // M = 64 over 128 experts: the sparse routing of a real layer (few slots per expert,
  // many partly filled blocks), on narrow weights.
  add({"E128_topk8_N136_K64", {}, bf16, 64, 8, 128, 136, 64, 16, false, true, contiguous, 0.0, false, 0.0});
  add({"E128_topk8_N136_K64_per_slot", {}, bf16, 64, 8, 128, 136, 64, 64, true, true, contiguous, 0.0, false, 0.0});

  // block sizes over a shape with odd N and K
  for (int64_t bs : {16, 32, 48, 64, 128, 256}) {
    add({"E16_topk4_N40_K24", {}, bf16, 37, 4, 16, 40, 24, bs, false, true, contiguous, 0.0, false, 0.0});
  }
  for (DType dtype : {bf16, fp16, fp32}) {
    add({"odd_K19_N33", {}, dtype, 21, 2, 6, 33, 19, 16, false, false, contiguous, 0.0, false, 0.0});
    add({"K2880_N2880", {}, dtype, 3, 2, 4, 2880, 2880, 32, false, true, contiguous, 0.0, false, 0.0});
    add({"padded", {}, dtype, 19, 3, 8, 72, 56, 16, false, true, padded, 0.2, false, 0.0});
    add({"padded_per_slot", {}, dtype, 11, 4, 8, 40, 24, 32, true, true, padded, 0.0, false, 0.0});
    add({"transposed_w", {}, dtype, 13, 2, 4, 24, 40, 16, false, false, transposed, 0.0, false, 0.0});
  }
  add({"dropped_and_expert_map", {}, bf16, 40, 4, 8, 64, 48, 16, false, true, contiguous, 0.3, true, 0.0});
  add({"expert_map_per_slot", {}, fp16, 25, 2, 4, 24, 64, 64, true, true, padded, 0.1, true, 0.0});
  add({"all_dropped", {}, bf16, 9, 2, 4, 32, 32, 16, false, false, contiguous, 1.0, false, 0.0});
  add({"M0", {}, bf16, 0, 2, 4, 32, 32, 16, false, true, contiguous, 0.0, false, 0.0});
  add({"M1_topk1", {}, fp32, 1, 1, 3, 40, 24, 16, false, false, contiguous, 0.0, false, 0.0});
  add({"topk1_E1", {}, bf16, 50, 1, 1, 48, 32, 16, false, true, padded, 0.0, false, 0.0});
  // K = 0: every output is zero (no weight tensor map can describe an empty K).
  for (GemmTile t : {GemmTile{}, GemmTile{GemmKernel::kSm80, 16, 64}, GemmTile{GemmKernel::kSm80, 16, 128},
                     GemmTile{GemmKernel::kSm90, 64, 128}}) {
    GemmCase empty_k{"K0", {}, bf16, 7, 2, 3, 40, 0, 64, false, true, contiguous, 0.0, false, 0.0};
    empty_k.tile = t;
    add(empty_k, t.kernel == GemmKernel::kAuto ? all_backends() : std::vector<Backend>{Backend::kCUDA});
  }
  // One K step on the 16 x 128 tile: its compact prologue loads one stage, then fences.
  GemmCase one_k_step{"one_K_step", {}, bf16, 7, 2, 3, 40, 24, 16, false, true, contiguous, 0.0, false, 0.0};
  one_k_step.tile = {GemmKernel::kSm80, 16, 128};
  add(one_k_step, {Backend::kCUDA});

  // Every tensor-core tile (CUDA only; the CPU ignores tiles). Partial N and K tiles,
  // several m-tiles per expert (raster groups), dropped slots and remote experts (-1
  // blocks), both GEMM kinds, and an out whose rows defeat paired (and 16-byte) stores.
  // sm90 in clusters of two: m-tile pairs of one expert (multicast weights), pairs
  // straddling two experts or a -1 block, and a last pair missing its second tile.
  const Layout odd_out = Layout::kOddOutRows;
  std::vector<GemmTile> tiles;
  for (int32_t bm : {16, 32, 64}) {
    for (int32_t bn : {64, 128}) tiles.push_back({GemmKernel::kSm80, bm, bn});
  }
  for (int32_t bm : {64, 128}) {
    for (int32_t bn : {128, 256}) {
      for (int32_t cluster : {1, 2}) tiles.push_back({GemmKernel::kSm90, bm, bn, cluster});
    }
  }
  const std::vector<Backend> cuda_only{Backend::kCUDA};
  for (const GemmTile& t : tiles) {
    GemmCase gathered{"tile_gathered", {}, bf16, 300, 4, 6, 520, 1000, 128, false, true, contiguous, 0.1, true, 0.0};
    gathered.tile = t;
    add(gathered, cuda_only);
    if (t.cluster_m > 1) {
      // Other slot counts per expert, so that the last m-tile pair is sometimes half full.
      for (int64_t m : {77, 161}) {
        GemmCase odd{"tile_gathered", {}, bf16, m, 3, 5, 264, 520, 64, false, true, contiguous, 0.0, false, 0.0};
        odd.tile = t;
        odd.block_size = std::max<int64_t>(64, t.block_m);
        add(odd, cuda_only);
      }
    }
    GemmCase per_slot{"tile_per_slot", {}, fp16, 97, 2, 3, 264, 136, 128, true, true, odd_out, 0.0, false, 0.0};
    per_slot.tile = t;
    add(per_slot, cuda_only);
  }
  for (GemmCase& c : cases) c.name = case_name(c);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, FusedMoeTest, ::testing::ValuesIn(gemm_cases()),
                         [](const auto& info) { return info.param.name; });

#ifdef MOELORA_WITH_CUDA
class FusedMoeSm80PrologueTest : public ::testing::TestWithParam<GemmCase> {};

// The sm80 16 x 128 tile's unrolled prologue ($MOELORA_SM80_COMPACT=0; the default loops) over
// every 16-bit CUDA case that may run it: an sm80 tile or the heuristic's (K of 0 and 24: fewer
// K steps than the prologue's stages, then fences).
TEST_P(FusedMoeSm80PrologueTest, UnrolledMatchesReference) {
  const GemmCase& c = GetParam();
  MOELORA_SKIP_UNLESS_AVAILABLE(c.backend);
  const ScopedKnob compact(cuda::sm80_compact_prologue_enabled, cuda::set_sm80_compact_prologue_enabled, false);
  expect_call_matches_reference(c, std::hash<std::string>{}(c.name) ^ 0xc0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, FusedMoeSm80PrologueTest,
                         ::testing::ValuesIn(cuda_cases_where(gemm_cases(),
                                                              [](const GemmCase& c) {
                                                                return c.dtype != DType::kFloat32 &&
                                                                       c.tile.kernel != GemmKernel::kSm90;
                                                              })),
                         [](const auto& info) { return info.param.name; });
#endif

// ---- a hand-made alignment -----------------------------------------------------------

class FusedMoeBackendTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override { MOELORA_SKIP_UNLESS_AVAILABLE(GetParam()); }
  Backend backend() const { return GetParam(); }
};

// Only the blocks below num_tokens_post_padded count: slots that no counted block holds
// keep their poison, even when a block past the count names them; -1 blocks write zeros;
// entries >= num_slots are padding.
TEST_P(FusedMoeBackendTest, WritesExactlyTheSlotsOfCountedBlocks) {
  const int64_t M = 6, top_k = 2, E = 3, N = 40, K = 24, block_size = 16;
  const int64_t num_slots = M * top_k;
  const int32_t pad = int32_t(num_slots);
  std::mt19937 rng(401);
  std::vector<double> sorted(5 * block_size, pad);
  std::vector<double> experts = {1, -1, 0, 2, 0};
  auto fill_block = [&](int64_t block, std::vector<int32_t> slots) {
    for (size_t i = 0; i < slots.size(); ++i) sorted[size_t(block * block_size) + i] = slots[i];
  };
  fill_block(0, {0, 5, pad + 7, 7});  // pad + 7: past the sentinel, still padding
  fill_block(1, {2, 3});              // expert -1: zeros
  fill_block(2, {11, 4});             // any order inside a block
  fill_block(3, {1, 6});              // past num_tokens_post_padded: ignored
  fill_block(4, {8});
  const int64_t counted_entries = 3 * block_size;

  Buffer sorted_buffer = buffer_with(backend(), DType::kInt32, sorted);
  Buffer expert_buffer = buffer_with(backend(), DType::kInt32, experts);
  Buffer count_buffer = buffer_with(backend(), DType::kInt32, {double(counted_entries)});
  Buffer a(backend(), DType::kBFloat16, M * K), w(backend(), DType::kBFloat16, E * N * K);
  Buffer out(backend(), DType::kBFloat16, num_slots * N);
  const TensorView a_view = a.view({M, K}), w_view = w.view({E, N, K}), out_view = out.view({num_slots, N});
  const std::vector<double> a_values = a.fill_normal(a_view, rng);
  const std::vector<double> w_values = w.fill_normal(w_view, rng, 0.2);
  a.upload();
  w.upload();
  out.poison();

  FusedMoeArgs args;
  args.a = a_view;
  args.w = w_view;
  args.out = out_view;
  args.sorted_token_ids = sorted_buffer.view({int64_t(sorted.size())});
  args.expert_ids = expert_buffer.view({int64_t(experts.size())});
  args.num_tokens_post_padded = count_buffer.view({1});
  args.top_k = top_k;
  args.block_size = block_size;
  TestStream stream(backend());
  fused_moe(args, stream.handle());
  stream.sync();
  out.download();

  // slot -> expert for the counted blocks; -2 = held by no counted block
  std::vector<int64_t> slot_expert(static_cast<size_t>(num_slots), -2);
  for (int64_t s : {0, 5, 7}) slot_expert[size_t(s)] = 1;
  for (int64_t s : {2, 3}) slot_expert[size_t(s)] = -1;
  for (int64_t s : {11, 4}) slot_expert[size_t(s)] = 0;
  std::vector<int64_t> computed = slot_expert;
  for (auto& e : computed) e = std::max<int64_t>(e, -1);
  const std::vector<double> expected = ref::reference_moe_gemm(a_values, w_values, computed, nullptr, M, top_k, N, K);
  std::vector<double> got_written, expected_written;
  for (int64_t s = 0; s < num_slots; ++s) {
    const TensorView row = out.view({N}, {1}, s * N);
    if (slot_expert[size_t(s)] == -2) {
      EXPECT_EQ(out.count_unwritten(row), N) << "slot " << s << " is in no counted block but was written";
      continue;
    }
    EXPECT_EQ(out.count_unwritten(row), 0) << "slot " << s;
    for (double v : out.read(row)) got_written.push_back(v);
    expected_written.insert(expected_written.end(), expected.begin() + s * N, expected.begin() + (s + 1) * N);
    if (slot_expert[size_t(s)] == -1) {
      for (double v : out.read(row)) EXPECT_EQ(v, 0.0) << "slot " << s << " of a -1 block";
    }
  }
  EXPECT_LE(ref::rel_error(got_written, expected_written), ref::tolerance(DType::kBFloat16));
}

// ---- rejected arguments --------------------------------------------------------------

TEST_P(FusedMoeBackendTest, RejectsBadArguments) {
  const GemmCase c{"bad", backend(), DType::kBFloat16, 7, 2, 4, 24, 40, 16, false, true, Layout::kContiguous,
                   0.0, false, 0.0};
  std::mt19937 rng(402);
  float any_storage[4] = {0, 0, 0, 0};
  Buffer other_dtype(backend(), DType::kFloat16, 4 * 24 * 40);
  Buffer int_weights(backend(), DType::kInt32, 14);

  struct BadCase {
    std::string what, argument;
    std::function<void(FusedMoeArgs&, GemmProblem&)> breaks;
  };
  const std::vector<BadCase> bad_cases = {
      {"rank 3 a", "a", [](FusedMoeArgs& a, GemmProblem&) { a.a.rank = 3; a.a.shape[2] = 1; a.a.strides[2] = 1; }},
      {"int32 a", "a", [](FusedMoeArgs& a, GemmProblem&) { a.a.dtype = DType::kInt32; }},
      {"null a", "a", [](FusedMoeArgs& a, GemmProblem&) { a.a.data = nullptr; }},
      {"rank above kMaxRank", "w", [](FusedMoeArgs& a, GemmProblem&) { a.w.rank = kMaxRank + 1; }},
      {"w of another dtype", "w",
       [&](FusedMoeArgs& a, GemmProblem&) { a.w = other_dtype.view({4, 24, 40}); }},
      {"w with another K", "w", [](FusedMoeArgs& a, GemmProblem&) { a.w.shape[2] = 39; }},
      {"w negative stride", "w", [](FusedMoeArgs& a, GemmProblem&) { a.w.strides[1] = -40; }},
      {"w on another device", "w",
       [&](FusedMoeArgs& a, GemmProblem&) { a.w.device = other_device(backend()); a.w.data = any_storage; }},
      {"out with too few rows", "out", [](FusedMoeArgs& a, GemmProblem&) { a.out.shape[0] -= 1; }},
      {"out with another N", "out", [](FusedMoeArgs& a, GemmProblem&) { a.out.shape[1] = 23; }},
      {"out of another dtype", "out", [](FusedMoeArgs& a, GemmProblem&) { a.out.dtype = DType::kFloat32; }},
      {"out overlapping a", "out",
       [](FusedMoeArgs& a, GemmProblem&) {
         a.out.data = a.a.data;
         a.out.shape[1] = 1;  // no size mismatch: only the overlap is wrong
         a.w.shape[1] = 1;
       }},
      // Found by the fuzzer (issue 33): out written over the alignment the GEMM reads
      // (the CPU backend then read w at a garbage expert), an unknown dtype code, an
      // element pointer off its alignment, and an extent past 64-bit byte offsets.
      {"out overlapping expert_ids", "out",
       [](FusedMoeArgs& a, GemmProblem&) { a.out.data = a.expert_ids.data; }},
      {"a of an unknown dtype code", "a", [](FusedMoeArgs& a, GemmProblem&) { a.a.dtype = static_cast<DType>(42); }},
      {"a off its elements' alignment", "a",
       [](FusedMoeArgs& a, GemmProblem&) { a.a.data = static_cast<char*>(a.a.data) + 1; }},
      {"w past 64-bit offsets", "w", [](FusedMoeArgs& a, GemmProblem&) { a.w.strides[0] = INT64_MAX / 2; }},
      {"block_size 40", "block_size", [](FusedMoeArgs& a, GemmProblem&) { a.block_size = 40; }},
      {"block_size 15", "block_size", [](FusedMoeArgs& a, GemmProblem&) { a.block_size = 15; }},
      {"block_size 257", "block_size", [](FusedMoeArgs& a, GemmProblem&) { a.block_size = 257; }},
      {"block_size 272", "block_size", [](FusedMoeArgs& a, GemmProblem&) { a.block_size = 272; }},
      {"tile 48 x 64", "tile", [](FusedMoeArgs& a, GemmProblem&) { a.tile = {GemmKernel::kSm80, 48, 64}; }},
      {"sm90 tile 64 x 64", "tile", [](FusedMoeArgs& a, GemmProblem&) { a.tile = {GemmKernel::kSm90, 64, 64}; }},
      {"tile taller than the block", "tile",
       [](FusedMoeArgs& a, GemmProblem&) { a.tile = {GemmKernel::kSm80, 32, 64}; }},
      {"int64 sorted_token_ids", "sorted_token_ids",
       [](FusedMoeArgs& a, GemmProblem&) {
         a.sorted_token_ids.dtype = DType::kInt64;
         a.sorted_token_ids.shape[0] /= 2;
       }},
      {"short expert_ids", "expert_ids", [](FusedMoeArgs& a, GemmProblem&) { a.expert_ids.shape[0] = 1; }},
      {"two counts", "num_tokens_post_padded",
       [](FusedMoeArgs& a, GemmProblem& p) { a.num_tokens_post_padded = p.expert_ids->view({2}); }},
      {"no topk_weights", "topk_weights", [](FusedMoeArgs& a, GemmProblem&) { a.topk_weights = nullptr; }},
      {"int32 topk_weights", "topk_weights",
       [&](FusedMoeArgs& a, GemmProblem& p) {
         p.weights_view = int_weights.view({7, 2});
         a.topk_weights = &p.weights_view;
       }},
      {"topk_weights of another size", "topk_weights",
       [](FusedMoeArgs& a, GemmProblem& p) {
         p.weights_view.shape[0] = 6;
         a.topk_weights = &p.weights_view;
       }},
  };
  for (const BadCase& bad : bad_cases) {
    SCOPED_TRACE(bad.what);
    GemmProblem problem(c, rng);
    FusedMoeArgs args = problem.args;
    bad.breaks(args, problem);
    TestStream stream(backend());
    const std::string message = error_message([&] { fused_moe(args, stream.handle()); });
    EXPECT_THAT(message, HasSubstr(quoted(bad.argument)));
    stream.sync();
    problem.out.download();
    EXPECT_EQ(problem.out.count_written(), 0);
  }
}

// On the CPU the block experts are readable, so an expert id past w's experts (a wrong
// expert_map) is an error before anything is written.
TEST_P(FusedMoeBackendTest, RejectsExpertIdsPastW) {
  if (backend() != Backend::kCPU) GTEST_SKIP() << "the CUDA backend cannot read expert ids on the host";
  GemmCase c{"bad_expert", backend(), DType::kBFloat16, 7, 2, 4, 24, 40, 16, false, false, Layout::kContiguous, 0.0,
             false, 0.0};
  std::mt19937 rng(403);
  GemmProblem problem(c, rng);
  problem.expert_ids->set(0, 4);  // w has experts 0..3
  const std::string message = error_message([&] { fused_moe(problem.args); });
  EXPECT_THAT(message, HasSubstr("'expert_ids'"));
  EXPECT_EQ(problem.out.count_written(), 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, FusedMoeBackendTest, ::testing::ValuesIn(all_backends()),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

}  // namespace
}  // namespace moelora::test
