// The worker's side of the control plane: a client of fp8rt.v1.Control
// (proto/fp8rt/v1/control.proto).
//
// Index:
//   ControllerOptions  address, token, TLS root, run id, deadline
//   Directives         what the controller last told this rank through its heartbeat: the newest
//                      recipe version, stop, save a checkpoint
//   ControllerClient   Register, a heartbeat thread, a step-report thread with a bounded queue,
//                      BeginCheckpoint, AckShard
//
// The controller is never on the step's critical path: heartbeats (which bring the directives)
// and step reports are sent by background threads, so a controller that is slow, stopped or
// restarting delays neither; the step loop only reads Latest() and queues reports.
//
// Every call carries `authorization: Bearer <token>` and a deadline; a failed call is a Status
// naming the RPC and the controller's address (the token never appears in messages).
// Thread-safe: the heartbeat thread and the step loop share the client; Latest() may be called
// from any thread.
#ifndef FP8RT_RUNTIME_WORKER_CONTROLLER_CLIENT_H_
#define FP8RT_RUNTIME_WORKER_CONTROLLER_CLIENT_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "fp8rt/v1/control.grpc.pb.h"
#include "fp8rt/v1/control.pb.h"

namespace fp8rt::worker {

struct ControllerOptions {
  std::string address;  // host:port of fp8rt-controller
  std::string token;    // bearer token (the token file's content, trimmed)
  std::string tls_ca;   // PEM of the root CA to verify the controller with; "" = plaintext
  std::string run_id;   // the run this worker belongs to
  std::chrono::milliseconds timeout{std::chrono::seconds(10)};  // deadline of every call
};

// Reads a token file: its content with surrounding whitespace removed. InvalidArgument naming the
// file when it is missing or empty.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

struct Directives {
  v1::RecipeVersion recipe;  // newest known version (version 0 before the first answer)
  bool stop = false;
  bool save_checkpoint = false;
};

class ControllerClient {
 public:
  static absl::StatusOr<std::unique_ptr<ControllerClient>> Connect(
      const ControllerOptions& options);
  ~ControllerClient();  // stops the heartbeat thread

  const ControllerOptions& options() const { return options_; }

  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& request);
  // Heartbeats every `interval` from a background thread, reporting `step()` (called on that
  // thread; it must be thread-safe). Failures are counted, not fatal: the controller marks a rank
  // lost only after its timeout.
  void StartHeartbeats(int rank, std::chrono::milliseconds interval, std::function<int64_t()> step);
  // Wakes the heartbeat thread to send one now (rank 0 calls it once per step, so that a recipe
  // update reaches the step loop within a step while the controller answers). Never blocks; a
  // no-op while the thread is inside a call.
  void KickHeartbeat();
  Directives Latest() const;

  // Queues a step report for the report thread (started on first use), which sends them in order.
  // At most kReportQueue wait: when the queue is full the oldest waiting report is dropped, so
  // the newest step always reaches the controller once it answers again. Never blocks.
  static constexpr size_t kReportQueue = 64;
  void QueueReport(v1::ReportStepRequest request);
  // Waits until every queued report has been sent (or failed), at most `budget`; true when the
  // queue drained. The end of a run calls it so that the final step is reported.
  bool FlushReports(std::chrono::milliseconds budget);
  // Reports the controller never received: dropped from a full queue, or their call failed.
  // Each report carries the count as of its sending (ReportStepRequest.reports_dropped).
  int64_t reports_dropped() const;
  absl::StatusOr<std::string> BeginCheckpoint(int64_t step);
  absl::StatusOr<bool> AckShard(const v1::AckShardRequest& request);

 private:
  explicit ControllerClient(const ControllerOptions& options);
  // Deadline and token; `wait_for_ready`: wait within the deadline for a connection to be made.
  void Prepare(grpc::ClientContext* context, bool wait_for_ready = false) const;
  absl::Status Convert(const char* rpc, const grpc::Status& status) const;

  const ControllerOptions options_;  // fixed after construction
  std::unique_ptr<v1::Control::Stub> stub_;

  // One heartbeat, what the heartbeat thread sends.
  absl::Status HeartbeatOnce(int rank, int64_t step);
  void ReportLoop();

  mutable std::mutex mu_;
  Directives latest_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool kicked_ ABSL_GUARDED_BY(mu_) = false;
  std::condition_variable cv_;
  std::thread heartbeat_;
  std::set<grpc::ClientContext*> heartbeat_contexts_ ABSL_GUARDED_BY(mu_);  // calls in flight

  // The report thread's state.
  std::deque<v1::ReportStepRequest> reports_ ABSL_GUARDED_BY(mu_);
  grpc::ClientContext* report_context_ ABSL_GUARDED_BY(mu_) = nullptr;  // the call in flight
  int64_t reports_dropped_ ABSL_GUARDED_BY(mu_) = 0;
  bool report_failing_ = false;        // report thread only: the last call failed (said once)
  std::condition_variable report_cv_;  // a report queued, the queue drained, or stopping
  std::thread reporter_;
};

}  // namespace fp8rt::worker

#endif  // FP8RT_RUNTIME_WORKER_CONTROLLER_CLIENT_H_
