// Registration site of the CUDA backend. The FP8 kernels, cuBLASLt GEMMs and NCCL are the work
// of a later change (issue 8); until then the table is not offered and says so.
#include <string>

#include "kernels/ops.h"

namespace fp8rt::kernels {
namespace cuda_internal {
int DeviceCount(std::string* why);
}  // namespace cuda_internal

int CudaDeviceCount(std::string* why) { return cuda_internal::DeviceCount(why); }

absl::StatusOr<const OpTable*> CudaOps() {
  std::string why;
  if (CudaDeviceCount(&why) == 0) return absl::UnavailableError("no CUDA device: " + why);
  return absl::UnimplementedError(
      "the CUDA op table (quantize, GEMM) is not implemented yet: the CPU backend is the only "
      "one in this build");
}

}  // namespace fp8rt::kernels
