// The fp8rt CLI's connection to fp8rt-controller: the Runs service (proto/fp8rt/v1/control.proto)
// behind calls that return absl::StatusOr.
//
// Defines:
//   ConnectionOptions         where the controller is and how to authenticate, as the user gave it
//   ResolveConnectionOptions  fills what the user left out from the environment and defaults
//   ControllerClient          one channel; one method per Runs RPC
//
// Every call carries `authorization: Bearer <token>` metadata (the token file's content with
// surrounding whitespace trimmed), a deadline of ConnectionOptions::timeout_s and a 16 MiB limit
// on the answer. gRPC failures come back as the absl::Status of the same code with the
// controller's message; UNAVAILABLE and DEADLINE_EXCEEDED name the address that did not answer,
// UNAUTHENTICATED says where the token came from. The token itself never appears in a message.
//
// Threads: a ControllerClient is immutable after Connect and its methods may be called from any
// thread (gRPC channels and stubs are thread-safe).
#ifndef FP8RT_LAUNCHER_CLIENT_CONTROL_CLIENT_H_
#define FP8RT_LAUNCHER_CLIENT_CONTROL_CLIENT_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fp8rt/v1/control.grpc.pb.h"

namespace fp8rt::cli {

// Environment variables read by ResolveConnectionOptions.
inline constexpr char kControllerEnv[] = "FP8RT_CONTROLLER";
inline constexpr char kTokenFileEnv[] = "FP8RT_TOKEN_FILE";
inline constexpr char kDefaultController[] = "127.0.0.1:50051";
inline constexpr double kDefaultTimeoutS = 10.0;
// The largest answer accepted (a layer table of a large MoE model stays well below it).
inline constexpr int kMaxReceiveMessageBytes = 16 << 20;

struct ConnectionOptions {
  // host:port of the controller's gRPC listener. Empty: $FP8RT_CONTROLLER, else
  // kDefaultController.
  std::string controller;
  // File holding the bearer token. Empty: $FP8RT_TOKEN_FILE; required one way or the other.
  std::string token_file;
  // PEM file of the root CA that signed the controller's certificate: TLS with it. Empty:
  // plaintext (loopback, or inside a trusted network).
  std::string tls_ca;
  // Deadline of every call, in seconds (> 0).
  double timeout_s = kDefaultTimeoutS;
};

// `given` with controller and token_file filled from the environment and the defaults above.
// InvalidArgument when no token file is given either way (saying how to give one), or when
// timeout_s is not a positive finite number.
[[nodiscard]] absl::StatusOr<ConnectionOptions> ResolveConnectionOptions(
    const ConnectionOptions& given);

// Drops gRPC's own log lines (e.g. "Handshake failed" on stderr), whose content the statuses
// carry anyway, so that a command's error stays one line; does nothing when GRPC_VERBOSITY is
// set (to debug a connection). Process-wide: for programs, not libraries, to call.
void SilenceGrpcLogging();

class ControllerClient {
 public:
  // Reads the token file (and the CA file with TLS) and creates the channel; nothing is sent
  // yet, so an unreachable controller shows up at the first call. InvalidArgument naming the
  // file when one cannot be read or the token is empty.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ControllerClient>> Connect(
      const ConnectionOptions& options);

  ControllerClient(const ControllerClient&) = delete;
  ControllerClient& operator=(const ControllerClient&) = delete;

  const ConnectionOptions& options() const { return options_; }

  [[nodiscard]] absl::StatusOr<v1::ListRunsResponse> ListRuns() const;
  [[nodiscard]] absl::StatusOr<v1::Run> GetRun(const std::string& run_id) const;
  [[nodiscard]] absl::StatusOr<v1::Run> StopRun(const std::string& run_id) const;
  [[nodiscard]] absl::StatusOr<v1::GetLayersResponse> GetLayers(const std::string& run_id) const;
  [[nodiscard]] absl::StatusOr<v1::RecipeVersion> GetRecipe(const std::string& run_id) const;
  [[nodiscard]] absl::StatusOr<v1::RecipeVersion> UpdateRecipe(const std::string& run_id,
                                                               const v1::Recipe& recipe,
                                                               const std::string& reason) const;
  [[nodiscard]] absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(
      const std::string& run_id) const;
  [[nodiscard]] absl::Status SaveCheckpoint(const std::string& run_id) const;
  // Streams the run's events (the stored ones first, then live ones) to `on_event` until the
  // stream ends: the controller shut down, or another thread called context->TryCancel(). The
  // caller owns `context` (no deadline is set on it); the status the stream ended with.
  [[nodiscard]] absl::Status WatchEvents(
      const std::string& run_id, grpc::ClientContext* context,
      const std::function<void(const v1::Event&)>& on_event) const;
  // A fresh token limited to `run_id` (needs the admin token).
  [[nodiscard]] absl::StatusOr<v1::CreateRunTokenResponse> CreateRunToken(
      const std::string& run_id) const;

 private:
  ControllerClient(ConnectionOptions options, std::string token,
                   std::unique_ptr<v1::Runs::Stub> stub);

  // Calls `method` on the stub with a fresh context (token, deadline) and converts the result.
  template <typename Request, typename Response, typename Method>
  absl::StatusOr<Response> Call(Method method, const Request& request) const;

  // The gRPC status as an absl::Status with the message a user can act on.
  absl::Status ToStatus(const grpc::Status& status) const;

  // All fixed at Connect.
  const ConnectionOptions options_;
  const std::string token_;  // never printed
  const std::unique_ptr<v1::Runs::Stub> stub_;
};

}  // namespace fp8rt::cli

#endif  // FP8RT_LAUNCHER_CLIENT_CONTROL_CLIENT_H_
