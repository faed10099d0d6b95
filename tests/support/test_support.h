// Helpers shared by the tests that run fp8rt's programs as a user does: temp folders, files,
// child processes with their output in a log, and a real fp8rt-controller on free ports.
//
// Defines (namespace fp8rt::test):
//   ReadFile, WriteFile, ReadJsonl   whole files and JSON-lines files.
//   FreePort                         a loopback TCP port that was free a moment ago.
//   TempDir                          a fresh folder, removed at destruction (unless kept).
//   ChildProcess                     fork+exec with stdout/stderr to a log and extra environment;
//                                    Wait with a deadline, Signal, Stop (SIGTERM then SIGKILL).
//   RunToExit                        a ChildProcess run to its end: exit code and log text.
//   ControllerProcess                fp8rt-controller on 127.0.0.1:0 with a token file and a
//                                    ready file; gRPC stubs; Kill and restart on the same state.
//   BearerContext                    a grpc::ClientContext with a deadline and a bearer token.
//   TinyModelSpec                    RunSpecDefaults() with a 2-layer, d_model 64 model.
//
// Header-only, for tests: a failure to start a process fails the current test (ADD_FAILURE).
#ifndef FP8RT_TESTS_SUPPORT_TEST_SUPPORT_H_
#define FP8RT_TESTS_SUPPORT_TEST_SUPPORT_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fp8rt/v1/control.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/spec/run_spec.h"

namespace fp8rt::test {

namespace support_fs = std::filesystem;

// The file's bytes (binary mode); empty if it is missing or unreadable, which is not a failure:
// tests read logs that may not exist yet and compare contents, so a missing file shows there.
inline std::string ReadFile(const support_fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Replaces the file's contents with `text`; a write that fails fails the test (a fatal failure
// in this function, as ASSERT_* makes it: wrap the call in ASSERT_NO_FATAL_FAILURE to stop there).
inline void WriteFile(const support_fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.flush();
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

// Every non-empty line of a JSON-lines file, parsed (a line that does not parse fails the test).
inline std::vector<nlohmann::json> ReadJsonl(const support_fs::path& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      ADD_FAILURE() << path << ": a line is not JSON: " << line;
      continue;
    }
    out.push_back(std::move(j));
  }
  return out;
}

// A loopback port bound by the kernel's choice, then closed: free a moment ago, and nobody
// listens on it. -1 (and a test failure) if the kernel gave none.
inline int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) close(fd);
    ADD_FAILURE() << "no free loopback port";
    return -1;
  }
  close(fd);
  return ntohs(addr.sin_port);
}

// A fresh folder under the system temp folder, removed at destruction unless FP8RT_KEEP_TEST_DIRS
// is set (then its path is printed, for debugging a failure).
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "fp8rt-test") {
    std::string pattern = (support_fs::temp_directory_path() / (prefix + "-XXXXXX")).string();
    if (mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp " << pattern << " failed";
    path_ = pattern;
  }
  ~TempDir() {
    if (std::getenv("FP8RT_KEEP_TEST_DIRS") != nullptr) {
      std::fprintf(stderr, "kept test folder %s\n", path_.c_str());
      return;
    }
    std::error_code ec;
    support_fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const support_fs::path& path() const { return path_; }
  support_fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  support_fs::path path_;
};

// A child process: argv[0] is run through PATH (execvp), stdout and stderr appended to `log`,
// with `env` set (an empty value unsets the variable); it gets SIGTERM if the test process dies.
// Stopped (SIGTERM, then SIGKILL after 5 s) at destruction if still running.
class ChildProcess {
 public:
  ChildProcess(const std::vector<std::string>& argv, const support_fs::path& log,
               const std::map<std::string, std::string>& env = {}) {
    std::fflush(nullptr);  // nothing buffered in the parent is written twice
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
      }
      for (const auto& [name, value] : env) {
        if (value.empty()) {
          unsetenv(name.c_str());
        } else {
          setenv(name.c_str(), value.c_str(), 1);
        }
      }
      std::vector<char*> args;
      for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      prctl(PR_SET_PDEATHSIG, SIGTERM);  // a crashed or killed test leaves nothing running
      execvp(args[0], args.data());
      _exit(127);
    }
    if (pid_ < 0) ADD_FAILURE() << "fork failed for " << argv[0];
  }
  ~ChildProcess() { Stop(); }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  bool running() {
    if (pid_ <= 0) return false;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      Record(status);
      return false;
    }
    return true;
  }

  // Waits up to `timeout`; the exit code (128 + signal if killed by one), or -1 past the deadline
  // (the process is then stopped and the caller should fail the test).
  int Wait(std::chrono::milliseconds timeout = std::chrono::minutes(5)) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (running()) {
      if (std::chrono::steady_clock::now() > end) {
        Stop();
        return -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return status_;
  }

  void Signal(int sig) {
    if (pid_ > 0) kill(pid_, sig);
  }

  // SIGTERM, then SIGKILL after 5 s. Safe to call twice.
  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    for (int i = 0; i < 250 && running(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
      Record(status);
    }
  }

 private:
  void Record(int status) {
    pid_ = 0;
    status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  pid_t pid_ = 0;
  int status_ = -1;
};

struct ExitResult {
  int exit_code = -1;  // -1: past the deadline (then stopped)
  std::string log;     // stdout and stderr
};

// Runs `argv` to its end (at most `timeout`) with its output in `log`.
inline ExitResult RunToExit(const std::vector<std::string>& argv, const support_fs::path& log,
                            const std::map<std::string, std::string>& env = {},
                            std::chrono::milliseconds timeout = std::chrono::minutes(5)) {
  ChildProcess p(argv, log, env);
  ExitResult r;
  r.exit_code = p.Wait(timeout);
  r.log = ReadFile(log);
  if (r.exit_code == -1) ADD_FAILURE() << argv[0] << " did not exit within the deadline";
  return r;
}

// A client context with a deadline and, unless `token` is empty, `authorization: Bearer <token>`.
inline std::unique_ptr<grpc::ClientContext> BearerContext(
    const std::string& token, std::chrono::seconds deadline = std::chrono::seconds(20)) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + deadline);
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  return ctx;
}

// RunSpecDefaults() with a small model: 2 layers, d_model 64, 4 heads, d_ff 256, seq_len 16,
// vocab 256. The caller sets the rest (parallelism, steps, data path, ...).
inline v1::RunSpec TinyModelSpec() {
  v1::RunSpec spec = RunSpecDefaults();
  auto* m = spec.mutable_model();
  m->set_layers(2);
  m->set_d_model(64);
  m->set_heads(4);
  m->set_d_ff(256);
  m->set_seq_len(16);
  m->set_vocab(256);
  return spec;
}

// One fp8rt-controller on free loopback ports (gRPC and metrics), with a 0600 token file holding
// `token`. Start() waits for its ready file. Stopped with SIGTERM at destruction.
class ControllerProcess {
 public:
  struct Options {
    std::string binary;          // path of fp8rt-controller
    support_fs::path dir;        // token file, ready file and log go here
    support_fs::path state_dir;  // --state-dir
    std::string token = "0123456789abcdef0123456789abcdef";
    std::vector<std::string> extra;  // more flags
    std::map<std::string, std::string> env;
  };

  // Starts it; nullptr (and a test failure) if it exits or is not ready within 20 s.
  static std::unique_ptr<ControllerProcess> Start(Options options) {
    auto p = std::unique_ptr<ControllerProcess>(new ControllerProcess(std::move(options)));
    if (!p->Launch()) return nullptr;
    return p;
  }

  ~ControllerProcess() { Stop(); }

  // SIGTERM (graceful) and wait; the exit code. The stubs are dropped first: graceful shutdown
  // waits for connected clients.
  int Stop() {
    DropStubs();
    if (!process_) return status_;
    process_->Stop();
    status_ = process_->Wait(std::chrono::seconds(1));
    process_.reset();
    return status_;
  }
  // SIGKILL: a crash.
  void Kill() {
    DropStubs();
    if (!process_) return;
    process_->Signal(SIGKILL);
    process_->Wait(std::chrono::seconds(10));
    process_.reset();
  }
  // Starts it again on the same state folder and options (new ports); false on failure.
  bool Restart() {
    Stop();
    return Launch();
  }
  bool running() { return process_ && process_->running(); }
  // The process, for tests that signal it (SIGSTOP, ...).
  ChildProcess* process() { return process_.get(); }

  const std::string& token() const { return options_.token; }
  const support_fs::path& token_file() const { return token_file_; }
  const std::string& grpc_address() const { return grpc_; }
  const std::string& metrics_address() const { return metrics_; }
  const support_fs::path& log_path() const { return log_; }
  std::string log() const { return ReadFile(log_); }
  v1::Control::Stub& control() { return *control_; }
  v1::Runs::Stub& runs() { return *runs_; }
  std::unique_ptr<grpc::ClientContext> Context() const { return BearerContext(options_.token); }

 private:
  explicit ControllerProcess(Options options) : options_(std::move(options)) {}

  bool Launch() {
    static int counter = 0;
    const std::string tag = std::to_string(getpid()) + "-" + std::to_string(counter++);
    token_file_ = options_.dir / "controller-token";
    WriteFile(token_file_, options_.token + "\n");
    support_fs::permissions(token_file_,
                            support_fs::perms::owner_read | support_fs::perms::owner_write);
    const support_fs::path ready = options_.dir / ("controller-ready-" + tag + ".json");
    log_ = options_.dir / ("controller-" + tag + ".log");
    std::vector<std::string> argv = {options_.binary,                                  //
                                     "--token-file",     token_file_.string(),         //
                                     "--state-dir",      options_.state_dir.string(),  //
                                     "--listen",         "127.0.0.1:0",                //
                                     "--metrics-listen", "127.0.0.1:0",                //
                                     "--ready-file",     ready.string()};
    argv.insert(argv.end(), options_.extra.begin(), options_.extra.end());
    process_ = std::make_unique<ChildProcess>(argv, log_, options_.env);
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!support_fs::exists(ready)) {
      if (!process_->running()) {
        ADD_FAILURE() << "fp8rt-controller exited early: " << ReadFile(log_);
        process_.reset();
        return false;
      }
      if (std::chrono::steady_clock::now() > end) {
        ADD_FAILURE() << "fp8rt-controller did not become ready: " << ReadFile(log_);
        process_.reset();
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const nlohmann::json j = nlohmann::json::parse(ReadFile(ready), nullptr, false);
    if (j.is_discarded() || !j.contains("grpc") || !j.contains("metrics")) {
      ADD_FAILURE() << "fp8rt-controller ready file " << ready << " is not as expected";
      return false;
    }
    grpc_ = j["grpc"].get<std::string>();
    metrics_ = j["metrics"].get<std::string>();
    channel_ = grpc::CreateChannel(grpc_, grpc::InsecureChannelCredentials());
    control_ = v1::Control::NewStub(channel_);
    runs_ = v1::Runs::NewStub(channel_);
    return true;
  }

  void DropStubs() {
    control_.reset();
    runs_.reset();
    channel_.reset();
  }

  const Options options_;
  std::unique_ptr<ChildProcess> process_;
  int status_ = -1;
  support_fs::path token_file_, log_;
  std::string grpc_, metrics_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Control::Stub> control_;
  std::unique_ptr<v1::Runs::Stub> runs_;
};

}  // namespace fp8rt::test

#endif  // FP8RT_TESTS_SUPPORT_TEST_SUPPORT_H_
