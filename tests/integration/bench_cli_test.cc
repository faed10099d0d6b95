// `fp8rt bench` as a user runs it: the JSON contract (a top-level `ratio` and the raw numbers)
// and the sanity checks each benchmark carries. Timings are not asserted here: benchmarks report
// ratios, tests check behaviour.
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
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
  EXPECT_EQ(j["scaling"], "tensor");
  // MXFP8 (E8M0 per 1x32 block) is timed in the same rounds; its blocks track the data more
  // closely than one tensor scale, so its result is at least as close to FP32.
  EXPECT_GT(j["mx32_over_tensor"].get<double>(), 0.0);
  EXPECT_LT(j["mx32_vs_fp32_rel_rms_diff"].get<double>(), 0.1);

  const auto mx = RunBench("gemm --size 256 --rounds 1 --samples 1 --scaling mx32 --json", &rc);
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(mx["scaling"], "mx32");
  EXPECT_NE(mx["ratio_definition"].get<std::string>().find("MXFP8"), std::string::npos);
  EXPECT_DOUBLE_EQ(mx["ratio"].get<double>() * mx["timings"]["fp8_e4m3_mx32"]["best_s"].get<double>(),
                   std::min(mx["timings"]["sgemm_openblas"]["best_s"].get<double>(),
                            mx["timings"]["f32_onednn"]["best_s"].get<double>()));
  RunBench("gemm --size 256 --scaling wavy", &rc);
  EXPECT_NE(rc, 0) << "an unknown --scaling is refused";
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

TEST(BenchCliTest, StepTimesTheSameSpecInThreePrecisions) {
  // A small spec so that the test is quick; the figures in docs/perf.md use the default one.
  char dir[] = "/tmp/fp8rt-bench-step-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string data = std::string(dir) + "/data.txt";
  {
    std::ofstream out(data);
    for (int i = 0; i < 4000; ++i) out << "In the beginning was the word. ";
  }
  const std::string spec = std::string(dir) + "/spec.yaml";
  {
    std::ofstream out(spec);
    out << "model: {layers: 1, d_model: 128, heads: 2, d_ff: 256, seq_len: 32, vocab: 256}\n"
           "train: {steps: 100, micro_batch: 4}\n"
           "data: {path: "
        << data << "}\n";
  }
  int rc = -1;
  const auto j = RunBench("step --rounds 1 --json --spec " + spec, &rc);
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(j["benchmark"], "step");
  const auto& m = j["modes"];
  const double ratio = j["ratio"].get<double>();
  EXPECT_NEAR(ratio, m["fp8"]["best_s"].get<double>() / m["fp32"]["best_s"].get<double>(),
              1e-9 * ratio);
  // The three modes trained the same model on the same tokens: their first-step losses agree
  // (FP8 and BF16 rounding move the loss of a fresh model by far less than 1%).
  const double fp32_loss = m["fp32"]["loss"].get<double>();
  EXPECT_NEAR(m["fp8"]["loss"].get<double>(), fp32_loss, 0.01 * fp32_loss);
  EXPECT_NEAR(m["bf16"]["loss"].get<double>(), fp32_loss, 0.01 * fp32_loss);
  // How busy the team was during the timed steps: CPU time over wall time x threads. The
  // process clock brings other threads' time up to date at scheduler ticks (4 ms at most here),
  // which on these millisecond steps allows a tick per thread of excess.
  const int threads = j["threads"].get<int>();
  for (const char* mode : {"fp8", "bf16", "fp32"}) {
    const double cpu = m[mode]["cpu_s"].get<double>(), wall = m[mode]["wall_s"].get<double>();
    EXPECT_GT(cpu, 0.0) << mode;
    EXPECT_LE(cpu, wall * threads + 0.004 * threads) << mode;
    EXPECT_NEAR(m[mode]["cpu_busy"].get<double>(), cpu / (wall * threads), 1e-9) << mode;
  }
  EXPECT_EQ(j["model"]["d_model"].get<int>(), 128);
  EXPECT_EQ(j["tokens_per_step"].get<double>(), 4 * 32);
  std::filesystem::remove_all(dir);
}

// What a command printed on stdout and stderr, and its exit code.
struct Output {
  std::string text;
  int exit_code = -1;
};

Output RunCommand(const std::string& cmd) {
  Output o;
  FILE* pipe = popen((cmd + " 2>&1").c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) o.text.append(buf, n);
  const int status = pclose(pipe);
  o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return o;
}

TEST(BenchCliTest, StepWithTheTorchPeerTimesPyTorchInTheSameRounds) {
  char dir[] = "/tmp/fp8rt-bench-peer-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string data = std::string(dir) + "/data.txt";
  {
    std::ofstream out(data);
    for (int i = 0; i < 4000; ++i) out << "In the beginning was the word. ";
  }
  auto write_spec = [&](const std::string& name, const std::string& family) {
    const std::string spec = std::string(dir) + "/" + name;
    std::ofstream out(spec);
    out << "model: {" << family
        << "layers: 1, d_model: 128, heads: 4, kv_heads: 2, d_ff: 256, seq_len: 32, vocab: 256}\n"
           "train: {steps: 100, micro_batch: 4}\n"
           "data: {path: "
        << data << "}\n";
    return spec;
  };
  // The plain family has no PyTorch twin: refused before anything runs, naming the field.
  const Output plain =
      RunCommand(std::string(FP8RT_BIN_DIR) + "/fp8rt bench step --rounds 1 --peer torch --spec " +
                 write_spec("plain.yaml", ""));
  EXPECT_EQ(plain.exit_code, 2) << plain.text;
  EXPECT_NE(plain.text.find("model.family"), std::string::npos) << plain.text;

  const Output probe = RunCommand(std::string(FP8RT_SOURCE_DIR) + "/scripts/bench-torch --probe");
  if (probe.exit_code == 77) {
    std::filesystem::remove_all(dir);
    GTEST_SKIP() << probe.text;
  }
  ASSERT_EQ(probe.exit_code, 0) << probe.text;
  int rc = -1;
  const auto j = RunBench(
      "step --rounds 1 --json --peer torch --spec " + write_spec("llama.yaml", "family: llama, "),
      &rc);
  ASSERT_EQ(rc, 0);
  ASSERT_TRUE(j.contains("peer")) << j.dump();
  const auto& p = j["peer"];
  EXPECT_EQ(p["name"], "torch");
  // The same thread count as fp8rt's OpenMP team.
  EXPECT_EQ(p["threads"].get<int>(), j["threads"].get<int>());
  EXPECT_TRUE(p["cpu_bf16"].is_array()) << p.dump();  // what the PyTorch BF16 figure runs on
  for (const char* mode : {"fp32", "bf16"}) {
    const double s = p["modes"][mode]["best_s"].get<double>();
    EXPECT_TRUE(std::isfinite(s) && s > 0.0) << mode;
    EXPECT_LE(s, p["modes"][mode]["median_s"].get<double>()) << mode;
  }
  // Each ratio is what its parts say.
  const auto& m = j["modes"];
  const auto& pm = p["modes"];
  const auto& r = p["ratios"];
  EXPECT_NEAR(r["fp8_over_torch_bf16"].get<double>(),
              m["fp8"]["best_s"].get<double>() / pm["bf16"]["best_s"].get<double>(), 1e-9);
  EXPECT_NEAR(r["fp32_over_torch_fp32"].get<double>(),
              m["fp32"]["best_s"].get<double>() / pm["fp32"]["best_s"].get<double>(), 1e-9);
  EXPECT_NEAR(r["fp8_over_fp32"].get<double>(), j["ratio"].get<double>(), 1e-9);
  for (const auto& [name, v] : r.items()) EXPECT_TRUE(std::isfinite(v.get<double>())) << name;
  EXPECT_DOUBLE_EQ(p["targets"]["fp8_over_torch_bf16"].get<double>(), 0.7);
  // The peer trains on uniform random tokens from fp8rt's initialisation law (N(0, 0.02)): a
  // near-uniform model, whose loss is near ln 256 = 5.545 for its first steps (agreement of the
  // architecture itself is torch_peer_test's, on shared weights).
  for (const char* mode : {"fp32", "bf16"}) {
    EXPECT_NEAR(pm[mode]["loss"].get<double>(), std::log(256.0), 0.03 * std::log(256.0)) << mode;
  }
  // --peer-modes fp32 leaves out the BF16-autocast step: no bf16 mode, its ratio null.
  const auto f = RunBench("step --rounds 1 --json --peer torch --peer-modes fp32 --spec " +
                              write_spec("llama32.yaml", "family: llama, "),
                          &rc);
  ASSERT_EQ(rc, 0);
  ASSERT_TRUE(f.contains("peer")) << f.dump();
  EXPECT_TRUE(f["peer"]["modes"].contains("fp32")) << f.dump();
  EXPECT_FALSE(f["peer"]["modes"].contains("bf16")) << f.dump();
  EXPECT_TRUE(f["peer"]["ratios"]["fp8_over_torch_bf16"].is_null()) << f.dump();
  EXPECT_NEAR(f["peer"]["ratios"]["fp32_over_torch_fp32"].get<double>(),
              f["modes"]["fp32"]["best_s"].get<double>() /
                  f["peer"]["modes"]["fp32"]["best_s"].get<double>(),
              1e-9);
  std::filesystem::remove_all(dir);
}

// fp8rt bench attention: flash against the materialising attention in the same rounds, on a
// grouped-query shape with a ragged last tile; both compute the same outputs, and each keeps
// what it says (lse: B H T floats; probabilities: B H T T).
TEST(BenchCliTest, AttentionTimesFlashAgainstTheMaterialisedAttention) {
  int rc = -1;
  const auto j = RunBench(
      "attention --batch 2 --seq 100 --heads 4 --kv-heads 2 --head-dim 16 --rounds 1 --samples 1 "
      "--json",
      &rc);
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(j["benchmark"], "attention");
  EXPECT_NEAR(j["ratio"].get<double>(),
              j["materialised"]["best_s"].get<double>() / j["flash"]["best_s"].get<double>(),
              1e-9);
  EXPECT_EQ(j["saved_bytes"]["flash_lse"].get<int64_t>(), 2 * 4 * 100 * 4);
  EXPECT_EQ(j["saved_bytes"]["materialised_probs"].get<int64_t>(), 2 * 4 * 100 * 100 * 4);
  EXPECT_LE(j["check"]["max_abs_out_difference"].get<double>(),
            1e-5 * j["check"]["max_abs_out"].get<double>());
  RunBench("attention --heads 4 --kv-heads 3", &rc);
  EXPECT_EQ(rc, 2);
  RunBench("attention --seq 0", &rc);
  EXPECT_EQ(rc, 2);
}

TEST(BenchCliTest, BadArgumentsExitWithCode2) {
  int rc = -1;
  RunBench("quantize --mib 0 --json", &rc);
  EXPECT_EQ(rc, 2);
  RunBench("gemm --size 3", &rc);
  EXPECT_EQ(rc, 2);
  RunBench("comm --np 0", &rc);
  EXPECT_EQ(rc, 2);
  RunBench("step --spec /nonexistent/spec.yaml", &rc);
  EXPECT_EQ(rc, 2);
  RunBench("step --peer jax", &rc);
  EXPECT_EQ(rc, 2);
  RunBench("nonsense", &rc);
  EXPECT_NE(rc, 0);
}

// The GPU step runs its program directly (no MPI ranks): where there is no GPU, or no CUDA in this
// build, that program says so and the bench exits 2. (The front end once divided the cores by the
// rank count 0 here and died of SIGFPE, on the H200 too.)
TEST(BenchCliTest, StepOnTheGpuWithoutOneExitsWithCode2) {
  if (std::filesystem::exists("/dev/nvidiactl")) {
    GTEST_SKIP() << "this machine has an NVIDIA device: tests/gpu/run.sh runs the GPU step there";
  }
  int rc = -1;
  RunBench("step --device cuda --rounds 1 --json", &rc);
  EXPECT_EQ(rc, 2);
}

}  // namespace
}  // namespace fp8rt
