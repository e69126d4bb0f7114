// CUDA error checking for the backend: every runtime call and every launch is checked.
// A failure is a runtime error (not an argument error): std::runtime_error with the
// call, the CUDA error string and the place.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace moelora::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line) {
  throw std::runtime_error(std::string("moelora CUDA error: ") + cudaGetErrorString(err) + " in " + what + " at " +
                           file + ":" + std::to_string(line));
}

}  // namespace moelora::cuda

#define MOELORA_CUDA_CHECK(call)                                                         \
  do {                                                                                   \
    const cudaError_t moelora_err_ = (call);                                             \
    if (moelora_err_ != cudaSuccess) ::moelora::cuda::throw_cuda_error(moelora_err_, #call, __FILE__, __LINE__); \
  } while (0)

// After a <<<...>>> launch: configuration errors surface here, without a sync.
#define MOELORA_CUDA_CHECK_LAUNCH() MOELORA_CUDA_CHECK(cudaGetLastError())
