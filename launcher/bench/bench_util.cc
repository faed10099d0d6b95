#include "launcher/bench/bench_util.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "benchmark/benchmark.h"

namespace fp8rt::bench {
namespace {

// Collects the runs of one RunSpecifiedBenchmarks call.
class CollectingReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.error_occurred || run.iterations == 0) continue;
      seconds_[run.benchmark_name()] = run.real_accumulated_time / static_cast<double>(run.iterations);
      iterations_[run.benchmark_name()] = run.iterations;
    }
  }
  std::map<std::string, double> seconds_;
  std::map<std::string, long> iterations_;
};

}  // namespace

std::map<std::string, Timing> RunInterleaved(const std::vector<Case>& cases, int rounds,
                                             double min_time_s) {
  static bool initialized = false;
  if (!initialized) {
    const std::string min_time = "--benchmark_min_time=" + std::to_string(min_time_s);
    std::vector<std::string> flags = {"fp8rt-bench", min_time};
    std::vector<char*> argv;
    for (auto& f : flags) argv.push_back(f.data());
    int argc = static_cast<int>(argv.size());
    benchmark::Initialize(&argc, argv.data());
    initialized = true;
  }
  std::map<std::string, std::vector<double>> samples;
  std::map<std::string, Timing> result;
  for (int round = 0; round < rounds; ++round) {
    for (const Case& c : cases) {
      std::fprintf(stderr, "\r  round %d/%d: %-40s", round + 1, rounds, c.name.c_str());
      std::fflush(stderr);
      benchmark::ClearRegisteredBenchmarks();
      auto body = c.body;
      benchmark::RegisterBenchmark(c.name.c_str(), [body](benchmark::State& state) {
        for (auto _ : state) body();
      })->UseRealTime();
      CollectingReporter reporter;
      benchmark::RunSpecifiedBenchmarks(&reporter);
      for (const auto& [name, seconds] : reporter.seconds_) {
        samples[c.name].push_back(seconds);
        result[c.name].iterations += reporter.iterations_[name];
      }
    }
  }
  std::fprintf(stderr, "\r%-60s\r", "");
  for (auto& [name, times] : samples) {
    std::sort(times.begin(), times.end());
    result[name].best_seconds = times.front();
    result[name].median_seconds = times[times.size() / 2];
  }
  return result;
}

}  // namespace fp8rt::bench
