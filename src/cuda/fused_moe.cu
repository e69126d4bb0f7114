// fused_moe launcher: resolves the tile (the caller's, else a heuristic) and launches
// the kernel instance. No sync, no allocation.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/fused_moe_launch.h"
#include "cuda/fused_moe_simt.cuh"
#include "cuda/numeric.cuh"
#include "cuda/tensor_map.h"

namespace moelora::cuda {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Heuristic for calls without a tuned tile. The grid is sized from the capacity bound
// (max_num_blocks), so that bound stands in for the m-tile count.
GemmTile heuristic_tile(const detail::GemmParams& p, const DeviceInfo& device, bool sm90) {
  const int64_t waves_target = 2 * int64_t(device.num_sms);
  const int64_t weight_rows = p.gated ? 2 * p.N : p.N;
  if (sm90 && p.block_size % 64 == 0) {
    // wgmma: 128 rows when the block allows; 256 columns when that still gives two
    // waves of CTAs, else 128 (more CTAs streaming the weights).
    const int block_m = p.block_size % 128 == 0 ? 128 : 64;
    const int64_t m_tiles = p.max_num_blocks * (p.block_size / block_m);
    const int block_n = m_tiles * ceil_div(weight_rows, 256) >= waves_target ? 256 : 128;
    return {GemmKernel::kSm90, block_m, block_n};
  }
  int block_m = 16;
  for (int rows : {64, 32, 16}) {
    if (p.block_size % rows == 0) { block_m = rows; break; }
  }
  const int64_t m_tiles = p.max_num_blocks * (p.block_size / block_m);
  const int block_n = m_tiles * ceil_div(weight_rows, 128) >= waves_target ? 128 : 64;
  return {GemmKernel::kSm80, block_m, block_n};
}

// A tensor map over `base`: 16-bit with the 128-byte swizzle wgmma reads, or bytes
// unswizzled (packed weights); out-of-range elements arrive as zeros. `what` names the
// tensor in the error.
void encode_tensor_map(CUtensorMap* map, DType dtype, const void* base, cuuint32_t rank, const cuuint64_t* dims,
                       const cuuint64_t* byte_strides, const cuuint32_t* box, const char* what) {
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const bool bytes = dtype == DType::kUInt8;
  const CUresult status = tensor_map_encode_tiled()(
      map,
      bytes                         ? CU_TENSOR_MAP_DATA_TYPE_UINT8
      : dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                  : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      rank, const_cast<void*>(base), dims, byte_strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      bytes ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS) {
    throw Error(std::string("moelora.fused_moe: cuTensorMapEncodeTiled failed for the ") + what +
                " tensor (CUresult " + std::to_string(int(status)) + ")");
  }
}

}  // namespace

// The tensor-core kernels copy 16-byte chunks of K-contiguous rows (and the sm90 weight
// tensor map cannot describe an empty K).
bool fused_moe_tensor_core_loadable(const detail::GemmParams& p) {
  constexpr int64_t kElems = 8;  // 16 bytes of a 16-bit type
  return p.dtype != DType::kFloat32 && p.K > 0 && p.K % kElems == 0 && p.a_stride_k == 1 && p.w_stride_k == 1 &&
         p.a_stride_row % kElems == 0 && p.w_stride_n % kElems == 0 && p.w_stride_expert % kElems == 0 &&
         aligned16(p.a) && aligned16(p.w);
}

bool fused_moe_lora_expand_supported(const detail::GemmParams& p, int64_t rank, int num_slices,
                                     const detail::LoraSliceParams* slices) {
  constexpr int64_t kElems = 8;  // 16 bytes of a 16-bit type: t's and lora_b's chunks
  // Both tensor-core kernels take the expand's K steps; the tile must name one.
  const bool kernel = p.tile.kernel == GemmKernel::kSm80 ||
                      (p.tile.kernel == GemmKernel::kSm90 && sm90_kernels_available(current_device_info()));
  bool ok = kernel && fused_moe_tensor_core_loadable(p) && rank % kElems == 0 && (num_slices == 1 || num_slices == 2);
  for (int c = 0; c < num_slices; ++c) {
    ok = ok && aligned16(slices[c].lora_b) && slices[c].b_stride_lora % kElems == 0 &&
         slices[c].b_stride_expert % kElems == 0 && slices[c].b_stride_n % kElems == 0;
  }
  return ok;
}

namespace {

// The weight map of a call: w as [E][halves][rows][row_elements] (gated split: gate rows
// then up rows; gated interleaved: row pairs; ungated: one half of N rows). Dims
// innermost first, byte strides growing outward: split halves put the half outside the
// row; interleaved pairs (2j gate, 2j + 1 up) inside.
WeightTensorMap weight_tensor_map(const detail::GemmParams& p, DType dtype, const void* w, uint64_t row_elements,
                                  uint64_t row_bytes, uint64_t expert_bytes, cuuint32_t box_elements, int box_rows,
                                  const char* what) {
  const bool interleaved = p.gated && p.activation == detail::ActivationKind::kSwigluOai;
  const uint64_t rows = uint64_t(p.N), halves = p.gated ? 2 : 1;
  const cuuint64_t dims[4] = {row_elements, interleaved ? halves : rows, interleaved ? rows : halves,
                              cuuint64_t(p.num_experts)};
  const cuuint64_t strides[3] = {row_bytes, interleaved ? 2 * row_bytes : rows * row_bytes, expert_bytes};
  const cuuint32_t box[4] = {box_elements, interleaved ? 1u : cuuint32_t(box_rows),
                             interleaved ? cuuint32_t(box_rows) : 1u, 1};
  WeightTensorMap w_map{};
  encode_tensor_map(&w_map.map, dtype, w, 4, dims, strides, box, what);
  return w_map;
}

}  // namespace

WeightTensorMap make_weight_tensor_map(const detail::GemmParams& p, int box_rows) {
  const uint64_t elem = 2;  // bf16 / fp16
  return weight_tensor_map(p, p.dtype, p.w, uint64_t(p.K), uint64_t(p.w_stride_n) * elem,
                           uint64_t(p.w_stride_expert) * elem, 64, box_rows, "weight");
}

WeightTensorMap make_packed_weight_tensor_map(const detail::GemmParams& p, int box_rows) {
  const detail::WeightOnlyParams& q = p.weight_only;
  return weight_tensor_map(p, DType::kUInt8, q.w, uint64_t(p.K * q.bits / 8), uint64_t(q.w_stride_n),
                           uint64_t(q.w_stride_expert), cuuint32_t(64 * q.bits / 8), box_rows, "packed weight");
}

ActivationTensorMap make_activation_tensor_map(const detail::GemmParams& p, int box_rows) {
  const uint64_t elem = 2;  // bf16 / fp16
  const cuuint64_t dims[2] = {cuuint64_t(p.K), cuuint64_t(std::max<int64_t>(p.num_rows, 1))};
  const cuuint64_t strides[1] = {uint64_t(p.a_stride_row) * elem};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)};
  ActivationTensorMap a_map{};
  encode_tensor_map(&a_map.map, p.dtype, p.a, 2, dims, strides, box, "activation");
  return a_map;
}

bool fused_moe_weight_only_loadable(const detail::GemmParams& p) {
  const detail::WeightOnlyParams& q = p.weight_only;
  constexpr int64_t kElems = 8;  // 16 bytes of a 16-bit type
  return q.enabled && sm90_kernels_available(current_device_info()) && p.dtype != DType::kFloat32 && p.K > 0 &&
         p.K % 32 == 0 && p.a_stride_k == 1 && p.a_stride_row % kElems == 0 && aligned16(p.a) &&
         (q.bits == 4 || q.bits == 8) && q.w_stride_n % 16 == 0 && q.w_stride_expert % 16 == 0 && aligned16(q.w);
}

bool quant_element_supported(DType element) {
  const DeviceInfo& device = current_device_info();
  const int cc = device.cc_major * 10 + device.cc_minor;
  return element == DType::kInt8 ? cc >= 80 : element == DType::kFloat8E4M3 && cc >= 89;
}

bool fused_moe_w8a8_loadable(const detail::GemmParams& p) {
  constexpr int64_t kElems = 16;  // 16 bytes of an 8-bit type
  return p.K > 0 && p.K % kElems == 0 && p.a_stride_k == 1 && p.w_stride_k == 1 && p.a_stride_row % kElems == 0 &&
         p.w_stride_n % kElems == 0 && p.w_stride_expert % kElems == 0 && aligned16(p.a) && aligned16(p.w) &&
         (p.quant.w_scales != ScaleGranularity::kBlock || p.quant.block_k == 128);
}

namespace {

// The W8A8 GEMM: the largest tile rows the block size allows (64, or 32 with block
// scales), else 16.
void fused_moe_w8a8(const detail::GemmParams& p, cudaStream_t stream) {
  if (!quant_element_supported(p.quant.element)) {
    const DeviceInfo& device = current_device_info();
    throw Error(std::string("moelora.fused_moe: ") + dtype_name(p.quant.element) +
                " experts need tensor cores for that type (fp8: sm_89 or newer; int8: sm_80 or newer); this device is sm_" +
                std::to_string(device.cc_major) + std::to_string(device.cc_minor));
  }
  if (!fused_moe_w8a8_loadable(p)) {
    throw Error("moelora.fused_moe: the CUDA W8A8 kernels need K a multiple of 16, unit K strides, 16-byte aligned "
                "rows, and block_k 128 for block scales; got K " + std::to_string(p.K) + ", block_k " +
                std::to_string(p.quant.block_k));
  }
  const int block_m = p.tile.block_m == 16 ? 16 : p.block_size % 64 == 0 ? 64 : p.block_size % 32 == 0 ? 32 : 16;
  if (p.quant.element == DType::kInt8) {
    fused_moe_w8a8_int8(p, block_m, stream);
  } else {
    fused_moe_w8a8_fp8(p, block_m, stream);
  }
}

// Weight-only experts: the sm90 kernel converting the packed experts (the tile's
// kernel must be kSm90 or kAuto; 1-CTA clusters).
void fused_moe_weight_only(const detail::GemmParams& p, cudaStream_t stream) {
  if (!fused_moe_weight_only_loadable(p)) {
    throw std::logic_error("moelora.fused_moe: the weight-only GEMM needs an sm_90 device with sm_90a kernels, K a "
                           "multiple of 32, unit K strides and 16-byte aligned rows");
  }
  if (p.tile.kernel != GemmKernel::kAuto && p.tile.kernel != GemmKernel::kSm90) {
    throw std::logic_error("moelora.fused_moe: the weight-only GEMM runs on the sm90 kernel only");
  }
  const GemmTile tile = p.tile.kernel == GemmKernel::kSm90 ? p.tile : heuristic_tile(p, current_device_info(), true);
  const bool bf16 = p.dtype == DType::kBFloat16;
  if (p.weight_only.bits == 4) {
    bf16 ? fused_moe_sm90_weight_only_bf16_w4(p, tile.block_m, tile.block_n, stream)
         : fused_moe_sm90_weight_only_fp16_w4(p, tile.block_m, tile.block_n, stream);
  } else {
    bf16 ? fused_moe_sm90_weight_only_bf16_w8(p, tile.block_m, tile.block_n, stream)
         : fused_moe_sm90_weight_only_fp16_w8(p, tile.block_m, tile.block_n, stream);
  }
}

}  // namespace

void fused_moe(const detail::GemmParams& p, Stream stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.max_num_blocks == 0 || p.N == 0 || p.num_slots == 0) return;
  if (p.quant.enabled) {
    if (p.a_rows_sorted || p.out_rows_sorted || p.lora_t != nullptr) {
      throw std::logic_error("moelora.fused_moe: the W8A8 kernels take neither sorted rows nor the fused LoRA expand");
    }
    fused_moe_w8a8(p, s);
    return;
  }
  const bool sorted_rows = p.a_rows_sorted || p.out_rows_sorted;
  if (p.weight_only.enabled) {
    fused_moe_weight_only(p, s);
    return;
  }
  const bool loadable = fused_moe_tensor_core_loadable(p);
  if ((sorted_rows || p.lora_t != nullptr) && !loadable) {
    throw std::logic_error("moelora.fused_moe: sorted A or output rows and the fused LoRA expand need a tensor-core kernel");
  }
  if (!loadable) {
    dispatch_float(p.dtype, [&](auto t) { launch_fused_moe_simt<decltype(t)>(p, s); });
    return;
  }
  const DeviceInfo& device = current_device_info();
  const bool sm90 = sm90_kernels_available(device);
  const GemmTile tile = p.tile.kernel == GemmKernel::kAuto ? heuristic_tile(p, device, sm90) : p.tile;
  const bool bf16 = p.dtype == DType::kBFloat16;
  if (sorted_rows && tile.kernel != GemmKernel::kSm90) {
    throw std::logic_error("moelora.fused_moe: sorted A or output rows need the sm90 kernel");
  }
  if (tile.kernel == GemmKernel::kSm90) {
    if (!sm90) {
      throw Error("moelora.fused_moe: the sm90 (wgmma) tile needs an sm_90 device and a build with sm_90a kernels; "
                  "this device is sm_" + std::to_string(device.cc_major) + std::to_string(device.cc_minor));
    }
    if (tile.block_m == 128) {
      bf16 ? fused_moe_sm90_bf16_m128(p, tile.block_n, tile.cluster_m, s)
           : fused_moe_sm90_fp16_m128(p, tile.block_n, tile.cluster_m, s);
    } else {
      bf16 ? fused_moe_sm90_bf16_m64(p, tile.block_n, tile.cluster_m, s)
           : fused_moe_sm90_fp16_m64(p, tile.block_n, tile.cluster_m, s);
    }
    return;
  }
  bf16 ? fused_moe_sm80_bf16(p, tile.block_m, tile.block_n, s) : fused_moe_sm80_fp16(p, tile.block_m, tile.block_n, s);
}

}  // namespace moelora::cuda
