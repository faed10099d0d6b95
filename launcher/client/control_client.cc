// ControllerClient (see control_client.h). Contents:
//   ReadFile, ResolveConnectionOptions   options and the files they name
//   ControllerClient::Connect            channel with its credentials and limits
//   ControllerClient::Call, ToStatus     one RPC: context, deadline, status conversion
//   the Runs methods
#include "launcher/client/control_client.h"

#include <grpc/support/log.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace fp8rt::cli {
namespace {

// The whole file, or InvalidArgument naming it and what it is for.
absl::StatusOr<std::string> ReadFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": cannot be read"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": read error"));
  }
  return text.str();
}

std::string Getenv(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? std::string() : std::string(value);
}

}  // namespace

void SilenceGrpcLogging() {
  if (std::getenv("GRPC_VERBOSITY") != nullptr) return;
  gpr_set_log_function([](gpr_log_func_args*) {});
}

absl::StatusOr<ConnectionOptions> ResolveConnectionOptions(const ConnectionOptions& given) {
  ConnectionOptions options = given;
  if (options.controller.empty()) options.controller = Getenv(kControllerEnv);
  if (options.controller.empty()) options.controller = kDefaultController;
  if (options.token_file.empty()) options.token_file = Getenv(kTokenFileEnv);
  if (options.token_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no token file: give --token-file FILE or set ", kTokenFileEnv,
                     " (the file holding the controller's bearer token)"));
  }
  if (!std::isfinite(options.timeout_s) || options.timeout_s <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--timeout-s: must be a positive number of seconds, got %g", options.timeout_s));
  }
  return options;
}

absl::StatusOr<std::unique_ptr<ControllerClient>> ControllerClient::Connect(
    const ConnectionOptions& options) {
  absl::StatusOr<std::string> token_text = ReadFile(options.token_file, "token file");
  if (!token_text.ok()) return token_text.status();
  std::string token(absl::StripAsciiWhitespace(*token_text));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", options.token_file, ": empty (it must hold the token)"));
  }
  // A token goes into a header: a line break inside it would be rejected by gRPC at every call
  // with a message that does not say why.
  if (token.find_first_of("\r\n") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", options.token_file, ": the token must be a single line"));
  }

  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.tls_ca.empty()) {
    credentials = grpc::InsecureChannelCredentials();
  } else {
    absl::StatusOr<std::string> ca = ReadFile(options.tls_ca, "--tls-ca");
    if (!ca.ok()) return ca.status();
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = *std::move(ca);
    credentials = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxReceiveMessageBytes);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(options.controller, credentials, args);
  return std::unique_ptr<ControllerClient>(
      new ControllerClient(options, std::move(token), v1::Runs::NewStub(channel)));
}

ControllerClient::ControllerClient(ConnectionOptions options, std::string token,
                                   std::unique_ptr<v1::Runs::Stub> stub)
    : options_(std::move(options)), token_(std::move(token)), stub_(std::move(stub)) {}

template <typename Request, typename Response, typename Method>
absl::StatusOr<Response> ControllerClient::Call(Method method, const Request& request) const {
  grpc::ClientContext context;
  context.AddMetadata("authorization", absl::StrCat("Bearer ", token_));
  const auto timeout = std::chrono::duration_cast<std::chrono::system_clock::duration>(
      std::chrono::duration<double>(options_.timeout_s));
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  Response response;
  const grpc::Status status = ((*stub_).*method)(&context, request, &response);
  if (!status.ok()) return ToStatus(status);
  return response;
}

absl::Status ControllerClient::WatchEvents(
    const std::string& run_id, grpc::ClientContext* context,
    const std::function<void(const v1::Event&)>& on_event) const {
  context->AddMetadata("authorization", absl::StrCat("Bearer ", token_));
  v1::WatchEventsRequest request;
  request.set_run_id(run_id);
  std::unique_ptr<grpc::ClientReader<v1::Event>> reader = stub_->WatchEvents(context, request);
  for (v1::Event event; reader->Read(&event);) on_event(event);
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return ToStatus(status);
  return absl::OkStatus();
}

absl::Status ControllerClient::ToStatus(const grpc::Status& status) const {
  // grpc::StatusCode and absl::StatusCode share their numbering (both are the canonical codes).
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  const std::string& address = options_.controller;
  std::string message = status.error_message();
  switch (status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
      message = absl::StrCat("cannot reach the controller at ", address, " (", message,
                             "); is fp8rt-controller running there? (--controller or ",
                             kControllerEnv, ")");
      break;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      message = absl::StrFormat("no answer from the controller at %s within %g s (--timeout-s)",
                                address, options_.timeout_s);
      break;
    case grpc::StatusCode::UNAUTHENTICATED:
      message = absl::StrCat(message, " (the token from ", options_.token_file,
                             " was refused; give the controller's token with --token-file or ",
                             kTokenFileEnv, ")");
      break;
    default:
      break;
  }
  return absl::Status(code, message);
}

absl::StatusOr<v1::ListRunsResponse> ControllerClient::ListRuns() const {
  return Call<v1::ListRunsRequest, v1::ListRunsResponse>(&v1::Runs::Stub::ListRuns,
                                                         v1::ListRunsRequest());
}

absl::StatusOr<v1::Run> ControllerClient::GetRun(const std::string& run_id) const {
  v1::GetRunRequest request;
  request.set_run_id(run_id);
  return Call<v1::GetRunRequest, v1::Run>(&v1::Runs::Stub::GetRun, request);
}

absl::StatusOr<v1::CreateRunTokenResponse> ControllerClient::CreateRunToken(
    const std::string& run_id) const {
  v1::CreateRunTokenRequest request;
  request.set_run_id(run_id);
  return Call<v1::CreateRunTokenRequest, v1::CreateRunTokenResponse>(
      &v1::Runs::Stub::CreateRunToken, request);
}

absl::StatusOr<v1::Run> ControllerClient::StopRun(const std::string& run_id) const {
  v1::StopRunRequest request;
  request.set_run_id(run_id);
  return Call<v1::StopRunRequest, v1::Run>(&v1::Runs::Stub::StopRun, request);
}

absl::StatusOr<v1::GetLayersResponse> ControllerClient::GetLayers(const std::string& run_id) const {
  v1::GetLayersRequest request;
  request.set_run_id(run_id);
  return Call<v1::GetLayersRequest, v1::GetLayersResponse>(&v1::Runs::Stub::GetLayers, request);
}

absl::StatusOr<v1::RecipeVersion> ControllerClient::GetRecipe(const std::string& run_id) const {
  v1::GetRecipeRequest request;
  request.set_run_id(run_id);
  return Call<v1::GetRecipeRequest, v1::RecipeVersion>(&v1::Runs::Stub::GetRecipe, request);
}

absl::StatusOr<v1::RecipeVersion> ControllerClient::UpdateRecipe(const std::string& run_id,
                                                                 const v1::Recipe& recipe,
                                                                 const std::string& reason) const {
  v1::UpdateRecipeRequest request;
  request.set_run_id(run_id);
  *request.mutable_recipe() = recipe;
  request.set_reason(reason);
  return Call<v1::UpdateRecipeRequest, v1::RecipeVersion>(&v1::Runs::Stub::UpdateRecipe, request);
}

absl::StatusOr<v1::ListCheckpointsResponse> ControllerClient::ListCheckpoints(
    const std::string& run_id) const {
  v1::ListCheckpointsRequest request;
  request.set_run_id(run_id);
  return Call<v1::ListCheckpointsRequest, v1::ListCheckpointsResponse>(
      &v1::Runs::Stub::ListCheckpoints, request);
}

absl::Status ControllerClient::SaveCheckpoint(const std::string& run_id) const {
  v1::SaveCheckpointRequest request;
  request.set_run_id(run_id);
  return Call<v1::SaveCheckpointRequest, v1::SaveCheckpointResponse>(
             &v1::Runs::Stub::SaveCheckpoint, request)
      .status();
}

}  // namespace fp8rt::cli
