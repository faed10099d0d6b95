// MPI backend: nonblocking MPI collectives polled against a deadline, BF16 and NaN-aware MAX
// reductions as user-defined MPI_Ops.
#include "parallel/mpi/mpi_communicator.h"

#include <mpi.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/formats.h"
#include "runtime/core/checks.h"
#include "runtime/core/status.h"

namespace fp8rt::internal {

absl::Status MpiErrorStatus(int code, const char* expr, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  return absl::InternalError(absl::StrCat(expr, " failed at ", file, ":", line, ": MPI error ",
                                          code, " (", std::string(text, len), ")"));
}

}  // namespace fp8rt::internal

namespace fp8rt::parallel {
namespace {

// --- user-defined reductions -----------------------------------------------------------------

// inout[i] = inout[i] + in[i], in FP32, rounded to BF16 once: one reduction step.
void Bf16Sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  const int n = *len;
  for (int i = 0; i < n; ++i)
    b[i] = kernels::FloatToBf16(kernels::Bf16ToFloat(a[i]) + kernels::Bf16ToFloat(b[i]));
}

// MAX that returns NaN when either side is NaN (MPI_MAX leaves that to the implementation).
void Bf16Max(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = kernels::Bf16ToFloat(a[i]), y = kernels::Bf16ToFloat(b[i]);
    if (std::isnan(x) || std::isnan(y)) {
      b[i] = 0x7FC0;
    } else if (x > y) {
      b[i] = a[i];
    }
  }
}

void F32Max(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const float*>(in);
  auto* b = static_cast<float*>(inout);
  for (int i = 0; i < *len; ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) {
      b[i] = std::numeric_limits<float>::quiet_NaN();
    } else if (a[i] > b[i]) {
      b[i] = a[i];
    }
  }
}

struct MpiOps {
  MPI_Op bf16_sum = MPI_OP_NULL;
  MPI_Op bf16_max = MPI_OP_NULL;
  MPI_Op f32_max = MPI_OP_NULL;
};

// Created on first use (after MPI_Init) and kept until MPI_Finalize.
absl::StatusOr<const MpiOps*> GetMpiOps() {
  static MpiOps ops;
  static bool created = false;
  if (!created) {
    MPI_RETURN_IF_ERROR(MPI_Op_create(&Bf16Sum, /*commute=*/1, &ops.bf16_sum));
    MPI_RETURN_IF_ERROR(MPI_Op_create(&Bf16Max, 1, &ops.bf16_max));
    MPI_RETURN_IF_ERROR(MPI_Op_create(&F32Max, 1, &ops.f32_max));
    created = true;
  }
  return &ops;
}

MPI_Datatype ToMpi(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return MPI_FLOAT;
    case DType::kBF16:
      return MPI_UINT16_T;
    case DType::kU8:
      return MPI_UINT8_T;
    case DType::kI32:
      return MPI_INT32_T;
    case DType::kI64:
      return MPI_INT64_T;
  }
  return MPI_DATATYPE_NULL;
}

absl::StatusOr<MPI_Op> ToMpi(DType dtype, ReduceOp op) {
  auto ops_or = GetMpiOps();
  if (!ops_or.ok()) return ops_or.status();
  const MpiOps& ops = **ops_or;
  switch (dtype) {
    case DType::kF32:
      return op == ReduceOp::kSum ? MPI_SUM : ops.f32_max;
    case DType::kBF16:
      return op == ReduceOp::kSum ? ops.bf16_sum : ops.bf16_max;
    case DType::kI32:
    case DType::kI64:
      return op == ReduceOp::kSum ? MPI_SUM : MPI_MAX;
    case DType::kU8:
      break;
  }
  return absl::InvalidArgumentError("FP8 bytes cannot be reduced");
}

// MPI counts are int: larger transfers are refused rather than silently truncated.
absl::StatusOr<int> ToInt(int64_t count, const char* what) {
  if (count > INT_MAX) {
    return absl::OutOfRangeError(
        absl::StrCat(what, " of ", count, " elements exceeds MPI's int count limit"));
  }
  return static_cast<int>(count);
}

// --- the communicator ------------------------------------------------------------------------

class MpiCommunicator : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name, int rank, int size, MpiOptions options)
      : Communicator(std::move(name), rank, size), comm_(comm), options_(options) {}

  ~MpiCommunicator() override {
    // A communicator with a collective left pending (timed out) cannot be freed safely.
    if (!broken_ && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  MPI_Comm comm() const { return comm_; }

 protected:
  absl::Status DoAllReduce(void* buf, int64_t count, DType dtype, ReduceOp op) override {
    auto n = ToInt(count, "count");
    if (!n.ok()) return n.status();
    auto mpi_op = ToMpi(dtype, op);
    if (!mpi_op.ok()) return mpi_op.status();
    return Run([&](MPI_Request* r) {
      return MPI_Iallreduce(MPI_IN_PLACE, buf, *n, ToMpi(dtype), *mpi_op, comm_, r);
    });
  }

  absl::Status DoAllGather(const void* send, int64_t count, void* recv, DType dtype) override {
    auto n = ToInt(count, "count");
    if (!n.ok()) return n.status();
    auto total = ToInt(count * size(), "gathered size");
    if (!total.ok()) return total.status();
    // This rank's block already in place in recv: MPI_IN_PLACE (overlapping buffers are not
    // allowed otherwise).
    const bool in_place =
        send == static_cast<const char*>(recv) + static_cast<int64_t>(rank()) * Bytes(count, dtype);
    const void* source = in_place ? MPI_IN_PLACE : send;
    return Run([&](MPI_Request* r) {
      return MPI_Iallgather(source, *n, ToMpi(dtype), recv, *n, ToMpi(dtype), comm_, r);
    });
  }

  absl::StatusOr<std::unique_ptr<PendingCollective>> DoStartAllGather(const void* send,
                                                                      int64_t count, void* recv,
                                                                      DType dtype) override {
    auto n = ToInt(count, "count");
    if (!n.ok()) return n.status();
    auto total = ToInt(count * size(), "gathered size");
    if (!total.ok()) return total.status();
    if (broken_) return Unusable();
    const bool in_place =
        send == static_cast<const char*>(recv) + static_cast<int64_t>(rank()) * Bytes(count, dtype);
    auto pending = std::make_unique<Pending>(this);
    MPI_RETURN_IF_ERROR(MPI_Iallgather(in_place ? MPI_IN_PLACE : send, *n, ToMpi(dtype), recv, *n,
                                       ToMpi(dtype), comm_, &pending->request));
    return std::unique_ptr<PendingCollective>(std::move(pending));
  }

  absl::Status DoReduceScatter(const void* send, void* recv, int64_t recv_count, DType dtype,
                               ReduceOp op) override {
    auto n = ToInt(recv_count, "recv_count");
    if (!n.ok()) return n.status();
    auto mpi_op = ToMpi(dtype, op);
    if (!mpi_op.ok()) return mpi_op.status();
    return Run([&](MPI_Request* r) {
      return MPI_Ireduce_scatter_block(send, recv, *n, ToMpi(dtype), *mpi_op, comm_, r);
    });
  }

  absl::Status DoAllToAllV(const void* send, std::span<const int64_t> send_counts,
                           std::span<const int64_t> send_displs, void* recv,
                           std::span<const int64_t> recv_counts,
                           std::span<const int64_t> recv_displs, DType dtype) override {
    std::vector<int> sc(send_counts.size()), sd(send_counts.size()), rc(send_counts.size()),
        rd(send_counts.size());
    for (size_t i = 0; i < sc.size(); ++i) {
      for (auto [in, out] :
           {std::pair{send_counts[i], &sc[i]}, std::pair{send_displs[i], &sd[i]},
            std::pair{recv_counts[i], &rc[i]}, std::pair{recv_displs[i], &rd[i]}}) {
        auto v = ToInt(in, "count or displacement");
        if (!v.ok()) return v.status();
        *out = *v;
      }
    }
    return Run([&](MPI_Request* r) {
      return MPI_Ialltoallv(send, sc.data(), sd.data(), ToMpi(dtype), recv, rc.data(), rd.data(),
                            ToMpi(dtype), comm_, r);
    });
  }

  absl::Status DoBroadcast(void* buf, int64_t count, DType dtype, int root) override {
    auto n = ToInt(count, "count");
    if (!n.ok()) return n.status();
    return Run([&](MPI_Request* r) { return MPI_Ibcast(buf, *n, ToMpi(dtype), root, comm_, r); });
  }

  absl::Status DoBarrier() override {
    return Run([&](MPI_Request* r) { return MPI_Ibarrier(comm_, r); });
  }

 private:
  // Starts a nonblocking collective and polls it until it completes or the timeout passes.
  // Spins first (the common case completes in microseconds), then backs off to short sleeps.
  template <class Start>
  absl::Status Run(Start start) {
    if (broken_) return Unusable();
    MPI_Request request = MPI_REQUEST_NULL;
    MPI_RETURN_IF_ERROR(start(&request));
    return Poll(request, std::chrono::steady_clock::now());
  }

  static absl::Status Unusable() {
    return absl::FailedPreconditionError(
        "communicator is unusable after an earlier collective failed or timed out");
  }

  // A collective started by DoStartAllGather; Wait polls it like a blocking call, with the
  // deadline counted from the start.
  struct Pending : PendingCollective {
    explicit Pending(MpiCommunicator* c) : comm(c), begin(std::chrono::steady_clock::now()) {}
    ~Pending() override {
      if (request != MPI_REQUEST_NULL) (void)Wait();
    }
    absl::Status Wait() override {
      if (request == MPI_REQUEST_NULL) return status;
      status = comm->Poll(request, begin);
      request = MPI_REQUEST_NULL;  // completed, or abandoned with the communicator broken
      return status;
    }
    MpiCommunicator* comm;
    const std::chrono::steady_clock::time_point begin;
    MPI_Request request = MPI_REQUEST_NULL;
    absl::Status status;
  };

  // Polls `request` until it completes or the timeout after `begin` passes.
  absl::Status Poll(MPI_Request& request, std::chrono::steady_clock::time_point begin) {
    const auto deadline = begin + options_.timeout;
    int done = 0;
    bool patient = false;  // after 20 ms of spinning, sleep between polls
    for (int64_t polls = 0;; ++polls) {
      MPI_RETURN_IF_ERROR(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
      if (done) return absl::OkStatus();
      if (patient) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      if (patient || (polls & 1023) == 0) {
        const auto now = std::chrono::steady_clock::now();
        if (now >= deadline) break;
        patient = now - begin > std::chrono::milliseconds(20);
      }
    }
    broken_ = true;
    return absl::DeadlineExceededError(
        absl::StrCat("did not complete within ", options_.timeout.count(),
                     " ms: a peer rank has failed, hangs, or called a different collective"));
  }

  MPI_Comm comm_;             // owned
  const MpiOptions options_;  // fixed after construction
  bool broken_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MpiCommunicatorFactory>> MpiCommunicatorFactory::Create(
    const MpiOptions& options) {
  int initialized = 0;
  MPI_RETURN_IF_ERROR(MPI_Initialized(&initialized));
  if (!initialized) return absl::FailedPreconditionError("MPI is not initialised (call InitMpi)");
  MPI_Comm world = MPI_COMM_NULL;
  MPI_RETURN_IF_ERROR(MPI_Comm_dup(MPI_COMM_WORLD, &world));
  // Errors come back as codes (turned into Status), never as an abort inside MPI.
  MPI_RETURN_IF_ERROR(MPI_Comm_set_errhandler(world, MPI_ERRORS_RETURN));
  int rank = 0, size = 0;
  MPI_RETURN_IF_ERROR(MPI_Comm_rank(world, &rank));
  MPI_RETURN_IF_ERROR(MPI_Comm_size(world, &size));
  std::unique_ptr<MpiCommunicatorFactory> factory(new MpiCommunicatorFactory());
  factory->options_ = options;
  factory->world_ = std::make_unique<MpiCommunicator>(world, "world", rank, size, options);
  return factory;
}

MpiCommunicatorFactory::~MpiCommunicatorFactory() = default;

absl::StatusOr<std::unique_ptr<Communicator>> MpiCommunicatorFactory::Split(int color, int key,
                                                                            std::string name) {
  auto* world = static_cast<MpiCommunicator*>(world_.get());
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_RETURN_IF_ERROR(MPI_Comm_split(world->comm(), color, key, &comm));
  MPI_RETURN_IF_ERROR(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
  int rank = 0, size = 0;
  MPI_RETURN_IF_ERROR(MPI_Comm_rank(comm, &rank));
  MPI_RETURN_IF_ERROR(MPI_Comm_size(comm, &size));
  return std::unique_ptr<Communicator>(
      new MpiCommunicator(comm, std::move(name), rank, size, options_));
}

absl::StatusOr<HostRanks> MpiCommunicatorFactory::RanksOnThisHost() {
  // Every rank's MPI processor name (its host's name), gathered over the world group: a collective
  // with the group's deadline, unlike MPI_Comm_split_type, so that a peer that never gets here (it
  // stopped on bad input of its own) fails this rank instead of holding it forever.
  std::string name(MPI_MAX_PROCESSOR_NAME, '\0');
  int length = 0;
  MPI_RETURN_IF_ERROR(MPI_Get_processor_name(name.data(), &length));
  name.resize(static_cast<size_t>(std::clamp(length, 0, MPI_MAX_PROCESSOR_NAME)));
  Communicator& world = *world_;
  FP8RT_ASSIGN_OR_RETURN(std::vector<std::string> names,
                         AllGatherStrings(world, name, MPI_MAX_PROCESSOR_NAME));
  HostRanks ranks{.world_rank = world.rank(), .world_ranks = {}};
  for (int r = 0; r < world.size(); ++r) {
    if (names[static_cast<size_t>(r)] == name) ranks.world_ranks.push_back(r);
  }
  return ranks;
}

namespace {
bool g_we_initialized = false;
}  // namespace

absl::StatusOr<int> InitMpi(int* argc, char*** argv) {
  int initialized = 0;
  MPI_RETURN_IF_ERROR(MPI_Initialized(&initialized));
  if (!initialized) {
    int provided = 0;
    MPI_RETURN_IF_ERROR(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
    g_we_initialized = true;
    if (provided < MPI_THREAD_FUNNELED) {
      return absl::FailedPreconditionError(absl::StrCat("MPI provides thread level ", provided,
                                                        ", fp8rt needs MPI_THREAD_FUNNELED"));
    }
  }
  int size = 0;
  MPI_RETURN_IF_ERROR(MPI_Comm_size(MPI_COMM_WORLD, &size));
  return size;
}

void FinalizeMpi() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (g_we_initialized && !finalized) MPI_Finalize();
}

void AbortMpi(int code, std::chrono::milliseconds grace) {
  if (grace.count() > 0) {
    MPI_Request barrier = MPI_REQUEST_NULL;
    if (MPI_Ibarrier(MPI_COMM_WORLD, &barrier) == MPI_SUCCESS) {
      const auto deadline = std::chrono::steady_clock::now() + grace;
      int done = 0;
      while (MPI_Test(&barrier, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done == 0 &&
             std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
  }
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort should not return
}

}  // namespace fp8rt::parallel
