#include "parallel/mesh.h"

#include "absl/strings/str_cat.h"
#include "runtime/core/status.h"

namespace fp8rt::parallel {

absl::StatusOr<MeshLayout> MeshLayout::Create(const MeshConfig& config, int world_size, int rank) {
  if (config.dp < 1)
    return absl::InvalidArgumentError(absl::StrCat("parallel.dp must be >= 1, got ", config.dp));
  if (config.tp < 1)
    return absl::InvalidArgumentError(absl::StrCat("parallel.tp must be >= 1, got ", config.tp));
  if (config.ep < 1)
    return absl::InvalidArgumentError(absl::StrCat("parallel.ep must be >= 1, got ", config.ep));
  if (config.dp * config.tp != world_size) {
    return absl::InvalidArgumentError(absl::StrCat("parallel.dp * parallel.tp = ", config.dp, " * ",
                                                   config.tp, " = ", config.dp * config.tp,
                                                   ", but the job has ", world_size, " ranks"));
  }
  if (config.dp % config.ep != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.ep (", config.ep, ") must divide parallel.dp (", config.dp, ")"));
  }
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside a world of ", world_size));
  }
  MeshLayout l;
  l.config = config;
  l.world_size = world_size;
  l.rank = rank;
  l.dp_rank = rank / config.tp;
  l.tp_rank = rank % config.tp;
  l.ep_rank = l.dp_rank % config.ep;
  l.edp_rank = l.dp_rank / config.ep;
  return l;
}

std::vector<int> MeshLayout::TpGroup() const {
  std::vector<int> ranks;
  for (int t = 0; t < config.tp; ++t) ranks.push_back(dp_rank * config.tp + t);
  return ranks;
}

std::vector<int> MeshLayout::DpGroup() const {
  std::vector<int> ranks;
  for (int d = 0; d < config.dp; ++d) ranks.push_back(d * config.tp + tp_rank);
  return ranks;
}

std::vector<int> MeshLayout::EpGroup() const {
  std::vector<int> ranks;
  const int first = (dp_rank / config.ep) * config.ep;
  for (int e = 0; e < config.ep; ++e) ranks.push_back((first + e) * config.tp + tp_rank);
  return ranks;
}

std::vector<int> MeshLayout::EdpGroup() const {
  std::vector<int> ranks;
  for (int g = 0; g < config.dp / config.ep; ++g) {
    ranks.push_back((g * config.ep + ep_rank) * config.tp + tp_rank);
  }
  return ranks;
}

absl::StatusOr<std::unique_ptr<Mesh>> Mesh::Create(const MeshConfig& config,
                                                   CommunicatorFactory& factory) {
  Communicator& world = factory.World();
  FP8RT_ASSIGN_OR_RETURN(MeshLayout layout, MeshLayout::Create(config, world.size(), world.rank()));
  std::unique_ptr<Mesh> mesh(new Mesh());
  mesh->layout_ = layout;
  mesh->world_ = &world;
  // Colors identify the group; keys order ranks inside it (the group index of the rank).
  const int tp = config.tp, ep = config.ep;
  FP8RT_ASSIGN_OR_RETURN(mesh->tp_, factory.Split(layout.dp_rank, layout.tp_rank, "tp"));
  FP8RT_ASSIGN_OR_RETURN(mesh->dp_, factory.Split(layout.tp_rank, layout.dp_rank, "dp"));
  FP8RT_ASSIGN_OR_RETURN(
      mesh->ep_, factory.Split((layout.dp_rank / ep) * tp + layout.tp_rank, layout.ep_rank, "ep"));
  FP8RT_ASSIGN_OR_RETURN(
      mesh->edp_, factory.Split(layout.ep_rank * tp + layout.tp_rank, layout.edp_rank, "edp"));
  return mesh;
}

}  // namespace fp8rt::parallel
