// Kernel launch with programmatic dependent launch (PDL, sm_90+).
//
// The layer is a chain of short kernels (align -> GEMM1 -> activation -> GEMM2 ->
// reduce). With PDL a kernel may be launched while the one before it is still running:
// its CTAs are scheduled early and park in wait_for_previous_kernel() until the
// previous grid has completed and its writes are visible. That hides the launch gap
// and the ramp-up of every kernel, several microseconds per layer in decode.
//
// Every kernel launched through launch_kernel() MUST call wait_for_previous_kernel()
// before its first global-memory access to anything an earlier kernel wrote, and MAY
// call allow_next_kernel_launch() once its main work is issued. Both are no-ops on
// devices and builds without PDL, where the launch is an ordinary stream-ordered one.
// The one exception, documented where it is used (SmallBatchMoeParams::late_delta_wait,
// GemmParams::lora_late_wait; MOELORA_LATE_WAITS=0 turns both off):
// when the previous kernel calls allow_next_kernel_launch() only after its own wait,
// every kernel before that one has completed when this grid launches, so this grid may
// read their outputs before its wait; what it writes before its wait must be memory the
// previous kernel neither reads nor writes. At least one of its CTAs must still wait on
// every path, so that its completion implies its predecessors' (the kernels after it
// rely on that).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda/cuda_check.h"

namespace moelora::cuda {

__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The next kernel in the stream may be launched once every CTA of this grid has called
// this (or exited). Call it after the main loop, not at entry: dependents launched too
// early would take SM slots from this grid's later waves.
__device__ __forceinline__ void allow_next_kernel_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// True when the current device runs PDL (compute capability >= 9.0) and it is not turned
// off with MOELORA_PDL=0. Cached per device; no sync.
bool pdl_enabled();

// Launches `kernel` in clusters of `cluster_size` CTAs along x (1: no cluster attribute).
template <class... KernelArgs, class... Args>
void launch_kernel_in_clusters(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                               cudaStream_t stream, int cluster_size, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2]{};
  int count = 0;
  if (pdl_enabled()) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (cluster_size > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = unsigned(cluster_size);
    attributes[count].val.clusterDim.y = 1;
    attributes[count].val.clusterDim.z = 1;
    ++count;
  }
  config.attrs = attributes;
  config.numAttrs = unsigned(count);
  MOELORA_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

template <class... KernelArgs, class... Args>
void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                   Args&&... args) {
  launch_kernel_in_clusters(kernel, grid, block, smem_bytes, stream, 1, std::forward<Args>(args)...);
}

}  // namespace moelora::cuda
