// The NCCL shim of the GPU tests (tests/gpu/nccl_shim.h): fp8rt's NCCL calls reach it through
// the link's --wrap (tests/gpu/CMakeLists.txt, FP8RT_NCCL_SHIM_WRAP), and it passes them on to NCCL
// (__real_*) at once, later, or never, as the test asks.
#include "tests/gpu/nccl_shim.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

extern "C" {
ncclResult_t __real_ncclAllReduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                  ncclComm_t, cudaStream_t);
ncclResult_t __real_ncclAllGather(const void*, void*, size_t, ncclDataType_t, ncclComm_t,
                                  cudaStream_t);
ncclResult_t __real_ncclReduceScatter(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                      ncclComm_t, cudaStream_t);
ncclResult_t __real_ncclBroadcast(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t,
                                  cudaStream_t);
ncclResult_t __real_ncclSend(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
ncclResult_t __real_ncclRecv(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
ncclResult_t __real_ncclGroupStart();
ncclResult_t __real_ncclGroupEnd();
ncclResult_t __real_ncclCommGetAsyncError(ncclComm_t, ncclResult_t*);
}

namespace shim {

std::atomic<bool> on{false};
std::atomic<bool> hang{false};
std::atomic<bool> stall{false};
std::atomic<bool> released{false};
std::atomic<bool> slow{false};
std::atomic<int> slow_ms{400};
std::atomic<int> mark{-1};
std::chrono::milliseconds delay{150};

namespace {
std::mutex mu;
int pending = 0;                   // deferred calls not made yet (guarded by mu)
int deferred = 0;                  // calls deferred since the last Reset (guarded by mu)
ncclResult_t error = ncclSuccess;  // a deferred call's failure (guarded by mu)
bool in_group = false;             // main thread only
std::vector<std::function<ncclResult_t()>> group;  // main thread only
std::vector<std::thread> threads;                  // main thread only

// Makes `call` `delay` from now on a thread of its own; the caller returns ncclInProgress.
ncclResult_t Defer(std::function<ncclResult_t()> call) {
  bool all_made = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    all_made = pending == 0;
    ++pending;
    ++deferred;
  }
  // Every earlier thread has made its call: join them now, so that a long run (a training run
  // with the shim on) does not keep thousands of them until Reset.
  if (all_made) {
    for (std::thread& t : threads) t.join();
    threads.clear();
  }
  int device = 0;
  (void)cudaGetDevice(&device);
  threads.emplace_back([call = std::move(call), device, wait = delay] {
    std::this_thread::sleep_for(wait);
    if (hang.load()) return;
    (void)cudaSetDevice(device);
    const ncclResult_t r = call();
    std::lock_guard<std::mutex> lock(mu);
    if (r != ncclSuccess && r != ncclInProgress) error = r;
    --pending;
  });
  return ncclInProgress;
}

void CUDART_CB BlockUntilReleased(void*) {
  while (!released.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

void CUDART_CB SleepSlowMs(void*) {
  std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms.load()));
}

// One collective on `stream`: deferred as it is, stalled, or recorded when inside a group.
ncclResult_t Call(cudaStream_t stream, std::function<ncclResult_t()> call) {
  if (stall.load() && !in_group) {
    return cudaLaunchHostFunc(stream, BlockUntilReleased, nullptr) == cudaSuccess
               ? ncclSuccess
               : ncclUnhandledCudaError;
  }
  if (slow.load()) {
    call = [stream, inner = std::move(call)] {
      if (cudaLaunchHostFunc(stream, SleepSlowMs, nullptr) != cudaSuccess) {
        return ncclUnhandledCudaError;
      }
      return inner();
    };
  }
  if (!on.load()) return call();
  if (in_group) {
    group.push_back(std::move(call));
    return ncclSuccess;
  }
  return Defer(std::move(call));
}

size_t Size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 4;
  }
}

// `call`, then (under `mark`) the memset of its `bytes` at `recv` on `stream`.
std::function<ncclResult_t()> Marked(void* recv, size_t bytes, cudaStream_t stream,
                                     std::function<ncclResult_t()> call) {
  const int pattern = mark.load();
  if (pattern < 0) return call;
  return [=, inner = std::move(call)] {
    const ncclResult_t r = inner();
    if (r != ncclSuccess && r != ncclInProgress) return r;
    return cudaMemsetAsync(recv, pattern, bytes, stream) == cudaSuccess ? r
                                                                        : ncclUnhandledCudaError;
  };
}

void Join() {
  for (std::thread& t : threads) t.join();
  threads.clear();
}

}  // namespace

void Reset() {
  Join();
  std::lock_guard<std::mutex> lock(mu);
  pending = 0;
  deferred = 0;
  error = ncclSuccess;
}

int Deferred() {
  std::lock_guard<std::mutex> lock(mu);
  return deferred;
}

}  // namespace shim

extern "C" {
ncclResult_t __wrap_ncclAllReduce(const void* s, void* r, size_t n, ncclDataType_t t,
                                  ncclRedOp_t op, ncclComm_t c, cudaStream_t st) {
  return shim::Call(st, shim::Marked(r, n * shim::Size(t), st,
                                     [=] { return __real_ncclAllReduce(s, r, n, t, op, c, st); }));
}
ncclResult_t __wrap_ncclAllGather(const void* s, void* r, size_t n, ncclDataType_t t, ncclComm_t c,
                                  cudaStream_t st) {
  return shim::Call(st, [=] { return __real_ncclAllGather(s, r, n, t, c, st); });
}
ncclResult_t __wrap_ncclReduceScatter(const void* s, void* r, size_t n, ncclDataType_t t,
                                      ncclRedOp_t op, ncclComm_t c, cudaStream_t st) {
  return shim::Call(st, [=] { return __real_ncclReduceScatter(s, r, n, t, op, c, st); });
}
ncclResult_t __wrap_ncclBroadcast(const void* s, void* r, size_t n, ncclDataType_t t, int root,
                                  ncclComm_t c, cudaStream_t st) {
  return shim::Call(st, shim::Marked(r, n * shim::Size(t), st, [=] {
                      return __real_ncclBroadcast(s, r, n, t, root, c, st);
                    }));
}
ncclResult_t __wrap_ncclSend(const void* s, size_t n, ncclDataType_t t, int peer, ncclComm_t c,
                             cudaStream_t st) {
  return shim::Call(st, [=] { return __real_ncclSend(s, n, t, peer, c, st); });
}
ncclResult_t __wrap_ncclRecv(void* r, size_t n, ncclDataType_t t, int peer, ncclComm_t c,
                             cudaStream_t st) {
  return shim::Call(st, [=] { return __real_ncclRecv(r, n, t, peer, c, st); });
}
ncclResult_t __wrap_ncclGroupStart() {
  if (!shim::on.load()) return __real_ncclGroupStart();
  shim::in_group = true;
  shim::group.clear();
  return ncclSuccess;
}
ncclResult_t __wrap_ncclGroupEnd() {
  if (!shim::on.load()) return __real_ncclGroupEnd();
  shim::in_group = false;
  return shim::Defer([calls = std::move(shim::group)] {
    ncclResult_t r = __real_ncclGroupStart();
    for (const auto& call : calls) {
      const ncclResult_t c = call();
      if (c != ncclSuccess && c != ncclInProgress) r = c;
    }
    const ncclResult_t end = __real_ncclGroupEnd();
    return r != ncclSuccess ? r : end;
  });
}
ncclResult_t __wrap_ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (shim::on.load()) {
    std::lock_guard<std::mutex> lock(shim::mu);
    if (shim::error != ncclSuccess) {
      *state = shim::error;
      return ncclSuccess;
    }
    if (shim::pending > 0) {
      *state = ncclInProgress;
      return ncclSuccess;
    }
  }
  return __real_ncclCommGetAsyncError(comm, state);
}
}  // extern "C"
