// sparse_mla_decode on Hopper tensor cores (sm_90a): wgmma, one producer warpgroup that
// gathers the kv rows and two math warpgroups that take the key blocks in pairs.
//
// A work item is one token, 64 query heads and one split of the token's indices, in the
// item order, workspace format and merge of the mma.sync kernel (sparse_mla_decode.cu).
// The CTAs are persistent (one an SM at most) and take items in turn: the producer loads
// the next item's Q once the last Q·Kᵀ of an item has retired and its first pair as the
// buffer halves free, while the math warpgroups finish the item and store it, so an
// item's start (~8 us to its first Q·Kᵀ, H100) overlaps the previous item's end.
// Shared memory holds Q [64 heads, 576 lanes] (72 KB) for the whole split and two kv
// buffers of 64 gathered rows [64, 576] (72 KB each). Each is stored as 64-lane tiles
// of 64 rows x 128 B in the 128-byte swizzle wgmma reads (tile t = lanes [64t, 64t+64),
// chunk c of row r at ((c ^ r % 8) · 16)), so the same bytes serve Q·Kᵀ (K-major B) and
// P·V (V = tiles 0-7 as an MN-major B).
//
// Blocks go in pairs: buffer b holds block 2i + b, and math warpgroup w
//   1. scores its own block: S_w = Q·K_wᵀ [64 heads, 64 keys] (m64n64k16, 36 k-steps,
//      both operands from shared memory);
//   2. exchanges row maxima with the other warpgroup; both derive the same new max, so
//      P_w = exp2(S_w - max) is final at once and no P is rescaled later;
//   3. accumulates half of O: value lanes [256w, 256w + 256) (128 fp32 registers a
//      thread), O_w += P_w · V_w with P from registers (the m64n64 accumulator layout is
//      the A-fragment layout, so no shuffle) and O_w += P_{1-w} · V_{1-w} with the
//      other warpgroup's P from shared memory.
// Every block is scored once and every V tile is read by one warpgroup. P_0 lives in
// buffer 0's tile 8 (its rope lanes: dead once S_0 is scored), P_1 in its own 8 KB:
// with Q and two buffers that is all of the 227 KB a CTA may have.
//
// Buffer halves: half h = the tiles warpgroup h reads for P·V (h = 0: tiles 0-3; h = 1:
// tiles 4-8, with P_0 in buffer 0). Each half of each buffer has a `free` barrier
// (warpgroup h's P·V wgmmas on it retired), and each tile of each buffer a `ready` one
// (the producer's cp.async completions; the first tile of the owner's half also its
// key-valid flags). The producer refills, per pair, buffer 0 half 0 and buffer 1 half 1
// first (each freed by its owner's register-operand P·V, the earlier one), then buffer 0
// half 1 and buffer 1 half 0 (freed after the other warpgroup's shared-operand P·V), tile
// by tile; warpgroup w scores its own half's tiles first and each tile as it lands, so the
// copies overlap Q·Kᵀ. (Per-tile `ready` against one a half: S 128K cells 1-7% faster,
// the rows' DRAM latency; H100.)
// An odd last block pairs with a block of masked rows (zero-filled, no global reads).
#include <cuda_bf16.h>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/launch.cuh"
#include "cuda/mma_sm80.cuh"
#include "cuda/sparse_mla_decode.cuh"

namespace moelora::cuda {
namespace {

using detail::SparseMlaDecodeParams;

constexpr int kHeads = kMlaSm90Heads;  // 64: the wgmma M of one warpgroup
constexpr int kBlockKeys = kMlaBlockKeys;
constexpr int kMathThreads = 256;  // warpgroups 0 and 1
constexpr int kThreads = kMathThreads + 128;  // warpgroup 2: the producer
constexpr int kTileBytes = 64 * 128;  // 64 rows x 64 bf16 lanes
constexpr int kTiles = kMlaHeadLanes / 64;  // 9
constexpr int kBufferBytes = kTiles * kTileBytes;  // 73,728
constexpr int kQOffset = 0;
constexpr int kKvOffset = kQOffset + kBufferBytes;
constexpr int kP1Offset = kKvOffset + 2 * kBufferBytes;
constexpr int kMaxOffset = kP1Offset + kTileBytes;         // float [2 warpgroups][64 rows]
constexpr int kSumOffset = kMaxOffset + 2 * kHeads * 4;    // float [2 item parities][2][64]
constexpr int kValidOffset = kSumOffset + 4 * kHeads * 4;  // u8 [2 buffers][64 keys]
constexpr int kBarrierOffset = kValidOffset + 2 * kBlockKeys;
// q_full, q_free, ready[buffer][tile], free[buffer][half]
constexpr int kNumBarriers = 2 + 2 * kTiles + 4;
// 1024 bytes of slack: the swizzle pattern repeats every 1024 bytes, tiles start on one.
constexpr int kSmemBytes = 1024 + kBarrierOffset + kNumBarriers * 8;
static_assert(kSmemBytes <= 232448, "the sm_90 opt-in limit of a CTA");
static_assert(kBarrierOffset % 8 == 0);

// Registers a thread (setmaxnreg). The warpgroups trade within the CTA's own pool, the
// 168 registers x 384 threads it launched with: a request beyond what the others gave
// back spins forever (NOTE: 232 + 48 hung on the H100). 216 + 72 spill nowhere (ptxas;
// the producer spilled at 56 once it held the next pair's rows).
constexpr int kMathRegisters = 216;
constexpr int kProducerRegisters = 72;
static_assert(kMathThreads * kMathRegisters + 128 * kProducerRegisters <= kThreads * 168);

// The device code below exists in the sm_90a pass only (an sm_80 pass of this file
// compiles the kernel's empty stub; the launcher never picks it there).
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Named barriers of the two math warpgroups (0 is __syncthreads).
constexpr uint32_t kBarrierRowMax = 1, kBarrierP = 2, kBarrierRowSum = 3;

// Log2 units a pair's max may exceed the reference max before O is rescaled (compute()).
constexpr float kMaxSlack = 8.0f;

// Tiles of buffer half h: [4h, 4h + 4 + h).
__host__ __device__ constexpr int half_first_tile(int h) { return 4 * h; }
__host__ __device__ constexpr int half_num_tiles(int h) { return 4 + h; }

// wgmma shared-memory descriptors, 128-byte swizzle (layout type 1 in bits 62-63).
__device__ __forceinline__ uint64_t sw128_descriptor(uint32_t addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  return (uint64_t(1) << 62) | (uint64_t((stride_bytes >> 4) & 0x3FFF) << 32) |
         (uint64_t((leading_bytes >> 4) & 0x3FFF) << 16) | uint64_t((addr >> 4) & 0x3FFF);
}
// K-major operand (Q, K, P): rows of 128 B, 8-row groups 1024 B apart; a k-step of 16
// lanes is +32 B within the row.
__device__ __forceinline__ uint64_t k_major(uint32_t addr) { return sw128_descriptor(addr, 16, 1024); }
// MN-major B (V): 64-lane tiles kTileBytes apart along N, 8-key groups 1024 B apart
// along K; a k-step of 16 keys is +2048 B.
__device__ __forceinline__ uint64_t mn_major(uint32_t addr) { return sw128_descriptor(addr, kTileBytes, 1024); }
// A descriptor `bytes` further on: the start address field (bits 0-13, 16-byte units) of a
// shared-memory address below 256 KB never carries, so one add of a constant per wgmma
// instead of building each descriptor from its address.
__host__ __device__ constexpr uint64_t desc_offset(uint32_t bytes) { return bytes >> 4; }

using QkWgmma =
    cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
using PvWgmmaRegs =
    cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>;
using PvWgmmaSmem =
    cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>;

template <class Op, size_t... I>
__device__ __forceinline__ void wgmma_smem(uint64_t a, uint64_t b, float (&acc)[sizeof...(I)], bool accumulate,
                                           std::index_sequence<I...>) {
  Op::fma(a, b, acc[I]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}
template <class Op, size_t... I>
__device__ __forceinline__ void wgmma_regs(const uint32_t* a, uint64_t b, float (&acc)[sizeof...(I)],
                                           std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], b, acc[I]..., cute::SM90::GMMA::ScaleOut::One);
}
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(r[i]);
}
template <int N>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(r[i]);
}

struct Sm90Barriers {
  uint64_t* base;
  __device__ uint64_t* q_full() const { return base; }
  __device__ uint64_t* q_free() const { return base + 1; }
  __device__ uint64_t* ready(int buffer, int tile) const { return base + 2 + kTiles * buffer + tile; }
  __device__ uint64_t* free(int buffer, int half) const { return base + 2 + 2 * kTiles + 2 * buffer + half; }
};

// The launch's work items (mla_cta_work); CTA b takes items b, b + gridDim.x, ...
struct MlaItems {
  int num_head_groups, blocks_per_split;
  int count;  // < 2^31 (the launcher checks)
  __device__ MlaCtaWork work(const SparseMlaDecodeParams& p, int64_t item) const {
    return mla_cta_work(p, num_head_groups, kHeads, blocks_per_split, int(item));
  }
};

// ---- producer: 16 groups of 8 threads; group g copies rows g, g+16, g+32, g+48 of a
// tile, thread c of the group the row's 16-byte chunk c (one 128-byte line a group) -----
// The CTA's items in turn: Q once the math warpgroups' last Q·Kᵀ of the previous item has
// retired (q_free), the pairs as their buffer halves free, so the next item's Q and first
// pair arrive while the math warpgroups finish the last pair and store the previous item.
// Phases run over the CTA's items: q_full/q_free once an item with keys, ready/free once a
// pair (`pairs_before`: the pairs of the CTA's earlier items).
__device__ __forceinline__ void produce(const SparseMlaDecodeParams& p, const MlaItems& items, uint32_t smem_base,
                                        uint8_t* key_valid, const Sm90Barriers& bar) {
  const int thread = threadIdx.x - kMathThreads;
  const int group = thread / 8, chunk = thread % 8;
  const uint32_t q_base = smem_base + kQOffset;
  const uint32_t kv_base = smem_base + kKvOffset;
  int q_loads = 0;
  uint32_t pairs_before = 0;
  for (int64_t item = blockIdx.x; item < items.count; item += gridDim.x) {
    const MlaCtaWork work = items.work(p, item);
    const int64_t token = work.token;
    const int head0 = work.head0;
    const int num_pairs = (work.num_blocks + 1) / 2;
    if (num_pairs == 0) continue;  // an empty split: the math warpgroups write zeros
    if (q_loads > 0) cutlass::arch::ClusterBarrier::wait(bar.q_free(), uint32_t((q_loads - 1) & 1));
    ++q_loads;

    {
      const auto* q_bytes = static_cast<const uint8_t*>(p.q);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = group + 16 * r;
        const bool ok = head0 + row < p.num_heads;
        const uint8_t* src =
            q_bytes + (ok ? (token * p.q_stride_token + int64_t(head0 + row) * p.q_stride_head) * 2 : 0) + chunk * 16;
        const uint32_t dst = q_base + row * 128 + ((chunk ^ (row & 7)) << 4);
#pragma unroll
        for (int t = 0; t < kTiles; ++t) cp_async_16_zfill(dst + t * kTileBytes, src + t * 128, ok);
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(bar.q_full());
    }

    const int32_t* token_indices = p.indices + token * p.indices_stride_token;
    const auto* kv_bytes = static_cast<const uint8_t*>(p.kv);
    // This thread's kv rows of a pair's two blocks, -1 = masked: read one pair ahead, so
    // the index loads' latency is not in front of every copy.
    auto read_rows = [&](int pair, int32_t (&rows)[2][4]) {
#pragma unroll
      for (int buffer = 0; buffer < 2; ++buffer) {
        const int block = 2 * pair + buffer;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int64_t pos = work.begin + int64_t(block) * kBlockKeys + group + 16 * r;
          int32_t row = -1;
          if (block < work.num_blocks && pos < work.end) {
            row = __ldg(token_indices + pos);
            if (row < 0 || row >= p.num_kv_rows) row = -1;
          }
          rows[buffer][r] = row;
        }
      }
    };
    int32_t rows[2][4], next_rows[2][4];
    read_rows(0, next_rows);
    for (int pair = 0; pair < num_pairs; ++pair) {
      const uint32_t global_pair = pairs_before + pair;
#pragma unroll
      for (int buffer = 0; buffer < 2; ++buffer) {
#pragma unroll
        for (int r = 0; r < 4; ++r) rows[buffer][r] = next_rows[buffer][r];
      }
      if (pair + 1 < num_pairs) read_rows(pair + 1, next_rows);
      // buffer 0 half 0, buffer 1 half 1, buffer 0 half 1, buffer 1 half 0: the order the
      // math warpgroups free them. Each tile has its own `ready`, so a warpgroup's Q·Kᵀ
      // starts on its first tile instead of its whole half.
#pragma unroll
      for (int step = 0; step < 4; ++step) {
        const int buffer = step & 1, half = buffer ^ (step >> 1);
        if (global_pair > 0) cutlass::arch::ClusterBarrier::wait(bar.free(buffer, half), (global_pair - 1) & 1);
        if (half == buffer && chunk == 0) {
          // The block's key flags: the owner reads them after its first tile's `ready` and
          // is done with them before it frees this half.
#pragma unroll
          for (int r = 0; r < 4; ++r) key_valid[buffer * kBlockKeys + group + 16 * r] = rows[buffer][r] >= 0;
        }
#pragma unroll
        for (int t = half_first_tile(half); t < half_first_tile(half) + half_num_tiles(half); ++t) {
          const uint32_t dst_tile = kv_base + buffer * kBufferBytes + t * kTileBytes;
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int key = group + 16 * r;
            const int32_t row = rows[buffer][r];
            const uint8_t* src = kv_bytes + (row >= 0 ? int64_t(row) * p.kv_stride_row * 2 : 0) + t * 128 + chunk * 16;
            cp_async_16_zfill(dst_tile + key * 128 + ((chunk ^ (key & 7)) << 4), src, row >= 0);
          }
          cutlass::arch::cpasync_barrier_arrive_noinc(bar.ready(buffer, t));
          // releases the flag writes
          if (half == buffer && t == half_first_tile(half)) cutlass::arch::ClusterBarrier::arrive(bar.ready(buffer, t));
        }
      }
    }
    pairs_before += num_pairs;
  }
  // Copies still in flight write this CTA's shared memory: wait before the thread exits.
  cute::cp_async_wait<0>();
}

// ---- math warpgroup kW ---------------------------------------------------------------
template <int kW>
__device__ __forceinline__ void compute(const SparseMlaDecodeParams& p, const MlaItems& items, uint32_t smem_base,
                                        uint8_t* smem, const Sm90Barriers& bar) {
  constexpr int kOther = 1 - kW;
  const int thread = threadIdx.x % 128, warp = thread / 32, lane = thread % 32;
  // Accumulator layout (m64nN): value v = pair + 2 · row_half + 4 · n_tile holds row
  // 16 · warp + lane / 4 + 8 · row_half, column 8 · n_tile + 2 · (lane % 4) + pair.
  const int row0 = 16 * warp + lane / 4;
  const int col0 = 2 * (lane % 4);
  const uint32_t q_base = smem_base + kQOffset;
  const uint32_t own_buffer = smem_base + kKvOffset + kW * kBufferBytes;
  const uint32_t other_buffer = smem_base + kKvOffset + kOther * kBufferBytes;
  const uint32_t p0_addr = smem_base + kKvOffset + (kTiles - 1) * kTileBytes;  // buffer 0, tile 8
  const uint32_t p1_addr = smem_base + kP1Offset;
  const uint32_t own_p = kW == 0 ? p0_addr : p1_addr;
  const uint32_t other_p = kW == 0 ? p1_addr : p0_addr;
  float* shared_max = reinterpret_cast<float*>(smem + kMaxOffset);
  const uint8_t* own_valid = smem + kValidOffset + kW * kBlockKeys;
  const float scale_log2 = p.softmax_scale * kMlaLog2e;
  const uint64_t q_desc = k_major(q_base), own_k_desc = k_major(own_buffer);
  const uint64_t own_v_desc = mn_major(own_buffer + 4 * kW * kTileBytes);
  const uint64_t other_v_desc = mn_major(other_buffer + 4 * kW * kTileBytes), other_p_desc = k_major(other_p);
  int q_loads = 0, items_done = 0;
  uint32_t pairs_before = 0;  // the pairs of the CTA's earlier items (the barriers' phases)

  for (int64_t item = blockIdx.x; item < items.count; item += gridDim.x, ++items_done) {
    const MlaCtaWork work = items.work(p, item);
    const int64_t token = work.token;
    const int split = work.split, head0 = work.head0;
    // Row sums of both warpgroups by item parity: a warpgroup may store an item's sums (even
    // an item with no keys, which passes no other barrier) while the other still reads the
    // previous item's; it cannot get two items ahead (kBarrierRowSum).
    float* shared_sum = reinterpret_cast<float*>(smem + kSumOffset) + (items_done & 1) * 2 * kHeads;
    float out_acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) out_acc[i] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY};  // log2 units
    float row_sum[2] = {0.0f, 0.0f};            // this thread's columns of its warpgroup's blocks
    const int num_pairs = (work.num_blocks + 1) / 2;
    if (num_pairs > 0) cutlass::arch::ClusterBarrier::wait(bar.q_full(), uint32_t(q_loads & 1));

    for (int pair = 0; pair < num_pairs; ++pair) {
      const uint32_t phase = (pairs_before + pair) & 1;
      // ---- S = Q·Kᵀ of the own block, own half's tiles first -------------------------
      float score[32];
#pragma unroll
      for (int part = 0; part < 2; ++part) {
        const int half = part == 0 ? kW : kOther;
#pragma unroll
        for (int t = half_first_tile(half); t < half_first_tile(half) + half_num_tiles(half); ++t) {
          cutlass::arch::ClusterBarrier::wait(bar.ready(kW, t), phase);
          // cp.async wrote the tile through the generic proxy; wgmma reads the async one.
          cutlass::arch::fence_view_async_shared();
          // An arrive after each wait: the wait is a spin loop, and an arrive ptxas injected
          // after it inside the item loop serialized every wgmma (C7520; 8-19% slower, H100).
          cute::warpgroup_arrive();
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            wgmma_smem<QkWgmma>(q_desc + desc_offset(t * kTileBytes + k * 32),
                                own_k_desc + desc_offset(t * kTileBytes + k * 32), score,
                                !(part == 0 && t == half_first_tile(half) && k == 0), std::make_index_sequence<32>{});
          }
        }
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
      fence_registers(score);
      // The item's last Q·Kᵀ has retired: the producer may load the next item's Q.
      if (pair + 1 == num_pairs && lane == 0) cutlass::arch::ClusterBarrier::arrive(bar.q_free());

      // ---- masking, the row max of both blocks -----------------------------------------
      float block_max[2];
      mla_mask_and_row_max<8, false>(score, own_valid + col0, scale_log2, block_max);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if ((lane & 3) == 0) shared_max[kW * kHeads + row0 + 8 * h] = block_max[h];
      }
      cutlass::arch::NamedBarrier::sync(kMathThreads, kBarrierRowMax);
      // Both warpgroups derive the same max from the same values. The other's entries are
      // rewritten only after it passes kBarrierP, which this warpgroup reaches after reading.
      // Lazy max: the exponents keep the row's reference max until a pair's max exceeds it
      // by more than kMaxSlack (log2 units), so P <= 2^kMaxSlack (exact in bf16's range,
      // summed in fp32) and O is rescaled only when the max jumps; the result is the same
      // because out and lse use the same reference. NOTE: the 128 multiplies of a rescale
      // cost two warps of a scheduler ~0.2 us a pair while the tensor pipe waits.
      float max_safe[2], rescale[2];
      bool any_rescale = false;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float pair_max = fmaxf(block_max[h], shared_max[kOther * kHeads + row0 + 8 * h]);
        const float m = pair_max > row_max[h] + kMaxSlack ? pair_max : row_max[h];
        // A row with no valid key yet keeps max -inf; exponents then use 0 (no inf - inf).
        max_safe[h] = m == -INFINITY ? 0.0f : m;
        rescale[h] = exp2f(row_max[h] - max_safe[h]);
        any_rescale |= rescale[h] != 1.0f;
        row_max[h] = m;
      }
      if (__any_sync(0xffffffffu, any_rescale)) {
#pragma unroll
        for (int i = 0; i < 128; ++i) out_acc[i] *= rescale[(i >> 1) & 1];
      }

      // ---- P = exp2(S - max) and O_w += P_w · V_w (P from registers) ------------------
      // A fragment of k-step s (keys 16s..16s+15) = p_frag[4s .. 4s+3]: (row, keys 8·2s),
      // (row + 8, keys 8·2s), (row, keys 8·(2s+1)), (row + 8, keys 8·(2s+1)). In two
      // halves of 32 keys: the first half's wgmmas run while the second half's exponents
      // are computed (the MUFU work of a pair is ~0.3 us of two warps a scheduler).
      // Each half is copied to shared memory for the other warpgroup before its wgmmas are
      // issued: reading A registers of a wgmma in flight is undefined (PTX).
      uint32_t p_frag[16];
      float block_sum[2] = {0.0f, 0.0f};
      fence_registers(out_acc);
#pragma unroll
      for (int part = 0; part < 2; ++part) {
#pragma unroll
        for (int j = 4 * part; j < 4 * part + 4; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float p0 = mla_exp2(fmaf(score[4 * j + 2 * h], scale_log2, -max_safe[h]));
            const float p1 = mla_exp2(fmaf(score[4 * j + 2 * h + 1], scale_log2, -max_safe[h]));
            block_sum[h] += p0 + p1;
            const __nv_bfloat162 pair2 = __floats2bfloat162_rn(p0, p1);
            p_frag[2 * j + h] = *reinterpret_cast<const uint32_t*>(&pair2);
            mla_store_p_pair(own_p, row0 + 8 * h, 8 * j + col0, p_frag[2 * j + h]);
          }
        }
        fence_registers(p_frag);
        cute::warpgroup_arrive();
#pragma unroll
        for (int s = 2 * part; s < 2 * part + 2; ++s) {
          wgmma_regs<PvWgmmaRegs>(p_frag + 4 * s, own_v_desc + desc_offset(s * 2048), out_acc,
                                  std::make_index_sequence<128>{});
        }
      }
      cute::warpgroup_commit_batch();
      // P was written through the generic proxy; the other warpgroup's wgmma reads it.
      cutlass::arch::fence_view_async_shared();
#pragma unroll
      for (int h = 0; h < 2; ++h) row_sum[h] = row_sum[h] * rescale[h] + block_sum[h];

      // ---- O_w += P_other · V_other (the other's P from shared memory) -----------------
      cutlass::arch::NamedBarrier::sync(kMathThreads, kBarrierP);
      cute::warpgroup_arrive();
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        wgmma_smem<PvWgmmaSmem>(other_p_desc + desc_offset(s * 32), other_v_desc + desc_offset(s * 2048),
                                out_acc, true, std::make_index_sequence<128>{});
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<1>();
      fence_registers(p_frag);
      if (lane == 0) cutlass::arch::ClusterBarrier::arrive(bar.free(kW, kW));
      cute::warpgroup_wait<0>();
      fence_registers(out_acc);
      if (lane == 0) cutlass::arch::ClusterBarrier::arrive(bar.free(kOther, kW));
    }
    if (num_pairs > 0) ++q_loads;
    pairs_before += num_pairs;
    if (item + gridDim.x >= items.count) allow_next_kernel_launch();  // the CTA's last item

    // ---- row sums of both warpgroups --------------------------------------------------
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
      row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
      if ((lane & 3) == 0) shared_sum[kW * kHeads + row0 + 8 * h] = row_sum[h];
    }
    cutlass::arch::NamedBarrier::sync(kMathThreads, kBarrierRowSum);

    // ---- epilogue: value lanes [256 kW, 256 kW + 256) of the 64 heads ------------------
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 8 * h;
      const int head = head0 + row;
      const bool valid = head < p.num_heads;
      const float sum = shared_sum[row] + shared_sum[kHeads + row];
      const float scale =
          valid ? mla_finish_row(p, token, split, head, row_max[h], sum, kW == 0 && (lane & 3) == 0) : 0.0f;
      mla_store_row<32>(p, token, split, head, valid, scale, 256 * kW,
                        [&](int n, int e) { return out_acc[4 * n + 2 * h + e]; });
    }
  }
}

#endif  // !__CUDA_ARCH__ || __CUDA_ARCH_FEAT_SM90_ALL

__global__ void __launch_bounds__(kThreads, 1)
    sparse_mla_decode_sm90_kernel(const SparseMlaDecodeParams p, int num_head_groups, int blocks_per_split) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t smem_base = smem_addr(smem);
  const Sm90Barriers bar{reinterpret_cast<uint64_t*>(smem + kBarrierOffset)};
  if (threadIdx.x == 0) {
    cutlass::arch::ClusterBarrier::init(bar.q_full(), 128);  // cp.async completions
    cutlass::arch::ClusterBarrier::init(bar.q_free(), 8);    // the 8 math warps
    for (int b = 0; b < 2; ++b) {
      for (int t = 0; t < kTiles; ++t) {
        // 128 cp.async completions (+ 128 plain arrivals after the flag writes on the
        // first tile of the owner's half)
        cutlass::arch::ClusterBarrier::init(bar.ready(b, t), t == half_first_tile(b) ? 256 : 128);
      }
      for (int h = 0; h < 2; ++h) {
        cutlass::arch::ClusterBarrier::init(bar.free(b, h), 4);  // the 4 warps of warpgroup h
      }
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  wait_for_previous_kernel();
  const MlaItems items{num_head_groups, blocks_per_split, int(p.num_tokens * num_head_groups * p.num_splits)};

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 2) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    produce(p, items, smem_base, smem + kValidOffset, bar);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kMathRegisters>();
    if (warpgroup == 0) {
      compute<0>(p, items, smem_base, smem, bar);
    } else {
      compute<1>(p, items, smem_base, smem, bar);
    }
  }
#endif
}

}  // namespace

int sparse_mla_decode_sm90_smem_bytes() { return kSmemBytes; }

void sparse_mla_decode_sm90(const SparseMlaDecodeParams& p, int num_head_groups, int blocks_per_split,
                            cudaStream_t stream) {
  MOELORA_CUDA_CHECK(
      cudaFuncSetAttribute(sparse_mla_decode_sm90_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  // Persistent: one CTA an SM at most, each taking items in turn.
  const int64_t num_items = p.num_tokens * num_head_groups * p.num_splits;
  const int64_t num_ctas = std::min<int64_t>(num_items, current_device_info().num_sms);
  launch_kernel(sparse_mla_decode_sm90_kernel, dim3(unsigned(num_ctas)), dim3(kThreads), kSmemBytes, stream, p,
                num_head_groups, blocks_per_split);
}

}  // namespace moelora::cuda
