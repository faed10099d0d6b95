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
#include <limits>
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
      return absl::DataLossError(
          absl::StrCat(metrics.string(), ":", n, ": not JSON (", line.substr(0, 80), ")"));
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

// One run of one mode at one seed: its figures, folder and time.
struct SeedRun {
  RunFigures figures;
  fs::path dir;
  double wall_s = 0.0;
};

nlohmann::ordered_json RunJson(const SeedRun& r, bool with_dir) {
  nlohmann::ordered_json j = {{"final_val_loss", r.figures.final_val_loss},
                              {"val_step", r.figures.val_step},
                              {"first10_loss", r.figures.first10_loss},
                              {"last10_loss", r.figures.last10_loss},
                              {"wall_s", r.wall_s}};
  if (with_dir) j["run_dir"] = r.dir.string();
  return j;
}

double Mean(const std::vector<double>& v) {
  double s = 0.0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

// The sample standard deviation (N - 1 in the denominator); 0 for fewer than two values.
double SampleSd(const std::vector<double>& v) {
  if (v.size() < 2) return 0.0;
  const double m = Mean(v);
  double s = 0.0;
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size() - 1));
}

}  // namespace

double StudentT95(int dof) {
  // Two-sided 95% (the 0.975 quantile) of Student's t, 1 to 30 degrees of freedom.
  static constexpr double kTable[30] = {
      12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
      2.2010,  2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
      2.0796,  2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423};
  if (dof < 1) return std::numeric_limits<double>::quiet_NaN();
  if (dof <= 30) return kTable[dof - 1];
  return 1.959964 + 2.4 / static_cast<double>(dof);
}

absl::StatusOr<PairedConvergence> ComparePaired(const std::vector<double>& bf16,
                                                const std::vector<double>& fp8, double target) {
  if (bf16.empty() || bf16.size() != fp8.size()) {
    return absl::InvalidArgumentError(absl::StrCat("paired losses: ", bf16.size(), " bf16 and ",
                                                   fp8.size(), " fp8 (need as many, at least 1)"));
  }
  for (size_t i = 0; i < bf16.size(); ++i) {
    for (const auto& [mode, v] : {std::pair{"bf16", bf16[i]}, std::pair{"fp8", fp8[i]}}) {
      if (!(v > 0.0) || !std::isfinite(v)) {
        return absl::InvalidArgumentError(
            absl::StrCat("paired losses: ", mode, "[", i, "] = ", v, " (need a finite loss > 0)"));
      }
    }
  }
  PairedConvergence p;
  p.bf16_mean = Mean(bf16);
  p.fp8_mean = Mean(fp8);
  p.relative_difference = (p.fp8_mean - p.bf16_mean) / p.bf16_mean;
  for (size_t i = 0; i < bf16.size(); ++i) p.paired.push_back((fp8[i] - bf16[i]) / bf16[i]);
  p.paired_mean = Mean(p.paired);
  const size_t n = bf16.size();
  if (n == 1) {
    p.verdict = std::abs(p.relative_difference) <= target ? "within" : "exceeded";
    return p;
  }
  p.paired_sd = SampleSd(p.paired);
  p.standard_error = p.paired_sd / std::sqrt(static_cast<double>(n));
  p.t95 = StudentT95(static_cast<int>(n) - 1);
  p.low = p.paired_mean - p.t95 * p.standard_error;
  p.high = p.paired_mean + p.t95 * p.standard_error;
  p.bf16_spread = SampleSd(bf16) / p.bf16_mean;
  if (p.low >= -target && p.high <= target) {
    p.verdict = "within";
  } else if (p.low > target || p.high < -target) {
    p.verdict = "exceeded";
  } else {
    p.verdict = "unresolved";
  }
  return p;
}

absl::StatusOr<nlohmann::ordered_json> ConvergenceBench(const ConvergenceBenchOptions& o) {
  if (o.steps < 0) return absl::InvalidArgumentError("--steps must be >= 1");
  if (!(o.target > 0.0) || !std::isfinite(o.target)) {
    return absl::InvalidArgumentError("--target must be a positive number (0.0025 = 0.25%)");
  }
  if (o.seeds < 1 || o.seeds > 100) {
    return absl::InvalidArgumentError(
        absl::StrCat("--seeds must be in [1, 100] (runs per mode), got ", o.seeds));
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
  // The seeds: the spec's train.seed (after --set), then the next ones. One seed keeps the
  // folders DIR/bf16 and DIR/fp8; more put each pair in DIR/seed<s>/.
  std::vector<uint64_t> seeds;
  for (int i = 0; i < o.seeds; ++i)
    seeds.push_back(spec->train().seed() + static_cast<uint64_t>(i));
  const auto seed_root = [&](uint64_t seed) {
    return o.seeds == 1 ? root : root / absl::StrCat("seed", seed);
  };
  for (uint64_t seed : seeds) {
    for (const Mode& m : modes) {
      if (fs::exists(seed_root(seed) / m.name, ec)) {
        return absl::AlreadyExistsError(
            absl::StrCat("--run-dir: ", (seed_root(seed) / m.name).string(),
                         " exists already (give a new folder)"));
      }
    }
  }
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  const fs::path launch = self.parent_path() / "fp8rt-launch";
  if (ec || access(launch.c_str(), X_OK) != 0) {
    return absl::NotFoundError(
        absl::StrCat("fp8rt-launch not found next to fp8rt-bench (", launch.string(), ")"));
  }

  std::vector<std::vector<SeedRun>> runs(modes.size());  // [mode][seed]
  for (size_t si = 0; si < seeds.size(); ++si) {
    for (size_t mi = 0; mi < modes.size(); ++mi) {
      const Mode& m = modes[mi];
      SeedRun r;
      r.dir = seed_root(seeds[si]) / m.name;
      fs::create_directories(r.dir.parent_path(), ec);
      std::vector<std::string> argv = {launch.string(),    o.spec,      "--np",
                                       std::to_string(np), "--run-dir", r.dir.string(),
                                       "--no-controller"};
      for (const std::string& kv : sets) argv.insert(argv.end(), {"--set", kv});
      if (o.seeds > 1) argv.insert(argv.end(), {"--set", absl::StrCat("train.seed=", seeds[si])});
      for (const std::string& kv : m.sets) argv.insert(argv.end(), {"--set", kv});
      std::fprintf(stderr,
                   "fp8rt bench convergence: %s run, seed %llu (%zu of %zu), %lld steps on "
                   "%d ranks, in %s\n",
                   m.name, static_cast<unsigned long long>(seeds[si]), si * modes.size() + mi + 1,
                   seeds.size() * modes.size(), static_cast<long long>(steps), np, r.dir.c_str());
      const auto t0 = std::chrono::steady_clock::now();
      if (absl::Status s = RunToStderr(argv, "; its log is under the run folder's logs/");
          !s.ok()) {
        return s;
      }
      r.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      absl::StatusOr<RunFigures> f = ReadFigures(r.dir / "metrics.jsonl", steps);
      if (!f.ok()) return f.status();
      r.figures = *f;
      runs[mi].push_back(std::move(r));
    }
  }

  nlohmann::ordered_json j;
  j["benchmark"] = "convergence";
  j["spec"] = fs::absolute(o.spec, ec).string();
  j["steps"] = steps;
  j["np"] = np;
  j["run_dir"] = root.string();
  j["target"] = o.target;
  j["seeds"] = seeds;
  j["modes"] = nlohmann::ordered_json::object();
  std::vector<std::vector<double>> finals(modes.size());
  for (size_t mi = 0; mi < modes.size(); ++mi) {
    const std::vector<SeedRun>& rs = runs[mi];
    if (rs.size() == 1) {
      j["modes"][modes[mi].name] = RunJson(rs[0], /*with_dir=*/true);
      finals[mi].push_back(rs[0].figures.final_val_loss);
      continue;
    }
    SeedRun mean;
    nlohmann::ordered_json per_seed = nlohmann::ordered_json::array();
    std::vector<double> first, last;
    for (size_t si = 0; si < rs.size(); ++si) {
      finals[mi].push_back(rs[si].figures.final_val_loss);
      first.push_back(rs[si].figures.first10_loss);
      last.push_back(rs[si].figures.last10_loss);
      mean.wall_s += rs[si].wall_s;
      nlohmann::ordered_json one = {{"seed", seeds[si]}};
      one.update(RunJson(rs[si], /*with_dir=*/true));
      per_seed.push_back(std::move(one));
    }
    mean.figures = {.final_val_loss = Mean(finals[mi]),
                    .val_step = steps,
                    .first10_loss = Mean(first),
                    .last10_loss = Mean(last)};
    nlohmann::ordered_json mj = RunJson(mean, /*with_dir=*/false);
    mj["per_seed"] = std::move(per_seed);
    j["modes"][modes[mi].name] = std::move(mj);
  }
  absl::StatusOr<PairedConvergence> p = ComparePaired(finals[0], finals[1], o.target);
  if (!p.ok()) return p.status();
  j["relative_difference"] = p->relative_difference;
  j["within_target"] = std::abs(p->relative_difference) <= o.target;
  j["verdict"] = p->verdict;
  if (seeds.size() > 1) {
    j["paired"] = {{"differences", p->paired},
                   {"mean", p->paired_mean},
                   {"sd", p->paired_sd},
                   {"standard_error", p->standard_error},
                   {"t95", p->t95},
                   {"interval", {p->low, p->high}},
                   {"bf16_spread", p->bf16_spread}};
  }
  return j;
}

}  // namespace fp8rt::bench
