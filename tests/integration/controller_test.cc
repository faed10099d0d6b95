// fp8rt-controller as the workers and users meet it: the real binary (fork/exec on free ports),
// driven through the generated gRPC stubs of proto/fp8rt/v1/control.proto by fake workers and
// users. Expected values come from the contract (control.proto, the run spec, the checkpoint
// layout of runtime/checkpoint/checkpoint_dir.h), not from the controller's own output.
//
// Index:
//   ControllerProcess          start (waits for --ready-file), SIGTERM, exit status, stderr
//   helpers                    contexts with/without the token, a small run spec, shards, scrape
//   tests                      auth, health, register/report/layers, recipes, checkpoints,
//                              restart, heartbeat timeout, health-policy demotion, metrics,
//                              corrupt state, bad flags
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fp8rt/v1/control.grpc.pb.h"
#include "fp8rt/v1/control.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/checkpoint/checkpoint_dir.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/spec/run_spec.h"
#include "tests/support/test_support.h"

namespace fp8rt {
namespace {

namespace fs = std::filesystem;
using test::ReadFile;
using test::TempDir;
using test::WriteFile;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

constexpr char kToken[] = "controller-test-token-0123456789";
const std::string kBinary = std::string(FP8RT_BIN_DIR) + "/fp8rt-controller";

// Runs the binary with `args`, stderr to `log`; returns the child's pid.
pid_t Spawn(const std::vector<std::string>& args, const std::string& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    FILE* f = std::freopen(log.c_str(), "w", stderr);
    (void)f;
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(kBinary.c_str()));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(kBinary.c_str(), argv.data());
    _exit(127);
  }
  return pid;
}

// Waits up to `timeout` for `pid`; its exit status, or -1 (then it is killed).
int WaitExit(pid_t pid, std::chrono::seconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (std::chrono::steady_clock::now() < end) {
    if (waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return -1;
}

// Runs the binary to its end; its exit status and stderr.
int RunToExit(const std::vector<std::string>& args, const std::string& log, std::string* err) {
  const int rc = WaitExit(Spawn(args, log), std::chrono::seconds(20));
  *err = ReadFile(log);
  return rc;
}

// One fp8rt-controller process on free ports, with its token file; SIGTERM at destruction.
class ControllerProcess {
 public:
  // Starts the controller on `state_dir` with extra flags; fails the test (returns nullptr) if it
  // does not write its ready file.
  static std::unique_ptr<ControllerProcess> Start(const TempDir& tmp, const std::string& state_dir,
                                                  std::vector<std::string> extra = {}) {
    auto p = std::unique_ptr<ControllerProcess>(new ControllerProcess());
    const std::string token_file = tmp / "token";
    WriteFile(token_file, std::string("  ") + kToken + "\n");
    fs::permissions(token_file, fs::perms::owner_read | fs::perms::owner_write);
    static int counter = 0;
    const std::string tag = std::to_string(getpid()) + "-" + std::to_string(counter++);
    p->ready_file_ = tmp / ("ready-" + tag + ".json");
    p->log_ = tmp / ("controller-" + tag + ".log");
    std::vector<std::string> args = {
        "--token-file", token_file,         "--state-dir", state_dir,      "--listen",
        "127.0.0.1:0",  "--metrics-listen", "127.0.0.1:0", "--ready-file", p->ready_file_};
    args.insert(args.end(), extra.begin(), extra.end());
    p->pid_ = Spawn(args, p->log_);
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!fs::exists(p->ready_file_)) {
      int status = 0;
      if (waitpid(p->pid_, &status, WNOHANG) == p->pid_) {
        p->pid_ = -1;
        ADD_FAILURE() << "fp8rt-controller exited early: " << ReadFile(p->log_);
        return nullptr;
      }
      if (std::chrono::steady_clock::now() > end) {
        ADD_FAILURE() << "fp8rt-controller did not become ready: " << ReadFile(p->log_);
        return nullptr;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const nlohmann::json ready = nlohmann::json::parse(ReadFile(p->ready_file_));
    p->grpc_ = ready["grpc"].get<std::string>();
    p->metrics_ = ready["metrics"].get<std::string>();
    EXPECT_EQ(ready["pid"].get<int>(), p->pid_);
    auto channel = grpc::CreateChannel(p->grpc_, grpc::InsecureChannelCredentials());
    p->channel_ = channel;
    p->control_ = v1::Control::NewStub(channel);
    p->runs_ = v1::Runs::NewStub(channel);
    return p;
  }

  ~ControllerProcess() {
    if (pid_ > 0) Stop();
  }

  // SIGTERM; the exit status. The test's channel is closed first: the server's graceful shutdown
  // waits (up to its grace period) for connected clients to go away.
  int Stop() {
    control_.reset();
    runs_.reset();
    channel_.reset();
    kill(pid_, SIGTERM);
    const int rc = WaitExit(pid_, std::chrono::seconds(20));
    pid_ = -1;
    return rc;
  }

  v1::Control::Stub& control() { return *control_; }
  v1::Runs::Stub& runs() { return *runs_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  const std::string& grpc_address() const { return grpc_; }
  const std::string& metrics_address() const { return metrics_; }
  std::string log() const { return ReadFile(log_); }

 private:
  ControllerProcess() = default;

  pid_t pid_ = -1;
  std::string ready_file_, log_, grpc_, metrics_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Control::Stub> control_;
  std::unique_ptr<v1::Runs::Stub> runs_;
};

// A client context with a deadline and, unless empty, `authorization: Bearer <token>`.
std::unique_ptr<grpc::ClientContext> Ctx(const std::string& token = kToken) {
  return test::BearerContext(token);
}

// A 2-layer model on dp 2 (world 2). data.path does not exist here: the controller must not care.
v1::RunSpec SmallSpec() {
  v1::RunSpec spec = test::TinyModelSpec();
  spec.mutable_parallel()->set_dp(2);
  spec.mutable_train()->set_steps(100);
  spec.mutable_data()->set_path("/nonexistent/on/the/controller/data.txt");
  spec.mutable_checkpoint()->set_keep(3);
  return spec;
}

grpc::Status Register(ControllerProcess& c, const std::string& run, int rank, int world,
                      const std::string& run_dir, const v1::RunSpec* spec, bool resume,
                      v1::RegisterResponse* response) {
  v1::RegisterRequest req;
  req.set_run_id(run);
  req.set_rank(rank);
  req.set_world_size(world);
  if (spec != nullptr) *req.mutable_spec() = *spec;
  req.set_run_dir(run_dir);
  req.set_hostname("test-host");
  req.set_pid(1000 + rank);
  req.set_resume(resume);
  return c.control().Register(Ctx().get(), req, response);
}

// Registers ranks 0..world-1 of a new run (rank 0 with `spec`).
void RegisterAll(ControllerProcess& c, const std::string& run, const std::string& run_dir,
                 const v1::RunSpec& spec, bool resume = false) {
  const int world = spec.parallel().dp() * spec.parallel().tp();
  for (int rank = 0; rank < world; ++rank) {
    v1::RegisterResponse resp;
    const grpc::Status s =
        Register(c, run, rank, world, run_dir, rank == 0 ? &spec : nullptr, resume, &resp);
    ASSERT_TRUE(s.ok()) << "rank " << rank << ": " << s.error_message();
  }
}

v1::SiteStats Site(const std::string& layer, v1::TensorRole role, float amax, double saturation,
                   int64_t expert = -1) {
  v1::SiteStats s;
  s.set_layer(layer);
  s.set_tensor(role);
  s.set_amax(amax);
  s.set_scale(448.0f / amax);
  s.set_underflow_ratio(0.0);
  s.set_saturation_ratio(saturation);
  s.set_expert(expert);
  return s;
}

grpc::Status ReportStep(ControllerProcess& c, const std::string& run, int64_t step,
                        const std::vector<v1::SiteStats>& sites = {}, bool skipped = false,
                        int64_t recipe_version = 1, int64_t recipe_applied_step = 0) {
  v1::ReportStepRequest req;
  req.set_run_id(run);
  auto* m = req.mutable_metrics();
  m->set_step(step);
  m->set_loss(5.0 - 0.01 * static_cast<double>(step));
  m->set_grad_norm(skipped ? std::nan("") : 1.5);
  m->set_lr(3e-4);
  m->set_tokens_per_s(1000.0);
  m->set_skipped(skipped);
  m->set_step_time_s(0.25);
  m->set_recipe_version(recipe_version);
  for (const auto& s : sites) *req.add_sites() = s;
  req.set_recipe_applied_step(recipe_applied_step);
  v1::ReportStepResponse resp;
  return c.control().ReportStep(Ctx().get(), req, &resp);
}

v1::Run GetRun(ControllerProcess& c, const std::string& run) {
  v1::GetRunRequest req;
  req.set_run_id(run);
  v1::Run out;
  const grpc::Status s = c.runs().GetRun(Ctx().get(), req, &out);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return out;
}

v1::RecipeVersion GetRecipe(ControllerProcess& c, const std::string& run) {
  v1::GetRecipeRequest req;
  req.set_run_id(run);
  v1::RecipeVersion out;
  const grpc::Status s = c.runs().GetRecipe(Ctx().get(), req, &out);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return out;
}

grpc::Status UpdateRecipe(ControllerProcess& c, const std::string& run, const v1::Recipe& recipe,
                          v1::RecipeVersion* out, const std::string& reason = "test") {
  v1::UpdateRecipeRequest req;
  req.set_run_id(run);
  *req.mutable_recipe() = recipe;
  req.set_reason(reason);
  return c.runs().UpdateRecipe(Ctx().get(), req, out);
}

v1::HeartbeatResponse Heartbeat(ControllerProcess& c, const std::string& run, int rank,
                                int64_t step) {
  v1::HeartbeatRequest req;
  req.set_run_id(run);
  req.set_rank(rank);
  req.set_step(step);
  v1::HeartbeatResponse resp;
  const grpc::Status s = c.control().Heartbeat(Ctx().get(), req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return resp;
}

std::vector<v1::CheckpointInfo> ListCheckpoints(ControllerProcess& c, const std::string& run) {
  v1::ListCheckpointsRequest req;
  req.set_run_id(run);
  v1::ListCheckpointsResponse resp;
  const grpc::Status s = c.runs().ListCheckpoints(Ctx().get(), req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return {resp.checkpoints().begin(), resp.checkpoints().end()};
}

// Reads WatchEvents of `run` until `done` holds for an event or `timeout` passes.
std::vector<v1::Event> WatchUntil(ControllerProcess& c, const std::string& run,
                                  const std::function<bool(const v1::Event&)>& done,
                                  std::chrono::seconds timeout) {
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", std::string("Bearer ") + kToken);
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  v1::WatchEventsRequest req;
  req.set_run_id(run);
  std::unique_ptr<grpc::ClientReader<v1::Event>> reader = c.runs().WatchEvents(&ctx, req);
  std::vector<v1::Event> events;
  v1::Event e;
  while (reader->Read(&e)) {
    events.push_back(e);
    if (done(e)) {
      ctx.TryCancel();
      break;
    }
  }
  reader->Finish();
  return events;
}

bool HasEvent(const std::vector<v1::Event>& events, const std::string& kind) {
  for (const auto& e : events) {
    if (e.kind() == kind) return true;
  }
  return false;
}

// Writes a real shard file for `rank` into `dir`; what the rank would acknowledge.
v1::AckShardRequest WriteShard(const std::string& run, int64_t step, int rank,
                               const std::string& dir) {
  ShardWriter writer;
  std::vector<std::byte> bytes(1000 + 100 * rank);
  for (size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<std::byte>((i * 7 + rank) & 0xff);
  EXPECT_TRUE(writer.Add("master/blocks.0.mlp.fc1", bytes).ok());
  const auto written = writer.Write((fs::path(dir) / ShardFileName(rank)).string());
  EXPECT_TRUE(written.ok()) << written.status();
  v1::AckShardRequest ack;
  ack.set_run_id(run);
  ack.set_step(step);
  ack.set_rank(rank);
  ack.set_file(ShardFileName(rank));
  ack.set_size(written->size);
  ack.set_xxh64(written->xxh64);
  ack.set_data_position(12345 + rank);
  return ack;
}

std::string BeginCheckpoint(ControllerProcess& c, const std::string& run, int64_t step) {
  v1::BeginCheckpointRequest req;
  req.set_run_id(run);
  req.set_step(step);
  v1::BeginCheckpointResponse resp;
  const grpc::Status s = c.control().BeginCheckpoint(Ctx().get(), req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return resp.temp_dir();
}

grpc::Status Ack(ControllerProcess& c, const v1::AckShardRequest& ack, bool* committed) {
  v1::AckShardResponse resp;
  const grpc::Status s = c.control().AckShard(Ctx().get(), ack, &resp);
  *committed = resp.committed();
  return s;
}

// A full save of `step` by every rank of a world-2 run; returns the committed folder.
std::string SaveCheckpoint(ControllerProcess& c, const std::string& run, int64_t step) {
  const std::string temp = BeginCheckpoint(c, run, step);
  bool committed = false;
  for (int rank = 0; rank < 2; ++rank) {
    const grpc::Status s = Ack(c, WriteShard(run, step, rank, temp), &committed);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_TRUE(committed);
  return (fs::path(temp).parent_path() / CheckpointName(step)).string();
}

// GET http://<address>/metrics over a plain socket; the body.
std::string Scrape(const std::string& address) {
  const size_t colon = address.rfind(':');
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &addr.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    ADD_FAILURE() << "cannot connect to " << address;
    return "";
  }
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: " + address + "\r\n\r\n";
  EXPECT_EQ(write(fd, request.data(), request.size()), static_cast<ssize_t>(request.size()));
  std::string response;
  char buf[8192];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) response.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  EXPECT_NE(body, std::string::npos) << response;
  EXPECT_THAT(response.substr(0, response.find("\r\n")), HasSubstr("200"));
  return body == std::string::npos ? "" : response.substr(body + 4);
}

// ---------------------------------------------------------------------------------------------
// One controller shared by the tests that need no restart (each uses its own run ids).

class ControllerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tmp_ = new TempDir("fp8rt-controller-test");
    controller_ = ControllerProcess::Start(*tmp_, *tmp_ / "state").release();
  }
  static void TearDownTestSuite() {
    if (controller_ != nullptr) {
      EXPECT_EQ(controller_->Stop(), 0) << controller_->log();
    }
    delete controller_;
    delete tmp_;
  }
  void SetUp() override { ASSERT_NE(controller_, nullptr); }

  ControllerProcess& c() { return *controller_; }
  std::string RunDir(const std::string& name) { return *tmp_ / ("runs/" + name); }

  static TempDir* tmp_;
  static ControllerProcess* controller_;
};

TempDir* ControllerTest::tmp_ = nullptr;
ControllerProcess* ControllerTest::controller_ = nullptr;

TEST_F(ControllerTest, EveryRpcNeedsTheBearerToken) {
  const std::string prefix = std::string(kToken).substr(0, 20);  // same start, shorter
  struct Case {
    std::string token;
    std::string message;
  } cases[] = {{"", "missing bearer token"},
               {"wrong-token-0123456789abcdef0123", "invalid bearer token"},
               {prefix, "invalid bearer token"},
               {std::string(kToken) + "x", "invalid bearer token"}};
  for (const Case& k : cases) {
    SCOPED_TRACE("token '" + k.token + "'");
    v1::ListRunsResponse runs;
    grpc::Status s = c().runs().ListRuns(Ctx(k.token).get(), v1::ListRunsRequest(), &runs);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_THAT(s.error_message(), HasSubstr(k.message));
    v1::HeartbeatRequest hb;
    hb.set_run_id("auth-run");
    v1::HeartbeatResponse hb_resp;
    s = c().control().Heartbeat(Ctx(k.token).get(), hb, &hb_resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_THAT(s.error_message(), HasSubstr(k.message));
    // A streaming RPC too.
    grpc::ClientContext ctx;
    if (!k.token.empty()) ctx.AddMetadata("authorization", "Bearer " + k.token);
    auto reader = c().runs().WatchEvents(&ctx, v1::WatchEventsRequest());
    v1::Event e;
    EXPECT_FALSE(reader->Read(&e));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  // Another scheme is no bearer token.
  grpc::ClientContext basic;
  basic.AddMetadata("authorization", std::string("Basic ") + kToken);
  v1::ListRunsResponse runs;
  EXPECT_EQ(c().runs().ListRuns(&basic, v1::ListRunsRequest(), &runs).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);

  // The right token passes: ListRuns answers, Heartbeat gets as far as the unknown run.
  EXPECT_TRUE(c().runs().ListRuns(Ctx().get(), v1::ListRunsRequest(), &runs).ok());
  v1::HeartbeatRequest hb;
  hb.set_run_id("auth-run");
  v1::HeartbeatResponse hb_resp;
  EXPECT_EQ(c().control().Heartbeat(Ctx().get(), hb, &hb_resp).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(ControllerTest, HealthServiceIsServing) {
  // grpc.health.v1.Health/Check with an empty HealthCheckRequest (service ""); the answer is
  // HealthCheckResponse{status: SERVING = 1}, encoded as field 1 varint 1: bytes 08 01.
  grpc::GenericStub stub(c().channel());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::ByteBuffer request, response;
  grpc::Slice empty("");
  request = grpc::ByteBuffer(&empty, 1);
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status s) { done.set_value(s); });
  const grpc::Status s = done.get_future().get();
  ASSERT_TRUE(s.ok()) << s.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (const auto& slice : slices)
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));
}

TEST_F(ControllerTest, RegisterReportStepsAndReadTheLayerTable) {
  const std::string run = "train-a";
  const v1::RunSpec spec = SmallSpec();
  v1::RegisterResponse resp;

  // Validation names the field; other ranks wait for rank 0.
  grpc::Status s = Register(c(), "Bad_Id", 0, 2, RunDir(run), &spec, false, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("run_id: must match [a-z0-9][a-z0-9._-]{0,62}"));
  s = Register(c(), run, 2, 2, RunDir(run), nullptr, false, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("rank: "));
  s = Register(c(), run, 1, 2, RunDir(run), nullptr, false, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("rank 0 registers first"));
  s = Register(c(), run, 0, 2, RunDir(run), nullptr, false, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("spec: "));
  s = Register(c(), run, 0, 4, RunDir(run), &spec, false, &resp);  // dp 2 x tp 1 != 4
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("spec.parallel.dp"));

  ASSERT_TRUE(Register(c(), run, 0, 2, RunDir(run), &spec, false, &resp).ok());
  EXPECT_EQ(resp.spec().model().d_model(), 64);
  EXPECT_EQ(resp.recipe().version(), 1);
  EXPECT_EQ(resp.recipe().source(), "spec");
  EXPECT_EQ(resp.recipe().effective_step(), 1);
  EXPECT_EQ(resp.recipe().recipe().amax_history_len(), spec.precision().amax_history_len());
  EXPECT_EQ(resp.resume_step(), 0);
  EXPECT_EQ(resp.resume_dir(), "");
  EXPECT_GT(resp.heartbeat_interval_ms(), 0);
  v1::RegisterResponse resp1;
  ASSERT_TRUE(Register(c(), run, 1, 2, RunDir(run), nullptr, false, &resp1).ok());
  EXPECT_EQ(resp1.spec().model().layers(), 2);
  EXPECT_EQ(resp1.recipe().version(), 1);
  // A fresh second registration of a running run is refused.
  s = Register(c(), run, 0, 2, RunDir(run), &spec, false, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);

  ASSERT_TRUE(ReportStep(c(), run, 1).ok());
  ASSERT_TRUE(ReportStep(c(), run, 2, {}, /*skipped=*/true).ok());
  const std::vector<v1::SiteStats> sites = {
      Site("blocks.0.attn.qkv", v1::TENSOR_ROLE_INPUT, 3.5f, 0.0),
      Site("blocks.0.attn.qkv", v1::TENSOR_ROLE_WEIGHT, 0.25f, 0.0),
      Site("blocks.1.mlp.fc2", v1::TENSOR_ROLE_GRAD_OUTPUT, 1e-3f, 0.0005),
  };
  ASSERT_TRUE(ReportStep(c(), run, 3, sites).ok());
  ASSERT_TRUE(ReportStep(c(), run, 4).ok());  // no statistics this step: the table stays

  v1::GetLayersRequest lreq;
  lreq.set_run_id(run);
  v1::GetLayersResponse layers;
  ASSERT_TRUE(c().runs().GetLayers(Ctx().get(), lreq, &layers).ok());
  EXPECT_EQ(layers.step(), 3);
  ASSERT_EQ(layers.sites_size(), 3);
  EXPECT_EQ(layers.sites(2).layer(), "blocks.1.mlp.fc2");
  EXPECT_EQ(layers.sites(2).tensor(), v1::TENSOR_ROLE_GRAD_OUTPUT);
  EXPECT_DOUBLE_EQ(layers.sites(2).saturation_ratio(), 0.0005);
  EXPECT_FLOAT_EQ(layers.sites(0).amax(), 3.5f);

  const v1::Run r = GetRun(c(), run);
  EXPECT_EQ(r.state(), v1::RUN_STATE_RUNNING);
  EXPECT_EQ(r.world_size(), 2);
  EXPECT_EQ(r.workers_connected(), 2);
  EXPECT_EQ(r.last_step().step(), 4);
  EXPECT_EQ(r.skipped_steps(), 1);
  EXPECT_EQ(r.recipe_version(), 1);
  EXPECT_EQ(r.run_dir(), RunDir(run));

  // Unknown runs are NOT_FOUND; malformed reports name the field.
  v1::GetRunRequest greq;
  greq.set_run_id("no-such-run");
  v1::Run out;
  EXPECT_EQ(c().runs().GetRun(Ctx().get(), greq, &out).error_code(), grpc::StatusCode::NOT_FOUND);
  s = ReportStep(c(), run, 5, {Site("blocks.0.attn.qkv", v1::TENSOR_ROLE_UNSPECIFIED, 1, 0)});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("sites[0].tensor"));

  // Reaching train.steps finishes the run.
  ASSERT_TRUE(ReportStep(c(), run, 100).ok());
  EXPECT_EQ(GetRun(c(), run).state(), v1::RUN_STATE_FINISHED);
  const auto events = WatchUntil(
      c(), run, [](const v1::Event& e) { return e.kind() == "run_finished"; },
      std::chrono::seconds(10));
  EXPECT_TRUE(HasEvent(events, "run_registered"));
  EXPECT_TRUE(HasEvent(events, "step_skipped"));
  EXPECT_TRUE(HasEvent(events, "run_finished"));
}

// The layers a recipe may name follow the spec's family and MoE layout (ModelLayerNames): a llama
// run's SwiGLU layers and its SwiGLU experts are accepted, the plain model's names refused.
TEST_F(ControllerTest, RecipeLayerNamesFollowTheModelFamily) {
  const std::string run = "recipe-llama";
  v1::RunSpec spec = SmallSpec();
  spec.mutable_model()->set_family(v1::RunSpec::Model::FAMILY_LLAMA);
  spec.mutable_model()->set_kv_heads(1);
  spec.mutable_moe()->set_experts(2);
  spec.mutable_moe()->set_every(2);  // block 1 is MoE, block 0 dense
  spec.mutable_parallel()->set_ep(2);
  RegisterAll(c(), run, RunDir(run), spec);
  ASSERT_TRUE(ReportStep(c(), run, 10).ok());
  const v1::Recipe base = GetRecipe(c(), run).recipe();
  v1::RecipeVersion out;
  for (const char* refused :
       {"blocks.0.mlp.fc1", "blocks.1.mlp.gate", "blocks.1.mlp.experts.2.up"}) {
    v1::Recipe r = base;
    r.add_exclude(refused);
    const grpc::Status s = UpdateRecipe(c(), run, r, &out);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused;
    EXPECT_THAT(s.error_message(), HasSubstr(absl::StrCat("no layer named '", refused, "'")));
    EXPECT_THAT(s.error_message(), HasSubstr("blocks.N.mlp.gate"));  // the list has the real ones
  }
  v1::Recipe good = base;
  for (const char* name : {"blocks.0.mlp.gate", "blocks.0.mlp.up", "blocks.0.mlp.down",
                           "blocks.1.mlp.experts.1.up", "blocks.1.mlp.experts.0.down"}) {
    good.add_exclude(name);
  }
  const grpc::Status s = UpdateRecipe(c(), run, good, &out);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(out.recipe().exclude_size(), 5);
}

TEST_F(ControllerTest, RecipeUpdatesAreValidatedAndScheduledAhead) {
  const std::string run = "recipe-a";
  RegisterAll(c(), run, RunDir(run), SmallSpec());
  ASSERT_TRUE(ReportStep(c(), run, 10).ok());
  const v1::Recipe base = GetRecipe(c(), run).recipe();

  struct Bad {
    std::function<void(v1::Recipe*)> edit;
    std::string message;
  } bad[] = {
      {[](v1::Recipe* r) { r->set_margin(40); }, "recipe.margin: must be in [0, 32], got 40"},
      {[](v1::Recipe* r) { r->set_amax_history_len(0); },
       "recipe.amax_history_len: must be in [1, 4096], got 0"},
      {[](v1::Recipe* r) {
         r->add_exclude("blocks.0.mlp.fc1");
         r->add_exclude("x");
       },
       "recipe.exclude[1]: no layer named 'x' (layers: blocks.0.attn.qkv"},
      {[](v1::Recipe* r) { r->add_exclude("blocks.2.mlp.fc1"); },  // only 2 blocks
       "recipe.exclude[0]: no layer named 'blocks.2.mlp.fc1'"},
      // d_model 64 is not a whole number of 128-wide blocks.
      {[](v1::Recipe* r) { r->set_scaling(v1::RunSpec::Precision::SCALING_BLOCK); },
       "recipe.scaling: "},
      {[](v1::Recipe* r) { r->set_grad_reduce(v1::RunSpec::Precision::GRAD_REDUCE_UNSPECIFIED); },
       "recipe.grad_reduce: "},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.message);
    v1::Recipe recipe = base;
    b.edit(&recipe);
    v1::RecipeVersion out;
    const grpc::Status s = UpdateRecipe(c(), run, recipe, &out);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr(b.message));
  }
  v1::RecipeVersion out;
  EXPECT_EQ(UpdateRecipe(c(), "no-such-run", base, &out).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(GetRecipe(c(), run).version(), 1);  // nothing accepted so far

  v1::Recipe good = base;
  good.set_margin(2);
  good.add_exclude("lm_head");
  ASSERT_TRUE(UpdateRecipe(c(), run, good, &out, "more headroom").ok());
  EXPECT_EQ(out.version(), 2);
  EXPECT_EQ(out.effective_step(), 10 + 3);  // latest step + --recipe-lead-steps (default 3)
  EXPECT_EQ(out.source(), "user");
  EXPECT_EQ(out.reason(), "more headroom");
  EXPECT_EQ(out.recipe().margin(), 2);
  EXPECT_EQ(out.applied_step(), 0);

  // Every rank hears of it through its heartbeat.
  for (int rank = 0; rank < 2; ++rank) {
    const v1::HeartbeatResponse hb = Heartbeat(c(), run, rank, 11);
    EXPECT_EQ(hb.recipe().version(), 2);
    EXPECT_EQ(hb.recipe().effective_step(), 13);
    EXPECT_EQ(hb.recipe().recipe().margin(), 2);
    EXPECT_FALSE(hb.stop());
  }
  // The latest step may come from a heartbeat too.
  Heartbeat(c(), run, 0, 20);
  good.set_margin(3);
  ASSERT_TRUE(UpdateRecipe(c(), run, good, &out).ok());
  EXPECT_EQ(out.version(), 3);
  EXPECT_EQ(out.effective_step(), 23);

  // The workers report the switch.
  ASSERT_TRUE(ReportStep(c(), run, 23, {}, false, /*recipe_version=*/3,
                         /*recipe_applied_step=*/23)
                  .ok());
  EXPECT_EQ(GetRecipe(c(), run).applied_step(), 23);
  EXPECT_EQ(GetRun(c(), run).recipe_version(), 3);

  // Stop: the heartbeat says so.
  v1::StopRunRequest stop;
  stop.set_run_id(run);
  v1::Run stopped;
  ASSERT_TRUE(c().runs().StopRun(Ctx().get(), stop, &stopped).ok());
  EXPECT_EQ(stopped.state(), v1::RUN_STATE_STOPPING);
  EXPECT_TRUE(Heartbeat(c(), run, 1, 24).stop());
}

TEST_F(ControllerTest, CheckpointCommitsOnlyOnceEveryShardIsAcknowledged) {
  const std::string run = "ckpt-a";
  const std::string run_dir = RunDir(run);
  RegisterAll(c(), run, run_dir, SmallSpec());

  // A user asks for a save; the heartbeat carries it until the save begins.
  v1::SaveCheckpointRequest save;
  save.set_run_id(run);
  v1::SaveCheckpointResponse save_resp;
  ASSERT_TRUE(c().runs().SaveCheckpoint(Ctx().get(), save, &save_resp).ok());
  EXPECT_TRUE(Heartbeat(c(), run, 0, 5).save_checkpoint());

  const std::string temp = BeginCheckpoint(c(), run, 5);
  EXPECT_EQ(temp, CheckpointDir(run_dir).TempDir(5));
  EXPECT_TRUE(fs::is_directory(temp));
  EXPECT_FALSE(Heartbeat(c(), run, 0, 5).save_checkpoint());
  const std::string committed_dir = CheckpointDir(run_dir).CommittedDir(5);

  const v1::AckShardRequest ack0 = WriteShard(run, 5, 0, temp);
  const v1::AckShardRequest ack1 = WriteShard(run, 5, 1, temp);
  bool committed = true;
  // Wrong file name or rank: INVALID_ARGUMENT naming the field.
  v1::AckShardRequest wrong = ack1;
  wrong.set_file("rank-1.shard");
  grpc::Status s = Ack(c(), wrong, &committed);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("file: "));
  wrong = ack1;
  wrong.set_rank(7);
  wrong.set_file(ShardFileName(7));
  s = Ack(c(), wrong, &committed);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("rank: "));
  wrong = ack1;
  wrong.set_step(6);  // no save of step 6 in progress
  EXPECT_EQ(Ack(c(), wrong, &committed).error_code(), grpc::StatusCode::FAILED_PRECONDITION);

  ASSERT_TRUE(Ack(c(), ack0, &committed).ok());
  EXPECT_FALSE(committed);
  EXPECT_THAT(ListCheckpoints(c(), run), IsEmpty());
  EXPECT_FALSE(fs::exists(committed_dir));

  ASSERT_TRUE(Ack(c(), ack1, &committed).ok());
  EXPECT_TRUE(committed);
  const auto list = ListCheckpoints(c(), run);
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].step(), 5);
  EXPECT_EQ(list[0].dir(), committed_dir);
  EXPECT_EQ(list[0].bytes(), ack0.size() + ack1.size());
  EXPECT_GT(list[0].created_unix_ms(), 0);
  EXPECT_TRUE(fs::exists(fs::path(committed_dir) / std::string(kManifestFileName)));
  EXPECT_FALSE(fs::exists(temp));
  // The manifest verifies against the shards and carries rank 0's data position and the layout.
  const auto manifest = CheckpointDir(run_dir).Verify(5);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->world_size(), 2);
  EXPECT_EQ(manifest->dp(), 2);
  EXPECT_EQ(manifest->data_position(), ack0.data_position());
  EXPECT_EQ(GetRun(c(), run).last_checkpoint_step(), 5);

  // A shard acknowledged with a wrong checksum: the commit fails (DATA_LOSS to the last acker),
  // nothing is listed or committed.
  const std::string temp6 = BeginCheckpoint(c(), run, 6);
  ASSERT_TRUE(Ack(c(), WriteShard(run, 6, 0, temp6), &committed).ok());
  v1::AckShardRequest bad = WriteShard(run, 6, 1, temp6);
  bad.set_xxh64(bad.xxh64() ^ 1);
  s = Ack(c(), bad, &committed);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
  EXPECT_FALSE(committed);
  EXPECT_EQ(ListCheckpoints(c(), run).size(), 1u);
  EXPECT_FALSE(fs::exists(CheckpointDir(run_dir).CommittedDir(6)));

  // Retention keeps checkpoint.keep = 3.
  for (int64_t step : {7, 8, 9}) SaveCheckpoint(c(), run, step);
  const auto kept = ListCheckpoints(c(), run);
  ASSERT_EQ(kept.size(), 3u);
  EXPECT_EQ(kept[0].step(), 7);
  EXPECT_EQ(kept[2].step(), 9);
  EXPECT_FALSE(fs::exists(committed_dir));
}

TEST_F(ControllerTest, HealthPolicyDemotesASaturatingLayerOnce) {
  const std::string run = "health-a";
  v1::RunSpec spec = SmallSpec();
  spec.mutable_health()->set_saturation_threshold(0.001);
  spec.mutable_health()->set_intervals(2);
  spec.mutable_health()->set_demote(true);
  RegisterAll(c(), run, RunDir(run), spec);

  const std::vector<v1::SiteStats> sick = {
      Site("blocks.0.mlp.fc1", v1::TENSOR_ROLE_GRAD_OUTPUT, 60000.0f, 0.01),
      Site("blocks.0.mlp.fc1", v1::TENSOR_ROLE_INPUT, 2.0f, 0.0),
      Site("lm_head", v1::TENSOR_ROLE_GRAD_OUTPUT, 100.0f, 0.5),  // not a block layer
  };
  ASSERT_TRUE(ReportStep(c(), run, 1, sick).ok());
  EXPECT_EQ(GetRecipe(c(), run).version(), 1);  // one interval is not enough
  ASSERT_TRUE(ReportStep(c(), run, 2, sick).ok());

  const v1::RecipeVersion v = GetRecipe(c(), run);
  EXPECT_EQ(v.version(), 2);
  EXPECT_EQ(v.source(), "health-policy");
  EXPECT_EQ(v.effective_step(), 2 + 3);
  EXPECT_THAT(v.recipe().exclude(), ::testing::ElementsAre("blocks.0.mlp.fc1"));
  EXPECT_THAT(v.reason(),
              HasSubstr("blocks.0.mlp.fc1/grad_output: saturation 1.00% above 0.10% for 2 "
                        "intervals"));

  // Still saturating: no second demotion of the same layer.
  ASSERT_TRUE(ReportStep(c(), run, 3, sick).ok());
  ASSERT_TRUE(ReportStep(c(), run, 4, sick).ok());
  EXPECT_EQ(GetRecipe(c(), run).version(), 2);

  // Events of one report come in site order: fc1's finding and demotion, then lm_head's finding.
  const auto events = WatchUntil(
      c(), run,
      [](const v1::Event& e) {
        return e.kind() == "fp8_health" && e.message().starts_with("lm_head/");
      },
      std::chrono::seconds(10));
  ASSERT_TRUE(HasEvent(events, "layer_demoted"));
  bool fc1_health = false, lm_head_health = false;
  for (const auto& e : events) {
    if (e.kind() != "fp8_health") continue;
    fc1_health |= e.message().find("blocks.0.mlp.fc1/grad_output") != std::string::npos;
    lm_head_health |= e.message().find("lm_head/grad_output") != std::string::npos;
  }
  EXPECT_TRUE(fc1_health);
  EXPECT_TRUE(lm_head_health);  // reported, but lm_head is not demoted
}

// health.action demote with health.promote_after: the layer leaves FP8, its healthy intervals are
// counted from the step the demotion takes effect (a demoted layer reports no FP8 statistics),
// and after promote_after of them it gets FP8 back through a new version (event
// layer_promoted); a layer that saturates again is demoted again.
TEST_F(ControllerTest, HealthPolicyPromotesADemotedLayerAfterHealthyIntervals) {
  const std::string run = "health-p";
  v1::RunSpec spec = SmallSpec();
  spec.mutable_health()->set_saturation_threshold(0.001);
  spec.mutable_health()->set_intervals(2);
  spec.mutable_health()->set_action(v1::RunSpec::Health::ACTION_DEMOTE);
  spec.mutable_health()->set_promote_after(3);
  RegisterAll(c(), run, RunDir(run), spec);
  const std::vector<v1::SiteStats> sick = {
      Site("blocks.0.mlp.fc1", v1::TENSOR_ROLE_GRAD_OUTPUT, 60000.0f, 0.01),
      Site("blocks.0.mlp.fc2", v1::TENSOR_ROLE_INPUT, 2.0f, 0.0)};
  const std::vector<v1::SiteStats> healthy = {
      Site("blocks.0.mlp.fc2", v1::TENSOR_ROLE_INPUT, 2.0f, 0.0)};
  ASSERT_TRUE(ReportStep(c(), run, 1, sick).ok());
  ASSERT_TRUE(ReportStep(c(), run, 2, sick).ok());
  v1::RecipeVersion v = GetRecipe(c(), run);
  ASSERT_EQ(v.version(), 2);
  EXPECT_THAT(v.recipe().exclude(), ::testing::ElementsAre("blocks.0.mlp.fc1"));
  EXPECT_EQ(v.effective_step(), 5);
  // Before the demotion takes effect nothing is counted; from step 5, three healthy intervals.
  ASSERT_TRUE(ReportStep(c(), run, 3, healthy).ok());
  ASSERT_TRUE(ReportStep(c(), run, 4, healthy).ok());
  ASSERT_TRUE(ReportStep(c(), run, 5, healthy).ok());
  ASSERT_TRUE(ReportStep(c(), run, 6, healthy).ok());
  EXPECT_EQ(GetRecipe(c(), run).version(), 2) << "two healthy intervals are not three";
  ASSERT_TRUE(ReportStep(c(), run, 7, healthy).ok());
  v = GetRecipe(c(), run);
  ASSERT_EQ(v.version(), 3);
  EXPECT_EQ(v.source(), "health-policy");
  EXPECT_THAT(v.recipe().exclude(), ::testing::IsEmpty());
  EXPECT_EQ(v.effective_step(), 10);
  EXPECT_THAT(v.reason(), HasSubstr("blocks.0.mlp.fc1: healthy for 3 intervals"));
  // Saturating again: demoted again.
  ASSERT_TRUE(ReportStep(c(), run, 10, sick).ok());
  ASSERT_TRUE(ReportStep(c(), run, 11, sick).ok());
  v = GetRecipe(c(), run);
  EXPECT_EQ(v.version(), 4);
  EXPECT_THAT(v.recipe().exclude(), ::testing::ElementsAre("blocks.0.mlp.fc1"));
  const auto events = WatchUntil(
      c(), run, [](const v1::Event& e) { return e.kind() == "layer_promoted"; },
      std::chrono::seconds(10));
  ASSERT_TRUE(HasEvent(events, "layer_promoted"));
  // Older versions stay readable by number.
  v1::GetRecipeRequest req;
  req.set_run_id(run);
  req.set_version(2);
  v1::RecipeVersion old;
  ASSERT_TRUE(c().runs().GetRecipe(Ctx().get(), req, &old).ok());
  EXPECT_EQ(old.version(), 2);
  req.set_version(99);
  const grpc::Status missing = c().runs().GetRecipe(Ctx().get(), req, &old);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(missing.error_message(), HasSubstr("no recipe version 99 (newest 4)"));
}

// health.action raise_margin on synthetic reports: an override in front of the list carrying the
// layer's recipe with the margin raised; block_scaling is refused up front on shapes block
// scaling cannot split, naming health.action.
TEST_F(ControllerTest, HealthPolicyRaisesTheMarginAndRefusesBlockScalingItCannotApply) {
  const std::string run = "health-m";
  v1::RunSpec spec = SmallSpec();
  spec.mutable_health()->set_saturation_threshold(0.001);
  spec.mutable_health()->set_intervals(1);
  spec.mutable_health()->set_action(v1::RunSpec::Health::ACTION_RAISE_MARGIN);
  spec.mutable_health()->set_margin_step(3);
  auto* o = spec.mutable_precision()->add_overrides();
  o->set_layers("blocks.*");
  o->set_scaling(v1::RunSpec::Precision::SCALING_CURRENT);
  RegisterAll(c(), run, RunDir(run), spec);
  ASSERT_TRUE(ReportStep(c(), run, 1,
                         {Site("blocks.0.mlp.fc1", v1::TENSOR_ROLE_INPUT, 60000.0f, 0.01)})
                  .ok());
  const v1::RecipeVersion v = GetRecipe(c(), run);
  ASSERT_EQ(v.version(), 2);
  ASSERT_EQ(v.recipe().overrides_size(), 2);
  EXPECT_EQ(v.recipe().overrides(0).layers(), "blocks.0.mlp.fc1");
  EXPECT_EQ(v.recipe().overrides(0).margin(), 3);
  EXPECT_EQ(v.recipe().overrides(0).scaling(), v1::RunSpec::Precision::SCALING_CURRENT)
      << "the layer's own recipe (its override's scaling) is carried";
  EXPECT_EQ(v.recipe().overrides(1).layers(), "blocks.*");

  v1::RunSpec block = SmallSpec();
  block.mutable_health()->set_saturation_threshold(0.001);
  block.mutable_health()->set_action(v1::RunSpec::Health::ACTION_BLOCK_SCALING);
  v1::RegisterResponse resp;
  const grpc::Status s = Register(c(), "health-b", 0, 2, RunDir("health-b"), &block, false, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("health.action"));
}

// A step's memory peaks (one per category, max over ranks) become fp8rt_memory_peak_bytes{run,
// category}; the next report replaces them (a category it leaves out disappears); oversized
// reports are refused naming the field.
TEST_F(ControllerTest, MemoryPeaksAreServedByCategory) {
  const std::string run = "memory-a";
  RegisterAll(c(), run, RunDir(run), SmallSpec());
  auto report = [&](int64_t step, const std::vector<std::pair<std::string, int64_t>>& peaks) {
    v1::ReportStepRequest req;
    req.set_run_id(run);
    req.mutable_metrics()->set_step(step);
    for (const auto& [category, bytes] : peaks) {
      v1::MemoryPeak* p = req.add_memory();
      p->set_category(category);
      p->set_peak_bytes(bytes);
    }
    v1::ReportStepResponse resp;
    return c().control().ReportStep(Ctx().get(), req, &resp);
  };
  auto series = [&](const std::string& category) {
    return "fp8rt_memory_peak_bytes{category=\"" + category + "\",run=\"" + run + "\"} ";
  };

  ASSERT_TRUE(report(1, {{"param_shards", 1 << 20}, {"gradients", 3 << 20}, {"scratch", 0}}).ok());
  std::string body = Scrape(c().metrics_address());
  EXPECT_THAT(body, HasSubstr(series("param_shards") + "1048576\n"));
  EXPECT_THAT(body, HasSubstr(series("gradients") + "3145728\n"));
  EXPECT_THAT(body, HasSubstr(series("scratch") + "0\n"));

  // A report without memory leaves the gauges; the next one with memory replaces them.
  ASSERT_TRUE(report(2, {}).ok());
  EXPECT_THAT(Scrape(c().metrics_address()), HasSubstr(series("gradients") + "3145728\n"));
  ASSERT_TRUE(report(3, {{"gradients", 5 << 20}, {"saved_activations", 7}}).ok());
  body = Scrape(c().metrics_address());
  EXPECT_THAT(body, HasSubstr(series("gradients") + "5242880\n"));
  EXPECT_THAT(body, HasSubstr(series("saved_activations") + "7\n"));
  EXPECT_THAT(body, Not(HasSubstr(series("param_shards"))));

  // Bounds: at most 16 categories of at most 32 bytes, no empty name, no negative peak.
  std::vector<std::pair<std::string, int64_t>> many;
  for (int i = 0; i < 17; ++i) many.emplace_back("c" + std::to_string(i), 1);
  grpc::Status s = report(4, many);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("memory: at most 16 entries, got 17"));
  many.pop_back();
  EXPECT_TRUE(report(4, many).ok()) << "16 categories are allowed";
  s = report(5, {{"gradients", 1}, {std::string(33, 'x'), 1}});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("memory[1].category: at most 32 bytes, got 33"));
  EXPECT_TRUE(report(5, {{std::string(32, 'x'), 1}}).ok()) << "a 32-byte category is allowed";
  s = report(6, {{"", 1}});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("memory[0].category: empty"));
  s = report(6, {{"gradients", -1}});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("memory[0].peak_bytes: must be >= 0, got -1"));
  // A refused report changes nothing.
  body = Scrape(c().metrics_address());
  EXPECT_THAT(body, HasSubstr(series(std::string(32, 'x')) + "1\n"));
  EXPECT_THAT(body, Not(HasSubstr(series("gradients"))));
}

TEST_F(ControllerTest, MetricsScrapePassesPromtool) {
  const std::string run = "metrics-a";
  RegisterAll(c(), run, RunDir(run), SmallSpec());
  ASSERT_TRUE(ReportStep(c(), run, 1,
                         {Site("blocks.0.mlp.fc1", v1::TENSOR_ROLE_GRAD_OUTPUT, 2.0f, 0.25),
                          Site("blocks.1.mlp.fc1", v1::TENSOR_ROLE_WEIGHT, 0.5f, 0.0, 3)})
                  .ok());
  // Cumulative communication bytes: 100, 250, then 50 after a worker restart -> 100 + 150 + 50.
  for (int64_t bytes : {100, 250, 50}) {
    v1::ReportStepRequest req;
    req.set_run_id(run);
    req.mutable_metrics()->set_step(2);
    auto* comm = req.add_comm();
    comm->set_op("all_reduce");
    comm->set_dtype("bf16");
    comm->set_bytes(bytes);
    v1::MemoryPeak* peak = req.add_memory();
    peak->set_category("gradients");
    peak->set_peak_bytes(4096);
    v1::ReportStepResponse resp;
    ASSERT_TRUE(c().control().ReportStep(Ctx().get(), req, &resp).ok());
  }

  const std::string body = Scrape(c().metrics_address());
  EXPECT_THAT(body, HasSubstr("fp8rt_fp8_saturation_ratio{layer=\"blocks.0.mlp.fc1\",run=\"" + run +
                              "\",tensor=\"grad_output\"} 0.25"));
  EXPECT_THAT(body, HasSubstr("fp8rt_fp8_amax{expert=\"3\",layer=\"blocks.1.mlp.fc1\",run=\"" +
                              run + "\",tensor=\"weight\"} 0.5"));
  EXPECT_THAT(body, HasSubstr("fp8rt_comm_bytes_total{dtype=\"bf16\",op=\"all_reduce\",run=\"" +
                              run + "\"} 300"));
  EXPECT_THAT(body, HasSubstr("fp8rt_workers_connected{run=\"" + run + "\"} 2"));
  EXPECT_THAT(body, HasSubstr("fp8rt_run_state{run=\"" + run + "\",state=\"running\"} 1"));
  for (const char* family :
       {"fp8rt_train_step", "fp8rt_train_loss", "fp8rt_tokens_per_second", "fp8rt_grad_norm",
        "fp8rt_skipped_steps_total", "fp8rt_fp8_scale", "fp8rt_fp8_underflow_ratio",
        "fp8rt_recipe_version", "fp8rt_checkpoint_last_committed_step",
        "fp8rt_checkpoint_last_committed_timestamp_seconds", "fp8rt_memory_peak_bytes"}) {
    EXPECT_THAT(body, HasSubstr(std::string("# HELP ") + family + " ")) << family;
  }

  if (std::system("command -v promtool > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "promtool not installed (Debian package prometheus): lint not checked";
  }
  const std::string scrape_file = *tmp_ / "scrape.txt";
  WriteFile(scrape_file, body);
  FILE* pipe = popen(("promtool check metrics < " + scrape_file + " 2>&1").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string lint;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) lint.append(buf, n);
  const int status = pclose(pipe);
  EXPECT_EQ(lint, "");
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << lint;
}

// ---------------------------------------------------------------------------------------------
// Tests with a controller of their own.

TEST(ControllerProcessTest, RestartKeepsRunsRecipesAndCheckpoints) {
  TempDir tmp("fp8rt-controller-test");
  const std::string state = tmp / "state";
  const std::string run = "restart-a";
  const std::string run_dir = tmp / "run";
  const v1::RunSpec spec = SmallSpec();
  {
    auto c = ControllerProcess::Start(tmp, state);
    ASSERT_NE(c, nullptr);
    RegisterAll(*c, run, run_dir, spec);
    ASSERT_TRUE(ReportStep(*c, run, 4).ok());
    v1::Recipe recipe = GetRecipe(*c, run).recipe();
    recipe.set_margin(1);
    v1::RecipeVersion out;
    ASSERT_TRUE(UpdateRecipe(*c, run, recipe, &out).ok());
    SaveCheckpoint(*c, run, 5);
    SaveCheckpoint(*c, run, 8);
    EXPECT_EQ(c->Stop(), 0) << c->log();
  }
  // The newest checkpoint rots on disk while the controller is down.
  const std::string shard8 =
      (fs::path(CheckpointDir(run_dir).CommittedDir(8)) / ShardFileName(1)).string();
  {
    std::fstream f(shard8, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(40);
    f.put('\x5a');
  }

  auto c = ControllerProcess::Start(tmp, state);
  ASSERT_NE(c, nullptr);
  v1::Run r = GetRun(*c, run);
  EXPECT_EQ(r.state(), v1::RUN_STATE_RUNNING);
  EXPECT_EQ(r.world_size(), 2);
  EXPECT_EQ(r.workers_connected(), 0);  // until they heartbeat
  EXPECT_EQ(r.last_step().step(), 4);
  EXPECT_EQ(r.spec().model().d_ff(), 256);
  const v1::RecipeVersion v = GetRecipe(*c, run);
  EXPECT_EQ(v.version(), 2);
  EXPECT_EQ(v.recipe().margin(), 1);
  auto list = ListCheckpoints(*c, run);
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].step(), 5);
  EXPECT_EQ(list[1].step(), 8);
  const auto old_events = WatchUntil(
      *c, run,
      [](const v1::Event& e) { return e.kind() == "checkpoint_committed" && e.step() == 8; },
      std::chrono::seconds(10));
  EXPECT_TRUE(HasEvent(old_events, "run_registered"));
  EXPECT_TRUE(HasEvent(old_events, "recipe_updated"));
  Heartbeat(*c, run, 1, 8);
  EXPECT_EQ(GetRun(*c, run).workers_connected(), 1);

  // A fresh start of a run with checkpoints is refused; a resume skips the rotten step 8.
  v1::RegisterResponse resp;
  grpc::Status s = Register(*c, run, 0, 2, run_dir, &spec, /*resume=*/false, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("--resume"));
  s = Register(*c, run, 0, 2, run_dir, &spec, /*resume=*/true, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.resume_step(), 5);
  EXPECT_EQ(resp.resume_dir(), CheckpointDir(run_dir).CommittedDir(5));
  EXPECT_EQ(resp.recipe().version(), 2);  // the user's update survives the restart
  EXPECT_TRUE(fs::exists(fs::path(CheckpointDir(run_dir).root()) / "refused-step-00000008"));
  list = ListCheckpoints(*c, run);
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].step(), 5);
  v1::RegisterResponse resp1;
  ASSERT_TRUE(Register(*c, run, 1, 2, run_dir, nullptr, true, &resp1).ok());
  EXPECT_EQ(resp1.resume_step(), 5);
  const auto events = WatchUntil(
      *c, run, [](const v1::Event& e) { return e.kind() == "checkpoint_refused"; },
      std::chrono::seconds(10));
  ASSERT_TRUE(HasEvent(events, "checkpoint_refused"));
  EXPECT_THAT(events.back().message(), HasSubstr("step 8"));
  EXPECT_EQ(c->Stop(), 0);
}

TEST(ControllerProcessTest, SilentWorkersAreLostAndTheRunFails) {
  TempDir tmp("fp8rt-controller-test");
  auto c = ControllerProcess::Start(tmp, tmp / "state", {"--heartbeat-timeout-s", "2"});
  ASSERT_NE(c, nullptr);
  const std::string run = "lost-a";
  RegisterAll(*c, run, tmp / "run", SmallSpec());
  EXPECT_EQ(GetRun(*c, run).workers_connected(), 2);

  // Rank 0 keeps heartbeating; rank 1 goes silent.
  std::atomic<bool> stop{false};
  std::thread beat([&] {
    for (int64_t step = 1; !stop; ++step) {
      v1::HeartbeatRequest req;
      req.set_run_id(run);
      req.set_rank(0);
      req.set_step(step);
      v1::HeartbeatResponse resp;
      c->control().Heartbeat(Ctx().get(), req, &resp);
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
  });
  const auto start = std::chrono::steady_clock::now();
  const auto events = WatchUntil(
      *c, run, [](const v1::Event& e) { return e.kind() == "worker_lost"; },
      std::chrono::seconds(15));
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(HasEvent(events, "worker_lost"));
  EXPECT_THAT(events.back().message(), HasSubstr("rank 1"));
  EXPECT_GE(waited, 1.5);  // not before the timeout
  const v1::Run r = GetRun(*c, run);
  EXPECT_EQ(r.workers_connected(), 1);
  EXPECT_EQ(r.state(), v1::RUN_STATE_FAILED);
  stop = true;
  beat.join();
  const std::string body = Scrape(c->metrics_address());
  EXPECT_THAT(body, HasSubstr("fp8rt_workers_connected{run=\"" + run + "\"} 1"));
  EXPECT_THAT(body, HasSubstr("fp8rt_run_state{run=\"" + run + "\",state=\"failed\"} 1"));
  EXPECT_EQ(c->Stop(), 0);
}

TEST(ControllerProcessTest, RanksOfARunningRunMustReturnAfterARestart) {
  TempDir tmp("fp8rt-controller-test");
  const std::string state = tmp / "state";
  const std::string run = "lost-b";
  const std::vector<std::string> flags = {"--heartbeat-timeout-s", "2"};
  {
    auto c = ControllerProcess::Start(tmp, state, flags);
    ASSERT_NE(c, nullptr);
    RegisterAll(*c, run, tmp / "run", SmallSpec());
    EXPECT_EQ(c->Stop(), 0);
  }
  // The workers died with the controller: nobody heartbeats after the restart.
  auto c = ControllerProcess::Start(tmp, state, flags);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(GetRun(*c, run).state(), v1::RUN_STATE_RUNNING);
  const auto events = WatchUntil(
      *c, "",  // every run
      [](const v1::Event& e) { return e.kind() == "run_failed"; }, std::chrono::seconds(15));
  ASSERT_TRUE(HasEvent(events, "worker_lost"));
  EXPECT_TRUE(HasEvent(events, "run_registered"));  // the old events come first
  EXPECT_EQ(events.front().run_id(), run);
  EXPECT_EQ(GetRun(*c, run).state(), v1::RUN_STATE_FAILED);
  EXPECT_EQ(c->Stop(), 0);
}

TEST(ControllerProcessTest, TlsWithClientCertificates) {
  TempDir tmp("fp8rt-controller-test");
  const std::string cert = tmp / "cert.pem", key = tmp / "key.pem";
  const std::string openssl =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost -addext "
      "subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout " +
      key + " -out " + cert + " > /dev/null 2>&1";
  if (std::system(openssl.c_str()) != 0) GTEST_SKIP() << "openssl cannot make a test certificate";
  // One self-signed certificate serves as server certificate, client certificate and client CA.
  auto c = ControllerProcess::Start(
      tmp, tmp / "state", {"--tls-cert", cert, "--tls-key", key, "--tls-client-ca", cert});
  ASSERT_NE(c, nullptr);
  auto list_runs = [&](std::shared_ptr<grpc::ChannelCredentials> creds) {
    auto stub = v1::Runs::NewStub(grpc::CreateChannel(c->grpc_address(), creds));
    auto ctx = Ctx();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ListRunsResponse resp;
    return stub->ListRuns(ctx.get(), v1::ListRunsRequest(), &resp);
  };
  grpc::SslCredentialsOptions with_cert;
  with_cert.pem_root_certs = ReadFile(cert);
  with_cert.pem_cert_chain = ReadFile(cert);
  with_cert.pem_private_key = ReadFile(key);
  const grpc::Status ok = list_runs(grpc::SslCredentials(with_cert));
  EXPECT_TRUE(ok.ok()) << ok.error_message();
  grpc::SslCredentialsOptions without_cert;
  without_cert.pem_root_certs = ReadFile(cert);
  EXPECT_FALSE(list_runs(grpc::SslCredentials(without_cert)).ok());
  EXPECT_FALSE(list_runs(grpc::InsecureChannelCredentials()).ok());
  EXPECT_EQ(c->Stop(), 0);
}

TEST(ControllerProcessTest, CorruptStateFileStopsTheStart) {
  TempDir tmp("fp8rt-controller-test");
  const std::string state = tmp / "state";
  {
    auto c = ControllerProcess::Start(tmp, state);
    ASSERT_NE(c, nullptr);
    RegisterAll(*c, "corrupt-a", tmp / "run", SmallSpec());
    EXPECT_EQ(c->Stop(), 0);
  }
  const std::string file = (fs::path(state) / "runs" / "corrupt-a.run").string();
  ASSERT_TRUE(fs::exists(file));
  std::string bytes = ReadFile(file);
  bytes[bytes.size() / 2] ^= 0x01;
  WriteFile(file, bytes);

  WriteFile(tmp / "token", kToken);
  std::string err;
  const int rc = RunToExit({"--token-file", tmp / "token", "--state-dir", state, "--listen",
                            "127.0.0.1:0", "--metrics-listen", "off"},
                           tmp / "corrupt.log", &err);
  EXPECT_EQ(rc, 1) << err;
  EXPECT_THAT(err, HasSubstr(file));
}

TEST(ControllerProcessTest, BadFlagsExitTwoNamingTheFlag) {
  TempDir tmp("fp8rt-controller-test");
  WriteFile(tmp / "token", kToken);
  WriteFile(tmp / "short", "  short-token \n");
  struct Case {
    std::vector<std::string> args;
    std::string names;
  } cases[] = {
      {{"--state-dir", tmp / "s"}, "--token-file"},
      {{"--token-file", tmp / "short", "--state-dir", tmp / "s"}, tmp / "short"},
      {{"--token-file", tmp / "missing", "--state-dir", tmp / "s"}, tmp / "missing"},
      {{"--token-file", tmp / "token", "--state-dir", tmp / "s", "--listen", "nowhere"},
       "--listen"},
      {{"--token-file", tmp / "token", "--state-dir", tmp / "s", "--heartbeat-timeout-s", "-1"},
       "--heartbeat-timeout-s"},
      {{"--token-file", tmp / "token", "--state-dir", tmp / "s", "--tls-cert", tmp / "token"},
       "--tls-cert"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.names);
    std::string err;
    EXPECT_EQ(RunToExit(k.args, tmp / "flags.log", &err), 2) << err;
    EXPECT_THAT(err, HasSubstr(k.names));
    EXPECT_THAT(err, Not(HasSubstr(kToken)));
  }
}

}  // namespace
}  // namespace fp8rt
