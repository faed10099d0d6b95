// gtest main of the MPI test executables (run under mpirun): initialises MPI, creates the
// communicator factory shared by every test (tests/mpi/mpi_test_env.h), runs the tests on every
// rank and exits 1 on every rank if any rank failed.
//
// Output: rank 0 prints gtest's usual report. The other ranks print only their failures, each
// line prefixed with "[rank r]", so that a failure seen on one rank only is still visible.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "parallel/mpi/mpi_communicator.h"
#include "tests/mpi/mpi_test_env.h"

namespace fp8rt::parallel::testing {
namespace {

std::unique_ptr<MpiCommunicatorFactory>& FactoryPtr() {
  static std::unique_ptr<MpiCommunicatorFactory> factory;
  return factory;
}

// The listener of ranks other than 0: failed assertions and failed tests, tagged with the rank.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() != nullptr ? result.file_name() : "unknown",
                 result.line_number(), result.message());
    std::fflush(stderr);
  }

  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.result()->Failed()) return;
    std::fprintf(stderr, "[rank %d] [  FAILED  ] %s.%s\n", rank_, info.test_suite_name(),
                 info.name());
    std::fflush(stderr);
  }

 private:
  const int rank_;
};

}  // namespace

CommunicatorFactory& Factory() { return *FactoryPtr(); }

bool AllRanksOk(bool ok) {
  int local = ok ? 1 : 0, all = 0;
  MPI_Allreduce(&local, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

}  // namespace fp8rt::parallel::testing

int main(int argc, char** argv) {
  namespace par = fp8rt::parallel;
  namespace env = fp8rt::parallel::testing;
  absl::StatusOr<int> world_size = par::InitMpi(&argc, &argv);
  if (!world_size.ok()) {
    std::fprintf(stderr, "InitMpi failed: %s\n",
                 std::string(world_size.status().message()).c_str());
    return 1;
  }
  // mpirun's output forwarding looks like a terminal to gtest: no colour codes in the logs
  // unless asked for (--gtest_color=yes).
  GTEST_FLAG_SET(color, "no");
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);

  par::MpiOptions options;
  options.timeout = std::chrono::seconds(20);
  absl::StatusOr<std::unique_ptr<par::MpiCommunicatorFactory>> factory =
      par::MpiCommunicatorFactory::Create(options);
  if (!factory.ok()) {
    std::fprintf(stderr, "[rank %d] MpiCommunicatorFactory::Create failed: %s\n", rank,
                 std::string(factory.status().message()).c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
  env::FactoryPtr() = *std::move(factory);

  if (rank != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new env::RankFailurePrinter(rank));
  }
  if (rank == 0) std::printf("Running on %d MPI ranks\n", *world_size);

  const int local_failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&local_failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any_failed && !local_failed) {
    std::printf("Rank 0 passed, but another rank failed (see the [rank r] lines)\n");
  }

  env::FactoryPtr().reset();
  par::FinalizeMpi();
  return any_failed ? 1 : 0;
}
