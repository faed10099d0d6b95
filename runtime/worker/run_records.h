// The run folder's record files, written by the step loop (formats: runtime/worker/trainer.h).
//
// Index:
//   MemoryPeaks       the most backend memory a rank has held at once, max over ranks
//   StepRecord        what one step did: what metrics.jsonl records and the controller receives
//   PrepareRunFolder  creates the run folder, refuses one that already holds a run (collective)
//   RunRecords        metrics.jsonl (rank 0) and fp8_stats/rank-NNNNN.jsonl (every rank, with
//                     metrics.per_rank_fp8_stats): opened for appending after a resume's step,
//                     one Write per step
//
// Every line is flushed as it is written, so a killed rank leaves whole lines (and at most one
// torn last line, which a resume drops). Not thread-safe; one per rank.
#ifndef FP8RT_RUNTIME_WORKER_RUN_RECORDS_H_
#define FP8RT_RUNTIME_WORKER_RUN_RECORDS_H_

#include <array>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/memory_stats.h"
#include "parallel/communicator.h"
#include "runtime/model/transformer.h"

namespace fp8rt::worker {

// Peak bytes of backend memory (kernels::DeviceArray, kernels/memory_stats.h) since the rank
// started, each the maximum over ranks (the total and each category may peak on different ranks).
struct MemoryPeaks {
  int64_t total = 0;                                           // all categories at once
  std::array<int64_t, kernels::kNumMemCategories> category{};  // indexed by kernels::MemCategory
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
  // Skipped steps: the ranks that saw the NaN or Inf of the step (every rank has the list; see
  // Trainer::NonFiniteRanks for how a rank counts).
  std::vector<int> nonfinite_ranks;
  int64_t recipe_version = 1;          // the live recipe version the step ran with
  std::optional<int64_t> moe_dropped;  // MoE runs: assignments over capacity, all ranks
  MemoryPeaks memory;                  // after the step
  // Eval steps (eval.every): the validation loss of the weights the step started from, the mean
  // over every DP rank's eval batches (Trainer::ValidationLoss).
  std::optional<double> val_loss;
};

// Rank 0 creates `run_dir` (and its fp8_stats/) and, unless `resume`, refuses a folder that
// already holds metrics or committed checkpoints (FailedPrecondition: nothing is overwritten);
// every rank gets the verdict. Collective over `world`.
absl::Status PrepareRunFolder(parallel::Communicator& world, const std::string& run_dir,
                              bool resume);

class RunRecords {
 public:
  // Opens this rank's files in `run_dir` for appending, after dropping their lines past
  // `after_step` (a resumed run rewrites the steps after its checkpoint): metrics.jsonl when
  // `rank` is 0, fp8_stats/rank-NNNNN.jsonl when `per_rank_fp8_stats` (written every
  // `stats_every` steps).
  static absl::StatusOr<std::unique_ptr<RunRecords>> Open(const std::string& run_dir, int rank,
                                                          bool per_rank_fp8_stats,
                                                          int64_t stats_every, int64_t after_step);
  ~RunRecords();
  RunRecords(const RunRecords&) = delete;
  RunRecords& operator=(const RunRecords&) = delete;

  // The step's metrics line, and on stats steps this rank's per-site and per-MoE-block lines
  // (`sites` from SyncScaling, `moe` this rank's routing). InternalError on a failed write.
  absl::Status Write(const StepRecord& r, const std::vector<model::SiteReport>& sites,
                     const std::vector<model::MoeBlockStats>& moe);

 private:
  RunRecords(std::string run_dir, int64_t stats_every)
      : run_dir_(std::move(run_dir)), stats_every_(stats_every) {}

  const std::string run_dir_;  // fixed after construction
  const int64_t stats_every_;  // fixed after construction
  FILE* metrics_ = nullptr;    // rank 0
  FILE* fp8_stats_ = nullptr;  // every rank, with per_rank_fp8_stats
};

}  // namespace fp8rt::worker

#endif  // FP8RT_RUNTIME_WORKER_RUN_RECORDS_H_
