// Whether the CUDA backend can use a device's memory as it does (issue 23 point 5): the
// host reads and writes DeviceArrays once the compute stream is synchronised, while an FSDP
// prefetch or an NCCL collective may still run on another stream. That is legal only where the
// device reports concurrentManagedAccess (Linux on Pascal and later, with the open or proprietary
// driver); elsewhere (Windows, WSL, some virtualised GPUs) any host access to managed memory while
// any kernel runs faults. Header-only and CUDA-free, so that tests/gpu/device_math_host_test.cc
// checks the message on any machine; kernels/cuda/device.cu (UseCudaDevice) asks the device.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace fp8rt::kernels::cuda_internal {

// OK when concurrent_managed_access is nonzero; otherwise FailedPrecondition naming the device
// ordinal and what to do.
inline absl::Status CheckConcurrentManagedAccess(int ordinal, int concurrent_managed_access) {
  if (concurrent_managed_access != 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "CUDA device ", ordinal,
      " reports concurrentManagedAccess = 0: the host cannot touch managed memory while a "
      "kernel runs there (Windows, WSL and some virtualised GPUs), which fp8rt's CUDA backend "
      "does between streams; run on Linux with the GPU passed through, or use device: cpu"));
}

// OK when memory_pools_supported (cudaDevAttrMemoryPoolsSupported) is nonzero: the backend's
// device-only arrays come from a stream-ordered memory pool. Otherwise FailedPrecondition naming
// the device ordinal.
inline absl::Status CheckMemoryPools(int ordinal, int memory_pools_supported) {
  if (memory_pools_supported != 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "CUDA device ", ordinal,
      " does not support stream-ordered memory pools (cudaDevAttrMemoryPoolsSupported = 0), "
      "which fp8rt's CUDA backend allocates its device memory from; update the driver (CUDA "
      "11.2 or later), or use device: cpu"));
}

// OK when this build has kernels the device can run (has_kernel_image: cudaFuncGetAttributes on
// one of its kernels succeeded there); otherwise FailedPrecondition naming the device ordinal,
// its compute capability (major.minor) and the CMake option to rebuild with, instead of "no
// kernel image is available" at the first launch.
inline absl::Status CheckKernelImage(int ordinal, int major, int minor, bool has_kernel_image) {
  if (has_kernel_image) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "CUDA device ", ordinal, " has compute capability ", major, ".", minor,
      ", which this build has no kernels for (it was compiled for later GPUs); rebuild with "
      "-DCMAKE_CUDA_ARCHITECTURES=",
      major, minor, " (or \"native\"), or use device: cpu"));
}

}  // namespace fp8rt::kernels::cuda_internal
