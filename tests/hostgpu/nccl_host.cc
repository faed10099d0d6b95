// NCCL's entry points that fp8rt calls, emulated on CPU ranks over MPI (host_gpu.h says the model).
//
// A communicator is a duplicate of an MPI communicator. On a non-blocking communicator a
// collective returns ncclInProgress and is put on its stream, as a kernel, at the poll of
// ncclCommGetAsyncError that first answers ncclSuccess (see Settings for when); on a blocking one
// at the call. The kernel (Kernel::Step, run by the emulated device) reads its send buffer when it
// starts, in the communicator's call order, exchanges it with MPI non-blocking operations and
// writes its receive buffer when they complete. Reductions gather every rank's input and reduce it
// in rank order, so sums exact in their type come out the same on every rank whatever the order.
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
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

using fp8rt::hostgpu::StreamId;
using Clock = std::chrono::steady_clock;
using Bytes = std::vector<uint8_t>;

// What the kernels of one communicator share: its MPI communicator, whether it was aborted, and
// the call order they start in.
struct Shared {
  MPI_Comm mpi = MPI_COMM_NULL;      // the kernels' operations
  MPI_Comm control = MPI_COMM_NULL;  // splits: never in the middle of the kernels' collectives
  std::atomic<bool> aborted{false};
  uint64_t calls = 0;    // kernels created (under the NCCL lock)
  uint64_t started = 0;  // kernels that started (by the device, which runs one piece at a time)
  std::atomic<uint64_t> ended{0};  // kernels that ended (with their results or by the abort)
};

// Buffers MPI may still write into after an abort: kept for ever.
std::mutex leak_mu;
std::vector<std::shared_ptr<void>>& Leaked() {
  static auto* leaked = new std::vector<std::shared_ptr<void>>;
  return *leaked;
}

std::atomic<int64_t> kernels_abandoned{0}, kernels_landed{0}, kernels_side{0}, kernels_caller{0},
    kernels_side_reduce_scatter{0}, kernels_side_bf16_all_gather{0};

// One collective (or one group's sends and receives) on the device.
struct Kernel : std::enable_shared_from_this<Kernel> {
  std::shared_ptr<Shared> shared;
  uint64_t seq = 0;
  bool hang = false;    // never ends (Settings::hang_on_stream, fail_on_stream)
  bool side = false;    // on a stream other than its communicator's own (ncclComm::main_stream)
  bool caller = false;  // receives into memory the caller allocated (cudaMalloc, cudaMallocHost)
  bool reduce_scatter = false;
  bool bf16_all_gather = false;
  fp8rt::hostgpu::Uses uses;  // its send and receive buffers (the stream-order checks)
  const char* call = "";
  // Reads the send buffers and starts the MPI operations (into requests, on bufs).
  std::function<void(Kernel&)> start;
  std::function<void()> land;  // writes the receive buffers
  std::vector<MPI_Request> requests;
  std::vector<std::unique_ptr<Bytes>> bufs;
  bool started = false;
  bool received = false;  // every rank's part arrived

  Bytes* Buf(size_t bytes) {
    bufs.push_back(std::make_unique<Bytes>(bytes));
    return bufs.back().get();
  }

  // The device's step: true once ended.
  bool Step() {
    if (shared->aborted.load()) {  // the abort ends the kernel
      if (started && !requests.empty()) {
        std::lock_guard<std::mutex> lock(leak_mu);
        Leaked().push_back(shared_from_this());
        if (!received) ++kernels_abandoned;
      }
      ++shared->ended;
      return true;
    }
    if (hang) return false;
    int is_main = 0;
    MPI_Is_thread_main(&is_main);
    if (is_main == 0) return false;  // MPI_THREAD_FUNNELED: MPI's thread runs it
    if (!started) {
      if (shared->started != seq) return false;  // an earlier call of the communicator first
      start(*this);
      started = true;
      ++shared->started;
    }
    if (!requests.empty()) {
      int done = 0;
      MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE);
      // Eager streams: every rank is putting this kernel on its stream now, and the host goes on
      // as if it ran, so it is waited for here (with the locks held: nothing can abort it). Ranks
      // that diverged would hang: after two minutes the process says so and aborts.
      const auto start = std::chrono::steady_clock::now();
      while (done == 0 && !fp8rt::hostgpu::settings().lazy_streams) {
        if (std::chrono::steady_clock::now() - start > std::chrono::minutes(2)) {
          std::fprintf(stderr,
                       "hostgpu: an NCCL kernel has waited two minutes for its peers (eager "
                       "streams): the ranks made different NCCL calls\n");
          std::abort();
        }
        std::this_thread::sleep_for(std::chrono::microseconds(20));
        MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE);
      }
      if (done == 0) return false;
      received = true;
    }
    if (land) land();
    ++kernels_landed;
    if (side) ++kernels_side;
    if (side && reduce_scatter) ++kernels_side_reduce_scatter;
    if (side && bf16_all_gather) ++kernels_side_bf16_all_gather;
    if (caller) ++kernels_caller;
    ++shared->ended;
    return true;
  }
};

// A call NCCL completes later: until then the communicator is ncclInProgress.
struct Deferred {
  std::shared_ptr<Kernel> kernel;  // put on `stream` when the call completes (none: no data)
  cudaStream_t stream = nullptr;
  std::function<bool()> ready;  // besides polls and delay (finalize: the kernels ended)
  std::function<void()> land;   // at completion (a split: the child's handle)
  int polls_left = 0;
  Clock::time_point due;
  // The fault settings when the call was made.
  bool hang = false;
  int fail = 0;
  int fail_on_stream = 0;
};

}  // namespace

struct ncclComm {
  std::shared_ptr<Shared> shared = std::make_shared<Shared>();
  int rank = 0;
  int size = 0;
  bool blocking = true;
  ncclResult_t async = ncclSuccess;  // the asynchronous error, once one happened
  Clock::time_point fail_at;         // fail_on_stream: when `fail_code` becomes the error
  int fail_code = 0;
  std::deque<std::unique_ptr<Deferred>> pending;  // oldest first
  std::string last_error;
  // The first stream created after the communicator: NcclCommunicator's own stream (Wrap makes
  // it right after the communicator exists). Kernels on any other stream count as side_stream.
  void* main_stream = nullptr;
  // Children of its splits whose handles were not written yet (Settings::setup_hang): freed with
  // it if they never are.
  std::vector<ncclComm*> unclaimed;
};

namespace {

std::mutex mu;  // guards every communicator, the stats and the registry below
fp8rt::hostgpu::Stats stats;
std::set<ncclComm*> live;  // created and not yet destroyed or aborted
int world_rank = 0;        // MPI_COMM_WORLD's, asked at each communicator's creation
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
thread_local ncclResult_t group_error = ncclSuccess;  // the group's first refused call

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
uint16_t FloatToBf16(float f) {  // round to nearest even; NaN stays a quiet NaN of its sign
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Integers wrap as NCCL's do (added as unsigned: no undefined behaviour on overflow).
template <typename T>
T Combine(T a, T b, ncclRedOp_t op) {
  if (op == ncclMax) return std::max(a, b);
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
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

// out[i] = op over the ranks r (in order) of element i of the block at blocks + r * stride. BF16
// adds in FP32 and rounds once per step, as NCCL does.
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

// With mu held: completes what is due of comm's deferred calls, oldest first, putting their
// kernels on their streams.
void Progress(ncclComm_t comm) {
  if (comm->async == ncclSuccess && comm->fail_code != 0 && Clock::now() >= comm->fail_at) {
    comm->async = static_cast<ncclResult_t>(comm->fail_code);
    comm->last_error = "a peer failed (emulated asynchronous error)";
  }
  while (comm->async == ncclSuccess && !comm->pending.empty()) {
    Deferred& d = *comm->pending.front();
    if (d.polls_left > 0) {
      --d.polls_left;
      return;
    }
    if (Clock::now() < d.due || d.hang || (d.ready && !d.ready())) return;
    if (d.fail != ncclSuccess) {
      comm->async = static_cast<ncclResult_t>(d.fail);
      comm->last_error = "a peer failed (emulated asynchronous error)";
      return;
    }
    if (d.fail_on_stream != ncclSuccess) {
      comm->fail_code = d.fail_on_stream;
      comm->fail_at = Clock::now() + std::chrono::milliseconds(20);
    }
    std::unique_ptr<Deferred> done = std::move(comm->pending.front());
    comm->pending.pop_front();
    if (done->land) done->land();
    if (done->kernel) {
      std::shared_ptr<Kernel> k = done->kernel;
      fp8rt::hostgpu::EnqueueKernel(
          done->stream, [k] { return k->Step(); }, k->uses, k->call);
    }
  }
}

// Whether the faults of Settings apply to this rank.
bool Faulty() {
  const int rank = fp8rt::hostgpu::settings().fault_rank;
  return rank < 0 || rank == world_rank;
}

// Whether the setup `which` of `comm` never completes here (Settings::setup_hang; never on a
// blocking communicator, whose call would then wait for ever holding mu).
bool SetupHangs(ncclComm_t comm, fp8rt::hostgpu::Settings::SetupHang which) {
  return !comm->blocking && Faulty() && fp8rt::hostgpu::settings().setup_hang == which;
}

// With mu held: comm takes `d`, a call made now (a blocking communicator completes it at once).
ncclResult_t Submit(ncclComm_t comm, std::unique_ptr<Deferred> d) {
  const fp8rt::hostgpu::Settings& s = fp8rt::hostgpu::settings();
  d->polls_left = s.polls;
  d->due = Clock::now() + s.delay;
  if (d->kernel && Faulty()) {
    d->hang = s.hang;
    d->fail = s.fail;
    d->fail_on_stream = s.fail_on_stream;
    d->kernel->hang = s.hang_on_stream || s.fail_on_stream != ncclSuccess;
  }
  if (d->kernel) {
    d->kernel->side = fp8rt::hostgpu::StreamId(d->stream) != comm->main_stream;
  }
  comm->pending.push_back(std::move(d));
  if (!comm->blocking) {
    ++stats.deferred;
    return ncclInProgress;
  }
  comm->pending.back()->polls_left = 0;
  comm->pending.back()->due = Clock::now();
  while (Busy(comm)) Progress(comm);  // a blocking call: waits, as NCCL's does
  return comm->async;
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

// A buffer NCCL may use: device-addressable and within its allocation, and at most INT_MAX bytes
// (the MPI counts). `caller`: whether it is memory the caller allocated rather than staging.
ncclResult_t CheckBuffer(ncclComm_t comm, const void* p, size_t bytes, const char* what,
                         bool* caller = nullptr) {
  if (bytes > static_cast<size_t>(INT_MAX)) {
    return Error(comm, ncclInvalidArgument, std::string(what) + ": over 2 GiB (not emulated)");
  }
  int kind = 0;
  if (bytes != 0 && !fp8rt::hostgpu::DeviceRange(p, bytes, &kind)) {
    return Error(comm, ncclInvalidArgument,
                 std::string(what) + " is not device memory, or runs past its allocation");
  }
  if (caller != nullptr) *caller = kind == 1 || kind == 3;
  return ncclSuccess;
}

int Int(size_t bytes) { return static_cast<int>(bytes); }  // CheckBuffer bounded it

std::shared_ptr<Kernel> NewKernel(ncclComm_t comm) {
  auto k = std::make_shared<Kernel>();
  k->shared = comm->shared;
  k->seq = comm->shared->calls++;
  return k;
}

// A kernel's start: every rank's `bytes` bytes at `send`, read now, gathered into `*all`.
void GatherAll(Kernel& k, const void* send, size_t bytes, int ranks, Bytes** all) {
  Bytes* mine = k.Buf(bytes);
  std::memcpy(mine->data(), send, bytes);
  *all = k.Buf(bytes * static_cast<size_t>(ranks));
  k.requests.emplace_back();
  MPI_Iallgather(mine->data(), Int(bytes), MPI_BYTE, (*all)->data(), Int(bytes), MPI_BYTE,
                 k.shared->mpi, &k.requests.back());
}

std::unique_ptr<Deferred> Call(std::shared_ptr<Kernel> k, cudaStream_t stream) {
  auto d = std::make_unique<Deferred>();
  d->kernel = std::move(k);
  d->stream = stream;
  return d;
}

ncclComm_t awaiting_main = nullptr;  // the newest communicator, until a stream is created

ncclComm_t NewComm(MPI_Comm mpi, const ncclConfig_t* config) {
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  auto* comm = new ncclComm;
  awaiting_main = comm;
  comm->shared->mpi = mpi;
  MPI_Comm_dup(mpi, &comm->shared->control);
  MPI_Comm_rank(mpi, &comm->rank);
  MPI_Comm_size(mpi, &comm->size);
  comm->blocking =
      config == nullptr || config->blocking == NCCL_CONFIG_UNDEF_INT || config->blocking != 0;
  live.insert(comm);
  return comm;
}

// With mu held: frees comm; its MPI communicator only once its kernels have ended, from MPI's
// thread (else it is left to the process's end).
void Bury(ncclComm_t comm) {
  live.erase(comm);
  for (ncclComm_t child : comm->unclaimed) {
    if (live.count(child) != 0) Bury(child);
  }
  int is_main = 0;
  MPI_Is_thread_main(&is_main);
  const Shared& sh = *comm->shared;
  if (is_main != 0 && sh.ended.load() == sh.calls && sh.mpi != MPI_COMM_NULL) {
    MPI_Comm_free(&comm->shared->mpi);
    MPI_Comm_free(&comm->shared->control);
  }
  delete comm;
}

// A collective that reads every rank's `send_bytes` at `send` when it starts (GatherAll) and,
// once all of them arrived, writes `recv_bytes` at `recv` with `land` (given the gathered bytes,
// in rank order): all-reduce, reduce-scatter and all-gather. The caller holds mu and has checked
// the communicator, stream, type and op.
ncclResult_t SubmitGathering(ncclComm_t comm, cudaStream_t stream, const std::string& what,
                             ncclDataType_t type, const void* send, size_t send_bytes, void* recv,
                             size_t recv_bytes, std::function<void(const uint8_t*)> land) {
  bool caller = false;
  if (ncclResult_t rc = CheckBuffer(comm, send, send_bytes, (what + " sendbuff").c_str()); rc) {
    return rc;
  }
  if (ncclResult_t rc = CheckBuffer(comm, recv, recv_bytes, (what + " recvbuff").c_str(), &caller);
      rc) {
    return rc;
  }
  auto k = NewKernel(comm);
  k->caller = caller;
  k->uses = {.reads = {{send_bytes != 0 ? send : nullptr, send_bytes}},
             .writes = {{recv_bytes != 0 ? recv : nullptr, recv_bytes}}};
  k->call = what == "ncclReduceScatter" ? "ncclReduceScatter"
            : what == "ncclAllGather"   ? "ncclAllGather"
                                        : "ncclAllReduce";
  k->reduce_scatter = what == "ncclReduceScatter";
  k->bf16_all_gather = what == "ncclAllGather" && type == ncclBfloat16;
  const int ranks = comm->size;
  auto slot = std::make_shared<Bytes*>(nullptr);  // the gathered inputs: set by start, read by land
  k->start = [send, send_bytes, ranks, slot](Kernel& self) {
    GatherAll(self, send, send_bytes, ranks, slot.get());
  };
  k->land = [slot, land = std::move(land)] { land((*slot)->data()); };
  return Submit(comm, Call(std::move(k), stream));
}

}  // namespace

namespace fp8rt::hostgpu {

Settings& settings() {
  static Settings s;
  return s;
}
Stats stats() {
  std::lock_guard<std::mutex> lock(mu);
  Stats s = ::stats;
  s.kernels = kernels_landed.load();
  s.abandoned = kernels_abandoned.load();
  s.side_stream = kernels_side.load();
  s.side_reduce_scatter = kernels_side_reduce_scatter.load();
  s.side_bf16_all_gather = kernels_side_bf16_all_gather.load();
  s.caller_memory = kernels_caller.load();
  s.live = static_cast<int64_t>(live.size());
  return s;
}
void ResetStats() {
  std::lock_guard<std::mutex> lock(mu);
  ::stats = Stats{};
  kernels_landed = 0;
  kernels_abandoned = 0;
  kernels_side = 0;
  kernels_side_reduce_scatter = 0;
  kernels_side_bf16_all_gather = 0;
  kernels_caller = 0;
}

void StreamCreated(void* stream) {
  std::lock_guard<std::mutex> lock(mu);
  if (awaiting_main != nullptr && live.contains(awaiting_main)) {
    awaiting_main->main_stream = StreamId(stream);
  }
  awaiting_main = nullptr;
}

bool NcclHoldsStream(void* stream, const char* call) {
  std::lock_guard<std::mutex> lock(mu);
  void* const id = StreamId(stream);
  for (const ncclComm* comm : live) {
    if (comm->async != ncclSuccess) continue;
    for (const auto& d : comm->pending) {
      if (d->kernel && StreamId(d->stream) == id) {
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
  *out = comm;
  if (std::memcmp(root.internal, id.internal, NCCL_UNIQUE_ID_BYTES) != 0) {
    comm->async = ncclInvalidUsage;
    comm->last_error = "ncclCommInitRank: the unique id differs from rank 0's";
    return comm->blocking ? comm->async : ncclInProgress;
  }
  auto d = std::make_unique<Deferred>();
  d->hang = SetupHangs(comm, fp8rt::hostgpu::Settings::SetupHang::kInit);
  return Submit(comm, std::move(d));
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
  MPI_Comm_split(comm->shared->control, color == NCCL_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key,
                 &child_mpi);
  using SetupHang = fp8rt::hostgpu::Settings::SetupHang;
  ncclComm_t child = child_mpi == MPI_COMM_NULL ? nullptr : NewComm(child_mpi, config);
  if (child != nullptr) {
    auto c = std::make_unique<Deferred>();
    c->hang = SetupHangs(child, SetupHang::kSplitChild);
    (void)Submit(child, std::move(c));
    comm->unclaimed.push_back(child);
  }
  auto d = std::make_unique<Deferred>();
  d->hang = SetupHangs(comm, SetupHang::kSplitParent);
  // The child's handle is written when the parent leaves ncclInProgress.
  if (!SetupHangs(comm, SetupHang::kSplitHandle)) {
    d->land = [comm, newcomm, child] {
      std::atomic_ref<ncclComm_t>(*newcomm).store(child);
      std::erase(comm->unclaimed, child);
    };
  }
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

// Ends once the communicator's kernels have.
ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(mu);
  if (comm == nullptr) return ncclInvalidArgument;
  if (comm->async != ncclSuccess) return comm->async;
  if (Busy(comm)) return Misuse(comm, "ncclCommFinalize");
  auto d = std::make_unique<Deferred>();
  std::shared_ptr<Shared> shared = comm->shared;
  d->ready = [shared] {
    fp8rt::hostgpu::RunAll();  // the kernels it waits for (a lazy device runs only on demand)
    return shared->ended.load() == shared->calls;
  };
  return Submit(comm, std::move(d));
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(mu);
  if (comm == nullptr) return ncclInvalidArgument;
  if (Busy(comm)) return Misuse(comm, "ncclCommDestroy");
  Bury(comm);
  return ncclSuccess;
}

// Ends the communicator's kernels (they end when the device next reaches them).
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(mu);
  if (comm == nullptr) return ncclSuccess;
  ++stats.aborted;
  comm->shared->aborted = true;
  Bury(comm);
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu);
  if (ncclResult_t rc = Check(comm, stream, "ncclAllReduce"); rc != ncclSuccess) return rc;
  if (TypeSize(type) == 0 || (op != ncclSum && op != ncclMax)) {
    return Error(comm, ncclInvalidArgument, "ncclAllReduce: type or op not emulated");
  }
  const size_t bytes = count * TypeSize(type);
  const int ranks = comm->size;
  return SubmitGathering(comm, stream, "ncclAllReduce", type, send, bytes, recv, bytes,
                         [bytes, ranks, count, type, op, recv](const uint8_t* all) {
                           Reduce(all, bytes, ranks, count, type, op, recv);
                         });
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recvcount, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu);
  if (ncclResult_t rc = Check(comm, stream, "ncclReduceScatter"); rc != ncclSuccess) return rc;
  if (TypeSize(type) == 0 || (op != ncclSum && op != ncclMax)) {
    return Error(comm, ncclInvalidArgument, "ncclReduceScatter: type or op not emulated");
  }
  const size_t bytes = recvcount * TypeSize(type);
  const size_t all_bytes = bytes * static_cast<size_t>(comm->size);
  const int ranks = comm->size, rank = comm->rank;
  return SubmitGathering(
      comm, stream, "ncclReduceScatter", type, send, all_bytes, recv, bytes,
      [bytes, all_bytes, ranks, rank, recvcount, type, op, recv](const uint8_t* all) {
        Reduce(all + static_cast<size_t>(rank) * bytes, all_bytes, ranks, recvcount, type, op,
               recv);
      });
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t sendcount, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu);
  if (ncclResult_t rc = Check(comm, stream, "ncclAllGather"); rc != ncclSuccess) return rc;
  if (TypeSize(type) == 0) return Error(comm, ncclInvalidArgument, "ncclAllGather: type");
  const size_t bytes = sendcount * TypeSize(type);
  const size_t all_bytes = bytes * static_cast<size_t>(comm->size);
  return SubmitGathering(
      comm, stream, "ncclAllGather", type, send, bytes, recv, all_bytes,
      [all_bytes, recv](const uint8_t* all) { std::memcpy(recv, all, all_bytes); });
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu);
  if (ncclResult_t rc = Check(comm, stream, "ncclBroadcast"); rc != ncclSuccess) return rc;
  if (TypeSize(type) == 0 || root < 0 || root >= comm->size) {
    return Error(comm, ncclInvalidArgument, "ncclBroadcast: type or root");
  }
  const size_t bytes = count * TypeSize(type);
  const bool is_root = comm->rank == root;
  if (is_root) {
    if (ncclResult_t rc = CheckBuffer(comm, send, bytes, "ncclBroadcast sendbuff"); rc) return rc;
  }
  bool caller = false;
  if (ncclResult_t rc = CheckBuffer(comm, recv, bytes, "ncclBroadcast recvbuff", &caller); rc) {
    return rc;
  }
  auto k = NewKernel(comm);
  k->caller = caller;
  k->uses = {.reads = {{is_root && bytes != 0 ? send : nullptr, bytes}},
             .writes = {{bytes != 0 ? recv : nullptr, bytes}}};
  k->call = "ncclBroadcast";
  auto slot = std::make_shared<Bytes*>(nullptr);
  k->start = [send, bytes, root, is_root, slot](Kernel& self) {
    Bytes* buf = self.Buf(bytes);
    if (is_root) std::memcpy(buf->data(), send, bytes);
    *slot = buf;
    self.requests.emplace_back();
    MPI_Ibcast(buf->data(), Int(bytes), MPI_BYTE, root, self.shared->mpi, &self.requests.back());
  };
  k->land = [slot, recv] { std::memcpy(recv, (*slot)->data(), (*slot)->size()); };
  return Submit(comm, Call(std::move(k), stream));
}

ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}

namespace {

ncclResult_t Refuse(ncclResult_t rc) {
  if (group_depth > 0 && group_error == ncclSuccess) group_error = rc;
  return rc;
}

ncclResult_t PointToPoint(P2p p, ncclDataType_t type, cudaStream_t stream, const char* call) {
  std::lock_guard<std::mutex> lock(mu);
  const ncclResult_t rc = [&] {
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
  }();
  return rc == ncclSuccess ? rc : Refuse(rc);
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

// The group's sends and receives, one kernel per communicator (on the stream of its first call).
ncclResult_t ncclGroupEnd() {
  if (group_depth == 0) return Error(nullptr, ncclInvalidUsage, "ncclGroupEnd without a start");
  if (--group_depth > 0) return ncclSuccess;
  std::vector<P2p> calls;
  calls.swap(group);
  const ncclResult_t refused = group_error;
  group_error = ncclSuccess;
  if (refused != ncclSuccess) return refused;  // a call of the group was refused: none is made
  std::lock_guard<std::mutex> lock(mu);
  for (const P2p& p : calls) {  // refused before anything is created
    if (p.comm->async != ncclSuccess) return p.comm->async;
    if (Busy(p.comm)) return Misuse(p.comm, "ncclGroupEnd");
  }
  std::map<ncclComm_t, std::vector<P2p>> by_comm;
  for (const P2p& p : calls) by_comm[p.comm].push_back(p);
  ncclResult_t rc = ncclSuccess;
  for (auto& [comm, ops] : by_comm) {
    auto k = NewKernel(comm);
    k->call = "ncclSend/ncclRecv";
    for (const P2p& p : ops) {
      if (p.bytes != 0 && p.send) k->uses.reads.push_back({p.sendbuf, p.bytes});
      if (p.bytes != 0 && !p.send) k->uses.writes.push_back({p.recvbuf, p.bytes});
      bool caller = false;
      if (!p.send && CheckBuffer(comm, p.recvbuf, p.bytes, "ncclRecv", &caller) == ncclSuccess) {
        k->caller |= caller;
      }
    }
    auto recvs = std::make_shared<std::vector<std::pair<void*, Bytes*>>>();
    k->start = [ops, recvs](Kernel& self) {
      for (const P2p& p : ops) {
        Bytes* buf = self.Buf(p.bytes);
        self.requests.emplace_back();
        if (p.send) {
          std::memcpy(buf->data(), p.sendbuf, p.bytes);
          MPI_Isend(buf->data(), Int(p.bytes), MPI_BYTE, p.peer, 0, self.shared->mpi,
                    &self.requests.back());
        } else {
          MPI_Irecv(buf->data(), Int(p.bytes), MPI_BYTE, p.peer, 0, self.shared->mpi,
                    &self.requests.back());
          recvs->emplace_back(p.recvbuf, buf);
        }
      }
    };
    k->land = [recvs] {
      for (const auto& [dst, buf] : *recvs) std::memcpy(dst, buf->data(), buf->size());
    };
    if (Submit(comm, Call(std::move(k), ops.front().stream)) == ncclInProgress) {
      rc = ncclInProgress;
    }
  }
  return rc;
}

}  // extern "C"
