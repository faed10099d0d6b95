// NCCL's non-blocking completion, on one GPU (issue 23, point 1).
//
// On a non-blocking communicator a collective may return ncclInProgress and reach the stream
// later, from NCCL's own thread. With two or more ranks that is what happens; with one rank NCCL
// usually enqueues at once, so one GPU hides the difference. This test makes it visible with the
// NCCL shim (tests/gpu/nccl_shim.h): while it is on, a collective's call returns ncclInProgress
// and the real call is made `delay` later. That is NCCL's documented contract, only slower, so
// results must come out right and the caller must wait for them.
//
// A communicator that queued the copy of a staged (host) output straight after the call, as
// fp8rt's did before this test, hands back the buffer as it was: the H200 showed it in training
// (train_cuda_test fp8_moe: the expert token counts came back 0, and the next all-to-all then sent
// to itself with no matching receive). Here each output starts as a sentinel, so a copy made too
// early fails the comparison.
//
// Completion::kStream (the model's TP reductions and gradient-free device collectives) is tested
// here too: such a call must not wait for the device (a host function that sleeps on the default
// stream holds the collective back, and the call returns long before it ends), must still wait
// for NCCL to enqueue (under the deferring shim), must order the default stream's later work
// after the collective (a copy queued straight after the call sees its result), and a queued
// collective that never completes (the shim's stall mode puts a host function that blocks until
// released on the stream in its place) must be aborted by the watchdog within the timeout.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/nccl/nccl_communicator.h"
#include "parallel/solo_communicator.h"
#include "tests/gpu/nccl_shim.h"

namespace fp8rt::parallel {
namespace {

using Clock = std::chrono::steady_clock;
using ::testing::HasSubstr;

constexpr float kSentinel = -12345.0f;

std::vector<float> Ramp(int64_t n, float start) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = start + 0.5f * static_cast<float>(i);
  return v;
}

class NcclDeferredTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (kernels::CudaDeviceCount(&why) == 0) {
      const char* required = std::getenv("FP8RT_REQUIRE_GPU");
      if (required != nullptr && std::string(required) == "1") {
        FAIL() << "FP8RT_REQUIRE_GPU=1 but there is no CUDA device: " << why;
      }
      GTEST_SKIP() << "no CUDA device: " << why;
    }
    shim::on = false;
    shim::hang = false;
    shim::stall = false;
    shim::slow = false;
    shim::mark = -1;
    shim::released = false;
    NcclOptions options;
    options.timeout = std::chrono::seconds(30);
    auto factory = NcclCommunicatorFactory::Create(bootstrap_, /*device=*/0, options);
    ASSERT_TRUE(factory.ok()) << factory.status();
    factory_ = std::move(factory).value();
    shim::Reset();
    shim::on = true;
  }
  void TearDown() override {
    shim::on = false;
    shim::hang = false;
    shim::stall = false;
    shim::slow = false;
    shim::mark = -1;
    shim::released = true;
    (void)cudaStreamSynchronize(cudaStreamLegacy);
    factory_.reset();  // aborts or finalises the communicator before the deferred calls end
    shim::Reset();
  }
  Communicator& world() { return factory_->World(); }
  // The world again, with the shim off while it is set up and the given timeout.
  void RecreateWithTimeout(std::chrono::milliseconds timeout) {
    factory_.reset();
    shim::on = false;
    shim::Reset();
    NcclOptions options;
    options.timeout = timeout;
    auto factory = NcclCommunicatorFactory::Create(bootstrap_, 0, options);
    ASSERT_TRUE(factory.ok()) << factory.status();
    factory_ = std::move(factory).value();
  }

  // Runs `collective`, checks that it was deferred and that the call waited for it.
  template <class F>
  void ExpectWaitedFor(F collective) {
    const int before = shim::Deferred();
    const auto t0 = Clock::now();
    const absl::Status s = collective();
    const auto waited = Clock::now() - t0;
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_GT(shim::Deferred(), before) << "the shim did not defer the call";
    EXPECT_GE(waited, shim::delay) << "the call returned before NCCL had run the collective";
  }

  SoloCommunicator bootstrap_;
  std::unique_ptr<NcclCommunicatorFactory> factory_;
};

TEST_F(NcclDeferredTest, AllGatherIntoHostMemoryWaitsForTheCollective) {
  const int64_t n = 1000;
  const std::vector<float> send = Ramp(n, 1.0f);
  std::vector<float> recv(n, kSentinel);
  ExpectWaitedFor([&] { return world().AllGather(send.data(), n, recv.data(), DType::kF32); });
  EXPECT_EQ(recv, send);
}

TEST_F(NcclDeferredTest, ReduceScatterIntoHostMemoryWaitsForTheCollective) {
  const int64_t n = 513;
  const std::vector<float> send = Ramp(n, -7.0f);
  std::vector<float> recv(n, kSentinel);
  ExpectWaitedFor([&] {
    return world().ReduceScatter(send.data(), recv.data(), n, DType::kF32, ReduceOp::kSum);
  });
  EXPECT_EQ(recv, send);
}

// MoE's pattern: the token counts first (one int64 per peer, host memory), then the tokens by
// those counts (what failed on the H200 before the fix).
TEST_F(NcclDeferredTest, AllToAllVCountsThenTokensFromHostMemory) {
  const std::vector<int64_t> ones = {1}, zero = {0};
  const std::vector<int64_t> send_counts = {96};
  std::vector<int64_t> recv_counts = {-1};
  ExpectWaitedFor([&] {
    return world().AllToAllV(send_counts.data(), ones, zero, recv_counts.data(), ones, zero,
                             DType::kI64);
  });
  ASSERT_EQ(recv_counts[0], 96);
  const std::vector<float> tokens = Ramp(96, 3.0f);
  std::vector<float> got(96, kSentinel);
  ExpectWaitedFor([&] {
    return world().AllToAllV(tokens.data(), send_counts, zero, got.data(), recv_counts, zero,
                             DType::kF32);
  });
  EXPECT_EQ(got, tokens);
}

TEST_F(NcclDeferredTest, InPlaceCollectivesOnHostMemoryWaitToo) {
  const std::vector<float> input = Ramp(64, 2.0f);
  std::vector<float> buf = input;
  ExpectWaitedFor([&] { return world().AllReduce(buf.data(), 64, DType::kF32, ReduceOp::kMax); });
  EXPECT_EQ(buf, input);
  ExpectWaitedFor([&] { return world().Broadcast(buf.data(), 64, DType::kF32, 0); });
  EXPECT_EQ(buf, input);
  // The same with each collective's result made different from its input (shim::mark): what
  // reaches the host is the result, so it was copied back after the collective ran.
  float marked = 0.0f;
  std::memset(&marked, 0x3F, sizeof(marked));
  shim::mark = 0x3F;
  ExpectWaitedFor([&] { return world().AllReduce(buf.data(), 64, DType::kF32, ReduceOp::kMax); });
  EXPECT_EQ(buf, std::vector<float>(64, marked)) << "all-reduce: the input came back";
  buf = input;
  ExpectWaitedFor([&] { return world().Broadcast(buf.data(), 64, DType::kF32, 0); });
  EXPECT_EQ(buf, std::vector<float>(64, marked)) << "broadcast: the input came back";
}

// A collective that never reaches the stream: the deadline still ends the call, the communicator
// is aborted and says why, and the host output is left as it was.
TEST_F(NcclDeferredTest, ACollectiveThatNeverRunsEndsAtTheDeadline) {
  ASSERT_NO_FATAL_FAILURE(RecreateWithTimeout(std::chrono::milliseconds(1500)));
  shim::on = true;
  shim::hang = true;
  const std::vector<float> send = Ramp(32, 0.0f);
  std::vector<float> recv(32, kSentinel);
  const auto t0 = Clock::now();
  const absl::Status s = world().AllGather(send.data(), 32, recv.data(), DType::kF32);
  const auto took = Clock::now() - t0;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("aborted"));
  EXPECT_LT(took, std::chrono::seconds(10));
  EXPECT_EQ(recv, std::vector<float>(32, kSentinel));
  EXPECT_FALSE(world().AllGather(send.data(), 32, recv.data(), DType::kF32).ok());
}

// --- Completion::kStream ------------------------------------------------------------------------

// Device memory holding `values`, or null (the test then fails).
float* DeviceCopy(const std::vector<float>& values) {
  void* p = nullptr;
  if (cudaMalloc(&p, values.size() * sizeof(float)) != cudaSuccess) return nullptr;
  if (cudaMemcpy(p, values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice) !=
      cudaSuccess) {
    return nullptr;
  }
  return static_cast<float*>(p);
}

// `n` floats of device memory read through a copy queued on the default stream right after the
// caller's collective, then a synchronisation of that stream: what the model's later work sees.
// `pinned` (n floats of pinned memory, allocated before the collective: a pinned allocation is
// an implicit synchronisation between streams, which would hide a missing wait) or, when null,
// pinned memory of its own.
std::vector<float> ReadOnDefaultStream(const float* device, int64_t n, float* pinned = nullptr) {
  const bool own = pinned == nullptr;
  std::vector<float> out;
  if (own && cudaMallocHost(&pinned, static_cast<size_t>(n) * sizeof(float)) != cudaSuccess) {
    return out;
  }
  if (cudaMemcpyAsync(pinned, device, static_cast<size_t>(n) * sizeof(float),
                      cudaMemcpyDeviceToHost, cudaStreamLegacy) == cudaSuccess &&
      cudaStreamSynchronize(cudaStreamLegacy) == cudaSuccess) {
    out.assign(pinned, pinned + n);
  }
  if (own) (void)cudaFreeHost(pinned);
  return out;
}

void CUDART_CB SleepHalfASecond(void*) {
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
}

TEST_F(NcclDeferredTest, StreamOrderedCollectivesReturnBeforeTheDeviceRunsThem) {
  shim::on = false;
  const int64_t n = 777;
  const std::vector<float> send = Ramp(n, 5.0f);
  float* s = DeviceCopy(send);
  float* r = DeviceCopy(std::vector<float>(n, kSentinel));
  float* rs = DeviceCopy(std::vector<float>(n, kSentinel));
  float* a2a = DeviceCopy(std::vector<float>(n, kSentinel));
  ASSERT_TRUE(s != nullptr && r != nullptr && rs != nullptr && a2a != nullptr);
  // Each once first, so that NCCL's first-call set-up (and the point-to-point connections it
  // makes lazily for the all-to-all) is not timed.
  const int64_t counts[] = {n}, displs[] = {0};
  ASSERT_TRUE(world().AllGather(s, n, r, DType::kF32, Completion::kStream).ok());
  ASSERT_TRUE(
      world()
          .AllToAllV(s, counts, displs, a2a, counts, displs, DType::kF32, Completion::kStream)
          .ok());
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(a2a, std::vector<float>(n, kSentinel).data(), n * sizeof(float),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(r, std::vector<float>(n, kSentinel).data(), n * sizeof(float),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  // The default stream is busy for 500 ms; the collectives (on the communicator's blocking
  // stream) start after it.
  ASSERT_EQ(cudaLaunchHostFunc(cudaStreamLegacy, SleepHalfASecond, nullptr), cudaSuccess);
  const auto t0 = Clock::now();
  ASSERT_TRUE(world().AllGather(s, n, r, DType::kF32, Completion::kStream).ok());
  ASSERT_TRUE(
      world().ReduceScatter(s, rs, n, DType::kF32, ReduceOp::kSum, Completion::kStream).ok());
  ASSERT_TRUE(world().AllReduce(s, n, DType::kF32, ReduceOp::kMax, Completion::kStream).ok());
  ASSERT_TRUE(
      world()
          .AllToAllV(s, counts, displs, a2a, counts, displs, DType::kF32, Completion::kStream)
          .ok());
  const auto took = Clock::now() - t0;
  EXPECT_LT(took, std::chrono::milliseconds(250)) << "a stream-ordered call waited for the device";
  EXPECT_EQ(ReadOnDefaultStream(r, n), send);
  EXPECT_EQ(ReadOnDefaultStream(rs, n), send);
  EXPECT_EQ(ReadOnDefaultStream(a2a, n), send);
  // The blocking form, by contrast, waits for the device.
  ASSERT_EQ(cudaLaunchHostFunc(cudaStreamLegacy, SleepHalfASecond, nullptr), cudaSuccess);
  const auto t1 = Clock::now();
  ASSERT_TRUE(world().AllGather(s, n, r, DType::kF32).ok());
  EXPECT_GE(Clock::now() - t1, std::chrono::milliseconds(400));
  for (float* p : {s, r, rs, a2a}) EXPECT_EQ(cudaFree(p), cudaSuccess);
}

TEST_F(NcclDeferredTest, StreamOrderedCollectivesWaitForNcclToEnqueueThem) {
  const int64_t n = 300;
  const std::vector<float> send = Ramp(n, -2.0f);
  float* s = DeviceCopy(send);
  float* r = DeviceCopy(std::vector<float>(n, kSentinel));
  ASSERT_TRUE(s != nullptr && r != nullptr);
  // Under the shim NCCL enqueues `delay` after the call: an event recorded before then would
  // not follow the collective, and the copy below would read the sentinel.
  ExpectWaitedFor([&] { return world().AllGather(s, n, r, DType::kF32, Completion::kStream); });
  EXPECT_EQ(ReadOnDefaultStream(r, n), send);
  // The all-to-all is a whole ncclGroupStart..ncclGroupEnd, which the shim defers as one.
  float* a2a = DeviceCopy(std::vector<float>(n, kSentinel));
  ASSERT_NE(a2a, nullptr);
  const int64_t counts[] = {n}, displs[] = {0};
  ExpectWaitedFor([&] {
    return world().AllToAllV(s, counts, displs, a2a, counts, displs, DType::kF32,
                             Completion::kStream);
  });
  EXPECT_EQ(ReadOnDefaultStream(a2a, n), send);
  for (float* p : {s, r, a2a}) EXPECT_EQ(cudaFree(p), cudaSuccess);
}

// FSDP's prefetch: the started all-gather's completion event must follow the gather even when
// NCCL enqueues it late, and Wait orders the default stream after it (the copy below, and the
// model's stream-ordered free of the buffer).
TEST_F(NcclDeferredTest, AStartedAllGatherIsWaitedForEvenWhenNcclEnqueuesItLate) {
  const int64_t n = 4099;
  const std::vector<float> send = Ramp(n, 0.25f);
  float* s = DeviceCopy(send);
  float* r = DeviceCopy(std::vector<float>(n, kSentinel));
  ASSERT_TRUE(s != nullptr && r != nullptr);
  EXPECT_TRUE(world().CheckStreamOrdered().ok());
  // The gather reaches the side stream `delay` after the call, behind 400 ms of sleep there: an
  // event recorded at the call would complete at once, and Wait would return before the gather.
  shim::slow = true;
  const int before = shim::Deferred();
  const auto t0 = Clock::now();
  auto started = world().StartAllGather(s, n, r, DType::kF32);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_GT(shim::Deferred(), before) << "the shim did not defer the call";
  ASSERT_TRUE((*started)->Wait().ok());
  EXPECT_GE(Clock::now() - t0, shim::delay + std::chrono::milliseconds(400))
      << "Wait returned before the gather had run";
  EXPECT_EQ(ReadOnDefaultStream(r, n), send);
  EXPECT_TRUE(world().CheckStreamOrdered().ok());
  for (float* p : {s, r}) EXPECT_EQ(cudaFree(p), cudaSuccess);
}

// FSDP's forward and backward take a started gather with WaitStreamOrdered: the host goes on at
// once while the gather runs (400 ms of sleep ahead of it on the side stream, which the default
// stream does not otherwise wait for), and a copy queued on the default stream afterwards still
// reads the gathered values.
TEST_F(NcclDeferredTest, AStartedAllGatherWaitedInStreamOrderDoesNotHoldTheHost) {
  shim::on = false;
  const int64_t n = 2053;
  const std::vector<float> send = Ramp(n, -9.0f);
  float* s = DeviceCopy(send);
  float* r = DeviceCopy(std::vector<float>(n, kSentinel));
  ASSERT_TRUE(s != nullptr && r != nullptr);
  {  // once first, so that NCCL's first-call set-up and the side stream's creation are not timed
    auto warm = world().StartAllGather(s, n, r, DType::kF32);
    ASSERT_TRUE(warm.ok()) << warm.status();
    ASSERT_TRUE((*warm)->Wait().ok());
    ASSERT_EQ(cudaMemcpy(r, std::vector<float>(n, kSentinel).data(), n * sizeof(float),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, n * sizeof(float)), cudaSuccess);
  shim::slow = true;
  const auto t0 = Clock::now();
  auto started = world().StartAllGather(s, n, r, DType::kF32);
  ASSERT_TRUE(started.ok()) << started.status();
  ASSERT_TRUE((*started)->WaitStreamOrdered().ok());
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(200)) << "the host waited for the gather";
  EXPECT_EQ(ReadOnDefaultStream(r, n, pinned), send);
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(400));
  EXPECT_TRUE((*started)->Wait().ok());  // the same status again
  EXPECT_TRUE(world().CheckStreamOrdered().ok());
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  for (float* p : {s, r}) EXPECT_EQ(cudaFree(p), cudaSuccess);
}

// FSDP's prefetch when a peer dies: a started gather whose collective never completes (the
// stall stand-in, released 3 s in). Starting it does not wait; Wait ends at the deadline with the
// communicator aborted, naming the started gather, and says the same again; the next collective
// is refused; the default stream's later work still comes after the gather (the read below sees
// the buffer only once the stand-in ended, and the gather never wrote it).
TEST_F(NcclDeferredTest, AStartedAllGatherThatNeverCompletesEndsAtTheDeadline) {
  ASSERT_NO_FATAL_FAILURE(RecreateWithTimeout(std::chrono::milliseconds(1500)));
  const int64_t n = 257;
  float* s = DeviceCopy(Ramp(n, 1.0f));
  float* r = DeviceCopy(std::vector<float>(n, kSentinel));
  ASSERT_TRUE(s != nullptr && r != nullptr);
  std::jthread release([] {  // joined on every way out of the test
    std::this_thread::sleep_for(std::chrono::seconds(3));
    shim::released = true;
  });
  shim::stall = true;
  const auto t0 = Clock::now();
  auto started = world().StartAllGather(s, n, r, DType::kF32);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(500)) << "starting it waited";
  const absl::Status waited = (*started)->Wait();
  const auto took = Clock::now() - t0;
  EXPECT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded) << waited;
  EXPECT_THAT(std::string(waited.message()), HasSubstr("ncclAllGather (started)"));
  EXPECT_THAT(std::string(waited.message()), HasSubstr("aborted"));
  // At least the timeout; Wait may last until the release when the abort waits for the device.
  EXPECT_GE(took, std::chrono::milliseconds(1500));
  EXPECT_LT(took, std::chrono::milliseconds(8000));
  std::printf("started gather: Wait returned after %.2f s (released at 3 s)\n",
              std::chrono::duration<double>(took).count());
  EXPECT_EQ((*started)->Wait(), waited);
  auto next = world().StartAllGather(s, n, r, DType::kF32);
  ASSERT_FALSE(next.ok());
  EXPECT_EQ(next.status().code(), absl::StatusCode::kFailedPrecondition) << next.status();
  EXPECT_EQ(ReadOnDefaultStream(r, n), std::vector<float>(n, kSentinel));
  EXPECT_GE(Clock::now() - t0, std::chrono::seconds(3)) << "the default stream did not wait";
  started->reset();
  for (float* p : {s, r}) EXPECT_EQ(cudaFree(p), cudaSuccess);
}

TEST_F(NcclDeferredTest, AStreamOrderedCollectiveThatNeverCompletesIsAbortedByTheWatchdog) {
  ASSERT_NO_FATAL_FAILURE(RecreateWithTimeout(std::chrono::milliseconds(1500)));
  auto& nccl = static_cast<NcclCommunicator&>(world());
  float* buf = DeviceCopy(Ramp(16, 1.0f));
  ASSERT_NE(buf, nullptr);
  // A real collective's kernels end at the abort; the stand-in here ends when released, 3 s in
  // (ncclCommAbort may wait for the device, and health() for the abort). Started first, so that
  // the stream is released whatever fails below.
  std::jthread release([] {  // joined on every way out of the test
    std::this_thread::sleep_for(std::chrono::seconds(3));
    shim::released = true;
  });
  shim::stall = true;
  const auto t0 = Clock::now();
  ASSERT_TRUE(world().AllReduce(buf, 16, DType::kF32, ReduceOp::kSum, Completion::kStream).ok());
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(500));
  // Nobody calls the communicator: only the watchdog can notice.
  while (nccl.health().ok() && Clock::now() - t0 < std::chrono::seconds(15)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const auto noticed = Clock::now() - t0;
  const absl::Status health = nccl.health();
  EXPECT_EQ(health.code(), absl::StatusCode::kDeadlineExceeded) << health;
  EXPECT_THAT(std::string(health.message()), HasSubstr("ncclAllReduce (stream-ordered)"));
  EXPECT_THAT(std::string(health.message()), HasSubstr("aborted"));
  EXPECT_GE(noticed, std::chrono::milliseconds(1500));
  EXPECT_LT(noticed, std::chrono::milliseconds(8000));
  const absl::Status next =
      world().AllReduce(buf, 16, DType::kF32, ReduceOp::kSum, Completion::kStream);
  EXPECT_EQ(next.code(), absl::StatusCode::kFailedPrecondition) << next;
  EXPECT_THAT(std::string(next.message()), HasSubstr("did not complete within 1500 ms"));
  // What the model asks after its pass's synchronisation.
  const absl::Status checked = world().CheckStreamOrdered();
  EXPECT_EQ(checked.code(), absl::StatusCode::kDeadlineExceeded) << checked;
  EXPECT_THAT(std::string(checked.message()),
              HasSubstr("group 'world' (rank 0 of 1): a stream-ordered collective failed"));
  EXPECT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
  EXPECT_EQ(cudaFree(buf), cudaSuccess);
}

}  // namespace
}  // namespace fp8rt::parallel
