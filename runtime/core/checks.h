// Library error codes become absl::Status here, in one place: each macro records the failing
// expression, file:line and the library's own error string. The formatting functions are
// defined next to the backend that links the library (parallel/mpi/, parallel/nccl/,
// kernels/cuda/), so this header includes no library header: MPI_SUCCESS, ncclSuccess and
// cudaSuccess must be visible where a macro is used.
#ifndef FP8RT_RUNTIME_CORE_CHECKS_H_
#define FP8RT_RUNTIME_CORE_CHECKS_H_

#include "absl/status/status.h"

namespace fp8rt::internal {
absl::Status MpiErrorStatus(int code, const char* expr, const char* file, int line);
absl::Status NcclErrorStatus(int code, const char* expr, const char* file, int line);
absl::Status CudaErrorStatus(int code, const char* expr, const char* file, int line);
}  // namespace fp8rt::internal

#define MPI_RETURN_IF_ERROR(expr)                                                         \
  do {                                                                                    \
    const int fp8rt_mpi_rc_ = (expr);                                                     \
    if (fp8rt_mpi_rc_ != MPI_SUCCESS) {                                                   \
      return ::fp8rt::internal::MpiErrorStatus(fp8rt_mpi_rc_, #expr, __FILE__, __LINE__); \
    }                                                                                     \
  } while (false)

#define NCCL_RETURN_IF_ERROR(expr)                                                          \
  do {                                                                                      \
    const int fp8rt_nccl_rc_ = static_cast<int>(expr);                                      \
    if (fp8rt_nccl_rc_ != static_cast<int>(ncclSuccess)) {                                  \
      return ::fp8rt::internal::NcclErrorStatus(fp8rt_nccl_rc_, #expr, __FILE__, __LINE__); \
    }                                                                                       \
  } while (false)

#define CUDA_RETURN_IF_ERROR(expr)                                                          \
  do {                                                                                      \
    const int fp8rt_cuda_rc_ = static_cast<int>(expr);                                      \
    if (fp8rt_cuda_rc_ != static_cast<int>(cudaSuccess)) {                                  \
      return ::fp8rt::internal::CudaErrorStatus(fp8rt_cuda_rc_, #expr, __FILE__, __LINE__); \
    }                                                                                       \
  } while (false)

#endif  // FP8RT_RUNTIME_CORE_CHECKS_H_
