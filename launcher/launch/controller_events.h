// The run's controller events, as `fp8rt launch` prints them between its progress lines: a
// background thread follows Runs.WatchEvents for the run and queues one line per event a user
// acts on (checkpoint committed, refused or failed; a resume at another layout; recipe version
// applied; health-policy demotion; step skipped; worker lost; run finished, failed or stopped).
// The thread reconnects after the stream ends (a controller restarting, a run not registered
// yet) and never prints itself: the launcher's poll loop takes the lines, so they never cut a
// redrawn progress line.
//
// Index:
//   EventLine         the line of one event, or nothing for kinds not shown
//   ControllerEvents  the follower: TakeLines, WaitForEnd
#ifndef FP8RT_LAUNCHER_LAUNCH_CONTROLLER_EVENTS_H_
#define FP8RT_LAUNCHER_LAUNCH_CONTROLLER_EVENTS_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "fp8rt/v1/control.pb.h"
#include "grpcpp/grpcpp.h"
#include "launcher/client/control_client.h"

namespace fp8rt::launch {

// "controller: step 20: checkpoint committed: ..." for the kinds a user acts on; nullopt for the
// others (run_registered, recipe_updated, checkpoint_requested, fp8_health).
std::optional<std::string> EventLine(const v1::Event& event);

// True for run_finished, run_failed and run_stopped.
bool IsEndEvent(const v1::Event& event);

class ControllerEvents {
 public:
  // Follows `run_id`'s events stamped at or after `since_unix_ms` (the launcher's start: a resumed
  // run's earlier events are not printed again).
  // `events_file`, unless empty, gets every such event (of every kind) appended as one JSON line
  // (the CLI's --json mapping of v1::Event): the run folder's events.jsonl, which `fp8rt report`
  // draws on its timeline.
  ControllerEvents(std::unique_ptr<cli::ControllerClient> client, std::string run_id,
                   int64_t since_unix_ms, std::string events_file = "");
  ~ControllerEvents();  // cancels the stream and joins the thread
  ControllerEvents(const ControllerEvents&) = delete;
  ControllerEvents& operator=(const ControllerEvents&) = delete;

  // The lines queued since the last call, oldest first.
  std::vector<std::string> TakeLines();
  // Waits up to `timeout` for an end event (IsEndEvent); true when one has arrived.
  bool WaitForEnd(std::chrono::milliseconds timeout);

 private:
  void Loop();

  const std::unique_ptr<cli::ControllerClient> client_;
  const std::string run_id_;
  const int64_t since_unix_ms_;
  const std::string events_file_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  int64_t last_id_ ABSL_GUARDED_BY(mu_) = 0;  // ids increase per controller, across restarts
  std::vector<std::string> lines_ ABSL_GUARDED_BY(mu_);
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;  // the open stream's
  std::thread thread_;
};

}  // namespace fp8rt::launch

#endif  // FP8RT_LAUNCHER_LAUNCH_CONTROLLER_EVENTS_H_
