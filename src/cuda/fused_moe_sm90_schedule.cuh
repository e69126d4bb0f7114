// The sm90 fused_moe kernel's tile schedule (fused_moe_sm90.cuh): the grouped raster of
// persistent cluster tiles, the ordered tiles' queue and taker (GemmParams::tile_counter),
// and each cluster tile's experts and LoRA adapters as the CTAs of a cluster see them.
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>

#include "common/params.h"

namespace moelora::cuda {

// m-tile group and n-tile of persistent cluster tile t in the grouped raster.
template <int kGroupM>
__device__ __forceinline__ void sm90_tile_coord(int64_t t, int64_t num_m_tiles, int64_t num_n_tiles, int64_t& m_tile,
                                                int64_t& n_tile) {
  const int64_t tiles_per_group = int64_t(kGroupM) * num_n_tiles;
  const int64_t group = t / tiles_per_group;
  const int64_t first_m = group * kGroupM;
  const int64_t group_rows = min(int64_t(kGroupM), num_m_tiles - first_m);
  const int64_t local = t - group * tiles_per_group;
  m_tile = first_m + local % group_rows;
  n_tile = local / group_rows;
}

// The cluster tiles a CTA takes, in order. Static: c, c + clusters, c + 2 * clusters, ...
// for cluster c. Ordered (GemmParams::tile_counter): the next tile of the grouped raster
// from a device counter, so tiles start in raster order as CTAs free up, whatever the
// CTAs' drift. The producer's thread 0 (of the leader CTA in a cluster) takes the
// indices (Sm90TileTaker) and every warp reads them from a ring of kTileQueueDepth
// entries, each with a `full` barrier (one arrival: the taker's) and an `empty` one (one
// per warp of the cluster, counted in the leader). In a cluster the taker writes each
// entry into every CTA's ring (st.shared::cluster, then a release arrival at cluster
// scope on that CTA's `full`; the waiters acquire at cluster scope), so the CTAs of a
// pair walk the same tiles, as the shared weight boxes need. NOTE: ordered 2-CTA
// clusters measured from 6% faster to 4% slower than ordered 1-CTA ones at M = 4096-8192
// (H100, step 6); the tables choose per cell.
// NOTE: static, the m-tiles that share a weight tile (consecutive t) drift apart by more
// than a line's life in L2 over tens of tiles: Mixtral's GEMM1 at M = 4096 (1.9 GB of
// weights) read 9.9 GB from DRAM static and 4.3 GB ordered (ncu, docs/PERF_NOTES.md
// step 5).
//
// Shared memory: full barriers [kDepth], empty barriers [kDepth], entries [kDepth]. One
// pointer locates all three (NOTE: the producer has 56 registers a thread).
template <int kDepth, int kClusterM>
struct Sm90TileQueue {
  using Barrier = cutlass::arch::ClusterBarrier;
  uint64_t* full;
  int index = 0;
  uint32_t phase = 0;

  __device__ __forceinline__ uint64_t* empty() const { return full + kDepth; }
  __device__ __forceinline__ int32_t* entries() const { return reinterpret_cast<int32_t*>(full + 2 * kDepth); }
  __device__ __forceinline__ void step() {
    if (++index == kDepth) {
      index = 0;
      phase ^= 1;
    }
  }
  // Every thread of a warp calls this together; lane 0 releases the entry (in a cluster,
  // to the leader CTA, whose taker fills every CTA's queue, and drains it before exit).
  __device__ __forceinline__ int32_t pop() {
    if constexpr (kClusterM == 1) {
      Barrier::wait(&full[index], phase);
    } else {
      // The entry came from the leader CTA: acquire at cluster scope.
      const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&full[index]));
      asm volatile(
          "{\n\t.reg .pred done;\n"
          "wait_%=:\n\t"
          "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n\t"
          "@!done bra wait_%=;\n\t}" ::"r"(bar),
          "r"(phase)
          : "memory");
    }
    const int32_t t = entries()[index];
    __syncwarp();
    if (threadIdx.x % 32 == 0) {
      if constexpr (kClusterM == 1) {
        Barrier::arrive(&empty()[index]);
      } else {
        Barrier::arrive(&empty()[index], 0u, 1u);
      }
    }
    step();
    return t;
  }
};

// The producer's thread 0 (of the leader CTA in a cluster): takes tile indices from the
// counter one tile ahead of the one it publishes, so the atomic's round trip hides
// behind a tile of loads. The last index it publishes is the first one past the end
// (every warp's stop). In a cluster it writes the entry into every CTA's queue.
template <int kDepth, int kClusterM>
struct Sm90TileTaker {
  using Barrier = cutlass::arch::ClusterBarrier;
  Sm90TileQueue<kDepth, kClusterM> slots;  // phase: of the empty barriers, starting at 1 (a fresh
                                           // barrier counts as having completed the phase before)
  int32_t next = 0;

  __device__ __forceinline__ void push(int32_t t) {
    Barrier::wait(&slots.empty()[slots.index], slots.phase);
    if constexpr (kClusterM == 1) {
      slots.entries()[slots.index] = t;
      Barrier::arrive(&slots.full[slots.index]);  // release: the entry is visible to the waiters
    } else {
      const uint32_t entry = static_cast<uint32_t>(__cvta_generic_to_shared(&slots.entries()[slots.index]));
      const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&slots.full[slots.index]));
#pragma unroll
      for (uint32_t rank = 0; rank < uint32_t(kClusterM); ++rank) {
        asm volatile(
            "{\n\t.reg .b32 remote_entry, remote_bar;\n\t"
            "mapa.shared::cluster.u32 remote_entry, %0, %2;\n\t"
            "mapa.shared::cluster.u32 remote_bar, %1, %2;\n\t"
            "st.shared::cluster.u32 [remote_entry], %3;\n\t"
            "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote_bar];\n\t}" ::"r"(entry),
            "r"(bar), "r"(rank), "r"(t)
            : "memory");
      }
    }
    slots.step();
  }
  __device__ __forceinline__ void start(int32_t* counter, int32_t num_tiles) {
    const int32_t first = atomicAdd(counter, 1);
    push(first);
    if (first < num_tiles) next = atomicAdd(counter, 1);
  }
  // After the CTA took a tile: publish the one after it, fetch the next.
  __device__ __forceinline__ void advance(int32_t* counter, int32_t num_tiles) {
    push(next);
    if (next < num_tiles) next = atomicAdd(counter, 1);
  }
  // Before the leader exits: every entry released, so no peer arrival is still on its way
  // to this CTA's shared memory.
  __device__ __forceinline__ void drain() {
    for (int q = 0; q < kDepth; ++q) {
      Barrier::wait(&slots.empty()[slots.index], slots.phase);
      slots.step();
    }
  }
};

// The experts of the m-tiles of one cluster tile, as each CTA of the cluster sees them.
struct Sm90ClusterTile {
  bool own_real;     // this CTA's m-tile exists (< num_m_tiles): it writes its rows
  bool own_loads;    // ... and its expert is on this rank: it loads and multiplies
  bool active;       // some CTA of the cluster loads: every CTA turns the ring
  bool shared;       // all CTAs load the same expert: the weight tile is multicast
  int expert;        // this CTA's expert (valid when own_loads)
  int64_t m_tile;    // this CTA's m-tile
};

// NOTE: every field goes through a shuffle from lane 0, so the compiler knows the
// branches on it are warp-uniform (the values come from global loads; without this the
// epilogue's shuffles get divergence fallbacks).
template <int kBlockM, int kClusterM>
__device__ __forceinline__ Sm90ClusterTile sm90_cluster_tile(const detail::GemmParams& p, int64_t m_group,
                                                             int64_t num_m_tiles, int cta_rank) {
  bool own_real = false, own_loads = false, active = false, shared = kClusterM > 1;
  int own_expert = -1, first_expert = -1;
#pragma unroll
  for (int r = 0; r < kClusterM; ++r) {
    const int64_t m_tile = m_group * kClusterM + r;
    const bool real = m_tile < num_m_tiles;
    const int expert = real ? p.expert_ids[m_tile * kBlockM / p.block_size] : -1;
    const bool loads = expert >= 0 && expert < p.num_experts;
    active |= loads;
    if (r == 0) first_expert = loads ? expert : -1;
    shared &= loads && expert == first_expert;
    if (r == cta_rank) {
      own_real = real;
      own_loads = loads;
      own_expert = expert;
    }
  }
  const int flags = __shfl_sync(0xffffffffu, int(own_real) | int(own_loads) << 1 | int(active) << 2 | int(shared) << 3, 0);
  Sm90ClusterTile c;
  c.own_real = flags & 1;
  c.own_loads = flags & 2;
  c.active = flags & 4;
  c.shared = flags & 8;
  c.expert = __shfl_sync(0xffffffffu, own_expert, 0);
  c.m_tile = m_group * kClusterM + cta_rank;
  return c;
}

// The adapters of a tile's block (bit l: adapter l) when the fused LoRA expand runs on it
// (GemmParams::lora_t), else 0. 1-CTA clusters only: a pair walks its tiles in lockstep,
// and its two blocks may differ in adapters. NOTE: not a field of Sm90ClusterTile: held
// across the producer's K loop it spilled the 56-register producer (ptxas).
template <int kBlockM, int kClusterM>
__device__ __forceinline__ uint64_t sm90_tile_lora_mask(const detail::GemmParams& p, const Sm90ClusterTile& tile) {
  uint64_t mask = 0;
  if (kClusterM == 1 && p.lora_t != nullptr && tile.own_loads) mask = p.block_lora_masks[tile.m_tile * kBlockM / p.block_size];
  // Warp-uniform (see sm90_cluster_tile).
  const uint32_t lo = __shfl_sync(0xffffffffu, uint32_t(mask), 0), hi = __shfl_sync(0xffffffffu, uint32_t(mask >> 32), 0);
  return uint64_t(hi) << 32 | lo;
}

}  // namespace moelora::cuda
