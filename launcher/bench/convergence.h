// `fp8rt bench convergence`: trains one run spec twice, in BF16 and in FP8 (hybrid formats,
// delayed scaling), through `fp8rt launch`, and reports the relative difference of the final
// validation losses against a target (DeepSeek-V3 reports < 0.25% relative loss error of its FP8
// training against BF16; that is the default target).
//
//   fp8rt bench convergence [--spec RUN.yaml] [--steps N] [--set KEY=VALUE ...]
//                           [--run-dir DIR] [--target R] [--json]
//
// Both runs use the spec as given (train.steps = --steps when given) on parallel.dp *
// parallel.tp MPI ranks, without a controller, in DIR/bf16 and DIR/fp8 (DIR defaults to a fresh
// folder under the temp directory; both must not exist yet). Only precision.mode, and for the FP8
// run precision.format and precision.scaling, differ; the bench refuses overrides of those three.
// The spec must evaluate (eval.every > 0 with validation data): the final validation loss is the
// val_loss that metrics.jsonl records for the last step (evaluated on the weights that step
// starts from, before its update; the trainer always evaluates the last step). The launcher's
// progress lines go to stderr.
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
};

// The JSON result: {"benchmark": "convergence", "spec", "steps", "np", "run_dir", "target",
// "modes": {"bf16": {...}, "fp8": {...}} (each: final_val_loss, val_step, first10_loss,
// last10_loss, wall_s, run_dir), "relative_difference" ((fp8 - bf16) / bf16, signed),
// "within_target" (|relative_difference| <= target)}. An error when a run fails (the tail of
// its launch log in the message) or records no final validation loss.
[[nodiscard]] absl::StatusOr<nlohmann::ordered_json> ConvergenceBench(
    const ConvergenceBenchOptions& options);

}  // namespace fp8rt::bench

#endif  // FP8RT_LAUNCHER_BENCH_CONVERGENCE_H_
