// The CUDA backend when fp8rt is built without it (FP8RT_CUDA=OFF): every entry fails loudly.
#include "kernels/ops.h"

namespace fp8rt::kernels {
namespace {

absl::Status NotBuilt() {
  return absl::UnavailableError(
      "the CUDA backend is not built into this fp8rt (configure with -DFP8RT_CUDA=ON and nvcc)");
}

}  // namespace

absl::StatusOr<const OpTable*> CudaOps() { return NotBuilt(); }

int CudaDeviceCount(std::string* why) {
  if (why != nullptr) *why = "fp8rt was built without CUDA (FP8RT_CUDA=OFF)";
  return 0;
}

absl::Status UseCudaDevice(int ordinal) {
  (void)ordinal;
  return NotBuilt();
}

absl::StatusOr<std::string> CudaDevicePciBusId(int ordinal) {
  (void)ordinal;
  return NotBuilt();
}

}  // namespace fp8rt::kernels
