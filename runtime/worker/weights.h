// Weights in and out of a run: the logical parameters of a committed checkpoint written at any
// layout, Hugging Face safetensors export, init.from, and a one-process CPU model for
// `fp8rt eval` and `fp8rt generate`.
//
// Index:
//   ReadCheckpointWeights  a committed checkpoint's run spec, step and logical parameters,
//                          assembled on one process from every rank's shard
//   OpenShards             every rank's shard of a checkpoint, each read once (or ranged)
//   RangeOf                a shard's TensorRange for a parameter cut by a model::ShardCut
//   ShardTensorRanges      where a shard's tensors lie in the logical tensors (its "ranges"
//                          section, or for older shards its MANIFEST's layout)
//   AssembleLogical        the logical tensors of any section family (master, Adam moments),
//                          all of them or only the elements a rank needs: resharding
//   ExportHuggingFace      DIR/model.safetensors and DIR/config.json (runtime/model/hf_weights.h)
//   LoadHuggingFace        Hugging Face weights (a file, or shards with their index) into a
//                          model's shards (init.from, --weights)
//   SoloModel              the spec's model on one process (CPU ops, FP32 GEMMs), for the
//                          shapes of its parameters and for eval / generate
//
// Errors name the file, the tensor or the parameter. Nothing here is collective except
// LoadHuggingFace, which only touches this rank's shards (every rank maps every file read-only,
// shared in the page cache with the other ranks of its node, and converts one parameter at a
// time).
#ifndef FP8RT_RUNTIME_WORKER_WEIGHTS_H_
#define FP8RT_RUNTIME_WORKER_WEIGHTS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fp8rt/v1/checkpoint.pb.h"
#include "fp8rt/v1/run_spec.pb.h"
#include "parallel/mesh.h"
#include "parallel/solo_communicator.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/model/transformer.h"

namespace fp8rt::worker {

struct CheckpointWeights {
  v1::RunSpec spec;  // the spec the checkpoint was written under
  int64_t step = 0;
  model::LogicalParams params;
  std::map<std::string, model::LogicalShape> shapes;  // of params, by name
};

// The checkpoint of `step` (default: the newest that verifies) in RUN_DIR/checkpoints, written at
// any layout, as the logical tensors of one process (MoE: every expert, each from the shards of
// its ep rank, ShardTensorRanges). NotFound naming the folder when there is none; DataLoss naming
// the shard file and the section for a section of the wrong size.
absl::StatusOr<CheckpointWeights> ReadCheckpointWeights(const std::string& run_dir,
                                                        std::optional<int64_t> step);

// Every rank's shard of the committed checkpoint in `folder`, indexed by rank, each read whole
// and its checksums verified, or with `ranged` opened ShardReader::OpenRanged (a section is read
// and verified when asked for; for a checkpoint CheckpointDir::Verify passed). DataLoss naming
// the MANIFEST when its layout and shards disagree.
absl::StatusOr<std::vector<std::unique_ptr<ShardReader>>> OpenShards(
    const std::string& folder, const v1::CheckpointManifest& manifest, bool ranged = false);

// The range of parameter `param` that a shard cut by `cut` holds (what every shard's "ranges"
// section records).
v1::TensorRange RangeOf(const std::string& param, const model::ShardCut& cut);

// Where the tensors of `shard` (rank `rank` of the checkpoint `manifest` describes) lie in the
// logical tensors `shapes`: its "ranges" section, each range checked against the shape and the
// section sizes; a shard written before ranges were recorded has them worked out from the
// MANIFEST's dp x tp x ep layout (each parameter's model::ShardCut at the rank's
// parallel::MeshLayout; the MoE experts, ".experts." in the name, of its ep rank only, cut over
// its expert-data-parallel group). DataLoss naming the file and the parameter.
absl::StatusOr<std::vector<v1::TensorRange>> ShardTensorRanges(
    const ShardReader& shard, const v1::CheckpointManifest& manifest, int rank,
    const std::map<std::string, model::LogicalShape>& shapes);

// The logical tensors of each section family in `prefixes` ("master/", "adam_m/", "adam_v/"),
// one LogicalParams per prefix, assembled from `shards` (OpenShards) by their ranges
// (ShardTensorRanges), with no assumption on how many ranks wrote them. With `need` (a cut per
// parameter: a rank of the resuming layout) only the elements those cuts hold are filled, the rest
// left zero, and a shard's section is read only when it holds one of them that no earlier shard
// held (ranged readers then read only those sections). DataLoss naming the file and section for
// a wrong size, or the folder and parameter for an element no shard holds.
absl::StatusOr<std::vector<model::LogicalParams>> AssembleLogical(
    const std::vector<std::unique_ptr<ShardReader>>& shards, const v1::CheckpointManifest& manifest,
    const std::map<std::string, model::LogicalShape>& shapes,
    const std::vector<std::string>& prefixes,
    const std::map<std::string, model::ShardCut>* need = nullptr);

// Writes out_dir/model.safetensors (FP32, or BF16 rounded to nearest even with bf16) and
// out_dir/config.json, creating out_dir. InvalidArgument naming the model field for a shape that
// is not GPT-2's or Llama's architecture.
absl::Status ExportHuggingFace(const model::ModelShape& shape,
                               const std::map<std::string, model::LogicalShape>& shapes,
                               const model::LogicalParams& params, const std::string& out_dir,
                               bool bf16);

// Reads `path` (Hugging Face names: a safetensors file, an index of several, or a folder holding
// either; SafetensorsSet::Open) and sets the model's shards from it. Unless `ignore_config`, a
// config.json in the weights' folder must describe `shape` first (model::CheckHfConfig: an error
// naming the file, the key and the spec field, nothing set); without one nothing is compared.
absl::Status LoadHuggingFace(const std::string& path, const model::ModelShape& shape,
                             model::Transformer& model, bool ignore_config = false);

// A model of the spec's shape on one process (CPU ops, FP32 GEMMs, seed from the spec).
struct SoloModel {
  parallel::SoloCommunicatorFactory factory;
  std::unique_ptr<parallel::Mesh> mesh;
  std::unique_ptr<model::Transformer> model;
  model::ModelShape shape;
};
absl::StatusOr<std::unique_ptr<SoloModel>> MakeSoloModel(const v1::RunSpec& spec);

}  // namespace fp8rt::worker

#endif  // FP8RT_RUNTIME_WORKER_WEIGHTS_H_
