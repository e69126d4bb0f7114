// Multi-LoRA: moe_lora_align_block_size (virtual experts) and fused_moe_lora (the delta
// alone), on CPU and CUDA, against float64 references: delta = scale[l] · B · (A · a) per
// slice. Fresh random data per case, outputs poisoned (NaN) first. fused_experts with
// adapters: test_fused_experts_lora.cpp.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
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

// ---- moe_lora_align_block_size --------------------------------------------------------

struct AlignCase {
  Backend backend;
  int64_t M, top_k, num_experts, max_loras, block_size;
  double share;
  bool disable_some;
  DType id_dtype = DType::kInt32;  // topk_ids' (each has its own CUDA kernel instance)
};

void PrintTo(const AlignCase& c, std::ostream* os) {
  *os << backend_name(c.backend) << "_M" << c.M << "_k" << c.top_k << "_E" << c.num_experts << "_L" << c.max_loras
      << "_bs" << c.block_size << "_share" << int(c.share * 100) << (c.disable_some ? "_disabled" : "")
      << (c.id_dtype == DType::kInt64 ? "_ids64" : "");
}

class LoraAlignTest : public ::testing::TestWithParam<AlignCase> {};

TEST_P(LoraAlignTest, BlocksHaveOneExpertAndOneAdapter) {
  const AlignCase c = GetParam();
  MOELORA_SKIP_UNLESS_AVAILABLE(c.backend);
  std::mt19937 rng(1234 + uint32_t(c.M * 7 + c.max_loras));
  std::vector<int64_t> ids = random_routing(c.M, c.top_k, c.num_experts, rng);
  if (c.M > 2) ids[1] = -1;  // a dropped slot
  const std::vector<int64_t> token_loras = random_token_loras(c.M, c.max_loras, c.share, rng);
  std::vector<int32_t> enabled(size_t(c.max_loras), 1);
  if (c.disable_some) {
    for (size_t l = 0; l < enabled.size(); l += 2) enabled[l] = 0;
  }
  const std::vector<int64_t> resolved = resolve_loras(token_loras, enabled);

  Buffer topk(c.backend, c.id_dtype, c.M * c.top_k);
  topk.write(topk.view({c.M, c.top_k}), std::vector<double>(ids.begin(), ids.end()));
  topk.upload();
  Buffer lora_ids = buffer_with(c.backend, DType::kInt32, std::vector<double>(token_loras.begin(), token_loras.end()));
  Buffer enabled_buf = buffer_with(c.backend, DType::kInt32, std::vector<double>(enabled.begin(), enabled.end()));
  const AlignCapacity cap = moe_lora_align_block_size_capacity(c.M * c.top_k, c.block_size, c.num_experts, c.max_loras);
  Buffer sorted(c.backend, DType::kInt32, cap.max_num_tokens_padded);
  Buffer experts(c.backend, DType::kInt32, cap.max_num_blocks);
  Buffer loras(c.backend, DType::kInt32, cap.max_num_blocks);
  Buffer ntpp(c.backend, DType::kInt32, 1);
  for (Buffer* b : {&sorted, &experts, &loras, &ntpp}) b->poison();
  const TensorView enabled_view = enabled_buf.view({c.max_loras});
  MoeLoraAdapters adapters{lora_ids.view({c.M}), &enabled_view, nullptr};
  TestStream stream(c.backend);
  moe_lora_align_block_size(topk.view({c.M, c.top_k}), adapters, c.max_loras, c.block_size, c.num_experts, nullptr,
                            sorted.view({cap.max_num_tokens_padded}), experts.view({cap.max_num_blocks}),
                            loras.view({cap.max_num_blocks}), ntpp.view({1}), stream.handle());
  stream.sync();
  for (Buffer* b : {&sorted, &experts, &loras, &ntpp}) b->download();

  const int64_t num_slots = c.M * c.top_k;
  const int64_t used = int64_t(ntpp.get(0));
  ASSERT_EQ(used % c.block_size, 0);
  ASSERT_LE(used, cap.max_num_tokens_padded);
  // Expected padded length: every (expert, adapter) group and the dropped group round up.
  std::vector<int64_t> group_size(size_t(c.num_experts * (c.max_loras + 1) + 1), 0);
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t e = ids[size_t(s)];
    ++group_size[size_t(e < 0 ? c.num_experts * (c.max_loras + 1) : e * (c.max_loras + 1) + resolved[size_t(s / c.top_k)] + 1)];
  }
  int64_t expected_used = 0;
  for (int64_t n : group_size) expected_used += (n + c.block_size - 1) / c.block_size * c.block_size;
  EXPECT_EQ(used, expected_used);

  std::vector<int> seen(size_t(num_slots), 0);
  int64_t previous_key = -1;
  for (int64_t b = 0; b < cap.max_num_blocks; ++b) {
    const int64_t expert = int64_t(experts.get(b)), lora = int64_t(loras.get(b));
    if (b * c.block_size >= used) {
      EXPECT_EQ(expert, -1) << "block " << b;
      EXPECT_EQ(lora, -1) << "block " << b;
      continue;
    }
    int64_t key = -1;
    for (int64_t i = b * c.block_size; i < (b + 1) * c.block_size; ++i) {
      const int64_t s = int64_t(sorted.get(i));
      if (s == num_slots) continue;  // padding
      ASSERT_GE(s, 0);
      ASSERT_LT(s, num_slots);
      ++seen[size_t(s)];
      const int64_t e = ids[size_t(s)];
      if (e < 0) {
        EXPECT_EQ(expert, -1) << "dropped slot " << s;
        key = c.num_experts * (c.max_loras + 1);
      } else {
        EXPECT_EQ(expert, e) << "slot " << s << " in block " << b;
        EXPECT_EQ(lora, resolved[size_t(s / c.top_k)]) << "slot " << s << " in block " << b;
        key = e * (c.max_loras + 1) + lora + 1;
      }
    }
    ASSERT_GE(key, 0) << "block " << b << " below the used length holds no slot";
    EXPECT_GE(key, previous_key) << "groups out of expert-major order at block " << b;
    previous_key = key;
  }
  for (int64_t i = used; i < cap.max_num_tokens_padded; ++i) EXPECT_EQ(sorted.get(i), double(num_slots)) << i;
  for (int64_t s = 0; s < num_slots; ++s) EXPECT_EQ(seen[size_t(s)], 1) << "slot " << s;
}

std::vector<AlignCase> align_cases() {
  std::vector<AlignCase> cases;
  for (Backend backend : all_backends()) {
    cases.push_back({backend, 1, 8, 128, 4, 16, 1.0, false});
    cases.push_back({backend, 37, 2, 8, 4, 16, 0.5, true});
    cases.push_back({backend, 37, 2, 8, 4, 16, 0.5, true, DType::kInt64});
    cases.push_back({backend, 64, 8, 64, 16, 32, 0.5, false});
    cases.push_back({backend, 300, 8, 256, 64, 64, 1.0, true});   // 16641 groups: the CUDA maximum
    cases.push_back({backend, 3000, 4, 128, 4, 128, 1.0, false}); // a cluster of CTAs on sm_90
    cases.push_back({backend, 3000, 4, 128, 4, 128, 1.0, false, DType::kInt64});
    cases.push_back({backend, 100, 4, 16, 1, 16, 0.0, false});    // nobody has an adapter
    // The CUDA kernel's CTA sizes at one CTA: 256 threads (128 slots, 641 groups), 512 (1089
    // groups, above; and 1600 slots), 1024 with two scan passes (4353 groups, 800 slots).
    cases.push_back({backend, 16, 8, 128, 4, 16, 1.0, false});
    cases.push_back({backend, 100, 8, 256, 16, 16, 0.5, true});
    cases.push_back({backend, 200, 8, 128, 4, 16, 1.0, false, DType::kInt64});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(All, LoraAlignTest, ::testing::ValuesIn(align_cases()));

// ---- fused_moe_lora -------------------------------------------------------------------

struct DeltaCase {
  Backend backend;
  DType dtype;
  int64_t M, top_k, E, L, rank, K, N;
  int num_slices;
  bool interleaved, aligned, add_inputs, weighted, a_per_slot;
  double share;
};

void PrintTo(const DeltaCase& c, std::ostream* os) {
  *os << backend_name(c.backend) << "_" << dtype_short_name(c.dtype) << "_M" << c.M << "_E" << c.E << "_L" << c.L
      << "_r" << c.rank << "_K" << c.K << "_N" << c.N << "_S" << c.num_slices << (c.interleaved ? "i" : "")
      << (c.aligned ? "_aligned" : "_perslot") << (c.add_inputs ? "_add" : "_set") << (c.weighted ? "_w" : "")
      << (c.a_per_slot ? "_aslot" : "") << "_share" << int(c.share * 100);
}

class LoraDeltaTest : public ::testing::TestWithParam<DeltaCase> {};

TEST_P(LoraDeltaTest, MatchesReference) {
  const DeltaCase c = GetParam();
  MOELORA_SKIP_UNLESS_AVAILABLE(c.backend);
  std::mt19937 rng(99 + uint32_t(c.rank * 131 + c.M));
  const int64_t num_slots = c.M * c.top_k;
  const int64_t a_rows = c.a_per_slot ? num_slots : c.M;
  std::vector<int64_t> ids = random_routing(c.M, c.top_k, c.E, rng);
  if (c.M > 1) ids[0] = -1;  // a dropped slot gets no delta
  const std::vector<int64_t> token_loras = random_token_loras(c.M, c.L, c.share, rng);
  std::vector<int32_t> enabled(size_t(c.L), 1);
  if (c.L > 1) enabled[1] = 0;
  const std::vector<int64_t> resolved = resolve_loras(token_loras, enabled);
  std::vector<double> scale(size_t(c.L));
  for (int64_t l = 0; l < c.L; ++l) scale[size_t(l)] = 0.5 + 0.25 * double(l % 4);

  LoraStackData stack(c.backend, c.dtype, c.num_slices, c.L, c.E, c.rank, c.K, c.N, c.interleaved, rng);
  Buffer a(c.backend, c.dtype, a_rows * c.K);
  const std::vector<double> a_values = a.fill_normal(a.view({a_rows, c.K}), rng);
  a.upload();
  Buffer out(c.backend, c.dtype, num_slots * c.N);
  const std::vector<double> base = out.fill_normal(out.view({num_slots, c.N}), rng);
  if (!c.add_inputs) {
    out.poison();  // every row must be written
  } else {
    out.upload();
  }
  Buffer topk(c.backend, DType::kInt32, num_slots);
  topk.write(topk.view({c.M, c.top_k}), std::vector<double>(ids.begin(), ids.end()));
  topk.upload();
  const std::vector<double> weight_values = random_router_weights(c.M, c.top_k, rng);
  Buffer weights = buffer_with(c.backend, DType::kFloat32, weight_values);
  Buffer lora_ids = buffer_with(c.backend, DType::kInt32, std::vector<double>(token_loras.begin(), token_loras.end()));
  Buffer enabled_buf = buffer_with(c.backend, DType::kInt32, std::vector<double>(enabled.begin(), enabled.end()));
  Buffer scale_buf = buffer_with(c.backend, DType::kFloat32, scale);
  Buffer workspace(c.backend, DType::kFloat32,
                   fused_moe_lora_workspace_size(num_slots, c.num_slices, c.rank, c.dtype) / 4);
  workspace.poison();
  const TensorView enabled_view = enabled_buf.view({c.L}), scale_view = scale_buf.view({c.L});
  const TensorView weights_view = weights.view({c.M, c.top_k});

  FusedMoeLoraArgs args;
  args.out = out.view({num_slots, c.N});
  args.a = a.view({a_rows, c.K});
  args.topk_ids = topk.view({c.M, c.top_k});
  args.adapters = MoeLoraAdapters{lora_ids.view({c.M}), &enabled_view, &scale_view};
  args.weights = stack.weights;
  args.workspace = workspace.view({workspace.size()});
  args.topk_weights = &weights_view;
  args.mul_routed_weight = c.weighted;
  args.add_inputs = c.add_inputs;

  TestStream stream(c.backend);
  const int64_t block_size = 16;
  const AlignCapacity cap = moe_lora_align_block_size_capacity(num_slots, block_size, c.E, c.L);
  Buffer sorted(c.backend, DType::kInt32, cap.max_num_tokens_padded);
  Buffer experts(c.backend, DType::kInt32, cap.max_num_blocks);
  Buffer loras(c.backend, DType::kInt32, cap.max_num_blocks);
  Buffer ntpp(c.backend, DType::kInt32, 1);
  const TensorView sorted_view = sorted.view({cap.max_num_tokens_padded}), experts_view = experts.view({cap.max_num_blocks}),
                   loras_view = loras.view({cap.max_num_blocks}), ntpp_view = ntpp.view({1});
  if (c.aligned) {
    moe_lora_align_block_size(args.topk_ids, args.adapters, c.L, block_size, c.E, nullptr, sorted_view, experts_view,
                              loras_view, ntpp_view, stream.handle());
    args.sorted_token_ids = &sorted_view;
    args.expert_ids = &experts_view;
    args.block_lora_ids = &loras_view;
    args.num_tokens_post_padded = &ntpp_view;
    args.block_size = block_size;
  }
  fused_moe_lora(args, stream.handle());
  stream.sync();
  out.download();

  std::vector<double> expected(static_cast<size_t>(num_slots * c.N));
  for (int64_t s = 0; s < num_slots; ++s) {
    double* row = &expected[size_t(s * c.N)];
    std::vector<double> delta(size_t(c.N), 0.0);
    const int64_t l = resolved[size_t(s / c.top_k)], e = ids[size_t(s)];
    if (l >= 0 && e >= 0) {
      const double* a_row = &a_values[size_t((c.a_per_slot ? s : s / c.top_k) * c.K)];
      ref::reference_lora_delta_row(stack.ref, l, e, a_row, scale[size_t(l)] * (c.weighted ? weight_values[size_t(s)] : 1.0),
                                    delta.data());
    }
    for (int64_t n = 0; n < c.N; ++n) row[n] = (c.add_inputs ? base[size_t(s * c.N + n)] : 0.0) + delta[size_t(n)];
  }
  const std::vector<double> got = out.read(out.view({num_slots, c.N}));
  EXPECT_LE(ref::rel_error(got, expected), ref::tolerance(c.dtype));
  EXPECT_EQ(out.count_unwritten(out.view({num_slots, c.N})), 0);
  // The delta alone, where it is non-zero, must match too (the base does not mask it).
  if (c.add_inputs && c.share > 0) {
    std::vector<double> got_delta, expected_delta;
    for (size_t i = 0; i < got.size(); ++i) {
      got_delta.push_back(got[i] - base[i]);
      expected_delta.push_back(expected[i] - base[i]);
    }
    EXPECT_LE(ref::rel_error(got_delta, expected_delta), 4 * ref::tolerance(c.dtype));
  }
}

std::vector<DeltaCase> delta_cases() {
  std::vector<DeltaCase> cases;
  for (Backend backend : all_backends()) {
    for (int64_t rank : {1, 8, 16, 64, 128}) {
      cases.push_back({backend, DType::kBFloat16, 12, 2, 8, 4, rank, 72, 48, 2, false, true, true, false, false, 1.0});
      cases.push_back({backend, DType::kBFloat16, 5, 4, 16, 4, rank, 64, 40, 1, false, false, true, true, true, 0.5});
    }
    for (DType dtype : {DType::kFloat16, DType::kFloat32}) {
      cases.push_back({backend, dtype, 9, 2, 4, 2, 24, 40, 72, 2, true, true, false, false, false, 0.5});
      cases.push_back({backend, dtype, 9, 2, 4, 2, 24, 40, 72, 2, true, false, false, true, false, 1.0});
    }
    cases.push_back({backend, DType::kBFloat16, 40, 8, 16, 16, 16, 136, 130, 1, false, true, false, true, true, 1.0});
    cases.push_back({backend, DType::kBFloat16, 40, 8, 16, 64, 16, 136, 130, 1, false, false, true, false, false, 0.5});
    cases.push_back({backend, DType::kBFloat16, 6, 2, 4, 4, 16, 64, 64, 2, false, true, true, false, false, 0.0});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(All, LoraDeltaTest, ::testing::ValuesIn(delta_cases()));

// ---- bad arguments --------------------------------------------------------------------

TEST(MoeLoraAlignErrors, NameTheArgument) {
  const int64_t M = 4, top_k = 2, E = 8, L = 4;
  Buffer topk(Backend::kCPU, DType::kInt32, M * top_k);
  topk.write(topk.view({M, top_k}), {0, 1, 2, 3, 4, 5, 6, 7});
  Buffer lora_ids = buffer_with(Backend::kCPU, DType::kInt32, {0, -1, 3, 5});
  const AlignCapacity cap = moe_lora_align_block_size_capacity(M * top_k, 16, E, L);
  Buffer sorted(Backend::kCPU, DType::kInt32, cap.max_num_tokens_padded);
  Buffer experts(Backend::kCPU, DType::kInt32, cap.max_num_blocks);
  Buffer loras(Backend::kCPU, DType::kInt32, cap.max_num_blocks);
  Buffer ntpp(Backend::kCPU, DType::kInt32, 1);
  auto call = [&](int64_t max_loras, int64_t lora_blocks) {
    moe_lora_align_block_size(topk.view({M, top_k}), MoeLoraAdapters{lora_ids.view({M})}, max_loras, 16, E, nullptr,
                              sorted.view({cap.max_num_tokens_padded}), experts.view({cap.max_num_blocks}),
                              loras.view({lora_blocks}), ntpp.view({1}));
  };
  EXPECT_THAT(error_message([&] { call(L, cap.max_num_blocks); }), HasSubstr("'token_lora_ids' expected values in [-1, 4), got 5"));
  lora_ids.set(3, 1);
  EXPECT_THAT(error_message([&] { call(65, cap.max_num_blocks); }), HasSubstr("'max_loras' expected a value in [1, 64]"));
  EXPECT_THAT(error_message([&] { call(L, cap.max_num_blocks - 1); }), HasSubstr("'block_lora_ids'"));
  call(L, cap.max_num_blocks);  // and the fixed call goes through
  EXPECT_EQ(int(ntpp.get(0)) % 16, 0);
}

}  // namespace
}  // namespace moelora::test
