// moelora_bench: the main job. Runs the whole MoE layer (fused_experts) at a real
// model's shapes from the design brief, checks it against a float64 reference, and
// prints time, achieved bandwidth and FLOP rate against the roofline floor.
//
//   moelora_bench [--model NAME[,NAME...]|all] [--tokens M[,M...]] [--dtype bf16|fp16]
//                 [--device auto|cpu|cuda] [--iters N] [--no-check] [--ceilings]
//                 [--baseline] [--static-tiles] [--grouped on|off] [--grouped-tiles T1,T2] [--json PATH]
//                 [--lora-rank R[,R...]] [--adapters N] [--lora-share S]
//   moelora_bench --tune DIR [--model NAME|all] [--tokens ...]   (CUDA only)
//
// --baseline also times each cell with the previous issue's kernels (mma.sync, fixed
// tiles, no programmatic dependent launch) and reports the speed-up.
// --static-tiles runs the sm90 GEMMs on the static persistent schedule instead of
// ordered tiles (FusedExpertsOptions::ordered_tiles), for A/B timing.
// --grouped on|off forces MoeKernelConfig::grouped_gemm (the CUTLASS grouped GEMMs; sm_90a)
// on or off in the cell's own config (the registry's or the heuristic's), for
// A/B timing; a row the path does not take runs the tiles either way. --grouped-tiles T1,T2
// (T: 64, 128 or 128x256) forces it on with those CUTLASS tiles for GEMM1 and GEMM2.
// --tune searches block size and tiles per (model, M) and writes the config registry's
// table for each model into DIR (copy it to configs/ to ship it).
// --lora-rank adds, per (model, M) cell and rank R (0: none), a row of the layer with
// LoRA (FusedExpertsArgs::lora): --adapters N slots (default 4) of random adapters on
// w13 (gate and up slices) and w2, all enabled, scale 2.0 (alpha / r with alpha = 2r),
// and a share S of the tokens (--lora-share, default 1.0; chosen at random) given an
// adapter round-robin, the rest -1. Timed like the base row on the same inputs; the LoRA
// tax is time(with LoRA) / time(without). A LoRA row's floor adds the LoRA weights of
// the (adapter, expert) pairs routed and the shrink and expand FLOPs of the slots with
// an adapter; tax_floor = floor(with LoRA) / floor(without).
//
// On CUDA: every layer call is captured in a CUDA graph over kRotations input sets with
// different routings (so consecutive calls touch different experts and L2 holds no
// weights from the call before), replayed after a warm-up; the median replay time over
// kRotations is the layer time. On the CPU: the median of a few plain calls.
// The floor is max(bytes / copy rate, FLOPs / bf16 matmul rate), where bytes are the
// weights of the experts the routing touches plus activations in and out, and the rates
// are the ceilings measured in the same run (--ceilings; otherwise H100 nominal
// 3.0 TB/s and 790 TFLOP/s are assumed and said so).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/host_numeric.h"
#include "common/params.h"
#include "moelora/ops.h"
#include "layer_bench.h"

#ifdef MOELORA_WITH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

namespace {

using namespace moelora::bench;
using moelora::Activation;
using moelora::DType;
using moelora::TensorView;

constexpr const char* kOwnFlags =
    "[--dtype bf16|fp16] [--baseline] [--static-tiles] [--grouped on|off] [--grouped-tiles T1,T2] "
    "[--tune DIR [--trace]]";

struct Options : LayerBenchOptions {
  DType dtype = DType::kBFloat16;
  bool baseline = false;   // also time the previous issue's kernels per cell
  bool trace = false;      // --tune: print every candidate's time
  bool static_tiles = false;  // sm90 tiles on the static persistent schedule (A/B of ordered tiles)
  std::string grouped = "auto";  // --grouped: "on", "off", or the cell's config
  // --grouped-tiles: the grouped GEMMs' tiles (with grouped "on"); kAuto: the heuristic's
  moelora::GroupedGemmTiles grouped_tiles1 = moelora::GroupedGemmTiles::kAuto;
  moelora::GroupedGemmTiles grouped_tiles2 = moelora::GroupedGemmTiles::kAuto;
  std::string tune_dir;    // --tune DIR: search tiles, write the registry's JSON there
};

[[noreturn]] void usage(const std::string& why) { exit_with_usage("moelora_bench", why, kOwnFlags); }

Options parse(int argc, char** argv) {
  Options o;
  o.tokens = {16};
  std::string tiles_text;
  parse_layer_bench_args(argc, argv, "moelora_bench", kOwnFlags, "qwen3-30b-a3b", o,
                         [&](const std::string& arg, const std::function<std::string()>& value) {
                           if (arg == "--dtype") {
                             const std::string d = value();
                             if (d == "bf16") o.dtype = DType::kBFloat16;
                             else if (d == "fp16") o.dtype = DType::kFloat16;
                             else usage("--dtype takes bf16 or fp16");
                           } else if (arg == "--baseline") o.baseline = true;
                           else if (arg == "--trace") o.trace = true;
                           else if (arg == "--static-tiles") o.static_tiles = true;
                           else if (arg == "--grouped") o.grouped = value();
                           else if (arg == "--grouped-tiles") tiles_text = value();
                           else if (arg == "--tune") o.tune_dir = value();
                           else return false;
                           return true;
                         });
  if (!o.lora_ranks.empty() && !o.tune_dir.empty()) usage("--tune tunes the base layer: drop --lora-rank");
  if (o.grouped != "on" && o.grouped != "off" && o.grouped != "auto") usage("--grouped takes on or off");
  if (!tiles_text.empty()) {
    const std::string why = "--grouped-tiles takes T1,T2 with T 64, 128 or 128x256, got " + tiles_text;
    const std::vector<std::string> tiles = split_commas(tiles_text);
    auto parse_tiles = [&](const std::string& t) {
      if (t == "64") return moelora::GroupedGemmTiles::kPingpong64;
      if (t == "128") return moelora::GroupedGemmTiles::kCooperative128;
      if (t == "128x256") return moelora::GroupedGemmTiles::kCooperative128x256;
      usage(why);
    };
    if (tiles.size() != 2) usage(why);
    if (o.grouped == "off") usage("--grouped-tiles runs the grouped path: not with --grouped off");
    o.grouped_tiles1 = parse_tiles(tiles[0]);
    o.grouped_tiles2 = parse_tiles(tiles[1]);
    o.grouped = "on";
  }
  if (o.grouped != "auto" && !o.tune_dir.empty()) usage("--tune searches the tiles: drop --grouped");
  return o;
}

// The reference's view of one batch's adapters.
struct LoraRef {
  const LoraStacks* stacks;
  const int32_t* token_ids;  // [M]
};

// ---- float64 reference of one token of the layer, straight from the dtype data ----
// With `lora` (and an adapter on the token), each slot adds
//   delta13 = scale · B13 (A13 x) to gate and up before the activation and
//   delta2 = scale · B2 (A2 act) to the expert's output before the routed weight;
// out_base (optional, [H]) gets the same token without LoRA.
void reference_token(const Model& m, DType dtype, const uint16_t* x, const uint16_t* w13, const uint16_t* w2,
                     const Routing& r, int64_t token, double* out /*[H]*/, const LoraRef* lora = nullptr,
                     double* out_base /*[H]*/ = nullptr) {
  const int64_t H = m.H, I = m.I;
  const int64_t l = lora ? lora->token_ids[token] : -1;
  const LoraStacks* st = l >= 0 ? lora->stacks : nullptr;
  std::vector<double> xd(H), act(I), h1(2 * I), act_base(st ? I : 0), delta2(st ? H : 0);
  auto activate = [&](const std::vector<double>& h, std::vector<double>& a) {
    for (int64_t i = 0; i < I; ++i) {
      if (m.activation == Activation::kSilu) {
        const double g = h[i], v = h[I + i];
        a[i] = g / (1 + std::exp(-g)) * v;
      } else {  // swiglu_oai, gate/up interleaved, alpha 1.702, limit 7
        const double g = std::min(h[2 * i], 7.0), v = std::clamp(h[2 * i + 1], -7.0, 7.0);
        a[i] = (v + 1) * g / (1 + std::exp(-1.702 * g));
      }
    }
  };
  for (int64_t h = 0; h < H; ++h) xd[h] = load(dtype, x, token * H + h);
  std::fill(out, out + H, 0.0);
  if (out_base) std::fill(out_base, out_base + H, 0.0);
  for (int64_t j = 0; j < m.top_k; ++j) {
    const int64_t e = r.ids[token * m.top_k + j];
    const double weight = r.weights[token * m.top_k + j];
    for (int64_t n = 0; n < 2 * I; ++n) {
      const uint16_t* row = w13 + (e * 2 * I + n) * H;
      double s = 0;
      for (int64_t h = 0; h < H; ++h) s += xd[h] * load(dtype, row, h);
      h1[n] = s;
    }
    if (st) {
      activate(h1, act_base);
      st->add_delta13(m, l * m.E + e, xd.data(), h1.data());
    }
    activate(h1, act);
    if (st) {
      std::fill(delta2.begin(), delta2.end(), 0.0);
      st->add_delta2(m, l * m.E + e, act.data(), delta2.data());
    }
    for (int64_t h = 0; h < H; ++h) {
      const uint16_t* row = w2 + (e * H + h) * I;
      double s = 0, s_base = 0;
      if (st) {
        for (int64_t i = 0; i < I; ++i) {
          const double w = load(dtype, row, i);
          s += act[i] * w;
          s_base += act_base[i] * w;
        }
        out[h] += weight * (s + delta2[h]);
      } else {
        for (int64_t i = 0; i < I; ++i) s += act[i] * load(dtype, row, i);
        s_base = s;
        out[h] += weight * s;
      }
      if (out_base) out_base[h] += weight * s_base;
    }
  }
}

// ‖out − ref‖/‖ref‖ over the checked tokens: all of them up to 256, else 128 spread
// over the batch (first and last included). With LoRA also ‖ref − ref without LoRA‖/‖ref‖
// (lora_delta: how far the adapters move the output; a row that dropped the delta would
// show rel_err ≈ lora_delta).
struct Check { double rel_err = -1; int64_t tokens = 0; double lora_delta = -1; };

Check check_layer(const Model& m, DType dtype, const std::vector<uint16_t>& x, const uint16_t* w13,
                  const uint16_t* w2, const Routing& r, const std::vector<uint16_t>& out, int64_t M,
                  const LoraRef* lora = nullptr) {
  std::vector<int64_t> tokens;
  if (M <= 256) {
    for (int64_t t = 0; t < M; ++t) tokens.push_back(t);
  } else {
    for (int64_t i = 0; i < 128; ++i) tokens.push_back(i * (M - 1) / 127);
  }
  std::vector<double> ref(tokens.size() * m.H), ref_base(lora ? tokens.size() * m.H : 0);
  parallel_for(int64_t(tokens.size()), [&](int64_t i) {
    reference_token(m, dtype, x.data(), w13, w2, r, tokens[i], &ref[i * m.H], lora,
                    lora ? &ref_base[i * m.H] : nullptr);
  });
  double diff = 0, norm = 0, delta = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    for (int64_t h = 0; h < m.H; ++h) {
      const double o = load(dtype, out.data(), tokens[i] * m.H + h), e = ref[i * m.H + h];
      diff += (o - e) * (o - e);
      norm += e * e;
      if (lora) delta += (e - ref_base[i * m.H + h]) * (e - ref_base[i * m.H + h]);
    }
  }
  Check c;
  c.rel_err = std::isfinite(diff) ? std::sqrt(diff / std::max(norm, 1e-300)) : INFINITY;
  c.tokens = int64_t(tokens.size());
  if (lora) c.lora_delta = std::sqrt(delta / std::max(norm, 1e-300));
  return c;
}

// ---- results ----------------------------------------------------------------------
struct Row {
  const Model* model;
  int64_t M;
  std::string device;
  double time_us, floor_us, bytes, flops;
  Check check;
  double baseline_us = 0;  // previous issue's kernels (--baseline), 0 = not measured
  // LoRA rows (--lora-rank); lora_rank 0: the base row. lora_tax and tax_floor divide by
  // the cell's base row (filled in by main).
  int64_t lora_rank = 0;
  double lora_tax = 0, tax_floor = 0, base_us = 0;
};

#ifdef MOELORA_WITH_CUDA
// The previous issue's kernels: mma.sync tiles of (16|32|64) x 128 on the heuristic
// block size, the separate activation kernel, no programmatic dependent launch.
moelora::MoeKernelConfig baseline_config(const Model& m, int64_t M) {
  moelora::MoeKernelConfig c;
  c.block_size = moelora::fused_experts_block_size(M, m.top_k, m.E);
  const int32_t rows = c.block_size % 64 == 0 ? 64 : c.block_size % 32 == 0 ? 32 : 16;
  c.gemm1 = c.gemm2 = moelora::GemmTile{moelora::GemmKernel::kSm80, rows, 128};
  return c;
}
#endif

// The cell's rows on the run's device: the base layer, then one row per LoRA stack on
// the same rotations (check against the float64 reference on rotation 0).
std::vector<Row> run_cell(const Model& m, int64_t M, const Options& o, bool cuda, const void* w13, const void* w2,
                          const std::vector<uint16_t>& w13_host, const std::vector<uint16_t>& w2_host,
                          const std::vector<LoraStacks*>& stacks) {
  LayerCell cell(m, M, o.dtype, cuda, w13, w2, stacks, o.lora_adapters, o.lora_share);
  const int iters = o.iters > 0 ? o.iters : cuda ? 30 : 3;
  auto fo = cell.options(nullptr);  // the registry's config
  fo.ordered_tiles = !o.static_tiles;
  moelora::MoeKernelConfig forced;  // --grouped: the cell's config with the grouped path forced
  if (o.grouped != "auto") {
    const moelora::Device device = cuda ? moelora::Device{moelora::DeviceType::kCUDA, 0} : moelora::Device{};
    forced = moelora::fused_experts_config({M, m.top_k, m.E, m.H, m.I, o.dtype}, 0, device, fo);
    forced.grouped_gemm = o.grouped == "on";
    forced.grouped_tiles1 = o.grouped_tiles1;
    forced.grouped_tiles2 = o.grouped_tiles2;
    fo.config = &forced;
  }
  std::vector<Row> rows;
  for (size_t i = 0; i <= stacks.size(); ++i) {  // 0: no LoRA, then each stack
    cell.set_lora(i == 0 ? nullptr : stacks[i - 1]);
    Row row{&m, M, cuda ? "cuda" : "cpu", 0, 0, 0, 0, {}};
    row.lora_rank = i == 0 ? 0 : stacks[i - 1]->rank;
    const std::vector<uint16_t> out = cell.run_once(fo);
    row.time_us = cell.time_us(fo, iters);
#ifdef MOELORA_WITH_CUDA
    if (o.baseline && cuda && i == 0) {
      const moelora::MoeKernelConfig base = baseline_config(m, M);
      moelora::FusedExpertsOptions base_options = cell.options(&base);
      base_options.fuse_activation = false;
      moelora::cuda::set_pdl_allowed(false);
      row.baseline_us = cell.time_us(base_options, iters);
      moelora::cuda::set_pdl_allowed(true);
    }
#endif
    double lora_flops;
    cell.floors(3.0 * m.H * m.I * 2, &row.bytes, &row.flops, &lora_flops);
    row.flops += lora_flops;
    if (o.check) {
      const LoraRef lora{cell.lora_stacks(), cell.lora_ids()};
      row.check = check_layer(m, o.dtype, cell.x_host(), w13_host.data(), w2_host.data(), cell.routing(), out, M,
                              i == 0 ? nullptr : &lora);
    }
    rows.push_back(row);
  }
  cell.set_lora(nullptr);
  return rows;
}

#ifdef MOELORA_WITH_CUDA
// ---- tuning: search the tile space per (model, M), write the registry's JSON --------
std::vector<moelora::GemmTile> candidate_tiles(int64_t block_size, bool sm90) {
  std::vector<moelora::GemmTile> tiles;
  for (int32_t bm : {16, 32, 64}) {
    for (int32_t bn : {64, 128}) {
      if (block_size % bm == 0) tiles.push_back({moelora::GemmKernel::kSm80, bm, bn});
    }
  }
  for (int32_t bm : {64, 128}) {
    for (int32_t bn : {128, 256}) {
      for (int32_t cluster : {1, 2}) {
        if (sm90 && block_size % bm == 0) tiles.push_back({moelora::GemmKernel::kSm90, bm, bn, cluster});
      }
    }
  }
  return tiles;
}

std::string tile_json(const moelora::GemmTile& t) {
  return std::string("{\"kernel\": \"") + (t.kernel == moelora::GemmKernel::kSm90 ? "sm90" : "sm80") +
         "\", \"block_m\": " + std::to_string(t.block_m) + ", \"block_n\": " + std::to_string(t.block_n) +
         (t.cluster_m > 1 ? ", \"cluster_m\": " + std::to_string(t.cluster_m) : std::string()) +
         (t.ordered ? std::string() : ", \"ordered\": 0") + "}";
}

std::string config_json(const moelora::MoeKernelConfig& c) {
  return "{\"block_size\": " + std::to_string(c.block_size) + ", \"gemm1\": " + tile_json(c.gemm1) +
         ", \"gemm2\": " + tile_json(c.gemm2) + (c.small_batch ? ", \"small_batch\": 1" : "") +
         (c.sorted_input ? ", \"sorted_input\": 1" : "") + "}";
}

// Coordinate descent: for each block size, the best GEMM1 tile (GEMM2 on the heuristic),
// then the best GEMM2 tile with it, each sm90 winner also timed on the static schedule;
// with two sm90 tiles, the sorted input too, and where it wins by 1%, GEMM1's sm90 tile
// again with it. The best block size wins. Then the small-batch
// kernels where the chunk has few enough slots: the aligned config stays in the entry
// (the path of chunks that do not qualify). Returns the config and its time.
std::pair<moelora::MoeKernelConfig, double> tune_cell(LayerCell& cell, const Model& m, int64_t M, int iters, bool trace,
                                                      bool sm90) {
  const double slots_per_expert = double(M) * m.top_k / m.E;
  moelora::MoeKernelConfig best;
  double best_us = INFINITY;
  for (int64_t block_size : {16, 32, 64, 128}) {
    // Blocks much taller than an expert's slot count only add padding rows.
    if (block_size > 16 && block_size > 4 * slots_per_expert) continue;
    // Short tiles re-read each weight slab once per tile: hopeless once experts see
    // hundreds of slots, and the slowest candidates to time.
    if (block_size < 64 && slots_per_expert >= 256) continue;
    moelora::MoeKernelConfig c;
    c.block_size = block_size;
    for (int gemm = 1; gemm <= 2; ++gemm) {
      moelora::GemmTile chosen{};
      double chosen_us = INFINITY;
      std::vector<moelora::GemmTile> candidates = candidate_tiles(block_size, sm90);
      const size_t num_tiles = candidates.size();
      for (size_t i = 0; i < candidates.size(); ++i) {
        const moelora::GemmTile t = candidates[i];
        moelora::MoeKernelConfig trial = c;
        (gemm == 1 ? trial.gemm1 : trial.gemm2) = t;
        const double us = cell.time_us(cell.options(&trial), iters);
        if (trace) {
          std::printf("  trial %-16s M=%-5lld block_size %3lld gemm%d %s  %9.1f us\n", m.name, (long long)M,
                      (long long)block_size, gemm, tile_json(t).c_str(), us);
        }
        if (us < chosen_us) {
          chosen_us = us;
          chosen = t;
        }
        // Last: the winner on the static schedule, when it is an sm90 tile.
        if (i + 1 == num_tiles && chosen.kernel == moelora::GemmKernel::kSm90) {
          moelora::GemmTile static_tile = chosen;
          static_tile.ordered = false;
          candidates.push_back(static_tile);
        }
      }
      (gemm == 1 ? c.gemm1 : c.gemm2) = chosen;
    }
    double c_us = cell.time_us(cell.options(&c), iters);
    // fused_experts ignores the flag on chunks that keep the activation by slot: those
    // time the same, and the 1% margin leaves them without it.
    if (c.gemm1.kernel == moelora::GemmKernel::kSm90 && c.gemm2.kernel == moelora::GemmKernel::kSm90) {
      moelora::MoeKernelConfig sorted = c;
      sorted.sorted_input = true;
      double sorted_us = cell.time_us(cell.options(&sorted), iters);
      if (trace) {
        std::printf("  trial %-16s M=%-5lld block_size %3lld sorted_input  %9.1f us (without %.1f us)\n", m.name,
                    (long long)M, (long long)block_size, sorted_us, c_us);
      }
      if (sorted_us < 0.99 * c_us) {
        for (moelora::GemmTile t : candidate_tiles(block_size, sm90)) {
          if (t.kernel != moelora::GemmKernel::kSm90) continue;
          for (bool ordered : {true, false}) {
            moelora::MoeKernelConfig trial = sorted;
            trial.gemm1 = t;
            trial.gemm1.ordered = ordered;
            const double us = cell.time_us(cell.options(&trial), iters);
            if (trace) {
              std::printf("  trial %-16s M=%-5lld block_size %3lld sorted_input gemm1 %s  %9.1f us\n", m.name,
                          (long long)M, (long long)block_size, tile_json(trial.gemm1).c_str(), us);
            }
            if (us < sorted_us) {
              sorted_us = us;
              sorted = trial;
            }
          }
        }
        c = sorted;
        c_us = sorted_us;
      }
    }
    if (c_us < best_us) {
      best_us = c_us;
      best = c;
    }
  }
  if (M * m.top_k <= moelora::kSmallBatchMaxSlots) {
    moelora::MoeKernelConfig small = best;
    small.small_batch = true;
    const double us = cell.time_us(cell.options(&small), iters);
    if (trace) {
      std::printf("  trial %-16s M=%-5lld small_batch  %9.1f us (aligned best %.1f us)\n", m.name, (long long)M, us,
                  best_us);
    }
    if (us < best_us) {
      best_us = us;
      best = small;
    }
  }
  return {best, best_us};
}

int tune(const Options& o) {
  const bool sm90 = moelora::cuda::current_device_facts().sm90_kernels;
  for (const Model* model : o.models) {
    const Model& m = *model;
    const ModelWeights w(m, o.dtype, true);
    const std::string file = o.tune_dir + "/" + moelora::kernel_config_file_name(m.E, m.I, o.dtype);
    std::string json = "{\n";
    for (size_t i = 0; i < o.tokens.size(); ++i) {
      const int64_t M = o.tokens[i];
      LayerCell cell(m, M, o.dtype, true, w.w13_run, w.w2_run);
      const auto [config, us] = tune_cell(cell, m, M, o.iters > 0 ? o.iters : 7, o.trace, sm90);
      std::printf("tune %-16s M=%-5lld %9.1f us  %s\n", m.name, (long long)M, us, config_json(config).c_str());
      std::fflush(stdout);
      json += "  \"" + std::to_string(M) + "\": " + config_json(config) + (i + 1 < o.tokens.size() ? ",\n" : "\n");
    }
    json += "}\n";
    FILE* f = std::fopen(file.c_str(), "w");
    if (!f) throw std::runtime_error("cannot write " + file);
    std::fputs(json.c_str(), f);
    std::fclose(f);
    // Also on stdout: a file name with '=' and ',' may not survive every transport.
    std::printf("wrote %s\n%s", file.c_str(), json.c_str());
  }
  return 0;
}
#endif

const char* model_dtype(DType d) { return d == DType::kBFloat16 ? "bf16" : "fp16"; }

constexpr double kMaxRelErr = 1e-2;  // a checked row passes at or below this relative error

// One console line per row; a LoRA row has "  + lora r=R" in the model column and ends
// with the size of the delta and the tax over the cell's base row.
void print_row(const Row& row) {
  const std::string baseline =
      row.baseline_us > 0 ? "  baseline " + std::to_string(int64_t(row.baseline_us + 0.5)) + " us (x" +
                                std::to_string(row.baseline_us / row.time_us).substr(0, 4) + ")"
                          : std::string();
  char lora_tail[160] = "";
  if (row.lora_rank > 0) {
    const std::string delta =
        row.check.tokens ? "  lora_delta " + std::to_string(row.check.lora_delta).substr(0, 6) : std::string();
    std::snprintf(lora_tail, sizeof lora_tail, "%s  tax x%.3f on base %.1f us (floor x%.3f)", delta.c_str(),
                  row.lora_tax, row.base_us, row.tax_floor);
  }
  const std::string label = row.lora_rank > 0 ? "  + lora r=" + std::to_string(row.lora_rank) : row.model->name;
  // The row's verdict against the float64 reference (kMaxRelErr).
  const std::string checked = row.check.tokens ? std::to_string(row.check.rel_err) + " (" +
                                                     std::to_string(row.check.tokens) + " tokens) " +
                                                     (row.check.rel_err <= kMaxRelErr ? "ok" : "FAIL")
                                               : std::string("not checked");
  std::printf("%-16s M=%-5lld %8.1f us  floor %8.1f us (%5.1f%%)  %6.3f TB/s  %7.2f TFLOP/s  rel_err %s%s%s\n",
              label.c_str(), (long long)row.M, row.time_us, row.floor_us, 100 * row.floor_us / row.time_us,
              row.bytes / (row.time_us * 1e-6) / 1e12, row.flops / (row.time_us * 1e-6) / 1e12,
              checked.c_str(), baseline.c_str(), lora_tail);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const bool use_cuda = o.cuda;

  Ceilings ceilings;
  try {
#ifdef MOELORA_WITH_CUDA
    if (!o.tune_dir.empty()) {
      if (!use_cuda) usage("--tune needs a CUDA device");
      return tune(o);
    }
    if (use_cuda && o.ceilings) ceilings = measure_ceilings();
#else
    if (!o.tune_dir.empty()) usage("--tune needs a build with the CUDA backend");
#endif
    std::printf("moelora %s | device %s | dtype %s | ceilings %.2f TB/s copy, %.0f TFLOP/s bf16 (%s)\n",
                moelora::version(), use_cuda ? "cuda" : "cpu", model_dtype(o.dtype), ceilings.copy_tbps,
                ceilings.bf16_tflops, ceilings.measured ? "measured" : "nominal H100, not measured");
    if (!use_cuda) {
      std::printf("note: on the CPU the floor and %% columns are against that nominal H100, not this machine; "
                  "read the time and the rel_err verdict (ok at <= %.0e against a float64 reference)\n",
                  kMaxRelErr);
    }
    if (!o.lora_ranks.empty()) {
      std::string ranks;
      for (int64_t r : o.lora_ranks) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
      std::printf("LoRA rows: rank %s | %lld adapters (scale %.1f, all enabled) | share %.2f of tokens | "
                  "tax = time with LoRA / time without\n",
                  ranks.c_str(), (long long)o.lora_adapters, kLoraScale, o.lora_share);
    }
    std::vector<Row> rows;
    for (const Model* model : o.models) {
      const Model& m = *model;
      const ModelWeights w(m, o.dtype, use_cuda);  // inputs are standard normal (LayerCell)
      // The model's LoRA stacks, one per rank, shared by its cells.
      const std::vector<std::unique_ptr<LoraStacks>> lora_owned =
          make_model_lora_stacks(m, o.dtype, o.lora_ranks, o.lora_adapters, use_cuda);
      std::vector<LoraStacks*> stacks;
      for (const auto& st : lora_owned) stacks.push_back(st.get());
      for (int64_t M : o.tokens) {
        std::vector<Row> cell_rows = run_cell(m, M, o, use_cuda, w.w13_run, w.w2_run, w.w13, w.w2, stacks);
        for (Row& row : cell_rows) {
          const double floor_bw = row.bytes / (ceilings.copy_tbps * 1e12) * 1e6;
          const double floor_fl = row.flops / (ceilings.bf16_tflops * 1e12) * 1e6;
          row.floor_us = std::max(floor_bw, floor_fl);
        }
        const Row& base = cell_rows[0];
        for (Row& row : cell_rows) {
          if (row.lora_rank == 0) continue;
          row.base_us = base.time_us;
          row.lora_tax = row.time_us / base.time_us;
          row.tax_floor = row.floor_us / base.floor_us;
        }
        for (const Row& row : cell_rows) {
          rows.push_back(row);
          print_row(row);
        }
      }
    }

    bool ok = true;
    int64_t checked = 0;
    for (const Row& r : rows) {
      ok = ok && (r.check.tokens == 0 || r.check.rel_err <= kMaxRelErr);
      checked += r.check.tokens > 0;
    }
    if (!o.json_path.empty()) {
      std::vector<std::string> json_rows;
      for (const Row& r : rows) {
        std::string lora = "null", lora_keys;
        if (r.lora_rank > 0) {
          lora = format("{\"rank\": %lld, \"adapters\": %lld, \"share\": %s}", (long long)r.lora_rank,
                        (long long)o.lora_adapters, json_fraction(o.lora_share).c_str());
          lora_keys = format(", \"lora_tax\": %.4f, \"tax_floor\": %.4f, \"base_us\": %.3f%s", r.lora_tax, r.tax_floor,
                             r.base_us,
                             r.check.tokens ? (", \"lora_delta\": " + std::to_string(r.check.lora_delta)).c_str() : "");
        }
        json_rows.push_back(format(
            "{\"op\": \"fused_experts\", \"model\": \"%s\", \"M\": %lld, \"dtype\": \"%s\", \"lora\": %s, "
            "\"device\": \"%s\", \"time_us\": %.3f, \"floor_us\": %.3f, \"pct_floor\": %.2f, \"tbps\": %.4f, "
            "\"tflops\": %.3f, \"rel_err\": %s, \"checked_tokens\": %lld, \"baseline_us\": %s%s}",
            r.model->name, (long long)r.M, model_dtype(o.dtype), lora.c_str(), r.device.c_str(), r.time_us, r.floor_us,
            100 * r.floor_us / r.time_us, r.bytes / (r.time_us * 1e-6) / 1e12, r.flops / (r.time_us * 1e-6) / 1e12,
            r.check.tokens ? std::to_string(r.check.rel_err).c_str() : "null", (long long)r.check.tokens,
            r.baseline_us > 0 ? std::to_string(r.baseline_us).c_str() : "null", lora_keys.c_str()));
      }
      write_bench_json(o.json_path, ceilings, json_rows);
    }
    if (!ok) {
      std::printf("verdict: FAIL: a checked row is above %.0e relative error against the float64 reference\n",
                  kMaxRelErr);
      return 1;
    }
    std::printf("verdict: ok: %lld of %zu rows checked, all within %.0e of the float64 reference\n",
                (long long)checked, rows.size(), kMaxRelErr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moelora_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
