// The run folder's record files (see run_records.h).
#include "runtime/worker/run_records.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "runtime/checkpoint/checkpoint_dir.h"
#include "runtime/core/status.h"

namespace fp8rt::worker {
namespace fs = std::filesystem;

namespace {

std::string RankFileName(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank-%05d.jsonl", rank);
  return buf;
}

// Keeps the lines of a JSONL file whose "step" is <= max_step (a resumed run rewrites the steps
// after its checkpoint). A missing file is fine.
absl::Status TruncateJsonlAfter(const std::string& path, int64_t max_step) {
  std::ifstream in(path);
  if (!in) return absl::OkStatus();
  std::ostringstream kept;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.contains("step")) continue;  // a torn last line
    if (j["step"].get<int64_t>() <= max_step) kept << line << '\n';
  }
  in.close();
  std::ofstream out(path, std::ios::trunc);
  out << kept.str();
  if (!out) return absl::InternalError(absl::StrCat("cannot rewrite ", path));
  return absl::OkStatus();
}

}  // namespace

absl::Status PrepareRunFolder(parallel::Communicator& world, const std::string& run_dir,
                              bool resume) {
  const std::string metrics_path = run_dir + "/metrics.jsonl";
  CheckpointDir checkpoints(run_dir);
  // Rank 0 checks the folder and tells the others, so every rank takes the same path.
  int64_t verdict = 0;
  std::string error;
  if (world.rank() == 0) {
    std::error_code ec;
    fs::create_directories(run_dir + "/fp8_stats", ec);
    if (ec) {
      error = absl::StrCat("cannot create run folder ", run_dir, ": ", ec.message());
      verdict = 1;
    } else if (!resume) {
      FP8RT_ASSIGN_OR_RETURN(std::vector<int64_t> committed, checkpoints.ListCommitted());
      if (!committed.empty() ||
          (fs::exists(metrics_path, ec) && fs::file_size(metrics_path, ec) > 0)) {
        error = absl::StrCat("run folder ", run_dir,
                             " already holds a run (metrics.jsonl or committed checkpoints): pass "
                             "--resume to continue it, or choose another --run-dir");
        verdict = 2;
      }
    }
  }
  FP8RT_RETURN_IF_ERROR(world.Broadcast(&verdict, 1, parallel::DType::kI64, 0));
  if (verdict == 1) return absl::InternalError(world.rank() == 0 ? error : "run folder not usable");
  if (verdict == 2) {
    return absl::FailedPreconditionError(world.rank() == 0 ? error
                                                           : "run folder already holds a run");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RunRecords>> RunRecords::Open(const std::string& run_dir, int rank,
                                                             bool per_rank_fp8_stats,
                                                             int64_t stats_every,
                                                             int64_t after_step) {
  std::unique_ptr<RunRecords> records(new RunRecords(run_dir, stats_every));
  if (rank == 0) {
    const std::string metrics_path = run_dir + "/metrics.jsonl";
    FP8RT_RETURN_IF_ERROR(TruncateJsonlAfter(metrics_path, after_step));
    records->metrics_ = std::fopen(metrics_path.c_str(), "a");
    if (records->metrics_ == nullptr) return absl::InternalError("cannot open " + metrics_path);
  }
  if (per_rank_fp8_stats) {
    const std::string stats_path = run_dir + "/fp8_stats/" + RankFileName(rank);
    FP8RT_RETURN_IF_ERROR(TruncateJsonlAfter(stats_path, after_step));
    records->fp8_stats_ = std::fopen(stats_path.c_str(), "a");
    if (records->fp8_stats_ == nullptr) return absl::InternalError("cannot open " + stats_path);
  }
  return records;
}

RunRecords::~RunRecords() {
  if (metrics_ != nullptr) std::fclose(metrics_);
  if (fp8_stats_ != nullptr) std::fclose(fp8_stats_);
}

absl::Status RunRecords::Write(const StepRecord& r, const std::vector<model::SiteReport>& sites,
                               const std::vector<model::MoeBlockStats>& moe) {
  if (metrics_ != nullptr) {
    nlohmann::ordered_json j;
    j["step"] = r.step;
    j["loss"] = r.loss;
    j["grad_norm"] = r.skipped ? nlohmann::ordered_json() : nlohmann::ordered_json(r.grad_norm);
    j["lr"] = r.lr;
    j["tokens_per_s"] = r.tokens_per_s;
    j["skipped"] = r.skipped;
    if (r.skipped) j["nonfinite_ranks"] = r.nonfinite_ranks;
    j["step_time_s"] = r.step_time_s;
    j["mem_peak_bytes"] = r.memory.total;
    j["recipe_version"] = r.recipe_version;
    if (r.moe_dropped.has_value()) j["moe_dropped"] = *r.moe_dropped;
    if (r.val_loss.has_value()) j["val_loss"] = *r.val_loss;  // NaN is written as null
    const std::string line = j.dump() + "\n";
    if (std::fputs(line.c_str(), metrics_) < 0 || std::fflush(metrics_) != 0) {
      return absl::InternalError(
          absl::StrCat("cannot write ", run_dir_, "/metrics.jsonl: ", std::strerror(errno)));
    }
  }
  if (fp8_stats_ != nullptr && r.step % stats_every_ == 0) {
    std::string out;
    for (const model::MoeBlockStats& m : moe) {
      nlohmann::ordered_json j;
      j["step"] = r.step;
      j["moe"] = m.layer;
      j["expert_tokens"] = m.tokens_per_expert;  // this rank's kept assignments per expert
      j["dropped"] = m.dropped;
      out += j.dump() + "\n";
    }
    for (const model::SiteReport& s : sites) {
      if (!s.used) continue;  // e.g. the experts of other ranks, or an expert without tokens
      nlohmann::ordered_json j;
      j["step"] = r.step;
      j["site"] = s.site;
      j["amax"] = s.amax;
      j["scale"] = s.scale;
      j["underflow_ratio"] = s.underflow_ratio;
      j["saturation_ratio"] = s.saturation_ratio;
      out += j.dump() + "\n";
    }
    if (std::fputs(out.c_str(), fp8_stats_) < 0 || std::fflush(fp8_stats_) != 0) {
      return absl::InternalError("cannot write the per-rank FP8 stats file");
    }
  }
  return absl::OkStatus();
}

}  // namespace fp8rt::worker
