// Facts about the current CUDA device that launchers and the config registry need.
#pragma once

namespace moelora::cuda {

struct DeviceInfo {
  int ordinal;
  int cc_major, cc_minor;
  int num_sms;
  int l2_bytes;
  char name[256];  // e.g. "NVIDIA H100 80GB HBM3"
};

// The current device's facts, queried once per device and cached. Throws on CUDA errors.
const DeviceInfo& current_device_info();

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
