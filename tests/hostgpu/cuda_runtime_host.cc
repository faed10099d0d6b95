// The CUDA runtime entry points fp8rt's NCCL backend calls, emulated on the host (host_gpu.h says
// the model): device memory is registered host memory, and streams are queues of work that the
// emulated device runs in stream order. Errors are CUDA's codes, and the last one is kept per
// thread as CUDA does.
//
// Locks: `dev_mu` (the streams and events; work runs with it held) is taken before `rt.mu` (the
// allocations), never after; nccl_host.cc's lock is taken before both, and never while either is
// held here.
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/cuda/device_pool.h"
#include "tests/hostgpu/host_gpu.h"

namespace {

// A piece of work on a stream: runs (step() returns true once done) when every (stream, n) it
// depends on has done its n-th piece.
struct Work {
  std::function<bool()> step;
  std::vector<std::pair<CUstream_st*, uint64_t>> after;
};

}  // namespace

struct CUstream_st {
  unsigned flags = 0;
  bool legacy = false;
  bool live = true;  // destroyed streams finish their work; the object is never freed
  std::deque<Work> queue;
  uint64_t enqueued = 0;  // pieces of work ever enqueued; the n-th is done when done >= n
  uint64_t done = 0;
};
struct CUevent_st {
  unsigned flags = 0;
  CUstream_st* stream = nullptr;  // of the last record (null: never recorded)
  uint64_t index = 0;
};

namespace {

enum Kind : int { kNone = 0, kDevice = 1, kPool = 2, kPinned = 3 };

struct Allocation {
  size_t bytes = 0;
  Kind kind = kDevice;
};

struct Runtime {
  std::mutex mu;
  std::map<const char*, Allocation> allocations;  // by base address
  std::set<cudaEvent_t> events;
};

Runtime& State() {
  static Runtime* runtime = new Runtime;  // outlives every static that frees memory at exit
  return *runtime;
}

std::recursive_mutex dev_mu;
CUstream_st& LegacyStream() {
  static auto* legacy = [] {
    auto* s = new CUstream_st;
    s->legacy = true;
    return s;
  }();
  return *legacy;
}
std::vector<CUstream_st*>& Streams() {  // every stream but the legacy one, ever created
  static auto* streams = new std::vector<CUstream_st*>;
  return *streams;
}
int query_ticks = 0;  // queries since the device last ran (lazy streams)
std::atomic<int64_t> lazy_progress_runs{
    0};  // host waits that ran every stream (lazy_progress_after)

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

cudaError_t Allocate(void** p, size_t bytes, Kind kind) {
  if (p == nullptr) return Fail(cudaErrorInvalidValue);
  // 256-byte aligned, as cudaMalloc's are; never null, even for 0 bytes.
  void* mem = std::aligned_alloc(256, ((bytes + 255) / 256) * 256 + 256);
  if (mem == nullptr) return Fail(cudaErrorMemoryAllocation);
  Runtime& rt = State();
  std::lock_guard<std::mutex> lock(rt.mu);
  rt.allocations[static_cast<const char*>(mem)] = Allocation{bytes, kind};
  *p = mem;
  return cudaSuccess;
}

cudaError_t Release(void* p, bool pinned) {
  if (p == nullptr) return cudaSuccess;
  Runtime& rt = State();
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    auto it = rt.allocations.find(static_cast<const char*>(p));
    if (it == rt.allocations.end() || (it->second.kind == kPinned) != pinned) {
      return Fail(cudaErrorInvalidValue);
    }
    rt.allocations.erase(it);
  }
  std::free(p);
  return cudaSuccess;
}

Kind KindOf(const void* p, size_t bytes, bool* inside) {
  Runtime& rt = State();
  std::lock_guard<std::mutex> lock(rt.mu);
  const Allocation* a = Find(rt, p, bytes, inside);
  return a == nullptr ? kNone : a->kind;
}

// The stream object of a handle: the null, legacy and per-thread handles are the legacy stream.
// Null for a handle that is no live stream.
// `dead`: also a destroyed stream (which still runs the work enqueued before).
CUstream_st* StreamOf(cudaStream_t s, bool dead = false) {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return &LegacyStream();
  std::lock_guard<std::recursive_mutex> lock(dev_mu);
  for (CUstream_st* x : Streams()) {
    if (x == s) return x->live || dead ? x : nullptr;
  }
  return nullptr;
}

bool ValidEvent(cudaEvent_t e) {
  Runtime& rt = State();
  std::lock_guard<std::mutex> lock(rt.mu);
  return rt.events.count(e) != 0;
}

// With dev_mu held: runs every piece of work that can run, until none can.
void RunDevice() {
  std::vector<CUstream_st*> all = Streams();
  all.push_back(&LegacyStream());
  for (bool progress = true; progress;) {
    progress = false;
    for (CUstream_st* s : all) {
      while (!s->queue.empty()) {
        Work& w = s->queue.front();
        bool ready = true;
        for (const auto& [stream, n] : w.after) ready &= stream->done >= n;
        if (!ready || (w.step && !w.step())) break;
        s->queue.pop_front();
        ++s->done;
        progress = true;
      }
    }
  }
}

// Enqueues `step` on `s`, after `also` (a stream and piece), in the legacy stream's order against
// blocking streams; returns its index on `s`.
uint64_t Enqueue(CUstream_st* s, std::function<bool()> step,
                 std::pair<CUstream_st*, uint64_t> also = {nullptr, 0}) {
  std::lock_guard<std::recursive_mutex> lock(dev_mu);
  Work w{std::move(step), {}};
  if (also.first != nullptr) w.after.push_back(also);
  if (s->legacy) {
    for (CUstream_st* b : Streams()) {
      if (b->flags == cudaStreamDefault) w.after.emplace_back(b, b->enqueued);
    }
  } else if (s->flags == cudaStreamDefault) {
    w.after.emplace_back(&LegacyStream(), LegacyStream().enqueued);
  }
  s->queue.push_back(std::move(w));
  const uint64_t index = ++s->enqueued;
  if (!fp8rt::hostgpu::settings().lazy_streams) RunDevice();
  return index;
}

// With dev_mu held: runs `s`'s work up to its n-th piece and, first, the work that work waits
// for, and nothing else (lazy streams: a missing dependency leaves the work it should have waited
// for undone); whether it got there.
bool RunUntil(CUstream_st* s, uint64_t n) {
  while (s->done < n && !s->queue.empty()) {
    // Dependencies always point at work enqueued earlier, so this recursion ends.
    const std::vector<std::pair<CUstream_st*, uint64_t>> after = s->queue.front().after;
    bool ready = true;
    for (const auto& [t, m] : after) ready &= t->done >= m || RunUntil(t, m);
    Work& w = s->queue.front();
    if (!ready || (w.step && !w.step())) return false;
    s->queue.pop_front();
    ++s->done;
  }
  return s->done >= n;
}

// The host waits until `run` (called with dev_mu held: runs the device, says whether the wait is
// over) returns true. Work that waits for other ranks progresses only on MPI's thread. A wait
// that makes no progress for a minute says so on stderr (a kernel that never ends, or work that
// waits for something never enqueued), then goes on waiting, as CUDA would.
template <typename Run>
void WaitFor(Run run, const char* what) {
  const auto start = std::chrono::steady_clock::now();
  const fp8rt::hostgpu::Settings& settings = fp8rt::hostgpu::settings();
  const bool progress = settings.lazy_streams && settings.lazy_progress_after.count() > 0;
  bool told = false, ran_all = false;
  for (;;) {
    {
      std::lock_guard<std::recursive_mutex> lock(dev_mu);
      if (run()) return;
      if (progress && std::chrono::steady_clock::now() - start > settings.lazy_progress_after) {
        RunDevice();  // Settings::lazy_progress_after
        if (!ran_all) ++lazy_progress_runs;
        ran_all = true;
      }
    }
    if (!told && std::chrono::steady_clock::now() - start > std::chrono::minutes(1)) {
      std::fprintf(stderr, "hostgpu: the host has waited a minute for %s\n", what);
      told = true;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void WaitStream(CUstream_st* s, const char* what) {
  uint64_t n = 0;
  {
    std::lock_guard<std::recursive_mutex> lock(dev_mu);
    n = s->enqueued;
  }
  WaitFor([s, n] { return RunUntil(s, n); }, what);  // lets other threads in between tries
}

void WaitDevice() {
  WaitFor(
      [] {
        RunDevice();
        bool idle = LegacyStream().queue.empty();
        for (CUstream_st* s : Streams()) idle &= s->queue.empty();
        return idle;
      },
      "the device (a synchronisation)");
}

// A query of `s` up to its n-th piece: runs the device every time (default), or with lazy
// streams every stream_polls-th query, and then only what the query needs.
bool Query(CUstream_st* s, uint64_t n) {
  std::lock_guard<std::recursive_mutex> lock(dev_mu);
  if (!fp8rt::hostgpu::settings().lazy_streams) {
    RunDevice();
  } else if (++query_ticks >= fp8rt::hostgpu::settings().stream_polls) {
    query_ticks = 0;
    RunUntil(s, n);
  }
  return s->done >= n;
}

// The stream and piece of `event`'s last record ({null, 0}: never recorded).
std::pair<CUstream_st*, uint64_t> LastRecord(cudaEvent_t event) {
  std::lock_guard<std::recursive_mutex> lock(dev_mu);
  return {event->stream, event->index};
}

// Whether CUDA work may be enqueued on `s` now: a live stream that no NCCL call still
// ncclInProgress is about to use (`call` is counted as misuse otherwise).
cudaError_t CheckEnqueue(cudaStream_t s, const char* call, CUstream_st** stream) {
  *stream = StreamOf(s);
  if (*stream == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  if (fp8rt::hostgpu::NcclHoldsStream(s, call)) return Fail(cudaErrorInvalidValue);
  return cudaSuccess;
}

// Checks a copy's sides against its kind: the device side in registered memory, the host side not
// in device memory, both within their allocations. `pageable`: a host side in plain host memory.
cudaError_t CheckCopy(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                      bool* pageable) {
  *pageable = false;
  if (dst == nullptr || src == nullptr) return Fail(cudaErrorInvalidValue);
  const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  bool dst_inside = true, src_inside = true;
  const Kind d = KindOf(dst, count, &dst_inside), s = KindOf(src, count, &src_inside);
  if (!dst_inside || !src_inside) return Fail(cudaErrorInvalidValue);
  if (kind != cudaMemcpyDefault) {
    auto side_ok = [](Kind k, bool device) {
      return device ? k != kNone : (k != kDevice && k != kPool);
    };
    if (!side_ok(d, dst_device) || !side_ok(s, src_device)) return Fail(cudaErrorInvalidValue);
  }
  *pageable = (kind == cudaMemcpyHostToDevice && s == kNone) ||
              (kind == cudaMemcpyDeviceToHost && d == kNone);
  return cudaSuccess;
}

cudaError_t CheckSet(void* p, size_t count) {
  bool inside = true;
  if (p == nullptr || KindOf(p, count, &inside) == kNone || !inside) {
    return Fail(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

// A copy on `stream` (cudaStreamLegacy for the synchronous form). The host waits for it when
// `sync`, or when either side is pageable memory, as CUDA's does.
cudaError_t Copy(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream,
                 bool sync, const char* call) {
  CUstream_st* s = nullptr;
  if (const cudaError_t e = CheckEnqueue(stream, call, &s); e != cudaSuccess) return e;
  if (count == 0) return cudaSuccess;
  bool pageable = false;
  if (const cudaError_t e = CheckCopy(dst, src, count, kind, &pageable); e != cudaSuccess) {
    return e;
  }
  const uint64_t n = Enqueue(s, [dst, src, count] {
    std::memmove(dst, src, count);
    return true;
  });
  if (sync || pageable) {
    WaitFor([s, n] { return RunUntil(s, n); },
            sync ? "a synchronous cudaMemcpy" : "a cudaMemcpyAsync of pageable memory");
  }
  return cudaSuccess;
}

// A memset on `stream` (cudaStreamLegacy for the synchronous form, which the host waits for).
cudaError_t Set(void* p, int value, size_t count, cudaStream_t stream, bool sync,
                const char* call) {
  CUstream_st* s = nullptr;
  if (const cudaError_t e = CheckEnqueue(stream, call, &s); e != cudaSuccess) return e;
  if (count == 0) return cudaSuccess;
  if (const cudaError_t e = CheckSet(p, count); e != cudaSuccess) return e;
  const uint64_t n = Enqueue(s, [p, value, count] {
    std::memset(p, value, count);
    return true;
  });
  if (sync) WaitFor([s, n] { return RunUntil(s, n); }, "a synchronous cudaMemset");
  return cudaSuccess;
}

}  // namespace

namespace fp8rt::hostgpu {

bool DeviceRange(const void* p, size_t bytes, int* kind) {
  bool inside = true;
  const Kind k = p == nullptr ? kNone : KindOf(p, bytes == 0 ? 1 : bytes, &inside);
  if (kind != nullptr) *kind = k;
  return k != kNone && inside;
}
bool ValidStream(void* stream) { return StreamOf(static_cast<cudaStream_t>(stream)) != nullptr; }
// A stream destroyed after the NCCL call still gets its kernel (cudaStreamDestroy while NCCL
// holds the stream is refused as misuse, so this is a stream destroyed with work queued).
void EnqueueKernel(void* stream, std::function<bool()> step) {
  CUstream_st* s = StreamOf(static_cast<cudaStream_t>(stream), /*dead=*/true);
  if (s != nullptr) Enqueue(s, std::move(step));
}
void* StreamId(void* stream) { return StreamOf(static_cast<cudaStream_t>(stream), /*dead=*/true); }
int Launch(void* stream, std::function<void()> work, const char* call) {
  CUstream_st* s = nullptr;
  if (const cudaError_t e = CheckEnqueue(static_cast<cudaStream_t>(stream), call, &s);
      e != cudaSuccess) {
    return e;
  }
  Enqueue(s, [work = std::move(work)] {
    work();
    return true;
  });
  return cudaSuccess;
}
int64_t LazyProgressRuns() { return lazy_progress_runs.load(); }
void RunAll() {
  std::lock_guard<std::recursive_mutex> lock(dev_mu);
  RunDevice();
}

}  // namespace fp8rt::hostgpu

namespace fp8rt::kernels::cuda_internal {

cudaError_t MallocFromDevicePool(void** p, size_t bytes, cudaStream_t stream) {
  CUstream_st* s = nullptr;
  if (const cudaError_t e = CheckEnqueue(stream, "MallocFromDevicePool", &s); e != cudaSuccess) {
    return e;
  }
  return Allocate(p, bytes, kPool);
}

}  // namespace fp8rt::kernels::cuda_internal

extern "C" {

cudaError_t cudaMalloc(void** p, size_t bytes) { return Allocate(p, bytes, kDevice); }
// cudaFree and cudaFreeHost wait for the device, as CUDA's do.
cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  WaitDevice();
  return Release(p, /*pinned=*/false);
}
cudaError_t cudaMallocHost(void** p, size_t bytes) { return Allocate(p, bytes, kPinned); }
cudaError_t cudaFreeHost(void* p) {
  if (p == nullptr) return cudaSuccess;
  WaitDevice();
  return Release(p, /*pinned=*/true);
}
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
  CUstream_st* s = nullptr;
  if (const cudaError_t e = CheckEnqueue(stream, "cudaFreeAsync", &s); e != cudaSuccess) return e;
  bool inside = true;
  if (p != nullptr && KindOf(p, 1, &inside) == kPinned) return Fail(cudaErrorInvalidValue);
  Enqueue(s, [p] {
    (void)Release(p, /*pinned=*/false);
    return true;
  });
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  return Copy(dst, src, count, kind, cudaStreamLegacy, /*sync=*/true, "cudaMemcpy");
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  return Copy(dst, src, count, kind, stream, /*sync=*/false, "cudaMemcpyAsync");
}
cudaError_t cudaMemset(void* p, int value, size_t count) {
  return Set(p, value, count, cudaStreamLegacy, /*sync=*/true, "cudaMemset");
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t count, cudaStream_t stream) {
  return Set(p, value, count, stream, /*sync=*/false, "cudaMemsetAsync");
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* p) {
  if (attributes == nullptr) return Fail(cudaErrorInvalidValue);
  *attributes = cudaPointerAttributes{};
  attributes->type = cudaMemoryTypeUnregistered;
  attributes->device = -2;
  attributes->hostPointer = const_cast<void*>(p);
  bool inside = true;
  const Kind k = KindOf(p, 1, &inside);
  if (k != kNone) {
    attributes->type = k == kPinned ? cudaMemoryTypeHost : cudaMemoryTypeDevice;
    attributes->device = 0;
    attributes->devicePointer = const_cast<void*>(p);
    attributes->hostPointer = k == kPinned ? const_cast<void*>(p) : nullptr;
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
cudaError_t cudaDeviceSynchronize(void) {
  WaitDevice();
  return cudaSuccess;
}

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
  auto* s = new CUstream_st;
  s->flags = flags;
  {
    std::lock_guard<std::recursive_mutex> lock(dev_mu);
    Streams().push_back(s);
    *stream = s;
  }
  fp8rt::hostgpu::StreamCreated(s);  // outside dev_mu: nccl_host.cc's lock comes first
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  CUstream_st* s = StreamOf(stream);
  if (s == nullptr || s->legacy) return Fail(cudaErrorInvalidResourceHandle);
  if (fp8rt::hostgpu::NcclHoldsStream(stream, "cudaStreamDestroy")) {
    return Fail(cudaErrorInvalidValue);
  }
  std::lock_guard<std::recursive_mutex> lock(dev_mu);
  s->live = false;  // its queued work still runs
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  CUstream_st* s = StreamOf(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  uint64_t n = 0;
  {
    std::lock_guard<std::recursive_mutex> lock(dev_mu);
    n = s->enqueued;
  }
  return Query(s, n) ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  CUstream_st* s = StreamOf(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  WaitStream(s, "cudaStreamSynchronize");
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  if (!ValidEvent(event)) return Fail(cudaErrorInvalidResourceHandle);
  if (flags != 0) return Fail(cudaErrorInvalidValue);
  CUstream_st* s = nullptr;
  if (const cudaError_t e = CheckEnqueue(stream, "cudaStreamWaitEvent", &s); e != cudaSuccess) {
    return e;
  }
  Enqueue(s, nullptr, LastRecord(event));  // never recorded: no wait
  return cudaSuccess;
}
cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* data) {
  if (fn == nullptr) return Fail(cudaErrorInvalidValue);
  return static_cast<cudaError_t>(fp8rt::hostgpu::Launch(
      stream, [fn, data] { fn(data); }, "cudaLaunchHostFunc"));
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (event == nullptr) return Fail(cudaErrorInvalidValue);
  auto* e = new CUevent_st;
  e->flags = flags;
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
  CUstream_st* s = nullptr;
  if (const cudaError_t e = CheckEnqueue(stream, "cudaEventRecord", &s); e != cudaSuccess) {
    return e;
  }
  std::lock_guard<std::recursive_mutex> lock(dev_mu);
  const uint64_t n = Enqueue(s, nullptr);
  event->stream = s;
  event->index = n;
  return cudaSuccess;
}
// An event never recorded is complete, as in CUDA.
cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (!ValidEvent(event)) return Fail(cudaErrorInvalidResourceHandle);
  const auto [s, n] = LastRecord(event);
  return s == nullptr || Query(s, n) ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (!ValidEvent(event)) return Fail(cudaErrorInvalidResourceHandle);
  const auto [s, n] = LastRecord(event);
  if (s != nullptr) WaitFor([s, n] { return RunUntil(s, n); }, "cudaEventSynchronize");
  return cudaSuccess;
}

}  // extern "C"
