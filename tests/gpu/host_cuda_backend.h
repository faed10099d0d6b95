// Stand-ins for the CUDA backend's device helpers (kernels/cuda/device.cu) and for the runtime
// calls its kernel files make (and for kernels/cuda/memory_cuda.cc and sort_cuda.cu, whose
// entries the kernel files' tables name), for a test that compiles one of those files as host code
// over the block emulator (host_cuda.h). The device they describe is an H100-like one (compute
// capability 9.0, 227 KiB of shared memory per block) with two multiprocessors, so that grids are
// small and the kernels' loops over further work items run.
//
// Use, in the test file: include host_cuda.h first, then the test's other headers, then
//   #define cuda_internal host_cuda_internal   // the backend's namespace, renamed
//   #include "tests/gpu/host_cuda_backend.h"
//   #include "kernels/cuda/<file>.cu"
//   #undef cuda_internal
// between `// clang-format off` and `// clang-format on` (clang-format would sort the two includes,
// which this header refuses with an #error). The renamed namespace keeps the host build of the file
// apart from the CUDA build of the same file in fp8rt_kernels. The file's calls of the runtime
// (cudaMemsetAsync, cudaMemcpyAsync, cudaFreeAsync, cudaGetLastError) are renamed by macros to the
// stand-ins below, which act at once on host memory (every launch has run when it returns);
// CUDA_RETURN_IF_ERROR returns the emulator's message with the failed call. Host memory stands for
// device memory: CheckDevicePointers accepts every pointer, so the entries' refusals of host
// pointers are the GPU tests' to show.
#ifndef FP8RT_TESTS_GPU_HOST_CUDA_BACKEND_H_
#define FP8RT_TESTS_GPU_HOST_CUDA_BACKEND_H_

#ifdef FP8RT_KERNELS_CUDA_LAUNCH_CUH_
#error "include tests/gpu/host_cuda_backend.h before the kernels' file"
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "runtime/core/checks.h"
#include "tests/gpu/host_cuda.h"

namespace fp8rt::kernels::host_cuda_internal {

inline constexpr int kSms = 2;
inline constexpr int kSharedOptin = 227 << 10;
inline constexpr int kSharedPerSm = 228 << 10;

// The emulator's message behind the last failed launch (GetLastError).
inline std::string& LastLaunchError() {
  static std::string error;
  return error;
}
// Stream-ordered scratch allocated and not yet freed.
inline int64_t& ScratchLive() {
  static int64_t live = 0;
  return live;
}

inline absl::StatusOr<DeviceFacts> CurrentDeviceFacts() {
  return DeviceFacts{kSms, 90, kSharedOptin};
}
inline absl::StatusOr<int> CurrentDeviceSmCount() { return kSms; }

// As the occupancy calculator: 2,048 threads and 228 KiB of shared memory per multiprocessor,
// 1 KiB of it reserved per block, 32 blocks at most.
inline absl::StatusOr<int> KernelBlocksPerSm(const void*, int threads, size_t dynamic_bytes) {
  const int by_threads = 2048 / threads;
  const int by_memory = static_cast<int>(kSharedPerSm / (dynamic_bytes + 1024));
  return std::min({by_threads, by_memory, 32});
}

// Only ever raises a kernel's limit, as device.cu's.
inline absl::Status AllowDynamicSharedMemory(const void* kernel, int bytes) {
  static std::map<const void*, int> allowed;
  if (bytes > kSharedOptin) return absl::InvalidArgumentError("more shared memory than sm_90's");
  int& limit = allowed[kernel];
  if (bytes > limit) {
    limit = bytes;
    host_cuda::SetMaxDynamicSharedMemory(kernel, bytes);
  }
  return absl::OkStatus();
}

inline int64_t GridFor(int64_t work, int threads, int sm_count, int per_sm) {
  const int64_t needed = std::max<int64_t>(1, (work + threads - 1) / threads);
  return std::min<int64_t>(needed, static_cast<int64_t>(std::max(sm_count, 1)) * per_sm);
}

// Host memory stands for device memory here: only null pointers are left to the entries.
inline absl::Status CheckDevicePointers(
    std::initializer_list<std::pair<const char*, const void*>>) {
  return absl::OkStatus();
}

// Host memory at CUDA's allocation alignment (256 bytes: cudaMalloc's and the pools' is at least
// that), at least one byte.
inline void* DeviceLikeAlloc(size_t bytes) {
  return std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
}

inline absl::StatusOr<void*> AllocateOnStream(const char*, size_t bytes, Stream) {
  ++ScratchLive();
  return DeviceLikeAlloc(bytes);
}

// kernels/cuda/sort_cuda.cu's radix sort: a stable sort by the key (every key is below
// 2^end_bit), so equal keys keep their input order, as CUB's. No scratch is needed.
inline absl::Status SortKeyRowPairsCuda(void* scratch, size_t* scratch_bytes,
                                        const uint32_t* keys_in, uint32_t* keys_out,
                                        const int64_t* rows_in, int64_t* rows_out, int64_t n,
                                        int end_bit, Stream) {
  if (scratch == nullptr) {
    *scratch_bytes = 0;
    return absl::OkStatus();
  }
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (end_bit < 32 && (keys_in[i] >> end_bit) != 0) {
      return absl::InternalError("SortKeyRowPairsCuda: a key has bits at or above end_bit");
    }
    order[static_cast<size_t>(i)] = i;
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return keys_in[a] < keys_in[b]; });
  for (int64_t i = 0; i < n; ++i) {
    keys_out[i] = keys_in[order[static_cast<size_t>(i)]];
    rows_out[i] = rows_in[order[static_cast<size_t>(i)]];
  }
  return absl::OkStatus();
}

// kernels/cuda/memory_cuda.cc's entries: host memory for every kind, the copies at once.
inline absl::Status SynchronizeCuda(Stream) { return absl::OkStatus(); }
inline absl::StatusOr<void*> AllocateCuda(size_t bytes) { return DeviceLikeAlloc(bytes); }
inline void DeallocateCuda(void* p) { std::free(p); }
inline absl::StatusOr<void*> AllocateDeviceCuda(size_t bytes) { return AllocateCuda(bytes); }
inline absl::StatusOr<void*> AllocateHostCuda(size_t bytes) { return AllocateCuda(bytes); }
inline absl::Status ZeroBytesCuda(void* p, size_t bytes, Stream) {
  if (bytes > 0) std::memset(p, 0, bytes);
  return absl::OkStatus();
}
inline absl::Status PrefetchCuda(const void*, size_t, Stream) { return absl::OkStatus(); }
inline absl::Status CopyBytesCuda(void* dst, const void* src, size_t bytes, Stream) {
  if (bytes > 0) std::memmove(dst, src, bytes);
  return absl::OkStatus();
}

inline cudaError_t FreeAsync(void* p, cudaStream_t) {
  --ScratchLive();
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t MemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t MemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                               cudaStream_t) {
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t GetLastError() {
  LastLaunchError() = host_cuda::TakeLaunchError();
  return LastLaunchError().empty() ? cudaSuccess : cudaErrorLaunchFailure;
}

}  // namespace fp8rt::kernels::host_cuda_internal

#define cudaFreeAsync FreeAsync
#define cudaMemsetAsync MemsetAsync
#define cudaMemcpyAsync MemcpyAsync
#define cudaGetLastError GetLastError

#undef CUDA_RETURN_IF_ERROR
#define CUDA_RETURN_IF_ERROR(expr)                                                         \
  do {                                                                                     \
    if ((expr) != cudaSuccess) {                                                           \
      return absl::InternalError(std::string(#expr) + " failed: " +                        \
                                 ::fp8rt::kernels::host_cuda_internal::LastLaunchError()); \
    }                                                                                      \
  } while (false)

#endif  // FP8RT_TESTS_GPU_HOST_CUDA_BACKEND_H_
