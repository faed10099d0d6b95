// CUDA device discovery. Any error from the runtime (35 = no driver, 100 = no device) means
// "no GPU here"; the reason is passed up so that GPU tests can say why they skip.
#include <cuda_runtime.h>

#include <string>

namespace fp8rt::kernels::cuda_internal {

int DeviceCount(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why != nullptr) {
      *why = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(err) + " (" +
             cudaGetErrorString(err) + ")";
    }
    return 0;
  }
  if (count == 0 && why != nullptr) *why = "the CUDA runtime reports no device";
  return count;
}

}  // namespace fp8rt::kernels::cuda_internal
