// Communicator: collectives over one process group (world, TP, DP, EP, expert-DP).
//
// The public methods validate their arguments, count bytes by (op, dtype) for the metrics, and
// call the backend's Do* method (MPI for CPU ranks in parallel/mpi/, NCCL for GPU ranks in
// parallel/nccl/). Buffers are host memory for MPI and device memory for NCCL; the interface is
// the same. Collectives are blocking and must be called in the same order on every rank of the
// group, except StartAllGather and StartReduceScatter, which start a collective and return a
// PendingCollective to wait on later (FSDP prefetches the next layer's weight with the first while
// the current layer computes, and reduces a layer's gradient with the second while the layers
// below run their backward); each counts, in that order, as the call that started it. A backend
// never hangs forever: a collective that does not complete within the group's timeout returns
// DeadlineExceeded naming the op and group, after which the communicator is unusable (the job is
// expected to tear down and restart from a checkpoint).
//
// Stream-ordered completion (Completion::kStream, all-reduce, all-gather, reduce-scatter and
// all-to-all): for results that only the device's later work reads (a TP activation sum, a
// current-scaling amax, a gradient shard, MoE tokens sent to their experts' ranks). A backend whose
// buffers are device memory (NCCL) then returns once the collective is on the device's queue,
// ordered before every kernel, copy and synchronisation queued after it on the default stream,
// instead of waiting for it to complete; the host may read the buffers only after such a
// synchronisation. A collective queued this way that fails or outlives the group's timeout aborts
// the communicator from a watchdog thread: the device work waiting for it is released, and the next
// call on the group returns the error. Backends with host buffers (MPI), and NCCL with host
// buffers, complete such calls before returning, as with Completion::kHost.
//
// Reductions: kSum and kMax on f32, bf16, i32, i64. A BF16 sum adds in FP32 and rounds to BF16
// once per reduction step, as NCCL does. FP8 bytes (kU8) are never reduced: gather, all-to-all
// and broadcast only (a sum of FP8 values rounded to FP8 at every step would lose the gradient).
//
// Thread-compatible: one thread drives a communicator at a time. stats() may be read between
// calls.
#ifndef FP8RT_PARALLEL_COMMUNICATOR_H_
#define FP8RT_PARALLEL_COMMUNICATOR_H_

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fp8rt::parallel {

enum class DType : uint8_t { kF32, kBF16, kU8, kI32, kI64 };
inline constexpr int kNumDTypes = 5;
size_t DTypeSize(DType dtype);
std::string_view DTypeName(
    DType dtype);  // "f32", "bf16", "fp8" (kU8 carries FP8 bytes), "i32", "i64"

enum class ReduceOp : uint8_t { kSum, kMax };

// When a collective's results are ready for the caller (see "Stream-ordered completion" above).
enum class Completion : uint8_t {
  kHost,    // on return (every backend, every buffer)
  kStream,  // for the device's work queued after the call; for the host after a synchronisation
};

enum class CollectiveOp : uint8_t {
  kAllReduce,
  kAllGather,
  kReduceScatter,
  kAllToAllV,
  kBroadcast,
  kBarrier,
};
inline constexpr int kNumCollectiveOps = 6;
std::string_view CollectiveOpName(CollectiveOp op);  // "all_reduce", "all_gather", ...

// Bytes this rank sent into collectives, and calls made, by op and dtype.
struct CommStats {
  std::array<std::array<int64_t, kNumDTypes>, kNumCollectiveOps> bytes{};
  std::array<std::array<int64_t, kNumDTypes>, kNumCollectiveOps> calls{};
  int64_t Bytes(CollectiveOp op, DType dtype) const {
    return bytes[static_cast<int>(op)][static_cast<int>(dtype)];
  }
  int64_t Calls(CollectiveOp op, DType dtype) const {
    return calls[static_cast<int>(op)][static_cast<int>(dtype)];
  }
  int64_t TotalBytes() const;
};

// An all-gather in flight (Communicator::StartAllGather). Wait() completes it, within the group's
// deadline counted from the start, and returns its status; the receive buffer may be read only
// after an OK Wait(). A handle destroyed without Wait() waits (and drops the error). The
// communicator must outlive the handle.
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  [[nodiscard]] virtual absl::Status Wait() = 0;
  // For a receive buffer that only the device's later work reads (FSDP's gathered weights): with
  // NCCL the default stream waits for the gather and the host does not; a failure or timeout
  // then aborts the communicator from its watchdog and shows at Communicator::
  // CheckStreamOrdered or the group's next call (see "Stream-ordered completion"). Elsewhere:
  // Wait(). Wait() after it returns its status.
  [[nodiscard]] virtual absl::Status WaitStreamOrdered() { return Wait(); }
  // Whether the collective may still be running: false when it ran to completion (or failed)
  // before the handle was returned, as with the backends that have no nonblocking form; Wait()
  // then returns at once. Callers use it to finish such a handle at once instead of keeping its
  // buffers alive for nothing.
  virtual bool InFlight() const { return true; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  // The group's name ("world", "tp", "dp", "ep", "edp"), this rank's index in it and its size.
  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  const CommStats& stats() const { return stats_; }

  // In place: buf (count elements) becomes the reduction over the group.
  absl::Status AllReduce(void* buf, int64_t count, DType dtype, ReduceOp op,
                         Completion completion = Completion::kHost);
  // recv (size() * count elements) receives every rank's `count` elements, in rank order.
  // In place when send is recv + rank() * count elements (this rank's block already there).
  absl::Status AllGather(const void* send, int64_t count, void* recv, DType dtype,
                         Completion completion = Completion::kHost);
  // The same all-gather, started: returns at once (MPI: MPI_Iallgather; NCCL: on a side stream
  // that the model's compute does not wait for, with device buffers) and completes in Wait().
  // Neither buffer may be touched until then. Backends without a nonblocking form (the
  // fault-injecting wrapper, one-rank groups, NCCL with host buffers) run it to completion here
  // and hand back a completed handle, so callers need not care which they got.
  absl::StatusOr<std::unique_ptr<PendingCollective>> StartAllGather(const void* send,
                                                                    int64_t count, void* recv,
                                                                    DType dtype);
  // send holds size() * recv_count elements; rank r receives the reduction of block r.
  absl::Status ReduceScatter(const void* send, void* recv, int64_t recv_count, DType dtype,
                             ReduceOp op, Completion completion = Completion::kHost);
  // The same reduce-scatter, started (FSDP's gradient reductions, which overlap the backward of
  // the layers below): returns at once where the backend has a nonblocking form that pays (NCCL
  // with device buffers: on the side stream, like StartAllGather) and completes in Wait() or
  // WaitStreamOrdered(). Neither buffer may be touched until then. Elsewhere (MPI: its
  // nonblocking collectives progress only inside MPI calls, so starting early gains nothing on
  // CPU ranks and would keep the send buffer alive longer) it runs to completion here and hands
  // back a completed handle (InFlight() false).
  absl::StatusOr<std::unique_ptr<PendingCollective>> StartReduceScatter(const void* send,
                                                                        void* recv,
                                                                        int64_t recv_count,
                                                                        DType dtype, ReduceOp op);
  // Counts and displacements in elements, one per rank of the group.
  absl::Status AllToAllV(const void* send, std::span<const int64_t> send_counts,
                         std::span<const int64_t> send_displs, void* recv,
                         std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                         DType dtype, Completion completion = Completion::kHost);
  absl::Status Broadcast(void* buf, int64_t count, DType dtype, int root);
  absl::Status Barrier();
  // The error of any Completion::kStream collective of this group that failed or timed out (OK
  // when none did): call it after the synchronisation that makes their results visible, before
  // the host trusts anything derived from them (a loss, statistics, a step). Never waits for the
  // device. Backends that complete every call at once: OK (each call reported its own error).
  absl::Status CheckStreamOrdered();

  // Bytes this rank contributes to one call, as counted in stats() (what it sends into the
  // collective: count * element size, size() * recv_count for reduce-scatter, the sum of
  // send_counts for all-to-all).
  static int64_t Bytes(int64_t elements, DType dtype) {
    return elements * static_cast<int64_t>(DTypeSize(dtype));
  }

 protected:
  Communicator(std::string name, int rank, int size)
      : name_(std::move(name)), rank_(rank), size_(size) {}

  virtual absl::Status DoAllReduce(void* buf, int64_t count, DType dtype, ReduceOp op) = 0;
  virtual absl::Status DoAllGather(const void* send, int64_t count, void* recv, DType dtype) = 0;
  virtual absl::Status DoReduceScatter(const void* send, void* recv, int64_t recv_count,
                                       DType dtype, ReduceOp op) = 0;
  virtual absl::Status DoAllToAllV(const void* send, std::span<const int64_t> send_counts,
                                   std::span<const int64_t> send_displs, void* recv,
                                   std::span<const int64_t> recv_counts,
                                   std::span<const int64_t> recv_displs, DType dtype) = 0;
  virtual absl::Status DoBroadcast(void* buf, int64_t count, DType dtype, int root) = 0;
  virtual absl::Status DoBarrier() = 0;
  // Completion::kStream forms. Default: the Completion::kHost form (DoAllReduce, ...).
  virtual absl::Status DoAllReduceQueued(void* buf, int64_t count, DType dtype, ReduceOp op);
  virtual absl::Status DoAllGatherQueued(const void* send, int64_t count, void* recv, DType dtype);
  virtual absl::Status DoReduceScatterQueued(const void* send, void* recv, int64_t recv_count,
                                             DType dtype, ReduceOp op);
  virtual absl::Status DoAllToAllVQueued(const void* send, std::span<const int64_t> send_counts,
                                         std::span<const int64_t> send_displs, void* recv,
                                         std::span<const int64_t> recv_counts,
                                         std::span<const int64_t> recv_displs, DType dtype);
  // Default: OK (every call completed when it returned, and reported its own error).
  virtual absl::Status DoCheckStreamOrdered();
  // Default: DoAllGather now, and a completed handle.
  virtual absl::StatusOr<std::unique_ptr<PendingCollective>> DoStartAllGather(const void* send,
                                                                              int64_t count,
                                                                              void* recv,
                                                                              DType dtype);
  // Default: DoReduceScatter now, and a completed handle.
  virtual absl::StatusOr<std::unique_ptr<PendingCollective>> DoStartReduceScatter(
      const void* send, void* recv, int64_t recv_count, DType dtype, ReduceOp op);

 private:
  void Count(CollectiveOp op, DType dtype, int64_t bytes);
  // Prefixes a backend error with the op and group so that every failure names both.
  absl::Status Annotate(CollectiveOp op, absl::Status status) const;
  std::string AnnotationPrefix(CollectiveOp op) const;  // "all_gather on group 'dp' (rank 0 of 2): "
  // A started collective's handle, its errors (at the start and at Wait) annotated like Annotate.
  absl::StatusOr<std::unique_ptr<PendingCollective>> Started(
      CollectiveOp op, absl::StatusOr<std::unique_ptr<PendingCollective>> started) const;

  const std::string name_;  // fixed after construction
  const int rank_;
  const int size_;
  CommStats stats_;
};

// Creates the communicators of a job: the world, and subgroups split from it.
class CommunicatorFactory {
 public:
  virtual ~CommunicatorFactory() = default;
  virtual Communicator& World() = 0;
  // Collective over the world: ranks with the same `color` form one group, ordered by `key`.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                              std::string name) = 0;
};

// Every rank's `mine` (its host's name, its GPU's PCI bus id), in rank order: an all-gather over
// `group`, within its timeout, of `max_bytes` per rank. A string ends at its first NUL byte and is
// cut at `max_bytes` (so compare only strings known to be shorter). InvalidArgument for
// `max_bytes` 0. Collective: every rank of the group calls it.
absl::StatusOr<std::vector<std::string>> AllGatherStrings(Communicator& group,
                                                          std::string_view mine, size_t max_bytes);

}  // namespace fp8rt::parallel

#endif  // FP8RT_PARALLEL_COMMUNICATOR_H_
