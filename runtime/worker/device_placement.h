// Which CUDA device a rank trains on (device: cuda).
//
//   CudaDeviceForRank  a host's rank -> its GPU, or an error when the host runs more ranks
//                      than it has GPUs
#pragma once

#include "absl/status/statusor.h"

namespace fp8rt::worker {

// The device of the rank that is `local_rank` of `local_size` ranks on its host, which has
// `device_count` CUDA devices: one GPU per rank, the local rank's. NCCL refuses two ranks of one
// communicator on one GPU, but only inside ncclCommInitRank, much later and less clearly; so a
// host with more ranks than GPUs is refused here, by every rank of it alike (they all see its
// size), with what to do instead. InvalidArgument for a negative rank or a rank not below the
// size.
absl::StatusOr<int> CudaDeviceForRank(int local_rank, int local_size, int device_count);

}  // namespace fp8rt::worker
