#include "runtime/worker/device_placement.h"

#include "absl/strings/str_cat.h"

namespace fp8rt::worker {

absl::StatusOr<int> CudaDeviceForRank(int local_rank, int local_size, int device_count) {
  if (local_rank < 0 || local_rank >= local_size) {
    return absl::InvalidArgumentError(absl::StrCat("local rank ", local_rank, " of ", local_size,
                                                   " ranks on this host is out of range"));
  }
  if (local_size > device_count) {
    return absl::FailedPreconditionError(absl::StrCat(
        local_size, " ranks on this host but ", device_count,
        " CUDA device(s): device: cuda needs one GPU per rank (start at most ", device_count,
        " ranks per host: fewer --np, or mpirun --map-by ppr:", device_count, ":node)"));
  }
  return local_rank;
}

}  // namespace fp8rt::worker
