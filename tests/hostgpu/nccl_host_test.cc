// NcclCommunicator with two or more ranks, on CPU ranks: the NCCL backend's own source built
// against the host emulation of CUDA's runtime and NCCL (host_gpu.h), under mpirun (issue 23,
// point 1). On a non-blocking communicator NCCL answers ncclInProgress and puts a collective on
// its stream later, as it does with several ranks; the emulation writes a collective's results
// only then. So a result read before the backend saw the collective complete is the buffer as it
// was before (on a host buffer: this rank's own input), and differs from the expected one, which
// the tests compute from every rank's input by the collective's definition. Each collective runs
// on plain host memory (staged through device memory), on device memory and on pinned memory,
// with the call waiting (Completion::kHost) and stream-ordered (Completion::kStream); then
// started all-gathers and reduce-scatters, splits, late completion, a peer that hangs and a peer
// that fails. Every test also asserts that no NCCL call was made while a communicator was still
// ncclInProgress.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nccl.h>
#include <sanitizer/asan_interface.h>

#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "parallel/communicator.h"
#include "parallel/nccl/nccl_communicator.h"
#include "tests/hostgpu/host_gpu.h"
#include "tests/mpi/mpi_test_env.h"

namespace fp8rt::parallel {
namespace {

using ::testing::HasSubstr;
using Bytes = std::vector<uint8_t>;
using namespace std::chrono_literals;

enum class Memory { kHost, kDevice, kPinned };

const char* Name(Memory m) {
  switch (m) {
    case Memory::kHost:
      return "host";
    case Memory::kDevice:
      return "device";
    case Memory::kPinned:
      return "pinned";
  }
  return "?";
}

// A buffer in the memory under test, filled from host bytes and read back as bytes.
class Buffer {
 public:
  Buffer(Memory memory, const Bytes& init) : memory_(memory), bytes_(init.size()) {
    if (memory == Memory::kHost) {
      host_ = init;
      return;
    }
    const cudaError_t e =
        memory == Memory::kDevice ? cudaMalloc(&p_, bytes_) : cudaMallocHost(&p_, bytes_);
    EXPECT_EQ(e, cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p_, init.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~Buffer() {
    if (p_ != nullptr) (void)(memory_ == Memory::kDevice ? cudaFree(p_) : cudaFreeHost(p_));
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* get() { return memory_ == Memory::kHost ? host_.data() : p_; }
  // Device memory through a copy on the default stream; host and pinned memory directly, as a
  // caller may read them once a call that waited has returned.
  Bytes Read() const {
    if (memory_ == Memory::kHost) return host_;
    Bytes out(bytes_);
    if (memory_ == Memory::kPinned) {
      std::memcpy(out.data(), p_, bytes_);
      return out;
    }
    EXPECT_EQ(cudaMemcpy(out.data(), p_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

 private:
  const Memory memory_;
  const size_t bytes_;
  Bytes host_;
  void* p_ = nullptr;
};

template <typename T>
Bytes AsBytes(const std::vector<T>& v) {
  Bytes out(v.size() * sizeof(T));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

template <typename T>
std::vector<T> FromBytes(const Bytes& b) {
  std::vector<T> out(b.size() / sizeof(T));
  std::memcpy(out.data(), b.data(), out.size() * sizeof(T));
  return out;
}

// Rank r's i-th input: small integers (some negative), exact in every type and in every sum of
// a few of them, so that the expected reductions do not depend on the order of the ranks.
int Input(int rank, int64_t i) { return (rank + 1) * static_cast<int>(i % 13 + 1) - 5 * rank; }

uint16_t Bf16(float f) { return static_cast<uint16_t>(std::bit_cast<uint32_t>(f) >> 16); }

// Rank r's `count` inputs as `dtype` bytes.
Bytes Inputs(DType dtype, int rank, int64_t count) {
  Bytes out;
  for (int64_t i = 0; i < count; ++i) {
    const int v = Input(rank, i);
    switch (dtype) {
      case DType::kF32: {
        const Bytes b = AsBytes(std::vector<float>{static_cast<float>(v)});
        out.insert(out.end(), b.begin(), b.end());
        break;
      }
      case DType::kBF16: {
        const Bytes b = AsBytes(std::vector<uint16_t>{Bf16(static_cast<float>(v))});
        out.insert(out.end(), b.begin(), b.end());
        break;
      }
      case DType::kI32: {
        const Bytes b = AsBytes(std::vector<int32_t>{v});
        out.insert(out.end(), b.begin(), b.end());
        break;
      }
      case DType::kI64: {
        const Bytes b = AsBytes(std::vector<int64_t>{int64_t{v} << 33});  // beyond 32 bits
        out.insert(out.end(), b.begin(), b.end());
        break;
      }
      case DType::kU8:
        out.push_back(static_cast<uint8_t>(v));
        break;
    }
  }
  return out;
}

// The reduction of the ranks [first, first + ranks)'s inputs [offset, offset + count), by
// definition.
Bytes Reduced(DType dtype, ReduceOp op, int ranks, int64_t offset, int64_t count) {
  Bytes out;
  for (int64_t i = offset; i < offset + count; ++i) {
    int64_t acc = Input(0, i);
    for (int r = 1; r < ranks; ++r) {
      acc = op == ReduceOp::kSum ? acc + Input(r, i) : std::max<int64_t>(acc, Input(r, i));
    }
    Bytes one;
    switch (dtype) {
      case DType::kF32:
        one = AsBytes(std::vector<float>{static_cast<float>(acc)});
        break;
      case DType::kBF16:
        one = AsBytes(std::vector<uint16_t>{Bf16(static_cast<float>(acc))});
        break;
      case DType::kI32:
        one = AsBytes(std::vector<int32_t>{static_cast<int32_t>(acc)});
        break;
      case DType::kI64:
        one = AsBytes(std::vector<int64_t>{acc << 33});
        break;
      case DType::kU8:
        one = {static_cast<uint8_t>(acc)};
        break;
    }
    out.insert(out.end(), one.begin(), one.end());
  }
  return out;
}

NcclOptions Options(std::chrono::milliseconds timeout) {
  NcclOptions options;
  options.timeout = timeout;
  return options;
}

class NcclHostTest : public ::testing::Test {
 protected:
  void SetUp() override {
    hostgpu::settings() = hostgpu::Settings{};
    // The device runs only when the host waits, and then only what the wait needs: a wait the
    // backend forgot leaves its result unwritten.
    hostgpu::settings().lazy_streams = true;
    hostgpu::ResetStats();
    hostgpu::ResetStreamRaces();
  }
  void TearDown() override {
    const hostgpu::Stats s = hostgpu::stats();
    EXPECT_EQ(s.misuse, 0) << "first: " << s.first_misuse;
    // The backend's own work follows the rules of stream-ordered memory (host_gpu.h).
    EXPECT_EQ(hostgpu::StreamRaces(), 0) << "first: " << hostgpu::FirstStreamRace();
    // A communicator that could not finalize in time is aborted by its destructor.
    if (!expect_aborts_) {
      EXPECT_EQ(s.aborted, 0);
    }
    hostgpu::settings() = hostgpu::Settings{};
  }

  bool expect_aborts_ = false;  // the test aborts communicators on purpose

  // A factory over the MPI world (the bootstrap), on the emulated device 0.
  static std::unique_ptr<NcclCommunicatorFactory> Make(
      std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    absl::StatusOr<std::unique_ptr<NcclCommunicatorFactory>> f =
        NcclCommunicatorFactory::Create(testing::Factory().World(), 0, Options(timeout));
    EXPECT_TRUE(f.ok()) << f.status();
    return f.ok() ? *std::move(f) : nullptr;
  }
};

struct Case {
  Memory memory;
  Completion completion;
};

std::string CaseName(const Case& c) {
  return std::string(Name(c.memory)) + (c.completion == Completion::kStream ? "/stream" : "/host");
}

// A call that hit a 300 ms deadline: the status names the call and the deadline, and the call
// ended within a few seconds of the deadline.
void ExpectTimedOut(const absl::Status& s, const std::string& call,
                    std::chrono::steady_clock::duration took) {
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr(call));
  EXPECT_THAT(s.message(), HasSubstr("did not complete within 300 ms"));
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, 5s);
}

// A waited-for all-reduce that hit the deadline, which also aborted the communicator.
void ExpectAllReduceTimedOut(const absl::Status& s, std::chrono::steady_clock::duration took) {
  ExpectTimedOut(s, "ncclAllReduce", took);
  EXPECT_THAT(s.message(), HasSubstr("the NCCL communicator was aborted"));
}

// After a stream-ordered collective `call` into `buf` whose kernel never ends: the host's read of
// `buf` on the default stream waits behind the kernel until the watchdog aborts at the 300 ms
// deadline, nothing lands (`buf` still holds `before`), and the group reports the timeout, naming
// the call.
void ExpectReadWaitsForTheWatchdog(Communicator& comm, const Buffer& buf, const Bytes& before,
                                   const std::string& call) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(buf.Read(), before);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, 200ms) << "the read did not wait for " << call;
  EXPECT_LT(took, 5s);
  const absl::Status s = comm.CheckStreamOrdered();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr(call));
  EXPECT_THAT(s.message(), HasSubstr("the NCCL communicator was aborted"));
}

const Case kCases[] = {
    {Memory::kHost, Completion::kHost},     {Memory::kDevice, Completion::kHost},
    {Memory::kPinned, Completion::kHost},   {Memory::kHost, Completion::kStream},
    {Memory::kDevice, Completion::kStream}, {Memory::kPinned, Completion::kStream},
};

// What a caller does before the host reads a result: after a stream-ordered call, synchronise the
// default stream (which the call made wait for the collective), then ask the group whether its
// stream-ordered collectives failed.
void Settle(Communicator& comm, Completion completion) {
  if (completion == Completion::kStream) {
    EXPECT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
  }
  EXPECT_TRUE(comm.CheckStreamOrdered().ok());
}

// Every rank's `count` inputs of `dtype`, in rank order (what an all-gather of them gives).
Bytes Concatenated(DType dtype, int size, int64_t count, int offset = 0) {
  Bytes out;
  for (int r = 0; r < size; ++r) {
    const Bytes b = Inputs(dtype, r + offset, count);
    out.insert(out.end(), b.begin(), b.end());
  }
  return out;
}

// The stream-order breaches counted since the last call, and the first of them.
std::pair<int64_t, std::string> TakeRaces() {
  const int64_t n = hostgpu::StreamRaces();
  const std::string first = hostgpu::FirstStreamRace();
  hostgpu::ResetStreamRaces();
  return std::make_pair(n, first);
}

// A non-blocking and a blocking stream and an event, for the stream-order tests; destroyed with it.
struct SideStreams {
  SideStreams() {
    EXPECT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaStreamCreate(&blocking), cudaSuccess);
    EXPECT_EQ(cudaEventCreate(&event), cudaSuccess);
  }
  ~SideStreams() {
    EXPECT_EQ(cudaEventDestroy(event), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(side), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(blocking), cudaSuccess);
  }
  SideStreams(const SideStreams&) = delete;
  SideStreams& operator=(const SideStreams&) = delete;
  cudaStream_t side = nullptr, blocking = nullptr;
  cudaEvent_t event = nullptr;
};

// The emulation's stream-order checks (host_gpu.h), which train_host_nccl_test relies on to find a
// missing wait in the model: each rule is broken once, and kept once by an event, a host wait or
// the legacy stream's implicit order. The breaches are caught at the enqueue, whatever the device
// later runs first.
TEST_F(NcclHostTest, BreachesOfStreamOrderedMemoryAreCaught) {
  const SideStreams streams;
  ASSERT_FALSE(::testing::Test::HasFailure()) << "creating the streams and the event";
  const cudaStream_t side = streams.side, blocking = streams.blocking;
  const cudaEvent_t event = streams.event;
  auto alloc = [](void** p) { ASSERT_EQ(cudaMallocAsync(p, 64, cudaStreamLegacy), cudaSuccess); };
  int64_t n = 0;
  std::string first;

  // 1. Used on a non-blocking stream straight after its allocation on the default stream: with
  // nothing before it, after the host synchronised the device, or after waiting for an event
  // recorded before the allocation. The allocation itself is the point to wait for (the pool may
  // make the default stream wait there for the memory's previous user).
  void* a = nullptr;
  for (const char* before : {"nothing", "a device synchronisation", "an event"}) {
    SCOPED_TRACE(before);
    if (std::string(before) == "a device synchronisation") {
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
    if (std::string(before) == "an event") {
      ASSERT_EQ(cudaEventRecord(event, cudaStreamLegacy), cudaSuccess);
    }
    alloc(&a);
    if (std::string(before) == "an event") {
      ASSERT_EQ(cudaStreamWaitEvent(side, event, 0), cudaSuccess);
    }
    ASSERT_EQ(cudaMemsetAsync(a, 0, 64, side), cudaSuccess);
    std::tie(n, first) = TakeRaces();
    EXPECT_EQ(n, 1);
    EXPECT_THAT(first, HasSubstr("cudaMemsetAsync on stream"));
    EXPECT_THAT(first, HasSubstr("allocated in stream order on the legacy default stream"));
  }
  // After an event recorded behind the allocation: none; nor on a blocking stream, which the
  // legacy stream's order puts after it.
  alloc(&a);
  ASSERT_EQ(cudaEventRecord(event, cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(side, event, 0), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(a, 0, 64, side), cudaSuccess);
  void* b = nullptr;
  alloc(&b);
  ASSERT_EQ(cudaMemsetAsync(b, 0, 64, blocking), cudaSuccess);
  std::tie(n, first) = TakeRaces();
  EXPECT_EQ(n, 0) << first;

  // 2. Freed on the default stream while the side stream's memset may still run.
  ASSERT_EQ(cudaFreeAsync(a, cudaStreamLegacy), cudaSuccess);
  std::tie(n, first) = TakeRaces();
  EXPECT_EQ(n, 1);
  EXPECT_THAT(first, HasSubstr("cudaFreeAsync on the legacy default stream of memory that work on "
                               "stream"));
  // The free of b on the default stream: the legacy order puts it after the blocking stream's
  // memset. Another, after the side stream's work is waited for by an event, or by the host.
  ASSERT_EQ(cudaFreeAsync(b, cudaStreamLegacy), cudaSuccess);
  void* c = nullptr;
  void* d = nullptr;
  alloc(&c);
  alloc(&d);
  ASSERT_EQ(cudaEventRecord(event, cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(side, event, 0), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(c, 0, 64, side), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(d, 0, 64, side), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(event, side), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(cudaStreamLegacy, event, 0), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(c, cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(d, 2, 64, side), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(d, cudaStreamLegacy), cudaSuccess);
  std::tie(n, first) = TakeRaces();
  EXPECT_EQ(n, 0) << first;

  // 3. Named by work enqueued after its free (the free has not run: the device is lazy). The work
  // is a launch that names the pointer and touches nothing, since the free runs first.
  void* e = nullptr;
  alloc(&e);
  ASSERT_EQ(cudaFreeAsync(e, cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(hostgpu::Launch(cudaStreamLegacy, [] {}, "a late kernel", {.reads = {e}, .writes = {}}),
            cudaSuccess);
  std::tie(n, first) = TakeRaces();
  EXPECT_EQ(n, 1);
  EXPECT_THAT(first, HasSubstr("a late kernel on the legacy default stream uses memory whose "
                               "cudaFreeAsync is already enqueued"));

  // 4. A synchronous copy orders the host after it only where CUDA's does: a device-to-device
  // cudaMemcpy on the default stream (which follows f's allocation there and the blocking
  // stream's use of f) does not, so a free of f on the non-blocking stream breaks the rule twice;
  // after a device-to-host one it does not.
  for (const bool to_host : {false, true}) {
    SCOPED_TRACE(to_host ? "device to host" : "device to device");
    void* f = nullptr;
    void* g = nullptr;
    alloc(&f);
    alloc(&g);
    ASSERT_EQ(cudaMemsetAsync(f, 3, 64, blocking), cudaSuccess);
    std::vector<uint8_t> host(64);
    if (to_host) {
      ASSERT_EQ(cudaMemcpy(host.data(), g, 64, cudaMemcpyDeviceToHost), cudaSuccess);
    } else {
      ASSERT_EQ(cudaMemcpy(g, g, 64, cudaMemcpyDeviceToDevice), cudaSuccess);
    }
    ASSERT_EQ(cudaFreeAsync(f, side), cudaSuccess);
    std::tie(n, first) = TakeRaces();
    if (to_host) {
      EXPECT_EQ(n, 0) << first;
    } else {
      EXPECT_EQ(n, 2);
      EXPECT_THAT(first, HasSubstr("cudaFreeAsync on stream"));
    }
    ASSERT_EQ(cudaFreeAsync(g, cudaStreamLegacy), cudaSuccess);
  }
  EXPECT_EQ(TakeRaces().first, 0);

  // 5. Freed twice; and a pointer inside an allocation is refused, as CUDA refuses it.
  void* h = nullptr;
  alloc(&h);
  ASSERT_EQ(cudaFreeAsync(h, cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(h, cudaStreamLegacy), cudaSuccess);
  std::tie(n, first) = TakeRaces();
  EXPECT_EQ(n, 1);
  EXPECT_THAT(first, HasSubstr("a second cudaFreeAsync on the legacy default stream"));
  void* inner = nullptr;
  alloc(&inner);
  EXPECT_EQ(cudaFreeAsync(static_cast<char*>(inner) + 8, cudaStreamLegacy), cudaErrorInvalidValue);
  (void)cudaGetLastError();
  ASSERT_EQ(cudaFreeAsync(inner, cudaStreamLegacy), cudaSuccess);

  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(TakeRaces().first, 0);
}

// Data races between streams (host_gpu.h, "Stream order"), in memory from cudaMalloc, which the
// rules of stream-ordered memory leave alone: a read after another stream's write, a write after
// another stream's read, and two writes, each once without a wait and once kept by an event, a
// host wait or the legacy stream's implicit order. A copy reads its source and writes its
// destination, a memset writes, and a launch's pointers are read or written as it says; the unit
// is the byte (disjoint parts of one allocation race not).
TEST_F(NcclHostTest, DataRacesBetweenStreamsAreCaught) {
  const SideStreams streams;
  ASSERT_FALSE(::testing::Test::HasFailure()) << "creating the streams and the event";
  const cudaStream_t side = streams.side, blocking = streams.blocking;
  const cudaEvent_t event = streams.event;
  void* x = nullptr;
  void* y = nullptr;
  ASSERT_EQ(cudaMalloc(&x, 64), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&y, 64), cudaSuccess);
  auto d2d = [](void* to, const void* from, cudaStream_t s) {
    ASSERT_EQ(cudaMemcpyAsync(to, from, 64, cudaMemcpyDeviceToDevice, s), cudaSuccess);
  };
  auto expect_one = [](const std::string& what) {
    const auto [n, first] = TakeRaces();
    EXPECT_EQ(n, 1) << first;
    EXPECT_THAT(first, HasSubstr(what));
  };
  auto expect_none = [] {
    const auto [n, first] = TakeRaces();
    EXPECT_EQ(n, 0) << first;
  };
  auto side_then_legacy = [&] {  // the legacy stream waits for the side stream's work so far
    ASSERT_EQ(cudaEventRecord(event, side), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(cudaStreamLegacy, event, 0), cudaSuccess);
  };

  // 1. Read after write: the side stream writes x, the default stream copies it out.
  ASSERT_EQ(cudaMemsetAsync(x, 1, 64, side), cudaSuccess);
  d2d(y, x, cudaStreamLegacy);
  expect_one(
      "cudaMemcpyAsync on the legacy default stream reads memory that cudaMemsetAsync on stream");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(x, 2, 64, side), cudaSuccess);
  side_then_legacy();
  d2d(y, x, cudaStreamLegacy);
  expect_none();

  // 2. Write after read: the default stream reads x, then the side stream overwrites it; kept by
  // a host wait for the default stream.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  d2d(y, x, cudaStreamLegacy);
  ASSERT_EQ(cudaMemsetAsync(x, 3, 64, side), cudaSuccess);
  expect_one("writes memory that cudaMemcpyAsync on the legacy default stream reads");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  d2d(y, x, cudaStreamLegacy);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(x, 4, 64, side), cudaSuccess);
  expect_none();

  // 3. Two writes: a launch that writes y on the side stream after the default stream's copy into
  // y; and on a blocking stream, which the legacy stream's implicit order keeps.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  d2d(y, x, cudaStreamLegacy);
  ASSERT_EQ(hostgpu::Launch(side, [] {}, "a kernel", {.reads = {}, .writes = {y}}), cudaSuccess);
  expect_one("writes memory that cudaMemcpyAsync on the legacy default stream writes");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  d2d(y, x, cudaStreamLegacy);
  ASSERT_EQ(hostgpu::Launch(blocking, [] {}, "a kernel", {.reads = {x}, .writes = {y}}),
            cudaSuccess);
  expect_none();

  // 4. Reads on two streams at once are no race; a write after them on either is one.
  for (const cudaStream_t writer : {side, cudaStreamLegacy}) {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(hostgpu::Launch(side, [] {}, "a reader", {.reads = {y}, .writes = {}}), cudaSuccess);
    ASSERT_EQ(hostgpu::Launch(cudaStreamLegacy, [] {}, "a reader", {.reads = {y}, .writes = {}}),
              cudaSuccess);
    expect_none();
    ASSERT_EQ(cudaMemsetAsync(y, 0, 64, writer), cudaSuccess);
    expect_one(writer == side ? "writes memory that a reader on the legacy default stream reads"
                              : "writes memory that a reader on stream");
  }

  // 5. The unit is the byte: two streams writing disjoint halves of x race not, a write over the
  // middle of it does; a launch's pointer without a size stands for the bytes from it to the
  // allocation's end (a reader from byte 32 on does not meet the side stream's write of bytes
  // 0-31; a reader from byte 31 on does).
  char* const bytes = static_cast<char*>(x);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(bytes, 5, 32, side), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(bytes + 32, 6, 32, cudaStreamLegacy), cudaSuccess);
  expect_none();
  ASSERT_EQ(cudaMemsetAsync(bytes + 16, 7, 32, blocking), cudaSuccess);
  expect_one("cudaMemsetAsync on stream");  // after the legacy stream's half, not the side's
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(bytes, 8, 32, side), cudaSuccess);
  ASSERT_EQ(hostgpu::Launch(cudaStreamLegacy, [] {}, "a tail reader",
                            {.reads = {bytes + 32}, .writes = {}}),
            cudaSuccess);
  expect_none();
  ASSERT_EQ(
      hostgpu::Launch(cudaStreamLegacy, [] {}, "a reader", {.reads = {bytes + 31}, .writes = {}}),
      cudaSuccess);
  expect_one("a reader on the legacy default stream reads memory that cudaMemsetAsync on stream");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // A copy reads only its count of bytes: the side stream's write just past them is no race.
  ASSERT_EQ(cudaMemcpyAsync(y, bytes, 16, cudaMemcpyDeviceToDevice, cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(bytes + 16, 9, 48, side), cudaSuccess);
  expect_none();
  ASSERT_EQ(cudaMemsetAsync(bytes + 15, 9, 1, side), cudaSuccess);
  expect_one("writes memory that cudaMemcpyAsync on the legacy default stream reads");

  // 6. A NCCL kernel reads its send buffer and writes its receive buffer: another stream may read
  // the send buffer meanwhile, but reads the result only after an event behind the kernel.
  ncclUniqueId id{};
  Communicator& world = testing::Factory().World();
  if (world.rank() == 0) {
    ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  }
  ASSERT_TRUE(world.Broadcast(&id, sizeof(id), DType::kU8, /*root=*/0).ok());
  ncclComm_t comm = nullptr;  // blocking: the kernel is on its stream when the call returns
  ASSERT_EQ(ncclCommInitRank(&comm, world.size(), id, world.rank()), ncclSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(hostgpu::Launch(side, [] {}, "a reader", {.reads = {x}, .writes = {}}), cudaSuccess);
  ASSERT_EQ(ncclAllReduce(x, y, 16, ncclFloat32, ncclSum, comm, cudaStreamLegacy), ncclSuccess);
  expect_none();
  ASSERT_EQ(hostgpu::Launch(side, [] {}, "a reader", {.reads = {y}, .writes = {}}), cudaSuccess);
  expect_one("reads memory that ncclAllReduce on the legacy default stream writes");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(ncclAllReduce(x, y, 16, ncclFloat32, ncclSum, comm, cudaStreamLegacy), ncclSuccess);
  ASSERT_EQ(cudaEventRecord(event, cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(side, event, 0), cudaSuccess);
  ASSERT_EQ(hostgpu::Launch(side, [] {}, "a reader", {.reads = {y}, .writes = {}}), cudaSuccess);
  expect_none();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);

  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaFree(x), cudaSuccess);
  EXPECT_EQ(cudaFree(y), cudaSuccess);
}

// Device memory's tail past the bytes asked for is poisoned for AddressSanitizer, so that an op
// that reads or writes past its array's end is reported (cuda_runtime_host.cc, Footprint), and a
// free gives it back unpoisoned.
TEST_F(NcclHostTest, AnArraysTailIsPoisonedForAddressSanitizer) {
#if defined(__SANITIZE_ADDRESS__)
  for (const size_t bytes : {size_t{0}, size_t{1}, size_t{100}, size_t{256}}) {
    SCOPED_TRACE(bytes);
    void* device = nullptr;
    void* pinned = nullptr;
    ASSERT_EQ(cudaMalloc(&device, bytes), cudaSuccess);
    ASSERT_EQ(cudaMallocHost(&pinned, bytes), cudaSuccess);
    for (void* p : {device, pinned}) {
      const auto* c = static_cast<const char*>(p);
      if (bytes != 0) {
        EXPECT_EQ(__asan_region_is_poisoned(const_cast<char*>(c), bytes), nullptr);
      }
      EXPECT_TRUE(__asan_address_is_poisoned(c + bytes));
      EXPECT_TRUE(__asan_address_is_poisoned(c + bytes + 255));
    }
    EXPECT_EQ(cudaFree(device), cudaSuccess);
    EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  }
#else
  GTEST_SKIP() << "not an AddressSanitizer build (the poisoning is then a no-op)";
#endif
}

TEST_F(NcclHostTest, EveryCollectiveGivesEveryRanksResult) {
  auto factory = Make();
  ASSERT_NE(factory, nullptr);
  Communicator& comm = factory->World();
  const int rank = comm.rank(), size = comm.size();
  ASSERT_EQ(size, testing::Factory().World().size());
  constexpr int64_t kCount = 37;  // not a multiple of anything the backend might round to
  const int64_t deferred_before = hostgpu::stats().deferred;
  int64_t calls = 0;

  for (const Case& c : kCases) {
    SCOPED_TRACE(CaseName(c));
    // All-reduce, in place, every dtype the backend reduces.
    const std::pair<DType, ReduceOp> reductions[] = {
        {DType::kF32, ReduceOp::kSum},  {DType::kF32, ReduceOp::kMax},
        {DType::kBF16, ReduceOp::kSum}, {DType::kI32, ReduceOp::kSum},
        {DType::kI64, ReduceOp::kMax},
    };
    for (const auto& [dtype, op] : reductions) {
      SCOPED_TRACE(DTypeName(dtype));
      Buffer buf(c.memory, Inputs(dtype, rank, kCount));
      EXPECT_TRUE(comm.AllReduce(buf.get(), kCount, dtype, op, c.completion).ok());
      Settle(comm, c.completion);
      EXPECT_EQ(buf.Read(), Reduced(dtype, op, size, 0, kCount));
      ++calls;
    }
    {
      SCOPED_TRACE("all-gather");
      Buffer send(c.memory, Inputs(DType::kU8, rank, kCount));
      Buffer recv(c.memory, Bytes(kCount * size, 0xEE));
      EXPECT_TRUE(comm.AllGather(send.get(), kCount, recv.get(), DType::kU8, c.completion).ok());
      Settle(comm, c.completion);
      EXPECT_EQ(recv.Read(), Concatenated(DType::kU8, size, kCount));
      ++calls;
    }
    {
      SCOPED_TRACE("reduce-scatter");
      // Every rank sends size * kCount elements; rank r gets the sum of block r.
      Buffer send(c.memory, Inputs(DType::kF32, rank, kCount * size));
      Buffer recv(c.memory, AsBytes(std::vector<float>(kCount, -1.0f)));
      EXPECT_TRUE(comm.ReduceScatter(send.get(), recv.get(), kCount, DType::kF32, ReduceOp::kSum,
                                     c.completion)
                      .ok());
      Settle(comm, c.completion);
      EXPECT_EQ(recv.Read(), Reduced(DType::kF32, ReduceOp::kSum, size, rank * kCount, kCount));
      ++calls;
    }
    if (c.completion == Completion::kHost) {
      SCOPED_TRACE("broadcast");
      const int root = size - 1;
      Buffer buf(c.memory, Inputs(DType::kI32, rank, kCount));
      EXPECT_TRUE(comm.Broadcast(buf.get(), kCount, DType::kI32, root).ok());
      EXPECT_EQ(buf.Read(), Inputs(DType::kI32, root, kCount));
      EXPECT_TRUE(comm.Barrier().ok());
      calls += 2;
    }
    {
      SCOPED_TRACE("all-to-all");
      // Rank s sends (s + 2 d) % 4 elements to rank d (none for some pairs), value
      // 1000 s + 100 d + k; blocks are laid out backwards with a gap of one element, which the
      // receiver's sentinel must keep.
      auto count = [](int s, int d) { return static_cast<int64_t>((s + 2 * d) % 4); };
      std::vector<int64_t> send_counts(size), send_displs(size), recv_counts(size),
          recv_displs(size);
      int64_t send_end = 0, recv_end = 0;
      for (int p = size - 1; p >= 0; --p) {
        send_counts[p] = count(rank, p);
        send_displs[p] = send_end;
        send_end += send_counts[p] + 1;
        recv_counts[p] = count(p, rank);
        recv_displs[p] = recv_end;
        recv_end += recv_counts[p] + 1;
      }
      std::vector<int32_t> send_values(send_end, -9), expected(recv_end, -7);
      for (int p = 0; p < size; ++p) {
        for (int64_t k = 0; k < send_counts[p]; ++k) {
          send_values[send_displs[p] + k] = 1000 * rank + 100 * p + static_cast<int32_t>(k);
        }
        for (int64_t k = 0; k < recv_counts[p]; ++k) {
          expected[recv_displs[p] + k] = 1000 * p + 100 * rank + static_cast<int32_t>(k);
        }
      }
      Buffer send(c.memory, AsBytes(send_values));
      Buffer recv(c.memory, AsBytes(std::vector<int32_t>(recv_end, -7)));
      EXPECT_TRUE(comm.AllToAllV(send.get(), send_counts, send_displs, recv.get(), recv_counts,
                                 recv_displs, DType::kI32, c.completion)
                      .ok());
      Settle(comm, c.completion);
      EXPECT_EQ(FromBytes<int32_t>(recv.Read()), expected);
      ++calls;  // every rank moves something with 2 or more ranks ((s + 2d) % 4 > 0 for some d)
    }
  }
  // NCCL answered ncclInProgress to every collective: the results above were waited for.
  EXPECT_EQ(hostgpu::stats().deferred - deferred_before, calls);
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

// A collective runs after the work already queued on the default stream (the communicator's own
// stream is a blocking one, which CUDA orders after it; made non-blocking, it would need an
// explicit wait). The input is written there by a copy the device has not run yet; a collective
// that does not wait for it reduces the old values.
TEST_F(NcclHostTest, CollectivesFollowTheDefaultStreamsWork) {
  auto factory = Make(std::chrono::seconds(5));
  ASSERT_NE(factory, nullptr);
  Communicator& comm = factory->World();
  const int rank = comm.rank(), size = comm.size();
  constexpr int64_t kCount = 13;
  const Bytes inputs = Inputs(DType::kI32, rank, kCount);
  Buffer pinned(Memory::kPinned, inputs);
  for (const Completion completion : {Completion::kHost, Completion::kStream}) {
    SCOPED_TRACE(completion == Completion::kStream ? "stream" : "host");
    Buffer buf(Memory::kDevice, Bytes(inputs.size(), 0));
    EXPECT_EQ(cudaMemcpyAsync(buf.get(), pinned.get(), inputs.size(), cudaMemcpyHostToDevice,
                              cudaStreamLegacy),
              cudaSuccess);
    EXPECT_TRUE(comm.AllReduce(buf.get(), kCount, DType::kI32, ReduceOp::kSum, completion).ok());
    Settle(comm, completion);
    EXPECT_EQ(buf.Read(), Reduced(DType::kI32, ReduceOp::kSum, size, 0, kCount));
  }
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

// FSDP's prefetch on device memory: gathers started on the side stream right after a
// stream-ordered all-reduce that writes their input (nothing synchronises in between: the
// buffers exist before), then waited for by the host (Wait) or by the default stream
// (WaitStreamOrdered) and read there with nothing else in between; a collective on the main
// stream afterwards. The device runs only what a wait needs, so a wait that leaves the default
// stream unordered after the gather leaves stale data, and a gather started before the
// all-reduce cannot start (NCCL runs a communicator's work in call order) and times out.
TEST_F(NcclHostTest, StartedAllGathersAreOrderedOnTheDevice) {
  auto factory = Make(std::chrono::seconds(5));
  ASSERT_NE(factory, nullptr);
  Communicator& comm = factory->World();
  const int rank = comm.rank(), size = comm.size();
  constexpr int64_t kCount = 19;
  Buffer x(Memory::kDevice, Inputs(DType::kF32, rank, kCount));
  Buffer recv_wait(Memory::kDevice, Bytes(4 * kCount * size, 0));
  EXPECT_TRUE(
      comm.AllReduce(x.get(), kCount, DType::kF32, ReduceOp::kSum, Completion::kStream).ok());
  const Bytes reduced = Reduced(DType::kF32, ReduceOp::kSum, size, 0, kCount);
  Bytes expected;
  for (int r = 0; r < size; ++r) expected.insert(expected.end(), reduced.begin(), reduced.end());
  {
    SCOPED_TRACE("Wait");
    Buffer& recv = recv_wait;
    auto pending = comm.StartAllGather(x.get(), kCount, recv.get(), DType::kF32);
    ASSERT_TRUE(pending.ok()) << pending.status();
    EXPECT_TRUE((*pending)->Wait().ok());
    EXPECT_EQ(recv.Read(), expected);
  }
  {
    SCOPED_TRACE("WaitStreamOrdered");
    Buffer recv(Memory::kDevice, Bytes(4 * kCount * size, 0));
    auto pending = comm.StartAllGather(x.get(), kCount, recv.get(), DType::kF32);
    ASSERT_TRUE(pending.ok()) << pending.status();
    EXPECT_TRUE((*pending)->WaitStreamOrdered().ok());
    EXPECT_EQ(recv.Read(), expected);
    EXPECT_TRUE(comm.CheckStreamOrdered().ok());
  }
  {
    SCOPED_TRACE("two in flight, then the main stream");
    Buffer send_a(Memory::kDevice, Inputs(DType::kBF16, rank, kCount));
    Buffer recv_a(Memory::kDevice, Bytes(2 * kCount * size, 0));
    Buffer recv_b(Memory::kDevice, Bytes(4 * kCount * size, 0));
    auto a = comm.StartAllGather(send_a.get(), kCount, recv_a.get(), DType::kBF16);
    auto b = comm.StartAllGather(x.get(), kCount, recv_b.get(), DType::kF32);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    Buffer sum(Memory::kDevice, Inputs(DType::kI32, rank, kCount));
    EXPECT_TRUE(comm.AllReduce(sum.get(), kCount, DType::kI32, ReduceOp::kSum).ok());
    EXPECT_TRUE((*a)->Wait().ok());
    EXPECT_TRUE((*b)->WaitStreamOrdered().ok());
    EXPECT_TRUE(comm.CheckStreamOrdered().ok());
    EXPECT_EQ(recv_a.Read(), Concatenated(DType::kBF16, size, kCount));
    EXPECT_EQ(recv_b.Read(), expected);
    EXPECT_EQ(sum.Read(), Reduced(DType::kI32, ReduceOp::kSum, size, 0, kCount));
  }
  // Started on device memory: on the side stream.
  EXPECT_GE(hostgpu::stats().side_stream, 4);
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

// FSDP's gradient reduction on device memory: the gradient written by work on the default stream
// (a copy the device has not run yet), the reduce-scatter started on the side stream right after
// it, then finished by the host (Wait) or by the default stream (WaitStreamOrdered) and read there
// with nothing else in between. The device runs only what a wait needs: a start that does not
// wait for the default stream reduces stale gradients, and a finish that leaves the default stream
// unordered after the reduce-scatter reads the shard as it was.
TEST_F(NcclHostTest, StartedReduceScattersAreOrderedOnTheDevice) {
  auto factory = Make(std::chrono::seconds(5));
  ASSERT_NE(factory, nullptr);
  Communicator& comm = factory->World();
  const int rank = comm.rank(), size = comm.size();
  constexpr int64_t kCount = 17;
  const Bytes inputs = Inputs(DType::kF32, rank, kCount * size);
  auto expected = [&](int block) {
    return Reduced(DType::kF32, ReduceOp::kSum, size, block * kCount, kCount);
  };
  // The gradient as the backward leaves it: written on the default stream, not yet run.
  Buffer pinned(Memory::kPinned, inputs);
  auto written = [&](Buffer& grad) {
    EXPECT_EQ(cudaMemcpyAsync(grad.get(), pinned.get(), inputs.size(), cudaMemcpyHostToDevice,
                              cudaStreamLegacy),
              cudaSuccess);
  };
  const Bytes stale(inputs.size(), 0);
  const Bytes unset = AsBytes(std::vector<float>(kCount, -1.0f));
  for (const bool stream_ordered : {false, true}) {
    SCOPED_TRACE(stream_ordered ? "WaitStreamOrdered" : "Wait");
    Buffer grad(Memory::kDevice, stale);
    Buffer shard(Memory::kDevice, unset);
    written(grad);
    auto pending =
        comm.StartReduceScatter(grad.get(), shard.get(), kCount, DType::kF32, ReduceOp::kSum);
    ASSERT_TRUE(pending.ok()) << pending.status();
    EXPECT_TRUE((*pending)->InFlight());
    EXPECT_TRUE((stream_ordered ? (*pending)->WaitStreamOrdered() : (*pending)->Wait()).ok());
    EXPECT_EQ(shard.Read(), expected(rank));
    EXPECT_TRUE(comm.CheckStreamOrdered().ok());
  }
  {
    // A unit's reductions: several in flight, a gather started between them, a collective on
    // the main stream, then finished in call order as the model does.
    SCOPED_TRACE("several in flight");
    Buffer grad_a(Memory::kDevice, stale), grad_b(Memory::kDevice, stale);
    Buffer shard_a(Memory::kDevice, unset), shard_b(Memory::kDevice, unset);
    Buffer gathered(Memory::kDevice, Bytes(4 * kCount * size, 0));
    written(grad_a);
    auto a =
        comm.StartReduceScatter(grad_a.get(), shard_a.get(), kCount, DType::kF32, ReduceOp::kSum);
    auto g = comm.StartAllGather(grad_a.get(), kCount, gathered.get(), DType::kF32);
    written(grad_b);
    auto b =
        comm.StartReduceScatter(grad_b.get(), shard_b.get(), kCount, DType::kF32, ReduceOp::kSum);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_TRUE(b.ok()) << b.status();
    Buffer sum(Memory::kDevice, Inputs(DType::kI32, rank, kCount));
    EXPECT_TRUE(comm.AllReduce(sum.get(), kCount, DType::kI32, ReduceOp::kSum).ok());
    EXPECT_TRUE((*a)->WaitStreamOrdered().ok());
    EXPECT_TRUE((*g)->WaitStreamOrdered().ok());
    EXPECT_TRUE((*b)->WaitStreamOrdered().ok());
    EXPECT_TRUE(comm.CheckStreamOrdered().ok());
    EXPECT_EQ(shard_a.Read(), expected(rank));
    EXPECT_EQ(shard_b.Read(), expected(rank));
    Bytes firsts;  // every rank's first block of its gradient
    for (int r = 0; r < size; ++r) {
      const Bytes in = Inputs(DType::kF32, r, kCount);
      firsts.insert(firsts.end(), in.begin(), in.end());
    }
    EXPECT_EQ(gathered.Read(), firsts);
    EXPECT_EQ(sum.Read(), Reduced(DType::kI32, ReduceOp::kSum, size, 0, kCount));
  }
  EXPECT_GE(hostgpu::stats().side_stream, 5);
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

// What the side stream is for: the default stream's work is not held up by the started
// collectives, even with a second one started behind the first (the communicator orders its own
// streams, not the model's). The first reduce-scatter never ends; a copy on the default stream
// after both starts must still run at once, not when the watchdog aborts the communicator.
TEST_F(NcclHostTest, StartedCollectivesDoNotHoldUpTheDefaultStream) {
  expect_aborts_ = true;  // the hung reduce-scatter, by the watchdog
  auto factory = Make(std::chrono::seconds(4));
  ASSERT_NE(factory, nullptr);
  Communicator& comm = factory->World();
  const size_t size = static_cast<size_t>(comm.size());
  Buffer grad_a(Memory::kDevice, Bytes(4 * 8 * size, 1)), shard_a(Memory::kDevice, Bytes(32, 0));
  Buffer grad_b(Memory::kDevice, Bytes(4 * 8 * size, 2)), shard_b(Memory::kDevice, Bytes(32, 0));
  Buffer x(Memory::kDevice, Bytes(64, 0));  // the model's next work writes it
  Buffer pinned(Memory::kPinned, Bytes(64, 7));
  hostgpu::settings().hang_on_stream = true;
  auto a = comm.StartReduceScatter(grad_a.get(), shard_a.get(), 8, DType::kF32, ReduceOp::kSum);
  hostgpu::settings().hang_on_stream = false;
  auto b = comm.StartReduceScatter(grad_b.get(), shard_b.get(), 8, DType::kF32, ReduceOp::kSum);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  // The model's next work, on the default stream, with its result read by the host.
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(cudaMemcpyAsync(x.get(), pinned.get(), 64, cudaMemcpyHostToDevice, cudaStreamLegacy),
            cudaSuccess);
  EXPECT_EQ(x.Read(), Bytes(64, 7));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s)
      << "the default stream waited for the started collectives";
  // Finished as the model finishes them: the default stream waits, and the hang ends at the
  // watchdog's abort, which the group then reports.
  (void)(*a)->WaitStreamOrdered();
  (void)(*b)->WaitStreamOrdered();
  (void)x.Read();
  EXPECT_EQ(comm.CheckStreamOrdered().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

// On plain host memory (staged), started collectives run to completion at the start: the result
// is there before Wait, and nothing went to the side stream.
TEST_F(NcclHostTest, StartedCollectivesOfHostMemoryCompleteAtOnce) {
  auto factory = Make();
  ASSERT_NE(factory, nullptr);
  Communicator& comm = factory->World();
  const int rank = comm.rank(), size = comm.size();
  {
    SCOPED_TRACE("reduce-scatter");
    constexpr int64_t kCount = 9;
    Buffer send(Memory::kHost, Inputs(DType::kBF16, rank, kCount * size));
    Buffer recv(Memory::kHost, Bytes(2 * kCount, 0));
    auto pending =
        comm.StartReduceScatter(send.get(), recv.get(), kCount, DType::kBF16, ReduceOp::kSum);
    ASSERT_TRUE(pending.ok()) << pending.status();
    EXPECT_FALSE((*pending)->InFlight());
    EXPECT_EQ(recv.Read(), Reduced(DType::kBF16, ReduceOp::kSum, size, rank * kCount, kCount));
    EXPECT_TRUE((*pending)->Wait().ok());
  }
  {
    SCOPED_TRACE("all-gather");
    constexpr int64_t kCount = 11;
    Buffer send(Memory::kHost, Inputs(DType::kU8, rank, kCount));
    Buffer recv(Memory::kHost, Bytes(kCount * size, 0));
    auto pending = comm.StartAllGather(send.get(), kCount, recv.get(), DType::kU8);
    ASSERT_TRUE(pending.ok()) << pending.status();
    EXPECT_EQ(recv.Read(), Concatenated(DType::kU8, size, kCount));  // before Wait
    EXPECT_TRUE((*pending)->Wait().ok());
  }
  EXPECT_EQ(hostgpu::stats().side_stream, 0);
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

TEST_F(NcclHostTest, SplitGroupsReduceOverTheirOwnRanks) {
  for (const bool group_last : {false, true}) {
    SCOPED_TRACE(group_last ? "group destroyed after the factory" : "group destroyed first");
    auto factory = Make();
    ASSERT_NE(factory, nullptr);
    const int rank = factory->World().rank(), size = factory->World().size();
    // Even and odd world ranks, each group in reverse world order (key = -rank). With 3 ranks
    // the even group has two (ranks 2 and 0).
    absl::StatusOr<std::unique_ptr<Communicator>> group = factory->Split(rank % 2, -rank, "parity");
    ASSERT_TRUE(group.ok()) << group.status();
    Communicator& g = **group;
    std::vector<int32_t> members;
    for (int r = size - 1; r >= 0; --r) {
      if (r % 2 == rank % 2) members.push_back(r);
    }
    ASSERT_EQ(g.size(), static_cast<int>(members.size()));
    EXPECT_EQ(members[static_cast<size_t>(g.rank())], rank);
    for (Memory memory : {Memory::kHost, Memory::kDevice}) {
      SCOPED_TRACE(Name(memory));
      Buffer who(memory, AsBytes(std::vector<int32_t>{rank}));
      Buffer all(memory, AsBytes(std::vector<int32_t>(members.size(), -1)));
      EXPECT_TRUE(g.AllGather(who.get(), 1, all.get(), DType::kI32).ok());
      EXPECT_EQ(FromBytes<int32_t>(all.Read()), members);
      Buffer sum(memory, AsBytes(std::vector<int64_t>{int64_t{1} << (2 * rank)}));
      EXPECT_TRUE(g.AllReduce(sum.get(), 1, DType::kI64, ReduceOp::kSum, Completion::kStream).ok());
      EXPECT_TRUE(g.CheckStreamOrdered().ok());
      int64_t expected = 0;
      for (int32_t r : members) expected += int64_t{1} << (2 * r);
      EXPECT_EQ(FromBytes<int64_t>(sum.Read()), std::vector<int64_t>{expected});
    }
    // The world still works after the split.
    int32_t one = 1;
    EXPECT_TRUE(factory->World().AllReduce(&one, 1, DType::kI32, ReduceOp::kSum).ok());
    EXPECT_EQ(one, size);
    if (group_last) {
      factory.reset();
      group->reset();
    } else {
      group->reset();
      factory.reset();
    }
  }
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

TEST_F(NcclHostTest, ResultsThatArriveLateAreWaitedFor) {
  // NCCL keeps every call ncclInProgress for 40 polls and 20 ms: longer than any copy back.
  hostgpu::settings().polls = 40;
  hostgpu::settings().delay = 20ms;
  auto factory = Make();
  ASSERT_NE(factory, nullptr);
  Communicator& comm = factory->World();
  const int size = comm.size();
  const int64_t before = hostgpu::stats().deferred;
  float loss = static_cast<float>(comm.rank() + 1);
  EXPECT_TRUE(comm.AllReduce(&loss, 1, DType::kF32, ReduceOp::kSum).ok());
  EXPECT_EQ(loss, static_cast<float>(size * (size + 1) / 2));
  Buffer amax(Memory::kDevice, AsBytes(std::vector<float>{static_cast<float>(comm.rank())}));
  EXPECT_TRUE(comm.AllReduce(amax.get(), 1, DType::kF32, ReduceOp::kMax, Completion::kStream).ok());
  EXPECT_TRUE(comm.CheckStreamOrdered().ok());
  EXPECT_EQ(FromBytes<float>(amax.Read()), std::vector<float>{static_cast<float>(size - 1)});
  EXPECT_EQ(hostgpu::stats().deferred - before, 2);
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

// A collective NCCL never puts on its stream: the call's own wait ends at the deadline.
TEST_F(NcclHostTest, ACollectiveThatNeverReachesItsStreamEndsAtTheDeadline) {
  expect_aborts_ = true;
  for (Memory memory : {Memory::kHost, Memory::kDevice}) {
    for (Completion completion : {Completion::kHost, Completion::kStream}) {
      SCOPED_TRACE(CaseName(Case{memory, completion}));
      auto factory = Make(300ms);
      ASSERT_NE(factory, nullptr);
      Communicator& comm = factory->World();
      const int64_t aborted = hostgpu::stats().aborted;
      hostgpu::settings().hang = true;
      const Bytes input = Inputs(DType::kF32, comm.rank(), 5);
      Buffer buf(memory, input);
      const auto start = std::chrono::steady_clock::now();
      const absl::Status s = comm.AllReduce(buf.get(), 5, DType::kF32, ReduceOp::kSum, completion);
      const auto took = std::chrono::steady_clock::now() - start;
      hostgpu::settings().hang = false;
      ExpectAllReduceTimedOut(s, took);
      // Nothing half-done reaches the caller's buffer.
      EXPECT_EQ(buf.Read(), input);
      EXPECT_EQ(hostgpu::stats().aborted, aborted + 1);
      const absl::Status next = comm.Barrier();
      EXPECT_EQ(next.code(), absl::StatusCode::kFailedPrecondition) << next;
      EXPECT_THAT(next.message(), HasSubstr("unusable after an earlier failure"));
    }
  }
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

// One dead peer (the last rank: its calls never reach their stream), which is how a rank fails in
// practice: the others' kernels start, send their part and wait for the dead rank's for ever. Every
// rank's call still ends at the deadline, the healthy ones through the abort that ends their
// waiting kernels, and nothing half-done reaches a caller's buffer.
TEST_F(NcclHostTest, ADeadPeerFailsEveryRankAtTheDeadline) {
  expect_aborts_ = true;
  for (Memory memory : {Memory::kHost, Memory::kDevice}) {
    SCOPED_TRACE(Name(memory));
    auto factory = Make(300ms);
    ASSERT_NE(factory, nullptr);
    Communicator& comm = factory->World();
    const bool dead = comm.rank() == comm.size() - 1;
    const int64_t aborted = hostgpu::stats().aborted;
    const int64_t abandoned = hostgpu::stats().abandoned;
    hostgpu::settings().fault_rank = comm.size() - 1;
    hostgpu::settings().hang = true;
    const Bytes input = Inputs(DType::kF32, comm.rank(), 5);
    Buffer buf(memory, input);
    const auto start = std::chrono::steady_clock::now();
    const absl::Status s = comm.AllReduce(buf.get(), 5, DType::kF32, ReduceOp::kSum);
    const auto took = std::chrono::steady_clock::now() - start;
    hostgpu::settings() = hostgpu::Settings{};
    hostgpu::settings().lazy_streams = true;
    SCOPED_TRACE(dead ? "the dead rank" : "a healthy rank");
    ExpectAllReduceTimedOut(s, took);
    EXPECT_EQ(buf.Read(), input);
    EXPECT_EQ(hostgpu::stats().aborted, aborted + 1);
    // The healthy ranks' kernels had started and sent their part; the dead rank's never did. (An
    // aborted kernel ends when the device next reaches it.)
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(hostgpu::stats().abandoned, abandoned + (dead ? 0 : 1));
    EXPECT_EQ(comm.Barrier().code(), absl::StatusCode::kFailedPrecondition);
  }
  // Stream-ordered: the healthy ranks' calls return once NCCL queued the kernel, and their
  // watchdogs abort at the deadline, which ends the host's wait behind it; the dead rank's call
  // never leaves ncclInProgress and fails itself.
  auto factory = Make(300ms);
  ASSERT_NE(factory, nullptr);
  Communicator& comm = factory->World();
  const bool dead = comm.rank() == comm.size() - 1;
  hostgpu::settings().fault_rank = comm.size() - 1;
  hostgpu::settings().hang = true;
  const Bytes input = Inputs(DType::kF32, comm.rank(), 5);
  Buffer buf(Memory::kDevice, input);
  const absl::Status call =
      comm.AllReduce(buf.get(), 5, DType::kF32, ReduceOp::kSum, Completion::kStream);
  hostgpu::settings() = hostgpu::Settings{};
  hostgpu::settings().lazy_streams = true;
  if (dead) {
    EXPECT_EQ(call.code(), absl::StatusCode::kDeadlineExceeded) << call;
    EXPECT_EQ(buf.Read(), input);
  } else {
    EXPECT_TRUE(call.ok()) << call;
    ExpectReadWaitsForTheWatchdog(comm, buf, input, "ncclAllReduce (stream-ordered)");
  }
  EXPECT_EQ(comm.Barrier().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

// Communicator setup that never completes (Settings::setup_hang), on every rank: the creation,
// the parent of a split, its child, or the child's handle never written. Each fails at the 300 ms
// deadline naming the call, and aborts what it created; a split whose parent is aborted leaves
// the world broken, one whose child alone hung leaves it usable.
TEST_F(NcclHostTest, ASetupThatNeverCompletesFailsAtTheDeadline) {
  expect_aborts_ = true;
  using SetupHang = hostgpu::Settings::SetupHang;
  {
    SCOPED_TRACE("creation");
    const int64_t aborted = hostgpu::stats().aborted;
    const int64_t live = hostgpu::stats().live;
    hostgpu::settings().setup_hang = SetupHang::kInit;
    const auto start = std::chrono::steady_clock::now();
    auto f = NcclCommunicatorFactory::Create(testing::Factory().World(), 0, Options(300ms));
    const auto took = std::chrono::steady_clock::now() - start;
    hostgpu::settings().setup_hang = SetupHang::kNone;
    ASSERT_FALSE(f.ok());
    ExpectTimedOut(f.status(), "ncclCommInitRankConfig", took);
    EXPECT_EQ(hostgpu::stats().aborted, aborted + 1);
    EXPECT_EQ(hostgpu::stats().live, live);
  }
  struct SplitCase {
    SetupHang hang;
    const char* name;
    std::string call;
    bool world_broken;
  };
  for (const SplitCase& c :
       {SplitCase{SetupHang::kSplitParent, "parent", "ncclCommSplit", true},
        SplitCase{SetupHang::kSplitChild, "child", "ncclCommSplit (new communicator)", false},
        SplitCase{SetupHang::kSplitHandle, "handle", "ncclCommSplit", true}}) {
    SCOPED_TRACE(c.name);
    const int64_t live = hostgpu::stats().live;
    auto factory = Make(300ms);
    ASSERT_NE(factory, nullptr);
    Communicator& world = factory->World();
    const int64_t aborted = hostgpu::stats().aborted;
    hostgpu::settings().setup_hang = c.hang;
    const auto start = std::chrono::steady_clock::now();
    auto group = factory->Split(world.rank() % 2, 0, "parity");
    const auto took = std::chrono::steady_clock::now() - start;
    hostgpu::settings().setup_hang = SetupHang::kNone;
    ASSERT_FALSE(group.ok());
    ExpectTimedOut(group.status(), c.call, took);
    EXPECT_EQ(hostgpu::stats().aborted, aborted + 1);  // the world, or the child
    if (c.world_broken) {
      EXPECT_EQ(world.Barrier().code(), absl::StatusCode::kFailedPrecondition);
    } else {
      EXPECT_TRUE(world.Barrier().ok());
    }
    factory.reset();
    EXPECT_EQ(hostgpu::stats().live, live) << "a communicator left, the unclaimed child included";
  }
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

// A stream-ordered collective whose kernel never ends (a peer died after NCCL queued it): the
// call returns, and the watchdog aborts the communicator at the deadline, which ends the kernel,
// so that a host waiting behind it returns; CheckStreamOrdered and the next call report it.
TEST_F(NcclHostTest, AQueuedCollectiveThatNeverEndsIsAbortedByTheWatchdog) {
  expect_aborts_ = true;
  auto factory = Make(300ms);
  ASSERT_NE(factory, nullptr);
  Communicator& comm = factory->World();
  hostgpu::settings().hang_on_stream = true;
  const Bytes input = Inputs(DType::kF32, comm.rank(), 5);
  Buffer buf(Memory::kDevice, input);
  EXPECT_TRUE(comm.AllReduce(buf.get(), 5, DType::kF32, ReduceOp::kSum, Completion::kStream).ok());
  hostgpu::settings().hang_on_stream = false;
  // The host waits behind the kernel (a synchronous copy on the default stream); only the abort
  // ends that wait.
  ExpectReadWaitsForTheWatchdog(comm, buf, input, "ncclAllReduce (stream-ordered)");
  EXPECT_EQ(comm.Barrier().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

// The same when NCCL reports an asynchronous error after queueing the kernel: the watchdog sees
// it (well before the deadline) and aborts.
TEST_F(NcclHostTest, AnErrorAfterQueueingIsCaughtByTheWatchdog) {
  expect_aborts_ = true;
  auto factory = Make(5s);
  ASSERT_NE(factory, nullptr);
  Communicator& comm = factory->World();
  hostgpu::settings().fail_on_stream = ncclRemoteError;
  Buffer buf(Memory::kDevice, Inputs(DType::kF32, comm.rank(), 5));
  EXPECT_TRUE(comm.AllReduce(buf.get(), 5, DType::kF32, ReduceOp::kSum, Completion::kStream).ok());
  hostgpu::settings().fail_on_stream = ncclSuccess;
  const auto start = std::chrono::steady_clock::now();
  (void)buf.Read();  // ends when the watchdog's abort ends the kernel
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  const absl::Status s = comm.CheckStreamOrdered();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("remote process exited"));
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

TEST_F(NcclHostTest, AStartedAllGatherThatNeverReachesItsStreamFails) {
  expect_aborts_ = true;
  auto factory = Make(300ms);
  ASSERT_NE(factory, nullptr);
  Communicator& comm = factory->World();
  hostgpu::settings().hang = true;
  Buffer send(Memory::kDevice, Bytes(8, 1));
  Buffer recv(Memory::kDevice, Bytes(8 * static_cast<size_t>(comm.size()), 0));
  auto pending = comm.StartAllGather(send.get(), 8, recv.get(), DType::kU8);
  hostgpu::settings().hang = false;
  // NCCL never put the gather on its stream: the start itself times out.
  ASSERT_FALSE(pending.ok());
  EXPECT_EQ(pending.status().code(), absl::StatusCode::kDeadlineExceeded) << pending.status();
  EXPECT_THAT(pending.status().message(), HasSubstr("ncclAllGather (started)"));
  EXPECT_EQ(comm.CheckStreamOrdered().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

TEST_F(NcclHostTest, AStartedAllGatherThatNeverEndsFailsInWait) {
  expect_aborts_ = true;
  auto factory = Make(300ms);
  ASSERT_NE(factory, nullptr);
  Communicator& comm = factory->World();
  hostgpu::settings().hang_on_stream = true;
  Buffer send(Memory::kDevice, Bytes(8, 1));
  Buffer recv(Memory::kDevice, Bytes(8 * static_cast<size_t>(comm.size()), 0));
  auto pending = comm.StartAllGather(send.get(), 8, recv.get(), DType::kU8);
  hostgpu::settings().hang_on_stream = false;
  ASSERT_TRUE(pending.ok()) << pending.status();
  const absl::Status s = (*pending)->Wait();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("ncclAllGather (started)"));
  EXPECT_EQ(recv.Read(), Bytes(8 * static_cast<size_t>(comm.size()), 0));  // ended by the abort
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

// A started reduce-scatter whose kernel never ends, finished as the model finishes it
// (WaitStreamOrdered: the host does not wait): the default stream's next read waits behind it
// until the watchdog aborts the communicator at the deadline, and the group then reports the
// timeout, naming the call.
TEST_F(NcclHostTest, AStartedReduceScatterThatNeverEndsIsAbortedByTheWatchdog) {
  expect_aborts_ = true;
  auto factory = Make(300ms);
  ASSERT_NE(factory, nullptr);
  Communicator& comm = factory->World();
  const size_t size = static_cast<size_t>(comm.size());
  hostgpu::settings().hang_on_stream = true;
  Buffer send(Memory::kDevice, Bytes(4 * 8 * size, 1));
  Buffer recv(Memory::kDevice, Bytes(4 * 8, 0));
  auto pending = comm.StartReduceScatter(send.get(), recv.get(), 8, DType::kF32, ReduceOp::kSum);
  hostgpu::settings().hang_on_stream = false;
  ASSERT_TRUE(pending.ok()) << pending.status();
  (void)(*pending)->WaitStreamOrdered();  // OK or the timeout, as the watchdog has seen so far
  ExpectReadWaitsForTheWatchdog(comm, recv, Bytes(4 * 8, 0), "ncclReduceScatter (started)");
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

TEST_F(NcclHostTest, APeerThatFailsGivesUnavailable) {
  expect_aborts_ = true;
  auto factory = Make(5s);
  ASSERT_NE(factory, nullptr);
  Communicator& comm = factory->World();
  hostgpu::settings().fail = ncclRemoteError;
  float x = 1.0f;
  const absl::Status s = comm.AllReduce(&x, 1, DType::kF32, ReduceOp::kSum);
  hostgpu::settings().fail = ncclSuccess;
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("ncclAllReduce"));
  EXPECT_THAT(s.message(), HasSubstr("remote process exited"));
  EXPECT_THAT(s.message(), HasSubstr("the NCCL communicator was aborted"));
  EXPECT_EQ(x, 1.0f);
  EXPECT_TRUE(testing::AllRanksOk(!::testing::Test::HasFailure()));
}

}  // namespace
}  // namespace fp8rt::parallel
