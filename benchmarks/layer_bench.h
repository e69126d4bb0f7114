// What the layer benches share (moelora_bench: bf16/fp16 experts; quant_bench: 8-bit
// experts): the brief's models and their weights, the flags both take, random routings,
// LoRA adapter stacks and batches, the layer's floors, and LayerCell, one (model, M)
// cell's rotated inputs and its timing.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.h"
#include "common/host_numeric.h"
#include "moelora/ops.h"

namespace moelora::bench {

using moelora::Activation;
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

inline std::vector<std::string> split_commas(const std::string& list) {
  std::vector<std::string> items;
  for (size_t at = 0; at <= list.size();) {
    const size_t comma = std::min(list.find(',', at), list.size());
    items.push_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  return items;
}

// ---- command line -----------------------------------------------------------------------
// The flags every layer bench takes; a bench's Options derive from this.
struct LayerBenchOptions {
  std::vector<const Model*> models;
  std::vector<int64_t> tokens;
  std::string device = "auto";
  bool cuda = false;  // --device resolved: run on the CUDA backend
  int iters = 0;  // 0: chosen per cell
  bool check = true;
  bool ceilings = false;
  std::string json_path;
  std::vector<int64_t> lora_ranks;  // --lora-rank: one LoRA row per rank and cell; empty: none
  int64_t lora_adapters = 4;        // --adapters: adapter slots L, all filled and enabled
  double lora_share = 1.0;          // --lora-share: fraction of tokens with an adapter
};

// Prints why and the usage of `bench` (the shared flags, then own_flags), and exits 2.
[[noreturn]] inline void exit_with_usage(const char* bench, const std::string& why, const char* own_flags) {
  std::fprintf(stderr,
               "%s: %s\nusage: %s [--model NAME[,NAME...]|all] [--tokens M[,M...]] [--device auto|cpu|cuda] [--iters N]\n"
               "       [--no-check] [--ceilings] [--json PATH] [--lora-rank R[,R...]] [--adapters N] [--lora-share S]\n"
               "       %s\nmodels:",
               bench, why.c_str(), bench, own_flags);
  for (const Model& m : kModels) std::fprintf(stderr, " %s", m.name);
  std::fprintf(stderr, "\n");
  std::exit(2);
}

// Reads argv into o: the shared flags here (--model default_model unless given; o.tokens
// keeps its default unless given), any other by own(arg, value), which says false for a
// flag that is not the bench's; a bad argument exits through exit_with_usage.
inline void parse_layer_bench_args(
    int argc, char** argv, const char* bench, const char* own_flags, const std::string& default_model,
    LayerBenchOptions& o, const std::function<bool(const std::string&, const std::function<std::string()>&)>& own) {
  auto usage = [&](const std::string& why) { exit_with_usage(bench, why, own_flags); };
  std::string model = default_model;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::function<std::string()> value = [&]() -> std::string {
      if (i + 1 >= argc) usage("missing value after " + arg);
      return argv[++i];
    };
    if (arg == "--model") model = value();
    else if (arg == "--tokens") {
      o.tokens.clear();
      for (const std::string& t : split_commas(value())) o.tokens.push_back(std::stoll(t));
    } else if (arg == "--device") o.device = value();
    else if (arg == "--iters") o.iters = std::stoi(value());
    else if (arg == "--no-check") o.check = false;
    else if (arg == "--ceilings") o.ceilings = true;
    else if (arg == "--json") o.json_path = value();
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
    else if (!own(arg, value)) usage("unknown argument " + arg);
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
  std::string device_error;
  o.cuda = choose_cuda(o.device, &device_error);
  if (!device_error.empty()) usage(device_error);
}

inline float load(DType dtype, const uint16_t* data, int64_t i) {
  return dtype == DType::kBFloat16 ? moelora::host::to_float(moelora::host::bf16{data[i]})
                                   : moelora::host::to_float(moelora::host::fp16{data[i]});
}

// One routing: top_k distinct experts per token uniformly at random, softmax weights.
struct Routing {
  std::vector<int32_t> ids;     // [M, top_k]
  std::vector<float> weights;   // [M, top_k]
  int64_t experts_touched = 0;
};

inline Routing make_routing(const Model& m, int64_t M, uint64_t seed) {
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

// Bytes and FLOPs the layer cannot avoid for one routing: the routed experts' weights
// (expert_bytes each, scales included), activations in and out (16-bit), ids and weights.
inline void floors(const Model& m, int64_t M, int64_t experts_touched, double expert_bytes, double* bytes,
                   double* flops) {
  *bytes = experts_touched * expert_bytes + 2.0 * M * m.H * 2 + M * m.top_k * 8.0;
  *flops = 2.0 * M * m.top_k * 3.0 * m.H * m.I;
}

// One model's experts as the layer benches make them: normal(0, 0.02) (the brief's scale,
// never zeros) in `dtype` on the host, w13 [E, 2I, H] and w2 [E, H, I], and copies on the
// GPU for CUDA runs; w13_run / w2_run are the run's (the host vectors on the CPU).
struct ModelWeights {
  ModelWeights(const Model& m, DType dtype, bool cuda) : w13(m.E * 2 * m.I * m.H), w2(m.E * m.H * m.I) {
    fill_normal(dtype, w13.data(), int64_t(w13.size()), 11, 0.02f);
    fill_normal(dtype, w2.data(), int64_t(w2.size()), 12, 0.02f);
    w13_run = w13.data();
    w2_run = w2.data();
    if (!cuda) return;
    w13_dev = std::make_unique<Buffer>(true, w13.size() * 2);
    w2_dev = std::make_unique<Buffer>(true, w2.size() * 2);
    w13_dev->upload(w13.data(), w13.size() * 2);
    w2_dev->upload(w2.data(), w2.size() * 2);
    w13_run = w13_dev->ptr();
    w2_run = w2_dev->ptr();
  }
  // Frees the GPU copies (the host vectors stay); w13_run / w2_run are then invalid.
  void free_device() {
    w13_dev.reset();
    w2_dev.reset();
    w13_run = w2_run = nullptr;
  }

  std::vector<uint16_t> w13, w2;
  const void* w13_run;
  const void* w2_run;
  std::unique_ptr<Buffer> w13_dev, w2_dev;
};

// ---- LoRA ---------------------------------------------------------------------------
// adapter_scale of every slot: PEFT's lora_alpha / r with alpha = 2r.
constexpr float kLoraScale = 2.0f;
// The std of each GEMM's LoRA delta over the std of its base output: lora_a ~ N(0, 1/K)
// keeps the shrink at the input's scale, lora_b ~ N(0, sigma_b²) with
// sigma_b = ratio · 0.02·sqrt(K) / (scale · sqrt(r)). With 3% per GEMM the layer's output
// moves by ~5% (moelora_bench's lora_delta), far above bf16 rounding, so a dropped or
// wrong delta fails the check.
constexpr double kLoraDeltaRatio = 0.03;
// NOTE: the stacks are L·E·r·(3H + 3I) elements (DeepSeek-V3 at r = 128: 5.8 GB for 4
// adapters, 23 GB for 16); a rank whose stacks exceed this is skipped with a note.
constexpr double kLoraMaxBytes = 20e9;

inline int64_t lora_stack_elements(const Model& m, int64_t rank, int64_t adapters) {
  return adapters * m.E * rank * (3 * m.H + 3 * m.I);
}

// out[n] += kLoraScale · Σ_i b[c][pair, j, i] · Σ_k a[c][pair, i, k] · in[k] over the
// `slices` slices c of one GEMM's stacks (a [L·E, r, K], b [L·E, N / S, r]; pair = l·E + e);
// slice c holds columns [c·N/S, (c+1)·N/S), or n ≡ c (mod S) when interleaved.
inline void lora_delta_row(const std::vector<uint16_t>* a, const std::vector<uint16_t>* b, int slices,
                           bool interleaved, DType dtype, int64_t pair, int64_t R, int64_t K, int64_t N_slice,
                           const double* in /*[K]*/, double* out /*[N]*/) {
  std::vector<double> u(R);
  for (int c = 0; c < slices; ++c) {
    for (int64_t i = 0; i < R; ++i) {
      const uint16_t* a_row = a[c].data() + (pair * R + i) * K;
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += load(dtype, a_row, k) * in[k];
      u[i] = s;
    }
    for (int64_t j = 0; j < N_slice; ++j) {
      const uint16_t* b_row = b[c].data() + (pair * N_slice + j) * R;
      double s = 0;
      for (int64_t i = 0; i < R; ++i) s += load(dtype, b_row, i) * u[i];
      out[interleaved ? j * slices + c : c * N_slice + j] += kLoraScale * s;
    }
  }
}

// One model's adapter stacks at one rank, host copies (the references read them):
// w13 in two slices (gate, up; gpt-oss's interleaved rows with swiglu_oai), w2 in one.
struct LoraStacks {
  int64_t rank = 0, adapters = 0;
  DType dtype = DType::kBFloat16;
  std::vector<uint16_t> a13[2], b13[2];  // [L, E, r, H], [L, E, I, r]
  std::vector<uint16_t> a2, b2;          // [L, E, r, I], [L, E, H, r]
  bool interleaved = false;
  moelora::MoeLoraWeights w13, w2;       // views on the device of the run
  std::vector<std::unique_ptr<Buffer>> dev;  // device copies (CUDA runs)

  // h1[2I] += the w13 delta of (adapter, expert) pair `pair` (l·E + e) on x[H];
  // h2[H] += the w2 delta on act[I].
  void add_delta13(const Model& m, int64_t pair, const double* x, double* h1) const {
    lora_delta_row(a13, b13, 2, interleaved, dtype, pair, rank, m.H, m.I, x, h1);
  }
  void add_delta2(const Model& m, int64_t pair, const double* act, double* h2) const {
    lora_delta_row(&a2, &b2, 1, false, dtype, pair, rank, m.I, m.H, act, h2);
  }
};

inline std::unique_ptr<LoraStacks> make_lora_stacks(const Model& m, DType dtype, int64_t rank, int64_t adapters) {
  auto st = std::make_unique<LoraStacks>();
  st->rank = rank;
  st->adapters = adapters;
  st->dtype = dtype;
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

// The model's stacks, one per rank, with views on the run's device (copied there on
// CUDA). A rank whose stacks do not fit (kLoraMaxBytes, or the GPU's free memory less
// 8 GB for the cells) is left out with a note.
inline std::vector<std::unique_ptr<LoraStacks>> make_model_lora_stacks(const Model& m, DType dtype,
                                                                       const std::vector<int64_t>& ranks,
                                                                       int64_t adapters, bool cuda) {
  std::vector<std::unique_ptr<LoraStacks>> stacks;
  for (int64_t rank : ranks) {
    const double bytes = 2.0 * double(lora_stack_elements(m, rank, adapters));
    std::string skip;
    if (bytes > kLoraMaxBytes) skip = "over the " + std::to_string(int(kLoraMaxBytes / 1e9)) + " GB limit";
    const double free_bytes = cuda ? device_free_bytes() : INFINITY;
    if (skip.empty() && bytes + 8e9 > free_bytes) {
      skip = "more than the device's free " + std::to_string(int(free_bytes / 1e9)) + " GB less 8 GB";
    }
    if (!skip.empty()) {
      std::printf("note: %s LoRA r=%lld with %lld adapters skipped in every cell: its stacks take %.1f GB, %s\n",
                  m.name, (long long)rank, (long long)adapters, bytes / 1e9, skip.c_str());
      continue;
    }
    stacks.push_back(make_lora_stacks(m, dtype, rank, adapters));
    LoraStacks& st = *stacks.back();
    std::vector<uint16_t>* host[6] = {&st.a13[0], &st.a13[1], &st.b13[0], &st.b13[1], &st.a2, &st.b2};
    void* data[6];
    for (int i = 0; i < 6; ++i) {
      data[i] = host[i]->data();
      if (!cuda) continue;
      st.dev.push_back(std::make_unique<Buffer>(true, host[i]->size() * 2));
      st.dev.back()->upload(host[i]->data(), host[i]->size() * 2);
      data[i] = st.dev.back()->ptr();
    }
    const moelora::Device device = cuda ? moelora::Device{moelora::DeviceType::kCUDA, 0} : moelora::Device{};
    const int64_t L = adapters, E = m.E, H = m.H, I = m.I, R = rank;
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
  return stacks;
}

// The adapters of one batch: round(share · M) tokens chosen at random get adapters
// round-robin (in token order), the others -1.
struct LoraBatch {
  std::vector<int32_t> ids;    // [M]
  int64_t pairs_touched = 0;   // distinct (adapter, expert) pairs of the routed slots
  int64_t adapted_slots = 0;   // slots whose token has an adapter
};

inline LoraBatch make_lora_batch(const Routing& r, int64_t M, int64_t top_k, int64_t adapters, double share,
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
inline void lora_floors(const Model& m, int64_t rank, const LoraBatch& b, int64_t M, double* bytes, double* flops) {
  const double macs_per_pair = double(rank) * (3.0 * m.H + 3.0 * m.I);
  *bytes = b.pairs_touched * macs_per_pair * 2 + M * 4.0;
  *flops = b.adapted_slots * 2.0 * macs_per_pair;
}

inline int64_t max_lora_rank(const std::vector<LoraStacks*>& stacks) {
  int64_t rank = 0;
  for (const LoraStacks* st : stacks) rank = std::max(rank, st->rank);
  return rank;
}

// ---- one (model, M) cell ------------------------------------------------------------
// kRotations input sets with different routings (and, with LoRA stacks, adapter ids),
// and layer timings under any options (config overrides for tuning and the baseline).
// On CUDA each timing captures one layer call per rotation in a CUDA graph, replayed
// after a warm-up; on the CPU it is the median of plain calls.
class LayerCell {
 public:
  // NOTE: kRotations input sets with different routings in one graph, so that the
  // weights one call reads are not in L2 from the call before.
  static constexpr int kRotations = 4;

  // w13 [E, 2I, H], w2 [E, H, I] on the run's device: `dtype`, or quant->scheme.element
  // with quant's scales (weight-only 4-bit: [E, 2I, H / 2], [E, H, I / 2]). With `stacks` (device views set), each rotation also gets
  // adapters for set_lora(): `adapters` slots, all enabled, a share `share` of tokens.
  LayerCell(const Model& m, int64_t M, DType dtype, bool cuda, const void* w13, const void* w2,
            const std::vector<LoraStacks*>& stacks = {}, int64_t adapters = 0, double share = 0,
            const moelora::FusedExpertsQuant* quant = nullptr)
      : m_(m), M_(M), cuda_(cuda) {
    const moelora::Device device = cuda ? moelora::Device{moelora::DeviceType::kCUDA, 0} : moelora::Device{};
    const DType w_dtype = quant ? quant->scheme.element : dtype;
    // Weight-only 4-bit experts: two weights a byte along K.
    const int64_t per_byte = quant && quant->scheme.weight_only() && quant->scheme.weight_bits == 4 ? 2 : 1;
    const int64_t L = stacks.empty() ? 0 : adapters;
    moelora::FusedExpertsShape shape{M, m.top_k, m.E, m.H, m.I, dtype};
    shape.max_loras = L;
    shape.lora_rank = max_lora_rank(stacks);
    if (quant) shape.quant = quant->scheme;
    // Room for any config a tuning trial passes, the sorted input included.
    moelora::MoeKernelConfig sorted_input;
    sorted_input.sorted_input = true;
    moelora::FusedExpertsOptions sorted_fo = options(nullptr);
    sorted_fo.config = &sorted_input;
    // ... and for weight-only experts any forced path (the dense one holds the dequantized experts).
    moelora::FusedExpertsOptions dense_fo = options(nullptr);
    dense_fo.weight_only_path = moelora::WeightOnlyPath::kDense;
    // ... and the grouped GEMMs forced on (16-bit experts reserve them only from
    // grouped_16bit_min_slots unless a config asks), with the sorted input's room.
    moelora::MoeKernelConfig grouped;
    grouped.grouped_gemm = true;
    grouped.sorted_input = true;
    moelora::FusedExpertsOptions grouped_fo = options(nullptr);
    grouped_fo.config = &grouped;
    // ... for the cell's base rows too (set_lora(nullptr)): without adapters a call may take
    // the grouped path, whose rooms a shape with LoRA does not reserve.
    moelora::FusedExpertsShape base_shape = shape;
    base_shape.max_loras = base_shape.lora_rank = 0;
    int64_t ws_bytes = 0;
    for (const moelora::FusedExpertsShape& s : {shape, base_shape}) {
      ws_bytes = std::max({ws_bytes, moelora::fused_experts_workspace_size(s, options(nullptr)),
                           moelora::fused_experts_workspace_size(s, sorted_fo),
                           moelora::fused_experts_workspace_size(s, grouped_fo),
                           quant && quant->scheme.weight_only() ? moelora::fused_experts_workspace_size(s, dense_fo)
                                                                : int64_t(0)});
    }
    workspace_ = std::make_unique<Buffer>(cuda, ws_bytes);
#ifdef MOELORA_WITH_CUDA
    if (cuda) CHECK_CUDA(cudaStreamCreateWithFlags(reinterpret_cast<cudaStream_t*>(&stream_), cudaStreamNonBlocking));
#endif
    auto buffer = [&](const void* host, size_t bytes) {
      bufs_.push_back(std::make_unique<Buffer>(cuda, bytes));
      if (host) bufs_.back()->upload(host, bytes);
      return bufs_.back().get();
    };
    x_host_.resize(kRotations);
    for (int r = 0; r < kRotations; ++r) {
      x_host_[r].resize(M * m.H);
      fill_normal(dtype, x_host_[r].data(), M * m.H, 1000 + 17 * r + M, 1.0f);
      routing_.push_back(make_routing(m, M, 2000 + 31 * r + M));
      out_.push_back(buffer(nullptr, M * m.H * 2));
      args_.push_back(moelora::FusedExpertsArgs{
          .hidden_states = view(buffer(x_host_[r].data(), M * m.H * 2)->ptr(), dtype, {M, m.H}, device),
          .w13 = view(const_cast<void*>(w13), w_dtype, {m.E, 2 * m.I, m.H / per_byte}, device),
          .w2 = view(const_cast<void*>(w2), w_dtype, {m.E, m.H, m.I / per_byte}, device),
          .topk_weights = view(buffer(routing_[r].weights.data(), M * m.top_k * 4)->ptr(), DType::kFloat32, {M, m.top_k},
                               device),
          .topk_ids = view(buffer(routing_[r].ids.data(), M * m.top_k * 4)->ptr(), DType::kInt32, {M, m.top_k}, device),
          .out = view(out_[r]->ptr(), dtype, {M, m.H}, device),
          .workspace = view(workspace_->ptr(), DType::kInt32, {ws_bytes / 4}, device),
          .quant = quant,
      });
    }
    if (L > 0) {
      // NOTE: the stacks do not rotate (they are shared by every call); each rotation
      // has its own adapter ids over its own routing.
      const std::vector<int32_t> enabled(L, 1);
      const std::vector<float> scale(L, kLoraScale);
      enabled_view_ = view(buffer(enabled.data(), L * 4)->ptr(), DType::kInt32, {L}, device);
      scale_view_ = view(buffer(scale.data(), L * 4)->ptr(), DType::kFloat32, {L}, device);
      lora_.resize(kRotations);
      for (int r = 0; r < kRotations; ++r) {
        lora_batch_.push_back(make_lora_batch(routing_[r], M, m.top_k, L, share, 3000 + 37 * r + M));
        lora_[r].adapters = moelora::MoeLoraAdapters{
            .token_lora_ids = view(buffer(lora_batch_[r].ids.data(), M * 4)->ptr(), DType::kInt32, {M}, device),
            .adapter_enabled = &enabled_view_,
            .adapter_scale = &scale_view_};
      }
    }
  }
  ~LayerCell() {
#ifdef MOELORA_WITH_CUDA
    if (cuda_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
#endif
  }
  LayerCell(const LayerCell&) = delete;
  LayerCell& operator=(const LayerCell&) = delete;

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

  // One call on rotation 0 into a poisoned output, returned for checking ([M, H]).
  std::vector<uint16_t> run_once(const moelora::FusedExpertsOptions& fo) {
    Buffer& out = *out_[0];
    out.fill(0xff, M_ * m_.H * 2);  // poison: NaN in bf16 and fp16
    moelora::fused_experts(args_[0], fo, stream_);
    synchronize();
    std::vector<uint16_t> out_host(M_ * m_.H);
    out.download(out_host.data(), out_host.size() * 2);
    return out_host;
  }

  // The median time of one layer call: over `iters` graph replays of kRotations calls
  // (CUDA; fewer, at least 5, where that many would take over budget_s), or over `iters`
  // calls cycling through the rotations (CPU; stops early after a call over 5 s).
  double time_us(const moelora::FusedExpertsOptions& fo, int iters, [[maybe_unused]] double budget_s = INFINITY) {
    std::vector<double> times;
    if (!cuda_) {
      for (int i = 0; i < iters; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        moelora::fused_experts(args_[i % kRotations], fo);
        times.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
        if (times.back() > 5e6) break;  // a slow cell needs no more samples
      }
      return median(times);
    }
#ifdef MOELORA_WITH_CUDA
    const cudaStream_t stream = static_cast<cudaStream_t>(stream_);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int r = 0; r < kRotations; ++r) moelora::fused_experts(args_[r], fo, stream);
    CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));  // warm-up
    const double warm_ms = event_ms(stream, [&] { CHECK_CUDA(cudaGraphLaunch(exec, stream)); });
    if (std::isfinite(budget_s)) iters = std::min(iters, std::max(5, int(budget_s * 1e3 / warm_ms)));
    for (int i = 0; i < iters; ++i) {
      times.push_back(event_ms(stream, [&] { CHECK_CUDA(cudaGraphLaunch(exec, stream)); }) * 1e3 / kRotations);
    }
    CHECK_CUDA(cudaGraphExecDestroy(exec));
    CHECK_CUDA(cudaGraphDestroy(graph));
#endif
    return median(times);
  }

  // The time of a call (time_us) whose slots all route to no local expert (an expert_map
  // of -1 for every expert): the layer's launches, slot tables and output writes without
  // reading an expert, its fixed cost at this M (issue 30's exemption of cells whose fixed
  // cost exceeds a quarter of the bf16 layer's time).
  double time_without_experts_us(const moelora::FusedExpertsOptions& fo, int iters, double budget_s = INFINITY) {
    if (!no_experts_) {
      const std::vector<int32_t> map(m_.E, -1);
      no_experts_ = std::make_unique<Buffer>(cuda_, map.size() * 4);
      no_experts_->upload(map.data(), map.size() * 4);
      const moelora::Device device = cuda_ ? moelora::Device{moelora::DeviceType::kCUDA, 0} : moelora::Device{};
      no_experts_view_ = view(no_experts_->ptr(), DType::kInt32, {m_.E}, device);
    }
    for (moelora::FusedExpertsArgs& a : args_) a.expert_map = &no_experts_view_;
    const double t = time_us(fo, iters, budget_s);
    for (moelora::FusedExpertsArgs& a : args_) a.expert_map = nullptr;
    return t;
  }

  // The routings' floors averaged over the rotations (expert_bytes per routed expert);
  // with LoRA set, the stacks' bytes are added and their FLOPs go to *lora_flops.
  void floors(double expert_bytes, double* bytes, double* flops, double* lora_flops) const {
    *bytes = *flops = *lora_flops = 0;
    for (int r = 0; r < kRotations; ++r) {
      double b, f;
      ::moelora::bench::floors(m_, M_, routing_[r].experts_touched, expert_bytes, &b, &f);
      *bytes += b / kRotations;
      *flops += f / kRotations;
      if (lora_stacks_) {
        lora_floors(m_, lora_stacks_->rank, lora_batch_[r], M_, &b, &f);
        *bytes += b / kRotations;
        *lora_flops += f / kRotations;
      }
    }
  }

  // Rotation 0's inputs (run_once's): x [M, H], routing, adapter ids with LoRA set (else null).
  const std::vector<uint16_t>& x_host() const { return x_host_[0]; }
  const Routing& routing() const { return routing_[0]; }
  const LoraStacks* lora_stacks() const { return lora_stacks_; }
  const int32_t* lora_ids() const { return lora_stacks_ ? lora_batch_[0].ids.data() : nullptr; }

 private:
  void synchronize() {
#ifdef MOELORA_WITH_CUDA
    if (cuda_) CHECK_CUDA(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
#endif
  }

  const Model& m_;
  int64_t M_;
  bool cuda_;
  moelora::Stream stream_ = nullptr;
  std::unique_ptr<Buffer> workspace_;
  std::vector<std::unique_ptr<Buffer>> bufs_;  // every input and output of the rotations
  std::vector<Buffer*> out_;                   // [kRotations], in bufs_
  std::vector<std::vector<uint16_t>> x_host_;
  std::vector<Routing> routing_;
  std::vector<moelora::FusedExpertsArgs> args_;
  // LoRA (constructed with stacks): per-rotation adapter ids; args_[r].lora points into
  // lora_ (sized once, never moved) while set_lora() has stacks set.
  TensorView enabled_view_, scale_view_;
  std::vector<LoraBatch> lora_batch_;
  std::vector<moelora::FusedExpertsLora> lora_;
  const LoraStacks* lora_stacks_ = nullptr;
  // time_without_experts_us: expert_map [E], all -1.
  std::unique_ptr<Buffer> no_experts_;
  TensorView no_experts_view_;
};

}  // namespace moelora::bench
