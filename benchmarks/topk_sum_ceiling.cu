// topk_sum_ceiling: what the top-k sum costs at prefill today, and what it would cost as
// GEMM2's epilogue adding each row into the output (docs/wip/design-topk-sum-in-gemm2.md),
// with no GEMM around either: the rows' values come from a small L2-resident source, as an
// epilogue's come from registers.
//
//   topk_sum_ceiling [--tokens M]
//
// Per model shape (top_k, experts, H; random distinct experts a token, slots sorted by
// expert as the alignment sorts them), three sequences:
//   today:  store_rows (GEMM2's [entries, H] bf16 store, a warp an entry in expert order)
//           + sum_rows (moe_sum_reduce's reads: a warp a token, its top_k rows times their
//           routed weights, summed in fp32, one bf16 store);
//   f32:    memset of an fp32 [M, H] buffer + red_rows<float> (a warp an entry in expert
//           order: red.global.add.v4.f32 of weight x value into its token's row) + the cast
//           to bf16;
//   bf16:   memset of the bf16 output + red_rows<bf16> (red.global.add.noftz.v4.bf16x2), as
//           TensorRT-LLM's fused finalize does (each term and each add rounded to bf16).
// Time: median of 10 timed groups of 8 back-to-back sequences (3 untimed), over 8. Each
// fused output is compared with today's (max |diff| / max |today|).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"

namespace {

constexpr int kWarps = 8;        // a CTA
constexpr int kSourceRows = 64;  // rows of the L2-resident value source
constexpr int kVec = 8;          // bf16 values a 16-byte chunk

struct Shape {
  const char* model;
  int top_k, experts, hidden;
};

__device__ __forceinline__ void load_values(const __nv_bfloat16* source, int64_t entry, int64_t chunk, int hidden,
                                            float (&v)[kVec]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(source + (entry % kSourceRows) * hidden + chunk * kVec);
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec; ++i) v[i] = __bfloat162float(h[i]);
}

// rows[entry, :] = the entry's values (bf16), entries in expert order.
__global__ void store_rows_kernel(const __nv_bfloat16* source, int64_t entries, int hidden, __nv_bfloat16* rows) {
  const int lane = threadIdx.x % 32;
  const int64_t entry = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (entry >= entries) return;
  for (int64_t c = lane; c < hidden / kVec; c += 32) {
    const uint4 raw = *reinterpret_cast<const uint4*>(source + (entry % kSourceRows) * hidden + c * kVec);
    *reinterpret_cast<uint4*>(rows + entry * hidden + c * kVec) = raw;
  }
}

// out[token, :] = sum over k of weight[slot] x rows[entry_of_slot[slot], :], slot = token x top_k + k.
__global__ void sum_rows_kernel(const __nv_bfloat16* rows, const int32_t* entry_of_slot, const float* weights,
                                int64_t tokens, int top_k, int hidden, __nv_bfloat16* out) {
  const int lane = threadIdx.x % 32;
  const int64_t token = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (token >= tokens) return;
  for (int64_t c = lane; c < hidden / kVec; c += 32) {
    float acc[kVec] = {};
    for (int k = 0; k < top_k; ++k) {
      const int64_t slot = token * top_k + k;
      const uint4 raw = *reinterpret_cast<const uint4*>(rows + int64_t(entry_of_slot[slot]) * hidden + c * kVec);
      const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
      const float w = weights[slot];
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] = fmaf(w, __bfloat162float(h[i]), acc[i]);
    }
    __nv_bfloat16 result[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) result[i] = __float2bfloat16(acc[i]);
    *reinterpret_cast<uint4*>(out + token * hidden + c * kVec) = *reinterpret_cast<const uint4*>(result);
  }
}

__device__ __forceinline__ void red_add(float* at, const float (&v)[kVec]) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(at), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
               : "memory");
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(at + 4), "f"(v[4]), "f"(v[5]), "f"(v[6]),
               "f"(v[7])
               : "memory");
#else
  for (int i = 0; i < kVec; ++i) atomicAdd(at + i, v[i]);
#endif
}

__device__ __forceinline__ void red_add(__nv_bfloat16* at, const float (&v)[kVec]) {
  __nv_bfloat162 pairs[kVec / 2];
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) pairs[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
#if __CUDA_ARCH__ >= 900
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(pairs);
  asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(at), "r"(bits[0]), "r"(bits[1]),
               "r"(bits[2]), "r"(bits[3])
               : "memory");
#else
  for (int i = 0; i < kVec / 2; ++i) atomicAdd(reinterpret_cast<__nv_bfloat162*>(at) + i, pairs[i]);
#endif
}

// out[token of entry, :] += weight x the entry's values, entries in expert order.
template <class Out>
__global__ void red_rows_kernel(const __nv_bfloat16* source, const int32_t* slot_of_entry, const float* weights,
                                int64_t entries, int top_k, int hidden, Out* out) {
  const int lane = threadIdx.x % 32;
  const int64_t entry = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (entry >= entries) return;
  const int32_t slot = slot_of_entry[entry];
  const int64_t token = slot / top_k;
  const float w = weights[slot];
  for (int64_t c = lane; c < hidden / kVec; c += 32) {
    float v[kVec];
    load_values(source, entry, c, hidden, v);
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] *= w;
    red_add(out + token * hidden + c * kVec, v);
  }
}

__global__ void cast_kernel(const float* in, int64_t count, __nv_bfloat16* out) {
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (i >= count) return;
  const float4 v = *reinterpret_cast<const float4*>(in + i);
  __nv_bfloat162 pairs[2] = {__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w)};
  *reinterpret_cast<uint2*>(out + i) = *reinterpret_cast<const uint2*>(pairs);
}

unsigned ctas(int64_t warps) { return unsigned((warps + kWarps - 1) / kWarps); }

// max |a - b| / max |a| over two bf16 device arrays.
double relative_diff(const void* a, const void* b, int64_t count) {
  std::vector<__nv_bfloat16> ha(count), hb(count);
  CHECK_CUDA(cudaMemcpy(ha.data(), a, count * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hb.data(), b, count * 2, cudaMemcpyDeviceToHost));
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double x = __bfloat162float(ha[i]), y = __bfloat162float(hb[i]);
    diff = std::max(diff, std::abs(x - y));
    scale = std::max(scale, std::abs(x));
  }
  return scale > 0 ? diff / scale : diff;
}

}  // namespace

int main(int argc, char** argv) {
  using moelora::bench::DeviceBuffer;
  int64_t tokens = 4096;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) {
      tokens = std::stoll(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: topk_sum_ceiling [--tokens M]\n");
      return 2;
    }
  }
  const Shape shapes[] = {{"qwen3-30b-a3b", 8, 128, 2048},  {"olmoe-1b-7b", 8, 64, 2048},
                          {"qwen3-235b-a22b", 8, 128, 4096}, {"deepseek-v3-tp8", 8, 256, 7168},
                          {"mixtral-8x7b", 2, 8, 4096},      {"gpt-oss-120b", 4, 128, 2880}};
  try {
    cudaStream_t stream;
    CHECK_CUDA(cudaStreamCreate(&stream));
    cudaDeviceProp prop{};
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    std::printf("%s, L2 %.0f MB, M = %lld; us a sequence (store + sum | memset + red + cast)\n", prop.name,
                prop.l2CacheSize / 1e6, static_cast<long long>(tokens));
    std::printf("%-16s %5s %9s %9s %9s %9s %9s %9s %9s %10s %10s\n", "model", "H", "store", "sum", "today", "red f32",
                "f32 all", "red bf16", "bf16 all", "diff f32", "diff bf16");
    std::mt19937_64 rng(1);
    for (const Shape& s : shapes) {
      const int64_t slots = tokens * s.top_k, H = s.hidden;
      // Routing: distinct experts a token; slots sorted by expert (stable: by slot inside one).
      std::vector<int32_t> expert_of_slot(slots);
      std::vector<int> pool(s.experts);
      std::iota(pool.begin(), pool.end(), 0);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int k = 0; k < s.top_k; ++k) {
          std::swap(pool[k], pool[k + rng() % (s.experts - k)]);
          expert_of_slot[t * s.top_k + k] = pool[k];
        }
      }
      std::vector<int32_t> slot_of_entry(slots), entry_of_slot(slots);
      std::iota(slot_of_entry.begin(), slot_of_entry.end(), 0);
      std::stable_sort(slot_of_entry.begin(), slot_of_entry.end(),
                       [&](int32_t a, int32_t b) { return expert_of_slot[a] < expert_of_slot[b]; });
      for (int64_t e = 0; e < slots; ++e) entry_of_slot[slot_of_entry[e]] = int32_t(e);
      std::vector<float> weights(slots);
      std::uniform_real_distribution<float> draw(0.f, 1.f);
      for (auto& w : weights) w = draw(rng);
      std::vector<__nv_bfloat16> source(kSourceRows * H);
      for (auto& v : source) v = __float2bfloat16(draw(rng) * 2.f - 1.f);

      DeviceBuffer d_source(source.size() * 2), d_slot_of_entry(slots * 4), d_entry_of_slot(slots * 4),
          d_weights(slots * 4), d_rows(slots * H * 2), d_today(tokens * H * 2), d_acc(tokens * H * 4),
          d_f32(tokens * H * 2), d_bf16(tokens * H * 2);
      CHECK_CUDA(cudaMemcpy(d_source.ptr, source.data(), source.size() * 2, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(d_slot_of_entry.ptr, slot_of_entry.data(), slots * 4, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(d_entry_of_slot.ptr, entry_of_slot.data(), slots * 4, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(d_weights.ptr, weights.data(), slots * 4, cudaMemcpyHostToDevice));
      const auto* src = static_cast<const __nv_bfloat16*>(d_source.ptr);
      const auto* soe = static_cast<const int32_t*>(d_slot_of_entry.ptr);
      const auto* eos = static_cast<const int32_t*>(d_entry_of_slot.ptr);
      const auto* w = static_cast<const float*>(d_weights.ptr);
      auto* rows = static_cast<__nv_bfloat16*>(d_rows.ptr);
      auto* acc = static_cast<float*>(d_acc.ptr);
      const unsigned block = kWarps * 32;
      auto store = [&] { store_rows_kernel<<<ctas(slots), block, 0, stream>>>(src, slots, int(H), rows); };
      auto sum = [&] {
        sum_rows_kernel<<<ctas(tokens), block, 0, stream>>>(rows, eos, w, tokens, s.top_k, int(H),
                                                             static_cast<__nv_bfloat16*>(d_today.ptr));
      };
      auto red_f32 = [&] {
        red_rows_kernel<float><<<ctas(slots), block, 0, stream>>>(src, soe, w, slots, s.top_k, int(H), acc);
      };
      auto f32_all = [&] {
        CHECK_CUDA(cudaMemsetAsync(acc, 0, tokens * H * 4, stream));
        red_f32();
        cast_kernel<<<unsigned((tokens * H / 4 + 255) / 256), 256, 0, stream>>>(
            acc, tokens * H, static_cast<__nv_bfloat16*>(d_f32.ptr));
      };
      auto red_bf16 = [&] {
        red_rows_kernel<__nv_bfloat16><<<ctas(slots), block, 0, stream>>>(src, soe, w, slots, s.top_k, int(H),
                                                                          static_cast<__nv_bfloat16*>(d_bf16.ptr));
      };
      auto bf16_all = [&] {
        CHECK_CUDA(cudaMemsetAsync(d_bf16.ptr, 0, tokens * H * 2, stream));
        red_bf16();
      };
      auto time_us = [&](auto&& body) {
        return 1e3 * moelora::bench::median_ms(stream, [&] {
          for (int i = 0; i < 8; ++i) body();
          CHECK_CUDA(cudaGetLastError());
        }, 10) / 8;
      };
      const double t_store = time_us(store), t_sum = time_us(sum);
      const double t_today = time_us([&] { store(); sum(); });
      const double t_red_f32 = time_us(red_f32), t_f32 = time_us(f32_all);
      const double t_red_bf16 = time_us(red_bf16), t_bf16 = time_us(bf16_all);
      // The outputs of one clean sequence each (the timed ones added onto unzeroed sums).
      store();
      sum();
      f32_all();
      bf16_all();
      CHECK_CUDA(cudaStreamSynchronize(stream));
      const double diff_f32 = relative_diff(d_today.ptr, d_f32.ptr, tokens * H);
      const double diff_bf16 = relative_diff(d_today.ptr, d_bf16.ptr, tokens * H);
      std::printf("%-16s %5lld %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %10.2e %10.2e\n", s.model,
                  static_cast<long long>(H), t_store, t_sum, t_today, t_red_f32, t_f32, t_red_bf16, t_bf16, diff_f32,
                  diff_bf16);
    }
    CHECK_CUDA(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "topk_sum_ceiling: %s\n", e.what());
    return 1;
  }
  return 0;
}
