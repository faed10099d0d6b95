// A rank that fails in a collective gives every rank a clear error, not a hang.
//
// Run under mpirun with 2+ ranks and FP8RT_TEST_FAULT set (e.g. "fail:op=all_reduce:call=2"):
// the last rank injects the fault; every rank prints one line "rank R: <status>" and the job
// then aborts (a timed-out collective leaves MPI unusable, as a real failure would). ctest checks
// the lines: the faulty rank reports the injected error, the others DEADLINE_EXCEEDED naming
// the op and group, all within the test's timeout.
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "parallel/fault_injection.h"
#include "parallel/mpi/mpi_communicator.h"

int main(int argc, char** argv) {
  using namespace fp8rt::parallel;
  if (!InitMpi(&argc, &argv).ok()) return 1;
  auto factory = MpiCommunicatorFactory::Create({.timeout = std::chrono::milliseconds(3000)});
  if (!factory.ok()) return 1;
  Communicator& world = (*factory)->World();
  const char* spec = std::getenv("FP8RT_TEST_FAULT");
  std::vector<CommFault> faults;
  if (world.rank() == world.size() - 1 && spec != nullptr) {
    auto f = ParseCommFault(spec);
    if (!f.ok()) {
      std::printf("rank %d: UNEXPECTED bad fault spec: %s\n", world.rank(),
                  std::string(f.status().message()).c_str());
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
    faults.push_back(*f);
  }
  if (std::getenv("FP8RT_TEST_STARTED_GATHER") != nullptr) {
    // A started (nonblocking) all-gather whose last rank never joins: the others' Wait returns
    // DEADLINE_EXCEEDED naming the op and group, within the timeout counted from the start.
    absl::Status status;
    if (world.rank() != world.size() - 1) {
      float mine = 1.0f;
      std::vector<float> all(static_cast<size_t>(world.size()));
      auto started = world.StartAllGather(&mine, 1, all.data(), DType::kF32);
      status = started.ok() ? (*started)->Wait() : started.status();
    }
    std::printf("rank %d: started gather: %s\n", world.rank(), status.ToString().c_str());
    std::fflush(stdout);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Abort(MPI_COMM_WORLD, status.ok() ? 0 : 3);
  }
  FaultInjectingCommunicator comm(world, faults);
  absl::Status status;
  for (int step = 1; step <= 3 && status.ok(); ++step) {
    float v = 1.0f;
    status = comm.AllReduce(&v, 1, DType::kF32, ReduceOp::kSum);
    if (status.ok() && v != static_cast<float>(world.size())) {
      std::printf("rank %d: UNEXPECTED sum %g\n", world.rank(), v);
    }
  }
  std::printf("rank %d: %s\n", world.rank(), status.ToString().c_str());
  std::fflush(stdout);
  MPI_Barrier(MPI_COMM_WORLD);  // the faulty rank was never in the pending all-reduce
  MPI_Abort(MPI_COMM_WORLD, status.ok() ? 0 : 3);
  return 0;
}
