// PickCudaDevice (how a device: cuda rank picks its GPU) under mpirun with 2 and 4 ranks, with
// fake devices standing in for CUDA (this machine has no GPU): each case gives every rank the
// devices a launcher would let it see, as PCI bus ids, and checks what each rank is given or told.
// The expected result of each rank is derived from the case's description (which GPUs each rank
// sees), not from the code under test; every case runs on every rank (the pick is collective).
#include <cstdio>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "parallel/mpi/mpi_communicator.h"
#include "runtime/worker/device_placement.h"
#include "tests/mpi/mpi_test_env.h"

namespace fp8rt::worker {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

parallel::Communicator& World() { return parallel::testing::Factory().World(); }

absl::StatusOr<parallel::HostRanks> RanksOnThisHost() {
  auto* mpi = dynamic_cast<parallel::MpiCommunicatorFactory*>(&parallel::testing::Factory());
  if (mpi == nullptr) return absl::InternalError("not the MPI factory");
  return mpi->RanksOnThisHost();
}

std::string BusId(int gpu) {  // the host's GPU number `gpu` as cudaDeviceGetPCIBusId names it
  char id[16];
  std::snprintf(id, sizeof(id), "0000:%02X:00.0", 0x18 + gpu);
  return id;
}

// A rank that sees the host's GPUs `visible` (CUDA_VISIBLE_DEVICES=visible[0],visible[1],...);
// `used` records the ordinal made current.
struct FakeDevices {
  std::vector<int> visible;
  int used = -1;
  CudaDeviceQuery Query() {
    return {.count =
                [this](std::string* why) {
                  if (visible.empty()) *why = "fake: none visible";
                  return static_cast<int>(visible.size());
                },
            .use =
                [this](int ordinal) {
                  used = ordinal;
                  return absl::OkStatus();
                },
            .pci_bus_id = [this](int ordinal) -> absl::StatusOr<std::string> {
              return BusId(visible.at(static_cast<size_t>(ordinal)));
            }};
  }
};

TEST(PickCudaDeviceTest, EveryRankSeeingTheHostsGpusTakesItsLocalRank) {
  absl::StatusOr<parallel::HostRanks> host = RanksOnThisHost();
  ASSERT_TRUE(parallel::testing::AllRanksOk(host.ok())) << host.status();
  FakeDevices fake{.visible = {}};
  for (int g = 0; g < host->local_size(); ++g) fake.visible.push_back(g);
  const absl::StatusOr<int> device = PickCudaDevice(World(), host, fake.Query());
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_EQ(*device, host->local_rank());
  EXPECT_EQ(fake.used, host->local_rank());
}

TEST(PickCudaDeviceTest, EachRankWithAGpuOfItsOwnTakesOrdinalZero) {
  // The launcher gives each rank its own GPU (CUDA_VISIBLE_DEVICES per rank): one device each.
  absl::StatusOr<parallel::HostRanks> host = RanksOnThisHost();
  ASSERT_TRUE(parallel::testing::AllRanksOk(host.ok())) << host.status();
  FakeDevices fake{.visible = {host->local_rank()}};
  const absl::StatusOr<int> device = PickCudaDevice(World(), host, fake.Query());
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_EQ(*device, 0);
  EXPECT_EQ(fake.used, 0);
}

TEST(PickCudaDeviceTest, RanksSharingOneGpuAreAllRefused) {
  // Every rank sees the same single GPU: more ranks on the host than GPUs.
  absl::StatusOr<parallel::HostRanks> host = RanksOnThisHost();
  ASSERT_TRUE(parallel::testing::AllRanksOk(host.ok())) << host.status();
  ASSERT_GE(host->local_size(), 2);  // mpirun starts every rank of this test on this machine
  FakeDevices fake{.visible = {0}};
  const absl::StatusOr<int> device = PickCudaDevice(World(), host, fake.Query());
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(device.status().message()),
              AllOf(HasSubstr("would share the GPU at PCI " + BusId(0)), HasSubstr("ppr:1:node")));
  EXPECT_EQ(fake.used, -1) << "a refused rank made the GPU current";
}

TEST(PickCudaDeviceTest, GpusListedInAnotherOrderOnOneRankAreCaught) {
  // Every rank sees all the host's GPUs, but the last rank's list is rotated by one: its ordinal
  // (its local rank) names the GPU of the local rank 0, so those two are refused.
  absl::StatusOr<parallel::HostRanks> host = RanksOnThisHost();
  ASSERT_TRUE(parallel::testing::AllRanksOk(host.ok())) << host.status();
  ASSERT_GE(host->local_size(), 2);  // mpirun starts every rank of this test on this machine
  const int n = host->local_size();
  FakeDevices fake{.visible = {}};
  for (int g = 0; g < n; ++g) fake.visible.push_back(host->local_rank() == n - 1 ? (g + 1) % n : g);
  const absl::StatusOr<int> device = PickCudaDevice(World(), host, fake.Query());
  const bool refused = host->local_rank() == 0 || host->local_rank() == n - 1;
  EXPECT_EQ(device.ok(), !refused) << device.status();
  if (refused) {
    EXPECT_THAT(
        std::string(device.status().message()),
        AllOf(HasSubstr("would share the GPU at PCI " + BusId(0)), HasSubstr("different orders")));
  }
}

TEST(PickCudaDeviceTest, ARankWithoutAGpuOrHostFailsAloneAndNobodyHangs) {
  // The last rank sees no device; the one before it has no host ranks (an error from the
  // gather of names). Both still take part in the bus-id gather, so the others finish.
  absl::StatusOr<parallel::HostRanks> host = RanksOnThisHost();
  ASSERT_TRUE(parallel::testing::AllRanksOk(host.ok())) << host.status();
  const int rank = World().rank(), size = World().size();
  FakeDevices fake{.visible = {host->local_rank()}};
  if (rank == size - 1) fake.visible.clear();
  const absl::StatusOr<parallel::HostRanks> given =
      rank == size - 2 ? absl::StatusOr<parallel::HostRanks>(absl::DeadlineExceededError("fake"))
                       : host;
  const absl::StatusOr<int> device = PickCudaDevice(World(), given, fake.Query());
  if (rank == size - 1) {
    EXPECT_EQ(device.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(std::string(device.status().message()), HasSubstr("fake: none visible"));
  } else if (rank == size - 2) {
    EXPECT_EQ(device.status().code(), absl::StatusCode::kDeadlineExceeded);
  } else {
    EXPECT_TRUE(device.ok()) << device.status();
  }
  EXPECT_EQ(fake.used, rank >= size - 2 ? -1 : 0);
}

TEST(PickCudaDeviceTest, TheSameBusIdOnTwoHostsIsTwoGpus) {
  // The world as two hosts of equal halves, each rank seeing its own host's GPU number `local
  // rank`: the halves repeat each other's bus ids, and nobody is refused.
  const int rank = World().rank(), half = World().size() / 2;
  parallel::HostRanks host{.world_rank = rank, .world_ranks = {}};
  for (int r = 0; r < World().size(); ++r) {
    if ((r < half) == (rank < half)) host.world_ranks.push_back(r);
  }
  FakeDevices fake{.visible = {host.local_rank()}};
  const absl::StatusOr<int> device = PickCudaDevice(World(), host, fake.Query());
  EXPECT_TRUE(device.ok()) << device.status();
}

}  // namespace
}  // namespace fp8rt::worker
