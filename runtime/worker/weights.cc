// Weights in and out of a run (see weights.h).
#include "runtime/worker/weights.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/formats.h"
#include "kernels/ops.h"
#include "runtime/checkpoint/checkpoint_dir.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/core/file_io.h"
#include "runtime/core/quote.h"
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
  FP8RT_ASSIGN_OR_RETURN(
      solo->model, model::Transformer::Create(solo->shape, recipe, spec.train().seed(), *solo->mesh,
                                              kernels::CpuOps()));
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
                         OpenShards(dir.CommittedDir(w.step), manifest, /*ranged=*/true));
  FP8RT_ASSIGN_OR_RETURN(std::vector<model::LogicalParams> all,
                         AssembleLogical(shards, manifest, w.shapes, {"master/"}));
  w.params = std::move(all[0]);
  return w;
}

absl::StatusOr<std::vector<std::unique_ptr<ShardReader>>> OpenShards(
    const std::string& folder, const v1::CheckpointManifest& manifest, bool ranged) {
  const int64_t tp = manifest.tp(), dp = manifest.dp();
  if (tp < 1 || dp < 1 || manifest.world_size() != tp * dp ||
      manifest.shards_size() != manifest.world_size()) {
    return absl::DataLossError(absl::StrCat(folder, "/MANIFEST", ": layout dp=", dp, " tp=", tp,
                                            " does not match ", manifest.shards_size(), " shards"));
  }
  std::vector<std::unique_ptr<ShardReader>> shards(static_cast<size_t>(manifest.world_size()));
  for (const v1::CheckpointShard& shard : manifest.shards()) {
    // ParseManifest checked that the ranks are 0 .. world_size - 1, each once.
    const std::string path = folder + "/" + shard.file();
    FP8RT_ASSIGN_OR_RETURN(shards[static_cast<size_t>(shard.rank())],
                           ranged ? ShardReader::OpenRanged(path) : ShardReader::Open(path));
  }
  return shards;
}

v1::TensorRange RangeOf(const std::string& param, const model::ShardCut& cut) {
  v1::TensorRange r;
  r.set_param(param);
  r.set_rows(cut.shape.rows);
  r.set_cols(cut.shape.cols);
  r.set_row_begin(cut.row0());
  r.set_row_count(cut.local_rows());
  r.set_col_begin(cut.col0());
  r.set_col_count(cut.local_cols());
  r.set_flat_begin(cut.flat_begin());
  r.set_flat_count(cut.flat_count());
  r.set_section_elements(cut.count());
  return r;
}

namespace {

// A recorded range that the logical shape `s` admits: every bound checked before any product.
bool RangeFits(const v1::TensorRange& r, const model::LogicalShape& s) {
  auto within = [](int64_t begin, int64_t count, int64_t size) {
    return begin >= 0 && count >= 0 && begin <= size && count <= size - begin;
  };
  return r.rows() == s.rows && r.cols() == s.cols && within(r.row_begin(), r.row_count(), s.rows) &&
         within(r.col_begin(), r.col_count(), s.cols) &&
         within(r.flat_begin(), r.flat_count(), r.row_count() * r.col_count()) &&
         r.section_elements() >= r.flat_count() &&
         // A shard cut in rows (model::ShardCut::row_unit, at most 128) pads the piece's rows
         // to a whole number of row groups at most.
         r.section_elements() <= (r.row_count() + 127) / 128 * 128 * r.col_count();
}

// fn(i, logical) for each element i < flat_count of range `r`.
void ForEachInRange(const v1::TensorRange& r, const std::function<void(size_t, int64_t)>& fn) {
  for (int64_t i = 0; i < r.flat_count(); ++i) {
    const int64_t li = r.flat_begin() + i;
    fn(static_cast<size_t>(i),
       (r.row_begin() + li / r.col_count()) * r.cols() + r.col_begin() + li % r.col_count());
  }
}

}  // namespace

absl::StatusOr<std::vector<v1::TensorRange>> ShardTensorRanges(
    const ShardReader& shard, const v1::CheckpointManifest& manifest, int rank,
    const std::map<std::string, model::LogicalShape>& shapes) {
  std::vector<v1::TensorRange> ranges;
  if (shard.HasSection("ranges")) {
    v1::ShardRanges recorded;
    FP8RT_RETURN_IF_ERROR(shard.ParseProto("ranges", &recorded));
    for (v1::TensorRange& r : *recorded.mutable_tensors()) {
      const auto it = shapes.find(r.param());
      if (it == shapes.end() || !RangeFits(r, it->second)) {
        return absl::DataLossError(absl::StrCat(
            shard.path(), ": section ranges: the range of ", QuoteBounded(r.param()),
            it == shapes.end() ? " names no parameter of this model"
                               : absl::StrCat(" does not fit its ", it->second.rows, " x ",
                                              it->second.cols, " logical tensor")));
      }
      ranges.push_back(std::move(r));
    }
    return ranges;
  }
  // Written before ranges were recorded: the MANIFEST's layout says how the rank's shard is cut.
  const int dp = manifest.dp(), tp = manifest.tp(), ep = std::max(1, manifest.ep());
  absl::StatusOr<parallel::MeshLayout> layout =
      parallel::MeshLayout::Create({dp, tp, ep}, manifest.world_size(), rank);
  if (!layout.ok()) {
    return absl::DataLossError(
        absl::StrCat(shard.path(), ": the MANIFEST's layout: ", layout.status().message()));
  }
  for (const auto& [name, s] : shapes) {
    // A rank holds the experts of its ep rank only, each FSDP-sharded over its
    // expert-data-parallel group (dp / ep ranks); every other parameter is FSDP-sharded over
    // the dp group.
    const bool expert = name.find(".experts.") != std::string::npos;
    if (expert && !shard.HasSection("master/" + name)) continue;  // another rank's expert
    ranges.push_back(
        RangeOf(name, model::ShardCut{.shape = s,
                                      .tp = tp,
                                      .tp_rank = layout->tp_rank,
                                      .fsdp = expert ? dp / ep : dp,
                                      .fsdp_rank = expert ? layout->edp_rank : layout->dp_rank}));
  }
  return ranges;
}

absl::StatusOr<std::vector<model::LogicalParams>> AssembleLogical(
    const std::vector<std::unique_ptr<ShardReader>>& shards, const v1::CheckpointManifest& manifest,
    const std::map<std::string, model::LogicalShape>& shapes,
    const std::vector<std::string>& prefixes, const std::map<std::string, model::ShardCut>* need) {
  // Every shard's ranges, by parameter, in rank order.
  std::map<std::string, std::vector<std::pair<size_t, v1::TensorRange>>> holders;
  for (size_t rank = 0; rank < shards.size(); ++rank) {
    FP8RT_ASSIGN_OR_RETURN(
        std::vector<v1::TensorRange> ranges,
        ShardTensorRanges(*shards[rank], manifest, static_cast<int>(rank), shapes));
    for (v1::TensorRange& r : ranges) {
      const std::string param = r.param();
      holders[param].emplace_back(rank, std::move(r));
    }
  }
  std::vector<model::LogicalParams> out(prefixes.size());
  std::vector<std::pair<size_t, int64_t>> take;  // (section element, logical element)
  for (const auto& [name, s] : shapes) {
    const size_t size = static_cast<size_t>(s.rows * s.cols);
    for (model::LogicalParams& params : out) params[name].assign(size, 0.0f);
    // 1: wanted, not yet filled; 0: filled or not wanted.
    std::vector<uint8_t> wanted(size, need == nullptr ? 1 : 0);
    size_t missing = need == nullptr ? size : 0;
    if (need != nullptr) {
      const auto cut = need->find(name);
      if (cut != need->end()) {
        cut->second.ForEach([&](size_t, int64_t logical) {
          wanted[static_cast<size_t>(logical)] = 1;
          ++missing;
        });
      }
    }
    for (const auto& [rank, range] : holders[name]) {
      if (missing == 0) break;
      take.clear();
      ForEachInRange(range, [&](size_t i, int64_t logical) {
        uint8_t& w = wanted[static_cast<size_t>(logical)];
        if (w == 0) return;
        w = 0;
        take.emplace_back(i, logical);
      });
      if (take.empty()) continue;  // nothing new here: its sections are not read
      missing -= take.size();
      const ShardReader& reader = *shards[rank];
      for (size_t k = 0; k < prefixes.size(); ++k) {
        const std::string section = prefixes[k] + name;
        FP8RT_ASSIGN_OR_RETURN(const std::span<const std::byte> bytes, reader.Section(section));
        if (bytes.size() != static_cast<size_t>(range.section_elements()) * sizeof(float)) {
          return absl::DataLossError(absl::StrCat(reader.path(), ": section ", section, " has ",
                                                  bytes.size(), " bytes, its range says ",
                                                  range.section_elements(), " FP32 values"));
        }
        std::vector<float>& dst = out[k][name];
        for (const auto& [i, logical] : take) {
          std::memcpy(&dst[static_cast<size_t>(logical)], bytes.data() + i * sizeof(float),
                      sizeof(float));
        }
      }
    }
    if (missing > 0) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint written at dp=", manifest.dp(), " tp=", manifest.tp(),
          " ep=", std::max(1, manifest.ep()), " on ", shards.size(), " ranks: ", missing, " of ",
          size, " elements of parameter ", name, " are in no shard's range"));
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
  FP8RT_RETURN_IF_ERROR(WriteSafetensors(out_dir + "/model.safetensors", out, {{"format", "pt"}}));
  const std::span<const std::byte> parts[] = {
      std::as_bytes(std::span(config.data(), config.size()))};
  return WriteFileAtomically(out_dir + "/config.json", parts, "config.json");
}

namespace {
constexpr uint64_t kMaxConfigBytes = uint64_t{1} << 20;  // config.json is a few kilobytes
}  // namespace

absl::Status LoadHuggingFace(const std::string& path, const model::ModelShape& shape,
                             model::Transformer& model, bool ignore_config) {
  FP8RT_ASSIGN_OR_RETURN(const SafetensorsSet file, SafetensorsSet::Open(path));
  if (!ignore_config) {
    // config.json beside the weights (the index's or the file's folder: save_pretrained and
    // fp8rt export write it there). Only its absence skips the check: anything else there (a
    // dangling link, a folder, a file that cannot be read) is refused, naming it.
    const std::filesystem::path config =
        std::filesystem::path(file.name()).parent_path() / "config.json";
    std::error_code ec;
    const std::filesystem::file_status st = std::filesystem::symlink_status(config, ec);
    if (ec && ec != std::errc::no_such_file_or_directory) {
      return absl::InvalidArgumentError(
          absl::StrCat(config.string(), ": cannot look at it: ", ec.message()));
    }
    if (st.type() != std::filesystem::file_type::not_found) {
      FP8RT_ASSIGN_OR_RETURN(const std::string text,
                             ReadTextFile(config.string(), kMaxConfigBytes));
      FP8RT_RETURN_IF_ERROR(model::CheckHfConfig(shape, text, config.string()));
    }
  }
  // One parameter at a time: the whole model never exists here in FP32, and the mapped files'
  // pages are shared by the ranks of a node.
  return model::ForEachHfParam(shape, model.ParamShapes(), file,
                               [&](const std::string& name, std::span<const float> values) {
                                 return model.SetLogicalParam(name, values);
                               });
}

}  // namespace fp8rt::worker
