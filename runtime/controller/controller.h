// Controller: the state and rules of the control plane (DESIGN.md section 6), behind the gRPC
// services of proto/fp8rt/v1/control.proto. service.h adapts it to gRPC (authentication,
// Status conversion); this class knows nothing of gRPC.
//
// What it owns:
//   - the runs, each a v1::RunRecord (persisted through StateStore) plus what only lives in
//     memory: which ranks are connected, the checkpoint being saved, the health policy's counters;
//   - a monitor thread that marks ranks silent for longer than the heartbeat timeout as lost
//     (a RUNNING run then FAILS; after a controller restart, the ranks of a RUNNING run have one
//     timeout to heartbeat) and writes run records whose step metrics changed;
//   - the Prometheus series (ControllerMetrics) of every run.
//
// Rules, per RPC (errors: InvalidArgument naming the field, NotFound for an unknown run,
// FailedPrecondition for a call out of order):
//   Register         rank 0 creates or restarts the run (its spec is validated; a fresh start of a
//                    run with committed checkpoints is refused, resume finds the newest checkpoint
//                    that verifies and moves newer refused ones aside as refused-step-NNNNNNNN);
//                    other ranks join a RUNNING run and get the same answer.
//   Heartbeat        marks the rank alive; answers the newest recipe, stop, save_checkpoint.
//   ReportStep       rank 0's step metrics, FP8 site table, communication bytes; finishes the run
//                    at train.steps; records recipe_applied; runs the FP8 health policy.
//   BeginCheckpoint  prepares <run_dir>/checkpoints/.tmp-step-N (CheckpointDir::PrepareTemp).
//   AckShard         records one rank's shard; the last one commits (manifest, rename), prunes
//                    to checkpoint.keep and answers committed = true. Nothing is listed or
//                    committed before every rank has acknowledged.
//                    An ack with `error` set (a rank could not write its shard) abandons the
//                    save: its temp folder is removed and checkpoint_failed recorded; a failed
//                    commit removes it too.
//   UpdateRecipe     validates and schedules a new version at latest step + recipe_lead_steps.
//   WatchEvents      existing events, then live ones until cancelled or shutdown.
//   CreateRunToken   a token for one run (service.h decides who may call what with it).
//
// Bounds (what a client can make the controller keep): at most max_runs runs, each with at most
// max_events_per_run events, max_recipe_versions_per_run recipe versions, one layer table of at
// most kMaxSitesPerReport sites, max_run_tokens_per_run tokens; requests beyond the k* caps below
// are refused before anything is stored.
//
// Long disk work (verifying checkpoints at resume, committing: both read every shard in full) runs
// without the controller's mutex held, so heartbeats keep being answered meanwhile.
//
// Threads: every public method may be called from any thread concurrently. One mutex (mu_) guards
// all run state; state files are written under write_mu_ (taken before mu_, never after).
#ifndef FP8RT_RUNTIME_CONTROLLER_CONTROLLER_H_
#define FP8RT_RUNTIME_CONTROLLER_CONTROLLER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "fp8rt/v1/control.pb.h"
#include "fp8rt/v1/run_spec.pb.h"
#include "fp8rt/v1/controller_state.pb.h"
#include "runtime/controller/metrics.h"
#include "runtime/controller/state_store.h"

namespace fp8rt::controller {

struct ControllerOptions {
  // Folder of the persistent state (created if missing). Required.
  std::string state_dir;
  // A rank not heard from for longer than this is lost.
  std::chrono::milliseconds heartbeat_timeout{std::chrono::seconds(30)};
  // A recipe update takes effect this many steps after the latest reported step.
  int64_t recipe_lead_steps = 3;
  // Events kept per run (in memory and in its state file).
  int max_events_per_run = 1000;
  // Recipe versions kept per run (the oldest are dropped; the newest is always kept).
  int max_recipe_versions_per_run = 1000;
  // Runs the controller keeps; registering one more is ResourceExhausted.
  int max_runs = 10000;
  // Valid run tokens per run (minting one more revokes the oldest) and in all.
  int max_run_tokens_per_run = 64;
  int max_run_tokens = 16384;
};

// Caps on what one request may carry (InvalidArgument naming the field and the cap beyond them),
// so that a client cannot make the controller store or export unbounded data. Chosen far above
// what production runs send: the largest MoE configurations report about 100 layers x 256
// experts x 2 linears x 3 tensors = 153,600 sites per step and 25,600 expert loads.
inline constexpr int kMaxSitesPerReport = 1 << 18;     // ReportStep.sites (262,144)
inline constexpr int kMaxExpertsPerReport = 1 << 17;   // ReportStep.experts (131,072)
inline constexpr int kMaxCommPerReport = 1024;         // ReportStep.comm
inline constexpr int kMaxMemoryPerReport = 16;         // ReportStep.memory (8 categories today)
inline constexpr size_t kMaxMemoryCategoryBytes = 32;  // ReportStep.memory[].category
inline constexpr int kMaxRecipeExcludes = 16384;       // Recipe.exclude (UpdateRecipe)
inline constexpr size_t kMaxNameBytes = 256;           // a layer, op, dtype or hostname
inline constexpr size_t kMaxPathBytes = 4096;          // RegisterRequest.run_dir
// Every step a request carries (Heartbeat, ReportStep, the checkpoint RPCs) is in [0, kMaxStep]
// (about 10^12 steps), so that the controller's step arithmetic (latest step + recipe lead,
// the health policy's intervals) cannot overflow; recipe_lead_steps is capped the same way.
inline constexpr int64_t kMaxStep = int64_t{1} << 40;

// What the controller keeps per run and rank (internal; guarded by Controller::mu_).
namespace internal {

using Clock = std::chrono::steady_clock;

struct RankState {
  bool connected = false;  // heard from within the timeout
  // A rank of a run that was RUNNING when the controller (re)started: not connected, but lost
  // if it is not heard from within the timeout after the start.
  bool awaited = false;
  // A rank other than 0 that has not registered since rank 0 did (rank 0 waits for every rank to
  // register): lost if it does not within kRegistrationTimeouts heartbeat timeouts of rank 0's
  // registration (ranks heartbeat only from their own registration on).
  bool registering = false;
  Clock::time_point registration_start;  // rank 0's registration (registering)
  Clock::time_point last_seen;           // last heard from, or the controller's start (awaited)
  int64_t step = 0;
  std::string hostname;  // from Register ("" when the rank only heartbeats)
  int pid = 0;
};

struct PendingCheckpoint {
  int64_t step = 0;
  std::string temp_dir;
  std::map<int, v1::CheckpointShard> shards;  // rank -> acknowledged shard
  uint64_t data_position = 0;                 // from rank 0's acknowledgement
  bool committing = false;                    // the last ack is committing it now
};

struct RunEntry {
  v1::RunRecord record;
  std::vector<RankState> ranks;              // world_size entries
  std::optional<PendingCheckpoint> pending;  // the save in progress
  // Health policy: site key -> consecutive intervals above the saturation / underflow threshold.
  std::map<std::string, int> saturation_streak;
  std::map<std::string, int> underflow_streak;
  // Health policy actions in force, by layer: what the action added to the recipe (to take it
  // back on promotion), the step it takes effect and the healthy intervals counted since. Not
  // persisted: after a controller restart no promotion follows (record.demoted_layers still
  // keeps a layer from being demoted twice).
  struct HealthAction {
    bool excluded = false;                     // demote: the layer was added to exclude
    v1::RunSpec::Precision::Override added;    // raise_margin, block_scaling: the override
    int64_t effective_step = 0;
    int healthy = 0;
    bool failed = false;  // the action could not be taken (event health_action_failed)
  };
  std::map<std::string, HealthAction> health_actions;
  // Last cumulative bytes of each (op, dtype), to turn them into counter increments.
  std::map<std::pair<std::string, std::string>, int64_t> comm_last;
  uint64_t change_seq = 0;     // bumped by every change to `record`
  uint64_t persisted_seq = 0;  // change_seq of the record last written
  bool write_failing = false;  // the last write failed (logged once)
};

}  // namespace internal

class Controller {
 public:
  // Loads every run of options.state_dir; DataLoss naming the file for a corrupt one.
  // `metrics` must outlive the controller.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Controller>> Open(
      const ControllerOptions& options, ControllerMetrics* metrics);
  ~Controller();  // Shutdown()

  Controller(const Controller&) = delete;
  Controller& operator=(const Controller&) = delete;

  // Starts the monitor thread.
  void Start();
  // Ends WatchEvents streams (they return Unavailable) and refuses new registrations, so that the
  // gRPC server's Shutdown does not wait for streams. Idempotent.
  void CloseStreams();
  // CloseStreams, stops the monitor thread and writes every changed run record. Call it after
  // the gRPC server has stopped, so that no handler changes a run afterwards. Idempotent.
  void Shutdown();

  // The interval the workers should heartbeat at (RegisterResponse.heartbeat_interval_ms).
  int heartbeat_interval_ms() const;

  // Control.
  [[nodiscard]] absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& request);
  [[nodiscard]] absl::StatusOr<v1::HeartbeatResponse> Heartbeat(
      const v1::HeartbeatRequest& request);
  [[nodiscard]] absl::Status ReportStep(const v1::ReportStepRequest& request);
  [[nodiscard]] absl::StatusOr<v1::BeginCheckpointResponse> BeginCheckpoint(
      const v1::BeginCheckpointRequest& request);
  [[nodiscard]] absl::StatusOr<v1::AckShardResponse> AckShard(const v1::AckShardRequest& request);

  // Runs.
  [[nodiscard]] v1::ListRunsResponse ListRuns();
  [[nodiscard]] absl::StatusOr<v1::Run> GetRun(const v1::GetRunRequest& request);
  [[nodiscard]] absl::StatusOr<v1::Run> StopRun(const v1::StopRunRequest& request);
  [[nodiscard]] absl::StatusOr<v1::GetLayersResponse> GetLayers(
      const v1::GetLayersRequest& request);
  [[nodiscard]] absl::StatusOr<v1::RecipeVersion> GetRecipe(const v1::GetRecipeRequest& request);
  [[nodiscard]] absl::StatusOr<v1::RecipeVersion> UpdateRecipe(
      const v1::UpdateRecipeRequest& request);
  [[nodiscard]] absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(
      const v1::ListCheckpointsRequest& request);
  [[nodiscard]] absl::Status SaveCheckpoint(const v1::SaveCheckpointRequest& request);
  // Calls `send` for each event of the run (every run for an empty run_id), oldest first, then
  // for each new one, until `send` returns false or `cancelled` returns true (OK), or Shutdown
  // (Unavailable). `send` is called without any lock held.
  [[nodiscard]] absl::Status WatchEvents(const v1::WatchEventsRequest& request,
                                         const std::function<bool()>& cancelled,
                                         const std::function<bool(const v1::Event&)>& send);

  // Run tokens. CreateRunToken: a fresh random token (64 hex digits) bound to `run_id` (which need
  // not be registered yet); only its SHA-256 is kept (and persisted). ResourceExhausted beyond
  // max_run_tokens; beyond max_run_tokens_per_run the run's oldest token is revoked.
  [[nodiscard]] absl::StatusOr<std::string> CreateRunToken(const std::string& run_id)
      ABSL_LOCKS_EXCLUDED(tokens_mu_);
  // The run `token` is bound to, or nullopt when it is no run token.
  [[nodiscard]] std::optional<std::string> RunOfToken(std::string_view token) const
      ABSL_LOCKS_EXCLUDED(tokens_mu_);

 private:
  using Clock = internal::Clock;
  using RankState = internal::RankState;
  using PendingCheckpoint = internal::PendingCheckpoint;
  using RunEntry = internal::RunEntry;

  Controller(const ControllerOptions& options, ControllerMetrics* metrics);

  RunEntry* FindLocked(const std::string& run_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<RunEntry*> GetLocked(const std::string& run_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::Run RunViewLocked(const RunEntry& run) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const v1::RecipeVersion& NewestRecipeLocked(const RunEntry& run) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int ConnectedLocked(const RunEntry& run) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddEventLocked(RunEntry* run, const std::string& kind, int64_t step,
                      const std::string& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetStateLocked(RunEntry* run, v1::RunState state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::RecipeVersion& AddRecipeLocked(RunEntry* run, const v1::Recipe& recipe,
                                     int64_t effective_step, const std::string& source,
                                     const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyHealthPolicyLocked(RunEntry* run, const v1::ReportStepRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The health action on `layer` (health.action), after a finding; a new recipe version.
  void TakeHealthActionLocked(RunEntry* run, const std::string& layer, int64_t step,
                              const std::string& finding) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts healthy intervals of the layers acted on; with health.promote_after, gives a layer
  // its recipe back (event layer_promoted).
  void PromoteHealthyLayersLocked(RunEntry* run, int64_t step,
                                  const std::set<std::string>& unhealthy)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExportRunLocked(const RunEntry& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkChangedLocked(RunEntry* run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { ++run->change_seq; }
  // ResourceExhausted when max_runs runs exist.
  absl::Status CheckRoomForRunLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::StatusOr<v1::RegisterResponse> RegisterRank0(const v1::RegisterRequest& request);
  absl::StatusOr<v1::RegisterResponse> RegisterOtherRank(const v1::RegisterRequest& request);
  v1::RegisterResponse RegisterResponseLocked(const RunEntry& run) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Writes the record of `run_id` if it changed since its last write. A failed write is logged
  // (once per streak of failures) and retried by the monitor; the change stays in memory.
  void Flush(const std::string& run_id) ABSL_LOCKS_EXCLUDED(mu_, write_mu_);
  void FlushAll() ABSL_LOCKS_EXCLUDED(mu_, write_mu_);
  void MonitorLoop() ABSL_LOCKS_EXCLUDED(mu_);
  // Marks silent ranks lost; returns the runs whose record changed.
  std::vector<std::string> SweepLocked(Clock::time_point now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ControllerOptions options_;  // fixed after construction
  ControllerMetrics* const metrics_;
  const StateStore store_;

  absl::Mutex write_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // serializes state file writes
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<RunEntry>> runs_ ABSL_GUARDED_BY(mu_);
  int64_t next_event_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  // Run tokens: SHA-256 (raw bytes) -> run id, and the persisted list (oldest first).
  mutable absl::Mutex tokens_mu_;
  std::map<std::string, std::string> token_runs_ ABSL_GUARDED_BY(tokens_mu_);
  v1::RunTokens tokens_ ABSL_GUARDED_BY(tokens_mu_);
  absl::CondVar events_cv_;   // a new event, or shutdown
  absl::CondVar monitor_cv_;  // shutdown
  std::thread monitor_;
};

}  // namespace fp8rt::controller

#endif  // FP8RT_RUNTIME_CONTROLLER_CONTROLLER_H_
