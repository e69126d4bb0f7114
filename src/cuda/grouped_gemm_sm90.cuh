// The sm_90a grouped GEMM (GroupedGemmRun), W8A8 or 16-bit, on CUTLASS 4.2's ptr-array TMA
// warp-specialized collectives. Read docs/CUTLASS_GROUPED_FP8.md first: which collective
// serves which scheme, the scale layouts, and the hazards (PDL off, NDEBUG, no host
// problem shapes, so no per-group alignment checks: fused_experts checks them).
//
// Three tile shapes (GroupedGemmTiles, a template parameter: one instance per TU), K steps of
// 128 bytes (128 8-bit or 64 16-bit elements: one 128-byte swizzle row):
//   kCooperative128: 128 x 128 tiles, both consumer warp groups on one tile, the
//     epilogue after the tile's mainloop.
//   kCooperative128x256 (16-bit operands only): 128 x 256, the same schedule, each warp
//     group 64 x 256 (128 fp32 accumulators a thread); a K step's operands are 48 KB.
//   kPingpong64: 64 x 128 tiles, each consumer warp group on its own tile, so one's
//     epilogue runs under the other's mainloop (short K, where the epilogue is a large share
//     of a tile), and half the padding for groups of few rows.
// Two scalings:
//   kBlockwise: fp8 with 1x128 activation groups and 128x128 weight blocks, applied in the
//     mainloop (FP8Blockwise), both scale tensors K-major (our layouts; no transpose).
//   kEpilogue: per-row or per-tensor activation scales times per-channel or per-expert
//     weight scales, applied to the fp32 (int32 for int8) accumulators in the epilogue:
//     D = a_scale(row) · (w_scale(col) · acc), each a vector or a scalar per group at run time.
//   kNone: 16-bit operands (the layer's type), D = acc rounded.
// NOTE: one instance per TU: each costs ~1 min and ~4 GB of nvcc.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <atomic>
#include <stdexcept>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/grouped_gemm_sm90.h"

namespace moelora::cuda::grouped_sm90 {

using namespace cute;

enum class Scaling { kBlockwise, kEpilogue, kNone };

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using LayoutA = cutlass::layout::RowMajor;     // activation rows [M, K]
using LayoutB = cutlass::layout::ColumnMajor;  // expert weights [N, K], K contiguous
using LayoutD = cutlass::layout::RowMajor;     // [M, N]
// NOTE: 1x2 clusters: the pair shares each A tile over two N tiles. The doc's probe
// compiled the 128-row cooperative tiles with no spills for all three collectives.
template <GroupedGemmTiles kTiles, int kTileK>
using TileShapeOf = std::conditional_t<
    kTiles == GroupedGemmTiles::kPingpong64, Shape<_64, _128, Int<kTileK>>,
    std::conditional_t<kTiles == GroupedGemmTiles::kCooperative128x256, Shape<_128, _256, Int<kTileK>>,
                       Shape<_128, _128, Int<kTileK>>>>;
using ClusterShape = Shape<_1, _2, _1>;
constexpr int kAlignmentD = 8;  // 16 bytes of bf16 / fp16

// Epilogue of kEpilogue: a_scale (column broadcast: one per row, or a scalar) times
// (w_scale (row broadcast: one per column, or a scalar) times the accumulator). float*
// element types make both broadcasts read one pointer per group; the bool strides pick
// vector or scalar at run time.
template <class ElementOut, class Tile>
using ScaledEpilogue = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, ElementOut, float, cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90ColBroadcast<0, Tile, float*, float, Stride<bool, _0, _0>, 1>,
    cutlass::epilogue::fusion::Sm90EVT<
        cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float, cutlass::FloatRoundStyle::round_to_nearest>,
        cutlass::epilogue::fusion::Sm90RowBroadcast<0, Tile, float*, float, Stride<_0, bool, _0>, 1>,
        cutlass::epilogue::fusion::Sm90AccFetch>>;

// The mainloop schedule of (tiles, scaling). fp8 takes the promoting mainloops (a second
// fp32 accumulator every 128 K), not FastAccum: measured on H100 (docs/PERF_NOTES.md, issue
// 28 step 5), FastAccum made fp8_channel 2-5% faster at M >= 4096 but its rel_err reached
// 1.6-2.2e-2 at K = 2880 (the issue's gate: 1e-2).
template <GroupedGemmTiles kTiles, Scaling kScaling>
using MainloopScheduleOf = std::conditional_t<
    kTiles == GroupedGemmTiles::kPingpong64,
    std::conditional_t<kScaling == Scaling::kBlockwise, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong>,
    std::conditional_t<kScaling == Scaling::kBlockwise, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>>;

template <class ElementIn, class ElementOut, Scaling kScaling, GroupedGemmTiles kTiles>
struct GroupedGemm {
  static constexpr bool kInt8 = std::is_same_v<ElementIn, int8_t>;
  static_assert(!(kInt8 && kScaling == Scaling::kBlockwise), "CUTLASS has no int8 blockwise mainloop");
  static_assert((kScaling == Scaling::kNone) == (sizeof(ElementIn) == 2), "16-bit operands are unscaled");
  static_assert(kTiles != GroupedGemmTiles::kCooperative128x256 || kScaling == Scaling::kNone,
                "128 x 256 tiles: 16-bit operands only");
  using ElementAccumulator = std::conditional_t<kInt8, int32_t, float>;
  // TMA: 16-byte rows; a K step of 128 bytes (one 128-byte swizzle row).
  static constexpr int kAlignmentAB = 16 / int(sizeof(ElementIn));
  using TileShape = TileShapeOf<kTiles, 128 / int(sizeof(ElementIn))>;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, GMMA::Major::K, GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using MainloopSchedule = MainloopScheduleOf<kTiles, kScaling>;
  using EpilogueSchedule = std::conditional_t<kTiles == GroupedGemmTiles::kPingpong64,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using Fusion = std::conditional_t<kScaling == Scaling::kEpilogue, ScaledEpilogue<ElementOut, TileShape>,
                                    cutlass::epilogue::fusion::LinearCombination<ElementOut, float>>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, float, void, LayoutD*, kAlignmentD,
      ElementOut, LayoutD*, kAlignmentD, EpilogueSchedule, Fusion>::CollectiveOp;
  using LayoutATag = std::conditional_t<kScaling == Scaling::kBlockwise, cute::tuple<LayoutA*, LayoutSFA*>, LayoutA*>;
  using LayoutBTag = std::conditional_t<kScaling == Scaling::kBlockwise, cute::tuple<LayoutB*, LayoutSFB*>, LayoutB*>;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, LayoutATag, kAlignmentAB, ElementIn, LayoutBTag,
      kAlignmentAB, ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  // GroupedGemmRun's arrays are written by a kernel that knows no CUTLASS type: one int64
  // row stride per operand and group, three int32 per problem shape.
  static_assert(sizeof(StrideA) == sizeof(int64_t) && sizeof(StrideB) == sizeof(int64_t) &&
                sizeof(StrideD) == sizeof(int64_t), "ptr-array strides are one int64 (the row stride)");
  static_assert(sizeof(typename ProblemShape::UnderlyingProblemShape) == 3 * sizeof(int32_t));
};

// operands, out: the instance's name parts, for its errors (composed only there).
template <class ElementIn, class ElementOut, Scaling kScaling, GroupedGemmTiles kTiles>
void run_grouped_gemm(const GroupedGemmRun& r, cudaStream_t stream, const char* operands, const char* out) {
  using G = GroupedGemm<ElementIn, ElementOut, kScaling, kTiles>;
  auto name = [&] {
    return std::string("grouped_gemm_sm90_") + operands + "_" + out +
           (kTiles == GroupedGemmTiles::kPingpong64           ? "_m64"
            : kTiles == GroupedGemmTiles::kCooperative128x256 ? "_m128n256"
                                                              : "_m128");
  };
  using Gemm = typename G::Gemm;
  const DeviceInfo& device = current_device_info();
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device.ordinal;
  hw_info.sm_count = device.num_sms;  // set here: CUTLASS would query the device on every call
  auto problems = reinterpret_cast<typename ProblemShape::UnderlyingProblemShape*>(const_cast<int32_t*>(r.problem_shapes));
  typename Gemm::Arguments args;
  if constexpr (kScaling == Scaling::kBlockwise) {
    // The per-group scale layouts follow from the problem shapes inside the mainloop; the
    // layout arrays are not read.
    args = typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {r.num_groups, problems, nullptr},
        {reinterpret_cast<const ElementIn**>(const_cast<const void**>(r.a)),
         reinterpret_cast<typename G::Kernel::StrideA>(const_cast<int64_t*>(r.stride_a)),
         reinterpret_cast<const ElementIn**>(const_cast<const void**>(r.b)),
         reinterpret_cast<typename G::Kernel::StrideB>(const_cast<int64_t*>(r.stride_b)), const_cast<const float**>(r.a_scales), nullptr,
         const_cast<const float**>(r.w_scales), nullptr},
        {{}, nullptr, nullptr, reinterpret_cast<ElementOut**>(const_cast<void**>(r.d)),
         reinterpret_cast<typename G::Kernel::StrideD>(const_cast<int64_t*>(r.stride_d))},
        hw_info};
    args.epilogue.thread.alpha = 1.f;
    args.epilogue.thread.beta = 0.f;
  } else {
    args = typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {r.num_groups, problems, nullptr},
        {reinterpret_cast<const ElementIn**>(const_cast<const void**>(r.a)),
         reinterpret_cast<typename G::Kernel::StrideA>(const_cast<int64_t*>(r.stride_a)),
         reinterpret_cast<const ElementIn**>(const_cast<const void**>(r.b)),
         reinterpret_cast<typename G::Kernel::StrideB>(const_cast<int64_t*>(r.stride_b))},
        {{}, nullptr, nullptr, reinterpret_cast<ElementOut**>(const_cast<void**>(r.d)),
         reinterpret_cast<typename G::Kernel::StrideD>(const_cast<int64_t*>(r.stride_d))},
        hw_info};
    if constexpr (kScaling == Scaling::kNone) {  // 16-bit operands: D = acc
      args.epilogue.thread.alpha = 1.f;
      args.epilogue.thread.beta = 0.f;
    } else {
      args.epilogue.thread = {
          {r.a_scales, 0.f, {r.a_scale_per_row, _0{}, _0{}}},
          {{r.w_scales, 0.f, {_0{}, r.w_scale_per_col, _0{}}}, {}, {}},
          {}};
    }
  }
  const size_t workspace_bytes = Gemm::get_workspace_size(args);
  if (int64_t(workspace_bytes) > r.workspace_bytes) {
    throw std::logic_error(std::string("moelora.") + name() + ": CUTLASS asks for " + std::to_string(workspace_bytes) +
                           " workspace bytes, " + std::to_string(r.workspace_bytes) + " reserved");
  }
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status == cutlass::Status::kSuccess) status = gemm.initialize(args, r.workspace, stream);
  // NOTE: launched without PDL: the ptr-array kernels never wait on griddepcontrol, so
  // they must start after the kernels that wrote their arrays have finished.
  if (status == cutlass::Status::kSuccess) status = gemm.run(stream, nullptr, /*launch_with_pdl=*/false);
  if (status != cutlass::Status::kSuccess) {
    throw std::runtime_error(std::string("moelora.") + name() + ": CUTLASS failed: " + cutlassGetStatusString(status));
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::cuda::grouped_sm90

namespace moelora::cuda {

template <GroupedGemmOperands kOperands, DType kOut, GroupedGemmTiles kTiles>
void grouped_gemm_sm90(const GroupedGemmRun& r, cudaStream_t stream) {
  static_assert(kOut == DType::kBFloat16 || kOut == DType::kFloat16, "bf16 or fp16 output");
  using ElementOut = std::conditional_t<kOut == DType::kBFloat16, cutlass::bfloat16_t, cutlass::half_t>;
  using ElementIn = std::conditional_t<kOperands == GroupedGemmOperands::k16Bit, ElementOut,
                                       std::conditional_t<kOperands == GroupedGemmOperands::kInt8Scaled, int8_t,
                                                          cutlass::float_e4m3_t>>;
  constexpr grouped_sm90::Scaling kScaling = kOperands == GroupedGemmOperands::kFp8Blockwise ? grouped_sm90::Scaling::kBlockwise
                                             : kOperands == GroupedGemmOperands::k16Bit      ? grouped_sm90::Scaling::kNone
                                                                                             : grouped_sm90::Scaling::kEpilogue;
  constexpr const char* kOperandsName = kOperands == GroupedGemmOperands::kFp8Blockwise ? "fp8_blockwise"
                                        : kOperands == GroupedGemmOperands::kFp8Scaled  ? "fp8_scaled"
                                        : kOperands == GroupedGemmOperands::kInt8Scaled ? "int8_scaled"
                                                                                        : "16bit";
  grouped_sm90::run_grouped_gemm<ElementIn, ElementOut, kScaling, kTiles>(r, stream, kOperandsName,
                                                                          kOut == DType::kBFloat16 ? "bf16" : "fp16");
}

}  // namespace moelora::cuda
