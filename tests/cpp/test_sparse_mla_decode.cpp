// sparse_mla_decode against the float64 reference: masked, duplicated and all-masked
// indices, S below topk, topk_length, attention sinks, the LSE, forced and automatic
// split counts, strided views; rejected arguments; one CUDA graph for every input.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/params.h"
#include "test_util.h"

namespace moelora::test {
namespace {

using ::testing::HasSubstr;

constexpr int64_t D = kMlaHeadDim, DV = kMlaValueDim;

enum class Indices { kRandom, kMasked, kDuplicates, kAllMaskedRows };

struct MlaCase {
  std::string name;
  Backend backend;
  int64_t T, Hq, S, topk;
  Indices pattern = Indices::kRandom;
  int num_splits = 0;  // 0: the device's choice
  bool padded = false;
  bool q_broadcast = false;  // one q row for all heads of a token (head stride 0)
  bool with_lse = false;
  bool with_length = false;
  bool with_sink = false;
  double scale = 1.0 / 24.0;  // 1/sqrt(576): logits of std ~1 for normal(0, 1) data
  int cta_smem_limit = 0;     // CUDA: the plan of a part whose CTA has this much shared memory
};

// An A100's CTA: the sm_80 plans (one-stage mma.sync CTAs, no wgmma) on any device.
constexpr int kA100CtaSmem = 166912;

// Sets the shared-memory limit of the CUDA kernel plans for one scope.
class CtaSmemLimit {
 public:
  explicit CtaSmemLimit(int bytes) : active_(bytes > 0) {
#ifdef MOELORA_WITH_CUDA
    if (active_) moelora::cuda::set_cta_smem_limit(bytes);
#endif
  }
  ~CtaSmemLimit() {
#ifdef MOELORA_WITH_CUDA
    if (active_) moelora::cuda::set_cta_smem_limit(0);
#endif
  }
  CtaSmemLimit(const CtaSmemLimit&) = delete;
  CtaSmemLimit& operator=(const CtaSmemLimit&) = delete;

 private:
  bool active_;
};

void PrintTo(const MlaCase& c, std::ostream* os) { *os << c.name; }

// indices [T, topk] of a pattern: kMasked mixes in -1, -7, S and S + 3 (a quarter of the
// entries); kDuplicates draws from 5 rows only; kAllMaskedRows masks every third token.
std::vector<int64_t> make_indices(const MlaCase& c, std::mt19937& rng) {
  std::uniform_int_distribution<int64_t> row(0, c.S - 1), few(0, std::min<int64_t>(4, c.S - 1)), coin(0, 3);
  const int64_t masked[4] = {-1, -7, c.S, c.S + 3};
  std::vector<int64_t> indices(size_t(c.T * c.topk));
  for (int64_t t = 0; t < c.T; ++t) {
    for (int64_t i = 0; i < c.topk; ++i) {
      int64_t& v = indices[size_t(t * c.topk + i)];
      switch (c.pattern) {
        case Indices::kRandom: v = row(rng); break;
        case Indices::kMasked: v = coin(rng) == 0 ? masked[coin(rng)] : row(rng); break;
        case Indices::kDuplicates: v = few(rng); break;
        case Indices::kAllMaskedRows: v = t % 3 == 1 ? masked[coin(rng)] : row(rng); break;
      }
    }
  }
  return indices;
}

class SparseMlaDecodeTest : public ::testing::TestWithParam<MlaCase> {};

TEST_P(SparseMlaDecodeTest, MatchesReference) {
  const MlaCase& c = GetParam();
  MOELORA_SKIP_UNLESS_AVAILABLE(c.backend);
  const CtaSmemLimit smem_limit(c.cta_smem_limit);
  std::mt19937 rng(std::hash<std::string>{}(c.name));
  // padded: q heads 640 apart and tokens 8 more; kv rows 584 apart; out heads 514 apart.
  const int64_t q_head = c.padded ? D + 64 : D, q_token = c.padded ? c.Hq * q_head + 8 : c.Hq * q_head;
  const int64_t kv_row = c.padded ? D + 8 : D;
  const int64_t out_head = c.padded ? DV + 2 : DV, out_token = c.padded ? c.Hq * out_head + 4 : c.Hq * out_head;
  Buffer q(c.backend, DType::kBFloat16, std::max<int64_t>(1, c.T * q_token));
  Buffer kv(c.backend, DType::kBFloat16, std::max<int64_t>(1, c.S * kv_row));
  Buffer indices(c.backend, DType::kInt32, std::max<int64_t>(1, c.T * c.topk));
  Buffer out(c.backend, DType::kBFloat16, std::max<int64_t>(1, c.T * out_token));
  Buffer lse(c.backend, DType::kFloat32, std::max<int64_t>(1, c.T * c.Hq));
  Buffer length(c.backend, DType::kInt32, std::max<int64_t>(1, c.T));
  Buffer sink(c.backend, DType::kFloat32, c.Hq);
  const TensorView q_view = q.view({c.T, c.Hq, D}, {q_token, c.q_broadcast ? 0 : q_head, 1});
  const TensorView kv_view = kv.view({c.S, 1, D}, {kv_row, kv_row, 1});
  const TensorView indices_view = indices.view({c.T, 1, c.topk});
  const TensorView out_view = out.view({c.T, c.Hq, DV}, {out_token, out_head, 1});
  const TensorView lse_view = lse.view({c.T, c.Hq});
  const TensorView length_view = length.view({c.T});
  const TensorView sink_view = sink.view({c.Hq});

  std::vector<double> q_values = q.fill_normal(q_view, rng);
  if (c.q_broadcast) q_values = q.read(q_view);  // the last value written to each shared row
  const std::vector<double> kv_values = kv.fill_normal(kv_view, rng);
  const std::vector<int64_t> index_values = make_indices(c, rng);
  for (size_t i = 0; i < index_values.size(); ++i) indices.set(int64_t(i), double(index_values[i]));
  std::vector<int64_t> length_values(size_t(c.T));
  std::uniform_int_distribution<int64_t> length_draw(-2, c.topk + 5);  // clamped to [0, topk]
  for (int64_t t = 0; t < c.T; ++t) length.set(t, double(length_values[size_t(t)] = length_draw(rng)));
  std::vector<double> sink_values(size_t(c.Hq));
  std::normal_distribution<double> sink_draw(2.0, 2.0);  // comparable to log Σ e^s
  for (int64_t h = 0; h < c.Hq; ++h) sink.set(h, sink_values[size_t(h)] = double(float(sink_draw(rng))));
  q.upload();
  kv.upload();
  indices.upload();
  length.upload();
  sink.upload();
  out.poison();
  lse.poison();

  const Device device = device_of(c.backend);
  const int64_t workspace_bytes = sparse_mla_decode_workspace_size(c.T, c.Hq, c.topk, device, c.num_splits);
  Buffer workspace(c.backend, DType::kFloat32, std::max<int64_t>(64, workspace_bytes / 4));
  workspace.poison();  // the merge must read only what the splits wrote
  SparseMlaDecodeArgs args;
  args.q = q_view;
  args.kv = kv_view;
  args.indices = indices_view;
  args.out = out_view;
  args.workspace = workspace.view({workspace.size()});
  args.softmax_scale = float(c.scale);
  args.lse = c.with_lse ? &lse_view : nullptr;
  args.topk_length = c.with_length ? &length_view : nullptr;
  args.attn_sink = c.with_sink ? &sink_view : nullptr;
  args.num_splits = c.num_splits;
  TestStream stream(c.backend);
  sparse_mla_decode(args, stream.handle());
  stream.sync();
  out.download();
  lse.download();

  std::vector<double> expected_lse;
  const std::vector<double> expected = ref::reference_sparse_mla_decode(
      q_values, kv_values, index_values, c.T, c.Hq, c.S, c.topk, double(float(c.scale)),
      c.with_length ? &length_values : nullptr, c.with_sink ? &sink_values : nullptr, &expected_lse);
  const std::vector<double> got = out.read(out_view);
  EXPECT_LE(ref::rel_error(got, expected), 1e-2) << "splits " << sparse_mla_decode_num_splits(c.T, c.Hq, c.topk, device, c.num_splits);
  EXPECT_EQ(out.count_unwritten(out_view), 0);
  EXPECT_EQ(out.count_written_outside(out_view), 0);
  // A (token, head) with no valid entry: exact zeros, and lse -inf.
  int64_t empty_rows = 0;
  for (int64_t th = 0; th < c.T * c.Hq; ++th) {
    if (expected_lse[size_t(th)] != -std::numeric_limits<double>::infinity()) continue;
    ++empty_rows;
    for (int64_t d = 0; d < DV; ++d) ASSERT_EQ(got[size_t(th * DV + d)], 0.0) << "row " << th << " lane " << d;
  }
  if (c.pattern == Indices::kAllMaskedRows && c.T > 1) EXPECT_GT(empty_rows, 0);
  if (c.with_lse) {
    const std::vector<double> got_lse = lse.read(lse_view);
    std::vector<double> finite_got, finite_expected;
    for (size_t i = 0; i < got_lse.size(); ++i) {
      if (std::isinf(expected_lse[i])) {
        EXPECT_EQ(got_lse[i], expected_lse[i]) << "lse " << i;
      } else {
        finite_got.push_back(got_lse[i]);
        finite_expected.push_back(expected_lse[i]);
      }
    }
    EXPECT_LE(ref::rel_error(finite_got, finite_expected), 1e-3);
  } else {
    EXPECT_EQ(lse.count_written(), 0);
  }
}

std::vector<MlaCase> mla_cases() {
  std::vector<MlaCase> cases;
  for (Backend backend : all_backends()) {
    const std::string prefix = std::string(backend_name(backend)) + "_";
    auto add = [&](MlaCase c) {
      c.name = prefix + c.name;
      c.backend = backend;
      cases.push_back(c);
    };
    // Every Hq the kernels tile differently (16 / 32 / 64 heads a CTA), odd ones included.
    add({.name = "T1_Hq16_topk64", .T = 1, .Hq = 16, .S = 500, .topk = 64});
    add({.name = "T2_Hq128_topk128_lse", .T = 2, .Hq = 128, .S = 300, .topk = 128, .with_lse = true});
    add({.name = "T3_Hq64_topk192_sink_lse", .T = 3, .Hq = 64, .S = 1000, .topk = 192, .with_lse = true,
         .with_sink = true});
    add({.name = "T5_Hq32_masked_lse", .T = 5, .Hq = 32, .S = 400, .topk = 128, .pattern = Indices::kMasked,
         .with_lse = true});
    add({.name = "T4_Hq8_duplicates", .T = 4, .Hq = 8, .S = 64, .topk = 64, .pattern = Indices::kDuplicates});
    add({.name = "T6_Hq20_allmasked_sink_lse", .T = 6, .Hq = 20, .S = 256, .topk = 64,
         .pattern = Indices::kAllMaskedRows, .with_lse = true, .with_sink = true});
    add({.name = "T3_Hq48_S_below_topk", .T = 3, .Hq = 48, .S = 40, .topk = 128, .pattern = Indices::kMasked});
    add({.name = "T7_Hq16_topk100_tail", .T = 7, .Hq = 16, .S = 300, .topk = 100, .with_lse = true});
    add({.name = "T4_Hq16_length_lse", .T = 4, .Hq = 16, .S = 300, .topk = 256, .with_lse = true,
         .with_length = true});
    add({.name = "T2_Hq64_padded_sink", .T = 2, .Hq = 64, .S = 200, .topk = 64, .padded = true, .with_sink = true});
    add({.name = "T3_Hq16_peaked", .T = 3, .Hq = 16, .S = 200, .topk = 128, .scale = 0.25});
    add({.name = "T1_Hq1", .T = 1, .Hq = 1, .S = 100, .topk = 64});
    add({.name = "T2_Hq32_topk128_qbroadcast", .T = 2, .Hq = 32, .S = 300, .topk = 128, .q_broadcast = true});
    add({.name = "T0", .T = 0, .Hq = 16, .S = 100, .topk = 64});
    if (backend == Backend::kCUDA) {
      // Split counts: forced (1, 3, every key block its own split) and chosen; large T.
      add({.name = "T1_Hq128_topk2048_auto_lse", .T = 1, .Hq = 128, .S = 8192, .topk = 2048, .with_lse = true});
      add({.name = "T1_Hq16_topk2048_auto_sink", .T = 1, .Hq = 16, .S = 4096, .topk = 2048, .with_sink = true});
      add({.name = "T8_Hq64_topk512_auto_length_lse", .T = 8, .Hq = 64, .S = 2000, .topk = 512, .with_lse = true,
           .with_length = true});
      add({.name = "T5_Hq32_topk640_split3_masked_lse", .T = 5, .Hq = 32, .S = 500, .topk = 640,
           .pattern = Indices::kMasked, .num_splits = 3, .with_lse = true});
      add({.name = "T6_Hq16_topk512_split8_allmasked_sink_lse", .T = 6, .Hq = 16, .S = 300, .topk = 512,
           .pattern = Indices::kAllMaskedRows, .num_splits = 8, .with_lse = true, .with_sink = true});
      add({.name = "T2_Hq128_topk256_split1_padded_lse", .T = 2, .Hq = 128, .S = 700, .topk = 256, .num_splits = 1,
           .padded = true, .with_lse = true});
      add({.name = "T3_Hq64_topk300_split64_length_sink_lse", .T = 3, .Hq = 64, .S = 900, .topk = 300,
           .num_splits = 64, .with_lse = true, .with_length = true, .with_sink = true});
      add({.name = "T2_Hq16_topk4096_auto", .T = 2, .Hq = 16, .S = 20000, .topk = 4096});
      // Many splits of few heads and tokens (the mma.sync kernel): 16 with lengths (splits
      // with no key), 6 of 32-head CTAs, 32 with all-masked tokens.
      add({.name = "T1_Hq64_topk2048_split16_length_sink_lse", .T = 1, .Hq = 64, .S = 9000, .topk = 2048,
           .num_splits = 16, .with_lse = true, .with_length = true, .with_sink = true});
      add({.name = "T2_Hq128_topk1024_split6_masked_length_lse", .T = 2, .Hq = 128, .S = 3000, .topk = 1024,
           .pattern = Indices::kMasked, .num_splits = 6, .with_lse = true, .with_length = true});
      add({.name = "T2_Hq20_topk2048_split32_allmasked_sink_lse", .T = 2, .Hq = 20, .S = 5000, .topk = 2048,
           .pattern = Indices::kAllMaskedRows, .num_splits = 32, .with_lse = true, .with_sink = true});
      add({.name = "T300_Hq16_topk128_lse", .T = 300, .Hq = 16, .S = 5000, .topk = 128, .with_lse = true});
      add({.name = "T64_Hq128_topk128_masked_sink", .T = 64, .Hq = 128, .S = 3000, .topk = 128,
           .pattern = Indices::kMasked, .with_sink = true});
      add({.name = "T40_Hq64_topk192_duplicates_padded", .T = 40, .Hq = 64, .S = 100, .topk = 192,
           .pattern = Indices::kDuplicates, .padded = true});
      // Enough CTAs for two 16-head CTAs an SM (the one-stage kernel): several blocks a
      // split with masking, lengths and sinks; fewer heads than a tile, padded strides.
      add({.name = "T40_Hq16_topk640_split3_masked_length_sink_lse", .T = 40, .Hq = 16, .S = 700, .topk = 640,
           .pattern = Indices::kMasked, .num_splits = 3, .with_lse = true, .with_length = true, .with_sink = true});
      add({.name = "T45_Hq8_topk512_duplicates_padded", .T = 45, .Hq = 8, .S = 90, .topk = 512,
           .pattern = Indices::kDuplicates, .padded = true});
      // Enough CTAs for 64-head groups (the wgmma kernel on sm_90a): many block pairs in
      // one split, a partial head group (Hq 96) with odd and empty splits, and one-pass
      // epilogues with sinks and all-masked rows.
      add({.name = "T34_Hq128_topk1024_split1_lse", .T = 34, .Hq = 128, .S = 30000, .topk = 1024, .num_splits = 1,
           .with_lse = true});
      add({.name = "T70_Hq96_topk640_split3_masked_length_sink_lse", .T = 70, .Hq = 96, .S = 900, .topk = 640,
           .pattern = Indices::kMasked, .num_splits = 3, .with_lse = true, .with_length = true, .with_sink = true});
      add({.name = "T40_Hq128_topk512_peaked_lse", .T = 40, .Hq = 128, .S = 4000, .topk = 512, .with_lse = true,
           .scale = 0.25});  // logits of std ~6: the row max jumps past the lazy-rescale slack
      add({.name = "T66_Hq64_topk256_split1_allmasked_sink_lse", .T = 66, .Hq = 64, .S = 500, .topk = 256,
           .pattern = Indices::kAllMaskedRows, .num_splits = 1, .with_lse = true, .with_sink = true});
      // One pass with rows past Hq in the CTA's head group: they join the quad transposes
      // of out's stores and store nothing (a 64-head group of 16 heads; a 16-head tile of 8).
      add({.name = "T70_Hq80_topk384_split1_sink", .T = 70, .Hq = 80, .S = 2000, .topk = 384, .num_splits = 1,
           .with_sink = true});
      add({.name = "T45_Hq8_topk512_split1_masked_lse", .T = 45, .Hq = 8, .S = 900, .topk = 512,
           .pattern = Indices::kMasked, .num_splits = 1, .with_lse = true});
      // The persistent wgmma CTAs take items in turn (300 items, 2-3 a CTA): odd pair counts,
      // items with no key (topk_length 0) between items with keys.
      add({.name = "T300_Hq64_topk192_split1_length_sink_lse", .T = 300, .Hq = 64, .S = 5000, .topk = 192,
           .num_splits = 1, .with_lse = true, .with_length = true, .with_sink = true});
      // A head stride of 0 (every head reads one q row) on the wgmma kernel: one pass and splits.
      add({.name = "T40_Hq128_topk512_split1_qbroadcast_lse", .T = 40, .Hq = 128, .S = 3000, .topk = 512,
           .num_splits = 1, .q_broadcast = true, .with_lse = true});
      add({.name = "T8_Hq64_topk1024_auto_qbroadcast_padded_sink", .T = 8, .Hq = 64, .S = 3000, .topk = 1024,
           .padded = true, .q_broadcast = true, .with_sink = true});
      // Rows enough for the warp-per-half-row merge (T x Hq > 16 x the SMs): 2 splits,
      // out rows 4-byte aligned, lse, sinks, lengths.
      add({.name = "T48_Hq64_topk1024_split2_padded_length_sink_lse", .T = 48, .Hq = 64, .S = 3000, .topk = 1024,
           .num_splits = 2, .padded = true, .with_lse = true, .with_length = true, .with_sink = true});
      // The sm_80 plans, as an A100's CTA (163 KB) gets them: one-stage CTAs of 16, 32 and
      // 64 heads, one pass and splits, masking, lengths, sinks, all-masked rows, strides.
      add({.name = "A100_T1_Hq128_topk2048_auto_lse", .T = 1, .Hq = 128, .S = 8192, .topk = 2048,
           .with_lse = true, .cta_smem_limit = kA100CtaSmem});
      add({.name = "A100_T1_Hq16_topk1024_auto_sink", .T = 1, .Hq = 16, .S = 4096, .topk = 1024,
           .with_sink = true, .cta_smem_limit = kA100CtaSmem});
      add({.name = "A100_T8_Hq64_topk512_auto_length_lse", .T = 8, .Hq = 64, .S = 2000, .topk = 512,
           .with_lse = true, .with_length = true, .cta_smem_limit = kA100CtaSmem});
      add({.name = "A100_T5_Hq32_topk640_split3_masked_lse", .T = 5, .Hq = 32, .S = 500, .topk = 640,
           .pattern = Indices::kMasked, .num_splits = 3, .with_lse = true, .cta_smem_limit = kA100CtaSmem});
      add({.name = "A100_T40_Hq128_topk512_split1_masked_sink_lse", .T = 40, .Hq = 128, .S = 4000, .topk = 512,
           .pattern = Indices::kMasked, .num_splits = 1, .with_lse = true, .with_sink = true,
           .cta_smem_limit = kA100CtaSmem});
      add({.name = "A100_T70_Hq96_topk640_split3_allmasked_length_sink_lse", .T = 70, .Hq = 96, .S = 900,
           .topk = 640, .pattern = Indices::kAllMaskedRows, .num_splits = 3, .with_lse = true, .with_length = true,
           .with_sink = true, .cta_smem_limit = kA100CtaSmem});
      add({.name = "A100_T64_Hq16_topk512_auto_padded_lse", .T = 64, .Hq = 16, .S = 3000, .topk = 512,
           .padded = true, .with_lse = true, .cta_smem_limit = kA100CtaSmem});
      add({.name = "A100_T40_Hq32_topk192_duplicates_padded", .T = 40, .Hq = 32, .S = 100, .topk = 192,
           .pattern = Indices::kDuplicates, .padded = true, .cta_smem_limit = kA100CtaSmem});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, SparseMlaDecodeTest, ::testing::ValuesIn(mla_cases()),
                         [](const auto& info) { return info.param.name; });

// ---- rejected arguments --------------------------------------------------------------

class SparseMlaDecodeArgsTest : public ::testing::TestWithParam<Backend> {};

TEST_P(SparseMlaDecodeArgsTest, RejectsBadArguments) {
  const Backend backend = GetParam();
  MOELORA_SKIP_UNLESS_AVAILABLE(backend);
  const int64_t T = 2, Hq = 16, S = 64, topk = 64;
  Buffer q(backend, DType::kBFloat16, T * Hq * D + 8);
  Buffer kv(backend, DType::kBFloat16, S * D);
  Buffer indices(backend, DType::kInt32, T * topk);
  Buffer out(backend, DType::kBFloat16, T * Hq * DV + 2);
  Buffer fp32(backend, DType::kFloat32, T * Hq * D);
  Buffer workspace(backend, DType::kFloat32, 64);
  out.poison();
  auto good = [&] {
    SparseMlaDecodeArgs a;
    a.q = q.view({T, Hq, D});
    a.kv = kv.view({S, 1, D});
    a.indices = indices.view({T, 1, topk});
    a.out = out.view({T, Hq, DV});
    a.workspace = workspace.view({64});
    a.softmax_scale = 0.04f;
    return a;
  };
  auto message = [&](const SparseMlaDecodeArgs& a) { return error_message([&] { sparse_mla_decode(a); }); };

  SparseMlaDecodeArgs a = good();
  a.q = fp32.view({T, Hq, D});
  EXPECT_THAT(message(a), HasSubstr("'q' expected dtype bfloat16"));
  a = good();
  a.q = q.view({T, Hq, 512});
  EXPECT_THAT(message(a), HasSubstr("'q' expected size 576 on dim 2"));
  a = good();
  a.q = q.view({T, Hq, D}, {Hq * D, D, 1}, 1);  // rows 2 bytes off
  EXPECT_THAT(message(a), HasSubstr("'q' expected data 16-byte aligned"));
  a = good();
  a.q = q.view({T, 8, D}, {Hq * D, D + 4, 1});
  EXPECT_THAT(message(a), HasSubstr("'q' expected strides of whole 16-byte units"));
  Buffer big_q(backend, DType::kBFloat16, 129 * D);
  a = good();
  a.q = big_q.view({1, 129, D});
  EXPECT_THAT(message(a), HasSubstr("'q' expected 1 to 128 heads"));
  a = good();
  a.kv = kv.view({S / 2, 2, D});
  EXPECT_THAT(message(a), HasSubstr("'kv' expected size 1 on dim 1"));
  a = good();
  a.indices = fp32.view({T, 1, topk});
  EXPECT_THAT(message(a), HasSubstr("'indices' expected dtype int32"));
  a = good();
  a.indices = indices.view({T - 1, 1, topk});
  EXPECT_THAT(message(a), HasSubstr("'indices' expected size 2 on dim 0 (tokens of 'q')"));
  a = good();
  a.out = out.view({T, Hq, DV}, {Hq * DV, DV, 1}, 1);
  EXPECT_THAT(message(a), HasSubstr("'out' expected data 4-byte aligned"));
  a = good();
  a.out = out.view({T, Hq, 256});
  EXPECT_THAT(message(a), HasSubstr("'out' expected size 512 on dim 2"));
  a = good();
  const TensorView lse_wrong = fp32.view({T, Hq + 1});
  a.lse = &lse_wrong;
  EXPECT_THAT(message(a), HasSubstr("'lse' expected size 16 on dim 1 (heads of 'q')"));
  a = good();
  const TensorView length_wrong = fp32.view({T});
  a.topk_length = &length_wrong;
  EXPECT_THAT(message(a), HasSubstr("'topk_length' expected dtype int32"));
  a = good();
  const TensorView sink_wrong = fp32.view({Hq - 1});
  a.attn_sink = &sink_wrong;
  EXPECT_THAT(message(a), HasSubstr("'attn_sink' expected size 16 on dim 0 (heads of 'q')"));
  a = good();
  a.softmax_scale = 0.0f;
  EXPECT_THAT(message(a), HasSubstr("'softmax_scale' expected a finite value > 0"));
  a = good();
  a.num_splits = 65;
  EXPECT_THAT(message(a), HasSubstr("'num_splits' expected 0 (auto) or a value in [1, 64]"));
  a = good();
  a.kv.device = other_device(backend);
  EXPECT_THAT(message(a), HasSubstr("'kv' expected device"));
  if (backend == Backend::kCUDA) {
    // topk 64 is one key block: never more than one split
    EXPECT_EQ(sparse_mla_decode_num_splits(T, Hq, topk, device_of(backend), 4), 1);
    Buffer long_indices(backend, DType::kInt32, T * 1024);
    a = good();
    a.indices = long_indices.view({T, 1, 1024});
    a.num_splits = 4;
    EXPECT_THAT(message(a), HasSubstr("'workspace' expected at least"));
    // A part whose CTA has less shared memory than the smallest plan (99 KB: sm_86 / sm_89)
    // is told so, by the workspace query and the op.
    const CtaSmemLimit small_part(101376);
    const std::string needs = "bytes of shared memory a CTA; this device";
    EXPECT_THAT(error_message([&] { sparse_mla_decode_workspace_size(T, Hq, 1024, device_of(backend)); }),
                HasSubstr(needs));
    EXPECT_THAT(message(good()), HasSubstr(needs));
  }
  // Nothing was written by a rejected call.
  out.download();
  EXPECT_EQ(out.count_written(), 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, SparseMlaDecodeArgsTest, ::testing::ValuesIn(all_backends()),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

// ---- one captured CUDA graph serves new data -------------------------------------------

#ifdef MOELORA_WITH_CUDA
TEST(SparseMlaDecodeGraphTest, OneGraphServesEveryInput) {
  MOELORA_SKIP_UNLESS_AVAILABLE(Backend::kCUDA);
  const Backend backend = Backend::kCUDA;
  const int64_t T = 3, Hq = 64, S = 1500, topk = 512;
  std::mt19937 rng(7);
  Buffer q(backend, DType::kBFloat16, T * Hq * D), kv(backend, DType::kBFloat16, S * D);
  Buffer indices(backend, DType::kInt32, T * topk), length(backend, DType::kInt32, T);
  Buffer out(backend, DType::kBFloat16, T * Hq * DV), lse(backend, DType::kFloat32, T * Hq);
  const Device device = device_of(backend);
  const int splits = sparse_mla_decode_num_splits(T, Hq, topk, device);
  EXPECT_GT(splits, 1);  // the graph holds the split and merge kernels
  Buffer workspace(backend, DType::kFloat32, sparse_mla_decode_workspace_size(T, Hq, topk, device) / 4);
  const TensorView lse_view = lse.view({T, Hq}), length_view = length.view({T});
  SparseMlaDecodeArgs args;
  args.q = q.view({T, Hq, D});
  args.kv = kv.view({S, 1, D});
  args.indices = indices.view({T, 1, topk});
  args.out = out.view({T, Hq, DV});
  args.workspace = workspace.view({workspace.size()});
  args.softmax_scale = 1.0f / 24.0f;
  args.lse = &lse_view;
  args.topk_length = &length_view;

  cudaStream_t stream;
  MOELORA_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  MOELORA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  sparse_mla_decode(args, stream);
  MOELORA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < 3; ++round) {
    const std::vector<double> q_values = q.fill_normal(args.q, rng);
    const std::vector<double> kv_values = kv.fill_normal(args.kv, rng);
    std::uniform_int_distribution<int64_t> row(-50, S + 50), len(0, topk);
    std::vector<int64_t> index_values(static_cast<size_t>(T * topk)), length_values(static_cast<size_t>(T));
    for (size_t i = 0; i < index_values.size(); ++i) indices.set(int64_t(i), double(index_values[i] = row(rng)));
    for (int64_t t = 0; t < T; ++t) length.set(t, double(length_values[size_t(t)] = round == 2 ? topk : len(rng)));
    q.upload();
    kv.upload();
    indices.upload();
    length.upload();
    out.poison();
    MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOELORA_CUDA_CHECK(cudaStreamSynchronize(stream));
    out.download();
    std::vector<double> expected_lse;
    const std::vector<double> expected = ref::reference_sparse_mla_decode(
        q_values, kv_values, index_values, T, Hq, S, topk, 1.0 / 24.0, &length_values, nullptr, &expected_lse);
    EXPECT_LE(ref::rel_error(out.read(args.out), expected), 1e-2) << "round " << round;
  }
  MOELORA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOELORA_CUDA_CHECK(cudaGraphDestroy(graph));
  MOELORA_CUDA_CHECK(cudaStreamDestroy(stream));
}
#endif

}  // namespace
}  // namespace moelora::test
