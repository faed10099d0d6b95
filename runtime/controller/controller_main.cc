// fp8rt-controller: the control plane server of fp8rt (DESIGN.md section 6).
//
//   fp8rt-controller --token-file FILE --state-dir DIR [--listen HOST:PORT]
//                    [--metrics-listen HOST:PORT|off] [--tls-cert F --tls-key F [--tls-client-ca
//                    F]]
//                    [--heartbeat-timeout-s S] [--recipe-lead-steps N] [--ready-file F]
//                    [--max-runs N] [--max-streams N] [--max-streams-per-token N]
//
// Limits: messages of at most 16 MiB each way (RESOURCE_EXHAUSTED beyond); at most --max-streams
// concurrent WatchEvents streams (--max-streams-per-token per caller), 256 concurrent HTTP/2
// streams per connection (more wait in the client), --max-streams + 256 handler threads; at most
// --max-runs runs. The request caps are in controller.h.
//
// Serves fp8rt.v1.Control and fp8rt.v1.Runs (bearer token on every call), the standard gRPC
// health service and server reflection on --listen, and Prometheus text on
// http://<metrics-listen>/metrics. Port 0 picks a free port; --ready-file receives the addresses
// actually bound, as JSON {"grpc": "HOST:PORT", "metrics": "HOST:PORT" or null, "pid": N},
// written atomically once the server is serving.
//
// Exit status: 0 after SIGINT/SIGTERM (graceful shutdown), 2 for bad flags (the message names the
// flag), 1 when the state cannot be loaded (naming the file) or an address cannot be bound.
#include <malloc.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "nlohmann/json.hpp"
#include "prometheus/exposer.h"
#include "runtime/controller/controller.h"
#include "runtime/controller/metrics.h"
#include "runtime/controller/service.h"
#include "runtime/core/program.h"

namespace fp8rt::controller {
namespace {

constexpr int kMaxMessageBytes = 16 << 20;
// HTTP/2 streams one connection may have open at once (a worker or CLI needs a handful).
constexpr int kMaxStreamsPerConnection = 256;
// Handler threads beyond the WatchEvents streams (each of which holds one): unary calls are short.
constexpr int kUnaryThreads = 256;
constexpr size_t kMinTokenChars = 16;
constexpr auto kShutdownGrace = std::chrono::seconds(5);

struct Flags {
  std::string token_file;
  std::string state_dir;
  std::string listen = "127.0.0.1:50051";
  std::string metrics_listen = "127.0.0.1:9464";
  std::string tls_cert, tls_key, tls_client_ca;
  double heartbeat_timeout_s = 30;
  int64_t recipe_lead_steps = 3;
  std::string ready_file;
  int max_runs = 10000;
  int max_streams = 256;
  int max_streams_per_token = 64;
};

// A flag error: the message is printed and the process exits with status 2.
struct FlagError {
  std::string message;
};

struct HostPort {
  std::string host;
  int port = 0;
};

// "HOST:PORT" (HOST may be [v6]); port in [0, 65535].
std::optional<HostPort> ParseHostPort(const std::string& text) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0) return std::nullopt;
  HostPort hp{text.substr(0, colon), 0};
  if (!absl::SimpleAtoi(text.substr(colon + 1), &hp.port) || hp.port < 0 || hp.port > 65535) {
    return std::nullopt;
  }
  return hp;
}

// Stops the metrics server. civetweb 1.15's listening thread reads its stop flag only between
// polls of its sockets, so destroying the Exposer took 1.05 s after SIGTERM (measured; every run
// that `fp8rt launch` ended waited for it). Connecting to the server's own port while it stops
// ends the poll at once (0.06 s). Connection failures are expected (the socket closes).
void StopMetricsServer(std::unique_ptr<prometheus::Exposer>& exposer, const HostPort& listen,
                       int port) {
  if (exposer == nullptr) return;
  std::string host = listen.host;
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty() || host == "0.0.0.0") host = "127.0.0.1";
  if (host == "::") host = "::1";
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* addresses = nullptr;
  const bool resolved =
      getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &addresses) == 0;
  std::atomic<bool> stopped{false};
  std::thread waker([&] {
    while (resolved && !stopped.load()) {
      const int fd = socket(addresses->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd >= 0) {
        (void)connect(fd, addresses->ai_addr, addresses->ai_addrlen);
        close(fd);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  exposer.reset();
  stopped = true;
  waker.join();
  if (addresses != nullptr) freeaddrinfo(addresses);
}

std::string ReadFileOrFlagError(const std::string& flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FlagError{absl::StrCat(flag, " ", path, ": cannot read the file")};
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A PEM file named by `flag`: its text, or a FlagError when it holds no "-----BEGIN <what>"
// block (a placeholder left in a Secret, a DER file), which gRPC would report only as a server
// that "cannot listen".
std::string ReadPemOrFlagError(const std::string& flag, const std::string& path, const char* what) {
  std::string pem = ReadFileOrFlagError(flag, path);
  if (pem.find("-----BEGIN ") == std::string::npos || pem.find(what) == std::string::npos) {
    throw FlagError{absl::StrCat(flag, " ", path, ": not a PEM file holding a ", what,
                                 " (no \"-----BEGIN ...", what, "-----\" line)")};
  }
  return pem;
}

std::string ReadToken(const std::string& path) {
  const std::string token(absl::StripAsciiWhitespace(ReadFileOrFlagError("--token-file", path)));
  if (token.size() < kMinTokenChars) {
    throw FlagError{absl::StrCat("--token-file ", path, ": the token must be at least ",
                                 kMinTokenChars, " characters (after trimming whitespace), got ",
                                 token.size())};
  }
  struct stat st {};
  if (stat(path.c_str(), &st) == 0 && (st.st_mode & 077) != 0) {
    std::fprintf(stderr,
                 "fp8rt-controller: warning: --token-file %s is readable by group or others "
                 "(chmod 600 it)\n",
                 path.c_str());
  }
  return token;
}

// Writes `text` to `path` atomically (temp file in the same folder, then rename).
bool WriteAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

int Run(const Flags& flags) {
  // Checks first, so that a bad flag fails before anything is bound or loaded.
  const std::string token = ReadToken(flags.token_file);
  const std::optional<HostPort> listen = ParseHostPort(flags.listen);
  if (!listen)
    throw FlagError{absl::StrCat("--listen: expected HOST:PORT, got '", flags.listen, "'")};
  std::optional<HostPort> metrics_listen;
  if (flags.metrics_listen != "off") {
    metrics_listen = ParseHostPort(flags.metrics_listen);
    if (!metrics_listen) {
      throw FlagError{absl::StrCat("--metrics-listen: expected HOST:PORT or off, got '",
                                   flags.metrics_listen, "'")};
    }
  }
  if (flags.tls_cert.empty() != flags.tls_key.empty()) {
    throw FlagError{flags.tls_cert.empty() ? "--tls-key: needs --tls-cert too"
                                           : "--tls-cert: needs --tls-key too"};
  }
  if (!flags.tls_client_ca.empty() && flags.tls_cert.empty()) {
    throw FlagError{"--tls-client-ca: needs --tls-cert and --tls-key"};
  }
  if (!(flags.heartbeat_timeout_s > 0)) {
    throw FlagError{
        absl::StrCat("--heartbeat-timeout-s: must be positive, got ", flags.heartbeat_timeout_s)};
  }
  if (flags.max_runs < 1) {
    throw FlagError{absl::StrCat("--max-runs: must be >= 1, got ", flags.max_runs)};
  }
  if (flags.max_streams < 1 || flags.max_streams > 100000) {
    throw FlagError{absl::StrCat("--max-streams: must be in [1, 100000], got ", flags.max_streams)};
  }
  if (flags.max_streams_per_token < 1) {
    throw FlagError{
        absl::StrCat("--max-streams-per-token: must be >= 1, got ", flags.max_streams_per_token)};
  }
  if (flags.recipe_lead_steps < 1 || flags.recipe_lead_steps > controller::kMaxStep) {
    throw FlagError{absl::StrCat("--recipe-lead-steps: must be in [1, ", controller::kMaxStep,
                                 "], got ", flags.recipe_lead_steps)};
  }
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!flags.tls_cert.empty()) {
    grpc::SslServerCredentialsOptions ssl(
        flags.tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                    : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    ssl.pem_key_cert_pairs.push_back(
        {ReadPemOrFlagError("--tls-key", flags.tls_key, "PRIVATE KEY"),
         ReadPemOrFlagError("--tls-cert", flags.tls_cert, "CERTIFICATE")});
    if (!flags.tls_client_ca.empty()) {
      ssl.pem_root_certs =
          ReadPemOrFlagError("--tls-client-ca", flags.tls_client_ca, "CERTIFICATE");
    }
    credentials = grpc::SslServerCredentials(ssl);
  }

  ControllerOptions options;
  options.state_dir = flags.state_dir;
  options.heartbeat_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(flags.heartbeat_timeout_s * 1000.0 + 0.5));
  options.recipe_lead_steps = flags.recipe_lead_steps;
  options.max_runs = flags.max_runs;
  ControllerMetrics metrics;
  absl::StatusOr<std::unique_ptr<Controller>> opened = Controller::Open(options, &metrics);
  if (!opened.ok()) {
    std::fprintf(stderr, "fp8rt-controller: cannot start with the state in %s: %s\n",
                 flags.state_dir.c_str(), std::string(opened.status().message()).c_str());
    return 1;
  }
  Controller& controller = **opened;

  std::unique_ptr<prometheus::Exposer> exposer;
  std::string metrics_address;
  int metrics_port = 0;
  if (metrics_listen) {
    try {
      exposer = std::make_unique<prometheus::Exposer>(flags.metrics_listen, 2);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fp8rt-controller: --metrics-listen %s: cannot listen: %s\n",
                   flags.metrics_listen.c_str(), e.what());
      return 1;
    }
    exposer->RegisterCollectable(metrics.registry());
    const std::vector<int> ports = exposer->GetListeningPorts();
    metrics_port = ports.empty() ? metrics_listen->port : ports[0];
    metrics_address = absl::StrCat(metrics_listen->host, ":", metrics_port);
  }

  const Authenticator auth(token, &controller);
  StreamLimiter streams(flags.max_streams, flags.max_streams_per_token);
  ControlService control(&controller, &auth);
  RunsService runs(&controller, &auth, &streams);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(flags.listen, credentials, &port);
  builder.RegisterService(&control);
  builder.RegisterService(&runs);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxStreamsPerConnection);
  // Bounds the sync server's threads (and so its memory): beyond, calls get RESOURCE_EXHAUSTED.
  grpc::ResourceQuota quota("fp8rt-controller");
  quota.SetMaxThreads(flags.max_streams + kUnaryThreads);
  builder.SetResourceQuota(quota);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "fp8rt-controller: --listen %s: cannot listen there\n",
                 flags.listen.c_str());
    return 1;
  }
  controller.Start();
  const std::string grpc_address = absl::StrCat(listen->host, ":", port);
  // A large request (up to 16 MiB, several times that once parsed) is freed when its call ends,
  // but glibc keeps the freed pages in its per-thread arenas; returning them every second keeps
  // the resident size near the steady state after a burst (abusive or not).
  std::atomic<bool> stop_trimming{false};
  std::thread trimmer([&stop_trimming] {
    while (!stop_trimming.load()) {
      for (int i = 0; i < 10 && !stop_trimming.load(); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      malloc_trim(0);
    }
  });
  struct StopTrimmer {
    std::atomic<bool>& stop;
    std::thread& thread;
    ~StopTrimmer() {
      stop = true;
      thread.join();
    }
  } stop_trimmer{stop_trimming, trimmer};

  if (!flags.ready_file.empty()) {
    nlohmann::json ready = {{"grpc", grpc_address}, {"pid", static_cast<int64_t>(getpid())}};
    ready["metrics"] =
        metrics_address.empty() ? nlohmann::json(nullptr) : nlohmann::json(metrics_address);
    if (!WriteAtomically(flags.ready_file, ready.dump() + "\n")) {
      std::fprintf(stderr, "fp8rt-controller: --ready-file %s: cannot write it\n",
                   flags.ready_file.c_str());
      server->Shutdown();
      return 1;
    }
  }
  std::fprintf(stderr, "fp8rt-controller: serving gRPC on %s, metrics %s, state in %s\n",
               grpc_address.c_str(),
               metrics_address.empty()
                   ? "off"
                   : absl::StrCat("on http://", metrics_address, "/metrics").c_str(),
               flags.state_dir.c_str());

  // SIGINT/SIGTERM were blocked in every thread (main), so they arrive here only.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  std::fprintf(stderr, "fp8rt-controller: %s: shutting down\n",
               signal_number == SIGINT ? "SIGINT" : "SIGTERM");
  controller.CloseStreams();
  server->Shutdown(std::chrono::system_clock::now() + kShutdownGrace);
  server->Wait();
  controller.Shutdown();
  if (metrics_listen) StopMetricsServer(exposer, *metrics_listen, metrics_port);
  return 0;
}

}  // namespace
}  // namespace fp8rt::controller

int main(int argc, char** argv) {
  // Block the shutdown signals before any thread starts, so every thread inherits the mask and
  // only the main thread's sigwait sees them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);
  fp8rt::DisableMutexDeadlockDetection();

  fp8rt::controller::Flags flags;
  CLI::App app{
      "fp8rt-controller: the control plane of fp8rt runs (gRPC services Control and Runs, "
      "Prometheus metrics)",
      "fp8rt-controller"};
  app.add_option("--token-file", flags.token_file,
                 "file holding the admin bearer token (>= 16 characters); run tokens "
                 "(Runs.CreateRunToken) are limited to their run")
      ->required();
  app.add_option("--state-dir", flags.state_dir, "folder of the persistent run state")->required();
  app.add_option("--listen", flags.listen, "gRPC address HOST:PORT (port 0: a free one)")
      ->capture_default_str();
  app.add_option("--metrics-listen", flags.metrics_listen,
                 "Prometheus /metrics address HOST:PORT (port 0: a free one), or off")
      ->capture_default_str();
  app.add_option("--tls-cert", flags.tls_cert, "PEM certificate chain: serve TLS");
  app.add_option("--tls-key", flags.tls_key, "PEM private key of --tls-cert");
  app.add_option("--tls-client-ca", flags.tls_client_ca,
                 "PEM CA bundle: require client certificates signed by it");
  app.add_option("--heartbeat-timeout-s", flags.heartbeat_timeout_s,
                 "a rank silent for longer is lost (its RUNNING run FAILS)")
      ->capture_default_str();
  app.add_option("--recipe-lead-steps", flags.recipe_lead_steps,
                 "a recipe update takes effect this many steps after the latest step")
      ->capture_default_str();
  app.add_option("--ready-file", flags.ready_file,
                 "written (atomically) with the bound addresses once serving");
  app.add_option("--max-runs", flags.max_runs,
                 "runs kept at most (registering one more is RESOURCE_EXHAUSTED)")
      ->capture_default_str();
  app.add_option("--max-streams", flags.max_streams,
                 "concurrent WatchEvents streams at most (one more is RESOURCE_EXHAUSTED)")
      ->capture_default_str();
  app.add_option("--max-streams-per-token", flags.max_streams_per_token,
                 "concurrent WatchEvents streams at most per caller (the admin, or one run)")
      ->capture_default_str();
  if (std::optional<int> exit_code = fp8rt::ParseCommandLine(app, argc, argv)) return *exit_code;
  try {
    return fp8rt::controller::Run(flags);
  } catch (const fp8rt::controller::FlagError& e) {
    std::fprintf(stderr, "fp8rt-controller: %s\n", e.message.c_str());
    return 2;
  }
}
