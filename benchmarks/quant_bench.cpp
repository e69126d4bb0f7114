// quant_bench: the MoE layer (fused_experts) on 8-bit experts (issue 28, W8A8): fp8 e4m3
// or int8 weights with fp32 scales, bf16 activations the layer quantizes itself, at the
// brief's model shapes. Times every (model, M, scheme) cell, checks it against a float64
// reference and prints time, achieved bandwidth and 8-bit FLOP rate against the floor.
//
//   quant_bench [--model NAME[,NAME...]|all] [--tokens M[,M...]] [--scheme S[,S...]]
//               [--static-act] [--device auto|cpu|cuda] [--iters N] [--no-check]
//               [--check-tokens N] [--ceilings] [--json PATH] [--grouped on|off]
//               [--lora-rank R[,R...]] [--adapters N] [--lora-share S]
//
// Schemes (DESIGN.md, "Quantized experts"): fp8_block, fp8_channel, fp8_tensor,
// int8_channel, int8_block (default: the first four), with 128 x 128 weight blocks and
// 1 x 128 activation groups. fp8_tensor quantizes the activations per tensor from each
// chunk's absmax; --static-act gives it static scales instead, calibrated once per model
// as a checkpoint's input_scale is: the absmax of x and of GEMM1's activation over a
// calibration batch of 16 tokens on the bf16 weights, over 448.
// Weights: moelora_bench's bf16 experts (normal(0, 0.02), same seeds), quantized once per
// (model, scheme) by moelora::quantize on the run's device; the bf16 device copy is freed
// before any cell runs.
// Timing: as moelora_bench (LayerCell: on CUDA a graph of one layer call per rotation of 4
// input sets with different routings, median of the replays; on the CPU plain calls).
// Check (one untimed call on rotation 0): rel_err = ‖out − ref‖/‖ref‖ over the checked
// tokens, ref the float64 layer on the dequantized weights with x and act quantized as the
// op quantizes them (tests/cpp/reference.h, RefQuant); rel_err_bf16 against the float64
// layer on the bf16 weights, unquantized. Checked tokens: up to --check-tokens (64) spread
// over the batch. NOTE: a per-tensor dynamic activation scale (fp8_tensor) is the absmax of
// GEMM1's output over the whole chunk, out of the host reference's reach at large M: every
// token is checked up to M = 256; beyond, the checked call runs with chunks of N/2 tokens
// and its first and last chunk are checked ("check_chunk" in the JSON row).
// Floor = max(bytes / copy rate, FLOPs / 8-bit rate): bytes = the routed experts' 8-bit
// weights and fp32 scales, x in and out (bf16), ids and weights; FLOPs = 2·slots·3HI over
// fp8_tflops or int8_tops, measured in the same run with --ceilings (else nominal, said so).
// --lora-rank R adds a row per fp8_block cell with LoRA (FusedExpertsArgs::lora) at rank
// R: --adapters slots (4) of bf16 adapters on a share --lora-share (1.0) of the tokens, as
// moelora_bench's; its floor adds the stacks' bytes and their FLOPs over bf16_tflops, and
// lora_tax = time / time of the cell's row without LoRA.
// Weight-only schemes (issue 30): w4a16 / w8a16[:gG][:zp] (group G, 0 per channel; zero
// points), random packed codes (WeightOnlyGemm), checked against the float64 layer on the
// dequantized weights; --weight-only-path forces FusedExpertsOptions::weight_only_path.
// Their rows at M <= 16 also time the layer with every slot routed to no expert (an
// expert_map of -1): "fixed_us", the launches and tables without the experts' bytes.
// --grouped on|off forces MoeKernelConfig::grouped_gemm (CUTLASS grouped GEMMs) on or off
// in every cell (a caller's config: no small-batch kernels, the heuristic block size), for
// the crossover against the W8A8 tile kernels; without it the layer's heuristic decides.
// --grouped-tiles T1,T2 (T: 128 or 64) forces the grouped path with GEMM1's and GEMM2's
// MoeKernelConfig::grouped_tiles (128 x 128 cooperative or 64 x 128 pingpong tiles).
// The JSON row's "grouped" key says which ("auto" without either flag; "on 64,128" ...).
// --weight-only-tiles T1,T2 (T: BMxBN[s], BM 64 or 128, BN 128 or 256, s: the static
// schedule instead of the ordered one) gives weight-only cells a caller's config naming
// GEMM1's and GEMM2's sm90 tiles (block size 128 where a tile has 128 rows, else 64), for
// a tile sweep of the dense path (the plan's rule: 128 x 256 ordered for both); the other
// paths (decode, aligned: fewer than 32 slots an expert) ignore it. The rows carry
// "weight_only_tiles". CUDA with sm_90a only.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "layer_bench.h"
#include "moelora/ops.h"
#include "moelora/quant.h"
#include "quant_experts.h"
#include "reference.h"

namespace {

using namespace moelora::bench;

constexpr DType kDtype = kQuantLayerDtype;  // the layer's activations and output
// NOTE: a cell times fewer graph replays than --iters (30), at least 5, where that many
// would take longer than this: the grid (264 cells) must fit one 10-minute device command.
constexpr double kCellBudgetS = 1.0;

constexpr const char* kOwnFlags =
    "[--scheme S[:gG][:zp][,S...]] [--weight-only-path auto|decode|aligned|dense] [--static-act] [--check-tokens N]\n"
    "       [--grouped on|off] [--grouped-tiles T1,T2] [--weight-only-tiles BMxBN[s],BMxBN[s]]";

// A --scheme entry: the method and, for weight-only ones (NAME[:gG][:zp]), the group
// (0: per channel) and whether zero points come with it.
struct SchemeSpec {
  QuantMethod method;
  int64_t group = 128;
  bool zero_points = false;
  bool operator==(QuantMethod m) const { return method == m; }
};

struct Options : LayerBenchOptions {
  std::vector<SchemeSpec> schemes{{QuantMethod::kFp8Block}, {QuantMethod::kFp8Channel}, {QuantMethod::kFp8Tensor},
                                  {QuantMethod::kInt8Channel}};
  bool static_act = false;   // fp8_tensor: static activation scales
  moelora::WeightOnlyPath weight_only_path = moelora::WeightOnlyPath::kAuto;  // --weight-only-path
  int64_t check_tokens = 64;  // most tokens a check reads
  std::string grouped = "auto";  // --grouped: "on", "off", or the heuristic
  // --grouped-tiles: each GEMM's tiles (kAuto without the flag)
  moelora::GroupedGemmTiles grouped_tiles1 = moelora::GroupedGemmTiles::kAuto, grouped_tiles2 = moelora::GroupedGemmTiles::kAuto;
  // --weight-only-tiles: the caller's config of weight-only cells (its text; empty: the plan's)
  std::string weight_only_tiles;
  moelora::MoeKernelConfig weight_only_config;
};

[[noreturn]] void usage(const std::string& why) { exit_with_usage("quant_bench", why, kOwnFlags); }

Options parse(int argc, char** argv) {
  Options o;
  std::string tiles_text;  // --grouped-tiles
  o.tokens = {1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096, 8192};
  parse_layer_bench_args(argc, argv, "quant_bench", kOwnFlags, "all", o,
                         [&](const std::string& arg, const std::function<std::string()>& value) {
                           if (arg == "--scheme") {
                             o.schemes.clear();
                             for (const std::string& entry : split_commas(value())) {
                               const size_t colon = entry.find(':');
                               SchemeSpec spec;
                               try {
                                 spec.method = moelora::quant_method_from_name(entry.substr(0, colon));
                               } catch (const moelora::Error&) {
                                 usage("unknown scheme " + entry + " (fp8_block, fp8_channel, fp8_tensor, "
                                       "int8_channel, int8_block, or w4a16 / w8a16[:gG][:zp])");
                               }
                               for (size_t at = colon; at != std::string::npos;) {
                                 const size_t next = entry.find(':', at + 1);
                                 const std::string part = entry.substr(at + 1, next == std::string::npos ? next : next - at - 1);
                                 if (part == "zp") spec.zero_points = true;
                                 else if (part.size() > 1 && part[0] == 'g') spec.group = std::stoll(part.substr(1));
                                 else usage("scheme options are :gG (group, 0 per channel) and :zp, got " + entry);
                                 at = next;
                               }
                               o.schemes.push_back(spec);
                             }
                           } else if (arg == "--static-act") o.static_act = true;
                           else if (arg == "--weight-only-path") {
                             const std::string path = value();
                             o.weight_only_path = path == "decode"    ? moelora::WeightOnlyPath::kDecode
                                                  : path == "aligned" ? moelora::WeightOnlyPath::kAligned
                                                  : path == "dense"   ? moelora::WeightOnlyPath::kDense
                                                                      : moelora::WeightOnlyPath::kAuto;
                             if (path != "decode" && path != "aligned" && path != "dense" && path != "auto") {
                               usage("--weight-only-path takes decode, aligned, dense or auto");
                             }
                           }
                           else if (arg == "--check-tokens") o.check_tokens = std::stoll(value());
                           else if (arg == "--grouped") o.grouped = value();
                           else if (arg == "--grouped-tiles") tiles_text = value();
                           else if (arg == "--weight-only-tiles") o.weight_only_tiles = value();
                           else return false;
                           return true;
                         });
  if (o.check_tokens < 2) usage("--check-tokens takes 2 or more");
  if (o.grouped != "on" && o.grouped != "off" && o.grouped != "auto") usage("--grouped takes on or off");
  if (!tiles_text.empty()) {
    const std::vector<std::string> tiles = split_commas(tiles_text);
    auto parse_tiles = [&](const std::string& t) {
      if (t == "128") return moelora::GroupedGemmTiles::kCooperative128;
      if (t == "64") return moelora::GroupedGemmTiles::kPingpong64;
      usage("--grouped-tiles takes T1,T2 with T 128 or 64, got " + tiles_text);
    };
    if (tiles.size() != 2) usage("--grouped-tiles takes T1,T2 with T 128 or 64, got " + tiles_text);
    if (o.grouped == "off") usage("--grouped-tiles runs the grouped path: not with --grouped off");
    o.grouped_tiles1 = parse_tiles(tiles[0]);
    o.grouped_tiles2 = parse_tiles(tiles[1]);
    o.grouped = "on " + tiles_text;
  }
  if (!o.weight_only_tiles.empty()) {
    const std::string why = "--weight-only-tiles takes T1,T2 with T BMxBN[s] (BM 64 or 128, BN 128 or 256), got " +
                            o.weight_only_tiles;
    const std::vector<std::string> tiles = split_commas(o.weight_only_tiles);
    if (tiles.size() != 2) usage(why);
    if (o.grouped != "auto") usage("--weight-only-tiles and --grouped/--grouped-tiles: one caller's config at a time");
    auto parse_tile = [&](const std::string& t) {
      const size_t x = t.find('x');
      const bool static_schedule = !t.empty() && t.back() == 's';
      if (x == std::string::npos) usage(why);
      const std::string bm = t.substr(0, x), bn = t.substr(x + 1, t.size() - x - 1 - (static_schedule ? 1 : 0));
      if ((bm != "64" && bm != "128") || (bn != "128" && bn != "256")) usage(why);
      moelora::GemmTile tile{moelora::GemmKernel::kSm90, int32_t(std::stoi(bm)), int32_t(std::stoi(bn))};
      tile.ordered = !static_schedule;
      return tile;
    };
    o.weight_only_config.gemm1 = parse_tile(tiles[0]);
    o.weight_only_config.gemm2 = parse_tile(tiles[1]);
    // The tiles' rows must divide the block.
    o.weight_only_config.block_size =
        std::max(o.weight_only_config.gemm1.block_m, o.weight_only_config.gemm2.block_m) == 128 ? 128 : 64;
  }
  return o;
}

// ---- float64 reference on sampled tokens ------------------------------------------------
// One expert GEMM's weights [E, N, K] as the reference reads them: bf16, or 8-bit
// elements times their fp32 scales.
struct RefWeights {
  const void* data;
  DType element;
  const float* scales;  // null for bf16
  ScaleGrid grid;
  int64_t N, K;
  const WeightOnlyGemm* weight_only = nullptr;  // its rows instead

  static RefWeights of(const QuantGemm& w) {
    return {w.host_values.data(), w.element, w.host_scales.data(), w.grid, w.N, w.K};
  }
  static RefWeights of(const WeightOnlyGemm& w) { return {nullptr, DType::kUInt8, nullptr, {}, w.N, w.K, &w}; }
  // Row n of expert e, dequantized: out[K].
  void row(int64_t e, int64_t n, double* out) const {
    if (weight_only) return weight_only->row(e, n, out);
    static const std::array<double, 256> fp8 = [] {
      std::array<double, 256> t{};
      for (int i = 0; i < 256; ++i) t[i] = moelora::host::to_float(moelora::host::fp8e4m3{uint8_t(i)});
      return t;
    }();
    const int64_t at = (e * N + n) * K;
    if (element == kDtype) {
      for (int64_t k = 0; k < K; ++k) out[k] = load(kDtype, static_cast<const uint16_t*>(data), at + k);
      return;
    }
    const uint8_t* q = static_cast<const uint8_t*>(data) + at;
    for (int64_t k = 0; k < K; ++k) out[k] = element == DType::kInt8 ? double(int8_t(q[k])) : fp8[q[k]];
    const int64_t cols = grid.cols ? grid.cols : K;
    for (int64_t k0 = 0; k0 < K; k0 += cols) {
      const double scale = scales[grid.index(e, n, k0)];
      for (int64_t k = k0; k < std::min(K, k0 + cols); ++k) out[k] *= scale;
    }
  }
};

// out [S, N]: out[s] = a[s] · w[experts[s]]ᵀ (a [S, K]). Expert by expert, so each
// dequantized weight row is built once and serves every slot routed to it.
std::vector<double> ref_gemm(const RefWeights& w, const std::vector<double>& a, const std::vector<int32_t>& experts) {
  constexpr int64_t kRows = 64;  // weight rows per work item
  std::map<int32_t, std::vector<int64_t>> slots;
  for (size_t s = 0; s < experts.size(); ++s) slots[experts[s]].push_back(int64_t(s));
  std::vector<std::pair<int32_t, int64_t>> items;  // (expert, first row)
  for (const auto& [e, list] : slots) {
    for (int64_t n = 0; n < w.N; n += kRows) items.push_back({e, n});
  }
  std::vector<double> out(experts.size() * w.N);
  parallel_for(int64_t(items.size()), [&](int64_t i) {
    const auto [e, first] = items[i];
    std::vector<double> row(w.K);
    for (int64_t n = first; n < std::min(w.N, first + kRows); ++n) {
      w.row(e, n, row.data());
      for (int64_t s : slots.at(e)) out[s * w.N + n] = moelora::ref::dot_product(&a[s * w.K], row.data(), w.K);
    }
  });
  return out;
}

// The slots of `tokens` (of one call's inputs): x rows [T, H] in double, each slot's expert
// and routed weight (slot s = t · top_k + j of the t-th token listed).
struct Slots {
  std::vector<double> x;
  std::vector<int32_t> experts;
  std::vector<double> weights;
};

Slots slots_of(const Model& m, const std::vector<uint16_t>& x, const Routing& r, const std::vector<int64_t>& tokens) {
  Slots s;
  for (int64_t t : tokens) {
    for (int64_t h = 0; h < m.H; ++h) s.x.push_back(load(kDtype, x.data(), t * m.H + h));
    for (int64_t j = 0; j < m.top_k; ++j) {
      s.experts.push_back(r.ids[t * m.top_k + j]);
      s.weights.push_back(r.weights[t * m.top_k + j]);
    }
  }
  return s;
}

// Rows [S, K] of `rows` [T, K] repeated top_k times (one per slot).
std::vector<double> by_slot(const std::vector<double>& rows, int64_t K, int64_t top_k) {
  std::vector<double> out;
  for (size_t t = 0; t < rows.size() / K; ++t) {
    for (int64_t j = 0; j < top_k; ++j) out.insert(out.end(), rows.begin() + t * K, rows.begin() + (t + 1) * K);
  }
  return out;
}

// What one checked call read: rotation 0 of a cell.
struct CallInputs {
  const std::vector<uint16_t>& x;
  const Routing& routing;
  const LoraStacks* lora;  // null: no adapters
  const int32_t* lora_ids;  // [M]
};

// The layer's output rows of `tokens` [T, H], as ref::reference_fused_experts computes the
// layer (RefQuant semantics with q) but on those tokens alone, so a weight row is read once
// per routed expert and not per token. With q, x and act are quantized by chunks of
// `chunk` listed tokens (the whole chunks of the op's call, for per-tensor scales).
std::vector<double> reference_tokens(const Model& m, const CallInputs& in, const RefWeights& w13,
                                     const RefWeights& w2, const std::vector<int64_t>& tokens, int64_t chunk,
                                     const moelora::ref::RefQuant* q) {
  const int64_t T = int64_t(tokens.size()), S = T * m.top_k, H = m.H, I = m.I;
  const Slots s = slots_of(m, in.x, in.routing, tokens);
  const std::vector<double> x =
      q ? moelora::ref::reference_quantize_activations(s.x, T, H, chunk, *q, q->a13_scale) : s.x;
  std::vector<double> h1 = ref_gemm(w13, by_slot(x, H, m.top_k), s.experts);  // [S, 2I]
  // The (adapter, expert) pair of slot i, or -1.
  auto pair = [&](int64_t i) -> int64_t {
    const int32_t l = in.lora ? in.lora_ids[tokens[i / m.top_k]] : -1;
    return l < 0 ? -1 : l * m.E + s.experts[i];
  };
  // Quantized experts: GEMM1's output is rounded to bf16 before the activation, as on
  // every path of the op: the base, then the sum with the delta. Adapters see the
  // unquantized x.
  const bool round_h1 = q != nullptr;
  if (round_h1) h1 = moelora::ref::round_to(kDtype, h1);
  for (int64_t i = 0; i < S; ++i) {
    if (pair(i) < 0) continue;
    std::vector<double> delta(2 * I, 0.0);
    in.lora->add_delta13(m, pair(i), &s.x[(i / m.top_k) * H], delta.data());
    for (int64_t n = 0; n < 2 * I; ++n) h1[i * 2 * I + n] += delta[n];
  }
  if (round_h1 && in.lora) h1 = moelora::ref::round_to(kDtype, h1);
  std::vector<double> act = moelora::ref::reference_activation(m.activation, h1, S, I);
  if (q) act = moelora::ref::round_to(kDtype, act);
  std::vector<double> h2 = ref_gemm(
      w2, q ? moelora::ref::reference_quantize_activations(act, S, I, chunk * m.top_k, *q, q->a2_scale) : act, s.experts);
  for (int64_t i = 0; i < S; ++i) {  // the w2 adapter sees act before its quantization
    if (pair(i) >= 0) in.lora->add_delta2(m, pair(i), &act[i * I], &h2[i * H]);
  }
  std::vector<double> out(T * H, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t j = 0; j < m.top_k; ++j) out[t * H + h] += s.weights[t * m.top_k + j] * h2[(t * m.top_k + j) * H + h];
    }
  }
  return out;
}

// fp8_tensor's static activation scales (--static-act): absmax / 448 of x and of GEMM1's
// activation (bf16-rounded) over a calibration batch of 16 tokens on the bf16 weights.
std::array<float, 2> calibrate(const Model& m, const RefWeights& w13) {
  const int64_t T = 16;
  std::vector<uint16_t> x(T * m.H);
  fill_normal(kDtype, x.data(), T * m.H, 777, 1.0f);
  std::vector<int64_t> tokens(T);
  for (int64_t t = 0; t < T; ++t) tokens[t] = t;
  const Slots s = slots_of(m, x, make_routing(m, T, 778), tokens);
  const std::vector<double> act = moelora::ref::round_to(
      kDtype, moelora::ref::reference_activation(m.activation, ref_gemm(w13, by_slot(s.x, m.H, m.top_k), s.experts),
                                                 T * m.top_k, m.I));
  auto absmax = [](const std::vector<double>& v) {
    double a = 0;
    for (double e : v) a = std::max(a, std::fabs(e));
    return float(a);
  };
  return {absmax(s.x) / 448.0f, absmax(act) / 448.0f};
}

// Which tokens of a cell's checked call (rotation 0) the reference covers, and the chunk
// size the call and the reference quantize with (0: the timed call's, one chunk).
struct CheckPlan {
  std::vector<int64_t> tokens;  // ascending
  int64_t chunk_size = 0;
};

CheckPlan plan_check(const QuantScheme& s, int64_t M, int64_t sample) {
  CheckPlan p;
  const bool per_tensor = s.activation_scales == ScaleGranularity::kTensor && !s.static_activation_scales;
  if (per_tensor && M > std::max<int64_t>(sample, 256)) {
    p.chunk_size = sample / 2;  // the first and the last chunk of the call, whole
    for (int64_t t = 0; t < p.chunk_size; ++t) p.tokens.push_back(t);
    for (int64_t t = (M - 1) / p.chunk_size * p.chunk_size; t < M; ++t) p.tokens.push_back(t);
  } else if (per_tensor || M <= sample) {
    for (int64_t t = 0; t < M; ++t) p.tokens.push_back(t);
  } else {
    for (int64_t i = 0; i < sample; ++i) p.tokens.push_back(i * (M - 1) / (sample - 1));
  }
  return p;
}

// The rows of `tokens` of out [M, H] (bf16) in double.
std::vector<double> rows_of(const std::vector<uint16_t>& out, int64_t H, const std::vector<int64_t>& tokens) {
  std::vector<double> rows;
  for (int64_t t : tokens) {
    for (int64_t h = 0; h < H; ++h) rows.push_back(load(kDtype, out.data(), t * H + h));
  }
  return rows;
}

// ---- cells -------------------------------------------------------------------------------
struct Row {
  const Model* model;
  int64_t M;
  QuantScheme scheme;
  int64_t lora_rank = 0;
  std::string device;
  std::string error = {};  // what the op threw (no numbers then)
  double time_us = 0, floor_us = 0, bytes = 0, flops = 0;
  double rel_err = -1, rel_err_bf16 = -1;  // -1: not checked
  int64_t checked_tokens = 0, check_chunk = 0;
  double base_us = 0, base_floor_us = 0;  // LoRA rows: the cell's row without LoRA
  // Weight-only rows without LoRA at M <= kFixedCostMaxTokens: the call's time with every
  // slot routed to no expert (LayerCell::time_without_experts_us); -1: not measured.
  double fixed_us = -1;
};

// The M up to which weight-only rows time the layer's fixed cost (issue 30's 3x target
// at M <= 16 exempts cells whose fixed cost exceeds a quarter of the bf16 layer's time).
constexpr int64_t kFixedCostMaxTokens = 16;

// A model's bf16 references by (M, LoRA rank, tokens): every scheme checks against them.
using Bf16Refs = std::map<std::vector<int64_t>, std::vector<double>>;

// One (model, M, scheme) cell: the row without LoRA, then one per stack.
std::vector<Row> run_cell(const Model& m, int64_t M, const Options& o, bool cuda, const QuantExperts& q,
                          const std::vector<LoraStacks*>& stacks, const std::vector<uint16_t>& w13_bf16,
                          const std::vector<uint16_t>& w2_bf16, const Ceilings& ceilings, Bf16Refs& bf16_refs) {
  LayerCell cell(m, M, kDtype, cuda, q.w13_values(), q.w2_values(), stacks, o.lora_adapters, o.lora_share, &q.args);
  const bool weight_only = q.scheme.weight_only();
  const moelora::MoeKernelConfig grouped_on{
      .grouped_gemm = true, .grouped_tiles1 = o.grouped_tiles1, .grouped_tiles2 = o.grouped_tiles2};
  static const moelora::MoeKernelConfig kGroupedOff{.grouped_gemm = false};
  const bool own_tiles = weight_only && !o.weight_only_tiles.empty();
  moelora::FusedExpertsOptions fo =
      cell.options(own_tiles                ? &o.weight_only_config
                   : o.grouped == "auto"    ? nullptr
                   : o.grouped == "off"     ? &kGroupedOff
                                            : &grouped_on);
  fo.weight_only_path = o.weight_only_path;
  const CheckPlan plan = plan_check(q.scheme, M, o.check_tokens);
  // Weight-only: the MMAs run on the 16-bit activations.
  const double rate = weight_only ? ceilings.bf16_tflops
                      : q.scheme.element == DType::kInt8 ? ceilings.int8_tops : ceilings.fp8_tflops;
  std::vector<Row> rows;
  for (size_t i = 0; i <= stacks.size(); ++i) {  // 0: no LoRA, then each stack
    cell.set_lora(i == 0 ? nullptr : stacks[i - 1]);
    Row row{.model = &m,
            .M = M,
            .scheme = q.scheme,
            .lora_rank = i == 0 ? 0 : stacks[i - 1]->rank,
            .device = cuda ? "cuda" : "cpu"};
    try {
      moelora::FusedExpertsOptions check_fo = fo;
      if (plan.chunk_size > 0) check_fo.chunk_size = plan.chunk_size;
      const std::vector<uint16_t> out = cell.run_once(check_fo);
      row.time_us = cell.time_us(fo, o.iters > 0 ? o.iters : cuda ? 30 : 3, kCellBudgetS);
      if (weight_only && i == 0 && M <= kFixedCostMaxTokens) {
        row.fixed_us = cell.time_without_experts_us(fo, o.iters > 0 ? o.iters : cuda ? 30 : 3, kCellBudgetS);
      }
      double lora_flops;
      cell.floors(q.expert_bytes(), &row.bytes, &row.flops, &lora_flops);
      row.floor_us = std::max(row.bytes / (ceilings.copy_tbps * 1e6),
                              row.flops / (rate * 1e6) + lora_flops / (ceilings.bf16_tflops * 1e6));
      row.flops += lora_flops;
      if (o.check) {
        const CallInputs in{cell.x_host(), cell.routing(), cell.lora_stacks(), cell.lora_ids()};
        moelora::ref::RefQuant rq{.element = q.scheme.element,
                                  .activation_scales = q.scheme.activation_scales,
                                  .block_k = q.scheme.block_k,
                                  .a13_scale = q.a13,
                                  .a2_scale = q.a2,
                                  .layer_dtype = kDtype};
        const int64_t chunk = plan.chunk_size > 0 ? plan.chunk_size : int64_t(plan.tokens.size());
        const std::vector<double> got = rows_of(out, m.H, plan.tokens);
        // Weight-only: the float64 layer on the dequantized weights, activations as they are.
        row.rel_err = moelora::ref::rel_error(
            got, weight_only ? reference_tokens(m, in, RefWeights::of(*q.wo13), RefWeights::of(*q.wo2), plan.tokens,
                                                chunk, nullptr)
                             : reference_tokens(m, in, RefWeights::of(*q.w13), RefWeights::of(*q.w2), plan.tokens,
                                                chunk, &rq));
        std::vector<int64_t> key{M, row.lora_rank};
        key.insert(key.end(), plan.tokens.begin(), plan.tokens.end());
        // rel_err_bf16: 8-bit experts only (weight-only codes are random, not the bf16
        // weights quantized), and only where the run has bf16 experts (not weight-only alone).
        const bool against_bf16 = !weight_only && !w13_bf16.empty();
        if (against_bf16 && !bf16_refs.count(key)) {
          const RefWeights w13{w13_bf16.data(), kDtype, nullptr, {}, 2 * m.I, m.H};
          const RefWeights w2{w2_bf16.data(), kDtype, nullptr, {}, m.H, m.I};
          bf16_refs[key] = reference_tokens(m, in, w13, w2, plan.tokens, chunk, nullptr);
        }
        if (against_bf16) row.rel_err_bf16 = moelora::ref::rel_error(got, bf16_refs[key]);
        row.checked_tokens = int64_t(plan.tokens.size());
        row.check_chunk = plan.chunk_size;
      }
    } catch (const std::logic_error& e) {  // moelora::Error: the op refused the call
      row.error = e.what();
    }
    if (i > 0) {
      row.base_us = rows[0].time_us;
      row.base_floor_us = rows[0].floor_us;
    }
    rows.push_back(row);
  }
  cell.set_lora(nullptr);
  return rows;
}

std::string scheme_label(const QuantScheme& s) {
  if (s.weight_only()) {
    return std::string(moelora::quant_method_name(s.method)) + "/g" + std::to_string(s.group_size) +
           (s.zero_points ? "/zp" : "");
  }
  return std::string(moelora::quant_method_name(s.method)) + (s.static_activation_scales ? "/static" : "");
}

void print_row(const Row& r) {
  const std::string label = r.lora_rank > 0 ? "  + lora r=" + std::to_string(r.lora_rank) : r.model->name;
  if (!r.error.empty()) {
    std::printf("%-16s M=%-5lld %-18s FAILED: %s\n", label.c_str(), (long long)r.M, scheme_label(r.scheme).c_str(),
                r.error.c_str());
    std::fflush(stdout);
    return;
  }
  const std::string check = r.checked_tokens == 0 ? std::string("not checked")
                                                  : format("%.2e (%lld tokens%s)%s", r.rel_err,
                                                           (long long)r.checked_tokens,
                                                           r.check_chunk ? format(", chunks of %lld", (long long)r.check_chunk).c_str() : "",
                                                           r.rel_err_bf16 < 0 ? "" : format("  vs bf16 layer %.2e", r.rel_err_bf16).c_str());
  const std::string tax = r.lora_rank > 0 ? format("  tax x%.3f on base %.1f us (floor x%.3f)", r.time_us / r.base_us,
                                                   r.base_us, r.floor_us / r.base_floor_us)
                                          : std::string();
  const std::string fixed = r.fixed_us >= 0 ? format("  fixed %.1f us", r.fixed_us) : std::string();
  std::printf("%-16s M=%-5lld %-18s %9.1f us  floor %8.1f us (%5.1f%%)  %6.3f TB/s  %7.1f TFLOP/s  rel_err %s%s%s\n",
              label.c_str(), (long long)r.M, scheme_label(r.scheme).c_str(), r.time_us, r.floor_us,
              100 * r.floor_us / r.time_us, r.bytes / (r.time_us * 1e6), r.flops / (r.time_us * 1e6), check.c_str(),
              tax.c_str(), fixed.c_str());
  std::fflush(stdout);
}

// DESIGN.md's row keys ("GPU reports"), plus rel_err_bf16, the check's extent and, on
// LoRA rows, the tax over the cell's row without LoRA.
std::string json_row(const Row& r, const Options& o) {
  const QuantScheme& s = r.scheme;
  const std::string group = s.weight_scales == ScaleGranularity::kBlock ? std::to_string(s.block_k) : "null";
  const std::string quant = format(
      "{\"scheme\": \"%s\", \"group\": %s, \"zero_point\": %s, \"activations\": \"%s\"}",
      moelora::quant_method_name(s.method), group.c_str(), s.zero_points ? "true" : "false",
      s.weight_only() ? "bf16" : s.static_activation_scales ? "static" : "dynamic");
  std::string lora = "null", lora_keys;
  if (r.lora_rank > 0) {
    lora = format("{\"rank\": %lld, \"adapters\": %lld, \"share\": %s}", (long long)r.lora_rank,
                  (long long)o.lora_adapters, json_fraction(o.lora_share).c_str());
    // base_us 0: the row without LoRA failed.
    auto ratio = [](double a, double b) { return b > 0 ? format("%.4f", a / b) : std::string("null"); };
    lora_keys = format(", \"lora_tax\": %s, \"tax_floor\": %s, \"base_us\": %.3f", ratio(r.time_us, r.base_us).c_str(),
                       ratio(r.floor_us, r.base_floor_us).c_str(), r.base_us);
  }
  auto number = [](double v) { return v < 0 ? std::string("null") : format("%.4e", v); };
  return format("{\"op\": \"fused_experts\", \"model\": \"%s\", \"M\": %lld, \"dtype\": \"bf16\", \"lora\": %s, "
                "\"quant\": %s, \"device\": \"%s\", \"time_us\": %.3f, \"floor_us\": %.3f, \"pct_floor\": %.2f, "
                "\"tbps\": %.4f, \"tflops\": %.3f, \"rel_err\": %s, \"rel_err_bf16\": %s, \"checked_tokens\": %lld, "
                "\"check_chunk\": %s, \"grouped\": \"%s\", \"weight_only_tiles\": %s%s%s}",
                r.model->name, (long long)r.M, lora.c_str(), quant.c_str(), r.device.c_str(), r.time_us, r.floor_us,
                100 * r.floor_us / r.time_us, r.bytes / (r.time_us * 1e6), r.flops / (r.time_us * 1e6),
                number(r.rel_err).c_str(), number(r.rel_err_bf16).c_str(), (long long)r.checked_tokens,
                r.check_chunk ? std::to_string(r.check_chunk).c_str() : "null", o.grouped.c_str(),
                s.weight_only() && !o.weight_only_tiles.empty() ? ("\"" + o.weight_only_tiles + "\"").c_str() : "null",
                lora_keys.c_str(),
                r.fixed_us >= 0 ? format(", \"fixed_us\": %.3f", r.fixed_us).c_str() : "");
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const bool cuda = o.cuda;
  // LoRA rows: on fp8_block and w4a16 cells.
  auto takes_lora = [](QuantMethod m) { return m == QuantMethod::kFp8Block || m == QuantMethod::kW4A16; };
  const bool lora_rows = !o.lora_ranks.empty() &&
                         std::any_of(o.schemes.begin(), o.schemes.end(), [&](const SchemeSpec& q) { return takes_lora(q.method); });
  if (!o.lora_ranks.empty() && !lora_rows) std::printf("note: --lora-rank adds rows to fp8_block and w4a16 cells only: none run\n");
  const bool any_8bit = std::any_of(o.schemes.begin(), o.schemes.end(), [](const SchemeSpec& q) {
    return q.method != QuantMethod::kW4A16 && q.method != QuantMethod::kW8A16;
  });
  try {
    Ceilings ceilings;
#ifdef MOELORA_WITH_CUDA
    if (cuda && o.ceilings) ceilings = measure_ceilings(true);
#endif
    std::printf("moelora %s | device %s | ceilings %.2f TB/s copy, %.0f TFLOP/s bf16, %.0f TFLOP/s fp8, %.0f TOP/s "
                "int8 (%s)\n",
                moelora::version(), cuda ? "cuda" : "cpu", ceilings.copy_tbps, ceilings.bf16_tflops,
                ceilings.fp8_tflops, ceilings.int8_tops, ceilings.measured ? "measured" : "nominal H100, not measured");
    std::vector<Row> rows;
    int failed = 0;
    for (const Model* model : o.models) {
      const Model& m = *model;
      const auto start = std::chrono::steady_clock::now();
      // moelora_bench's bf16 experts (same seeds), for the 8-bit schemes. NOTE: their GPU
      // copy (6.4 GB for gpt-oss-120b) lives only while the schemes are quantized from it.
      // Weight-only schemes take random codes of their own (WeightOnlyGemm).
      ModelWeights w(any_8bit ? m : Model{m.name, 0, m.top_k, m.H, m.I, m.activation}, kDtype, cuda && any_8bit);
      std::array<float, 2> calibrated{0, 0};
      const bool static_scales =
          o.static_act && std::count(o.schemes.begin(), o.schemes.end(), QuantMethod::kFp8Tensor) > 0;
      if (static_scales) calibrated = calibrate(m, RefWeights{w.w13.data(), kDtype, nullptr, {}, 2 * m.I, m.H});
      std::vector<std::unique_ptr<QuantExperts>> experts;
      for (const SchemeSpec& spec : o.schemes) {
        experts.push_back(spec.method == QuantMethod::kW4A16 || spec.method == QuantMethod::kW8A16
                              ? weight_only_experts(m, spec.method, spec.group, spec.zero_points, cuda)
                              : quantize_experts(m, spec.method, o.static_act, cuda, w.w13_run, w.w2_run,
                                                 calibrated.data()));
      }
      device_synchronize();  // the quantization is done before the frees
      w.free_device();
      const auto stacks_owned = make_model_lora_stacks(m, kDtype, lora_rows ? o.lora_ranks : std::vector<int64_t>{},
                                                       o.lora_adapters, cuda);
      std::vector<LoraStacks*> stacks;
      for (const auto& st : stacks_owned) stacks.push_back(st.get());
      std::printf("%s: %zu schemes quantized in %.1f s%s\n", m.name, experts.size(),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                  static_scales ? format(" | fp8_tensor static scales a13 %.4g a2 %.4g", calibrated[0], calibrated[1]).c_str()
                               : "");
      std::fflush(stdout);
      Bf16Refs bf16_refs;
      for (std::unique_ptr<QuantExperts>& q : experts) {
        if (o.check && q->w13) {
          q->w13->download();
          q->w2->download();
        }
        const bool with_lora = takes_lora(q->scheme.method);
        for (int64_t M : o.tokens) {
          for (const Row& row : run_cell(m, M, o, cuda, *q, with_lora ? stacks : std::vector<LoraStacks*>{}, w.w13,
                                         w.w2, ceilings, bf16_refs)) {
            print_row(row);
            const bool bad = !row.error.empty() ||
                             (row.checked_tokens > 0 && !(row.rel_err <= moelora::ref::tolerance(kDtype)));
            failed += bad;
            if (row.error.empty()) rows.push_back(row);
          }
        }
        q.reset();  // its device and host copies
      }
    }
    if (!o.json_path.empty()) {
      std::vector<std::string> json_rows;
      for (const Row& r : rows) json_rows.push_back(json_row(r, o));
      write_bench_json(o.json_path, ceilings, json_rows, true);
    }
    if (failed > 0) {
      std::printf("FAILED: %d rows failed or are above %.0e relative error\n", failed, moelora::ref::tolerance(kDtype));
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "quant_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
