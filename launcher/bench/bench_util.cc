#include "launcher/bench/bench_util.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "benchmark/benchmark.h"

namespace fp8rt::bench {
namespace {

// Collects the per-repetition runs of one RunSpecifiedBenchmarks call (not the aggregates).
class CollectingReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.error_occurred || run.iterations == 0 || run.run_type != Run::RT_Iteration) continue;
      seconds.push_back(run.real_accumulated_time / static_cast<double>(run.iterations));
    }
  }
  std::vector<double> seconds;
};

}  // namespace

std::map<std::string, Timing> RunInterleaved(const std::vector<Case>& cases, int rounds,
                                             int samples_per_round) {
  static bool initialized = false;
  if (!initialized) {
    std::vector<std::string> flags = {"fp8rt-bench"};
    std::vector<char*> argv;
    for (auto& f : flags) argv.push_back(f.data());
    int argc = static_cast<int>(argv.size());
    benchmark::Initialize(&argc, argv.data());
    initialized = true;
  }
  for (const Case& c : cases) c.body();  // warm-up: page faults, primitive creation, caches
  std::map<std::string, std::vector<double>> samples;
  for (int round = 0; round < rounds; ++round) {
    for (const Case& c : cases) {
      std::fprintf(stderr, "\r  round %d/%d: %-40s", round + 1, rounds, c.name.c_str());
      std::fflush(stderr);
      benchmark::ClearRegisteredBenchmarks();
      auto body = c.body;
      benchmark::RegisterBenchmark(c.name.c_str(),
                                   [body](benchmark::State& state) {
                                     for (auto _ : state) body();
                                   })
          ->UseRealTime()
          ->Iterations(1)
          ->Repetitions(samples_per_round);
      CollectingReporter reporter;
      benchmark::RunSpecifiedBenchmarks(&reporter);
      auto& v = samples[c.name];
      v.insert(v.end(), reporter.seconds.begin(), reporter.seconds.end());
    }
  }
  std::fprintf(stderr, "\r%-60s\r", "");
  std::map<std::string, Timing> result;
  for (auto& [name, times] : samples) {
    std::sort(times.begin(), times.end());
    Timing& t = result[name];
    t.best_seconds = times.front();
    t.median_seconds = times[times.size() / 2];
    t.samples = static_cast<long>(times.size());
  }
  return result;
}

}  // namespace fp8rt::bench
