// Host-side conversions between fp32 and the 16-bit float formats, bit-exact with the
// CUDA intrinsics (__float2bfloat16_rn / __float2half_rn: round to nearest even).
// Used by the CPU backend, the tests and the benchmark; no CUDA header needed.
#pragma once

#include <cstdint>
#include <cstring>

namespace moelora::host {

struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float to_float(bf16 v) { return bits_float(uint32_t(v.bits) << 16); }

inline bf16 to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16{uint16_t(u >> 16)};
}

inline float to_float(fp16 v) {
  const uint32_t sign = uint32_t(v.bits & 0x8000u) << 16;
  uint32_t exp = (v.bits >> 10) & 0x1fu;
  uint32_t man = v.bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // subnormal: normalise
    int e = -1;
    do { man <<= 1; ++e; } while ((man & 0x400u) == 0);
    man &= 0x3ffu;
    return bits_float(sign | uint32_t(127 - 15 - e) << 23 | (man << 13));
  }
  return bits_float(sign | (exp + 127 - 15) << 23 | (man << 13));
}

inline fp16 to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return fp16{uint16_t(sign | 0x7e00u)};         // NaN
  if (abs >= 0x477ff000u) return fp16{uint16_t(sign | 0x7c00u)};        // rounds to inf
  if (abs < 0x38800000u) {                                               // subnormal or zero
    // value = abs_float; fp16 subnormal unit = 2^-24
    const float a = bits_float(abs);
    const float scaled = a * 16777216.0f;  // exact (power of two)
    // round half to even on an integer
    uint32_t q = uint32_t(scaled);
    const float rem = scaled - float(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
    return fp16{uint16_t(sign | q)};
  }
  uint32_t mant = abs & 0x7fffffu;
  uint32_t exp = (abs >> 23) - 127 + 15;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // may carry into exponent: correct
  return fp16{uint16_t(sign | h)};
}

}  // namespace moelora::host
