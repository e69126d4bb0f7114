// The element and scale rules of quantization on CUDA, shared by the quantize op and the
// kernels that quantize as they write (moe_activation_quantize). See include/moelora/quant.h:
// scale = max(absmax, kQuantAbsmaxFloor) / qmax, element = round(x / scale) with an IEEE
// division (no fast math), so every kernel matches the CPU backend bit for bit.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "moelora/quant.h"

namespace moelora::cuda {

template <class Out>
__device__ __forceinline__ Out quantize_element(float x, float scale);
template <>
__device__ __forceinline__ uint8_t quantize_element<uint8_t>(float x, float scale) {
  const float v = fminf(fmaxf(x / scale, -448.f), 448.f);
  return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}
template <>
__device__ __forceinline__ int8_t quantize_element<int8_t>(float x, float scale) {
  const float v = fminf(fmaxf(x / scale, -127.f), 127.f);
  return int8_t(__float2int_rn(v));
}

// uint8_t holds fp8 e4m3 bits.
template <class Out>
constexpr float kQmax = std::is_same_v<Out, int8_t> ? 127.f : 448.f;

__device__ __forceinline__ float scale_of(float absmax, float qmax) { return fmaxf(absmax, kQuantAbsmaxFloor) / qmax; }

// Max over the team: kTeam <= 32 (a power of two), aligned lanes of one warp, every lane
// of the warp calling; a multiple of 32, kTeam / 32 aligned warps through shared memory
// (teams numbered threadIdx.x / kTeam), and then every thread of the CTA must call it.
template <int kTeam>
__device__ __forceinline__ float team_max(float v) {
  static_assert((kTeam <= 32 && (kTeam & (kTeam - 1)) == 0) || kTeam % 32 == 0,
                "teams of a power of two lanes of a warp, or of whole warps");
#pragma unroll
  for (int offset = kTeam < 32 ? kTeam / 2 : 16; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  if constexpr (kTeam <= 32) {
    return v;
  } else {
    __shared__ float warp_max[32];  // one per warp of the CTA (at most 1024 threads)
    __syncthreads();  // an earlier segment's readers are done with warp_max
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
    __syncthreads();
    const int first = int(threadIdx.x) / kTeam * (kTeam / 32);
    float m = warp_max[first];
#pragma unroll
    for (int w = 1; w < kTeam / 32; ++w) m = fmaxf(m, warp_max[first + w]);
    return m;
  }
}

}  // namespace moelora::cuda
