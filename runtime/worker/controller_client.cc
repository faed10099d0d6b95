// Control-plane client of a worker rank (see controller_client.h).
#include "runtime/worker/controller_client.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"

namespace fp8rt::worker {

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("token file ", path, ": cannot read it"));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string token(absl::StripAsciiWhitespace(ss.str()));
  if (token.empty())
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, " is empty"));
  return token;
}

ControllerClient::ControllerClient(const ControllerOptions& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<ControllerClient>> ControllerClient::Connect(
    const ControllerOptions& options) {
  if (options.address.empty()) return absl::InvalidArgumentError("--controller: empty address");
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (options.tls_ca.empty()) {
    creds = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_ca;
    creds = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(16 << 20);
  args.SetMaxSendMessageSize(16 << 20);
  std::unique_ptr<ControllerClient> client(new ControllerClient(options));
  client->stub_ = v1::Control::NewStub(grpc::CreateCustomChannel(options.address, creds, args));
  return client;
}

ControllerClient::~ControllerClient() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    // Calls held by an unanswering controller end now rather than at their deadline.
    if (report_context_ != nullptr) report_context_->TryCancel();
    for (grpc::ClientContext* c : heartbeat_contexts_) c->TryCancel();
  }
  cv_.notify_all();
  report_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  if (reporter_.joinable()) reporter_.join();
}

void ControllerClient::Prepare(grpc::ClientContext* context, bool wait_for_ready) const {
  context->set_deadline(std::chrono::system_clock::now() + options_.timeout);
  context->set_wait_for_ready(wait_for_ready);
  context->AddMetadata("authorization", "Bearer " + options_.token);
}

absl::Status ControllerClient::Convert(const char* rpc, const grpc::Status& status) const {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(
      static_cast<absl::StatusCode>(status.error_code()),
      absl::StrCat("controller ", options_.address, ": ", rpc, ": ", status.error_message()));
}

absl::StatusOr<v1::RegisterResponse> ControllerClient::Register(
    const v1::RegisterRequest& request) {
  grpc::ClientContext context;
  // The first call of a worker: wait (up to the deadline) for the channel to connect, so that a
  // controller still starting, or a connection burst of many ranks, is not an error at once.
  Prepare(&context, /*wait_for_ready=*/true);
  v1::RegisterResponse response;
  absl::Status s = Convert("Register", stub_->Register(&context, request, &response));
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  latest_.recipe = response.recipe();
  return response;
}

absl::Status ControllerClient::HeartbeatOnce(int rank, int64_t step) {
  grpc::ClientContext context;
  // Background calls wait (within the deadline) for a connection lost to a controller restart
  // to be made again, rather than failing at once.
  Prepare(&context, /*wait_for_ready=*/true);
  v1::HeartbeatRequest request;
  request.set_run_id(options_.run_id);
  request.set_rank(rank);
  request.set_step(step);
  v1::HeartbeatResponse response;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::CancelledError("Heartbeat: the client is closing");
    heartbeat_contexts_.insert(&context);
  }
  absl::Status s = Convert("Heartbeat", stub_->Heartbeat(&context, request, &response));
  std::lock_guard<std::mutex> lock(mu_);
  heartbeat_contexts_.erase(&context);
  if (!s.ok()) return s;
  if (response.recipe().version() >= latest_.recipe.version()) latest_.recipe = response.recipe();
  latest_.stop = response.stop();
  latest_.save_checkpoint = latest_.save_checkpoint || response.save_checkpoint();
  return absl::OkStatus();
}

void ControllerClient::StartHeartbeats(int rank, std::chrono::milliseconds interval,
                                       std::function<int64_t()> step) {
  heartbeat_ = std::thread([this, rank, interval, step = std::move(step)] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      kicked_ = false;
      lock.unlock();
      (void)HeartbeatOnce(rank, step());  // a miss is tolerated; the controller times ranks out
      lock.lock();
      cv_.wait_for(lock, interval,
                   [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return stopping_ || kicked_; });
    }
  });
}

void ControllerClient::KickHeartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    kicked_ = true;
  }
  cv_.notify_all();
}

Directives ControllerClient::Latest() const {
  std::lock_guard<std::mutex> lock(mu_);
  return latest_;
}

void ControllerClient::QueueReport(v1::ReportStepRequest request) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    if (!reporter_.joinable()) reporter_ = std::thread([this] { ReportLoop(); });
    if (reports_.size() >= kReportQueue) {
      reports_.pop_front();
      ++reports_dropped_;
    }
    reports_.push_back(std::move(request));
  }
  report_cv_.notify_all();
}

void ControllerClient::ReportLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    report_cv_.wait(
        lock, [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return stopping_ || !reports_.empty(); });
    if (stopping_) break;
    v1::ReportStepRequest request = std::move(reports_.front());
    reports_.pop_front();
    request.set_reports_dropped(reports_dropped_);
    grpc::ClientContext context;
    Prepare(&context, /*wait_for_ready=*/true);  // as the heartbeats
    report_context_ = &context;
    lock.unlock();
    v1::ReportStepResponse response;
    const absl::Status s = Convert("ReportStep", stub_->ReportStep(&context, request, &response));
    // Said once per outage on the worker's log, and once when reports get through again.
    if (!s.ok() && !report_failing_) {
      std::fprintf(stderr,
                   "fp8rt-worker: step %lld not reported (training goes on; reports continue in "
                   "the background): %s\n",
                   static_cast<long long>(request.metrics().step()), s.ToString().c_str());
    } else if (s.ok() && report_failing_) {
      std::fprintf(stderr, "fp8rt-worker: step reports reach the controller again (step %lld)\n",
                   static_cast<long long>(request.metrics().step()));
    }
    report_failing_ = !s.ok();
    lock.lock();
    report_context_ = nullptr;
    if (!s.ok()) ++reports_dropped_;
    if (reports_.empty()) report_cv_.notify_all();  // FlushReports
  }
}

bool ControllerClient::FlushReports(std::chrono::milliseconds budget) {
  std::unique_lock<std::mutex> lock(mu_);
  return report_cv_.wait_for(lock, budget, [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return stopping_ || (reports_.empty() && report_context_ == nullptr);
  });
}

int64_t ControllerClient::reports_dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reports_dropped_;
}

absl::StatusOr<std::string> ControllerClient::BeginCheckpoint(int64_t step) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::BeginCheckpointRequest request;
  request.set_run_id(options_.run_id);
  request.set_step(step);
  v1::BeginCheckpointResponse response;
  absl::Status s = Convert("BeginCheckpoint", stub_->BeginCheckpoint(&context, request, &response));
  if (!s.ok()) return s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    latest_.save_checkpoint = false;  // the request (if any) is being served
  }
  return response.temp_dir();
}

absl::StatusOr<bool> ControllerClient::AckShard(const v1::AckShardRequest& request) {
  grpc::ClientContext context;
  Prepare(&context);
  // The last acknowledgement commits: the controller hashes every shard first.
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  v1::AckShardResponse response;
  absl::Status s = Convert("AckShard", stub_->AckShard(&context, request, &response));
  if (!s.ok()) return s;
  return response.committed();
}

}  // namespace fp8rt::worker
