// The controller commands of `fp8rt` (runs, layers, recipe, checkpoints) as a user runs them,
// against the real fp8rt-controller.
//
// The suite starts one fp8rt-controller (temp token and state folder, ports chosen by the
// kernel, address read from its ready file). Each test creates its own run through the Control
// service as rank 0 of a one-rank worker would: Register with a 2-block spec, three ReportStep
// calls with the FP8 statistics of every site, and one committed checkpoint at step 3 (a real
// shard file written with ShardWriter, acknowledged with its size and XXH64). Then it runs the
// fp8rt binary (fork/exec, stdout and stderr captured) and checks what a user sees: the --json
// documents field by field, and the tables cell by cell, against the values the fake worker
// reported. Commands reach the controller through FP8RT_CONTROLLER / FP8RT_TOKEN_FILE, except
// where a test gives the flags instead.
//
// Index: process helpers (RunProcess; files and ports come from tests/support), the fake
// worker's values (Loss, Site*), the fixture (controller, CreateRun, Fp8rt), then the tests: runs,
// layers, recipe, checkpoints, stop, connection errors.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fp8rt/v1/control.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/checkpoint/checkpoint_dir.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/spec/run_spec.h"
#include "tests/support/test_support.h"

namespace fp8rt {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;
using test::FreePort;
using test::ReadFile;
using test::WriteFile;

// ---------------------------------------------------------------------------------------------
// Processes

struct Result {
  int exit_code = -1;  // -1: killed by a signal or timed out
  std::string out, err;
  double seconds = 0;  // wall time
};

// Runs `argv` with stdout and stderr into files under `dir`, the FP8RT_* variables of this
// process removed and `env` set; kills it after `timeout`.
Result RunProcess(const std::vector<std::string>& argv,
                  const std::map<std::string, std::string>& env, const fs::path& dir,
                  std::chrono::seconds timeout = std::chrono::seconds(60)) {
  const std::string out_path = (dir / "cmd.out").string(), err_path = (dir / "cmd.err").string();
  std::vector<std::string> args = argv;
  std::vector<char*> cargs;
  for (std::string& a : args) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  const auto start = Clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    if (!freopen(out_path.c_str(), "w", stdout) || !freopen(err_path.c_str(), "w", stderr)) {
      _exit(126);
    }
    for (const char* name : {"FP8RT_CONTROLLER", "FP8RT_TOKEN_FILE"}) unsetenv(name);
    for (const auto& [name, value] : env) setenv(name.c_str(), value.c_str(), 1);
    execv(cargs[0], cargs.data());
    _exit(127);
  }
  Result result;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (Clock::now() - start > timeout) {
      ADD_FAILURE() << argv[0] << " did not exit within " << timeout.count() << " s";
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  result.out = ReadFile(out_path);
  result.err = ReadFile(err_path);
  return result;
}

// Lines of `text` whose whitespace-separated cells start with `prefix`.
std::vector<std::vector<std::string>> RowsStartingWith(const std::string& text,
                                                       const std::vector<std::string>& prefix) {
  std::vector<std::vector<std::string>> rows;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::vector<std::string> cells;
    for (std::string w; words >> w;) cells.push_back(w);
    if (cells.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), cells.begin())) {
      rows.push_back(cells);
    }
  }
  return rows;
}

// A row of `fp8rt layers`' statistics table (LAYER TENSOR ...), not of its recipe table
// (LAYER RECIPE...), which lists the same layers first.
bool IsSiteRow(const std::vector<std::string>& row) {
  return row.size() >= 2 && row[0].rfind("blocks.", 0) == 0 &&
         (row[1] == "input" || row[1] == "weight" || row[1] == "grad_output");
}

// ---------------------------------------------------------------------------------------------
// What the fake worker reports

constexpr int kLayers = 2;
constexpr int kSteps = 3;
constexpr int64_t kTrainSteps = 100;
// The controller schedules a recipe update this many steps after the run's latest step
// (its documented default lead).
constexpr int64_t kRecipeLead = 3;

const char* const kGemms[] = {"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"};
const v1::TensorRole kRoles[] = {v1::TENSOR_ROLE_INPUT, v1::TENSOR_ROLE_WEIGHT,
                                 v1::TENSOR_ROLE_GRAD_OUTPUT};
const char* const kRoleWords[] = {"input", "weight", "grad_output"};

// Loss of step s: 6 - s/4, exact in binary (5.75, 5.5, 5.25).
double Loss(int step) { return 6.0 - 0.25 * step; }

// One site's statistics at `step`: distinct per layer, GEMM, role and step, exact in float.
v1::SiteStats Site(int step, int block, int gemm, int role) {
  v1::SiteStats s;
  s.set_layer("blocks." + std::to_string(block) + "." + kGemms[gemm]);
  s.set_tensor(kRoles[role]);
  const float base = static_cast<float>(block * 4 + gemm + 1);  // 1 .. 8
  s.set_amax(step * base * (role == 0 ? 1.0f : role == 1 ? 0.5f : 0.25f));
  s.set_scale(256.0f / base / static_cast<float>(step));
  s.set_underflow_ratio(0.001 * (role + 1) * step);  // 0.1% .. 0.9%
  s.set_saturation_ratio(role == 2 ? 0.0001 * base : 0.0);
  s.set_expert(-1);
  return s;
}

v1::RunSpec Spec(const fs::path& data_path) {
  v1::RunSpec spec = RunSpecDefaults();
  auto* m = spec.mutable_model();
  m->set_layers(kLayers);
  m->set_d_model(128);
  m->set_heads(4);
  m->set_d_ff(512);
  m->set_seq_len(64);
  m->set_vocab(256);
  spec.mutable_train()->set_steps(kTrainSteps);
  spec.mutable_train()->set_micro_batch(8);
  spec.mutable_data()->set_path(data_path.string());
  spec.mutable_checkpoint()->set_every(0);
  return spec;
}

// ---------------------------------------------------------------------------------------------
// fp8rt-controller as a child process

class ControllerProcess {
 public:
  ~ControllerProcess() { Stop(); }

  // Starts fp8rt-controller with its state in dir/<name>-state and `extra` flags; waits for its
  // ready file. Returns "" or what went wrong (with the controller's log).
  std::string Start(const fs::path& dir, const std::string& name, const fs::path& token_file,
                    const std::vector<std::string>& extra = {}) {
    const fs::path ready = dir / (name + "-ready.json");
    const std::string log = (dir / (name + ".log")).string();
    std::vector<std::string> args = {std::string(FP8RT_BIN_DIR) + "/fp8rt-controller",
                                     "--token-file",
                                     token_file.string(),
                                     "--state-dir",
                                     (dir / (name + "-state")).string(),
                                     "--listen",
                                     "127.0.0.1:0",
                                     "--metrics-listen",
                                     "127.0.0.1:0",
                                     "--ready-file",
                                     ready.string()};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> cargs;
    for (std::string& a : args) cargs.push_back(a.data());
    cargs.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      if (!freopen(log.c_str(), "w", stdout) || !freopen(log.c_str(), "a", stderr)) _exit(126);
      execv(cargs[0], cargs.data());
      _exit(127);
    }
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return "fp8rt-controller exited at start: " + ReadFile(log);
      }
      if (fs::exists(ready)) {
        const Json j = Json::parse(ReadFile(ready), nullptr, /*allow_exceptions=*/false);
        if (j.is_object() && j.contains("grpc")) {
          address_ = j["grpc"].get<std::string>();
          return "";
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return "fp8rt-controller wrote no ready file within 30 s: " + ReadFile(log);
  }

  // SIGTERM, then SIGKILL after 10 s.
  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    int status = 0;
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid_ = -1;
  }

  const std::string& address() const { return address_; }  // 127.0.0.1:PORT

 private:
  pid_t pid_ = -1;
  std::string address_;
};

// ---------------------------------------------------------------------------------------------
// The fixture: one controller for the suite, one run per test

class CliControlTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string tmpl = (fs::temp_directory_path() / "fp8rt_cli_control_XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) {
      setup_error_ = "mkdtemp failed";
      return;
    }
    dir_ = new fs::path(tmpl);
    // The controller wants at least 16 characters.
    token_ = new std::string("fp8rt-cli-test-" + std::to_string(getpid()) + "-a7c1e9d2");
    token_file_ = new fs::path(*dir_ / "token");
    WriteFile(*token_file_, *token_ + "\n");  // trailing newline, as `echo` leaves it
    WriteFile(*dir_ / "data.txt", "In the beginning God created the heaven and the earth.\n");
    controller_ = new ControllerProcess();
    setup_error_ = controller_->Start(*dir_, "controller", *token_file_);
    if (!setup_error_.empty()) return;
    address_ = new std::string(controller_->address());
    channel_ = new std::shared_ptr<grpc::Channel>(
        grpc::CreateChannel(*address_, grpc::InsecureChannelCredentials()));
  }

  static void TearDownTestSuite() {
    delete controller_;  // stops it
    delete channel_;
    if (dir_ != nullptr) {
      std::error_code ec;
      fs::remove_all(*dir_, ec);
    }
    delete dir_;
    delete token_;
    delete token_file_;
    delete address_;
  }

  void SetUp() override {
    ASSERT_TRUE(setup_error_.empty()) << setup_error_;
    control_ = v1::Control::NewStub(*channel_);
    // One run per test, named after it (run ids are [a-z0-9._-]).
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    run_id_ = "cli-" + name;
  }

  // A context with the token and a deadline.
  static std::unique_ptr<grpc::ClientContext> Ctx() {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata("authorization", "Bearer " + *token_);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return ctx;
  }

  // Rank 0 of a one-rank run of a `layers`-block model registers.
  void RegisterRun(int layers) {
    run_dir_ = *dir_ / run_id_;
    fs::create_directories(run_dir_);
    v1::RegisterRequest reg;
    reg.set_run_id(run_id_);
    reg.set_rank(0);
    reg.set_world_size(1);
    *reg.mutable_spec() = Spec(*dir_ / "data.txt");
    reg.mutable_spec()->mutable_model()->set_layers(layers);
    reg.set_run_dir(run_dir_.string());
    reg.set_hostname("localhost");
    reg.set_pid(getpid());
    v1::RegisterResponse registered;
    const grpc::Status s = control_->Register(Ctx().get(), reg, &registered);
    ASSERT_TRUE(s.ok()) << "Register: " << s.error_message();
    ASSERT_EQ(registered.recipe().version(), 1);
  }

  // Reports step `step` (loss Loss(step)) with `sites`.
  // `recipe_version` and `applied_step`: the version the fake worker trains with, and the step it
  // applied it at (0: none newly applied).
  void ReportStep(int step, const std::vector<v1::SiteStats>& sites, int64_t recipe_version = 1,
                  int64_t applied_step = 0) {
    v1::ReportStepRequest report;
    report.set_run_id(run_id_);
    v1::StepMetrics* m = report.mutable_metrics();
    m->set_step(step);
    m->set_loss(Loss(step));
    m->set_grad_norm(1.5);
    m->set_lr(1e-3);
    m->set_tokens_per_s(1000.0 * step);
    m->set_step_time_s(0.5);
    m->set_recipe_version(recipe_version);
    report.set_recipe_applied_step(applied_step);
    for (const v1::SiteStats& site : sites) *report.add_sites() = site;
    v1::ReportStepResponse reported;
    const grpc::Status s = control_->ReportStep(Ctx().get(), report, &reported);
    ASSERT_TRUE(s.ok()) << "ReportStep " << step << ": " << s.error_message();
  }

  // Saves a checkpoint of `step` as the one rank: a real shard file in the controller's temp
  // folder, acknowledged with its size and XXH64; the controller commits it.
  void CommitCheckpoint(int step) {
    v1::BeginCheckpointRequest begin;
    begin.set_run_id(run_id_);
    begin.set_step(step);
    v1::BeginCheckpointResponse temp;
    grpc::Status s = control_->BeginCheckpoint(Ctx().get(), begin, &temp);
    ASSERT_TRUE(s.ok()) << "BeginCheckpoint: " << s.error_message();
    ShardWriter writer;
    const std::vector<std::byte> payload(4096, std::byte{0x5a});
    ASSERT_TRUE(writer.Add("master/blocks.0.mlp.fc1", payload).ok());
    const std::string file = ShardFileName(0);
    const absl::StatusOr<ShardWriteResult> written =
        writer.Write((fs::path(temp.temp_dir()) / file).string());
    ASSERT_TRUE(written.ok()) << written.status();
    shard_bytes_ = written->size;
    v1::AckShardRequest ack;
    ack.set_run_id(run_id_);
    ack.set_step(step);
    ack.set_rank(0);
    ack.set_file(file);
    ack.set_size(written->size);
    ack.set_xxh64(written->xxh64);
    ack.set_data_position(0);
    v1::AckShardResponse acked;
    s = control_->AckShard(Ctx().get(), ack, &acked);
    ASSERT_TRUE(s.ok()) << "AckShard: " << s.error_message();
    ASSERT_TRUE(acked.committed());
  }

  // The standard run: kLayers blocks, kSteps steps with the statistics of every site, a
  // checkpoint of step kSteps.
  void CreateRun() {
    ASSERT_NO_FATAL_FAILURE(RegisterRun(kLayers));
    for (int step = 1; step <= kSteps; ++step) {
      std::vector<v1::SiteStats> sites;
      for (int block = 0; block < kLayers; ++block) {
        for (int gemm = 0; gemm < 4; ++gemm) {
          for (int role = 0; role < 3; ++role) sites.push_back(Site(step, block, gemm, role));
        }
      }
      ASSERT_NO_FATAL_FAILURE(ReportStep(step, sites));
    }
    ASSERT_NO_FATAL_FAILURE(CommitCheckpoint(kSteps));
  }

  v1::HeartbeatResponse Heartbeat() {
    v1::HeartbeatRequest request;
    request.set_run_id(run_id_);
    request.set_rank(0);
    request.set_step(kSteps);
    v1::HeartbeatResponse response;
    const grpc::Status s = control_->Heartbeat(Ctx().get(), request, &response);
    EXPECT_TRUE(s.ok()) << "Heartbeat: " << s.error_message();
    return response;
  }

  // `fp8rt ARGS` with FP8RT_CONTROLLER and FP8RT_TOKEN_FILE pointing at the suite's controller
  // (`env` adds or replaces variables; an empty value removes one).
  Result Fp8rt(const std::vector<std::string>& args, std::map<std::string, std::string> env = {},
               std::chrono::seconds timeout = std::chrono::seconds(60)) {
    std::map<std::string, std::string> full = {{"FP8RT_CONTROLLER", *address_},
                                               {"FP8RT_TOKEN_FILE", token_file_->string()}};
    for (auto& [k, v] : env) full[k] = v;
    for (auto it = full.begin(); it != full.end();) {
      it = it->second.empty() ? full.erase(it) : std::next(it);
    }
    std::vector<std::string> argv = {std::string(FP8RT_BIN_DIR) + "/fp8rt"};
    argv.insert(argv.end(), args.begin(), args.end());
    Result r = RunProcess(argv, full, *dir_, timeout);
    // Whatever happens, the token never shows; stderr is empty on success, one line otherwise.
    EXPECT_THAT(r.out + r.err, Not(HasSubstr(*token_)));
    if (r.exit_code == 0) {
      EXPECT_EQ(r.err, "");
    } else {
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    }
    return r;
  }

  // `fp8rt ARGS --json`: exit 0 and one JSON document on stdout.
  Json Fp8rtJson(std::vector<std::string> args) {
    args.push_back("--json");
    const Result r = Fp8rt(args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    const Json j = Json::parse(r.out, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(j.is_discarded()) << "not one JSON document: " << r.out;
    return j;
  }

  static inline std::string setup_error_;
  static inline fs::path* dir_ = nullptr;         // the suite's temp folder
  static inline std::string* token_ = nullptr;    // the controller's token
  static inline fs::path* token_file_ = nullptr;  // holding *token_ and a newline
  static inline std::string* address_ = nullptr;  // the controller's gRPC address
  static inline std::shared_ptr<grpc::Channel>* channel_ = nullptr;
  static inline ControllerProcess* controller_ = nullptr;

  std::unique_ptr<v1::Control::Stub> control_;
  std::string run_id_;        // this test's run
  fs::path run_dir_;          // its run folder
  uint64_t shard_bytes_ = 0;  // size of its one checkpoint shard
};

// ---------------------------------------------------------------------------------------------
// runs

TEST_F(CliControlTest, RunsListShowsTheRunWithItsStepAndLoss) {
  ASSERT_NO_FATAL_FAILURE(CreateRun());
  const Json list = Fp8rtJson({"runs", "list"});
  ASSERT_TRUE(list.contains("runs")) << list.dump();
  const Json* run = nullptr;
  for (const Json& r : list["runs"]) {
    if (r["run_id"] == run_id_) run = &r;
  }
  ASSERT_NE(run, nullptr) << list.dump();
  EXPECT_EQ((*run)["state"], "running");
  EXPECT_EQ((*run)["world_size"], 1);
  EXPECT_EQ((*run)["last_step"]["step"], kSteps);
  EXPECT_EQ((*run)["last_step"]["loss"], Loss(kSteps));
  EXPECT_EQ((*run)["recipe_version"], 1);
  EXPECT_EQ((*run)["last_checkpoint_step"], kSteps);

  const Result table = Fp8rt({"runs", "list"});
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_THAT(table.out, HasSubstr("RUN"));
  const auto rows = RowsStartingWith(table.out, {run_id_});
  ASSERT_EQ(rows.size(), 1u) << table.out;
  // RUN STATE STEP LOSS TOKENS/S WORKERS RECIPE CHECKPOINT
  ASSERT_EQ(rows[0].size(), 8u) << table.out;
  EXPECT_EQ(rows[0][1], "running");
  EXPECT_EQ(rows[0][2], "3/100");
  EXPECT_DOUBLE_EQ(std::stod(rows[0][3]), Loss(kSteps));
  EXPECT_DOUBLE_EQ(std::stod(rows[0][4]), 3000.0);
  EXPECT_EQ(rows[0][6], "v1");
  EXPECT_EQ(rows[0][7], "3");
}

TEST_F(CliControlTest, RunsGetShowsTheRun) {
  ASSERT_NO_FATAL_FAILURE(CreateRun());
  const Json run = Fp8rtJson({"runs", "get", run_id_});
  EXPECT_EQ(run["run_id"], run_id_);
  EXPECT_EQ(run["state"], "running");
  EXPECT_EQ(run["run_dir"], run_dir_.string());
  EXPECT_EQ(run["last_step"]["step"], kSteps);
  EXPECT_EQ(run["last_step"]["loss"], Loss(kSteps));
  EXPECT_EQ(run["last_step"]["tokens_per_s"], 3000.0);
  EXPECT_EQ(run["spec"]["model"]["layers"], kLayers);
  EXPECT_EQ(run["spec"]["train"]["steps"], kTrainSteps);  // int64 as a JSON number
  EXPECT_EQ(run["spec"]["precision"]["scaling"], "delayed");
  EXPECT_EQ(run["last_checkpoint_step"], kSteps);

  const Result details = Fp8rt({"runs", "get", run_id_});
  ASSERT_EQ(details.exit_code, 0) << details.err;
  const auto state = RowsStartingWith(details.out, {"state"});
  ASSERT_EQ(state.size(), 1u) << details.out;
  EXPECT_EQ(state[0][1], "running");
  const auto step = RowsStartingWith(details.out, {"step"});
  ASSERT_EQ(step.size(), 1u) << details.out;
  EXPECT_EQ(step[0][1], "3/100");
  const auto loss = RowsStartingWith(details.out, {"loss"});
  ASSERT_EQ(loss.size(), 1u) << details.out;
  EXPECT_DOUBLE_EQ(std::stod(loss[0][1]), Loss(kSteps));
  EXPECT_THAT(details.out, HasSubstr(run_dir_.string()));
}

TEST_F(CliControlTest, UnknownRunIsNotFoundExit2) {
  const Result r = Fp8rt({"runs", "get", "no-such-run"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("fp8rt runs get: NOT_FOUND: "));
  EXPECT_THAT(r.err, HasSubstr("no-such-run"));
  EXPECT_EQ(r.out, "");
}

// ---------------------------------------------------------------------------------------------
// layers

TEST_F(CliControlTest, LayersShowsEverySiteOfTheLatestStep) {
  ASSERT_NO_FATAL_FAILURE(CreateRun());
  // The expected order: layers in model order as names sort (blocks.0.attn.proj before
  // blocks.0.attn.qkv), then input, weight, grad_output.
  struct Expected {
    v1::SiteStats site;
    int role;
  };
  std::vector<Expected> expected;
  for (int block = 0; block < kLayers; ++block) {
    for (int gemm = 0; gemm < 4; ++gemm) {
      for (int role = 0; role < 3; ++role)
        expected.push_back({Site(kSteps, block, gemm, role), role});
    }
  }
  std::stable_sort(expected.begin(), expected.end(), [](const Expected& a, const Expected& b) {
    if (a.site.layer() != b.site.layer()) return a.site.layer() < b.site.layer();
    return a.role < b.role;
  });

  const Json layers = Fp8rtJson({"layers", run_id_});
  EXPECT_EQ(layers["step"], kSteps);
  ASSERT_EQ(layers["sites"].size(), expected.size()) << layers.dump();
  for (size_t i = 0; i < expected.size(); ++i) {
    const Json& got = layers["sites"][i];
    const v1::SiteStats& want = expected[i].site;
    SCOPED_TRACE(want.layer() + " " + kRoleWords[expected[i].role]);
    EXPECT_EQ(got["layer"], want.layer());
    EXPECT_EQ(got["tensor"], kRoleWords[expected[i].role]);
    EXPECT_EQ(got["amax"].get<float>(), want.amax());
    EXPECT_EQ(got["scale"].get<float>(), want.scale());
    EXPECT_DOUBLE_EQ(got["underflow_ratio"].get<double>(), want.underflow_ratio());
    EXPECT_DOUBLE_EQ(got["saturation_ratio"].get<double>(), want.saturation_ratio());
    EXPECT_EQ(got["expert"], -1);
  }

  const Result table = Fp8rt({"layers", run_id_});
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_THAT(table.out, HasSubstr("step 3"));
  EXPECT_THAT(table.out, HasSubstr("SATURATION %"));
  EXPECT_THAT(table.out, Not(HasSubstr("EXPERT"))) << "no site is an expert's";
  const auto rows = RowsStartingWith(table.out, {});
  // Header line, column titles, then one row per site in the expected order.
  std::vector<std::vector<std::string>> site_rows;
  for (const auto& row : rows) {
    if (IsSiteRow(row)) site_rows.push_back(row);
  }
  ASSERT_EQ(site_rows.size(), expected.size()) << table.out;
  for (size_t i = 0; i < expected.size(); ++i) {
    const auto& row = site_rows[i];
    const v1::SiteStats& want = expected[i].site;
    SCOPED_TRACE(table.out);
    ASSERT_EQ(row.size(), 6u);
    EXPECT_EQ(row[0], want.layer());
    EXPECT_EQ(row[1], kRoleWords[expected[i].role]);
    EXPECT_NEAR(std::stod(row[2]), want.amax(), 1e-5 * want.amax());
    EXPECT_NEAR(std::stod(row[3]), want.scale(), 1e-5 * want.scale());
    EXPECT_NEAR(std::stod(row[4]), 100 * want.underflow_ratio(), 1e-4);  // percent
    EXPECT_NEAR(std::stod(row[5]), 100 * want.saturation_ratio(), 1e-4);
  }
}

TEST_F(CliControlTest, LayersSortBlocksNumericallyAndShowExperts) {
  ASSERT_NO_FATAL_FAILURE(RegisterRun(12));
  auto site = [](const std::string& layer, v1::TensorRole role, int64_t expert, float amax) {
    v1::SiteStats s;
    s.set_layer(layer);
    s.set_tensor(role);
    s.set_expert(expert);
    s.set_amax(amax);
    s.set_scale(448.0f / amax);
    return s;
  };
  // Reported in no particular order; blocks.10 must come after blocks.2, as in the model.
  ASSERT_NO_FATAL_FAILURE(
      ReportStep(1, {site("blocks.10.mlp.fc1", v1::TENSOR_ROLE_WEIGHT, 1, 5.0f),
                     site("blocks.10.mlp.fc1", v1::TENSOR_ROLE_WEIGHT, 0, 4.0f),
                     site("blocks.2.attn.qkv", v1::TENSOR_ROLE_GRAD_OUTPUT, -1, 3.0f),
                     site("blocks.2.attn.qkv", v1::TENSOR_ROLE_INPUT, -1, 2.0f),
                     site("blocks.10.mlp.fc1", v1::TENSOR_ROLE_INPUT, 0, 1.0f)}));
  const std::vector<std::vector<std::string>> expected = {
      {"blocks.2.attn.qkv", "input", "-", "2"},  {"blocks.2.attn.qkv", "grad_output", "-", "3"},
      {"blocks.10.mlp.fc1", "input", "0", "1"},  {"blocks.10.mlp.fc1", "weight", "0", "4"},
      {"blocks.10.mlp.fc1", "weight", "1", "5"},
  };
  const Result table = Fp8rt({"layers", run_id_});
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_THAT(table.out, HasSubstr("EXPERT"));
  std::vector<std::vector<std::string>> rows;
  for (const auto& row : RowsStartingWith(table.out, {})) {
    if (IsSiteRow(row)) rows.push_back(row);
  }
  ASSERT_EQ(rows.size(), expected.size()) << table.out;
  for (size_t i = 0; i < expected.size(); ++i) {
    SCOPED_TRACE(table.out);
    ASSERT_EQ(rows[i].size(), 7u);  // LAYER TENSOR EXPERT AMAX SCALE UNDERFLOW SATURATION
    EXPECT_EQ(std::vector<std::string>(rows[i].begin(), rows[i].begin() + 4), expected[i]);
  }
  const Json layers = Fp8rtJson({"layers", run_id_});
  ASSERT_EQ(layers["sites"].size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(layers["sites"][i]["layer"], expected[i][0]);
    EXPECT_EQ(layers["sites"][i]["tensor"], expected[i][1]);
  }
}

// ---------------------------------------------------------------------------------------------
// recipe

TEST_F(CliControlTest, RecipeGetShowsTheSpecRecipe) {
  ASSERT_NO_FATAL_FAILURE(CreateRun());
  const Json version = Fp8rtJson({"recipe", "get", run_id_});
  EXPECT_EQ(version["version"], 1);
  EXPECT_EQ(version["source"], "spec");
  EXPECT_EQ(version["recipe"]["scaling"], "delayed");
  EXPECT_EQ(version["recipe"]["amax_history_len"], 16);
  EXPECT_EQ(version["recipe"]["amax_compute_algo"], "max");
  EXPECT_EQ(version["recipe"]["margin"], 0);
  EXPECT_EQ(version["recipe"]["fsdp_gather"], "fp8");
  EXPECT_EQ(version["recipe"]["grad_reduce"], "fp32");
  EXPECT_EQ(version["recipe"]["exclude"], Json::array());

  const Result table = Fp8rt({"recipe", "get", run_id_});
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_THAT(table.out, HasSubstr("recipe version 1"));
  const auto margin = RowsStartingWith(table.out, {"margin"});
  ASSERT_EQ(margin.size(), 1u) << table.out;
  EXPECT_EQ(margin[0][1], "0");
  const auto scaling = RowsStartingWith(table.out, {"scaling"});
  ASSERT_EQ(scaling.size(), 1u) << table.out;
  EXPECT_EQ(scaling[0][1], "delayed");
}

TEST_F(CliControlTest, RecipeSetSchedulesANewVersion) {
  ASSERT_NO_FATAL_FAILURE(CreateRun());
  const Json updated = Fp8rtJson({"recipe", "set", run_id_, "--margin", "2", "--reason", "x"});
  EXPECT_EQ(updated["version"], 2);
  EXPECT_EQ(updated["effective_step"], kSteps + kRecipeLead);
  EXPECT_EQ(updated["recipe"]["margin"], 2);
  EXPECT_EQ(updated["recipe"]["scaling"], "delayed") << "fields not given stay as they were";
  EXPECT_EQ(updated["reason"], "x");
  EXPECT_EQ(updated["source"], "user");

  // The workers see it in their next heartbeat.
  const v1::HeartbeatResponse beat = Heartbeat();
  EXPECT_EQ(beat.recipe().version(), 2);
  EXPECT_EQ(beat.recipe().recipe().margin(), 2);

  // A second change, in words, keeps the first: the human form names version and step.
  const Result human = Fp8rt({"recipe", "set", run_id_, "--scaling", "current", "--exclude-add",
                              "blocks.1.mlp.fc2,blocks.0.attn.qkv"});
  ASSERT_EQ(human.exit_code, 0) << human.err;
  EXPECT_THAT(human.out, HasSubstr("recipe version 3 takes effect at step 6"));
  const Json now = Fp8rtJson({"recipe", "get", run_id_});
  EXPECT_EQ(now["version"], 3);
  EXPECT_EQ(now["recipe"]["margin"], 2);
  EXPECT_EQ(now["recipe"]["scaling"], "current");
  EXPECT_EQ(now["recipe"]["exclude"], Json({"blocks.1.mlp.fc2", "blocks.0.attn.qkv"}));

  const Json removed =
      Fp8rtJson({"recipe", "set", run_id_, "--exclude-remove", "blocks.1.mlp.fc2"});
  EXPECT_EQ(removed["version"], 4);
  EXPECT_EQ(removed["recipe"]["exclude"], Json({"blocks.0.attn.qkv"}));
  const Json cleared = Fp8rtJson({"recipe", "set", run_id_, "--exclude", ""});
  EXPECT_EQ(cleared["recipe"]["exclude"], Json::array());
}

// Per-layer recipes (precision.overrides) through `fp8rt recipe set --override`, and each
// layer's effective recipe in `fp8rt layers`: the spec's until the workers report the new
// version applied, then the first matching override's.
TEST_F(CliControlTest, LayersShowEachLayersRecipeAndRecipeSetTakesOverrides) {
  ASSERT_NO_FATAL_FAILURE(CreateRun());
  const size_t kModelLayers = kLayers * 4 + 1;  // four GEMMs a block, and lm_head
  Json layers = Fp8rtJson({"layers", run_id_});
  ASSERT_EQ(layers["recipes"].size(), kModelLayers) << layers.dump();
  for (const Json& r : layers["recipes"]) {
    EXPECT_EQ(r["mode"], "fp8") << r.dump();
    EXPECT_EQ(r["scaling"], "delayed") << r.dump();
    EXPECT_EQ(r["override_index"], -1) << r.dump();
    EXPECT_EQ(r["recipe_version"], 1) << r.dump();
  }
  EXPECT_EQ(layers["recipes"][0]["layer"], "blocks.0.attn.qkv");
  EXPECT_EQ(layers["recipes"][kModelLayers - 1]["layer"], "lm_head");

  const Result set = Fp8rt({"recipe", "set", run_id_, "--override", "blocks.1.mlp.*:mode=bf16",
                            "--override", "blocks.*:scaling=current, margin=2"});
  ASSERT_EQ(set.exit_code, 0) << set.err;
  EXPECT_THAT(set.out, HasSubstr("recipe version 2"));
  const Json now = Fp8rtJson({"recipe", "get", run_id_});
  ASSERT_EQ(now["recipe"]["overrides"].size(), 2u) << now.dump();
  EXPECT_EQ(now["recipe"]["overrides"][0]["layers"], "blocks.1.mlp.*");
  EXPECT_EQ(now["recipe"]["overrides"][0]["mode"], "bf16");
  EXPECT_EQ(now["recipe"]["overrides"][1]["scaling"], "current");
  EXPECT_EQ(now["recipe"]["overrides"][1]["margin"], 2);
  const Result get = Fp8rt({"recipe", "get", run_id_});
  EXPECT_THAT(get.out, HasSubstr("'blocks.1.mlp.*': bf16; 'blocks.*': scaling current, margin 2"));
  // The workers get it in their heartbeat.
  const v1::HeartbeatResponse beat = Heartbeat();
  EXPECT_EQ(beat.recipe().version(), 2);
  ASSERT_EQ(beat.recipe().recipe().overrides_size(), 2);

  // Not applied yet: the layers still show version 1.
  layers = Fp8rtJson({"layers", run_id_});
  EXPECT_EQ(layers["recipes"][0]["recipe_version"], 1);
  // The worker applies it at step 6.
  ASSERT_NO_FATAL_FAILURE(ReportStep(6, {}, 2, 6));
  layers = Fp8rtJson({"layers", run_id_});
  std::map<std::string, Json> by_layer;
  for (const Json& r : layers["recipes"]) by_layer[r["layer"].get<std::string>()] = r;
  ASSERT_EQ(by_layer.size(), kModelLayers);
  for (const char* name : {"blocks.1.mlp.fc1", "blocks.1.mlp.fc2"}) {
    SCOPED_TRACE(name);
    EXPECT_EQ(by_layer[name]["mode"], "bf16");
    EXPECT_EQ(by_layer[name]["override_index"], 0) << "the first match wins";
    EXPECT_EQ(by_layer[name]["recipe_version"], 2);
  }
  for (const char* name : {"blocks.0.attn.qkv", "blocks.0.mlp.fc2", "blocks.1.attn.proj"}) {
    SCOPED_TRACE(name);
    EXPECT_EQ(by_layer[name]["mode"], "fp8");
    EXPECT_EQ(by_layer[name]["scaling"], "current");
    EXPECT_EQ(by_layer[name]["margin"], 2);
    EXPECT_EQ(by_layer[name]["amax_history_len"], 16) << "the run's, unset in the override";
    EXPECT_EQ(by_layer[name]["override_index"], 1);
  }
  EXPECT_EQ(by_layer["lm_head"]["scaling"], "delayed");
  EXPECT_EQ(by_layer["lm_head"]["override_index"], -1);
  // The table: a row per layer with its recipe in words.
  const Result table = Fp8rt({"layers", run_id_});
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_THAT(table.out, HasSubstr("each layer's recipe (version 2)"));
  const auto fc2 = RowsStartingWith(table.out, {"blocks.1.mlp.fc2", "bf16"});
  ASSERT_EQ(fc2.size(), 1u) << table.out;
  EXPECT_EQ(fc2[0].back(), "#0)");
  const auto qkv = RowsStartingWith(table.out, {"blocks.0.attn.qkv", "fp8", "current"});
  ASSERT_EQ(qkv.size(), 1u) << table.out;
  EXPECT_THAT(qkv[0], ::testing::Contains("2"));
  EXPECT_EQ(qkv[0].back(), "#1)");

  // A pattern that matches no layer is refused by the controller, naming the entry.
  const Result none = Fp8rt({"recipe", "set", run_id_, "--override", "blocks.9.*:mode=bf16"});
  EXPECT_EQ(none.exit_code, 2) << none.err;
  EXPECT_THAT(none.err, HasSubstr("recipe.overrides[0].layers"));
  EXPECT_THAT(none.err, HasSubstr("'blocks.9.*' matches no layer"));
  // Bad flags are refused by the CLI, naming the key.
  const Result key = Fp8rt({"recipe", "set", run_id_, "--override", "blocks.*:colour=red"});
  EXPECT_EQ(key.exit_code, 2) << key.err;
  EXPECT_THAT(key.err, HasSubstr("--override: unknown key 'colour'"));
  const Result margin = Fp8rt({"recipe", "set", run_id_, "--override", "blocks.*:margin=40"});
  EXPECT_EQ(margin.exit_code, 2) << margin.err;
  EXPECT_THAT(margin.err, HasSubstr("--override margin"));
  const Result shape = Fp8rt({"recipe", "set", run_id_, "--override", "mode=bf16"});
  EXPECT_EQ(shape.exit_code, 2) << shape.err;
  EXPECT_THAT(shape.err, HasSubstr("expected GLOB:key=value"));
  EXPECT_EQ(Fp8rtJson({"recipe", "get", run_id_})["version"], 2) << "nothing stored";
  // --clear-overrides removes them.
  const Json cleared = Fp8rtJson({"recipe", "set", run_id_, "--clear-overrides"});
  EXPECT_EQ(cleared["version"], 3);
  EXPECT_EQ(cleared["recipe"]["overrides"], Json::array());
}

TEST_F(CliControlTest, RecipeSetRejectsBadValuesWithExit2) {
  ASSERT_NO_FATAL_FAILURE(CreateRun());
  // The controller refuses an out-of-range margin, naming the field.
  const Result margin = Fp8rt({"recipe", "set", run_id_, "--margin", "99"});
  EXPECT_EQ(margin.exit_code, 2) << margin.err;
  EXPECT_THAT(margin.err, HasSubstr("fp8rt recipe set: INVALID_ARGUMENT: "));
  EXPECT_THAT(margin.err, HasSubstr("recipe.margin"));
  // ... and a layer the model does not have (2 blocks: no blocks.7).
  const Result layer = Fp8rt({"recipe", "set", run_id_, "--exclude-add", "blocks.7.mlp.fc1"});
  EXPECT_EQ(layer.exit_code, 2) << layer.err;
  EXPECT_THAT(layer.err, HasSubstr("blocks.7.mlp.fc1"));
  // The CLI refuses a word that is no enum value, naming the flag and the choices.
  const Result word = Fp8rt({"recipe", "set", run_id_, "--scaling", "fast"});
  EXPECT_EQ(word.exit_code, 2) << word.err;
  EXPECT_THAT(word.err,
              HasSubstr("--scaling: expected one of delayed, current, block, mx32, got 'fast'"));
  const Result algo = Fp8rt({"recipe", "set", run_id_, "--amax-compute-algo", "mean"});
  EXPECT_EQ(algo.exit_code, 2) << algo.err;
  EXPECT_THAT(algo.err, HasSubstr("--amax-compute-algo"));
  // Removing a layer that is not excluded, or changing nothing.
  const Result remove = Fp8rt({"recipe", "set", run_id_, "--exclude-remove", "blocks.0.mlp.fc1"});
  EXPECT_EQ(remove.exit_code, 2) << remove.err;
  EXPECT_THAT(remove.err, HasSubstr("--exclude-remove: blocks.0.mlp.fc1 is not excluded"));
  const Result nothing = Fp8rt({"recipe", "set", run_id_});
  EXPECT_EQ(nothing.exit_code, 2) << nothing.err;
  EXPECT_THAT(nothing.err, HasSubstr("nothing to change"));
  // None of these made a version.
  EXPECT_EQ(Fp8rtJson({"recipe", "get", run_id_})["version"], 1);
}

// ---------------------------------------------------------------------------------------------
// checkpoints

TEST_F(CliControlTest, CheckpointsListAndSave) {
  ASSERT_NO_FATAL_FAILURE(CreateRun());
  const Json list = Fp8rtJson({"checkpoints", "list", run_id_});
  ASSERT_EQ(list["checkpoints"].size(), 1u) << list.dump();
  EXPECT_EQ(list["checkpoints"][0]["step"], kSteps);
  EXPECT_EQ(list["checkpoints"][0]["bytes"], shard_bytes_);
  EXPECT_EQ(list["checkpoints"][0]["dir"], CheckpointDir(run_dir_.string()).CommittedDir(kSteps));

  const Result table = Fp8rt({"checkpoints", "list", run_id_});
  ASSERT_EQ(table.exit_code, 0) << table.err;
  const auto rows = RowsStartingWith(table.out, {"3"});
  ASSERT_EQ(rows.size(), 1u) << table.out;
  EXPECT_THAT(table.out, HasSubstr(CheckpointDir(run_dir_.string()).CommittedDir(kSteps)));

  EXPECT_FALSE(Heartbeat().save_checkpoint()) << "nobody asked yet";
  const Result save = Fp8rt({"checkpoints", "save", run_id_});
  ASSERT_EQ(save.exit_code, 0) << save.err;
  EXPECT_THAT(save.out, HasSubstr(run_id_));
  EXPECT_TRUE(Heartbeat().save_checkpoint());
}

// ---------------------------------------------------------------------------------------------
// stop

TEST_F(CliControlTest, RunsStopTellsTheWorkers) {
  ASSERT_NO_FATAL_FAILURE(CreateRun());
  EXPECT_FALSE(Heartbeat().stop());
  const Json stopped = Fp8rtJson({"runs", "stop", run_id_});
  EXPECT_EQ(stopped["run_id"], run_id_);
  EXPECT_EQ(stopped["state"], "stopping");
  EXPECT_TRUE(Heartbeat().stop());
  EXPECT_EQ(Fp8rtJson({"runs", "get", run_id_})["state"], "stopping");
}

// ---------------------------------------------------------------------------------------------
// Connection errors

TEST_F(CliControlTest, WrongTokenIsUnauthenticatedExit1) {
  const fs::path wrong = *dir_ / "wrong-token";
  WriteFile(wrong, "not-the-token\n");
  const Result r =
      Fp8rt({"runs", "list", "--token-file", wrong.string()}, {{"FP8RT_TOKEN_FILE", ""}});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("fp8rt runs list: UNAUTHENTICATED: "));
  EXPECT_THAT(r.err, HasSubstr("--token-file"));
  EXPECT_THAT(r.err, Not(HasSubstr("not-the-token")));
  EXPECT_EQ(r.out, "");
}

TEST_F(CliControlTest, FlagsWorkWithoutTheEnvironment) {
  ASSERT_NO_FATAL_FAILURE(CreateRun());
  const Result r = Fp8rt({"runs", "get", run_id_, "--controller", *address_, "--token-file",
                          token_file_->string(), "--json"},
                         {{"FP8RT_CONTROLLER", ""}, {"FP8RT_TOKEN_FILE", ""}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(Json::parse(r.out)["run_id"], run_id_);
}

TEST_F(CliControlTest, UnreachableControllerNamesTheAddressWithinTheTimeout) {
  const int port = FreePort();  // bound by the kernel's choice, then closed: nobody listens
  ASSERT_GT(port, 0);
  const std::string address = "127.0.0.1:" + std::to_string(port);
  const Result r = Fp8rt({"runs", "list", "--timeout-s", "3"}, {{"FP8RT_CONTROLLER", address}},
                         std::chrono::seconds(30));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("fp8rt runs list: UNAVAILABLE: "));
  EXPECT_THAT(r.err, HasSubstr(address));
  EXPECT_LT(r.seconds, 3.0 + 2.0) << "the deadline bounds the wait";
}

TEST_F(CliControlTest, SilentControllerHitsTheDeadline) {
  // A socket that accepts connections (the kernel completes the handshake from the backlog) but
  // never speaks HTTP/2: the call can only end at its deadline.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 16), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string address = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  const Result r = Fp8rt({"layers", "some-run", "--timeout-s", "1.5"},
                         {{"FP8RT_CONTROLLER", address}}, std::chrono::seconds(30));
  close(fd);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("fp8rt layers: DEADLINE_EXCEEDED: "));
  EXPECT_THAT(r.err, HasSubstr(address));
  EXPECT_THAT(r.err, HasSubstr("1.5 s"));
  EXPECT_GE(r.seconds, 1.4);
  EXPECT_LT(r.seconds, 1.5 + 2.0);
}

TEST_F(CliControlTest, TlsWithTheControllersCa) {
  const fs::path openssl = "/usr/bin/openssl";
  if (!fs::exists(openssl)) GTEST_SKIP() << "no " << openssl << " to make a certificate with";
  // Self-signed certificates for 127.0.0.1: one the controller serves, one it does not.
  for (const std::string name : {"tls", "other"}) {
    const Result made = RunProcess(
        {openssl.string(), "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
         "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout",
         (*dir_ / (name + "-key.pem")).string(), "-out", (*dir_ / (name + "-cert.pem")).string()},
        {}, *dir_);
    ASSERT_EQ(made.exit_code, 0) << made.err;
  }
  const std::string cert = (*dir_ / "tls-cert.pem").string();
  ControllerProcess tls;
  const std::string error =
      tls.Start(*dir_, "tls-controller", *token_file_,
                {"--tls-cert", cert, "--tls-key", (*dir_ / "tls-key.pem").string()});
  ASSERT_EQ(error, "");
  const std::map<std::string, std::string> env = {{"FP8RT_CONTROLLER", tls.address()}};

  const Result ok = Fp8rt({"runs", "list", "--json", "--tls-ca", cert}, env);
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_EQ(Json::parse(ok.out), Json({{"runs", Json::array()}})) << "a fresh controller";

  // Plaintext to a TLS listener, and TLS trusting the wrong CA, both fail naming the address.
  const Result plain = Fp8rt({"runs", "list", "--timeout-s", "3"}, env);
  EXPECT_EQ(plain.exit_code, 1) << plain.err;
  EXPECT_THAT(plain.err, HasSubstr(tls.address()));
  const Result wrong_ca = Fp8rt(
      {"runs", "list", "--timeout-s", "3", "--tls-ca", (*dir_ / "other-cert.pem").string()}, env);
  EXPECT_EQ(wrong_ca.exit_code, 1) << wrong_ca.err;
  EXPECT_THAT(wrong_ca.err, HasSubstr(tls.address()));
  // A CA file that does not exist is bad input.
  const Result no_ca = Fp8rt({"runs", "list", "--tls-ca", (*dir_ / "absent-ca.pem").string()}, env);
  EXPECT_EQ(no_ca.exit_code, 2) << no_ca.err;
  EXPECT_THAT(no_ca.err, HasSubstr("absent-ca.pem"));

  // A certificate or key that is not PEM (the placeholder of deploy/kubernetes/components/tls)
  // stops the controller at start naming the flag and the file, instead of gRPC's "cannot
  // listen".
  const fs::path placeholder = *dir_ / "placeholder.pem";
  std::ofstream(placeholder) << "CHANGE-ME";
  for (const auto& [flag, args] :
       {std::pair<std::string, std::vector<std::string>>{
            "--tls-cert",
            {"--tls-cert", placeholder.string(), "--tls-key", (*dir_ / "tls-key.pem").string()}},
        {"--tls-key", {"--tls-cert", cert, "--tls-key", placeholder.string()}}}) {
    ControllerProcess bad;
    const std::string refused = bad.Start(*dir_, "bad-tls", *token_file_, args);
    EXPECT_THAT(refused, HasSubstr("exited at start")) << flag;
    EXPECT_THAT(refused, HasSubstr(flag + " " + placeholder.string() + ": not a PEM file"));
  }
}

TEST_F(CliControlTest, MissingTokenFileOptionIsExit2) {
  const Result r = Fp8rt({"runs", "list"}, {{"FP8RT_TOKEN_FILE", ""}});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--token-file"));
  EXPECT_THAT(r.err, HasSubstr("FP8RT_TOKEN_FILE"));
  const Result missing = Fp8rt({"runs", "list", "--token-file", (*dir_ / "absent").string()});
  EXPECT_EQ(missing.exit_code, 2) << missing.err;
  EXPECT_THAT(missing.err, HasSubstr((*dir_ / "absent").string()));
}

}  // namespace
}  // namespace fp8rt
