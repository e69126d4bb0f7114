// fused_experts' small-batch path (MoeKernelConfig::small_batch): two kernels straight
// from topk_ids, for chunks of at most kSmallBatchMaxSlots slots (kSmallBatchMaxSlots8Bit
// with 8-bit experts). The kernels and their launchers; fused_experts_small_batch{,_fp8,
// _int8}.cu instantiate them.
//
// At a few tokens the layer is a stream of the routed experts' weights (Qwen3-30B at
// M = 1: 8 experts, 75 MB, 25 us at the copy rate), and the aligned path's fixed costs
// weigh on it: the alignment launch (6-7 us at M = 1 on H100), tiles padded to 16 rows
// for one slot, GEMM2's [slots, H] round trip and the reduce launch. Here:
//   GEMM1 (+ activation): one warp per unit (routed expert, output column j) takes the
//     gate and up rows of j against the hidden row of every slot on that expert. The
//     units are spread over every warp the device holds at once, so any expert count
//     and intermediate size balance to within one unit per warp.
//   GEMM2 (+ the top-k sum): one CTA per block of output rows h. Its warps take (expert,
//     4 rows) items and leave each slot's dot products in shared memory; then every
//     token's sum over its slots, in slot order (deterministic, no atomics).
// Both kernels first build the same slot tables in shared memory: the local expert of
// each slot (-1: dropped, out of range or not on this rank), the distinct experts in
// order of first occurrence, and the slots of each. A weight row is read once per
// kSlotsPerPass slots of its expert: once at decode, where experts rarely repeat.
// Weights stream through L2 only (ld.global.nc.L1::no_allocate); hidden rows and
// activations go through L1, where every warp working on one expert finds them.
// W8A8 (issue 28, quant13.enabled): the same two kernels and slot tables on 8-bit
// operands, x and act already quantized by the caller, with the dot products on
// m16n8k32 MMAs over items of 16 weight rows (warp_mma_rows, MmaTeams:
// small_batch_mma.cuh); block scales fold each K block's products (a 64-byte MMA step
// never straddles a block: block_k % 64 == 0), channel and tensor scales the finished sums.
#pragma once

#include <algorithm>
#include <atomic>
#include <climits>
#include <string>

#include <cuda_fp8.h>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/gated_activation.cuh"
#include "cuda/launch.cuh"
#include "cuda/numeric.cuh"
#include "cuda/small_batch_mma.cuh"
#include "cuda/small_batch_slots.cuh"

namespace moelora::cuda::small_batch {

using detail::ActivationKind;
using detail::SmallBatchMoeParams;

constexpr int kSlotsPerPass = 4;   // slots of one expert multiplied per pass over its weight rows (GEMM2's 16-row items: 2)
constexpr int kChunkBytes = 16;  // one 16-byte load a lane
// 16-byte loads in flight per lane: GEMM1 2 rows x 4 (x 8 spilled once the input
// vector's chunks were batched too, under the 128-register cap); GEMM2 4 rows x 4, or 16 rows x 1
// when I <= 512 (a row of I = 256 is one chunk a lane: 4-row items left 2 KB in flight
// per warp, and DeepSeek's M = 2 ran slower than the aligned path). NOTE: ~64 KB in
// flight per SM (GEMM1: two CTAs of 8 warps; GEMM2: one), above the ~25 KB that HBM
// latency x the per-SM share of the copy rate asks for.
constexpr int kUnrollGemm1 = 4;
constexpr int kGemm2MaxRows = 64;  // output rows of one GEMM2 CTA

// The 8 elements of a 16-byte chunk of a 16-bit operand type E, converted to fp32 (the
// vector's chunk once, reused against every row).
template <class E>
struct Chunk {
  using Vec = float[8];
  static __device__ __forceinline__ void load(const uint4& v, Vec& f) {
    const Vec16<E>& chunk = reinterpret_cast<const Vec16<E>&>(v);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = to_float(chunk.v[i]);
  }
};

// acc[r][v] = rows[r][0, K) · vecs[v][0, K) for v < num_vecs, in every lane of the warp
// (16-bit operands). Lane l takes the 16-byte chunks l, l + 32, ...; kUnroll chunks of
// every row are loaded before the first is used. K a multiple of a chunk; rows and vecs
// 16-byte aligned.
template <class T, int kRows, int kUnroll, int kVecs>
__device__ __forceinline__ void warp_dot(const T* const (&rows)[kRows], const T* const (&vecs)[kVecs], int num_vecs,
                                         int K, float (&acc)[kRows][kVecs]) {
  constexpr int kWarpChunk = 32 * 8;
  const int lane = int(threadIdx.x) % 32;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) acc[r][v] = 0.f;
  }
  for (int k0 = lane * 8; k0 < K; k0 += kWarpChunk * kUnroll) {
    uint4 w[kRows][kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = k0 + u * kWarpChunk;
#pragma unroll
      for (int r = 0; r < kRows; ++r) w[r][u] = k < K ? load_streaming(rows[r] + k) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      if (v >= num_vecs) break;
      // NOTE: all of the vector's chunks in flight before the first use. A load next to
      // each use (with a break at K) left them serialised in the SASS, one L1/L2 round
      // trip per chunk, and the kernels streamed at 36-57% of peak (ncu, H100, M = 1).
      uint4 xv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int k = k0 + u * kWarpChunk;
        xv[u] = k < K ? *reinterpret_cast<const uint4*>(vecs[v] + k) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        typename Chunk<T>::Vec x;
        Chunk<T>::load(xv[u], x);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          // NOTE: a single FMA chain per (r, v), as measured (docs/PERF_NOTES.md, issue 3 step 5).
          float wf[8];
          Chunk<T>::load(w[r][u], wf);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r][v] = fmaf(wf[i], x[i], acc[r][v]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) acc[r][v] += __shfl_xor_sync(0xffffffffu, acc[r][v], offset);
    }
  }
}

// acc[r][lane]: the value of slot `lane` of a pass (lane < kVecs), without register
// indexing.
template <int kRows, int kVecs>
__device__ __forceinline__ float lane_value(const float (&acc)[kRows][kVecs], int r, int lane) {
  float value = 0.f;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) value = lane == v ? acc[r][v] : value;
  return value;
}

__device__ __forceinline__ float routed_weight(const SmallBatchMoeParams& p, int slot) {
  const int token = slot / int(p.top_k), j = slot - token * int(p.top_k);
  return p.topk_weights[token * p.topk_weights_stride_token + j * p.topk_weights_stride_k];
}

// GEMM1's value of (slot, column j) into act: the activation of gate and up (GEMM1's
// products), the LoRA deltas and the routed weight on the input joined first.
// late_wait: the delta is read after this kernel's wait (SmallBatchMoeParams::late_delta_wait;
// a constant where the caller has it as a template parameter).
template <class T, ActivationKind kAct, bool kQuant>
__device__ __forceinline__ void store_activation(const SmallBatchMoeParams& p, int slot, int j, float gate, float up,
                                                 bool late_wait) {
  const int I = int(p.I);
  const bool interleaved = kAct == ActivationKind::kSwigluOai;
  const float w_in = p.router_weight_on_input ? routed_weight(p, slot) : 1.f;
  float gate_delta = 0.f, up_delta = 0.f;
  if (p.gate_up_delta) {  // LoRA: in w13's row order, before the weight and the activation
    if (late_wait) wait_for_previous_kernel();
    const T* delta = static_cast<const T*>(p.gate_up_delta) + int64_t(slot) * 2 * I;
    gate_delta = to_float(delta[interleaved ? 2 * j : j]);
    up_delta = to_float(delta[interleaved ? 2 * j + 1 : I + j]);
  }
  if constexpr (kQuant) {
    // W8A8: GEMM1's output rounded to T, then its sum with the delta, as on the
    // aligned paths (a T tensor between GEMM1 and the activation).
    gate = to_float(from_float<T>(to_float(from_float<T>(gate * w_in)) + gate_delta * w_in));
    up = to_float(from_float<T>(to_float(from_float<T>(up * w_in)) + up_delta * w_in));
  } else {
    gate = (gate + gate_delta) * w_in;
    up = (up + up_delta) * w_in;
  }
  static_cast<T*>(p.act)[int64_t(slot) * I + j] = from_float<T>(gated_activation<kAct>(gate, up, p.alpha, p.limit));
}

// GEMM1 + activation: act[s][j] = act(x[s / top_k] · gate_j, x[s / top_k] · up_j) for
// every slot s with a local expert (× its routed weight before the activation when
// router_weight_on_input). Rows of the other slots are not written; GEMM2 skips them.
// 16-bit operands (E = T).
template <class T, ActivationKind kAct, bool kLateWait>
__device__ __forceinline__ void small_batch_gemm1(const SmallBatchMoeParams& p, const SlotTables& t) {
  const T* x = static_cast<const T*>(p.x);
  const T* w13 = static_cast<const T*>(p.w13);
  const int I = int(p.I), H = int(p.H), top_k = int(p.top_k);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t num_units = int64_t(t.num_distinct) * I;
  // Neighbouring warps take neighbouring columns of one expert: adjacent weight rows.
  for (int64_t unit = int64_t(blockIdx.x) * kWarps + warp; unit < num_units; unit += int64_t(gridDim.x) * kWarps) {
    const int d = int(unit / I), j = int(unit - int64_t(d) * I);
    const T* w = w13 + t.distinct_expert[d] * p.w13_stride_expert;
    // gate and up rows of column j: halves, or interleaved pairs (gpt-oss)
    const bool interleaved = kAct == ActivationKind::kSwigluOai;
    const T* const rows[2] = {w + (interleaved ? 2 * j : j) * p.w13_stride_n,
                              w + (interleaved ? 2 * j + 1 : I + j) * p.w13_stride_n};
    const int end = t.group_begin[d + 1];
    for (int g = t.group_begin[d]; g < end; g += kSlotsPerPass) {
      const int n = min(kSlotsPerPass, end - g);
      const T* vecs[kSlotsPerPass];
#pragma unroll
      for (int v = 0; v < kSlotsPerPass; ++v) vecs[v] = x + (t.sorted_slot[g + min(v, n - 1)] / top_k) * p.x_stride_token;
      float acc[2][kSlotsPerPass];
      warp_dot<T, 2, kUnrollGemm1, kSlotsPerPass>(rows, vecs, n, H, acc);
      if (lane < n) {
        store_activation<T, kAct, false>(p, t.sorted_slot[g + lane], j, lane_value(acc, 0, lane),
                                         lane_value(acc, 1, lane), kLateWait);
      }
    }
  }
}

// GEMM1 + activation on 8-bit operands (W8A8: x and w13 quantized, quant13's scales). A
// warp unit is (expert, 8 columns): its 16 MMA rows are the 8 gate rows (g) and the 8 up
// rows (g + 8), so lane (g, q) ends with column j0 + g's gate and up for its vectors.
template <class T, class E, ActivationKind kAct>
__device__ __forceinline__ void small_batch_gemm1_w8a8(const SmallBatchMoeParams& p, const SlotTables& t) {
  const E* x = static_cast<const E*>(p.x);
  const E* w13 = static_cast<const E*>(p.w13);
  const int I = int(p.I), H = int(p.H), top_k = int(p.top_k);
  const int lane = int(threadIdx.x) % 32, g = lane / 4;
  // The caller quantizes every row of act (a per-tensor scale reads them all): the rows
  // of slots without a local expert get zeros, which move no absmax.
  // NOTE: a warp a slot, only where it has none (the loop over every element with a
  // division each kept CTA 0 busy for thousands of instructions a thread).
  if (blockIdx.x == 0) {
    T* act = static_cast<T*>(p.act);
    const int num_slots = int(p.num_tokens) * top_k;
    for (int slot = int(threadIdx.x) / 32; slot < num_slots; slot += kWarps) {
      if (t.expert[slot] >= 0) continue;
      for (int c = lane; c < I; c += 32) act[int64_t(slot) * I + c] = from_float<T>(0.f);
    }
  }
  const bool interleaved = kAct == ActivationKind::kSwigluOai;
  const int column_groups = I / 8;
  const int64_t num_units = int64_t(t.num_distinct) * column_groups;
  const int steps = (H + kMmaStep - 1) / kMmaStep;
  const MmaTeams teams(int(num_units), int(gridDim.x), steps, steps_per_block(p.quant13));
  __shared__ float red[kMmaReduceFloats];
  // num_units < 2^31 (at most 128 distinct experts times I / 8, I < 2^27: supported()):
  // 32-bit unit math.
  for (int unit = int(blockIdx.x) * teams.count + teams.team; unit < num_units; unit += int(gridDim.x) * teams.count) {
    const int d = unit / column_groups, j = (unit - d * column_groups) * 8 + g;
    const int64_t expert = t.distinct_expert[d];
    const int64_t gate_row = interleaved ? 2 * j : j, up_row = interleaved ? 2 * j + 1 : I + j;
    MmaRows<E> m;
    m.row_lo = w13 + expert * p.w13_stride_expert + gate_row * p.w13_stride_n;
    m.row_hi = w13 + expert * p.w13_stride_expert + up_row * p.w13_stride_n;
    m.w_scale[0] = weight_scales(p.quant13, expert, gate_row);
    m.w_scale[1] = weight_scales(p.quant13, expert, up_row);
    mma_item_passes(p.quant13, m, t, d, x, p.x_stride_token, [&](int slot) { return slot / top_k; }, H, steps, teams,
                    red, [&](int slot, float gate, float up) { store_activation<T, kAct, true>(p, slot, j, gate, up, false); });
  }
}

// kLateWait (SmallBatchMoeParams::late_delta_wait; 16-bit operands only): a template
// parameter, so that the base layer's instances compile as if it did not exist.
template <class T, class E, ActivationKind kAct, bool kLateWait>
__device__ __forceinline__ void small_batch_gemm1(const SmallBatchMoeParams& p) {
  static_assert(!kLateWait || std::is_same_v<T, E>, "the late delta wait is the 16-bit kernels'");
  __shared__ SlotTables t;
  // 8-bit operands: the tables before the wait, while x's quantization runs (it lets
  // this grid launch right after its own wait, so every kernel that wrote topk_ids and
  // expert_map, the layer's inputs, has completed). 16-bit: this kernel may be the
  // layer's first, after a kernel that gives no such promise.
  constexpr bool kTablesFirst = !std::is_same_v<T, E>;
  if constexpr (kTablesFirst) build_slot_tables(p, t);
  if (!(kLateWait && p.gate_up_delta)) wait_for_previous_kernel();
  // One wave (the grid is what the device holds at once): the GEMM2 CTAs may launch now
  // and take the SM slots these CTAs free.
  allow_next_kernel_launch();
  if constexpr (!kTablesFirst) build_slot_tables(p, t);
  if constexpr (std::is_same_v<T, E>) {
    small_batch_gemm1<T, kAct, kLateWait>(p, t);
  } else {
    small_batch_gemm1_w8a8<T, E, kAct>(p, t);
  }
  // A chunk with no local expert reads no delta: CTA 0 still waits, so this grid completes
  // after the delta kernels (GEMM2's delta kernels reuse their region and lora_t).
  if (kLateWait && p.gate_up_delta && blockIdx.x == 0) wait_for_previous_kernel();
}

// GEMM2's rows [h0, h0 + rows_here) of `out` from each slot's dot products (partial[slot]
// [row - h0], the LoRA delta joined): the routed weights and the top-k sum in slot order,
// or (no_combine) each slot's weighted row, zeros for the slots without a local expert.
template <class T, int kCtaThreads>
__device__ __forceinline__ void write_gemm2_rows(const SmallBatchMoeParams& p, const SlotTables& t,
                                                 const float (*partial)[kGemm2MaxRows], int h0, int rows_here) {
  T* out = static_cast<T*>(p.out);
  const int top_k = int(p.top_k), num_tokens = int(p.num_tokens), num_slots = num_tokens * top_k;
  if (p.no_combine) {
    for (int i = int(threadIdx.x); i < num_slots * rows_here; i += kCtaThreads) {
      const int slot = i / rows_here, r = i - slot * rows_here;
      const int token = slot / top_k, j = slot - token * top_k;
      const float w = p.router_weight_on_input ? 1.f : routed_weight(p, slot);
      const float value = t.expert[slot] >= 0 ? w * partial[slot][r] : 0.f;
      out[token * p.out_stride_token + j * p.out_stride_k + h0 + r] = from_float<T>(value);
    }
    return;
  }
  for (int i = int(threadIdx.x); i < num_tokens * rows_here; i += kCtaThreads) {
    const int token = i / rows_here, r = i - token * rows_here;
    float sum = 0.f;
    for (int j = 0; j < top_k; ++j) {
      const int slot = token * top_k + j;
      if (t.expert[slot] < 0) continue;
      sum += (p.router_weight_on_input ? 1.f : routed_weight(p, slot)) * partial[slot][r];
    }
    out[token * p.out_stride_token + h0 + r] = from_float<T>(p.routed_scaling_factor * sum);
  }
}

// GEMM2 + the top-k sum: out[m][h] = routed_scaling_factor × Σ_j w_mj × (act[m·top_k + j] ·
// w2[e_mj][h]) over the slots with a local expert (w_mj = 1 when router_weight_on_input);
// with no_combine out[m][j][h] = w_mj × (...), zeros for the other slots.
// kRowsPerItem x kUnroll: the rows a warp item takes and the chunks of each loaded before
// use. NOTE: one CTA per SM: at two, the 128-register cap spilled the 4 x 4 loads.
// E: as GEMM1's; W8A8 reads act_quantized (by slot) with quant2's scales, 16-row items on
// MMAs (warp_mma_rows: lane (g, q) holds rows g and g + 8 of the item).
// kCtaThreads: kThreads, or 512 for W8A8 when H's 16-row blocks are no more than the SMs
// (launch_small_batch).
template <class T, class E, int kRowsPerItem, int kUnroll, int kCtaThreads, bool kLateWait>
__device__ __forceinline__ void small_batch_gemm2(const SmallBatchMoeParams& p, int rows_per_cta) {
  static_assert(!kLateWait || std::is_same_v<T, E>, "the late delta wait is the 16-bit kernels'");
  constexpr bool kQuant = !std::is_same_v<T, E>;
  constexpr int kCtaWarps = kCtaThreads / 32;
  static_assert(kCtaThreads >= kMaxSlots, "one thread per slot builds the slot tables");
  static_assert(!kQuant || kRowsPerItem == 16, "W8A8 items are an MMA's 16 rows");
  // NOTE: 16-row items with 4 slots a pass spilled (64 accumulators).
  constexpr int kVecs = kRowsPerItem > 4 ? 2 : kSlotsPerPass;
  __shared__ SlotTables t;
  __shared__ float partial[kMaxSlots][kGemm2MaxRows];  // [slot][row of the block]: each slot's dot products
  // NOTE: before the wait: the tables read only the layer's inputs (topk_ids,
  // expert_map), and GEMM1 lets this grid launch only after its own wait, so every
  // kernel that wrote them has completed.
  build_slot_tables(p, t);
  if (!(kLateWait && p.down_delta)) wait_for_previous_kernel();
  const E* w2 = static_cast<const E*>(p.w2);
  const E* act = static_cast<const E*>(kQuant ? p.act_quantized : p.act);
  const int H = int(p.H), I = int(p.I);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int row_groups = rows_per_cta / kRowsPerItem;
  // W8A8: the CTA's items in teams that split K (one warp an item for 16-bit operands).
  const int steps = (I + kMmaStep - 1) / kMmaStep;
  const MmaTeams<kCtaWarps> teams(kQuant ? t.num_distinct * row_groups : kCtaWarps, 1, steps,
                                  kQuant ? steps_per_block(p.quant2) : 1);
  __shared__ float red[kQuant ? kMmaReduceFloatsFor<kCtaWarps> : 1];
  for (int h0 = int(blockIdx.x) * rows_per_cta; h0 < H; h0 += int(gridDim.x) * rows_per_cta) {
    const int items = t.num_distinct * row_groups;
    for (int item = kQuant ? teams.team : warp; item < items; item += kQuant ? teams.count : kCtaWarps) {
      const int d = item / row_groups, row0 = (item - d * row_groups) * kRowsPerItem;
      const int64_t expert = t.distinct_expert[d];
      const E* w = w2 + expert * p.w2_stride_expert;
      const int end = t.group_begin[d + 1];
      // Rows past H (the last block) repeat row H - 1; their sums are never read.
      if constexpr (kQuant) {
        const int g = lane / 4;
        const int h_lo = min(h0 + row0 + g, H - 1), h_hi = min(h0 + row0 + g + 8, H - 1);
        MmaRows<E> m;
        m.row_lo = w + int64_t(h_lo) * p.w2_stride_n;
        m.row_hi = w + int64_t(h_hi) * p.w2_stride_n;
        m.w_scale[0] = weight_scales(p.quant2, expert, h_lo);
        m.w_scale[1] = weight_scales(p.quant2, expert, h_hi);
        mma_item_passes(p.quant2, m, t, d, act, int64_t(I), [](int slot) { return slot; }, I, steps, teams, red,
                        [&](int slot, float product_lo, float product_hi) {
                          // LoRA: the slot's delta joins before the routed weight.
                          if (kLateWait && p.down_delta) wait_for_previous_kernel();
                          const T* delta =
                              p.down_delta ? static_cast<const T*>(p.down_delta) + int64_t(slot) * H : nullptr;
                          partial[slot][row0 + g] = product_lo + (delta ? to_float(delta[h_lo]) : 0.f);
                          partial[slot][row0 + g + 8] = product_hi + (delta ? to_float(delta[h_hi]) : 0.f);
                        });
      } else {
        const E* rows[kRowsPerItem];
#pragma unroll
        for (int r = 0; r < kRowsPerItem; ++r) rows[r] = w + int64_t(min(h0 + row0 + r, H - 1)) * p.w2_stride_n;
        for (int g = t.group_begin[d]; g < end; g += kVecs) {
          const int n = min(kVecs, end - g);
          const E* vecs[kVecs];
#pragma unroll
          for (int v = 0; v < kVecs; ++v) vecs[v] = act + int64_t(t.sorted_slot[g + min(v, n - 1)]) * I;
          float acc[kRowsPerItem][kVecs];
          warp_dot<E, kRowsPerItem, kUnroll, kVecs>(rows, vecs, n, I, acc);
          if (lane < n) {
            const int slot = t.sorted_slot[g + lane];
            if (kLateWait && p.down_delta) wait_for_previous_kernel();
            const T* delta = p.down_delta ? static_cast<const T*>(p.down_delta) + int64_t(slot) * H : nullptr;
#pragma unroll
            for (int r = 0; r < kRowsPerItem; ++r) {
              partial[slot][row0 + r] =
                  lane_value(acc, r, lane) + (delta ? to_float(delta[min(h0 + row0 + r, H - 1)]) : 0.f);
            }
          }
        }
      }
    }
    __syncthreads();
    write_gemm2_rows<T, kCtaThreads>(p, t, partial, h0, min(rows_per_cta, H - h0));
    __syncthreads();  // partial is rewritten by the next block
  }
  // A chunk with no local expert reads no delta: CTA 0 still waits, so this grid completes
  // after the delta kernels (the next chunk's or layer's delta kernels reuse their region).
  if (kLateWait && p.down_delta && blockIdx.x == 0) wait_for_previous_kernel();
  allow_next_kernel_launch();
}

// fp8 operands run on sm_89+ only (the API refuses fp8 schemes below): the sm_80 build
// of their kernels is a trap, which also spares ptxas the software fp8 conversions
// (the sm_80 pass of these kernels ran past 8 minutes on a 16-core build machine).
template <class E>
__device__ constexpr bool operands_run_here() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  return !std::is_same_v<E, __nv_fp8_e4m3>;
#else
  return true;
#endif
}

// NOTE: two CTAs an SM (128 registers) for every operand type since the 8-bit dot
// products run on MMAs (the CUDA-core fp8 conversions spilled 576-916 B under this cap).
template <class T, class E, ActivationKind kAct, bool kLateWait = false>
__global__ void __launch_bounds__(kThreads, 2)
    small_batch_gemm1_kernel(const SmallBatchMoeParams p) {
  if constexpr (operands_run_here<E>()) {
    small_batch_gemm1<T, E, kAct, kLateWait>(p);
  } else {
    __trap();
  }
}

// NOTE: two CTAs an SM for 8-bit operands (MMAs: 123 registers), for twice the warps
// streaming rows at decode; one of 512 threads where H has too few 16-row blocks for
// two CTAs an SM (launch_small_batch).
template <class T, class E, int kRowsPerItem, int kUnroll, int kCtaThreads = kThreads, bool kLateWait = false>
__global__ void __launch_bounds__(kCtaThreads, std::is_same_v<T, E> || kCtaThreads > kThreads ? 1 : 2)
    small_batch_gemm2_kernel(const SmallBatchMoeParams p, int rows_per_cta) {
  if constexpr (operands_run_here<E>()) {
    small_batch_gemm2<T, E, kRowsPerItem, kUnroll, kCtaThreads, kLateWait>(p, rows_per_cta);
  } else {
    __trap();
  }
}

// CTAs of `kernel` the device holds at once (occupancy query, cached per device; one
// cache per kernel instance through the template).
template <auto kKernel, int kCtaThreads = kThreads>
int resident_ctas() {
  static std::atomic<int> cache[64] = {};
  return cached_per_device(cache, [](const DeviceInfo& device) {
    int per_sm = 0;
    MOELORA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kCtaThreads, 0));
    return std::max(1, per_sm) * device.num_sms;
  });
}

// GEMM2 in blocks of rows (a multiple of the item's rows, at most 64) so that one wave
// covers H.
template <auto kKernel, int kRowsPerItem, int kCtaThreads = kThreads>
void launch_small_batch_gemm2(const SmallBatchMoeParams& p, cudaStream_t stream) {
  const int64_t resident = resident_ctas<kKernel, kCtaThreads>();
  const int64_t rows = std::clamp<int64_t>((p.H + resident - 1) / resident, 1, kGemm2MaxRows);
  const int rows_per_cta = int((rows + kRowsPerItem - 1) / kRowsPerItem * kRowsPerItem);
  const int64_t ctas = std::min<int64_t>((p.H + rows_per_cta - 1) / rows_per_cta, resident);
  launch_kernel(kKernel, dim3(unsigned(ctas)), dim3(kCtaThreads), 0, stream, p, rows_per_cta);
}

template <class T, class E, ActivationKind kAct, bool kLateWait>
void launch_small_batch_kernels(const SmallBatchMoeParams& p, cudaStream_t stream, int stages) {
  constexpr auto gemm1 = small_batch_gemm1_kernel<T, E, kAct, kLateWait>;
  if (stages & 1) launch_kernel(gemm1, dim3(unsigned(resident_ctas<gemm1>())), dim3(kThreads), 0, stream, p);
  if (!(stages & 2)) return;
  // NOTE: I <= 512 is one 16-byte chunk a lane or less per row (bf16). 8-bit operands:
  // always the MMA's 16-row items.
  if constexpr (!std::is_same_v<T, E>) {
    // NOTE: a CTA takes 16 rows of H at least (an MMA's), so H = 2048 (Qwen3-30B, OLMoE)
    // filled 128 CTAs: one of 8 warps an SM, each warp through 4-5 items of 16 rows in turn
    // (OLMoE M = 8: GEMM2 55 us at 43% of DRAM peak, GEMM1 63 us at 74%; ncu, H100).
    // There, CTAs of 16 warps.
    if ((p.H + 15) / 16 <= int64_t(current_device_info().num_sms)) {
      launch_small_batch_gemm2<small_batch_gemm2_kernel<T, E, 16, 1, 2 * kThreads>, 16, 2 * kThreads>(p, stream);
    } else {
      launch_small_batch_gemm2<small_batch_gemm2_kernel<T, E, 16, 1>, 16>(p, stream);
    }
  } else if (p.I <= 512) {
    launch_small_batch_gemm2<small_batch_gemm2_kernel<T, E, 16, 1, kThreads, kLateWait>, 16>(p, stream);
  } else {
    launch_small_batch_gemm2<small_batch_gemm2_kernel<T, E, 4, 4, kThreads, kLateWait>, 4>(p, stream);
  }
}

// The late delta wait's instances exist for 16-bit operands only (the W8A8 GEMM2 reads its
// quantized activation up front, so fused_experts never asks it of them).
template <class T, class E, ActivationKind kAct>
void launch_small_batch(const SmallBatchMoeParams& p, cudaStream_t stream, int stages) {
  if constexpr (std::is_same_v<T, E>) {
    if (p.late_delta_wait) return launch_small_batch_kernels<T, E, kAct, true>(p, stream, stages);
  }
  launch_small_batch_kernels<T, E, kAct, false>(p, stream, stages);
}

template <class T, class E>
void dispatch_activation(const SmallBatchMoeParams& p, cudaStream_t stream, int stages) {
  switch (p.activation) {
    case ActivationKind::kSiluAndMul: return launch_small_batch<T, E, ActivationKind::kSiluAndMul>(p, stream, stages);
    case ActivationKind::kGeluAndMul: return launch_small_batch<T, E, ActivationKind::kGeluAndMul>(p, stream, stages);
    case ActivationKind::kSwigluOai: return launch_small_batch<T, E, ActivationKind::kSwigluOai>(p, stream, stages);
  }
}

// The launchers of the 8-bit operand instances (one translation unit each, compiled in
// parallel): layer dtype bf16 or fp16 (p.dtype), fp8 e4m3 or int8 operands.
void launch_fp8(const SmallBatchMoeParams& p, cudaStream_t stream, int stages);
void launch_int8(const SmallBatchMoeParams& p, cudaStream_t stream, int stages);
// Weight-only experts (w13q enabled; fused_experts_small_batch_weight_only.cu).
void launch_weight_only(const SmallBatchMoeParams& p, cudaStream_t stream, int stages);

}  // namespace moelora::cuda::small_batch
