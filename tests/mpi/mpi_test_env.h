// The environment shared by the MPI test executables (tests/mpi/): mpi_test_main.cc initialises
// MPI, creates one MpiCommunicatorFactory for the whole run and exposes it here.
//
// Every test in these executables runs on every rank, and the collectives inside a test must be
// called in the same order on all of them. A test should therefore use EXPECT_* (not ASSERT_*)
// for checks that can fail on one rank only, so that no rank leaves a test early while its peers
// wait in a collective (they would fail after the communicator timeout of 20 s, and the world
// communicator is unusable after that). AllRanksOk() turns a local verdict into a collective one.
#ifndef FP8RT_TESTS_MPI_MPI_TEST_ENV_H_
#define FP8RT_TESTS_MPI_MPI_TEST_ENV_H_

#include "parallel/communicator.h"

namespace fp8rt::parallel::testing {

// The factory of this run (world = MPI_COMM_WORLD's duplicate). Valid while tests run.
CommunicatorFactory& Factory();

// True on every rank iff `ok` is true on every rank of the world. Collective over the world
// (an MPI_Allreduce on MPI_COMM_WORLD, outside the communicators under test).
bool AllRanksOk(bool ok);

}  // namespace fp8rt::parallel::testing

#endif  // FP8RT_TESTS_MPI_MPI_TEST_ENV_H_
