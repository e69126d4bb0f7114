// Facts about the current CUDA device that launchers and the config registry need.
#pragma once

#include <atomic>

namespace moelora::cuda {

struct DeviceInfo {
  int ordinal;
  int cc_major, cc_minor;
  int num_sms;
  int l2_bytes;
  int max_smem_per_cta;  // the opt-in limit of a CTA's shared memory (A100 166,912; H100 232,448)
  int smem_per_sm;       // (A100 167,936; H100 233,472)
  char name[256];  // e.g. "NVIDIA H100 80GB HBM3"
};

// The current device's facts, queried once per device and cached. Throws on CUDA errors.
const DeviceInfo& current_device_info();

// The shared memory a kernel plan may give one CTA, and an SM, on `d`: the device's own
// limits, or less under set_cta_smem_limit (tests and benchmarks run smaller parts' plans).
int cta_smem_limit(const DeviceInfo& d);
int sm_smem_limit(const DeviceInfo& d);

// A per-device value computed once on first use (an occupancy query, say) and kept in
// the caller's cache, one per kernel instance; 0 means not computed yet. No sync.
template <class Compute>
int cached_per_device(std::atomic<int> (&cache)[64], Compute&& compute) {
  const DeviceInfo& device = current_device_info();
  std::atomic<int>& slot = cache[device.ordinal % 64];
  int value = slot.load(std::memory_order_relaxed);
  if (value == 0) {
    value = compute(device);
    slot.store(value, std::memory_order_relaxed);
  }
  return value;
}

// sm_90a kernels (wgmma) run here: compute capability 9.0 exactly.
inline bool is_sm90(const DeviceInfo& d) { return d.cc_major == 9 && d.cc_minor == 0; }

// This build has sm_90a kernels and the device runs them.
inline bool sm90_kernels_available(const DeviceInfo& d) {
#ifdef MOELORA_BUILD_SM90A
  return is_sm90(d);
#else
  (void)d;
  return false;
#endif
}

}  // namespace moelora::cuda
