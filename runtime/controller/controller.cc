// The control plane's state and rules (see controller.h). Contents:
//   helpers                 validation of ids and ranks, time, site names
//   Open / Start / Shutdown lifecycle, loading the state folder
//   Register                rank 0 (create, restart, resume) and the other ranks
//   Heartbeat, ReportStep   liveness, step metrics, the FP8 health policy
//   BeginCheckpoint, AckShard, ListCheckpoints, SaveCheckpoint
//   the Runs service        ListRuns ... UpdateRecipe, WatchEvents
//   monitor, persistence    MonitorLoop, SweepLocked, Flush
#include "runtime/controller/controller.h"

#include <openssl/evp.h>
#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <set>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/util/message_differencer.h"
#include "runtime/checkpoint/checkpoint_dir.h"
#include "runtime/controller/recipe.h"
#include "runtime/core/check.h"
#include "runtime/core/fault_point.h"
#include "runtime/core/quote.h"
#include "runtime/core/status.h"
#include "runtime/spec/run_spec.h"

namespace fp8rt::controller {
namespace {

namespace fs = std::filesystem;

constexpr int kMaxWorldSize = 99999;  // ShardFileName has 5 digits
constexpr int kMaxReasonBytes = 4096;
// At most this many worker_lost events per sweep and run; the rest are summed up in one.
constexpr size_t kMaxLostEvents = 16;
// How many heartbeat timeouts a rank has to register after rank 0 did (RankState::registering).
constexpr int kRegistrationTimeouts = 3;

int64_t NowUnixMs() { return absl::ToUnixMillis(absl::Now()); }

// SHA-256 of `text` (32 raw bytes).
std::string Sha256(std::string_view text) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  FP8RT_CHECK(EVP_Digest(text.data(), text.size(), digest, &size, EVP_sha256(), nullptr) == 1 &&
              size == 32)
      << "EVP_Digest(SHA-256) failed";
  return std::string(reinterpret_cast<const char*>(digest), size);
}

// 32 bytes from the kernel's CSPRNG, as 64 hex digits.
absl::StatusOr<std::string> RandomHexToken() {
  unsigned char bytes[32];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::ErrnoToStatus(errno, "getrandom for a run token");
    got += static_cast<size_t>(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) token += {kHex[b >> 4], kHex[b & 15]};
  return token;
}

// InvalidArgument unless `value` has at most `max` bytes.
absl::Status CheckLength(const std::string& field, const std::string& value, size_t max) {
  if (value.size() <= max) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": at most ", max, " bytes, got ", value.size()));
}

// InvalidArgument unless 0 <= step <= kMaxStep (`lowest` 1 where step 0 means nothing).
absl::Status CheckStep(const std::string& field, int64_t step, int64_t lowest = 0) {
  if (step >= lowest && step <= kMaxStep) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": must be in [", lowest, ", ", kMaxStep, "], got ", step));
}

// InvalidArgument unless the repeated field `field` has at most `max` entries.
absl::Status CheckCount(const std::string& field, int count, int max) {
  if (count <= max) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": at most ", max, " entries, got ", count));
}

bool RunIdChar(char c, bool first) {
  if ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')) return true;
  return !first && (c == '.' || c == '_' || c == '-');
}

absl::Status ValidateRunId(const std::string& id) {
  bool valid = !id.empty() && id.size() <= 63;
  for (size_t i = 0; valid && i < id.size(); ++i) valid = RunIdChar(id[i], i == 0);
  if (valid) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("run_id: must match [a-z0-9][a-z0-9._-]{0,62}, got ", QuoteBounded(id)));
}

absl::Status CheckRankInWorld(int rank, int world_size, const std::string& run_id) {
  if (rank >= 0 && rank < world_size) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("rank: must be in [0, ", world_size, ") for run ", run_id, ", got ", rank));
}

// "blocks.0.mlp.fc1/grad_output", with " (expert 3)" for expert sites.
std::string SiteName(const v1::SiteStats& site) {
  std::string name = absl::StrCat(site.layer(), "/", TensorRoleLabel(site.tensor()));
  if (site.expert() >= 0) absl::StrAppend(&name, " (expert ", site.expert(), ")");
  return name;
}

std::string StateName(v1::RunState state) { return absl::AsciiStrToUpper(RunStateLabel(state)); }

// Moves a refused checkpoint folder aside as refused-step-NNNNNNNN (with -2, -3, ... when that
// name is taken), so that it no longer counts as committed; returns the new path.
absl::StatusOr<std::string> MoveAside(const CheckpointDir& dir, int64_t step) {
  const fs::path from = dir.CommittedDir(step);
  const std::string base = absl::StrCat("refused-", CheckpointName(step));
  std::error_code ec;
  for (int n = 1; n < 1000; ++n) {
    const fs::path to = fs::path(dir.root()) / (n == 1 ? base : absl::StrCat(base, "-", n));
    if (fs::exists(to, ec)) continue;
    fs::rename(from, to, ec);
    if (ec) {
      return absl::ErrnoToStatus(ec.value(), absl::StrCat("cannot move the refused checkpoint ",
                                                          from.string(), " to ", to.string()));
    }
    return to.string();
  }
  return absl::AlreadyExistsError(absl::StrCat("no free refused-* name for ", from.string()));
}

uint64_t ShardBytes(const google::protobuf::RepeatedPtrField<v1::CheckpointShard>& shards) {
  uint64_t bytes = 0;
  for (const v1::CheckpointShard& s : shards) bytes += s.size();
  return bytes;
}

// Adds `c` to `list`, which is sorted by step and stays so.
void InsertByStep(v1::CommittedCheckpoint c,
                  google::protobuf::RepeatedPtrField<v1::CommittedCheckpoint>* list) {
  const auto pos = std::find_if(list->begin(), list->end(), [&](const v1::CommittedCheckpoint& x) {
    return x.info().step() > c.info().step();
  });
  const auto index = pos - list->begin();  // Add may reallocate: iterators do not survive it
  *list->Add() = std::move(c);
  std::rotate(list->begin() + index, list->end() - 1, list->end());
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Lifecycle.

Controller::Controller(const ControllerOptions& options, ControllerMetrics* metrics)
    : options_(options), metrics_(metrics), store_(options.state_dir) {}

Controller::~Controller() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Controller>> Controller::Open(const ControllerOptions& options,
                                                             ControllerMetrics* metrics) {
  if (options.state_dir.empty()) return absl::InvalidArgumentError("state_dir: required");
  if (options.heartbeat_timeout.count() <= 0) {
    return absl::InvalidArgumentError("heartbeat_timeout: must be positive");
  }
  if (options.recipe_lead_steps < 1 || options.recipe_lead_steps > kMaxStep) {
    return absl::InvalidArgumentError(absl::StrCat("recipe_lead_steps: must be in [1, ", kMaxStep, "]"));
  }
  std::unique_ptr<Controller> c(new Controller(options, metrics));
  FP8RT_RETURN_IF_ERROR(c->store_.Init());
  FP8RT_ASSIGN_OR_RETURN(std::vector<v1::RunRecord> records, c->store_.LoadAll());
  {
    FP8RT_ASSIGN_OR_RETURN(v1::RunTokens tokens, c->store_.LoadTokens());
    absl::MutexLock lock(&c->tokens_mu_);
    for (const v1::RunToken& t : tokens.tokens()) c->token_runs_[t.sha256()] = t.run_id();
    c->tokens_ = std::move(tokens);
  }
  absl::MutexLock lock(&c->mu_);
  for (v1::RunRecord& record : records) {
    auto run = std::make_unique<RunEntry>();
    run->record = std::move(record);
    // Ranks count as disconnected until they heartbeat; those of a RUNNING run must do so within
    // the timeout, or they are lost (the run may have died while the controller was down).
    run->ranks.resize(run->record.run().world_size());
    if (run->record.run().state() == v1::RUN_STATE_RUNNING) {
      for (RankState& r : run->ranks) {
        r.awaited = true;
        r.last_seen = Clock::now();
        r.step = run->record.latest_step();
      }
    }
    for (const v1::Event& e : run->record.events()) {
      c->next_event_id_ = std::max(c->next_event_id_, e.id() + 1);
    }
    c->ExportRunLocked(*run);
    const std::string id = run->record.run().run_id();
    c->runs_.emplace(id, std::move(run));
  }
  return c;
}

void Controller::Start() {
  absl::MutexLock lock(&mu_);
  if (monitor_.joinable() || shutting_down_) return;
  monitor_ = std::thread([this] { MonitorLoop(); });
}

void Controller::CloseStreams() {
  absl::MutexLock lock(&mu_);
  shutting_down_ = true;
  events_cv_.SignalAll();
  monitor_cv_.SignalAll();
}

void Controller::Shutdown() {
  CloseStreams();
  if (monitor_.joinable()) monitor_.join();
  FlushAll();
}

int Controller::heartbeat_interval_ms() const {
  const int64_t third = options_.heartbeat_timeout.count() / 3;
  return static_cast<int>(std::clamp<int64_t>(third, 100, 1000));
}

// ---------------------------------------------------------------------------------------------
// Run bookkeeping.

Controller::RunEntry* Controller::FindLocked(const std::string& run_id) {
  auto it = runs_.find(run_id);
  return it == runs_.end() ? nullptr : it->second.get();
}

absl::StatusOr<Controller::RunEntry*> Controller::GetLocked(const std::string& run_id) {
  RunEntry* run = FindLocked(run_id);
  if (run == nullptr) return absl::NotFoundError(absl::StrCat("run ", run_id, " not found"));
  return run;
}

int Controller::ConnectedLocked(const RunEntry& run) const {
  return static_cast<int>(std::count_if(run.ranks.begin(), run.ranks.end(),
                                        [](const RankState& r) { return r.connected; }));
}

const v1::RecipeVersion& Controller::NewestRecipeLocked(const RunEntry& run) const {
  return *run.record.recipes().rbegin();  // never empty (StateStore and Register ensure it)
}

v1::Run Controller::RunViewLocked(const RunEntry& run) const {
  v1::Run view = run.record.run();
  view.set_workers_connected(ConnectedLocked(run));
  view.set_recipe_version(NewestRecipeLocked(run).version());
  return view;
}

void Controller::AddEventLocked(RunEntry* run, const std::string& kind, int64_t step,
                                const std::string& message) {
  v1::Event* e = run->record.add_events();
  e->set_id(next_event_id_++);
  e->set_run_id(run->record.run().run_id());
  e->set_unix_ms(NowUnixMs());
  e->set_step(step);
  e->set_kind(kind);
  e->set_message(message);
  const int excess = run->record.events_size() - options_.max_events_per_run;
  if (excess > 0) run->record.mutable_events()->DeleteSubrange(0, excess);
  MarkChangedLocked(run);
  metrics_->CountEvent(e->run_id(), kind);
  std::fprintf(stderr, "fp8rt-controller: run %s: %s (step %" PRId64 "): %s\n", e->run_id().c_str(),
               kind.c_str(), step, message.c_str());
  events_cv_.SignalAll();
}

void Controller::SetStateLocked(RunEntry* run, v1::RunState state) {
  run->record.mutable_run()->set_state(state);
  MarkChangedLocked(run);
  metrics_->SetRunState(run->record.run().run_id(), state, run->record.run().world_size());
}

v1::RecipeVersion& Controller::AddRecipeLocked(RunEntry* run, const v1::Recipe& recipe,
                                               int64_t effective_step, const std::string& source,
                                               const std::string& reason) {
  const int64_t version =
      run->record.recipes().empty() ? 1 : NewestRecipeLocked(*run).version() + 1;
  v1::RecipeVersion* v = run->record.add_recipes();
  v->set_version(version);
  v->set_effective_step(effective_step);
  *v->mutable_recipe() = recipe;
  v->set_reason(reason);
  v->set_source(source);
  v->set_created_unix_ms(NowUnixMs());
  run->record.mutable_run()->set_recipe_version(version);
  // Keep the newest versions only (the workers only ever need the newest).
  const int excess = run->record.recipes_size() - std::max(1, options_.max_recipe_versions_per_run);
  if (excess > 0) run->record.mutable_recipes()->DeleteSubrange(0, excess);
  MarkChangedLocked(run);
  metrics_->SetRecipeVersion(run->record.run().run_id(), version);
  return *run->record.mutable_recipes()->rbegin();
}

void Controller::ExportRunLocked(const RunEntry& run) {
  const v1::Run& r = run.record.run();
  const std::string& id = r.run_id();
  metrics_->SetRunState(id, r.state(), r.world_size());
  metrics_->SetWorkersConnected(id, ConnectedLocked(run));
  metrics_->SetRecipeVersion(id, NewestRecipeLocked(run).version());
  metrics_->SetSkippedSteps(id, r.skipped_steps());
  if (r.last_step().step() > 0) metrics_->SetStep(id, r.last_step());
  if (r.val_loss_step() > 0) metrics_->SetEvalLoss(id, r.val_loss());
  if (!run.record.checkpoints().empty()) {
    const v1::CheckpointInfo& newest = run.record.checkpoints().rbegin()->info();
    metrics_->SetCheckpoint(id, newest.step(), newest.created_unix_ms());
  }
  metrics_->SetSites(id, run.record.layers().step(),
                     {run.record.layers().sites().begin(), run.record.layers().sites().end()});
}

// ---------------------------------------------------------------------------------------------
// Register.

absl::StatusOr<v1::RegisterResponse> Controller::Register(const v1::RegisterRequest& request) {
  FP8RT_RETURN_IF_ERROR(ValidateRunId(request.run_id()));
  if (request.world_size() < 1 || request.world_size() > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat("world_size: must be in [1, ", kMaxWorldSize,
                                                   "], got ", request.world_size()));
  }
  FP8RT_RETURN_IF_ERROR(CheckRankInWorld(request.rank(), request.world_size(), request.run_id()));
  FP8RT_RETURN_IF_ERROR(CheckLength("hostname", request.hostname(), kMaxNameBytes));
  FP8RT_RETURN_IF_ERROR(CheckLength("run_dir", request.run_dir(), kMaxPathBytes));
  return request.rank() == 0 ? RegisterRank0(request) : RegisterOtherRank(request);
}

v1::RegisterResponse Controller::RegisterResponseLocked(const RunEntry& run) const {
  v1::RegisterResponse response;
  *response.mutable_spec() = run.record.run().spec();
  *response.mutable_recipe() = NewestRecipeLocked(run);
  response.set_resume_step(run.record.resume_step());
  response.set_resume_dir(run.record.resume_dir());
  response.set_heartbeat_interval_ms(heartbeat_interval_ms());
  return response;
}

absl::StatusOr<v1::RegisterResponse> Controller::RegisterRank0(const v1::RegisterRequest& request) {
  const std::string& id = request.run_id();
  if (!request.has_spec()) {
    return absl::InvalidArgumentError("spec: required from rank 0 (the run's spec)");
  }
  if (request.run_dir().empty() || request.run_dir()[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("run_dir: must be an absolute path, got ", QuoteBounded(request.run_dir())));
  }
  FP8RT_RETURN_IF_ERROR(ValidateSpec(request.spec(), request.world_size()));
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return absl::UnavailableError("the controller is shutting down");
    const RunEntry* run = FindLocked(id);
    if (run == nullptr) FP8RT_RETURN_IF_ERROR(CheckRoomForRunLocked());
    if (run != nullptr && run->record.run().state() == v1::RUN_STATE_RUNNING && !request.resume()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "run ", id, " is already RUNNING (", ConnectedLocked(*run), " of ",
          run->record.run().world_size(),
          " ranks connected); a restart after a crash registers with --resume, or stop the run "
          "first"));
    }
  }

  // The run folder's checkpoints, without the lock: verifying reads every shard in full.
  const CheckpointDir dir(request.run_dir());
  FP8RT_ASSIGN_OR_RETURN(std::vector<int64_t> committed, dir.ListCommitted());
  if (!request.resume() && !committed.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("run ", id, ": ", dir.root(), " holds committed checkpoints (newest: step ",
                     committed.back(),
                     "); start with --resume to continue from the newest one, or use a new run "
                     "folder"));
  }
  std::optional<ResumePoint> resume;
  std::vector<std::pair<int64_t, std::string>> refused;  // step, event message
  if (request.resume() && !committed.empty()) {
    std::vector<std::string> reasons;  // newest first, as FindNewestValid walks
    absl::StatusOr<ResumePoint> found = dir.FindNewestValid(&reasons);
    if (!found.ok() && !absl::IsNotFound(found.status())) return found.status();
    // Refused up front, before any rank trains, with every checkpoint left where it is: a resume
    // none of whose checkpoints verifies (starting afresh would silently drop the run's
    // progress), and one whose checkpoint does not fit the run's model or layout.
    if (!found.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "run ", id, ": --resume, but every committed checkpoint in ", dir.root(),
          " is refused (", found.status().message(),
          "); nothing was moved; repair or remove them, or start without --resume in a new run "
          "folder"));
    }
    FP8RT_RETURN_IF_ERROR(CheckResumable(*found, request.spec()));
    const int64_t newest_valid = found.ok() ? found->step : -1;
    size_t k = 0;
    for (auto it = committed.rbegin(); it != committed.rend() && *it > newest_valid; ++it, ++k) {
      FP8RT_ASSIGN_OR_RETURN(std::string moved, MoveAside(dir, *it));
      refused.emplace_back(*it, absl::StrCat("checkpoint of step ", *it, " refused (",
                                             k < reasons.size() ? reasons[k] : "it does not verify",
                                             "); moved to ", moved));
    }
    if (found.ok()) resume = *std::move(found);
  }
  // Saves the previous incarnation left unfinished.
  const absl::StatusOr<int> stale = dir.RemoveStaleTemps();

  v1::RegisterResponse response;
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return absl::UnavailableError("the controller is shutting down");
    RunEntry* run = FindLocked(id);
    const int64_t resume_step = resume ? resume->step : 0;
    const v1::Recipe spec_recipe = RecipeFromSpec(request.spec());
    const std::string who =
        absl::StrCat("rank 0 (", request.hostname().empty() ? "?" : request.hostname(), ", pid ",
                     request.pid(), ")");
    const std::string start =
        resume ? absl::StrCat("resumes from step ", resume_step, " (", resume->dir, ")")
               : (request.resume() ? "resume asked, but there is no committed checkpoint: starts "
                                     "at step 1"
                                   : "starts at step 1");
    if (run == nullptr) {
      FP8RT_RETURN_IF_ERROR(CheckRoomForRunLocked());  // another run may have come meanwhile
      auto entry = std::make_unique<RunEntry>();
      run = entry.get();
      runs_.emplace(id, std::move(entry));
      v1::Run* r = run->record.mutable_run();
      r->set_run_id(id);
      r->set_created_unix_ms(NowUnixMs());
      run->record.set_latest_step(resume_step);
      AddRecipeLocked(run, spec_recipe, 1, "spec", "run spec");
      AddEventLocked(run, "run_registered", resume_step,
                     absl::StrCat("registered by ", who, ": world size ", request.world_size(),
                                  ", run folder ", request.run_dir(), "; ", start));
    } else {
      const v1::Recipe old_spec_recipe = RecipeFromSpec(run->record.run().spec());
      if (!request.resume() || !resume) {
        // A fresh start: nothing of the previous incarnation's progress applies.
        run->record.set_latest_step(0);
        run->record.mutable_run()->clear_last_step();
        run->record.mutable_run()->clear_val_loss();
        run->record.mutable_run()->clear_val_loss_step();
        run->record.clear_layers();
        run->record.clear_demoted_layers();
        const v1::RecipeVersion& newest = NewestRecipeLocked(*run);
        if (!SameRecipe(newest.recipe(), spec_recipe) || newest.effective_step() != 1) {
          AddRecipeLocked(run, spec_recipe, 1, "spec", "run spec (fresh start)");
        }
      } else {
        run->record.set_latest_step(resume_step);
        if (!SameRecipe(old_spec_recipe, spec_recipe)) {
          AddRecipeLocked(run, spec_recipe, resume_step + 1, "spec",
                          absl::StrCat("run spec changed at the restart: ",
                                       DescribeRecipeChange(old_spec_recipe, spec_recipe)));
        }
      }
      AddEventLocked(
          run, "run_registered", resume_step,
          absl::StrCat("re-registered by ", who, ": world size ", request.world_size(),
                       ", previous state ", StateName(run->record.run().state()), "; ", start));
    }
    v1::RunRecord& rec = run->record;
    v1::Run* r = rec.mutable_run();
    *r->mutable_spec() = request.spec();
    r->set_run_dir(request.run_dir());
    r->set_world_size(request.world_size());
    rec.set_save_requested(false);
    run->ranks.assign(request.world_size(), RankState{});
    for (size_t i = 1; i < run->ranks.size(); ++i) {
      run->ranks[i].registering = true;
      run->ranks[i].registration_start = Clock::now();
      run->ranks[i].step = resume_step;
    }
    run->pending.reset();
    run->saturation_streak.clear();
    run->underflow_streak.clear();
    run->comm_last.clear();

    // Checkpoints: drop records of refused ones, record the resume point if it is not known.
    std::set<int64_t> gone;
    for (const auto& [step, message] : refused) {
      gone.insert(step);
      AddEventLocked(run, "checkpoint_refused", step, message);
    }
    // A resume at another layout (the workers reshard as they load): what changed.
    if (resume) {
      const v1::CheckpointManifest& m = resume->manifest;
      const v1::RunSpec& s = request.spec();
      const int ep = std::max(1, s.parallel().ep());
      if (!SameLayout(m, s)) {
        AddEventLocked(
            run, "resume_resharded", resume_step,
            absl::StrCat("checkpoint of step ", resume_step, " written at dp=", m.dp(),
                         " tp=", m.tp(), " ep=", std::max(1, m.ep()), " on ", m.world_size(),
                         " ranks (micro_batch ", m.spec().train().micro_batch(), ", grad_accum ",
                         m.spec().train().grad_accum(), ") resumes at dp=", s.parallel().dp(),
                         " tp=", s.parallel().tp(), " ep=", ep, " on ", request.world_size(),
                         " ranks (micro_batch ", s.train().micro_batch(), ", grad_accum ",
                         s.train().grad_accum(), "): weights and Adam moments resharded"));
      }
    }
    auto* cps = rec.mutable_checkpoints();
    cps->erase(std::remove_if(cps->begin(), cps->end(),
                              [&](const v1::CommittedCheckpoint& c) {
                                return gone.contains(c.info().step());
                              }),
               cps->end());
    rec.set_resume_step(resume_step);
    rec.set_resume_dir(resume ? resume->dir : "");
    if (resume && std::none_of(cps->begin(), cps->end(), [&](const v1::CommittedCheckpoint& c) {
          return c.info().step() == resume_step;
        })) {
      v1::CommittedCheckpoint c;
      c.mutable_info()->set_step(resume_step);
      c.mutable_info()->set_dir(resume->dir);
      c.mutable_info()->set_created_unix_ms(resume->manifest.created_unix_ms());
      c.mutable_info()->set_bytes(ShardBytes(resume->manifest.shards()));
      *c.mutable_shards() = resume->manifest.shards();
      c.set_data_position(resume->manifest.data_position());
      InsertByStep(std::move(c), cps);
    }
    r->set_last_checkpoint_step(cps->empty() ? 0 : cps->rbegin()->info().step());
    if (!stale.ok()) {
      AddEventLocked(run, "checkpoint_failed", resume_step,
                     absl::StrCat("cannot remove unfinished saves: ", stale.status().message()));
    }

    RankState& rank0 = run->ranks[0];
    rank0.connected = true;
    rank0.last_seen = Clock::now();
    rank0.step = resume_step;
    rank0.hostname = request.hostname();
    rank0.pid = request.pid();
    SetStateLocked(run, v1::RUN_STATE_RUNNING);
    ExportRunLocked(*run);
    response = RegisterResponseLocked(*run);
  }
  Flush(id);
  return response;
}

absl::StatusOr<v1::RegisterResponse> Controller::RegisterOtherRank(
    const v1::RegisterRequest& request) {
  const std::string& id = request.run_id();
  absl::MutexLock lock(&mu_);
  RunEntry* run = FindLocked(id);
  if (run == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("run ", id, " is not registered yet (rank 0 registers first)"));
  }
  const v1::Run& r = run->record.run();
  if (r.state() != v1::RUN_STATE_RUNNING) {
    return absl::FailedPreconditionError(
        absl::StrCat("run ", id, " is ", StateName(r.state()),
                     " (rank 0 registers first: its registration restarts the run)"));
  }
  if (request.world_size() != r.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("world_size: run ", id, " has ", r.world_size(),
                                                   " ranks (registered by rank 0), got ",
                                                   request.world_size()));
  }
  RankState& rank = run->ranks[request.rank()];
  rank.connected = true;
  rank.awaited = false;
  rank.registering = false;
  rank.last_seen = Clock::now();
  rank.step = run->record.resume_step();
  rank.hostname = request.hostname();
  rank.pid = request.pid();
  metrics_->SetWorkersConnected(id, ConnectedLocked(*run));
  return RegisterResponseLocked(*run);
}

// ---------------------------------------------------------------------------------------------
// Heartbeat and ReportStep.

absl::StatusOr<v1::HeartbeatResponse> Controller::Heartbeat(const v1::HeartbeatRequest& request) {
  FP8RT_RETURN_IF_ERROR(ValidateRunId(request.run_id()));
  FP8RT_RETURN_IF_ERROR(CheckStep("step", request.step()));
  absl::MutexLock lock(&mu_);
  FP8RT_ASSIGN_OR_RETURN(RunEntry * run, GetLocked(request.run_id()));
  FP8RT_RETURN_IF_ERROR(
      CheckRankInWorld(request.rank(), run->record.run().world_size(), request.run_id()));
  RankState& rank = run->ranks[request.rank()];
  const bool was_connected = rank.connected;
  rank.connected = true;
  rank.awaited = false;
  rank.registering = false;
  rank.last_seen = Clock::now();
  rank.step = request.step();
  if (!was_connected) metrics_->SetWorkersConnected(request.run_id(), ConnectedLocked(*run));
  if (request.step() > run->record.latest_step()) {
    run->record.set_latest_step(request.step());
    MarkChangedLocked(run);  // written by the monitor, not on every heartbeat
  }
  v1::HeartbeatResponse response;
  *response.mutable_recipe() = NewestRecipeLocked(*run);
  response.set_stop(run->record.run().state() == v1::RUN_STATE_STOPPING);
  response.set_save_checkpoint(run->record.save_requested());
  return response;
}

absl::Status Controller::ReportStep(const v1::ReportStepRequest& request) {
  FP8RT_RETURN_IF_ERROR(ValidateRunId(request.run_id()));
  if (!request.has_metrics()) return absl::InvalidArgumentError("metrics: required");
  const v1::StepMetrics& m = request.metrics();
  FP8RT_RETURN_IF_ERROR(CheckStep("metrics.step", m.step(), 1));
  FP8RT_RETURN_IF_ERROR(CheckCount("sites", request.sites_size(), kMaxSitesPerReport));
  FP8RT_RETURN_IF_ERROR(CheckCount("comm", request.comm_size(), kMaxCommPerReport));
  FP8RT_RETURN_IF_ERROR(CheckCount("experts", request.experts_size(), kMaxExpertsPerReport));
  FP8RT_RETURN_IF_ERROR(CheckCount("memory", request.memory_size(), kMaxMemoryPerReport));
  FP8RT_RETURN_IF_ERROR(
      CheckCount("metrics.nonfinite_ranks", m.nonfinite_ranks_size(), kMaxWorldSize));
  for (int i = 0; i < m.nonfinite_ranks_size(); ++i) {
    if (m.nonfinite_ranks(i) < 0 || m.nonfinite_ranks(i) >= kMaxWorldSize) {
      return absl::InvalidArgumentError(absl::StrCat("metrics.nonfinite_ranks[", i,
                                                     "]: must be a rank in [0, ", kMaxWorldSize,
                                                     "), got ", m.nonfinite_ranks(i)));
    }
  }
  for (int i = 0; i < request.sites_size(); ++i) {
    const v1::SiteStats& s = request.sites(i);
    if (s.layer().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("sites[", i, "].layer: empty"));
    }
    FP8RT_RETURN_IF_ERROR(
        CheckLength(absl::StrCat("sites[", i, "].layer"), s.layer(), kMaxNameBytes));
    if (s.tensor() == v1::TENSOR_ROLE_UNSPECIFIED || !v1::TensorRole_IsValid(s.tensor())) {
      const std::string what = s.tensor() == v1::TENSOR_ROLE_UNSPECIFIED
                                   ? std::string("not set")
                                   : absl::StrCat(s.tensor(), " is not a tensor role");
      return absl::InvalidArgumentError(
          absl::StrCat("sites[", i, "].tensor: ", what, " (input, weight or grad_output)"));
    }
    if (s.expert() < -1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sites[", i, "].expert: must be -1 (not an expert layer) or >= 0, got ", s.expert()));
    }
  }
  for (int i = 0; i < request.comm_size(); ++i) {
    const v1::CommBytes& c = request.comm(i);
    if (c.op().empty() || c.dtype().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("comm[", i, "].", c.op().empty() ? "op" : "dtype", ": empty"));
    }
    if (c.bytes() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("comm[", i, "].bytes: must be >= 0, got ", c.bytes()));
    }
    FP8RT_RETURN_IF_ERROR(CheckLength(absl::StrCat("comm[", i, "].op"), c.op(), kMaxNameBytes));
    FP8RT_RETURN_IF_ERROR(
        CheckLength(absl::StrCat("comm[", i, "].dtype"), c.dtype(), kMaxNameBytes));
  }
  for (int i = 0; i < request.experts_size(); ++i) {
    const v1::ExpertLoad& e = request.experts(i);
    if (e.layer().empty() || e.expert() < 0 || e.tokens() < 0 || e.dropped() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "experts[", i, "]: needs a layer and non-negative expert, tokens and dropped"));
    }
    FP8RT_RETURN_IF_ERROR(
        CheckLength(absl::StrCat("experts[", i, "].layer"), e.layer(), kMaxNameBytes));
  }
  for (int i = 0; i < request.memory_size(); ++i) {
    const v1::MemoryPeak& p = request.memory(i);
    if (p.category().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("memory[", i, "].category: empty"));
    }
    FP8RT_RETURN_IF_ERROR(CheckLength(absl::StrCat("memory[", i, "].category"), p.category(),
                                      kMaxMemoryCategoryBytes));
    if (p.peak_bytes() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("memory[", i, "].peak_bytes: must be >= 0, got ", p.peak_bytes()));
    }
  }
  FP8RT_RETURN_IF_ERROR(CheckStep("recipe_applied_step", request.recipe_applied_step()));
  FP8RT_RETURN_IF_ERROR(CheckStep("reports_dropped", request.reports_dropped()));

  const std::string& id = request.run_id();
  bool urgent = false;
  {
    absl::MutexLock lock(&mu_);
    FP8RT_ASSIGN_OR_RETURN(RunEntry * run, GetLocked(id));
    const int64_t events_before = next_event_id_;
    v1::RunRecord& rec = run->record;
    v1::Run* r = rec.mutable_run();
    *r->mutable_last_step() = m;
    rec.set_latest_step(std::max(rec.latest_step(), m.step()));
    if (m.has_val_loss()) {
      r->set_val_loss(m.val_loss());
      r->set_val_loss_step(m.step());
      metrics_->SetEvalLoss(id, m.val_loss());
    }
    if (m.skipped()) {
      r->set_skipped_steps(r->skipped_steps() + 1);
      // The message names the ranks that saw the NaN/Inf (workers that do not say: none named).
      const std::string where =
          m.nonfinite_ranks().empty()
              ? ""
              : absl::StrCat(m.nonfinite_ranks_size() == 1 ? " on rank " : " on ranks ",
                             absl::StrJoin(m.nonfinite_ranks(), ", "));
      AddEventLocked(run, "step_skipped", m.step(),
                     absl::StrCat("step ", m.step(), " skipped: non-finite values", where,
                                  " (no optimizer update)"));
    }
    if (!request.sites().empty()) {
      rec.mutable_layers()->set_step(m.step());
      *rec.mutable_layers()->mutable_sites() = request.sites();
      metrics_->SetSites(id, m.step(), {request.sites().begin(), request.sites().end()});
      ApplyHealthPolicyLocked(run, request);
    }
    for (const v1::ExpertLoad& e : request.experts()) metrics_->SetExpertLoad(id, e);
    if (!request.memory().empty()) {
      metrics_->SetMemoryPeaks(id, {request.memory().begin(), request.memory().end()});
    }
    for (const v1::CommBytes& c : request.comm()) {
      int64_t& last = run->comm_last[{c.op(), c.dtype()}];
      // Cumulative since the workers (re)started: a drop means they restarted.
      metrics_->AddCommBytes(id, c.op(), c.dtype(),
                             c.bytes() >= last ? c.bytes() - last : c.bytes());
      last = c.bytes();
    }
    if (request.recipe_applied_step() > 0) {
      auto* versions = rec.mutable_recipes();
      v1::RecipeVersion* applied = &*versions->rbegin();
      for (v1::RecipeVersion& v : *versions) {
        if (v.version() == m.recipe_version()) applied = &v;
      }
      if (applied->applied_step() == 0) {
        applied->set_applied_step(request.recipe_applied_step());
        AddEventLocked(run, "recipe_applied", request.recipe_applied_step(),
                       absl::StrCat("recipe version ", applied->version(), " applied at step ",
                                    request.recipe_applied_step(), " (scheduled for step ",
                                    applied->effective_step(), ")"));
      }
    }
    if (m.step() >= r->spec().train().steps() &&
        (r->state() == v1::RUN_STATE_RUNNING || r->state() == v1::RUN_STATE_STOPPING)) {
      SetStateLocked(run, v1::RUN_STATE_FINISHED);
      AddEventLocked(run, "run_finished", m.step(),
                     absl::StrFormat("reached train.steps = %d (loss %.4f)",
                                     r->spec().train().steps(), m.loss()));
    }
    MarkChangedLocked(run);
    metrics_->SetStep(id, m);
    metrics_->SetSkippedSteps(id, r->skipped_steps());
    if (request.reports_dropped() > r->reports_dropped()) {
      r->set_reports_dropped(request.reports_dropped());
    }
    metrics_->SetReportsDropped(id, r->reports_dropped());
    urgent = next_event_id_ != events_before;
  }
  if (urgent) Flush(id);
  return absl::OkStatus();
}

void Controller::ApplyHealthPolicyLocked(RunEntry* run, const v1::ReportStepRequest& request) {
  const v1::RunSpec& spec = run->record.run().spec();
  const v1::RunSpec::Health& health = spec.health();
  const int intervals = std::max(1, health.intervals());
  const int64_t step = request.metrics().step();
  std::map<std::string, int> saturation, underflow;  // the new streaks
  std::set<std::string> unhealthy;                     // layers above a threshold in this report
  for (const v1::SiteStats& site : request.sites()) {
    const std::string name = SiteName(site);
    const struct {
      const char* what;
      double threshold;
      double ratio;
      std::map<std::string, int>* old_streaks;
      std::map<std::string, int>* new_streaks;
    } checks[] = {
        {"saturation", health.saturation_threshold(), site.saturation_ratio(),
         &run->saturation_streak, &saturation},
        {"underflow", health.underflow_threshold(), site.underflow_ratio(), &run->underflow_streak,
         &underflow},
    };
    for (const auto& c : checks) {
      if (!(c.threshold > 0 && c.ratio > c.threshold)) continue;
      unhealthy.insert(site.layer());
      const auto it = c.old_streaks->find(name);
      const int streak = (it == c.old_streaks->end() ? 0 : it->second) + 1;
      (*c.new_streaks)[name] = streak;
      if (streak != intervals) continue;  // once per streak
      // Percentages with two decimals, or two significant digits below 0.01%.
      auto percent = [](double ratio) {
        return ratio * 100 >= 0.01 ? absl::StrFormat("%.2f%%", ratio * 100)
                                   : absl::StrFormat("%.2g%%", ratio * 100);
      };
      const std::string finding =
          absl::StrFormat("%s: %s %s above %s for %d intervals", name, c.what, percent(c.ratio),
                          percent(c.threshold), intervals);
      AddEventLocked(run, "fp8_health", step, finding);
      TakeHealthActionLocked(run, site.layer(), step, finding);
    }
  }
  run->saturation_streak = std::move(saturation);
  run->underflow_streak = std::move(underflow);
  PromoteHealthyLayersLocked(run, step, unhealthy);
}

void Controller::TakeHealthActionLocked(RunEntry* run, const std::string& layer, int64_t step,
                                        const std::string& finding) {
  using Health = v1::RunSpec::Health;
  using Precision = v1::RunSpec::Precision;
  const v1::RunSpec& spec = run->record.run().spec();
  const Health& health = spec.health();
  const Health::Action action = health.action() != Health::ACTION_UNSPECIFIED ? health.action()
                                : health.demote()                            ? Health::ACTION_DEMOTE
                                                                              : Health::ACTION_REPORT;
  if (action == Health::ACTION_REPORT || !IsBlockLayer(layer, spec) ||
      run->health_actions.contains(layer)) {
    return;
  }
  v1::Recipe recipe = NewestRecipeLocked(*run).recipe();
  const auto& excluded = recipe.exclude();
  const auto& demoted = run->record.demoted_layers();
  if (std::find(excluded.begin(), excluded.end(), layer) != excluded.end() ||
      std::find(demoted.begin(), demoted.end(), layer) != demoted.end()) {
    return;  // already out of FP8
  }
  // The lead is counted from the newest step reported; overflow-safe (steps are capped).
  const int64_t effective = run->record.latest_step() + options_.recipe_lead_steps;
  RunEntry::HealthAction taken;
  taken.effective_step = effective;
  std::string kind, what;
  if (action == Health::ACTION_DEMOTE) {
    recipe.add_exclude(layer);
    taken.excluded = true;
    kind = "layer_demoted";
    what = absl::StrCat(layer, " leaves FP8 (BF16 from step ", effective);
  } else {
    // An override in front of the list (the first match wins) carrying the layer's whole
    // effective recipe, so that only the one field changes.
    const Precision now = LayerPrecision(WithRecipe(spec, recipe).precision(), layer);
    Precision::Override o;
    o.set_layers(layer);
    o.set_mode(Precision::MODE_FP8);
    o.set_scaling(now.scaling());
    o.set_format(now.format());
    o.set_margin(now.margin());
    o.set_amax_history_len(now.amax_history_len());
    o.set_amax_compute_algo(now.amax_compute_algo());
    if (action == Health::ACTION_RAISE_MARGIN) {
      const int raised =
          std::min(32, now.margin() + (health.margin_step() > 0 ? health.margin_step() : 2));
      o.set_margin(raised);
      what = absl::StrCat(layer, ": margin ", now.margin(), " -> ", raised, " (from step ",
                          effective);
    } else {
      o.set_scaling(Precision::SCALING_BLOCK);
      what = absl::StrCat(layer, ": block scaling (from step ", effective);
    }
    if (o.margin() == now.margin() && o.scaling() == now.scaling()) {
      taken.failed = true;
      run->health_actions[layer] = taken;
      AddEventLocked(run, "health_action_failed", step,
                     absl::StrCat(layer, ": nothing left to change (margin ", now.margin(),
                                  ", the most there is 32): ", finding));
      return;
    }
    recipe.mutable_overrides()->Add(std::move(o));
    std::rotate(recipe.mutable_overrides()->rbegin(), recipe.mutable_overrides()->rbegin() + 1,
                recipe.mutable_overrides()->rend());
    taken.added = recipe.overrides(0);
    // The policy's recipe is checked as a user's would be (count, shapes block scaling needs).
    const absl::Status valid = ValidateRecipe(recipe, spec, run->record.run().world_size());
    if (!valid.ok()) {
      taken.failed = true;
      run->health_actions[layer] = taken;
      AddEventLocked(run, "health_action_failed", step,
                     absl::StrCat(what, ") refused: ", valid.message(), ": ", finding));
      return;
    }
    kind = "layer_recipe_changed";
  }
  const v1::RecipeVersion& v = AddRecipeLocked(run, recipe, effective, "health-policy", finding);
  if (taken.excluded) run->record.add_demoted_layers(layer);
  run->health_actions[layer] = taken;
  AddEventLocked(run, kind, step,
                 absl::StrCat(what, ", recipe version ", v.version(), "): ", finding));
}

void Controller::PromoteHealthyLayersLocked(RunEntry* run, int64_t step,
                                            const std::set<std::string>& unhealthy) {
  const int promote_after = run->record.run().spec().health().promote_after();
  for (auto it = run->health_actions.begin(); it != run->health_actions.end();) {
    RunEntry::HealthAction& a = it->second;
    const std::string& layer = it->first;
    if (a.failed || step < a.effective_step) {
      ++it;
      continue;
    }
    a.healthy = unhealthy.contains(layer) ? 0 : a.healthy + 1;
    if (promote_after <= 0 || a.healthy < promote_after) {
      ++it;
      continue;
    }
    // The recipe as it is now, without what the action added (other changes since are kept).
    v1::Recipe recipe = NewestRecipeLocked(*run).recipe();
    if (a.excluded) {
      auto* ex = recipe.mutable_exclude();
      ex->erase(std::remove(ex->begin(), ex->end(), layer), ex->end());
      auto* demoted = run->record.mutable_demoted_layers();
      demoted->erase(std::remove(demoted->begin(), demoted->end(), layer), demoted->end());
    } else {
      auto* ov = recipe.mutable_overrides();
      for (int i = 0; i < ov->size(); ++i) {
        if (google::protobuf::util::MessageDifferencer::Equals(ov->Get(i), a.added)) {
          ov->DeleteSubrange(i, 1);
          break;
        }
      }
    }
    const int64_t effective = run->record.latest_step() + options_.recipe_lead_steps;
    const std::string reason = absl::StrCat(layer, ": healthy for ", a.healthy,
                                            " intervals (health.promote_after)");
    const v1::RecipeVersion& v = AddRecipeLocked(run, recipe, effective, "health-policy", reason);
    AddEventLocked(run, "layer_promoted", step,
                   absl::StrCat(layer, " back to its recipe before the health action (from step ",
                                effective, ", recipe version ", v.version(), "): ", reason));
    it = run->health_actions.erase(it);
  }
}

// ---------------------------------------------------------------------------------------------
// Checkpoints.

absl::StatusOr<v1::BeginCheckpointResponse> Controller::BeginCheckpoint(
    const v1::BeginCheckpointRequest& request) {
  FP8RT_RETURN_IF_ERROR(ValidateRunId(request.run_id()));
  FP8RT_RETURN_IF_ERROR(CheckStep("step", request.step()));
  const std::string& id = request.run_id();
  std::string run_dir;
  {
    absl::MutexLock lock(&mu_);
    FP8RT_ASSIGN_OR_RETURN(RunEntry * run, GetLocked(id));
    if (run->pending && run->pending->committing) {
      return absl::FailedPreconditionError(absl::StrCat("run ", id, ": the checkpoint of step ",
                                                        run->pending->step, " is being committed"));
    }
    run_dir = run->record.run().run_dir();
  }
  // Removing a stale temp folder of the same step may take a while: no lock.
  FP8RT_ASSIGN_OR_RETURN(std::string temp_dir, CheckpointDir(run_dir).PrepareTemp(request.step()));
  {
    absl::MutexLock lock(&mu_);
    FP8RT_ASSIGN_OR_RETURN(RunEntry * run, GetLocked(id));
    if (run->pending && run->pending->committing) {
      return absl::FailedPreconditionError(absl::StrCat("run ", id, ": the checkpoint of step ",
                                                        run->pending->step, " is being committed"));
    }
    run->pending.emplace();
    run->pending->step = request.step();
    run->pending->temp_dir = temp_dir;
    if (run->record.save_requested()) {
      run->record.set_save_requested(false);
      MarkChangedLocked(run);
    }
  }
  v1::BeginCheckpointResponse response;
  response.set_temp_dir(temp_dir);
  return response;
}

absl::StatusOr<v1::AckShardResponse> Controller::AckShard(const v1::AckShardRequest& request) {
  FP8RT_RETURN_IF_ERROR(ValidateRunId(request.run_id()));
  FP8RT_RETURN_IF_ERROR(CheckStep("step", request.step()));
  const std::string& id = request.run_id();
  v1::CheckpointManifest manifest;
  std::string run_dir;
  int keep = 1;
  std::string abandoned_temp;  // set when a rank reports that the save failed
  {
    absl::MutexLock lock(&mu_);
    FP8RT_ASSIGN_OR_RETURN(RunEntry * run, GetLocked(id));
    const v1::Run& r = run->record.run();
    FP8RT_RETURN_IF_ERROR(CheckRankInWorld(request.rank(), r.world_size(), id));
    const std::string expected = ShardFileName(request.rank());
    if (request.file() != expected) {
      return absl::InvalidArgumentError(absl::StrCat("file: rank ", request.rank(), " writes ",
                                                     expected, ", got ",
                                                     QuoteBounded(request.file())));
    }
    if (!run->pending || run->pending->step != request.step()) {
      return absl::FailedPreconditionError(
          absl::StrCat("run ", id, ": no checkpoint of step ", request.step(),
                       " in progress (BeginCheckpoint starts one)"));
    }
    PendingCheckpoint& p = *run->pending;
    if (p.committing) {
      return absl::FailedPreconditionError(absl::StrCat("run ", id, ": the checkpoint of step ",
                                                        p.step, " is already being committed"));
    }
    if (!request.error().empty()) {
      // A rank could not write its shard: the save is abandoned, its temp folder removed below.
      abandoned_temp = CheckpointDir(r.run_dir()).TempDir(request.step());
      run->pending.reset();
      AddEventLocked(run, "checkpoint_failed", request.step(),
                     absl::StrCat("save of step ", request.step(), " abandoned by rank ",
                                  request.rank(), ": ", request.error()));
    } else {
      v1::CheckpointShard& shard = p.shards[request.rank()];  // a retried ack replaces the first
      shard.set_rank(request.rank());
      shard.set_file(request.file());
      shard.set_size(request.size());
      shard.set_xxh64(request.xxh64());
      if (request.rank() == 0) p.data_position = request.data_position();
      if (static_cast<int>(p.shards.size()) < r.world_size()) return v1::AckShardResponse();

      // The last acknowledgement: commit, without the lock (Commit hashes every shard).
      p.committing = true;
      manifest.set_step(p.step);
      manifest.set_world_size(r.world_size());
      manifest.set_dp(r.spec().parallel().dp());
      manifest.set_tp(r.spec().parallel().tp());
      manifest.set_ep(r.spec().parallel().ep());
      for (const auto& [rank, s] : p.shards) *manifest.add_shards() = s;
      *manifest.mutable_spec() = r.spec();
      manifest.set_created_unix_ms(NowUnixMs());
      manifest.set_data_position(p.data_position);
      run_dir = r.run_dir();
      keep = std::max(1, r.spec().checkpoint().keep());
    }
  }
  if (!abandoned_temp.empty()) {
    Flush(id);
    std::error_code ec;
    fs::remove_all(abandoned_temp, ec);
    if (ec) {
      return absl::ErrnoToStatus(ec.value(),
                                 absl::StrCat("run ", id, ": cannot remove ", abandoned_temp,
                                              " of the abandoned save: ", ec.message()));
    }
    return v1::AckShardResponse();
  }
  const CheckpointDir dir(run_dir);
  const absl::Status committed = dir.Commit(manifest);
  absl::StatusOr<std::vector<int64_t>> pruned = std::vector<int64_t>();
  // Retention runs only after a successful commit and keeps >= 1: never the newest checkpoint.
  if (committed.ok()) pruned = dir.Prune(keep);
  if (!committed.ok()) {
    // Nothing partial is left: Commit leaves its temp folder, the controller owns the save.
    std::error_code ec;
    fs::remove_all(dir.TempDir(manifest.step()), ec);
  }
  InjectKill(FaultPoint::kControllerCommitted, manifest.step());  // before the state is persisted

  {
    absl::MutexLock lock(&mu_);
    FP8RT_ASSIGN_OR_RETURN(RunEntry * run, GetLocked(id));
    run->pending.reset();
    const int64_t step = manifest.step();
    if (!committed.ok()) {
      AddEventLocked(run, "checkpoint_failed", step,
                     absl::StrCat("commit of step ", step, " failed: ", committed.message()));
    } else {
      v1::CommittedCheckpoint c;
      c.mutable_info()->set_step(step);
      c.mutable_info()->set_dir(dir.CommittedDir(step));
      c.mutable_info()->set_created_unix_ms(manifest.created_unix_ms());
      c.mutable_info()->set_bytes(ShardBytes(manifest.shards()));
      *c.mutable_shards() = manifest.shards();
      c.set_data_position(manifest.data_position());
      auto* cps = run->record.mutable_checkpoints();
      std::set<int64_t> gone = {step};
      if (pruned.ok()) gone.insert(pruned->begin(), pruned->end());
      cps->erase(std::remove_if(cps->begin(), cps->end(),
                                [&](const v1::CommittedCheckpoint& x) {
                                  return gone.contains(x.info().step());
                                }),
                 cps->end());
      InsertByStep(std::move(c), cps);
      const v1::CheckpointInfo& newest = cps->rbegin()->info();
      run->record.mutable_run()->set_last_checkpoint_step(newest.step());
      metrics_->SetCheckpoint(id, newest.step(), newest.created_unix_ms());
      std::string message =
          absl::StrCat("step ", step, " committed: ", manifest.shards_size(), " shards, ",
                       ShardBytes(manifest.shards()), " bytes, in ", dir.CommittedDir(step));
      if (pruned.ok() && !pruned->empty()) {
        absl::StrAppend(&message, "; retention (keep ", keep, ") deleted step",
                        pruned->size() > 1 ? "s " : " ", absl::StrJoin(*pruned, ", "));
      }
      AddEventLocked(run, "checkpoint_committed", step, message);
      if (!pruned.ok()) {
        AddEventLocked(
            run, "checkpoint_failed", step,
            absl::StrCat("retention after step ", step, " failed: ", pruned.status().message()));
      }
    }
  }
  Flush(id);
  FP8RT_RETURN_IF_ERROR(committed);
  v1::AckShardResponse response;
  response.set_committed(true);
  return response;
}

absl::StatusOr<v1::ListCheckpointsResponse> Controller::ListCheckpoints(
    const v1::ListCheckpointsRequest& request) {
  FP8RT_RETURN_IF_ERROR(ValidateRunId(request.run_id()));
  std::vector<v1::CheckpointInfo> recorded;
  std::string run_dir;
  {
    absl::MutexLock lock(&mu_);
    FP8RT_ASSIGN_OR_RETURN(RunEntry * run, GetLocked(request.run_id()));
    for (const v1::CommittedCheckpoint& c : run->record.checkpoints()) recorded.push_back(c.info());
    run_dir = run->record.run().run_dir();
  }
  // A recorded checkpoint counts only while its committed folder is there.
  FP8RT_ASSIGN_OR_RETURN(std::vector<int64_t> on_disk, CheckpointDir(run_dir).ListCommitted());
  const std::set<int64_t> present(on_disk.begin(), on_disk.end());
  v1::ListCheckpointsResponse response;
  for (const v1::CheckpointInfo& info : recorded) {
    if (present.contains(info.step())) *response.add_checkpoints() = info;
  }
  return response;
}

absl::Status Controller::SaveCheckpoint(const v1::SaveCheckpointRequest& request) {
  FP8RT_RETURN_IF_ERROR(ValidateRunId(request.run_id()));
  {
    absl::MutexLock lock(&mu_);
    FP8RT_ASSIGN_OR_RETURN(RunEntry * run, GetLocked(request.run_id()));
    const v1::RunState state = run->record.run().state();
    if (state != v1::RUN_STATE_RUNNING) {
      return absl::FailedPreconditionError(absl::StrCat(
          "run ", request.run_id(), " is ", StateName(state), ": no workers to save a checkpoint"));
    }
    run->record.set_save_requested(true);
    AddEventLocked(run, "checkpoint_requested", run->record.latest_step(),
                   "a checkpoint was requested: the workers save at their next step");
  }
  Flush(request.run_id());
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// The Runs service.

v1::ListRunsResponse Controller::ListRuns() {
  absl::MutexLock lock(&mu_);
  v1::ListRunsResponse response;
  for (const auto& [id, run] : runs_) *response.add_runs() = RunViewLocked(*run);
  return response;
}

absl::StatusOr<v1::Run> Controller::GetRun(const v1::GetRunRequest& request) {
  FP8RT_RETURN_IF_ERROR(ValidateRunId(request.run_id()));
  absl::MutexLock lock(&mu_);
  FP8RT_ASSIGN_OR_RETURN(RunEntry * run, GetLocked(request.run_id()));
  return RunViewLocked(*run);
}

absl::StatusOr<v1::Run> Controller::StopRun(const v1::StopRunRequest& request) {
  FP8RT_RETURN_IF_ERROR(ValidateRunId(request.run_id()));
  v1::Run view;
  {
    absl::MutexLock lock(&mu_);
    FP8RT_ASSIGN_OR_RETURN(RunEntry * run, GetLocked(request.run_id()));
    // Stopping a run that is not running changes nothing.
    if (run->record.run().state() == v1::RUN_STATE_RUNNING) {
      SetStateLocked(run, v1::RUN_STATE_STOPPING);
      AddEventLocked(run, "run_stopped", run->record.latest_step(),
                     "stop requested: the workers save and exit");
    }
    view = RunViewLocked(*run);
  }
  Flush(request.run_id());
  return view;
}

absl::StatusOr<v1::GetLayersResponse> Controller::GetLayers(const v1::GetLayersRequest& request) {
  FP8RT_RETURN_IF_ERROR(ValidateRunId(request.run_id()));
  absl::MutexLock lock(&mu_);
  FP8RT_ASSIGN_OR_RETURN(RunEntry * run, GetLocked(request.run_id()));
  v1::GetLayersResponse layers = run->record.layers();
  // The recipe in force: the newest version the workers applied, else the spec's (version 1).
  const v1::RecipeVersion* in_force = &*run->record.recipes().begin();
  for (const v1::RecipeVersion& v : run->record.recipes()) {
    if (v.applied_step() > 0 || v.version() == 1) in_force = &v;
  }
  const v1::RunSpec spec = WithRecipe(run->record.run().spec(), in_force->recipe());
  layers.clear_recipes();
  for (const std::string& name : LayerNames(spec)) {
    int matched = -1;
    const v1::RunSpec::Precision p = LayerPrecision(spec.precision(), name, &matched);
    v1::LayerRecipe* r = layers.add_recipes();
    r->set_layer(name);
    r->set_mode(p.mode());
    r->set_scaling(p.scaling());
    r->set_format(p.format());
    r->set_margin(p.margin());
    r->set_amax_history_len(p.amax_history_len());
    r->set_amax_compute_algo(p.amax_compute_algo());
    const auto& excluded = spec.precision().exclude();
    r->set_override_index(std::find(excluded.begin(), excluded.end(), name) != excluded.end()
                              ? -2
                              : matched);
    r->set_recipe_version(in_force->version());
  }
  return layers;
}

absl::StatusOr<v1::RecipeVersion> Controller::GetRecipe(const v1::GetRecipeRequest& request) {
  FP8RT_RETURN_IF_ERROR(ValidateRunId(request.run_id()));
  absl::MutexLock lock(&mu_);
  FP8RT_ASSIGN_OR_RETURN(RunEntry * run, GetLocked(request.run_id()));
  if (request.version() == 0) return NewestRecipeLocked(*run);
  for (const v1::RecipeVersion& v : run->record.recipes()) {
    if (v.version() == request.version()) return v;
  }
  return absl::NotFoundError(absl::StrCat("run ", request.run_id(), ": no recipe version ",
                                          request.version(), " (newest ",
                                          NewestRecipeLocked(*run).version(), ")"));
}

absl::StatusOr<v1::RecipeVersion> Controller::UpdateRecipe(const v1::UpdateRecipeRequest& request) {
  FP8RT_RETURN_IF_ERROR(ValidateRunId(request.run_id()));
  if (!request.has_recipe()) {
    return absl::InvalidArgumentError(
        "recipe: required (the whole new recipe: GetRecipe, change it, UpdateRecipe)");
  }
  if (request.reason().size() > kMaxReasonBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("reason: at most ", kMaxReasonBytes, " bytes, got ", request.reason().size()));
  }
  FP8RT_RETURN_IF_ERROR(
      CheckCount("recipe.exclude", request.recipe().exclude_size(), kMaxRecipeExcludes));
  FP8RT_RETURN_IF_ERROR(CheckCount("recipe.overrides", request.recipe().overrides_size(),
                                   kMaxPrecisionOverrides));
  v1::RecipeVersion result;
  {
    absl::MutexLock lock(&mu_);
    FP8RT_ASSIGN_OR_RETURN(RunEntry * run, GetLocked(request.run_id()));
    const v1::Run& r = run->record.run();
    FP8RT_RETURN_IF_ERROR(ValidateRecipe(request.recipe(), r.spec(), r.world_size()));
    const v1::Recipe previous = NewestRecipeLocked(*run).recipe();
    const int64_t effective = run->record.latest_step() + options_.recipe_lead_steps;
    const std::string reason = request.reason().empty() ? "user update" : request.reason();
    result = AddRecipeLocked(run, request.recipe(), effective, "user", reason);
    AddEventLocked(
        run, "recipe_updated", run->record.latest_step(),
        absl::StrCat("recipe version ", result.version(), " from step ", effective, ": ",
                     DescribeRecipeChange(previous, request.recipe()), " (", reason, ")"));
  }
  Flush(request.run_id());
  return result;
}

absl::Status Controller::WatchEvents(const v1::WatchEventsRequest& request,
                                     const std::function<bool()>& cancelled,
                                     const std::function<bool(const v1::Event&)>& send) {
  const std::string& id = request.run_id();
  if (!id.empty()) FP8RT_RETURN_IF_ERROR(ValidateRunId(id));
  int64_t last_sent = 0;
  std::vector<v1::Event> batch;
  absl::MutexLock lock(&mu_);
  if (!id.empty() && FindLocked(id) == nullptr) {
    return absl::NotFoundError(absl::StrCat("run ", id, " not found"));
  }
  while (true) {
    batch.clear();
    // Events are kept in id order per run: take those after last_sent from each watched run.
    for (const auto& [run_id, run] : runs_) {
      if (!id.empty() && run_id != id) continue;
      const auto& events = run->record.events();
      auto it = std::upper_bound(events.begin(), events.end(), last_sent,
                                 [](int64_t value, const v1::Event& e) { return value < e.id(); });
      batch.insert(batch.end(), it, events.end());
    }
    if (batch.empty()) {
      if (shutting_down_) return absl::UnavailableError("the controller is shutting down");
      if (cancelled()) return absl::OkStatus();
      events_cv_.WaitWithTimeout(&mu_, absl::Milliseconds(200));
      continue;
    }
    std::sort(batch.begin(), batch.end(),
              [](const v1::Event& a, const v1::Event& b) { return a.id() < b.id(); });
    mu_.Unlock();
    bool open = true;
    for (const v1::Event& e : batch) {
      if (!(open = send(e))) break;
      last_sent = e.id();
    }
    mu_.Lock();
    if (!open || cancelled()) return absl::OkStatus();
  }
}

// ---------------------------------------------------------------------------------------------
// Run tokens and bounds.

absl::Status Controller::CheckRoomForRunLocked() const {
  if (static_cast<int64_t>(runs_.size()) < options_.max_runs) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("runs: the controller keeps at most ", options_.max_runs,
                   " runs (--max-runs) and has that many; use another state folder for more"));
}

absl::StatusOr<std::string> Controller::CreateRunToken(const std::string& run_id) {
  FP8RT_RETURN_IF_ERROR(ValidateRunId(run_id));
  FP8RT_ASSIGN_OR_RETURN(const std::string token, RandomHexToken());
  const std::string hash = Sha256(token);
  absl::MutexLock lock(&tokens_mu_);
  v1::RunTokens updated = tokens_;
  auto* list = updated.mutable_tokens();
  const int of_run = static_cast<int>(std::count_if(
      list->begin(), list->end(), [&](const v1::RunToken& t) { return t.run_id() == run_id; }));
  if (of_run >= options_.max_run_tokens_per_run) {
    // Revoke the run's oldest token.
    const auto oldest = std::find_if(list->begin(), list->end(),
                                     [&](const v1::RunToken& t) { return t.run_id() == run_id; });
    list->erase(oldest);
  } else if (list->size() >= options_.max_run_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("run tokens: the controller keeps at most ",
                                                     options_.max_run_tokens, " run tokens"));
  }
  v1::RunToken* t = updated.add_tokens();
  t->set_run_id(run_id);
  t->set_sha256(hash);
  t->set_created_unix_ms(NowUnixMs());
  // Persist first: a token that would not survive a restart is not handed out.
  FP8RT_RETURN_IF_ERROR(store_.SaveTokens(updated));
  tokens_ = std::move(updated);
  token_runs_.clear();
  for (const v1::RunToken& x : tokens_.tokens()) token_runs_[x.sha256()] = x.run_id();
  std::fprintf(stderr, "fp8rt-controller: run %s: a run token was created (%d valid)\n",
               run_id.c_str(), of_run >= options_.max_run_tokens_per_run ? of_run : of_run + 1);
  return token;
}

std::optional<std::string> Controller::RunOfToken(std::string_view token) const {
  // The lookup is by the token's hash, so its timing says nothing about how close a guess is.
  const std::string hash = Sha256(token);
  absl::MutexLock lock(&tokens_mu_);
  const auto it = token_runs_.find(hash);
  if (it == token_runs_.end()) return std::nullopt;
  return it->second;
}

// ---------------------------------------------------------------------------------------------
// Monitor and persistence.

void Controller::MonitorLoop() {
  using std::chrono::milliseconds;
  const milliseconds tick =
      std::clamp(options_.heartbeat_timeout / 4, milliseconds(50), milliseconds(500));
  constexpr milliseconds kLazyWriteEvery(1000);
  Clock::time_point last_write = Clock::now();
  while (true) {
    std::vector<std::string> to_write;
    {
      absl::MutexLock lock(&mu_);
      if (!shutting_down_) monitor_cv_.WaitWithTimeout(&mu_, absl::FromChrono(tick));
      if (shutting_down_) return;
      const Clock::time_point now = Clock::now();
      to_write = SweepLocked(now);  // failures are written now
      if (now - last_write >= kLazyWriteEvery) {
        last_write = now;
        for (const auto& [id, run] : runs_) {
          if (run->change_seq != run->persisted_seq) to_write.push_back(id);
        }
      }
    }
    for (const std::string& id : to_write) Flush(id);
  }
}

std::vector<std::string> Controller::SweepLocked(Clock::time_point now) {
  std::vector<std::string> changed;
  for (auto& [id, run] : runs_) {
    std::vector<int> lost;
    // Per lost rank: awaited since the controller's start, or never registered after rank 0.
    std::vector<bool> never_heard, unregistered;
    for (int rank = 0; rank < static_cast<int>(run->ranks.size()); ++rank) {
      RankState& r = run->ranks[rank];
      const bool silent =
          (r.connected || r.awaited) && now - r.last_seen > options_.heartbeat_timeout;
      const bool late = r.registering && now - r.registration_start >
                                             kRegistrationTimeouts * options_.heartbeat_timeout;
      if (silent || late) {
        lost.push_back(rank);
        never_heard.push_back(r.awaited);
        unregistered.push_back(late && !silent);
        r.connected = false;
        r.awaited = false;
        r.registering = false;
      }
    }
    if (lost.empty()) continue;
    changed.push_back(id);
    metrics_->SetWorkersConnected(id, ConnectedLocked(*run));
    const v1::RunState state = run->record.run().state();
    const int64_t step = run->record.latest_step();
    if (state != v1::RUN_STATE_RUNNING) {
      // Workers leave after a run finishes, stops or fails: not a failure of its own.
      AddEventLocked(run.get(), "worker_exited", step,
                     absl::StrCat(lost.size() == 1 ? "rank " : "ranks ", absl::StrJoin(lost, ", "),
                                  " stopped heartbeating (run ", StateName(state), ")"));
      continue;
    }
    const double timeout_s = std::chrono::duration<double>(options_.heartbeat_timeout).count();
    for (size_t i = 0; i < lost.size() && i < kMaxLostEvents; ++i) {
      const RankState& r = run->ranks[lost[i]];
      const std::string who =
          r.hostname.empty() ? "" : absl::StrCat(" (", r.hostname, ", pid ", r.pid, ")");
      const std::string message =
          unregistered[i]
              ? absl::StrFormat(
                    "rank %d did not register within %.1f s of rank 0 (%d x the heartbeat "
                    "timeout)",
                    lost[i], kRegistrationTimeouts * timeout_s, kRegistrationTimeouts)
          : never_heard[i]
              ? absl::StrFormat(
                    "rank %d not heard from since the controller started (timeout "
                    "%.1f s)",
                    lost[i], timeout_s)
              : absl::StrFormat(
                    "rank %d%s not heard from for %.1f s (timeout %.1f s, last step "
                    "%d)",
                    lost[i], who, std::chrono::duration<double>(now - r.last_seen).count(),
                    timeout_s, r.step);
      AddEventLocked(run.get(), "worker_lost", r.step, message);
    }
    if (lost.size() > kMaxLostEvents) {
      AddEventLocked(run.get(), "worker_lost", step,
                     absl::StrCat("and ", lost.size() - kMaxLostEvents, " more ranks"));
    }
    SetStateLocked(run.get(), v1::RUN_STATE_FAILED);
    AddEventLocked(run.get(), "run_failed", step,
                   absl::StrCat(lost.size(), " of ", run->ranks.size(),
                                " ranks lost: the run FAILED (restart it with --resume)"));
  }
  return changed;
}

void Controller::Flush(const std::string& run_id) {
  absl::MutexLock write_lock(&write_mu_);
  v1::RunRecord snapshot;
  uint64_t seq = 0;
  {
    absl::MutexLock lock(&mu_);
    const RunEntry* run = FindLocked(run_id);
    if (run == nullptr || run->change_seq == run->persisted_seq) return;
    snapshot = run->record;
    seq = run->change_seq;
  }
  const absl::Status s = store_.Save(snapshot);
  absl::MutexLock lock(&mu_);
  RunEntry* run = FindLocked(run_id);  // runs are never removed
  if (s.ok()) {
    if (run->write_failing) {
      std::fprintf(stderr, "fp8rt-controller: run %s: state saved again to %s\n", run_id.c_str(),
                   store_.PathOf(run_id).c_str());
    }
    run->write_failing = false;
    run->persisted_seq = seq;
  } else if (!run->write_failing) {
    // Kept in memory and retried by the monitor; reported once per failure streak.
    run->write_failing = true;
    std::fprintf(stderr, "fp8rt-controller: run %s: cannot save its state (retrying): %s\n",
                 run_id.c_str(), std::string(s.message()).c_str());
  }
}

void Controller::FlushAll() {
  std::vector<std::string> ids;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, run] : runs_) ids.push_back(id);
  }
  for (const std::string& id : ids) Flush(id);
}

}  // namespace fp8rt::controller
