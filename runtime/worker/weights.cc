// Weights in and out of a run (see weights.h).
#include "runtime/worker/weights.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/formats.h"
#include "kernels/ops.h"
#include "runtime/checkpoint/checkpoint_dir.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/core/file_io.h"
#include "runtime/core/safetensors.h"
#include "runtime/core/status.h"
#include "runtime/model/hf_weights.h"
#include "runtime/worker/recipe.h"

namespace fp8rt::worker {

absl::StatusOr<std::unique_ptr<SoloModel>> MakeSoloModel(const v1::RunSpec& spec) {
  auto solo = std::make_unique<SoloModel>();
  solo->shape = ShapeFromSpec(spec);
  FP8RT_ASSIGN_OR_RETURN(solo->mesh,
                         parallel::Mesh::Create({.dp = 1, .tp = 1, .ep = 1}, solo->factory));
  model::ModelRecipe recipe;
  recipe.precision = model::GemmPrecision::kFp32;
  FP8RT_ASSIGN_OR_RETURN(solo->model,
                         model::Transformer::Create(solo->shape, recipe, spec.train().seed(),
                                                    *solo->mesh, kernels::CpuOps()));
  return solo;
}

absl::StatusOr<CheckpointWeights> ReadCheckpointWeights(const std::string& run_dir,
                                                        std::optional<int64_t> step) {
  const CheckpointDir dir(run_dir);
  CheckpointWeights w;
  v1::CheckpointManifest manifest;
  if (step.has_value()) {
    FP8RT_ASSIGN_OR_RETURN(manifest, dir.Verify(*step));
  } else {
    FP8RT_ASSIGN_OR_RETURN(const ResumePoint point, dir.FindNewestValid(nullptr));
    manifest = point.manifest;
  }
  w.spec = manifest.spec();
  w.step = manifest.step();
  if (w.spec.moe().experts() > 0) {
    return absl::UnimplementedError(
        "reading the weights of an MoE checkpoint (experts sharded over parallel.ep) is not "
        "built yet");
  }
  const int64_t tp = manifest.tp(), dp = manifest.dp();
  if (tp < 1 || dp < 1 || manifest.world_size() != tp * dp ||
      manifest.shards_size() != manifest.world_size()) {
    return absl::DataLossError(absl::StrCat(dir.CommittedDir(w.step), "/MANIFEST",
                                            ": layout dp=", dp, " tp=", tp, " does not match ",
                                            manifest.shards_size(), " shards"));
  }
  FP8RT_ASSIGN_OR_RETURN(std::unique_ptr<SoloModel> solo, MakeSoloModel(w.spec));
  w.shapes = solo->model->ParamShapes();
  FP8RT_ASSIGN_OR_RETURN(const std::vector<std::unique_ptr<ShardReader>> shards,
                         OpenShards(dir.CommittedDir(w.step), manifest));
  FP8RT_ASSIGN_OR_RETURN(std::vector<model::LogicalParams> all,
                         AssembleLogical(shards, manifest, w.shapes, {"master/"}));
  w.params = std::move(all[0]);
  return w;
}

absl::StatusOr<std::vector<std::unique_ptr<ShardReader>>> OpenShards(
    const std::string& folder, const v1::CheckpointManifest& manifest) {
  const int64_t tp = manifest.tp(), dp = manifest.dp();
  if (tp < 1 || dp < 1 || manifest.world_size() != tp * dp ||
      manifest.shards_size() != manifest.world_size()) {
    return absl::DataLossError(absl::StrCat(folder, "/MANIFEST", ": layout dp=", dp, " tp=", tp,
                                            " does not match ", manifest.shards_size(), " shards"));
  }
  std::vector<std::unique_ptr<ShardReader>> shards(static_cast<size_t>(manifest.world_size()));
  for (const v1::CheckpointShard& shard : manifest.shards()) {
    // ParseManifest checked that the ranks are 0 .. world_size - 1, each once.
    FP8RT_ASSIGN_OR_RETURN(shards[static_cast<size_t>(shard.rank())],
                           ShardReader::Open(folder + "/" + shard.file()));
  }
  return shards;
}

absl::StatusOr<std::vector<model::LogicalParams>> AssembleLogical(
    const std::vector<std::unique_ptr<ShardReader>>& shards, const v1::CheckpointManifest& manifest,
    const std::map<std::string, model::LogicalShape>& shapes,
    const std::vector<std::string>& prefixes) {
  const int dp = manifest.dp(), tp = manifest.tp(), ep = std::max(1, manifest.ep());
  std::vector<model::LogicalParams> out(prefixes.size());
  for (model::LogicalParams& params : out) {
    for (const auto& [name, s] : shapes) {
      params[name] = std::vector<float>(static_cast<size_t>(s.rows * s.cols), 0.0f);
    }
  }
  for (size_t rank = 0; rank < shards.size(); ++rank) {
    const ShardReader& reader = *shards[rank];
    absl::StatusOr<parallel::MeshLayout> layout =
        parallel::MeshLayout::Create({dp, tp, ep}, manifest.world_size(), static_cast<int>(rank));
    if (!layout.ok()) {
      return absl::DataLossError(
          absl::StrCat(reader.path(), ": the MANIFEST's layout: ", layout.status().message()));
    }
    for (const auto& [name, s] : shapes) {
      // A rank holds the experts of its ep rank only, each FSDP-sharded over its
      // expert-data-parallel group (dp / ep ranks); every other parameter is FSDP-sharded over
      // the dp group.
      const bool expert = name.find(".experts.") != std::string::npos;
      if (expert && !reader.HasSection(prefixes[0] + name)) continue;  // another rank's expert
      const model::ShardCut cut{.shape = s,
                                .tp = tp,
                                .tp_rank = layout->tp_rank,
                                .fsdp = expert ? dp / ep : dp,
                                .fsdp_rank = expert ? layout->edp_rank : layout->dp_rank};
      const int64_t count = cut.count();
      for (size_t k = 0; k < prefixes.size(); ++k) {
        const std::string section = prefixes[k] + name;
        FP8RT_ASSIGN_OR_RETURN(const std::span<const std::byte> bytes, reader.Section(section));
        if (bytes.size() != static_cast<size_t>(count) * sizeof(float)) {
          return absl::DataLossError(absl::StrCat(
              reader.path(), ": section ", section, " has ", bytes.size(), " bytes, expected ",
              count * static_cast<int64_t>(sizeof(float)), " at dp=", dp, " tp=", tp, " ep=", ep));
        }
        std::vector<float>& dst = out[k][name];
        cut.ForEach([&](size_t i, int64_t logical) {
          std::memcpy(&dst[static_cast<size_t>(logical)], bytes.data() + i * sizeof(float),
                      sizeof(float));
        });
      }
    }
  }
  return out;
}

absl::Status ExportHuggingFace(const model::ModelShape& shape,
                               const std::map<std::string, model::LogicalShape>& shapes,
                               const model::LogicalParams& params, const std::string& out_dir,
                               bool bf16) {
  FP8RT_ASSIGN_OR_RETURN(const std::string config,
                         model::HfConfigJson(shape, bf16 ? "bfloat16" : "float32"));
  FP8RT_ASSIGN_OR_RETURN(const std::vector<model::HfTensor> tensors,
                         model::ToHuggingFace(shape, shapes, params));
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat(out_dir, ": cannot create the output folder: ", ec.message()));
  }
  std::vector<std::vector<uint16_t>> halves;
  halves.reserve(tensors.size());
  std::vector<SafetensorsWriteTensor> out;
  for (const model::HfTensor& t : tensors) {
    SafetensorsWriteTensor w{.name = t.name, .shape = t.shape};
    if (bf16) {
      std::vector<uint16_t>& h = halves.emplace_back(t.values.size());
      for (size_t i = 0; i < h.size(); ++i) h[i] = kernels::FloatToBf16(t.values[i]);
      w.dtype = SafetensorsDtype::kBF16;
      w.data = h.data();
    } else {
      w.dtype = SafetensorsDtype::kF32;
      w.data = t.values.data();
    }
    out.push_back(std::move(w));
  }
  FP8RT_RETURN_IF_ERROR(
      WriteSafetensors(out_dir + "/model.safetensors", out, {{"format", "pt"}}));
  const std::span<const std::byte> parts[] = {
      std::as_bytes(std::span(config.data(), config.size()))};
  return WriteFileAtomically(out_dir + "/config.json", parts, "config.json");
}

absl::Status LoadHuggingFace(const std::string& path, const model::ModelShape& shape,
                             model::Transformer& model) {
  FP8RT_ASSIGN_OR_RETURN(const SafetensorsFile file, SafetensorsFile::Read(path));
  FP8RT_ASSIGN_OR_RETURN(const model::LogicalParams params,
                         model::FromHuggingFace(shape, model.ParamShapes(), file));
  return model.SetLogicalParams(params);
}

}  // namespace fp8rt::worker
