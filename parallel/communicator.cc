// Communicator front end: argument checks, byte counting and error annotation shared by every
// backend.
#include "parallel/communicator.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace fp8rt::parallel {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kU8:
      return 1;
    case DType::kI64:
      return 8;
  }
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kU8:
      return "fp8";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
  }
  return "?";
}

std::string_view CollectiveOpName(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllReduce:
      return "all_reduce";
    case CollectiveOp::kAllGather:
      return "all_gather";
    case CollectiveOp::kReduceScatter:
      return "reduce_scatter";
    case CollectiveOp::kAllToAllV:
      return "all_to_all_v";
    case CollectiveOp::kBroadcast:
      return "broadcast";
    case CollectiveOp::kBarrier:
      return "barrier";
  }
  return "?";
}

int64_t CommStats::TotalBytes() const {
  int64_t total = 0;
  for (const auto& per_op : bytes) {
    for (int64_t b : per_op) total += b;
  }
  return total;
}

void Communicator::Count(CollectiveOp op, DType dtype, int64_t bytes) {
  stats_.bytes[static_cast<int>(op)][static_cast<int>(dtype)] += bytes;
  stats_.calls[static_cast<int>(op)][static_cast<int>(dtype)] += 1;
}

std::string Communicator::AnnotationPrefix(CollectiveOp op) const {
  return absl::StrCat(std::string(CollectiveOpName(op)), " on group '", name_, "' (rank ", rank_,
                      " of ", size_, "): ");
}

absl::Status Communicator::Annotate(CollectiveOp op, absl::Status status) const {
  if (status.ok()) return status;
  const std::string prefix = AnnotationPrefix(op);
  // A wrapper (FaultInjectingCommunicator) calls an inner communicator that annotated already.
  if (absl::StartsWith(status.message(), prefix)) return status;
  return absl::Status(status.code(), absl::StrCat(prefix, status.message()));
}

namespace {

absl::Status CheckReducible(DType dtype) {
  if (dtype == DType::kU8) {
    return absl::InvalidArgumentError(
        "dtype: FP8 bytes are never reduced (sum in FP8 would round at every step); reduce in "
        "BF16 or FP32");
  }
  return absl::OkStatus();
}

absl::Status CheckCount(int64_t count, const void* buf, const char* what) {
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat("count must be >= 0, got ", count));
  if (count > 0 && buf == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(what, " is null"));
  return absl::OkStatus();
}

absl::Status CheckCompletion(Completion completion) {
  if (completion == Completion::kHost || completion == Completion::kStream) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("completion must be host or stream, got ", static_cast<int>(completion)));
}

}  // namespace

absl::Status Communicator::AllReduce(void* buf, int64_t count, DType dtype, ReduceOp op,
                                     Completion completion) {
  absl::Status s = CheckReducible(dtype);
  if (s.ok()) s = CheckCount(count, buf, "buf");
  if (s.ok()) s = CheckCompletion(completion);
  if (!s.ok()) return Annotate(CollectiveOp::kAllReduce, s);
  Count(CollectiveOp::kAllReduce, dtype, Bytes(count, dtype));
  return Annotate(CollectiveOp::kAllReduce, completion == Completion::kStream
                                                ? DoAllReduceQueued(buf, count, dtype, op)
                                                : DoAllReduce(buf, count, dtype, op));
}

absl::Status Communicator::AllGather(const void* send, int64_t count, void* recv, DType dtype,
                                     Completion completion) {
  absl::Status s = CheckCount(count, send, "send");
  if (s.ok()) s = CheckCount(count, recv, "recv");
  if (s.ok()) s = CheckCompletion(completion);
  if (!s.ok()) return Annotate(CollectiveOp::kAllGather, s);
  Count(CollectiveOp::kAllGather, dtype, Bytes(count, dtype));
  return Annotate(CollectiveOp::kAllGather, completion == Completion::kStream
                                                ? DoAllGatherQueued(send, count, recv, dtype)
                                                : DoAllGather(send, count, recv, dtype));
}

absl::Status Communicator::CheckStreamOrdered() {
  absl::Status s = DoCheckStreamOrdered();
  if (s.ok()) return s;
  return absl::Status(s.code(),
                      absl::StrCat("group '", name_, "' (rank ", rank_, " of ", size_,
                                   "): a stream-ordered collective failed: ", s.message()));
}

absl::Status Communicator::DoCheckStreamOrdered() { return absl::OkStatus(); }

absl::Status Communicator::DoAllReduceQueued(void* buf, int64_t count, DType dtype, ReduceOp op) {
  return DoAllReduce(buf, count, dtype, op);
}

absl::Status Communicator::DoAllGatherQueued(const void* send, int64_t count, void* recv,
                                             DType dtype) {
  return DoAllGather(send, count, recv, dtype);
}

absl::Status Communicator::DoReduceScatterQueued(const void* send, void* recv, int64_t recv_count,
                                                 DType dtype, ReduceOp op) {
  return DoReduceScatter(send, recv, recv_count, dtype, op);
}

absl::Status Communicator::DoAllToAllVQueued(const void* send, std::span<const int64_t> send_counts,
                                             std::span<const int64_t> send_displs, void* recv,
                                             std::span<const int64_t> recv_counts,
                                             std::span<const int64_t> recv_displs, DType dtype) {
  return DoAllToAllV(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
}

namespace {

// A collective that completed (or failed) when it was started.
class DonePending : public PendingCollective {
 public:
  explicit DonePending(absl::Status status) : status_(std::move(status)) {}
  absl::Status Wait() override { return status_; }
  bool InFlight() const override { return false; }

 private:
  const absl::Status status_;
};

// Annotates the status of the wrapped handle's Wait like a blocking call.
class AnnotatedPending : public PendingCollective {
 public:
  AnnotatedPending(std::unique_ptr<PendingCollective> inner, std::string prefix)
      : inner_(std::move(inner)), prefix_(std::move(prefix)) {}
  absl::Status Wait() override { return Annotate(inner_->Wait()); }
  absl::Status WaitStreamOrdered() override { return Annotate(inner_->WaitStreamOrdered()); }
  bool InFlight() const override { return inner_->InFlight(); }

 private:
  absl::Status Annotate(absl::Status s) const {
    if (s.ok() || absl::StartsWith(s.message(), prefix_)) return s;
    return absl::Status(s.code(), absl::StrCat(prefix_, s.message()));
  }

  std::unique_ptr<PendingCollective> inner_;
  const std::string prefix_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PendingCollective>> Communicator::StartAllGather(const void* send,
                                                                                int64_t count,
                                                                                void* recv,
                                                                                DType dtype) {
  absl::Status s = CheckCount(count, send, "send");
  if (s.ok()) s = CheckCount(count, recv, "recv");
  if (!s.ok()) return Annotate(CollectiveOp::kAllGather, s);
  Count(CollectiveOp::kAllGather, dtype, Bytes(count, dtype));
  return Started(CollectiveOp::kAllGather, DoStartAllGather(send, count, recv, dtype));
}

absl::StatusOr<std::unique_ptr<PendingCollective>> Communicator::Started(
    CollectiveOp op, absl::StatusOr<std::unique_ptr<PendingCollective>> started) const {
  if (!started.ok()) return Annotate(op, started.status());
  return std::unique_ptr<PendingCollective>(
      std::make_unique<AnnotatedPending>(*std::move(started), AnnotationPrefix(op)));
}

absl::StatusOr<std::unique_ptr<PendingCollective>> Communicator::DoStartAllGather(
    const void* send, int64_t count, void* recv, DType dtype) {
  return std::unique_ptr<PendingCollective>(
      std::make_unique<DonePending>(DoAllGather(send, count, recv, dtype)));
}

absl::Status Communicator::ReduceScatter(const void* send, void* recv, int64_t recv_count,
                                         DType dtype, ReduceOp op, Completion completion) {
  absl::Status s = CheckReducible(dtype);
  if (s.ok()) s = CheckCount(recv_count, send, "send");
  if (s.ok()) s = CheckCount(recv_count, recv, "recv");
  if (s.ok()) s = CheckCompletion(completion);
  if (!s.ok()) return Annotate(CollectiveOp::kReduceScatter, s);
  Count(CollectiveOp::kReduceScatter, dtype, Bytes(recv_count * size_, dtype));
  return Annotate(CollectiveOp::kReduceScatter,
                  completion == Completion::kStream
                      ? DoReduceScatterQueued(send, recv, recv_count, dtype, op)
                      : DoReduceScatter(send, recv, recv_count, dtype, op));
}

absl::StatusOr<std::unique_ptr<PendingCollective>> Communicator::StartReduceScatter(
    const void* send, void* recv, int64_t recv_count, DType dtype, ReduceOp op) {
  absl::Status s = CheckReducible(dtype);
  if (s.ok()) s = CheckCount(recv_count, send, "send");
  if (s.ok()) s = CheckCount(recv_count, recv, "recv");
  if (!s.ok()) return Annotate(CollectiveOp::kReduceScatter, s);
  Count(CollectiveOp::kReduceScatter, dtype, Bytes(recv_count * size_, dtype));
  return Started(CollectiveOp::kReduceScatter,
                 DoStartReduceScatter(send, recv, recv_count, dtype, op));
}

absl::StatusOr<std::unique_ptr<PendingCollective>> Communicator::DoStartReduceScatter(
    const void* send, void* recv, int64_t recv_count, DType dtype, ReduceOp op) {
  return std::unique_ptr<PendingCollective>(
      std::make_unique<DonePending>(DoReduceScatter(send, recv, recv_count, dtype, op)));
}

absl::Status Communicator::AllToAllV(const void* send, std::span<const int64_t> send_counts,
                                     std::span<const int64_t> send_displs, void* recv,
                                     std::span<const int64_t> recv_counts,
                                     std::span<const int64_t> recv_displs, DType dtype,
                                     Completion completion) {
  const size_t n = static_cast<size_t>(size_);
  if (send_counts.size() != n || send_displs.size() != n || recv_counts.size() != n ||
      recv_displs.size() != n) {
    return Annotate(CollectiveOp::kAllToAllV,
                    absl::InvalidArgumentError(absl::StrCat(
                        "counts and displacements need one entry per rank (", size_, ")")));
  }
  int64_t sent = 0, received = 0;
  for (size_t r = 0; r < n; ++r) {
    if (send_counts[r] < 0 || recv_counts[r] < 0 || send_displs[r] < 0 || recv_displs[r] < 0) {
      return Annotate(
          CollectiveOp::kAllToAllV,
          absl::InvalidArgumentError(absl::StrCat("negative count or displacement for rank ", r)));
    }
    sent += send_counts[r];
    received += recv_counts[r];
  }
  absl::Status s = CheckCount(sent, send, "send");
  if (s.ok()) s = CheckCount(received, recv, "recv");
  if (s.ok()) s = CheckCompletion(completion);
  if (!s.ok()) return Annotate(CollectiveOp::kAllToAllV, s);
  Count(CollectiveOp::kAllToAllV, dtype, Bytes(sent, dtype));
  return Annotate(
      CollectiveOp::kAllToAllV,
      completion == Completion::kStream
          ? DoAllToAllVQueued(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype)
          : DoAllToAllV(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype));
}

absl::Status Communicator::Broadcast(void* buf, int64_t count, DType dtype, int root) {
  absl::Status s = CheckCount(count, buf, "buf");
  if (s.ok() && (root < 0 || root >= size_)) {
    s = absl::InvalidArgumentError(absl::StrCat("root ", root, " is not a rank of the group"));
  }
  if (!s.ok()) return Annotate(CollectiveOp::kBroadcast, s);
  Count(CollectiveOp::kBroadcast, dtype, rank_ == root ? Bytes(count, dtype) : 0);
  return Annotate(CollectiveOp::kBroadcast, DoBroadcast(buf, count, dtype, root));
}

absl::Status Communicator::Barrier() {
  Count(CollectiveOp::kBarrier, DType::kU8, 0);
  return Annotate(CollectiveOp::kBarrier, DoBarrier());
}

absl::StatusOr<std::vector<std::string>> AllGatherStrings(Communicator& group,
                                                          std::string_view mine, size_t max_bytes) {
  if (max_bytes == 0) return absl::InvalidArgumentError("AllGatherStrings: max_bytes is 0");
  // Fixed-width, zero-padded int64 words (kU8 would count as FP8 bytes in the group's statistics).
  const size_t words = (max_bytes + 7) / 8;
  std::vector<int64_t> send(words, 0);
  std::memcpy(send.data(), mine.data(), std::min(mine.size(), max_bytes));
  std::vector<int64_t> all(words * static_cast<size_t>(group.size()));
  if (absl::Status s =
          group.AllGather(send.data(), static_cast<int64_t>(words), all.data(), DType::kI64);
      !s.ok()) {
    return s;
  }
  std::vector<std::string> out(static_cast<size_t>(group.size()));
  for (size_t r = 0; r < out.size(); ++r) {
    const char* text = reinterpret_cast<const char*>(all.data() + r * words);
    out[r].assign(text, std::find(text, text + max_bytes, '\0'));
  }
  return out;
}

}  // namespace fp8rt::parallel
