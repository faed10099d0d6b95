// Checkpoint save and load of the step loop (see trainer.h): this rank's shard (its FSDP shards,
// Adam moments, every scaling state, the data position and cursor, the live recipe), written and
// committed standalone (rank 0 writes the manifest) or under a controller (every rank
// acknowledges its shard, the controller commits); Restore picks the newest committed checkpoint
// that verifies.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fp8rt/v1/checkpoint.pb.h"
#include "fp8rt/v1/control.pb.h"
#include "fp8rt/v1/scaling.pb.h"
#include "runtime/checkpoint/checkpoint_dir.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/core/fault_point.h"
#include "runtime/core/status.h"
#include "runtime/worker/recipe.h"
#include "runtime/worker/trainer.h"  // the Trainer members defined here
#include "runtime/worker/weights.h"

namespace fp8rt::worker {
namespace fs = std::filesystem;

namespace {

template <typename T>
std::span<const std::byte> Bytes(const T* data, size_t count) {
  return std::as_bytes(std::span<const T>(data, count));
}

// Copies a section into `count` values of T, or DataLoss naming the section and file.
template <typename T>
absl::Status ReadSection(const ShardReader& reader, const std::string& name, T* out, size_t count) {
  FP8RT_ASSIGN_OR_RETURN(std::span<const std::byte> bytes, reader.Section(name));
  if (bytes.size() != count * sizeof(T)) {
    return absl::DataLossError(absl::StrCat(reader.path(), ": section '", name, "' holds ",
                                            bytes.size(), " bytes, this run expects ",
                                            count * sizeof(T)));
  }
  std::memcpy(out, bytes.data(), bytes.size());
  return absl::OkStatus();
}

// Every rank's outcome of a save stage (OK, or the error's code and first 1022 bytes), in rank
// order: one AllGather of a fixed-size record per rank.
absl::StatusOr<std::vector<absl::Status>> GatherOutcomes(parallel::Communicator& world,
                                                         const absl::Status& mine) {
  constexpr size_t kRecord = 1024;  // byte 0: the absl code; then the message, NUL-padded
  std::vector<uint8_t> send(kRecord, 0);
  send[0] = static_cast<uint8_t>(mine.code());
  const std::string message(mine.message());
  std::memcpy(send.data() + 1, message.data(), std::min(message.size(), kRecord - 2));
  std::vector<uint8_t> all(kRecord * static_cast<size_t>(world.size()));
  FP8RT_RETURN_IF_ERROR(world.AllGather(send.data(), static_cast<int64_t>(kRecord), all.data(),
                                        parallel::DType::kU8));
  std::vector<absl::Status> outcomes;
  for (int r = 0; r < world.size(); ++r) {
    const uint8_t* rec = all.data() + kRecord * static_cast<size_t>(r);
    const auto code = static_cast<absl::StatusCode>(rec[0]);
    const std::string message(reinterpret_cast<const char*>(rec + 1));
    outcomes.push_back(code == absl::StatusCode::kOk ? absl::OkStatus()
                                                     : absl::Status(code, message));
  }
  return outcomes;
}

// The failures among `outcomes` as "rank 1 (RESOURCE_EXHAUSTED: ...); ...", and the first one's
// code; {kOk, ""} when every rank succeeded.
std::pair<absl::StatusCode, std::string> DescribeFailures(
    const std::vector<absl::Status>& outcomes) {
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string text;
  for (size_t r = 0; r < outcomes.size(); ++r) {
    if (outcomes[r].ok()) continue;
    if (code == absl::StatusCode::kOk) code = outcomes[r].code();
    absl::StrAppend(&text, text.empty() ? "" : "; ", "rank ", r, " (", outcomes[r].ToString(), ")");
  }
  return {code, text};
}

}  // namespace

absl::Status Trainer::SaveCheckpoint() {
  parallel::Communicator& world = mesh_->world();
  const parallel::MeshLayout& layout = mesh_->layout();
  CheckpointDir dir(options_.run_dir);
  SetFaultStep(step_);  // FP8RT_FAULT_POINT's step=S (runtime/core/fault_point.h)
  int64_t ok = 1;
  std::string error;
  if (world.rank() == 0) {
    absl::StatusOr<std::string> prepared =
        controller_ != nullptr ? controller_->BeginCheckpoint(step_) : dir.PrepareTemp(step_);
    if (!prepared.ok()) {
      ok = 0;
      error = prepared.status().ToString();
    }
  }
  FP8RT_RETURN_IF_ERROR(world.Broadcast(&ok, 1, parallel::DType::kI64, 0));
  if (ok == 0) {
    return absl::InternalError(
        world.rank() == 0 ? error : "rank 0 could not prepare the checkpoint folder");
  }

  // This rank's shard: its FSDP shards, Adam moments, every scaling state, the data position.
  ShardWriter w;
  const int64_t applied = optimizer_->applied_steps();
  const uint64_t position = loader_->position();
  // Where the position is in the sequence stream (train::DataCursor): the epoch, and the
  // sequences of it all ranks have read; layout-free, checked against the position on resume.
  const train::DataCursor cursor = loader_->Cursor();
  const uint64_t cursor_values[2] = {cursor.epoch, cursor.sequence};
  const int32_t layout_ints[4] = {layout.world_size, layout.config.dp, layout.config.tp,
                                  layout.rank};
  const uint64_t rng[2] = {spec_.train().seed(), 0};  // no stochastic ops draw numbers yet
  absl::Status st = w.Add("meta/step", Bytes(&step_, 1));
  if (st.ok()) st = w.Add("meta/applied_steps", Bytes(&applied, 1));
  if (st.ok()) st = w.Add("meta/data_position", Bytes(&position, 1));
  if (st.ok()) st = w.Add("meta/data_cursor", Bytes(cursor_values, 2));
  if (st.ok()) st = w.Add("meta/layout", Bytes(layout_ints, 4));
  if (st.ok()) st = w.Add("rng", Bytes(rng, 2));
  if (st.ok()) st = w.Add("meta/recipe_version", Bytes(&recipe_version_, 1));
  if (st.ok()) st = w.AddProto("recipe", live_recipe_);
  // Where each tensor section lies in its logical tensor, so that any layout can read it back.
  v1::ShardRanges ranges;
  for (const model::Param& p : model_->params()) {
    *ranges.add_tensors() = RangeOf(p.name, model_->CutOf(p));
  }
  if (st.ok()) st = w.AddProto("ranges", ranges);
  for (const model::Param& p : model_->params()) {
    const size_t n = p.master.size();
    if (st.ok()) st = w.Add("master/" + p.name, Bytes(p.master.data(), n));
    if (st.ok()) st = w.Add("adam_m/" + p.name, Bytes(p.m.data(), n));
    if (st.ok()) st = w.Add("adam_v/" + p.name, Bytes(p.v.data(), n));
  }
  for (const model::QuantSite* s : model_->sites()) {
    v1::ScalingState proto;
    s->state().ToProto(&proto);
    if (st.ok()) st = w.AddProto("scaling/" + s->name(), proto);
  }
  absl::StatusOr<ShardWriteResult> written =
      st.ok() ? w.Write(dir.TempDir(step_) + "/" + ShardFileName(layout.rank))
              : absl::StatusOr<ShardWriteResult>(st);

  // Every rank learns which ranks could not write their shard and why, so that each rank's error
  // names the step and the failing ranks, and nobody acknowledges a save that cannot commit.
  FP8RT_ASSIGN_OR_RETURN(const std::vector<absl::Status> outcomes,
                         GatherOutcomes(world, written.status()));
  const auto [failed_code, failed] = DescribeFailures(outcomes);
  if (!failed.empty()) {
    // The save is abandoned: rank 0 (or the controller) removes the temp folder before any rank
    // returns, since mpirun stops the job as soon as one rank exits with an error. The run then
    // fails; the previous committed checkpoint is untouched (fp8rt launch --max-restarts resumes
    // from it).
    const std::string why = absl::StrCat("checkpoint step ", step_,
                                         " not saved, the save is abandoned (the previous "
                                         "checkpoint is kept): could not write the shard of ",
                                         failed);
    if (world.rank() == 0) {
      if (controller_ != nullptr) {
        v1::AckShardRequest abandon;
        abandon.set_run_id(options_.controller.run_id);
        abandon.set_step(step_);
        abandon.set_rank(layout.rank);
        abandon.set_file(ShardFileName(layout.rank));
        abandon.set_error(why);
        absl::StatusOr<bool> told = controller_->AckShard(abandon);
        if (!told.ok()) {
          std::fprintf(stderr,
                       "fp8rt-worker: cannot tell the controller to abandon step %lld: %s\n",
                       static_cast<long long>(step_), told.status().ToString().c_str());
        }
      } else {
        std::error_code ec;
        fs::remove_all(dir.TempDir(step_), ec);  // nothing partial is left behind
      }
    }
    int64_t done = 1;
    FP8RT_RETURN_IF_ERROR(world.Broadcast(&done, 1, parallel::DType::kI64, 0));
    return absl::Status(failed_code, why);
  }

  if (controller_ != nullptr) {
    // Every rank acknowledges its own shard; the controller commits after the last one.
    v1::AckShardRequest ack;
    ack.set_run_id(options_.controller.run_id);
    ack.set_step(step_);
    ack.set_rank(layout.rank);
    ack.set_file(ShardFileName(layout.rank));
    ack.set_size(written->size);
    ack.set_xxh64(written->xxh64);
    ack.set_data_position(position);
    const absl::StatusOr<bool> acked = controller_->AckShard(ack);
    if (acked.ok()) InjectKill(FaultPoint::kShardAcked, step_);
    // The last ack commits: its failure (the controller's commit, or the controller gone) is
    // every rank's error. The controller removes the temp folder of a failed commit.
    FP8RT_ASSIGN_OR_RETURN(const std::vector<absl::Status> ack_outcomes,
                           GatherOutcomes(world, acked.status()));
    if (const auto [code, text] = DescribeFailures(ack_outcomes); !text.empty()) {
      return absl::Status(code, absl::StrCat("checkpoint step ", step_,
                                             " not committed by the controller (the previous "
                                             "checkpoint is kept): the acknowledgement of ",
                                             text, " failed"));
    }
    int64_t committed = acked.ok() && *acked ? 1 : 0;
    FP8RT_RETURN_IF_ERROR(
        world.AllReduce(&committed, 1, parallel::DType::kI64, parallel::ReduceOp::kMax));
    if (world.rank() == 0 && committed != 0) {
      std::fprintf(stderr, "fp8rt-worker: checkpoint step %lld committed by the controller\n",
                   static_cast<long long>(step_));
    }
    return absl::OkStatus();
  }
  int64_t report[2] = {static_cast<int64_t>(written->size), static_cast<int64_t>(written->xxh64)};
  std::vector<int64_t> reports(2 * static_cast<size_t>(world.size()));
  FP8RT_RETURN_IF_ERROR(world.AllGather(report, 2, reports.data(), parallel::DType::kI64));
  absl::Status commit;  // rank 0's
  if (world.rank() == 0) {
    v1::CheckpointManifest manifest;
    manifest.set_step(step_);
    manifest.set_world_size(layout.world_size);
    manifest.set_dp(layout.config.dp);
    manifest.set_tp(layout.config.tp);
    manifest.set_ep(layout.config.ep);
    *manifest.mutable_spec() = spec_;
    manifest.set_created_unix_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count());
    manifest.set_data_position(position);
    for (int r = 0; r < world.size(); ++r) {
      v1::CheckpointShard* shard = manifest.add_shards();
      shard->set_rank(r);
      shard->set_file(ShardFileName(r));
      shard->set_size(static_cast<uint64_t>(reports[2 * static_cast<size_t>(r)]));
      shard->set_xxh64(static_cast<uint64_t>(reports[2 * static_cast<size_t>(r) + 1]));
    }
    commit = dir.Commit(manifest);
    if (!commit.ok()) {
      std::error_code ec;
      fs::remove_all(dir.TempDir(step_), ec);  // nothing partial is left behind
    } else {
      // Retention never deletes the checkpoint just committed (keep >= 1, checkpoint_dir.h).
      absl::StatusOr<std::vector<int64_t>> pruned = dir.Prune(spec_.checkpoint().keep());
      if (!pruned.ok())
        std::fprintf(stderr, "fp8rt-worker: %s\n", pruned.status().ToString().c_str());
    }
  }
  // Every rank learns rank 0's commit outcome (after rank 0 cleaned up, see above).
  FP8RT_ASSIGN_OR_RETURN(const std::vector<absl::Status> commit_outcomes,
                         GatherOutcomes(world, commit));
  if (const auto [code, text] = DescribeFailures(commit_outcomes); !text.empty()) {
    return absl::Status(code, absl::StrCat("checkpoint step ", step_,
                                           " not committed, the save is abandoned (the previous "
                                           "checkpoint is kept): the commit of ",
                                           text, " failed"));
  }
  return absl::OkStatus();
}

absl::Status Trainer::Restore() {
  parallel::Communicator& world = mesh_->world();
  CheckpointDir dir(options_.run_dir);
  // Rank 0 picks the checkpoint (verifying every shard), sets aside refused newer ones, and tells
  // the others which step to load: -1 none (fresh start), -2 an error.
  int64_t chosen = -1;
  std::string error;
  if (controller_ != nullptr) {
    // The controller verified the checkpoints and set refused ones aside (its Register answer).
    chosen = resume_step_ > 0 ? resume_step_ : -1;
    FP8RT_RETURN_IF_ERROR(world.Broadcast(&chosen, 1, parallel::DType::kI64, 0));
    if (chosen < 0) {
      if (world.rank() == 0) {
        std::fprintf(stderr, "fp8rt-worker: no checkpoint to resume from; starting at step 1\n");
      }
      return absl::OkStatus();
    }
    return LoadCheckpoint(chosen, dir.CommittedDir(chosen));
  }
  if (world.rank() == 0) {
    std::vector<std::string> refused;
    absl::StatusOr<ResumePoint> point = dir.FindNewestValid(&refused);
    for (const std::string& why : refused) {
      std::fprintf(stderr, "fp8rt-worker: refusing checkpoint: %s\n", why.c_str());
    }
    absl::StatusOr<std::vector<int64_t>> committed = dir.ListCommitted();
    if (!committed.ok()) {
      chosen = -2;
      error = committed.status().ToString();
    } else if (point.ok()) {
      chosen = point->step;
      if (const absl::Status fits = CheckResumable(*point, spec_); !fits.ok()) {
        chosen = -2;
        error = std::string(fits.message());
      }
    } else if (absl::IsFailedPrecondition(point.status())) {
      chosen = -2;  // intact, in a format this build cannot read: no fall-back to an older one
      error = std::string(point.status().message());
    } else if (!committed->empty()) {
      chosen = -2;
      error = absl::StrCat("no committed checkpoint in ", dir.root(),
                           " verifies (see the refusals above): ", point.status().ToString());
    }
    if (chosen >= -1 && committed.ok()) {
      for (int64_t s : *committed) {
        if (s <= chosen) continue;
        std::error_code ec;
        const std::string aside = dir.root() + "/refused-" + CheckpointName(s);
        fs::rename(dir.CommittedDir(s), aside, ec);
        std::fprintf(stderr, "fp8rt-worker: moved %s to %s%s\n", dir.CommittedDir(s).c_str(),
                     aside.c_str(), ec ? (" failed: " + ec.message()).c_str() : "");
      }
    }
    if (chosen == -1)
      std::fprintf(stderr, "fp8rt-worker: no checkpoint to resume from; starting at step 1\n");
  }
  FP8RT_RETURN_IF_ERROR(world.Broadcast(&chosen, 1, parallel::DType::kI64, 0));
  if (chosen == -2) {
    return absl::FailedPreconditionError(world.rank() == 0 ? error : "resume failed on rank 0");
  }
  if (chosen == -1) return absl::OkStatus();
  return LoadCheckpoint(chosen, dir.CommittedDir(chosen));
}

absl::Status Trainer::LoadCheckpoint(int64_t chosen, const std::string& folder) {
  parallel::Communicator& world = mesh_->world();
  const parallel::MeshLayout& layout = mesh_->layout();
  // The layout that wrote it (its MANIFEST): the same one loads this rank's own shard; another
  // one is resharded: every rank assembles the logical tensors it needs from all the shards.
  FP8RT_ASSIGN_OR_RETURN(std::unique_ptr<ShardReader> manifest_file,
                         ShardReader::Open(folder + "/" + std::string(kManifestFileName)));
  FP8RT_ASSIGN_OR_RETURN(const v1::CheckpointManifest manifest,
                         ParseManifest(*manifest_file, chosen));
  const bool other_layout = !SameLayout(manifest, spec_);
  if (other_layout) {
    FP8RT_RETURN_IF_ERROR(CheckResumable(ResumePoint{chosen, folder, manifest}, spec_));
  }
  // At the same layout the shards may still be cut otherwise (model::ShardCut::row_unit: a run
  // that started with another scaling): then they are resharded too.
  bool recut = false;
  if (!other_layout) {
    FP8RT_ASSIGN_OR_RETURN(std::unique_ptr<ShardReader> own,
                           ShardReader::OpenRanged(folder + "/" + ShardFileName(world.rank())));
    FP8RT_ASSIGN_OR_RETURN(
        const std::vector<v1::TensorRange> ranges,
        ShardTensorRanges(*own, manifest, world.rank(), model_->ParamShapes()));
    std::map<std::string, std::string> recorded;
    for (const v1::TensorRange& r : ranges) recorded[r.param()] = r.SerializeAsString();
    for (const model::Param& p : model_->params()) {
      const auto it = recorded.find(p.name);
      if (it == recorded.end()) continue;  // another rank's expert: CheckResumable's business
      if (it->second != RangeOf(p.name, model_->CutOf(p)).SerializeAsString()) recut = true;
    }
  }
  const bool reshard = other_layout || recut;
  // Resharding opens every shard ranged (rank 0 verified them all against the MANIFEST before
  // choosing the checkpoint), to read only the sections holding what this rank needs; otherwise
  // this rank reads its own whole.
  std::vector<std::unique_ptr<ShardReader>> shards;
  if (reshard) {
    FP8RT_ASSIGN_OR_RETURN(shards, OpenShards(folder, manifest, /*ranged=*/true));
  } else {
    FP8RT_ASSIGN_OR_RETURN(std::unique_ptr<ShardReader> own,
                           ShardReader::Open(folder + "/" + ShardFileName(world.rank())));
    shards.push_back(std::move(own));
  }
  // The run's counters and recipe: rank 0's when resharding (every rank wrote the same).
  const ShardReader* reader = shards[0].get();
  const std::string& path = reader->path();
  int64_t step = 0, applied = 0;
  uint64_t position = 0;
  FP8RT_RETURN_IF_ERROR(ReadSection(*reader, "meta/step", &step, 1));
  FP8RT_RETURN_IF_ERROR(ReadSection(*reader, "meta/applied_steps", &applied, 1));
  FP8RT_RETURN_IF_ERROR(ReadSection(*reader, "meta/data_position", &position, 1));
  // The recipe in force when the checkpoint was written (its sites are the saved ones).
  if (reader->HasSection("recipe")) {
    int64_t version = 1;
    FP8RT_RETURN_IF_ERROR(ReadSection(*reader, "meta/recipe_version", &version, 1));
    v1::Recipe recipe;
    FP8RT_RETURN_IF_ERROR(reader->ParseProto("recipe", &recipe));
    if (version > 1) {
      absl::Status applied = model_->ApplyRecipe(MergeRecipe(spec_, recipe));
      if (!applied.ok()) {
        return absl::DataLossError(absl::StrCat(path, ": recipe: ", applied.message()));
      }
      live_recipe_ = recipe;
    }
    recipe_version_ = version;
  }
  if (step != chosen || applied < 0 || applied > step) {
    return absl::DataLossError(absl::StrCat(path, ": meta/step ", step, " applied_steps ", applied,
                                            " do not match checkpoint step ", chosen));
  }
  if (!reshard) {
    for (model::Param& p : model_->params()) {
      const size_t n = p.master.size();
      FP8RT_RETURN_IF_ERROR(ReadSection(*reader, "master/" + p.name, p.master.data(), n));
      FP8RT_RETURN_IF_ERROR(ReadSection(*reader, "adam_m/" + p.name, p.m.data(), n));
      FP8RT_RETURN_IF_ERROR(ReadSection(*reader, "adam_v/" + p.name, p.v.data(), n));
    }
  } else {
    std::map<std::string, model::ShardCut> need;
    for (const model::Param& p : model_->params()) need.emplace(p.name, model_->CutOf(p));
    FP8RT_ASSIGN_OR_RETURN(std::vector<model::LogicalParams> logical,
                           AssembleLogical(shards, manifest, model_->ParamShapes(),
                                           {"master/", "adam_m/", "adam_v/"}, &need));
    using Array = model::Transformer::ShardArray;
    FP8RT_RETURN_IF_ERROR(model_->SetLogicalShards(logical[0], Array::kMaster));
    FP8RT_RETURN_IF_ERROR(model_->SetLogicalShards(logical[1], Array::kAdamM));
    FP8RT_RETURN_IF_ERROR(model_->SetLogicalShards(logical[2], Array::kAdamV));
  }
  for (model::QuantSite* s : model_->sites()) {
    const std::string section = "scaling/" + s->name();
    // FP8 scaling states are identical on every rank after the amax sync: a checkpoint whose
    // ranks disagree cannot be resharded (which rank's would the new ranks take?).
    std::span<const std::byte> mine;
    if (shards.size() > 1) {
      FP8RT_ASSIGN_OR_RETURN(mine, reader->Section(section));
    }
    for (size_t r = 1; r < shards.size(); ++r) {
      const ShardReader* other = shards[r].get();
      FP8RT_ASSIGN_OR_RETURN(const std::span<const std::byte> theirs, other->Section(section));
      if (mine.size() != theirs.size() ||
          std::memcmp(mine.data(), theirs.data(), mine.size()) != 0) {
        return absl::DataLossError(absl::StrCat(
            other->path(), ": section ", section, " differs from ", reader->path(),
            "'s: the ranks' FP8 scaling states disagree, so the checkpoint cannot be resharded"));
      }
    }
    v1::ScalingState proto;
    FP8RT_RETURN_IF_ERROR(reader->ParseProto(section, &proto));
    absl::StatusOr<train::ScalingState> state = train::ScalingState::FromProto(proto);
    if (!state.ok()) {
      return absl::DataLossError(
          absl::StrCat(path, ": scaling/", s->name(), ": ", state.status().message()));
    }
    const train::ScalingConfig& want = s->state().config();
    const train::ScalingConfig& got = state->config();
    if (want.format == got.format && want.strategy == got.strategy &&
        want.history_len == got.history_len && want.algo == got.algo && want.margin == got.margin &&
        want.power_of_two == got.power_of_two) {
      s->state() = *state;
    } else if (world.rank() == 0) {
      std::fprintf(stderr,
                   "fp8rt-worker: %s: recipe changed since the checkpoint; its scaling "
                   "state starts afresh\n",
                   s->name().c_str());
    }
  }
  optimizer_->set_applied_steps(applied);
  if (other_layout) {
    // The position counts micro-batches, grad_accum per step: the same step at this layout.
    const int64_t was = manifest.spec().train().grad_accum(), now = spec_.train().grad_accum();
    if (was < 1 || position % static_cast<uint64_t>(was) != 0) {
      return absl::DataLossError(absl::StrCat(path, ": meta/data_position ", position,
                                              " is not a whole number of steps of grad_accum ",
                                              was));
    }
    position = position / static_cast<uint64_t>(was) * static_cast<uint64_t>(now);
  }
  FP8RT_RETURN_IF_ERROR(loader_->Seek(position));
  // The epoch and its sequences done, as saved (checkpoints before data shuffling have none):
  // the same position over different data or a different order would resume elsewhere.
  if (reader->HasSection("meta/data_cursor")) {
    uint64_t saved[2] = {0, 0};
    FP8RT_RETURN_IF_ERROR(ReadSection(*reader, "meta/data_cursor", saved, 2));
    const train::DataCursor now = loader_->Cursor();
    if (saved[0] != now.epoch || saved[1] != now.sequence) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": meta/data_cursor: the checkpoint is at epoch ", saved[0], ", sequence ",
          saved[1], " of the data, but its data position ", position, " is epoch ", now.epoch,
          ", sequence ", now.sequence,
          " here: data.path, data.shuffle, data.val_fraction or the layout changed since the "
          "checkpoint"));
    }
  }
  step_ = step;
  if (world.rank() == 0) {
    if (recut) {
      std::fprintf(stderr,
                   "fp8rt-worker: resharding: the checkpoint's FSDP shards were cut for another "
                   "scaling (FP8 weights in whole rows or 128/32-row blocks); master weights and "
                   "Adam moments re-cut\n");
    }
    if (other_layout) {
      const v1::RunSpec& was = manifest.spec();
      std::fprintf(stderr,
                   "fp8rt-worker: resharding: the checkpoint was written at dp=%d tp=%d ep=%d "
                   "on %d ranks (micro_batch %d, grad_accum %d); this run is dp=%d tp=%d ep=%d "
                   "on %d ranks (micro_batch %d, grad_accum %d); master weights and Adam moments "
                   "resharded, FP8 scaling states the same on every rank\n",
                   manifest.dp(), manifest.tp(), std::max(1, manifest.ep()), manifest.world_size(),
                   was.train().micro_batch(), was.train().grad_accum(), layout.config.dp,
                   layout.config.tp, layout.config.ep, layout.world_size,
                   spec_.train().micro_batch(), spec_.train().grad_accum());
      uint64_t read = 0, total = 0;
      for (const std::unique_ptr<ShardReader>& shard : shards) {
        read += shard->bytes_read();
        total += shard->file_size();
      }
      std::fprintf(stderr,
                   "fp8rt-worker: resharding: rank 0 read %llu of the checkpoint's %llu bytes "
                   "(only the sections holding its elements)\n",
                   static_cast<unsigned long long>(read), static_cast<unsigned long long>(total));
    }
    std::fprintf(stderr, "fp8rt-worker: resuming after step %lld from %s\n",
                 static_cast<long long>(step), folder.c_str());
  }
  return absl::OkStatus();
}

}  // namespace fp8rt::worker
