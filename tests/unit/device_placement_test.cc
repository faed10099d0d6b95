// CudaDeviceForRank and CheckOneRankPerGpu: one GPU per rank of a host, whether every rank sees
// all of the host's GPUs or a launcher gives each rank its own through CUDA_VISIBLE_DEVICES, and a
// clear refusal (naming the ranks, the GPU and what to do) when two ranks of a host would share a
// GPU, instead of NCCL's failure inside ncclCommInitRank (issue 23). The bus ids below are what
// cudaDeviceGetPCIBusId writes; each case says which GPUs the ranks see.
#include "runtime/worker/device_placement.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fp8rt::worker {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(CudaDeviceForRankTest, EachRankOfAHostTakesItsOwnOrdinal) {
  for (int rank = 0; rank < 8; ++rank) {
    absl::StatusOr<int> device = CudaDeviceForRank(rank, 8, 8);
    ASSERT_TRUE(device.ok()) << device.status();
    EXPECT_EQ(*device, rank);
  }
  absl::StatusOr<int> device = CudaDeviceForRank(1, 2, 8);  // fewer ranks than GPUs
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_EQ(*device, 1);
}

TEST(CudaDeviceForRankTest, RanksThatSeeFewerGpusThanTheHostHasRanksWrapAround) {
  // 8 ranks, each seeing only its own GPU (CUDA_VISIBLE_DEVICES per rank): ordinal 0 each.
  for (int rank = 0; rank < 8; ++rank) EXPECT_EQ(CudaDeviceForRank(rank, 8, 1).value(), 0);
  // 4 ranks, each seeing two GPUs of its own: ordinals 0, 1, 0, 1.
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(CudaDeviceForRank(rank, 4, 2).value(), rank % 2);
}

TEST(CudaDeviceForRankTest, ARankOutsideTheHostOrNoDeviceIsAnError) {
  EXPECT_EQ(CudaDeviceForRank(-1, 2, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaDeviceForRank(2, 2, 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaDeviceForRank(0, 2, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// Two hosts of 3 ranks each: world ranks 0-2 on the first, 3-5 on the second. `host_of`: the
// rank whose host it is (the rank itself unless a case needs a rank outside its host's list).
parallel::HostRanks HostOf(int world_rank, int host_of = -1) {
  if (host_of < 0) host_of = world_rank;
  return {.world_rank = world_rank,
          .world_ranks = host_of < 3 ? std::vector<int>{0, 1, 2} : std::vector<int>{3, 4, 5}};
}

TEST(CheckOneRankPerGpuTest, DistinctGpusOnEachHostPassEvenWhenHostsRepeatBusIds) {
  // Both hosts have the same three bus ids: the same ids on two hosts are two GPUs.
  const std::vector<std::string> ids = {"0000:18:00.0", "0000:3B:00.0", "0000:86:00.0",
                                        "0000:18:00.0", "0000:3B:00.0", "0000:86:00.0"};
  for (int r = 0; r < 6; ++r) {
    EXPECT_TRUE(CheckOneRankPerGpu(ids, HostOf(r), 1, 0).ok()) << r;      // each sees its own
    EXPECT_TRUE(CheckOneRankPerGpu(ids, HostOf(r), 3, r % 3).ok()) << r;  // each sees all three
  }
}

TEST(CheckOneRankPerGpuTest, MoreRanksThanGpusIsRefusedOnTheRanksThatShare) {
  // Every rank of the first host sees the same two GPUs; ranks 0 and 2 took ordinal 0.
  const std::vector<std::string> ids = {"0000:18:00.0", "0000:3B:00.0", "0000:18:00.0",
                                        "0000:18:00.0", "0000:3B:00.0", "0000:86:00.0"};
  for (int r : {0, 2}) {
    const absl::Status s = CheckOneRankPerGpu(ids, HostOf(r), 2, 0);
    ASSERT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << r;
    EXPECT_THAT(std::string(s.message()),
                AllOf(HasSubstr("world ranks 0, 2 of one host would share the GPU at PCI "
                                "0000:18:00.0"),
                      HasSubstr("3 ranks on this host; world rank " + std::to_string(r) +
                                " sees 2 CUDA device(s) and took device 0"),
                      HasSubstr("one GPU per rank"), HasSubstr("ppr:2:node"),
                      HasSubstr("CUDA_VISIBLE_DEVICES")));
  }
  EXPECT_TRUE(CheckOneRankPerGpu(ids, HostOf(1), 2, 1).ok());
  // Rank 3 has the first host's 0000:18:00.0 too, but on its own host nobody else does.
  EXPECT_TRUE(CheckOneRankPerGpu(ids, HostOf(3), 3, 0).ok());
}

TEST(CheckOneRankPerGpuTest, RanksSeeingTheGpusInDifferentOrdersAreTold) {
  // Each rank of the first host sees all three GPUs, but rank 2's CUDA_VISIBLE_DEVICES lists them
  // in another order: its ordinal 2 is the GPU rank 0 took as its ordinal 0.
  const std::vector<std::string> ids = {"0000:18:00.0", "0000:3B:00.0", "0000:18:00.0",
                                        "0000:18:00.0", "0000:3B:00.0", "0000:86:00.0"};
  const absl::Status s = CheckOneRankPerGpu(ids, HostOf(2), 3, 2);
  ASSERT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("world ranks 0, 2 of one host"), HasSubstr("different orders"),
                    Not(HasSubstr("ppr:"))));
}

TEST(CheckOneRankPerGpuTest, ARankWithoutAGpuSharesWithNobody) {
  // Ranks 0 and 1 found no device (empty id): neither collides with the other.
  const std::vector<std::string> ids = {"", "", "0000:18:00.0", "", "", ""};
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(CheckOneRankPerGpu(ids, HostOf(r), 1, 0).ok()) << r;
}

TEST(CheckOneRankPerGpuTest, ARankWithoutABusIdIsAnError) {
  const std::vector<std::string> ids = {"0000:18:00.0", "0000:3B:00.0", "0000:86:00.0"};
  // This rank, or a rank of its host, beyond the gathered ids (the host's ranks are 3, 4, 5).
  EXPECT_EQ(CheckOneRankPerGpu(ids, HostOf(6, 0), 1, 0).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status s = CheckOneRankPerGpu(ids, HostOf(0, 3), 1, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("world rank 3 of this host has no bus id"));
}

}  // namespace
}  // namespace fp8rt::worker
