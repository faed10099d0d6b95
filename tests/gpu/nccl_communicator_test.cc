// NCCL backend on one GPU: every collective on device buffers, in a one-rank world.
//
// NCCL refuses two ranks on one GPU, so a single process is the GPU check; the multi-rank logic
// of the Communicator front end is covered by the MPI tests. With one rank the expected result of
// each collective follows from its definition: a reduction over one rank is that rank's input,
// a gather or all-to-all moves the bytes unchanged to the documented place. Out-of-place calls
// write into buffers filled with a sentinel, with guard elements past the end, so a wrong element
// size or displacement shows up. Without a CUDA device the GPU tests skip and say why.
#include "parallel/nccl/nccl_communicator.h"

#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/solo_communicator.h"

namespace fp8rt::parallel {
namespace {

using ::testing::HasSubstr;

// --- device memory ---------------------------------------------------------------------------

struct CudaFree {
  void operator()(void* p) const { (void)cudaFree(p); }
};
using DevicePtr = std::unique_ptr<void, CudaFree>;

// Device copy of `host`. Fails the test (returning null) on a CUDA error.
DevicePtr ToDevice(const std::vector<uint8_t>& host) {
  void* p = nullptr;
  if (cudaMalloc(&p, host.empty() ? 1 : host.size()) != cudaSuccess) {
    ADD_FAILURE() << "cudaMalloc of " << host.size() << " bytes failed";
    return nullptr;
  }
  DevicePtr d(p);
  if (cudaMemcpy(p, host.data(), host.size(), cudaMemcpyHostToDevice) != cudaSuccess) {
    ADD_FAILURE() << "cudaMemcpy to device failed";
    return nullptr;
  }
  return d;
}

std::vector<uint8_t> ToHost(const DevicePtr& d, size_t bytes) {
  std::vector<uint8_t> host(bytes);
  if (cudaMemcpy(host.data(), d.get(), bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
    ADD_FAILURE() << "cudaMemcpy to host failed";
  }
  return host;
}

// --- test data -------------------------------------------------------------------------------

// `count` elements of `dtype` as bytes: finite and special values (signed zeros, infinities,
// subnormals, extremes), never NaN, so that any conversion on the way would show.
std::vector<uint8_t> Values(DType dtype, int64_t count, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const float specials[] = {0.0f, -0.0f, 1.0f, -1.0f, 1e-40f, -3.0e38f, 448.0f, 57344.0f};
  std::vector<uint8_t> out(static_cast<size_t>(Communicator::Bytes(count, dtype)));
  for (int64_t i = 0; i < count; ++i) {
    const float f = i < 8 ? specials[i] : normal(rng);
    uint8_t* at = out.data() + i * Communicator::Bytes(1, dtype);
    switch (dtype) {
      case DType::kF32: {
        const uint32_t bits = std::bit_cast<uint32_t>(f);
        std::memcpy(at, &bits, 4);
        break;
      }
      case DType::kBF16: {
        const uint16_t bits = static_cast<uint16_t>(std::bit_cast<uint32_t>(f) >> 16);
        std::memcpy(at, &bits, 2);
        break;
      }
      case DType::kU8:
        *at = static_cast<uint8_t>(i);  // every FP8 code, NaN codes included: bytes only
        break;
      case DType::kI32: {
        const int32_t v = i == 0 ? INT32_MIN : i == 1 ? INT32_MAX : static_cast<int32_t>(rng());
        std::memcpy(at, &v, 4);
        break;
      }
      case DType::kI64: {
        const int64_t v = i == 0 ? INT64_MIN : i == 1 ? INT64_MAX : static_cast<int64_t>(rng());
        std::memcpy(at, &v, 8);
        break;
      }
    }
  }
  return out;
}

constexpr uint8_t kSentinel = 0xA5;
constexpr int64_t kGuard = 7;  // sentinel elements past the end of every output buffer

std::vector<uint8_t> Sentinel(int64_t elements, DType dtype) {
  return std::vector<uint8_t>(static_cast<size_t>(Communicator::Bytes(elements, dtype)), kSentinel);
}

std::string Name(DType dtype) { return std::string(DTypeName(dtype)); }

// --- fixtures --------------------------------------------------------------------------------

NcclOptions TestOptions() {
  NcclOptions options;
  options.timeout = std::chrono::seconds(60);
  return options;
}

class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (kernels::CudaDeviceCount(&why) == 0) GTEST_SKIP() << "no CUDA device: " << why;
    auto factory = NcclCommunicatorFactory::Create(bootstrap_, /*device=*/0, TestOptions());
    ASSERT_TRUE(factory.ok()) << factory.status();
    factory_ = std::move(factory).value();
  }
  Communicator& world() { return factory_->World(); }

  SoloCommunicator bootstrap_;
  std::unique_ptr<NcclCommunicatorFactory> factory_;
};

const DType kReducible[] = {DType::kF32, DType::kBF16, DType::kI32, DType::kI64};
const DType kAll[] = {DType::kF32, DType::kBF16, DType::kU8, DType::kI32, DType::kI64};

// --- tests that need no GPU ------------------------------------------------------------------

TEST(NcclFactoryTest, RejectsNegativeDevice) {
  SoloCommunicator bootstrap;
  auto factory = NcclCommunicatorFactory::Create(bootstrap, -1, TestOptions());
  EXPECT_EQ(factory.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(factory.status().message()), HasSubstr("device"));
}

TEST(NcclFactoryTest, WithoutDeviceFailsWithStatusNamingIt) {
  std::string why;
  if (kernels::CudaDeviceCount(&why) > 0) GTEST_SKIP() << "a CUDA device is present";
  SoloCommunicator bootstrap;
  auto factory = NcclCommunicatorFactory::Create(bootstrap, 0, TestOptions());
  ASSERT_FALSE(factory.ok());
  EXPECT_THAT(std::string(factory.status().message()), HasSubstr("CUDA device 0"));
  // Every rank learned of the failure through one collective on the bootstrap, not a hang.
  EXPECT_EQ(bootstrap.stats().Calls(CollectiveOp::kAllReduce, DType::kI32), 1);
}

// --- the world -------------------------------------------------------------------------------

TEST_F(NcclTest, WorldIsOneRankOnDeviceZero) {
  EXPECT_EQ(world().name(), "world");
  EXPECT_EQ(world().rank(), 0);
  EXPECT_EQ(world().size(), 1);
  auto& nccl = static_cast<NcclCommunicator&>(world());
  EXPECT_EQ(nccl.device(), 0);
  EXPECT_NE(nccl.stream(), nullptr);
  EXPECT_TRUE(nccl.health().ok());
}

// --- reductions ------------------------------------------------------------------------------

class NcclReduceTest : public NcclTest,
                       public ::testing::WithParamInterface<std::tuple<DType, ReduceOp>> {};

TEST_P(NcclReduceTest, AllReduceOverOneRankIsTheInput) {
  const auto [dtype, op] = GetParam();
  const int64_t count = 1000;
  const std::vector<uint8_t> input = Values(dtype, count, 1);
  DevicePtr buf = ToDevice(input);
  ASSERT_NE(buf, nullptr);
  ASSERT_TRUE(world().AllReduce(buf.get(), count, dtype, op).ok());
  EXPECT_EQ(ToHost(buf, input.size()), input);
  EXPECT_EQ(world().stats().Bytes(CollectiveOp::kAllReduce, dtype),
            count * static_cast<int64_t>(DTypeSize(dtype)));
  EXPECT_EQ(world().stats().Calls(CollectiveOp::kAllReduce, dtype), 1);
}

// Plain host memory (the step loop's control values) is staged through device memory: every
// collective gives the same result on host buffers, the guard elements after them untouched.
TEST_F(NcclTest, HostBuffersAreStaged) {
  const int64_t count = 37;
  const std::vector<uint8_t> input = Values(DType::kF32, count, 5);
  std::vector<uint8_t> buf = input;
  ASSERT_TRUE(world().AllReduce(buf.data(), count, DType::kF32, ReduceOp::kSum).ok());
  EXPECT_EQ(buf, input);
  std::vector<uint8_t> recv = Sentinel(count + kGuard, DType::kF32);
  ASSERT_TRUE(world().AllGather(input.data(), count, recv.data(), DType::kF32).ok());
  std::vector<uint8_t> expected = input;
  const std::vector<uint8_t> guard = Sentinel(kGuard, DType::kF32);
  expected.insert(expected.end(), guard.begin(), guard.end());
  EXPECT_EQ(recv, expected);
  recv = Sentinel(count + kGuard, DType::kF32);
  ASSERT_TRUE(
      world().ReduceScatter(input.data(), recv.data(), count, DType::kF32, ReduceOp::kMax).ok());
  EXPECT_EQ(recv, expected);
  std::vector<uint8_t> root = input;
  ASSERT_TRUE(world().Broadcast(root.data(), count, DType::kF32, 0).ok());
  EXPECT_EQ(root, input);
  // One buffer on the device, the other on the host.
  DevicePtr dev = ToDevice(input);
  ASSERT_NE(dev, nullptr);
  recv = Sentinel(count + kGuard, DType::kF32);
  const int64_t counts[1] = {count}, displs[1] = {0};
  ASSERT_TRUE(
      world().AllToAllV(dev.get(), counts, displs, recv.data(), counts, displs, DType::kF32).ok());
  EXPECT_EQ(recv, expected);
  // A receive block at a displacement: the host bytes before it are left as they were (the staged
  // extent starts at 0 and is copied back whole).
  const int64_t gap = 5;
  const int64_t gap_displs[1] = {gap};
  recv = Sentinel(gap + count + kGuard, DType::kF32);
  ASSERT_TRUE(
      world()
          .AllToAllV(dev.get(), counts, displs, recv.data(), counts, gap_displs, DType::kF32)
          .ok());
  expected = Sentinel(gap, DType::kF32);
  expected.insert(expected.end(), input.begin(), input.end());
  expected.insert(expected.end(), guard.begin(), guard.end());
  EXPECT_EQ(recv, expected);
}

TEST_P(NcclReduceTest, ReduceScatterOverOneRankCopiesItsBlockOnly) {
  const auto [dtype, op] = GetParam();
  const int64_t count = 777;
  const std::vector<uint8_t> input = Values(dtype, count, 2);
  DevicePtr send = ToDevice(input);
  DevicePtr recv = ToDevice(Sentinel(count + kGuard, dtype));
  ASSERT_NE(send, nullptr);
  ASSERT_NE(recv, nullptr);
  ASSERT_TRUE(world().ReduceScatter(send.get(), recv.get(), count, dtype, op).ok());
  std::vector<uint8_t> expected = input;
  const std::vector<uint8_t> guard = Sentinel(kGuard, dtype);
  expected.insert(expected.end(), guard.begin(), guard.end());
  EXPECT_EQ(ToHost(recv, expected.size()), expected);
  EXPECT_EQ(world().stats().Bytes(CollectiveOp::kReduceScatter, dtype),
            count * static_cast<int64_t>(DTypeSize(dtype)));
}

INSTANTIATE_TEST_SUITE_P(AllReducibleTypes, NcclReduceTest,
                         ::testing::Combine(::testing::ValuesIn(kReducible),
                                            ::testing::Values(ReduceOp::kSum, ReduceOp::kMax)),
                         [](const auto& info) {
                           return Name(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) == ReduceOp::kSum ? "_sum" : "_max");
                         });

TEST_F(NcclTest, Fp8BytesAreNeverReduced) {
  DevicePtr buf = ToDevice(Values(DType::kU8, 16, 3));
  ASSERT_NE(buf, nullptr);
  const absl::Status s = world().AllReduce(buf.get(), 16, DType::kU8, ReduceOp::kSum);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  // Refused before NCCL was called: the communicator is still usable.
  EXPECT_TRUE(static_cast<NcclCommunicator&>(world()).health().ok());
  EXPECT_TRUE(world().Barrier().ok());
}

// --- data movement ---------------------------------------------------------------------------

class NcclMoveTest : public NcclTest, public ::testing::WithParamInterface<DType> {};

TEST_P(NcclMoveTest, AllGatherPlacesTheRankBlockUnchanged) {
  const DType dtype = GetParam();
  const int64_t count = 256;  // for kU8: every FP8 code once
  const std::vector<uint8_t> input = Values(dtype, count, 4);
  DevicePtr send = ToDevice(input);
  DevicePtr recv = ToDevice(Sentinel(count + kGuard, dtype));
  ASSERT_NE(send, nullptr);
  ASSERT_NE(recv, nullptr);
  ASSERT_TRUE(world().AllGather(send.get(), count, recv.get(), dtype).ok());
  std::vector<uint8_t> expected = input;
  const std::vector<uint8_t> guard = Sentinel(kGuard, dtype);
  expected.insert(expected.end(), guard.begin(), guard.end());
  EXPECT_EQ(ToHost(recv, expected.size()), expected);
  EXPECT_EQ(world().stats().Bytes(CollectiveOp::kAllGather, dtype),
            Communicator::Bytes(count, dtype));
}

// StartAllGather on device buffers runs on the side stream: it must see what the legacy default
// stream wrote before it started (a memset enqueued just before), the main stream's next
// collective must wait for it, and Wait() completes it. Two gathers in flight at once, then an
// all-reduce on the main stream, then both waits: every result as its definition says. Host
// buffers take the blocking path and give the same bytes.
// Holds the stream it is queued on for 300 ms.
void CUDART_CB Sleep300Ms(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }

TEST_P(NcclMoveTest, StartedAllGatherIsOrderedAfterEarlierDeviceWork) {
  const DType dtype = GetParam();
  const int64_t count = 1 << 20;
  const int64_t bytes = Communicator::Bytes(count, dtype);
  DevicePtr send = ToDevice(Values(dtype, count, 8));
  DevicePtr send2 = ToDevice(Values(dtype, count, 9));
  DevicePtr recv = ToDevice(Sentinel(count, dtype));
  DevicePtr recv2 = ToDevice(Sentinel(count, dtype));
  ASSERT_NE(send, nullptr);
  ASSERT_NE(recv2, nullptr);
  // The default stream is held for 300 ms before the memset, so the memset is certainly still
  // queued when the gather starts: a side stream not ordered after the default stream would
  // gather the old values (8), not the memset's bytes.
  ASSERT_EQ(cudaLaunchHostFunc(cudaStreamLegacy, Sleep300Ms, nullptr), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(send.get(), 0x3C, static_cast<size_t>(bytes), cudaStreamLegacy),
            cudaSuccess);
  auto first = world().StartAllGather(send.get(), count, recv.get(), dtype);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = world().StartAllGather(send2.get(), count, recv2.get(), dtype);
  ASSERT_TRUE(second.ok()) << second.status();
  int32_t flag = 5;
  ASSERT_TRUE(world().AllReduce(&flag, 1, DType::kI32, ReduceOp::kMax).ok());
  EXPECT_EQ(flag, 5);
  ASSERT_TRUE((*first)->Wait().ok());
  ASSERT_TRUE((*second)->Wait().ok());
  EXPECT_EQ(ToHost(recv, static_cast<size_t>(bytes)),
            std::vector<uint8_t>(static_cast<size_t>(bytes), 0x3C));
  EXPECT_EQ(ToHost(recv2, static_cast<size_t>(bytes)), Values(dtype, count, 9));
  // Host buffers: staged, blocking, the same bytes.
  const std::vector<uint8_t> input = Values(dtype, 300, 10);
  std::vector<uint8_t> out = Sentinel(300, dtype);
  auto host = world().StartAllGather(input.data(), 300, out.data(), dtype);
  ASSERT_TRUE(host.ok()) << host.status();
  ASSERT_TRUE((*host)->Wait().ok());
  EXPECT_EQ(out, input);
  EXPECT_EQ(world().stats().Bytes(CollectiveOp::kAllGather, dtype),
            2 * bytes + Communicator::Bytes(300, dtype));
}

// StartReduceScatter (FSDP's gradient reduction) on device buffers runs on the side stream too:
// it must see the gradient the default stream wrote before it started (a memset queued behind a
// 300 ms host function), and after WaitStreamOrdered the default stream's next copy must see its
// result (the copy is queued at once, while the reduce-scatter is still waiting for the memset,
// so an unordered copy would read the sentinel). One rank: the block is the input.
TEST_F(NcclTest, StartedReduceScatterIsOrderedBetweenTheDefaultStreamsWork) {
  const int64_t count = 1 << 22;
  const size_t bytes = static_cast<size_t>(Communicator::Bytes(count, DType::kF32));
  DevicePtr grad = ToDevice(Values(DType::kF32, count, 11));
  DevicePtr shard = ToDevice(Sentinel(count, DType::kF32));
  DevicePtr copy = ToDevice(Sentinel(count, DType::kF32));
  ASSERT_NE(grad, nullptr);
  ASSERT_NE(shard, nullptr);
  ASSERT_NE(copy, nullptr);
  ASSERT_EQ(cudaLaunchHostFunc(cudaStreamLegacy, Sleep300Ms, nullptr), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(grad.get(), 0x3C, bytes, cudaStreamLegacy), cudaSuccess);
  auto pending =
      world().StartReduceScatter(grad.get(), shard.get(), count, DType::kF32, ReduceOp::kSum);
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_TRUE((*pending)->InFlight());
  ASSERT_TRUE((*pending)->WaitStreamOrdered().ok());
  ASSERT_EQ(
      cudaMemcpyAsync(copy.get(), shard.get(), bytes, cudaMemcpyDeviceToDevice, cudaStreamLegacy),
      cudaSuccess);
  EXPECT_EQ(ToHost(copy, bytes), std::vector<uint8_t>(bytes, 0x3C));
  EXPECT_TRUE(world().CheckStreamOrdered().ok());
  EXPECT_EQ(world().stats().Bytes(CollectiveOp::kReduceScatter, DType::kF32),
            static_cast<int64_t>(bytes));
}

TEST_P(NcclMoveTest, AllToAllVHonoursDisplacements) {
  const DType dtype = GetParam();
  const int64_t send_total = 40, recv_total = 50, n = 25, send_displ = 9, recv_displ = 17;
  const std::vector<uint8_t> input = Values(dtype, send_total, 5);
  DevicePtr send = ToDevice(input);
  DevicePtr recv = ToDevice(Sentinel(recv_total, dtype));
  ASSERT_NE(send, nullptr);
  ASSERT_NE(recv, nullptr);
  const int64_t counts[] = {n}, send_displs[] = {send_displ}, recv_displs[] = {recv_displ};
  ASSERT_TRUE(
      world()
          .AllToAllV(send.get(), counts, send_displs, recv.get(), counts, recv_displs, dtype)
          .ok());
  // Reference: elements [send_displ, send_displ + n) land at [recv_displ, recv_displ + n).
  std::vector<uint8_t> expected = Sentinel(recv_total, dtype);
  const int64_t elem = Communicator::Bytes(1, dtype);
  std::memcpy(expected.data() + recv_displ * elem, input.data() + send_displ * elem,
              static_cast<size_t>(n * elem));
  EXPECT_EQ(ToHost(recv, expected.size()), expected);
  EXPECT_EQ(world().stats().Bytes(CollectiveOp::kAllToAllV, dtype), Communicator::Bytes(n, dtype));
  // Stream-ordered (MoE's tokens): the same bytes, read through a copy on the default stream.
  DevicePtr queued = ToDevice(Sentinel(recv_total, dtype));
  ASSERT_NE(queued, nullptr);
  ASSERT_TRUE(world()
                  .AllToAllV(send.get(), counts, send_displs, queued.get(), counts, recv_displs,
                             dtype, Completion::kStream)
                  .ok());
  EXPECT_EQ(ToHost(queued, expected.size()), expected);
  EXPECT_TRUE(world().CheckStreamOrdered().ok());
  EXPECT_EQ(world().stats().Bytes(CollectiveOp::kAllToAllV, dtype),
            2 * Communicator::Bytes(n, dtype));
}

TEST_P(NcclMoveTest, BroadcastFromTheOnlyRankKeepsTheData) {
  const DType dtype = GetParam();
  const int64_t count = 300;
  const std::vector<uint8_t> input = Values(dtype, count, 6);
  DevicePtr buf = ToDevice(input);
  ASSERT_NE(buf, nullptr);
  ASSERT_TRUE(world().Broadcast(buf.get(), count, dtype, /*root=*/0).ok());
  EXPECT_EQ(ToHost(buf, input.size()), input);
  EXPECT_EQ(world().stats().Bytes(CollectiveOp::kBroadcast, dtype),
            Communicator::Bytes(count, dtype));
}

INSTANTIATE_TEST_SUITE_P(AllTypes, NcclMoveTest, ::testing::ValuesIn(kAll),
                         [](const auto& info) { return Name(info.param); });

TEST_F(NcclTest, BroadcastRejectsARootOutsideTheGroup) {
  DevicePtr buf = ToDevice(Values(DType::kF32, 4, 7));
  ASSERT_NE(buf, nullptr);
  EXPECT_EQ(world().Broadcast(buf.get(), 4, DType::kF32, /*root=*/1).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(NcclTest, ZeroElementCollectivesSucceedWithoutBuffers) {
  const int64_t zero[] = {0};
  EXPECT_TRUE(world().AllReduce(nullptr, 0, DType::kF32, ReduceOp::kSum).ok());
  EXPECT_TRUE(world().AllGather(nullptr, 0, nullptr, DType::kBF16).ok());
  EXPECT_TRUE(world().ReduceScatter(nullptr, nullptr, 0, DType::kI32, ReduceOp::kMax).ok());
  EXPECT_TRUE(world().AllToAllV(nullptr, zero, zero, nullptr, zero, zero, DType::kU8).ok());
  EXPECT_TRUE(world().Broadcast(nullptr, 0, DType::kI64, 0).ok());
  EXPECT_TRUE(static_cast<NcclCommunicator&>(world()).health().ok());
}

TEST_F(NcclTest, BarrierCompletesAndIsCounted) {
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(world().Barrier().ok());
  EXPECT_EQ(world().stats().Calls(CollectiveOp::kBarrier, DType::kU8), 3);
  EXPECT_EQ(world().stats().Bytes(CollectiveOp::kBarrier, DType::kU8), 0);
}

TEST_F(NcclTest, ByteCountersAddUpOverASequence) {
  const int64_t count = 64;
  DevicePtr a = ToDevice(Values(DType::kF32, count, 8));
  DevicePtr b = ToDevice(Sentinel(count, DType::kF32));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(world().AllReduce(a.get(), count, DType::kF32, ReduceOp::kSum).ok());
  ASSERT_TRUE(world().AllReduce(a.get(), count, DType::kF32, ReduceOp::kMax).ok());
  ASSERT_TRUE(world().AllGather(a.get(), count, b.get(), DType::kF32).ok());
  ASSERT_TRUE(world().Barrier().ok());
  const CommStats& stats = world().stats();
  EXPECT_EQ(stats.Bytes(CollectiveOp::kAllReduce, DType::kF32), 2 * count * 4);
  EXPECT_EQ(stats.Calls(CollectiveOp::kAllReduce, DType::kF32), 2);
  EXPECT_EQ(stats.Bytes(CollectiveOp::kAllGather, DType::kF32), count * 4);
  EXPECT_EQ(stats.TotalBytes(), 3 * count * 4);
}

// --- subgroups -------------------------------------------------------------------------------

TEST_F(NcclTest, SplitGivesAWorkingOneRankGroup) {
  auto tp = factory_->Split(/*color=*/0, /*key=*/0, "tp");
  ASSERT_TRUE(tp.ok()) << tp.status();
  Communicator& group = **tp;
  EXPECT_EQ(group.name(), "tp");
  EXPECT_EQ(group.rank(), 0);
  EXPECT_EQ(group.size(), 1);
  const std::vector<uint8_t> input = Values(DType::kF32, 128, 9);
  DevicePtr buf = ToDevice(input);
  ASSERT_NE(buf, nullptr);
  ASSERT_TRUE(group.AllReduce(buf.get(), 128, DType::kF32, ReduceOp::kMax).ok());
  EXPECT_EQ(ToHost(buf, input.size()), input);
  // The subgroup counts its own bytes; the world's counters are untouched.
  EXPECT_EQ(group.stats().Bytes(CollectiveOp::kAllReduce, DType::kF32), 128 * 4);
  EXPECT_EQ(world().stats().TotalBytes(), 0);
  // The world still works after the split.
  EXPECT_TRUE(world().Barrier().ok());
}

TEST_F(NcclTest, SplitRejectsNegativeColor) {
  auto group = factory_->Split(-1, 0, "none");
  EXPECT_EQ(group.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(world().Barrier().ok());
}

}  // namespace
}  // namespace fp8rt::parallel
