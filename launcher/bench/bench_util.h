// Helpers of fp8rt-bench: run several Google Benchmark functions interleaved, in one process,
// and keep the best time of each, so that a ratio compares runs made under the same conditions.
#ifndef FP8RT_LAUNCHER_BENCH_BENCH_UTIL_H_
#define FP8RT_LAUNCHER_BENCH_BENCH_UTIL_H_

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace fp8rt::bench {

struct Case {
  std::string name;
  std::function<void()> body;  // one iteration
};

struct Timing {
  double best_seconds = 0.0;    // fastest per-iteration real time over all rounds
  double median_seconds = 0.0;  // median over rounds
  long iterations = 0;          // total iterations measured
};

// Runs `rounds` rounds; each round runs every case once through Google Benchmark (at least
// `min_time_s` seconds of iterations). Progress goes to stderr.
std::map<std::string, Timing> RunInterleaved(const std::vector<Case>& cases, int rounds,
                                             double min_time_s);

}  // namespace fp8rt::bench

#endif  // FP8RT_LAUNCHER_BENCH_BENCH_UTIL_H_
