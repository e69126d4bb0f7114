// Weight-only experts (w4a16 / w8a16, issue 30): fused_experts on packed 4- and 8-bit
// weights with group or channel scales and optional zero points (packed or one a byte),
// against the float64 layer on the dequantized weights (q - zero) * scale. The packed
// bytes, scales and zero points are fresh random data per case (no quantizer between the
// test and the op), outputs poisoned (NaN) first. Every CUDA path: the decode kernels
// (at most kSmallBatchMaxSlots8Bit slots), the aligned kernels, and the dense path past
// them: the sm90 tiles reading the packed experts, or the GEMMs on dequantized copies.
#include <cmath>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "api/fused_experts_plan.h"
#include "common/params.h"
#include "quant_layer_testing.h"
#include "test_util.h"

namespace moelora::test {
namespace {

using ::testing::HasSubstr;

enum class Zeros { kNone, kBytes, kPacked };

struct WeightOnlyCase : QuantLayerDims {
  WeightOnlyCase() {
    M = 8;
    lora_share = 0.75;
  }
  std::string name;
  int bits = 4;
  int64_t group_size = 128;  // 0: per channel
  Zeros zeros = Zeros::kNone;
  WeightOnlyPath expect_path = WeightOnlyPath::kDecode;  // the CUDA path that must run
  // kDense: the sm90 tiles read the packed experts (on a device with sm_90a kernels), else
  // the dense experts are dequantized.
  bool expect_tiles = false;
  // Auto routing at 32-127 slots an expert: the tiles where the device has sm90 kernels
  // (expect_path kDense, expect_tiles), else the aligned kernels.
  bool aligned_without_tiles = false;
};

// Both GEMMs on 64 x 256 sm90 tiles, x copied into sorted order first.
const MoeKernelConfig kSortedInputTiles{64, GemmTile{GemmKernel::kSm90, 64, 256}, GemmTile{GemmKernel::kSm90, 64, 128},
                                        false, true};

void PrintTo(const WeightOnlyCase& c, std::ostream* os) { *os << c.name; }

QuantScheme scheme_of(const WeightOnlyCase& c) {
  return make_weight_only_scheme(c.bits == 4 ? QuantMethod::kW4A16 : QuantMethod::kW8A16, c.group_size,
                                 c.zeros != Zeros::kNone);
}

// One GEMM's packed weights w [E, N, K * bits / 8] (random codes), scales [E, N, groups]
// (or [E, N]) in the layer dtype, zero points, and the dequantized values.
struct PackedWeights {
  PackedWeights(const WeightOnlyCase& c, int64_t E, int64_t N, int64_t K, std::mt19937& rng)
      : groups(c.group_size > 0 ? K / c.group_size : 1),
        zero_rows(c.zeros == Zeros::kPacked ? N / 2 : N),
        packed(c.backend, DType::kUInt8, E * N * K * c.bits / 8),
        scales(c.backend, c.dtype, E * N * groups),
        zeros(c.backend, DType::kUInt8, std::max<int64_t>(1, E * zero_rows * groups)) {
    const int maxq = (1 << c.bits) - 1;
    std::uniform_int_distribution<int> code(0, maxq), byte(0, 255);
    std::vector<int> q(size_t(E * N * K)), z(size_t(E * N * groups), 1 << (c.bits - 1));
    for (auto& v : q) v = code(rng);
    auto* bytes = packed.host_as<uint8_t>();
    for (int64_t i = 0; i < E * N * K; i += (c.bits == 4 ? 2 : 1)) {
      bytes[c.bits == 4 ? i / 2 : i] = uint8_t(c.bits == 4 ? q[size_t(i)] | (q[size_t(i + 1)] << 4) : q[size_t(i)]);
    }
    // Scales about 1 / (sqrt(K) * half the code range): weights of unit variance over K.
    std::uniform_real_distribution<double> scale(0.5, 1.5);
    std::vector<double> s(size_t(E * N * groups));
    for (auto& v : s) v = scale(rng) * 2.0 / (double(maxq) * std::sqrt(double(K)));
    scales.write(scales.view({E * N * groups}), s);
    s = scales.read(scales.view({E * N * groups}));  // as stored (bf16/fp16)
    if (c.zeros != Zeros::kNone) {
      // Around the middle of the range, as real asymmetric groups are.
      std::uniform_int_distribution<int> zero(maxq / 4, 3 * maxq / 4);
      for (auto& v : z) v = zero(rng);
      auto* zb = zeros.host_as<uint8_t>();
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t g = 0; g < groups; ++g) {
            const int v = z[size_t((e * N + n) * groups + g)];
            if (c.zeros == Zeros::kBytes) {
              zb[(e * N + n) * groups + g] = uint8_t(v);
            } else {
              uint8_t& b = zb[(e * zero_rows + n / 2) * groups + g];
              b = uint8_t(n % 2 == 0 ? (b & 0xF0) | v : (b & 0x0F) | (v << 4));
            }
          }
        }
      }
    }
    dequantized.resize(q.size());
    const int64_t size = K / groups;
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t k = 0; k < K; ++k) {
          const size_t gi = size_t((e * N + n) * groups + k / size);
          dequantized[size_t((e * N + n) * K + k)] = double(q[size_t((e * N + n) * K + k)] - z[gi]) * s[gi];
        }
      }
    }
    packed.upload();
    scales.upload();
    zeros.upload();
    view = packed.view({E, N, K * c.bits / 8});
    scale_view = c.group_size > 0 ? scales.view({E, N, groups}) : scales.view({E, N});
    zero_view = c.group_size > 0 ? zeros.view({E, zero_rows, groups}) : zeros.view({E, zero_rows});
  }
  int64_t groups, zero_rows;
  Buffer packed, scales, zeros;
  std::vector<double> dequantized;
  TensorView view, scale_view, zero_view;
};

struct WeightOnlyLayer {
  WeightOnlyLayer(const WeightOnlyCase& c, std::mt19937& rng)
      : c(c),
        scheme(scheme_of(c)),
        w13(c, c.num_local, 2 * c.I, c.H, rng),
        w2(c, c.num_local, c.H, c.I, rng),
        io(c, quant_layer_shape(c, scheme), rng, [&c](const std::vector<int64_t>&, std::mt19937& r) {
          return random_routing(c.M, c.top_k, c.num_global, r);
        }) {}

  FusedExpertsShape shape() const { return quant_layer_shape(c, scheme); }

  FusedExpertsArgs args() {
    quant.scheme = scheme;
    quant.w13_scale = w13.scale_view;
    quant.w2_scale = w2.scale_view;
    quant.w13_zero = c.zeros != Zeros::kNone ? &w13.zero_view : nullptr;
    quant.w2_zero = c.zeros != Zeros::kNone ? &w2.zero_view : nullptr;
    return io.args(w13.view, w2.view, &quant);
  }

  std::vector<double> reference() const { return io.reference(w13.dequantized, w2.dequantized); }

  const WeightOnlyCase& c;
  QuantScheme scheme;
  PackedWeights w13, w2;
  QuantLayerIo io;
  FusedExpertsQuant quant;
};

class WeightOnlyTest : public ::testing::TestWithParam<WeightOnlyCase> {};

TEST_P(WeightOnlyTest, MatchesReference) {
  const WeightOnlyCase& c = GetParam();
  MOELORA_SKIP_UNLESS_AVAILABLE(c.backend);
  std::mt19937 rng(std::hash<std::string>{}(c.name));
  WeightOnlyLayer layer(c, rng);
  TestStream stream(c.backend);
  fused_experts(layer.args(), c.options, stream.handle());
  stream.sync();
  layer.io.out.download();
  const TensorView ov = c.options.no_combine ? layer.io.out.view({c.M, c.top_k, c.H}) : layer.io.out.view({c.M, c.H});
  const double error = ref::rel_error(layer.io.out.read(ov), layer.reference());
  EXPECT_LE(error, ref::tolerance(c.dtype));
  EXPECT_EQ(layer.io.out.count_unwritten(ov), 0);
  // Which CUDA path ran: the decode kernels write no alignment (sorted_token_ids open the
  // workspace), the dense path its dequantized experts.
  if (c.backend == Backend::kCUDA && c.M > 0) {
#ifdef MOELORA_WITH_CUDA
    const bool sm90 = cuda::current_device_facts().sm90_kernels;
#else
    const bool sm90 = false;
#endif
    const WeightOnlyPath expect_path = c.aligned_without_tiles && !sm90 ? WeightOnlyPath::kAligned : c.expect_path;
    const detail::WorkspaceLayout layout = detail::workspace_layout(layer.shape(), c.options);
    EXPECT_EQ(int(layout.weight_only_path), int(expect_path));
    layer.io.workspace.download();
    EXPECT_EQ(layer.io.workspace.is_poison(0), expect_path == WeightOnlyPath::kDecode) << "the other path ran";
    if (layout.weight_only_dense) {
      // The tiles read the packed experts: no dequantized copies reserved (or written).
      const bool tiles = c.expect_tiles && sm90;
      EXPECT_EQ(layout.weight_only_copies, !tiles) << "copies of the experts reserved where the tiles run, or not where they do not";
      if (layout.weight_only_copies) {
        EXPECT_FALSE(layer.io.workspace.is_poison(layout.dense_w13 / 4)) << "the dense experts were not written";
      } else if (c.M <= c.options.chunk_size) {
        // One chunk, on the tiles: aligned in their blocks of 64 or 128 entries (the aligned
        // kernels' blocks of 16 would leave entries past a multiple of 64 with random routing).
        const int32_t padded = layer.io.workspace.host_as<int32_t>()[layout.num_tokens_post_padded / 4];
        EXPECT_EQ(padded % 64, 0) << "the tiles did not run: " << padded << " padded entries";
      }
    }
  }
  RecordProperty("rel_error", std::to_string(error));
}

std::vector<WeightOnlyCase> weight_only_cases() {
  std::vector<WeightOnlyCase> cases;
  for (Backend backend : all_backends()) {
    const std::string b = backend_name(backend);
    for (int bits : {4, 8}) {
      const std::string w = bits == 4 ? "w4a16" : "w8a16";
      for (int64_t group : {int64_t(32), int64_t(64), int64_t(128), int64_t(0)}) {
        for (Zeros zeros : {Zeros::kNone, Zeros::kBytes, Zeros::kPacked}) {
          if (zeros == Zeros::kPacked && bits == 8) continue;
          const std::string z = zeros == Zeros::kNone ? "sym" : zeros == Zeros::kBytes ? "zp" : "zp_packed";
          WeightOnlyCase c;
          c.backend = backend;
          c.bits = bits;
          c.group_size = group;
          c.zeros = zeros;
          c.name = b + "_" + w + "_g" + std::to_string(group) + "_" + z;
          cases.push_back(c);
        }
      }
      // M = 0 and 1, fp16, expert_map with -1 and dropped slots, no_combine, large M (the
      // dense path on CUDA), LoRA on both paths, odd model sizes (gpt-oss's 2880, 1408).
      auto add = [&](const std::string& name, auto&& edit) {
        WeightOnlyCase c;
        c.backend = backend;
        c.bits = bits;
        c.name = b + "_" + w + "_" + name;
        edit(c);
        cases.push_back(c);
      };
      add("m0", [](WeightOnlyCase& c) { c.M = 0; });
      add("m1", [](WeightOnlyCase& c) { c.M = 1; });
      add("fp16_zp", [](WeightOnlyCase& c) { c.dtype = DType::kFloat16; c.zeros = Zeros::kBytes; c.M = 5; });
      add("fp16_g32", [](WeightOnlyCase& c) { c.dtype = DType::kFloat16; c.group_size = 32; });
      add("expert_map", [](WeightOnlyCase& c) { c.num_global = 16; c.num_local = 6; c.dropped_share = 0.1; c.M = 12; });
      add("no_combine", [](WeightOnlyCase& c) { c.options.no_combine = true; c.top_k = 3; });
      add("router_weight_on_input", [](WeightOnlyCase& c) { c.options.apply_router_weight_on_input = true; c.top_k = 1; });
      add("top8_m16", [](WeightOnlyCase& c) { c.top_k = 8; c.num_global = c.num_local = 32; c.M = 16; c.zeros = Zeros::kBytes; });
      // Past the decode kernels (128 slots): the aligned path, the dense one from 128 slots
      // an expert, from 32 where the chunk's config names sm90 tiles (or forced).
      constexpr WeightOnlyPath kAligned = WeightOnlyPath::kAligned, kDense = WeightOnlyPath::kDense;
      add("aligned_m100", [&](WeightOnlyCase& c) { c.M = 100; c.zeros = Zeros::kBytes; c.expect_path = kAligned; });
      add("aligned_g32", [&](WeightOnlyCase& c) { c.M = 100; c.group_size = 32; c.expect_path = kAligned; });
      add("aligned_fp16_zp_packed", [&](WeightOnlyCase& c) {
        c.M = 70, c.dtype = DType::kFloat16, c.zeros = bits == 4 ? Zeros::kPacked : Zeros::kBytes, c.expect_path = kAligned;
      });
      add("aligned_expert_map", [&](WeightOnlyCase& c) {
        c.M = 90, c.num_global = 12, c.num_local = 5, c.dropped_share = 0.05, c.expect_path = kAligned;
      });
      add("aligned_no_combine", [&](WeightOnlyCase& c) {
        c.M = 60, c.top_k = 3, c.options.no_combine = true, c.expect_path = kAligned;
      });
      add("aligned_top1_direct", [&](WeightOnlyCase& c) { c.M = 200, c.top_k = 1, c.expect_path = kAligned; });
      add("aligned_decode_asked", [&](WeightOnlyCase& c) {
        c.M = 100, c.options.weight_only_path = WeightOnlyPath::kDecode, c.expect_path = kAligned;
      });
      add("dense_auto_m512", [&](WeightOnlyCase& c) { c.M = 512; c.expect_path = kDense; c.expect_tiles = true; });
      // 8 slots an expert (64 slots, within the decode kernels' 128): the aligned kernels.
      add("aligned_m32_8_an_expert", [&](WeightOnlyCase& c) { c.M = 32, c.expect_path = kAligned; });
      add("decode_asked_m32", [&](WeightOnlyCase& c) {
        c.M = 32, c.options.weight_only_path = WeightOnlyPath::kDecode, c.expect_path = WeightOnlyPath::kDecode;
      });
      // 55 slots an expert: blocks of 64 name sm90 tiles, which take the chunk from 32 an expert.
      add("tiles_auto_m220", [&](WeightOnlyCase& c) {
        c.M = 220, c.zeros = Zeros::kBytes, c.expect_path = kDense, c.expect_tiles = true, c.aligned_without_tiles = true;
      });
      add("dense_expert_map", [&](WeightOnlyCase& c) {
        c.M = 90, c.num_global = 12, c.num_local = 5, c.dropped_share = 0.05, c.options.weight_only_path = kDense,
        c.expect_path = kDense;
      });
      add("lora_decode", [](WeightOnlyCase& c) { c.lora_rank = 16; c.M = 6; });
      add("lora_aligned", [&](WeightOnlyCase& c) { c.lora_rank = 16; c.M = 80; c.zeros = Zeros::kBytes; c.expect_path = kAligned; });
      add("lora_aligned_no_combine", [&](WeightOnlyCase& c) {
        c.lora_rank = 16, c.M = 70, c.options.no_combine = true, c.expect_path = kAligned;
      });
      add("lora_dense", [&](WeightOnlyCase& c) {
        c.lora_rank = 16, c.M = 80, c.options.weight_only_path = kDense, c.expect_path = kDense;
      });
      add("swiglu_oai", [](WeightOnlyCase& c) { c.options.activation = Activation::kSwigluOai; c.M = 7; });
      add("swiglu_oai_aligned", [&](WeightOnlyCase& c) {
        c.options.activation = Activation::kSwigluOai, c.M = 77, c.expect_path = kAligned;
      });
      add("gelu_dense", [&](WeightOnlyCase& c) {
        c.options.activation = Activation::kGelu, c.M = 70, c.options.weight_only_path = kDense, c.expect_path = kDense;
      });
      add("h2880_i1408_g64", [](WeightOnlyCase& c) {
        c.H = 2880, c.I = 1408, c.group_size = 64, c.num_global = c.num_local = 4, c.M = 3, c.zeros = Zeros::kBytes;
      });
      add("h1408_i2880_g32_aligned", [&](WeightOnlyCase& c) {
        c.H = 1408, c.I = 2880, c.group_size = 32, c.num_global = c.num_local = 4, c.M = 66, c.expect_path = kAligned;
      });
      add("h2880_i1408_g64_dense", [&](WeightOnlyCase& c) {
        c.H = 2880, c.I = 1408, c.group_size = 64, c.num_global = c.num_local = 4, c.M = 66,
        c.options.weight_only_path = kDense, c.expect_path = kDense;
      });
      // The sm90 tiles (blocks of 64 or 128 entries name them): every scale and zero-point
      // layout, gated split and interleaved, K % 64 == 32 and partial N tiles (1440 /
      // 1376), both tile heights, sorted input, expert_map.
      auto tiles = [&](const std::string& name, auto&& edit) {
        add("tiles_" + name, [&](WeightOnlyCase& c) {
          c.M = 300, c.options.weight_only_path = kDense, c.options.block_size = 64, c.expect_path = kDense;
          c.expect_tiles = true;
          edit(c);
        });
      };
      tiles("g128", [](WeightOnlyCase&) {});
      tiles("g32_zp", [](WeightOnlyCase& c) { c.group_size = 32, c.zeros = Zeros::kBytes; });
      tiles("g64_zp_packed_fp16", [&](WeightOnlyCase& c) {
        c.group_size = 64, c.zeros = bits == 4 ? Zeros::kPacked : Zeros::kBytes, c.dtype = DType::kFloat16;
      });
      tiles("channel_zp", [](WeightOnlyCase& c) { c.group_size = 0, c.zeros = Zeros::kBytes; });
      tiles("swiglu_oai_h1440_i1376_g32", [](WeightOnlyCase& c) {
        c.options.activation = Activation::kSwigluOai, c.H = 1440, c.I = 1376, c.group_size = 32;
        c.num_global = c.num_local = 4, c.M = 200;
      });
      tiles("gelu_h1376_i1440_zp", [](WeightOnlyCase& c) {
        c.options.activation = Activation::kGelu, c.H = 1376, c.I = 1440, c.group_size = 32, c.zeros = Zeros::kBytes;
        c.num_global = c.num_local = 4, c.M = 200;
      });
      tiles("block128", [](WeightOnlyCase& c) { c.options.block_size = 128, c.M = 700; });
      // Chunks of 300 tokens: the first on the tiles (75 slots an expert, blocks of 64), the
      // last (30 tokens, blocks of 16, no sm90 tiles) on the aligned kernels: the layout
      // holds no copies for it.
      add("tiles_then_aligned_chunk", [&](WeightOnlyCase& c) {
        c.M = 330, c.options.chunk_size = 300, c.zeros = Zeros::kBytes, c.expect_path = kDense, c.expect_tiles = true;
        c.aligned_without_tiles = true;
      });
      tiles("sorted_input", [](WeightOnlyCase& c) { c.options.block_size = 0, c.options.config = &kSortedInputTiles; });
      // With adapters the tiles take the fused LoRA expand (their consumers read lora_b).
      tiles("lora", [](WeightOnlyCase& c) { c.lora_rank = 16, c.zeros = Zeros::kBytes; });
      tiles("lora_gelu_h1376_i1440_g32", [](WeightOnlyCase& c) {
        c.options.activation = Activation::kGelu, c.H = 1376, c.I = 1440, c.group_size = 32, c.num_global = c.num_local = 4;
        c.M = 200, c.lora_rank = 16;
      });
      tiles("lora_swiglu_oai_rank8", [](WeightOnlyCase& c) {
        c.options.activation = Activation::kSwigluOai, c.lora_rank = 8;
      });
      // Blocks of 16 name no sm90 tiles: adapters on the dequantized copies (the bf16
      // kernels' fused LoRA expand).
      add("dense_lora_copies_block16", [&](WeightOnlyCase& c) {
        c.M = 300, c.options.weight_only_path = kDense, c.options.block_size = 16, c.expect_path = kDense;
        c.lora_rank = 16, c.zeros = Zeros::kBytes;
      });
      tiles("expert_map_no_combine", [](WeightOnlyCase& c) {
        c.num_global = 12, c.num_local = 5, c.dropped_share = 0.05, c.options.no_combine = true, c.top_k = 3;
      });
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Schemes, WeightOnlyTest, ::testing::ValuesIn(weight_only_cases()),
                         [](const auto& info) { return sanitized(info.param.name); });

// ---- bad input: a clear error naming the argument, nothing written --------------------

class WeightOnlyBackendTest : public ::testing::TestWithParam<Backend> {};

TEST_P(WeightOnlyBackendTest, RejectsBadArguments) {
  const Backend backend = GetParam();
  MOELORA_SKIP_UNLESS_AVAILABLE(backend);
  std::mt19937 rng(7);
  WeightOnlyCase c;
  c.backend = backend;
  c.zeros = Zeros::kBytes;
  c.name = "bad";
  WeightOnlyLayer layer(c, rng);
  Buffer wrong(backend, DType::kUInt8, 8 * 2 * 128 * 256);
  Buffer wrong_scales(backend, DType::kFloat32, 8 * 2 * 128 * 2);
  Buffer wide_zeros(backend, DType::kUInt8, 8 * 2 * 128 * 2);
  wide_zeros.write(wide_zeros.view({8 * 2 * 128 * 2}), std::vector<double>(8 * 2 * 128 * 2, 200.0));
  wide_zeros.upload();
  auto expect_error = [&](const std::string& what, const std::function<void(FusedExpertsArgs&)>& edit,
                          const std::string& needle) {
    FusedExpertsArgs a = layer.args();
    edit(a);
    const std::string message = error_message([&] { fused_experts(a, c.options); });
    EXPECT_THAT(message, HasSubstr(needle)) << what;
    layer.io.out.download();
    EXPECT_EQ(layer.io.out.count_written(), 0) << what << ": out was written";
  };
  expect_error("packed K", [&](FusedExpertsArgs& a) { a.w13 = wrong.view({8, 256, 256}); }, "'w13'");
  expect_error("w2 packed K", [&](FusedExpertsArgs& a) { a.w2 = wrong.view({8, 256, 128}); }, "'w2'");
  expect_error("w13 int8", [&](FusedExpertsArgs& a) { a.w13.dtype = DType::kInt8; }, "'w13'");
  expect_error("scale dtype", [&](FusedExpertsArgs& a) {
    layer.quant.w13_scale = wrong_scales.view({8, 256, 2});
  }, "'w13_scale'");
  expect_error("scale groups", [&](FusedExpertsArgs& a) {
    (void)a;
    layer.quant.w13_scale = layer.w13.scales.view({8, 256, 1});
  }, "'w13_scale'");
  expect_error("group divides K", [&](FusedExpertsArgs& a) {
    (void)a;
    layer.quant.scheme.group_size = layer.quant.scheme.block_k = 96;
  }, "group_size");
  expect_error("zeros missing", [&](FusedExpertsArgs& a) { (void)a; layer.quant.w2_zero = nullptr; }, "'w2_zero'");
  expect_error("zeros without the scheme", [&](FusedExpertsArgs& a) {
    (void)a;
    layer.quant.scheme.zero_points = false;
  }, "'w13_zero'");
  TensorView bad_zero;  // outlives the call
  expect_error("zeros shape", [&](FusedExpertsArgs& a) {
    (void)a;
    layer.quant.w13_zero = &(bad_zero = wide_zeros.view({8, 100, 2}));
  }, "'w13_zero'");
  if (backend == Backend::kCPU) {
    // 4-bit zero points one a byte above 15: a packed tensor passed as unpacked.
    expect_error("zero values", [&](FusedExpertsArgs& a) {
      (void)a;
      layer.quant.w13_zero = &(bad_zero = wide_zeros.view({8, 256, 2}));
    }, "[0, 15]");
  } else {
    // The CUDA kernels' 16-byte chunks: H a multiple of 32.
    WeightOnlyCase odd = c;
    odd.H = 240;
    odd.group_size = 0;
    WeightOnlyLayer small(odd, rng);
    const std::string message = error_message([&] { fused_experts(small.args(), odd.options); });
    EXPECT_THAT(message, HasSubstr("multiples of 32"));
    small.io.out.download();
    EXPECT_EQ(small.io.out.count_written(), 0);
    // x's rows in 16-byte chunks on every CUDA path: rows 4 elements apart past the
    // decode kernels (M = 100, the aligned kernels) are refused before anything runs.
    WeightOnlyCase many = c;
    many.M = 100;
    WeightOnlyLayer past_decode(many, rng);
    Buffer wide_x(backend, many.dtype, many.M * (many.H + 4));
    FusedExpertsArgs strided = past_decode.args();
    strided.hidden_states = wide_x.view({many.M, many.H}, {many.H + 4, 1});
    const std::string strided_message = error_message([&] { fused_experts(strided, many.options); });
    EXPECT_THAT(strided_message, HasSubstr("'hidden_states'"));
    EXPECT_THAT(strided_message, HasSubstr("16-byte"));
    past_decode.io.out.download();
    EXPECT_EQ(past_decode.io.out.count_written(), 0);
    // The kernels step through a row's groups with 32-bit offsets.
    expect_error("scale K stride", [&](FusedExpertsArgs& a) {
      (void)a;
      layer.quant.w13_scale.strides[2] = int64_t(1) << 30;
    }, "stride along K / group_size");
  }
  // A scheme of the wrong kind: a group size the kernels do not take.
  EXPECT_THAT(error_message([] { make_weight_only_scheme(QuantMethod::kW4A16, 48); }), HasSubstr("group_size"));
  EXPECT_THAT(error_message([] { make_quant_scheme(QuantMethod::kW8A16); }), HasSubstr("weight-only"));
}

// The dequantized copies are a speed-up: a workspace with room for everything but them
// (the lean layout) runs the call, the chunks that would read them on the aligned kernels
// (CUDA) or the packed experts (CPU); one word less is refused, naming both sizes.
TEST_P(WeightOnlyBackendTest, RunsInAWorkspaceWithoutRoomForTheCopies) {
  const Backend backend = GetParam();
  MOELORA_SKIP_UNLESS_AVAILABLE(backend);
  std::mt19937 rng(11);
  WeightOnlyCase c;  // adapters on the dense path: the full layout holds copies
  c.backend = backend;
  c.lora_rank = 16;
  c.M = 80;
  c.zeros = Zeros::kBytes;
  c.options.weight_only_path = WeightOnlyPath::kDense;
  c.name = "lean";
  WeightOnlyLayer layer(c, rng);
  const detail::WorkspaceLayout full = detail::workspace_layout(layer.shape(), c.options);
  const detail::WorkspaceLayout lean = detail::workspace_layout(layer.shape(), c.options, /*with_copies=*/false);
  ASSERT_TRUE(full.weight_only_copies);
  ASSERT_FALSE(lean.weight_only_copies);
  ASSERT_LT(lean.total, full.total);
  Buffer workspace(backend, DType::kFloat32, lean.total / 4);
  workspace.poison();
  FusedExpertsArgs args = layer.args();
  args.workspace = workspace.view({lean.total / 4});
  TestStream stream(backend);
  fused_experts(args, c.options, stream.handle());
  stream.sync();
  layer.io.out.download();
  const TensorView ov = layer.io.out.view({c.M, c.H});
  EXPECT_LE(ref::rel_error(layer.io.out.read(ov), layer.reference()), ref::tolerance(c.dtype));
  EXPECT_EQ(layer.io.out.count_unwritten(ov), 0);
  args.workspace = workspace.view({lean.total / 4 - 1});
  const std::string message = error_message([&] { fused_experts(args, c.options); });
  EXPECT_THAT(message, HasSubstr("'workspace'"));
  EXPECT_THAT(message, HasSubstr(std::to_string(lean.total)));
  EXPECT_THAT(message, HasSubstr(std::to_string(full.total)));
}

// Copies only as large as dequantize_experts indexes (2^34 weights a stack): past that the
// layout reserves none, so the chunks are planned onto the packed experts before anything
// is written. Blocks of 16 name no sm90 tiles, so the smaller stack has copies on any device.
TEST(WeightOnlyLayout, ReservesNoCopiesPastTheDequantizeIndexRange) {
  FusedExpertsOptions options;
  options.weight_only_path = WeightOnlyPath::kDense;
  options.block_size = 16;
  auto layout = [&](int64_t experts) {
    FusedExpertsShape shape{/*num_tokens=*/64, /*top_k=*/2, experts, /*hidden_size=*/8192, /*intermediate_size=*/8192,
                            DType::kBFloat16};
    shape.quant = make_weight_only_scheme(QuantMethod::kW4A16, 128, false);
    return detail::workspace_layout(shape, options);
  };
  const detail::WorkspaceLayout largest = layout(128);  // 128 x 2 x 8192 x 8192 = 2^34 weights
  EXPECT_TRUE(largest.weight_only_copies);
  EXPECT_GE(largest.total, int64_t(3) << 34) << "both stacks' bf16 copies: 48 GB";
  const detail::WorkspaceLayout past = layout(129);
  EXPECT_TRUE(past.weight_only_dense);
  EXPECT_FALSE(past.weight_only_copies);
  EXPECT_LT(past.total, largest.total);
}

INSTANTIATE_TEST_SUITE_P(Backends, WeightOnlyBackendTest, ::testing::ValuesIn(all_backends()),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

}  // namespace
}  // namespace moelora::test
