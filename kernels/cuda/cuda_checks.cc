// CUDA error codes as Status (the formatter behind CUDA_RETURN_IF_ERROR in runtime/core/checks.h).
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "runtime/core/checks.h"

namespace fp8rt::internal {

absl::Status CudaErrorStatus(int code, const char* expr, const char* file, int line) {
  const auto err = static_cast<cudaError_t>(code);
  return absl::InternalError(absl::StrCat(expr, " failed at ", file, ":", line, ": CUDA error ",
                                          code, " ", cudaGetErrorName(err), " (",
                                          cudaGetErrorString(err), ")"));
}

}  // namespace fp8rt::internal
