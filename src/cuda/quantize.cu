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
#include <climits>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/launch.cuh"
#include "cuda/numeric.cuh"
#include "cuda/quantize.cuh"

namespace moelora::cuda {
namespace {

using detail::QuantizeParams;

constexpr int kThreads = 256;

enum class Pass : int { kRows, kAbsmax, kFromAbsmax, kStatic };

// kVec elements of one chunk: 16 bytes of input (8 bf16/fp16, 4 fp32) or a single element.
template <class In, class Out, int kVec>
struct QuantChunk {
  In in[kVec];
  __device__ __forceinline__ void load(const In* x) {
    if constexpr (kVec > 1) {
      *reinterpret_cast<Vec16<In>*>(in) = *reinterpret_cast<const Vec16<In>*>(x);
    } else {
      in[0] = x[0];
    }
  }
  __device__ __forceinline__ float absmax() const {
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) m = fmaxf(m, fabsf(to_float(in[i])));
    return m;
  }
  __device__ __forceinline__ void store(Out* y, float scale) const {
    struct alignas(kVec) Packed {
      Out v[kVec];
    } q;
#pragma unroll
    for (int i = 0; i < kVec; ++i) q.v[i] = quantize_element<Out>(to_float(in[i]), scale);
    *reinterpret_cast<Packed*>(y) = q;
  }
};

// Where segment s (numbered row-major over (b, row, col block)) lies.
// NOTE: 32-bit divisions, and none where a dimension is 1 (a 64-bit division is a
// subroutine, and there were five a segment); measured 37 -> 35 us for Qwen3-30B's x at
// M = 4096 (ncu, H100): the rest was occupancy (quantize_kernel).
struct SegmentIndex {
  int64_t b, row, row_block, cb;
};
__device__ __forceinline__ SegmentIndex segment_index(const QuantizeParams& p, int64_t segment, int64_t col_blocks) {
  SegmentIndex at;
  int64_t row_index;
  if (segment <= INT32_MAX && col_blocks <= INT32_MAX) {
    const uint32_t s = uint32_t(segment), blocks = uint32_t(col_blocks);
    const uint32_t r = blocks == 1 ? s : s / blocks;
    row_index = r;
    at.cb = s - r * blocks;
  } else {
    row_index = segment / col_blocks;
    at.cb = segment - row_index * col_blocks;
  }
  at.b = 0;
  at.row = row_index;
  if (p.batch > 1) {
    at.b = row_index <= INT32_MAX && p.rows <= INT32_MAX ? int64_t(uint32_t(row_index) / uint32_t(p.rows))
                                                         : row_index / p.rows;
    at.row = row_index - at.b * p.rows;
  }
  at.row_block = p.block_rows == 1 ? at.row
                 : at.row <= INT32_MAX && p.block_rows <= INT32_MAX ? int64_t(uint32_t(at.row) / uint32_t(p.block_rows))
                                                                    : at.row / p.block_rows;
  return at;
}

// One team per segment (b, row, col block); segments are numbered row-major over
// (b, row, cb). A CTA of 256 threads holds 256 / kTeam teams. kVec: elements a thread
// loads at once (16 bytes; the launcher checks alignment and widths, else 1). A thread's
// first kKeep chunks of its segment stay in registers between the absmax and the writes;
// longer segments are read again (L1/L2 hits).
// NOTE: with scalar 2-byte loads and 1-byte stores this kernel took 4-5x its bytes' time
// at large M (38 us for Qwen3-30B's x at M = 4096; 248 us at DeepSeek-V3's M = 8192; ncu,
// H100). Then, with one 16-byte chunk a thread (teams of 16 for a 128-column group, the
// CTA for a per-token row), it ran at 0.8-1.2 TB/s (DeepSeek-V3 fp8_block M = 8192:
// 144 us; Qwen3-30B per-token M = 8192: 66 us): too few bytes in flight an SM. Now a
// team is sized so that each thread loads up to kKeep chunks before their first use.
// one_wave: the grid is resident at once (no later waves to take SM slots from), so the
// next kernel may launch as soon as this one has waited: its CTAs then do their prologue
// and park while this one runs (decode: x's or act's few rows before a small-batch GEMM).
// NOTE: teams of 16 (decode grids) keep one chunk a thread at three CTAs an SM, the
// kernel that served decode before the larger teams; the others keep kKeep at two CTAs an
// SM (16-bit input: 88-95 registers, no spills; fp32 input spilled 8-16 bytes at that
// bound and takes one: its chunks are 4 elements, not the layer's hot path).
constexpr int kKeep = 4;
template <int kTeam>
constexpr int kKeepOf = kTeam == 16 ? 1 : kKeep;
template <class In, class Out, int kTeam, int kVec, Pass kPass>
__global__ void __launch_bounds__(kThreads, kTeam == 16 ? 3 : std::is_same_v<In, float> ? 1 : 2)
    quantize_kernel(const QuantizeParams p, bool one_wave) {
  constexpr int kKept = kKeepOf<kTeam>;  // chunks a thread keeps
  wait_for_previous_kernel();
  if (one_wave) allow_next_kernel_launch();
  const int64_t col_blocks = (p.cols + p.block_cols - 1) / p.block_cols;
  const int64_t num_segments = p.batch * p.rows * col_blocks;
  const int team_lane = int(threadIdx.x) % kTeam;
  constexpr int kTeamsPerCta = kThreads / kTeam;
  const In* input = static_cast<const In*>(p.input);
  Out* out = static_cast<Out*>(p.out);
  // NOTE: the loop is uniform over the CTA (a team past the last segment idles through
  // it), so every thread reaches team_max's shuffles and barriers.
  for (int64_t first = int64_t(blockIdx.x) * kTeamsPerCta; first < num_segments;
       first += int64_t(gridDim.x) * kTeamsPerCta) {
    const int64_t segment = first + int(threadIdx.x) / kTeam;
    const bool active = segment < num_segments;
    const SegmentIndex at = segment_index(p, segment, col_blocks);
    const int64_t col_begin = at.cb * p.block_cols;
    const int64_t col_end = active ? min(p.cols, col_begin + p.block_cols) : col_begin;
    const In* x = input + at.b * p.input_stride_batch + at.row * p.input_stride_row;
    float* scale_ptr = p.scales + at.b * p.scales_stride_batch + at.row_block * p.scales_stride_row +
                       at.cb * p.scales_stride_col;
    QuantChunk<In, Out, kVec> keep[kKept];
    auto col_of = [&](int i) { return col_begin + (int64_t(i) * kTeam + team_lane) * kVec; };
    float scale = 0.f;
    if constexpr (kPass != Pass::kStatic && kPass != Pass::kFromAbsmax) {
      float absmax = 0.f;
      // The absmax pass alone keeps nothing: its writes come in the next launch.
      constexpr int kLoaded = kPass == Pass::kAbsmax ? 0 : kKept;
#pragma unroll
      for (int i = 0; i < kLoaded; ++i) {
        if (col_of(i) < col_end) {
          keep[i].load(x + col_of(i));
          absmax = fmaxf(absmax, keep[i].absmax());
        }
      }
      for (int64_t c = col_of(kLoaded); c < col_end; c += kTeam * kVec) {
        QuantChunk<In, Out, kVec> chunk;
        chunk.load(x + c);
        absmax = fmaxf(absmax, chunk.absmax());
      }
      absmax = team_max<kTeam>(absmax);
      if constexpr (kPass == Pass::kAbsmax) {
        if (active && team_lane == 0) atomicMax(reinterpret_cast<int*>(scale_ptr), __float_as_int(absmax));
        continue;
      }
      scale = scale_of(absmax, kQmax<Out>);
      if (active && team_lane == 0) *scale_ptr = scale;
    } else {
      if (!active) continue;
      scale = kPass == Pass::kFromAbsmax ? scale_of(*scale_ptr, kQmax<Out>) : *scale_ptr;
#pragma unroll
      for (int i = 0; i < kKept; ++i) {
        if (col_of(i) < col_end) keep[i].load(x + col_of(i));
      }
    }
    Out* y = out + at.b * p.out_stride_batch + at.row * p.out_stride_row;
#pragma unroll
    for (int i = 0; i < kKept; ++i) {
      if (col_of(i) < col_end) keep[i].store(y + col_of(i), scale);
    }
    for (int64_t c = col_of(kKept); c < col_end; c += kTeam * kVec) {
      QuantChunk<In, Out, kVec> chunk;
      chunk.load(x + c);
      chunk.store(y + c, scale);
    }
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

template <class In, class Out, int kTeam, int kVec>
void launch_quantize(const QuantizeParams& p, cudaStream_t stream) {
  const int64_t segments = p.batch * p.rows * ((p.cols + p.block_cols - 1) / p.block_cols);
  const dim3 grid(grid_for(segments, kThreads / kTeam)), block(kThreads);
  const bool one_wave = int64_t(grid.x) <= int64_t(current_device_info().num_sms);
  if (p.static_scales) {
    launch_kernel(quantize_kernel<In, Out, kTeam, kVec, Pass::kStatic>, grid, block, 0, stream, p, one_wave);
  } else if (p.block_rows == 1) {
    launch_kernel(quantize_kernel<In, Out, kTeam, kVec, Pass::kRows>, grid, block, 0, stream, p, one_wave);
  } else {
    const int64_t num_scales = p.batch * ((p.rows + p.block_rows - 1) / p.block_rows) *
                               ((p.cols + p.block_cols - 1) / p.block_cols);
    const dim3 scale_grid(grid_for(num_scales, kThreads));
    launch_kernel(block_scales_kernel<false>, scale_grid, block, 0, stream, p, kQmax<Out>);
    launch_kernel(quantize_kernel<In, Out, kTeam, kVec, Pass::kAbsmax>, grid, block, 0, stream, p, one_wave);
    launch_kernel(quantize_kernel<In, Out, kTeam, kVec, Pass::kFromAbsmax>, grid, block, 0, stream, p, one_wave);
    launch_kernel(block_scales_kernel<true>, scale_grid, block, 0, stream, p, kQmax<Out>);
  }
}

// Whether every segment splits into 16-byte input chunks that start aligned, with their
// kVec-byte outputs aligned too.
template <class In>
bool chunks_aligned(const QuantizeParams& p) {
  constexpr int64_t kVec = Vec16<In>::kSize;
  const int64_t segment_cols = std::min(p.block_cols, p.cols);
  return p.cols % kVec == 0 && (segment_cols == p.cols || p.block_cols % kVec == 0) && aligned16(p.input) &&
         (p.batch == 1 || (p.input_stride_batch % kVec == 0 && p.out_stride_batch % kVec == 0)) &&
         (p.rows == 1 || (p.input_stride_row % kVec == 0 && p.out_stride_row % kVec == 0)) &&
         reinterpret_cast<uintptr_t>(p.out) % kVec == 0;
}

template <class In, class Out>
void dispatch_team(const QuantizeParams& p, cudaStream_t stream) {
  // Threads a segment needs: kKeep chunks a thread before re-reads. A team of 4 for a
  // 128-column group (4 chunks a thread), a warp up to 1024 columns, half the CTA up to
  // 4096, beyond that the CTA. NOTE: a decode batch's few groups take teams of 16 (one
  // chunk a thread, four times the threads on the few rows): with teams of 4 the fp8_block
  // layer at M = 1 was 4-7% slower (H100, docs/PERF_NOTES.md issue 28 step 5).
  const int64_t segment_cols = std::min(p.block_cols, p.cols);
  if (chunks_aligned<In>(p)) {
    constexpr int kVec = Vec16<In>::kSize;
    if (segment_cols <= 4 * kKeep * kVec) {
      const int64_t segments = p.batch * p.rows * ((p.cols + p.block_cols - 1) / p.block_cols);
      if (segments * 16 <= int64_t(current_device_info().num_sms) * kThreads) {
        return launch_quantize<In, Out, 16, kVec>(p, stream);
      }
      return launch_quantize<In, Out, 4, kVec>(p, stream);
    }
    if (segment_cols <= 32 * kKeep * kVec) return launch_quantize<In, Out, 32, kVec>(p, stream);
    if (segment_cols <= 128 * kKeep * kVec) return launch_quantize<In, Out, 128, kVec>(p, stream);
    return launch_quantize<In, Out, kThreads, kVec>(p, stream);
  }
  if (segment_cols > 1024) return launch_quantize<In, Out, kThreads, 1>(p, stream);
  launch_quantize<In, Out, 32, 1>(p, stream);
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
