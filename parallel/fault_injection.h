// FaultInjectingCommunicator: wraps a Communicator and fails or delays chosen calls, in the
// spirit of LevelDB's FaultInjectionTestEnv. Used by tests to check that a failing or slow rank
// gives every rank a clear error instead of a hang.
//
// A fault names the op, the 1-based index of that op's call on this communicator, and the
// action. `kFail` returns `status` without entering the collective (the other ranks then see
// their collective time out); `kDelay` sleeps `delay_ms` before entering it.
// Thread-compatible, like the communicator it wraps.
#ifndef FP8RT_PARALLEL_FAULT_INJECTION_H_
#define FP8RT_PARALLEL_FAULT_INJECTION_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"

namespace fp8rt::parallel {

struct CommFault {
  enum class Action { kFail, kDelay };
  CollectiveOp op = CollectiveOp::kAllReduce;
  int64_t call = 1;  // the n-th call of `op` on this communicator, 1-based
  Action action = Action::kFail;
  int delay_ms = 0;
  absl::Status status = absl::UnavailableError("injected fault");
};

// Parses "fail:op=all_reduce:call=3" or "delay:op=all_gather:call=1:ms=500" (the op names of
// CollectiveOpName). InvalidArgument naming the part that is wrong.
absl::StatusOr<CommFault> ParseCommFault(const std::string& spec);

class FaultInjectingCommunicator : public Communicator {
 public:
  // `inner` must outlive this wrapper.
  FaultInjectingCommunicator(Communicator& inner, std::vector<CommFault> faults);

  // Faults that fired so far.
  int fired() const { return fired_; }

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

 private:
  // OK to proceed into the inner collective, or the injected error.
  absl::Status Before(CollectiveOp op);

  Communicator& inner_;
  std::vector<CommFault> faults_;
  std::array<int64_t, kNumCollectiveOps> calls_{};
  int fired_ = 0;
};

}  // namespace fp8rt::parallel

#endif  // FP8RT_PARALLEL_FAULT_INJECTION_H_
