// TrainSteps: the training loop of the tests that compare whole runs across backends or
// communicators (tests/gpu/train_cuda_test.cc, tests/gpu/train_host_test.cc,
// tests/hostgpu/train_host_nccl_test.cc): a Trainer for the spec over `comms` and `ops`, `steps`
// steps, and the expectations each of them makes of every step (it succeeded, the optimizer did
// not skip it, its loss is finite); ExpectLossesWithin and ExpectSameLossBits compare two runs;
// TextRunDir holds their data and run folders.
//
// Header-only, for tests: a failure to create the trainer or to run a step fails the current
// test (EXPECT) and returns no records, so that callers compare only complete runs.
#ifndef FP8RT_TESTS_SUPPORT_TRAIN_STEPS_H_
#define FP8RT_TESTS_SUPPORT_TRAIN_STEPS_H_

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "runtime/worker/trainer.h"
#include "tests/support/learnable_text.h"

namespace fp8rt::test {

// `name` labels the failures (the run's device or communicator).
inline std::vector<worker::StepRecord> TrainSteps(const v1::RunSpec& spec,
                                                  const worker::TrainerOptions& options,
                                                  parallel::CommunicatorFactory& comms,
                                                  const kernels::OpTable& ops, int steps,
                                                  const std::string& name) {
  auto trainer = worker::Trainer::Create(spec, options, comms, ops);
  EXPECT_TRUE(trainer.ok()) << name << ": " << trainer.status();
  if (!trainer.ok()) return {};
  std::vector<worker::StepRecord> records;
  for (int s = 1; s <= steps; ++s) {
    absl::StatusOr<worker::StepRecord> rec = (*trainer)->Step();
    EXPECT_TRUE(rec.ok()) << name << " step " << s << ": " << rec.status();
    if (!rec.ok()) return {};
    EXPECT_FALSE(rec->skipped) << name << " step " << s << " was skipped";
    EXPECT_TRUE(std::isfinite(rec->loss)) << name << " step " << s;
    records.push_back(*rec);
  }
  return records;
}

// Each step's relative loss difference |got - reference| / |reference| held to `tolerance` (a
// failure names `what` and the step); the largest of them. The runs must have the same length.
inline double ExpectLossesWithin(const std::vector<double>& reference,
                                 const std::vector<double>& got, double tolerance,
                                 const std::string& what) {
  EXPECT_EQ(reference.size(), got.size()) << what;
  double worst = 0.0;
  for (size_t s = 0; s < std::min(reference.size(), got.size()); ++s) {
    const double rel = std::abs(got[s] - reference[s]) / std::abs(reference[s]);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, tolerance) << what << " step " << s + 1 << ": " << got[s] << ", reference "
                              << reference[s];
  }
  return worst;
}

// The same loss bits at every step.
inline void ExpectSameLossBits(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  for (size_t s = 0; s < std::min(a.size(), b.size()); ++s) {
    EXPECT_EQ(std::bit_cast<uint64_t>(a[s]), std::bit_cast<uint64_t>(b[s]))
        << "step " << s + 1 << ": " << a[s] << " vs " << b[s];
  }
}

// A fresh temporary folder holding text.txt, `bytes` of LearnableText: the data of the runs,
// which write their run folders below it. Removed at destruction unless the current test has
// failed (then kept, and its path printed, for inspection).
class TextRunDir {
 public:
  TextRunDir(const std::string& prefix, size_t bytes) {
    std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "_XXXXXX")).string();
    if (mkdtemp(tmpl.data()) == nullptr) {
      ADD_FAILURE() << "mkdtemp " << tmpl;
      return;
    }
    path_ = tmpl;
    std::ofstream(path_ / "text.txt", std::ios::binary) << LearnableText(bytes);
  }
  TextRunDir(const TextRunDir&) = delete;
  TextRunDir& operator=(const TextRunDir&) = delete;
  ~TextRunDir() {
    if (path_.empty()) return;
    if (::testing::Test::HasFailure()) {
      std::printf("kept for inspection: %s\n", path_.c_str());
      return;
    }
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// The loss of each record.
inline std::vector<double> Losses(const std::vector<worker::StepRecord>& records) {
  std::vector<double> losses;
  for (const worker::StepRecord& r : records) losses.push_back(r.loss);
  return losses;
}

}  // namespace fp8rt::test

#endif  // FP8RT_TESTS_SUPPORT_TRAIN_STEPS_H_
