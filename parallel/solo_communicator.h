// A one-rank world in host memory, for single-process runs without MPI: the CPU side of the
// GPU training test, `fp8rt bench step --device cuda` on a one-GPU machine, and the bootstrap
// of a one-rank NCCL world (NcclCommunicatorFactory::Create). Reductions over one rank are the
// identity; gathers, reduce-scatters and all-to-all copy (memmove, so in-place calls are fine).
//
// Buffers are host memory (or CUDA managed memory, which the host can read once the stream that
// wrote it has been synchronised). Thread-compatible like every Communicator.
#ifndef FP8RT_PARALLEL_SOLO_COMMUNICATOR_H_
#define FP8RT_PARALLEL_SOLO_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "parallel/communicator.h"

namespace fp8rt::parallel {

class SoloCommunicator : public Communicator {
 public:
  explicit SoloCommunicator(std::string name = "world") : Communicator(std::move(name), 0, 1) {}

 protected:
  absl::Status DoAllReduce(void* buf, int64_t count, DType dtype, ReduceOp op) override;
  absl::Status DoAllGather(const void* send, int64_t count, void* recv, DType dtype) override;
  absl::Status DoReduceScatter(const void* send, void* recv, int64_t recv_count, DType dtype,
                               ReduceOp op) override;
  absl::Status DoAllToAllV(const void* send, std::span<const int64_t> send_counts,
                           std::span<const int64_t> send_displs, void* recv,
                           std::span<const int64_t> recv_counts,
                           std::span<const int64_t> recv_displs, DType dtype) override;
  absl::Status DoBroadcast(void* buf, int64_t count, DType dtype, int root) override;
  absl::Status DoBarrier() override;
};

// The world and every split of it are SoloCommunicators (the only color has the only rank).
class SoloCommunicatorFactory : public CommunicatorFactory {
 public:
  Communicator& World() override { return world_; }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                      std::string name) override;

 private:
  SoloCommunicator world_;
};

}  // namespace fp8rt::parallel

#endif  // FP8RT_PARALLEL_SOLO_COMMUNICATOR_H_
