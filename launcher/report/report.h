// `fp8rt report RUN_DIR [--out report.html]`: one self-contained HTML file that pictures a run
// from its folder alone, for a user without Grafana (or after the controller is gone). It needs
// no network: the plots are inline SVG written here, with no script and no external resource.
//
// What it reads (docs/operations.md section 2, the run folder):
//   metrics.jsonl          loss, val_loss, grad_norm, tokens/s, recipe_version per step
//   fp8_stats/rank-*.jsonl per-site amax, scale, underflow and saturation (rank 0's amax and
//                          scale, which the amax sync makes equal on every rank; the ratios
//                          averaged over the ranks' files)
//   events.jsonl           the controller's events, as `fp8rt launch` recorded them
//   checkpoints/step-*     the committed checkpoints (a MANIFEST each)
// Only metrics.jsonl is required; each missing part is said in its place in the report.
//
// What it shows: a summary, the loss and validation loss, the gradient norm and tokens/s against
// the step; a timeline of recipe versions, controller events and checkpoints on the same step
// axis; heatmaps (site x step) of scale, amax, underflow and saturation; the checkpoint table.
//
// Bad input: a run folder without metrics.jsonl is NotFound naming it; a line that is not JSON
// (other than an unfinished last line of a run still writing) is InvalidArgument naming the file
// and line and quoting a bounded prefix. Nothing in the run folder is changed.
//
// Index:
//   RenderReport       the HTML of a run folder
//   RunReportCommand   the command line (fp8rt report)
#ifndef FP8RT_LAUNCHER_REPORT_REPORT_H_
#define FP8RT_LAUNCHER_REPORT_REPORT_H_

#include <string>

#include "absl/status/statusor.h"

namespace fp8rt::report {

[[nodiscard]] absl::StatusOr<std::string> RenderReport(const std::string& run_dir);

// argv[0] is "report". Writes RUN_DIR/report.html unless --out is given; prints the path.
// Exit 0, 2 for bad arguments or input, 1 when the file cannot be written.
int RunReportCommand(int argc, char** argv);

}  // namespace fp8rt::report

#endif  // FP8RT_LAUNCHER_REPORT_REPORT_H_
