#include "parallel/fault_injection.h"

#include <chrono>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace fp8rt::parallel {

absl::StatusOr<CommFault> ParseCommFault(const std::string& spec) {
  const std::vector<std::string> parts = absl::StrSplit(spec, ':');
  CommFault fault;
  if (parts.empty() || (parts[0] != "fail" && parts[0] != "delay")) {
    return absl::InvalidArgumentError(
        absl::StrCat("fault '", spec, "': must start with fail or delay"));
  }
  fault.action = parts[0] == "fail" ? CommFault::Action::kFail : CommFault::Action::kDelay;
  bool have_op = false;
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::vector<std::string> kv = absl::StrSplit(parts[i], absl::MaxSplits('=', 1));
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("fault '", spec, "': '", parts[i], "' is not key=value"));
    }
    if (kv[0] == "op") {
      bool found = false;
      for (int o = 0; o < kNumCollectiveOps; ++o) {
        if (kv[1] == CollectiveOpName(static_cast<CollectiveOp>(o))) {
          fault.op = static_cast<CollectiveOp>(o);
          found = true;
        }
      }
      if (!found) {
        return absl::InvalidArgumentError(
            absl::StrCat("fault '", spec, "': unknown op '", kv[1], "'"));
      }
      have_op = true;
    } else if (kv[0] == "call") {
      if (!absl::SimpleAtoi(kv[1], &fault.call) || fault.call < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("fault '", spec, "': call must be an integer >= 1"));
      }
    } else if (kv[0] == "ms") {
      if (!absl::SimpleAtoi(kv[1], &fault.delay_ms) || fault.delay_ms < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("fault '", spec, "': ms must be an integer >= 0"));
      }
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("fault '", spec, "': unknown key '", kv[0], "'"));
    }
  }
  if (!have_op) return absl::InvalidArgumentError(absl::StrCat("fault '", spec, "': op= missing"));
  return fault;
}

FaultInjectingCommunicator::FaultInjectingCommunicator(Communicator& inner,
                                                       std::vector<CommFault> faults)
    : Communicator(inner.name(), inner.rank(), inner.size()),
      inner_(inner),
      faults_(std::move(faults)) {}

absl::Status FaultInjectingCommunicator::Before(CollectiveOp op) {
  const int64_t call = ++calls_[static_cast<int>(op)];
  for (const CommFault& f : faults_) {
    if (f.op != op || f.call != call) continue;
    ++fired_;
    if (f.action == CommFault::Action::kFail) {
      return absl::Status(f.status.code(), absl::StrCat(f.status.message(), " (call ", call, ")"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(f.delay_ms));
  }
  return absl::OkStatus();
}

absl::Status FaultInjectingCommunicator::DoAllReduce(void* buf, int64_t count, DType dtype,
                                                     ReduceOp op) {
  if (absl::Status s = Before(CollectiveOp::kAllReduce); !s.ok()) return s;
  return inner_.AllReduce(buf, count, dtype, op);
}

absl::Status FaultInjectingCommunicator::DoAllGather(const void* send, int64_t count, void* recv,
                                                     DType dtype) {
  if (absl::Status s = Before(CollectiveOp::kAllGather); !s.ok()) return s;
  return inner_.AllGather(send, count, recv, dtype);
}

absl::Status FaultInjectingCommunicator::DoReduceScatter(const void* send, void* recv,
                                                         int64_t recv_count, DType dtype,
                                                         ReduceOp op) {
  if (absl::Status s = Before(CollectiveOp::kReduceScatter); !s.ok()) return s;
  return inner_.ReduceScatter(send, recv, recv_count, dtype, op);
}

absl::Status FaultInjectingCommunicator::DoAllToAllV(
    const void* send, std::span<const int64_t> send_counts, std::span<const int64_t> send_displs,
    void* recv, std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
    DType dtype) {
  if (absl::Status s = Before(CollectiveOp::kAllToAllV); !s.ok()) return s;
  return inner_.AllToAllV(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
}

absl::Status FaultInjectingCommunicator::DoBroadcast(void* buf, int64_t count, DType dtype,
                                                     int root) {
  if (absl::Status s = Before(CollectiveOp::kBroadcast); !s.ok()) return s;
  return inner_.Broadcast(buf, count, dtype, root);
}

absl::Status FaultInjectingCommunicator::DoBarrier() {
  if (absl::Status s = Before(CollectiveOp::kBarrier); !s.ok()) return s;
  return inner_.Barrier();
}

}  // namespace fp8rt::parallel
