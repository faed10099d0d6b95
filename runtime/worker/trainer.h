// The training step loop of one rank (DESIGN.md section 5), standalone under mpirun.
//
// Index:
//   TrainerOptions   run folder, resume, progress printing, the controller to report to
//   FP8RT_FAULT      the test faults (parsed and fired by step_faults.h)
//   Trainer          Create (model, data, optimizer, resume), Run (the steps), Step (one step)
// The step loop's other concerns have files of their own: run_records.h (StepRecord,
// metrics.jsonl, fp8_stats), controller_link.cc (registration, directives, the step report),
// trainer_checkpoint.cc (save, restore), step_faults.h (FP8RT_FAULT), recipe.h (spec -> recipe).
//
// One optimizer step (Trainer::Step) reads, top to bottom:
//   faults.BeforeStep                       FP8RT_FAULT kill / hang
//   ShareDirectives()                       under a controller: stop, save, a due recipe version
//   model.BeginStep()                       FSDP: FP8 weight shards for the step, zeroed grads
//   ValidationLoss()                        eval steps only (eval.every, and the last step):
//                                           model.Evaluate over the eval batches, mean over DP
//   faults.BeforeForward                    FP8RT_FAULT nan_act / inf_act
//   ForwardBackward()                       each micro-batch: loader.Next, model.ForwardBackward
//                                           (layer by layer: gather, forward, backward,
//                                           reduce-scatter into the FP32 grad shards, +=)
//   model.ReduceGrads()                     the gradient shards are complete (BF16 or FP32
//                                           reduction per recipe)
//   faults.AfterReduceGrads                 FP8RT_FAULT nan_grad / inf_grad
//   (non-finite check)                      a rank whose loss or FP8 amaxes of the step are NaN or
//                                           Inf puts a NaN into its gradient shard
//                                           (PoisonGradShard), so that
//   optimizer.ComputeNorm()                 global norm over every rank's shards, non-finite
//                                           skip, clip: skips the step on every rank
//   model.SyncScaling()                     one MAX all-reduce of every site's amax, states updated
//                                           (a skipped step leaves every scaling state as it was:
//                                           its amaxes come from non-finite values)
//   model.AttachFp8Shards(), optimizer.Apply()
//                                           AdamW on the shards, writing each FP8 weight shard
//                                           whose next scale is known in the same pass
//   NonFiniteRanks(), MeanLoss(), MoeDropped(), MemoryPeaksOverRanks()
//                                           the step's record, reduced over the ranks
//   records.Write(), ReportToController()   metrics.jsonl, per-rank FP8 stats, the controller
// Run() adds the progress line and the checkpoint after each step (SaveCheckpoint).
// A skipped step changes nothing but the step counter and the data position: weights, Adam
// moments, applied_steps and scaling states are bitwise as before it.
//
// Outputs in the run folder (rank 0 unless noted):
//   metrics.jsonl                 one object per optimizer step: step (1-based), loss (mean over
//                                 the global batch), grad_norm (null when skipped), lr,
//                                 tokens_per_s, skipped, nonfinite_ranks (skipped steps only: the
//                                 ranks that saw a NaN/Inf, see NonFiniteRanks), step_time_s,
//                                 recipe_version (the live recipe version the step ran with; 1 =
//                                 the spec's), mem_peak_bytes (the most backend memory a rank
//                                 has held at once since it started, max over ranks:
//                                 kernels/memory_stats.h), moe_dropped (MoE runs: assignments
//                                 over capacity, all ranks), val_loss (eval steps: the
//                                 validation loss of the weights the step started from, i.e.
//                                 after step - 1 updates; null when not finite). step_time_s
//                                 and tokens_per_s count the training, not the evaluation.
//   fp8_stats/rank-NNNNN.jsonl    every rank, every metrics.every steps when
//                                 metrics.per_rank_fp8_stats: one object per FP8 site
//                                 {step, site, amax, scale, underflow_ratio, saturation_ratio}
//                                 for the sites the rank used, and per MoE block
//                                 {step, moe, expert_tokens, dropped}
//   checkpoints/step-NNNNNNNN/    every checkpoint.every steps and at the last step
//                                 (runtime/checkpoint/checkpoint_dir.h), checkpoint.keep kept
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
#include <optional>
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
#include "runtime/worker/run_records.h"
#include "runtime/worker/step_faults.h"

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

// FP8RT_FAULT: faults for tests (also in docs/operations.md; parsed and fired by step_faults.h):
//   nan_grad:rank=R:step=S           rank R puts a NaN into its gradient shard after the DP
//   inf_grad:rank=R:step=S           reduction (element 0 of its first parameter's shard) at
//                                    step S; inf_grad an +Inf
//   nan_act:rank=R:step=S[:block=B]  rank R puts a NaN (inf_act: +Inf) into one element of the
//   inf_act:rank=R:step=S[:block=B]  activation entering block B (default 0) in the forward of
//                                    its first micro-batch of step S
//   kill:rank=R:step=S               rank R SIGKILLs itself at the start of step S (not in a
//                                    resumed run)
//   hang:rank=R:step=S               rank R SIGSTOPs itself there (a hung rank; not in a resumed
//                                    run)
//   slow_register:rank=R:ms=M        rank R waits M ms (at most 600000) before it registers with
//                                    the controller (a rank slow to start; not in a resumed run)
// Non-finite values fire in every attempt (a resumed run included) and must make every rank skip
// step S (see Step).
// Checkpoint-write faults come from FP8RT_FAULT_POINT=<point>:kill|enospc[:rank=R][:step=S]
// [:after_bytes=B] (runtime/core/fault_point.h lists the points): a rank (or, set in its
// environment, fp8rt-controller) SIGKILLs itself at that point of a save, or the write there fails
// with ENOSPC. `fp8rt launch` passes it to the first attempt only. A failed shard write abandons
// the save on every rank: the temp folder is removed (by rank 0, or by the controller that rank 0
// tells), every rank's error names the step and the failing ranks, the previous checkpoint is
// kept, and the run fails (exit 1), so that `fp8rt launch --max-restarts` resumes from it.

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
  // Create's last part: the run folder checked (refused if it holds a run and this is no
  // resume), the checkpoint restored with --resume, the record files opened after its step.
  absl::Status PrepareRunDir();
  // Create's data part: the training loader (data.shuffle; without data.val_fraction's tail) and,
  // with eval.every, the validation loader.
  absl::Status OpenData();

  // The named parts of Step (trainer.cc).
  // Every micro-batch of the step: forward and backward; this rank's summed micro-batch losses.
  absl::StatusOr<float> ForwardBackward();
  // A NaN into this rank's gradient shard (after ReduceGrads): every rank skips the step.
  absl::Status PoisonGradShard();
  std::vector<train::ParamShard> Shards();
  // This rank's NaN/Inf checks of a step: an FP8 site's amax (forward or backward), and its
  // gradient shards after the DP reduction (a full scan: skipped steps only).
  bool AnySiteAmaxNonFinite() const;
  absl::StatusOr<bool> GradShardNonFinite() const;
  // Skipped steps (collective, every rank): the ranks that saw a NaN/Inf themselves (loss, FP8
  // amaxes, an injected fault: `saw_nonfinite`); when none did, the ranks whose gradient shard
  // holds one. Not skipped: empty, no collective.
  absl::StatusOr<std::vector<int>> NonFiniteRanks(bool skipped, bool saw_nonfinite) const;
  // The step's mean loss over the global batch (sum over DP).
  absl::StatusOr<double> MeanLoss(float local_sum);
  // Whether `step` (1-based) evaluates: eval.every > 0 and step % eval.every == 0, or the last.
  bool EvalDue(int64_t step) const;
  // The validation loss (collective, every rank; after BeginStep, before the first
  // ForwardBackward): rank r's eval micro-batch j is window j * dp + r of the validation data in
  // file order (eval_loader_ at position j), so the ranks read the first
  // eval.batches * micro_batch * dp sequences; the mean of every micro-batch's loss over DP.
  absl::StatusOr<double> ValidationLoss();
  // MoE runs: assignments dropped over capacity in the step, summed over all ranks.
  absl::StatusOr<std::optional<int64_t>> MoeDropped();
  // This rank's peak backend memory (kernels/memory_stats.h), max over all ranks (collective).
  absl::StatusOr<MemoryPeaks> MemoryPeaksOverRanks();
  int64_t GlobalBatchTokens() const;

  // The controller link (controller_link.cc); each returns OK at once when standalone.
  absl::Status RegisterWithController();
  // Start of a step under a controller: rank 0's directives to every rank; applies a due recipe.
  absl::Status ShareDirectives();
  void FlushControllerReports();  // end of Run: the queued step reports, at most 15 s
  absl::Status ReportToController(const StepRecord& record,
                                  const std::vector<model::SiteReport>& sites);

  // Checkpoints (trainer_checkpoint.cc).
  absl::Status Restore();
  absl::Status LoadCheckpoint(int64_t step, const std::string& dir);
  absl::Status SaveCheckpoint();

  const v1::RunSpec spec_;
  const TrainerOptions options_;
  const kernels::OpTable& ops_;
  StepFaults faults_;  // set in Create
  std::unique_ptr<parallel::Mesh> mesh_;
  std::unique_ptr<model::Transformer> model_;
  std::unique_ptr<train::DataLoader> loader_;
  std::unique_ptr<train::DataLoader> eval_loader_;  // file order; null when eval.every is 0
  std::unique_ptr<train::AdamW> optimizer_;
  std::vector<int32_t> tokens_;
  int64_t step_ = 0;
  // Declared before controller_, so that it outlives the heartbeat thread that reads it (the
  // client's destructor joins that thread).
  std::atomic<int64_t> progress_{0};  // steps done, read by the heartbeat thread
  std::unique_ptr<ControllerClient> controller_;
  int64_t resume_step_ = -1;          // from the controller's Register answer
  int64_t recipe_version_ = 1;        // applied recipe version
  v1::Recipe live_recipe_;             // and its recipe (the spec's until an update; checkpoints)
  int64_t recipe_applied_step_ = 0;   // the step a new version was applied at, for the report
  bool stop_requested_ = false;
  bool save_requested_ = false;
  std::unique_ptr<RunRecords> records_;  // metrics.jsonl, fp8_stats
};

}  // namespace fp8rt::worker

#endif  // FP8RT_RUNTIME_WORKER_TRAINER_H_
