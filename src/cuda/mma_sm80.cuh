// The sm_80 tensor-core and async-copy instructions the mma.sync kernels share, on
// 32-bit shared-memory addresses.
// NOTE: a generic pointer converted to a shared address per use costs 3 instructions;
// kernels compute their 32-bit addresses once (smem_addr) and add offsets.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cute/arch/util.hpp>

#include <cstdint>
#include <type_traits>

namespace moelora::cuda {

// Shared-memory element p as a 32-bit shared address.
template <typename T>
__device__ __forceinline__ uint32_t smem_addr(const T* p) {
  return cute::cast_smem_ptr_to_uint(p);
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t smem_addr, uint32_t& d0, uint32_t& d1, uint32_t& d2,
                                            uint32_t& d3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3)
               : "r"(smem_addr));
}
// The same, each matrix transposed (an mma B fragment from k-major rows).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t smem_addr, uint32_t& d0, uint32_t& d1, uint32_t& d2,
                                                  uint32_t& d3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3)
               : "r"(smem_addr));
}

// c[4] += a[16x16] · b[16x8], bf16 operands, fp32 accumulation (mma.m16n8k16 fragments).
__device__ __forceinline__ void mma_bf16_16x8x16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                 uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same on fp16 operands.
__device__ __forceinline__ void mma_fp16_16x8x16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                 uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same for T (__half or __nv_bfloat16).
template <class T>
__device__ __forceinline__ void mma_16x8x16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                            uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    mma_fp16_16x8x16(c, a0, a1, a2, a3, b0, b1);
  } else {
    mma_bf16_16x8x16(c, a0, a1, a2, a3, b0, b1);
  }
}

// c[4] += a[16x32] · b[32x8], 8-bit operands (mma.m16n8k32 fragments: a0 row g k 4q..4q+3,
// a1 row g+8, a2/a3 the same rows at k + 16; b0 k 4q..4q+3 column g, b1 at k + 16):
// fp8 e4m3 into fp32 (sm_89+; a trap below), int8 into int32.
__device__ __forceinline__ void mma_8bit_16x8x32(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                 uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  (void)c, (void)a0, (void)a1, (void)a2, (void)a3, (void)b0, (void)b1;
  __trap();
#endif
}
__device__ __forceinline__ void mma_8bit_16x8x32(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                 uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared by cp.async, zeros when !ok (src then is not read).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem_addr, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(src), "r"(ok ? 16 : 0));
}

}  // namespace moelora::cuda
