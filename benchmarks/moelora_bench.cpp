// moelora_bench: the main job. Runs the whole MoE layer (fused_experts) at a real
// model's shapes from the design brief, checks it against a float64 reference, and
// prints time, achieved bandwidth and FLOP rate against the roofline floor.
//
//   moelora_bench [--model NAME[,NAME...]|all] [--tokens M[,M...]] [--dtype bf16|fp16]
//                 [--device auto|cpu|cuda] [--iters N] [--no-check] [--ceilings]
//                 [--baseline] [--static-tiles] [--json PATH]
//   moelora_bench --tune DIR [--model NAME|all] [--tokens ...]   (CUDA only)
//
// --baseline also times each cell with the previous issue's kernels (mma.sync, fixed
// tiles, no programmatic dependent launch) and reports the speed-up.
// --static-tiles runs the sm90 GEMMs on the static persistent schedule instead of
// ordered tiles (FusedExpertsOptions::ordered_tiles), for A/B timing.
// --tune searches block size and tiles per (model, M) and writes the config registry's
// table for each model into DIR (copy it to configs/ to ship it).
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

#ifdef MOELORA_WITH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

namespace {

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
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "moelora_bench: %s\nusage: moelora_bench [--model NAME[,NAME...]|all] [--tokens M[,M...]] [--dtype bf16|fp16]\n"
               "       [--device auto|cpu|cuda] [--iters N] [--no-check] [--ceilings] [--baseline] [--json PATH]\n"
               "       [--static-tiles] [--tune DIR [--trace]]\nmodels:",
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
  return o;
}

template <class F>
void parallel_for(int64_t count, F fn) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(std::thread::hardware_concurrency(), count));
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int64_t i = t; i < count; i += threads) fn(i);
    });
  }
  for (auto& th : pool) th.join();
}

// ---- random data ------------------------------------------------------------------
// NOTE: hundreds of millions of normal draws per model; a table of 65536 normal
// quantiles indexed by a counter hash gives normal data at memory speed.
const std::vector<float>& normal_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (int i = 0; i < 65536; ++i) {
      const double p = (i + 0.5) / 65536.0;
      // Acklam-free: invert the CDF by bisection on erfc (once, 65536 entries).
      double lo = -6, hi = 6;
      for (int it = 0; it < 60; ++it) {
        const double mid = 0.5 * (lo + hi);
        (0.5 * std::erfc(-mid / std::sqrt(2.0)) < p ? lo : hi) = mid;
      }
      t[i] = float(0.5 * (lo + hi));
    }
    return t;
  }();
  return table;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

void fill_normal(DType dtype, void* data, int64_t count, uint64_t seed, float scale) {
  const std::vector<float>& table = normal_table();
  constexpr int64_t kBlock = 1 << 20;
  parallel_for((count + kBlock - 1) / kBlock, [&](int64_t b) {
    const int64_t end = std::min(count, (b + 1) * kBlock);
    for (int64_t i = b * kBlock; i < end; ++i) {
      const float v = table[splitmix64(seed * 0x100000001b3ull + uint64_t(i)) & 0xffff] * scale;
      if (dtype == DType::kBFloat16) static_cast<uint16_t*>(data)[i] = moelora::host::to_bf16(v).bits;
      else static_cast<uint16_t*>(data)[i] = moelora::host::to_fp16(v).bits;
    }
  });
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

// ---- float64 reference of one token of the layer, straight from the dtype data ----
void reference_token(const Model& m, DType dtype, const uint16_t* x, const uint16_t* w13, const uint16_t* w2,
                     const Routing& r, int64_t token, double* out /*[H]*/) {
  const int64_t H = m.H, I = m.I;
  std::vector<double> xd(H), act(I), h1(2 * I);
  for (int64_t h = 0; h < H; ++h) xd[h] = load(dtype, x, token * H + h);
  std::fill(out, out + H, 0.0);
  for (int64_t j = 0; j < m.top_k; ++j) {
    const int64_t e = r.ids[token * m.top_k + j];
    const double weight = r.weights[token * m.top_k + j];
    for (int64_t n = 0; n < 2 * I; ++n) {
      const uint16_t* row = w13 + (e * 2 * I + n) * H;
      double s = 0;
      for (int64_t h = 0; h < H; ++h) s += xd[h] * load(dtype, row, h);
      h1[n] = s;
    }
    for (int64_t i = 0; i < I; ++i) {
      if (m.activation == Activation::kSilu) {
        const double g = h1[i], u = h1[I + i];
        act[i] = g / (1 + std::exp(-g)) * u;
      } else {  // swiglu_oai, gate/up interleaved, alpha 1.702, limit 7
        const double g = std::min(h1[2 * i], 7.0), u = std::clamp(h1[2 * i + 1], -7.0, 7.0);
        act[i] = (u + 1) * g / (1 + std::exp(-1.702 * g));
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      const uint16_t* row = w2 + (e * H + h) * I;
      double s = 0;
      for (int64_t i = 0; i < I; ++i) s += act[i] * load(dtype, row, i);
      out[h] += weight * s;
    }
  }
}

// ‖out − ref‖/‖ref‖ over the checked tokens: all of them up to 256, else 128 spread
// over the batch (first and last included).
struct Check { double rel_err = -1; int64_t tokens = 0; };

Check check_layer(const Model& m, DType dtype, const std::vector<uint16_t>& x, const uint16_t* w13,
                  const uint16_t* w2, const Routing& r, const std::vector<uint16_t>& out, int64_t M) {
  std::vector<int64_t> tokens;
  if (M <= 256) {
    for (int64_t t = 0; t < M; ++t) tokens.push_back(t);
  } else {
    for (int64_t i = 0; i < 128; ++i) tokens.push_back(i * (M - 1) / 127);
  }
  std::vector<double> ref(tokens.size() * m.H);
  parallel_for(int64_t(tokens.size()), [&](int64_t i) {
    reference_token(m, dtype, x.data(), w13, w2, r, tokens[i], &ref[i * m.H]);
  });
  double diff = 0, norm = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    for (int64_t h = 0; h < m.H; ++h) {
      const double o = load(dtype, out.data(), tokens[i] * m.H + h), e = ref[i * m.H + h];
      diff += (o - e) * (o - e);
      norm += e * e;
    }
  }
  Check c;
  c.rel_err = std::isfinite(diff) ? std::sqrt(diff / std::max(norm, 1e-300)) : INFINITY;
  c.tokens = int64_t(tokens.size());
  return c;
}

// ---- results ----------------------------------------------------------------------
struct Ceilings { double copy_tbps = 3.0, bf16_tflops = 790; bool measured = false; };

struct Row {
  const Model* model;
  int64_t M;
  std::string device;
  double time_us, floor_us, bytes, flops;
  Check check;
  double baseline_us = 0;  // previous issue's kernels (--baseline), 0 = not measured
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

TensorView view(void* data, DType dtype, std::initializer_list<int64_t> shape, moelora::Device device) {
  return TensorView::contiguous(data, dtype, shape, device);
}

// Bytes and FLOPs the layer cannot avoid for one routing.
void floors(const Model& m, int64_t M, int64_t experts_touched, double* bytes, double* flops) {
  const double expert_bytes = 3.0 * m.H * m.I * 2;
  *bytes = experts_touched * expert_bytes + 2.0 * M * m.H * 2 + M * m.top_k * 8.0;
  *flops = 2.0 * M * m.top_k * 3.0 * m.H * m.I;
}

// ---- CPU ----------------------------------------------------------------------------
Row run_cpu(const Model& m, int64_t M, const Options& o, const std::vector<uint16_t>& w13,
            const std::vector<uint16_t>& w2) {
  const moelora::Device cpu{};
  std::vector<uint16_t> x(M * m.H), out(M * m.H, 0x7fc0);
  fill_normal(o.dtype, x.data(), int64_t(x.size()), 1000 + M, 1.0f);
  const Routing r = make_routing(m, M, 2000 + M);
  moelora::FusedExpertsOptions fo;
  fo.activation = m.activation;
  const int64_t ws_bytes = moelora::fused_experts_workspace_size({M, m.top_k, m.E, m.H, m.I, o.dtype}, fo);
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
  std::vector<double> times;
  const int iters = o.iters > 0 ? o.iters : 3;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    moelora::fused_experts(args, fo);
    times.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    if (times.back() > 5e6) break;  // a slow cell needs no more samples
  }
  Row row{&m, M, "cpu", median(times), 0, 0, 0, {}};
  floors(m, M, r.experts_touched, &row.bytes, &row.flops);
  if (o.check) row.check = check_layer(m, o.dtype, x, w13.data(), w2.data(), r, out, M);
  return row;
}

#ifdef MOELORA_WITH_CUDA
#define CHECK_CUDA(call)                                                                          \
  do {                                                                                            \
    const cudaError_t err_ = (call);                                                              \
    if (err_ != cudaSuccess) throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorString(err_)); \
  } while (0)

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { CHECK_CUDA(cudaMalloc(&ptr, std::max<size_t>(bytes, 256))); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

Ceilings measure_ceilings() {
  Ceilings c;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  auto time_ms = [&](auto&& body, int reps) {
    std::vector<double> t;
    for (int i = 0; i < reps + 3; ++i) {
      CHECK_CUDA(cudaEventRecord(start, stream));
      body();
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (i >= 3) t.push_back(ms);
    }
    return median(t);
  };
  {  // device-to-device copy of 2 GiB, counting bytes read and written
    const size_t bytes = size_t(2) << 30;
    DeviceBuffer a(bytes), b(bytes);
    CHECK_CUDA(cudaMemsetAsync(a.ptr, 1, bytes, stream));
    const double ms = time_ms([&] { CHECK_CUDA(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice, stream)); }, 10);
    c.copy_tbps = 2.0 * bytes / (ms * 1e-3) / 1e12;
  }
  {  // 8192^3 bf16 matmul through cuBLAS, fp32 accumulation, random data
    const int n = 8192;
    std::vector<uint16_t> host(size_t(n) * n);
    DeviceBuffer a(host.size() * 2), b(host.size() * 2), d(host.size() * 2);
    fill_normal(DType::kBFloat16, host.data(), int64_t(host.size()), 7, 1.0f);
    CHECK_CUDA(cudaMemcpy(a.ptr, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(b.ptr, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
    cublasHandle_t handle;
    if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed");
    cublasSetStream(handle, stream);
    const float one = 1, zero = 0;
    const double ms = time_ms([&] {
      if (cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a.ptr, CUDA_R_16BF, n, b.ptr, CUDA_R_16BF, n,
                       &zero, d.ptr, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
        throw std::runtime_error("cublasGemmEx failed");
      }
    }, 10);
    cublasDestroy(handle);
    c.bf16_tflops = 2.0 * n * n * double(n) / (ms * 1e-3) / 1e12;
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  CHECK_CUDA(cudaStreamDestroy(stream));
  c.measured = true;
  return c;
}

// One (model, M) cell on the GPU: kRotations input sets with different routings, and
// layer timings under any options (config overrides for tuning and the baseline).
class CudaCell {
 public:
  // NOTE: kRotations input sets with different routings in one graph, so that the
  // weights one call reads are not in L2 from the call before.
  static constexpr int kRotations = 4;

  CudaCell(const Model& m, int64_t M, DType dtype, const void* w13, const void* w2) : m_(m), M_(M), dtype_(dtype) {
    const moelora::Device gpu{moelora::DeviceType::kCUDA, 0};
    moelora::FusedExpertsOptions fo;
    fo.activation = m.activation;
    const moelora::FusedExpertsShape shape{M, m.top_k, m.E, m.H, m.I, dtype};
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
  }
  ~CudaCell() { cudaStreamDestroy(stream_); }

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

  void floors(double* bytes, double* flops) const {
    double bytes_sum = 0;
    for (int r = 0; r < kRotations; ++r) {
      double b;
      ::floors(m_, M_, routing_[r].experts_touched, &b, flops);
      bytes_sum += b;
    }
    *bytes = bytes_sum / kRotations;
  }

  Check check(const std::vector<uint16_t>& out, const std::vector<uint16_t>& w13_host,
              const std::vector<uint16_t>& w2_host) const {
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

Row run_cuda(const Model& m, int64_t M, const Options& o, const void* w13, const void* w2,
             const std::vector<uint16_t>& w13_host, const std::vector<uint16_t>& w2_host) {
  CudaCell cell(m, M, o.dtype, w13, w2);
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
  return row;
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

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  bool use_cuda = false;
  if (o.device == "cuda") {
    if (!moelora::cuda_available()) usage("--device cuda but no CUDA device (or built without CUDA)");
    use_cuda = true;
  } else if (o.device == "auto") {
    use_cuda = moelora::cuda_available();
  } else if (o.device != "cpu") {
    usage("--device takes auto, cpu or cuda");
  }

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
      for (int64_t M : o.tokens) {
#ifdef MOELORA_WITH_CUDA
        Row row = use_cuda ? run_cuda(m, M, o, w13_dev->ptr, w2_dev->ptr, w13, w2) : run_cpu(m, M, o, w13, w2);
#else
        Row row = run_cpu(m, M, o, w13, w2);
#endif
        const double floor_bw = row.bytes / (ceilings.copy_tbps * 1e12) * 1e6;
        const double floor_fl = row.flops / (ceilings.bf16_tflops * 1e12) * 1e6;
        row.floor_us = std::max(floor_bw, floor_fl);
        rows.push_back(row);
        const std::string baseline =
            row.baseline_us > 0 ? "  baseline " + std::to_string(int64_t(row.baseline_us + 0.5)) + " us (x" +
                                      std::to_string(row.baseline_us / row.time_us).substr(0, 4) + ")"
                                : std::string();
        std::printf("%-16s M=%-5lld %8.1f us  floor %8.1f us (%5.1f%%)  %6.3f TB/s  %7.2f TFLOP/s  rel_err %s%s\n",
                    m.name, (long long)M, row.time_us, row.floor_us, 100 * row.floor_us / row.time_us,
                    row.bytes / (row.time_us * 1e-6) / 1e12, row.flops / (row.time_us * 1e-6) / 1e12,
                    row.check.tokens ? (std::to_string(row.check.rel_err) + " (" + std::to_string(row.check.tokens) +
                                        " tokens)").c_str()
                                     : "not checked",
                    baseline.c_str());
        std::fflush(stdout);
      }
    }

    bool ok = true;
    for (const Row& r : rows) ok = ok && (r.check.tokens == 0 || r.check.rel_err <= 1e-2);
    if (!o.json_path.empty()) {
      FILE* f = std::fopen(o.json_path.c_str(), "w");
      if (!f) throw std::runtime_error("cannot write " + o.json_path);
      std::fprintf(f, "{\"ceilings\": {\"copy_tbps\": %.4f, \"bf16_tflops\": %.2f, \"measured\": %s},\n \"rows\": [\n",
                   ceilings.copy_tbps, ceilings.bf16_tflops, ceilings.measured ? "true" : "false");
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        std::fprintf(f,
                     "  {\"op\": \"fused_experts\", \"model\": \"%s\", \"M\": %lld, \"dtype\": \"%s\", \"lora\": null, "
                     "\"device\": \"%s\", \"time_us\": %.3f, \"floor_us\": %.3f, \"pct_floor\": %.2f, \"tbps\": %.4f, "
                     "\"tflops\": %.3f, \"rel_err\": %s, \"checked_tokens\": %lld, \"baseline_us\": %s}%s\n",
                     r.model->name, (long long)r.M, model_dtype(o.dtype), r.device.c_str(), r.time_us, r.floor_us,
                     100 * r.floor_us / r.time_us, r.bytes / (r.time_us * 1e-6) / 1e12,
                     r.flops / (r.time_us * 1e-6) / 1e12,
                     r.check.tokens ? std::to_string(r.check.rel_err).c_str() : "null", (long long)r.check.tokens,
                     r.baseline_us > 0 ? std::to_string(r.baseline_us).c_str() : "null",
                     i + 1 < rows.size() ? "," : "");
      }
      std::fprintf(f, " ]}\n");
      std::fclose(f);
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
