// TensorView, dtype and device helpers of include/moelora/tensor.h.
#include <string>

#include "test_util.h"

namespace moelora::test {
namespace {

using ::testing::HasSubstr;

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::kFloat32), 4u);
  EXPECT_EQ(dtype_size(DType::kFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kInt32), 4u);
  EXPECT_EQ(dtype_size(DType::kInt64), 8u);
  // torch's names, so error messages read the same as the framework's
  EXPECT_STREQ(dtype_name(DType::kFloat32), "float32");
  EXPECT_STREQ(dtype_name(DType::kFloat16), "float16");
  EXPECT_STREQ(dtype_name(DType::kBFloat16), "bfloat16");
  EXPECT_STREQ(dtype_name(DType::kInt32), "int32");
  EXPECT_STREQ(dtype_name(DType::kInt64), "int64");
}

TEST(DeviceTest, NamesAndEquality) {
  EXPECT_EQ(device_name(Device{}), "cpu");
  EXPECT_EQ(device_name(Device{DeviceType::kCUDA, 1}), "cuda:1");
  EXPECT_EQ((Device{DeviceType::kCUDA, 0}), (Device{DeviceType::kCUDA, 0}));
  EXPECT_NE((Device{DeviceType::kCUDA, 0}), (Device{DeviceType::kCUDA, 1}));
  EXPECT_NE((Device{DeviceType::kCUDA, 0}), Device{});
}

class TensorViewTest : public ::testing::TestWithParam<Backend> {};

TEST_P(TensorViewTest, ContiguousViewHasRowMajorStrides) {
  const Device device = device_of(GetParam());
  int storage = 0;
  const TensorView t = TensorView::contiguous(&storage, DType::kBFloat16, {8, 14336, 4096}, device);
  EXPECT_EQ(t.rank, 3);
  EXPECT_EQ(t.data, &storage);
  EXPECT_EQ(t.dtype, DType::kBFloat16);
  EXPECT_EQ(t.device, device);
  EXPECT_EQ(t.size(0), 8);
  EXPECT_EQ(t.size(2), 4096);
  EXPECT_EQ(t.stride(0), 14336 * 4096);
  EXPECT_EQ(t.stride(1), 4096);
  EXPECT_EQ(t.stride(2), 1);
  EXPECT_EQ(t.numel(), int64_t(8) * 14336 * 4096);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.shape_string(), "[8, 14336, 4096]");
}

TEST_P(TensorViewTest, ScalarAndEmptyViews) {
  const Device device = device_of(GetParam());
  float value = 1.0f;
  const TensorView scalar = TensorView::contiguous(&value, DType::kFloat32, {}, device);
  EXPECT_EQ(scalar.rank, 0);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_TRUE(scalar.is_contiguous());
  EXPECT_EQ(scalar.shape_string(), "[]");

  const TensorView empty = TensorView::contiguous(nullptr, DType::kFloat32, {0, 7}, device);
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_EQ(empty.shape_string(), "[0, 7]");
}

TEST_P(TensorViewTest, StridedViewsAreNotContiguous) {
  const Device device = device_of(GetParam());
  int storage = 0;
  TensorView every_other_row = TensorView::contiguous(&storage, DType::kFloat16, {4, 6}, device);
  every_other_row.strides[0] = 12;
  EXPECT_FALSE(every_other_row.is_contiguous());

  TensorView transposed = TensorView::contiguous(&storage, DType::kFloat16, {4, 6}, device);
  transposed.strides[0] = 1;
  transposed.strides[1] = 4;
  EXPECT_FALSE(transposed.is_contiguous());

  // A dim of size 1 has no step, so its stride does not matter (torch's rule).
  TensorView single_row = TensorView::contiguous(&storage, DType::kFloat16, {1, 6}, device);
  single_row.strides[0] = 999;
  EXPECT_TRUE(single_row.is_contiguous());
}

TEST_P(TensorViewTest, RankAboveMaximumThrows) {
  int storage = 0;
  const std::string message = error_message(
      [&] { TensorView::contiguous(&storage, DType::kFloat32, {1, 2, 3, 4, 5}, device_of(GetParam())); });
  EXPECT_THAT(message, HasSubstr("rank 5"));
}

INSTANTIATE_TEST_SUITE_P(Devices, TensorViewTest, ::testing::ValuesIn(all_backends()),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

TEST(BuildTest, VersionAndCudaAvailability) {
  EXPECT_STRNE(version(), "");
#ifndef MOELORA_WITH_CUDA
  EXPECT_FALSE(cuda_available());
#endif
}

}  // namespace
}  // namespace moelora::test
