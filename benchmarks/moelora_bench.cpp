// moelora_bench: the main job. Runs the whole MoE layer (fused_experts) at a real
// model's shapes from the design brief, checks it against a float64 reference, and
// prints time, achieved bandwidth and FLOP rate against the roofline floor.
//
//   moelora_bench [--model NAME[,NAME...]|all] [--tokens M[,M...]] [--dtype bf16|fp16]
//                 [--device auto|cpu|cuda] [--iters N] [--no-check] [--ceilings]
//                 [--baseline] [--static-tiles] [--json PATH]
//                 [--lora-rank R[,R...]] [--adapters N] [--lora-share S]
//   moelora_bench --tune DIR [--model NAME|all] [--tokens ...]   (CUDA only)
//
// --baseline also times each cell with the previous issue's kernels (mma.sync, fixed
// tiles, no programmatic dependent launch) and reports the speed-up.
// --static-tiles runs the sm90 GEMMs on the static persistent schedule instead of
// ordered tiles (FusedExpertsOptions::ordered_tiles), for A/B timing.
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
#include "bench_util.h"

#ifdef MOELORA_WITH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

namespace {

using namespace moelora::bench;
using moelora::Activation;
using moelora::DType;
using moelora::TensorView;

struct Model {
  const char* name;
  int64_t E, top_k, H, I;
  Activation activation;
};

// The brief's workloads.
constexpr Model kModels[] = {
    {"mixtral-8x7b", 8, 2, 4096, 14336, Activation::kSilu},
    {"qwen3-30b-a3b", 128, 8, 2048, 768, Activation::kSilu},
    {"qwen3-235b-a22b", 128, 8, 4096, 1536, Activation::kSilu},
    {"deepseek-v3-tp8", 256, 8, 7168, 256, Activation::kSilu},
    {"olmoe-1b-7b", 64, 8, 2048, 1024, Activation::kSilu},
    {"gpt-oss-120b", 128, 4, 2880, 2880, Activation::kSwigluOai},
};

struct Options {
  std::vector<const Model*> models;
  std::vector<int64_t> tokens{16};
  DType dtype = DType::kBFloat16;
  std::string device = "auto";
  int iters = 0;  // 0: chosen per cell
  bool check = true;
  bool ceilings = false;
  bool baseline = false;   // also time the previous issue's kernels per cell
  bool trace = false;      // --tune: print every candidate's time
  bool static_tiles = false;  // sm90 tiles on the static persistent schedule (A/B of ordered tiles)
  std::string tune_dir;    // --tune DIR: search tiles, write the registry's JSON there
  std::string json_path;
  std::vector<int64_t> lora_ranks;  // --lora-rank: one LoRA row per rank and cell; empty: none
  int64_t lora_adapters = 4;        // --adapters: adapter slots L, all filled and enabled
  double lora_share = 1.0;          // --lora-share: fraction of tokens with an adapter
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "moelora_bench: %s\nusage: moelora_bench [--model NAME[,NAME...]|all] [--tokens M[,M...]] [--dtype bf16|fp16]\n"
               "       [--device auto|cpu|cuda] [--iters N] [--no-check] [--ceilings] [--baseline] [--json PATH]\n"
               "       [--static-tiles] [--tune DIR [--trace]]\n"
               "       [--lora-rank R[,R...]] [--adapters N] [--lora-share S]\nmodels:",
               why.c_str());
  for (const Model& m : kModels) std::fprintf(stderr, " %s", m.name);
  std::fprintf(stderr, "\n");
  std::exit(2);
}

std::vector<std::string> split_commas(const std::string& list) {
  std::vector<std::string> items;
  for (size_t at = 0; at <= list.size();) {
    const size_t comma = std::min(list.find(',', at), list.size());
    items.push_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  return items;
}

Options parse(int argc, char** argv) {
  Options o;
  std::string model = "qwen3-30b-a3b";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage("missing value after " + arg);
      return argv[++i];
    };
    if (arg == "--model") model = value();
    else if (arg == "--tokens") {
      o.tokens.clear();
      for (const std::string& t : split_commas(value())) o.tokens.push_back(std::stoll(t));
    } else if (arg == "--dtype") {
      const std::string d = value();
      if (d == "bf16") o.dtype = DType::kBFloat16;
      else if (d == "fp16") o.dtype = DType::kFloat16;
      else usage("--dtype takes bf16 or fp16");
    } else if (arg == "--device") o.device = value();
    else if (arg == "--iters") o.iters = std::stoi(value());
    else if (arg == "--no-check") o.check = false;
    else if (arg == "--ceilings") o.ceilings = true;
    else if (arg == "--json") o.json_path = value();
    else if (arg == "--baseline") o.baseline = true;
    else if (arg == "--trace") o.trace = true;
    else if (arg == "--static-tiles") o.static_tiles = true;
    else if (arg == "--tune") o.tune_dir = value();
    else if (arg == "--lora-rank") {
      o.lora_ranks.clear();
      for (const std::string& r : split_commas(value())) {
        const int64_t rank = std::stoll(r);
        if (rank < 0 || rank > moelora::kMaxLoraRank) {
          usage("--lora-rank takes ranks in [0, " + std::to_string(moelora::kMaxLoraRank) + "]");
        }
        if (rank > 0) o.lora_ranks.push_back(rank);  // 0: no LoRA rows
      }
    } else if (arg == "--adapters") o.lora_adapters = std::stoll(value());
    else if (arg == "--lora-share") o.lora_share = std::stod(value());
    else if (arg == "--help" || arg == "-h") usage("help");
    else usage("unknown argument " + arg);
  }
  for (const std::string& name : split_commas(model)) {  // NAME[,NAME...] or all
    const size_t before = o.models.size();
    for (const Model& m : kModels) {
      if (name == "all" || name == m.name) o.models.push_back(&m);
    }
    if (o.models.size() == before) usage("unknown model " + name);
  }
  for (int64_t t : o.tokens) {
    if (t < 1) usage("--tokens must be >= 1");
  }
  if (o.lora_adapters < 1 || o.lora_adapters > moelora::kMaxLoraAdapters) {
    usage("--adapters takes 1 to " + std::to_string(moelora::kMaxLoraAdapters));
  }
  if (!(o.lora_share >= 0 && o.lora_share <= 1)) usage("--lora-share takes a fraction in [0, 1]");
  if (!o.lora_ranks.empty() && !o.tune_dir.empty()) usage("--tune tunes the base layer: drop --lora-rank");
  return o;
}

float load(DType dtype, const uint16_t* data, int64_t i) {
  return dtype == DType::kBFloat16 ? moelora::host::to_float(moelora::host::bf16{data[i]})
                                   : moelora::host::to_float(moelora::host::fp16{data[i]});
}

// One routing: top_k distinct experts per token uniformly at random, softmax weights.
struct Routing {
  std::vector<int32_t> ids;     // [M, top_k]
  std::vector<float> weights;   // [M, top_k]
  int64_t experts_touched = 0;
};

Routing make_routing(const Model& m, int64_t M, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  Routing r;
  r.ids.resize(M * m.top_k);
  r.weights.resize(M * m.top_k);
  std::vector<int32_t> perm(m.E);
  std::set<int32_t> touched;
  for (int64_t t = 0; t < M; ++t) {
    for (int32_t e = 0; e < m.E; ++e) perm[e] = e;
    float sum = 0;
    for (int64_t j = 0; j < m.top_k; ++j) {
      std::swap(perm[j], perm[j + rng() % (m.E - j)]);
      r.ids[t * m.top_k + j] = perm[j];
      touched.insert(perm[j]);
      r.weights[t * m.top_k + j] = std::exp(normal(rng));
      sum += r.weights[t * m.top_k + j];
    }
    for (int64_t j = 0; j < m.top_k; ++j) r.weights[t * m.top_k + j] /= sum;
  }
  r.experts_touched = int64_t(touched.size());
  return r;
}

// ---- LoRA ---------------------------------------------------------------------------
// adapter_scale of every slot: PEFT's lora_alpha / r with alpha = 2r.
constexpr float kLoraScale = 2.0f;
// The std of each GEMM's LoRA delta over the std of its base output: lora_a ~ N(0, 1/K)
// keeps the shrink at the input's scale, lora_b ~ N(0, sigma_b²) with
// sigma_b = ratio · 0.02·sqrt(K) / (scale · sqrt(r)). With 3% per GEMM the layer's output
// moves by ~5% (Check::lora_delta prints it), far above bf16 rounding, so a dropped or
// wrong delta fails the check.
constexpr double kLoraDeltaRatio = 0.03;
// NOTE: the stacks are L·E·r·(3H + 3I) elements (DeepSeek-V3 at r = 128: 5.8 GB for 4
// adapters, 23 GB for 16); a rank whose stacks exceed this is skipped with a note.
constexpr double kLoraMaxBytes = 20e9;

int64_t lora_stack_elements(const Model& m, int64_t rank, int64_t adapters) {
  return adapters * m.E * rank * (3 * m.H + 3 * m.I);
}

// One model's adapter stacks at one rank, host copies (the reference reads them):
// w13 in two slices (gate, up; gpt-oss's interleaved rows with swiglu_oai), w2 in one.
struct LoraStacks {
  int64_t rank = 0, adapters = 0;
  std::vector<uint16_t> a13[2], b13[2];  // [L, E, r, H], [L, E, I, r]
  std::vector<uint16_t> a2, b2;          // [L, E, r, I], [L, E, H, r]
  bool interleaved = false;
  moelora::MoeLoraWeights w13, w2;       // views on the device of the run
#ifdef MOELORA_WITH_CUDA
  std::vector<std::unique_ptr<DeviceBuffer>> dev;  // device copies
#endif
};

std::unique_ptr<LoraStacks> make_lora_stacks(const Model& m, DType dtype, int64_t rank, int64_t adapters) {
  auto st = std::make_unique<LoraStacks>();
  st->rank = rank;
  st->adapters = adapters;
  st->interleaved = m.activation == Activation::kSwigluOai;
  const int64_t L = adapters, E = m.E, H = m.H, I = m.I;
  const double sd_b13 = kLoraDeltaRatio * 0.02 * std::sqrt(double(H)) / (kLoraScale * std::sqrt(double(rank)));
  const double sd_b2 = kLoraDeltaRatio * 0.02 * std::sqrt(double(I)) / (kLoraScale * std::sqrt(double(rank)));
  const uint64_t seed = 5000 + 16 * uint64_t(rank);
  for (int c = 0; c < 2; ++c) {
    st->a13[c].resize(L * E * rank * H);
    st->b13[c].resize(L * E * I * rank);
    fill_normal(dtype, st->a13[c].data(), int64_t(st->a13[c].size()), seed + c, float(1 / std::sqrt(double(H))));
    fill_normal(dtype, st->b13[c].data(), int64_t(st->b13[c].size()), seed + 2 + c, float(sd_b13));
  }
  st->a2.resize(L * E * rank * I);
  st->b2.resize(L * E * H * rank);
  fill_normal(dtype, st->a2.data(), int64_t(st->a2.size()), seed + 4, float(1 / std::sqrt(double(I))));
  fill_normal(dtype, st->b2.data(), int64_t(st->b2.size()), seed + 5, float(sd_b2));
  return st;
}

// Points the stacks' MoeLoraWeights at data on `device`: the host vectors, or device
// copies in the order a13[0], a13[1], b13[0], b13[1], a2, b2.
void set_lora_views(LoraStacks& st, const Model& m, DType dtype, moelora::Device device, void* const data[6]) {
  const int64_t L = st.adapters, E = m.E, H = m.H, I = m.I, R = st.rank;
  st.w13.num_slices = 2;
  st.w13.interleaved_slices = st.interleaved;
  for (int c = 0; c < 2; ++c) {
    st.w13.lora_a[c] = TensorView::contiguous(data[c], dtype, {L, E, R, H}, device);
    st.w13.lora_b[c] = TensorView::contiguous(data[2 + c], dtype, {L, E, I, R}, device);
  }
  st.w2.num_slices = 1;
  st.w2.lora_a[0] = TensorView::contiguous(data[4], dtype, {L, E, R, I}, device);
  st.w2.lora_b[0] = TensorView::contiguous(data[5], dtype, {L, E, H, R}, device);
}

// The adapters of one batch: round(share · M) tokens chosen at random get adapters
// round-robin (in token order), the others -1.
struct LoraBatch {
  std::vector<int32_t> ids;    // [M]
  int64_t pairs_touched = 0;   // distinct (adapter, expert) pairs of the routed slots
  int64_t adapted_slots = 0;   // slots whose token has an adapter
};

LoraBatch make_lora_batch(const Routing& r, int64_t M, int64_t top_k, int64_t adapters, double share,
                          uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> order(M);
  for (int64_t t = 0; t < M; ++t) order[t] = t;
  std::shuffle(order.begin(), order.end(), rng);
  const int64_t count = std::min<int64_t>(M, std::llround(share * double(M)));
  std::vector<char> chosen(M, 0);
  for (int64_t i = 0; i < count; ++i) chosen[order[i]] = 1;
  LoraBatch b;
  b.ids.assign(M, -1);
  std::set<std::pair<int32_t, int32_t>> pairs;
  for (int64_t t = 0, next = 0; t < M; ++t) {
    if (!chosen[t]) continue;
    b.ids[t] = int32_t(next++ % adapters);
    for (int64_t j = 0; j < top_k; ++j) {
      pairs.insert({b.ids[t], r.ids[t * top_k + j]});
      ++b.adapted_slots;
    }
  }
  b.pairs_touched = int64_t(pairs.size());
  return b;
}

// What one batch's LoRA adds to the layer's floor: the stacks of the (adapter, expert)
// pairs it routes to, the token ids, and the shrink + expand FLOPs of the adapted slots
// (w13: 2 slices of r·H + I·r MACs; w2: r·I + H·r).
void lora_floors(const Model& m, int64_t rank, const LoraBatch& b, int64_t M, double* bytes, double* flops) {
  const double macs_per_pair = double(rank) * (3.0 * m.H + 3.0 * m.I);
  *bytes = b.pairs_touched * macs_per_pair * 2 + M * 4.0;
  *flops = b.adapted_slots * 2.0 * macs_per_pair;
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
  const int64_t R = st ? st->rank : 0;
  std::vector<double> xd(H), act(I), h1(2 * I), act_base(st ? I : 0), u(R), delta2(st ? H : 0);
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
      const int64_t pair = l * m.E + e;
      for (int c = 0; c < 2; ++c) {  // slice 0: gate, 1: up
        for (int64_t i = 0; i < R; ++i) {
          const uint16_t* a_row = st->a13[c].data() + (pair * R + i) * H;
          double s = 0;
          for (int64_t h = 0; h < H; ++h) s += load(dtype, a_row, h) * xd[h];
          u[i] = s;
        }
        for (int64_t col = 0; col < I; ++col) {
          const uint16_t* b_row = st->b13[c].data() + (pair * I + col) * R;
          double s = 0;
          for (int64_t i = 0; i < R; ++i) s += load(dtype, b_row, i) * u[i];
          h1[st->interleaved ? 2 * col + c : c * I + col] += kLoraScale * s;
        }
      }
    }
    activate(h1, act);
    if (st) {
      const int64_t pair = l * m.E + e;
      for (int64_t i = 0; i < R; ++i) {
        const uint16_t* a_row = st->a2.data() + (pair * R + i) * I;
        double s = 0;
        for (int64_t k = 0; k < I; ++k) s += load(dtype, a_row, k) * act[k];
        u[i] = s;
      }
      for (int64_t h = 0; h < H; ++h) {
        const uint16_t* b_row = st->b2.data() + (pair * H + h) * R;
        double s = 0;
        for (int64_t i = 0; i < R; ++i) s += load(dtype, b_row, i) * u[i];
        delta2[h] = kLoraScale * s;
      }
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

// The workspace query's shape; max_loras = lora_rank = 0 without LoRA.
moelora::FusedExpertsShape layer_shape(const Model& m, int64_t M, DType dtype, int64_t max_loras,
                                       int64_t lora_rank) {
  moelora::FusedExpertsShape shape{M, m.top_k, m.E, m.H, m.I, dtype};
  shape.max_loras = max_loras;
  shape.lora_rank = lora_rank;
  return shape;
}

int64_t max_lora_rank(const std::vector<LoraStacks*>& stacks) {
  int64_t rank = 0;
  for (const LoraStacks* st : stacks) rank = std::max(rank, st->rank);
  return rank;
}

// Bytes and FLOPs the layer cannot avoid for one routing.
void floors(const Model& m, int64_t M, int64_t experts_touched, double* bytes, double* flops) {
  const double expert_bytes = 3.0 * m.H * m.I * 2;
  *bytes = experts_touched * expert_bytes + 2.0 * M * m.H * 2 + M * m.top_k * 8.0;
  *flops = 2.0 * M * m.top_k * 3.0 * m.H * m.I;
}

// ---- CPU ----------------------------------------------------------------------------
// The cell's rows: the base layer, then one row per LoRA stack on the same inputs and
// routing (adapters of --adapters / --lora-share).
std::vector<Row> run_cpu(const Model& m, int64_t M, const Options& o, const std::vector<uint16_t>& w13,
                         const std::vector<uint16_t>& w2, const std::vector<LoraStacks*>& stacks) {
  const moelora::Device cpu{};
  std::vector<uint16_t> x(M * m.H), out(M * m.H, 0x7fc0);
  fill_normal(o.dtype, x.data(), int64_t(x.size()), 1000 + M, 1.0f);
  const Routing r = make_routing(m, M, 2000 + M);
  moelora::FusedExpertsOptions fo;
  fo.activation = m.activation;
  const int64_t L = stacks.empty() ? 0 : o.lora_adapters;
  const int64_t ws_bytes =
      moelora::fused_experts_workspace_size(layer_shape(m, M, o.dtype, L, max_lora_rank(stacks)), fo);
  std::vector<uint64_t> workspace((ws_bytes + 7) / 8 + 32);
  void* ws = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(workspace.data()) + 255) / 256 * 256);
  moelora::FusedExpertsArgs args{
      .hidden_states = view(x.data(), o.dtype, {M, m.H}, cpu),
      .w13 = view(const_cast<uint16_t*>(w13.data()), o.dtype, {m.E, 2 * m.I, m.H}, cpu),
      .w2 = view(const_cast<uint16_t*>(w2.data()), o.dtype, {m.E, m.H, m.I}, cpu),
      .topk_weights = view(const_cast<float*>(r.weights.data()), DType::kFloat32, {M, m.top_k}, cpu),
      .topk_ids = view(const_cast<int32_t*>(r.ids.data()), DType::kInt32, {M, m.top_k}, cpu),
      .out = view(out.data(), o.dtype, {M, m.H}, cpu),
      .workspace = view(ws, DType::kInt32, {ws_bytes / 4 + 1}, cpu),
  };
  auto time_layer = [&] {
    std::vector<double> times;
    const int iters = o.iters > 0 ? o.iters : 3;
    for (int i = 0; i < iters; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      moelora::fused_experts(args, fo);
      times.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      if (times.back() > 5e6) break;  // a slow cell needs no more samples
    }
    return median(times);
  };
  std::vector<Row> rows;
  Row row{&m, M, "cpu", time_layer(), 0, 0, 0, {}};
  floors(m, M, r.experts_touched, &row.bytes, &row.flops);
  if (o.check) row.check = check_layer(m, o.dtype, x, w13.data(), w2.data(), r, out, M);
  rows.push_back(row);
  if (stacks.empty()) return rows;

  LoraBatch batch = make_lora_batch(r, M, m.top_k, L, o.lora_share, 3000 + M);
  std::vector<int32_t> enabled(L, 1);
  std::vector<float> scale(L, kLoraScale);
  const TensorView enabled_view = view(enabled.data(), DType::kInt32, {L}, cpu);
  const TensorView scale_view = view(scale.data(), DType::kFloat32, {L}, cpu);
  moelora::FusedExpertsLora lora;  // stacks set per row below
  lora.adapters = moelora::MoeLoraAdapters{.token_lora_ids = view(batch.ids.data(), DType::kInt32, {M}, cpu),
                                           .adapter_enabled = &enabled_view,
                                           .adapter_scale = &scale_view};
  args.lora = &lora;
  for (LoraStacks* st : stacks) {
    lora.w13 = st->w13;
    lora.w2 = st->w2;
    std::fill(out.begin(), out.end(), uint16_t(0x7fc0));  // poison: NaN
    Row lrow{&m, M, "cpu", time_layer(), 0, 0, 0, {}};
    lrow.lora_rank = st->rank;
    double bytes, flops;
    lora_floors(m, st->rank, batch, M, &bytes, &flops);
    lrow.bytes = row.bytes + bytes;
    lrow.flops = row.flops + flops;
    if (o.check) {
      const LoraRef ref{st, batch.ids.data()};
      lrow.check = check_layer(m, o.dtype, x, w13.data(), w2.data(), r, out, M, &ref);
    }
    rows.push_back(lrow);
  }
  return rows;
}

#ifdef MOELORA_WITH_CUDA
// One (model, M) cell on the GPU: kRotations input sets with different routings, and
// layer timings under any options (config overrides for tuning and the baseline).
class CudaCell {
 public:
  // NOTE: kRotations input sets with different routings in one graph, so that the
  // weights one call reads are not in L2 from the call before.
  static constexpr int kRotations = 4;

  // With `stacks` (device views set), each rotation also gets adapters for
  // set_lora(): `adapters` slots, all enabled, and a share `share` of tokens with one.
  CudaCell(const Model& m, int64_t M, DType dtype, const void* w13, const void* w2,
           const std::vector<LoraStacks*>& stacks = {}, int64_t adapters = 0, double share = 0)
      : m_(m), M_(M), dtype_(dtype) {
    const moelora::Device gpu{moelora::DeviceType::kCUDA, 0};
    moelora::FusedExpertsOptions fo;
    fo.activation = m.activation;
    const int64_t L = stacks.empty() ? 0 : adapters;
    const moelora::FusedExpertsShape shape = layer_shape(m, M, dtype, L, max_lora_rank(stacks));
    // Room for any config a tuning trial passes, the sorted input included.
    moelora::MoeKernelConfig sorted_input;
    sorted_input.sorted_input = true;
    moelora::FusedExpertsOptions sorted_fo = fo;
    sorted_fo.config = &sorted_input;
    const int64_t ws_bytes = std::max(moelora::fused_experts_workspace_size(shape, fo),
                                      moelora::fused_experts_workspace_size(shape, sorted_fo));
    workspace_ = std::make_unique<DeviceBuffer>(ws_bytes);
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    x_host_.resize(kRotations);
    for (int r = 0; r < kRotations; ++r) {
      x_host_[r].resize(M * m.H);
      fill_normal(dtype, x_host_[r].data(), M * m.H, 1000 + 17 * r + M, 1.0f);
      routing_.push_back(make_routing(m, M, 2000 + 31 * r + M));
      x_dev_.push_back(std::make_unique<DeviceBuffer>(M * m.H * 2));
      out_dev_.push_back(std::make_unique<DeviceBuffer>(M * m.H * 2));
      ids_dev_.push_back(std::make_unique<DeviceBuffer>(M * m.top_k * 4));
      weights_dev_.push_back(std::make_unique<DeviceBuffer>(M * m.top_k * 4));
      CHECK_CUDA(cudaMemcpy(x_dev_[r]->ptr, x_host_[r].data(), M * m.H * 2, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(ids_dev_[r]->ptr, routing_[r].ids.data(), M * m.top_k * 4, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(weights_dev_[r]->ptr, routing_[r].weights.data(), M * m.top_k * 4, cudaMemcpyHostToDevice));
      args_.push_back(moelora::FusedExpertsArgs{
          .hidden_states = view(x_dev_[r]->ptr, dtype, {M, m.H}, gpu),
          .w13 = view(const_cast<void*>(w13), dtype, {m.E, 2 * m.I, m.H}, gpu),
          .w2 = view(const_cast<void*>(w2), dtype, {m.E, m.H, m.I}, gpu),
          .topk_weights = view(weights_dev_[r]->ptr, DType::kFloat32, {M, m.top_k}, gpu),
          .topk_ids = view(ids_dev_[r]->ptr, DType::kInt32, {M, m.top_k}, gpu),
          .out = view(out_dev_[r]->ptr, dtype, {M, m.H}, gpu),
          .workspace = view(workspace_->ptr, DType::kInt32, {ws_bytes / 4}, gpu),
      });
    }
    if (L > 0) {
      // NOTE: the stacks do not rotate (they are shared by every call); each rotation
      // has its own adapter ids over its own routing.
      const std::vector<int32_t> enabled(L, 1);
      const std::vector<float> scale(L, kLoraScale);
      enabled_dev_ = std::make_unique<DeviceBuffer>(L * 4);
      scale_dev_ = std::make_unique<DeviceBuffer>(L * 4);
      CHECK_CUDA(cudaMemcpy(enabled_dev_->ptr, enabled.data(), L * 4, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(scale_dev_->ptr, scale.data(), L * 4, cudaMemcpyHostToDevice));
      enabled_view_ = view(enabled_dev_->ptr, DType::kInt32, {L}, gpu);
      scale_view_ = view(scale_dev_->ptr, DType::kFloat32, {L}, gpu);
      lora_.resize(kRotations);
      for (int r = 0; r < kRotations; ++r) {
        lora_batch_.push_back(make_lora_batch(routing_[r], M, m.top_k, L, share, 3000 + 37 * r + M));
        lora_ids_dev_.push_back(std::make_unique<DeviceBuffer>(M * 4));
        CHECK_CUDA(cudaMemcpy(lora_ids_dev_[r]->ptr, lora_batch_[r].ids.data(), M * 4, cudaMemcpyHostToDevice));
        lora_[r].adapters = moelora::MoeLoraAdapters{.token_lora_ids = view(lora_ids_dev_[r]->ptr, DType::kInt32, {M}, gpu),
                                                     .adapter_enabled = &enabled_view_,
                                                     .adapter_scale = &scale_view_};
      }
    }
  }
  ~CudaCell() { cudaStreamDestroy(stream_); }

  // The stacks every following call runs with (one of the constructor's), or none.
  void set_lora(const LoraStacks* stacks) {
    lora_stacks_ = stacks;
    for (int r = 0; r < kRotations; ++r) {
      if (stacks) {
        lora_[r].w13 = stacks->w13;
        lora_[r].w2 = stacks->w2;
      }
      args_[r].lora = stacks ? &lora_[r] : nullptr;
    }
  }

  moelora::FusedExpertsOptions options(const moelora::MoeKernelConfig* config) const {
    moelora::FusedExpertsOptions fo;
    fo.activation = m_.activation;
    fo.config = config;
    return fo;
  }

  // One call on rotation 0 into a poisoned output, returned for checking.
  std::vector<uint16_t> run_once(const moelora::FusedExpertsOptions& fo) {
    CHECK_CUDA(cudaMemset(out_dev_[0]->ptr, 0xff, M_ * m_.H * 2));  // poison: NaN in bf16 and fp16
    moelora::fused_experts(args_[0], fo, stream_);
    CHECK_CUDA(cudaStreamSynchronize(stream_));
    std::vector<uint16_t> out_host(M_ * m_.H);
    CHECK_CUDA(cudaMemcpy(out_host.data(), out_dev_[0]->ptr, M_ * m_.H * 2, cudaMemcpyDeviceToHost));
    return out_host;
  }

  // Median over `iters` replays of a graph of kRotations layer calls, per call.
  double time_us(const moelora::FusedExpertsOptions& fo, int iters) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    for (int r = 0; r < kRotations; ++r) moelora::fused_experts(args_[r], fo, stream_);
    CHECK_CUDA(cudaStreamEndCapture(stream_, &graph));
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    for (int i = 0; i < 2; ++i) CHECK_CUDA(cudaGraphLaunch(exec, stream_));
    std::vector<double> times;
    for (int i = 0; i < iters; ++i) {
      CHECK_CUDA(cudaEventRecord(start, stream_));
      CHECK_CUDA(cudaGraphLaunch(exec, stream_));
      CHECK_CUDA(cudaEventRecord(stop, stream_));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      times.push_back(ms * 1e3 / kRotations);
    }
    CHECK_CUDA(cudaEventDestroy(start));
    CHECK_CUDA(cudaEventDestroy(stop));
    CHECK_CUDA(cudaGraphExecDestroy(exec));
    CHECK_CUDA(cudaGraphDestroy(graph));
    return median(times);
  }

  // Averages over the rotations; with LoRA set, the stacks' share is added.
  void floors(double* bytes, double* flops) const {
    double bytes_sum = 0, flops_sum = 0;
    for (int r = 0; r < kRotations; ++r) {
      double b, f;
      ::floors(m_, M_, routing_[r].experts_touched, &b, &f);
      bytes_sum += b;
      flops_sum += f;
      if (lora_stacks_) {
        lora_floors(m_, lora_stacks_->rank, lora_batch_[r], M_, &b, &f);
        bytes_sum += b;
        flops_sum += f;
      }
    }
    *bytes = bytes_sum / kRotations;
    *flops = flops_sum / kRotations;
  }

  Check check(const std::vector<uint16_t>& out, const std::vector<uint16_t>& w13_host,
              const std::vector<uint16_t>& w2_host) const {
    if (lora_stacks_) {
      const LoraRef ref{lora_stacks_, lora_batch_[0].ids.data()};
      return check_layer(m_, dtype_, x_host_[0], w13_host.data(), w2_host.data(), routing_[0], out, M_, &ref);
    }
    return check_layer(m_, dtype_, x_host_[0], w13_host.data(), w2_host.data(), routing_[0], out, M_);
  }

 private:
  const Model& m_;
  int64_t M_;
  DType dtype_;
  cudaStream_t stream_;
  std::unique_ptr<DeviceBuffer> workspace_;
  std::vector<std::vector<uint16_t>> x_host_;
  std::vector<Routing> routing_;
  std::vector<std::unique_ptr<DeviceBuffer>> x_dev_, out_dev_, ids_dev_, weights_dev_;
  std::vector<moelora::FusedExpertsArgs> args_;
  // LoRA (constructed with stacks): per-rotation adapter ids; args_[r].lora points into
  // lora_ (sized once, never moved) while set_lora() has stacks set.
  std::unique_ptr<DeviceBuffer> enabled_dev_, scale_dev_;
  TensorView enabled_view_, scale_view_;
  std::vector<LoraBatch> lora_batch_;
  std::vector<std::unique_ptr<DeviceBuffer>> lora_ids_dev_;
  std::vector<moelora::FusedExpertsLora> lora_;
  const LoraStacks* lora_stacks_ = nullptr;
};

// The previous issue's kernels: mma.sync tiles of (16|32|64) x 128 on the heuristic
// block size, the separate activation kernel, no programmatic dependent launch.
moelora::MoeKernelConfig baseline_config(const Model& m, int64_t M) {
  moelora::MoeKernelConfig c;
  c.block_size = moelora::fused_experts_block_size(M, m.top_k, m.E);
  const int32_t rows = c.block_size % 64 == 0 ? 64 : c.block_size % 32 == 0 ? 32 : 16;
  c.gemm1 = c.gemm2 = moelora::GemmTile{moelora::GemmKernel::kSm80, rows, 128};
  return c;
}

// The cell's rows: the base layer, then one row per LoRA stack on the same rotations.
std::vector<Row> run_cuda(const Model& m, int64_t M, const Options& o, const void* w13, const void* w2,
                          const std::vector<uint16_t>& w13_host, const std::vector<uint16_t>& w2_host,
                          const std::vector<LoraStacks*>& stacks) {
  CudaCell cell(m, M, o.dtype, w13, w2, stacks, o.lora_adapters, o.lora_share);
  const int iters = o.iters > 0 ? o.iters : 30;
  Row row{&m, M, "cuda", 0, 0, 0, 0, {}};
  auto fo = cell.options(nullptr);  // the registry's config
  fo.ordered_tiles = !o.static_tiles;
  const std::vector<uint16_t> out = cell.run_once(fo);
  row.time_us = cell.time_us(fo, iters);
  if (o.baseline) {
    const moelora::MoeKernelConfig base = baseline_config(m, M);
    moelora::FusedExpertsOptions base_options = cell.options(&base);
    base_options.fuse_activation = false;
    moelora::cuda::set_pdl_allowed(false);
    row.baseline_us = cell.time_us(base_options, iters);
    moelora::cuda::set_pdl_allowed(true);
  }
  cell.floors(&row.bytes, &row.flops);
  if (o.check) row.check = cell.check(out, w13_host, w2_host);
  std::vector<Row> rows{row};
  for (const LoraStacks* st : stacks) {
    cell.set_lora(st);
    Row lrow{&m, M, "cuda", 0, 0, 0, 0, {}};
    lrow.lora_rank = st->rank;
    const std::vector<uint16_t> lora_out = cell.run_once(fo);
    lrow.time_us = cell.time_us(fo, iters);
    cell.floors(&lrow.bytes, &lrow.flops);
    if (o.check) lrow.check = cell.check(lora_out, w13_host, w2_host);
    rows.push_back(lrow);
  }
  cell.set_lora(nullptr);
  return rows;
}

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
std::pair<moelora::MoeKernelConfig, double> tune_cell(CudaCell& cell, const Model& m, int64_t M, int iters, bool trace,
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
    std::vector<uint16_t> w13(m.E * 2 * m.I * m.H), w2(m.E * m.H * m.I);
    fill_normal(o.dtype, w13.data(), int64_t(w13.size()), 11, 0.02f);
    fill_normal(o.dtype, w2.data(), int64_t(w2.size()), 12, 0.02f);
    DeviceBuffer w13_dev(w13.size() * 2), w2_dev(w2.size() * 2);
    CHECK_CUDA(cudaMemcpy(w13_dev.ptr, w13.data(), w13.size() * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(w2_dev.ptr, w2.data(), w2.size() * 2, cudaMemcpyHostToDevice));
    const std::string file = o.tune_dir + "/" + moelora::kernel_config_file_name(m.E, m.I, o.dtype);
    std::string json = "{\n";
    for (size_t i = 0; i < o.tokens.size(); ++i) {
      const int64_t M = o.tokens[i];
      CudaCell cell(m, M, o.dtype, w13_dev.ptr, w2_dev.ptr);
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
  std::printf("%-16s M=%-5lld %8.1f us  floor %8.1f us (%5.1f%%)  %6.3f TB/s  %7.2f TFLOP/s  rel_err %s%s%s\n",
              label.c_str(), (long long)row.M, row.time_us, row.floor_us, 100 * row.floor_us / row.time_us,
              row.bytes / (row.time_us * 1e-6) / 1e12, row.flops / (row.time_us * 1e-6) / 1e12,
              row.check.tokens ? (std::to_string(row.check.rel_err) + " (" + std::to_string(row.check.tokens) +
                                  " tokens)").c_str()
                               : "not checked",
              baseline.c_str(), lora_tail);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::string device_error;
  const bool use_cuda = choose_cuda(o.device, &device_error);
  if (!device_error.empty()) usage(device_error);

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
      std::vector<uint16_t> w13(m.E * 2 * m.I * m.H), w2(m.E * m.H * m.I);
      // Weights ~0.02 as in the brief; inputs standard normal.
      fill_normal(o.dtype, w13.data(), int64_t(w13.size()), 11, 0.02f);
      fill_normal(o.dtype, w2.data(), int64_t(w2.size()), 12, 0.02f);
#ifdef MOELORA_WITH_CUDA
      std::unique_ptr<DeviceBuffer> w13_dev, w2_dev;
      if (use_cuda) {
        w13_dev = std::make_unique<DeviceBuffer>(w13.size() * 2);
        w2_dev = std::make_unique<DeviceBuffer>(w2.size() * 2);
        CHECK_CUDA(cudaMemcpy(w13_dev->ptr, w13.data(), w13.size() * 2, cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMemcpy(w2_dev->ptr, w2.data(), w2.size() * 2, cudaMemcpyHostToDevice));
      }
#endif
      // The model's LoRA stacks, one per rank, shared by its cells.
      std::vector<std::unique_ptr<LoraStacks>> lora_owned;
      std::vector<LoraStacks*> stacks;
      for (int64_t rank : o.lora_ranks) {
        const double bytes = 2.0 * double(lora_stack_elements(m, rank, o.lora_adapters));
        std::string skip;
        if (bytes > kLoraMaxBytes) skip = "over the " + std::to_string(int(kLoraMaxBytes / 1e9)) + " GB limit";
#ifdef MOELORA_WITH_CUDA
        if (skip.empty() && use_cuda) {
          size_t free_bytes = 0, total_bytes = 0;
          CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
          // NOTE: 8 GB left for the cell's inputs, outputs and workspace.
          if (bytes + 8e9 > double(free_bytes)) {
            skip = "more than the device's free " + std::to_string(int(free_bytes / 1e9)) + " GB less 8 GB";
          }
        }
#endif
        if (!skip.empty()) {
          std::printf("note: %s LoRA r=%lld with %lld adapters skipped in every cell: its stacks take %.1f GB, %s\n",
                      m.name, (long long)rank, (long long)o.lora_adapters, bytes / 1e9, skip.c_str());
          continue;
        }
        lora_owned.push_back(make_lora_stacks(m, o.dtype, rank, o.lora_adapters));
        LoraStacks& st = *lora_owned.back();
        void* data[6] = {st.a13[0].data(), st.a13[1].data(), st.b13[0].data(),
                         st.b13[1].data(), st.a2.data(),     st.b2.data()};
#ifdef MOELORA_WITH_CUDA
        if (use_cuda) {
          const std::vector<uint16_t>* host[6] = {&st.a13[0], &st.a13[1], &st.b13[0], &st.b13[1], &st.a2, &st.b2};
          for (int i = 0; i < 6; ++i) {
            st.dev.push_back(std::make_unique<DeviceBuffer>(host[i]->size() * 2));
            CHECK_CUDA(cudaMemcpy(st.dev[i]->ptr, host[i]->data(), host[i]->size() * 2, cudaMemcpyHostToDevice));
            data[i] = st.dev[i]->ptr;
          }
        }
        set_lora_views(st, m, o.dtype, use_cuda ? moelora::Device{moelora::DeviceType::kCUDA, 0} : moelora::Device{},
                       data);
#else
        set_lora_views(st, m, o.dtype, moelora::Device{}, data);
#endif
        stacks.push_back(&st);
      }
      for (int64_t M : o.tokens) {
#ifdef MOELORA_WITH_CUDA
        std::vector<Row> cell_rows = use_cuda ? run_cuda(m, M, o, w13_dev->ptr, w2_dev->ptr, w13, w2, stacks)
                                              : run_cpu(m, M, o, w13, w2, stacks);
#else
        std::vector<Row> cell_rows = run_cpu(m, M, o, w13, w2, stacks);
#endif
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
    for (const Row& r : rows) ok = ok && (r.check.tokens == 0 || r.check.rel_err <= 1e-2);
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
      std::printf("FAILED: a checked cell is above 1e-2 relative error\n");
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moelora_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
