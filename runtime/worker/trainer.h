// The training step loop of one rank (DESIGN.md section 5), standalone under mpirun.
//
// Index:
//   TrainerOptions   run folder, resume, progress printing
//   FaultSpec        test faults from FP8RT_FAULT (NaN/Inf in gradients or activations, kill,
//                    hang), parsed once
//   Trainer          Create (model, data, optimizer, resume), Run (the steps), Step (one step)
//
// One optimizer step reads, top to bottom:
//   model.BeginStep()                       FSDP gathers (FP8 weights with their scales)
//   for each micro-batch:                   loader.Next, model.ForwardBackward (grads +=)
//   (non-finite check)                      a rank whose loss or FP8 amaxes of the step are NaN or
//                                           Inf puts a NaN into its local gradient, so that
//   model.ReduceGrads()                     reduce-scatter over DP (BF16 or FP32 per recipe)
//   optimizer.Step()                        global norm, non-finite skip, clip, AdamW: skips the
//                                           step on every rank
//   model.SyncScaling()                     one MAX all-reduce of every site's amax, states updated
//                                           (a skipped step leaves every scaling state as it was:
//                                           its amaxes come from non-finite values)
//   metrics, per-rank FP8 stats, checkpoint
// A skipped step changes nothing but the step counter and the data position: weights, Adam
// moments, applied_steps and scaling states are bitwise as before it.
//
// Outputs in the run folder (rank 0 unless noted):
//   metrics.jsonl                 one object per optimizer step: step (1-based), loss (mean over
//   the
//                                 global batch), grad_norm (null when skipped), lr, tokens_per_s,
//                                 skipped, nonfinite_ranks (skipped steps only: the ranks that
//                                 saw a NaN/Inf), step_time_s, recipe_version (the live recipe
//                                 version the step ran with; 1 = the spec's), moe_dropped (MoE
//                                 runs: assignments over capacity, all ranks)
//   fp8_stats/rank-NNNNN.jsonl    every rank, every metrics.every steps when
//                                 metrics.per_rank_fp8_stats: one object per FP8 site
//                                 {step, site, amax, scale, underflow_ratio, saturation_ratio}
//                                 for the sites the rank used, and per MoE block
//                                 {step, moe, expert_tokens, dropped}
//   checkpoints/step-NNNNNNNN/    every checkpoint.every steps and at the last step
//                                 (runtime/core/checkpoint_dir.h), checkpoint.keep kept
//
// A fresh run refuses a run folder that already holds metrics or committed checkpoints (pass
// --resume or choose another folder: nothing is overwritten). A resume starts after the newest
// committed checkpoint that verifies; newer ones that fail verification are renamed
// `refused-step-NNNNNNNN` (kept for inspection, never loaded) and the reason is printed; metrics
// lines after the resumed step are dropped so that the files read as one run.
//
// Under a controller, rank 0 also receives the controller's directives (the heartbeat thread
// keeps the newest) and broadcasts them to every rank at the start of each step, so that a new
// recipe version is applied by every rank at the same step: its effective step, or the next step
// when the run is already past it (the applied step is reported back).
//
// Not thread-safe; one per rank. Every rank of the job runs the same calls.
#ifndef FP8RT_RUNTIME_WORKER_TRAINER_H_
#define FP8RT_RUNTIME_WORKER_TRAINER_H_

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fp8rt/v1/run_spec.pb.h"
#include "kernels/ops.h"
#include "parallel/mesh.h"
#include "runtime/model/transformer.h"
#include "runtime/train/data_loader.h"
#include "runtime/train/optimizer.h"
#include "runtime/worker/controller_client.h"

namespace fp8rt::worker {

struct TrainerOptions {
  std::string run_dir;         // where metrics, stats and checkpoints go; created if absent
  bool resume = false;         // continue from the newest committed checkpoint (if any)
  bool print_progress = true;  // rank 0 prints a line every metrics.every steps to stdout
  // Under a controller (fp8rt-worker --controller): every rank registers (rank 0 with the
  // spec), heartbeats, and the controller gives the resume point and recipe updates, receives the
  // step metrics and FP8 statistics (reduced over all ranks) and commits the checkpoints. Empty
  // address: standalone.
  ControllerOptions controller;
};

// Faults for tests, from the environment variable FP8RT_FAULT (documented in docs/operations.md):
//   nan_grad:rank=R:step=S           rank R puts a NaN into its local gradient (the first
//   inf_grad:rank=R:step=S           parameter's, before the DP reduction) at step S; inf_grad an
//                                    +Inf
//   nan_act:rank=R:step=S[:block=B]  rank R puts a NaN (inf_act: +Inf) into one element of the
//   inf_act:rank=R:step=S[:block=B]  activation entering block B (default 0) in the forward of
//                                    its first micro-batch of step S
//   kill:rank=R:step=S               rank R SIGKILLs itself at the start of step S (not in a
//                                    resumed run)
//   hang:rank=R:step=S               rank R SIGSTOPs itself there (a hung rank; not in a resumed
//                                    run)
// Non-finite values fire in every attempt (a resumed run included) and must make every rank skip
// step S (see Step).
// Checkpoint-write faults come from FP8RT_FAULT_POINT=<point>:kill|enospc[:rank=R][:step=S]
// [:after_bytes=B] (runtime/core/fault_point.h lists the points): a rank (or, set in its
// environment, fp8rt-controller) SIGKILLs itself at that point of a save, or the write there fails
// with ENOSPC. `fp8rt launch` passes it to the first attempt only. A failed shard write abandons
// the save on every rank: the temp folder is removed (by rank 0, or by the controller that rank 0
// tells), every rank's error names the step and the failing ranks, the previous checkpoint is
// kept, and the run fails (exit 1), so that `fp8rt launch --max-restarts` resumes from it.
struct FaultSpec {
  enum class Kind : uint8_t {
    kNone,
    kNanGrad,
    kInfGrad,
    kNanAct,
    kInfAct,
    kKill,
    kHang
  } kind = Kind::kNone;
  int rank = -1;
  int64_t step = -1;
  int64_t block = 0;  // nan_act / inf_act: the block whose input is poisoned
  bool grad() const { return kind == Kind::kNanGrad || kind == Kind::kInfGrad; }
  bool act() const { return kind == Kind::kNanAct || kind == Kind::kInfAct; }
  // The value a nan_* / inf_* fault injects.
  float value() const;
  // InvalidArgument naming FP8RT_FAULT when `text` is not one of the forms above.
  static absl::StatusOr<FaultSpec> Parse(const std::string& text);
};

// What one step did (also what metrics.jsonl records).
struct StepRecord {
  int64_t step = 0;
  double loss = 0.0;
  double grad_norm = 0.0;
  double lr = 0.0;
  double tokens_per_s = 0.0;
  double step_time_s = 0.0;
  bool skipped = false;
  // Skipped steps: the ranks whose own loss, FP8 amaxes or local (pre-reduction) gradients held a
  // NaN or Inf in the step (every rank has the list).
  std::vector<int> nonfinite_ranks;
};

class Trainer {
 public:
  // Builds the rank's model, data loader and optimizer from a validated spec, and restores the
  // newest committed checkpoint with options.resume. Collective over the factory's world.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const v1::RunSpec& spec,
                                                         const TrainerOptions& options,
                                                         parallel::CommunicatorFactory& factory,
                                                         const kernels::OpTable& ops);
  ~Trainer();

  // Runs the remaining steps up to train.steps.
  absl::Status Run();
  // One optimizer step (the next one); exposed for benchmarks.
  absl::StatusOr<StepRecord> Step();

  int64_t step() const { return step_; }  // optimizer steps done
  model::Transformer& model() { return *model_; }
  parallel::Mesh& mesh() { return *mesh_; }

 private:
  Trainer(const v1::RunSpec& spec, const TrainerOptions& options, const kernels::OpTable& ops);
  absl::Status RegisterWithController();
  absl::Status PrepareRunDir();
  absl::Status Restore();
  absl::Status LoadCheckpoint(int64_t step, const std::string& dir);
  absl::Status SaveCheckpoint();
  // Start of a step under a controller: rank 0's directives to every rank; applies a due recipe.
  absl::Status ShareDirectives();
  absl::Status ReportToController(const StepRecord& record,
                                  const std::vector<model::SiteReport>& sites);
  absl::Status WriteRecords(const StepRecord& record, const std::vector<model::SiteReport>& sites);
  std::vector<train::ParamShard> Shards();
  // This rank's NaN/Inf checks of a step: an FP8 site's amax (forward or backward), the local
  // gradients before the DP reduction (a full scan: skipped steps only).
  bool AnySiteAmaxNonFinite() const;
  bool LocalGradNonFinite() const;

  const v1::RunSpec spec_;
  const TrainerOptions options_;
  const kernels::OpTable& ops_;
  FaultSpec fault_;
  std::unique_ptr<parallel::Mesh> mesh_;
  std::unique_ptr<model::Transformer> model_;
  std::unique_ptr<train::DataLoader> loader_;
  std::unique_ptr<train::AdamW> optimizer_;
  std::vector<int32_t> tokens_;
  int64_t step_ = 0;
  bool resumed_ = false;  // started with --resume (the kill fault fires in a first attempt only)
  std::unique_ptr<ControllerClient> controller_;
  std::atomic<int64_t> progress_{0};  // steps done, read by the heartbeat thread
  int64_t resume_step_ = -1;          // from the controller's Register answer
  int64_t recipe_version_ = 1;       // applied recipe version
  int64_t recipe_applied_step_ = 0;  // the step a new version was applied at, for the report
  int64_t moe_dropped_ = 0;          // MoE assignments dropped over capacity in the step, all ranks
  bool stop_requested_ = false;
  bool save_requested_ = false;
  FILE* metrics_ = nullptr;    // rank 0
  FILE* fp8_stats_ = nullptr;  // every rank, with per_rank_fp8_stats
};

}  // namespace fp8rt::worker

#endif  // FP8RT_RUNTIME_WORKER_TRAINER_H_
