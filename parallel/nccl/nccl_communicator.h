// The NCCL backend of Communicator (GPU ranks, one CUDA device per process).
//
// Buffers passed to the collectives are device memory on the communicator's device (cudaMalloc,
// managed or pinned); plain host memory is accepted too and staged through a temporary device
// buffer (for the step loop's small control values: a loss, a norm, flags). Each
// collective is enqueued on the communicator's own CUDA stream (stream()) and then waited for:
// the call polls the stream and NCCL's asynchronous error state until the work is done, NCCL
// reports an error, or the group's timeout passes. On a timeout or an asynchronous error the NCCL
// communicator is aborted (ncclCommAbort), the call returns DeadlineExceeded (or the NCCL error)
// and every later call on that communicator fails with FailedPrecondition: the job is expected
// to tear down and restart from a checkpoint, as with the MPI backend.
//
// NCCL communicators are created non-blocking (ncclConfig_t::blocking = 0) so that creation,
// splitting and connection setup can time out too instead of hanging on a dead peer.
//
// Ordering with the caller's kernels: stream() is an ordinary (blocking) stream, so a collective
// runs after work already queued on stream() and on the legacy default stream. Work queued on
// other streams must be complete before the call (synchronize it, or make stream() wait on an
// event recorded after it). When a call returns OK its results are visible to every stream.
// Started collectives (StartAllGather, StartReduceScatter) run on a second, non-blocking side
// stream, which the default stream waits for only at WaitStreamOrdered, so that the model's
// compute runs meanwhile; stream() waits for the side stream's last collective before its own.
//
// Completion::kStream (all-reduce, all-gather, reduce-scatter, all-to-all on device-addressable
// buffers): the call waits only until NCCL has put the collective on stream() (immediate unless
// NCCL defers the launch, as a non-blocking communicator may), records an event after it and makes
// the legacy default stream wait for that event, then returns: the model's later kernels, copies
// and synchronisations on the default stream come after the collective, and the host never waits
// for the device at the call. A watchdog thread, started by the first such call (or the first
// StartAllGather or StartReduceScatter on device buffers, which it watches too), checks the queued
// collectives every timeout/20 (at most 100 ms): one that fails, or has not completed within the
// timeout of its call, aborts the NCCL communicator (which ends its kernels, so a host blocked in a
// synchronisation behind it returns), and the next call fails with that error. While a blocking
// call is polling, the watchdog leaves the communicator to it: that call's own deadline covers
// everything queued before it. Host buffers take the blocking path.
//
// The ncclUniqueId of the world is created by rank 0 and broadcast over a bootstrap communicator
// (the MPI world, host memory); subgroups come from ncclCommSplit and need no bootstrap.
//
// Built with CUDA only (FP8RT_CUDA). Code that must also build without it (fp8rt-worker) calls
// CreateNcclCommunicatorFactory, which nccl_communicator_stub.cc defines as an Unavailable error
// in a build without CUDA; the classes below exist in CUDA builds only.
//
// Thread-compatible, like every Communicator (the watchdog is internal: a mutex serialises it
// with the calls; health() may be read from any thread and waits for a call in progress or an
// abort, which may wait for the device). The
// factory and the communicators it returns may be destroyed in any order. Destroying a communicator
// finalizes it (ncclCommFinalize, waiting up to the timeout for its outstanding work) and aborts it
// instead if that fails.
#ifndef FP8RT_PARALLEL_NCCL_NCCL_COMMUNICATOR_H_
#define FP8RT_PARALLEL_NCCL_NCCL_COMMUNICATOR_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "parallel/communicator.h"

// Opaque library handles, so that this header needs neither nccl.h nor cuda_runtime.h:
// ncclComm_t is `ncclComm*` and cudaStream_t is `CUstream_st*`.
struct ncclComm;
struct CUstream_st;
struct CUevent_st;

namespace fp8rt::parallel {

struct NcclOptions {
  // A collective, a communicator creation or a split that has not completed after this long
  // fails with DeadlineExceeded and aborts the NCCL communicator. Also bounds the wait for peers
  // when a communicator is destroyed.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

class NcclCommunicator : public Communicator {
 public:
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // The CUDA device ordinal and the stream the collectives run on (a cudaStream_t).
  int device() const { return device_; }
  CUstream_st* stream() const { return stream_; }
  // OK while usable; otherwise the error that aborted the communicator (a call's, or the
  // watchdog's for a collective queued with Completion::kStream).
  absl::Status health() const;

 protected:
  absl::Status DoAllReduce(void* buf, int64_t count, DType dtype, ReduceOp op) override;
  absl::Status DoAllGather(const void* send, int64_t count, void* recv, DType dtype) override;
  absl::Status DoReduceScatter(const void* send, void* recv, int64_t recv_count, DType dtype,
                               ReduceOp op) override;
  absl::Status DoAllToAllV(const void* send, std::span<const int64_t> send_counts,
                           std::span<const int64_t> send_displs, void* recv,
                           std::span<const int64_t> recv_counts,
                           std::span<const int64_t> recv_displs, DType dtype) override;
  absl::Status DoBroadcast(void* buf, int64_t count, DType dtype, int root) override;
  absl::Status DoBarrier() override;
  // Completion::kStream: see the file comment. Host buffers: the blocking forms.
  absl::Status DoAllReduceQueued(void* buf, int64_t count, DType dtype, ReduceOp op) override;
  absl::Status DoAllGatherQueued(const void* send, int64_t count, void* recv, DType dtype) override;
  absl::Status DoReduceScatterQueued(const void* send, void* recv, int64_t recv_count, DType dtype,
                                     ReduceOp op) override;
  absl::Status DoAllToAllVQueued(const void* send, std::span<const int64_t> send_counts,
                                 std::span<const int64_t> send_displs, void* recv,
                                 std::span<const int64_t> recv_counts,
                                 std::span<const int64_t> recv_displs, DType dtype) override;
  // health(), after taking in what the queued collectives and NCCL's asynchronous state say.
  absl::Status DoCheckStreamOrdered() override;
  // FSDP's prefetch: the all-gather runs on the communicator's side stream, a non-blocking
  // stream, so that the compute on the legacy default stream (the model's ops) overlaps it. It
  // starts after the compute enqueued so far (the FP8 shard the optimizer wrote) and after this
  // communicator's earlier collectives; the next collective on the main stream waits for it, so
  // the communicator's collectives still run one at a time in the order they were called (the
  // same on every rank). Wait() polls its completion event against the deadline, like Finish.
  // Buffers that need staging (plain host memory) take the blocking path.
  absl::StatusOr<std::unique_ptr<PendingCollective>> DoStartAllGather(const void* send,
                                                                      int64_t count, void* recv,
                                                                      DType dtype) override;
  // FSDP's gradient reduction, on the side stream like the gathers: it starts after the compute
  // that wrote the gradient and runs while the backward of the layers below computes; the
  // handle's WaitStreamOrdered makes the default stream's later work (the shard's conversion or
  // accumulation, the free of the full gradient) wait for it. Host buffers: the blocking path.
  absl::StatusOr<std::unique_ptr<PendingCollective>> DoStartReduceScatter(
      const void* send, void* recv, int64_t recv_count, DType dtype, ReduceOp op) override;

 private:
  friend class NcclCommunicatorFactory;
  friend class NcclPendingSide;

  // Takes ownership of `comm`, an initialised NCCL communicator on `device`; on error aborts it.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Wrap(std::string name, int device,
                                                                ncclComm* comm,
                                                                const NcclOptions& options);
  NcclCommunicator(std::string name, int rank, int size, int device, ncclComm* comm,
                   const NcclOptions& options);

  // A host buffer of one collective staged through device memory (defined in the .cc).
  class Staged;
  // Page-locked host memory that a Staged buffer copies through, grown on demand and reused by
  // every collective (Finish waits for the stream, so a slot is free again at the next call).
  struct PinnedSlot {
    void* p = nullptr;
    size_t bytes = 0;
    std::vector<void*> retired;  // smaller slots it replaced, freed with the communicator
  };

  // With mu_ held: polls until NCCL has put the work just enqueued on its stream (the state
  // leaves ncclInProgress), NCCL reports an error or the deadline passes; aborts on failure.
  absl::Status WaitEnqueued(std::chrono::steady_clock::time_point deadline, const char* what);
  // A collective queued with Completion::kStream or started on the side stream, until it is seen
  // complete.
  struct Queued {
    CUevent_st* done = nullptr;  // recorded after the collective on its stream (main or side)
    std::chrono::steady_clock::time_point deadline;
    const char* what = nullptr;  // the NCCL call, for errors
  };

  // Takes mu_: enqueues a collective on the side stream (`enqueue`, given the side stream: the
  // NCCL call) after the compute queued so far and this communicator's earlier collectives, waits
  // until NCCL has put it there, records its event and hands it to the watchdog; returns its
  // handle. Aborts the communicator on any failure. `what` names the call in errors.
  absl::StatusOr<std::unique_ptr<PendingCollective>> StartOnSide(
      const char* what, const std::function<int(CUstream_st*)>& enqueue);
  // With mu_ held: makes the device current, takes in what the watchdog found (CheckQueued) and
  // fails if the communicator was aborted. With `main_stream_work` (the call enqueues work on
  // stream_; not StartOnSide, whose side stream is in call order by itself, nor an empty call),
  // makes stream_ wait for the side stream's last collective.
  absl::Status Begin(bool main_stream_work = true);
  // With mu_ held, after a Completion::kStream collective was enqueued (`enqueued`: the status of
  // the enqueue calls): waits until NCCL has put it on stream_ (its state leaves ncclInProgress)
  // within `deadline`, then records an event after it, makes the legacy default stream wait for
  // the event and hands it to the watchdog. Aborts the communicator on any failure.
  absl::Status Queue(absl::Status enqueued, std::chrono::steady_clock::time_point deadline,
                     const char* what);
  // With mu_ held: enqueues the all-to-all's ncclSend/ncclRecv group on stream_ (device buffers);
  // the status of the enqueue calls, for Finish or Queue.
  absl::Status EnqueueAllToAllV(const void* send, std::span<const int64_t> send_counts,
                                std::span<const int64_t> send_displs, void* recv,
                                std::span<const int64_t> recv_counts,
                                std::span<const int64_t> recv_displs, DType dtype);
  // With mu_ held: records an event on `stream` after the work just enqueued there and hands it
  // to the watchdog (queued_ owns it); returns it.
  absl::StatusOr<CUevent_st*> Track(CUstream_st* stream,
                                    std::chrono::steady_clock::time_point deadline,
                                    const char* what);
  // With mu_ held: drops the queued collectives that completed; aborts the communicator if one
  // failed, NCCL reports an error, or the oldest one still running is past its deadline.
  void CheckQueued();
  // With mu_ held: what an asynchronous NCCL error met by the call `what` is blamed on.
  std::string AsyncErrorSource(const char* what) const;
  // With mu_ held and comm_ set: aborts the communicator if NCCL reports an asynchronous error;
  // whether it is still healthy.
  bool BreakOnAsyncError();
  // The watchdog thread: CheckQueued every period, when no call holds mu_, until stop_.
  void Watch();
  // Poll with mu_ taken (for NcclPendingSide, outside any call).
  absl::Status PollLocked(CUevent_st* done, std::chrono::steady_clock::time_point deadline,
                          const char* what);
  // Waits until the work just enqueued (`enqueued`: the status of the enqueue calls) completes,
  // NCCL reports an error or the deadline passes; aborts the communicator on any failure. Only
  // then are the staged `outputs` copied back to their host buffers, through pinned memory and
  // within the same deadline: a non-blocking communicator may put the collective on the stream
  // after its call returned ncclInProgress, so a copy queued straight after the call could run
  // first. `what` names the NCCL call in errors.
  absl::Status Finish(absl::Status enqueued, std::chrono::steady_clock::time_point deadline,
                      const char* what, std::initializer_list<Staged*> outputs = {});
  // With mu_ held: polls until `done` (an event; null: the main stream) has completed, NCCL
  // reports an error or the deadline passes; aborts the communicator on any failure.
  absl::Status Poll(CUevent_st* done, std::chrono::steady_clock::time_point deadline,
                    const char* what);
  // With mu_ held: aborts the NCCL communicator and remembers why.
  absl::Status Break(absl::Status why);
  // Break with mu_ taken (for NcclPendingSide, outside any call).
  absl::Status BreakLocked(absl::Status why);
  // The NCCL communicator, for ncclCommSplit; null once aborted.
  ncclComm* comm() const { return comm_; }

  const int device_;                 // fixed after construction
  const NcclOptions options_;        // fixed after construction
  // Held by every call that touches the NCCL communicator, and by the watchdog's checks: guards
  // comm_, broken_, queued_ and spare_events_.
  mutable std::mutex mu_;
  ncclComm* comm_;                   // owned; null once aborted
  CUstream_st* stream_ = nullptr;    // owned
  CUstream_st* side_ = nullptr;      // owned, non-blocking; created by the first StartOnSide
  CUevent_st* side_done_ = nullptr;  // owned: recorded after the side stream's last collective
  void* barrier_buf_ = nullptr;      // owned device memory, one int32 for Barrier()
  PinnedSlot pinned_[2];             // owned: a collective's staged send and receive buffers
  absl::Status broken_;              // OK until the communicator is aborted
  std::deque<Queued> queued_;        // owned events, oldest first
  std::vector<CUevent_st*> spare_events_;  // owned: completed queued collectives' events, reused
  std::thread watchdog_;                   // started by the first queued collective
  std::mutex watch_mu_;                    // guards stop_
  std::condition_variable watch_cv_;
  bool stop_ = false;
};

class NcclCommunicatorFactory : public CommunicatorFactory {
 public:
  // Creates the world group ("world") over the ranks of `bootstrap` (the MPI world: same ranks,
  // same order, host buffers), with this process on CUDA device `device`. Collective over
  // `bootstrap`: rank 0 creates the ncclUniqueId and broadcasts it. If any rank fails to set up
  // its device, every rank gets an error naming the failing rank rather than a hang.
  static absl::StatusOr<std::unique_ptr<NcclCommunicatorFactory>> Create(
      Communicator& bootstrap, int device, const NcclOptions& options = {});
  ~NcclCommunicatorFactory() override;

  Communicator& World() override { return *world_; }
  // ncclCommSplit of the world: collective over the world. `color` must be >= 0. A split that
  // times out aborts the world communicator.
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                      std::string name) override;

 private:
  explicit NcclCommunicatorFactory(const NcclOptions& options) : options_(options) {}

  const NcclOptions options_;  // fixed after construction
  std::unique_ptr<NcclCommunicator> world_;
};

// NcclCommunicatorFactory::Create, returned as the interface. Without CUDA in the build:
// Unavailable, saying so.
[[nodiscard]] absl::StatusOr<std::unique_ptr<CommunicatorFactory>> CreateNcclCommunicatorFactory(
    Communicator& bootstrap, int device, const NcclOptions& options = {});

}  // namespace fp8rt::parallel

#endif  // FP8RT_PARALLEL_NCCL_NCCL_COMMUNICATOR_H_
