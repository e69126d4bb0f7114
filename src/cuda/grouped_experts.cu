// fused_experts' grouped path on CUDA (GroupedExpertsParams; W8A8 or 16-bit experts): the
// device arrays of both grouped GEMMs, written after the alignment, and the choice of the CUTLASS instance
// (grouped_gemm_sm90_*.cu) that runs each GEMM. No CUTLASS type in this file: it builds for
// every architecture, the instances for sm_90a only.
#include <stdexcept>
#include <string>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/grouped_gemm_sm90.h"
#include "cuda/launch.cuh"
#include "cuda/numeric.cuh"

namespace moelora::cuda {
namespace {

using detail::GemmQuantParams;
using detail::GroupedExpertsParams;

constexpr int64_t kScaleBlock = 128;  // block_k of the blockwise scales (CUTLASS's granularity)

// One GEMM's arrays in GroupedExpertsParams::args (grouped_gemm_args_bytes' layout).
struct GemmArrays {
  int32_t* problem_shapes;
  const void** a;
  const void** b;
  void** d;
  int64_t* stride_a;
  int64_t* stride_b;
  int64_t* stride_d;
  const float** a_scales;
  const float** w_scales;
};

__host__ __device__ inline GemmArrays gemm_arrays(void* args, int64_t num_groups, int gemm) {
  char* base = static_cast<char*>(args) + (gemm - 1) * detail::grouped_gemm_args_bytes(num_groups);
  GemmArrays r;
  r.problem_shapes = reinterpret_cast<int32_t*>(base);
  char* at = base + (num_groups * 12 + 15) / 16 * 16;
  auto next = [&]() { char* here = at; at += 8 * num_groups; return here; };
  r.a = reinterpret_cast<const void**>(next());
  r.b = reinterpret_cast<const void**>(next());
  r.d = reinterpret_cast<void**>(next());
  r.stride_a = reinterpret_cast<int64_t*>(next());
  r.stride_b = reinterpret_cast<int64_t*>(next());
  r.stride_d = reinterpret_cast<int64_t*>(next());
  r.a_scales = reinterpret_cast<const float**>(next());
  r.w_scales = reinterpret_cast<const float**>(next());
  return r;
}

// Group g's activation scales: a row of ceil(K / 128) block scales or one scale per entry
// (gathered or written by entry), or the tensor's scale.
__device__ inline const float* activation_scales_of(const GemmQuantParams& q, const float* by_entry,
                                                    const float* tensor_scale, int64_t start, int64_t K) {
  switch (q.a_scales) {
    case ScaleGranularity::kBlock: return by_entry + start * ((K + kScaleBlock - 1) / kScaleBlock);
    case ScaleGranularity::kChannel: return by_entry + start;
    default: return tensor_scale;
  }
}

// One thread per group (global expert). Groups whose expert is not local get M = 0: the
// GEMMs skip them and never read their pointers.
__global__ void grouped_experts_args_kernel(const GroupedExpertsParams p) {
  wait_for_previous_kernel();
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g == 0 && p.act_amax) *p.act_amax = 0.f;  // moe_activation_quantize's tensor absmax
  if (g < p.num_groups) {
    const int32_t local = p.expert_map ? p.expert_map[g] : int32_t(g);
    const int64_t expert = local >= 0 ? local : 0;
    // The expert's alignment groups lie packed from its first one's first entry.
    const int64_t first = g * p.groups_per_expert, last = first + p.groups_per_expert - 1;
    const int64_t start = p.group_entry_offsets[first];
    const int32_t rows = local >= 0 ? int32_t(p.group_entry_offsets[last] + p.group_sizes[last] - start) : 0;
    // d is bf16 / fp16 (grouped_experts_supported); a and the weights 8-bit, or d's type.
    const int64_t elem = 2, in = p.quant13.enabled ? 1 : elem, H = p.H, I = p.I;
    const GemmArrays g1 = gemm_arrays(p.args, p.num_groups, 1), g2 = gemm_arrays(p.args, p.num_groups, 2);
    // GEMM1: d[start.., 2I] = a[start.., H] · w13[e]ᵀ
    g1.problem_shapes[3 * g] = rows;
    g1.problem_shapes[3 * g + 1] = int32_t(2 * I);
    g1.problem_shapes[3 * g + 2] = int32_t(H);
    g1.a[g] = static_cast<const uint8_t*>(p.a) + start * H * in;
    g1.b[g] = static_cast<const uint8_t*>(p.w13) + expert * p.w13_stride_expert * in;
    g1.d[g] = static_cast<char*>(p.d) + start * 2 * I * elem;
    g1.stride_a[g] = H;
    g1.stride_b[g] = p.w13_stride_n;
    g1.stride_d[g] = 2 * I;
    const bool scaled = p.quant13.enabled;  // 16-bit operands: no scales
    g1.a_scales[g] = scaled ? activation_scales_of(p.quant13, p.a_scales, p.x_tensor_scale, start, H) : nullptr;
    g1.w_scales[g] = scaled ? p.quant13.w_scale + expert * p.quant13.w_scale_stride_expert : nullptr;
    // GEMM2: d[start.., H] = a[start.., I] · w2[e]ᵀ
    g2.problem_shapes[3 * g] = rows;
    g2.problem_shapes[3 * g + 1] = int32_t(H);
    g2.problem_shapes[3 * g + 2] = int32_t(I);
    g2.a[g] = static_cast<const uint8_t*>(p.a) + start * I * in;
    g2.b[g] = static_cast<const uint8_t*>(p.w2) + expert * p.w2_stride_expert * in;
    g2.d[g] = static_cast<char*>(p.d) + start * H * elem;
    g2.stride_a[g] = I;
    g2.stride_b[g] = p.w2_stride_n;
    g2.stride_d[g] = H;
    g2.a_scales[g] = scaled ? activation_scales_of(p.quant2, p.a_scales, p.act_tensor_scale, start, I) : nullptr;
    g2.w_scales[g] = scaled ? p.quant2.w_scale + expert * p.quant2.w_scale_stride_expert : nullptr;
  }
  allow_next_kernel_launch();
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One GEMM's scales fit its instance: blockwise (fp8, 128 x 128 weight blocks, 1 x 128
// activation groups, the scale tensors packed as CUTLASS reads them), or epilogue scales
// (per-channel or per-expert weights, per-row or per-tensor activations).
bool gemm_scales_supported(const GemmQuantParams& q, int64_t K) {
  if (q.w_scales == ScaleGranularity::kBlock) {
    return q.element == DType::kFloat8E4M3 && q.a_scales == ScaleGranularity::kBlock && q.block_n == kScaleBlock &&
           q.block_k == kScaleBlock && q.w_scale_stride_k == 1 && q.w_scale_stride_n == ceil_div(K, kScaleBlock);
  }
  if (q.a_scales == ScaleGranularity::kBlock) return false;
  return q.w_scales == ScaleGranularity::kTensor || q.w_scale_stride_n == 1;
}

#ifdef MOELORA_BUILD_SM90A
using InstanceFn = void (*)(const GroupedGemmRun&, cudaStream_t);

template <GroupedGemmOperands kOperands, GroupedGemmTiles kTiles>
InstanceFn instance_for(DType out) {
  return out == DType::kBFloat16 ? grouped_gemm_sm90<kOperands, DType::kBFloat16, kTiles>
                                 : grouped_gemm_sm90<kOperands, DType::kFloat16, kTiles>;
}

template <GroupedGemmTiles kTiles>
InstanceFn instance_for(const GroupedExpertsParams& p, const GemmQuantParams& q) {
  if (!q.enabled) return instance_for<GroupedGemmOperands::k16Bit, kTiles>(p.dtype);
  if constexpr (kTiles == GroupedGemmTiles::kCooperative128x256) {
    // No 8-bit instance of these tiles: grouped_gemm_tiles (fused_experts_plan.cpp) gives
    // 8-bit operands asking for them 128 x 128.
    throw std::logic_error("moelora.fused_experts: 128 x 256 grouped tiles for 8-bit operands");
  } else {
    if (q.w_scales == ScaleGranularity::kBlock) return instance_for<GroupedGemmOperands::kFp8Blockwise, kTiles>(p.dtype);
    if (q.element == DType::kInt8) return instance_for<GroupedGemmOperands::kInt8Scaled, kTiles>(p.dtype);
    return instance_for<GroupedGemmOperands::kFp8Scaled, kTiles>(p.dtype);
  }
}
#endif

}  // namespace

bool grouped_experts_supported(const GroupedExpertsParams& p) {
#ifdef MOELORA_BUILD_SM90A
  if (!sm90_kernels_available(current_device_info())) return false;
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return false;
  // TMA: 16-byte rows and bases for the operands (K = H, then I; 8-bit, or 16-bit where
  // 16 elements are 32 bytes), 8 outputs per 16 bytes of D. The kernels skip these checks
  // when the problem sizes live on the device.
  const int64_t H = p.H, I = p.I;
  const bool aligned = H % 16 == 0 && I % 16 == 0 && p.w13_stride_n % 16 == 0 && p.w2_stride_n % 16 == 0 &&
                       p.w13_stride_expert % 16 == 0 && p.w2_stride_expert % 16 == 0 && aligned16(p.w13) &&
                       aligned16(p.w2) && aligned16(p.a) && aligned16(p.d);
  // 16-bit operands (the layer's type, unquantized experts): no scales.
  if (!p.quant13.enabled && !p.quant2.enabled) return aligned;
  return aligned && p.quant13.enabled && p.quant2.enabled && gemm_scales_supported(p.quant13, H) &&
         gemm_scales_supported(p.quant2, I);
#else
  (void)p;
  return false;
#endif
}

void grouped_experts_args(const GroupedExpertsParams& p, Stream stream) {
  constexpr int kThreads = 128;
  launch_kernel(grouped_experts_args_kernel, dim3(unsigned(ceil_div(p.num_groups, kThreads))), dim3(kThreads), 0,
                static_cast<cudaStream_t>(stream), p);
}

void grouped_experts_gemm(const GroupedExpertsParams& p, int gemm, Stream stream) {
  const GemmQuantParams& q = gemm == 1 ? p.quant13 : p.quant2;
  const GemmArrays arrays = gemm_arrays(p.args, p.num_groups, gemm);
  GroupedGemmRun run{};
  run.num_groups = int(p.num_groups);
  run.problem_shapes = arrays.problem_shapes;
  run.a = arrays.a;
  run.stride_a = arrays.stride_a;
  run.b = arrays.b;
  run.stride_b = arrays.stride_b;
  run.d = arrays.d;
  run.stride_d = arrays.stride_d;
  run.a_scales = arrays.a_scales;
  run.w_scales = arrays.w_scales;
  run.a_scale_per_row = q.a_scales != ScaleGranularity::kTensor;
  run.w_scale_per_col = q.w_scales == ScaleGranularity::kChannel;
  run.workspace = p.cutlass_workspace;
  run.workspace_bytes = p.cutlass_workspace_bytes;
#ifdef MOELORA_BUILD_SM90A
  const GroupedGemmTiles tiles = gemm == 1 ? p.tiles1 : p.tiles2;
  if (tiles == GroupedGemmTiles::kAuto) throw std::logic_error("moelora.fused_experts: grouped GEMM tiles not chosen");
  const InstanceFn instance =
      tiles == GroupedGemmTiles::kPingpong64           ? instance_for<GroupedGemmTiles::kPingpong64>(p, q)
      : tiles == GroupedGemmTiles::kCooperative128x256 ? instance_for<GroupedGemmTiles::kCooperative128x256>(p, q)
                                                       : instance_for<GroupedGemmTiles::kCooperative128>(p, q);
  instance(run, static_cast<cudaStream_t>(stream));
#else
  (void)run;
  throw std::logic_error("moelora.fused_experts: the grouped path needs an sm_90a build");
#endif
}

}  // namespace moelora::cuda
