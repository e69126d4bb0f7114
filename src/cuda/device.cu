// Device queries for the CUDA backend.
#include "common/params.h"
#include "cuda/cuda_check.h"

namespace moelora::cuda {

bool device_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error so later checks stay clean
    return false;
  }
  return count > 0;
}

}  // namespace moelora::cuda
