// fp8rt-bench-controller (run as `fp8rt bench controller`): load on one fp8rt-controller from a
// simulated fleet of workers, with the latency of every RPC and the controller's memory.
//
//   fp8rt bench controller [--workers 1024] [--world-size 64] [--hz 1] [--duration 30]
//                          [--layers 32] [--channels N] [--json]
//                          [--controller HOST:PORT --token-file F [--controller-pid PID]]
//
// Without --controller it starts fp8rt-controller (found next to this program) on loopback with
// a fresh state folder, and stops it at the end (SIGTERM: it must exit 0).
//
// Traffic model: what runtime/worker/trainer.cc sends, one training step per 1/hz seconds.
//   - `workers` ranks in runs of `world-size` ranks (the last run takes the remainder); every rank
//     registers once (rank 0 first, with the run spec), before the timed part;
//   - every rank: one Heartbeat per period (the worker's heartbeat thread; the controller asks
//     for heartbeat_interval_ms = 1000 with its default 30 s timeout);
//   - rank 0 of each run, per step: one more Heartbeat (Trainer::ShareDirectives at the start of
//     the step) and one ReportStep with the step metrics, 3 communication counters, 8 memory
//     peaks and the FP8 statistics of every site (metrics.every = 1, the most the spec allows):
//     the sites are reduced over all ranks by the workers, so only rank 0 reports them, and their
//     number is that of the model, not of the world: (4 linears x layers + lm_head) x 3 tensors,
//     387 for the default 32-layer model.
//   Start times are spread evenly across the period (rank g of all `workers` at g/workers of it;
//   rank 0's step heartbeat and report a quarter and a half period after its own heartbeat).
//   Every simulated worker has its own channel (TCP connection) unless --channels says fewer, as
//   real workers are separate processes. The calls are made with gRPC's callback API from two
//   sender threads.
//
// Measured: every RPC's latency at the client (send to response), every non-OK status (any one
// fails the run: exit status 1), the controller's VmRSS each second (peak) and VmHWM at the end,
// its CPU time. Baseline in the same run: the latency of 200 sequential heartbeats before the
// load (an idle controller); `ratio` = loaded p99 / idle p99.
//
// Exit status: 0 when every expected RPC was answered OK, 1 otherwise (the report is still
// printed), 2 for bad flags or when the controller cannot be started or registered with.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "fp8rt/v1/control.grpc.pb.h"
#include "fp8rt/v1/control.pb.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "runtime/core/program.h"
#include "runtime/spec/run_spec.h"
#include "runtime/core/status.h"

namespace fp8rt::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr double kTargetP99Ms = 50.0;
constexpr double kTargetRssMib = 1024.0;
constexpr int kIdleSamples = 200;

struct Options {
  int workers = 1024;          // simulated ranks, all runs together
  int world_size = 64;         // ranks per run
  double hz = 1.0;             // steps (and heartbeats) per second
  double duration_s = 30.0;    // timed part
  int layers = 32;             // transformer blocks of the simulated model (sites per report)
  int channels = 0;            // client channels (connections); 0 = one per worker
  int sender_threads = 2;      // threads issuing the calls
  int deadline_ms = 10000;     // deadline of every call (the worker's default)
  std::string controller;      // HOST:PORT of a running controller; "" = start one
  std::string token_file;      // its token file
  int controller_pid = 0;      // its pid, for RSS and CPU (0: not measured)
  std::string controller_bin;  // fp8rt-controller to start ("" = next to this program)
  bool json = false;
};

// ---------------------------------------------------------------------------------------------
// The controller process.

std::string ReadText(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// VmRSS or VmHWM of `pid` in MiB, -1 when unreadable.
double ProcStatusMib(int pid, const std::string& field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) {
      return std::strtod(line.c_str() + field.size() + 1, nullptr) / 1024.0;  // kB
    }
  }
  return -1;
}

// utime + stime of `pid` in seconds, -1 when unreadable.
double ProcCpuSeconds(int pid) {
  const std::string stat = ReadText(absl::StrCat("/proc/", pid, "/stat"));
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream in(stat.substr(close + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; in >> field; ++i) {  // fields are 1-based; field 3 is the state
    if (i == 14) utime = std::stoull(field);
    if (i == 15) {
      stime = std::stoull(field);
      break;
    }
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

int CpuCount() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::thread::hardware_concurrency());
}

// fp8rt-controller started by this tool: a temp folder with token, state and log; SIGTERM at the
// end.
class OwnController {
 public:
  static absl::StatusOr<std::unique_ptr<OwnController>> Start(const std::string& binary) {
    auto c = std::unique_ptr<OwnController>(new OwnController());
    std::string pattern = (fs::temp_directory_path() / "fp8rt-bench-controller-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) return absl::InternalError("mkdtemp failed");
    c->dir_ = pattern;
    std::random_device rd;
    c->token_ = absl::StrFormat("%08x%08x%08x%08x", rd(), rd(), rd(), rd());
    const fs::path token_file = c->dir_ / "token";
    {
      std::ofstream out(token_file);
      out << c->token_ << "\n";
    }
    fs::permissions(token_file, fs::perms::owner_read | fs::perms::owner_write);
    const fs::path ready = c->dir_ / "ready.json";
    c->log_ = c->dir_ / "controller.log";
    const std::vector<std::string> argv = {binary,
                                           "--token-file",
                                           token_file.string(),
                                           "--state-dir",
                                           (c->dir_ / "state").string(),
                                           "--listen",
                                           "127.0.0.1:0",
                                           "--metrics-listen",
                                           "127.0.0.1:0",
                                           "--ready-file",
                                           ready.string()};
    std::fflush(nullptr);
    c->pid_ = fork();
    if (c->pid_ == 0) {
      const int fd = ::open(c->log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        ::close(fd);
      }
      std::vector<char*> args;
      for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
    if (c->pid_ < 0) return absl::InternalError("fork failed");
    const auto end = Clock::now() + std::chrono::seconds(30);
    while (!fs::exists(ready)) {
      int status = 0;
      if (waitpid(c->pid_, &status, WNOHANG) == c->pid_) {
        c->pid_ = 0;
        return absl::InternalError(absl::StrCat(binary, " exited early: ", ReadText(c->log_)));
      }
      if (Clock::now() > end) {
        return absl::DeadlineExceededError(
            absl::StrCat(binary, " was not ready within 30 s: ", ReadText(c->log_)));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const nlohmann::json j = nlohmann::json::parse(ReadText(ready), nullptr, false);
    if (j.is_discarded() || !j.contains("grpc")) {
      return absl::InternalError(absl::StrCat("unexpected ready file ", ready.string()));
    }
    c->address_ = j["grpc"].get<std::string>();
    return c;
  }

  ~OwnController() {
    (void)Stop();
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }

  // SIGTERM and wait (10 s, then SIGKILL); the exit status (128 + signal when killed).
  int Stop() {
    if (pid_ <= 0) return status_;
    kill(pid_, SIGTERM);
    const auto end = Clock::now() + std::chrono::seconds(10);
    int status = 0;
    while (waitpid(pid_, &status, WNOHANG) != pid_) {
      if (Clock::now() > end) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid_ = 0;
    status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return status_;
  }

  int pid() const { return pid_; }
  const std::string& address() const { return address_; }
  const std::string& token() const { return token_; }
  std::string log() const { return ReadText(log_); }

 private:
  OwnController() = default;
  fs::path dir_, log_;
  std::string token_, address_;
  int pid_ = 0;
  int status_ = -1;
};

// ---------------------------------------------------------------------------------------------
// What the simulated workers send.

// A run spec a 64-rank fleet would train: a 32-layer dense model over dp = world size.
v1::RunSpec FleetSpec(int layers, int world_size, int64_t steps) {
  v1::RunSpec spec = RunSpecDefaults();
  auto* m = spec.mutable_model();
  m->set_layers(layers);
  m->set_d_model(4096);
  m->set_heads(32);
  m->set_d_ff(16384);
  m->set_seq_len(2048);
  m->set_vocab(32768);
  spec.mutable_parallel()->set_dp(world_size);
  spec.mutable_parallel()->set_tp(1);
  spec.mutable_train()->set_steps(steps);
  spec.mutable_data()->set_path("/data/on/the/workers/train.bin");
  spec.mutable_metrics()->set_every(1);
  // The health policy on, as an operator would run it (the simulated sites stay below it).
  spec.mutable_health()->set_saturation_threshold(0.001);
  spec.mutable_health()->set_underflow_threshold(0.05);
  return spec;
}

// The site names of runtime/model/transformer.cc's LayerNames for a dense model.
std::vector<std::string> LayerNames(int layers) {
  std::vector<std::string> names;
  for (int l = 0; l < layers; ++l) {
    for (const char* s : {"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"}) {
      names.push_back(absl::StrCat("blocks.", l, ".", s));
    }
  }
  names.push_back("lm_head");
  return names;
}

// Rank 0's report of `step`: plausible statistics that change every step, below the health
// thresholds of FleetSpec.
v1::ReportStepRequest StepReport(const std::string& run_id, const std::vector<std::string>& layers,
                                 int64_t step) {
  v1::ReportStepRequest r;
  r.set_run_id(run_id);
  v1::StepMetrics* m = r.mutable_metrics();
  m->set_step(step);
  m->set_loss(2.0 + 8.0 / std::sqrt(static_cast<double>(step)));
  m->set_grad_norm(1.0 + 0.01 * static_cast<double>(step % 7));
  m->set_lr(3e-4);
  m->set_tokens_per_s(2.6e6);
  m->set_step_time_s(1.0);
  m->set_recipe_version(1);
  constexpr v1::TensorRole kRoles[] = {v1::TENSOR_ROLE_INPUT, v1::TENSOR_ROLE_WEIGHT,
                                       v1::TENSOR_ROLE_GRAD_OUTPUT};
  for (size_t i = 0; i < layers.size(); ++i) {
    for (v1::TensorRole role : kRoles) {
      v1::SiteStats* s = r.add_sites();
      s->set_layer(layers[i]);
      s->set_tensor(role);
      const float amax = 0.5f + 0.001f * static_cast<float>((step * 31 + i * 7 + role) % 1000);
      s->set_amax(amax);
      s->set_scale((role == v1::TENSOR_ROLE_GRAD_OUTPUT ? 57344.0f : 448.0f) / amax);
      s->set_underflow_ratio(1e-4 * static_cast<double>((step + i) % 10));
      s->set_saturation_ratio(0.0);
      s->set_expert(-1);
    }
  }
  const struct {
    const char* op;
    const char* dtype;
    int64_t per_step;
  } comm[] = {{"all_gather", "fp8", 7LL << 30},
              {"reduce_scatter", "f32", 28LL << 30},
              {"all_reduce", "f32", 1 << 20}};
  for (const auto& c : comm) {
    v1::CommBytes* b = r.add_comm();
    b->set_op(c.op);
    b->set_dtype(c.dtype);
    b->set_bytes(c.per_step * step);
  }
  // The memory peak of every category (kernels/memory_stats.h's names; this program links no
  // kernels), as Trainer::MemoryPeaksOverRanks reports them each step.
  for (const char* category :
       {"other", "param_shards", "gradients", "optimizer_state", "gathered_weights",
        "saved_activations", "comm_buffers", "scratch"}) {
    v1::MemoryPeak* p = r.add_memory();
    p->set_category(category);
    p->set_peak_bytes(3LL << 30);
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// Measurement.

enum class Rpc { kHeartbeat, kReportStep };

// Latencies (ms) and failures, recorded from gRPC's callback threads.
class Recorder {
 public:
  void Ok(Rpc rpc, double ms) {
    std::lock_guard<std::mutex> lock(mu_);
    (rpc == Rpc::kHeartbeat ? heartbeat_ : report_).push_back(static_cast<float>(ms));
    window_.push_back(static_cast<float>(ms));
  }
  void Fail(Rpc rpc, double ms, const grpc::Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    ++errors_;
    (rpc == Rpc::kHeartbeat ? heartbeat_ : report_).push_back(static_cast<float>(ms));
    const std::string text = absl::StrCat(rpc == Rpc::kHeartbeat ? "Heartbeat" : "ReportStep",
                                          ": code ", s.error_code(), ": ", s.error_message());
    if (error_samples_.size() < 5) error_samples_.push_back(text);
  }
  // Latencies since the last call (for progress lines).
  std::vector<float> TakeWindow() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<float> w;
    w.swap(window_);
    return w;
  }
  int64_t completed() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(heartbeat_.size() + report_.size());
  }
  int64_t errors() {
    std::lock_guard<std::mutex> lock(mu_);
    return errors_;
  }
  // Copies, once the calls have ended.
  std::vector<float> heartbeat() {
    std::lock_guard<std::mutex> lock(mu_);
    return heartbeat_;
  }
  std::vector<float> report() {
    std::lock_guard<std::mutex> lock(mu_);
    return report_;
  }
  std::vector<std::string> error_samples() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_samples_;
  }

 private:
  std::mutex mu_;
  std::vector<float> heartbeat_, report_, window_;  // Guarded by mu_
  int64_t errors_ = 0;                              // Guarded by mu_
  std::vector<std::string> error_samples_;          // Guarded by mu_
};

// The q-quantile (nearest rank) of `v` (sorted in place); NaN for an empty one.
double Quantile(std::vector<float>& v, double q) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

nlohmann::ordered_json Summary(std::vector<float> v) {
  nlohmann::ordered_json j;
  j["count"] = v.size();
  j["p50_ms"] = Quantile(v, 0.50);
  j["p90_ms"] = Quantile(v, 0.90);
  j["p99_ms"] = Quantile(v, 0.99);
  j["max_ms"] = v.empty() ? std::nan("") : static_cast<double>(v.back());
  return j;
}

// ---------------------------------------------------------------------------------------------
// The simulation.

struct SimRun {
  std::string id;
  int world_size = 0;
  int first_worker = 0;  // global index of its rank 0
};

// One periodic call of one simulated worker.
struct Stream {
  enum Kind { kHeartbeat, kStepHeartbeat, kReport } kind;
  int run = 0;
  int rank = 0;
  int channel = 0;
  double phase_s = 0;  // offset in the period
};

class Fleet {
 public:
  Fleet(const Options& o, const std::string& address, std::string token)
      : o_(o), token_(std::move(token)), layers_(LayerNames(o.layers)) {
    const int channels = o.channels > 0 ? o.channels : o.workers;
    for (int i = 0; i < channels; ++i) {
      grpc::ChannelArguments args;
      // Separate connections (gRPC would otherwise share one between equal channels).
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      args.SetMaxReceiveMessageSize(16 << 20);
      stubs_.push_back(v1::Control::NewStub(
          grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args)));
    }
    runs_stub_ =
        v1::Runs::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    const int64_t steps = static_cast<int64_t>(std::ceil(o.duration_s * o.hz)) + 1000000;
    for (int first = 0, r = 0; first < o.workers; first += o.world_size, ++r) {
      SimRun run;
      run.id = absl::StrCat("bench-", getpid(), "-", r);
      run.world_size = std::min(o.world_size, o.workers - first);
      run.first_worker = first;
      runs_.push_back(run);
      specs_.push_back(FleetSpec(o.layers, run.world_size, steps));
    }
    const double period = 1.0 / o.hz;
    for (const SimRun& run : runs_) {
      for (int rank = 0; rank < run.world_size; ++rank) {
        const int g = run.first_worker + rank;
        const double phase = period * g / o.workers;
        const int channel = g % channels;
        streams_.push_back({Stream::kHeartbeat, RunIndex(run), rank, channel, phase});
        if (rank == 0) {
          streams_.push_back({Stream::kStepHeartbeat, RunIndex(run), 0, channel,
                              std::fmod(phase + 0.25 * period, period)});
          streams_.push_back({Stream::kReport, RunIndex(run), 0, channel,
                              std::fmod(phase + 0.5 * period, period)});
        }
      }
    }
    std::sort(streams_.begin(), streams_.end(),
              [](const Stream& a, const Stream& b) { return a.phase_s < b.phase_s; });
  }

  int runs() const { return static_cast<int>(runs_.size()); }
  int channels() const { return static_cast<int>(stubs_.size()); }
  int streams() const { return static_cast<int>(streams_.size()); }
  int sites_per_report() const { return static_cast<int>(layers_.size()) * 3; }
  size_t report_bytes() const { return StepReport(runs_[0].id, layers_, 1).ByteSizeLong(); }
  int64_t ticks() const { return static_cast<int64_t>(std::llround(o_.duration_s * o_.hz)); }
  int64_t expected() const { return ticks() * streams(); }
  std::string heartbeat_description() const {
    return absl::StrCat(o_.workers, " ranks x 1 Heartbeat + ", runs(),
                        " rank-0s x (1 more Heartbeat + 1 ReportStep) per period");
  }

  std::unique_ptr<grpc::ClientContext> Context(std::chrono::milliseconds deadline) const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + deadline);
    ctx->AddMetadata("authorization", "Bearer " + token_);
    return ctx;
  }

  // Registers every rank (rank 0 of each run first), `parallel` calls in flight.
  absl::Status RegisterAll() {
    const std::string run_root =
        (fs::temp_directory_path() / "fp8rt-bench-controller-runs").string();
    for (size_t r = 0; r < runs_.size(); ++r) {
      FP8RT_RETURN_IF_ERROR(Register(r, 0, run_root));
    }
    std::vector<std::thread> threads;
    std::mutex mu;
    absl::Status first_error;
    std::atomic<size_t> next{0};
    std::vector<std::pair<size_t, int>> todo;
    for (size_t r = 0; r < runs_.size(); ++r) {
      for (int rank = 1; rank < runs_[r].world_size; ++rank) todo.emplace_back(r, rank);
    }
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&] {
        for (size_t i; (i = next.fetch_add(1)) < todo.size();) {
          const absl::Status s = Register(todo[i].first, todo[i].second, run_root);
          if (!s.ok()) {
            std::lock_guard<std::mutex> lock(mu);
            if (first_error.ok()) first_error = s;
          }
        }
      });
    }
    for (std::thread& t : threads) t.join();
    return first_error;
  }

  // Sequential heartbeats of one rank against the idle controller: the baseline latencies.
  absl::StatusOr<std::vector<float>> IdleLatencies(int count) {
    std::vector<float> out;
    for (int i = 0; i < count; ++i) {
      v1::HeartbeatRequest req;
      req.set_run_id(runs_[0].id);
      req.set_rank(0);
      v1::HeartbeatResponse resp;
      auto ctx = Context(std::chrono::milliseconds(o_.deadline_ms));
      const auto t0 = Clock::now();
      const grpc::Status s = stubs_[0]->Heartbeat(ctx.get(), req, &resp);
      out.push_back(std::chrono::duration<float, std::milli>(Clock::now() - t0).count());
      if (!s.ok())
        return absl::UnavailableError(absl::StrCat("idle Heartbeat: ", s.error_message()));
    }
    return out;
  }

  // Drives every stream for ticks() periods from `start`; returns once every call has ended.
  // `late_ms` receives the largest delay of a send behind its schedule.
  void Drive(Clock::time_point start, Recorder* recorder, double* late_ms, int64_t* late_sends) {
    std::atomic<int64_t> in_flight{0};
    std::mutex late_mu;
    double worst = 0;
    int64_t late = 0;
    std::vector<std::thread> senders;
    const int threads = std::max(1, o_.sender_threads);
    const auto period =
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(1.0 / o_.hz));
    for (int t = 0; t < threads; ++t) {
      senders.emplace_back([&, t] {
        double my_worst = 0;
        int64_t my_late = 0;
        for (int64_t k = 0; k < ticks(); ++k) {
          for (size_t i = static_cast<size_t>(t); i < streams_.size();
               i += static_cast<size_t>(threads)) {
            const Stream& s = streams_[i];
            const Clock::time_point due = start + k * period +
                                          std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(s.phase_s));
            std::this_thread::sleep_until(due);
            const double behind =
                std::chrono::duration<double, std::milli>(Clock::now() - due).count();
            my_worst = std::max(my_worst, behind);
            if (behind > 10) ++my_late;
            in_flight.fetch_add(1);
            Send(s, k, recorder, &in_flight);
          }
        }
        std::lock_guard<std::mutex> lock(late_mu);
        worst = std::max(worst, my_worst);
        late += my_late;
      });
    }
    for (std::thread& t : senders) t.join();
    const auto end = Clock::now() + std::chrono::milliseconds(o_.deadline_ms + 5000);
    while (in_flight.load() > 0 && Clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    *late_ms = worst;
    *late_sends = late;
  }

  // Stops every run (so that an external controller does not report them lost later).
  void StopAll() {
    for (const SimRun& run : runs_) {
      v1::StopRunRequest req;
      req.set_run_id(run.id);
      v1::Run resp;
      auto ctx = Context(std::chrono::milliseconds(o_.deadline_ms));
      (void)runs_stub_->StopRun(ctx.get(), req, &resp);
    }
  }

 private:
  int RunIndex(const SimRun& run) const { return static_cast<int>(&run - runs_.data()); }

  absl::Status Register(size_t r, int rank, const std::string& run_root) {
    const SimRun& run = runs_[r];
    v1::RegisterRequest req;
    req.set_run_id(run.id);
    req.set_rank(rank);
    req.set_world_size(run.world_size);
    if (rank == 0) *req.mutable_spec() = specs_[r];
    req.set_run_dir(absl::StrCat(run_root, "/", run.id));
    req.set_hostname(absl::StrCat("node-", (run.first_worker + rank) / 8));
    req.set_pid(10000 + rank);
    v1::RegisterResponse resp;
    auto ctx = Context(std::chrono::milliseconds(o_.deadline_ms));
    // Registration also opens the connections, which is not what is measured: it waits through
    // a connection attempt that fails (the timed calls below do not, as the workers' calls).
    ctx->set_wait_for_ready(true);
    const int channel = (run.first_worker + rank) % static_cast<int>(stubs_.size());
    const grpc::Status s = stubs_[channel]->Register(ctx.get(), req, &resp);
    if (!s.ok()) {
      return absl::Status(
          static_cast<absl::StatusCode>(s.error_code()),
          absl::StrCat("Register run ", run.id, " rank ", rank, ": ", s.error_message()));
    }
    return absl::OkStatus();
  }

  // One call of stream `s` in period k (step k + 1), with the callback API.
  void Send(const Stream& s, int64_t k, Recorder* recorder, std::atomic<int64_t>* in_flight) {
    const SimRun& run = runs_[s.run];
    v1::Control::Stub* stub = stubs_[s.channel].get();
    struct Call {
      std::unique_ptr<grpc::ClientContext> ctx;
      v1::HeartbeatRequest hb_req;
      v1::HeartbeatResponse hb_resp;
      v1::ReportStepRequest report_req;
      v1::ReportStepResponse report_resp;
      Clock::time_point t0;
    };
    auto* call = new Call;
    call->ctx = Context(std::chrono::milliseconds(o_.deadline_ms));
    const Rpc rpc = s.kind == Stream::kReport ? Rpc::kReportStep : Rpc::kHeartbeat;
    auto done = [call, recorder, in_flight, rpc](grpc::Status status) {
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - call->t0).count();
      if (status.ok()) {
        recorder->Ok(rpc, ms);
      } else {
        recorder->Fail(rpc, ms, status);
      }
      delete call;
      in_flight->fetch_sub(1);
    };
    if (rpc == Rpc::kReportStep) {
      call->report_req = StepReport(run.id, layers_, k + 1);
      call->t0 = Clock::now();
      stub->async()->ReportStep(call->ctx.get(), &call->report_req, &call->report_resp,
                                std::move(done));
    } else {
      call->hb_req.set_run_id(run.id);
      call->hb_req.set_rank(s.rank);
      call->hb_req.set_step(s.kind == Stream::kStepHeartbeat ? k : std::max<int64_t>(0, k - 1));
      call->t0 = Clock::now();
      stub->async()->Heartbeat(call->ctx.get(), &call->hb_req, &call->hb_resp, std::move(done));
    }
  }

  const Options o_;
  const std::string token_;
  const std::vector<std::string> layers_;
  std::vector<std::unique_ptr<v1::Control::Stub>> stubs_;
  std::unique_ptr<v1::Runs::Stub> runs_stub_;
  std::vector<SimRun> runs_;
  std::vector<v1::RunSpec> specs_;
  std::vector<Stream> streams_;
};

std::string ProgramDir() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : self.parent_path().string();
}

absl::StatusOr<std::string> ReadToken(const std::string& path) {
  std::string text = ReadText(path);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.erase(0, 1);
  if (text.empty())
    return absl::InvalidArgumentError("--token-file " + path + ": missing or empty");
  return text;
}

// The whole benchmark; the report, with "ok" false when a call failed or went unanswered.
absl::StatusOr<nlohmann::ordered_json> RunBench(const Options& o) {
  std::unique_ptr<OwnController> own;
  std::string address, token;
  int pid = o.controller_pid;
  if (o.controller.empty()) {
    const std::string binary =
        o.controller_bin.empty() ? ProgramDir() + "/fp8rt-controller" : o.controller_bin;
    absl::StatusOr<std::unique_ptr<OwnController>> started = OwnController::Start(binary);
    if (!started.ok()) return started.status();
    own = *std::move(started);
    address = own->address();
    token = own->token();
    pid = own->pid();
  } else {
    address = o.controller;
    absl::StatusOr<std::string> t = ReadToken(o.token_file);
    if (!t.ok()) return t.status();
    token = *t;
  }

  Fleet fleet(o, address, token);
  std::fprintf(stderr,
               "fp8rt bench controller: %d workers in %d runs of %d, %d channels, %g Hz for %g s "
               "against %s (pid %d)\n",
               o.workers, fleet.runs(), o.world_size, fleet.channels(), o.hz, o.duration_s,
               address.c_str(), pid);
  const auto reg0 = Clock::now();
  absl::Status registered = fleet.RegisterAll();
  if (!registered.ok()) return registered;
  const double register_s = std::chrono::duration<double>(Clock::now() - reg0).count();
  absl::StatusOr<std::vector<float>> idle = fleet.IdleLatencies(kIdleSamples);
  if (!idle.ok()) return idle.status();

  const double rss_start = pid > 0 ? ProcStatusMib(pid, "VmRSS") : -1;
  const double cpu_start = pid > 0 ? ProcCpuSeconds(pid) : -1;
  Recorder recorder;
  std::atomic<bool> done{false};
  double rss_peak = rss_start;
  std::thread sampler([&] {
    const auto t0 = Clock::now();
    auto next_progress = t0 + std::chrono::seconds(5);
    int64_t last_completed = 0;
    while (!done.load()) {
      for (int i = 0; i < 20 && !done.load(); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      const double rss = pid > 0 ? ProcStatusMib(pid, "VmRSS") : -1;
      rss_peak = std::max(rss_peak, rss);
      if (Clock::now() >= next_progress && !done.load()) {
        next_progress += std::chrono::seconds(5);
        std::vector<float> window = recorder.TakeWindow();
        const int64_t completed = recorder.completed();
        std::fprintf(stderr,
                     "  %5.0f s: %lld RPCs answered (%lld in the last 5 s), %lld errors, window "
                     "p99 %.2f ms, controller RSS %.1f MiB\n",
                     std::chrono::duration<double>(Clock::now() - t0).count(),
                     static_cast<long long>(completed),
                     static_cast<long long>(completed - last_completed),
                     static_cast<long long>(recorder.errors()), Quantile(window, 0.99), rss);
        last_completed = completed;
      }
    }
  });
  double late_ms = 0;
  int64_t late_sends = 0;
  const auto start = Clock::now() + std::chrono::milliseconds(100);
  fleet.Drive(start, &recorder, &late_ms, &late_sends);
  const double wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  done.store(true);
  sampler.join();
  const double cpu_end = pid > 0 ? ProcCpuSeconds(pid) : -1;
  const double rss_end = pid > 0 ? ProcStatusMib(pid, "VmRSS") : -1;
  const double hwm = pid > 0 ? ProcStatusMib(pid, "VmHWM") : -1;
  rss_peak = std::max(rss_peak, rss_end);
  fleet.StopAll();

  std::vector<float> heartbeat = recorder.heartbeat(), report = recorder.report();
  std::vector<float> all = heartbeat;
  all.insert(all.end(), report.begin(), report.end());
  const int64_t errors = recorder.errors();
  const int64_t answered = static_cast<int64_t>(all.size());

  nlohmann::ordered_json j;
  j["benchmark"] = "controller";
  j["workers"] = o.workers;
  j["runs"] = fleet.runs();
  j["world_size"] = o.world_size;
  j["hz"] = o.hz;
  j["duration_s"] = o.duration_s;
  j["wall_s"] = wall_s;
  j["traffic"] = fleet.heartbeat_description();
  j["layers"] = o.layers;
  j["sites_per_report"] = fleet.sites_per_report();
  j["report_bytes"] = fleet.report_bytes();
  j["channels"] = fleet.channels();
  j["cpus"] = CpuCount();
  j["register_s"] = register_s;
  j["rpcs_expected"] = fleet.expected();
  j["rpcs"] = answered;
  j["errors"] = errors;
  j["error_samples"] = recorder.error_samples();
  j["rpcs_per_s"] = static_cast<double>(answered) / wall_s;
  std::vector<float> all_copy = all;
  j["p50_ms"] = Quantile(all_copy, 0.50);
  j["p90_ms"] = Quantile(all_copy, 0.90);
  j["p99_ms"] = Quantile(all_copy, 0.99);
  j["max_ms"] = all_copy.empty() ? std::nan("") : static_cast<double>(all_copy.back());
  j["heartbeat"] = Summary(heartbeat);
  j["report_step"] = Summary(report);
  j["idle"] = Summary(*idle);
  j["ratio"] = j["p99_ms"].get<double>() / j["idle"]["p99_ms"].get<double>();
  j["late_sends"] = late_sends;
  j["max_send_lag_ms"] = late_ms;
  if (pid > 0) {
    j["controller_pid"] = pid;
    j["rss_start_mib"] = rss_start;
    j["rss_peak_mib"] = rss_peak;
    j["rss_end_mib"] = rss_end;
    j["rss_hwm_mib"] = hwm;
    j["controller_cpu_s"] = cpu_end - cpu_start;
    j["controller_cpu_per_s"] = (cpu_end - cpu_start) / wall_s;
  } else {
    j["rss_peak_mib"] = nullptr;
  }
  j["targets"] = {{"p99_ms", kTargetP99Ms}, {"rss_mib", kTargetRssMib}};
  const bool answered_all = errors == 0 && answered == fleet.expected();
  j["ok"] = answered_all;
  j["meets_targets"] = answered_all && j["p99_ms"].get<double>() < kTargetP99Ms &&
                       (pid <= 0 || std::max(rss_peak, hwm) < kTargetRssMib);
  if (own) {
    const int status = own->Stop();
    j["controller_exit"] = status;
    if (status != 0) {
      j["ok"] = false;
      std::fprintf(stderr, "fp8rt bench controller: the controller exited with %d: %s\n", status,
                   own->log().c_str());
    }
  }
  return j;
}

void PrintHuman(const nlohmann::ordered_json& j) {
  std::cout << absl::StrFormat(
      "controller load: %d workers (%d runs of %d ranks) at %g Hz for %g s, %d CPUs\n"
      "  traffic    %s\n"
      "             ReportStep: %d sites (%d layers), %d bytes\n"
      "  RPCs       %d answered of %d expected, %d errors, %.0f/s\n"
      "  latency    p50 %.2f ms  p90 %.2f ms  p99 %.2f ms  max %.2f ms  (target p99 < %g ms)\n"
      "             Heartbeat p99 %.2f ms, ReportStep p99 %.2f ms; idle p99 %.2f ms "
      "(ratio %.2f)\n",
      j["workers"].get<int>(), j["runs"].get<int>(), j["world_size"].get<int>(),
      j["hz"].get<double>(), j["duration_s"].get<double>(), j["cpus"].get<int>(),
      j["traffic"].get<std::string>(), j["sites_per_report"].get<int>(), j["layers"].get<int>(),
      j["report_bytes"].get<int>(), j["rpcs"].get<int64_t>(), j["rpcs_expected"].get<int64_t>(),
      j["errors"].get<int64_t>(), j["rpcs_per_s"].get<double>(), j["p50_ms"].get<double>(),
      j["p90_ms"].get<double>(), j["p99_ms"].get<double>(), j["max_ms"].get<double>(),
      j["targets"]["p99_ms"].get<double>(), j["heartbeat"]["p99_ms"].get<double>(),
      j["report_step"]["p99_ms"].get<double>(), j["idle"]["p99_ms"].get<double>(),
      j["ratio"].get<double>());
  if (j.contains("rss_start_mib")) {
    std::cout << absl::StrFormat(
        "  memory     controller RSS %.1f MiB after registration, peak %.1f MiB (VmHWM %.1f MiB) "
        "(target < %g MiB)\n"
        "  CPU        controller %.2f CPU-s per s\n",
        j["rss_start_mib"].get<double>(), j["rss_peak_mib"].get<double>(),
        j["rss_hwm_mib"].get<double>(), j["targets"]["rss_mib"].get<double>(),
        j["controller_cpu_per_s"].get<double>());
  }
  std::cout << absl::StrFormat("  schedule   %d sends more than 10 ms late (worst %.1f ms)\n",
                               j["late_sends"].get<int64_t>(), j["max_send_lag_ms"].get<double>());
  for (const auto& e : j["error_samples"])
    std::cout << "  error      " << e.get<std::string>() << "\n";
  std::cout << (j["ok"].get<bool>() ? "  every RPC answered OK"
                                    : "  FAILED: RPCs failed or unanswered")
            << (j["meets_targets"].get<bool>() ? "; targets met\n" : "; targets NOT met\n");
}

}  // namespace
}  // namespace fp8rt::bench

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  fp8rt::DisableMutexDeadlockDetection();
  fp8rt::bench::Options o;
  CLI::App app{
      "controller load: simulated workers heartbeating and reporting FP8 statistics to "
      "one fp8rt-controller; p99 RPC latency and controller RSS",
      "fp8rt bench controller"};
  app.add_option("--workers", o.workers, "simulated ranks, all runs together")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  app.add_option("--world-size", o.world_size, "ranks per run (the last run takes the rest)")
      ->capture_default_str()
      ->check(CLI::Range(1, 99999));
  app.add_option("--hz", o.hz, "training steps (and heartbeats) per second")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 100.0));
  app.add_option("--duration", o.duration_s, "seconds of load")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 86400.0));
  app.add_option("--layers", o.layers, "transformer blocks of the simulated model")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--channels", o.channels, "client connections (default: one per worker)")
      ->check(CLI::Range(1, 100000));
  app.add_option("--sender-threads", o.sender_threads, "threads issuing the calls")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--deadline-ms", o.deadline_ms, "deadline of every call")
      ->capture_default_str()
      ->check(CLI::Range(10, 600000));
  app.add_option("--controller", o.controller,
                 "HOST:PORT of a running controller (default: start fp8rt-controller on "
                 "loopback)");
  app.add_option("--token-file", o.token_file, "the running controller's token file");
  app.add_option("--controller-pid", o.controller_pid,
                 "pid of the running controller, to measure its RSS and CPU");
  app.add_option("--controller-bin", o.controller_bin,
                 "fp8rt-controller to start (default: next to this program)");
  app.add_flag("--json", o.json, "print one JSON object");
  if (std::optional<int> exit_code = fp8rt::ParseCommandLine(app, argc, argv)) return *exit_code;
  if (!o.controller.empty() && o.token_file.empty()) {
    std::fprintf(stderr, "fp8rt bench controller: --controller needs --token-file\n");
    return 2;
  }
  absl::StatusOr<nlohmann::ordered_json> result = fp8rt::bench::RunBench(o);
  if (!result.ok()) {
    std::fprintf(stderr, "fp8rt bench controller: %s\n",
                 std::string(result.status().message()).c_str());
    return 2;
  }
  if (o.json) {
    std::cout << result->dump() << "\n";
  } else {
    fp8rt::bench::PrintHuman(*result);
  }
  return (*result)["ok"].get<bool>() ? 0 : 1;
}
