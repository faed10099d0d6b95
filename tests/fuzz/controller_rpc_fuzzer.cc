// Fuzz target: the controller's request validation and state machine (runtime/controller/
// controller.h, class Controller), in process, without gRPC.
//
// Each input starts from a fresh controller on a fresh state folder, with the run "fuzz" (world
// size 2, a valid spec) already registered by both ranks, so that a request naming it reaches the
// checks behind "run not found". The input is then a list of requests, each
//   selector  1 byte: which method (kMethods below, modulo their count)
//   length    2 bytes, little-endian: bytes of the request (clipped to what is left)
//   request   the serialized request message of that method
// A request that does not parse is skipped. A single request is just selector + length + message;
// several let the fuzzer reach sequences (begin a checkpoint, acknowledge shards, commit,
// restart the controller from its state folder and register with --resume, ...).
//
// Every call must return OK or an error with a message, never crash, trip a sanitizer, hang or
// grow memory without bound. Every run token CreateRunToken hands out must name its run, before
// and after a restart (fewer than max_run_tokens_per_run per input: none is revoked), and an
// arbitrary string (the request bytes) must not be taken for a token.
//
// The harness keeps the fuzzer inside its sandbox (a temp folder): an absolute run_dir in a
// Register request is replaced by the sandbox's run folder (relative and empty ones are kept:
// they are refused). After a BeginCheckpoint succeeds, the harness writes a small valid shard for
// ranks 0..3 into the temp folder, the way workers would, and an AckShard with size and xxh64
// both 0 is given that shard's real size and checksum, so that commits, retention and resume run.
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "fp8rt/v1/control.pb.h"
#include "runtime/checkpoint/checkpoint_dir.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/controller/controller.h"
#include "runtime/controller/metrics.h"
#include "runtime/spec/run_spec.h"
#include "tests/fuzz/fuzz_support.h"

namespace fp8rt::fuzz {
namespace {

namespace fs = std::filesystem;
using controller::Controller;
using controller::ControllerMetrics;
using controller::ControllerOptions;

constexpr int kMaxRequests = 16;
constexpr int kShardRanks = 4;  // ranks the harness writes a shard for in a begun checkpoint
constexpr char kRunId[] = "fuzz";

struct Sandbox {
  std::string root;       // the temp folder, removed at exit
  std::string state_dir;  // root/state: the controller's --state-dir
  std::string run_dir;    // root/run: the run folder of every run registered
  std::string shard_src;  // root/shard: the shard copied into begun checkpoints
  ShardWriteResult shard;
};

Sandbox& TheSandbox() {
  static Sandbox* const sandbox = [] {
    auto* s = new Sandbox;
    // tmpfs when there is one: the controller fsyncs every state and shard file it writes.
    std::error_code ec;
    std::string base = "/dev/shm";
    if (const char* tmp = std::getenv("TMPDIR"); tmp != nullptr && *tmp != '\0') {
      base = tmp;
    } else if (!fs::is_directory(base, ec)) {
      base = "/tmp";
    }
    std::string name = base + "/fp8rt-fuzz-controller-XXXXXX";
    FUZZ_CHECK(::mkdtemp(name.data()) != nullptr, "mkdtemp %s", name.c_str());
    s->root = name;
    s->state_dir = s->root + "/state";
    s->run_dir = s->root + "/run";
    s->shard_src = s->root + "/shard";
    ShardWriter writer;
    const std::byte payload[] = {std::byte{1}, std::byte{2}, std::byte{3}};
    FUZZ_CHECK(writer.Add("master/blocks.0.mlp.fc1", payload).ok(), "Add");
    absl::StatusOr<ShardWriteResult> written = writer.Write(s->shard_src);
    FUZZ_CHECK(written.ok(), "%s", written.status().ToString().c_str());
    s->shard = *written;
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(TheSandbox().root, ec);
    });
    return s;
  }();
  return *sandbox;
}

v1::RunSpec ValidSpec() {
  v1::RunSpec spec = SmallRunSpec();
  spec.mutable_health()->set_saturation_threshold(0.01);
  spec.mutable_health()->set_intervals(1);
  spec.mutable_health()->set_demote(true);
  return spec;
}

void CheckStatus(const absl::Status& s, const char* method) {
  FUZZ_CHECK(s.ok() || !s.message().empty(), "%s: error without a message: %s", method,
             s.ToString().c_str());
}

// One controller with its metrics; Restart reopens it from the state folder, as a restarted
// fp8rt-controller would.
class Harness {
 public:
  explicit Harness(Sandbox& sandbox) : sandbox_(sandbox) {
    std::error_code ec;
    fs::remove_all(sandbox_.state_dir, ec);
    fs::remove_all(sandbox_.run_dir, ec);
    fs::create_directories(sandbox_.run_dir, ec);
    FUZZ_CHECK(!ec, "create %s", sandbox_.run_dir.c_str());
    Open();
    for (int rank = 0; rank < 2; ++rank) {
      v1::RegisterRequest r;
      r.set_run_id(kRunId);
      r.set_rank(rank);
      r.set_world_size(2);
      if (rank == 0) *r.mutable_spec() = ValidSpec();
      r.set_run_dir(sandbox_.run_dir);
      r.set_hostname("fuzz");
      const absl::StatusOr<v1::RegisterResponse> response = controller_->Register(r);
      FUZZ_CHECK(response.ok(), "setup Register rank %d: %s", rank,
                 response.status().ToString().c_str());
    }
  }

  void Restart() {
    controller_.reset();  // Shutdown writes every run record
    metrics_.reset();
    Open();
    CheckTokens();
  }

  // Every token handed out in this input still names its run.
  void CheckTokens() const {
    for (const auto& [token, run_id] : tokens_) {
      const std::optional<std::string> run = controller_->RunOfToken(token);
      FUZZ_CHECK(run.has_value() && *run == run_id, "run token of '%s' names '%s'", run_id.c_str(),
                 run.has_value() ? run->c_str() : "(no run)");
    }
  }

  // Calls method `selector` with the request in `bytes`.
  void Call(uint8_t selector, const std::string& bytes);

 private:
  void Open() {
    metrics_ = std::make_unique<ControllerMetrics>();
    ControllerOptions options;
    options.state_dir = sandbox_.state_dir;
    // The monitor thread is never started: no rank is ever lost by the clock.
    options.heartbeat_timeout = std::chrono::hours(1);
    options.max_events_per_run = 64;
    absl::StatusOr<std::unique_ptr<Controller>> c = Controller::Open(options, metrics_.get());
    FUZZ_CHECK(c.ok(), "Controller::Open: %s", c.status().ToString().c_str());
    controller_ = *std::move(c);
  }

  // Writes the harness's shard for ranks 0..kShardRanks-1 into a begun checkpoint's folder.
  void WriteShards(const std::string& temp_dir) {
    for (int rank = 0; rank < kShardRanks; ++rank) {
      std::error_code ec;
      fs::copy_file(sandbox_.shard_src, fs::path(temp_dir) / ShardFileName(rank),
                    fs::copy_options::overwrite_existing, ec);
      FUZZ_CHECK(!ec, "copy shard into %s: %s", temp_dir.c_str(), ec.message().c_str());
    }
  }

  Sandbox& sandbox_;
  std::unique_ptr<ControllerMetrics> metrics_;  // outlives controller_ (declared first)
  std::unique_ptr<Controller> controller_;
  std::vector<std::pair<std::string, std::string>> tokens_;  // (token, run id) handed out
};

template <typename Request>
bool Parse(const std::string& bytes, Request* request) {
  return request->ParseFromString(bytes);
}

void Harness::Call(uint8_t selector, const std::string& bytes) {
  Controller& c = *controller_;
  switch (selector % 16) {
    case 0: {
      v1::RegisterRequest r;
      if (!Parse(bytes, &r)) return;
      if (!r.run_dir().empty() && r.run_dir()[0] == '/') r.set_run_dir(sandbox_.run_dir);
      CheckStatus(c.Register(r).status(), "Register");
      return;
    }
    case 1: {
      v1::HeartbeatRequest r;
      if (!Parse(bytes, &r)) return;
      CheckStatus(c.Heartbeat(r).status(), "Heartbeat");
      return;
    }
    case 2: {
      v1::ReportStepRequest r;
      if (!Parse(bytes, &r)) return;
      CheckStatus(c.ReportStep(r), "ReportStep");
      return;
    }
    case 3: {
      v1::BeginCheckpointRequest r;
      if (!Parse(bytes, &r)) return;
      const absl::StatusOr<v1::BeginCheckpointResponse> response = c.BeginCheckpoint(r);
      CheckStatus(response.status(), "BeginCheckpoint");
      if (response.ok()) WriteShards(response->temp_dir());
      return;
    }
    case 4: {
      v1::AckShardRequest r;
      if (!Parse(bytes, &r)) return;
      if (r.size() == 0 && r.xxh64() == 0) {
        r.set_size(sandbox_.shard.size);
        r.set_xxh64(sandbox_.shard.xxh64);
      }
      CheckStatus(c.AckShard(r).status(), "AckShard");
      return;
    }
    case 5: {
      v1::GetRunRequest r;
      if (!Parse(bytes, &r)) return;
      CheckStatus(c.GetRun(r).status(), "GetRun");
      return;
    }
    case 6: {
      v1::StopRunRequest r;
      if (!Parse(bytes, &r)) return;
      CheckStatus(c.StopRun(r).status(), "StopRun");
      return;
    }
    case 7: {
      v1::GetLayersRequest r;
      if (!Parse(bytes, &r)) return;
      CheckStatus(c.GetLayers(r).status(), "GetLayers");
      return;
    }
    case 8: {
      v1::GetRecipeRequest r;
      if (!Parse(bytes, &r)) return;
      CheckStatus(c.GetRecipe(r).status(), "GetRecipe");
      return;
    }
    case 9: {
      v1::UpdateRecipeRequest r;
      if (!Parse(bytes, &r)) return;
      CheckStatus(c.UpdateRecipe(r).status(), "UpdateRecipe");
      return;
    }
    case 10: {
      v1::ListCheckpointsRequest r;
      if (!Parse(bytes, &r)) return;
      CheckStatus(c.ListCheckpoints(r).status(), "ListCheckpoints");
      return;
    }
    case 11: {
      v1::SaveCheckpointRequest r;
      if (!Parse(bytes, &r)) return;
      CheckStatus(c.SaveCheckpoint(r), "SaveCheckpoint");
      return;
    }
    case 12: {
      v1::WatchEventsRequest r;
      if (!Parse(bytes, &r)) return;
      // Existing events only: cancelled at once, so the call returns after sending them.
      int sent = 0;
      CheckStatus(c.WatchEvents(
                      r, [] { return true; },
                      [&](const v1::Event&) {
                        ++sent;
                        return true;
                      }),
                  "WatchEvents");
      return;
    }
    case 13:
      (void)c.ListRuns();
      return;
    case 14:
      Restart();
      return;
    case 15: {
      // The bytes themselves are no token: tokens are 64 random hex digits, only hashes kept.
      FUZZ_CHECK(!c.RunOfToken(bytes).has_value(), "a %zu-byte request was taken for a token",
                 bytes.size());
      v1::CreateRunTokenRequest r;
      if (!Parse(bytes, &r)) return;
      const absl::StatusOr<std::string> token = c.CreateRunToken(r.run_id());
      CheckStatus(token.status(), "CreateRunToken");
      if (!token.ok()) return;
      tokens_.emplace_back(*token, r.run_id());
      CheckTokens();
      return;
    }
  }
}

}  // namespace
}  // namespace fp8rt::fuzz

FP8RT_FUZZ_QUIET_PROTOBUF_INIT()

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fp8rt::fuzz;
  Harness harness(TheSandbox());
  size_t pos = 0;
  for (int i = 0; i < kMaxRequests && pos < size; ++i) {
    const uint8_t selector = data[pos++];
    size_t length = 0;
    if (pos < size) length |= data[pos++];
    if (pos < size) length |= static_cast<size_t>(data[pos++]) << 8;
    length = std::min(length, size - pos);
    harness.Call(selector, std::string(reinterpret_cast<const char*>(data + pos), length));
    pos += length;
  }
  return 0;
}
