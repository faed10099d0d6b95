// The CUDA runtime entry points fp8rt's NCCL backend calls, emulated on the host (host_gpu.h says
// the model): device memory is registered host memory, and streams execute work as it is
// enqueued. Errors are CUDA's codes, and the last one is kept per thread as CUDA does.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <set>

#include "kernels/cuda/device_pool.h"
#include "tests/hostgpu/host_gpu.h"

struct CUstream_st {
  unsigned flags = 0;
};
struct CUevent_st {
  unsigned flags = 0;
};

namespace {

struct Allocation {
  size_t bytes = 0;
  cudaMemoryType type = cudaMemoryTypeDevice;
};

struct Runtime {
  std::mutex mu;
  std::map<const char*, Allocation> allocations;  // by base address
  std::set<cudaStream_t> streams;
  std::set<cudaEvent_t> events;
};

Runtime& State() {
  static Runtime* runtime = new Runtime;  // outlives every static that frees memory at exit
  return *runtime;
}

thread_local cudaError_t last_error = cudaSuccess;
thread_local int current_device = 0;

cudaError_t Fail(cudaError_t e) {
  last_error = e;
  return e;
}

// The allocation that holds [p, p + bytes), if p lies in one; `inside` false when p does but the
// range runs past its end.
const Allocation* Find(Runtime& rt, const void* p, size_t bytes, bool* inside) {
  *inside = true;
  const char* c = static_cast<const char*>(p);
  auto it = rt.allocations.upper_bound(c);
  if (it == rt.allocations.begin()) return nullptr;
  --it;
  if (c >= it->first + it->second.bytes) return nullptr;
  *inside = c + bytes <= it->first + it->second.bytes;
  return &it->second;
}

cudaError_t Allocate(void** p, size_t bytes, cudaMemoryType type) {
  if (p == nullptr) return Fail(cudaErrorInvalidValue);
  // 256-byte aligned, as cudaMalloc's are; never null, even for 0 bytes.
  void* mem = std::aligned_alloc(256, ((bytes + 255) / 256) * 256 + 256);
  if (mem == nullptr) return Fail(cudaErrorMemoryAllocation);
  Runtime& rt = State();
  std::lock_guard<std::mutex> lock(rt.mu);
  rt.allocations[static_cast<const char*>(mem)] = Allocation{bytes, type};
  *p = mem;
  return cudaSuccess;
}

cudaError_t Release(void* p, cudaMemoryType type) {
  if (p == nullptr) return cudaSuccess;
  Runtime& rt = State();
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    auto it = rt.allocations.find(static_cast<const char*>(p));
    if (it == rt.allocations.end() || it->second.type != type) return Fail(cudaErrorInvalidValue);
    rt.allocations.erase(it);
  }
  std::free(p);
  return cudaSuccess;
}

bool LiveStream(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return true;
  Runtime& rt = State();
  std::lock_guard<std::mutex> lock(rt.mu);
  return rt.streams.count(s) != 0;
}

// Whether CUDA work may be enqueued on `s` now: a live stream that no NCCL call still
// ncclInProgress is about to use (`call` is counted as misuse otherwise).
cudaError_t Enqueue(cudaStream_t s, const char* call) {
  if (!LiveStream(s)) return Fail(cudaErrorInvalidResourceHandle);
  if (fp8rt::hostgpu::NcclHoldsStream(s, call)) return Fail(cudaErrorInvalidValue);
  return cudaSuccess;
}

bool ValidEvent(cudaEvent_t e) {
  Runtime& rt = State();
  std::lock_guard<std::mutex> lock(rt.mu);
  return rt.events.count(e) != 0;
}

// Whether [p, p + bytes) is device-addressable memory as a copy of this kind needs it: wholly
// inside one registered allocation. Plain host memory is fine where the kind says host.
bool Addressable(const void* p, size_t bytes, bool device) {
  Runtime& rt = State();
  std::lock_guard<std::mutex> lock(rt.mu);
  bool inside = true;
  const Allocation* a = Find(rt, p, bytes, &inside);
  if (a != nullptr && !inside) return false;  // runs past the end of its allocation
  return !device || a != nullptr;
}

cudaError_t Copy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  if (count == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return Fail(cudaErrorInvalidValue);
  const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (!Addressable(dst, count, dst_device) || !Addressable(src, count, src_device)) {
    return Fail(cudaErrorInvalidValue);
  }
  std::memmove(dst, src, count);
  return cudaSuccess;
}

cudaError_t Set(void* p, int value, size_t count) {
  if (count == 0) return cudaSuccess;
  if (p == nullptr || !Addressable(p, count, true)) return Fail(cudaErrorInvalidValue);
  std::memset(p, value, count);
  return cudaSuccess;
}

}  // namespace

namespace fp8rt::hostgpu {

bool DeviceRange(const void* p, size_t bytes) {
  return p != nullptr && Addressable(p, bytes == 0 ? 1 : bytes, true);
}
bool ValidStream(void* stream) { return LiveStream(static_cast<cudaStream_t>(stream)); }

}  // namespace fp8rt::hostgpu

namespace fp8rt::kernels::cuda_internal {

cudaError_t MallocFromDevicePool(void** p, size_t bytes, cudaStream_t stream) {
  if (const cudaError_t e = Enqueue(stream, "MallocFromDevicePool"); e != cudaSuccess) return e;
  return Allocate(p, bytes, cudaMemoryTypeDevice);
}

}  // namespace fp8rt::kernels::cuda_internal

extern "C" {

cudaError_t cudaMalloc(void** p, size_t bytes) { return Allocate(p, bytes, cudaMemoryTypeDevice); }
cudaError_t cudaFree(void* p) { return Release(p, cudaMemoryTypeDevice); }
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  return Allocate(p, bytes, cudaMemoryTypeHost);
}
cudaError_t cudaFreeHost(void* p) { return Release(p, cudaMemoryTypeHost); }
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
  if (const cudaError_t e = Enqueue(stream, "cudaFreeAsync"); e != cudaSuccess) return e;
  return Release(p, cudaMemoryTypeDevice);
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  return Copy(dst, src, count, kind);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (const cudaError_t e = Enqueue(stream, "cudaMemcpyAsync"); e != cudaSuccess) return e;
  return Copy(dst, src, count, kind);
}
cudaError_t cudaMemset(void* p, int value, size_t count) { return Set(p, value, count); }
cudaError_t cudaMemsetAsync(void* p, int value, size_t count, cudaStream_t stream) {
  if (const cudaError_t e = Enqueue(stream, "cudaMemsetAsync"); e != cudaSuccess) return e;
  return Set(p, value, count);
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* p) {
  if (attributes == nullptr) return Fail(cudaErrorInvalidValue);
  *attributes = cudaPointerAttributes{};
  attributes->type = cudaMemoryTypeUnregistered;
  attributes->device = -2;
  attributes->hostPointer = const_cast<void*>(p);
  Runtime& rt = State();
  std::lock_guard<std::mutex> lock(rt.mu);
  bool inside = true;
  if (const Allocation* a = Find(rt, p, 1, &inside); a != nullptr) {
    attributes->type = a->type;
    attributes->device = 0;
    attributes->devicePointer = const_cast<void*>(p);
    attributes->hostPointer = a->type == cudaMemoryTypeHost ? const_cast<void*>(p) : nullptr;
  }
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device != 0) return Fail(cudaErrorInvalidDevice);
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return Fail(cudaErrorInvalidValue);
  *device = current_device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return Fail(cudaErrorInvalidValue);
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) { return last_error; }
const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    default:
      return "cudaErrorUnknown";
  }
}
const char* cudaGetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "no error" : "error of the host emulation of CUDA (tests/hostgpu)";
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (stream == nullptr) return Fail(cudaErrorInvalidValue);
  auto* s = new CUstream_st{flags};
  Runtime& rt = State();
  std::lock_guard<std::mutex> lock(rt.mu);
  rt.streams.insert(s);
  *stream = s;
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  Runtime& rt = State();
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    if (rt.streams.erase(stream) == 0) return Fail(cudaErrorInvalidResourceHandle);
  }
  delete stream;
  return cudaSuccess;
}
// Work executes as it is enqueued: a valid stream is always idle.
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  return LiveStream(stream) ? cudaSuccess : Fail(cudaErrorInvalidResourceHandle);
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) { return cudaStreamQuery(stream); }
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  if (!ValidEvent(event)) return Fail(cudaErrorInvalidResourceHandle);
  if (const cudaError_t e = Enqueue(stream, "cudaStreamWaitEvent"); e != cudaSuccess) return e;
  return flags == 0 ? cudaSuccess : Fail(cudaErrorInvalidValue);
}
cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* data) {
  if (const cudaError_t e = Enqueue(stream, "cudaLaunchHostFunc"); e != cudaSuccess) return e;
  if (fn == nullptr) return Fail(cudaErrorInvalidValue);
  fn(data);
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (event == nullptr) return Fail(cudaErrorInvalidValue);
  auto* e = new CUevent_st{flags};
  Runtime& rt = State();
  std::lock_guard<std::mutex> lock(rt.mu);
  rt.events.insert(e);
  *event = e;
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  Runtime& rt = State();
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    if (rt.events.erase(event) == 0) return Fail(cudaErrorInvalidResourceHandle);
  }
  delete event;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (!ValidEvent(event)) return Fail(cudaErrorInvalidResourceHandle);
  return Enqueue(stream, "cudaEventRecord");
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  return ValidEvent(event) ? cudaSuccess : Fail(cudaErrorInvalidResourceHandle);
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) { return cudaEventQuery(event); }

}  // extern "C"
