// moe_sum_reduce against the float64 reference.
#include <string>
#include <vector>

#include "test_util.h"

#ifdef MOELORA_WITH_CUDA
#include "common/params.h"
#endif

namespace moelora::test {
namespace {

using ::testing::HasSubstr;

struct SumReduceCase {
  std::string name;
  Backend backend;
  DType dtype;
  int64_t M, top_k, H;
  float scale;
  bool padded;  // input slots and tokens strided past their extent, out rows padded
};

void PrintTo(const SumReduceCase& c, std::ostream* os) { *os << c.name; }

// One moe_sum_reduce call on fresh data (seeded), against the float64 reference.
void expect_sum_matches_reference(const SumReduceCase& c, size_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  // padded: each slot row is H + 5 long, each token holds top_k + 1 slot rows
  const int64_t stride_k = c.padded ? c.H + 5 : c.H;
  const int64_t stride_token = c.padded ? (c.top_k + 1) * stride_k : c.top_k * stride_k;
  const int64_t out_stride = c.padded ? c.H + 3 : c.H;
  Buffer input(c.backend, c.dtype, std::max<int64_t>(1, c.M * stride_token));
  Buffer out(c.backend, c.dtype, std::max<int64_t>(1, c.M * out_stride));
  const TensorView input_view = input.view({c.M, c.top_k, c.H}, {stride_token, stride_k, 1});
  const TensorView out_view = out.view({c.M, c.H}, {out_stride, 1});
  const std::vector<double> input_values = input.fill_normal(input_view, rng);
  input.upload();
  out.poison();

  TestStream stream(c.backend);
  moe_sum_reduce(input_view, out_view, c.scale, stream.handle());
  stream.sync();
  out.download();
  const std::vector<double> expected = ref::reference_sum_reduce(input_values, c.M, c.top_k, c.H, c.scale);
  EXPECT_LE(ref::rel_error(out.read(out_view), expected), ref::tolerance(c.dtype));
  EXPECT_EQ(out.count_unwritten(out_view), 0);
  EXPECT_EQ(out.count_written_outside(out_view), 0);
}

class SumReduceTest : public ::testing::TestWithParam<SumReduceCase> {};

TEST_P(SumReduceTest, MatchesReference) {
  MOELORA_SKIP_UNLESS_AVAILABLE(GetParam().backend);
  expect_sum_matches_reference(GetParam(), std::hash<std::string>{}(GetParam().name));
}

std::vector<SumReduceCase> sum_reduce_cases() {
  std::vector<SumReduceCase> cases;
  for (Backend backend : all_backends()) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      auto add = [&](const std::string& shape, int64_t M, int64_t top_k, int64_t H, float scale, bool padded) {
        cases.push_back({std::string(backend_name(backend)) + "_" + dtype_short_name(dtype) + "_" + shape, backend,
                         dtype, M, top_k, H, scale, padded});
      };
      add("M0", 0, 8, 64, 1.0f, false);
      add("M1_topk1_H1", 1, 1, 1, 1.0f, false);
      add("topk1_scale2.5", 7, 1, 40, 2.5f, true);
      add("mixtral_M16", 16, 2, 4096, 1.0f, false);
      add("qwen3_M64", 64, 8, 2048, 1.0f, false);
      add("deepseek_M16_scale2.5", 16, 8, 7168, 2.5f, false);
      add("gpt_oss_M19_padded", 19, 4, 2880, 1.0f, true);
      add("odd_H19_padded", 33, 3, 19, 0.5f, true);
      // Past one batch of 8 slots a thread (moe_sum_reduce.cu's kSlotBatch): a full batch and 2, 1.
      add("topk10_H2880", 5, 10, 2880, 1.0f, false);
      add("topk9_odd_H19_padded", 6, 9, 19, 1.5f, true);
    }
  }
  return cases;
}

// A case's name as a test name: gtest takes no '.' ("scale2.5" -> "scale2p5").
std::string sum_case_test_name(const ::testing::TestParamInfo<SumReduceCase>& info) {
  std::string name = info.param.name;
  for (char& ch : name) ch = (ch == '.') ? 'p' : ch;
  return name;
}

INSTANTIATE_TEST_SUITE_P(Shapes, SumReduceTest, ::testing::ValuesIn(sum_reduce_cases()), sum_case_test_name);

#ifdef MOELORA_WITH_CUDA
class SumReduceKernelsTest : public ::testing::TestWithParam<SumReduceCase> {};

// Both CUDA kernels on every CUDA case (the rule batches the slots' loads of a small grid,
// which every case here is): one slot at a time, and kSlotBatch at a time.
TEST_P(SumReduceKernelsTest, MatchesReferenceWithEitherKernel) {
  const SumReduceCase& c = GetParam();
  MOELORA_SKIP_UNLESS_AVAILABLE(c.backend);
  for (cuda::SumBatchedUse use : {cuda::SumBatchedUse::kNever, cuda::SumBatchedUse::kAlways}) {
    SCOPED_TRACE(use == cuda::SumBatchedUse::kNever ? "a slot at a time" : "batched");
    const ScopedKnob batched(cuda::sum_batched_use, cuda::set_sum_batched_use, use);
    expect_sum_matches_reference(c, std::hash<std::string>{}(c.name) ^ size_t(use));
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, SumReduceKernelsTest,
                         ::testing::ValuesIn(cuda_cases_where(sum_reduce_cases(), [](const SumReduceCase&) { return true; })),
                         sum_case_test_name);
#endif

// ---- rejected arguments --------------------------------------------------------------

class SumReduceBackendTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override { MOELORA_SKIP_UNLESS_AVAILABLE(GetParam()); }
  Backend backend() const { return GetParam(); }
};

TEST_P(SumReduceBackendTest, RejectsBadArguments) {
  const int64_t M = 5, top_k = 3, H = 16;
  float any_storage[4] = {0, 0, 0, 0};
  struct BadCase {
    std::string what, argument;
    std::function<void(TensorView& input, TensorView& out)> breaks;
  };
  const std::vector<BadCase> bad_cases = {
      {"rank 2 input", "input", [](TensorView& in, TensorView&) { in.rank = 2; }},
      {"rank above kMaxRank", "input", [](TensorView& in, TensorView&) { in.rank = kMaxRank + 1; }},
      {"int64 input", "input", [](TensorView& in, TensorView&) { in.dtype = DType::kInt64; }},
      {"input hidden stride 2", "input", [](TensorView& in, TensorView&) { in.shape[2] = H / 2; in.strides[2] = 2; }},
      {"null input", "input", [](TensorView& in, TensorView&) { in.data = nullptr; }},
      {"negative input stride", "input", [](TensorView& in, TensorView&) { in.strides[1] = -H; }},
      {"out of other tokens", "out", [](TensorView&, TensorView& out) { out.shape[0] = M + 1; }},
      {"out of another hidden size", "out", [](TensorView&, TensorView& out) { out.shape[1] = H - 1; }},
      {"out rank 3", "out", [](TensorView&, TensorView& out) { out.rank = 3; out.shape[2] = 1; out.strides[2] = 1; }},
      {"out of another dtype", "out", [](TensorView&, TensorView& out) { out.dtype = DType::kFloat32; }},
      {"out on another device", "out",
       [&](TensorView&, TensorView& out) { out.device = other_device(backend()); out.data = any_storage; }},
      {"out over input", "out", [](TensorView& in, TensorView& out) { out.data = in.data; }},
  };
  for (const BadCase& bad : bad_cases) {
    SCOPED_TRACE(bad.what);
    std::mt19937 rng(601);
    Buffer input(backend(), DType::kBFloat16, M * top_k * H);
    Buffer out(backend(), DType::kBFloat16, M * H);
    TensorView input_view = input.view({M, top_k, H}), out_view = out.view({M, H});
    input.fill_normal(input_view, rng);
    input.upload();
    out.poison();
    bad.breaks(input_view, out_view);
    TestStream stream(backend());
    const std::string message = error_message([&] { moe_sum_reduce(input_view, out_view, 1.0f, stream.handle()); });
    EXPECT_THAT(message, HasSubstr(quoted(bad.argument)));
    stream.sync();
    out.download();
    EXPECT_EQ(out.count_written(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, SumReduceBackendTest, ::testing::ValuesIn(all_backends()),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

}  // namespace
}  // namespace moelora::test
