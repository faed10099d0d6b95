#include "launcher/bench/convergence.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "fp8rt/v1/run_spec.pb.h"
#include "launcher/bench/subprocess.h"
#include "runtime/spec/run_spec.h"

namespace fp8rt::bench {
namespace {

namespace fs = std::filesystem;

// The keys the bench sets itself, per mode.
constexpr const char* kOwnKeys[] = {"precision.mode", "precision.format", "precision.scaling"};

struct Mode {
  const char* name;
  std::vector<std::string> sets;
};

// What one run's metrics.jsonl says: the final step's val_loss and the training-loss means.
struct RunFigures {
  double final_val_loss = 0.0;
  int64_t val_step = 0;
  double first10_loss = 0.0;
  double last10_loss = 0.0;
};

absl::StatusOr<RunFigures> ReadFigures(const fs::path& metrics, int64_t steps) {
  std::ifstream in(metrics);
  if (!in) return absl::NotFoundError(absl::StrCat(metrics.string(), ": cannot open"));
  std::vector<double> losses;
  RunFigures f;
  bool have_val = false;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      return absl::DataLossError(absl::StrCat(metrics.string(), ":", n, ": not JSON (",
                                              line.substr(0, 80), ")"));
    }
    if (!j.contains("step") || !j["step"].is_number_integer()) continue;  // not a step record
    if (j.contains("loss") && j["loss"].is_number()) losses.push_back(j["loss"].get<double>());
    if (j.contains("val_loss") && j["val_loss"].is_number()) {
      f.final_val_loss = j["val_loss"].get<double>();
      f.val_step = j["step"].get<int64_t>();
      have_val = true;
    }
  }
  if (!have_val || f.val_step != steps) {
    return absl::FailedPreconditionError(absl::StrCat(
        metrics.string(), ": no val_loss recorded for the last step ", steps,
        have_val ? absl::StrCat(" (the last is step ", f.val_step, ")") : std::string()));
  }
  const size_t w = std::min<size_t>(10, losses.size());
  double first = 0.0, last = 0.0;
  for (size_t i = 0; i < w; ++i) {
    first += losses[i];
    last += losses[losses.size() - 1 - i];
  }
  f.first10_loss = w > 0 ? first / static_cast<double>(w) : 0.0;
  f.last10_loss = w > 0 ? last / static_cast<double>(w) : 0.0;
  return f;
}

}  // namespace

absl::StatusOr<nlohmann::ordered_json> ConvergenceBench(const ConvergenceBenchOptions& o) {
  if (o.steps < 0) return absl::InvalidArgumentError("--steps must be >= 1");
  if (!(o.target > 0.0) || !std::isfinite(o.target)) {
    return absl::InvalidArgumentError("--target must be a positive number (0.0025 = 0.25%)");
  }
  for (const std::string& kv : o.overrides) {
    for (const char* key : kOwnKeys) {
      if (kv.rfind(std::string(key) + "=", 0) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--set ", key, ": the bench sets it itself (bf16, then fp8 hybrid delayed)"));
      }
    }
  }
  std::error_code ec;
  if (!fs::is_regular_file(o.spec, ec)) {
    return absl::NotFoundError(absl::StrCat("--spec: no such file: ", o.spec));
  }
  std::vector<std::string> sets = o.overrides;
  if (o.steps > 0) sets.push_back(absl::StrCat("train.steps=", o.steps));
  // The spec as the runs will see it, checked before anything starts (the FP8 run's precision).
  const std::vector<Mode> modes = {
      {"bf16", {"precision.mode=bf16"}},
      {"fp8", {"precision.mode=fp8", "precision.format=hybrid", "precision.scaling=delayed"}}};
  std::vector<std::string> fp8_sets = sets;
  fp8_sets.insert(fp8_sets.end(), modes[1].sets.begin(), modes[1].sets.end());
  absl::StatusOr<v1::RunSpec> spec = LoadRunSpec(o.spec, fp8_sets);
  if (!spec.ok()) return spec.status();
  const int np = static_cast<int>(spec->parallel().dp() * spec->parallel().tp());
  if (absl::Status valid = ValidateRunSpec(*spec, np); !valid.ok()) return valid;
  if (spec->eval().every() <= 0) {
    return absl::InvalidArgumentError(
        "eval.every: the bench compares final validation losses; the spec must evaluate "
        "(eval.every > 0 and data.val_fraction or data.val_path)");
  }
  const int64_t steps = spec->train().steps();

  fs::path root = o.run_dir;
  if (root.empty()) {
    std::string tmpl = (fs::temp_directory_path(ec) / "fp8rt-convergence-XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) {
      return absl::InternalError(absl::StrCat("mkdtemp ", tmpl, ": ", std::strerror(errno)));
    }
    root = tmpl;
  }
  for (const Mode& m : modes) {
    if (fs::exists(root / m.name, ec)) {
      return absl::AlreadyExistsError(absl::StrCat(
          "--run-dir: ", (root / m.name).string(), " exists already (give a new folder)"));
    }
  }
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  const fs::path launch = self.parent_path() / "fp8rt-launch";
  if (ec || access(launch.c_str(), X_OK) != 0) {
    return absl::NotFoundError(
        absl::StrCat("fp8rt-launch not found next to fp8rt-bench (", launch.string(), ")"));
  }

  nlohmann::ordered_json j;
  j["benchmark"] = "convergence";
  j["spec"] = fs::absolute(o.spec, ec).string();
  j["steps"] = steps;
  j["np"] = np;
  j["run_dir"] = root.string();
  j["target"] = o.target;
  j["modes"] = nlohmann::ordered_json::object();
  std::vector<double> finals;
  for (const Mode& m : modes) {
    const fs::path dir = root / m.name;
    std::vector<std::string> argv = {launch.string(), o.spec,          "--np", std::to_string(np),
                                     "--run-dir",     dir.string(),    "--no-controller"};
    for (const std::string& kv : sets) argv.insert(argv.end(), {"--set", kv});
    for (const std::string& kv : m.sets) argv.insert(argv.end(), {"--set", kv});
    std::fprintf(stderr, "fp8rt bench convergence: %s run, %lld steps on %d ranks, in %s\n",
                 m.name, static_cast<long long>(steps), np, dir.c_str());
    const auto t0 = std::chrono::steady_clock::now();
    if (absl::Status s = RunToStderr(argv, "; its log is under the run folder's logs/"); !s.ok()) {
      return s;
    }
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    absl::StatusOr<RunFigures> f = ReadFigures(dir / "metrics.jsonl", steps);
    if (!f.ok()) return f.status();
    finals.push_back(f->final_val_loss);
    j["modes"][m.name] = {{"final_val_loss", f->final_val_loss},
                          {"val_step", f->val_step},
                          {"first10_loss", f->first10_loss},
                          {"last10_loss", f->last10_loss},
                          {"wall_s", wall},
                          {"run_dir", dir.string()}};
  }
  const double rel = (finals[1] - finals[0]) / finals[0];
  j["relative_difference"] = rel;
  j["within_target"] = std::abs(rel) <= o.target;
  return j;
}

}  // namespace fp8rt::bench
