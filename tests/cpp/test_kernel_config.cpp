// Kernel config registry: table format, lookup, the override folder, shipped tables.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

#include "api/kernel_config.h"
#include "test_util.h"

namespace moelora::test {
namespace {

using ::testing::HasSubstr;

const char* kTable = R"({
  "1": {"block_size": 16, "gemm1": {"kernel": "sm80", "block_m": 16, "block_n": 64},
        "gemm2": {"kernel": "sm80", "block_m": 16, "block_n": 128}, "small_batch": 1},
  "64": {"block_size": 64, "gemm1": {"kernel": "sm90", "block_m": 64, "block_n": 256},
         "gemm2": {"kernel": "auto"}},
  "4096": {"block_size": 128, "gemm1": {"kernel": "sm90", "block_m": 128, "block_n": 256, "ordered": 1},
           "gemm2": {"kernel": "sm90", "block_m": 128, "block_n": 128, "cluster_m": 2, "ordered": 0},
           "sorted_input": 1}
})";

TEST(KernelConfig, ParsesATable) {
  const detail::KernelConfigTable table = detail::parse_kernel_config_table(kTable, "test");
  ASSERT_EQ(table.size(), 3u);
  const MoeKernelConfig& c = table.at(64);
  EXPECT_EQ(c.block_size, 64);
  EXPECT_EQ(c.gemm1.kernel, GemmKernel::kSm90);
  EXPECT_EQ(c.gemm1.block_m, 64);
  EXPECT_EQ(c.gemm1.block_n, 256);
  EXPECT_EQ(c.gemm2.kernel, GemmKernel::kAuto);
  EXPECT_EQ(table.at(1).gemm2.block_n, 128);
  EXPECT_TRUE(table.at(1).small_batch);
  EXPECT_FALSE(c.small_batch);
  // ordered: 1 unless the table says 0 (the static schedule, sm90 only).
  EXPECT_TRUE(c.gemm1.ordered);
  EXPECT_TRUE(table.at(4096).gemm1.ordered);
  EXPECT_FALSE(table.at(4096).gemm2.ordered);
  EXPECT_EQ(table.at(4096).gemm2.cluster_m, 2);
  // sorted_input: 0 unless the table says 1.
  EXPECT_TRUE(table.at(4096).sorted_input);
  EXPECT_FALSE(c.sorted_input);
}

TEST(KernelConfig, NearestTokenCountWinsTiesGoToTheSmaller) {
  const detail::KernelConfigTable table = detail::parse_kernel_config_table(kTable, "test");
  EXPECT_EQ(detail::nearest_kernel_config(table, 1).block_size, 16);
  EXPECT_EQ(detail::nearest_kernel_config(table, 32).block_size, 16);   // 31 from 1, 32 from 64
  EXPECT_EQ(detail::nearest_kernel_config(table, 33).block_size, 64);
  EXPECT_EQ(detail::nearest_kernel_config(table, 2080).block_size, 64);  // tie: 2016 from both
  EXPECT_EQ(detail::nearest_kernel_config(table, 2081).block_size, 128);
  EXPECT_EQ(detail::nearest_kernel_config(table, 100000).block_size, 128);
}

TEST(KernelConfig, RejectsMalformedTablesNamingTheSource) {
  const std::pair<const char*, const char*> bad[] = {
      {R"({"1": {"block_size": 16, "gemm3": {}}})", "gemm3"},
      {R"({"1": {"block_size": 16, "gemm1": {"kernel": "sm70"}}})", "sm70"},
      {R"({"1": {"block_size": 16, "gemm1": {"kernel": "sm80", "block_m": 32, "block_n": 64}}})", "block_m"},
      {R"({"1": {"block_size": 64, "gemm1": {"kernel": "sm90", "block_m": 64, "block_n": 64}}})", "block_m x block_n"},
      {R"({"1": {"gemm1": {"kernel": "auto"}}})", "block_size"},
      {R"({"1": {"block_size": 24}})", "block_size"},
      {R"({"x": {"block_size": 16}})", "token count"},
      {R"({"0": {"block_size": 16}})", "token count"},
      {R"({"1": {"block_size": 16}} trailing)", "end of text"},
      {R"({"1": {"block_size": 16})", "'}'"},
      {R"({"1": {"block_size": "16"}})", "integer"},
      {R"({"1": {"block_size": 16, "small_batch": 2}})", "small_batch 0 or 1"},
      {R"({"1": {"block_size": 64, "gemm1": {"kernel": "sm90", "block_m": 64, "block_n": 128, "ordered": 2}}})",
       "ordered 0 or 1"},
      {R"({"1": {"block_size": 16, "gemm1": {"kernel": "sm80", "block_m": 16, "block_n": 64, "ordered": 0}}})",
       "ordered only on sm90"},
      {R"({"1": {"block_size": 64, "sorted_input": 2}})", "sorted_input 0 or 1"},
      {R"({"1": {"block_size": 64, "gemm1": {"kernel": "sm90", "block_m": 64, "block_n": 128},
                 "gemm2": {"kernel": "sm80", "block_m": 64, "block_n": 128}, "sorted_input": 1}})",
       "sm90 tiles for both GEMMs with sorted_input"},
  };
  for (const auto& [json, expected] : bad) {
    SCOPED_TRACE(json);
    const std::string message = error_message([&] { detail::parse_kernel_config_table(json, "my_table.json"); });
    EXPECT_THAT(message, HasSubstr("my_table.json"));
    EXPECT_THAT(message, HasSubstr(expected));
  }
}

TEST(KernelConfig, FileNamesFollowVllm) {
  EXPECT_EQ(detail::kernel_config_file_name(128, 768, DType::kBFloat16, "NVIDIA H100 80GB HBM3"),
            "E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3,dtype=bf16.json");
  EXPECT_EQ(detail::kernel_config_file_name(8, 14336, DType::kFloat16, "NVIDIA H200"),
            "E=8,N=14336,device_name=NVIDIA_H200,dtype=fp16.json");
}

// Every shipped table parses, and its name says which device and shape it is for.
TEST(KernelConfig, ShippedTablesParse) {
  for (int i = 0; i < detail::kNumShippedKernelConfigs; ++i) {
    const detail::ShippedKernelConfig& shipped = detail::kShippedKernelConfigs[i];
    SCOPED_TRACE(shipped.file_name);
    const std::string name = shipped.file_name;
    EXPECT_EQ(name.rfind("E=", 0), 0u);
    EXPECT_NE(name.find(",device_name="), std::string::npos);
    const detail::KernelConfigTable* table = detail::find_kernel_config_table(name);
    ASSERT_NE(table, nullptr);
    EXPECT_FALSE(table->empty());
  }
  EXPECT_EQ(detail::find_kernel_config_table("E=3,N=5,device_name=none,dtype=bf16.json"), nullptr);
}

// $MOELORA_CONFIG_DIR names `dir` for this object's life, then what it named before.
class ScopedConfigDir {
 public:
  explicit ScopedConfigDir(const std::string& dir) {
    const char* value = std::getenv("MOELORA_CONFIG_DIR");
    had_ = value != nullptr;
    previous_ = had_ ? value : "";
    setenv("MOELORA_CONFIG_DIR", dir.c_str(), 1);
  }
  ~ScopedConfigDir() {
    if (had_) setenv("MOELORA_CONFIG_DIR", previous_.c_str(), 1); else unsetenv("MOELORA_CONFIG_DIR");
  }

 private:
  bool had_ = false;
  std::string previous_;
};

// $MOELORA_CONFIG_DIR wins over the shipped tables; a broken file there is an error
// that names the file, not a silent fallback.
TEST(KernelConfig, OverrideFolderIsRead) {
  const std::string dir = ::testing::TempDir();
  const std::string good = "E=5,N=7,device_name=Test_Device,dtype=bf16.json";
  const std::string broken = "E=5,N=9,device_name=Test_Device,dtype=bf16.json";
  for (const auto& [name, text] : {std::pair{good, std::string(kTable)}, std::pair{broken, std::string("{\"1\": 3}")}}) {
    std::FILE* f = std::fopen((dir + "/" + name).c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(text.c_str(), f);
    std::fclose(f);
  }
  const detail::KernelConfigTable* table = nullptr;
  std::string message;
  {
    const ScopedConfigDir scoped(dir);
    table = detail::find_kernel_config_table(good);
    message = error_message([&] { detail::find_kernel_config_table(broken); });
  }
  ASSERT_NE(table, nullptr);
  EXPECT_EQ(table->size(), 3u);
  EXPECT_THAT(message, HasSubstr(broken));
}

// Weight-only experts take the sm90 tiles for both GEMMs wherever the block is a multiple of
// 64, whatever 16-bit tiles the table names (those were tuned for bf16 weights; any other tile
// means dequantized copies or the aligned kernels): the H200 table naming sm80 for GEMM2 of
// DeepSeek-V3-TP8 ran w4a16 at M = 4096 in 4321 us on copies, 2004 on the tiles. A caller's
// own config stands.
TEST(KernelConfig, WeightOnlyTakesTheTilesOverATablesSm80Tiles) {
  MOELORA_SKIP_UNLESS_AVAILABLE(Backend::kCUDA);
#ifdef MOELORA_WITH_CUDA
  const detail::CudaDeviceFacts facts = cuda::current_device_facts();
  if (!facts.sm90_kernels) GTEST_SKIP() << "no sm90 tiles on this device";
  // A table of its own (E = 6, N = 1536: no shipped table has them) for this device.
  const std::string dir = ::testing::TempDir() + "/weight_only_tiles";
  std::filesystem::create_directories(dir);
  const std::string name = detail::kernel_config_file_name(6, 1536, DType::kBFloat16, facts.name);
  std::FILE* f = std::fopen((dir + "/" + name).c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs(R"({"1024": {"block_size": 64, "gemm1": {"kernel": "sm80", "block_m": 64, "block_n": 128},
                          "gemm2": {"kernel": "sm80", "block_m": 32, "block_n": 128}}})", f);
  std::fclose(f);
  std::optional<ScopedConfigDir> scoped(std::in_place, dir);
  FusedExpertsShape shape{1024, 2, 6, 512, 1536, DType::kBFloat16};
  const Device cuda{DeviceType::kCUDA, 0};
  FusedExpertsOptions options;
  const MoeKernelConfig bf16 = fused_experts_config(shape, 6, cuda, options);
  shape.quant = make_weight_only_scheme(QuantMethod::kW4A16, 128);
  const MoeKernelConfig w4a16 = fused_experts_config(shape, 6, cuda, options);
  const MoeKernelConfig caller{64, {GemmKernel::kSm80, 64, 128}, {GemmKernel::kSm80, 32, 128}};
  options.config = &caller;
  const MoeKernelConfig w4a16_caller = fused_experts_config(shape, 6, cuda, options);
  scoped.reset();
  EXPECT_EQ(bf16.gemm2.kernel, GemmKernel::kSm80) << "the table was not read";
  EXPECT_EQ(w4a16.block_size, 64);
  for (const GemmTile& tile : {w4a16.gemm1, w4a16.gemm2}) {
    EXPECT_EQ(tile.kernel, GemmKernel::kSm90);
    EXPECT_EQ(tile.block_m, 64);
  }
  EXPECT_EQ(w4a16_caller.gemm1.kernel, GemmKernel::kSm80) << "the caller's config did not stand";
  EXPECT_EQ(w4a16_caller.gemm2.kernel, GemmKernel::kSm80);
#endif
}

// The config fused_experts resolves: explicit options win; the CPU gets the heuristic.
TEST(KernelConfig, FusedExpertsConfigResolution) {
  const FusedExpertsShape shape{64, 8, 128, 2048, 768, DType::kBFloat16};
  const Device cpu{DeviceType::kCPU, 0};
  FusedExpertsOptions options;
  const MoeKernelConfig heuristic = fused_experts_config(shape, 128, cpu, options);
  EXPECT_EQ(heuristic.block_size, fused_experts_block_size(64, 8, 128));
  EXPECT_EQ(heuristic.gemm1.kernel, GemmKernel::kAuto);
  const MoeKernelConfig explicit_config{64, {GemmKernel::kSm80, 64, 64}, {GemmKernel::kSm80, 32, 128}};
  options.config = &explicit_config;
  const MoeKernelConfig got = fused_experts_config(shape, 128, cpu, options);
  EXPECT_EQ(got.block_size, 64);
  EXPECT_EQ(got.gemm2.block_m, 32);
  options.block_size = 128;  // block_size in the options wins over the config's
  EXPECT_EQ(fused_experts_config(shape, 128, cpu, options).block_size, 128);
}

}  // namespace
}  // namespace moelora::test
