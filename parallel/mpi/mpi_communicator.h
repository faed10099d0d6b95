// The MPI backend of Communicator (Open MPI, CPU ranks).
//
// Collectives run as nonblocking MPI calls polled until they complete or until the group's
// timeout passes; then the call returns DeadlineExceeded naming the op and group (a peer died or
// hangs) instead of blocking forever, and the communicator refuses further calls. BF16 sums add
// in FP32 and round once per reduction step (a user-defined MPI_Op, as NCCL does); float MAX
// propagates NaN. The caller initialises MPI (MPI_Init_thread) before creating the factory and
// finalizes it after destroying every communicator.
#ifndef FP8RT_PARALLEL_MPI_MPI_COMMUNICATOR_H_
#define FP8RT_PARALLEL_MPI_MPI_COMMUNICATOR_H_

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"

namespace fp8rt::parallel {

// Where a rank sits among the ranks of its own host: what a rank needs to pick its GPU.
struct HostRanks {
  int world_rank = 0;            // this rank
  std::vector<int> world_ranks;  // the world ranks of this host's ranks, ascending (this one too)
  // This rank's place among them, 0 .. local_size() - 1.
  int local_rank() const {
    return static_cast<int>(std::count_if(world_ranks.begin(), world_ranks.end(),
                                          [&](int r) { return r < world_rank; }));
  }
  int local_size() const { return static_cast<int>(world_ranks.size()); }  // ranks on this host
};

struct MpiOptions {
  // A collective that has not completed after this long fails with DeadlineExceeded.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

class MpiCommunicatorFactory : public CommunicatorFactory {
 public:
  // Wraps a duplicate of MPI_COMM_WORLD as the world group ("world"). MPI must be initialised.
  static absl::StatusOr<std::unique_ptr<MpiCommunicatorFactory>> Create(
      const MpiOptions& options = {});
  ~MpiCommunicatorFactory() override;

  Communicator& World() override { return *world_; }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                      std::string name) override;

  // This rank's place on its host, from MPI itself (the ranks whose MPI processor name, the host
  // name, is this rank's, in world-rank order; gathered over the world group, within its
  // timeout) rather than from one launcher's environment (OMPI_COMM_WORLD_LOCAL_RANK is Open
  // MPI's; Kubernetes operators and other MPIs set others or none). Collective over the world:
  // every rank calls it, at the same point.
  absl::StatusOr<HostRanks> RanksOnThisHost();

 private:
  MpiCommunicatorFactory() = default;
  MpiOptions options_;
  std::unique_ptr<Communicator> world_;
};

// Initialises MPI for a process that uses fp8rt's MPI backend (MPI_THREAD_FUNNELED: only the
// thread that initialised MPI calls it) unless it already is; FailedPrecondition when the
// library cannot give that level. Returns the world size.
absl::StatusOr<int> InitMpi(int* argc, char*** argv);
// Finalizes MPI if InitMpi initialised it (call it after destroying every communicator).
void FinalizeMpi();
// Tears the whole job down (MPI_Abort on MPI_COMM_WORLD) with `code`: for a rank that fails while
// its peers may be waiting in a collective. Does not return. With a `grace` > 0 it first waits, up
// to `grace`, for every rank to reach AbortMpi as well (a non-blocking barrier on MPI_COMM_WORLD,
// which fp8rt's communicators never use: they work on duplicates), so that ranks failing on one
// agreed verdict have all reported it before the job goes; a rank failing alone waits the grace.
// Flush what must be seen before calling it.
[[noreturn]] void AbortMpi(int code,
                           std::chrono::milliseconds grace = std::chrono::milliseconds(0));

}  // namespace fp8rt::parallel

#endif  // FP8RT_PARALLEL_MPI_MPI_COMMUNICATOR_H_
