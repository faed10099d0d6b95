// The control plane end to end, as an operator runs it: a real fp8rt-controller, a real
// Prometheus server scraping it, and `fp8rt launch` training tests/data/tiny-plain.yaml on 2 MPI
// ranks against that controller.
//   - a live recipe update (a layer excluded from FP8, a new margin) is applied by every rank at
//     the same step, which metrics.jsonl, the per-rank FP8 statistics and the controller agree on;
//   - Prometheus scrapes per-layer FP8 metrics of the run and answers a PromQL query on them;
//   - checkpoints are committed by the controller, and a resume through it continues the run.
//   - a run with eval.every reports its validation loss to the run view and to Prometheus.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fp8rt/v1/control.grpc.pb.h"
#include "fp8rt/v1/scaling.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/checkpoint/checkpoint_dir.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "tests/support/test_support.h"

namespace fp8rt {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

const std::string kBin = FP8RT_BIN_DIR;
const std::string kSource = FP8RT_SOURCE_DIR;

using test::FreePort;
using test::ReadFile;
using test::ReadJsonl;
using Process = test::ChildProcess;

std::string Capture(const std::string& cmd) {
  std::string out;
  FILE* pipe = popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  pclose(pipe);
  return out;
}

class ControlPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/fp8rt-control-plane-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    token_file_ = dir_ / "token";
    std::ofstream(token_file_) << "0123456789abcdef0123456789abcdef\n";
    fs::permissions(token_file_, fs::perms::owner_read | fs::perms::owner_write);
    StartController();
    // The spec: tests/data/tiny-plain.yaml with an absolute data path (the test runs in the build
    // dir).
    std::string spec = ReadFile(kSource + "/tests/data/tiny-plain.yaml");
    const std::string rel = "path: examples/data/kjv.txt";
    ASSERT_NE(spec.find(rel), std::string::npos);
    spec.replace(spec.find(rel), rel.size(), "path: " + kSource + "/examples/data/kjv.txt");
    spec_ = dir_ / "tiny.yaml";
    std::ofstream(spec_) << spec;
  }

  void TearDown() override {
    controller_.reset();
    if (!HasFailure())
      fs::remove_all(dir_);
    else
      std::printf("test folder kept: %s\n", dir_.c_str());
  }

  // `listen`: 127.0.0.1:0 picks a free port; a restart passes the previous address.
  void StartController(const std::string& listen = "127.0.0.1:0") {
    const fs::path ready = dir_ / "ready.json";
    fs::remove(ready);
    controller_ = std::make_unique<Process>(
        std::vector<std::string>{kBin + "/fp8rt-controller", "--token-file", token_file_.string(),
                                 "--state-dir", (dir_ / "state").string(), "--listen", listen,
                                 "--metrics-listen", "127.0.0.1:0", "--ready-file", ready.string()},
        dir_ / "controller.log");
    for (int i = 0; i < 200 && !fs::exists(ready); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_TRUE(fs::exists(ready)) << ReadFile(dir_ / "controller.log");
    const Json j = Json::parse(ReadFile(ready));
    address_ = j["grpc"].get<std::string>();
    metrics_ = j["metrics"].get<std::string>();
    runs_ = v1::Runs::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }

  void Prepare(grpc::ClientContext* ctx) {
    ctx->AddMetadata("authorization", "Bearer 0123456789abcdef0123456789abcdef");
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  }

  // The run view (an empty Run when the call fails).
  v1::Run GetRun(const std::string& id) {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::GetRunRequest req;
    req.set_run_id(id);
    v1::Run run;
    if (!runs_->GetRun(&ctx, req, &run).ok()) return v1::Run();
    return run;
  }

  // Recipe version `version` of tiny-e2e (0: the newest); `ok` false when the call fails.
  v1::RecipeVersion Recipe(int64_t version, bool* ok) {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::GetRecipeRequest req;
    req.set_run_id("tiny-e2e");
    req.set_version(version);
    v1::RecipeVersion v;
    const grpc::Status s = runs_->GetRecipe(&ctx, req, &v);
    *ok = s.ok();
    if (!s.ok()) ADD_FAILURE() << "GetRecipe " << version << ": " << s.error_message();
    return v;
  }

  std::vector<std::string> LaunchArgv(const std::string& run_dir,
                                      const std::vector<std::string>& extra) {
    std::vector<std::string> argv = {
        kBin + "/fp8rt", "launch",       spec_.string(),       "--np",      "2",     "--controller",
        address_,        "--token-file", token_file_.string(), "--run-dir", run_dir, "--run-id",
        "tiny-e2e"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  }

  fs::path dir_, token_file_, spec_;
  std::string address_, metrics_;
  std::unique_ptr<Process> controller_;
  std::unique_ptr<v1::Runs::Stub> runs_;
};

TEST_F(ControlPlaneTest, RecipeUpdatePrometheusAndCheckpointsThroughTheController) {
  // Prometheus scrapes the controller every second.
  const int prom_port = FreePort();
  const fs::path prom_cfg = dir_ / "prometheus.yml";
  std::ofstream(prom_cfg) << "global:\n  scrape_interval: 1s\n"
                             "scrape_configs:\n  - job_name: fp8rt\n    static_configs:\n"
                             "      - targets: ['"
                          << metrics_ << "']\n";
  Process prometheus({"prometheus", "--config.file=" + prom_cfg.string(),
                      "--storage.tsdb.path=" + (dir_ / "tsdb").string(),
                      "--web.listen-address=127.0.0.1:" + std::to_string(prom_port)},
                     dir_ / "prometheus.log");

  // Training: 60 steps, checkpoints every 20, FP8 statistics of every rank at every step.
  const fs::path run_dir = dir_ / "run";
  Process launch(
      LaunchArgv(run_dir.string(), {"--set", "train.steps=60", "--set", "train.warmup=5", "--set",
                                    "checkpoint.every=20", "--set", "metrics.every=1"}),
      dir_ / "launch.log");
  // Once the run is under way, exclude one layer from FP8 and change the margin.
  int64_t step_seen = 0;
  for (int i = 0; i < 600 && step_seen < 5; ++i) {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::GetRunRequest req;
    req.set_run_id("tiny-e2e");
    v1::Run run;
    if (runs_->GetRun(&ctx, req, &run).ok()) step_seen = run.last_step().step();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(step_seen, 5) << ReadFile(dir_ / "launch.log") << ReadFile(run_dir / "logs/launch.log");
  bool ok = false;
  const v1::RecipeVersion current = Recipe(0, &ok);
  ASSERT_TRUE(ok);
  v1::RecipeVersion updated;
  {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::UpdateRecipeRequest req;
    req.set_run_id("tiny-e2e");
    *req.mutable_recipe() = current.recipe();
    req.mutable_recipe()->add_exclude("blocks.0.mlp.fc1");
    req.mutable_recipe()->set_margin(1);
    req.set_reason("test: fc1 of block 0 back to BF16");
    const grpc::Status s = runs_->UpdateRecipe(&ctx, req, &updated);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(updated.version(), current.version() + 1);
  const int64_t scheduled = updated.effective_step();
  EXPECT_GT(scheduled, step_seen);
  ASSERT_EQ(launch.Wait(), 0) << ReadFile(dir_ / "launch.log")
                              << ReadFile(run_dir / "logs/launch.log");
  // The step the workers switched at, as they reported it: the scheduled one, or a later one when
  // the version reached rank 0 (whose heartbeats run off the step's path) after it.
  int64_t effective = 0;
  {
    bool ok = false;
    const v1::RecipeVersion v = Recipe(0, &ok);
    ASSERT_TRUE(ok);
    EXPECT_EQ(v.version(), 2);
    effective = v.applied_step();
    EXPECT_GE(effective, scheduled);
    EXPECT_LE(effective, 60);
  }

  // Every rank switched at the effective step: its FP8 statistics stop listing the excluded
  // layer exactly there, metrics.jsonl shows the new version from there on, the controller
  // recorded it as applied there.
  for (const char* rank_file : {"rank-00000.jsonl", "rank-00001.jsonl"}) {
    SCOPED_TRACE(rank_file);
    std::map<int64_t, std::set<std::string>> sites;
    for (const Json& j : ReadJsonl(run_dir / "fp8_stats" / rank_file)) {
      sites[j["step"].get<int64_t>()].insert(j["site"].get<std::string>());
    }
    ASSERT_EQ(sites.size(), 60u);
    for (const auto& [step, names] : sites) {
      EXPECT_EQ(names.count("blocks.0.mlp.fc1/input") == 0, step >= effective) << "step " << step;
      EXPECT_EQ(names.count("blocks.1.mlp.fc1/input"), 1u) << "step " << step;
    }
  }
  // The launcher printed the controller's events as they happened, a line each.
  const std::string out = ReadFile(dir_ / "launch.log");
  EXPECT_NE(
      out.find("fp8rt launch: controller: step " + std::to_string(effective) +
               ": recipe applied: recipe version 2 applied at step " + std::to_string(effective)),
      std::string::npos)
      << out;
  for (const int step : {20, 40, 60}) {
    EXPECT_NE(out.find("fp8rt launch: controller: step " + std::to_string(step) +
                       ": checkpoint committed: "),
              std::string::npos)
        << out;
  }
  EXPECT_NE(out.find("fp8rt launch: controller: step 60: run finished: reached train.steps = 60"),
            std::string::npos)
      << out;
  const std::vector<Json> metrics = ReadJsonl(run_dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 60u);
  for (const Json& m : metrics) {
    EXPECT_EQ(m["recipe_version"].get<int64_t>(), m["step"].get<int64_t>() >= effective ? 2 : 1)
        << m.dump();
  }

  // The controller committed the checkpoints (20, 40, 60; keep 2 in tiny.yaml).
  {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::ListCheckpointsRequest req;
    req.set_run_id("tiny-e2e");
    v1::ListCheckpointsResponse resp;
    ASSERT_TRUE(runs_->ListCheckpoints(&ctx, req, &resp).ok());
    ASSERT_EQ(resp.checkpoints_size(), 2);
    EXPECT_EQ(resp.checkpoints(0).step(), 40);
    EXPECT_EQ(resp.checkpoints(1).step(), 60);
    EXPECT_TRUE(fs::exists(run_dir / "checkpoints/step-00000060/MANIFEST"));
  }

  // Prometheus has the run's per-layer FP8 metrics: a PromQL query on the weight scale of a
  // layer answers with the run's series.
  const std::string query =
      "curl -s -G --data-urlencode 'query=fp8rt_fp8_scale{run=\"tiny-e2e\",layer=\"blocks.1.mlp."
      "fc1\",tensor=\"weight\"}' http://127.0.0.1:" +
      std::to_string(prom_port) + "/api/v1/query";
  Json answer;
  for (int i = 0; i < 100; ++i) {
    const std::string out = Capture(query);
    answer = Json::parse(out, nullptr, false);
    if (!answer.is_discarded() && answer.value("status", "") == "success" &&
        !answer["data"]["result"].empty()) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  ASSERT_FALSE(answer.is_discarded()) << ReadFile(dir_ / "prometheus.log");
  ASSERT_FALSE(answer["data"]["result"].empty()) << answer.dump();
  const double scale = std::stod(answer["data"]["result"][0]["value"][1].get<std::string>());
  EXPECT_TRUE(std::isfinite(scale) && scale > 0) << answer.dump();

  // Resume through the controller: it names step 60 as the resume point; the run goes on to 70.
  Process resumed(LaunchArgv(run_dir.string(),
                             {"--resume", "--set", "train.steps=70", "--set", "train.warmup=5",
                              "--set", "checkpoint.every=20", "--set", "metrics.every=1"}),
                  dir_ / "launch2.log");
  ASSERT_EQ(resumed.Wait(), 0) << ReadFile(dir_ / "launch2.log")
                               << ReadFile(run_dir / "logs/launch.log");
  const std::vector<Json> after = ReadJsonl(run_dir / "metrics.jsonl");
  ASSERT_EQ(after.size(), 70u);
  EXPECT_EQ(after.back()["step"].get<int64_t>(), 70);
  EXPECT_NE(ReadFile(run_dir / "logs/launch.log").find("resuming after step 60"),
            std::string::npos);
}

// A mixture-of-experts run under the controller: the per-expert FP8 statistics and token counts
// reach its metrics with an `expert` label, and `fp8rt layers` lists the expert sites.
TEST_F(ControlPlaneTest, MoeRunReportsPerExpertMetrics) {
  std::string spec = ReadFile(kSource + "/examples/tiny-moe.yaml");
  const std::string rel = "path: examples/data/kjv.txt";
  ASSERT_NE(spec.find(rel), std::string::npos);
  spec.replace(spec.find(rel), rel.size(), "path: " + kSource + "/examples/data/kjv.txt");
  const fs::path moe_spec = dir_ / "tiny-moe.yaml";
  std::ofstream(moe_spec) << spec;
  const fs::path run_dir = dir_ / "moe";
  Process launch(
      {kBin + "/fp8rt", "launch", moe_spec.string(), "--np", "2", "--controller", address_,
       "--token-file", token_file_.string(), "--run-dir", run_dir.string(), "--run-id", "tiny-moe",
       "--set", "train.steps=10", "--set", "train.warmup=2", "--set", "metrics.every=5"},
      dir_ / "moe-launch.log");
  ASSERT_EQ(launch.Wait(), 0) << ReadFile(dir_ / "moe-launch.log")
                              << ReadFile(run_dir / "logs/launch.log");
  const std::string scrape = Capture("curl -s http://" + metrics_ + "/metrics");
  // 4 experts of blocks.1.mlp, token counts summed over both ranks (each expert is busy with
  // top-2 routing of 2 x 8 x 64 tokens), FP8 sites of experts held by either rank.
  for (int e = 0; e < 4; ++e) {
    const std::string series = "fp8rt_moe_expert_tokens{expert=\"" + std::to_string(e) +
                               "\",layer=\"blocks.1.mlp\",run=\"tiny-moe\"}";
    EXPECT_NE(scrape.find(series), std::string::npos) << series << "\n" << scrape.substr(0, 2000);
  }
  EXPECT_NE(scrape.find("fp8rt_fp8_scale{expert=\"3\",layer=\"blocks.1.mlp.experts.3.fc1\""),
            std::string::npos);
  EXPECT_NE(scrape.find("fp8rt_fp8_scale{expert=\"0\",layer=\"blocks.1.mlp.experts.0.fc2\""),
            std::string::npos);
  EXPECT_NE(scrape.find("fp8rt_moe_dropped_tokens{layer=\"blocks.1.mlp\",run=\"tiny-moe\"}"),
            std::string::npos);
  // The workers' memory peaks (max over ranks) reach the controller, one series per category;
  // a rank's persistent state (parameter shards, gradient shards, Adam moments) is in them.
  for (const std::string category : {"param_shards", "gradients", "optimizer_state"}) {
    const std::string series =
        "fp8rt_memory_peak_bytes{category=\"" + category + "\",run=\"tiny-moe\"} ";
    const size_t at = scrape.find(series);
    ASSERT_NE(at, std::string::npos) << series << "\n" << scrape.substr(0, 2000);
    EXPECT_GT(std::stod(scrape.substr(at + series.size())), 0.0) << series;
  }
  const std::string layers = Capture(kBin + "/fp8rt layers tiny-moe --controller " + address_ +
                                     " --token-file " + token_file_.string());
  EXPECT_NE(layers.find("blocks.1.mlp.experts.2.fc1"), std::string::npos) << layers;
}

// A run with eval.every under the controller: the validation loss of each eval step reaches
// metrics.jsonl, the launcher's progress lines, the controller's run view (GetRun, `fp8rt runs
// show`) and Prometheus (fp8rt_eval_loss), all with the value rank 0 wrote.
TEST_F(ControlPlaneTest, ValidationLossReachesTheRunViewAndPrometheus) {
  const fs::path run_dir = dir_ / "eval";
  Process launch(
      LaunchArgv(run_dir.string(), {"--set", "train.steps=4", "--set", "train.warmup=2", "--set",
                                    "checkpoint.every=0", "--set", "data.val_fraction=0.01",
                                    "--set", "eval.every=2", "--set", "eval.batches=2"}),
      dir_ / "eval-launch.log");
  ASSERT_EQ(launch.Wait(), 0) << ReadFile(dir_ / "eval-launch.log")
                              << ReadFile(run_dir / "logs/launch.log");
  const std::vector<Json> metrics = ReadJsonl(run_dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 4u);
  std::map<int64_t, double> val;
  for (const Json& m : metrics) {
    if (m.contains("val_loss")) val[m["step"].get<int64_t>()] = m["val_loss"].get<double>();
  }
  ASSERT_EQ(val.size(), 2u) << "eval at steps 2 and 4 only";
  ASSERT_TRUE(val.contains(2) && val.contains(4));
  // A byte-level model near its start: finite, below ln(256) + 1 nats (a uniform guess is 5.55).
  for (const auto& [step, v] : val) {
    EXPECT_TRUE(std::isfinite(v) && v > 0.0 && v < std::log(256.0) + 1.0) << step << ": " << v;
  }

  // The run view holds the newest one and its step.
  {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::GetRunRequest req;
    req.set_run_id("tiny-e2e");
    v1::Run run;
    ASSERT_TRUE(runs_->GetRun(&ctx, req, &run).ok());
    EXPECT_EQ(run.val_loss_step(), 4);
    EXPECT_EQ(run.val_loss(), val[4]);
    EXPECT_TRUE(run.last_step().has_val_loss());
    EXPECT_EQ(run.last_step().val_loss(), val[4]);
  }
  char four[32];
  std::snprintf(four, sizeof(four), "%.4f (step 4)", val[4]);
  const std::string show = Capture(kBin + "/fp8rt runs get tiny-e2e --controller " + address_ +
                                   " --token-file " + token_file_.string());
  EXPECT_NE(show.find("val loss"), std::string::npos) << show;
  EXPECT_NE(show.find(four), std::string::npos) << show;

  // Prometheus's scrape of the controller: the gauge, with the same value.
  const std::string scrape = Capture("curl -s http://" + metrics_ + "/metrics");
  const std::string series = "fp8rt_eval_loss{run=\"tiny-e2e\"} ";
  const size_t at = scrape.find(series);
  ASSERT_NE(at, std::string::npos) << scrape.substr(0, 3000);
  EXPECT_NEAR(std::stod(scrape.substr(at + series.size())), val[4], 1e-9 * val[4]);
  EXPECT_NE(scrape.find("# HELP fp8rt_eval_loss "), std::string::npos);

  // The launcher's progress lines (not a terminal: a line per step here) carry it from step 2.
  char two[32];
  std::snprintf(two, sizeof(two), "val_loss %.4f", val[2]);
  EXPECT_NE(ReadFile(dir_ / "eval-launch.log").find(two), std::string::npos)
      << ReadFile(dir_ / "eval-launch.log");
}

// The controller is never on the step's critical path (issue 19 point 3): stopped (SIGSTOP) for
// 20 s, the run's median step time stays within 10% of before; after SIGCONT it shows the newest
// step, with the undelivered reports counted. Killed and restarted on its state folder at the
// same address, it receives the run's reports again.
// Per-layer recipes (precision.overrides, issue 20) on real workers: the spec's overrides from
// step 1, a live list through `fp8rt recipe set --override` applied by both ranks at one step,
// each layer's recipe in `fp8rt layers`, and the live list stored in the checkpoints and restored
// by a resume without the controller (so from the checkpoint alone).
TEST_F(ControlPlaneTest, PerLayerRecipesFromTheSpecLiveAndThroughAResume) {
  {  // The spec sends the MLP of block 1 to BF16.
    std::string spec = ReadFile(spec_);
    const std::string at = "  exclude: []\n";
    ASSERT_NE(spec.find(at), std::string::npos);
    spec.replace(spec.find(at), at.size(),
                 at + "  overrides:\n    - {layers: 'blocks.1.mlp.*', mode: bf16}\n");
    std::ofstream(spec_) << spec;
  }
  const fs::path run_dir = dir_ / "overrides";
  Process launch(
      LaunchArgv(run_dir.string(), {"--set", "train.steps=30", "--set", "train.warmup=5", "--set",
                                    "checkpoint.every=10", "--set", "metrics.every=1"}),
      dir_ / "launch.log");
  int64_t step_seen = 0;
  for (int i = 0; i < 600 && step_seen < 5; ++i) {
    step_seen = GetRun("tiny-e2e").last_step().step();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(step_seen, 5) << ReadFile(dir_ / "launch.log");
  // Live: the list is replaced, block 1's MLP kept in BF16, block 0's fc1 sent there too, and
  // block 0's attention switched to current scaling with a margin of 3.
  const std::string cli = "FP8RT_CONTROLLER=" + address_ +
                          " FP8RT_TOKEN_FILE=" + token_file_.string() + " " + kBin + "/fp8rt ";
  const std::string set =
      Capture(cli +
              "recipe set tiny-e2e --override 'blocks.1.mlp.*:mode=bf16' --override "
              "'blocks.0.mlp.fc1:mode=bf16' --override "
              "'blocks.0.attn.*:scaling=current,margin=3' --reason 'test: per-layer' 2>&1");
  ASSERT_NE(set.find("recipe version 2"), std::string::npos) << set;
  ASSERT_EQ(launch.Wait(), 0) << ReadFile(dir_ / "launch.log")
                              << ReadFile(run_dir / "logs/launch.log");
  int64_t applied = 0;
  {
    bool ok = false;
    const v1::RecipeVersion v = Recipe(0, &ok);
    ASSERT_TRUE(ok);
    ASSERT_EQ(v.version(), 2);
    applied = v.applied_step();
    ASSERT_GT(applied, step_seen);
    ASSERT_LE(applied, 30);
  }
  // Both ranks: block 1's MLP never quantized, block 0's fc1 until the applied step only.
  auto sites_by_step = [&](const char* rank_file) {
    std::map<int64_t, std::set<std::string>> sites;
    for (const Json& j : ReadJsonl(run_dir / "fp8_stats" / rank_file)) {
      if (j.contains("site")) sites[j["step"].get<int64_t>()].insert(j["site"].get<std::string>());
    }
    return sites;
  };
  for (const char* rank_file : {"rank-00000.jsonl", "rank-00001.jsonl"}) {
    SCOPED_TRACE(rank_file);
    const auto sites = sites_by_step(rank_file);
    ASSERT_EQ(sites.size(), 30u);
    for (const auto& [step, names] : sites) {
      EXPECT_EQ(names.count("blocks.1.mlp.fc1/input") + names.count("blocks.1.mlp.fc2/weight"), 0u)
          << "step " << step;
      EXPECT_EQ(names.count("blocks.0.mlp.fc1/input") == 0, step >= applied) << "step " << step;
      EXPECT_EQ(names.count("blocks.0.attn.qkv/input"), 1u) << "step " << step;
      EXPECT_EQ(names.count("blocks.0.mlp.fc2/input"), 1u) << "step " << step;
    }
  }
  // `fp8rt layers`: each layer's effective recipe, from version 2.
  const Json layers = Json::parse(Capture(cli + "layers tiny-e2e --json"), nullptr, false);
  ASSERT_FALSE(layers.is_discarded());
  std::map<std::string, Json> recipe;
  for (const Json& r : layers["recipes"]) recipe[r["layer"].get<std::string>()] = r;
  ASSERT_EQ(recipe.size(), 9u) << layers.dump();
  EXPECT_EQ(recipe["blocks.1.mlp.fc2"]["mode"], "bf16");
  EXPECT_EQ(recipe["blocks.0.mlp.fc1"]["mode"], "bf16");
  EXPECT_EQ(recipe["blocks.0.mlp.fc1"]["override_index"], 1);
  EXPECT_EQ(recipe["blocks.0.attn.proj"]["scaling"], "current");
  EXPECT_EQ(recipe["blocks.0.attn.proj"]["margin"], 3);
  EXPECT_EQ(recipe["blocks.1.attn.proj"]["scaling"], "delayed");
  EXPECT_EQ(recipe["blocks.1.attn.proj"]["recipe_version"], 2);
  // The checkpoint of step 30 holds the live recipe and the sites' configs under it.
  {
    auto shard =
        ShardReader::Open((run_dir / "checkpoints/step-00000030" / ShardFileName(1)).string());
    ASSERT_TRUE(shard.ok()) << shard.status();
    v1::Recipe saved;
    ASSERT_TRUE((*shard)->ParseProto("recipe", &saved).ok());
    ASSERT_EQ(saved.overrides_size(), 3);
    EXPECT_EQ(saved.overrides(2).layers(), "blocks.0.attn.*");
    v1::ScalingState qkv, fc2;
    ASSERT_TRUE((*shard)->ParseProto("scaling/blocks.0.attn.qkv/input", &qkv).ok());
    ASSERT_TRUE((*shard)->ParseProto("scaling/blocks.0.mlp.fc2/input", &fc2).ok());
    EXPECT_EQ(qkv.strategy(), v1::SCALING_STRATEGY_CURRENT);
    EXPECT_EQ(qkv.margin(), 3);
    EXPECT_EQ(fc2.strategy(), v1::SCALING_STRATEGY_DELAYED);
    EXPECT_EQ(fc2.margin(), 0);
  }
  // Resumed without the controller: the checkpoint alone restores version 2, so block 0's fc1
  // stays in BF16 for steps 31-40.
  Process resumed({kBin + "/fp8rt", "launch", spec_.string(), "--np", "2", "--no-controller",
                   "--run-dir", run_dir.string(), "--resume", "--set", "train.steps=40", "--set",
                   "train.warmup=5", "--set", "checkpoint.every=10", "--set", "metrics.every=1"},
                  dir_ / "launch2.log");
  ASSERT_EQ(resumed.Wait(), 0) << ReadFile(dir_ / "launch2.log")
                               << ReadFile(run_dir / "logs/launch.log");
  EXPECT_NE(ReadFile(run_dir / "logs/launch.log").find("resuming after step 30"),
            std::string::npos);
  for (const char* rank_file : {"rank-00000.jsonl", "rank-00001.jsonl"}) {
    SCOPED_TRACE(rank_file);
    const auto sites = sites_by_step(rank_file);
    ASSERT_TRUE(sites.contains(40));
    for (int64_t step = 31; step <= 40; ++step) {
      ASSERT_TRUE(sites.contains(step)) << step;
      EXPECT_EQ(sites.at(step).count("blocks.0.mlp.fc1/input"), 0u) << "step " << step;
      EXPECT_EQ(sites.at(step).count("blocks.1.mlp.fc1/input"), 0u) << "step " << step;
      EXPECT_EQ(sites.at(step).count("blocks.0.attn.qkv/input"), 1u) << "step " << step;
    }
  }
  const std::vector<Json> metrics = ReadJsonl(run_dir / "metrics.jsonl");
  ASSERT_FALSE(metrics.empty());
  EXPECT_EQ(metrics.back()["step"].get<int64_t>(), 40);
  EXPECT_EQ(metrics.back()["recipe_version"].get<int64_t>(), 2);
}

// The FP8 health policy's whole loop on real workers (issue 20 point 3): rank 0 puts a growing
// outlier into the input of blocks.0.mlp.fc2 from step 4 (FP8RT_FAULT outlier_act, x2 a step for
// 12 steps), so that with delayed scaling and margin 0 the site saturates every step. After 3
// saturated intervals the controller's policy (health.action raise_margin, margin_step 2) gives
// the layer margin 2 through a new recipe version, which both ranks apply at one step; from
// there the x2 growth fits in the margin's x4 and the site stops saturating. Six healthy
// intervals later (health.promote_after) the layer gets its recipe back. Seen on the launcher's
// terminal, in the controller's Prometheus metrics, in `fp8rt layers` and in the checkpoint.
// Every other layer has margin 1 (fc2 keeps 0 through the spec's override): at margin 0 a single
// value over the delayed scale's history, which the summation order of the machine's GEMMs can
// produce in any layer (it does in blocks.1.attn.qkv on AVX2-only CPUs), would pass this test's
// threshold of one value and have the policy act there first.
TEST_F(ControlPlaneTest, HealthPolicyRaisesTheMarginOfASaturatingLayerAndPromotesItBack) {
  {
    std::string spec = ReadFile(spec_);
    const std::string margin = "  margin: 0\n  exclude: []\n";
    ASSERT_NE(spec.find(margin), std::string::npos);
    spec.replace(spec.find(margin), margin.size(),
                 "  margin: 1\n  exclude: []\n  overrides:\n"
                 "    - {layers: \"blocks.0.mlp.fc2\", margin: 0}\n");
    std::ofstream(spec_) << spec;
  }
  std::ofstream(spec_, std::ios::app) << "\nhealth:\n  saturation_threshold: 0.0000001\n"
                                         "  intervals: 3\n  action: raise_margin\n"
                                         "  margin_step: 2\n  promote_after: 6\n";
  const fs::path run_dir = dir_ / "health";
  const std::string site = "blocks.0.mlp.fc2/input";
  setenv("FP8RT_FAULT", "outlier_act:rank=0:step=4:layer=blocks.0.mlp.fc2:growth=2:steps=12", 1);
  Process launch(
      LaunchArgv(run_dir.string(), {"--set", "train.steps=28", "--set", "train.warmup=5", "--set",
                                    "checkpoint.every=28", "--set", "metrics.every=1"}),
      dir_ / "launch.log");
  unsetenv("FP8RT_FAULT");
  ASSERT_EQ(launch.Wait(), 0) << ReadFile(dir_ / "launch.log")
                              << ReadFile(run_dir / "logs/launch.log");
  // The versions the policy issued: 2 raises the margin, 3 gives the recipe back.
  std::vector<v1::RecipeVersion> versions;
  for (int64_t version : {2, 3}) {
    bool ok = false;
    const v1::RecipeVersion v = Recipe(version, &ok);
    ASSERT_TRUE(ok) << ReadFile(dir_ / "controller.log");
    EXPECT_EQ(v.source(), "health-policy");
    versions.push_back(v);
  }
  // The policy's override goes in front of the spec's.
  ASSERT_EQ(versions[0].recipe().overrides_size(), 2);
  const auto& raised = versions[0].recipe().overrides(0);
  EXPECT_EQ(raised.layers(), "blocks.0.mlp.fc2");
  EXPECT_EQ(raised.margin(), 2);
  EXPECT_EQ(raised.scaling(), v1::RunSpec::Precision::SCALING_DELAYED) << "the rest unchanged";
  EXPECT_NE(versions[0].reason().find(site + ": saturation"), std::string::npos)
      << versions[0].reason();
  ASSERT_EQ(versions[1].recipe().overrides_size(), 1) << "promoted: the spec's recipe again";
  EXPECT_EQ(versions[1].recipe().overrides(0).margin(), 0);
  const int64_t applied = versions[0].applied_step(), promoted = versions[1].applied_step();
  std::printf("outlier from step 4, margin 2 applied at step %lld, promoted at step %lld\n",
              static_cast<long long>(applied), static_cast<long long>(promoted));
  // Within K = 3 intervals the policy acted: the report of step 6 made the version, due
  // recipe_lead_steps later (a step or two more when rank 0's reports lag).
  EXPECT_GE(applied, 9);
  EXPECT_LE(applied, 13) << "the growth lasts to step 15";
  EXPECT_GT(promoted, applied + 6);

  // Rank 0's statistics: saturating from step 4 until the margin applies, then not, although
  // the outlier keeps doubling to step 15. Both ranks quantize with the same scale at every
  // step: they switched at the same step.
  std::map<int64_t, Json> r0, r1;
  for (const Json& j : ReadJsonl(run_dir / "fp8_stats/rank-00000.jsonl")) {
    if (j.value("site", "") == site) r0[j["step"].get<int64_t>()] = j;
  }
  for (const Json& j : ReadJsonl(run_dir / "fp8_stats/rank-00001.jsonl")) {
    if (j.value("site", "") == site) r1[j["step"].get<int64_t>()] = j;
  }
  ASSERT_EQ(r0.size(), 28u);
  ASSERT_EQ(r1.size(), 28u);
  for (int64_t step = 1; step <= 28; ++step) {
    SCOPED_TRACE(step);
    const double sat = r0[step]["saturation_ratio"].get<double>();
    if (step < 4) {
      EXPECT_EQ(sat, 0.0);
    } else if (step < applied) {
      EXPECT_GT(sat, 0.0) << "the outlier saturates at margin 0";
    } else if (step <= 15) {
      EXPECT_EQ(sat, 0.0) << "x2 a step fits in margin 2";
    }
    // (Step 1 has no history yet: each rank scales by its own amax before the first sync.)
    if (step > 1) {
      EXPECT_EQ(r0[step]["scale"].get<float>(), r1[step]["scale"].get<float>());
    }
  }
  const std::vector<Json> metrics = ReadJsonl(run_dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 28u);
  for (const Json& m : metrics) {
    const int64_t step = m["step"].get<int64_t>();
    EXPECT_EQ(m["recipe_version"].get<int64_t>(), step >= promoted  ? 3
                                                  : step >= applied ? 2
                                                                    : 1)
        << m.dump();
  }
  // The launcher's terminal.
  const std::string out = ReadFile(dir_ / "launch.log");
  EXPECT_NE(out.find("health policy: blocks.0.mlp.fc2: margin 0 -> 2 (from step "),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("health policy: blocks.0.mlp.fc2 back to its recipe"), std::string::npos)
      << out;
  // Prometheus (the controller's exposition, which the first test scrapes with a real server).
  const std::string scrape = Capture("curl -s http://" + metrics_ + "/metrics");
  auto sample = [&](const std::string& name, const std::string& label) {
    std::istringstream lines(scrape);
    for (std::string line; std::getline(lines, line);) {
      if (line.starts_with(name + "{") && line.find(label) != std::string::npos &&
          line.find("run=\"tiny-e2e\"") != std::string::npos) {
        return std::stod(line.substr(line.rfind(' ') + 1));
      }
    }
    return -1.0;
  };
  EXPECT_EQ(sample("fp8rt_events_total", "kind=\"layer_recipe_changed\""), 1.0) << scrape;
  EXPECT_EQ(sample("fp8rt_events_total", "kind=\"layer_promoted\""), 1.0) << scrape;
  EXPECT_EQ(sample("fp8rt_recipe_version", ""), 3.0) << scrape;
  // The checkpoint of step 28, both ranks: the site is back at margin 0.
  for (int rank : {0, 1}) {
    auto shard =
        ShardReader::Open((run_dir / "checkpoints/step-00000028" / ShardFileName(rank)).string());
    ASSERT_TRUE(shard.ok()) << shard.status();
    v1::ScalingState state;
    ASSERT_TRUE((*shard)->ParseProto("scaling/" + site, &state).ok());
    EXPECT_EQ(state.margin(), 0);
  }
}

TEST_F(ControlPlaneTest, AStoppedOrRestartedControllerNeverHoldsTheSteps) {
  const fs::path run_dir = dir_ / "stall";
  const std::string id = "tiny-e2e";
  // Micro-batches of 32 sequences: steps long enough (about 0.1 s here) that scheduling noise is
  // small next to them.
  Process launch(LaunchArgv(run_dir.string(),
                            {"--set", "train.steps=100000", "--set", "metrics.every=1", "--set",
                             "checkpoint.every=0", "--set", "train.micro_batch=32"}),
                 dir_ / "stall-launch.log");
  const fs::path metrics = run_dir / "metrics.jsonl";
  // The complete lines of metrics.jsonl (rank 0 may be writing the next one).
  auto complete_lines = [&] {
    std::vector<Json> out;
    std::ifstream in(metrics);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (size_t at = 0, end; (end = text.find('\n', at)) != std::string::npos; at = end + 1) {
      out.push_back(Json::parse(text.substr(at, end - at)));
    }
    return out;
  };
  auto steps_written = [&] { return static_cast<int64_t>(complete_lines().size()); };
  auto wait_for_steps = [&](int64_t n) {
    for (int i = 0; i < 1200 && steps_written() < n && launch.running(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return steps_written() >= n;
  };
  // Steps 1-5 warm up; the baseline is steps 6 up to the stop, 10 s later and at least 10 steps
  // (a sanitizer build on a busy 2-core machine may take over a second a step).
  ASSERT_TRUE(wait_for_steps(5)) << ReadFile(dir_ / "stall-launch.log");
  std::this_thread::sleep_for(std::chrono::seconds(10));
  ASSERT_TRUE(wait_for_steps(15)) << "steps before the stop: " << steps_written();
  const int64_t stopped_at = steps_written();
  // Stopped for 20 s, longer than the worker's call deadline, and for at least 10 steps.
  controller_->Signal(SIGSTOP);
  std::this_thread::sleep_for(std::chrono::seconds(20));
  (void)wait_for_steps(stopped_at + 10);  // at most a minute more
  const int64_t resumed_at = steps_written();
  controller_->Signal(SIGCONT);
  ASSERT_GE(resumed_at - stopped_at, 1) << "no step while the controller was stopped";

  auto step_times = [](const std::vector<Json>& all, int64_t begin, int64_t end) {
    std::vector<double> t;
    for (int64_t i = begin; i < end; ++i) t.push_back(all[i]["step_time_s"].get<double>());
    std::sort(t.begin(), t.end());
    return t;
  };
  {
    // Not a timing check (the machine may be busy with other work): a step that waited on the
    // stopped controller would wait out the worker's call deadline (ControllerOptions::timeout),
    // so the slowest step while it is stopped must stay well under that. The medians are
    // printed for the log only.
    const std::vector<Json> all = complete_lines();
    const std::vector<double> before = step_times(all, 5, stopped_at);
    const std::vector<double> during = step_times(all, stopped_at, resumed_at);
    constexpr double deadline_s = 10.0;  // runtime/worker/controller_client.h, the worker's own
    std::printf(
        "median step time: %.4f s before, %.4f s while stopped (%lld steps, slowest %.4f s, "
        "call deadline %.1f s), ratio %.3f\n",
        before[before.size() / 2], during[during.size() / 2],
        static_cast<long long>(resumed_at - stopped_at), during.back(), deadline_s,
        during[during.size() / 2] / before[before.size() / 2]);
    EXPECT_LT(during.back(), deadline_s / 2) << "a step waited on the stopped controller";
    EXPECT_GE(resumed_at - stopped_at, 10) << "steps while the controller was stopped";
  }
  // After SIGCONT the controller shows the newest step: the queued reports arrive in order.
  v1::Run run;
  for (int i = 0; i < 400; ++i) {
    run = GetRun(id);
    if (run.last_step().step() >= resumed_at) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_GE(run.last_step().step(), resumed_at);
  // 20 s of steps overflow the 64-report queue, or at least the call in flight times out.
  EXPECT_GT(run.reports_dropped(), 0);
  const std::string scrape = Capture("curl -s http://" + metrics_ + "/metrics");
  EXPECT_NE(scrape.find("fp8rt_step_reports_dropped_total{run=\"" + id + "\"}"), std::string::npos);

  // Killed, then restarted on its state folder at the same address: reports resume.
  const std::string address = address_;
  const int64_t killed_at = steps_written();
  controller_->Signal(SIGKILL);
  (void)controller_->Wait();
  StartController(address);
  ASSERT_EQ(address_, address);
  for (int i = 0; i < 600; ++i) {
    run = GetRun(id);
    if (run.last_step().step() > killed_at) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_GT(run.last_step().step(), killed_at) << ReadFile(dir_ / "controller.log");
  EXPECT_TRUE(launch.running());
  // Both ranks back (their heartbeats), before the stop's checkpoint needs every rank's call.
  for (int i = 0; i < 200 && GetRun(id).workers_connected() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(GetRun(id).workers_connected(), 2);

  // The run ends through the controller, which the workers hear through their heartbeats.
  {
    grpc::ClientContext ctx;
    Prepare(&ctx);
    v1::StopRunRequest req;
    req.set_run_id(id);
    v1::Run stopped;
    ASSERT_TRUE(runs_->StopRun(&ctx, req, &stopped).ok());
  }
  EXPECT_EQ(launch.Wait(std::chrono::seconds(120)), 0) << ReadFile(dir_ / "stall-launch.log");
}

}  // namespace
}  // namespace fp8rt
