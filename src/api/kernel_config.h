// Kernel config registry: tuned tables per (device, E, N, dtype), keyed by token count.
//
// Sources, first match wins: the folder named by $MOELORA_CONFIG_DIR (read once per
// file name), then the tables shipped in configs/ (compiled into the library by CMake).
// A table maps a token count to a MoeKernelConfig; lookup takes the nearest count, as
// vLLM does. No table: the heuristic (heuristic_config).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "common/params.h"
#include "moelora/ops.h"

namespace moelora::detail {

// One shipped table: its file name and JSON text (generated from configs/*.json).
struct ShippedKernelConfig {
  const char* file_name;
  const char* json;
};
extern const ShippedKernelConfig kShippedKernelConfigs[];
extern const int kNumShippedKernelConfigs;

using KernelConfigTable = std::map<int64_t, MoeKernelConfig>;  // token count -> config

// Parses a table; throws moelora::Error naming `source` and the offending entry.
KernelConfigTable parse_kernel_config_table(const std::string& json, const std::string& source);

// "E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3,dtype=bf16.json" (spaces -> '_').
std::string kernel_config_file_name(int64_t num_experts, int64_t intermediate_size, DType dtype,
                                    const std::string& device_name);

// The table for a file name, or null. Parsed once per name and kept for the process
// lifetime, so the pointer stays valid and a lookup copies nothing.
const KernelConfigTable* find_kernel_config_table(const std::string& file_name);

// Entry of a table nearest to num_tokens (ties go to the smaller count).
MoeKernelConfig nearest_kernel_config(const KernelConfigTable& table, int64_t num_tokens);

// Throws moelora::Error (naming `what`) unless the config is usable: block size 16..256
// and a multiple of 16, tiles from the kernel's set and dividing the block size.
void check_kernel_config(const char* op, const char* what, const MoeKernelConfig& config);
void check_gemm_tile(const char* op, const char* what, const GemmTile& tile, int64_t block_size);

}  // namespace moelora::detail
