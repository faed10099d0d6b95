// `fp8rt bench` as a user runs it: the JSON contract (a top-level `ratio` and the raw numbers)
// and the sanity checks each benchmark carries. Timings are not asserted here: benchmarks report
// ratios, tests check behaviour.
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace fp8rt {
namespace {

nlohmann::json RunBench(const std::string& args, int* exit_code) {
  const std::string cmd = std::string(FP8RT_BIN_DIR) + "/fp8rt bench " + args + " 2>/dev/null";
  std::string out;
  FILE* pipe = popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  const int status = pclose(pipe);
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return *exit_code == 0 ? nlohmann::json::parse(out) : nlohmann::json();
}

TEST(BenchCliTest, QuantizeReportsARatioAndItsParts) {
  int rc = -1;
  const auto j = RunBench("quantize --mib 8 --rounds 1 --samples 2 --json", &rc);
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(j["benchmark"], "quantize");
  const double ratio = j["ratio"].get<double>();
  EXPECT_TRUE(std::isfinite(ratio) && ratio > 0.0);
  // The ratio is what its parts say it is.
  EXPECT_NEAR(ratio, j["quantize_gb_per_s"].get<double>() / j["memcpy_gb_per_s"].get<double>(),
              1e-9 * ratio);
  EXPECT_EQ(j["elements"].get<int64_t>(), 8 * (1 << 20) / 4);
  // N(0, 1) data quantized with the scale of an amax of 5: the kernel's amax is the data's.
  EXPECT_GT(j["check"]["amax"].get<double>(), 4.0);
  EXPECT_EQ(j["check"]["count"].get<int64_t>(), j["elements"].get<int64_t>());
}

TEST(BenchCliTest, GemmReportsARatioAndAnAccurateResult) {
  int rc = -1;
  const auto j = RunBench("gemm --size 256 --rounds 1 --samples 1 --json", &rc);
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(j["benchmark"], "gemm");
  const double ratio = j["ratio"].get<double>();
  EXPECT_TRUE(std::isfinite(ratio) && ratio > 0.0);
  // E4M3 inputs carry ~2^-4 relative error each; the FP8 product must still track FP32 closely.
  EXPECT_LT(j["fp8_vs_fp32_rel_rms_diff"].get<double>(), 0.1);
  EXPECT_EQ(j["m"].get<int>(), 256);
}

TEST(BenchCliTest, CommRunsMpiRanksAndMovesHalfTheBytesInFp8) {
  int rc = -1;
  const auto j = RunBench("comm --np 2 --repeats 1 --json", &rc);
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(j["benchmark"], "comm");
  EXPECT_EQ(j["np"].get<int>(), 2);
  // Bytes are deterministic (times are not asserted): FP8 codes are half of BF16, and the
  // 128x128 block scales add 4 bytes per 16384 values.
  const auto& g = j["fsdp_gather"];
  EXPECT_EQ(g["fp8_bytes"].get<int64_t>() * 2, g["bf16_bytes"].get<int64_t>());
  EXPECT_LE(j["ratio"].get<double>(), 0.52);
  EXPECT_LE(g["fp8_block_byte_ratio"].get<double>(), 0.52);
  EXPECT_GT(g["fp8_block_bytes"].get<int64_t>(), g["fp8_bytes"].get<int64_t>());
  // MoE: 1024 FP8 bytes + 8 FP32 scales per token (plus the counts) vs 2048 BF16 bytes.
  EXPECT_LE(j["moe_dispatch"]["byte_ratio"].get<double>(), 0.52);
  EXPECT_DOUBLE_EQ(j["grad_reduce_scatter"]["byte_ratio"].get<double>(), 0.5);
}

TEST(BenchCliTest, BadArgumentsExitWithCode2) {
  int rc = -1;
  RunBench("quantize --mib 0 --json", &rc);
  EXPECT_EQ(rc, 2);
  RunBench("gemm --size 3", &rc);
  EXPECT_EQ(rc, 2);
  RunBench("comm --np 0", &rc);
  EXPECT_EQ(rc, 2);
  RunBench("nonsense", &rc);
  EXPECT_NE(rc, 0);
}

}  // namespace
}  // namespace fp8rt
