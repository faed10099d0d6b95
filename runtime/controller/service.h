// The gRPC services of fp8rt-controller (proto/fp8rt/v1/control.proto): thin adapters from
// Control and Runs to Controller (controller.h).
//
// Every handler goes through one helper that (1) checks `authorization: Bearer <token>` metadata
// (UNAUTHENTICATED "missing bearer token" / "invalid bearer token"; the comparison takes the same
// time wherever the tokens differ), (2) calls the controller, whose absl::Status becomes the gRPC
// status with the same code and message, and (3) turns any exception into INTERNAL, so none
// crosses into gRPC. The token never appears in a message or log.
//
// Threads: the sync gRPC server calls handlers on many threads; these classes hold only pointers
// fixed at construction and the Controller is thread-safe.
#ifndef FP8RT_RUNTIME_CONTROLLER_SERVICE_H_
#define FP8RT_RUNTIME_CONTROLLER_SERVICE_H_

#include <string>
#include <string_view>

#include "fp8rt/v1/control.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "runtime/controller/controller.h"

namespace fp8rt::controller {

// Checks the bearer token of a call.
class Authenticator {
 public:
  // `token`: the shared secret (non-empty).
  explicit Authenticator(std::string token);
  // OK, or UNAUTHENTICATED.
  grpc::Status Check(const grpc::ServerContext& context) const;

 private:
  const std::string token_;  // fixed after construction
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
  RunsService(Controller* controller, const Authenticator* auth)
      : controller_(controller), auth_(auth) {}

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

 private:
  Controller* const controller_;
  const Authenticator* const auth_;
};

}  // namespace fp8rt::controller

#endif  // FP8RT_RUNTIME_CONTROLLER_SERVICE_H_
