// gRPC adapters of the controller (see service.h).
#include "runtime/controller/service.h"

#include <algorithm>
#include <exception>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "runtime/core/quote.h"

namespace fp8rt::controller {
namespace {

constexpr std::string_view kBearer = "bearer ";  // the scheme is case-insensitive (RFC 6750)

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbers.
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// Which runs a call may touch.
struct Scope {
  enum Kind { kRun, kAdmin, kAny } kind;
  std::string run_id;  // kRun: the request's run_id ("" means every run)
  std::string what;    // kAdmin: the RPC, for the message
};
Scope OnRun(const std::string& run_id) { return {Scope::kRun, run_id, ""}; }
Scope AdminOnly(const std::string& what) { return {Scope::kAdmin, "", what}; }
Scope AnyCaller() { return {Scope::kAny, "", ""}; }

// OK, or PERMISSION_DENIED naming the field.
grpc::Status Authorize(const Caller& caller, const Scope& scope) {
  if (caller.admin || scope.kind == Scope::kAny) return grpc::Status::OK;
  if (scope.kind == Scope::kAdmin) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat(scope.what,
                                     ": needs the controller's admin token (a run "
                                     "token is limited to its own run)"));
  }
  if (scope.run_id == caller.run_id) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      absl::StrCat("run_id: this token is valid for run '", caller.run_id,
                                   "' only, got ", QuoteBounded(scope.run_id),
                                   scope.run_id.empty() ? " (every run)" : ""));
}

// The one path of every handler: authenticate, authorize `scope`, run `body(caller)` (returning
// absl::Status), convert.
template <typename Body>
grpc::Status Serve(const Authenticator& auth, const grpc::ServerContext& context,
                   const Scope& scope, Body&& body) {
  try {
    Caller caller;
    grpc::Status authenticated = auth.Check(context, &caller);
    if (!authenticated.ok()) return authenticated;
    grpc::Status authorized = Authorize(caller, scope);
    if (!authorized.ok()) return authorized;
    return ToGrpc(body(caller));
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

Authenticator::Authenticator(std::string admin_token, const Controller* controller)
    : admin_token_(std::move(admin_token)), controller_(controller) {}

grpc::Status Authenticator::Check(const grpc::ServerContext& context, Caller* caller) const {
  // Only `authorization` is read: no other metadata (x-run-id, ...) or the peer can change who
  // the caller is.
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing bearer token");
  }
  if (metadata.count("authorization") != 1) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "invalid bearer token (authorization metadata given more than once)");
  }
  const std::string_view value(it->second.data(), it->second.size());
  if (value.size() < kBearer.size() ||
      absl::AsciiStrToLower(std::string(value.substr(0, kBearer.size()))) != kBearer) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing bearer token (authorization metadata must be 'Bearer <token>')");
  }
  const std::string_view presented = value.substr(kBearer.size());
  if (ConstantTimeEquals(presented, admin_token_)) {
    *caller = Caller{true, ""};
    return grpc::Status::OK;
  }
  if (controller_ != nullptr) {
    if (std::optional<std::string> run = controller_->RunOfToken(presented)) {
      *caller = Caller{false, *std::move(run)};
      return grpc::Status::OK;
    }
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token");
}

grpc::Status StreamLimiter::Acquire(const std::string& key) {
  absl::MutexLock lock(&mu_);
  int& mine = per_caller_[key];
  if (total_ >= max_total_ || mine >= max_per_caller_) {
    const bool per_caller = mine >= max_per_caller_;
    if (mine == 0) per_caller_.erase(key);
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        per_caller
                            ? absl::StrCat("WatchEvents: at most ", max_per_caller_,
                                           " concurrent streams per token; close one first")
                            : absl::StrCat("WatchEvents: the controller serves at most ",
                                           max_total_, " concurrent streams; try again later"));
  }
  ++mine;
  ++total_;
  return grpc::Status::OK;
}

void StreamLimiter::Release(const std::string& key) {
  absl::MutexLock lock(&mu_);
  --total_;
  if (--per_caller_[key] <= 0) per_caller_.erase(key);
}

// ---------------------------------------------------------------------------------------------
// Control.

grpc::Status ControlService::Register(grpc::ServerContext* context,
                                      const v1::RegisterRequest* request,
                                      v1::RegisterResponse* response) {
  return Serve(*auth_, *context, OnRun(request->run_id()),
               [&](const Caller&) { return Assign(controller_->Register(*request), response); });
}

grpc::Status ControlService::Heartbeat(grpc::ServerContext* context,
                                       const v1::HeartbeatRequest* request,
                                       v1::HeartbeatResponse* response) {
  return Serve(*auth_, *context, OnRun(request->run_id()),
               [&](const Caller&) { return Assign(controller_->Heartbeat(*request), response); });
}

grpc::Status ControlService::ReportStep(grpc::ServerContext* context,
                                        const v1::ReportStepRequest* request,
                                        v1::ReportStepResponse* response) {
  return Serve(*auth_, *context, OnRun(request->run_id()),
               [&](const Caller&) { return controller_->ReportStep(*request); });
}

grpc::Status ControlService::BeginCheckpoint(grpc::ServerContext* context,
                                             const v1::BeginCheckpointRequest* request,
                                             v1::BeginCheckpointResponse* response) {
  return Serve(*auth_, *context, OnRun(request->run_id()), [&](const Caller&) {
    return Assign(controller_->BeginCheckpoint(*request), response);
  });
}

grpc::Status ControlService::AckShard(grpc::ServerContext* context,
                                      const v1::AckShardRequest* request,
                                      v1::AckShardResponse* response) {
  return Serve(*auth_, *context, OnRun(request->run_id()),
               [&](const Caller&) { return Assign(controller_->AckShard(*request), response); });
}

// ---------------------------------------------------------------------------------------------
// Runs.

grpc::Status RunsService::ListRuns(grpc::ServerContext* context, const v1::ListRunsRequest* request,
                                   v1::ListRunsResponse* response) {
  return Serve(*auth_, *context, AnyCaller(), [&](const Caller& caller) {
    *response = controller_->ListRuns();
    if (!caller.admin) {
      auto* runs = response->mutable_runs();
      runs->erase(std::remove_if(runs->begin(), runs->end(),
                                 [&](const v1::Run& r) { return r.run_id() != caller.run_id; }),
                  runs->end());
    }
    return absl::OkStatus();
  });
}

grpc::Status RunsService::GetRun(grpc::ServerContext* context, const v1::GetRunRequest* request,
                                 v1::Run* response) {
  return Serve(*auth_, *context, OnRun(request->run_id()),
               [&](const Caller&) { return Assign(controller_->GetRun(*request), response); });
}

grpc::Status RunsService::StopRun(grpc::ServerContext* context, const v1::StopRunRequest* request,
                                  v1::Run* response) {
  return Serve(*auth_, *context, OnRun(request->run_id()),
               [&](const Caller&) { return Assign(controller_->StopRun(*request), response); });
}

grpc::Status RunsService::GetLayers(grpc::ServerContext* context,
                                    const v1::GetLayersRequest* request,
                                    v1::GetLayersResponse* response) {
  return Serve(*auth_, *context, OnRun(request->run_id()),
               [&](const Caller&) { return Assign(controller_->GetLayers(*request), response); });
}

grpc::Status RunsService::GetRecipe(grpc::ServerContext* context,
                                    const v1::GetRecipeRequest* request,
                                    v1::RecipeVersion* response) {
  return Serve(*auth_, *context, OnRun(request->run_id()),
               [&](const Caller&) { return Assign(controller_->GetRecipe(*request), response); });
}

grpc::Status RunsService::UpdateRecipe(grpc::ServerContext* context,
                                       const v1::UpdateRecipeRequest* request,
                                       v1::RecipeVersion* response) {
  return Serve(*auth_, *context, OnRun(request->run_id()), [&](const Caller&) {
    return Assign(controller_->UpdateRecipe(*request), response);
  });
}

grpc::Status RunsService::ListCheckpoints(grpc::ServerContext* context,
                                          const v1::ListCheckpointsRequest* request,
                                          v1::ListCheckpointsResponse* response) {
  return Serve(*auth_, *context, OnRun(request->run_id()), [&](const Caller&) {
    return Assign(controller_->ListCheckpoints(*request), response);
  });
}

grpc::Status RunsService::SaveCheckpoint(grpc::ServerContext* context,
                                         const v1::SaveCheckpointRequest* request,
                                         v1::SaveCheckpointResponse* response) {
  return Serve(*auth_, *context, OnRun(request->run_id()),
               [&](const Caller&) { return controller_->SaveCheckpoint(*request); });
}

grpc::Status RunsService::WatchEvents(grpc::ServerContext* context,
                                      const v1::WatchEventsRequest* request,
                                      grpc::ServerWriter<v1::Event>* writer) {
  // A run token watches its own run: an empty run_id (every run) is refused for it.
  return Serve(*auth_, *context, OnRun(request->run_id()), [&](const Caller& caller) {
    const std::string key = caller.Key();
    const grpc::Status slot = streams_->Acquire(key);
    if (!slot.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(slot.error_code()), slot.error_message());
    }
    struct Releaser {
      StreamLimiter* limiter;
      const std::string& key;
      ~Releaser() { limiter->Release(key); }
    } release{streams_, key};
    return controller_->WatchEvents(
        *request, [context] { return context->IsCancelled(); },
        [writer](const v1::Event& e) { return writer->Write(e); });
  });
}

grpc::Status RunsService::CreateRunToken(grpc::ServerContext* context,
                                         const v1::CreateRunTokenRequest* request,
                                         v1::CreateRunTokenResponse* response) {
  return Serve(*auth_, *context, AdminOnly("CreateRunToken"), [&](const Caller&) {
    absl::StatusOr<std::string> token = controller_->CreateRunToken(request->run_id());
    if (!token.ok()) return token.status();
    response->set_run_id(request->run_id());
    response->set_token(*std::move(token));
    return absl::OkStatus();
  });
}

}  // namespace fp8rt::controller
