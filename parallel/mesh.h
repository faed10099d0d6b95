// Mesh: how the ranks of a job are arranged, and the process groups that follow.
//
//   world = dp x tp, TP innermost: rank = dp_rank * tp + tp_rank.
//   tp group   ranks with the same dp_rank (size tp): tensor-parallel layers, amax sync.
//   dp group   ranks with the same tp_rank (size dp): FSDP gathers, gradient reduce-scatter.
//   ep group   `ep` consecutive DP ranks with the same tp_rank (size ep): MoE all-to-all.
//   edp group  DP ranks with the same tp_rank and the same position inside their ep group
//              (size dp / ep): reduction of expert gradients.
//
// MeshLayout is pure arithmetic (no communication) and is what tests and the bench check;
// Mesh additionally owns the communicators built from a CommunicatorFactory.
#ifndef FP8RT_PARALLEL_MESH_H_
#define FP8RT_PARALLEL_MESH_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"

namespace fp8rt::parallel {

struct MeshConfig {
  int dp = 1;  // data-parallel (FSDP) size
  int tp = 1;  // tensor-parallel size
  int ep = 1;  // expert-parallel size, a divisor of dp
};

// Rank arithmetic of one rank in a mesh.
struct MeshLayout {
  MeshConfig config;
  int world_size = 1;
  int rank = 0;
  int dp_rank = 0;
  int tp_rank = 0;
  int ep_rank = 0;   // position inside the ep group
  int edp_rank = 0;  // position inside the expert-data-parallel group

  // InvalidArgument naming the field when dp * tp != world_size, ep does not divide dp, a size
  // is < 1, or rank is out of range.
  static absl::StatusOr<MeshLayout> Create(const MeshConfig& config, int world_size, int rank);

  // World ranks of this rank's groups, in group order.
  std::vector<int> TpGroup() const;
  std::vector<int> DpGroup() const;
  std::vector<int> EpGroup() const;
  std::vector<int> EdpGroup() const;
};

// The communicators of one rank.
class Mesh {
 public:
  // Collective over the factory's world: every rank must call it with the same config.
  static absl::StatusOr<std::unique_ptr<Mesh>> Create(const MeshConfig& config,
                                                      CommunicatorFactory& factory);

  const MeshLayout& layout() const { return layout_; }
  Communicator& world() { return *world_; }
  Communicator& tp() { return *tp_; }
  Communicator& dp() { return *dp_; }
  Communicator& ep() { return *ep_; }
  Communicator& edp() { return *edp_; }

 private:
  Mesh() = default;
  MeshLayout layout_;
  Communicator* world_ = nullptr;  // owned by the factory
  std::unique_ptr<Communicator> tp_, dp_, ep_, edp_;
};

}  // namespace fp8rt::parallel

#endif  // FP8RT_PARALLEL_MESH_H_
