#include "runtime/worker/device_placement.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/ops.h"

namespace fp8rt::worker {

absl::StatusOr<int> CudaDeviceForRank(int local_rank, int local_size, int device_count) {
  if (local_rank < 0 || local_rank >= local_size) {
    return absl::InvalidArgumentError(absl::StrCat("local rank ", local_rank, " of ", local_size,
                                                   " ranks on this host is out of range"));
  }
  if (device_count <= 0) return absl::InvalidArgumentError("no CUDA device to pick from");
  return local_rank % device_count;  // the local rank itself when the devices are enough
}

absl::Status CheckOneRankPerGpu(const std::vector<std::string>& bus_ids,
                                const parallel::HostRanks& host, int device_count, int device) {
  const int world_rank = host.world_rank;
  auto no_bus_id = [&](int r, const char* whose) {
    return absl::InvalidArgumentError(
        absl::StrCat("world rank ", r, whose, " has no bus id (", bus_ids.size(), " gathered)"));
  };
  if (world_rank < 0 || static_cast<size_t>(world_rank) >= bus_ids.size()) {
    return no_bus_id(world_rank, "");
  }
  const std::string& mine = bus_ids[static_cast<size_t>(world_rank)];
  std::vector<int> sharing;  // world ranks, this one included
  for (int r : host.world_ranks) {
    if (r < 0 || static_cast<size_t>(r) >= bus_ids.size()) return no_bus_id(r, " of this host");
    if (!mine.empty() && bus_ids[static_cast<size_t>(r)] == mine) sharing.push_back(r);
  }
  if (sharing.size() < 2) return absl::OkStatus();
  const std::string what = absl::StrCat(
      "world ranks ", absl::StrJoin(sharing, ", "), " of one host would share the GPU at PCI ",
      mine, " (", host.local_size(), " ranks on this host; world rank ", world_rank, " sees ",
      device_count, " CUDA device(s) and took device ", device,
      "): device: cuda needs one GPU per rank");
  if (host.local_size() > device_count) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " (start at most ", device_count,
                     " ranks per host: fewer --np, or mpirun --map-by ppr:", device_count,
                     ":node; or give each rank GPUs of its own through CUDA_VISIBLE_DEVICES)"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      what,
      " (the ranks of this host see their GPUs in different orders: give each the same "
      "CUDA_VISIBLE_DEVICES, or each one GPUs of its own)"));
}

const CudaDeviceQuery& SystemCudaDevices() {
  static const CudaDeviceQuery* devices = new CudaDeviceQuery{
      .count = [](std::string* why) { return kernels::CudaDeviceCount(why); },
      .use = [](int ordinal) { return kernels::UseCudaDevice(ordinal); },
      .pci_bus_id = [](int ordinal) { return kernels::CudaDevicePciBusId(ordinal); }};
  return *devices;
}

absl::StatusOr<int> PickCudaDevice(parallel::Communicator& world,
                                   const absl::StatusOr<parallel::HostRanks>& host,
                                   const CudaDeviceQuery& devices) {
  // This rank's choice and its bus id (which needs no context on the device), then the gather on
  // every rank alike, failed or not, then the check; only then is the device made current, so
  // that two ranks refused for sharing a GPU (or an exclusive-process GPU) get the clear refusal.
  int count = 0;
  std::string bus_id;
  const absl::StatusOr<int> device = [&]() -> absl::StatusOr<int> {
    if (!host.ok()) return host.status();
    std::string why;
    count = devices.count(&why);
    if (count <= 0) return absl::UnavailableError("no CUDA device: " + why);
    absl::StatusOr<int> picked = CudaDeviceForRank(host->local_rank(), host->local_size(), count);
    if (!picked.ok()) return picked.status();
    absl::StatusOr<std::string> id = devices.pci_bus_id(*picked);
    if (!id.ok()) return id.status();
    if (id->empty()) {
      return absl::InternalError(absl::StrCat("CUDA device ", *picked, ": empty PCI bus id"));
    }
    bus_id = *std::move(id);
    return picked;
  }();
  constexpr size_t kBusIdBytes = 64;  // "dddd:bb:dd.f" needs 12
  absl::StatusOr<std::vector<std::string>> bus_ids =
      parallel::AllGatherStrings(world, bus_id, kBusIdBytes);
  if (!device.ok()) return device.status();
  if (!bus_ids.ok()) return bus_ids.status();
  if (absl::Status s = CheckOneRankPerGpu(*bus_ids, *host, count, *device); !s.ok()) {
    return s;
  }
  if (absl::Status s = devices.use(*device); !s.ok()) return s;
  return device;
}

}  // namespace fp8rt::worker
