// fused_experts on weight-only experts (w4a16 / w8a16, issue 30): the small-batch
// kernels on packed weights (the dot products: small_batch_weight_only.cuh), and the
// dequantization of whole experts for the chunks past them.
//
// The kernels are the small-batch path's (fused_experts_small_batch.cuh): the same slot
// tables built from topk_ids, GEMM1 over units of (routed expert, 8 columns) whose 16
// MMA rows are the 8 gate and the 8 up rows, GEMM2 over (routed expert, 16 rows of H)
// with each slot's products left in shared memory for the top-k sum in slot order; warps
// in teams that split K when there are fewer items than warps (MmaTeams). x and act stay
// in the layer dtype.
#include <type_traits>

#include "cuda/fused_experts_small_batch.cuh"
#include "cuda/small_batch_weight_only.cuh"

namespace moelora::cuda {

namespace small_batch {

namespace {

template <class T, int kBits, bool kScaleAfter, ActivationKind kAct>
__global__ void __launch_bounds__(kThreads, 2) weight_only_gemm1_kernel(const SmallBatchMoeParams p) {
  __shared__ SlotTables t;
  __shared__ float red[kMmaReduceFloats];
  // This kernel may be the layer's first, after a kernel that wrote topk_ids: the tables
  // after the wait (with late_delta_wait, the delta kernels before it have waited).
  if (!(p.late_delta_wait && p.gate_up_delta)) wait_for_previous_kernel();
  allow_next_kernel_launch();  // one wave: GEMM2's CTAs may take the SM slots these free
  build_slot_tables(p, t);
  const T* x = static_cast<const T*>(p.x);
  const int I = int(p.I), H = int(p.H), top_k = int(p.top_k);
  const int g = int(threadIdx.x) % 32 / 4;
  const bool interleaved = kAct == ActivationKind::kSwigluOai;
  const int column_groups = I / 8;
  const int num_units = t.num_distinct * column_groups;  // < 2^31: at most 128 experts x I / 8
  const MmaTeams teams(num_units, int(gridDim.x), weight_only_steps<kBits>(H), 1);
  for (int unit = int(blockIdx.x) * teams.count + teams.team; unit < num_units; unit += int(gridDim.x) * teams.count) {
    const int d = unit / column_groups, j = (unit - d * column_groups) * 8 + g;
    const int64_t expert = t.distinct_expert[d];
    const int64_t gate_row = interleaved ? 2 * j : j, up_row = interleaved ? 2 * j + 1 : I + j;
    weight_only_item_passes<T, kBits, kScaleAfter>(
        p.w13q, expert, gate_row, up_row, t, d, x, p.x_stride_token, [&](int slot) { return slot / top_k; }, H, teams,
        red, [&](int slot, float gate, float up) { store_activation<T, kAct, false>(p, slot, j, gate, up, p.late_delta_wait); });
  }
  // CTA 0 waits on every path (a chunk with no local expert reads no delta): see
  // small_batch_gemm1.
  if (p.late_delta_wait && p.gate_up_delta && blockIdx.x == 0) wait_for_previous_kernel();
}

// kCtaThreads: kThreads, or 512 when H's 16-row blocks are no more than the SMs (as the
// W8A8 instances, launch_small_batch).
template <class T, int kBits, bool kScaleAfter, int kCtaThreads>
__global__ void __launch_bounds__(kCtaThreads, kCtaThreads > kThreads ? 1 : 2)
    weight_only_gemm2_kernel(const SmallBatchMoeParams p, int rows_per_cta) {
  constexpr int kCtaWarps = kCtaThreads / 32;
  __shared__ SlotTables t;
  __shared__ float partial[kMaxSlots][kGemm2MaxRows];  // [slot][row of the block]
  __shared__ float red[kMmaReduceFloatsFor<kCtaWarps>];
  // Before the wait: the tables read only the layer's inputs, and GEMM1 lets this grid
  // launch only after its own wait.
  build_slot_tables(p, t);
  if (!(p.late_delta_wait && p.down_delta)) wait_for_previous_kernel();
  const T* act = static_cast<const T*>(p.act);
  const int H = int(p.H), I = int(p.I);
  const int g = int(threadIdx.x) % 32 / 4;
  const int row_groups = rows_per_cta / 16;
  const MmaTeams<kCtaWarps> teams(t.num_distinct * row_groups, 1, weight_only_steps<kBits>(I), 1);
  for (int h0 = int(blockIdx.x) * rows_per_cta; h0 < H; h0 += int(gridDim.x) * rows_per_cta) {
    const int items = t.num_distinct * row_groups;
    for (int item = teams.team; item < items; item += teams.count) {
      const int d = item / row_groups, row0 = (item - d * row_groups) * 16;
      // Rows past H (the last block) repeat row H - 1; their sums are never read.
      const int h_lo = min(h0 + row0 + g, H - 1), h_hi = min(h0 + row0 + g + 8, H - 1);
      weight_only_item_passes<T, kBits, kScaleAfter>(
          p.w2q, t.distinct_expert[d], h_lo, h_hi, t, d, act, int64_t(I), [](int slot) { return slot; }, I, teams, red,
          [&](int slot, float product_lo, float product_hi) {
            // LoRA: the slot's delta joins before the routed weight.
            if (p.late_delta_wait && p.down_delta) wait_for_previous_kernel();
            const T* delta = p.down_delta ? static_cast<const T*>(p.down_delta) + int64_t(slot) * H : nullptr;
            partial[slot][row0 + g] = product_lo + (delta ? to_float(delta[h_lo]) : 0.f);
            partial[slot][row0 + g + 8] = product_hi + (delta ? to_float(delta[h_hi]) : 0.f);
          });
    }
    __syncthreads();
    write_gemm2_rows<T, kCtaThreads>(p, t, partial, h0, min(rows_per_cta, H - h0));
    __syncthreads();  // partial is rewritten by the next block
  }
  if (p.late_delta_wait && p.down_delta && blockIdx.x == 0) wait_for_previous_kernel();  // see small_batch_gemm2
  allow_next_kernel_launch();
}

template <class T, int kBits, bool kScaleAfter, ActivationKind kAct>
void launch_weight_only(const SmallBatchMoeParams& p, cudaStream_t stream, int stages) {
  if (stages & 1) {
    constexpr auto gemm1 = weight_only_gemm1_kernel<T, kBits, kScaleAfter, kAct>;
    launch_kernel(gemm1, dim3(unsigned(resident_ctas<gemm1>())), dim3(kThreads), 0, stream, p);
  }
  if (!(stages & 2)) return;
  // NOTE: as the W8A8 instances: CTAs of 16 warps where H's 16-row blocks do not fill
  // two CTAs an SM.
  if ((p.H + 15) / 16 <= int64_t(current_device_info().num_sms)) {
    launch_small_batch_gemm2<weight_only_gemm2_kernel<T, kBits, kScaleAfter, 2 * kThreads>, 16, 2 * kThreads>(p, stream);
  } else {
    launch_small_batch_gemm2<weight_only_gemm2_kernel<T, kBits, kScaleAfter, kThreads>, 16>(p, stream);
  }
}

// Scales after the MMAs where a step of K (128 4-bit or 64 8-bit weights) lies in one
// group of both GEMMs.
template <class T, int kBits>
void dispatch_weight_only(const SmallBatchMoeParams& p, cudaStream_t stream, int stages) {
  auto whole_steps = [](int64_t group) { return group == 0 || group % kWeightsPerStep<kBits> == 0; };
  const bool after = whole_steps(p.w13q.group_size) && whole_steps(p.w2q.group_size);
  auto launch = [&](auto act) {
    constexpr ActivationKind kAct = decltype(act)::value;
    after ? launch_weight_only<T, kBits, true, kAct>(p, stream, stages)
          : launch_weight_only<T, kBits, false, kAct>(p, stream, stages);
  };
  switch (p.activation) {
    case ActivationKind::kSiluAndMul: return launch(std::integral_constant<ActivationKind, ActivationKind::kSiluAndMul>{});
    case ActivationKind::kGeluAndMul: return launch(std::integral_constant<ActivationKind, ActivationKind::kGeluAndMul>{});
    case ActivationKind::kSwigluOai: return launch(std::integral_constant<ActivationKind, ActivationKind::kSwigluOai>{});
  }
}

}  // namespace

void launch_weight_only(const SmallBatchMoeParams& p, cudaStream_t stream, int stages) {
  const bool four = p.w13q.bits == 4;
  if (p.dtype == DType::kBFloat16) {
    four ? dispatch_weight_only<__nv_bfloat16, 4>(p, stream, stages)
         : dispatch_weight_only<__nv_bfloat16, 8>(p, stream, stages);
  } else {
    four ? dispatch_weight_only<__half, 4>(p, stream, stages) : dispatch_weight_only<__half, 8>(p, stream, stages);
  }
}

// ---- the aligned path: the same dot products over moe_align_block_size's blocks ----
//
// A block holds kAlignedBlock entries of one expert (padding: sorted_token_ids >= slots):
// two n8 tiles of vectors, entries 0-7 and 8-15. A warp item is (column group or row
// group, block), one warp an item, items ordered group-major so that the warps running
// together share the group's weight rows across the blocks of an expert (L2 hits where an
// expert has several blocks).
// NOTE: measured against a CTA's 8 warps on one block and consecutive groups (the block's
// 16 vectors read once from L2, then L1 hits): 1.07-1.16x slower on Mixtral w4a16 at
// M = 32-64, no faster elsewhere (H200, issue 30 step 6). The vectors' L2 reads were not
// the bound.
constexpr int kAlignedBlock = 16;

// The lane's vector of each tile: the rows of entries g and 8 + g of `block` (padding:
// row 0 of a, whose product column is not stored), and their slots (-1 for padding).
template <class T, class RowOf>
__device__ __forceinline__ void block_vectors(const detail::WeightOnlyAlignedParams& p, int64_t block, const T* a,
                                              int64_t a_stride, RowOf row_of, const T* (&vec)[2], int (&slot)[2]) {
  const int g = int(threadIdx.x) % 32 / 4;
  const int num_slots = int(p.moe.num_tokens * p.moe.top_k);
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const int s = p.sorted_token_ids[block * kAlignedBlock + 8 * t + g];
    slot[t] = s >= 0 && s < num_slots ? s : -1;
    vec[t] = slot[t] >= 0 ? a + int64_t(row_of(slot[t])) * a_stride : a;
  }
}

// The slot of the lane's result column c of tile t (entry 8t + 2q + c), -1 for padding:
// from the lanes that loaded those entries (lane 4 (2q + c) holds entry 2q + c's slot).
__device__ __forceinline__ int result_slot(const int (&slot)[2], int t, int c) {
  const int quad = int(threadIdx.x) % 4;
  return __shfl_sync(0xffffffffu, slot[t], 4 * (2 * quad + c));
}

// A block's 16-row product over K: both n8 tiles, or only the first where entries 8-15
// are all padding (an expert's last block with at most 8 slots: most blocks of the
// small-expert models at M = 32-64). One tile converts the same weights for half the MMAs
// and vector loads, and takes two steps a round instead of one (the second tile's
// registers), so a warp has twice the weight bytes in flight: 0.72-0.85x the time of both
// tiles at M = 32-64 on the small-expert models (H200, docs/perf_notes issue 30 step 6).
// acc[1] is then zero.
template <class T, int kBits, bool kScaleAfter>
__device__ __forceinline__ void block_rows_product(const detail::WeightOnlyParams& q, int64_t expert, int64_t row_lo,
                                                   int64_t row_hi, const T* const (&vec)[2], const int (&slot)[2],
                                                   int K, float (&acc)[2][4]) {
  const int steps = weight_only_steps<kBits>(K);
  if (__any_sync(0xffffffffu, slot[1] >= 0)) {
    warp_weight_only_rows<T, kBits, kScaleAfter, 2>(q, expert, row_lo, row_hi, vec, K, 0, steps, acc);
    return;
  }
  const T* const first[1] = {vec[0]};
  float one[1][4];
  warp_weight_only_rows<T, kBits, kScaleAfter, 1>(q, expert, row_lo, row_hi, first, K, 0, steps, one);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[0][i] = one[0][i];
    acc[1][i] = 0.f;
  }
}

template <class T, int kBits, bool kScaleAfter, ActivationKind kAct>
__global__ void __launch_bounds__(kThreads, 2) weight_only_aligned_gemm1_kernel(const detail::WeightOnlyAlignedParams p) {
  wait_for_previous_kernel();
  const SmallBatchMoeParams& m = p.moe;
  const T* x = static_cast<const T*>(m.x);
  const int I = int(m.I), H = int(m.H), top_k = int(m.top_k);
  const int g = int(threadIdx.x) % 32 / 4;
  const bool interleaved = kAct == ActivationKind::kSwigluOai;
  const int64_t blocks =
      ::min(int64_t((*p.num_tokens_post_padded + kAlignedBlock - 1) / kAlignedBlock), p.max_num_blocks);
  const int64_t items = blocks * (I / 8);
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t item = int64_t(blockIdx.x) * kWarps + int(threadIdx.x) / 32; item < items; item += warps) {
    const int64_t block = item % blocks;
    const int j = int(item / blocks) * 8 + g;
    const int expert = p.expert_ids[block];
    if (expert < 0 || expert >= m.num_local_experts) continue;  // GEMM2 writes those slots' zeros
    const T* vec[2];
    int slot[2];
    block_vectors(p, block, x, m.x_stride_token, [&](int s) { return s / top_k; }, vec, slot);
    const int64_t gate_row = interleaved ? 2 * j : j, up_row = interleaved ? 2 * j + 1 : I + j;
    float acc[2][4];
    block_rows_product<T, kBits, kScaleAfter>(m.w13q, expert, gate_row, up_row, vec, slot, H, acc);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int s = result_slot(slot, t, c);
        if (s >= 0) store_activation<T, kAct, false>(m, s, j, acc[t][c], acc[t][2 + c], m.late_delta_wait);
      }
    }
  }
  allow_next_kernel_launch();
}

template <class T, int kBits, bool kScaleAfter>
__global__ void __launch_bounds__(kThreads, 2) weight_only_aligned_gemm2_kernel(const detail::WeightOnlyAlignedParams p) {
  wait_for_previous_kernel();
  const SmallBatchMoeParams& m = p.moe;
  const T* act = static_cast<const T*>(m.act);
  T* out = static_cast<T*>(p.down_out);
  const int H = int(m.H), I = int(m.I);
  const int lane = int(threadIdx.x) % 32, g = lane / 4;
  const int64_t blocks =
      ::min(int64_t((*p.num_tokens_post_padded + kAlignedBlock - 1) / kAlignedBlock), p.max_num_blocks);
  const int64_t items = blocks * ((H + 15) / 16);
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t item = int64_t(blockIdx.x) * kWarps + int(threadIdx.x) / 32; item < items; item += warps) {
    const int64_t block = item % blocks;
    const int h0 = int(item / blocks) * 16;
    const int expert = p.expert_ids[block];
    const T* vec[2];
    int slot[2];
    block_vectors(p, block, act, int64_t(I), [](int s) { return s; }, vec, slot);
    // Rows past H (the last group) repeat row H - 1; their sums are not stored.
    const int h_lo = min(h0 + g, H - 1), h_hi = min(h0 + g + 8, H - 1);
    float acc[2][4] = {};
    const bool has_expert = expert >= 0 && expert < m.num_local_experts;
    if (has_expert) {
      block_rows_product<T, kBits, kScaleAfter>(m.w2q, expert, h_lo, h_hi, vec, slot, I, acc);
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int s = result_slot(slot, t, c);
        if (s < 0) continue;
        T* row = out + int64_t(s) * p.down_out_stride_slot;
        const T* delta = m.down_delta ? static_cast<const T*>(m.down_delta) + int64_t(s) * p.down_out_stride_slot
                                      : nullptr;
        const float w = m.router_weight_on_input ? 1.f : routed_weight(m, s);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int h = h0 + g + 8 * half;
          if (h >= H) continue;
          // LoRA: the slot's delta joins before the routed weight (read, then written, here).
          const float value = acc[t][2 * half + c] + (delta && has_expert ? to_float(delta[h]) : 0.f);
          row[h] = from_float<T>(has_expert ? w * value : 0.f);
        }
      }
    }
  }
  allow_next_kernel_launch();
}

template <class T, int kBits, bool kScaleAfter, ActivationKind kAct>
void launch_weight_only_aligned(const detail::WeightOnlyAlignedParams& p, cudaStream_t stream, int stage) {
  // NOTE: a persistent grid of what the device holds at once: the item count lives on the
  // device (the alignment's padded entries), never read by the host.
  if (stage == 1) {
    constexpr auto gemm1 = weight_only_aligned_gemm1_kernel<T, kBits, kScaleAfter, kAct>;
    launch_kernel(gemm1, dim3(unsigned(resident_ctas<gemm1>())), dim3(kThreads), 0, stream, p);
  } else {
    constexpr auto gemm2 = weight_only_aligned_gemm2_kernel<T, kBits, kScaleAfter>;
    launch_kernel(gemm2, dim3(unsigned(resident_ctas<gemm2>())), dim3(kThreads), 0, stream, p);
  }
}

template <class T, int kBits>
void dispatch_weight_only_aligned(const detail::WeightOnlyAlignedParams& p, cudaStream_t stream, int stage) {
  const SmallBatchMoeParams& m = p.moe;
  auto whole_steps = [](int64_t group) { return group == 0 || group % kWeightsPerStep<kBits> == 0; };
  const bool after = whole_steps(m.w13q.group_size) && whole_steps(m.w2q.group_size);
  auto launch = [&](auto act) {
    constexpr ActivationKind kAct = decltype(act)::value;
    after ? launch_weight_only_aligned<T, kBits, true, kAct>(p, stream, stage)
          : launch_weight_only_aligned<T, kBits, false, kAct>(p, stream, stage);
  };
  switch (m.activation) {
    case ActivationKind::kSiluAndMul: return launch(std::integral_constant<ActivationKind, ActivationKind::kSiluAndMul>{});
    case ActivationKind::kGeluAndMul: return launch(std::integral_constant<ActivationKind, ActivationKind::kGeluAndMul>{});
    case ActivationKind::kSwigluOai: return launch(std::integral_constant<ActivationKind, ActivationKind::kSwigluOai>{});
  }
}

}  // namespace small_batch

void fused_experts_weight_only_aligned(const detail::WeightOnlyAlignedParams& p, Stream stream, int stage) {
  using namespace small_batch;
  const auto s = static_cast<cudaStream_t>(stream);
  const bool four = p.moe.w13q.bits == 4;
  if (p.moe.dtype == DType::kBFloat16) {
    four ? dispatch_weight_only_aligned<__nv_bfloat16, 4>(p, s, stage)
         : dispatch_weight_only_aligned<__nv_bfloat16, 8>(p, s, stage);
  } else {
    four ? dispatch_weight_only_aligned<__half, 4>(p, s, stage) : dispatch_weight_only_aligned<__half, 8>(p, s, stage);
  }
}

namespace {

// Units of 8 weights of a row (4 packed bytes of 4-bit, 8 of 8-bit; within one scale group
// as K % 32 == 0, the API's CUDA check) into their 16 output bytes, thread i taking unit i,
// so a warp's loads and its stores each cover one contiguous run (128 / 256 packed bytes,
// 512 output bytes). Measured on an H200 against a thread a 16-byte packed chunk (64 output
// bytes as four 16-byte stores 64 bytes apart across the warp, each store writing half of
// 32 sectors): Mixtral w4a16 M = 4096 8366 -> 7607 us, OLMoE M = 8192 2777 -> 2514 us
// (docs/perf_notes/issue-30-weight-only.md, step 8). kDequantizeUnroll units a thread are
// loaded (weights and codes) before any is converted. 32-bit index math: launch_dequantize
// checks that every index a thread forms stays below 2^32.
constexpr int kDequantizeUnroll = 4;

template <int kBits>
using PackedUnit = std::conditional_t<kBits == 4, uint32_t, uint2>;  // 8 weights

// A unit's 8 weights, scaled, as 16 output bytes in K order.
template <class T, int kBits>
__device__ __forceinline__ uint4 convert_unit(PackedUnit<kBits> packed, const weight_only::GroupConstants<T>& c) {
  uint32_t values[4];  // pairs in K order
  if constexpr (kBits == 4) {
    uint32_t pairs[4];
    weight_only::weight_pairs<T, 4, true>(packed, c, pairs);
    weight_only::natural_order(pairs, values);
  } else {
    uint32_t low[4], high[4];
    weight_only::weight_pairs<T, 8, true>(packed.x, c, low);
    weight_only::weight_pairs<T, 8, true>(packed.y, c, high);
    values[0] = low[0], values[1] = low[1], values[2] = high[0], values[3] = high[1];
  }
  return make_uint4(values[0], values[1], values[2], values[3]);
}

template <class T, int kBits>
__global__ void __launch_bounds__(256) dequantize_experts_kernel(const detail::DequantizeExpertsParams p) {
  using Packed = PackedUnit<kBits>;
  wait_for_previous_kernel();
  const detail::WeightOnlyParams& q = p.w;
  const uint32_t units_per_row = uint32_t(p.K / 8), N = uint32_t(p.N);
  const uint32_t units = uint32_t(p.num_experts * p.N) * units_per_row;
  const uint32_t stride = gridDim.x * blockDim.x;
  const int group_shift = q.group_size > 0 ? __ffs(int(q.group_size)) - 1 : 31;  // group sizes: 32, 64, 128
  uint4* out = static_cast<uint4*>(p.out);  // unit i's 16 bytes are out[i]
  for (uint32_t first = blockIdx.x * blockDim.x + threadIdx.x; first < units; first += kDequantizeUnroll * stride) {
    Packed packed[kDequantizeUnroll];
    weight_only::WeightRowCodes<T, kBits> rows[kDequantizeUnroll];
    weight_only::GroupCodes<T> codes[kDequantizeUnroll];
#pragma unroll
    for (int u = 0; u < kDequantizeUnroll; ++u) {
      const uint32_t i = first + u * stride;
      if (i >= units) break;
      const uint32_t row = i / units_per_row, unit = i - row * units_per_row;
      const uint32_t e = row / N, n = row - e * N;
      packed[u] = __ldcs(reinterpret_cast<const Packed*>(q.w + e * q.w_stride_expert + n * q.w_stride_n) + unit);
      rows[u].start(q, e, n);
      codes[u] = rows[u].load(q.group_size > 0 ? int((unit * 8) >> group_shift) : 0);
    }
#pragma unroll
    for (int u = 0; u < kDequantizeUnroll; ++u) {
      const uint32_t i = first + u * stride;
      if (i >= units) break;
      out[i] = convert_unit<T, kBits>(packed[u], rows[u].constants(codes[u]));
    }
  }
  allow_next_kernel_launch();
}

template <class T>
void launch_dequantize(const detail::DequantizeExpertsParams& p, cudaStream_t stream) {
  const int64_t units = p.num_experts * p.N * p.K / 8;
  const int64_t blocks = std::min<int64_t>((units + 255) / 256, int64_t(current_device_info().num_sms) * 8);
  if (blocks == 0) return;
  // A thread's last index is below units + kDequantizeUnroll x the grid's threads.
  if (units + int64_t(kDequantizeUnroll) * blocks * 256 >= (int64_t(1) << 32)) {
    throw Error("moelora.fused_experts: experts too large for the dense weight-only path");
  }
  if (p.w.bits == 4) {
    launch_kernel(dequantize_experts_kernel<T, 4>, dim3(unsigned(blocks)), dim3(256), 0, stream, p);
  } else {
    launch_kernel(dequantize_experts_kernel<T, 8>, dim3(unsigned(blocks)), dim3(256), 0, stream, p);
  }
}

}  // namespace

void dequantize_experts(const detail::DequantizeExpertsParams& p, Stream stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::kBFloat16) {
    launch_dequantize<__nv_bfloat16>(p, s);
  } else {
    launch_dequantize<__half>(p, s);
  }
}

}  // namespace moelora::cuda
