// `fp8rt bench memory` as a user runs it: per-rank tracked peaks by category and peak RSS of a
// real training run on N MPI ranks, gathered by rank 0, with the one-rank baseline and the ratios
// against it. The figures are checked for what must hold of any run (peaks of parts vs the peak of
// the whole, max over ranks, ratios from their parts, the parameter count of the spec's shape) and
// for the sharding that exists: FSDP master weights and Adam moments are 1/dp per rank.
#include <sys/wait.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/test_support.h"

namespace fp8rt {
namespace {

// The model of the test's spec (--set makes it 2 layers): every weight's rows divide by 2, so
// the FSDP shards at np 2 are exact halves with no padding. FP32 GEMMs: what is measured here does
// not depend on the precision, and oneDNN runs BF16 (hence FP8) matmuls only on CPUs with
// AVX512-BF16 or AMX, which not every host that runs the tests has.
constexpr int64_t kLayers = 2, kDModel = 64, kDff = 256, kVocab = 256;

const char* const kCategories[] = {"other",           "param_shards",     "gradients",
                                   "optimizer_state", "gathered_weights", "saved_activations",
                                   "comm_buffers",    "scratch"};

struct BenchRun {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

BenchRun RunBench(const std::string& args, const std::string& stderr_file) {
  const std::string cmd =
      std::string(FP8RT_BIN_DIR) + "/fp8rt bench memory " + args + " 2>" + stderr_file;
  BenchRun r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) r.out.append(buf, n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.err = test::ReadFile(stderr_file);
  return r;
}

class BenchMemoryCliTest : public ::testing::Test {
 protected:
  // One run of `--np 2 --steps 1 --json` (with its np 1 baseline) shared by the tests.
  static void SetUpTestSuite() {
    dir_ = new test::TempDir("fp8rt-bench-memory-test");
    std::string text;
    for (int i = 0; i < 4000; ++i) text += "In the beginning was the word. ";
    test::WriteFile(dir_->path() / "data.txt", text);
    test::WriteFile(dir_->path() / "spec.yaml",
                    "model: {layers: 3, d_model: 64, heads: 2, d_ff: 256, seq_len: 32, "
                    "vocab: 256}\n"
                    "parallel: {dp: 1}\n"
                    "precision: {mode: fp32}\n"
                    "train: {steps: 100, micro_batch: 2}\n"
                    "data: {path: " +
                        (dir_->path() / "data.txt").string() + "}\n");
    run_ = new BenchRun(RunBench("--np 2 --steps 1 --json --set model.layers=2 --spec " +
                                     (dir_->path() / "spec.yaml").string(),
                                 (dir_->path() / "stderr.txt").string()));
    if (run_->exit_code == 0) json_ = new nlohmann::json(nlohmann::json::parse(run_->out));
  }
  static void TearDownTestSuite() {
    delete json_;
    delete run_;
    delete dir_;
    json_ = nullptr;
    run_ = nullptr;
    dir_ = nullptr;
  }
  void SetUp() override {
    ASSERT_EQ(run_->exit_code, 0) << run_->err;
    ASSERT_NE(json_, nullptr);
  }

  static test::TempDir* dir_;
  static BenchRun* run_;
  static nlohmann::json* json_;
};

test::TempDir* BenchMemoryCliTest::dir_ = nullptr;
BenchRun* BenchMemoryCliTest::run_ = nullptr;
nlohmann::json* BenchMemoryCliTest::json_ = nullptr;

// The figures every rank object (and "max") carries, and what holds between them.
void ExpectConsistentFigures(const nlohmann::json& r, const std::string& what) {
  SCOPED_TRACE(what);
  int64_t sum = 0, largest = 0;
  for (const char* c : kCategories) {
    ASSERT_TRUE(r["peak_bytes"].contains(c)) << c;
    const int64_t v = r["peak_bytes"][c].get<int64_t>();
    EXPECT_GE(v, 0) << c;
    sum += v;
    largest = std::max(largest, v);
  }
  EXPECT_EQ(r["peak_bytes"].size(), std::size(kCategories));
  const int64_t total = r["total_peak_bytes"].get<int64_t>();
  const int64_t without = r["peak_without_activations_bytes"].get<int64_t>();
  // The peak of the whole is at least the peak of any part and at most the sum of the parts'.
  EXPECT_GT(total, 0);
  EXPECT_GE(total, largest);
  EXPECT_LE(total, sum);
  // Leaving the activations out: at most the total, and at the total's peak the rest was live.
  EXPECT_LE(without, total);
  EXPECT_GE(without, total - r["peak_bytes"]["saved_activations"].get<int64_t>());
  EXPECT_EQ(r["state_peak_bytes"].get<int64_t>(),
            r["peak_bytes"]["param_shards"].get<int64_t>() +
                r["peak_bytes"]["gradients"].get<int64_t>() +
                r["peak_bytes"]["optimizer_state"].get<int64_t>());
  EXPECT_GT(r["vm_hwm_bytes"].get<int64_t>(), 0);
}

TEST_F(BenchMemoryCliTest, ReportsEveryRanksFiguresAndTheirMaximum) {
  const nlohmann::json& j = *json_;
  EXPECT_EQ(j["benchmark"], "memory");
  EXPECT_EQ(j["np"].get<int>(), 2);
  EXPECT_EQ(j["steps"].get<int>(), 1);
  EXPECT_EQ(j["model"]["dp"].get<int>(), 2);            // --np sets parallel.dp (the spec says 1)
  EXPECT_EQ(j["model"]["layers"].get<int>(), kLayers);  // the --set override was applied
  // Embedding and LM head (vocab x d_model), per block the qkv, proj, fc1 and fc2 weights and two
  // norm gains, and the final norm: the count of the spec's shape.
  const int64_t c = kDModel, f = kDff;
  EXPECT_EQ(j["params"].get<int64_t>(),
            2 * kVocab * c + kLayers * (4 * c * c + 2 * c * f + 2 * c) + c);
  ASSERT_EQ(j["ranks"].size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(j["ranks"][r]["rank"].get<int>(), r);
    ExpectConsistentFigures(j["ranks"][r], "rank " + std::to_string(r));
  }
  ExpectConsistentFigures(j["max"], "max");
  // "max" is each figure's maximum over the ranks.
  const auto& a = j["ranks"][0];
  const auto& b = j["ranks"][1];
  for (const char* c : kCategories) {
    EXPECT_EQ(j["max"]["peak_bytes"][c].get<int64_t>(),
              std::max(a["peak_bytes"][c].get<int64_t>(), b["peak_bytes"][c].get<int64_t>()))
        << c;
  }
  for (const char* field :
       {"total_peak_bytes", "peak_without_activations_bytes", "state_peak_bytes", "vm_hwm_bytes"}) {
    EXPECT_EQ(j["max"][field].get<int64_t>(),
              std::max(a[field].get<int64_t>(), b[field].get<int64_t>()))
        << field;
  }
}

TEST_F(BenchMemoryCliTest, RatiosAreAgainstTheOneRankBaseline) {
  const nlohmann::json& j = *json_;
  ASSERT_EQ(j["baseline"]["np"].get<int>(), 1);
  const auto& base = j["baseline"]["max"];
  ExpectConsistentFigures(base, "baseline");
  const auto& r = j["ratios"];
  auto expect_ratio = [&](const char* name, int64_t at_np, int64_t at_1) {
    if (at_1 == 0) {
      EXPECT_TRUE(r[name].is_null()) << name;
    } else {
      EXPECT_DOUBLE_EQ(r[name].get<double>(),
                       static_cast<double>(at_np) / static_cast<double>(at_1))
          << name;
    }
  };
  const auto& max = j["max"];
  for (const char* f :
       {"total_peak_bytes", "peak_without_activations_bytes", "vm_hwm_bytes", "state_peak_bytes"}) {
    const std::string name = std::string(f) == "total_peak_bytes"   ? "total_peak"
                             : std::string(f) == "vm_hwm_bytes"     ? "vm_hwm"
                             : std::string(f) == "state_peak_bytes" ? "state"
                                                                    : "peak_without_activations";
    expect_ratio(name.c_str(), max[f].get<int64_t>(), base[f].get<int64_t>());
  }
  expect_ratio("param_shards", max["peak_bytes"]["param_shards"].get<int64_t>(),
               base["peak_bytes"]["param_shards"].get<int64_t>());
}

TEST_F(BenchMemoryCliTest, TwoRanksHoldLessTrackedMemoryThanOne) {
  // The FP32 master shards, gradient shards and Adam moments (16 bytes per parameter at np 1)
  // are halved at np 2; the micro-batch per rank, hence the activations, is the same. So every
  // rank's tracked peak falls by 8 bytes per parameter, less what a rank may add for the
  // collectives (allowed: FP32 send and receive buffers for the largest weight, d_ff x d_model).
  const nlohmann::json& j = *json_;
  const int64_t base = j["baseline"]["max"]["total_peak_bytes"].get<int64_t>();
  const int64_t params = j["params"].get<int64_t>();
  const int64_t largest_weight = kDff * kDModel;
  for (const auto& r : j["ranks"]) {
    EXPECT_LE(r["total_peak_bytes"].get<int64_t>(), base - 8 * params + 2 * 4 * largest_weight)
        << "rank " << r["rank"];
  }
}

TEST_F(BenchMemoryCliTest, ParamShardsHalveAtTwoRanks) {
  const nlohmann::json& j = *json_;
  const int64_t base = j["baseline"]["max"]["peak_bytes"]["param_shards"].get<int64_t>();
  if (base == 0) {
    GTEST_SKIP() << "the model attributes no DeviceArray to param_shards yet (issue 16, point 4: "
                    "the model refactor tags its arrays); nothing to compare";
  }
  for (const auto& r : j["ranks"]) {
    const int64_t shards = r["peak_bytes"]["param_shards"].get<int64_t>();
    EXPECT_GT(shards, 0);
    const double ratio = static_cast<double>(shards) / static_cast<double>(base);
    EXPECT_GE(ratio, 0.45) << "rank " << r["rank"];
    EXPECT_LE(ratio, 0.6) << "rank " << r["rank"];
  }
}

TEST_F(BenchMemoryCliTest, PrintsATableWithoutJson) {
  const BenchRun r = RunBench("--np 1 --steps 1 --spec " + (dir_->path() / "spec.yaml").string(),
                              (dir_->path() / "stderr-table.txt").string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* c : kCategories) EXPECT_NE(r.out.find(c), std::string::npos) << c;
  EXPECT_NE(r.out.find("VmHWM"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("1 MPI ranks"), std::string::npos) << r.out;
  // Progress: one line per step on stderr.
  EXPECT_NE(r.err.find("step 1/1"), std::string::npos) << r.err;
}

TEST_F(BenchMemoryCliTest, BadArgumentsExitWithCode2AndSayWhy) {
  for (const char* np : {"0", "17"}) {
    const BenchRun r =
        RunBench(std::string("--np ") + np + " --json", (dir_->path() / "stderr-np.txt").string());
    EXPECT_EQ(r.exit_code, 2) << np;
    EXPECT_NE(r.err.find("--np must be in [1, 16]"), std::string::npos) << r.err;
  }
  BenchRun r = RunBench("--json", (dir_->path() / "stderr-missing.txt").string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--np"), std::string::npos) << r.err;
  r = RunBench("--np 1 --steps 0", (dir_->path() / "stderr-steps.txt").string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--steps must be >= 1"), std::string::npos) << r.err;
  r = RunBench("--np 1 --spec /nonexistent/spec.yaml", (dir_->path() / "stderr-spec.txt").string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("/nonexistent/spec.yaml"), std::string::npos) << r.err;
  // A spec error found by the ranks (an unknown key through --set) also exits 2, with the key.
  r = RunBench(
      "--np 1 --steps 1 --set model.layerz=2 --spec " + (dir_->path() / "spec.yaml").string(),
      (dir_->path() / "stderr-set.txt").string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("layerz"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace fp8rt
