// Device queries for the CUDA backend. Each is cached per device ordinal, so the launch
// path pays one cudaGetDevice per call and never a property query or a sync.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_info.h"
#include "cuda/launch.cuh"
#include "cuda/tensor_map.h"

namespace moelora::cuda {
namespace {

constexpr int kMaxDevices = 64;

struct CachedDevice {
  std::atomic<bool> ready{false};
  DeviceInfo info;
};
CachedDevice g_devices[kMaxDevices];

}  // namespace

bool device_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error so later checks stay clean
    return false;
  }
  return count > 0;
}

const DeviceInfo& current_device_info() {
  int device = 0;
  MOELORA_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) throw Error("moelora: CUDA device ordinal " + std::to_string(device) + " out of range");
  CachedDevice& cached = g_devices[device];
  if (!cached.ready.load(std::memory_order_acquire)) {
    // Two threads may fill it at once; they write the same values.
    cudaDeviceProp prop{};
    MOELORA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    DeviceInfo info{};
    info.ordinal = device;
    info.cc_major = prop.major;
    info.cc_minor = prop.minor;
    info.num_sms = prop.multiProcessorCount;
    info.l2_bytes = prop.l2CacheSize;
    info.max_smem_per_cta = int(prop.sharedMemPerBlockOptin);
    info.smem_per_sm = int(prop.sharedMemPerMultiprocessor);
    std::strncpy(info.name, prop.name, sizeof(info.name) - 1);
    cached.info = info;
    cached.ready.store(true, std::memory_order_release);
  }
  return cached.info;
}

detail::CudaDeviceFacts current_device_facts() {
  const DeviceInfo& d = current_device_info();
  return {d.name, d.cc_major, d.cc_minor, d.num_sms, sm90_kernels_available(d)};
}

namespace {
// A switch that is on unless the environment sets it to "0".
bool env_switch_on(const char* name) {
  const char* env = std::getenv(name);
  return env == nullptr || std::strcmp(env, "0") != 0;
}
std::atomic<bool> g_pdl_allowed{env_switch_on("MOELORA_PDL")};
}  // namespace

void set_pdl_allowed(bool allowed) { g_pdl_allowed.store(allowed); }

namespace {
std::atomic<bool> g_late_waits_allowed{env_switch_on("MOELORA_LATE_WAITS")};
}  // namespace

void set_late_waits_allowed(bool allowed) { g_late_waits_allowed.store(allowed); }

bool late_waits_enabled() { return g_late_waits_allowed.load(std::memory_order_relaxed); }

namespace {
std::atomic<bool> g_align_small_cta{env_switch_on("MOELORA_ALIGN_SMALL_CTA")};
}  // namespace

void set_align_small_cta_enabled(bool enabled) { g_align_small_cta.store(enabled); }

bool align_small_cta_enabled() { return g_align_small_cta.load(std::memory_order_relaxed); }

namespace {
std::atomic<bool> g_sm80_compact_prologue{env_switch_on("MOELORA_SM80_COMPACT")};
}  // namespace

void set_sm80_compact_prologue_enabled(bool enabled) { g_sm80_compact_prologue.store(enabled); }

bool sm80_compact_prologue_enabled() { return g_sm80_compact_prologue.load(std::memory_order_relaxed); }

bool lora_expand_activation_enabled() {
  static const bool enabled = env_switch_on("MOELORA_LORA_EXPAND_ACTIVATION");
  return enabled;
}

namespace {
// $name as 0, 1 or 2 (anything else, or unset: 1): a three-way A/B knob (never, by the rule,
// always) as its enum.
template <class Use>
Use three_way_from_env(const char* name) {
  const char* env = std::getenv(name);
  if (env != nullptr && std::strcmp(env, "0") == 0) return Use(0);
  if (env != nullptr && std::strcmp(env, "2") == 0) return Use(2);
  return Use(1);
}
std::atomic<ExpandStreamUse> g_expand_stream{three_way_from_env<ExpandStreamUse>("MOELORA_LORA_EXPAND_STREAM")};
std::atomic<WarpTilesUse> g_shrink_warp_tiles{three_way_from_env<WarpTilesUse>("MOELORA_LORA_SHRINK_WARP_TILES")};
std::atomic<ExpandGroupsUse> g_expand_groups{three_way_from_env<ExpandGroupsUse>("MOELORA_LORA_EXPAND_GROUPS")};
std::atomic<SumBatchedUse> g_sum_batched{three_way_from_env<SumBatchedUse>("MOELORA_SUM_BATCHED")};
}  // namespace

SumBatchedUse sum_batched_use() { return g_sum_batched.load(std::memory_order_relaxed); }
void set_sum_batched_use(SumBatchedUse use) { g_sum_batched.store(use); }

ExpandGroupsUse lora_expand_groups_use() { return g_expand_groups.load(std::memory_order_relaxed); }
void set_lora_expand_groups_use(ExpandGroupsUse use) { g_expand_groups.store(use); }

ExpandStreamUse lora_expand_stream_use() { return g_expand_stream.load(std::memory_order_relaxed); }
void set_lora_expand_stream_use(ExpandStreamUse use) { g_expand_stream.store(use); }

WarpTilesUse lora_shrink_warp_tiles_use() { return g_shrink_warp_tiles.load(std::memory_order_relaxed); }
void set_lora_shrink_warp_tiles_use(WarpTilesUse use) { g_shrink_warp_tiles.store(use); }

namespace {
std::atomic<int> g_cta_smem_limit{0};
}  // namespace

void set_cta_smem_limit(int bytes) { g_cta_smem_limit.store(std::max(bytes, 0)); }

int cta_smem_limit(const DeviceInfo& d) {
  const int limit = g_cta_smem_limit.load(std::memory_order_relaxed);
  return limit > 0 ? std::min(limit, d.max_smem_per_cta) : d.max_smem_per_cta;
}

// A part whose CTA may have L bytes has L + 1 KB an SM (A100, H100: the 1 KB the
// system reserves per CTA).
int sm_smem_limit(const DeviceInfo& d) {
  const int limit = g_cta_smem_limit.load(std::memory_order_relaxed);
  return limit > 0 ? std::min(limit + 1024, d.smem_per_sm) : d.smem_per_sm;
}

bool pdl_enabled() { return g_pdl_allowed.load(std::memory_order_relaxed) && current_device_info().cc_major >= 9; }

TensorMapEncodeTiled tensor_map_encode_tiled() {
  static const TensorMapEncodeTiled encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    MOELORA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
      throw Error("moelora: the CUDA driver has no cuTensorMapEncodeTiled (the sm90 kernels need a CUDA 12 driver)");
    }
    return reinterpret_cast<TensorMapEncodeTiled>(fn);
  }();
  return encode;
}

}  // namespace moelora::cuda
