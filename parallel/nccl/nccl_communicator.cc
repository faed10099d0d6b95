// NCCL backend: collectives enqueued on the communicator's stream of a non-blocking NCCL
// communicator, then polled (NCCL's asynchronous state, then the stream) against a deadline.
//
// Index:
//   ToNccl                  DType / ReduceOp -> NCCL enums
//   WaitState               polls a communicator out of ncclInProgress (init, split, finalize)
//   NcclCommunicator        Do* collectives, Finish and Poll (the deadline), Break (abort),
//                           teardown; Do*Queued (Completion::kStream), Queue, CheckQueued and
//                           the watchdog (Watch)
//   NcclPendingSide         StartAllGather's and StartReduceScatter's handle: the side
//                           stream's collective (StartOnSide)
//   NcclCommunicatorFactory Create (unique id over the bootstrap), Split (ncclCommSplit)
//   CreateNcclCommunicatorFactory  Create as the interface (a stub without CUDA)
#include "parallel/nccl/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/device_pool.h"
#include "runtime/core/checks.h"
#include "runtime/core/status.h"

namespace fp8rt::parallel {
namespace {

using Clock = std::chrono::steady_clock;

// Whether the device can address `p` (cudaMalloc, managed or registered/pinned memory).
bool DeviceAddressable(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // not a pointer CUDA knows: host memory
    return false;
  }
  return a.type != cudaMemoryTypeUnregistered;
}

// Bytes of the span [0, max_p(displs[p] + counts[p])) of an all-to-all buffer.
size_t Extent(std::span<const int64_t> counts, std::span<const int64_t> displs, size_t elem) {
  int64_t end = 0;
  for (size_t p = 0; p < counts.size(); ++p) {
    if (counts[p] > 0) end = std::max(end, displs[p] + counts[p]);
  }
  return static_cast<size_t>(end) * elem;
}

ncclDataType_t ToNccl(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kU8:
      return ncclUint8;  // FP8 bytes are moved, never reduced (the front end rejects that)
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
  }
  return ncclUint8;
}

ncclRedOp_t ToNccl(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclMax; }

// A call on a non-blocking communicator returns ncclInProgress when it queued work that
// completes later; that is success so far, and the caller polls the communicator's state.
absl::Status Enqueued(ncclResult_t rc, const char* expr, const char* file, int line) {
  if (rc == ncclSuccess || rc == ncclInProgress) return absl::OkStatus();
  return internal::NcclErrorStatus(rc, expr, file, line);
}
#define FP8RT_NCCL_ENQUEUE(expr) Enqueued((expr), #expr, __FILE__, __LINE__)

// Between polls: yield for the first ~thousand (small collectives finish in microseconds), then
// sleep briefly so that a long wait does not burn a core.
void Pause(int64_t polls) {
  if (polls < 1024) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

absl::Status Timeout(const char* what, std::chrono::milliseconds timeout) {
  return absl::DeadlineExceededError(
      absl::StrCat(what, " did not complete within ", timeout.count(),
                   " ms: a peer rank has failed, hangs, or called a different collective"));
}

// Polls `comm` until it leaves ncclInProgress: OK when it reaches ncclSuccess, the NCCL error
// otherwise, DeadlineExceeded past `deadline` (the caller then aborts it).
absl::Status WaitState(ncclComm_t comm, Clock::time_point deadline,
                       std::chrono::milliseconds timeout, const char* what) {
  for (int64_t polls = 0;; ++polls) {
    ncclResult_t state = ncclInProgress;
    NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comm, &state));
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return internal::NcclErrorStatus(state, what, __FILE__, __LINE__);
    if (Clock::now() >= deadline) return Timeout(what, timeout);
    Pause(polls);
  }
}

}  // namespace

// A buffer of one collective, as the device sees it. Device-addressable memory (cudaMalloc,
// managed, pinned) is used as it is; plain host memory (the step loop's control values: a loss,
// a gradient norm, flags, token counts, checkpoint verdicts) is staged through stream-ordered
// device memory and the communicator's pinned memory: an input is copied to pinned memory by the
// host and then to the device on the communicator's stream before the collective; an output is
// copied back only once Finish has seen the collective complete (CopyOut, then Deliver). Pinned
// memory keeps those copies asynchronous: a copy from or to pageable memory waits for the stream,
// and behind a hung collective it would block the thread past the deadline.
class NcclCommunicator::Staged {
 public:
  Staged() = default;
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;
  ~Staged() {
    if (staged_ != nullptr) (void)cudaFreeAsync(staged_, stream_);
  }

  // `p` holds `bytes` bytes; `in`: the collective reads it (copied to the device first).
  absl::Status Init(const void* p, size_t bytes, bool in, cudaStream_t stream, PinnedSlot& pinned) {
    host_ = const_cast<void*>(p);
    bytes_ = bytes;
    stream_ = stream;
    if (p == nullptr || bytes == 0 || DeviceAddressable(p)) return absl::OkStatus();
    if (pinned.bytes < bytes) {
      // The old slot is freed with the communicator, not here: cudaFreeHost waits for the device,
      // which a hung stream-ordered collective would keep busy while this call holds the lock
      // the watchdog needs to abort it. Allocating pinned memory may synchronise too: this path
      // is safe only because no host-buffer call is made on a group while a stream-ordered
      // collective of it is queued (each pass synchronises first), and rare because slots grow
      // by doubling (at most log2(largest payload) are ever retired).
      const size_t grow = std::max(bytes, 2 * pinned.bytes);
      void* grown = nullptr;
      CUDA_RETURN_IF_ERROR(cudaMallocHost(&grown, grow));
      if (pinned.p != nullptr) pinned.retired.push_back(pinned.p);
      pinned.p = grown;
      pinned.bytes = grow;
    }
    pinned_ = pinned.p;
    // From fp8rt's device pool, which can reuse the memory freed arrays left there (the
    // device's default pool cannot), without waiting for the device (mu_ is held).
    if (const cudaError_t err =
            kernels::cuda_internal::MallocFromDevicePool(&staged_, bytes, stream);
        err != cudaSuccess) {
      (void)cudaGetLastError();
      staged_ = nullptr;
      return ::fp8rt::internal::CudaErrorStatus(err, "MallocFromDevicePool (staging)", __FILE__,
                                                __LINE__);
    }
    if (in) {
      std::memcpy(pinned_, p, bytes);
      CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(staged_, pinned_, bytes, cudaMemcpyHostToDevice, stream));
    }
    return absl::OkStatus();
  }
  void* device() const { return staged_ != nullptr ? staged_ : host_; }
  bool staged() const { return staged_ != nullptr; }
  // For an output, once the collective has completed: enqueues the copy to pinned memory.
  absl::Status CopyOut() {
    if (staged_ == nullptr) return absl::OkStatus();
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(pinned_, staged_, bytes_, cudaMemcpyDeviceToHost, stream_));
    return absl::OkStatus();
  }
  // Once that copy has completed: the result into the caller's buffer.
  void Deliver() {
    if (staged_ != nullptr) std::memcpy(host_, pinned_, bytes_);
  }

 private:
  void* host_ = nullptr;
  void* staged_ = nullptr;
  void* pinned_ = nullptr;
  size_t bytes_ = 0;
  cudaStream_t stream_ = nullptr;
};

// --- NcclCommunicator --------------------------------------------------------------------------

NcclCommunicator::NcclCommunicator(std::string name, int rank, int size, int device, ncclComm* comm,
                                   const NcclOptions& options)
    : Communicator(std::move(name), rank, size), device_(device), options_(options), comm_(comm) {}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Wrap(
    std::string name, int device, ncclComm* comm, const NcclOptions& options) {
  int rank = 0, size = 0;
  absl::Status status = [&]() -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclCommUserRank(comm, &rank));
    NCCL_RETURN_IF_ERROR(ncclCommCount(comm, &size));
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    ncclCommAbort(comm);
    return status;
  }
  // From here the object owns `comm`: its destructor frees whatever was created.
  std::unique_ptr<NcclCommunicator> self(
      new NcclCommunicator(std::move(name), rank, size, device, comm, options));
  status = [&]() -> absl::Status {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    // A blocking stream (the default flags): ordered after the legacy default stream, which in
    // turn waits for whatever is queued on it, its waits for the side stream included (so
    // StartOnSide queues none there).
    CUDA_RETURN_IF_ERROR(cudaStreamCreate(&self->stream_));
    CUDA_RETURN_IF_ERROR(cudaMalloc(&self->barrier_buf_, sizeof(int32_t)));
    CUDA_RETURN_IF_ERROR(cudaMemset(self->barrier_buf_, 0, sizeof(int32_t)));
    return absl::OkStatus();
  }();
  if (!status.ok()) return self->Break(status);
  return self;
}

NcclCommunicator::~NcclCommunicator() {
  if (watchdog_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(watch_mu_);
      stop_ = true;
    }
    watch_cv_.notify_all();
    watchdog_.join();
  }
  (void)cudaSetDevice(device_);
  if (comm_ != nullptr) {
    // Finalize flushes outstanding work and waits for the peers' side of it; if that fails or
    // does not finish in time, abort (which never waits for peers).
    const auto deadline = Clock::now() + options_.timeout;
    const bool finalized = FP8RT_NCCL_ENQUEUE(ncclCommFinalize(comm_)).ok() &&
                           WaitState(comm_, deadline, options_.timeout, "ncclCommFinalize").ok();
    (void)(finalized ? ncclCommDestroy(comm_) : ncclCommAbort(comm_));
    comm_ = nullptr;
  }
  if (barrier_buf_ != nullptr) (void)cudaFree(barrier_buf_);
  for (const Queued& q : queued_) (void)cudaEventDestroy(q.done);
  for (cudaEvent_t e : spare_events_) (void)cudaEventDestroy(e);
  for (PinnedSlot& slot : pinned_) {
    if (slot.p != nullptr) (void)cudaFreeHost(slot.p);
    for (void* p : slot.retired) (void)cudaFreeHost(p);
  }
  if (side_done_ != nullptr) (void)cudaEventDestroy(side_done_);
  if (side_ != nullptr) (void)cudaStreamDestroy(side_);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

absl::Status NcclCommunicator::Break(absl::Status why) {
  if (comm_ != nullptr) {
    (void)ncclCommAbort(comm_);
    comm_ = nullptr;
    why = absl::Status(why.code(),
                       absl::StrCat(why.message(), "; the NCCL communicator was aborted"));
  }
  if (broken_.ok()) broken_ = why;
  return why;
}

absl::Status NcclCommunicator::BreakLocked(absl::Status why) {
  std::lock_guard<std::mutex> lock(mu_);
  return Break(std::move(why));
}

absl::Status NcclCommunicator::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

absl::Status NcclCommunicator::Begin(bool main_stream_work) {
  CheckQueued();
  if (!broken_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("communicator is unusable after an earlier failure: ", broken_.message()));
  }
  // A failure here breaks the communicator: this rank would otherwise skip a collective its
  // peers make, and its next one would pair with their previous one.
  if (const cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
    return Break(internal::CudaErrorStatus(e, "cudaSetDevice", __FILE__, __LINE__));
  }
  // After the side stream's last collective: one collective at a time, in call order. Only for
  // work on the main stream: a collective started on the side stream follows it there anyway,
  // and the default stream waits for everything queued on the (blocking) main stream, so a wait
  // for the side stream queued there with nothing behind it would hold up the model's compute
  // behind the started collectives.
  if (side_done_ != nullptr && main_stream_work) {
    if (const cudaError_t e = cudaStreamWaitEvent(stream_, side_done_, 0); e != cudaSuccess) {
      return Break(internal::CudaErrorStatus(e, "cudaStreamWaitEvent(stream_, side_done_)",
                                             __FILE__, __LINE__));
    }
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Finish(absl::Status enqueued, Clock::time_point deadline,
                                      const char* what, std::initializer_list<Staged*> outputs) {
  // A failed enqueue leaves a non-blocking communicator in an error state: it is not reusable.
  if (!enqueued.ok()) return Break(enqueued);
  FP8RT_RETURN_IF_ERROR(Poll(nullptr, deadline, what));
  bool copied = false;
  for (Staged* out : outputs) {
    if (!out->staged()) continue;
    if (absl::Status s = out->CopyOut(); !s.ok()) return Break(s);
    copied = true;
  }
  if (!copied) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(Poll(nullptr, deadline, what));
  for (Staged* out : outputs) out->Deliver();
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Poll(CUevent_st* done, Clock::time_point deadline,
                                    const char* what) {
  for (int64_t polls = 0;; ++polls) {
    if (comm_ == nullptr) return broken_;  // aborted meanwhile (another handle's failure)
    ncclResult_t state = ncclInProgress;
    const ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
    if (rc != ncclSuccess) {
      return Break(internal::NcclErrorStatus(rc, "ncclCommGetAsyncError", __FILE__, __LINE__));
    }
    if (state != ncclSuccess && state != ncclInProgress) {
      return Break(
          internal::NcclErrorStatus(state, AsyncErrorSource(what).c_str(), __FILE__, __LINE__));
    }
    // Only once NCCL has finished enqueueing (state ncclSuccess) does an idle stream, or a
    // completed event, mean done.
    if (state == ncclSuccess) {
      const cudaError_t q = done != nullptr ? cudaEventQuery(done) : cudaStreamQuery(stream_);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) {
        return Break(internal::CudaErrorStatus(
            q, done != nullptr ? "cudaEventQuery" : "cudaStreamQuery(stream_)", __FILE__,
            __LINE__));
      }
    }
    if (Clock::now() >= deadline) {
      return Break(Timeout(AsyncErrorSource(what).c_str(), options_.timeout));
    }
    Pause(polls);
  }
}

absl::Status NcclCommunicator::PollLocked(CUevent_st* done, Clock::time_point deadline,
                                          const char* what) {
  std::lock_guard<std::mutex> lock(mu_);
  return Poll(done, deadline, what);
}

// The handle of a collective started on the side stream (StartAllGather, StartReduceScatter):
// owns the event recorded after it.
class NcclPendingSide final : public PendingCollective {
 public:
  NcclPendingSide(NcclCommunicator* comm, cudaEvent_t done, Clock::time_point deadline,
                  const char* what)
      : comm_(comm), done_(done), deadline_(deadline), what_(what) {}
  NcclPendingSide(const NcclPendingSide&) = delete;
  NcclPendingSide& operator=(const NcclPendingSide&) = delete;
  ~NcclPendingSide() override {
    if (!waited_) (void)Wait();
    (void)cudaEventDestroy(done_);
  }
  // The default stream waits for the collective; the host only takes in what the watchdog found
  // so far (it watches the collective: StartOnSide tracked it).
  absl::Status WaitStreamOrdered() override {
    if (!waited_) Settle(comm_->CheckStreamOrdered());
    return status_;
  }
  absl::Status Wait() override {
    if (!waited_) Settle(comm_->PollLocked(done_, deadline_, what_));
    return status_;
  }

 private:
  // Records `status` and, whatever it is, makes the default stream's later work (the model's
  // frees of the buffers among it: stream-ordered) come after the collective, which the side
  // stream does not otherwise order. After an abort its kernels end, so the wait ends. If the
  // default stream cannot be made to wait, the host waits for the collective instead (the
  // buffers may be freed as soon as this returns, whatever its status, and kernels may already
  // read them), and the communicator is broken, so that every later check reports it.
  void Settle(absl::Status status) {
    waited_ = true;
    status_ = std::move(status);
    if (const cudaError_t e = cudaStreamWaitEvent(cudaStreamLegacy, done_, 0); e != cudaSuccess) {
      (void)cudaGetLastError();
      absl::Status why = internal::CudaErrorStatus(e, "cudaStreamWaitEvent(started collective)",
                                                   __FILE__, __LINE__);
      why = comm_->BreakLocked(std::move(why));
      (void)cudaEventSynchronize(done_);
      if (status_.ok()) status_ = std::move(why);
    }
  }

  NcclCommunicator* const comm_;
  const cudaEvent_t done_;
  const Clock::time_point deadline_;
  const char* const what_;  // the NCCL call, for errors
  bool waited_ = false;
  absl::Status status_;
};

absl::StatusOr<std::unique_ptr<PendingCollective>> NcclCommunicator::DoStartAllGather(
    const void* send, int64_t count, void* recv, DType dtype) {
  if (count == 0 || !DeviceAddressable(send) || !DeviceAddressable(recv)) {
    return Communicator::DoStartAllGather(send, count, recv, dtype);  // blocking, staged
  }
  return StartOnSide("ncclAllGather (started)", [&](cudaStream_t side) {
    return ncclAllGather(send, recv, static_cast<size_t>(count), ToNccl(dtype), comm_, side);
  });
}

absl::StatusOr<std::unique_ptr<PendingCollective>> NcclCommunicator::DoStartReduceScatter(
    const void* send, void* recv, int64_t recv_count, DType dtype, ReduceOp op) {
  if (recv_count == 0 || !DeviceAddressable(send) || !DeviceAddressable(recv)) {
    return Communicator::DoStartReduceScatter(send, recv, recv_count, dtype, op);  // blocking
  }
  return StartOnSide("ncclReduceScatter (started)", [&](cudaStream_t side) {
    return ncclReduceScatter(send, recv, static_cast<size_t>(recv_count), ToNccl(dtype), ToNccl(op),
                             comm_, side);
  });
}

absl::StatusOr<std::unique_ptr<PendingCollective>> NcclCommunicator::StartOnSide(
    const char* what, const std::function<int(CUstream_st*)>& enqueue) {
  std::lock_guard<std::mutex> lock(mu_);
  FP8RT_RETURN_IF_ERROR(Begin(/*main_stream_work=*/false));
  const auto deadline = Clock::now() + options_.timeout;
  cudaEvent_t done = nullptr;
  absl::Status status = [&]() -> absl::Status {
    if (side_ == nullptr) {
      CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&side_done_, cudaEventDisableTiming));
    }
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    // After the compute enqueued so far (legacy default stream) and this communicator's
    // earlier collectives (main stream, which waits for the side stream's before its own; the
    // side stream is in call order already). The default stream waits for the collective only
    // at WaitStreamOrdered.
    CUDA_RETURN_IF_ERROR(cudaEventRecord(done, cudaStreamLegacy));
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, done, 0));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(done, stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, done, 0));
    return absl::OkStatus();
  }();
  bool accepted = false;  // NCCL took the collective: it may be on the side stream, or go there
  if (status.ok()) {
    status = Enqueued(static_cast<ncclResult_t>(enqueue(side_)), what, __FILE__, __LINE__);
    accepted = status.ok();
  }
  // The events must follow the collective on the side stream: a non-blocking communicator may
  // put it there only after the call returned ncclInProgress.
  if (status.ok()) status = WaitEnqueued(deadline, what);
  if (status.ok()) {
    status = [&]() -> absl::Status {
      CUDA_RETURN_IF_ERROR(cudaEventRecord(done, side_));
      CUDA_RETURN_IF_ERROR(cudaEventRecord(side_done_, side_));
      return absl::OkStatus();
    }();
    // The watchdog watches it too: a host blocked in a device-wide wait (a free of pinned or
    // managed memory) before Wait() would otherwise hang behind a collective whose peer died.
    if (status.ok()) status = Track(side_, deadline, what).status();
  }
  if (!status.ok()) {
    if (done != nullptr) (void)cudaEventDestroy(done);
    status = Break(status);  // aborts the communicator (once: a second Break keeps the first)
    // No handle is returned, so the default stream will never wait for this collective: the
    // caller may free and reuse its buffers at once. The aborted collective ends at once; it
    // must have ended before this returns.
    if (accepted) (void)cudaStreamSynchronize(side_);
    return status;
  }
  return std::unique_ptr<PendingCollective>(
      std::make_unique<NcclPendingSide>(this, done, deadline, what));
}

absl::Status NcclCommunicator::DoAllReduce(void* buf, int64_t count, DType dtype, ReduceOp op) {
  std::lock_guard<std::mutex> lock(mu_);
  FP8RT_RETURN_IF_ERROR(Begin(/*main_stream_work=*/count != 0));
  if (count == 0) return absl::OkStatus();  // same count on every rank: all skip together
  const auto deadline = Clock::now() + options_.timeout;
  Staged b;
  absl::Status status =
      b.Init(buf, static_cast<size_t>(Bytes(count, dtype)), true, stream_, pinned_[0]);
  if (status.ok()) {
    status = FP8RT_NCCL_ENQUEUE(ncclAllReduce(b.device(), b.device(), static_cast<size_t>(count),
                                              ToNccl(dtype), ToNccl(op), comm_, stream_));
  }
  return Finish(status, deadline, "ncclAllReduce", {&b});
}

absl::Status NcclCommunicator::DoAllGather(const void* send, int64_t count, void* recv,
                                           DType dtype) {
  std::lock_guard<std::mutex> lock(mu_);
  FP8RT_RETURN_IF_ERROR(Begin(/*main_stream_work=*/count != 0));
  if (count == 0) return absl::OkStatus();
  const auto deadline = Clock::now() + options_.timeout;
  const size_t bytes = static_cast<size_t>(Bytes(count, dtype));
  Staged s, r;
  absl::Status status = s.Init(send, bytes, true, stream_, pinned_[0]);
  if (status.ok())
    status = r.Init(recv, bytes * static_cast<size_t>(size()), false, stream_, pinned_[1]);
  if (status.ok()) {
    status = FP8RT_NCCL_ENQUEUE(ncclAllGather(s.device(), r.device(), static_cast<size_t>(count),
                                              ToNccl(dtype), comm_, stream_));
  }
  return Finish(status, deadline, "ncclAllGather", {&r});
}

absl::Status NcclCommunicator::DoReduceScatter(const void* send, void* recv, int64_t recv_count,
                                               DType dtype, ReduceOp op) {
  std::lock_guard<std::mutex> lock(mu_);
  FP8RT_RETURN_IF_ERROR(Begin(/*main_stream_work=*/recv_count != 0));
  if (recv_count == 0) return absl::OkStatus();
  const auto deadline = Clock::now() + options_.timeout;
  const size_t bytes = static_cast<size_t>(Bytes(recv_count, dtype));
  Staged s, r;
  absl::Status status =
      s.Init(send, bytes * static_cast<size_t>(size()), true, stream_, pinned_[0]);
  if (status.ok()) status = r.Init(recv, bytes, false, stream_, pinned_[1]);
  if (status.ok()) {
    status = FP8RT_NCCL_ENQUEUE(ncclReduceScatter(s.device(), r.device(),
                                                  static_cast<size_t>(recv_count), ToNccl(dtype),
                                                  ToNccl(op), comm_, stream_));
  }
  return Finish(status, deadline, "ncclReduceScatter", {&r});
}

absl::Status NcclCommunicator::DoAllToAllV(const void* send, std::span<const int64_t> send_counts,
                                           std::span<const int64_t> send_displs, void* recv,
                                           std::span<const int64_t> recv_counts,
                                           std::span<const int64_t> recv_displs, DType dtype) {
  std::lock_guard<std::mutex> lock(mu_);
  FP8RT_RETURN_IF_ERROR(Begin());
  const auto deadline = Clock::now() + options_.timeout;
  const size_t elem = DTypeSize(dtype);
  Staged s, r;
  absl::Status status =
      s.Init(send, Extent(send_counts, send_displs, elem), true, stream_, pinned_[0]);
  if (status.ok())
    // Staged as an input too: the whole extent is copied back, so the bytes between the receive
    // blocks (which MPI leaves alone) must go out as they came in.
    status = r.Init(recv, Extent(recv_counts, recv_displs, elem), true, stream_, pinned_[1]);
  if (!status.ok()) return Finish(status, deadline, "staging host buffers");
  return Finish(EnqueueAllToAllV(s.device(), send_counts, send_displs, r.device(), recv_counts,
                                 recv_displs, dtype),
                deadline, "ncclSend/ncclRecv group", {&r});
}

absl::Status NcclCommunicator::EnqueueAllToAllV(const void* send,
                                                std::span<const int64_t> send_counts,
                                                std::span<const int64_t> send_displs, void* recv,
                                                std::span<const int64_t> recv_counts,
                                                std::span<const int64_t> recv_displs, DType dtype) {
  const size_t elem = DTypeSize(dtype);
  const ncclDataType_t type = ToNccl(dtype);
  const auto* send_bytes = static_cast<const char*>(send);
  auto* recv_bytes = static_cast<char*>(recv);
  // One group of point-to-point calls: NCCL schedules them together, so the order of peers
  // cannot deadlock. Empty transfers are skipped on both sides (counts agree pairwise).
  absl::Status status = FP8RT_NCCL_ENQUEUE(ncclGroupStart());
  if (!status.ok()) return status;
  for (int peer = 0; peer < size() && status.ok(); ++peer) {
    const size_t p = static_cast<size_t>(peer);
    if (send_counts[p] > 0) {
      status = FP8RT_NCCL_ENQUEUE(ncclSend(send_bytes + send_displs[p] * elem,
                                           static_cast<size_t>(send_counts[p]), type, peer, comm_,
                                           stream_));
    }
    if (status.ok() && recv_counts[p] > 0) {
      status = FP8RT_NCCL_ENQUEUE(ncclRecv(recv_bytes + recv_displs[p] * elem,
                                           static_cast<size_t>(recv_counts[p]), type, peer, comm_,
                                           stream_));
    }
  }
  // The group is closed even after a failed call, or this thread's NCCL group stays open.
  const absl::Status end = FP8RT_NCCL_ENQUEUE(ncclGroupEnd());
  return status.ok() ? end : status;
}

absl::Status NcclCommunicator::DoBroadcast(void* buf, int64_t count, DType dtype, int root) {
  std::lock_guard<std::mutex> lock(mu_);
  FP8RT_RETURN_IF_ERROR(Begin(/*main_stream_work=*/count != 0));
  if (count == 0) return absl::OkStatus();
  const auto deadline = Clock::now() + options_.timeout;
  Staged b;
  absl::Status status =
      b.Init(buf, static_cast<size_t>(Bytes(count, dtype)), true, stream_, pinned_[0]);
  if (status.ok()) {
    status = FP8RT_NCCL_ENQUEUE(ncclBroadcast(b.device(), b.device(), static_cast<size_t>(count),
                                              ToNccl(dtype), root, comm_, stream_));
  }
  return Finish(status, deadline, "ncclBroadcast", {&b});
}

absl::Status NcclCommunicator::DoBarrier() {
  std::lock_guard<std::mutex> lock(mu_);
  FP8RT_RETURN_IF_ERROR(Begin());
  const auto deadline = Clock::now() + options_.timeout;
  // MAX of zeros keeps the buffer at zero however many barriers run.
  return Finish(FP8RT_NCCL_ENQUEUE(ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclInt32, ncclMax,
                                                 comm_, stream_)),
                deadline, "ncclAllReduce (barrier)");
}

// --- Completion::kStream -------------------------------------------------------------------------

absl::Status NcclCommunicator::DoCheckStreamOrdered() {
  std::lock_guard<std::mutex> lock(mu_);
  CheckQueued();
  // A collective that failed and ended (its event complete) shows only in NCCL's state.
  if (comm_ != nullptr) (void)BreakOnAsyncError();
  return broken_;
}

absl::Status NcclCommunicator::WaitEnqueued(Clock::time_point deadline, const char* what) {
  for (int64_t polls = 0;; ++polls) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
    if (rc != ncclSuccess) {
      return Break(internal::NcclErrorStatus(rc, "ncclCommGetAsyncError", __FILE__, __LINE__));
    }
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) {
      return Break(
          internal::NcclErrorStatus(state, AsyncErrorSource(what).c_str(), __FILE__, __LINE__));
    }
    if (Clock::now() >= deadline) {
      return Break(Timeout(AsyncErrorSource(what).c_str(), options_.timeout));
    }
    Pause(polls);
  }
}

absl::StatusOr<cudaEvent_t> NcclCommunicator::Track(cudaStream_t stream, Clock::time_point deadline,
                                                    const char* what) {
  cudaEvent_t done = nullptr;
  if (!spare_events_.empty()) {
    done = spare_events_.back();
    spare_events_.pop_back();
  }
  absl::Status status = [&]() -> absl::Status {
    if (done == nullptr) {
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    }
    CUDA_RETURN_IF_ERROR(cudaEventRecord(done, stream));
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    if (done != nullptr) (void)cudaEventDestroy(done);
    return status;
  }
  queued_.push_back(Queued{.done = done, .deadline = deadline, .what = what});
  if (!watchdog_.joinable()) watchdog_ = std::thread([this] { Watch(); });
  return done;
}

absl::Status NcclCommunicator::Queue(absl::Status enqueued, Clock::time_point deadline,
                                     const char* what) {
  if (!enqueued.ok()) return Break(enqueued);
  FP8RT_RETURN_IF_ERROR(WaitEnqueued(deadline, what));
  absl::StatusOr<cudaEvent_t> done = Track(stream_, deadline, what);
  if (!done.ok()) return Break(done.status());
  // The default stream's later work (the model's kernels, copies, frees, a synchronisation)
  // waits for the collective even where no kernel follows it on the default stream before a sync.
  if (const cudaError_t e = cudaStreamWaitEvent(cudaStreamLegacy, *done, 0); e != cudaSuccess) {
    return Break(
        internal::CudaErrorStatus(e, "cudaStreamWaitEvent(queued collective)", __FILE__, __LINE__));
  }
  return absl::OkStatus();
}

std::string NcclCommunicator::AsyncErrorSource(const char* what) const {
  // NCCL's asynchronous error is the communicator's: with collectives of it still queued (or a
  // collective started), any of them may have failed, not necessarily this call.
  return queued_.empty() ? std::string(what)
                         : absl::StrCat(what, " or a queued or started collective");
}

bool NcclCommunicator::BreakOnAsyncError() {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
  if (rc != ncclSuccess) {
    (void)Break(internal::NcclErrorStatus(rc, "ncclCommGetAsyncError", __FILE__, __LINE__));
    return false;
  }
  if (state != ncclSuccess && state != ncclInProgress) {
    // Any of the communicator's collectives may have failed, not necessarily the oldest queued.
    (void)Break(
        internal::NcclErrorStatus(state, "a queued or started collective", __FILE__, __LINE__));
    return false;
  }
  return true;
}

void NcclCommunicator::CheckQueued() {
  while (!queued_.empty() && comm_ != nullptr) {
    const Queued& q = queued_.front();
    const cudaError_t e = cudaEventQuery(q.done);
    if (e == cudaSuccess) {
      spare_events_.push_back(q.done);
      queued_.pop_front();
      continue;
    }
    if (e != cudaErrorNotReady) {
      (void)Break(
          internal::CudaErrorStatus(e, "cudaEventQuery (queued collective)", __FILE__, __LINE__));
      break;
    }
    if (BreakOnAsyncError() && Clock::now() >= q.deadline) {
      (void)Break(Timeout(q.what, options_.timeout));
    }
    break;  // the oldest is still running: the later ones are behind it on the stream
  }
  if (comm_ == nullptr) {
    // Aborted: nothing queued will be waited for any more. An event destroyed before its work
    // completes is released by CUDA once it does.
    for (const Queued& q : queued_) (void)cudaEventDestroy(q.done);
    queued_.clear();
  }
}

void NcclCommunicator::Watch() {
  (void)cudaSetDevice(device_);
  const auto period = std::clamp<std::chrono::milliseconds>(
      options_.timeout / 20, std::chrono::milliseconds(1), std::chrono::milliseconds(100));
  std::unique_lock<std::mutex> w(watch_mu_);
  while (!stop_) {
    watch_cv_.wait_for(w, period, [this] { return stop_; });
    if (stop_) break;
    w.unlock();
    {
      // A call in progress holds mu_ and polls against its own deadline, which is later than
      // every queued collective's: leave the communicator to it.
      std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
      if (lock.owns_lock()) CheckQueued();
    }
    w.lock();
  }
}

absl::Status NcclCommunicator::DoAllReduceQueued(void* buf, int64_t count, DType dtype,
                                                 ReduceOp op) {
  if (count == 0 || !DeviceAddressable(buf)) return DoAllReduce(buf, count, dtype, op);
  std::lock_guard<std::mutex> lock(mu_);
  FP8RT_RETURN_IF_ERROR(Begin());
  const auto deadline = Clock::now() + options_.timeout;
  return Queue(FP8RT_NCCL_ENQUEUE(ncclAllReduce(buf, buf, static_cast<size_t>(count), ToNccl(dtype),
                                                ToNccl(op), comm_, stream_)),
               deadline, "ncclAllReduce (stream-ordered)");
}

absl::Status NcclCommunicator::DoAllGatherQueued(const void* send, int64_t count, void* recv,
                                                 DType dtype) {
  if (count == 0 || !DeviceAddressable(send) || !DeviceAddressable(recv)) {
    return DoAllGather(send, count, recv, dtype);
  }
  std::lock_guard<std::mutex> lock(mu_);
  FP8RT_RETURN_IF_ERROR(Begin());
  const auto deadline = Clock::now() + options_.timeout;
  return Queue(FP8RT_NCCL_ENQUEUE(ncclAllGather(send, recv, static_cast<size_t>(count),
                                                ToNccl(dtype), comm_, stream_)),
               deadline, "ncclAllGather (stream-ordered)");
}

absl::Status NcclCommunicator::DoReduceScatterQueued(const void* send, void* recv,
                                                     int64_t recv_count, DType dtype, ReduceOp op) {
  if (recv_count == 0 || !DeviceAddressable(send) || !DeviceAddressable(recv)) {
    return DoReduceScatter(send, recv, recv_count, dtype, op);
  }
  std::lock_guard<std::mutex> lock(mu_);
  FP8RT_RETURN_IF_ERROR(Begin());
  const auto deadline = Clock::now() + options_.timeout;
  return Queue(FP8RT_NCCL_ENQUEUE(ncclReduceScatter(send, recv, static_cast<size_t>(recv_count),
                                                    ToNccl(dtype), ToNccl(op), comm_, stream_)),
               deadline, "ncclReduceScatter (stream-ordered)");
}

absl::Status NcclCommunicator::DoAllToAllVQueued(const void* send,
                                                 std::span<const int64_t> send_counts,
                                                 std::span<const int64_t> send_displs, void* recv,
                                                 std::span<const int64_t> recv_counts,
                                                 std::span<const int64_t> recv_displs,
                                                 DType dtype) {
  int64_t sent = 0, received = 0;
  for (size_t p = 0; p < send_counts.size(); ++p) {
    sent += send_counts[p];
    received += recv_counts[p];
  }
  // A buffer that needs staging: the blocking form. A side that moves nothing may be null.
  if ((sent > 0 && !DeviceAddressable(send)) || (received > 0 && !DeviceAddressable(recv))) {
    return DoAllToAllV(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
  }
  std::lock_guard<std::mutex> lock(mu_);
  FP8RT_RETURN_IF_ERROR(Begin());
  // Nothing to move for this rank (its peers' sends and receives pair among themselves): no
  // call, and no wait for the group's queued collectives either.
  if (sent == 0 && received == 0) return absl::OkStatus();
  const auto deadline = Clock::now() + options_.timeout;
  return Queue(
      EnqueueAllToAllV(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype),
      deadline, "ncclSend/ncclRecv group (stream-ordered)");
}

// --- NcclCommunicatorFactory -------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<NcclCommunicatorFactory>> NcclCommunicatorFactory::Create(
    Communicator& bootstrap, int device, const NcclOptions& options) {
  if (device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("device must be >= 0, got ", device));
  }
  const int rank = bootstrap.rank();
  const int size = bootstrap.size();

  // Local setup first, then agree on it over the bootstrap, so that one rank without a usable
  // GPU gives every rank an error naming it instead of a timeout in ncclCommInitRank.
  ncclUniqueId id{};
  absl::Status local = [&]() -> absl::Status {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    if (rank == 0) NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
    return absl::OkStatus();
  }();
  int32_t failed = local.ok() ? 0 : rank + 1;  // 1 + the highest failing rank, after the MAX
  FP8RT_RETURN_IF_ERROR(bootstrap.AllReduce(&failed, 1, DType::kI32, ReduceOp::kMax));
  if (!local.ok()) {
    return absl::Status(local.code(), absl::StrCat("CUDA device ", device, ": ", local.message()));
  }
  if (failed != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", failed - 1,
                     " could not set up its CUDA device or the NCCL unique id (see that "
                     "rank's error); NCCL was not initialised"));
  }
  FP8RT_RETURN_IF_ERROR(bootstrap.Broadcast(&id, sizeof(id), DType::kU8, /*root=*/0));

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // init, split and connection setup return instead of hanging
  ncclComm_t comm = nullptr;
  const auto deadline = Clock::now() + options.timeout;
  absl::Status status = FP8RT_NCCL_ENQUEUE(ncclCommInitRankConfig(&comm, size, id, rank, &config));
  if (status.ok()) status = WaitState(comm, deadline, options.timeout, "ncclCommInitRankConfig");
  if (!status.ok()) {
    if (comm != nullptr) (void)ncclCommAbort(comm);
    return status;
  }

  std::unique_ptr<NcclCommunicatorFactory> factory(new NcclCommunicatorFactory(options));
  FP8RT_ASSIGN_OR_RETURN(factory->world_, NcclCommunicator::Wrap("world", device, comm, options));
  return factory;
}

NcclCommunicatorFactory::~NcclCommunicatorFactory() = default;

absl::StatusOr<std::unique_ptr<CommunicatorFactory>> CreateNcclCommunicatorFactory(
    Communicator& bootstrap, int device, const NcclOptions& options) {
  FP8RT_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicatorFactory> factory,
                         NcclCommunicatorFactory::Create(bootstrap, device, options));
  return std::unique_ptr<CommunicatorFactory>(std::move(factory));
}

absl::StatusOr<std::unique_ptr<Communicator>> NcclCommunicatorFactory::Split(int color, int key,
                                                                             std::string name) {
  if (color < 0) {
    return absl::InvalidArgumentError(absl::StrCat("split color must be >= 0, got ", color));
  }
  NcclCommunicator& world = *world_;
  std::lock_guard<std::mutex> lock(world.mu_);
  FP8RT_RETURN_IF_ERROR(world.Begin());
  const auto deadline = Clock::now() + options_.timeout;

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  // NCCL writes the child handle from its own thread once the split completes, possibly after a
  // timeout made us give up: the slot lives on the heap and is leaked in that case.
  auto slot = std::make_unique<ncclComm_t>(nullptr);
  absl::Status status =
      FP8RT_NCCL_ENQUEUE(ncclCommSplit(world.comm(), color, key, slot.get(), &config));
  // The parent stays ncclInProgress until the split is done; an error or timeout there leaves
  // the world unusable, so it is aborted.
  if (status.ok()) {
    status = WaitState(world.comm(), deadline, options_.timeout, "ncclCommSplit");
  }
  if (!status.ok()) {
    (void)slot.release();
    return world.Break(status);
  }
  // The parent reaching ncclSuccess does not guarantee the handle is written yet (NCCL 2.23+).
  std::atomic_ref<ncclComm_t> child_ref(*slot);
  for (int64_t polls = 0; child_ref.load(std::memory_order_acquire) == nullptr; ++polls) {
    if (Clock::now() >= deadline) {
      (void)slot.release();
      return world.Break(Timeout("ncclCommSplit", options_.timeout));
    }
    Pause(polls);
  }
  ncclComm_t child = child_ref.load(std::memory_order_acquire);
  status = WaitState(child, deadline, options_.timeout, "ncclCommSplit (new communicator)");
  if (!status.ok()) {
    (void)ncclCommAbort(child);
    return status;
  }
  FP8RT_ASSIGN_OR_RETURN(auto group,
                         NcclCommunicator::Wrap(std::move(name), world.device(), child, options_));
  return std::unique_ptr<Communicator>(std::move(group));
}

}  // namespace fp8rt::parallel
