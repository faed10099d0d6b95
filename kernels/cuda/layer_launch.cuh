// The layer-op entries' launch helpers, shared by the files that hold them
// (kernels/cuda/layer_ops_cuda.cu, kernels/cuda/moe_cuda.cu): argument checks with the CPU
// entries' messages, the launch, and grid sizes. Included by .cu files only.
#ifndef FP8RT_KERNELS_CUDA_LAYER_LAUNCH_CUH_
#define FP8RT_KERNELS_CUDA_LAYER_LAUNCH_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/ops.h"
#include "runtime/core/checks.h"
#include "runtime/core/status.h"

namespace fp8rt::kernels::cuda_internal::layer_launch {

inline constexpr int kThreads = 256;

inline cudaStream_t ToCuda(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

// InvalidArgument naming the first negative size (the CPU entries' message).
inline absl::Status CheckSizes(const char* op,
                               std::initializer_list<std::pair<const char*, int64_t>> s) {
  for (const auto& [name, value] : s) {
    if (value < 0) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is ", value, " (< 0)"));
    }
  }
  return absl::OkStatus();
}

// InvalidArgument naming the op and the pointer unless every pointer is non-null device memory.
// Called only when the op has work: a null pointer then would fault on the device.
inline absl::Status CheckPointers(const char* op,
                                  std::initializer_list<std::pair<const char*, const void*>> ptrs) {
  for (const auto& [name, ptr] : ptrs) {
    if (ptr == nullptr) return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is null"));
  }
  const absl::Status s = CheckDevicePointers(ptrs);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(op, ": ", s.message()));
  return absl::OkStatus();
}

template <class Kernel, class... Args>
absl::Status Launch(Kernel kernel, dim3 grid, dim3 block, Stream stream, Args... args) {
  FP8RT_LAUNCH(kernel, grid, block, 0, ToCuda(stream))(args...);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// Enough blocks of `threads` threads for `work_items`, at most 8 per multiprocessor (the kernels
// loop over the rest).
inline absl::StatusOr<dim3> GridOf(int64_t work_items, int threads = kThreads) {
  FP8RT_ASSIGN_OR_RETURN(const int sms, CurrentDeviceSmCount());
  return dim3(static_cast<unsigned>(cuda_internal::GridFor(work_items, threads, sms)));
}

// One block per row (or item), kThreads threads each.
inline absl::StatusOr<dim3> GridOfRows(int64_t rows) { return GridOf(rows * kThreads); }

}  // namespace fp8rt::kernels::cuda_internal::layer_launch

#endif  // FP8RT_KERNELS_CUDA_LAYER_LAUNCH_CUH_
