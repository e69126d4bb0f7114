// sparse_mla_bench: sparse MLA decode (sparse_mla_decode) over the brief's grid, checked
// against a float64 reference, timed against its roofline floor.
//
//   sparse_mla_bench [--heads H[,H...]] [--topk K[,K...]] [--kv-len S[,S...]] [--tokens T[,T...]]
//                    [--splits N] [--device auto|cpu|cuda] [--iters N] [--no-check] [--ceilings]
//                    [--cta-smem-limit BYTES] [--json PATH]
//
// Defaults on CUDA: Hq 16, 64, 128; topk 512, 2048; S 8192, 131072; T 1, 8, 64, 256 (the
// issue's grid). On the CPU: Hq 16, topk 512, S 8192, T 1, 8.
// Each token attends to topk distinct rows drawn uniformly from [0, S); q and kv are
// normal(0, 1), the softmax scale 1/sqrt(576).
// On CUDA one call per input set is captured in a CUDA graph over enough input sets
// (q, kv cache, indices, out) that together they exceed twice the L2, so the kv rows a
// call gathers come from HBM (within a call, rows repeated across tokens may still hit);
// the graph is replayed after a warm-up and the median replay over the sets is the time.
// Floor = max(bytes / copy rate, FLOPs / bf16 matmul rate) with
//   bytes = gathered kv rows (T·topk·1152) + q (T·Hq·1152) + out (T·Hq·1024),
//   FLOPs = 2·(576 + 512) per head per key;
// the rates are measured in the same run (--ceilings), else H100 nominal (3.0 TB/s,
// 790 TFLOP/s) and said so. rel_err: ‖out − ref‖/‖ref‖ over the first and last token.
// --cta-smem-limit plans the kernels as for a part whose CTA has BYTES of shared memory
// (166912: the sm_80 plans an A100 runs, timed on this GPU).
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "common/host_numeric.h"
#include "common/params.h"
#include "moelora/ops.h"

namespace {

using namespace moelora::bench;
using moelora::TensorView;

constexpr int64_t kD = moelora::kMlaHeadDim, kDV = moelora::kMlaValueDim;

struct Options {
  std::vector<int64_t> heads, topks, kv_lens, tokens;
  int splits = 0;
  std::string device = "auto";
  int iters = 20;
  bool check = true, ceilings = false;
  int cta_smem_limit = 0;
  std::string json_path;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "sparse_mla_bench: %s\nusage: sparse_mla_bench [--heads H,...] [--topk K,...] [--kv-len S,...] "
               "[--tokens T,...]\n       [--splits N] [--device auto|cpu|cuda] [--iters N] [--no-check] "
               "[--ceilings] [--cta-smem-limit BYTES] [--json PATH]\n",
               why.c_str());
  std::exit(why == "help" ? 0 : 2);
}

std::vector<int64_t> parse_list(const std::string& list, const char* flag) {
  std::vector<int64_t> values;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = list.find(',', start);
    const std::string item = list.substr(start, end == std::string::npos ? std::string::npos : end - start);
    try {
      values.push_back(std::stoll(item));
    } catch (const std::exception&) {
      usage(std::string(flag) + " takes a comma-separated list of integers");
    }
    if (values.back() < 1) usage(std::string(flag) + " takes values >= 1");
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return values;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--heads") o.heads = parse_list(value(), "--heads");
    else if (arg == "--topk") o.topks = parse_list(value(), "--topk");
    else if (arg == "--kv-len") o.kv_lens = parse_list(value(), "--kv-len");
    else if (arg == "--tokens") o.tokens = parse_list(value(), "--tokens");
    else if (arg == "--splits") o.splits = std::stoi(value());
    else if (arg == "--device") o.device = value();
    else if (arg == "--iters") o.iters = std::stoi(value());
    else if (arg == "--no-check") o.check = false;
    else if (arg == "--ceilings") o.ceilings = true;
    else if (arg == "--cta-smem-limit") o.cta_smem_limit = std::stoi(value());
    else if (arg == "--json") o.json_path = value();
    else if (arg == "--help" || arg == "-h") usage("help");
    else usage("unknown argument " + arg);
  }
  if (o.iters < 1) usage("--iters takes a value >= 1");
  if (o.cta_smem_limit < 0) usage("--cta-smem-limit takes a byte count >= 0");
  return o;
}

// One input set of a cell, on the host (bf16 bits, int32 indices).
struct Inputs {
  std::vector<uint16_t> q, kv;
  std::vector<int32_t> indices;
};

Inputs make_inputs(int64_t T, int64_t Hq, int64_t S, int64_t topk, uint64_t seed) {
  Inputs in;
  in.q.resize(size_t(T * Hq * kD));
  in.kv.resize(size_t(S * kD));
  in.indices.resize(size_t(T * topk));
  fill_normal(DType::kBFloat16, in.q.data(), int64_t(in.q.size()), seed * 3 + 1, 1.0f);
  fill_normal(DType::kBFloat16, in.kv.data(), int64_t(in.kv.size()), seed * 3 + 2, 1.0f);
  // topk distinct rows a token (a partial Fisher-Yates over [0, S); topk <= S), or
  // with repeats when topk > S.
  parallel_for(T, [&](int64_t t) {
    std::mt19937_64 rng(seed * 1000003 + uint64_t(t));
    if (topk <= S) {
      std::vector<int32_t> rows(static_cast<size_t>(S));
      for (int64_t s = 0; s < S; ++s) rows[size_t(s)] = int32_t(s);
      for (int64_t i = 0; i < topk; ++i) {
        std::swap(rows[size_t(i)], rows[size_t(i + int64_t(rng() % uint64_t(S - i)))]);
        in.indices[size_t(t * topk + i)] = rows[size_t(i)];
      }
    } else {
      for (int64_t i = 0; i < topk; ++i) in.indices[size_t(t * topk + i)] = int32_t(rng() % uint64_t(S));
    }
  });
  return in;
}

float bf16_value(uint16_t bits) { return moelora::host::to_float(moelora::host::bf16{bits}); }

// ‖out − ref‖/‖ref‖ over tokens `check_tokens`, every head; ref in double from the inputs.
double check_tokens(const Inputs& in, const std::vector<uint16_t>& out, int64_t Hq, int64_t topk,
                    const std::vector<int64_t>& tokens, double scale) {
  std::vector<double> err(size_t(tokens.size() * Hq)), norm(err.size());
  parallel_for(int64_t(err.size()), [&](int64_t th) {
    const int64_t t = tokens[size_t(th / Hq)], h = th % Hq;
    std::vector<double> logits(static_cast<size_t>(topk)), acc(static_cast<size_t>(kDV), 0.0);
    double max_logit = -INFINITY;
    for (int64_t i = 0; i < topk; ++i) {
      const int64_t row = in.indices[size_t(t * topk + i)];
      double dot = 0;
      for (int64_t d = 0; d < kD; ++d) {
        dot += double(bf16_value(in.q[size_t((t * Hq + h) * kD + d)])) * bf16_value(in.kv[size_t(row * kD + d)]);
      }
      logits[size_t(i)] = scale * dot;
      max_logit = std::max(max_logit, logits[size_t(i)]);
    }
    double sum = 0;
    for (int64_t i = 0; i < topk; ++i) {
      const double w = std::exp(logits[size_t(i)] - max_logit);
      sum += w;
      const int64_t row = in.indices[size_t(t * topk + i)];
      for (int64_t d = 0; d < kDV; ++d) acc[size_t(d)] += w * bf16_value(in.kv[size_t(row * kD + d)]);
    }
    double e = 0, n = 0;
    for (int64_t d = 0; d < kDV; ++d) {
      const double ref = acc[size_t(d)] / sum;
      const double got = bf16_value(out[size_t((t * Hq + h) * kDV + d)]);
      e += (got - ref) * (got - ref);
      n += ref * ref;
    }
    err[size_t(th)] = e;
    norm[size_t(th)] = n;
  });
  double e = 0, n = 0;
  for (size_t i = 0; i < err.size(); ++i) {
    e += err[i];
    n += norm[i];
  }
  return std::sqrt(e / n);
}

struct Row {
  int64_t Hq, T, topk, S;
  int splits;
  double time_us, floor_us, bytes, flops, rel_err;  // rel_err < 0: not checked
};

moelora::SparseMlaDecodeArgs make_args(void* q, void* kv, void* indices, void* out, void* workspace,
                                       int64_t workspace_bytes, int64_t T, int64_t Hq, int64_t S, int64_t topk,
                                       int splits, moelora::Device device) {
  moelora::SparseMlaDecodeArgs a;
  a.q = view(q, DType::kBFloat16, {T, Hq, kD}, device);
  a.kv = view(kv, DType::kBFloat16, {S, 1, kD}, device);
  a.indices = view(indices, DType::kInt32, {T, 1, topk}, device);
  a.out = view(out, DType::kBFloat16, {T, Hq, kDV}, device);
  a.workspace = view(workspace, DType::kFloat32, {std::max<int64_t>(1, workspace_bytes / 4)}, device);
  a.softmax_scale = float(1.0 / std::sqrt(double(kD)));
  a.num_splits = splits;
  return a;
}

std::vector<int64_t> checked_tokens(int64_t T) { return T > 1 ? std::vector<int64_t>{0, T - 1} : std::vector<int64_t>{0}; }

Row run_cpu(int64_t Hq, int64_t T, int64_t topk, int64_t S, const Options& o) {
  Inputs in = make_inputs(T, Hq, S, topk, 1);
  std::vector<uint16_t> out(size_t(T * Hq * kDV));
  std::vector<float> workspace(1);
  const moelora::SparseMlaDecodeArgs a = make_args(in.q.data(), in.kv.data(), in.indices.data(), out.data(),
                                                   workspace.data(), 4, T, Hq, S, topk, 1, moelora::Device{});
  std::vector<double> times;
  for (int i = 0; i < std::min(o.iters, 3); ++i) {
    const auto start = std::chrono::steady_clock::now();
    moelora::sparse_mla_decode(a);
    times.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
  }
  Row row{Hq, T, topk, S, 1, median(times), 0, 0, 0, -1};
  if (o.check) row.rel_err = check_tokens(in, out, Hq, topk, checked_tokens(T), a.softmax_scale);
  return row;
}

#ifdef MOELORA_WITH_CUDA
Row run_cuda(int64_t Hq, int64_t T, int64_t topk, int64_t S, const Options& o, int64_t l2_bytes) {
  const moelora::Device gpu{moelora::DeviceType::kCUDA, 0};
  const int64_t q_bytes = T * Hq * kD * 2, kv_bytes = S * kD * 2, index_bytes = T * topk * 4,
                out_bytes = T * Hq * kDV * 2;
  const int64_t set_bytes = q_bytes + kv_bytes + index_bytes + out_bytes;
  // NOTE: enough input sets that one replay streams more than twice the L2.
  const int sets = int(std::clamp<int64_t>((2 * l2_bytes + set_bytes - 1) / set_bytes, 2, 16));
  const int splits = moelora::sparse_mla_decode_num_splits(T, Hq, topk, gpu, o.splits);
  const int64_t workspace_bytes = moelora::sparse_mla_decode_workspace_size(T, Hq, topk, gpu, o.splits);
  DeviceBuffer workspace(static_cast<size_t>(workspace_bytes));
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  std::vector<moelora::SparseMlaDecodeArgs> args;
  Inputs first;
  for (int i = 0; i < sets; ++i) {
    Inputs in = make_inputs(T, Hq, S, topk, uint64_t(i + 1));
    auto upload = [&](const void* host, int64_t bytes) {
      buffers.push_back(std::make_unique<DeviceBuffer>(size_t(bytes)));
      CHECK_CUDA(cudaMemcpy(buffers.back()->ptr, host, size_t(bytes), cudaMemcpyHostToDevice));
      return buffers.back()->ptr;
    };
    void* q = upload(in.q.data(), q_bytes);
    void* kv = upload(in.kv.data(), kv_bytes);
    void* indices = upload(in.indices.data(), index_bytes);
    buffers.push_back(std::make_unique<DeviceBuffer>(size_t(out_bytes)));
    CHECK_CUDA(cudaMemset(buffers.back()->ptr, 0xff, size_t(out_bytes)));  // NaN until written
    args.push_back(make_args(q, kv, indices, buffers.back()->ptr, workspace.ptr, workspace_bytes, T, Hq, S, topk,
                             o.splits, gpu));
    if (i == 0) first = std::move(in);
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (const auto& a : args) moelora::sparse_mla_decode(a, stream);
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> times;
  for (int i = 0; i < o.iters + 3; ++i) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 3) times.push_back(1e3 * ms / sets);  // warm-up excluded
  }
  Row row{Hq, T, topk, S, splits, median(times), 0, 0, 0, -1};
  if (o.check) {
    std::vector<uint16_t> out(size_t(T * Hq * kDV));
    CHECK_CUDA(cudaMemcpy(out.data(), args[0].out.data, size_t(out_bytes), cudaMemcpyDeviceToHost));
    row.rel_err = check_tokens(first, out, Hq, topk, checked_tokens(T), args[0].softmax_scale);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaStreamDestroy(stream));
  return row;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  std::string device_error;
  const bool use_cuda = choose_cuda(o.device, &device_error);
  if (!device_error.empty()) usage(device_error);
  auto or_default = [](std::vector<int64_t>& v, std::vector<int64_t> cuda, std::vector<int64_t> cpu, bool gpu) {
    if (v.empty()) v = gpu ? cuda : cpu;
  };
  or_default(o.heads, {16, 64, 128}, {16}, use_cuda);
  or_default(o.topks, {512, 2048}, {512}, use_cuda);
  or_default(o.kv_lens, {8192, 131072}, {8192}, use_cuda);
  or_default(o.tokens, {1, 8, 64, 256}, {1, 8}, use_cuda);

  try {
    Ceilings ceilings;
    int64_t l2_bytes = 50 << 20;
#ifdef MOELORA_WITH_CUDA
    if (use_cuda) {
      if (o.ceilings) ceilings = measure_ceilings();
      moelora::cuda::set_cta_smem_limit(o.cta_smem_limit);
      int l2 = 0;
      CHECK_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
      l2_bytes = l2;
    }
#endif
    std::printf("moelora %s | sparse_mla_decode | device %s | ceilings %.2f TB/s copy, %.0f TFLOP/s bf16 (%s)\n",
                moelora::version(), use_cuda ? "cuda" : "cpu", ceilings.copy_tbps, ceilings.bf16_tflops,
                ceilings.measured ? "measured" : "nominal H100, not measured");
    if (o.cta_smem_limit > 0) {
      std::printf("kernel plans for a CTA of at most %d bytes of shared memory\n", o.cta_smem_limit);
    }
    std::vector<Row> rows;
    for (int64_t Hq : o.heads) {
      for (int64_t topk : o.topks) {
        for (int64_t S : o.kv_lens) {
          for (int64_t T : o.tokens) {
#ifdef MOELORA_WITH_CUDA
            Row row = use_cuda ? run_cuda(Hq, T, topk, S, o, l2_bytes) : run_cpu(Hq, T, topk, S, o);
#else
            Row row = run_cpu(Hq, T, topk, S, o);
#endif
            row.bytes = double(T) * topk * kD * 2 + double(T) * Hq * kD * 2 + double(T) * Hq * kDV * 2;
            row.flops = 2.0 * (kD + kDV) * double(T) * Hq * topk;
            row.floor_us = std::max(row.bytes / (ceilings.copy_tbps * 1e12), row.flops / (ceilings.bf16_tflops * 1e12)) * 1e6;
            std::printf("Hq=%-3lld topk=%-4lld S=%-6lld T=%-3lld splits %-2d %9.1f us  floor %8.1f us (%5.1f%%)  "
                        "%6.3f TB/s  %7.2f TFLOP/s  rel_err %s\n",
                        (long long)Hq, (long long)topk, (long long)S, (long long)T, row.splits, row.time_us,
                        row.floor_us, 100 * row.floor_us / row.time_us, row.bytes / (row.time_us * 1e-6) / 1e12,
                        row.flops / (row.time_us * 1e-6) / 1e12,
                        row.rel_err >= 0 ? std::to_string(row.rel_err).c_str() : "not checked");
            std::fflush(stdout);
            rows.push_back(row);
          }
        }
      }
    }
    bool ok = true;
    for (const Row& r : rows) ok = ok && r.rel_err <= 1e-2;
    if (!o.json_path.empty()) {
      std::vector<std::string> json_rows;
      for (const Row& r : rows) {
        json_rows.push_back(format(
            "{\"op\": \"sparse_mla_decode\", \"Hq\": %lld, \"T\": %lld, \"topk\": %lld, \"S\": %lld, "
            "\"dtype\": \"bf16\", \"lora\": null, \"device\": \"%s\", \"num_splits\": %d, \"time_us\": %.3f, "
            "\"floor_us\": %.3f, \"pct_floor\": %.2f, \"tbps\": %.4f, \"tflops\": %.3f, \"rel_err\": %s}",
            (long long)r.Hq, (long long)r.T, (long long)r.topk, (long long)r.S, use_cuda ? "cuda" : "cpu", r.splits,
            r.time_us, r.floor_us, 100 * r.floor_us / r.time_us, r.bytes / (r.time_us * 1e-6) / 1e12,
            r.flops / (r.time_us * 1e-6) / 1e12, r.rel_err >= 0 ? std::to_string(r.rel_err).c_str() : "null"));
      }
      write_bench_json(o.json_path, ceilings, json_rows);
    }
    if (!ok) {
      std::printf("FAILED: a checked cell is above 1e-2 relative error\n");
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sparse_mla_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
