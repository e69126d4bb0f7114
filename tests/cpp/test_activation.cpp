// silu_and_mul, gelu_and_mul, swiglu_oai_and_mul against the float64 reference.
#include <string>
#include <vector>

#include "test_util.h"

namespace moelora::test {
namespace {

using ::testing::HasSubstr;

const char* activation_name(Activation activation) {
  switch (activation) {
    case Activation::kSilu: return "silu";
    case Activation::kGelu: return "gelu";
    case Activation::kSwigluOai: return "swiglu_oai";
  }
  return "unknown";
}

void run_activation(Activation activation, const TensorView& input, const TensorView& out, float alpha, float limit,
                    Stream stream) {
  switch (activation) {
    case Activation::kSilu: silu_and_mul(input, out, stream); return;
    case Activation::kGelu: gelu_and_mul(input, out, stream); return;
    case Activation::kSwigluOai: swiglu_oai_and_mul(input, out, alpha, limit, stream); return;
  }
}

struct ActivationCase {
  std::string name;
  Backend backend;
  DType dtype;
  Activation activation;
  int64_t rows, width;
  bool padded;         // input and out rows strided past their width: the gaps keep their poison
  double input_scale;  // spread of the inputs; large values drive swiglu into its clamps
  float alpha, limit;
};

void PrintTo(const ActivationCase& c, std::ostream* os) { *os << c.name; }

class ActivationTest : public ::testing::TestWithParam<ActivationCase> {};

TEST_P(ActivationTest, MatchesReference) {
  const ActivationCase& c = GetParam();
  MOELORA_SKIP_UNLESS_AVAILABLE(c.backend);
  std::mt19937 rng(std::hash<std::string>{}(c.name));
  const int64_t in_stride = c.padded ? 2 * c.width + 7 : 2 * c.width;
  const int64_t out_stride = c.padded ? c.width + 3 : c.width;
  Buffer input(c.backend, c.dtype, std::max<int64_t>(1, c.rows * in_stride));
  Buffer out(c.backend, c.dtype, std::max<int64_t>(1, c.rows * out_stride));
  const TensorView input_view = input.view({c.rows, 2 * c.width}, {in_stride, 1});
  const TensorView out_view = out.view({c.rows, c.width}, {out_stride, 1});
  const std::vector<double> input_values = input.fill_normal(input_view, rng, c.input_scale);
  input.upload();
  out.poison();

  TestStream stream(c.backend);
  run_activation(c.activation, input_view, out_view, c.alpha, c.limit, stream.handle());
  stream.sync();
  out.download();
  const std::vector<double> expected =
      ref::reference_activation(c.activation, input_values, c.rows, c.width, c.alpha, c.limit);
  EXPECT_LE(ref::rel_error(out.read(out_view), expected), ref::tolerance(c.dtype));
  EXPECT_EQ(out.count_unwritten(out_view), 0);
  EXPECT_EQ(out.count_written_outside(out_view), 0);
}

std::vector<ActivationCase> activation_cases() {
  std::vector<ActivationCase> cases;
  for (Backend backend : all_backends()) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      for (Activation activation : {Activation::kSilu, Activation::kGelu, Activation::kSwigluOai}) {
        auto add = [&](const std::string& shape, int64_t rows, int64_t width, bool padded, double scale, float alpha,
                       float limit) {
          cases.push_back({std::string(backend_name(backend)) + "_" + dtype_short_name(dtype) + "_" +
                               activation_name(activation) + "_" + shape,
                           backend, dtype, activation, rows, width, padded, scale, alpha, limit});
        };
        add("rows0", 0, 24, false, 1.0, 1.702f, 7.0f);
        add("rows1_width1", 1, 1, false, 1.0, 1.702f, 7.0f);
        add("rows19_width19_padded", 19, 19, true, 1.0, 1.702f, 7.0f);
        add("qwen3_slots512_I768", 512, 768, false, 1.0, 1.702f, 7.0f);
        add("gpt_oss_slots64_I2880_padded", 64, 2880, true, 1.0, 1.702f, 7.0f);
        // NOTE: wide inputs cross swiglu's limits (gate above `limit`, up outside ±limit)
        add("wide_inputs_limit2", 33, 40, false, 4.0, 1.0f, 2.0f);
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, ActivationTest, ::testing::ValuesIn(activation_cases()),
                         [](const auto& info) { return info.param.name; });

// ---- rejected arguments --------------------------------------------------------------

class ActivationBackendTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override { MOELORA_SKIP_UNLESS_AVAILABLE(GetParam()); }
  Backend backend() const { return GetParam(); }
};

TEST_P(ActivationBackendTest, RejectsBadArguments) {
  const int64_t rows = 6, width = 8;
  float any_storage[4] = {0, 0, 0, 0};
  struct BadCase {
    std::string what, argument;
    std::function<void(TensorView& input, TensorView& out)> breaks;
    Activation activation = Activation::kSilu;
    float limit = 7.0f;
  };
  const std::vector<BadCase> bad_cases = {
      {"rank 3 input", "input", [](TensorView& in, TensorView&) { in.rank = 3; in.shape[2] = 1; in.strides[2] = 1; }},
      {"rank above kMaxRank", "input", [](TensorView& in, TensorView&) { in.rank = kMaxRank + 1; }},
      {"int32 input", "input", [](TensorView& in, TensorView&) { in.dtype = DType::kInt32; }},
      {"odd input width", "input", [](TensorView& in, TensorView&) { in.shape[1] = 2 * width - 1; }},
      {"input column stride 2", "input", [](TensorView& in, TensorView&) { in.shape[1] = width; in.strides[1] = 2; }},
      {"null input", "input", [](TensorView& in, TensorView&) { in.data = nullptr; }},
      {"negative input stride", "input", [](TensorView& in, TensorView&) { in.strides[0] = -2 * width; }},
      {"out of another width", "out", [](TensorView&, TensorView& out) { out.shape[1] = width - 1; }},
      {"out of other rows", "out", [](TensorView&, TensorView& out) { out.shape[0] = rows - 1; }},
      {"out of another dtype", "out", [](TensorView&, TensorView& out) { out.dtype = DType::kFloat16; }},
      {"out on another device", "out",
       [&](TensorView&, TensorView& out) { out.device = other_device(backend()); out.data = any_storage; }},
      {"out over input", "out", [](TensorView& in, TensorView& out) { out.data = in.data; }},
      {"swiglu limit 0", "limit", [](TensorView&, TensorView&) {}, Activation::kSwigluOai, 0.0f},
  };
  for (const BadCase& bad : bad_cases) {
    SCOPED_TRACE(bad.what);
    std::mt19937 rng(501);
    Buffer input(backend(), DType::kBFloat16, rows * 2 * width);
    Buffer out(backend(), DType::kBFloat16, rows * width);
    TensorView input_view = input.view({rows, 2 * width}), out_view = out.view({rows, width});
    input.fill_normal(input_view, rng);
    input.upload();
    out.poison();
    bad.breaks(input_view, out_view);
    TestStream stream(backend());
    const std::string message = error_message(
        [&] { run_activation(bad.activation, input_view, out_view, 1.702f, bad.limit, stream.handle()); });
    EXPECT_THAT(message, HasSubstr(quoted(bad.argument)));
    stream.sync();
    out.download();
    EXPECT_EQ(out.count_written(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, ActivationBackendTest, ::testing::ValuesIn(all_backends()),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

}  // namespace
}  // namespace moelora::test
