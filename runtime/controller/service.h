// The gRPC services of fp8rt-controller (proto/fp8rt/v1/control.proto): thin adapters from
// Control and Runs to Controller (controller.h).
//
// Every handler goes through one helper that (1) checks `authorization: Bearer <token>` metadata
// (UNAUTHENTICATED "missing bearer token" / "invalid bearer token"; the comparison with the admin
// token takes the same time wherever the tokens differ, run tokens are looked up by their SHA-256)
// and so learns who calls: the admin (the --token-file token: everything) or one run (a run token
// from Runs.CreateRunToken); (2) authorizes: a run token's calls must name its run in run_id
// (PERMISSION_DENIED "run_id: ..."), CreateRunToken needs the admin token, ListRuns with a run
// token lists its run only; (3) calls the controller, whose absl::Status becomes the gRPC status
// with the same code and message, and (4) turns any exception into INTERNAL, so none crosses into
// gRPC. Who calls is decided by the token alone (looked up server side), never by other metadata
// or the peer's address. The token never appears in a message or log.
//
// WatchEvents streams are capped (StreamLimiter): in all and per caller (the admin, or one run's
// tokens together); one more is RESOURCE_EXHAUSTED.
//
// Threads: the sync gRPC server calls handlers on many threads; these classes hold only pointers
// fixed at construction and the Controller is thread-safe.
#ifndef FP8RT_RUNTIME_CONTROLLER_SERVICE_H_
#define FP8RT_RUNTIME_CONTROLLER_SERVICE_H_

#include <map>
#include <string>
#include <string_view>

#include "fp8rt/v1/control.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "runtime/controller/controller.h"

namespace fp8rt::controller {

// Who a call comes from, as its token says.
struct Caller {
  bool admin = false;  // the controller's own token: every call on every run
  std::string run_id;  // a run token's run (empty for the admin)

  // "admin" or "run:<id>" (the key of per-caller limits).
  std::string Key() const { return admin ? "admin" : "run:" + run_id; }
};

// Checks the bearer token of a call.
class Authenticator {
 public:
  // `admin_token`: the controller's secret (non-empty). `controller` (may be null: no run tokens)
  // looks run tokens up; it must outlive this.
  Authenticator(std::string admin_token, const Controller* controller);
  // OK with `*caller` set, or UNAUTHENTICATED.
  grpc::Status Check(const grpc::ServerContext& context, Caller* caller) const;

 private:
  const std::string admin_token_;       // fixed after construction
  const Controller* const controller_;  // fixed after construction
};

// Counts the open WatchEvents streams: at most `max_total` in all and `max_per_caller` per
// Caller::Key(). Thread-safe.
class StreamLimiter {
 public:
  StreamLimiter(int max_total, int max_per_caller)
      : max_total_(max_total), max_per_caller_(max_per_caller) {}
  // OK (then Release(key) once the stream ends) or RESOURCE_EXHAUSTED saying which cap.
  grpc::Status Acquire(const std::string& key);
  void Release(const std::string& key);

 private:
  const int max_total_, max_per_caller_;  // fixed after construction
  absl::Mutex mu_;
  int total_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, int> per_caller_ ABSL_GUARDED_BY(mu_);
};

// Equality of `presented` and `secret` in time that depends only on presented.size(), whatever
// the contents and wherever they differ (the secret's length does not leak either).
bool ConstantTimeEquals(std::string_view presented, std::string_view secret);

class ControlService final : public v1::Control::Service {
 public:
  ControlService(Controller* controller, const Authenticator* auth)
      : controller_(controller), auth_(auth) {}

  grpc::Status Register(grpc::ServerContext* context, const v1::RegisterRequest* request,
                        v1::RegisterResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;
  grpc::Status ReportStep(grpc::ServerContext* context, const v1::ReportStepRequest* request,
                          v1::ReportStepResponse* response) override;
  grpc::Status BeginCheckpoint(grpc::ServerContext* context,
                               const v1::BeginCheckpointRequest* request,
                               v1::BeginCheckpointResponse* response) override;
  grpc::Status AckShard(grpc::ServerContext* context, const v1::AckShardRequest* request,
                        v1::AckShardResponse* response) override;

 private:
  Controller* const controller_;
  const Authenticator* const auth_;
};

class RunsService final : public v1::Runs::Service {
 public:
  // `streams` caps WatchEvents; all must outlive the service.
  RunsService(Controller* controller, const Authenticator* auth, StreamLimiter* streams)
      : controller_(controller), auth_(auth), streams_(streams) {}

  grpc::Status ListRuns(grpc::ServerContext* context, const v1::ListRunsRequest* request,
                        v1::ListRunsResponse* response) override;
  grpc::Status GetRun(grpc::ServerContext* context, const v1::GetRunRequest* request,
                      v1::Run* response) override;
  grpc::Status StopRun(grpc::ServerContext* context, const v1::StopRunRequest* request,
                       v1::Run* response) override;
  grpc::Status GetLayers(grpc::ServerContext* context, const v1::GetLayersRequest* request,
                         v1::GetLayersResponse* response) override;
  grpc::Status GetRecipe(grpc::ServerContext* context, const v1::GetRecipeRequest* request,
                         v1::RecipeVersion* response) override;
  grpc::Status UpdateRecipe(grpc::ServerContext* context, const v1::UpdateRecipeRequest* request,
                            v1::RecipeVersion* response) override;
  grpc::Status ListCheckpoints(grpc::ServerContext* context,
                               const v1::ListCheckpointsRequest* request,
                               v1::ListCheckpointsResponse* response) override;
  grpc::Status SaveCheckpoint(grpc::ServerContext* context,
                              const v1::SaveCheckpointRequest* request,
                              v1::SaveCheckpointResponse* response) override;
  grpc::Status WatchEvents(grpc::ServerContext* context, const v1::WatchEventsRequest* request,
                           grpc::ServerWriter<v1::Event>* writer) override;
  grpc::Status CreateRunToken(grpc::ServerContext* context,
                              const v1::CreateRunTokenRequest* request,
                              v1::CreateRunTokenResponse* response) override;

 private:
  Controller* const controller_;
  const Authenticator* const auth_;
  StreamLimiter* const streams_;
};

}  // namespace fp8rt::controller

#endif  // FP8RT_RUNTIME_CONTROLLER_SERVICE_H_
