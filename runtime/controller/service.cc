// gRPC adapters of the controller (see service.h).
#include "runtime/controller/service.h"

#include <exception>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace fp8rt::controller {
namespace {

constexpr std::string_view kBearer = "bearer ";  // the scheme is case-insensitive (RFC 6750)

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbers.
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// The one path of every handler: authenticate, run `body` (returning absl::Status), convert.
template <typename Body>
grpc::Status Serve(const Authenticator& auth, const grpc::ServerContext& context, Body&& body) {
  try {
    grpc::Status authenticated = auth.Check(context);
    if (!authenticated.ok()) return authenticated;
    return ToGrpc(body());
  } catch (const std::exception& e) {
    return grpc::Status(grpc::StatusCode::INTERNAL, absl::StrCat("internal error: ", e.what()));
  } catch (...) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "internal error");
  }
}

// `*out = value of result`, or its error.
template <typename T>
absl::Status Assign(absl::StatusOr<T> result, T* out) {
  if (!result.ok()) return result.status();
  *out = *std::move(result);
  return absl::OkStatus();
}

}  // namespace

bool ConstantTimeEquals(std::string_view presented, std::string_view secret) {
  // Walks the presented bytes only, pairing them with the secret cyclically, so the time depends
  // on neither the secret's length nor the position of the first difference.
  if (secret.empty()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < presented.size(); ++i) {
    diff |= static_cast<unsigned char>(presented[i] ^ secret[i % secret.size()]);
  }
  const bool same_length = presented.size() == secret.size();
  return diff == 0 && same_length;
}

Authenticator::Authenticator(std::string token) : token_(std::move(token)) {}

grpc::Status Authenticator::Check(const grpc::ServerContext& context) const {
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing bearer token");
  }
  const std::string_view value(it->second.data(), it->second.size());
  if (value.size() < kBearer.size() ||
      absl::AsciiStrToLower(std::string(value.substr(0, kBearer.size()))) != kBearer) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing bearer token (authorization metadata must be 'Bearer <token>')");
  }
  if (!ConstantTimeEquals(value.substr(kBearer.size()), token_)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token");
  }
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------------------------
// Control.

grpc::Status ControlService::Register(grpc::ServerContext* context,
                                      const v1::RegisterRequest* request,
                                      v1::RegisterResponse* response) {
  return Serve(*auth_, *context, [&] { return Assign(controller_->Register(*request), response); });
}

grpc::Status ControlService::Heartbeat(grpc::ServerContext* context,
                                       const v1::HeartbeatRequest* request,
                                       v1::HeartbeatResponse* response) {
  return Serve(*auth_, *context,
               [&] { return Assign(controller_->Heartbeat(*request), response); });
}

grpc::Status ControlService::ReportStep(grpc::ServerContext* context,
                                        const v1::ReportStepRequest* request,
                                        v1::ReportStepResponse* response) {
  return Serve(*auth_, *context, [&] { return controller_->ReportStep(*request); });
}

grpc::Status ControlService::BeginCheckpoint(grpc::ServerContext* context,
                                             const v1::BeginCheckpointRequest* request,
                                             v1::BeginCheckpointResponse* response) {
  return Serve(*auth_, *context,
               [&] { return Assign(controller_->BeginCheckpoint(*request), response); });
}

grpc::Status ControlService::AckShard(grpc::ServerContext* context,
                                      const v1::AckShardRequest* request,
                                      v1::AckShardResponse* response) {
  return Serve(*auth_, *context, [&] { return Assign(controller_->AckShard(*request), response); });
}

// ---------------------------------------------------------------------------------------------
// Runs.

grpc::Status RunsService::ListRuns(grpc::ServerContext* context, const v1::ListRunsRequest* request,
                                   v1::ListRunsResponse* response) {
  return Serve(*auth_, *context, [&] {
    *response = controller_->ListRuns();
    return absl::OkStatus();
  });
}

grpc::Status RunsService::GetRun(grpc::ServerContext* context, const v1::GetRunRequest* request,
                                 v1::Run* response) {
  return Serve(*auth_, *context, [&] { return Assign(controller_->GetRun(*request), response); });
}

grpc::Status RunsService::StopRun(grpc::ServerContext* context, const v1::StopRunRequest* request,
                                  v1::Run* response) {
  return Serve(*auth_, *context, [&] { return Assign(controller_->StopRun(*request), response); });
}

grpc::Status RunsService::GetLayers(grpc::ServerContext* context,
                                    const v1::GetLayersRequest* request,
                                    v1::GetLayersResponse* response) {
  return Serve(*auth_, *context,
               [&] { return Assign(controller_->GetLayers(*request), response); });
}

grpc::Status RunsService::GetRecipe(grpc::ServerContext* context,
                                    const v1::GetRecipeRequest* request,
                                    v1::RecipeVersion* response) {
  return Serve(*auth_, *context,
               [&] { return Assign(controller_->GetRecipe(*request), response); });
}

grpc::Status RunsService::UpdateRecipe(grpc::ServerContext* context,
                                       const v1::UpdateRecipeRequest* request,
                                       v1::RecipeVersion* response) {
  return Serve(*auth_, *context,
               [&] { return Assign(controller_->UpdateRecipe(*request), response); });
}

grpc::Status RunsService::ListCheckpoints(grpc::ServerContext* context,
                                          const v1::ListCheckpointsRequest* request,
                                          v1::ListCheckpointsResponse* response) {
  return Serve(*auth_, *context,
               [&] { return Assign(controller_->ListCheckpoints(*request), response); });
}

grpc::Status RunsService::SaveCheckpoint(grpc::ServerContext* context,
                                         const v1::SaveCheckpointRequest* request,
                                         v1::SaveCheckpointResponse* response) {
  return Serve(*auth_, *context, [&] { return controller_->SaveCheckpoint(*request); });
}

grpc::Status RunsService::WatchEvents(grpc::ServerContext* context,
                                      const v1::WatchEventsRequest* request,
                                      grpc::ServerWriter<v1::Event>* writer) {
  return Serve(*auth_, *context, [&] {
    return controller_->WatchEvents(
        *request, [context] { return context->IsCancelled(); },
        [writer](const v1::Event& e) { return writer->Write(e); });
  });
}

}  // namespace fp8rt::controller
