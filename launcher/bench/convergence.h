// `fp8rt bench convergence`: trains one run spec twice, in BF16 and in FP8 (hybrid formats,
// delayed scaling), through `fp8rt launch`, and reports the relative difference of the final
// validation losses against a target (DeepSeek-V3 reports < 0.25% relative loss error of its FP8
// training against BF16; that is the default target).
//
//   fp8rt bench convergence [--spec RUN.yaml] [--steps N] [--set KEY=VALUE ...]
//                           [--run-dir DIR] [--target R] [--seeds N] [--json]
//
// Both runs use the spec as given (train.steps = --steps when given) on parallel.dp *
// parallel.tp MPI ranks, without a controller, in DIR/bf16 and DIR/fp8 (DIR defaults to a fresh
// folder under the temp directory; both must not exist yet). Only precision.mode, and for the FP8
// run precision.format and precision.scaling, differ; the bench refuses overrides of those three.
// The spec must evaluate (eval.every > 0 with validation data): the final validation loss is the
// val_loss that metrics.jsonl records for the last step (evaluated on the weights that step
// starts from, before its update; the trainer always evaluates the last step). The launcher's
// progress lines go to stderr.
//
// One seed is an existence proof, not a measurement: on a small model, the final validation loss
// moves by more than 0.25% when only the summation order of the GEMMs changes (docs/perf.md). With
// --seeds N > 1 the bench trains both modes at train.seed = S, S+1, ..., S+N-1 (S the spec's, after
// --set), in DIR/seed<s>/bf16 and DIR/seed<s>/fp8, and compares the two modes seed by seed (a pair
// shares its initial weights and batch order): the paired relative differences d_s, their mean
// and its 95% confidence interval (Student's t, N-1 degrees of freedom). The run then fails only
// when the interval lies wholly outside [-target, target]: when the seeds show FP8 away from BF16
// by more than the target. An interval inside [-target, target] shows FP8 within it; one that
// straddles a bound is reported as unresolved by this many seeds (and passes).
#ifndef FP8RT_LAUNCHER_BENCH_CONVERGENCE_H_
#define FP8RT_LAUNCHER_BENCH_CONVERGENCE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace fp8rt::bench {

struct ConvergenceBenchOptions {
  std::string spec = "examples/llama-tiny.yaml";  // run spec file
  int64_t steps = 0;                              // train.steps; 0 keeps the spec's
  std::vector<std::string> overrides;             // --set KEY=VALUE, in order
  std::string run_dir;                            // empty: a fresh temp folder
  double target = 0.0025;                         // bound on |fp8 - bf16| / bf16
  int seeds = 1;                                  // seeds per mode (paired runs)
};

// The statistics of N paired runs: final validation losses per seed, bf16[i] and fp8[i].
struct PairedConvergence {
  double bf16_mean = 0.0, fp8_mean = 0.0;
  double relative_difference = 0.0;  // (fp8_mean - bf16_mean) / bf16_mean
  std::vector<double> paired;        // (fp8[i] - bf16[i]) / bf16[i]
  double paired_mean = 0.0;
  // N >= 2 only (0 otherwise): the sample standard deviation of `paired`, the standard error of
  // its mean, the two-sided 95% Student's t quantile at N-1 degrees of freedom, and the interval
  // paired_mean -/+ t * standard_error. bf16_spread: the sample standard deviation of bf16[] over
  // its mean (how far the seeds alone move the baseline).
  double paired_sd = 0.0, standard_error = 0.0, t95 = 0.0, low = 0.0, high = 0.0;
  double bf16_spread = 0.0;
  // "within": |relative_difference| <= target (N = 1) or the interval inside [-target, target];
  // "exceeded": |relative_difference| > target (N = 1) or the interval wholly outside it;
  // "unresolved": N >= 2 and the interval straddles -target or target.
  std::string verdict;
};

// The two-sided 95% quantile of Student's t with `dof` >= 1 degrees of freedom (a table to 30,
// then the normal's 1.959964 corrected by 2.4/dof, within 2.5e-3 of the true value).
[[nodiscard]] double StudentT95(int dof);

// InvalidArgument when the vectors are empty, differ in length, or hold a loss <= 0 or not finite.
[[nodiscard]] absl::StatusOr<PairedConvergence> ComparePaired(const std::vector<double>& bf16,
                                                              const std::vector<double>& fp8,
                                                              double target);

// The JSON result: {"benchmark": "convergence", "spec", "steps", "np", "run_dir", "target",
// "seeds" ([S, ...]), "modes": {"bf16": {...}, "fp8": {...}} (each: final_val_loss, val_step,
// first10_loss, last10_loss, wall_s, run_dir; with N > 1 seeds these are means over the seeds,
// wall_s a sum, run_dir absent, and "per_seed" lists each seed's figures with its run_dir),
// "relative_difference" ((fp8 - bf16) / bf16 of the means, signed), "within_target"
// (|relative_difference| <= target), "verdict" (PairedConvergence::verdict) and, with N > 1,
// "paired": {"differences", "mean", "sd", "standard_error", "t95", "interval": [low, high],
// "bf16_spread"}}. An error when a run fails (the tail of its launch log in the message) or
// records no final validation loss. The command exits 1 when the verdict is "exceeded".
[[nodiscard]] absl::StatusOr<nlohmann::ordered_json> ConvergenceBench(
    const ConvergenceBenchOptions& options);

}  // namespace fp8rt::bench

#endif  // FP8RT_LAUNCHER_BENCH_CONVERGENCE_H_
