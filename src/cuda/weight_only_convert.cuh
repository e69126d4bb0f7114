// The weight-only conversions (w4a16 / w8a16, issue 30): packed 4-bit or 8-bit weights
// to bf16/fp16 pairs in registers, shared by the small-batch kernels
// (small_batch_weight_only.cuh), dequantize_experts and the sm90 tile kernel's consumers
// (fused_moe_sm90_weight_only.cuh).
// - 4-bit: LOP3 (q >> 4i) & 0x000f000f | EXP makes the 16-bit pair (base + v_i, base +
//   v_{i+4}) of a word's nibbles i and i + 4 (k = 8w + i, 8w + i + 4), exact in bf16
//   (base 128) and fp16 (base 1024); (pair - (base + zero)) * scale is the weight pair.
//   FasterTransformer's and Marlin's conversion, here without the offline reshuffle of
//   the weights: the layer keeps the checkpoint's plain layout.
// - 8-bit: fp16 takes PRMT with 0x64 (1024 + v); bf16 builds 2^23 + v in fp32 (PRMT with
//   0x4B000000), subtracts 2^23 + zero and converts the pair (exact: |v - zero| <= 255).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/params.h"
#include "cuda/numeric.cuh"

namespace moelora::cuda::weight_only {

using detail::WeightOnlyParams;

__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "r"(mask), "r"(bits));  // (a & mask) | bits
  return r;
}

template <class T>
using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;

template <class T>
__device__ __forceinline__ Pair<T> as_pair(uint32_t v) {
  return reinterpret_cast<const Pair<T>&>(v);
}
template <class T>
__device__ __forceinline__ uint32_t as_bits(Pair<T> v) {
  return reinterpret_cast<const uint32_t&>(v);
}

// A row's constants for one lane-step (one scale group): the scale pair, the pair that
// the conversion's base and the zero point make (4-bit; 8-bit fp16), and the zero point
// (8-bit bf16, subtracted in fp32).
template <class T>
struct GroupConstants {
  Pair<T> scale, offset;
  float zero;
};

// A row's scale and zero point for one group, as loaded: split from the constants so
// that a caller can issue the loads early (the decode kernels, a round of steps ahead;
// the sm90 consumers, a step ahead). `zero` is the loaded byte (packed: both nibbles of
// the row pair) or the symmetric zero point; ZeroPointField picks the row's bits only
// when the constants are made, so that nothing waits for the load where it is issued.
template <class T>
struct GroupCodes {
  T scale;
  int zero;
};

// Where a row's zero point lies in its loaded byte: packed zero points hold row 2i in the
// low nibble and 2i + 1 in the high one.
struct ZeroPointField {
  int shift = 0;
  int mask = 255;
};

// The 16-bit pattern of the base the conversions add (exact with 8 / 11 significant
// bits): 4-bit 128 (bf16, 0x4300) or 1024 (fp16, 0x6400); 8-bit fp16 1024. base + z for
// an integer 0 <= z < 2^7 (bf16: one unit a mantissa step) or < 2^10 (fp16) is that
// pattern plus z, exactly: two integer instructions a pair, not a trip through fp32.
template <class T>
constexpr uint32_t kConversionBaseBits = std::is_same_v<T, __half> ? 0x6400u : 0x4300u;

// A group's constants from its codes. 8-bit bf16 keeps the zero point for fp32 (128 + z
// past 255 has no exact bf16); the others take the offset pair base + zero.
template <class T, int kBits>
__device__ __forceinline__ GroupConstants<T> make_group_constants(const GroupCodes<T>& codes, ZeroPointField field) {
  const int zero = (codes.zero >> field.shift) & field.mask;
  GroupConstants<T> c;
  c.scale = Pair<T>(codes.scale, codes.scale);
  if constexpr (kBits == 8 && !std::is_same_v<T, __half>) {
    c.zero = float(zero);
  } else {
    c.offset = as_pair<T>((kConversionBaseBits<T> + uint32_t(zero)) * 0x10001u);
  }
  return c;
}

// Whether a caller knows that the rows have zero points (kYes), have none (kNo), or
// leaves it to a branch on the row's zero-point pointer (kMaybe).
enum class ZeroPoints { kMaybe, kNo, kYes };

// One weight row's scale and zero-point rows (of one expert), set once per row so that
// a group's codes cost a 32-bit offset and a load. NOTE: computed per step
// (`expert * stride + row * stride + group * stride` in 64 bits), with the loads behind
// the step's branch, this index math was ~90 of a decode step's 235 instructions (SASS
// of the w4 GEMM1, H100 build) and 170 of the sm90 tiles' 834 (docs/PERF_NOTES.md,
// issue 30 steps 2 and 4).
template <class T, int kBits>
struct WeightRowCodes {
  const uint8_t* scale_row = nullptr;  // bytes: a group's offset is a 32-bit add
  const uint8_t* zero_row = nullptr;   // null: the scheme's symmetric zero point
  // Between groups, in bytes: non-negative, and below 2^31 over a row (the API checks).
  uint32_t scale_stride = 0, zero_stride = 0;
  ZeroPointField zero_field;

  __device__ __forceinline__ void start(const WeightOnlyParams& q, int64_t expert, int64_t row) {
    scale_row = static_cast<const uint8_t*>(q.scale) +
                (expert * q.scale_stride_expert + row * q.scale_stride_n) * int64_t(sizeof(T));
    scale_stride = uint32_t(q.scale_stride_k) * uint32_t(sizeof(T));
    zero_row = nullptr;
    zero_field = ZeroPointField{};
    if (q.zero) {
      zero_row = q.zero + expert * q.zero_stride_expert + (q.zero_packed ? row >> 1 : row) * q.zero_stride_n;
      zero_stride = uint32_t(q.zero_stride_k);
      // packed zero points hold row 2i in the low nibble and 2i + 1 in the high one
      if (q.zero_packed) zero_field = ZeroPointField{4 * int(row & 1), 15};
    }
  }
  // The codes of group `group` (in bounds: callers clamp it).
  template <ZeroPoints kZero = ZeroPoints::kMaybe>
  __device__ __forceinline__ GroupCodes<T> load(int group) const {
    GroupCodes<T> codes;
    codes.scale = *reinterpret_cast<const T*>(scale_row + uint32_t(group) * scale_stride);
    constexpr int kSymmetric = kBits == 4 ? 8 : 128;
    if constexpr (kZero == ZeroPoints::kYes) {
      codes.zero = zero_row[uint32_t(group) * zero_stride];
    } else if constexpr (kZero == ZeroPoints::kNo) {
      codes.zero = kSymmetric;
    } else {
      codes.zero = zero_row ? int(zero_row[uint32_t(group) * zero_stride]) : kSymmetric;
    }
    return codes;
  }
  __device__ __forceinline__ GroupConstants<T> constants(const GroupCodes<T>& codes) const {
    return make_group_constants<T, kBits>(codes, zero_field);
  }
};

// Four weight pairs of one 32-bit word, as MMA operand registers, in the order the
// vector's pairs of vector_pairs() take:
//   4-bit: (k0, k4), (k1, k5), (k2, k6), (k3, k7) of the word's 8 values
//   8-bit: (k0, k1), (k2, k3) in w[0], w[1] (w[2], w[3] unused)
// kScaled: times the scale (groups smaller than a step); else q - zero alone, exact, for
// a scale applied to the step's MMA sums (warp_weight_only_rows).
template <class T, int kBits, bool kScaled>
__device__ __forceinline__ void weight_pairs(uint32_t word, const GroupConstants<T>& c, uint32_t (&w)[4]) {
  auto scaled = [&](Pair<T> v) { return as_bits<T>(kScaled ? __hmul2(v, c.scale) : v); };
  if constexpr (kBits == 4) {
    constexpr uint32_t kExp = std::is_same_v<T, __half> ? 0x64006400u : 0x43004300u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const Pair<T> v = as_pair<T>(and_or(word >> (4 * i), 0x000f000fu, kExp));
      w[i] = scaled(__hsub2(v, c.offset));
    }
  } else if constexpr (std::is_same_v<T, __half>) {
    const Pair<T> lo = as_pair<T>(__byte_perm(word, 0x64646464u, 0x4140));
    const Pair<T> hi = as_pair<T>(__byte_perm(word, 0x64646464u, 0x4342));
    w[0] = scaled(__hsub2(lo, c.offset));
    w[1] = scaled(__hsub2(hi, c.offset));
  } else {
    // 2^23 + v in fp32, minus 2^23 + zero: v - zero exactly.
    const float bias = 8388608.f + c.zero;
    float f[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) f[b] = __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540 | b)) - bias;
    w[0] = scaled(__floats2bfloat162_rn(f[0], f[1]));
    w[1] = scaled(__floats2bfloat162_rn(f[2], f[3]));
  }
}

// weight_pairs' 4-bit order (k0, k4), (k1, k5), (k2, k6), (k3, k7) back to K order:
// (k0, k1), (k2, k3), (k4, k5), (k6, k7).
__device__ __forceinline__ void natural_order(const uint32_t (&pairs)[4], uint32_t (&out)[4]) {
  out[0] = __byte_perm(pairs[0], pairs[1], 0x5410);
  out[1] = __byte_perm(pairs[2], pairs[3], 0x5410);
  out[2] = __byte_perm(pairs[0], pairs[1], 0x7632);
  out[3] = __byte_perm(pairs[2], pairs[3], 0x7632);
}

}  // namespace moelora::cuda::weight_only
