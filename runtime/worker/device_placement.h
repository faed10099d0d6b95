// Which CUDA device a rank trains on (device: cuda).
//
//   CudaDeviceForRank   a host's rank -> the ordinal it takes among the devices it sees
//   CheckOneRankPerGpu  no two ranks of a host on one GPU (by PCI bus id), else what to do
//   CudaDeviceQuery     what a rank learns of its devices: SystemCudaDevices (CUDA's) or a test's
//   PickCudaDevice      all of it, for this rank, over the world group (the bus ids are gathered)
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "parallel/mpi/mpi_communicator.h"

namespace fp8rt::worker {

// The ordinal that the rank `local_rank` of `local_size` ranks on its host takes among the
// `device_count` CUDA devices it sees: its local rank when the host's ranks do not outnumber them
// (every rank sees the host's GPUs and takes its own), else local_rank % device_count (a launcher
// that gives each rank its own GPUs through CUDA_VISIBLE_DEVICES, fewer than the host's ranks; or
// too many ranks, which CheckOneRankPerGpu refuses). InvalidArgument for a local rank outside
// [0, local_size) or no device.
absl::StatusOr<int> CudaDeviceForRank(int local_rank, int local_size, int device_count);

// NCCL refuses two ranks of one communicator on one GPU, but only inside ncclCommInitRank, much
// later and less clearly: so this rank (`host.world_rank`) is refused here when another rank of
// its host took the same GPU; the message names the world ranks that share it and
// says what to do instead. `bus_ids`: every world rank's GPU as its PCI bus id (empty for a rank
// that found none). `device_count`, `device`: what this rank sees and took, for the message.
// Ranks of other hosts may share a bus id. InvalidArgument for a rank without a bus id.
absl::Status CheckOneRankPerGpu(const std::vector<std::string>& bus_ids,
                                const parallel::HostRanks& host, int device_count, int device);

// What a rank can learn of the CUDA devices it sees: the CUDA backend's (SystemCudaDevices) or a
// test's.
struct CudaDeviceQuery {
  std::function<int(std::string* why)> count;    // visible devices; 0 with `why` when none
  std::function<absl::Status(int ordinal)> use;  // make it this thread's device
  std::function<absl::StatusOr<std::string>(int ordinal)> pci_bus_id;
};
const CudaDeviceQuery& SystemCudaDevices();

// This rank's CUDA device, made current (`devices.use`, only once the check passed), or why it has
// none: the errors of `host`, of the device query, of CudaDeviceForRank and of CheckOneRankPerGpu.
// Collective over `world` (an all-gather of the ranks' bus ids, within its timeout): every rank
// calls it, even one whose `host` is an error, so that the ranks stay in step for the verdict the
// caller agrees on.
absl::StatusOr<int> PickCudaDevice(parallel::Communicator& world,
                                   const absl::StatusOr<parallel::HostRanks>& host,
                                   const CudaDeviceQuery& devices);

}  // namespace fp8rt::worker
