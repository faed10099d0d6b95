// fp8rt-launch (run as `fp8rt launch`): starts a training run through mpirun and shows progress.
//
//   fp8rt launch RUN.yaml --np N --run-dir DIR [--set key=value]... [--resume]
//                [--threads-per-rank T] [--quiet] [--run-id ID] [--max-restarts K]
//                [--metrics-port P | --controller HOST:PORT --token-file F | --no-controller]
//
// The control plane: unless --controller or --no-controller is given, the launcher starts an
// fp8rt-controller on loopback for the run (a fresh random token in DIR/controller/token, state
// in DIR/controller/state, output in DIR/logs/controller.log, Prometheus metrics on
// --metrics-port, default any free port), prints where its gRPC API and metrics are served, mints
// a token valid for this run only (DIR/controller/run-token) and hands the workers that and the
// address (the admin token stays with the launcher), and stops it when the workers are done. With
// --controller the workers join an existing controller. The run id defaults to the run folder's
// name.
//
// The spec is loaded and validated for N ranks before anything starts. Then mpirun runs N ranks
// of fp8rt-worker with the spec, the run folder and the overrides; its output goes to
// DIR/logs/launch.log, and the launcher follows DIR/metrics.jsonl (one JSON object per step,
// appended by rank 0) to draw a progress bar on a terminal, or plain lines otherwise. Under a
// controller it also prints the run's controller events as they happen, a line each
// (controller_events.h): checkpoints committed or refused, recipe versions applied, health-policy
// demotions, workers lost, the run finished or failed.
//
// Restarts: with --max-restarts K, when mpirun fails (a rank died; or hung, and either the
// controller declared the run FAILED after its heartbeat timeout, whereupon the launcher stops the
// workers, or without a controller the others' collective timeout, FP8RT_COLLECTIVE_TIMEOUT_S,
// tore the job down) the launcher says so and runs
// mpirun again with --resume, up to K times; the run continues bit-identically from its newest
// committed checkpoint. Exit 2 from the workers (bad input) and a user's Ctrl-C are not retried.
// FP8RT_FAULT and FP8RT_FAULT_POINT (test faults, docs/operations.md) reach the ranks of the
// first attempt only.
//
// Exit codes: 0 the workers finished; 2 they refused to start (bad input found by every rank,
// such as a resume that cannot work: not retried); 1 they failed (the tail of the last
// attempt's output in launch.log is printed, without mpirun's job-ending boxes);
// 2 bad options or spec, or no worker/mpirun to run (nothing was started).
// SIGINT/SIGTERM are forwarded to mpirun, which stops its ranks (a second Ctrl-C makes mpirun
// kill them at once).
//
// Environment: FP8RT_WORKER, the absolute path of a worker executable to run instead of the
// fp8rt-worker found next to this program or on PATH (for tests and custom builds).
//
// Index:
//   Options, ParseOptions        the command line
//   LoadSpec                     the run spec, loaded and validated for --np ranks
//   FindWorker, FindExecutable   the worker executable: FP8RT_WORKER, sibling, PATH
//   MpirunArgv, ShellQuote       the mpirun command line
//   StartChild                   fork/exec with output appended to launch.log
//   MetricsTail                  the complete lines appended to metrics.jsonl since the start
//   Progress                     a redrawn bar (terminal) or every-5% lines (pipe, file)
//   WaitForMpirun                polls metrics and the child; forwards signals
//   PrintLogTail, main
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "launcher/client/control_client.h"
#include "launcher/launch/controller_events.h"
#include "nlohmann/json.hpp"
#include "runtime/core/quote.h"
#include "runtime/spec/run_spec.h"
#include "runtime/core/status.h"

#ifndef FP8RT_MPIEXEC
#define FP8RT_MPIEXEC "mpirun"
#endif

namespace fp8rt {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr char kWorkerName[] = "fp8rt-worker";
constexpr auto kPollInterval = std::chrono::milliseconds(200);
constexpr int kLogTailLines = 30;
constexpr int kExitOk = 0, kExitWorkersFailed = 1, kExitBadInput = 2;

// ---------------------------------------------------------------------------------------------
// Options

struct Options {
  std::string spec_path;               // RUN.yaml as given
  int np = 0;                          // MPI ranks; must equal parallel.dp * parallel.tp
  std::vector<std::string> overrides;  // --set key=value, in order
  std::string run_dir;                 // run folder as given (created if missing)
  bool resume = false;                 // passed to the workers as --resume
  int threads_per_rank = 0;            // OMP_NUM_THREADS per rank; 0 = max(1, cores / np)
  bool quiet = false;                  // print errors only
  std::string controller;              // an existing controller's address ("": start one)
  std::string token_file;              // its token (--token-file or $FP8RT_TOKEN_FILE)
  bool no_controller = false;          // standalone workers, no control plane
  int metrics_port = 0;                // the started controller's metrics port (0: any free)
  int max_restarts = 0;                // restarts from the newest checkpoint after a failure
  std::string run_id;                  // default: the run folder's name
  // Several hosts: mpirun's --hostfile / --host, and MCA parameters ("btl=tcp,self").
  std::string hostfile;
  std::string hosts;
  std::vector<std::string> mca;
  // The started controller's gRPC address (host:port; port 0: any free one), which the ranks and
  // this launcher dial; its Prometheus endpoint listens on the same host.
  std::string controller_listen = "127.0.0.1:0";
  // TLS: the started controller's certificate and key; the CA the ranks and this launcher
  // verify the controller (started or --controller) with.
  std::string tls_cert, tls_key, tls_ca;
};

// True for an address that only this host can reach ("127.0.0.1:5", "localhost:0", "[::1]:5").
bool LoopbackAddress(const std::string& host_port) {
  const std::string host = host_port.substr(0, host_port.rfind(':'));
  return host.starts_with("127.") || host == "localhost" || host == "[::1]" || host.empty();
}

// CLI11's PositiveNumber names the range up to DBL_MAX in its message; this says what it wants.
const CLI::Validator kPositiveInt(
    [](std::string& text) -> std::string {
      int value = 0;
      const char* end = text.data() + text.size();
      const auto [ptr, ec] = std::from_chars(text.data(), end, value);
      if (ec == std::errc() && ptr == end && value > 0) return "";
      return "expected a positive integer, got '" + text + "'";
    },
    "POSITIVE");

// Parses argv; on failure (or --help) returns the exit code to leave with.
std::optional<int> ParseOptions(int argc, char** argv, Options* options) {
  CLI::App app{"Start a training run through mpirun and show its progress", "fp8rt launch"};
  app.add_option("spec", options->spec_path, "run spec (YAML)")->required();
  app.add_option("--np", options->np, "number of MPI ranks (parallel.dp * parallel.tp)")
      ->required()
      ->check(kPositiveInt);
  // One value per --set, kept intact (a value may hold commas: precision.exclude=a,b).
  app.add_option("--set", options->overrides,
                 "override a spec key (repeatable), e.g. train.steps=20")
      ->allow_extra_args(false);
  app.add_option("--run-dir", options->run_dir, "run folder: logs, metrics, checkpoints")
      ->required();
  app.add_flag("--resume", options->resume, "resume from the newest checkpoint in the run folder");
  app.add_option("--threads-per-rank", options->threads_per_rank,
                 "OMP_NUM_THREADS of each rank (default: cores / np, at least 1)")
      ->check(kPositiveInt);
  app.add_flag("--quiet", options->quiet, "print nothing but errors");
  app.add_option("--max-restarts", options->max_restarts,
                 "after a failed attempt (a rank died or hung), restart from the newest committed "
                 "checkpoint up to this many times (default 0)")
      ->check(CLI::Range(0, 1000));
  app.add_option("--run-id", options->run_id, "run id at the controller (default: folder name)");
  app.add_option("--metrics-port", options->metrics_port,
                 "Prometheus port of the controller started for the run (default: any free one)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--controller", options->controller,
                 "join an existing fp8rt-controller (host:port) instead of starting one");
  app.add_option("--token-file", options->token_file,
                 "bearer token of --controller (default: $FP8RT_TOKEN_FILE)");
  app.add_flag("--no-controller", options->no_controller,
               "run the workers without a control plane (metrics files only)");
  app.add_option("--hostfile", options->hostfile,
                 "several hosts: mpirun's hostfile (\"node1 slots=2\" per line); the run folder "
                 "and the build must be at the same paths on every host");
  app.add_option("--host", options->hosts, "several hosts: mpirun's --host list (node1:2,node2:2)");
  app.add_option("--mca", options->mca,
                 "an Open MPI MCA parameter for mpirun, KEY=VALUE (repeatable), e.g. btl=tcp,self")
      ->allow_extra_args(false);
  app.add_option("--controller-listen", options->controller_listen,
                 "host:port the started controller serves on and the ranks dial (default "
                 "127.0.0.1:0; with --hostfile or --host an address the other hosts reach); its "
                 "Prometheus endpoint is on the same host, port --metrics-port");
  app.add_option("--tls-cert", options->tls_cert,
                 "PEM certificate chain of the started controller: it serves TLS");
  app.add_option("--tls-key", options->tls_key, "PEM private key of --tls-cert");
  app.add_option("--tls-ca", options->tls_ca,
                 "PEM root certificate the ranks and the launcher verify the controller with");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "fp8rt launch: %s (see fp8rt launch --help)\n", e.what());
    return kExitBadInput;
  }
  if (options->run_dir.empty()) {
    std::fputs("fp8rt launch: --run-dir: must not be empty\n", stderr);
    return kExitBadInput;
  }
  if (options->no_controller && !options->controller.empty()) {
    std::fputs("fp8rt launch: --no-controller and --controller exclude each other\n", stderr);
    return kExitBadInput;
  }
  for (const std::string& kv : options->mca) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      std::fprintf(stderr, "fp8rt launch: --mca: expected KEY=VALUE, got %s\n",
                   QuoteBounded(kv).c_str());
      return kExitBadInput;
    }
  }
  if (!options->hostfile.empty() && !options->hosts.empty()) {
    std::fputs("fp8rt launch: --hostfile and --host exclude each other\n", stderr);
    return kExitBadInput;
  }
  if (options->controller_listen.rfind(':') == std::string::npos) {
    std::fprintf(stderr, "fp8rt launch: --controller-listen: expected host:port, got %s\n",
                 QuoteBounded(options->controller_listen).c_str());
    return kExitBadInput;
  }
  const bool several_hosts = !options->hostfile.empty() || !options->hosts.empty();
  if (several_hosts && options->controller.empty() && !options->no_controller &&
      LoopbackAddress(options->controller_listen)) {
    std::fprintf(stderr,
                 "fp8rt launch: %s: ranks on other hosts cannot reach a controller on %s; give "
                 "--controller-listen ADDRESS:PORT with an address of this host they reach (or "
                 "--controller, or --no-controller)\n",
                 options->hostfile.empty() ? "--host" : "--hostfile",
                 options->controller_listen.c_str());
    return kExitBadInput;
  }
  if (options->tls_cert.empty() != options->tls_key.empty()) {
    std::fputs("fp8rt launch: --tls-cert and --tls-key go together\n", stderr);
    return kExitBadInput;
  }
  if (!options->tls_cert.empty() && options->tls_ca.empty()) {
    std::fputs("fp8rt launch: --tls-cert: the ranks need --tls-ca to verify it\n", stderr);
    return kExitBadInput;
  }
  for (const std::string* file : {&options->hostfile, &options->tls_cert, &options->tls_key,
                                  &options->tls_ca}) {
    std::error_code ec;
    if (!file->empty() && !fs::is_regular_file(*file, ec)) {
      std::fprintf(stderr, "fp8rt launch: %s: not a readable file\n", QuoteBounded(*file).c_str());
      return kExitBadInput;
    }
  }
  if (!options->controller.empty() && options->token_file.empty()) {
    const char* env = std::getenv("FP8RT_TOKEN_FILE");
    if (env == nullptr || *env == '\0') {
      std::fputs(
          "fp8rt launch: --token-file: required with --controller (or set "
          "FP8RT_TOKEN_FILE)\n",
          stderr);
      return kExitBadInput;
    }
    options->token_file = env;
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Spec

absl::StatusOr<v1::RunSpec> LoadSpec(const Options& options) {
  absl::StatusOr<v1::RunSpec> spec = LoadRunSpec(options.spec_path, options.overrides);
  if (!spec.ok()) return spec.status();
  if (absl::Status valid = ValidateRunSpec(*spec, options.np); !valid.ok()) return valid;
  return spec;
}

// ---------------------------------------------------------------------------------------------
// Executables

bool IsExecutableFile(const fs::path& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec) && access(path.c_str(), X_OK) == 0;
}

// Directory holding this executable (for its sibling fp8rt-worker).
fs::path SelfDir() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : self.parent_path();
}

// `name` itself when it contains a '/', else the first executable `name` on PATH.
std::optional<fs::path> FindExecutable(const std::string& name) {
  if (name.find('/') != std::string::npos) {
    return IsExecutableFile(name) ? std::optional<fs::path>(name) : std::nullopt;
  }
  const char* path = std::getenv("PATH");
  for (const absl::string_view dir : absl::StrSplit(path ? path : "", ':', absl::SkipEmpty())) {
    const fs::path candidate = fs::path(std::string(dir)) / name;
    if (IsExecutableFile(candidate)) return candidate;
  }
  return std::nullopt;
}

// The worker mpirun runs: $FP8RT_WORKER, else fp8rt-worker next to this program, else on PATH.
// Resolved here so that a missing worker is a clear error before anything starts.
absl::StatusOr<fs::path> FindWorker() {
  if (const char* env = std::getenv("FP8RT_WORKER"); env != nullptr && *env != '\0') {
    const fs::path worker(env);
    if (!worker.is_absolute() || !IsExecutableFile(worker)) {
      return absl::InvalidArgumentError(
          absl::StrCat("FP8RT_WORKER=", env, ": not an absolute path to an executable file"));
    }
    return worker;
  }
  const fs::path sibling = SelfDir() / kWorkerName;
  if (IsExecutableFile(sibling)) return sibling;
  if (std::optional<fs::path> on_path = FindExecutable(kWorkerName)) {
    return fs::absolute(*on_path);
  }
  return absl::NotFoundError(absl::StrCat("cannot find ", kWorkerName, " (looked in ",
                                          SelfDir().string(), ", then on PATH)"));
}

// ---------------------------------------------------------------------------------------------
// The mpirun command line

int CoreCount() { return static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN))); }

// Absolute and without "." or ".." parts (nor a trailing '/'), for paths handed to the workers.
fs::path AbsolutePath(const std::string& path) {
  fs::path p = fs::absolute(path).lexically_normal();
  if (!p.has_filename() && p.has_parent_path() && p != p.root_path()) p = p.parent_path();
  return p;
}

std::vector<std::string> MpirunArgv(const Options& options, const fs::path& worker,
                                    const fs::path& run_dir,
                                    const std::vector<std::string>& worker_extra) {
  const int cores = CoreCount();
  const int threads =
      options.threads_per_rank > 0 ? options.threads_per_rank : std::max(1, cores / options.np);
  std::vector<std::string> argv = {FP8RT_MPIEXEC, "-np", std::to_string(options.np)};
  const bool several_hosts = !options.hostfile.empty() || !options.hosts.empty();
  if (!options.hostfile.empty()) {
    argv.insert(argv.end(), {"--hostfile", AbsolutePath(options.hostfile).string()});
  }
  if (!options.hosts.empty()) argv.insert(argv.end(), {"--host", options.hosts});
  for (const std::string& kv : options.mca) {
    const size_t eq = kv.find('=');
    argv.insert(argv.end(), {"--mca", kv.substr(0, eq), kv.substr(eq + 1)});
  }
  // On this host alone, more ranks than cores share them; across hosts the slots decide.
  if (!several_hosts && options.np > cores) argv.push_back("--oversubscribe");
  if (geteuid() == 0) argv.push_back("--allow-run-as-root");
  // Each rank runs its own OpenMP/oneDNN threads: binding ranks to cores would pile them up.
  argv.insert(argv.end(), {"--bind-to", "none", "-x", absl::StrCat("OMP_NUM_THREADS=", threads)});
  // Settings every rank must see, also on other hosts.
  for (const char* var : {"FP8RT_FAULT", "FP8RT_FAULT_POINT", "FP8RT_COLLECTIVE_TIMEOUT_S"}) {
    if (std::getenv(var) != nullptr) argv.insert(argv.end(), {"-x", var});
  }
  argv.insert(argv.end(), {worker.string(), "--spec", AbsolutePath(options.spec_path).string(),
                           "--run-dir", run_dir.string()});
  for (const std::string& kv : options.overrides) argv.insert(argv.end(), {"--set", kv});
  if (options.resume) argv.push_back("--resume");
  argv.insert(argv.end(), worker_extra.begin(), worker_extra.end());
  return argv;
}

// `arg` as a POSIX shell word, so that the printed command can be pasted into a shell.
std::string ShellQuote(const std::string& arg) {
  const bool plain = !arg.empty() && arg.find_first_not_of(
                                         "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                         "0123456789_-+=.,:/@%") == std::string::npos;
  if (plain) return arg;
  std::string quoted = "'";
  for (char c : arg) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

std::string CommandLine(const std::vector<std::string>& argv) {
  std::vector<std::string> words;
  for (const std::string& arg : argv) words.push_back(ShellQuote(arg));
  return absl::StrJoin(words, " ");
}

// ---------------------------------------------------------------------------------------------
// Starting mpirun

std::string LocalTimeNow() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S %z", &tm);
  return buf;
}

// Opens the log for appending and writes the header line (date and command).
absl::StatusOr<int> OpenLog(const fs::path& log_path, const std::string& command) {
  const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot open ", log_path.string(), ": ", std::strerror(errno)));
  }
  const std::string header = absl::StrCat("=== ", LocalTimeNow(), " fp8rt launch: ", command, "\n");
  if (write(fd, header.data(), header.size()) != static_cast<ssize_t>(header.size())) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot write ", log_path.string(), ": ", std::strerror(err)));
  }
  return fd;
}

// Forks and execs argv in its own process group, stdin from /dev/null and stdout+stderr into
// log_fd. In its own group, a terminal's Ctrl-C reaches only the launcher, which forwards it:
// mpirun gets each signal once and stops its ranks (they run in process groups of their own).
// If the launcher dies without forwarding a signal (SIGKILL), mpirun gets SIGTERM and stops
// the ranks rather than running on unobserved.
absl::StatusOr<pid_t> StartChild(const std::vector<std::string>& argv, int log_fd) {
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  const pid_t launcher = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::UnavailableError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    // Child: async-signal-safe calls only until exec.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != launcher) _exit(127);  // the launcher died before prctl took effect
    const int null_fd = open("/dev/null", O_RDONLY);
    if (null_fd >= 0) dup2(null_fd, STDIN_FILENO);
    dup2(log_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execvp(args[0], args.data());
    const char* err = std::strerror(errno);
    const char prefix[] = "fp8rt launch: cannot exec ";
    [[maybe_unused]] ssize_t n = write(STDERR_FILENO, prefix, sizeof(prefix) - 1);
    n = write(STDERR_FILENO, args[0], std::strlen(args[0]));
    n = write(STDERR_FILENO, ": ", 2);
    n = write(STDERR_FILENO, err, std::strlen(err));
    n = write(STDERR_FILENO, "\n", 1);
    _exit(127);
  }
  setpgid(pid, pid);  // also in the parent, so that the group exists before any kill
  return pid;
}

// ---------------------------------------------------------------------------------------------
// Following metrics.jsonl

// One record of metrics.jsonl (written by rank 0 of the worker).
struct StepRecord {
  int64_t step = 0;  // 1-based optimizer step
  double loss = NAN;
  double tokens_per_s = NAN;
  bool skipped = false;            // the optimizer skipped the step (non-finite gradients)
  std::optional<double> val_loss;  // eval steps (eval.every); NaN when written as null
};

// A record from one line; nullopt for a line that is not a JSON object with an integer "step".
std::optional<StepRecord> ParseRecord(const std::string& line) {
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) return std::nullopt;
  auto number = [&j](const char* key) {
    return j.contains(key) && j[key].is_number() ? j[key].get<double>() : NAN;
  };
  StepRecord record;
  record.step = j["step"].get<int64_t>();
  record.loss = number("loss");
  record.tokens_per_s = number("tokens_per_s");
  record.skipped = j.contains("skipped") && j["skipped"].is_boolean() && j["skipped"].get<bool>();
  if (j.contains("val_loss")) record.val_loss = number("val_loss");
  return record;
}

// Reads the lines appended to a file since construction. Only complete lines (ending in '\n')
// are returned; a partly written last line waits for the next call. Lines already in the file
// when the launcher starts (an earlier run, before --resume) are skipped. A file that shrinks
// (rewritten by a fresh run) is read again from its start.
class MetricsTail {
 public:
  explicit MetricsTail(fs::path path) : path_(std::move(path)) {
    std::error_code ec;
    const uintmax_t size = fs::file_size(path_, ec);
    offset_ = ec ? 0 : size;
  }

  std::vector<std::string> ReadNewLines() {
    std::vector<std::string> lines;
    std::error_code ec;
    const uintmax_t size = fs::file_size(path_, ec);
    if (ec) return lines;
    if (size < offset_) {
      offset_ = 0;
      partial_.clear();
    }
    if (size == offset_) return lines;
    std::ifstream in(path_, std::ios::binary);
    in.seekg(static_cast<std::streamoff>(offset_));
    std::string chunk(size - offset_, '\0');
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    chunk.resize(static_cast<size_t>(in.gcount()));
    offset_ += chunk.size();
    partial_ += chunk;
    size_t start = 0;
    for (size_t end; (end = partial_.find('\n', start)) != std::string::npos; start = end + 1) {
      lines.push_back(partial_.substr(start, end - start));
    }
    partial_.erase(0, start);
    return lines;
  }

 private:
  const fs::path path_;   // fixed after construction
  uintmax_t offset_ = 0;  // bytes of the file consumed (complete lines plus partial_)
  std::string partial_;   // the start of a line whose '\n' has not been written yet
};

// ---------------------------------------------------------------------------------------------
// Progress display

// "4,321"
std::string WithThousands(int64_t value) {
  std::string digits = std::to_string(value < 0 ? -value : value);
  for (int i = static_cast<int>(digits.size()) - 3; i > 0; i -= 3) digits.insert(i, ",");
  return value < 0 ? "-" + digits : digits;
}

// "0:42", "1:02:03" (terminal) or "42s", "3m20s", "1h02m03s" (plain lines).
std::string FormatEta(double seconds, bool clock_style) {
  if (!std::isfinite(seconds) || seconds < 0) return clock_style ? "-:--" : "?";
  const int64_t s = std::llround(seconds);
  const int64_t h = s / 3600, m = s / 60 % 60, sec = s % 60;
  char buf[48];
  if (clock_style) {
    if (h > 0) {
      std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(h),
                    static_cast<long long>(m), static_cast<long long>(sec));
    } else {
      std::snprintf(buf, sizeof(buf), "%lld:%02lld", static_cast<long long>(m),
                    static_cast<long long>(sec));
    }
  } else if (h > 0) {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm%02llds", static_cast<long long>(h),
                  static_cast<long long>(m), static_cast<long long>(sec));
  } else if (m > 0) {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", static_cast<long long>(m),
                  static_cast<long long>(sec));
  } else {
    std::snprintf(buf, sizeof(buf), "%llds", static_cast<long long>(sec));
  }
  return buf;
}

std::string FormatLoss(double loss) {
  if (!std::isfinite(loss)) return "nan";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.4f", loss);
  return buf;
}

// Shows the records as they arrive: on a terminal one line redrawn in place, otherwise a plain
// line every max(1, total/20) steps and at the last step. Keeps the last record for the summary.
class Progress {
 public:
  Progress(int64_t total_steps, bool terminal, bool quiet)
      : total_(total_steps),
        terminal_(terminal),
        quiet_(quiet),
        every_(std::max<int64_t>(1, total_steps / 20)),
        start_(Clock::now()) {}

  // Plain lines are printed here, one per qualifying record.
  void Add(const StepRecord& record) {
    // The rate counts steps since the launcher started; a resumed run starts past step 0.
    if (!first_step_) first_step_ = record.step - 1;
    last_ = record;
    if (record.val_loss.has_value()) val_loss_ = record.val_loss;
    changed_ = true;
    if (quiet_ || terminal_) return;
    if (record.step / every_ > last_printed_ / every_ || record.step == total_) {
      PrintLine();
      last_printed_ = record.step;
    }
  }

  // The terminal line is redrawn here, once per poll that brought new records.
  void Refresh() {
    if (changed_ && terminal_ && !quiet_) Redraw();
    changed_ = false;
  }

  // Ends a redrawn line so that what follows starts on a fresh one.
  void Finish() {
    if (drawn_) std::fputc('\n', stderr);
    drawn_ = false;
  }

  const std::optional<StepRecord>& last() const { return last_; }

 private:
  double EtaSeconds() const {
    const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
    const int64_t done = last_->step - *first_step_;
    if (done <= 0 || elapsed <= 0) return NAN;
    return static_cast<double>(total_ - last_->step) * elapsed / static_cast<double>(done);
  }

  std::string TokensPerSecond() const {
    return std::isfinite(last_->tokens_per_s) ? WithThousands(std::llround(last_->tokens_per_s))
                                              : "?";
  }

  // The newest validation loss, after `gap`; empty before the first eval step.
  std::string ValLossText(const char* gap) const {
    if (!val_loss_.has_value()) return "";
    return std::string(gap) + "val_loss " + FormatLoss(*val_loss_);
  }

  void Redraw() {
    constexpr int kWidth = 20;
    const double fraction =
        total_ > 0 ? std::clamp(static_cast<double>(last_->step) / total_, 0.0, 1.0) : 0.0;
    const int filled = static_cast<int>(fraction * kWidth);
    const std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
    // \x1b[K clears what a longer previous line left behind.
    std::fprintf(stderr, "\r[%s] step %lld/%lld  loss %s%s  %s tok/s  ETA %s%s\x1b[K", bar.c_str(),
                 static_cast<long long>(last_->step), static_cast<long long>(total_),
                 FormatLoss(last_->loss).c_str(), ValLossText("  ").c_str(),
                 TokensPerSecond().c_str(), FormatEta(EtaSeconds(), /*clock_style=*/true).c_str(),
                 last_->skipped ? "  (skipped)" : "");
    std::fflush(stderr);
    drawn_ = true;
  }

  void PrintLine() {
    const std::string tokens = std::isfinite(last_->tokens_per_s)
                                   ? std::to_string(std::llround(last_->tokens_per_s))
                                   : "?";
    std::fprintf(stderr, "step %lld/%lld loss %s%s tokens/s %s eta %s%s\n",
                 static_cast<long long>(last_->step), static_cast<long long>(total_),
                 FormatLoss(last_->loss).c_str(), ValLossText(" ").c_str(), tokens.c_str(),
                 FormatEta(EtaSeconds(), /*clock_style=*/false).c_str(),
                 last_->skipped ? " (skipped)" : "");
    std::fflush(stderr);
  }

  const int64_t total_;                // train.steps
  const bool terminal_;                // stderr is a terminal: redraw one line
  const bool quiet_;                   // show nothing
  const int64_t every_;                // plain lines: print every this many steps
  const Clock::time_point start_;      // when the launcher started mpirun
  std::optional<int64_t> first_step_;  // the step before the first record seen
  std::optional<StepRecord> last_;     // the newest record
  std::optional<double> val_loss_;     // the newest record's with a val_loss
  int64_t last_printed_ = 0;           // plain lines: the step printed last
  bool changed_ = false;               // records arrived since the last Refresh
  bool drawn_ = false;                 // a redrawn line is on screen
};

// ---------------------------------------------------------------------------------------------
// Waiting for mpirun

volatile std::sig_atomic_t g_pending_signal = 0;  // set by OnSignal, consumed by WaitForMpirun
bool g_interrupted = false;                       // a signal was forwarded to mpirun: no restart

void OnSignal(int signo) { g_pending_signal = signo; }

// No SA_RESTART: the poll's sleep returns early on a signal.
void InstallSignalHandlers() {
  struct sigaction action {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

// Watches the run at the controller while an attempt runs. Once the run has been RUNNING in the
// attempt, a FAILED state means the controller gave up on it: a rank stopped heartbeating (hung or
// dead) within the controller's heartbeat timeout, which is far shorter than the collective
// timeout the other ranks would otherwise wait out. The controller is asked at most once a
// second; an unreachable controller is not a failure of the run (training goes on without it).
class RunWatchdog {
 public:
  RunWatchdog(std::unique_ptr<cli::ControllerClient> client, std::string run_id)
      : client_(std::move(client)), run_id_(std::move(run_id)) {}

  void NewAttempt() {
    seen_running_ = false;
    next_poll_ = std::chrono::steady_clock::now();
  }

  // True once the run, after being RUNNING in this attempt, is FAILED at the controller.
  bool RunFailed() {
    const auto now = std::chrono::steady_clock::now();
    if (now < next_poll_) return false;
    next_poll_ = now + std::chrono::seconds(1);
    absl::StatusOr<v1::Run> run = client_->GetRun(run_id_);
    if (!run.ok()) return false;
    if (run->state() == v1::RUN_STATE_RUNNING) seen_running_ = true;
    return seen_running_ && run->state() == v1::RUN_STATE_FAILED;
  }

 private:
  const std::unique_ptr<cli::ControllerClient> client_;
  const std::string run_id_;
  bool seen_running_ = false;
  std::chrono::steady_clock::time_point next_poll_;
};

// SIGKILLs `root` and every process descending from it on this host (found through /proc):
// mpirun starts the local ranks in process groups of their own, so killing mpirun's group would
// leave a hung rank running. Remote ranks are stopped by their orted, which exits with mpirun.
void KillProcessTree(pid_t root) {
  std::vector<std::pair<pid_t, pid_t>> parent_of;  // (pid, ppid)
  std::error_code ec;
  for (const fs::directory_entry& entry : fs::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || !std::all_of(name.begin(), name.end(), ::isdigit)) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    // pid (comm) state ppid ...: comm may hold spaces and parentheses, so parse after the last ')'.
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 1));
    std::string state;
    pid_t ppid = 0;
    if (rest >> state >> ppid) parent_of.emplace_back(std::stoi(name), ppid);
  }
  std::vector<pid_t> tree = {root};
  for (size_t i = 0; i < tree.size(); ++i) {
    for (const auto& [pid, ppid] : parent_of) {
      if (ppid == tree[i]) tree.push_back(pid);
    }
  }
  // Children first, so that none is re-parented before it is found; then mpirun.
  for (auto it = tree.rbegin(); it != tree.rend(); ++it) kill(*it, SIGKILL);
}

// Feeds every new metrics line to `progress` until mpirun exits; returns its wait status. With a
// watchdog, a run the controller declares FAILED has mpirun and its local ranks killed (SIGKILL:
// a hung rank would not act on SIGTERM, and mpirun answers SIGTERM by waking stopped ranks first;
// the run restarts from its newest committed checkpoint, so there is nothing to save).
// The controller's events that arrived, a line each, between the progress lines.
void PrintEvents(launch::ControllerEvents* events, Progress* progress, bool quiet = false) {
  if (events == nullptr) return;
  const std::vector<std::string> lines = events->TakeLines();
  if (lines.empty() || quiet) return;
  progress->Finish();
  for (const std::string& line : lines) std::fprintf(stderr, "fp8rt launch: %s\n", line.c_str());
}

int WaitForMpirun(pid_t pid, MetricsTail* metrics, Progress* progress, bool quiet,
                  RunWatchdog* watchdog, launch::ControllerEvents* events) {
  bool killed = false;
  auto drain = [&] {
    for (const std::string& line : metrics->ReadNewLines()) {
      if (std::optional<StepRecord> record = ParseRecord(line)) progress->Add(*record);
    }
    PrintEvents(events, progress, quiet);
    progress->Refresh();
  };
  for (;;) {
    int status = 0;
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) {
      drain();  // the last lines written before the workers exited
      return status;
    }
    if (done < 0 && errno != EINTR) {
      std::fprintf(stderr, "fp8rt launch: waitpid: %s\n", std::strerror(errno));
      return 1 << 8;  // a wait status saying "exited with 1"
    }
    if (const int signo = g_pending_signal; signo != 0) {
      g_pending_signal = 0;
      g_interrupted = true;
      progress->Finish();
      if (!quiet) {
        std::fprintf(stderr, "fp8rt launch: %s received, stopping the workers\n",
                     signo == SIGINT ? "SIGINT" : "SIGTERM");
      }
      kill(-pid, signo);
    }
    if (!killed && watchdog != nullptr && watchdog->RunFailed()) {
      progress->Finish();
      std::fprintf(stderr,
                   "fp8rt launch: the controller declared the run FAILED (a rank stopped "
                   "heartbeating); killing the workers\n");
      KillProcessTree(pid);
      killed = true;
    }
    drain();
    std::this_thread::sleep_for(kPollInterval);
  }
}

// ---------------------------------------------------------------------------------------------
// Reporting the end

// Open MPI's own messages about the job ending: its dashed boxes ("Primary job terminated
// normally, but 1 process returned a non-zero exit code", MPI_ABORT notes, the process table)
// and its "more processes have sent help message" lines. The launcher reports the exit itself.
class MpirunNoise {
 public:
  bool Skip(const std::string& line) {
    if (line.starts_with("-----")) {
      in_box_ = !in_box_;
      return true;
    }
    return in_box_ || line.empty() || line.find("help message") != std::string::npos ||
           line.find("help_aggregate") != std::string::npos;
  }

 private:
  bool in_box_ = false;
};

// The last lines the workers wrote in the last attempt: from `offset` (where that attempt's
// output starts in the log) on, without mpirun's job-ending boxes.
void PrintLogTail(const fs::path& log_path, std::streamoff offset) {
  std::ifstream in(log_path);
  in.seekg(offset);
  std::deque<std::string> tail;
  MpirunNoise noise;
  for (std::string line; std::getline(in, line);) {
    if (noise.Skip(line)) continue;
    tail.push_back(std::move(line));
    if (tail.size() > kLogTailLines) tail.pop_front();
  }
  std::fprintf(stderr, "--- last %zu lines of the workers' output in %s ---\n", tail.size(),
               log_path.c_str());
  for (const std::string& line : tail) std::fprintf(stderr, "%s\n", line.c_str());
  std::fprintf(stderr, "---\n");
}

// The exit code a shell would report: the child's, or 128 + the signal that killed it.
int ShellExitCode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// ---------------------------------------------------------------------------------------------
// The run's controller

struct ControlPlane {
  std::string address;     // gRPC host:port ("" = none)
  std::string metrics;     // Prometheus host:port of a controller we started
  std::string token_file;  // absolute path
  // A token valid for the run only (minted from the admin token of a controller we started),
  // what the workers get; "" = they get token_file.
  std::string worker_token_file;
  std::string tls_ca;  // absolute path of --tls-ca ("" = plaintext)
  pid_t pid = 0;       // a controller we started (0: external or none)
};

// Least privilege: the workers of the run get a token that authorizes calls on `run_id` only
// (Runs.CreateRunToken), in <run_dir>/controller/run-token (0600); the admin token stays with the
// launcher and the user.
absl::Status MintWorkerToken(const std::string& run_id, const fs::path& run_dir,
                             ControlPlane* plane) {
  cli::ConnectionOptions connection;
  connection.controller = plane->address;
  connection.token_file = plane->token_file;
  connection.tls_ca = plane->tls_ca;
  FP8RT_ASSIGN_OR_RETURN(auto client, cli::ControllerClient::Connect(connection));
  FP8RT_ASSIGN_OR_RETURN(const v1::CreateRunTokenResponse created, client->CreateRunToken(run_id));
  const std::string path = (run_dir / "controller" / "run-token").string();
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  const std::string& token = created.token();
  if (fd < 0 || write(fd, token.data(), token.size()) != static_cast<ssize_t>(token.size())) {
    if (fd >= 0) close(fd);
    return absl::UnavailableError(absl::StrCat("cannot write ", path));
  }
  fchmod(fd, 0600);
  close(fd);
  plane->worker_token_file = path;
  return absl::OkStatus();
}

// 32 random bytes as hex, from the kernel's CSPRNG.
absl::StatusOr<std::string> RandomToken() {
  std::ifstream in("/dev/urandom", std::ios::binary);
  unsigned char bytes[32];
  if (!in.read(reinterpret_cast<char*>(bytes), sizeof(bytes))) {
    return absl::UnavailableError("cannot read /dev/urandom for a controller token");
  }
  static const char kHex[] = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) token += {kHex[b >> 4], kHex[b & 15]};
  return token;
}

// Starts fp8rt-controller for the run on loopback and waits until it serves.
absl::StatusOr<ControlPlane> StartController(const Options& options, const fs::path& run_dir) {
  fs::path binary = SelfDir() / "fp8rt-controller";
  if (!IsExecutableFile(binary)) {
    std::optional<fs::path> on_path = FindExecutable("fp8rt-controller");
    if (!on_path) {
      return absl::NotFoundError(absl::StrCat("cannot find fp8rt-controller (looked in ",
                                              SelfDir().string(),
                                              ", then on PATH); pass "
                                              "--no-controller to run without one"));
    }
    binary = *on_path;
  }
  const fs::path dir = run_dir / "controller";
  std::error_code ec;
  fs::create_directories(dir / "state", ec);
  if (ec)
    return absl::UnavailableError(absl::StrCat("cannot create ", dir.string(), ": ", ec.message()));
  ControlPlane plane;
  plane.token_file = (dir / "token").string();
  if (!options.tls_ca.empty()) plane.tls_ca = AbsolutePath(options.tls_ca).string();
  FP8RT_ASSIGN_OR_RETURN(const std::string token, RandomToken());
  {
    const int fd = open(plane.token_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || write(fd, token.data(), token.size()) != static_cast<ssize_t>(token.size())) {
      if (fd >= 0) close(fd);
      return absl::UnavailableError(absl::StrCat("cannot write ", plane.token_file));
    }
    fchmod(fd, 0600);
    close(fd);
  }
  const fs::path ready = dir / "ready.json";
  fs::remove(ready, ec);
  const std::string listen_host =
      options.controller_listen.substr(0, options.controller_listen.rfind(':'));
  std::vector<std::string> argv = {binary.string(),
                                   "--token-file",
                                   plane.token_file,
                                   "--state-dir",
                                   (dir / "state").string(),
                                   "--listen",
                                   options.controller_listen,
                                   "--metrics-listen",
                                   absl::StrCat(listen_host, ":", options.metrics_port),
                                   "--ready-file",
                                   ready.string()};
  if (!options.tls_cert.empty()) {
    argv.insert(argv.end(), {"--tls-cert", AbsolutePath(options.tls_cert).string(), "--tls-key",
                             AbsolutePath(options.tls_key).string()});
  }
  const fs::path log_path = run_dir / "logs" / "controller.log";
  FP8RT_ASSIGN_OR_RETURN(const int log_fd, OpenLog(log_path, CommandLine(argv)));
  absl::StatusOr<pid_t> pid = StartChild(argv, log_fd);
  close(log_fd);
  if (!pid.ok()) return pid.status();
  plane.pid = *pid;
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  while (Clock::now() < deadline) {
    int status = 0;
    if (waitpid(plane.pid, &status, WNOHANG) == plane.pid) {
      PrintLogTail(log_path, 0);
      return absl::UnavailableError("fp8rt-controller exited before serving (see above)");
    }
    std::ifstream in(ready);
    if (in) {
      const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
      if (!j.is_discarded() && j.contains("grpc") && j.contains("metrics")) {
        plane.address = j["grpc"].get<std::string>();
        plane.metrics = j["metrics"].get<std::string>();
        return plane;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(plane.pid, SIGKILL);
  waitpid(plane.pid, nullptr, 0);
  return absl::DeadlineExceededError("fp8rt-controller did not come up within 30 s (see " +
                                     log_path.string() + ")");
}

void StopController(const ControlPlane& plane) {
  if (plane.pid <= 0) return;
  kill(plane.pid, SIGTERM);
  for (int i = 0; i < 100; ++i) {  // 10 s for a graceful shutdown
    if (waitpid(plane.pid, nullptr, WNOHANG) == plane.pid) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  kill(plane.pid, SIGKILL);
  waitpid(plane.pid, nullptr, 0);
}

int Launch(const Options& options) {
  auto fail = [](const absl::Status& status) {
    std::fprintf(stderr, "fp8rt launch: %s\n", std::string(status.message()).c_str());
    return kExitBadInput;
  };
  // 1. Everything a user can get wrong is checked before anything starts.
  absl::StatusOr<v1::RunSpec> spec = LoadSpec(options);
  if (!spec.ok()) return fail(spec.status());
  absl::StatusOr<fs::path> worker = FindWorker();
  if (!worker.ok()) return fail(worker.status());
  if (fs::path(FP8RT_MPIEXEC).is_absolute() && !IsExecutableFile(FP8RT_MPIEXEC)) {
    return fail(absl::NotFoundError(
        absl::StrCat("cannot run mpirun: ", FP8RT_MPIEXEC, " is not an executable file")));
  }

  // 2. The run folder, the log and mpirun.
  const fs::path run_dir = AbsolutePath(options.run_dir);
  const fs::path log_path = run_dir / "logs" / "launch.log";
  std::error_code ec;
  fs::create_directories(run_dir / "logs", ec);
  if (ec) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "--run-dir: cannot create ", (run_dir / "logs").string(), ": ", ec.message())));
  }
  const std::string run_id = options.run_id.empty() ? run_dir.filename().string() : options.run_id;
  ControlPlane plane;
  if (!options.no_controller) {
    if (!options.controller.empty()) {
      plane.address = options.controller;
      plane.token_file = AbsolutePath(options.token_file).string();
      if (!options.tls_ca.empty()) plane.tls_ca = AbsolutePath(options.tls_ca).string();
    } else {
      absl::StatusOr<ControlPlane> started = StartController(options, run_dir);
      if (!started.ok()) {
        std::fprintf(stderr, "fp8rt launch: %s\n", std::string(started.status().message()).c_str());
        return kExitWorkersFailed;
      }
      plane = *started;
      if (const absl::Status minted = MintWorkerToken(run_id, run_dir, &plane); !minted.ok()) {
        StopController(plane);
        if (minted.code() == absl::StatusCode::kInvalidArgument) return fail(minted);  // run id
        std::fprintf(stderr, "fp8rt launch: cannot get a run token from the controller: %s\n",
                     std::string(minted.message()).c_str());
        return kExitWorkersFailed;
      }
      if (!options.quiet) {
        std::fprintf(stderr,
                     "fp8rt launch: controller serving gRPC on %s (token in %s); Prometheus "
                     "metrics on http://%s/metrics\n",
                     plane.address.c_str(), plane.token_file.c_str(), plane.metrics.c_str());
      }
    }
  }
  std::vector<std::string> worker_extra;
  if (!plane.address.empty()) {
    const std::string& worker_token =
        plane.worker_token_file.empty() ? plane.token_file : plane.worker_token_file;
    worker_extra = {"--controller", plane.address, "--token-file",
                    worker_token,   "--run-id",    run_id};
    if (!plane.tls_ca.empty()) worker_extra.insert(worker_extra.end(), {"--tls-ca", plane.tls_ca});
  }
  std::unique_ptr<RunWatchdog> watchdog;
  if (!plane.address.empty()) {
    cli::ConnectionOptions connection;
    connection.controller = plane.address;
    connection.token_file = plane.token_file;
    connection.tls_ca = plane.tls_ca;
    connection.timeout_s = 2.0;
    absl::StatusOr<std::unique_ptr<cli::ControllerClient>> client =
        cli::ControllerClient::Connect(connection);
    if (!client.ok()) {
      StopController(plane);
      return fail(client.status());
    }
    watchdog = std::make_unique<RunWatchdog>(std::move(*client), run_id);
  }
  // The controller's events, printed as they happen (not with --quiet) and recorded in the run
  // folder's events.jsonl (for `fp8rt report`).
  std::unique_ptr<launch::ControllerEvents> events;
  if (!plane.address.empty()) {
    cli::ConnectionOptions connection;
    connection.controller = plane.address;
    connection.token_file = plane.token_file;
    connection.tls_ca = plane.tls_ca;
    absl::StatusOr<std::unique_ptr<cli::ControllerClient>> client =
        cli::ControllerClient::Connect(connection);
    if (!client.ok()) {
      StopController(plane);
      return fail(client.status());
    }
    const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
    events = std::make_unique<launch::ControllerEvents>(std::move(*client), run_id, now_ms,
                                                        (run_dir / "events.jsonl").string());
  }
  MetricsTail metrics(run_dir / "metrics.jsonl");  // before the start: earlier lines are skipped
  Progress progress(spec->train().steps(), isatty(STDERR_FILENO) == 1, options.quiet);
  InstallSignalHandlers();

  // 3. mpirun, and again from the newest committed checkpoint after a failure (--max-restarts).
  int status = 0;
  std::streamoff attempt_offset = 0;  // where the last attempt's output starts in the log
  for (int attempt = 0;; ++attempt) {
    Options attempt_options = options;
    if (attempt > 0) {
      attempt_options.resume = true;
      unsetenv("FP8RT_FAULT");  // test faults fire in the first attempt only
      unsetenv("FP8RT_FAULT_POINT");
    }
    const std::vector<std::string> argv =
        MpirunArgv(attempt_options, *worker, run_dir, worker_extra);
    const std::string command = CommandLine(argv);
    if (!options.quiet) std::fprintf(stderr, "fp8rt launch: %s\n", command.c_str());
    absl::StatusOr<int> log_fd = OpenLog(log_path, command);
    if (!log_fd.ok()) {
      StopController(plane);
      return fail(log_fd.status());
    }
    attempt_offset = lseek(*log_fd, 0, SEEK_END);
    absl::StatusOr<pid_t> pid = StartChild(argv, *log_fd);
    close(*log_fd);
    if (!pid.ok()) {
      StopController(plane);
      return fail(pid.status());
    }
    if (watchdog) watchdog->NewAttempt();
    status = WaitForMpirun(*pid, &metrics, &progress, options.quiet, watchdog.get(), events.get());
    progress.Finish();
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) break;
    // Bad input (exit 2 from every rank) or a user's Ctrl-C is not a failure to retry.
    const bool bad_input = WIFEXITED(status) && WEXITSTATUS(status) == kExitBadInput;
    if (attempt >= options.max_restarts || bad_input || g_interrupted) break;
    std::fprintf(stderr,
                 "fp8rt launch: workers failed (exit code %d); restarting from the newest "
                 "committed checkpoint (restart %d of %d)\n",
                 ShellExitCode(status), attempt + 1, options.max_restarts);
  }
  // The run's last events (run_finished, the final checkpoint) reach the controller as the
  // workers exit: wait for them briefly before the controller we started is stopped.
  if (events != nullptr) {
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    (void)events->WaitForEnd(std::chrono::seconds(ok ? 3 : 1));
    PrintEvents(events.get(), &progress, options.quiet);
    events.reset();
  }
  // Our connections close before the controller stops: a gRPC server's shutdown waits for each
  // open connection to acknowledge its GOAWAY, and an idle client channel reads it only on its
  // next poll (about 1 s later; measured with the metrics server's slow stop, every launch ended
  // 3-4 s after its run: docs/perf.md, "The end of a run").
  watchdog.reset();
  StopController(plane);

  // 4. The outcome.
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    if (options.quiet) return kExitOk;
    if (const std::optional<StepRecord>& last = progress.last()) {
      std::fprintf(stderr, "fp8rt launch: done, %lld steps, final loss %s, run folder %s\n",
                   static_cast<long long>(last->step), FormatLoss(last->loss).c_str(),
                   run_dir.c_str());
    } else {
      std::fprintf(stderr, "fp8rt launch: done, no new steps in %s, run folder %s\n",
                   (run_dir / "metrics.jsonl").c_str(), run_dir.c_str());
    }
    return kExitOk;
  }
  const int code = ShellExitCode(status);
  if (WIFEXITED(status) && WEXITSTATUS(status) == kExitBadInput) {
    // Every rank refused its input before training (a resume that cannot work, a bad data file):
    // their reason is in the tail below; not retried.
    std::fprintf(stderr, "fp8rt launch: the workers refused to start (exit code 2): see below\n");
    PrintLogTail(log_path, attempt_offset);
    return kExitBadInput;
  }
  if (WIFSIGNALED(status)) {
    std::fprintf(stderr, "fp8rt launch: workers failed (exit code %d: mpirun killed by %s)\n", code,
                 strsignal(WTERMSIG(status)));
  } else {
    std::fprintf(stderr, "fp8rt launch: workers failed (exit code %d)\n", code);
  }
  PrintLogTail(log_path, attempt_offset);
  return kExitWorkersFailed;
}

}  // namespace
}  // namespace fp8rt

int main(int argc, char** argv) {
  try {
    fp8rt::Options options;
    if (std::optional<int> exit_code = fp8rt::ParseOptions(argc, argv, &options)) {
      return *exit_code;
    }
    return fp8rt::Launch(options);
  } catch (const std::exception& e) {
    // Nothing here is expected to throw (filesystem calls take error codes); this is the net.
    std::fprintf(stderr, "fp8rt launch: internal error: %s\n", e.what());
    return 1;
  }
}
