// Following a run's controller events for `fp8rt launch` (see controller_events.h).
#include "launcher/launch/controller_events.h"

#include <cstdio>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "launcher/client/format.h"

namespace fp8rt::launch {

std::optional<std::string> EventLine(const v1::Event& event) {
  // The kinds shown, as words.
  static const std::map<std::string, std::string> kShown = {
      {"checkpoint_committed", "checkpoint committed"},
      {"checkpoint_refused", "checkpoint refused"},
      {"checkpoint_failed", "checkpoint failed"},
      {"resume_resharded", "resumed at another layout"},
      {"recipe_applied", "recipe applied"},
      {"layer_demoted", "health policy"},
      {"layer_recipe_changed", "health policy"},
      {"layer_promoted", "health policy"},
      {"health_action_failed", "health policy"},
      {"step_skipped", "step skipped"},
      {"worker_lost", "worker lost"},
      {"run_finished", "run finished"},
      {"run_failed", "run failed"},
      {"run_stopped", "run stopped"},
  };
  const auto it = kShown.find(event.kind());
  if (it == kShown.end()) return std::nullopt;
  return absl::StrCat("controller: step ", event.step(), ": ", it->second, ": ", event.message());
}

bool IsEndEvent(const v1::Event& event) {
  return event.kind() == "run_finished" || event.kind() == "run_failed" ||
         event.kind() == "run_stopped";
}

ControllerEvents::ControllerEvents(std::unique_ptr<cli::ControllerClient> client,
                                   std::string run_id, int64_t since_unix_ms,
                                   std::string events_file)
    : client_(std::move(client)),
      run_id_(std::move(run_id)),
      since_unix_ms_(since_unix_ms),
      events_file_(std::move(events_file)) {
  thread_ = std::thread([this] { Loop(); });
}

ControllerEvents::~ControllerEvents() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    if (context_ != nullptr) context_->TryCancel();
  }
  cv_.notify_all();
  thread_.join();
}

void ControllerEvents::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    grpc::ClientContext context;
    context_ = &context;
    lock.unlock();
    // NotFound until rank 0 registers the run; Unavailable while the controller restarts.
    (void)client_->WatchEvents(run_id_, &context, [this](const v1::Event& e) {
      std::lock_guard<std::mutex> guard(mu_);
      if (e.id() <= last_id_) return;  // sent again after a reconnection
      last_id_ = e.id();
      if (e.unix_ms() < since_unix_ms_) return;
      if (!events_file_.empty()) {
        // Best effort: the record is for reports; the terminal lines below do not depend on it.
        if (std::FILE* f = std::fopen(events_file_.c_str(), "a")) {
          const std::string line = cli::ToJson(e).dump() + "\n";
          std::fputs(line.c_str(), f);
          std::fclose(f);
        }
      }
      if (std::optional<std::string> line = EventLine(e)) lines_.push_back(std::move(*line));
      if (IsEndEvent(e)) {
        ended_ = true;
        cv_.notify_all();
      }
    });
    lock.lock();
    context_ = nullptr;
    cv_.wait_for(lock, std::chrono::milliseconds(500),
                 [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return stopping_; });
  }
}

std::vector<std::string> ControllerEvents::TakeLines() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(lines_, {});
}

bool ControllerEvents::WaitForEnd(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return ended_; });
}

}  // namespace fp8rt::launch
