// The one-rank world (solo_communicator.h).
#include "parallel/solo_communicator.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace fp8rt::parallel {
namespace {

void Move(void* dst, const void* src, int64_t bytes) {
  if (bytes > 0 && dst != src) std::memmove(dst, src, static_cast<size_t>(bytes));
}

}  // namespace

absl::Status SoloCommunicator::DoAllReduce(void*, int64_t, DType, ReduceOp) {
  return absl::OkStatus();
}

absl::Status SoloCommunicator::DoAllGather(const void* send, int64_t count, void* recv,
                                           DType dtype) {
  Move(recv, send, Bytes(count, dtype));
  return absl::OkStatus();
}

absl::Status SoloCommunicator::DoReduceScatter(const void* send, void* recv, int64_t recv_count,
                                               DType dtype, ReduceOp) {
  Move(recv, send, Bytes(recv_count, dtype));
  return absl::OkStatus();
}

absl::Status SoloCommunicator::DoAllToAllV(const void* send, std::span<const int64_t> send_counts,
                                           std::span<const int64_t> send_displs, void* recv,
                                           std::span<const int64_t> recv_counts,
                                           std::span<const int64_t> recv_displs, DType dtype) {
  if (send_counts[0] != recv_counts[0]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "one rank sends ", send_counts[0], " elements to itself but expects ", recv_counts[0]));
  }
  const int64_t elem = Bytes(1, dtype);
  Move(static_cast<char*>(recv) + recv_displs[0] * elem,
       static_cast<const char*>(send) + send_displs[0] * elem, Bytes(send_counts[0], dtype));
  return absl::OkStatus();
}

absl::Status SoloCommunicator::DoBroadcast(void*, int64_t, DType, int) { return absl::OkStatus(); }

absl::Status SoloCommunicator::DoBarrier() { return absl::OkStatus(); }

absl::StatusOr<std::unique_ptr<Communicator>> SoloCommunicatorFactory::Split(int color, int,
                                                                             std::string name) {
  if (color < 0) return absl::InvalidArgumentError(absl::StrCat("split color ", color, " < 0"));
  return std::make_unique<SoloCommunicator>(std::move(name));
}

}  // namespace fp8rt::parallel
