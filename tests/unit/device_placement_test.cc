// CudaDeviceForRank: one GPU per rank of a host, and a clear refusal (naming both counts and what
// to do) when a host starts more ranks than it has GPUs, instead of NCCL's failure inside
// ncclCommInitRank (issue 23).
#include "runtime/worker/device_placement.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fp8rt::worker {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(CudaDeviceForRankTest, EachRankOfAHostGetsItsOwnGpu) {
  for (int rank = 0; rank < 8; ++rank) {
    absl::StatusOr<int> device = CudaDeviceForRank(rank, 8, 8);
    ASSERT_TRUE(device.ok()) << device.status();
    EXPECT_EQ(*device, rank);
  }
  absl::StatusOr<int> device = CudaDeviceForRank(1, 2, 8);  // fewer ranks than GPUs
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_EQ(*device, 1);
}

TEST(CudaDeviceForRankTest, MoreRanksThanGpusIsRefusedOnEveryRank) {
  for (int rank = 0; rank < 3; ++rank) {  // rank 0 has a GPU, but the host is refused as a whole
    absl::StatusOr<int> device = CudaDeviceForRank(rank, 3, 2);
    ASSERT_FALSE(device.ok());
    EXPECT_EQ(device.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(device.status().message()),
                AllOf(HasSubstr("3 ranks on this host but 2 CUDA device(s)"),
                      HasSubstr("one GPU per rank"), HasSubstr("ppr:2:node")));
  }
}

TEST(CudaDeviceForRankTest, ARankOutsideTheHostIsAnError) {
  EXPECT_EQ(CudaDeviceForRank(-1, 2, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaDeviceForRank(2, 2, 4).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fp8rt::worker
