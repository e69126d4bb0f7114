// moe_activation_quantize on CUDA (ActivationQuantizeParams): fused_experts' grouped path
// turns GEMM1's rows [entries, 2I] into GEMM2's 8-bit input [entries, I] and its scales in
// one pass, instead of an activation kernel writing [entries, I] in the layer dtype and a
// quantize kernel reading it back. Each value is the activation rounded to the layer dtype,
// then quantized by the rules of cuda/quantize.cuh, as the reference does. With 16-bit
// experts (element = the layer dtype) the rounded activation is the output (Pass::kPlain).
//
// One team per row (grid-stride): a warp for rows of up to 1024 columns, else the CTA;
// each thread 8 consecutive outputs (16-byte loads) a step:
//   kBlock: the 16 threads of a 128-column block reduce its absmax with shuffles; one pass.
//   kChannel: the team reduces the row's absmax, then a second pass quantizes (its first
//     kKeep steps from registers, the rest re-read: L1/L2 hits).
// NOTE: with the CTA (128 threads) on every row, rows of 256 columns (DeepSeek-V3's I)
// left 96 threads idle and 768 (Qwen3-30B's) 32: DeepSeek-V3 fp8_block at M = 8192 spent
// 100 us here for 100 MB, Qwen3-30B fp8_channel 171 us for 250 MB (ncu, H100).
//   kTensor dynamic: a first launch atomicMax-es each row's absmax into *amax, the second
//     quantizes with scale_of(*amax) (its CTA 0 writes that scale for GEMM2). Static: one.
#include <algorithm>
#include <stdexcept>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/gated_activation.cuh"
#include "cuda/launch.cuh"
#include "cuda/numeric.cuh"
#include "cuda/quantize.cuh"

namespace moelora::cuda {
namespace {

using detail::ActivationKind;
using detail::ActivationQuantizeParams;

constexpr int kThreads = 128;
constexpr int kVec = 8;                  // outputs per thread and step: 16 bytes of 16-bit input
constexpr int kScaleBlock = 128;         // kBlock scales: 16 threads a block
// Per-row scales: steps a thread keeps in registers (a warp's row: 1024 columns; the CTA's: 2048).
template <int kTeam>
constexpr int kKeep = kTeam == 32 ? 4 : 2;

enum class Pass { kRows, kAmax, kTensor, kPlain };

// The activations of columns [col, col + kVec) of one row, rounded to T.
template <typename T, ActivationKind kKind>
__device__ __forceinline__ void activations(const T* in, int64_t width, int64_t col, const ActivationQuantizeParams& p,
                                            float (&v)[kVec]) {
  T gate[kVec], up[kVec];
  load_gate_up<T, kKind, kVec>(in, width, col, gate, up);
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    v[i] = to_float(from_float<T>(gated_activation<kKind>(to_float(gate[i]), to_float(up[i]), p.alpha, p.limit)));
  }
}

template <class Out>
__device__ __forceinline__ void store_quantized(Out* out, const float (&v)[kVec], float scale) {
  Out q[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) q[i] = quantize_element<Out>(v[i], scale);
  *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(q);
}

// Pass::kPlain: v holds values already rounded to T (activations()), stored as they are.
template <typename T>
__device__ __forceinline__ void store_rounded(T* out, const float (&v)[kVec]) {
  T r[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) r[i] = from_float<T>(v[i]);
  *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(r);
}

template <typename T, class Out, ActivationKind kKind, ScaleGranularity kScales, Pass kPass, int kTeam>
__global__ void __launch_bounds__(kThreads) moe_activation_quantize_kernel(const ActivationQuantizeParams p) {
  static_assert(kTeam == 32 || kTeam == kThreads, "a warp or the CTA a row");
  constexpr int kStep = kTeam * kVec;  // columns per team step
  constexpr int kRowsPerCta = kThreads / kTeam;
  constexpr int kKept = kKeep<kTeam>;
  const int team_lane = int(threadIdx.x) % kTeam;
  wait_for_previous_kernel();
  const int64_t entries = std::min<int64_t>(*p.num_tokens_post_padded, p.max_num_tokens_padded);
  const int64_t width = p.width;
  float tensor_scale = 0.f;
  if constexpr (kPass == Pass::kTensor) {
    tensor_scale = p.static_scale ? *p.scales : scale_of(*p.amax, kQmax<Out>);
    if (!p.static_scale && blockIdx.x == 0 && threadIdx.x == 0) *p.scales = tensor_scale;
  }
  // NOTE: the row test is uniform over the team (the CTA's barriers when the CTA is the team).
  for (int64_t row = int64_t(blockIdx.x) * kRowsPerCta + int(threadIdx.x) / kTeam; row < entries;
       row += int64_t(gridDim.x) * kRowsPerCta) {
    const int32_t slot = p.sorted_token_ids[row];
    if (slot < 0 || slot >= p.num_slots || p.expert_ids[row / p.block_size] < 0) continue;  // never computed
    const T* in = static_cast<const T*>(p.input) + row * 2 * width;
    Out* out = static_cast<Out*>(p.out) + row * width;
    if constexpr (kScales == ScaleGranularity::kBlock && kPass == Pass::kRows) {
      const int64_t scale_cols = (width + kScaleBlock - 1) / kScaleBlock;
      for (int64_t c0 = 0; c0 < width; c0 += kStep) {
        const int64_t col = c0 + int64_t(team_lane) * kVec;
        float v[kVec] = {};
        float absmax = 0.f;
        if (col < width) {
          activations<T, kKind>(in, width, col, p, v);
#pragma unroll
          for (int i = 0; i < kVec; ++i) absmax = fmaxf(absmax, fabsf(v[i]));
        }
        absmax = team_max<kScaleBlock / kVec>(absmax);
        const float scale = scale_of(absmax, kQmax<Out>);
        if (col < width) {
          if (team_lane % (kScaleBlock / kVec) == 0) p.scales[row * scale_cols + col / kScaleBlock] = scale;
          store_quantized(out + col, v, scale);
        }
      }
    } else {
      float scale = tensor_scale;
      // The row's first kKeep steps stay in registers between the absmax and the
      // quantization (rows of up to kKeep x kStep columns are read and activated once).
      // NOTE: recomputed, Qwen3-30B fp8_channel at M = 8192 spent 212 us of 1350 here
      // (65536 rows of 768: two loads and two activations a value; ncu, H100).
      float kept[kKept][kVec];
      constexpr bool kRowScales = kPass == Pass::kRows || kPass == Pass::kAmax;
      if constexpr (kRowScales) {
        float absmax = 0.f;
        for (int64_t col = int64_t(team_lane) * kVec, step = 0; col < width; col += kStep, ++step) {
          float v[kVec];
          activations<T, kKind>(in, width, col, p, v);
#pragma unroll
          for (int i = 0; i < kVec; ++i) absmax = fmaxf(absmax, fabsf(v[i]));
#pragma unroll
          for (int k = 0; k < kKept; ++k) {
            if (step == k) {
#pragma unroll
              for (int i = 0; i < kVec; ++i) kept[k][i] = v[i];
            }
          }
        }
        absmax = team_max<kTeam>(absmax);
        if constexpr (kPass == Pass::kAmax) {
          // Non-negative floats order like their bits.
          if (team_lane == 0) atomicMax(reinterpret_cast<int*>(p.amax), __float_as_int(absmax));
          continue;
        }
        scale = scale_of(absmax, kQmax<Out>);
        if (team_lane == 0) p.scales[row] = scale;
      }
      for (int64_t col = int64_t(team_lane) * kVec, step = 0; col < width; col += kStep, ++step) {
        float v[kVec];
        if (kRowScales && step < kKept) {
#pragma unroll
          for (int k = 0; k < kKept; ++k) {
            if (step == k) {
#pragma unroll
              for (int i = 0; i < kVec; ++i) v[i] = kept[k][i];
            }
          }
        } else {
          activations<T, kKind>(in, width, col, p, v);
        }
        if constexpr (kPass == Pass::kPlain) {
          store_rounded(out + col, v);
        } else {
          store_quantized(out + col, v, scale);
        }
      }
    }
  }
  allow_next_kernel_launch();
}

template <typename T, class Out, ActivationKind kKind, ScaleGranularity kScales, int kTeam>
void launch_team(const ActivationQuantizeParams& p, cudaStream_t stream) {
  constexpr int kRowsPerCta = kThreads / kTeam;
  const unsigned ctas = unsigned(std::clamp<int64_t>((p.max_num_tokens_padded + kRowsPerCta - 1) / kRowsPerCta, 1,
                                                     int64_t(current_device_info().num_sms) * 16));
  if constexpr (std::is_same_v<T, Out>) {
    launch_kernel(moe_activation_quantize_kernel<T, Out, kKind, kScales, Pass::kPlain, kTeam>, dim3(ctas),
                  dim3(kThreads), 0, stream, p);
  } else if constexpr (kScales == ScaleGranularity::kTensor) {
    if (!p.static_scale) {
      launch_kernel(moe_activation_quantize_kernel<T, Out, kKind, kScales, Pass::kAmax, kTeam>, dim3(ctas),
                    dim3(kThreads), 0, stream, p);
    }
    launch_kernel(moe_activation_quantize_kernel<T, Out, kKind, kScales, Pass::kTensor, kTeam>, dim3(ctas),
                  dim3(kThreads), 0, stream, p);
  } else {
    launch_kernel(moe_activation_quantize_kernel<T, Out, kKind, kScales, Pass::kRows, kTeam>, dim3(ctas),
                  dim3(kThreads), 0, stream, p);
  }
}

template <typename T, class Out, ActivationKind kKind, ScaleGranularity kScales>
void launch_scales(const ActivationQuantizeParams& p, cudaStream_t stream) {
  if (p.width <= 32 * kVec * kKeep<32>) return launch_team<T, Out, kKind, kScales, 32>(p, stream);
  launch_team<T, Out, kKind, kScales, kThreads>(p, stream);
}

template <typename T, class Out, ActivationKind kKind>
void launch_kind(const ActivationQuantizeParams& p, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, Out>) {  // 16-bit experts: no scales
    launch_scales<T, Out, kKind, ScaleGranularity::kTensor>(p, stream);
  } else {
    switch (p.granularity) {
      case ScaleGranularity::kBlock: launch_scales<T, Out, kKind, ScaleGranularity::kBlock>(p, stream); break;
      case ScaleGranularity::kChannel: launch_scales<T, Out, kKind, ScaleGranularity::kChannel>(p, stream); break;
      default: launch_scales<T, Out, kKind, ScaleGranularity::kTensor>(p, stream); break;
    }
  }
}

template <typename T, class Out>
void launch_out(const ActivationQuantizeParams& p, cudaStream_t stream) {
  switch (p.kind) {
    case ActivationKind::kSiluAndMul: launch_kind<T, Out, ActivationKind::kSiluAndMul>(p, stream); break;
    case ActivationKind::kGeluAndMul: launch_kind<T, Out, ActivationKind::kGeluAndMul>(p, stream); break;
    default: launch_kind<T, Out, ActivationKind::kSwigluOai>(p, stream); break;
  }
}

}  // namespace

void moe_activation_quantize(const ActivationQuantizeParams& p, Stream stream) {
  if (p.max_num_tokens_padded == 0 || p.width == 0) return;
  // 16-byte input loads, 8-byte output stores (16-byte unquantized), 128-column scale
  // blocks of 16 threads.
  const bool plain = p.element == p.dtype;
  if (p.width % 16 != 0 || !aligned16(p.input) || reinterpret_cast<uintptr_t>(p.out) % (plain ? 16 : 8) != 0 ||
      (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16)) {
    throw std::logic_error("moelora.moe_activation_quantize: needs 16-bit rows, width % 16 == 0, aligned rows");
  }
  const auto s = static_cast<cudaStream_t>(stream);
  auto with_out = [&](auto t) {
    using T = decltype(t);
    if (plain) {
      launch_out<T, T>(p, s);
    } else if (p.element == DType::kInt8) {
      launch_out<T, int8_t>(p, s);
    } else {
      launch_out<T, uint8_t>(p, s);
    }
  };
  if (p.dtype == DType::kBFloat16) {
    with_out(__nv_bfloat16{});
  } else {
    with_out(__half{});
  }
}

}  // namespace moelora::cuda
