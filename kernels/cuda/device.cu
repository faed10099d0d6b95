// CUDA device discovery and selection (UseCudaDevice, kernels/ops.h), and the small per-device
// facts the kernels size their launches with.
// Any error from the runtime (35 = no driver, 100 = no device) means "no GPU here"; the reason is
// passed up so that GPU tests can say why they skip.
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/allocation_registry.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/cuda/managed_access.h"
#include "runtime/core/checks.h"
#include "runtime/core/status.h"

namespace fp8rt::kernels::cuda_internal {

int DeviceCount(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why != nullptr) {
      *why = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(err) + " (" +
             cudaGetErrorString(err) + ")";
    }
    (void)cudaGetLastError();  // not sticky; do not leave it for the next caller to find
    return 0;
  }
  if (count == 0 && why != nullptr) *why = "the CUDA runtime reports no device";
  return count;
}

absl::StatusOr<DeviceFacts> CurrentDeviceFacts() {
  static std::mutex mu;
  static auto* facts = new std::unordered_map<int, DeviceFacts>();  // Guarded by mu
  int device = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  auto it = facts->find(device);
  if (it != facts->end()) return it->second;
  DeviceFacts f;
  int major = 0, minor = 0;
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&f.sm_count, cudaDevAttrMultiProcessorCount, device));
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  f.compute_capability = major * 10 + minor;
  CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&f.shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  (*facts)[device] = f;
  return f;
}

absl::StatusOr<int> CurrentDeviceSmCount() {
  absl::StatusOr<DeviceFacts> f = CurrentDeviceFacts();
  if (!f.ok()) return f.status();
  return f->sm_count;
}

absl::StatusOr<int> CurrentDeviceComputeCapability() {
  absl::StatusOr<DeviceFacts> f = CurrentDeviceFacts();
  if (!f.ok()) return f.status();
  return f->compute_capability;
}

absl::StatusOr<int> CurrentDeviceSharedMemoryOptin() {
  absl::StatusOr<DeviceFacts> f = CurrentDeviceFacts();
  if (!f.ok()) return f.status();
  return f->shared_optin;
}

AllocationRegistry& BackendAllocations() {
  static auto* registry = new AllocationRegistry();
  return *registry;
}

absl::Status CheckDevicePointers(std::initializer_list<std::pair<const char*, const void*>> ptrs) {
  const AllocationRegistry& own = BackendAllocations();
  for (const auto& [field, ptr] : ptrs) {
    // The backend's own allocations (every DeviceArray) answer from the registry; only pointers
    // from elsewhere (a caller's cudaMalloc, pinned host memory, a mistake) ask the runtime.
    if (ptr == nullptr || own.Contains(ptr)) continue;
    cudaPointerAttributes attr{};
    const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": cudaPointerGetAttributes failed (", cudaGetErrorString(err), ")"));
    }
    const bool addressable = attr.type == cudaMemoryTypeDevice ||
                             attr.type == cudaMemoryTypeManaged ||
                             (attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr);
    if (!addressable) {
      return absl::InvalidArgumentError(
          absl::StrCat(field,
                       " is not device memory (the CUDA ops take cudaMalloc'd, managed or "
                       "mapped pinned buffers)"));
    }
  }
  return absl::OkStatus();
}

namespace {

// compute() for (kernel, param, bytes) on the current device, asked once and remembered.
template <class Compute>
absl::StatusOr<int> OncePerKernel(const void* kernel, int param, size_t bytes,
                                  const Compute& compute) {
  struct Key {
    const void* kernel;
    int param;
    size_t bytes;
    int device;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(k.kernel) ^ (static_cast<size_t>(k.param) << 20) ^
             (k.bytes << 36) ^ static_cast<size_t>(k.device);
    }
  };
  static std::mutex mu;
  static auto* known = new std::unordered_map<Key, int, KeyHash>();  // Guarded by mu
  int device = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  const Key key{kernel, param, bytes, device};
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = known->find(key); it != known->end()) return it->second;
  }
  absl::StatusOr<int> value = compute();
  if (!value.ok()) return value.status();
  std::lock_guard<std::mutex> lock(mu);
  (*known)[key] = *value;
  return *value;
}

}  // namespace

absl::StatusOr<int> KernelBlocksPerSm(const void* kernel, int threads, size_t dynamic_bytes) {
  return OncePerKernel(kernel, threads, dynamic_bytes, [&]() -> absl::StatusOr<int> {
    int per_sm = 0;
    CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic_bytes));
    return per_sm;
  });
}

// The attribute holds one value per kernel and device, and each set replaces it, a smaller value
// included: remembering every (kernel, bytes) once would let a later launch of more bytes skip the
// set after a smaller one lowered the limit (and a thread lower it under another's launch). So it
// is only ever raised, to the most any launch has asked for, under the lock; a launch of fewer
// bytes runs under the higher limit.
absl::Status AllowDynamicSharedMemory(const void* kernel, int bytes) {
  static std::mutex mu;
  static auto* highest = new std::map<std::pair<const void*, int>, int>();  // Guarded by mu
  int device = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  int& have = (*highest)[{kernel, device}];
  if (bytes <= have) return absl::OkStatus();
  CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  have = bytes;
  return absl::OkStatus();
}

// A kernel of this file, asked only whether the build holds code the device can run.
__global__ void ProbeKernel() {}

int64_t GridFor(int64_t work, int threads, int sm_count, int per_sm) {
  const int64_t needed = std::max<int64_t>(1, (work + threads - 1) / threads);
  return std::min<int64_t>(needed, static_cast<int64_t>(std::max(sm_count, 1)) * per_sm);
}

}  // namespace fp8rt::kernels::cuda_internal

namespace fp8rt::kernels {
namespace {

// Unavailable without a device; InvalidArgument for an ordinal outside the visible ones.
absl::Status CheckOrdinal(int ordinal) {
  std::string why;
  const int count = cuda_internal::DeviceCount(&why);
  if (count == 0) return absl::UnavailableError("no CUDA device: " + why);
  if (ordinal < 0 || ordinal >= count) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", ordinal, " does not exist (",
                                                   count, " device", count == 1 ? "" : "s",
                                                   " visible)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status UseCudaDevice(int ordinal) {
  FP8RT_RETURN_IF_ERROR(CheckOrdinal(ordinal));
  const cudaError_t err = cudaSetDevice(ordinal);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("cudaSetDevice(", ordinal,
                                               ") failed: ", cudaGetErrorName(err), " (",
                                               cudaGetErrorString(err), ")"));
  }
  int concurrent = 0;
  CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&concurrent, cudaDevAttrConcurrentManagedAccess, ordinal));
  FP8RT_RETURN_IF_ERROR(cuda_internal::CheckConcurrentManagedAccess(ordinal, concurrent));
  int pools = 0;
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, ordinal));
  FP8RT_RETURN_IF_ERROR(cuda_internal::CheckMemoryPools(ordinal, pools));
  int major = 0, minor = 0;
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal));
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal));
  cudaFuncAttributes attr{};
  const cudaError_t image = cudaFuncGetAttributes(&attr, cuda_internal::ProbeKernel);
  if (image != cudaSuccess) (void)cudaGetLastError();  // not sticky: the answer, not a fault
  if (image != cudaSuccess && image != cudaErrorNoKernelImageForDevice &&
      image != cudaErrorInvalidDeviceFunction) {
    return ::fp8rt::internal::CudaErrorStatus(image, "cudaFuncGetAttributes(ProbeKernel)", __FILE__,
                                              __LINE__);
  }
  return cuda_internal::CheckKernelImage(ordinal, major, minor, image == cudaSuccess);
}

absl::StatusOr<std::string> CudaDevicePciBusId(int ordinal) {
  FP8RT_RETURN_IF_ERROR(CheckOrdinal(ordinal));
  char id[64] = {};  // "dddd:bb:dd.f" and its NUL fit in 16; room to spare
  CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(id, static_cast<int>(sizeof(id)), ordinal));
  return std::string(id);
}

}  // namespace fp8rt::kernels
