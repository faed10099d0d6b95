// Helpers of fp8rt-bench: run several Google Benchmark functions interleaved, in one process,
// so that a ratio compares runs made under the same conditions. Each sample is one iteration
// (a whole kernel call); noise on a shared machine only ever adds time, so the fastest sample is
// the estimate of each case, and the median is reported beside it.
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
  double best_seconds = 0.0;    // fastest sample
  double median_seconds = 0.0;  // median sample
  long samples = 0;             // samples measured
};

// Runs `rounds` rounds; each round measures every case `samples_per_round` times through Google
// Benchmark (one iteration per sample), after one warm-up call. Progress goes to stderr.
std::map<std::string, Timing> RunInterleaved(const std::vector<Case>& cases, int rounds,
                                             int samples_per_round);

}  // namespace fp8rt::bench

#endif  // FP8RT_LAUNCHER_BENCH_BENCH_UTIL_H_
