// CUDA quantize: fp32 scales per block of block_rows x block_cols elements, 8-bit
// elements = round(x / scale). See include/moelora/quant.h for the contract.
//
// A team of threads (a warp, or the whole CTA for segments over 1024 elements: the
// per-token scales of a 7168-wide row) owns a segment: one row of one block column.
//   block_rows == 1 (per token group, per token): one launch; the team reduces its
//     segment's absmax, writes the scale and the elements.
//   block_rows > 1 (per tensor, weight blocks): the teams of a block meet in its scale:
//     zero the scales, atomicMax each segment's absmax into them (non-negative floats
//     order like their bits), write the elements from the absmax, then turn every absmax
//     into its scale. Four short launches, no host synchronisation.
// Static scales skip the reductions. Every division is IEEE (no fast math), so the
// elements match the CPU backend bit for bit.
#include <algorithm>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/launch.cuh"
#include "cuda/numeric.cuh"
#include "cuda/quantize.cuh"

namespace moelora::cuda {
namespace {

using detail::QuantizeParams;

constexpr int kThreads = 256;

enum class Pass : int { kRows, kAbsmax, kFromAbsmax, kStatic };

// One team per segment (b, row, col block); segments are numbered row-major over
// (b, row, cb). A CTA of 256 threads holds 256 / kTeam teams.
template <class In, class Out, int kTeam, Pass kPass>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const QuantizeParams p) {
  wait_for_previous_kernel();
  const int64_t col_blocks = (p.cols + p.block_cols - 1) / p.block_cols;
  const int64_t num_segments = p.batch * p.rows * col_blocks;
  const int team_lane = int(threadIdx.x) % kTeam;
  constexpr int kTeamsPerCta = kThreads / kTeam;
  const In* input = static_cast<const In*>(p.input);
  Out* out = static_cast<Out*>(p.out);
  // NOTE: the loop bound is uniform over a CTA-wide team (kTeam 256), so every thread
  // reaches team_max's barriers.
  for (int64_t segment = int64_t(blockIdx.x) * kTeamsPerCta + int(threadIdx.x) / kTeam; segment < num_segments;
       segment += int64_t(gridDim.x) * kTeamsPerCta) {
    const int64_t cb = segment % col_blocks, row_index = segment / col_blocks;
    const int64_t b = row_index / p.rows, row = row_index % p.rows;
    const int64_t col_begin = cb * p.block_cols, col_end = min(p.cols, col_begin + p.block_cols);
    const In* x = input + b * p.input_stride_batch + row * p.input_stride_row;
    float* scale_ptr = p.scales + b * p.scales_stride_batch + (row / p.block_rows) * p.scales_stride_row +
                       cb * p.scales_stride_col;
    float scale;
    if constexpr (kPass == Pass::kRows || kPass == Pass::kAbsmax) {
      float absmax = 0.f;
      for (int64_t c = col_begin + team_lane; c < col_end; c += kTeam) absmax = fmaxf(absmax, fabsf(to_float(x[c])));
      absmax = team_max<kTeam>(absmax);
      if constexpr (kPass == Pass::kAbsmax) {
        if (team_lane == 0) atomicMax(reinterpret_cast<int*>(scale_ptr), __float_as_int(absmax));
        continue;
      }
      scale = scale_of(absmax, kQmax<Out>);
      if (team_lane == 0) *scale_ptr = scale;
    } else if constexpr (kPass == Pass::kFromAbsmax) {
      scale = scale_of(*scale_ptr, kQmax<Out>);
    } else {
      scale = *scale_ptr;
    }
    Out* y = out + b * p.out_stride_batch + row * p.out_stride_row;
    for (int64_t c = col_begin + team_lane; c < col_end; c += kTeam) y[c] = quantize_element<Out>(to_float(x[c]), scale);
  }
  allow_next_kernel_launch();
}

// Scales of the block path: set to 0 before the absmax pass, or absmax -> scale after it.
template <bool kFinalize>
__global__ void __launch_bounds__(kThreads) block_scales_kernel(const QuantizeParams p, float qmax) {
  wait_for_previous_kernel();
  const int64_t row_blocks = (p.rows + p.block_rows - 1) / p.block_rows;
  const int64_t col_blocks = (p.cols + p.block_cols - 1) / p.block_cols;
  const int64_t n = p.batch * row_blocks * col_blocks;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
    const int64_t cb = i % col_blocks, rb = (i / col_blocks) % row_blocks, b = i / (col_blocks * row_blocks);
    float* s = p.scales + b * p.scales_stride_batch + rb * p.scales_stride_row + cb * p.scales_stride_col;
    *s = kFinalize ? scale_of(*s, qmax) : 0.f;
  }
  allow_next_kernel_launch();
}

unsigned grid_for(int64_t items, int64_t per_cta) {
  return unsigned(std::clamp<int64_t>((items + per_cta - 1) / per_cta, 1, int64_t(1) << 20));
}

template <class In, class Out, int kTeam>
void launch_quantize(const QuantizeParams& p, cudaStream_t stream) {
  const int64_t segments = p.batch * p.rows * ((p.cols + p.block_cols - 1) / p.block_cols);
  const dim3 grid(grid_for(segments, kThreads / kTeam)), block(kThreads);
  if (p.static_scales) {
    launch_kernel(quantize_kernel<In, Out, kTeam, Pass::kStatic>, grid, block, 0, stream, p);
  } else if (p.block_rows == 1) {
    launch_kernel(quantize_kernel<In, Out, kTeam, Pass::kRows>, grid, block, 0, stream, p);
  } else {
    const int64_t num_scales = p.batch * ((p.rows + p.block_rows - 1) / p.block_rows) *
                               ((p.cols + p.block_cols - 1) / p.block_cols);
    const dim3 scale_grid(grid_for(num_scales, kThreads));
    launch_kernel(block_scales_kernel<false>, scale_grid, block, 0, stream, p, kQmax<Out>);
    launch_kernel(quantize_kernel<In, Out, kTeam, Pass::kAbsmax>, grid, block, 0, stream, p);
    launch_kernel(quantize_kernel<In, Out, kTeam, Pass::kFromAbsmax>, grid, block, 0, stream, p);
    launch_kernel(block_scales_kernel<true>, scale_grid, block, 0, stream, p, kQmax<Out>);
  }
}

template <class In, class Out>
void dispatch_team(const QuantizeParams& p, cudaStream_t stream) {
  // NOTE: a warp per segment up to 1024 elements (32 a lane); beyond, the CTA, so a
  // per-token row of a decode batch is not left to one warp.
  if (std::min(p.block_cols, p.cols) > 1024) {
    launch_quantize<In, Out, kThreads>(p, stream);
  } else {
    launch_quantize<In, Out, 32>(p, stream);
  }
}

}  // namespace

void quantize(const QuantizeParams& p, Stream stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.batch * p.rows * p.cols == 0) return;
  dispatch_float(p.input_dtype, [&](auto t) {
    using In = decltype(t);
    if (p.out_dtype == DType::kInt8) {
      dispatch_team<In, int8_t>(p, s);
    } else {
      dispatch_team<In, uint8_t>(p, s);
    }
  });
}

}  // namespace moelora::cuda
