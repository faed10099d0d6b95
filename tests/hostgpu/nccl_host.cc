// NCCL's entry points that fp8rt calls, emulated on CPU ranks over MPI (host_gpu.h says the model).
//
// A communicator is a duplicate of an MPI communicator. A collective copies its input at the call
// and starts an MPI non-blocking operation on the copy; on a non-blocking communicator the call
// returns ncclInProgress and the results reach the receive buffer only at the poll of
// ncclCommGetAsyncError that first answers ncclSuccess (see Settings for when). Reductions gather
// every rank's input and reduce it here in rank order, so sums of integers or of values exact in
// the type come out the same on every rank whatever the order.
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/hostgpu/host_gpu.h"

namespace {

using Clock = std::chrono::steady_clock;
using Bytes = std::vector<uint8_t>;

// A call NCCL completes later: its MPI requests, the copies they read and write, and what it does
// to the caller's buffers when it completes.
struct Deferred {
  std::vector<MPI_Request> requests;
  std::vector<std::unique_ptr<Bytes>> bufs;
  std::function<void()> land;
  int polls_left = 0;
  Clock::time_point ready;
  bool collective = false;  // moves data: Settings::hang and Settings::fail apply
  cudaStream_t stream = nullptr;  // the stream NCCL puts it on (none for init, split, finalize)
};

}  // namespace

struct ncclComm {
  MPI_Comm mpi = MPI_COMM_NULL;
  int rank = 0;
  int size = 0;
  bool blocking = true;
  std::thread::id owner;                          // the thread that may call MPI for it
  ncclResult_t async = ncclSuccess;               // the asynchronous error, once one happened
  std::deque<std::unique_ptr<Deferred>> pending;  // oldest first
  std::string last_error;
};

namespace {

std::mutex mu;  // guards every communicator, the stats and the graveyard
fp8rt::hostgpu::Stats stats;
std::vector<ncclComm*> graveyard;  // aborted with MPI operations started: never freed
std::set<ncclComm*> live;          // created and not yet destroyed or aborted
thread_local std::string thread_last_error;

// A send or receive of the current thread's ncclGroupStart..ncclGroupEnd.
struct P2p {
  bool send = false;
  const void* sendbuf = nullptr;
  void* recvbuf = nullptr;
  size_t bytes = 0;
  int peer = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
};
thread_local int group_depth = 0;
thread_local std::vector<P2p> group;

ncclResult_t Error(ncclComm_t comm, ncclResult_t rc, const std::string& why) {
  thread_last_error = why;
  if (comm != nullptr) comm->last_error = why;
  return rc;
}

size_t TypeSize(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclBfloat16:
    case ncclFloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

float Bf16ToFloat(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }
uint16_t FloatToBf16(float f) {  // round to nearest even (no NaNs in the tests)
  const uint32_t u = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <typename T>
T Combine(T a, T b, ncclRedOp_t op) {
  return op == ncclSum ? static_cast<T>(a + b) : std::max(a, b);
}

template <typename T>
void ReduceAs(const uint8_t* blocks, size_t stride, int ranks, size_t count, ncclRedOp_t op,
              void* out) {
  for (size_t i = 0; i < count; ++i) {
    T acc;
    std::memcpy(&acc, blocks + i * sizeof(T), sizeof(T));
    for (int r = 1; r < ranks; ++r) {
      T v;
      std::memcpy(&v, blocks + static_cast<size_t>(r) * stride + i * sizeof(T), sizeof(T));
      acc = Combine(acc, v, op);
    }
    std::memcpy(static_cast<uint8_t*>(out) + i * sizeof(T), &acc, sizeof(T));
  }
}

// out[i] = op over the ranks r (in order) of element i of the block at blocks + r * stride.
void Reduce(const uint8_t* blocks, size_t stride, int ranks, size_t count, ncclDataType_t t,
            ncclRedOp_t op, void* out) {
  switch (t) {
    case ncclInt8:
      return ReduceAs<int8_t>(blocks, stride, ranks, count, op, out);
    case ncclUint8:
      return ReduceAs<uint8_t>(blocks, stride, ranks, count, op, out);
    case ncclInt32:
      return ReduceAs<int32_t>(blocks, stride, ranks, count, op, out);
    case ncclUint32:
      return ReduceAs<uint32_t>(blocks, stride, ranks, count, op, out);
    case ncclInt64:
      return ReduceAs<int64_t>(blocks, stride, ranks, count, op, out);
    case ncclUint64:
      return ReduceAs<uint64_t>(blocks, stride, ranks, count, op, out);
    case ncclFloat32:
      return ReduceAs<float>(blocks, stride, ranks, count, op, out);
    case ncclFloat64:
      return ReduceAs<double>(blocks, stride, ranks, count, op, out);
    case ncclBfloat16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t b;
        std::memcpy(&b, blocks + 2 * i, 2);
        float acc = Bf16ToFloat(b);
        for (int r = 1; r < ranks; ++r) {
          std::memcpy(&b, blocks + static_cast<size_t>(r) * stride + 2 * i, 2);
          acc = Bf16ToFloat(FloatToBf16(Combine(acc, Bf16ToFloat(b), op)));
        }
        b = FloatToBf16(acc);
        std::memcpy(static_cast<uint8_t*>(out) + 2 * i, &b, 2);
      }
      return;
    default:
      return;  // refused before
  }
}

bool Busy(ncclComm_t comm) { return comm->async == ncclSuccess && !comm->pending.empty(); }

ncclResult_t Misuse(ncclComm_t comm, const char* call,
                    const char* where = "on a communicator still ncclInProgress") {
  ++stats.misuse;
  const std::string why = std::string(call) + " " + where;
  if (stats.first_misuse.empty()) stats.first_misuse = why;
  return Error(comm, ncclInvalidUsage, why);
}

// With mu held: completes what is due of comm's deferred work, oldest first.
void Progress(ncclComm_t comm) {
  const fp8rt::hostgpu::Settings& s = fp8rt::hostgpu::settings();
  while (comm->async == ncclSuccess && !comm->pending.empty()) {
    Deferred& d = *comm->pending.front();
    if (d.polls_left > 0) {
      --d.polls_left;
      return;
    }
    if (Clock::now() < d.ready) return;
    if (d.collective && s.hang) return;
    if (d.collective && s.fail != ncclSuccess) {
      comm->async = static_cast<ncclResult_t>(s.fail);
      comm->last_error = "a peer failed (emulated asynchronous error)";
      return;
    }
    if (!d.requests.empty()) {
      if (std::this_thread::get_id() != comm->owner) return;  // MPI is the owner's
      int done = 0;
      MPI_Testall(static_cast<int>(d.requests.size()), d.requests.data(), &done,
                  MPI_STATUSES_IGNORE);
      if (done == 0) return;
    }
    if (d.land) d.land();
    comm->pending.pop_front();
  }
}

// With mu held: comm takes `d` (nothing deferred on a blocking communicator: done at once).
ncclResult_t Submit(ncclComm_t comm, std::unique_ptr<Deferred> d, cudaStream_t stream = nullptr) {
  const fp8rt::hostgpu::Settings& s = fp8rt::hostgpu::settings();
  d->polls_left = s.polls;
  d->ready = Clock::now() + s.delay;
  d->stream = stream;
  if (comm->blocking) {
    if (!d->requests.empty()) {
      MPI_Waitall(static_cast<int>(d->requests.size()), d->requests.data(), MPI_STATUSES_IGNORE);
    }
    if (d->land) d->land();
    return ncclSuccess;
  }
  comm->pending.push_back(std::move(d));
  ++stats.deferred;
  return ncclInProgress;
}

// With mu held: the checks every collective call makes.
ncclResult_t Check(ncclComm_t comm, cudaStream_t stream, const char* call) {
  if (comm == nullptr)
    return Error(nullptr, ncclInvalidArgument, std::string(call) + ": null comm");
  if (comm->async != ncclSuccess) return comm->async;
  if (Busy(comm)) return Misuse(comm, call);
  if (!fp8rt::hostgpu::ValidStream(stream)) {
    return Error(comm, ncclInvalidArgument, std::string(call) + ": invalid stream");
  }
  return ncclSuccess;
}

ncclResult_t CheckBuffer(ncclComm_t comm, const void* p, size_t bytes, const char* what) {
  if (bytes == 0 || fp8rt::hostgpu::DeviceRange(p, bytes)) return ncclSuccess;
  return Error(comm, ncclInvalidArgument,
               std::string(what) + " is not device memory, or runs past its allocation");
}

int Int(size_t bytes) { return static_cast<int>(bytes); }  // the tests' sizes fit

Bytes* Buf(Deferred& d, size_t bytes) {
  d.bufs.push_back(std::make_unique<Bytes>(bytes));
  return d.bufs.back().get();
}

// With mu held: starts d's data movement unless deferred collectives hang or fail.
bool Moves() {
  const fp8rt::hostgpu::Settings& s = fp8rt::hostgpu::settings();
  return !s.hang && s.fail == ncclSuccess;
}

// With mu held: every rank's `bytes` bytes at `send` gathered into one buffer of d.
Bytes* GatherAll(Deferred& d, ncclComm_t comm, const void* send, size_t bytes) {
  Bytes* mine = Buf(d, bytes);
  std::memcpy(mine->data(), send, bytes);
  Bytes* all = Buf(d, bytes * static_cast<size_t>(comm->size));
  if (Moves()) {
    d.requests.emplace_back();
    MPI_Iallgather(mine->data(), Int(bytes), MPI_BYTE, all->data(), Int(bytes), MPI_BYTE, comm->mpi,
                   &d.requests.back());
  }
  return all;
}

ncclComm_t NewComm(MPI_Comm mpi, const ncclConfig_t* config) {
  auto* comm = new ncclComm;
  comm->mpi = mpi;
  MPI_Comm_rank(mpi, &comm->rank);
  MPI_Comm_size(mpi, &comm->size);
  comm->blocking =
      config == nullptr || config->blocking == NCCL_CONFIG_UNDEF_INT || config->blocking != 0;
  comm->owner = std::this_thread::get_id();
  live.insert(comm);
  return comm;
}

// With mu held: frees comm, or keeps it for ever when MPI may still write into its buffers.
void Bury(ncclComm_t comm) {
  live.erase(comm);
  bool started = false;
  for (const auto& d : comm->pending) started |= !d->requests.empty();
  if (started || std::this_thread::get_id() != comm->owner) {
    graveyard.push_back(comm);
    return;
  }
  MPI_Comm_free(&comm->mpi);
  delete comm;
}

}  // namespace

namespace fp8rt::hostgpu {

Settings& settings() {
  static Settings s;
  return s;
}
Stats stats() {
  std::lock_guard<std::mutex> lock(mu);
  return ::stats;
}
void ResetStats() {
  std::lock_guard<std::mutex> lock(mu);
  ::stats = Stats{};
}

bool NcclHoldsStream(void* stream, const char* call) {
  std::lock_guard<std::mutex> lock(mu);
  for (const ncclComm* comm : live) {
    if (comm->async != ncclSuccess) continue;
    for (const auto& d : comm->pending) {
      if (d->stream != nullptr && d->stream == stream) {
        (void)Misuse(nullptr, call, "on a stream of a NCCL call still ncclInProgress");
        return true;
      }
    }
  }
  return false;
}

}  // namespace fp8rt::hostgpu

extern "C" {

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error";
    case ncclSystemError:
      return "unhandled system error";
    case ncclInternalError:
      return "internal error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(mu);
  return comm != nullptr ? comm->last_error.c_str() : thread_last_error.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return Error(nullptr, ncclInvalidArgument, "ncclGetUniqueId: null id");
  std::random_device rd;
  for (char& c : id->internal) c = static_cast<char>(rd());
  return ncclSuccess;
}

// Communicators over MPI_COMM_WORLD's ranks in their order (what fp8rt creates); rank 0's id is
// compared with every rank's.
ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  if (out == nullptr) return Error(nullptr, ncclInvalidArgument, "ncclCommInitRank: null comm");
  int world_size = 0, world_rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  if (nranks != world_size || rank != world_rank) {
    return Error(nullptr, ncclInvalidArgument,
                 "ncclCommInitRank: the emulation takes MPI_COMM_WORLD's ranks in their order");
  }
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  ncclUniqueId root = id;
  MPI_Bcast(root.internal, NCCL_UNIQUE_ID_BYTES, MPI_BYTE, 0, dup);
  std::lock_guard<std::mutex> lock(mu);
  ncclComm_t comm = NewComm(dup, config);
  if (std::memcmp(root.internal, id.internal, NCCL_UNIQUE_ID_BYTES) != 0) {
    comm->async = ncclInvalidUsage;
    comm->last_error = "ncclCommInitRank: the unique id differs from rank 0's";
  }
  *out = comm;
  if (comm->async != ncclSuccess) return comm->blocking ? comm->async : ncclInProgress;
  return Submit(comm, std::make_unique<Deferred>());
}

ncclResult_t ncclCommInitRank(ncclComm_t* out, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(out, nranks, id, rank, nullptr);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                           ncclConfig_t* config) {
  std::lock_guard<std::mutex> lock(mu);
  if (comm == nullptr || newcomm == nullptr) {
    return Error(comm, ncclInvalidArgument, "ncclCommSplit: null comm");
  }
  if (comm->async != ncclSuccess) return comm->async;
  if (Busy(comm)) return Misuse(comm, "ncclCommSplit");
  MPI_Comm child_mpi = MPI_COMM_NULL;
  MPI_Comm_split(comm->mpi, color == NCCL_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key, &child_mpi);
  ncclComm_t child = child_mpi == MPI_COMM_NULL ? nullptr : NewComm(child_mpi, config);
  if (child != nullptr) (void)Submit(child, std::make_unique<Deferred>());
  auto d = std::make_unique<Deferred>();
  // The child's handle is written when the parent leaves ncclInProgress.
  d->land = [newcomm, child] { std::atomic_ref<ncclComm_t>(*newcomm).store(child); };
  return Submit(comm, std::move(d));
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (comm == nullptr || state == nullptr) {
    return Error(comm, ncclInvalidArgument, "ncclCommGetAsyncError: null argument");
  }
  std::lock_guard<std::mutex> lock(mu);
  Progress(comm);
  *state = comm->async != ncclSuccess ? comm->async
           : comm->pending.empty()    ? ncclSuccess
                                      : ncclInProgress;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (comm == nullptr || rank == nullptr) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (comm == nullptr || count == nullptr) return ncclInvalidArgument;
  *count = comm->size;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(mu);
  if (comm == nullptr) return ncclInvalidArgument;
  if (comm->async != ncclSuccess) return comm->async;
  if (Busy(comm)) return Misuse(comm, "ncclCommFinalize");
  return Submit(comm, std::make_unique<Deferred>());
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(mu);
  if (comm == nullptr) return ncclInvalidArgument;
  if (Busy(comm)) return Misuse(comm, "ncclCommDestroy");
  Bury(comm);
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(mu);
  if (comm == nullptr) return ncclSuccess;
  ++stats.aborted;
  Bury(comm);
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu);
  if (ncclResult_t rc = Check(comm, stream, "ncclAllReduce"); rc != ncclSuccess) return rc;
  const size_t bytes = count * TypeSize(type);
  if (TypeSize(type) == 0 || (op != ncclSum && op != ncclMax)) {
    return Error(comm, ncclInvalidArgument, "ncclAllReduce: type or op not emulated");
  }
  if (ncclResult_t rc = CheckBuffer(comm, send, bytes, "ncclAllReduce sendbuff"); rc) return rc;
  if (ncclResult_t rc = CheckBuffer(comm, recv, bytes, "ncclAllReduce recvbuff"); rc) return rc;
  auto d = std::make_unique<Deferred>();
  d->collective = true;
  const Bytes* all = GatherAll(*d, comm, send, bytes);
  const int ranks = comm->size;
  d->land = [all, bytes, ranks, count, type, op, recv] {
    Reduce(all->data(), bytes, ranks, count, type, op, recv);
  };
  return Submit(comm, std::move(d), stream);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recvcount, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu);
  if (ncclResult_t rc = Check(comm, stream, "ncclReduceScatter"); rc != ncclSuccess) return rc;
  const size_t bytes = recvcount * TypeSize(type);
  if (TypeSize(type) == 0 || (op != ncclSum && op != ncclMax)) {
    return Error(comm, ncclInvalidArgument, "ncclReduceScatter: type or op not emulated");
  }
  const size_t all_bytes = bytes * static_cast<size_t>(comm->size);
  if (ncclResult_t rc = CheckBuffer(comm, send, all_bytes, "ncclReduceScatter sendbuff"); rc) {
    return rc;
  }
  if (ncclResult_t rc = CheckBuffer(comm, recv, bytes, "ncclReduceScatter recvbuff"); rc) {
    return rc;
  }
  auto d = std::make_unique<Deferred>();
  d->collective = true;
  const Bytes* all = GatherAll(*d, comm, send, all_bytes);
  const int ranks = comm->size, rank = comm->rank;
  d->land = [all, bytes, all_bytes, ranks, rank, recvcount, type, op, recv] {
    Reduce(all->data() + static_cast<size_t>(rank) * bytes, all_bytes, ranks, recvcount, type, op,
           recv);
  };
  return Submit(comm, std::move(d), stream);
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t sendcount, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu);
  if (ncclResult_t rc = Check(comm, stream, "ncclAllGather"); rc != ncclSuccess) return rc;
  if (TypeSize(type) == 0) return Error(comm, ncclInvalidArgument, "ncclAllGather: type");
  const size_t bytes = sendcount * TypeSize(type);
  const size_t all_bytes = bytes * static_cast<size_t>(comm->size);
  if (ncclResult_t rc = CheckBuffer(comm, send, bytes, "ncclAllGather sendbuff"); rc) return rc;
  if (ncclResult_t rc = CheckBuffer(comm, recv, all_bytes, "ncclAllGather recvbuff"); rc) {
    return rc;
  }
  auto d = std::make_unique<Deferred>();
  d->collective = true;
  const Bytes* all = GatherAll(*d, comm, send, bytes);
  d->land = [all, recv] { std::memcpy(recv, all->data(), all->size()); };
  return Submit(comm, std::move(d), stream);
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu);
  if (ncclResult_t rc = Check(comm, stream, "ncclBroadcast"); rc != ncclSuccess) return rc;
  if (TypeSize(type) == 0 || root < 0 || root >= comm->size) {
    return Error(comm, ncclInvalidArgument, "ncclBroadcast: type or root");
  }
  const size_t bytes = count * TypeSize(type);
  if (comm->rank == root) {
    if (ncclResult_t rc = CheckBuffer(comm, send, bytes, "ncclBroadcast sendbuff"); rc) return rc;
  }
  if (ncclResult_t rc = CheckBuffer(comm, recv, bytes, "ncclBroadcast recvbuff"); rc) return rc;
  auto d = std::make_unique<Deferred>();
  d->collective = true;
  Bytes* buf = Buf(*d, bytes);
  if (comm->rank == root) std::memcpy(buf->data(), send, bytes);
  if (Moves()) {
    d->requests.emplace_back();
    MPI_Ibcast(buf->data(), Int(bytes), MPI_BYTE, root, comm->mpi, &d->requests.back());
  }
  d->land = [buf, recv] { std::memcpy(recv, buf->data(), buf->size()); };
  return Submit(comm, std::move(d), stream);
}

ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}

namespace {

ncclResult_t PointToPoint(P2p p, ncclDataType_t type, cudaStream_t stream, const char* call) {
  std::lock_guard<std::mutex> lock(mu);
  if (p.comm == nullptr) return Error(nullptr, ncclInvalidArgument, std::string(call) + ": comm");
  if (p.comm->async != ncclSuccess) return p.comm->async;
  if (TypeSize(type) == 0 || p.peer < 0 || p.peer >= p.comm->size) {
    return Error(p.comm, ncclInvalidArgument, std::string(call) + ": type or peer");
  }
  if (!fp8rt::hostgpu::ValidStream(stream)) {
    return Error(p.comm, ncclInvalidArgument, std::string(call) + ": invalid stream");
  }
  if (group_depth == 0) {
    return Error(p.comm, ncclInvalidUsage,
                 std::string(call) + " outside a group (the emulation needs one)");
  }
  p.bytes *= TypeSize(type);
  p.stream = stream;
  const void* buf = p.send ? p.sendbuf : p.recvbuf;
  if (ncclResult_t rc = CheckBuffer(p.comm, buf, p.bytes, call); rc != ncclSuccess) return rc;
  group.push_back(p);
  return ncclSuccess;
}

}  // namespace

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return PointToPoint(
      P2p{.send = true, .sendbuf = send, .bytes = count, .peer = peer, .comm = comm}, type, stream,
      "ncclSend");
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return PointToPoint(P2p{.recvbuf = recv, .bytes = count, .peer = peer, .comm = comm}, type,
                      stream, "ncclRecv");
}

// The group's sends and receives, one deferred operation per communicator.
ncclResult_t ncclGroupEnd() {
  if (group_depth == 0) return Error(nullptr, ncclInvalidUsage, "ncclGroupEnd without a start");
  if (--group_depth > 0) return ncclSuccess;
  std::vector<P2p> calls;
  calls.swap(group);
  std::lock_guard<std::mutex> lock(mu);
  std::map<ncclComm_t, std::unique_ptr<Deferred>> ops;
  std::map<ncclComm_t, cudaStream_t> streams;
  for (const P2p& p : calls) {
    if (Busy(p.comm)) return Misuse(p.comm, "ncclGroupEnd");
    std::unique_ptr<Deferred>& d = ops[p.comm];
    if (d == nullptr) {
      d = std::make_unique<Deferred>();
      d->collective = true;
      streams[p.comm] = p.stream;
    }
    Bytes* buf = Buf(*d, p.bytes);
    if (p.send) std::memcpy(buf->data(), p.sendbuf, p.bytes);
    if (Moves()) {
      d->requests.emplace_back();
      if (p.send) {
        MPI_Isend(buf->data(), Int(p.bytes), MPI_BYTE, p.peer, 0, p.comm->mpi, &d->requests.back());
      } else {
        MPI_Irecv(buf->data(), Int(p.bytes), MPI_BYTE, p.peer, 0, p.comm->mpi, &d->requests.back());
      }
    }
    if (!p.send) {
      auto previous = std::move(d->land);
      void* recv = p.recvbuf;
      d->land = [previous = std::move(previous), buf, recv] {
        if (previous) previous();
        std::memcpy(recv, buf->data(), buf->size());
      };
    }
  }
  ncclResult_t rc = ncclSuccess;
  for (auto& [comm, d] : ops) {
    if (Submit(comm, std::move(d), streams[comm]) == ncclInProgress) rc = ncclInProgress;
  }
  return rc;
}

}  // extern "C"
