// fp8rt-controller under hostile clients (issue 9): who may call what, and what a client cannot
// make it do. The real binary on free loopback ports, driven through the generated stubs.
//
// Index:
//   helpers           a small run spec, certificates (openssl CLI), RSS of the controller
//   AuthMatrix        no / malformed / wrong / another run's token on Control and Runs RPCs,
//                     a run token on its own run, the admin token, spoofed metadata, tokens kept
//                     as hashes across a restart, no token in the log
//   MutualTls         no client certificate and an untrusted one fail the handshake (UNAVAILABLE);
//                     a trusted certificate still needs a token
//   Limits*           oversized messages (RESOURCE_EXHAUSTED), huge repeated fields
//                     (INVALID_ARGUMENT naming the field and the cap), 500 concurrent streams
//                     (capped, RESOURCE_EXHAUSTED), bounded runs / recipe versions / events /
//                     tokens, the controller's RSS bounded throughout
//
// Expected codes and caps come from control.proto, controller.h and controller_main.cc's
// documented limits, not from the controller's own answers.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fp8rt/v1/control.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "runtime/spec/run_spec.h"
#include "tests/support/test_support.h"

namespace fp8rt {
namespace {

namespace fs = std::filesystem;
using test::BearerContext;
using test::ControllerProcess;
using test::ReadFile;
using test::TempDir;
using test::WriteFile;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kBinary = std::string(FP8RT_BIN_DIR) + "/fp8rt-controller";
constexpr char kAdminToken[] = "security-test-admin-token-0123456789";

// The documented limits (controller_main.cc, controller.h).
constexpr int kMaxMessageBytes = 16 << 20;
constexpr int kMaxSitesPerReport = 1 << 18;
constexpr int kMaxRecipeExcludes = 16384;
constexpr int kMaxRunTokensPerRun = 64;
constexpr int kMaxEventsPerRun = 1000;
constexpr int kMaxRecipeVersions = 1000;
// The memory bound this test holds the controller to: peak resident size during the abuse, and
// growth once it is over (the controller returns freed memory to the system every second).
constexpr double kMaxRssMiB = 512, kMaxRssGrowthMiB = 256;
// Under AddressSanitizer the allocator keeps freed memory in quarantine (256 MiB by default) and
// shadow memory doubles the rest: the figures are printed, not checked.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kCheckRss = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kCheckRss = false;
#else
constexpr bool kCheckRss = true;
#endif
#else
constexpr bool kCheckRss = true;
#endif

v1::RunSpec SmallSpec() {
  v1::RunSpec spec = test::TinyModelSpec();
  spec.mutable_parallel()->set_dp(1);
  spec.mutable_train()->set_steps(100000);
  spec.mutable_data()->set_path("/nonexistent/on/the/controller/data.txt");
  return spec;
}

std::unique_ptr<ControllerProcess> StartController(const TempDir& tmp,
                                                   std::vector<std::string> extra = {}) {
  ControllerProcess::Options o;
  o.binary = kBinary;
  o.dir = tmp.path();
  o.state_dir = tmp / "state";
  o.token = kAdminToken;
  o.extra = std::move(extra);
  return ControllerProcess::Start(std::move(o));
}

// VmRSS of `pid` in MiB (from /proc/<pid>/status), or -1.
double RssMiB(pid_t pid) {
  const std::string status = ReadFile("/proc/" + std::to_string(pid) + "/status");
  const size_t at = status.find("VmRSS:");
  if (at == std::string::npos) return -1;
  return std::strtod(status.c_str() + at + 6, nullptr) / 1024.0;
}

// Samples RssMiB(pid) every 10 ms from construction to Stop(); peak() is the largest sample.
class RssSampler {
 public:
  explicit RssSampler(pid_t pid)
      : thread_([this, pid] {
          while (!stop_.load()) {
            const double rss = RssMiB(pid);
            if (rss > peak_.load()) peak_ = rss;
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
        }) {}
  ~RssSampler() { Stop(); }
  double Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    return peak_.load();
  }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<double> peak_{0};
  std::thread thread_;
};

std::string MintToken(ControllerProcess& c, const std::string& run) {
  v1::CreateRunTokenRequest req;
  req.set_run_id(run);
  v1::CreateRunTokenResponse resp;
  const grpc::Status s = c.runs().CreateRunToken(BearerContext(kAdminToken).get(), req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.run_id(), run);
  EXPECT_EQ(resp.token().size(), 64u);  // 32 random bytes in hex
  return resp.token();
}

grpc::Status RegisterRank0(ControllerProcess& c, const std::string& token, const std::string& run,
                           const fs::path& run_dir) {
  v1::RegisterRequest req;
  req.set_run_id(run);
  req.set_rank(0);
  req.set_world_size(1);
  *req.mutable_spec() = SmallSpec();
  req.set_run_dir(run_dir.string());
  req.set_hostname("security-test");
  req.set_pid(1);
  v1::RegisterResponse resp;
  return c.control().Register(BearerContext(token).get(), req, &resp);
}

// A context whose authorization metadata is exactly `header` (none when empty), plus `extra`.
std::unique_ptr<grpc::ClientContext> RawContext(
    const std::string& header, const std::vector<std::pair<std::string, std::string>>& extra = {}) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  if (!header.empty()) ctx->AddMetadata("authorization", header);
  for (const auto& [k, v] : extra) ctx->AddMetadata(k, v);
  return ctx;
}

// Every run-scoped RPC of both services, called on `run` with a context from `make`: the statuses
// in the order of `kRpcNames`. None of them changes the run (StopRun is left to the caller).
const std::vector<std::string> kRpcNames = {
    "Control.Heartbeat",    "Control.ReportStep", "Control.BeginCheckpoint", "Control.AckShard",
    "Runs.GetRun",          "Runs.GetLayers",     "Runs.GetRecipe",          "Runs.UpdateRecipe",
    "Runs.ListCheckpoints", "Runs.WatchEvents"};

template <typename MakeContext>
std::vector<grpc::Status> CallEveryRpc(ControllerProcess& c, const std::string& run,
                                       MakeContext make) {
  std::vector<grpc::Status> out;
  {
    v1::HeartbeatRequest req;
    req.set_run_id(run);
    v1::HeartbeatResponse resp;
    out.push_back(c.control().Heartbeat(make().get(), req, &resp));
  }
  {
    v1::ReportStepRequest req;  // invalid (no metrics): reaches validation only when authorized
    req.set_run_id(run);
    v1::ReportStepResponse resp;
    out.push_back(c.control().ReportStep(make().get(), req, &resp));
  }
  {
    v1::BeginCheckpointRequest req;  // invalid step: reaches validation only when authorized
    req.set_run_id(run);
    req.set_step(-1);
    v1::BeginCheckpointResponse resp;
    out.push_back(c.control().BeginCheckpoint(make().get(), req, &resp));
  }
  {
    v1::AckShardRequest req;  // no save in progress: FAILED_PRECONDITION when authorized
    req.set_run_id(run);
    req.set_step(5);
    req.set_rank(0);
    req.set_file("rank-00000.shard");
    v1::AckShardResponse resp;
    out.push_back(c.control().AckShard(make().get(), req, &resp));
  }
  {
    v1::GetRunRequest req;
    req.set_run_id(run);
    v1::Run resp;
    out.push_back(c.runs().GetRun(make().get(), req, &resp));
  }
  {
    v1::GetLayersRequest req;
    req.set_run_id(run);
    v1::GetLayersResponse resp;
    out.push_back(c.runs().GetLayers(make().get(), req, &resp));
  }
  {
    v1::GetRecipeRequest req;
    req.set_run_id(run);
    v1::RecipeVersion resp;
    out.push_back(c.runs().GetRecipe(make().get(), req, &resp));
  }
  {
    v1::UpdateRecipeRequest req;  // no recipe: INVALID_ARGUMENT when authorized
    req.set_run_id(run);
    v1::RecipeVersion resp;
    out.push_back(c.runs().UpdateRecipe(make().get(), req, &resp));
  }
  {
    v1::ListCheckpointsRequest req;
    req.set_run_id(run);
    v1::ListCheckpointsResponse resp;
    out.push_back(c.runs().ListCheckpoints(make().get(), req, &resp));
  }
  {
    // A stream: an authorized one delivers the run's first event (run_registered), then is
    // cancelled.
    auto ctx = make();
    v1::WatchEventsRequest req;
    req.set_run_id(run);
    auto reader = c.runs().WatchEvents(ctx.get(), req);
    v1::Event e;
    const bool got = reader->Read(&e);
    if (got) ctx->TryCancel();
    const grpc::Status s = reader->Finish();
    out.push_back(got ? grpc::Status::OK : s);
  }
  return out;
}

// Expects every status to have `code` (and `message` in its text).
void ExpectAll(const std::vector<grpc::Status>& statuses, grpc::StatusCode code,
               const std::string& message) {
  ASSERT_EQ(statuses.size(), kRpcNames.size());
  for (size_t i = 0; i < statuses.size(); ++i) {
    EXPECT_EQ(statuses[i].error_code(), code)
        << kRpcNames[i] << ": " << statuses[i].error_message();
    EXPECT_THAT(statuses[i].error_message(), HasSubstr(message)) << kRpcNames[i];
  }
}

// Expects every call to have passed authentication and authorization: what comes back is the
// handler's own answer (OK, or the validation / precondition error of the test's request).
void ExpectAllAuthorized(const std::vector<grpc::Status>& statuses) {
  ASSERT_EQ(statuses.size(), kRpcNames.size());
  for (size_t i = 0; i < statuses.size(); ++i) {
    const grpc::StatusCode code = statuses[i].error_code();
    EXPECT_NE(code, grpc::StatusCode::UNAUTHENTICATED)
        << kRpcNames[i] << ": " << statuses[i].error_message();
    EXPECT_NE(code, grpc::StatusCode::PERMISSION_DENIED)
        << kRpcNames[i] << ": " << statuses[i].error_message();
    EXPECT_NE(code, grpc::StatusCode::UNAVAILABLE) << kRpcNames[i];
  }
  // The ones that have nothing to refuse answer OK.
  for (const int i : {0, 4, 5, 6, 8, 9}) {
    EXPECT_TRUE(statuses[i].ok()) << kRpcNames[i] << ": " << statuses[i].error_message();
  }
}

std::vector<std::string> RunIds(const v1::ListRunsResponse& list) {
  std::vector<std::string> ids;
  for (const v1::Run& r : list.runs()) ids.push_back(r.run_id());
  return ids;
}

// Every file under `dir`, concatenated (to look for a secret in it).
std::string AllFiles(const fs::path& dir) {
  std::string all;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) all += ReadFile(e.path());
  }
  return all;
}

// ---------------------------------------------------------------------------------------------
// The auth matrix.

TEST(SecurityTest, AuthMatrixOnControlAndRunsRpcs) {
  TempDir tmp("fp8rt-security");
  auto c = StartController(tmp);
  ASSERT_NE(c, nullptr);

  // Run tokens are minted by the admin; the run need not exist yet (its workers register it).
  const std::string token_a = MintToken(*c, "run-a");
  const std::string token_b = MintToken(*c, "run-b");
  ASSERT_NE(token_a, token_b);
  ASSERT_TRUE(RegisterRank0(*c, token_a, "run-a", tmp / "runs/a").ok());
  ASSERT_TRUE(RegisterRank0(*c, token_b, "run-b", tmp / "runs/b").ok());
  // A run token cannot register another run, nor a new one.
  EXPECT_EQ(RegisterRank0(*c, token_a, "run-b", tmp / "runs/b").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(RegisterRank0(*c, token_a, "run-new", tmp / "runs/new").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);

  struct Case {
    std::string what;
    std::string header;
    grpc::StatusCode code;
    std::string message;
  } refused[] = {
      {"no token", "", grpc::StatusCode::UNAUTHENTICATED, "missing bearer token"},
      {"another scheme", std::string("Basic ") + kAdminToken, grpc::StatusCode::UNAUTHENTICATED,
       "missing bearer token"},
      {"no scheme", kAdminToken, grpc::StatusCode::UNAUTHENTICATED, "missing bearer token"},
      {"empty bearer", "Bearer ", grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token"},
      {"wrong token", "Bearer wrong-token-0123456789abcdef0123456789",
       grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token"},
      {"admin token with a suffix", std::string("Bearer ") + kAdminToken + "x",
       grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token"},
      {"run token, one digit changed",
       "Bearer " + token_a.substr(0, 63) + (token_a[63] == '0' ? "1" : "0"),
       grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token"},
      {"another run's token", "Bearer " + token_b, grpc::StatusCode::PERMISSION_DENIED,
       "run_id: this token is valid for run 'run-b' only, got 'run-a'"},
  };
  for (const Case& k : refused) {
    SCOPED_TRACE(k.what);
    ExpectAll(CallEveryRpc(*c, "run-a", [&] { return RawContext(k.header); }), k.code, k.message);
    v1::StopRunRequest stop;
    stop.set_run_id("run-a");
    v1::Run run;
    EXPECT_EQ(c->runs().StopRun(RawContext(k.header).get(), stop, &run).error_code(), k.code);
  }

  // Accepted: the run's own token and the admin token.
  {
    SCOPED_TRACE("own run token");
    ExpectAllAuthorized(CallEveryRpc(*c, "run-a", [&] { return BearerContext(token_a); }));
  }
  {
    SCOPED_TRACE("admin token");
    ExpectAllAuthorized(CallEveryRpc(*c, "run-b", [&] { return BearerContext(kAdminToken); }));
  }

  // Listing: a run token sees its run only; watching every run is the admin's.
  v1::ListRunsResponse list;
  ASSERT_TRUE(c->runs().ListRuns(BearerContext(token_a).get(), {}, &list).ok());
  EXPECT_THAT(RunIds(list), ::testing::ElementsAre("run-a"));
  ASSERT_TRUE(c->runs().ListRuns(BearerContext(kAdminToken).get(), {}, &list).ok());
  EXPECT_THAT(RunIds(list), ::testing::ElementsAre("run-a", "run-b"));
  {
    auto ctx = BearerContext(token_a);
    auto reader = c->runs().WatchEvents(ctx.get(), v1::WatchEventsRequest());
    v1::Event e;
    EXPECT_FALSE(reader->Read(&e));
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(s.error_message(), HasSubstr("run_id: "));
  }
  // Minting is the admin's.
  {
    v1::CreateRunTokenRequest req;
    req.set_run_id("run-a");
    v1::CreateRunTokenResponse resp;
    const grpc::Status s = c->runs().CreateRunToken(BearerContext(token_a).get(), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(s.error_message(), HasSubstr("CreateRunToken: needs the controller's admin token"));
    EXPECT_TRUE(resp.token().empty());
    req.set_run_id("Bad_Id");
    EXPECT_EQ(c->runs().CreateRunToken(BearerContext(kAdminToken).get(), req, &resp).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }

  // Identity comes from the token only: metadata a client can set changes nothing.
  const std::vector<std::pair<std::string, std::string>> spoofed = {
      {"x-run-id", "run-a"},
      {"x-fp8rt-run", "run-a"},
      {"x-forwarded-for", "127.0.0.1"},
      {"x-fp8rt-admin", "true"},
      {"x-user", "admin"}};
  {
    SCOPED_TRACE("run-b's token claiming run-a in metadata");
    ExpectAll(CallEveryRpc(*c, "run-a", [&] { return RawContext("Bearer " + token_b, spoofed); }),
              grpc::StatusCode::PERMISSION_DENIED, "valid for run 'run-b' only");
    ASSERT_TRUE(c->runs().ListRuns(RawContext("Bearer " + token_b, spoofed).get(), {}, &list).ok());
    EXPECT_THAT(RunIds(list), ::testing::ElementsAre("run-b"));
  }
  {
    SCOPED_TRACE("no token, claims in metadata");
    ExpectAll(CallEveryRpc(*c, "run-a", [&] { return RawContext("", spoofed); }),
              grpc::StatusCode::UNAUTHENTICATED, "missing bearer token");
  }

  // StopRun: refused with run-b's token, accepted with run-a's.
  v1::StopRunRequest stop;
  stop.set_run_id("run-a");
  v1::Run run;
  EXPECT_EQ(c->runs().StopRun(BearerContext(token_b).get(), stop, &run).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  ASSERT_TRUE(c->runs()
                  .GetRun(
                      BearerContext(kAdminToken).get(),
                      [] {
                        v1::GetRunRequest r;
                        r.set_run_id("run-a");
                        return r;
                      }(),
                      &run)
                  .ok());
  EXPECT_EQ(run.state(), v1::RUN_STATE_RUNNING);  // nothing refused above stopped it
  ASSERT_TRUE(c->runs().StopRun(BearerContext(token_a).get(), stop, &run).ok());
  EXPECT_EQ(run.state(), v1::RUN_STATE_STOPPING);

  // Tokens survive a restart, and only their hashes are stored.
  ASSERT_TRUE(c->Restart());
  ASSERT_TRUE(c->runs().ListRuns(BearerContext(token_a).get(), {}, &list).ok());
  EXPECT_THAT(RunIds(list), ::testing::ElementsAre("run-a"));
  v1::GetRunRequest get_b;
  get_b.set_run_id("run-b");
  EXPECT_EQ(c->runs().GetRun(BearerContext(token_a).get(), get_b, &run).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  const std::string state = AllFiles(tmp / "state");
  EXPECT_THAT(state, Not(HasSubstr(token_a)));
  EXPECT_THAT(state, Not(HasSubstr(token_b)));

  // No token ever reaches the log.
  ASSERT_EQ(c->Stop(), 0);
  std::string logs;
  for (const auto& e : fs::directory_iterator(tmp.path())) {
    if (e.path().extension() == ".log") logs += ReadFile(e.path());
  }
  EXPECT_THAT(logs, HasSubstr("a run token was created"));
  EXPECT_THAT(logs, Not(HasSubstr(kAdminToken)));
  EXPECT_THAT(logs, Not(HasSubstr(token_a)));
  EXPECT_THAT(logs, Not(HasSubstr(token_b)));
}

TEST(SecurityTest, RunTokensPerRunAreCappedOldestRevoked) {
  TempDir tmp("fp8rt-security");
  auto c = StartController(tmp);
  ASSERT_NE(c, nullptr);
  std::vector<std::string> tokens;
  for (int i = 0; i <= kMaxRunTokensPerRun; ++i) tokens.push_back(MintToken(*c, "run-c"));
  v1::ListRunsResponse list;
  const grpc::Status first = c->runs().ListRuns(BearerContext(tokens[0]).get(), {}, &list);
  EXPECT_EQ(first.error_code(), grpc::StatusCode::UNAUTHENTICATED) << "the oldest is revoked";
  for (size_t i = 1; i < tokens.size(); ++i) {
    EXPECT_TRUE(c->runs().ListRuns(BearerContext(tokens[i]).get(), {}, &list).ok()) << i;
  }
  EXPECT_EQ(c->Stop(), 0);
}

TEST(SecurityTest, CliMintsARunTokenIntoA0600File) {
  TempDir tmp("fp8rt-security");
  auto c = StartController(tmp);
  ASSERT_NE(c, nullptr);
  const std::string fp8rt = std::string(FP8RT_BIN_DIR) + "/fp8rt";
  const fs::path out = tmp / "run-z.token";
  const std::map<std::string, std::string> env = {{"FP8RT_CONTROLLER", c->grpc_address()},
                                                  {"FP8RT_TOKEN_FILE", c->token_file().string()}};
  const test::ExitResult minted =
      test::RunToExit({fp8rt, "runs", "token", "run-z", "--out", out.string()}, tmp / "cli.log",
                      env, std::chrono::seconds(30));
  ASSERT_EQ(minted.exit_code, 0) << minted.log;
  EXPECT_EQ(fs::status(out).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);
  std::string token = ReadFile(out);
  while (!token.empty() && token.back() == '\n') token.pop_back();
  ASSERT_EQ(token.size(), 64u);
  EXPECT_THAT(minted.log, Not(HasSubstr(token)));  // written to the file only
  ASSERT_TRUE(RegisterRank0(*c, token, "run-z", tmp / "runs/z").ok());
  v1::ListRunsResponse list;
  ASSERT_TRUE(c->runs().ListRuns(BearerContext(token).get(), {}, &list).ok());
  EXPECT_THAT(RunIds(list), ::testing::ElementsAre("run-z"));
  // --out never overwrites; a run token cannot mint.
  const test::ExitResult again =
      test::RunToExit({fp8rt, "runs", "token", "run-z", "--out", out.string()}, tmp / "cli2.log",
                      env, std::chrono::seconds(30));
  EXPECT_NE(again.exit_code, 0);
  EXPECT_EQ(ReadFile(out), token + "\n");
  const test::ExitResult by_run =
      test::RunToExit({fp8rt, "runs", "token", "run-z", "--token-file", out.string()},
                      tmp / "cli3.log", env, std::chrono::seconds(30));
  EXPECT_EQ(by_run.exit_code, 1);
  EXPECT_THAT(by_run.log, HasSubstr("PERMISSION_DENIED"));
  EXPECT_EQ(c->Stop(), 0);
}

// ---------------------------------------------------------------------------------------------
// Mutual TLS.

struct Pki {
  std::string ca, server_cert, server_key, client_cert, client_key;
  std::string rogue_client_cert, rogue_client_key;
};

// Runs an openssl command line in `dir`; false when it fails.
bool Openssl(const fs::path& dir, const std::string& args) {
  const std::string cmd = "cd '" + dir.string() + "' && openssl " + args + " > openssl.log 2>&1";
  return std::system(cmd.c_str()) == 0;
}

// A CA; a server certificate (localhost, 127.0.0.1) and a client certificate signed by it; and a
// second, self-signed "rogue" CA with a client certificate of its own. EC P-256 keys (fast).
bool MakePki(const fs::path& dir, Pki* pki) {
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  WriteFile(dir / "server.ext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n");
  WriteFile(dir / "client.ext", "extendedKeyUsage=clientAuth\n");
  const std::string ca_ext =
      " -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign";
  const bool ok =
      Openssl(dir, "req -x509 " + key + " -days 1 -subj /CN=fp8rt-test-ca" + ca_ext +
                       " -keyout ca.key -out ca.pem") &&
      Openssl(dir, "req " + key + " -subj /CN=localhost -keyout server.key -out server.csr") &&
      Openssl(dir,
              "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -set_serial 2 -days 1 "
              "-extfile server.ext -out server.pem") &&
      Openssl(dir, "req " + key + " -subj /CN=fp8rt-worker -keyout client.key -out client.csr") &&
      Openssl(dir,
              "x509 -req -in client.csr -CA ca.pem -CAkey ca.key -set_serial 3 -days 1 "
              "-extfile client.ext -out client.pem") &&
      Openssl(dir, "req -x509 " + key + " -days 1 -subj /CN=rogue-ca" + ca_ext +
                       " -keyout rogue-ca.key -out rogue-ca.pem") &&
      Openssl(dir, "req " + key + " -subj /CN=fp8rt-worker -keyout rogue.key -out rogue.csr") &&
      Openssl(dir,
              "x509 -req -in rogue.csr -CA rogue-ca.pem -CAkey rogue-ca.key -set_serial 4 "
              "-days 1 -extfile client.ext -out rogue.pem");
  if (!ok) return false;
  pki->ca = (dir / "ca.pem").string();
  pki->server_cert = (dir / "server.pem").string();
  pki->server_key = (dir / "server.key").string();
  pki->client_cert = (dir / "client.pem").string();
  pki->client_key = (dir / "client.key").string();
  pki->rogue_client_cert = (dir / "rogue.pem").string();
  pki->rogue_client_key = (dir / "rogue.key").string();
  return true;
}

TEST(SecurityTest, MutualTlsRejectsMissingAndUntrustedClientCertificates) {
  TempDir tmp("fp8rt-security");
  Pki pki;
  ASSERT_TRUE(MakePki(tmp.path(), &pki)) << ReadFile(tmp / "openssl.log");
  auto c = StartController(
      tmp, {"--tls-cert", pki.server_cert, "--tls-key", pki.server_key, "--tls-client-ca", pki.ca});
  ASSERT_NE(c, nullptr);

  auto list_runs = [&](const std::string& cert, const std::string& key, const std::string& token) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = ReadFile(pki.ca);
    if (!cert.empty()) {
      ssl.pem_cert_chain = ReadFile(cert);
      ssl.pem_private_key = ReadFile(key);
    }
    auto stub =
        v1::Runs::NewStub(grpc::CreateChannel(c->grpc_address(), grpc::SslCredentials(ssl)));
    v1::ListRunsResponse resp;
    return stub->ListRuns(BearerContext(token, std::chrono::seconds(10)).get(), {}, &resp);
  };

  // The handshake fails: the call never reaches a handler.
  grpc::Status s = list_runs("", "", kAdminToken);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << "no client certificate";
  s = list_runs(pki.rogue_client_cert, pki.rogue_client_key, kAdminToken);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << "untrusted client certificate";
  {
    // Plaintext to a TLS port.
    auto stub = v1::Runs::NewStub(
        grpc::CreateChannel(c->grpc_address(), grpc::InsecureChannelCredentials()));
    v1::ListRunsResponse resp;
    EXPECT_EQ(stub->ListRuns(BearerContext(kAdminToken, std::chrono::seconds(10)).get(), {}, &resp)
                  .error_code(),
              grpc::StatusCode::UNAVAILABLE);
  }
  // A trusted certificate is not a credential of its own: the token is still required.
  s = list_runs(pki.client_cert, pki.client_key, kAdminToken);
  EXPECT_TRUE(s.ok()) << s.error_message();
  s = list_runs(pki.client_cert, pki.client_key, "");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(s.error_message(), HasSubstr("missing bearer token"));
  s = list_runs(pki.client_cert, pki.client_key, "wrong-token-0123456789abcdef");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(c->Stop(), 0);
}

// ---------------------------------------------------------------------------------------------
// Limits.

TEST(LimitsTest, OversizedMessagesAndHugeRepeatedFieldsAreRefused) {
  TempDir tmp("fp8rt-security");
  auto c = StartController(tmp);
  ASSERT_NE(c, nullptr);
  const pid_t pid = c->process()->pid();
  ASSERT_TRUE(RegisterRank0(*c, kAdminToken, "big", tmp / "runs/big").ok());
  const double rss_before = RssMiB(pid);
  RssSampler sampler(pid);

  // Over the receive limit: refused by gRPC before any handler runs.
  {
    v1::UpdateRecipeRequest req;
    req.set_run_id("big");
    req.set_reason(std::string(kMaxMessageBytes + 1024, 'x'));
    v1::RecipeVersion resp;
    const grpc::Status s = c->runs().UpdateRecipe(BearerContext(kAdminToken).get(), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  }
  {
    v1::ReportStepRequest req;
    req.set_run_id("big");
    req.mutable_metrics()->set_step(1);
    v1::SiteStats* site = req.add_sites();
    site->set_layer(std::string(kMaxMessageBytes, 'L'));
    site->set_tensor(v1::TENSOR_ROLE_INPUT);
    v1::ReportStepResponse resp;
    const grpc::Status s = c->control().ReportStep(BearerContext(kAdminToken).get(), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  }

  // Within the size limit, but far more entries than any run reports: refused, naming the cap.
  {
    v1::ReportStepRequest req;
    req.set_run_id("big");
    req.mutable_metrics()->set_step(1);
    for (int i = 0; i < 1000000; ++i) {
      v1::SiteStats* site = req.add_sites();
      site->set_layer("l");
      site->set_tensor(v1::TENSOR_ROLE_INPUT);
    }
    ASSERT_LT(req.ByteSizeLong(), static_cast<size_t>(kMaxMessageBytes));
    v1::ReportStepResponse resp;
    const grpc::Status s = c->control().ReportStep(BearerContext(kAdminToken).get(), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(),
                HasSubstr("sites: at most " + std::to_string(kMaxSitesPerReport) +
                          " entries, got 1000000"));
  }
  {
    v1::UpdateRecipeRequest req;
    req.set_run_id("big");
    auto* recipe = req.mutable_recipe();
    for (int i = 0; i < 100000; ++i) recipe->add_exclude("blocks.0.mlp.fc1");
    v1::RecipeVersion resp;
    const grpc::Status s = c->runs().UpdateRecipe(BearerContext(kAdminToken).get(), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(),
                HasSubstr("recipe.exclude: at most " + std::to_string(kMaxRecipeExcludes) +
                          " entries, got 100000"));
  }
  {
    v1::ReportStepRequest req;
    req.set_run_id("big");
    req.mutable_metrics()->set_step(1);
    v1::SiteStats* site = req.add_sites();
    site->set_layer(std::string(100000, 'L'));
    site->set_tensor(v1::TENSOR_ROLE_INPUT);
    v1::ReportStepResponse resp;
    const grpc::Status s = c->control().ReportStep(BearerContext(kAdminToken).get(), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("sites[0].layer: at most 256 bytes, got 100000"));
  }
  // Many oversized and huge requests at once, from several clients.
  {
    std::vector<std::thread> threads;
    std::atomic<int> refused{0};
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        auto stub = v1::Control::NewStub(
            grpc::CreateChannel(c->grpc_address(), grpc::InsecureChannelCredentials()));
        v1::ReportStepRequest req;
        req.set_run_id("big");
        req.mutable_metrics()->set_step(1);
        for (int i = 0; i < kMaxSitesPerReport + 1; ++i) {
          v1::SiteStats* site = req.add_sites();
          site->set_layer("blocks.0.mlp.fc1");
          site->set_tensor(v1::TENSOR_ROLE_WEIGHT);
        }
        for (int k = 0; k < 4; ++k) {
          v1::ReportStepResponse resp;
          if (stub->ReportStep(BearerContext(kAdminToken).get(), req, &resp).error_code() ==
              grpc::StatusCode::INVALID_ARGUMENT) {
            ++refused;
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(refused.load(), 16);
  }

  // Alive and answering; nothing of the refused requests was stored.
  ASSERT_TRUE(c->running());
  v1::GetLayersRequest layers_req;
  layers_req.set_run_id("big");
  v1::GetLayersResponse layers;
  ASSERT_TRUE(c->runs().GetLayers(BearerContext(kAdminToken).get(), layers_req, &layers).ok());
  EXPECT_EQ(layers.sites_size(), 0);
  const double rss_peak = sampler.Stop();
  // Freed memory goes back to the system within about a second.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const double rss_after = RssMiB(pid);
  std::printf(
      "controller VmRSS: %.1f MiB before, %.1f MiB peak during the oversized and huge "
      "requests (4 clients x 4 262,145-site reports, concurrently), %.1f MiB 1.5 s after\n",
      rss_before, rss_peak, rss_after);
  if (kCheckRss) {
    EXPECT_LT(rss_peak, kMaxRssMiB);
    EXPECT_LT(rss_after - rss_before, kMaxRssGrowthMiB);
  }
  EXPECT_EQ(c->Stop(), 0);
}

// Issue 19's four classes of input validation, each over gRPC on a real controller: client input
// quoted by a bounded prefix only; string fields length-checked before any other check (so a
// megabyte name comes back as a short INVALID_ARGUMENT naming the field, not as RESOURCE_EXHAUSTED
// from an oversized error); enum numbers the proto does not define refused, naming the field,
// with nothing stored; steps bounded by kMaxStep, so the recipe schedule cannot overflow.
TEST(InputValidationTest, EachClassIsRefusedNamingTheFieldInAShortMessage) {
  TempDir tmp("fp8rt-security");
  auto c = StartController(tmp);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(RegisterRank0(*c, kAdminToken, "val", tmp / "runs/val").ok());
  auto update = [&](const v1::Recipe& recipe) {
    v1::UpdateRecipeRequest req;
    req.set_run_id("val");
    *req.mutable_recipe() = recipe;
    v1::RecipeVersion resp;
    return c->runs().UpdateRecipe(BearerContext(kAdminToken).get(), req, &resp);
  };
  v1::RecipeVersion current;
  {
    v1::GetRecipeRequest req;
    req.set_run_id("val");
    ASSERT_TRUE(c->runs().GetRecipe(BearerContext(kAdminToken).get(), req, &current).ok());
  }
  auto expect_refused = [](const grpc::Status& s, const std::string& field) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(field));
    EXPECT_LT(s.error_message().size(), 400u) << "an error quotes a bounded prefix only";
  };
  // Length first: a 1 MiB layer name in the exclude list.
  {
    v1::Recipe r = current.recipe();
    r.add_exclude(std::string(1 << 20, 'L'));
    const grpc::Status s = update(r);
    expect_refused(s, "recipe.exclude[0]: at most 256 bytes, got 1048576");
  }
  // Within the length cap but no such layer: quoted by its first 64 bytes and its length.
  {
    v1::Recipe r = current.recipe();
    r.add_exclude(std::string(200, 'x'));
    const grpc::Status s = update(r);
    expect_refused(s, "recipe.exclude[0]: no layer named '" + std::string(64, 'x') +
                          "'...(200 bytes)");
  }
  // The same for a per-layer recipe's pattern (precision.overrides): length first, then a
  // bounded quote of a pattern that matches no layer, and enum numbers the proto lacks.
  {
    v1::Recipe r = current.recipe();
    r.add_overrides()->set_layers(std::string(1 << 20, 'G'));
    expect_refused(update(r), "recipe.overrides[0].layers: at most 256 bytes, got 1048576");
    r = current.recipe();
    r.add_overrides()->set_layers(std::string(200, 'g'));
    expect_refused(update(r), "recipe.overrides[0].layers: '" + std::string(64, 'g') +
                                  "'...(200 bytes) matches no layer");
    r = current.recipe();
    for (int i = 0; i < 100000; ++i) r.add_overrides()->set_layers("blocks.*");
    expect_refused(update(r), "recipe.overrides: at most 256");
    r = current.recipe();
    v1::RunSpec::Precision::Override* o = r.add_overrides();
    o->set_layers("blocks.*");
    o->set_mode(static_cast<v1::RunSpec::Precision::Mode>(77));
    expect_refused(update(r), "recipe.overrides[0].mode");
  }
  // An enum number the proto does not define: refused, and no new version stored.
  {
    v1::Recipe r = current.recipe();
    r.set_scaling(static_cast<v1::RunSpec::Precision::Scaling>(99));
    expect_refused(update(r), "recipe.scaling: 99 is not a value of the enum");
    r = current.recipe();
    r.set_grad_reduce(static_cast<v1::RunSpec::Precision::GradReduce>(-5));
    expect_refused(update(r), "recipe.grad_reduce: -5 is not a value of the enum");
    v1::GetRecipeRequest req;
    req.set_run_id("val");
    v1::RecipeVersion after;
    ASSERT_TRUE(c->runs().GetRecipe(BearerContext(kAdminToken).get(), req, &after).ok());
    EXPECT_EQ(after.version(), current.version());
  }
  // A registered spec: the same checks (enum, then the exclude list's lengths).
  {
    v1::RegisterRequest req;
    req.set_run_id("val2");
    req.set_rank(0);
    req.set_world_size(1);
    *req.mutable_spec() = SmallSpec();
    req.mutable_spec()->mutable_precision()->set_format(
        static_cast<v1::RunSpec::Precision::Format>(42));
    req.set_run_dir((tmp / "runs/val2").string());
    v1::RegisterResponse resp;
    expect_refused(c->control().Register(BearerContext(kAdminToken).get(), req, &resp),
                   "spec.precision.format: 42 is not a value of the enum");
    *req.mutable_spec() = SmallSpec();
    req.mutable_spec()->mutable_precision()->add_exclude(std::string(1 << 20, 'E'));
    expect_refused(c->control().Register(BearerContext(kAdminToken).get(), req, &resp),
                   "spec.precision.exclude[0]: at most 256 bytes");
    *req.mutable_spec() = SmallSpec();
    req.mutable_spec()->mutable_precision()->add_overrides()->set_layers(
        std::string(1 << 20, 'O'));
    expect_refused(c->control().Register(BearerContext(kAdminToken).get(), req, &resp),
                   "precision.overrides[0].layers: at most 256 bytes");
  }
  // Steps: a heartbeat at 2^63 - 1 is refused, and the next recipe is scheduled at a sane step.
  {
    v1::HeartbeatRequest req;
    req.set_run_id("val");
    req.set_rank(0);
    req.set_step(std::numeric_limits<int64_t>::max());
    v1::HeartbeatResponse resp;
    expect_refused(c->control().Heartbeat(BearerContext(kAdminToken).get(), req, &resp),
                   "step: must be in [0, 1099511627776], got 9223372036854775807");
    v1::ReportStepRequest rep;
    rep.set_run_id("val");
    rep.mutable_metrics()->set_step(std::numeric_limits<int64_t>::max());
    v1::ReportStepResponse rep_resp;
    expect_refused(c->control().ReportStep(BearerContext(kAdminToken).get(), rep, &rep_resp),
                   "metrics.step: must be in [1, 1099511627776]");
    v1::Recipe r = current.recipe();
    r.set_margin(current.recipe().margin() + 1);
    v1::UpdateRecipeRequest up;
    up.set_run_id("val");
    *up.mutable_recipe() = r;
    v1::RecipeVersion scheduled;
    ASSERT_TRUE(c->runs().UpdateRecipe(BearerContext(kAdminToken).get(), up, &scheduled).ok());
    EXPECT_GT(scheduled.effective_step(), 0);
    EXPECT_LT(scheduled.effective_step(), 100);
  }
  // A checkpoint RPC: a 1 MiB file name is quoted by its prefix.
  {
    v1::AckShardRequest req;
    req.set_run_id("val");
    req.set_step(1);
    req.set_rank(0);
    req.set_file(std::string(1 << 20, 'f'));
    v1::AckShardResponse resp;
    expect_refused(c->control().AckShard(BearerContext(kAdminToken).get(), req, &resp),
                   "'...(1048576 bytes)");
  }
}

TEST(LimitsTest, ConcurrentStreamsAreCappedPerTokenAndInAll) {
  TempDir tmp("fp8rt-security");
  constexpr int kMaxStreams = 96, kPerToken = 64, kAttempts = 500;
  auto c = StartController(tmp, {"--max-streams", std::to_string(kMaxStreams),
                                 "--max-streams-per-token", std::to_string(kPerToken)});
  ASSERT_NE(c, nullptr);
  const pid_t pid = c->process()->pid();
  ASSERT_TRUE(RegisterRank0(*c, kAdminToken, "watched", tmp / "runs/w").ok());
  const std::string run_token = MintToken(*c, "watched");
  const double rss_before = RssMiB(pid);

  // Opens `n` WatchEvents streams with `token` at once; each either delivers the run's first event
  // (held open) or fails. Returns the statuses of the failed ones; the open ones are in `open`.
  struct Stream {
    std::unique_ptr<grpc::ClientContext> ctx;
    std::unique_ptr<grpc::ClientReader<v1::Event>> reader;
    bool open = false;
    grpc::Status status;
  };
  auto channel = grpc::CreateChannel(c->grpc_address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Runs::NewStub(channel);
  auto open_streams = [&](const std::string& token, int n) {
    std::vector<std::unique_ptr<Stream>> streams(n);
    std::vector<std::thread> threads;
    for (int i = 0; i < n; ++i) {
      streams[i] = std::make_unique<Stream>();
      threads.emplace_back([&, i] {
        Stream& s = *streams[i];
        s.ctx = BearerContext(token, std::chrono::seconds(60));
        v1::WatchEventsRequest req;
        req.set_run_id("watched");
        s.reader = stub->WatchEvents(s.ctx.get(), req);
        v1::Event e;
        s.open = s.reader->Read(&e);
        if (!s.open) s.status = s.reader->Finish();
      });
    }
    for (auto& t : threads) t.join();
    return streams;
  };
  auto count = [](const std::vector<std::unique_ptr<Stream>>& streams, const std::string& msg) {
    int open = 0, exhausted = 0;
    for (const auto& s : streams) {
      if (s->open) {
        ++open;
      } else if (s->status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        ++exhausted;
        EXPECT_THAT(s->status.error_message(), HasSubstr(msg));
      } else {
        ADD_FAILURE() << "unexpected " << s->status.error_code() << ": "
                      << s->status.error_message();
      }
    }
    return std::pair(open, exhausted);
  };

  auto admin = open_streams(kAdminToken, kAttempts);
  const auto [admin_open, admin_exhausted] = count(admin, "concurrent streams per token");
  std::printf("admin: %d of %d streams open, %d RESOURCE_EXHAUSTED\n", admin_open, kAttempts,
              admin_exhausted);
  EXPECT_EQ(admin_open, kPerToken);
  EXPECT_EQ(admin_exhausted, kAttempts - kPerToken);

  // Another caller still gets streams, up to what is left of the controller's total.
  auto run = open_streams(run_token, 100);
  const auto [run_open, run_exhausted] = count(run, "the controller serves at most");
  std::printf("run token: %d of 100 streams open, %d RESOURCE_EXHAUSTED\n", run_open,
              run_exhausted);
  EXPECT_EQ(run_open, kMaxStreams - kPerToken);
  EXPECT_EQ(run_exhausted, 100 - (kMaxStreams - kPerToken));

  // Unary calls are still served meanwhile.
  v1::ListRunsResponse list;
  EXPECT_TRUE(c->runs().ListRuns(BearerContext(kAdminToken).get(), {}, &list).ok());
  const double rss_peak = RssMiB(pid);

  // Closing streams frees their slots.
  for (auto* group : {&admin, &run}) {
    for (auto& s : *group) {
      if (!s->open) continue;
      s->ctx->TryCancel();
      s->reader->Finish();
    }
  }
  // (The controller notices a cancelled stream within its 200 ms wake-up: poll a while.)
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int reopened = 0;
  while (reopened < kPerToken && std::chrono::steady_clock::now() < give_up) {
    auto again = open_streams(kAdminToken, kPerToken - reopened);
    for (auto& s : again) {
      if (!s->open) continue;
      ++reopened;
      s->ctx->TryCancel();
      s->reader->Finish();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(reopened, kPerToken);
  admin.clear();
  run.clear();
  ASSERT_TRUE(c->running());
  EXPECT_TRUE(c->runs().ListRuns(BearerContext(kAdminToken).get(), {}, &list).ok());
  const double rss_after = RssMiB(pid);
  std::printf("controller VmRSS: %.1f MiB before, %.1f MiB with %d streams open, %.1f MiB after\n",
              rss_before, rss_peak, kMaxStreams, rss_after);
  if (kCheckRss) {
    EXPECT_LT(rss_peak, kMaxRssMiB);
    EXPECT_LT(rss_peak - rss_before, kMaxRssGrowthMiB);
  }
  stub.reset();
  channel.reset();
  EXPECT_EQ(c->Stop(), 0);
}

TEST(LimitsTest, StoredStateIsBounded) {
  TempDir tmp("fp8rt-security");
  auto c = StartController(tmp, {"--max-runs", "3"});
  ASSERT_NE(c, nullptr);
  const pid_t pid = c->process()->pid();
  for (const char* run : {"r1", "r2", "r3"}) {
    ASSERT_TRUE(RegisterRank0(*c, kAdminToken, run, tmp / "runs" / run).ok()) << run;
  }
  // A fourth run is refused; re-registering a known one is not.
  grpc::Status s = RegisterRank0(*c, kAdminToken, "r4", tmp / "runs/r4");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("runs: the controller keeps at most 3 runs"));
  v1::StopRunRequest stop;
  stop.set_run_id("r3");
  v1::Run run;
  ASSERT_TRUE(c->runs().StopRun(BearerContext(kAdminToken).get(), stop, &run).ok());
  EXPECT_TRUE(RegisterRank0(*c, kAdminToken, "r3", tmp / "runs/r3").ok());

  // Recipe versions and events are rings: 1100 updates keep the newest 1000 of each.
  const double rss_before = RssMiB(pid);
  v1::GetRecipeRequest get;
  get.set_run_id("r1");
  v1::RecipeVersion current;
  ASSERT_TRUE(c->runs().GetRecipe(BearerContext(kAdminToken).get(), get, &current).ok());
  constexpr int kUpdates = 1100;
  for (int i = 0; i < kUpdates; ++i) {
    v1::UpdateRecipeRequest req;
    req.set_run_id("r1");
    *req.mutable_recipe() = current.recipe();
    req.mutable_recipe()->set_margin(i % 2);
    req.set_reason("note " + std::to_string(i));
    v1::RecipeVersion resp;
    ASSERT_TRUE(c->runs().UpdateRecipe(BearerContext(kAdminToken).get(), req, &resp).ok()) << i;
  }
  ASSERT_TRUE(c->runs().GetRecipe(BearerContext(kAdminToken).get(), get, &current).ok());
  EXPECT_EQ(current.version(), 1 + kUpdates);
  int events = 0;
  {
    auto ctx = BearerContext(kAdminToken);
    v1::WatchEventsRequest req;
    req.set_run_id("r1");
    auto reader = c->runs().WatchEvents(ctx.get(), req);
    v1::Event e;
    // The stored events come at once; stop reading once none arrives for a while.
    std::thread stopper([&] {
      std::this_thread::sleep_for(std::chrono::seconds(3));
      ctx->TryCancel();
    });
    while (reader->Read(&e)) ++events;
    reader->Finish();
    stopper.join();
  }
  EXPECT_EQ(events, kMaxEventsPerRun);
  // Restart: the stored record holds the same bounded lists.
  ASSERT_TRUE(c->Restart());
  ASSERT_TRUE(c->runs().GetRecipe(BearerContext(kAdminToken).get(), get, &current).ok());
  EXPECT_EQ(current.version(), 1 + kUpdates);
  const uintmax_t record_bytes = fs::file_size(tmp / "state/runs/r1.run");
  std::printf(
      "r1's state file after %d updates: %ju bytes; controller VmRSS %.1f MiB before the "
      "updates, %.1f MiB after the restart\n",
      kUpdates, record_bytes, rss_before, RssMiB(c->process()->pid()));
  // 1000 versions and 1000 events of a few hundred bytes each: bounded, whatever the updates.
  EXPECT_LT(record_bytes, (kMaxRecipeVersions + kMaxEventsPerRun) * 1024u);
  EXPECT_EQ(c->Stop(), 0);
}

}  // namespace
}  // namespace fp8rt
