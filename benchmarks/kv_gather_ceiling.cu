// kv_gather_ceiling: how fast this GPU gathers kv-cache rows of sparse MLA decode (1152
// bytes: 576 bf16 lanes) by index, with nothing else to do: a floor under what
// sparse_mla_decode can reach where its rows come from HBM (sparse_mla_bench's S 128K
// cells), beside the copy rate that bench's floor uses.
//
//   kv_gather_ceiling [--rows S]
//
// Each pass gathers n rows of one of 8 tables of S rows (8 x 151 MB at S = 131072, so no
// table is in L2 when it is gathered) for n = 32768 (T 64 x topk 512), 131072 (T 64 x topk
// 2048) and 524288 (T 256 x topk 2048), in three orders: uniform random indices (as
// sparse_mla_bench draws them: rows repeat across tokens), sequential rows, and a random
// permutation (no repeats). 8 threads a row load 9 x 16 bytes each, as the kernels'
// producers do, and fold them into one word (no write traffic). Time: median of 10
// timed groups of 8 back-to-back launches, over 8; TB/s over the gathered and over the
// distinct rows' bytes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"

namespace {

constexpr int kRowBytes = 1152;
constexpr int kRowChunks = kRowBytes / 16;  // 72
constexpr int kThreadsPerRow = 8;
constexpr int kTables = 8;

__global__ void gather_rows_kernel(const uint4* __restrict__ table, const int32_t* __restrict__ indices, int num_rows,
                                   unsigned* __restrict__ sink) {
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t r = thread / kThreadsPerRow;
  const int c = int(thread % kThreadsPerRow);
  if (r >= num_rows) return;
  const uint4* row = table + int64_t(__ldg(indices + r)) * kRowChunks;
  unsigned folded = 0;
#pragma unroll
  for (int i = 0; i < kRowChunks / kThreadsPerRow; ++i) {
    const uint4 v = __ldcs(row + c + kThreadsPerRow * i);
    folded ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  // A store no table's contents produce (every byte of table k is k + 1): the loads stay.
  if (folded == 0x9e3779b9u) sink[thread % 1024] = folded;
}

}  // namespace

int main(int argc, char** argv) {
  using moelora::bench::DeviceBuffer;
  using moelora::bench::median;
  int64_t table_rows = 131072;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--rows") == 0 && i + 1 < argc) {
      table_rows = std::stoll(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: kv_gather_ceiling [--rows S]\n");
      return 2;
    }
  }
  try {
    std::vector<std::unique_ptr<DeviceBuffer>> tables;
    for (int k = 0; k < kTables; ++k) {
      tables.push_back(std::make_unique<DeviceBuffer>(size_t(table_rows) * kRowBytes));
      CHECK_CUDA(cudaMemset(tables.back()->ptr, k + 1, size_t(table_rows) * kRowBytes));
    }
    DeviceBuffer sink(4096);
    cudaStream_t stream;
    CHECK_CUDA(cudaStreamCreate(&stream));
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    cudaDeviceProp prop{};
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    std::printf("%s, table %lld rows of %d B (%.0f MB) x %d\n", prop.name, static_cast<long long>(table_rows),
                kRowBytes, table_rows * kRowBytes / 1e6, kTables);
    std::printf("%-28s %8s %8s %9s %11s %11s\n", "order", "rows", "distinct", "us", "TB/s rows", "TB/s dist.");
    std::mt19937_64 rng(1);
    for (const int n : {32768, 131072, 524288}) {
      for (const char* order : {"uniform random", "sequential", "random permutation"}) {
        std::vector<int32_t> indices(n);
        if (order[0] == 'u') {
          std::uniform_int_distribution<int64_t> draw(0, table_rows - 1);
          for (auto& v : indices) v = int32_t(draw(rng));
        } else {
          std::vector<int32_t> rows(static_cast<size_t>(table_rows));
          std::iota(rows.begin(), rows.end(), 0);
          if (order[0] == 'r') std::shuffle(rows.begin(), rows.end(), rng);
          for (int i = 0; i < n; ++i) indices[i] = rows[size_t(i % table_rows)];
        }
        std::vector<int32_t> distinct = indices;
        std::sort(distinct.begin(), distinct.end());
        const int64_t num_distinct = std::unique(distinct.begin(), distinct.end()) - distinct.begin();
        DeviceBuffer device_indices(size_t(n) * 4);
        CHECK_CUDA(cudaMemcpy(device_indices.ptr, indices.data(), size_t(n) * 4, cudaMemcpyHostToDevice));
        const int threads = 256;
        const int blocks = int((int64_t(n) * kThreadsPerRow + threads - 1) / threads);
        std::vector<double> pass_us;
        for (int rep = 0; rep < 12; ++rep) {
          CHECK_CUDA(cudaEventRecord(start, stream));
          for (int k = 0; k < kTables; ++k) {
            gather_rows_kernel<<<blocks, threads, 0, stream>>>(static_cast<const uint4*>(tables[k]->ptr),
                                                                static_cast<const int32_t*>(device_indices.ptr), n,
                                                                static_cast<unsigned*>(sink.ptr));
            CHECK_CUDA(cudaGetLastError());
          }
          CHECK_CUDA(cudaEventRecord(stop, stream));
          CHECK_CUDA(cudaEventSynchronize(stop));
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
          if (rep >= 2) pass_us.push_back(1e3 * ms / kTables);  // warm-up excluded
        }
        const double us = median(pass_us);
        std::printf("%-28s %8d %8lld %9.2f %11.3f %11.3f\n", order, n, static_cast<long long>(num_distinct), us,
                    double(n) * kRowBytes / us / 1e6, double(num_distinct) * kRowBytes / us / 1e6);
      }
    }
    CHECK_CUDA(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kv_gather_ceiling: %s\n", e.what());
    return 1;
  }
  return 0;
}
