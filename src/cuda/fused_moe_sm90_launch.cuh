// The sm90 fused_moe kernel's launchers (fused_moe_sm90.cuh holds the kernel): the
// occupancy query that sizes its persistent grid, one launch per instance, and the
// dispatch from a tile (and cluster, weight bits, adapters) to the instance that runs it.
// Included by the instance files (fused_moe_sm90_*.cu), one element type and tile height
// or weight width each, so that no translation unit compiles every instance.
#pragma once

#include <atomic>
#include <stdexcept>
#include <string>

#include "cuda/fused_moe_sm90.cuh"

namespace moelora::cuda {

// Clusters of the Config's kernel that fit on the device at once (an occupancy query,
// cached per device and kernel instance; no sync). NOTE: the cache must be per instance:
// one shared by every instance (all have the same function type) handed the first
// instance's count to all, and a 64-cluster count from a 2-CTA instance halved the grid
// of every 1-CTA instance after it (DeepSeek M = 4096: 1750 -> 2800 us).
template <class Config>
int sm90_max_active_clusters() {
  static std::atomic<int> cache[64] = {};
  return cached_per_device(cache, [](const DeviceInfo& device) {
    if (Config::kClusterM == 1) return device.num_sms;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(unsigned(device.num_sms / Config::kClusterM * Config::kClusterM));
    config.blockDim = dim3(unsigned(Config::kThreads));
    config.dynamicSmemBytes = Config::kSmemBytes;
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = unsigned(Config::kClusterM);
    attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    int clusters = 0;
    MOELORA_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, fused_moe_sm90_kernel<Config>, &config));
    if (clusters < 1) throw Error("moelora.fused_moe: no cluster of the sm90 kernel fits on this device");
    return clusters;
  });
}

// Launches the kernel for one (element type, tile, cluster, weight bits) instance: at
// most one CTA per SM, and no more clusters than fit at once (the tile loop is persistent).
template <class Element, int kBlockM, int kBlockN, int kClusterM, int kWeightBits = 16, bool kFusedLora = true>
void launch_fused_moe_sm90(const detail::GemmParams& p, cudaStream_t stream) {
  using Config = FusedMoeSm90Config<Element, kBlockM, kBlockN, kClusterM, kWeightBits, kFusedLora>;
  if (!Config::kFusedLora && p.lora_t != nullptr) {
    throw std::logic_error("moelora.fused_moe: an sm90 instance without the fused LoRA expand got adapters");
  }
  const int64_t num_m_tiles = p.max_num_blocks * (p.block_size / kBlockM);
  const int64_t out_width = p.gated ? kBlockN / 2 : kBlockN;
  const int64_t num_tiles = (num_m_tiles + kClusterM - 1) / kClusterM * ((p.N + out_width - 1) / out_width);
  if (num_tiles == 0) return;
  const WeightTensorMap w_map = Config::kWeightOnly ? make_packed_weight_tensor_map(p, Config::kBoxRows)
                                                    : make_weight_tensor_map(p, Config::kBoxRows);
  const ActivationTensorMap a_map = p.a_rows_sorted ? make_activation_tensor_map(p, kBlockM) : ActivationTensorMap{};
  auto kernel = fused_moe_sm90_kernel<Config>;
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Config::kSmemBytes)));
  const int64_t clusters = std::min<int64_t>(num_tiles, sm90_max_active_clusters<Config>());
  launch_kernel_in_clusters(kernel, dim3(unsigned(clusters * kClusterM)), dim3(Config::kThreads), Config::kSmemBytes,
                            stream, kClusterM, p, w_map, a_map);
}

// The instances of one (element type, tile height): one translation unit each.
template <class T, int kBlockM>
void dispatch_fused_moe_sm90(const detail::GemmParams& p, int block_n, int cluster_m, cudaStream_t stream) {
  if (p.lora_t != nullptr) cluster_m = 1;  // the fused LoRA expand runs in 1-CTA clusters (sm90_cluster_tile)
  if (block_n == 128 && cluster_m == 1) return launch_fused_moe_sm90<T, kBlockM, 128, 1>(p, stream);
  if (block_n == 128 && cluster_m == 2) return launch_fused_moe_sm90<T, kBlockM, 128, 2>(p, stream);
  if (block_n == 256 && cluster_m == 1) return launch_fused_moe_sm90<T, kBlockM, 256, 1>(p, stream);
  if (block_n == 256 && cluster_m == 2) return launch_fused_moe_sm90<T, kBlockM, 256, 2>(p, stream);
  throw Error("moelora.fused_moe: no sm90 instance for tile " + std::to_string(kBlockM) + "x" + std::to_string(block_n) +
              " in clusters of " + std::to_string(cluster_m));
}

// The weight-only instances of one (element type, weight bits): 1-CTA clusters, with the
// fused LoRA expand where the call has adapters.
template <class T, int kWeightBits, bool kFusedLora>
void dispatch_fused_moe_sm90_weight_only_lora(const detail::GemmParams& p, int block_m, int block_n, cudaStream_t stream) {
  if (block_m == 64 && block_n == 128) return launch_fused_moe_sm90<T, 64, 128, 1, kWeightBits, kFusedLora>(p, stream);
  if (block_m == 64 && block_n == 256) return launch_fused_moe_sm90<T, 64, 256, 1, kWeightBits, kFusedLora>(p, stream);
  if (block_m == 128 && block_n == 128) return launch_fused_moe_sm90<T, 128, 128, 1, kWeightBits, kFusedLora>(p, stream);
  if (block_m == 128 && block_n == 256) return launch_fused_moe_sm90<T, 128, 256, 1, kWeightBits, kFusedLora>(p, stream);
  throw Error("moelora.fused_moe: no sm90 weight-only instance for tile " + std::to_string(block_m) + "x" +
              std::to_string(block_n));
}

template <class T, int kWeightBits>
void dispatch_fused_moe_sm90_weight_only(const detail::GemmParams& p, int block_m, int block_n, cudaStream_t stream) {
  p.lora_t != nullptr ? dispatch_fused_moe_sm90_weight_only_lora<T, kWeightBits, true>(p, block_m, block_n, stream)
                      : dispatch_fused_moe_sm90_weight_only_lora<T, kWeightBits, false>(p, block_m, block_n, stream);
}

}  // namespace moelora::cuda
