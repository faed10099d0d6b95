// The CUDA backend's memory and stream entries of the layer-op table (LayerOps,
// kernels/layer_ops.h: synchronize, allocate, deallocate, allocate_device, allocate_host,
// zero_bytes, prefetch, copy_bytes; kernels/cuda/layer_ops_cuda.cu puts them into kLayerOps), the
// stream-ordered scratch of the kernels' entries (AllocateOnStream) and fp8rt's device memory pool
// (kernels/cuda/device_pool.h). Host code over the CUDA runtime: no kernels here, so the kernel
// files stay free of it and run on the CPU over the block emulator of tests/gpu/host_cuda.h
// (tests/gpu/host_cuda_backend.h stands in for this file there).
//
//   allocate / deallocate    cudaMallocManaged / cudaFree (the table's memory, DeviceArray)
//   allocate_device          cudaMallocFromPoolAsync on the default stream, from a pool that
//                            keeps freed memory (DeviceArray's device-only arrays; freed with
//                            cudaFreeAsync there: no wait)
//   allocate_host            cudaHostAlloc, mapped (host-read arrays)
//   zero_bytes, prefetch, copy_bytes   cudaMemsetAsync, cudaMemPrefetchAsync, cudaMemcpyAsync
//   deallocate               cudaFreeAsync, cudaFree or cudaFreeHost, as the registry says
//   synchronize              cudaStreamSynchronize
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/allocation_registry.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/cuda/device_pool.h"
#include "kernels/ops.h"
#include "runtime/core/checks.h"
#include "runtime/core/status.h"

namespace fp8rt::kernels::cuda_internal {
namespace {

cudaStream_t ToCuda(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

// The pool the backend's device-only arrays and stream-ordered scratch come from, and NCCL's
// staging of host values (MallocFromDevicePool): one per device, created on first use and kept
// for the life of the process. It keeps what is freed for reuse (its release threshold is at the
// maximum; a pool's default, 0, hands freed memory back to the driver at every synchronisation
// and maps it again at the next allocation), as a caching allocator does. Memory it keeps is not
// available to allocations outside it (managed memory, cuBLAS's and NCCL's own): the backend's
// allocations that fail (but NCCL's staging, which must not wait for the device) give it back
// (TrimPoolAndRetry) and try once more. Leaked on purpose (no destructor runs at exit), as
// BackendAllocations is.
std::mutex& PoolsMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::map<int, cudaMemPool_t>& Pools() {  // device -> its pool; guarded by PoolsMutex()
  static auto* pools = new std::map<int, cudaMemPool_t>;
  return *pools;
}

// The current device's pool in *pool; a CUDA error (cleared, so that the next launch's
// cudaGetLastError does not report it) when it cannot be made.
cudaError_t DeviceArrayPool(cudaMemPool_t* pool) {
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    (void)cudaGetLastError();
    return err;
  }
  std::lock_guard<std::mutex> lock(PoolsMutex());
  if (const auto it = Pools().find(device); it != Pools().end()) {
    *pool = it->second;
    return cudaSuccess;
  }
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t created = nullptr;
  if (const cudaError_t err = cudaMemPoolCreate(&created, &props); err != cudaSuccess) {
    (void)cudaGetLastError();
    return err;
  }
  uint64_t keep_all = UINT64_MAX;
  if (const cudaError_t err =
          cudaMemPoolSetAttribute(created, cudaMemPoolAttrReleaseThreshold, &keep_all);
      err != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaMemPoolDestroy(created);
    return err;
  }
  Pools().emplace(device, created);
  *pool = created;
  return cudaSuccess;
}

// `allocate` once; if the device is out of memory, the unused memory of the current device's
// pool goes back to the driver (after a device synchronisation, so that the frees still queued
// have happened) and `allocate` runs again. An error of the synchronisation or the trim (a sticky
// error of an earlier kernel, say) is returned instead of the out-of-memory, so that it is the one
// reported.
template <class F>
cudaError_t TrimPoolAndRetry(F allocate) {
  const cudaError_t err = allocate();
  if (err != cudaErrorMemoryAllocation) return err;
  int device = 0;
  cudaMemPool_t pool = nullptr;
  if (cudaGetDevice(&device) != cudaSuccess) return err;
  {
    std::lock_guard<std::mutex> lock(PoolsMutex());
    const auto it = Pools().find(device);
    if (it == Pools().end()) return err;  // no pool yet: nothing kept
    pool = it->second;
  }
  (void)cudaGetLastError();  // the first attempt's out-of-memory
  if (const cudaError_t sync = cudaDeviceSynchronize(); sync != cudaSuccess) return sync;
  if (const cudaError_t trim = cudaMemPoolTrimTo(pool, 0); trim != cudaSuccess) return trim;
  return allocate();
}

}  // namespace

cudaError_t MallocFromDevicePool(void** p, size_t bytes, cudaStream_t stream) {
  cudaMemPool_t pool = nullptr;
  if (const cudaError_t err = DeviceArrayPool(&pool); err != cudaSuccess) return err;
  return cudaMallocFromPoolAsync(p, bytes, pool, stream);
}

cudaError_t TrimDevicePool() {
  cudaMemPool_t pool = nullptr;
  if (const cudaError_t err = DeviceArrayPool(&pool); err != cudaSuccess) return err;
  if (const cudaError_t sync = cudaDeviceSynchronize(); sync != cudaSuccess) return sync;
  return cudaMemPoolTrimTo(pool, 0);
}

namespace {

// A failed allocation's error: `what` (which names the size and the kind of memory), then CUDA's
// name and text of `err`. Only a full device is ResourceExhausted: any other error (a device
// without memory pools, or a sticky error of an earlier kernel that a retry's synchronisation met)
// is Internal, named as what it is. A failed allocation is not a sticky error, but it stays as the
// thread's last error; it is cleared here so that the next launch's cudaGetLastError does not
// report it.
absl::Status AllocationError(const std::string& what, cudaError_t err) {
  (void)cudaGetLastError();
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  return err == cudaErrorMemoryAllocation ? absl::ResourceExhaustedError(message)
                                          : absl::InternalError(message);
}

}  // namespace

// Declared in cuda_ops_internal.h: stream-ordered scratch from the device's array pool
// (MallocFromDevicePool; when the device is full, the pool's unused memory goes back to the
// driver and the allocation runs once more: a large free block may be what it lacks). On
// failure, AllocationError's status.
absl::StatusOr<void*> AllocateOnStream(const char* op, size_t bytes, Stream stream) {
  void* p = nullptr;
  const cudaError_t err =
      TrimPoolAndRetry([&] { return MallocFromDevicePool(&p, bytes, ToCuda(stream)); });
  if (err == cudaSuccess) return p;
  return AllocationError(absl::StrCat(op, ": allocating ", bytes, " bytes of scratch"), err);
}

namespace {

// An allocation's result: p registered (BackendAllocations) and returned, or AllocationError's
// status naming the size and the kind of memory. Every allocation is at least one byte, so that
// 0 bytes gives a valid pointer.
absl::StatusOr<void*> Registered(cudaError_t err, void* p, size_t bytes, const char* kind,
                                 AllocationRegistry::Kind registry_kind) {
  if (err != cudaSuccess) {
    return AllocationError(absl::StrCat("allocating ", bytes, " bytes of ", kind), err);
  }
  BackendAllocations().Add(p, std::max<size_t>(bytes, 1), registry_kind);
  return p;
}

}  // namespace

absl::Status SynchronizeCuda(Stream stream) {
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ToCuda(stream)));
  return absl::OkStatus();
}

// Managed memory on the current device.
absl::StatusOr<void*> AllocateCuda(size_t bytes) {
  void* p = nullptr;
  const cudaError_t err =
      TrimPoolAndRetry([&] { return cudaMallocManaged(&p, std::max<size_t>(bytes, 1)); });
  return Registered(err, p, bytes, "CUDA managed memory", AllocationRegistry::Kind::kDevice);
}

// Device memory on the current device, from its array pool, ordered on the legacy default
// stream (where the model's ops run; other blocking streams, such as NCCL's, synchronise with
// it, and the one non-blocking stream, the FSDP prefetch's, waits on an event recorded there).
// The host never touches it: no managed pages migrate on first touch. Its free (deallocate) is
// ordered on the same stream after the work already queued, so it does not wait for the device,
// where cudaFree would on every buffer the step frees (FSDP's gathered weights and gradients,
// the MoE's temporaries).
absl::StatusOr<void*> AllocateDeviceCuda(size_t bytes) {
  void* p = nullptr;
  const cudaError_t err = TrimPoolAndRetry(
      [&] { return MallocFromDevicePool(&p, std::max<size_t>(bytes, 1), cudaStreamLegacy); });
  return Registered(err, p, bytes, "CUDA device memory", AllocationRegistry::Kind::kStreamOrdered);
}

// Pinned, mapped host memory; with unified addressing its device pointer is the host pointer.
absl::StatusOr<void*> AllocateHostCuda(size_t bytes) {
  void* p = nullptr;
  const cudaError_t err =
      cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocMapped | cudaHostAllocPortable);
  return Registered(err, p, bytes, "pinned host memory", AllocationRegistry::Kind::kPinnedHost);
}

absl::Status ZeroBytesCuda(void* p, size_t bytes, Stream stream) {
  if (bytes == 0) return absl::OkStatus();
  if (p == nullptr) return absl::InvalidArgumentError("zero_bytes: p is null");
  FP8RT_RETURN_IF_ERROR(CheckDevicePointers({{"p", p}}));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p, 0, bytes, ToCuda(stream)));
  return absl::OkStatus();
}

absl::Status CopyBytesCuda(void* dst, const void* src, size_t bytes, Stream stream) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError("copy_bytes: dst is null");
  if (src == nullptr) return absl::InvalidArgumentError("copy_bytes: src is null");
  FP8RT_RETURN_IF_ERROR(CheckDevicePointers({{"copy_bytes: dst", dst}, {"copy_bytes: src", src}}));
  // cudaMemcpyDefault: unified addressing tells device, managed and pinned memory apart.
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, ToCuda(stream)));
  return absl::OkStatus();
}

absl::Status PrefetchCuda(const void* p, size_t bytes, Stream stream) {
  if (bytes == 0 || p == nullptr) return absl::OkStatus();
  int device = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  cudaMemLocation location{};
  location.type = cudaMemLocationTypeDevice;
  location.id = device;
  CUDA_RETURN_IF_ERROR(cudaMemPrefetchAsync(p, bytes, location, 0, ToCuda(stream)));
  return absl::OkStatus();
}

// Device-only memory (allocate_device) goes back with cudaFreeAsync on the legacy default
// stream, after the work queued there (no wait); pinned host memory (allocate_host) with
// cudaFreeHost and managed memory with cudaFree, which wait for the device. The registry says
// which; only a pointer it does not know costs a runtime query. An error (a pointer allocate did
// not give) has nowhere to go from a void entry and is cleared rather than left for the next
// launch to report.
void DeallocateCuda(void* p) {
  if (p == nullptr) return;
  const AllocationRegistry::Kind kind = BackendAllocations().Remove(p);
  cudaError_t err = cudaSuccess;
  if (kind == AllocationRegistry::Kind::kStreamOrdered) {
    err = cudaFreeAsync(p, cudaStreamLegacy);
  } else {
    bool pinned = kind == AllocationRegistry::Kind::kPinnedHost;
    if (kind == AllocationRegistry::Kind::kUnknown) {
      cudaPointerAttributes attr{};
      pinned = cudaPointerGetAttributes(&attr, p) == cudaSuccess && attr.type == cudaMemoryTypeHost;
    }
    err = pinned ? cudaFreeHost(p) : cudaFree(p);
  }
  if (err != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace fp8rt::kernels::cuda_internal
